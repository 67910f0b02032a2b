#include "model/llama.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/quant.hpp"

namespace cascade::llama {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Counts are u32 in real files, u64 allowed by the spec; get_uint accepts both. A count must fit an int
// comfortably: the limit keeps a hostile file from asking for absurd allocations.
int64_t count_key(const gguf::File& f, const std::string& key, std::optional<int64_t> fallback = std::nullopt) {
  const auto v = f.get_uint_opt(key);
  if (!v) {
    CASCADE_CHECK(fallback.has_value(), f.name(), ": missing key '", key, "'");
    return *fallback;
  }
  CASCADE_CHECK(*v <= (uint64_t(1) << 30), f.name(), ": key '", key, "' = ", *v, " is out of range");
  return int64_t(*v);
}

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

const gguf::TensorInfo& find_checked(const gguf::File& f, const std::string& name, const std::vector<int64_t>& ne) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  CASCADE_CHECK(t != nullptr, f.name(), ": missing tensor '", name, "'");
  CASCADE_CHECK(t->ne == ne, f.name(), ": tensor '", name, "' has shape ", shape_str(t->ne), ", expected ",
                shape_str(ne), " from the hyperparameters");
  CASCADE_CHECK(gguf::can_dequantize(t->type), f.name(), ": tensor '", name, "' has type ",
                gguf::type_name(t->type), ", which this runtime cannot read");
  return *t;
}

// A 2-D tensor (ne = {n_in, n_out}) viewed where its bytes are: base + the tensor's offset in the file.
Linear load_linear(const gguf::File& f, const uint8_t* base, const std::string& name, int64_t n_in, int64_t n_out) {
  const gguf::TensorInfo& t = find_checked(f, name, {n_in, n_out});
  try {
    return linear::Matrix::view(t.type, base + (f.tensor_data(t) - f.tensor_data(f.tensors().front())), n_in, n_out);
  } catch (const Error& e) {
    detail::fail(f.name(), ": tensor '", name, "': ", e.what());
  }
}

// The quantized matrices of w packed in blocks of 16 rows (linear::pack; the tied embeddings too, which the lm_head
// multiplies), each read from the file's bytes at src + its offset from base and written to dst + that offset
// (src: the file's first tensor; base and dst: where the model's matrices view their bytes and where the packed
// ones go, dst covering every tensor's offset from the first one's). The file's pages of a packed matrix are
// dropped: nothing reads them again. Returns the packed matrices' offsets from base.
std::vector<int64_t> pack_weights(Weights& w, const gguf::File& f, const uint8_t* base, uint8_t* dst) {
  std::vector<Linear*> all = {&w.output};
  if (w.tied) all.push_back(&w.tok_embd);
  for (Layer& l : w.layers)
    for (Linear* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_gate, &l.ffn_up, &l.ffn_down}) all.push_back(m);
  const uint8_t* src = f.tensor_data(f.tensors().front());
  std::vector<int64_t> offsets;
  for (Linear* m : all) {
    if (m->data == nullptr || !linear::can_pack(m->type)) continue;
    const int64_t off = m->data - base;
    Linear from = *m;
    from.data = src + off;
    *m = linear::pack(from, dst + off);
    f.drop_pages(from.data, from.bytes());
    offsets.push_back(off);
  }
  return offsets;
}

std::vector<float> load_vector(const gguf::File& f, const std::string& name, int64_t n) {
  const gguf::TensorInfo& t = find_checked(f, name, {n});
  std::vector<float> v(static_cast<size_t>(n));
  gguf::dequantize_row(t.type, f.tensor_data(t), v.data(), n);
  return v;
}

// y = x / sqrt(mean(x^2) + eps) * w, for each of n rows of d values.
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

// cos and sin of pos[r] * inv_freq[i], (n, n_rot / 2) each: computed once per forward pass, used by every layer.
void rope_table(const std::vector<int32_t>& pos, const std::vector<float>& inv_freq, std::vector<float>& c,
                std::vector<float>& s) {
  const size_t half_rot = inv_freq.size();
  c.resize(pos.size() * half_rot);
  s.resize(pos.size() * half_rot);
  for (size_t r = 0; r < pos.size(); ++r)
    for (size_t i = 0; i < half_rot; ++i) {
      const double a = double(pos[r]) * double(inv_freq[i]);
      c[r * half_rot + i] = float(std::cos(a));
      s[r * half_rot + i] = float(std::sin(a));
    }
}

// Rotates consecutive pairs (x[2i], x[2i+1]) of the first n_rot values of every head by pos * inv_freq[i]
// ("normal" RoPE, what GGUF llama files expect; not the neox halves).
void rope(float* x, int64_t n, int64_t n_heads, int64_t head_dim, int64_t n_rot, const std::vector<float>& c,
          const std::vector<float>& s) {
  const int64_t half_rot = n_rot / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float* cr = c.data() + r * half_rot;
    const float* sr = s.data() + r * half_rot;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (r * n_heads + h) * head_dim;
      for (int64_t i = 0; i < half_rot; ++i) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cr[i] - x1 * sr[i];
        v[2 * i + 1] = x0 * sr[i] + x1 * cr[i];
      }
    }
  }
}

}  // namespace

Hparams Hparams::from_gguf(const gguf::File& f) {
  const std::string arch(f.architecture());
  CASCADE_CHECK(arch == "llama", f.name(), ": unsupported architecture '", arch, "' (this runtime runs 'llama')");
  Hparams hp;
  hp.n_ctx_train = count_key(f, "llama.context_length");
  hp.n_embd = count_key(f, "llama.embedding_length");
  hp.n_layer = count_key(f, "llama.block_count");
  hp.n_ff = count_key(f, "llama.feed_forward_length");
  hp.n_head = count_key(f, "llama.attention.head_count");
  hp.n_head_kv = count_key(f, "llama.attention.head_count_kv", hp.n_head);
  CASCADE_CHECK(hp.n_head > 0 && hp.n_embd % hp.n_head == 0, f.name(), ": embedding_length (", hp.n_embd,
                ") is not a positive multiple of head_count (", hp.n_head, ")");
  hp.head_dim = hp.n_embd / hp.n_head;
  hp.n_rot = count_key(f, "llama.rope.dimension_count", hp.head_dim);
  hp.rope_base = f.get_float_opt("llama.rope.freq_base").value_or(10000.0f);
  const auto eps = f.get_float_opt("llama.attention.layer_norm_rms_epsilon");
  CASCADE_CHECK(eps.has_value(), f.name(), ": missing key 'llama.attention.layer_norm_rms_epsilon'");
  hp.rms_eps = *eps;
  const gguf::TensorInfo* embd = f.find_tensor("token_embd.weight");
  CASCADE_CHECK(embd != nullptr, f.name(), ": missing tensor 'token_embd.weight'");
  CASCADE_CHECK(embd->ne.size() == 2, f.name(), ": tensor 'token_embd.weight' has shape ", shape_str(embd->ne),
                ", expected [n_embd, n_vocab]");
  hp.n_vocab = embd->ne[1];
  // Token ids index token_embd's rows: a vocabulary (or vocab_size) of another length would let the tokenizer
  // make ids the model has no row for, or the model sample ids the tokenizer has no text for.
  const gguf::Value* tokens = f.find("tokenizer.ggml.tokens");
  if (tokens != nullptr && tokens->is_array())
    CASCADE_CHECK(int64_t(tokens->count) == hp.n_vocab, f.name(), ": the vocabulary has ", tokens->count,
                  " tokens but token_embd.weight has ", hp.n_vocab, " rows");
  if (const auto n = f.get_uint_opt("llama.vocab_size"))
    CASCADE_CHECK(*n == uint64_t(hp.n_vocab), f.name(), ": llama.vocab_size is ", *n, " but token_embd.weight has ",
                  hp.n_vocab, " rows");
  try {
    hp.validate();
  } catch (const Error& e) {
    detail::fail(f.name(), ": ", e.what());
  }
  return hp;
}

void Hparams::validate() const {
  CASCADE_CHECK(n_vocab <= INT32_MAX, "n_vocab ", n_vocab, " does not fit a token id (int32)");
  CASCADE_CHECK(n_vocab > 0 && n_embd > 0 && n_layer > 0 && n_ff > 0 && n_head > 0 && n_head_kv > 0,
                "hyperparameters must be positive (n_vocab ", n_vocab, ", n_embd ", n_embd, ", n_layer ", n_layer,
                ", n_ff ", n_ff, ", n_head ", n_head, ", n_head_kv ", n_head_kv, ")");
  CASCADE_CHECK(n_ctx_train > 0, "context_length must be positive (it is the default context)");
  CASCADE_CHECK(n_embd % n_head == 0, "embedding_length ", n_embd, " is not a multiple of head_count ", n_head);
  CASCADE_CHECK(head_dim == n_embd / n_head, "head_dim ", head_dim, " != n_embd / n_head");
  CASCADE_CHECK(n_head % n_head_kv == 0, "head_count (", n_head, ") is not a multiple of head_count_kv (",
                n_head_kv, ")");
  CASCADE_CHECK(n_rot > 0 && n_rot <= head_dim && n_rot % 2 == 0, "rope.dimension_count ", n_rot,
                " must be even and in [2, head_dim = ", head_dim, "]");
  CASCADE_CHECK(std::isfinite(rope_base) && rope_base > 0, "rope.freq_base ", rope_base, " must be positive");
  CASCADE_CHECK(std::isfinite(rms_eps) && rms_eps >= 0, "layer_norm_rms_epsilon ", rms_eps,
                " must be non-negative");
}

size_t Model::weight_bytes() const {
  size_t n = w_.tok_embd.bytes() + (w_.tied ? 0 : w_.output.bytes()) + w_.output_norm.size() * sizeof(float);
  for (const Layer& l : w_.layers)
    n += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + l.ffn_gate.bytes() + l.ffn_up.bytes() +
         l.ffn_down.bytes() + (l.attn_norm.size() + l.ffn_norm.size()) * sizeof(float);
  return n;
}

uint64_t Model::bytes_needed(const gguf::File& f) {
  uint64_t n = 0;
  for (const gguf::TensorInfo& t : f.tensors()) n += t.n_bytes;
  return n;
}

// base: where the bytes of the file's first tensor are (the file itself, or a copy of its data section from
// there on); every matrix views base + its offset from that tensor.
Model Model::load_from(const gguf::File& f, const uint8_t* base, LinearPath path) {
  Model m;
  m.path_ = path;
  m.hp_ = Hparams::from_gguf(f);
  const Hparams& hp = m.hp_;
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
  Weights& w = m.w_;
  w.tok_embd = load_linear(f, base, "token_embd.weight", d, hp.n_vocab);
  w.output_norm = load_vector(f, "output_norm.weight", d);
  w.tied = f.find_tensor("output.weight") == nullptr;
  if (!w.tied) w.output = load_linear(f, base, "output.weight", d, hp.n_vocab);
  // Layer by layer, so a block_count larger than the file's tensors fails at the first missing tensor
  // instead of allocating every layer up front.
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer& l = w.layers.emplace_back();
    l.attn_norm = load_vector(f, p + "attn_norm.weight", d);
    l.wq = load_linear(f, base, p + "attn_q.weight", d, dq);
    l.wk = load_linear(f, base, p + "attn_k.weight", d, dkv);
    l.wv = load_linear(f, base, p + "attn_v.weight", d, dkv);
    l.wo = load_linear(f, base, p + "attn_output.weight", dq, d);
    l.ffn_norm = load_vector(f, p + "ffn_norm.weight", d);
    l.ffn_gate = load_linear(f, base, p + "ffn_gate.weight", d, hp.n_ff);
    l.ffn_up = load_linear(f, base, p + "ffn_up.weight", d, hp.n_ff);
    l.ffn_down = load_linear(f, base, p + "ffn_down.weight", hp.n_ff, d);
  }
  m.inv_freq_.resize(size_t(hp.n_rot / 2));
  for (int64_t i = 0; i < hp.n_rot / 2; ++i)
    m.inv_freq_[i] = float(std::pow(double(hp.rope_base), -2.0 * double(i) / double(hp.n_rot)));
  return m;
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
  const int64_t n = int64_t(tokens.size());
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
  CASCADE_CHECK(int64_t(pos.size()) == n, "forward: ", n, " tokens but ", pos.size(), " positions");
  CASCADE_CHECK(cache.step_rows() == n, "forward: the cache's step has ", cache.step_rows(), " rows, the batch ", n);
  CASCADE_CHECK(cache.n_layer() == hp.n_layer && cache.shape().n_q_heads == hp.n_head &&
                    cache.shape().n_kv_heads == hp.n_head_kv && cache.shape().head_dim == hp.head_dim,
                "forward: the cache's shape does not match the model");
  for (int32_t t : tokens)
    CASCADE_CHECK(t >= 0 && t < hp.n_vocab, "forward: token id ", t, " outside the vocabulary [0, ", hp.n_vocab, ")");

  std::vector<float> x(size_t(n * d)), h(size_t(n * d)), q(size_t(n * dq)), k(size_t(n * dkv)), v(size_t(n * dkv)),
      att(size_t(n * dq)), g(size_t(n * hp.n_ff)), u(size_t(n * hp.n_ff)), tmp(size_t(n * d));
  for (int64_t r = 0; r < n; ++r)
    w_.tok_embd.row(tokens[r], x.data() + r * d);

  std::vector<float> rope_cos, rope_sin;
  rope_table(pos, inv_freq_, rope_cos, rope_sin);
  // Y = X W^T for the model's linear path; an Input is quantized once for all the matrices it meets.
  const auto mul = [&](const Linear& W, const linear::Input& in, float* y) {
    if (path_ == LinearPath::f32) linear::matmul_f32(W, in.data(), in.n(), y);
    else linear::matmul(W, in, y);
  };
  // Several matrices against one input (q, k, v; gate, up): one split across the threads for all of them.
  const auto mul_group = [&](std::initializer_list<linear::Product> products, const linear::Input& in) {
    if (path_ == LinearPath::f32)
      for (const linear::Product& p : products) linear::matmul_f32(*p.w, in.data(), in.n(), p.y);
    else linear::matmul_group(products, in);
  };
  double t_attn = 0;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const Layer& l = w_.layers[il];
    rms_norm(x.data(), l.attn_norm.data(), n, d, hp.rms_eps, h.data());
    {
      const linear::Input hin(h.data(), n, d);
      mul_group({{&l.wq, q.data()}, {&l.wk, k.data()}, {&l.wv, v.data()}}, hin);
    }
    rope(q.data(), n, hp.n_head, hp.head_dim, hp.n_rot, rope_cos, rope_sin);
    rope(k.data(), n, hp.n_head_kv, hp.head_dim, hp.n_rot, rope_cos, rope_sin);
    cache.store(int(il), k.data(), v.data());
    const auto t0 = Clock::now();  // attention alone: storing K/V is not part of it
    cache.attend(int(il), q.data(), att.data());
    t_attn += seconds_since(t0);
    mul(l.wo, linear::Input(att.data(), n, dq), tmp.data());
    for (int64_t i = 0; i < n * d; ++i) x[i] += tmp[i];

    rms_norm(x.data(), l.ffn_norm.data(), n, d, hp.rms_eps, h.data());
    {
      const linear::Input hin(h.data(), n, d);
      mul_group({{&l.ffn_gate, g.data()}, {&l.ffn_up, u.data()}}, hin);
    }
    for (int64_t i = 0; i < n * hp.n_ff; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    mul(l.ffn_down, linear::Input(g.data(), n, hp.n_ff), tmp.data());
    for (int64_t i = 0; i < n * d; ++i) x[i] += tmp[i];
  }

  const int64_t n_out = int64_t(logit_rows.size());
  std::vector<float> sel(size_t(n_out * d));
  for (int64_t j = 0; j < n_out; ++j) {
    CASCADE_CHECK(logit_rows[j] >= 0 && logit_rows[j] < n, "forward: logits asked for row ", logit_rows[j],
                  " of ", n);
    rms_norm(x.data() + logit_rows[j] * d, w_.output_norm.data(), 1, d, hp.rms_eps, sel.data() + j * d);
  }
  logits.resize(size_t(n_out * hp.n_vocab));
  mul(w_.lm_head(), linear::Input(sel.data(), n_out, d), logits.data());
  if (timings) {
    timings->attention += t_attn;
    timings->total += seconds_since(t_start);
  }
}

}  // namespace cascade::llama
