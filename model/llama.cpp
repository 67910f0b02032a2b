#include "model/llama.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <list>
#include <optional>
#include <set>
#include <string>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/quant.hpp"
#include "model/vecmath.hpp"

namespace cascade::llama {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// Every matrix of w that the linear layers multiply (the tied embeddings too, which the lm_head multiplies).
std::vector<Linear*> matrices(Weights& w) {
  std::vector<Linear*> all = {&w.output};
  if (w.tied) all.push_back(&w.tok_embd);
  for (Layer& l : w.layers)
    for (Linear* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_gate, &l.ffn_up, &l.ffn_down}) all.push_back(m);
  return all;
}

// Whether linear::pack takes m: a quantized matrix still in the file's row layout.
bool packable(const Linear& m) {
  return m.data != nullptr && m.layout == linear::Layout::rows && linear::can_pack(m.type);
}

// Matrices the loader rewrote in another type (Q5_0 widened to Q8_0): each buffer stays where it is while the
// list lives.
using Widened = std::list<std::vector<uint8_t>>;

// The tensors of a file, handed out by name and shape; remembers which were taken, so that what is left can be
// refused (a tensor the runtime does not use would be a part of the model silently left out).
class Tensors {
 public:
  // base: where the bytes of the file's first tensor are (the file itself, or a copy of its data section from
  // there on); every matrix views base + its offset from that tensor, or a buffer of widened() for a Q5_0 one.
  Tensors(const gguf::File& f, const uint8_t* base) : f_(f), base_(base), widened_(std::make_shared<Widened>()) {}

  bool has(const std::string& name) const { return f_.find_tensor(name) != nullptr; }
  const std::string& file_name() const { return f_.name(); }

  // A 2-D tensor (ne = {n_in, n_out}) viewed where its bytes are.
  Linear matrix(const std::string& name, int64_t n_in, int64_t n_out) {
    return rows(name, n_in, n_out, 0, n_out);
  }
  // Rows [first, first + n) of a 2-D tensor of n_out rows (a block of a fused matrix). Q5_0 rows are widened to
  // Q8_0, the same values (quant.hpp), since the linear layers have no Q5_0 product.
  Linear rows(const std::string& name, int64_t n_in, int64_t n_out, int64_t first, int64_t n) {
    const gguf::TensorInfo& t = take(name, {n_in, n_out}, /*widen=*/true);
    try {
      const uint8_t* at = base_ + (f_.tensor_data(t) - f_.tensor_data(f_.tensors().front()));
      at += uint64_t(first) * gguf::row_bytes(t.type, n_in);
      if (t.type != gguf::TensorType::Q5_0) return linear::Matrix::view(t.type, at, n_in, n);
      const int64_t n_blocks = n * (n_in / gguf::block_size(t.type));  // row_bytes checked whole blocks
      std::vector<uint8_t>& q8 = widened_->emplace_back(size_t(n_blocks) * gguf::block_bytes(gguf::TensorType::Q8_0));
      gguf::widen_q5_0_to_q8_0(at, q8.data(), n_blocks);
      return linear::Matrix::view(gguf::TensorType::Q8_0, q8.data(), n_in, n);
    } catch (const Error& e) {
      detail::fail(f_.name(), ": tensor '", name, "': ", e.what());
    }
  }
  std::vector<float> vector(const std::string& name, int64_t n) {
    const gguf::TensorInfo& t = take(name, {n});
    std::vector<float> v(static_cast<size_t>(n));
    gguf::dequantize_row(t.type, f_.tensor_data(t), v.data(), n);
    return v;
  }
  // Empty when the file has no such tensor.
  std::vector<float> optional_vector(const std::string& name, int64_t n) {
    return has(name) ? vector(name, n) : std::vector<float>();
  }
  // The buffers of the widened matrices, which the model keeps.
  std::shared_ptr<const Widened> widened() const { return widened_; }
  // Packs each widened matrix of `all` (linear::pack) into a buffer of its own in place of its widened one.
  void pack_widened(const std::vector<Linear*>& all) {
    for (Linear* m : all)
      for (auto it = widened_->begin(); it != widened_->end(); ++it) {
        if (m->data != it->data() || !packable(*m)) continue;
        std::vector<uint8_t>& packed = widened_->emplace_back(size_t(m->bytes()));
        *m = linear::pack(*m, packed.data());
        widened_->erase(it);
        break;
      }
  }
  // Every tensor of the file was taken.
  void check_all_used() const {
    for (const gguf::TensorInfo& t : f_.tensors())
      CASCADE_CHECK(used_.count(t.name), f_.name(), ": tensor '", t.name, "' is not used by this runtime (",
                    "architecture '", std::string(f_.architecture()), "')");
  }

 private:
  // widen: a Q5_0 tensor is accepted (a matrix, which rows() widens).
  const gguf::TensorInfo& take(const std::string& name, const std::vector<int64_t>& ne, bool widen = false) {
    const gguf::TensorInfo* t = f_.find_tensor(name);
    CASCADE_CHECK(t != nullptr, f_.name(), ": missing tensor '", name, "'");
    CASCADE_CHECK(t->ne == ne, f_.name(), ": tensor '", name, "' has shape ", shape_str(t->ne), ", expected ",
                  shape_str(ne), " from the hyperparameters");
    CASCADE_CHECK(gguf::can_dequantize(t->type) || (widen && t->type == gguf::TensorType::Q5_0), f_.name(),
                  ": tensor '", name, "' has type ", gguf::type_name(t->type), ", which this runtime cannot read");
    used_.insert(name);
    return *t;
  }

  const gguf::File& f_;
  const uint8_t* base_;
  std::set<std::string> used_;
  std::shared_ptr<Widened> widened_;
};

// Q, K and V: three matrices with optional biases, or one fused matrix (attn_qkv) of their rows in that order,
// with one fused bias or the three separate ones (llama.cpp's create_tensor_qkv).
void load_qkv(Tensors& ts, const std::string& p, const Hparams& hp, Layer& l) {
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
  if (ts.has(p + "attn_qkv.weight")) {
    const std::string name = p + "attn_qkv.weight";
    l.wq = ts.rows(name, d, dq + 2 * dkv, 0, dq);
    l.wk = ts.rows(name, d, dq + 2 * dkv, dq, dkv);
    l.wv = ts.rows(name, d, dq + 2 * dkv, dq + dkv, dkv);
    if (ts.has(p + "attn_qkv.bias")) {
      const std::vector<float> b = ts.vector(p + "attn_qkv.bias", dq + 2 * dkv);
      l.bq.assign(b.begin(), b.begin() + dq);
      l.bk.assign(b.begin() + dq, b.begin() + dq + dkv);
      l.bv.assign(b.begin() + dq + dkv, b.end());
      return;
    }
  } else {
    CASCADE_CHECK(ts.has(p + "attn_q.weight"), ts.file_name(), ": missing tensor '", p,
                  "attn_q.weight' (and no fused '", p, "attn_qkv.weight')");
    l.wq = ts.matrix(p + "attn_q.weight", d, dq);
    l.wk = ts.matrix(p + "attn_k.weight", d, dkv);
    l.wv = ts.matrix(p + "attn_v.weight", d, dkv);
  }
  l.bq = ts.optional_vector(p + "attn_q.bias", dq);
  l.bk = ts.optional_vector(p + "attn_k.bias", dkv);
  l.bv = ts.optional_vector(p + "attn_v.bias", dkv);
}

// One block's tensors, as llama.cpp's load_arch_tensors names them for the architecture.
Layer load_layer(Tensors& ts, const Hparams& hp, int64_t il) {
  const std::string p = "blk." + std::to_string(il) + ".";
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim;
  const Arch a = hp.arch;
  Layer l;
  l.attn_norm = ts.vector(p + "attn_norm.weight", d);
  load_qkv(ts, p, hp, l);
  if (a == Arch::qwen3 || a == Arch::gemma3) {
    l.attn_q_norm = ts.vector(p + "attn_q_norm.weight", hp.head_dim);
    l.attn_k_norm = ts.vector(p + "attn_k_norm.weight", hp.head_dim);
  }
  l.wo = ts.matrix(p + "attn_output.weight", dq, d);
  if (a == Arch::llama) l.bo = ts.optional_vector(p + "attn_output.bias", d);
  if (a == Arch::gemma3) l.attn_post_norm = ts.vector(p + "post_attention_norm.weight", d);
  l.ffn_norm = ts.vector(p + "ffn_norm.weight", d);
  if (a == Arch::phi3) {  // gate and up fused in ffn_up, gate first
    l.ffn_gate = ts.rows(p + "ffn_up.weight", d, 2 * hp.n_ff, 0, hp.n_ff);
    l.ffn_up = ts.rows(p + "ffn_up.weight", d, 2 * hp.n_ff, hp.n_ff, hp.n_ff);
  } else {
    l.ffn_gate = ts.matrix(p + "ffn_gate.weight", d, hp.n_ff);
    l.ffn_up = ts.matrix(p + "ffn_up.weight", d, hp.n_ff);
  }
  l.ffn_down = ts.matrix(p + "ffn_down.weight", hp.n_ff, d);
  if (a == Arch::llama) {
    l.ffn_gate_b = ts.optional_vector(p + "ffn_gate.bias", hp.n_ff);
    l.ffn_up_b = ts.optional_vector(p + "ffn_up.bias", hp.n_ff);
    l.ffn_down_b = ts.optional_vector(p + "ffn_down.bias", d);
  }
  if (a == Arch::gemma3) l.ffn_post_norm = ts.vector(p + "post_ffw_norm.weight", d);
  return l;
}

// The quantized matrices of w viewed in the file packed in blocks of 16 rows (linear::pack), each read from the
// file's bytes at src + its offset from base and written to dst + that offset (src: the file's first tensor; base
// and dst: where the model's matrices view their bytes and where the packed ones go, dst covering every tensor's
// offset from the first one's). Matrices packed already (the widened ones, Tensors::pack_widened) are left. The
// file's pages of a packed matrix are dropped: nothing reads them again. Returns the packed matrices' offsets.
std::vector<int64_t> pack_weights(Weights& w, const gguf::File& f, const uint8_t* base, uint8_t* dst) {
  const uint8_t* src = f.tensor_data(f.tensors().front());
  std::vector<int64_t> offsets;
  for (Linear* m : matrices(w)) {
    if (!packable(*m)) continue;
    const int64_t off = m->data - base;
    Linear from = *m;
    from.data = src + off;
    *m = linear::pack(from, dst + off);
    f.drop_pages(from.data, from.bytes());
    offsets.push_back(off);
  }
  return offsets;
}

// y = x / sqrt(mean(x^2) + eps) * w, for each of n rows of d values. y may be x.
void rms_norm(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(xr[i]) * xr[i];
    const float s = float(1.0 / std::sqrt(ss / double(d) + double(eps)));
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * s * w[i];
  }
}

// y[r] += b for each of n rows of b.size() values; nothing when b is empty (an absent bias).
void add_bias(float* y, const std::vector<float>& b, int64_t n) {
  const int64_t d = int64_t(b.size());
  for (int64_t r = 0; r < n && d > 0; ++r)
    for (int64_t i = 0; i < d; ++i) y[r * d + i] += b[size_t(i)];
}

// cos and sin of pos[r] * freq[i] times mscale, (n, n_rot / 2) each: made once per forward pass for each table
// a layer uses.
struct RopeAngles {
  std::vector<float> c, s;
  RopeAngles(const std::vector<int32_t>& pos, const RopeTable& t) {
    const size_t half = t.freq.size();
    c.resize(pos.size() * half);
    s.resize(pos.size() * half);
    for (size_t r = 0; r < pos.size(); ++r)
      for (size_t i = 0; i < half; ++i) {
        const double a = double(pos[r]) * double(t.freq[i]);
        c[r * half + i] = float(std::cos(a)) * t.mscale;
        s[r * half + i] = float(std::sin(a)) * t.mscale;
      }
  }
};

// Rotates the first n_rot values of every head: pairs (x[2i], x[2i+1]) ("normal" RoPE, what GGUF llama files
// expect), or (x[i], x[i + n_rot/2]) when neox (qwen2, qwen3, phi3, gemma3), pair i by the angle of row r.
void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, int64_t n_rot, bool neox, const RopeAngles& a) {
  const int64_t half = n_rot / 2, step = neox ? 1 : 2, other = neox ? half : 1;
  for (int64_t r = 0; r < n; ++r) {
    const float* cr = a.c.data() + r * half;
    const float* sr = a.s.data() + r * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (r * n_heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        float& x0 = v[i * step];
        float& x1 = v[i * step + other];
        const float a0 = x0, a1 = x1;
        x0 = a0 * cr[i] - a1 * sr[i];
        x1 = a0 * sr[i] + a1 * cr[i];
      }
    }
  }
}

// The linear layers of a forward pass on the model's path: Y = X W^T; several matrices against one input (q, k
// and v; gate and up) split across the threads together. An Input is quantized once for all the matrices it meets.
struct Products {
  LinearPath path;
  void operator()(const Linear& w, const linear::Input& in, float* y) const {
    if (path == LinearPath::f32) linear::matmul_f32(w, in.data(), in.n(), y);
    else linear::matmul(w, in, y);
  }
  void operator()(std::initializer_list<linear::Product> products, const linear::Input& in) const {
    if (path == LinearPath::f32)
      for (const linear::Product& p : products) linear::matmul_f32(*p.w, in.data(), in.n(), p.y);
    else linear::matmul_group(products, in);
  }
};

// A step's activations: (n, width) each.
struct Activations {
  std::vector<float> x, h, q, k, v, att, g, u, tmp;
  Activations(const Hparams& hp, int64_t n) {
    const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
    for (auto* b : {&x, &h, &tmp}) b->resize(size_t(n * d));
    for (auto* b : {&q, &att}) b->resize(size_t(n * dq));
    for (auto* b : {&k, &v}) b->resize(size_t(n * dkv));
    for (auto* b : {&g, &u}) b->resize(size_t(n * hp.n_ff));
  }
};

// x += the attention block of layer il on x's n rows; returns the seconds spent in the cache's attention.
double attention_block(const Hparams& hp, const Layer& l, const Products& mul, const RopeAngles& angles,
                       KvCache& cache, int il, int64_t n, Activations& a) {
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim;
  rms_norm(a.x.data(), l.attn_norm.data(), n, d, hp.rms_eps, a.h.data());
  {
    const linear::Input hin(a.h.data(), n, d);
    mul({{&l.wq, a.q.data()}, {&l.wk, a.k.data()}, {&l.wv, a.v.data()}}, hin);
  }
  add_bias(a.q.data(), l.bq, n);
  add_bias(a.k.data(), l.bk, n);
  add_bias(a.v.data(), l.bv, n);
  if (!l.attn_q_norm.empty()) {
    rms_norm(a.q.data(), l.attn_q_norm.data(), n * hp.n_head, hp.head_dim, hp.rms_eps, a.q.data());
    rms_norm(a.k.data(), l.attn_k_norm.data(), n * hp.n_head_kv, hp.head_dim, hp.rms_eps, a.k.data());
  }
  rope(a.q.data(), n, hp.n_head, hp.head_dim, hp.n_rot, hp.rope_neox, angles);
  rope(a.k.data(), n, hp.n_head_kv, hp.head_dim, hp.n_rot, hp.rope_neox, angles);
  // The cache's softmax scale is 1/sqrt(head_dim); another scale is carried by q.
  const float q_scale = hp.attn_scale > 0 ? hp.attn_scale * std::sqrt(float(hp.head_dim)) : 1.0f;
  if (std::fabs(q_scale - 1.0f) > 1e-6f)
    for (float& e : a.q) e *= q_scale;
  cache.store(il, a.k.data(), a.v.data());
  const auto t0 = Clock::now();  // attention alone: storing K/V is not part of it
  cache.attend(il, a.q.data(), a.att.data());
  const double t_attn = seconds_since(t0);
  mul(l.wo, linear::Input(a.att.data(), n, dq), a.tmp.data());
  add_bias(a.tmp.data(), l.bo, n);
  if (!l.attn_post_norm.empty()) rms_norm(a.tmp.data(), l.attn_post_norm.data(), n, d, hp.rms_eps, a.tmp.data());
  for (int64_t i = 0; i < n * d; ++i) a.x[size_t(i)] += a.tmp[size_t(i)];
  return t_attn;
}

// x += the feed-forward block of a layer on x's n rows.
void ffn_block(const Hparams& hp, const Layer& l, const Products& mul, int64_t n, Activations& a) {
  const int64_t d = hp.n_embd, n_ff = hp.n_ff;
  rms_norm(a.x.data(), l.ffn_norm.data(), n, d, hp.rms_eps, a.h.data());
  {
    const linear::Input hin(a.h.data(), n, d);
    mul({{&l.ffn_gate, a.g.data()}, {&l.ffn_up, a.u.data()}}, hin);
  }
  add_bias(a.g.data(), l.ffn_gate_b, n);
  add_bias(a.u.data(), l.ffn_up_b, n);
  float* g = a.g.data();
  const float* u = a.u.data();
  // Row by row over the threads (vecmath: a value's result depends on that value alone).
  tbb::parallel_for(int64_t(0), n, [&](int64_t r) {
    if (hp.act == Activation::gelu) vecmath::gelu_mul(g + r * n_ff, u + r * n_ff, n_ff);
    else vecmath::silu_mul(g + r * n_ff, u + r * n_ff, n_ff);
  });
  mul(l.ffn_down, linear::Input(a.g.data(), n, n_ff), a.tmp.data());
  add_bias(a.tmp.data(), l.ffn_down_b, n);
  if (!l.ffn_post_norm.empty()) rms_norm(a.tmp.data(), l.ffn_post_norm.data(), n, d, hp.rms_eps, a.tmp.data());
  for (int64_t i = 0; i < n * d; ++i) a.x[size_t(i)] += a.tmp[size_t(i)];
}

}  // namespace

size_t Model::weight_bytes() const {
  size_t n = w_.tok_embd.bytes() + (w_.tied ? 0 : w_.output.bytes());
  size_t n_floats = w_.output_norm.size() + w_.output_b.size() + w_.rope_freqs.size() + w_.rope_long.size() +
                    w_.rope_short.size();
  for (const Layer& l : w_.layers) {
    n += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + l.ffn_gate.bytes() + l.ffn_up.bytes() +
         l.ffn_down.bytes();
    for (const auto* v : {&l.attn_norm, &l.bq, &l.bk, &l.bv, &l.attn_q_norm, &l.attn_k_norm, &l.bo,
                          &l.attn_post_norm, &l.ffn_norm, &l.ffn_gate_b, &l.ffn_up_b, &l.ffn_down_b, &l.ffn_post_norm})
      n_floats += v->size();
  }
  return n + n_floats * sizeof(float);
}

uint64_t Model::bytes_needed(const gguf::File& f) {
  uint64_t n = 0;
  for (const gguf::TensorInfo& t : f.tensors()) {
    n += t.n_bytes;
    if (t.type == gguf::TensorType::Q5_0)  // and its widened copy
      n += t.n_bytes / gguf::block_bytes(t.type) * gguf::block_bytes(gguf::TensorType::Q8_0);
  }
  return n;
}

// base: where the bytes of the file's first tensor are (the file itself, or a copy of its data section from
// there on); every matrix views base + its offset from that tensor.
Model Model::load_from(const gguf::File& f, const uint8_t* base, LinearPath path) {
  Model m;
  m.path_ = path;
  m.hp_ = Hparams::from_gguf(f);
  const Hparams& hp = m.hp_;
  Tensors ts(f, base);
  Weights& w = m.w_;
  w.tok_embd = ts.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
  w.output_norm = ts.vector("output_norm.weight", hp.n_embd);
  w.tied = !ts.has("output.weight");
  if (!w.tied) w.output = ts.matrix("output.weight", hp.n_embd, hp.n_vocab);
  if (hp.arch == Arch::qwen2) w.output_b = ts.optional_vector("output.bias", hp.n_vocab);
  // llama.cpp's llama reads rope_freqs, or the long and short factors under longrope scaling; phi3 the latter.
  const bool longrope = hp.rope_scaling.type == RopeScaling::Type::longrope;
  if (hp.arch == Arch::llama && !longrope) w.rope_freqs = ts.optional_vector("rope_freqs.weight", hp.n_rot / 2);
  if (hp.arch == Arch::phi3 || longrope) {
    w.rope_long = ts.optional_vector("rope_factors_long.weight", hp.n_rot / 2);
    w.rope_short = ts.optional_vector("rope_factors_short.weight", hp.n_rot / 2);
  }
  // Layer by layer, so a block_count larger than the file's tensors fails at the first missing tensor
  // instead of allocating every layer up front.
  for (int64_t il = 0; il < hp.n_layer; ++il) w.layers.push_back(load_layer(ts, hp, il));
  ts.check_all_used();
  if (path == LinearPath::quantized) ts.pack_widened(matrices(w));
  m.widened_ = ts.widened();
  m.set_context_length(hp.n_ctx_train);
  return m;
}

void Model::set_context_length(int64_t n_ctx) {
  CASCADE_CHECK(n_ctx > 0, "set_context_length: a context of ", n_ctx, " tokens");
  n_ctx_ = n_ctx;
  const std::vector<float>& factors = !w_.rope_freqs.empty()                ? w_.rope_freqs
                                      : n_ctx > hp_.rope_scaling.n_ctx_orig ? w_.rope_long
                                                                            : w_.rope_short;
  rope_ = RopeTable::make(hp_, hp_.rope_base, hp_.rope_scaling.freq_scale, factors);
  rope_swa_ = RopeTable::make(hp_, hp_.rope_base_swa, 1.0f, factors);
}

// The bytes from the first tensor's to the end of the file (tensors are laid out after it, in any order).
Model Model::load(const gguf::File& f, LinearPath path) {
  CASCADE_CHECK(!f.tensors().empty(), f.name(), ": the file holds no tensors");
  const uint8_t* first = f.tensor_data(f.tensors().front());
  uint64_t lo = UINT64_MAX, hi = 0;
  for (const gguf::TensorInfo& t : f.tensors()) {
    lo = std::min<uint64_t>(lo, t.offset);
    hi = std::max<uint64_t>(hi, t.offset + t.n_bytes);
  }
  // Copy [lo, hi) of the data section; base is where the first tensor lands in the copy. The quantized matrices
  // are packed over their copies (from the file's bytes).
  const uint8_t* data = first - f.tensors().front().offset;
  auto copy = std::make_shared<std::vector<uint8_t>>(data + lo, data + hi);
  uint8_t* base = copy->data() + (f.tensors().front().offset - lo);
  Model m = load_from(f, base, path);
  if (path == LinearPath::quantized) pack_weights(m.w_, f, base, base);
  m.bytes_ = copy;
  return m;
}

Model Model::load(std::shared_ptr<const gguf::File> file, LinearPath path) {
  CASCADE_CHECK(file != nullptr, "Model::load: no file");
  CASCADE_CHECK(!file->tensors().empty(), file->name(), ": the file holds no tensors");
  const uint8_t* first = file->tensor_data(file->tensors().front());
  Model m = load_from(*file, first, path);
  // The quantized matrices packed into memory of the model's own, at the offsets they have in the file (only
  // those pages are ever written); the rest are read in place.
  struct Bytes {
    std::shared_ptr<const gguf::File> file;
    std::unique_ptr<uint8_t[]> packed;
  };
  auto bytes = std::make_shared<Bytes>();
  std::vector<int64_t> packed;
  if (path == LinearPath::quantized) {
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const gguf::TensorInfo& t : file->tensors()) {
      lo = std::min<uint64_t>(lo, t.offset);
      hi = std::max<uint64_t>(hi, t.offset + t.n_bytes);
    }
    bytes->packed.reset(new uint8_t[hi - lo]);  // not touched: no pages yet
    packed = pack_weights(m.w_, *file, first, bytes->packed.get() + (file->tensors().front().offset - lo));
  }
  // Touch every page of the tensors read in place once, so the first forward pass does not take the page faults.
  const auto in_place = [&](const gguf::TensorInfo& t) {
    return std::find(packed.begin(), packed.end(), file->tensor_data(t) - first) == packed.end();
  };
  std::vector<const gguf::TensorInfo*> ts;
  for (const gguf::TensorInfo& t : file->tensors())
    if (in_place(t)) ts.push_back(&t);
  tbb::parallel_for(size_t(0), ts.size(), [&](size_t i) {
    const uint8_t* p = file->tensor_data(*ts[i]);
    uint8_t sum = 0;
    for (uint64_t o = 0; o < ts[i]->n_bytes; o += 4096) sum = uint8_t(sum + p[o]);
    volatile uint8_t sink = sum;
    (void)sink;
  });
  bytes->file = std::move(file);
  m.bytes_ = std::move(bytes);
  return m;
}

void Model::forward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& pos, KvCache& cache,
                    const std::vector<int64_t>& logit_rows, std::vector<float>& logits, Timings* timings) const {
  const auto t_start = Clock::now();
  const Hparams& hp = hp_;
  const int64_t n = int64_t(tokens.size()), d = hp.n_embd;
  CASCADE_CHECK(int64_t(pos.size()) == n, "forward: ", n, " tokens but ", pos.size(), " positions");
  CASCADE_CHECK(cache.step_rows() == n, "forward: the cache's step has ", cache.step_rows(), " rows, the batch ", n);
  CASCADE_CHECK(cache.n_layer() == hp.n_layer && cache.shape().n_q_heads == hp.n_head &&
                    cache.shape().n_kv_heads == hp.n_head_kv && cache.shape().head_dim == hp.head_dim,
                "forward: the cache's shape does not match the model");
  for (int32_t t : tokens)
    CASCADE_CHECK(t >= 0 && t < hp.n_vocab, "forward: token id ", t, " outside the vocabulary [0, ", hp.n_vocab, ")");
  // Sliding-window layers see their last n_swa keys: the cache plans each window once per step.
  std::vector<int64_t> windows;
  for (int64_t il = 0; il < hp.n_layer && hp.n_swa > 0; ++il) {
    windows.resize(size_t(hp.n_layer), 0);
    if (hp.is_swa(il)) windows[size_t(il)] = hp.n_swa;
  }
  cache.set_layer_windows(windows);

  Activations a(hp, n);
  for (int64_t r = 0; r < n; ++r) {
    float* xr = a.x.data() + r * d;
    w_.tok_embd.row(tokens[size_t(r)], xr);
    if (hp.embd_scale != 1.0f)
      for (int64_t i = 0; i < d; ++i) xr[i] *= hp.embd_scale;
  }
  const RopeAngles angles(pos, rope_);
  std::optional<RopeAngles> angles_swa;
  const Products mul{path_};
  double t_attn = 0;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const bool own_rope = hp.swa_rope && hp.is_swa(il);
    if (own_rope && !angles_swa) angles_swa.emplace(pos, rope_swa_);
    const Layer& l = w_.layers[size_t(il)];
    t_attn += attention_block(hp, l, mul, own_rope ? *angles_swa : angles, cache, int(il), n, a);
    ffn_block(hp, l, mul, n, a);
  }

  const int64_t n_out = int64_t(logit_rows.size());
  std::vector<float> sel(size_t(n_out * d));
  for (int64_t j = 0; j < n_out; ++j) {
    CASCADE_CHECK(logit_rows[j] >= 0 && logit_rows[j] < n, "forward: logits asked for row ", logit_rows[j],
                  " of ", n);
    rms_norm(a.x.data() + logit_rows[j] * d, w_.output_norm.data(), 1, d, hp.rms_eps, sel.data() + j * d);
  }
  logits.resize(size_t(n_out * hp.n_vocab));
  mul(w_.lm_head(), linear::Input(sel.data(), n_out, d), logits.data());
  add_bias(logits.data(), w_.output_b, n_out);
  if (hp.logit_softcap > 0)
    for (float& z : logits) z = hp.logit_softcap * std::tanh(z / hp.logit_softcap);
  if (timings) {
    timings->attention += t_attn;
    timings->total += seconds_since(t_start);
  }
}

}  // namespace cascade::llama
