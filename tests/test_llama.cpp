// The forward pass against an independent double-precision forward written here with plain loops, on a tiny
// random Llama model written with the project's GGUF writer; the KV cache's three methods; the loader's errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/perplexity.hpp"
#include "model/quant.hpp"

namespace test_llama {

using namespace cascade;
using gguf::TensorType;

namespace {

struct Spec {
  int n_layer = 2, n_embd = 32, n_head = 4, n_head_kv = 2, n_ff = 48, n_vocab = 50;
  float rope_base = 10000.0f;
  bool write_rope_base = false;  // absent: the default 10000 must be used
  bool write_head_count_kv = true;
  bool tied = true;
  bool q8 = false;               // Q8_0 for every matrix whose rows are a whole number of blocks
  bool q4_1 = false;             // Q4_1 likewise (q8 wins when both are set)
  bool u64 = false;              // counts as u64 instead of u32
  // Any other type the runtime reads, for every matrix whose rows are a whole number of its blocks: random
  // codes with scales that keep the values O(1 / sqrt(n_in)) (F32: none)
  TensorType other = TensorType::F32;
  std::string arch = "llama";
};

// A matrix (n_out rows of n_in) as the model will see it: the values after quantization.
struct Mat {
  int n_in = 0, n_out = 0;
  std::vector<double> w;  // (n_out, n_in)
  double at(int o, int i) const { return w[size_t(o) * n_in + i]; }
};

struct Tiny {
  Spec spec;
  Mat embd, out;
  std::vector<double> out_norm;
  struct L {
    std::vector<double> attn_norm, ffn_norm;
    Mat q, k, v, o, gate, up, down;
  };
  std::vector<L> layers;
  std::vector<uint8_t> bytes;
};

// Q8_0 blocks of a row, and the values they stand for.
std::vector<uint8_t> quantize_q8_0(const std::vector<float>& x, std::vector<double>& back) {
  std::vector<uint8_t> out;
  back.resize(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const uint16_t d16 = gguf::fp32_to_fp16(amax / 127.0f);
    const float d = gguf::fp16_to_fp32(d16);
    out.push_back(uint8_t(d16 & 0xff));
    out.push_back(uint8_t(d16 >> 8));
    for (size_t j = 0; j < 32; ++j) {
      const int q = d > 0 ? int(std::lround(x[b + j] / d)) : 0;
      const int qc = std::clamp(q, -127, 127);
      out.push_back(uint8_t(int8_t(qc)));
      back[b + j] = double(qc) * double(d);
    }
  }
  return out;
}

// Q4_1 blocks of a row (d = (max - min) / 15, m = min), and the values they stand for.
std::vector<uint8_t> quantize_q4_1(const std::vector<float>& x, std::vector<double>& back) {
  std::vector<uint8_t> out;
  back.resize(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float lo = x[b], hi = x[b];
    for (size_t j = 0; j < 32; ++j) lo = std::min(lo, x[b + j]), hi = std::max(hi, x[b + j]);
    const uint16_t d16 = gguf::fp32_to_fp16((hi - lo) / 15.0f), m16 = gguf::fp32_to_fp16(lo);
    const float d = gguf::fp16_to_fp32(d16), m = gguf::fp16_to_fp32(m16);
    for (uint16_t h : {d16, m16}) {
      out.push_back(uint8_t(h & 0xff));
      out.push_back(uint8_t(h >> 8));
    }
    int q[32];
    for (size_t j = 0; j < 32; ++j) {
      q[j] = d > 0 ? std::clamp(int(std::lround((x[b + j] - m) / d)), 0, 15) : 0;
      back[b + j] = double(q[j]) * double(d) + double(m);
    }
    for (size_t j = 0; j < 16; ++j) out.push_back(uint8_t(q[j] | (q[j + 16] << 4)));
  }
  return out;
}

// The values of n Q5_0 values at b, bit by bit (f16 d, u32 qh, u8 qs[16] a block: value j of a block is
// (nibble j + 16 bit j of qh - 16) d, nibble j the low nibble of qs[j] for j < 16, the high one of qs[j - 16] after):
// the runtime has no Q5_0 decode of its own to compare with, it widens them to Q8_0 at load.
std::vector<float> q5_0_values(const std::vector<uint8_t>& b, size_t n) {
  std::vector<float> y(n);
  for (size_t k = 0; k < n / 32; ++k) {
    const uint8_t* blk = b.data() + 22 * k;
    const float d = gguf::fp16_to_fp32(uint16_t(blk[0] | blk[1] << 8));
    const uint32_t qh = uint32_t(blk[2]) | uint32_t(blk[3]) << 8 | uint32_t(blk[4]) << 16 | uint32_t(blk[5]) << 24;
    for (size_t j = 0; j < 32; ++j) {
      const int nib = j < 16 ? blk[6 + j] & 15 : blk[6 + j - 16] >> 4;
      y[32 * k + j] = float(nib + 16 * int((qh >> j) & 1) - 16) * d;
    }
  }
  return y;
}

// n_out rows of n_in values of a quantized (or f16 / bf16) type t whose values are about uniform in
// [-amp, amp]: random codes, every scale amp / (largest code), offsets centring the codes.
std::vector<uint8_t> random_blocks(TensorType t, int n_in, int n_out, float amp, std::mt19937& rng) {
  const uint64_t n = uint64_t(n_in) * uint64_t(n_out);
  std::vector<uint8_t> out(gguf::row_bytes(t, n_in) * uint64_t(n_out));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto put = [&](size_t at, float v) {
    const uint16_t h = gguf::fp32_to_fp16(v);
    out[at] = uint8_t(h & 0xff);
    out[at + 1] = uint8_t(h >> 8);
  };
  if (t == TensorType::F16 || t == TensorType::BF16) {
    for (uint64_t k = 0; k < n; ++k) {
      const float v = u(rng) * amp;
      const uint16_t h = t == TensorType::F16 ? gguf::fp32_to_fp16(v) : gguf::fp32_to_bf16(v);
      out[2 * k] = uint8_t(h & 0xff);
      out[2 * k + 1] = uint8_t(h >> 8);
    }
    return out;
  }
  for (auto& b : out) b = uint8_t(rng());
  const size_t bb = gguf::block_bytes(t);
  for (size_t at = 0; at < out.size(); at += bb) {
    switch (t) {
      case TensorType::Q4_0: put(at, amp / 8); break;
      case TensorType::Q5_0: put(at, amp / 16); break;
      case TensorType::Q8_0: put(at, amp / 128); break;
      case TensorType::Q4_K: case TensorType::Q5_K: {
        // scales and mins of every sub-block: 6-bit fields, here sc = 32 + (random low bits), mn ~ sc * 7.5
        const int top = t == TensorType::Q4_K ? 15 : 31;
        put(at, 2 * amp / top / 48);
        put(at + 2, amp / 48);
        for (int j = 0; j < 12; ++j) out[at + 4 + j] = uint8_t(0xA0 | (rng() & 0x0F));
        break;
      }
      case TensorType::Q6_K:
        put(at + 208, amp / 32 / 48);
        for (int j = 0; j < 16; ++j) out[at + 192 + j] = uint8_t(int8_t(32 + int(rng() % 32)));
        break;
      default: FAIL("no random blocks for " << gguf::type_name(t));
    }
  }
  return out;
}

Tiny make_tiny(const Spec& s, uint32_t seed = 1) {
  Tiny t;
  t.spec = s;
  std::mt19937 rng(seed);
  gguf::Writer w;
  w.set_string("general.architecture", s.arch);
  const auto count = [&](const std::string& key, uint64_t v) {
    if (s.u64) w.set_u64(key, v);
    else w.set_u32(key, uint32_t(v));
  };
  const std::string a = s.arch;
  count(a + ".context_length", 256);
  count(a + ".embedding_length", uint64_t(s.n_embd));
  count(a + ".block_count", uint64_t(s.n_layer));
  count(a + ".feed_forward_length", uint64_t(s.n_ff));
  count(a + ".attention.head_count", uint64_t(s.n_head));
  if (s.write_head_count_kv) count(a + ".attention.head_count_kv", uint64_t(s.n_head_kv));
  count(a + ".rope.dimension_count", uint64_t(s.n_embd / s.n_head));
  w.set_f32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  if (s.write_rope_base) w.set_f32(a + ".rope.freq_base", s.rope_base);

  // Values scaled so that activations stay O(1) through the layers: uniform(-1, 1) / sqrt(n_in) * 2.
  const auto matrix = [&](const std::string& name, int n_in, int n_out, double gain) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x(size_t(n_in) * n_out);
    const float sc = float(gain / std::sqrt(double(n_in)));
    for (float& v : x) v = u(rng) * sc;
    Mat m;
    m.n_in = n_in;
    m.n_out = n_out;
    if (s.q8 && n_in % 32 == 0) {
      const auto q = quantize_q8_0(x, m.w);
      w.add_tensor(name, TensorType::Q8_0, {n_in, n_out}, q.data());
    } else if (s.q4_1 && n_in % 32 == 0) {
      const auto q = quantize_q4_1(x, m.w);
      w.add_tensor(name, TensorType::Q4_1, {n_in, n_out}, q.data());
    } else if (s.other != TensorType::F32 && n_in % gguf::block_size(s.other) == 0) {
      const auto q = random_blocks(s.other, n_in, n_out, float(gain / std::sqrt(double(n_in))), rng);
      std::vector<float> back(x.size());
      if (s.other == TensorType::Q5_0) back = q5_0_values(q, x.size());
      else gguf::dequantize_row(s.other, q.data(), back.data(), int64_t(x.size()));
      m.w.assign(back.begin(), back.end());
      w.add_tensor(name, s.other, {n_in, n_out}, q.data());
    } else {
      m.w.assign(x.begin(), x.end());
      w.add_tensor(name, TensorType::F32, {n_in, n_out}, x.data());
    }
    return m;
  };
  const auto norm = [&](const std::string& name, int n) {
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = u(rng);
    w.add_tensor(name, TensorType::F32, {n}, x.data());
    return std::vector<double>(x.begin(), x.end());
  };
  const int hd = s.n_embd / s.n_head;
  t.embd = matrix("token_embd.weight", s.n_embd, s.n_vocab, std::sqrt(double(s.n_embd)));
  for (int il = 0; il < s.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Tiny::L l;
    l.attn_norm = norm(p + "attn_norm.weight", s.n_embd);
    l.q = matrix(p + "attn_q.weight", s.n_embd, s.n_head * hd, 2.0);
    l.k = matrix(p + "attn_k.weight", s.n_embd, s.n_head_kv * hd, 2.0);
    l.v = matrix(p + "attn_v.weight", s.n_embd, s.n_head_kv * hd, 1.0);
    l.o = matrix(p + "attn_output.weight", s.n_head * hd, s.n_embd, 1.0);
    l.ffn_norm = norm(p + "ffn_norm.weight", s.n_embd);
    l.gate = matrix(p + "ffn_gate.weight", s.n_embd, s.n_ff, 1.0);
    l.up = matrix(p + "ffn_up.weight", s.n_embd, s.n_ff, 1.0);
    l.down = matrix(p + "ffn_down.weight", s.n_ff, s.n_embd, 1.0);
    t.layers.push_back(std::move(l));
  }
  t.out_norm = norm("output_norm.weight", s.n_embd);
  if (!s.tied) t.out = matrix("output.weight", s.n_embd, s.n_vocab, 1.0);
  t.bytes = w.to_bytes();
  return t;
}

// --- the independent reference: double precision, direct loops ---

std::vector<double> matvec(const Mat& m, const std::vector<double>& x) {
  std::vector<double> y(size_t(m.n_out), 0.0);
  for (int o = 0; o < m.n_out; ++o)
    for (int i = 0; i < m.n_in; ++i) y[o] += m.at(o, i) * x[i];
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<double>& g) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * g[i];
  return y;
}

// Rotates (x[2i], x[2i+1]) of every head by pos * base^(-2i/head_dim).
void rope_ref(std::vector<double>& x, int n_heads, int hd, int pos, double base) {
  for (int h = 0; h < n_heads; ++h)
    for (int i = 0; i < hd / 2; ++i) {
      const double th = pos * std::pow(base, -2.0 * i / hd);
      double& a = x[size_t(h) * hd + 2 * i];
      double& b = x[size_t(h) * hd + 2 * i + 1];
      const double a0 = a, b0 = b;
      a = a0 * std::cos(th) - b0 * std::sin(th);
      b = a0 * std::sin(th) + b0 * std::cos(th);
    }
}

// K or V of one token as a q8_0 cache holds it: its f32 value quantized per block of 32 (quantize_q8_0 above,
// written apart from the runtime's) and read back.
void round_to_q8_0(std::vector<double>& x) {
  std::vector<float> f(x.begin(), x.end());
  std::vector<double> back;
  (void)quantize_q8_0(f, back);
  x = back;
}

// Logits of every position of a token sequence: (n, n_vocab). q8_kv: attention reads K and V as a q8_0 cache
// stores them.
std::vector<std::vector<double>> reference_logits(const Tiny& t, const std::vector<int32_t>& toks,
                                                  bool q8_kv = false) {
  const Spec& s = t.spec;
  const int hd = s.n_embd / s.n_head, n = int(toks.size()), group = s.n_head / s.n_head_kv;
  std::vector<std::vector<double>> x(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) x[p].assign(t.embd.w.begin() + size_t(toks[p]) * s.n_embd,
                                          t.embd.w.begin() + size_t(toks[p] + 1) * s.n_embd);
  for (const Tiny::L& l : t.layers) {
    std::vector<std::vector<double>> q(static_cast<size_t>(n)), k(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      const auto h = rmsnorm(x[p], l.attn_norm);
      q[p] = matvec(l.q, h);
      k[p] = matvec(l.k, h);
      v[p] = matvec(l.v, h);
      rope_ref(q[p], s.n_head, hd, p, s.rope_base);
      rope_ref(k[p], s.n_head_kv, hd, p, s.rope_base);
      if (q8_kv) {
        round_to_q8_0(k[p]);
        round_to_q8_0(v[p]);
      }
    }
    for (int p = 0; p < n; ++p) {
      std::vector<double> att(size_t(s.n_head) * hd, 0.0);
      for (int h = 0; h < s.n_head; ++h) {
        const int kh = h / group;
        std::vector<double> sc(size_t(p + 1));
        double mx = -1e300;
        for (int j = 0; j <= p; ++j) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += q[p][size_t(h) * hd + i] * k[j][size_t(kh) * hd + i];
          sc[j] = d / std::sqrt(double(hd));
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (double& e : sc) sum += (e = std::exp(e - mx));
        for (int j = 0; j <= p; ++j)
          for (int i = 0; i < hd; ++i) att[size_t(h) * hd + i] += sc[j] / sum * v[j][size_t(kh) * hd + i];
      }
      const auto o = matvec(l.o, att);
      for (int i = 0; i < s.n_embd; ++i) x[p][i] += o[i];
      const auto h2 = rmsnorm(x[p], l.ffn_norm);
      auto g = matvec(l.gate, h2);
      const auto u = matvec(l.up, h2);
      for (int i = 0; i < s.n_ff; ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const auto dn = matvec(l.down, g);
      for (int i = 0; i < s.n_embd; ++i) x[p][i] += dn[i];
    }
  }
  std::vector<std::vector<double>> logits(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) logits[p] = matvec(s.tied ? t.embd : t.out, rmsnorm(x[p], t.out_norm));
  return logits;
}

// Tolerances. With an f32 cache the runtime differs from the reference only by f32 rounding: each dot product
// has <= 64 terms of O(1) values (relative error ~ 64 * 6e-8 ~ 4e-6), and two layers with residuals, softmax
// and norms amplify that by a small factor; logits are O(1..10), so 1e-4 absolute plus 1e-4 relative leaves a
// margin of ~10x over what we see, yet a wrong RoPE pair, a missing mask or a misplaced row is off by O(1).
// An f16 cache rounds every K and V to 11 significant bits (relative 2^-12 ~ 2.4e-4 per value), which reaches
// the logits amplified the same way: 1e-2 + 1e-2 relative.
struct Tol {
  double atol, rtol;
};

void check_logits(const float* got, const std::vector<double>& ref, const Tol& tol, const std::string& what) {
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref[i]);
    const double lim = tol.atol + tol.rtol * std::fabs(ref[i]);
    worst = std::max(worst, err / lim);
    if (!(err <= lim)) ++bad;
  }
  INFO(what << ": worst error / tolerance = " << worst);
  CHECK(bad == 0);
}

// Prefill of two prompts sharing 5 tokens (a tree of 3 nodes), then 4 sequences (2 per prompt) decoding
// their own random tokens for 4 steps, the last with only some of them active. Every logit of every row
// is compared with the reference of the sequence's whole token list.
// chunked: the prefill runs as two passes, the first ending inside the shared node (as generate's n_batch).
void run_scenario(const Tiny& t, AttnMethod method, DType dtype, const Tol& tol, int n_shared = 5,
                  llama::LinearPath path = llama::LinearPath::f32, bool chunked = false) {
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Model model = llama::Model::load(file, path);
  const llama::Hparams& hp = model.hparams();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, t.spec.n_vocab - 1);
  std::vector<int32_t> shared(static_cast<size_t>(n_shared)), tail_a(3), tail_b(4);
  const int S = n_shared;
  for (auto* v : {&shared, &tail_a, &tail_b})
    for (int32_t& x : *v) x = tok(rng);
  std::unique_ptr<TreeCache> prompts = make_prefill_cache(method, int(hp.n_layer), hp.head_shape(), dtype);
  TreeCache& cache = *prompts;
  const int root = cache.add_segment(-1, 0);
  const int na = cache.add_segment(root, S);
  const int nb = cache.add_segment(root, S);
  std::vector<int32_t> tokens, pos;
  for (int i = 0; i < S; ++i) tokens.push_back(shared[i]), pos.push_back(i);
  for (int i = 0; i < 3; ++i) tokens.push_back(tail_a[i]), pos.push_back(S + i);
  for (int i = 0; i < 4; ++i) tokens.push_back(tail_b[i]), pos.push_back(S + i);
  std::vector<float> logits;
  if (!chunked) {
    cache.begin_step({{root, S, 0}, {na, 3, S}, {nb, 4, S}});
    std::vector<int64_t> all_rows(tokens.size());
    for (size_t i = 0; i < all_rows.size(); ++i) all_rows[i] = int64_t(i);
    model.forward(tokens, pos, cache, all_rows, logits);
  } else {
    const int c = S - 2;  // rows [0, c) first, then the rest of the root and both children
    std::vector<float> first;
    cache.begin_step({{root, c, 0}});
    std::vector<int64_t> rows(static_cast<size_t>(c));
    for (int i = 0; i < c; ++i) rows[i] = i;
    model.forward(std::vector<int32_t>(tokens.begin(), tokens.begin() + c),
                  std::vector<int32_t>(pos.begin(), pos.begin() + c), cache, rows, first);
    cache.begin_step({{root, 2, c}, {na, 3, S}, {nb, 4, S}});
    rows.resize(tokens.size() - size_t(c));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = int64_t(i);
    model.forward(std::vector<int32_t>(tokens.begin() + c, tokens.end()),
                  std::vector<int32_t>(pos.begin() + c, pos.end()), cache, rows, logits);
    logits.insert(logits.begin(), first.begin(), first.end());
  }

  std::vector<int32_t> prompt_a = shared, prompt_b = shared;
  prompt_a.insert(prompt_a.end(), tail_a.begin(), tail_a.end());
  prompt_b.insert(prompt_b.end(), tail_b.begin(), tail_b.end());
  {
    const bool q8 = dtype == DType::q8_0;
    const auto ra = reference_logits(t, prompt_a, q8), rb = reference_logits(t, prompt_b, q8);
    const int64_t V = hp.n_vocab;
    for (int r = 0; r < S + 3; ++r)
      check_logits(logits.data() + r * V, ra[r], tol, "prefill row " + std::to_string(r));
    for (int r = 0; r < 4; ++r)
      check_logits(logits.data() + (S + 3 + r) * V, rb[S + r], tol, "prefill row " + std::to_string(S + 3 + r));
  }

  // Four sequences: 0, 1 from prompt a; 2, 3 from prompt b.
  std::vector<std::vector<int32_t>> seq_tokens = {prompt_a, prompt_a, prompt_b, prompt_b};
  const std::vector<int> leaf = {na, na, nb, nb};
  std::vector<int> id;
  const std::unique_ptr<KvCache> decode = start_sequences(method, std::move(prompts), leaf, id);
  for (int step = 0; step < 4; ++step) {
    std::vector<int> active = {0, 1, 2, 3};
    if (step == 3) active = {1, 2};
    std::vector<KvCache::Entry> entries;
    tokens.clear();
    pos.clear();
    for (int s : active) {
      const int32_t x = tok(rng);
      entries.push_back({id[s], 1, int64_t(seq_tokens[s].size())});
      tokens.push_back(x);
      pos.push_back(int32_t(seq_tokens[s].size()));
      seq_tokens[s].push_back(x);
    }
    decode->begin_step(entries);
    std::vector<int64_t> rows(active.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = int64_t(i);
    model.forward(tokens, pos, *decode, rows, logits);
    for (size_t r = 0; r < active.size(); ++r) {
      const auto ref = reference_logits(t, seq_tokens[active[r]], dtype == DType::q8_0);
      check_logits(logits.data() + r * hp.n_vocab, ref.back(), tol,
                   std::string(attn_method_name(method)) + " step " + std::to_string(step) + " sequence " +
                       std::to_string(active[r]));
    }
  }
  // The prompt is stored once by cascade and unified, once per sequence by split.
  const int64_t fed = 4 * 3 + 2;
  if (method == AttnMethod::split) CHECK(decode->stored_tokens() == 2 * (S + 3) + 2 * (S + 4) + fed);
  else CHECK(decode->stored_tokens() == S + 7 + fed);
}

std::string load_error(const Tiny& t) {
  try {
    const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
    (void)llama::Model::load(file);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("llama: f32 weights, f32 cache: every logit matches the double reference, all three methods") {
  const Tiny t = make_tiny(Spec{});
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    CAPTURE(attn_method_name(m));
    run_scenario(t, m, DType::f32, {1e-4, 1e-4});
  }
}

TEST_CASE("llama: Q8_0 weights (mixed with f32), untied output, u64 counts, explicit rope base") {
  Spec s;
  s.q8 = true;
  s.tied = false;
  s.u64 = true;
  s.write_rope_base = true;
  s.rope_base = 500.0f;
  const Tiny t = make_tiny(s, 2);
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    CAPTURE(attn_method_name(m));
    run_scenario(t, m, DType::f32, {1e-4, 1e-4});
  }
}

// Q5_0 matrices are widened to Q8_0 at load: the same values, so the f32 path's logits are the double
// reference's, and the quantized path multiplies them as Q8_0.
TEST_CASE("llama: Q5_0 weights, widened to Q8_0 at load, against the double reference") {
  Spec s;
  s.other = TensorType::Q5_0;
  const Tiny t = make_tiny(s, 6);
  {
    const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
    const llama::Model m = llama::Model::load(file);
    CHECK(m.weights().layers[0].wq.type == TensorType::Q8_0);
    CHECK(m.weights().layers[0].ffn_down.type == TensorType::F32);  // 48 is no block multiple
  }
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::unified}) {
    CAPTURE(attn_method_name(m));
    run_scenario(t, m, DType::f32, {1e-4, 1e-4});
  }
}

TEST_CASE("llama: Q4_1 weights, a prefill of 37 rows, and one in two passes") {
  Spec s;
  s.q4_1 = true;
  const Tiny t = make_tiny(s, 4);
  {
    const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
    CHECK(llama::Model::load(file).weights().layers[0].wq.type == TensorType::Q4_1);
    CHECK(llama::Model::load(file).weights().layers[0].ffn_down.type == TensorType::F32);  // 48 is no block multiple
  }
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    CAPTURE(attn_method_name(m));
    run_scenario(t, m, DType::f32, {1e-4, 1e-4}, 5);
    run_scenario(t, m, DType::f32, {1e-4, 1e-4}, 30);
    run_scenario(t, m, DType::f32, {1e-4, 1e-4}, 30, llama::LinearPath::f32, /*chunked=*/true);
  }
}

// Every method on the quantized path, step by step with the tokens the scenario feeds, against the double
// reference: within the quantized path's tolerance (below: 0.08 of the logits' standard deviation plus 2% of
// each logit; these models' logits have a standard deviation of 4.1-4.5, so 0.35 + 2%).
TEST_CASE("llama: Q8_0 and Q4_1 weights on the quantized path, every method, within the int8 tolerance") {
  for (int kind = 0; kind < 2; ++kind) {
    Spec s;
    (kind ? s.q4_1 : s.q8) = true;
    const Tiny t = make_tiny(s, 8 + kind);
    for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
      CAPTURE(attn_method_name(m));
      CAPTURE(kind);
      run_scenario(t, m, DType::f32, {0.35, 0.02}, 5, llama::LinearPath::quantized);
      run_scenario(t, m, DType::f16, {0.35, 0.02}, 30, llama::LinearPath::quantized, /*chunked=*/true);
    }
  }
}

TEST_CASE("llama: f16 cache within the f16 tolerance, no GQA when head_count_kv is absent") {
  Spec s;
  s.write_head_count_kv = false;
  s.n_head_kv = s.n_head;
  const Tiny t = make_tiny(s, 3);
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  CHECK(llama::Model::load(file).hparams().n_head_kv == 4);
  CHECK(llama::Model::load(file).weights().tied);
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    CAPTURE(attn_method_name(m));
    run_scenario(t, m, DType::f16, {1e-2, 1e-2});
  }
}

// A bf16 cache keeps 8 bits of each K/V element (the f16 one 11), and on CPUs whose bf16 dot products
// out-run their f32 FMAs both passes round q and the softmax weights to bf16 as well (cpu/kernel_avx512.hpp):
// four times the f16 cache's error from the storage, as much again from the products (seen: 8e-3 at most).
TEST_CASE("llama: bf16 cache within the bf16 tolerance, on bf16 products and in f32") {
  const Tiny t = make_tiny(Spec{}, 5);
  for (bool products : {false, true}) {
    const cpu::Bf16Products use(products);
    for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
      CAPTURE(attn_method_name(m));
      CAPTURE(products);
      run_scenario(t, m, DType::bf16, {4e-2, 4e-2});
    }
  }
}

// A q8_0 cache against the reference reading the same quantized K/V (head dim 64: the int8 products take it), so
// what remains is the products' rounding, and a code one step apart wherever the runtime's f32 K/V and the
// reference's double straddle a rounding boundary. Those are not rare: this model's K/V hold dozens of values
// within 2e-4 of a boundary (in units of a code), about as far as f32 rounding moves them. One code step moves a
// score by a 127th of its block's largest value times q: up to 1.7e-3 in the logits (seen on a Zen 3, AVX2 tier;
// on a Zen 4's AVX-512 tier none straddled). So f32 products (codes times scales; f32 rounding alone: seen 8e-6)
// are held to 5e-3. On int8 products q is quantized to 8 bits per block of 32 (2^-8 of
// its block's largest value) and the weights of P V to 16 bits, and the shared pass's bf16 tiles round code times
// scale and q to bf16: on this model twice a bf16 cache's error from its storage (seen: 4.3e-2 against 2.0e-2; an
// f16 cache 2.1e-3). A wrong scale, code or block lands at O(1).
TEST_CASE("llama: q8_0 cache against the reference on the same quantized K/V, on each products path") {
  Spec s;
  s.n_embd = 256, s.n_ff = 128, s.n_head = 4, s.n_head_kv = 2;
  const Tiny t = make_tiny(s, 12);
  struct Path {
    bool int8, bf16;
    Tol tol;
  };
  for (const Path& p : {Path{false, false, {5e-3, 5e-3}}, Path{true, false, {8e-2, 8e-2}},
                        Path{false, true, {8e-2, 8e-2}}, Path{true, true, {8e-2, 8e-2}}}) {
    const cpu::Int8Products int8(p.int8);
    const cpu::Bf16Products bf16(p.bf16);
    for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
      CAPTURE(attn_method_name(m));
      CAPTURE(p.int8);
      CAPTURE(p.bf16);
      run_scenario(t, m, DType::q8_0, p.tol, 20);
    }
  }
}

TEST_CASE("llama: a q8_0 cache generates the same text twice with every method") {
  Spec s;
  s.n_embd = 128, s.n_ff = 64, s.n_head = 2, s.n_head_kv = 1;
  const Tiny t = make_tiny(s, 13);
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Model model = llama::Model::load(file);
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 9}, {7}};
  GenerateParams gp;
  gp.n_predict = 12;
  gp.n_parallel = 3;
  gp.sampling.temp = 1.0f;
  gp.sampling.top_k = 0;
  gp.sampling.top_p = 1.0f;
  gp.sampling.min_p = 0.0f;
  gp.sampling.seed = 5;
  gp.kv_dtype = DType::q8_0;
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    CAPTURE(attn_method_name(m));
    gp.attn = m;
    const GenerateResult a = generate(model, prompts, gp, [](int32_t) { return false; });
    const GenerateResult b = generate(model, prompts, gp, [](int32_t) { return false; });
    REQUIRE(a.sequences.size() == 9);
    for (size_t i = 0; i < a.sequences.size(); ++i) {
      CAPTURE(i);
      CHECK(a.sequences[i].tokens.size() == 12);
      CHECK(b.sequences[i].tokens == a.sequences[i].tokens);
    }
  }
  // Storage is where q8_0 differs: a q8_0 cache holds 1.0625 bytes an element.
  KvCache::Entry e{0, 3, 0};
  TreeCache c(1, {2, 1, 64}, DType::q8_0);
  e.id = c.add_segment(-1);
  c.begin_step({e});
  std::vector<float> kv(3 * 64, 0.5f);
  c.store(0, kv.data(), kv.data());
  CHECK(c.kv_bytes() == size_t(3 * 2 * (64 + 2 * 2)));
  CHECK_THROWS_AS(TreeCache(1, {2, 1, 48}, DType::q8_0), Error);
}

// Perplexity as llama.cpp defines it (perplexity.hpp), computed here from the double reference's logits of each
// window (first token replaced by BOS) over the positions n_ctx / 2 .. n_ctx - 2; the runtime's f32 path and f32
// K/V give it to f32 rounding. KL divergence: the saved (f16) log-probabilities of the reference against its logits
// at another temperature, against the KL computed here in double (f16's rounding of a log-probability,
// 2^-11 relative, bounds the difference).
TEST_CASE("perplexity: windows scored as llama.cpp does, against exp(mean NLL) of the reference, KL divergence") {
  const Tiny t = make_tiny(Spec{}, 14);
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Model model = llama::Model::load(file, llama::LinearPath::f32);
  const int64_t V = t.spec.n_vocab;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, t.spec.n_vocab - 1);
  PerplexityParams p;
  p.n_ctx = 16;
  p.n_batch = 5;  // windows in several passes
  p.kv_dtype = DType::f32;
  p.bos = 1;
  std::vector<int32_t> tokens(size_t(3 * p.n_ctx + 7));  // three windows, 7 tokens left out
  for (int32_t& x : tokens) x = tok(rng);

  const std::string saved = (std::filesystem::temp_directory_path() / "cascade_test_kl.bin").string();
  NllSum nll;
  KlSum kl;
  double ref_nll = 0, ref_kl = 0;
  int64_t ref_n = 0, ref_same = 0;
  std::vector<std::vector<double>> ref_windows;
  {
    LogProbWriter w(saved, p.n_ctx, V, tokens);
    run_windows(model, tokens, p, [&](int64_t win, const std::vector<float>& logits, const int32_t* targets) {
      REQUIRE(int64_t(logits.size()) == n_scored_per_window(p.n_ctx) * V);
      std::vector<int32_t> window(tokens.begin() + win * p.n_ctx, tokens.begin() + (win + 1) * p.n_ctx);
      window[0] = p.bos;
      const auto ref = reference_logits(t, window);
      std::vector<float> base;
      for (int64_t pos = p.n_ctx / 2, r = 0; pos <= p.n_ctx - 2; ++pos, ++r) {
        CHECK(targets[r] == window[size_t(pos + 1)]);
        nll.add(token_nll(logits.data() + r * V, V, targets[r]));
        const std::vector<double>& x = ref[size_t(pos)];
        double mx = -1e300, z = 0;
        for (double v : x) mx = std::max(mx, v);
        for (double v : x) z += std::exp(v - mx);
        ref_nll += mx + std::log(z) - x[size_t(window[size_t(pos + 1)])];
        ++ref_n;
        for (double v : x) base.push_back(float(v));
      }
      w.add_window(base);
    });
    w.close();
  }
  CHECK(nll.n == 3 * (p.n_ctx - p.n_ctx / 2 - 1));
  CHECK(ref_n == nll.n);
  CHECK(std::fabs(nll.perplexity() - std::exp(ref_nll / double(ref_n))) <= 1e-5 * nll.perplexity());

  // KL of the reference at temperature 1 (saved) from the same logits at temperature 1 / 0.7.
  LogProbReader r(saved, p.n_ctx, V, tokens);
  run_windows(model, tokens, p, [&](int64_t, const std::vector<float>& logits, const int32_t*) {
    const std::vector<f16>& b = r.next_window();
    for (int64_t row = 0; row < n_scored_per_window(p.n_ctx); ++row) {
      std::vector<float> hot(static_cast<size_t>(V));
      std::vector<double> lb(static_cast<size_t>(V)), lh(static_cast<size_t>(V));
      const float* x = logits.data() + row * V;
      double mb = -1e300, mh = -1e300, zb = 0, zh = 0;
      for (int64_t v = 0; v < V; ++v) {
        hot[size_t(v)] = 0.7f * x[v];
        mb = std::max(mb, double(x[v]));
        mh = std::max(mh, double(hot[size_t(v)]));
      }
      for (int64_t v = 0; v < V; ++v) {
        zb += std::exp(double(x[v]) - mb);
        zh += std::exp(double(hot[size_t(v)]) - mh);
      }
      double k = 0;
      int64_t top_b = 0, top_h = 0;
      for (int64_t v = 0; v < V; ++v) {
        lb[size_t(v)] = double(x[v]) - mb - std::log(zb);
        lh[size_t(v)] = double(hot[size_t(v)]) - mh - std::log(zh);
        k += std::exp(lb[size_t(v)]) * (lb[size_t(v)] - lh[size_t(v)]);
        if (lb[size_t(v)] > lb[size_t(top_b)]) top_b = v;
        if (lh[size_t(v)] > lh[size_t(top_h)]) top_h = v;
      }
      ref_kl += k;
      ref_same += top_b == top_h;
      kl.add(b.data() + row * V, hot.data(), V);
    }
  });
  std::filesystem::remove(saved);
  CHECK(kl.n == nll.n);
  CHECK(ref_kl / double(kl.n) > 1e-3);  // a KL that says something
  CHECK(std::fabs(kl.mean() - ref_kl / double(kl.n)) <= 2e-3 * ref_kl / double(kl.n) + 1e-5);
  CHECK(kl.n_top1_same == ref_same);

  // Fewer than two windows' tokens, a file saved for another text or window: errors.
  CHECK_THROWS_AS(run_windows(model, std::vector<int32_t>(size_t(2 * p.n_ctx - 1), 1), p, {}), Error);
  {
    LogProbWriter w(saved, p.n_ctx, V, tokens);
    w.close();
  }
  std::vector<int32_t> other = tokens;
  other[3] = (other[3] + 1) % int32_t(V);
  CHECK_THROWS_WITH_AS(LogProbReader(saved, p.n_ctx, V, other), doctest::Contains("another text"), Error);
  CHECK_THROWS_WITH_AS(LogProbReader(saved, 8, V, tokens), doctest::Contains("windows of 16"), Error);
  std::filesystem::remove(saved);
}

namespace {

// Logits of every row of a 12-token prefill, then of 3 single-token decode steps: (15, n_vocab).
std::vector<float> path_logits(const Tiny& t, llama::LinearPath path) {
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Model model = llama::Model::load(file, path);
  const llama::Hparams& hp = model.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
  const int seg = cache.add_segment(-1, 0);
  std::vector<int32_t> tokens, pos;
  std::vector<int64_t> rows;
  for (int i = 0; i < 12; ++i) tokens.push_back((7 * i + 3) % t.spec.n_vocab), pos.push_back(i), rows.push_back(i);
  std::vector<float> all, step;
  cache.begin_step({{seg, 12, 0}});
  model.forward(tokens, pos, cache, rows, all);
  for (int i = 12; i < 15; ++i) {
    cache.begin_step({{seg, 1, i}});
    model.forward({(5 * i + 1) % t.spec.n_vocab}, {i}, cache, {0}, step);
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

}  // namespace

// The quantized path rounds every activation entering a linear layer to 8 bits per block of 32: each value moves
// by at most half a step, max|x| / 254 of its block. A layer's output moves by the weighted sum of those
// errors; with errors of random sign that is about ||w|| max|x| / (254 sqrt(3)) per output, i.e. ~0.5% of the
// output's typical size for activations whose block maximum is ~3 standard deviations. Two such layers, the
// attention's softmax and the residuals compound it to ~1-3% of the logits' spread (measured: at most 2.5%,
// q4_0 and q8_0); the tolerance is 0.08 of the logits' standard deviation plus 2% of each logit. A wrong
// scale, offset, code or group lands at O(1) of the spread.
TEST_CASE("llama: the quantized path's logits against the f32 path, every weight type") {
  struct Case {
    const char* name;
    Spec spec;
  };
  std::vector<Case> cases;
  {
    Spec s;
    s.q8 = true;
    cases.push_back({"q8_0", s});
    s.q8 = false;
    s.q4_1 = true;
    cases.push_back({"q4_1", s});
  }
  for (TensorType ty : {TensorType::Q4_0, TensorType::Q5_0, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K,
                        TensorType::F16, TensorType::BF16}) {
    Spec s;
    s.other = ty;
    if (gguf::block_size(ty) == 256) s.n_embd = 256, s.n_ff = 512, s.n_head = 4, s.n_head_kv = 2;
    cases.push_back({gguf::type_name(ty), s});
  }
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const Tiny t = make_tiny(c.spec, 21);
    const std::vector<float> q = path_logits(t, llama::LinearPath::quantized);
    const std::vector<float> f = path_logits(t, llama::LinearPath::f32);
    REQUIRE(q.size() == f.size());
    double mean = 0, var = 0;
    for (float v : f) mean += v;
    mean /= double(f.size());
    for (float v : f) var += (v - mean) * (v - mean);
    const double sd = std::sqrt(var / double(f.size()));
    double worst = 0;
    int bad = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      const double err = std::fabs(double(q[i]) - f[i]), lim = 0.08 * sd + 0.02 * std::fabs(f[i]);
      worst = std::max(worst, err / sd);
      bad += !(err <= lim);
    }
    INFO("logits' sd " << sd << ", worst |quantized - f32| / sd = " << worst);
    CHECK(bad == 0);
    CHECK(sd > 0.1);  // logits that say something
  }
}

TEST_CASE("llama: hyperparameters read from the keys") {
  const Tiny t = make_tiny(Spec{});
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Hparams hp = llama::Hparams::from_gguf(file);
  CHECK(hp.n_vocab == 50);
  CHECK(hp.n_embd == 32);
  CHECK(hp.n_layer == 2);
  CHECK(hp.n_ff == 48);
  CHECK(hp.n_head == 4);
  CHECK(hp.n_head_kv == 2);
  CHECK(hp.head_dim == 8);
  CHECK(hp.n_rot == 8);
  CHECK(hp.rope_base == 10000.0f);
  CHECK(hp.rms_eps == doctest::Approx(1e-5));
  CHECK(hp.n_ctx_train == 256);
}

TEST_CASE("llama: errors name the architecture, key or tensor at fault") {
  SUBCASE("unknown architecture") {
    Spec s;
    s.arch = "gpt2";
    const std::string e = load_error(make_tiny(s));
    CHECK(e.find("unsupported architecture 'gpt2'") != std::string::npos);
  }
  SUBCASE("head_count does not divide the embedding") {
    Spec s;
    s.n_head = 5;
    s.n_head_kv = 5;
    const std::string e = load_error(make_tiny(s));
    CHECK(e.find("head_count") != std::string::npos);
  }
  SUBCASE("head_count not a multiple of head_count_kv") {
    Spec s;
    s.n_head_kv = 3;
    s.n_embd = 24;  // 4 heads of 6: K/V would be 18 wide; the error comes from the keys first
    const std::string e = load_error(make_tiny(s));
    CHECK(e.find("head_count_kv") != std::string::npos);
  }
  SUBCASE("a tensor of the wrong shape") {
    Tiny t = make_tiny(Spec{});
    gguf::Writer w;
    const gguf::File f = gguf::File::from_bytes(t.bytes);
    for (const auto& kv : f.kvs()) {
      if (kv.value.type == gguf::ValueType::STRING) w.set_string(kv.key, kv.value.str);
      else if (kv.value.type == gguf::ValueType::F32) w.set_f32(kv.key, float(*kv.value.as_float()));
      else w.set_u32(kv.key, uint32_t(*kv.value.as_uint()));
    }
    for (const auto& ti : f.tensors()) {
      if (ti.name == "blk.1.attn_k.weight") {
        std::vector<float> z(size_t(32) * 8, 0.0f);
        w.add_tensor(ti.name, ti.type, {32, 8}, z.data());
      } else {
        w.add_tensor(ti.name, ti.type, ti.ne, f.tensor_data(ti));
      }
    }
    t.bytes = w.to_bytes();
    const std::string e = load_error(t);
    CHECK(e.find("blk.1.attn_k.weight") != std::string::npos);
    CHECK(e.find("[32, 8]") != std::string::npos);
    CHECK(e.find("[32, 16]") != std::string::npos);
  }
  SUBCASE("a missing tensor, and a tensor type the runtime cannot read") {
    Tiny t = make_tiny(Spec{});
    const gguf::File f = gguf::File::from_bytes(t.bytes);
    for (int variant = 0; variant < 2; ++variant) {
      gguf::Writer w;
      for (const auto& kv : f.kvs()) {
        if (kv.value.type == gguf::ValueType::STRING) w.set_string(kv.key, kv.value.str);
        else if (kv.value.type == gguf::ValueType::F32) w.set_f32(kv.key, float(*kv.value.as_float()));
        else w.set_u32(kv.key, uint32_t(*kv.value.as_uint()));
      }
      for (const auto& ti : f.tensors()) {
        if (ti.name == "blk.0.ffn_up.weight") {
          if (variant == 0) continue;
          std::vector<uint8_t> q5(gguf::row_bytes(TensorType::Q5_1, 32) * 48, 0);
          w.add_tensor(ti.name, TensorType::Q5_1, ti.ne, q5.data());
        } else {
          w.add_tensor(ti.name, ti.type, ti.ne, f.tensor_data(ti));
        }
      }
      Tiny bad = t;
      bad.bytes = w.to_bytes();
      const std::string e = load_error(bad);
      CAPTURE(e);
      CHECK(e.find("blk.0.ffn_up.weight") != std::string::npos);
      if (variant == 0) CHECK(e.find("missing tensor") != std::string::npos);
      else CHECK(e.find("q5_1") != std::string::npos);
    }
  }
  SUBCASE("a missing required key") {
    Tiny t = make_tiny(Spec{});
    const gguf::File f = gguf::File::from_bytes(t.bytes);
    gguf::Writer w;
    for (const auto& kv : f.kvs()) {
      if (kv.key == "llama.block_count") continue;
      if (kv.value.type == gguf::ValueType::STRING) w.set_string(kv.key, kv.value.str);
      else if (kv.value.type == gguf::ValueType::F32) w.set_f32(kv.key, float(*kv.value.as_float()));
      else w.set_u32(kv.key, uint32_t(*kv.value.as_uint()));
    }
    for (const auto& ti : f.tensors()) w.add_tensor(ti.name, ti.type, ti.ne, f.tensor_data(ti));
    t.bytes = w.to_bytes();
    CHECK(load_error(t).find("llama.block_count") != std::string::npos);
  }
}

TEST_CASE("llama: generate() with more than 64 sequences (several mask words) agrees across methods") {
  const Tiny t = make_tiny(Spec{}, 5);
  const gguf::File file = gguf::File::from_bytes(t.bytes, "tiny.gguf");
  const llama::Model model = llama::Model::load(file);
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 9}, {7}};
  GenerateParams gp;
  gp.n_predict = 4;
  gp.n_parallel = 25;  // 75 sequences
  gp.sampling.temp = 1.0f;
  gp.sampling.top_k = 0;
  gp.sampling.top_p = 1.0f;
  gp.sampling.min_p = 0.0f;
  gp.sampling.seed = 11;
  gp.kv_dtype = DType::f32;
  std::vector<GenerateResult> r;
  for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    gp.attn = m;
    r.push_back(generate(model, prompts, gp, [](int32_t) { return false; }));
  }
  REQUIRE(r[0].sequences.size() == 75);
  int differ = 0;
  for (int s = 0; s < 75; ++s) {
    CAPTURE(s);
    CHECK(r[0].sequences[s].tokens.size() == 4);
    CHECK(r[1].sequences[s].tokens == r[0].sequences[s].tokens);
    CHECK(r[2].sequences[s].tokens == r[0].sequences[s].tokens);
    differ += s > 0 && r[0].sequences[s].tokens != r[0].sequences[0].tokens;
  }
  CHECK(differ > 0);
  CHECK(r[0].n_prompt_stored == 3 + 3 + 1 + 1);  // [1 2 3] shared, [4 5 6], [9], [7]
  CHECK(r[0].n_prompt_tokens == 11);
}

TEST_CASE("llama: KV cache rejects a step at the wrong position and unknown methods") {
  TreeCache cache(1, {4, 2, 8}, DType::f32);
  const int root = cache.add_segment(-1);
  CHECK_THROWS_AS(cache.begin_step({{root, 1, 3}}), Error);
  CHECK_THROWS_AS(parse_attn_method("flash"), Error);
  CHECK(parse_attn_method("unified") == AttnMethod::unified);
}

}  // namespace test_llama
