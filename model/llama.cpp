#include "model/llama.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/parallel_for.h>

#include <Eigen/Core>
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

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
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

bool kept_quantized(gguf::TensorType t) {
  return t == gguf::TensorType::Q8_0 || t == gguf::TensorType::Q4_1;
}

// A 2-D tensor (ne = {n_in, n_out}): its blocks as they are (keep_quantized and a kept type), or dequantized
// row by row, rows spread over threads.
Linear load_linear(const gguf::File& f, const std::string& name, int64_t n_in, int64_t n_out, bool keep_quantized) {
  const gguf::TensorInfo& t = find_checked(f, name, {n_in, n_out});
  Linear l;
  l.n_in = n_in;
  l.n_out = n_out;
  const uint8_t* data = f.tensor_data(t);
  const uint64_t rb = gguf::row_bytes(t.type, n_in);
  if (keep_quantized && kept_quantized(t.type)) {
    l.type = t.type;
    l.row_bytes = rb;
    l.q.assign(data, data + rb * uint64_t(n_out));
    return l;
  }
  l.w.resize(size_t(n_in * n_out));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n_out, 256), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i)
      gguf::dequantize_row(t.type, data + i * rb, l.w.data() + i * n_in, n_in);
  });
  return l;
}

// --- the kept block types, written so the compiler vectorizes them (layouts in quant.hpp) ---
inline float half(const uint8_t* p) {
#if defined(__F16C__)
  return _cvtsh_ss(uint16_t(p[0] | (p[1] << 8)));  // one instruction: this runs once per block
#else
  return gguf::fp16_to_fp32(uint16_t(p[0] | (p[1] << 8)));
#endif
}

template <gguf::TensorType T>
struct Block;
template <>
struct Block<gguf::TensorType::Q8_0> {
  static constexpr int64_t bytes = 34;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half(b);
    const auto* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * float(q[j]);
  }
};
template <>
struct Block<gguf::TensorType::Q4_1> {
  static constexpr int64_t bytes = 20;
  static void dequant(const uint8_t* b, float* y) {
    const float d = half(b), m = half(b + 2);
    const uint8_t* q = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(q[j] & 15) + m;
      y[j + 16] = d * float(q[j] >> 4) + m;
    }
  }
};

template <gguf::TensorType T>
void dequant_row(const uint8_t* row, float* y, int64_t n_in) {
  for (int64_t b = 0; b < n_in / 32; ++b) Block<T>::dequant(row + b * Block<T>::bytes, y + b * 32);
}

// Most rows of X the fused path takes; more go through dequantized tiles and Eigen.
constexpr int64_t kFusedRows = 16;

#if defined(__AVX512F__)
// The 32 values of a block as two vectors of 16 floats (values 0-15, 16-31).
template <gguf::TensorType T>
inline void load_block16(const uint8_t* b, __m512 w[2]) {
  if constexpr (T == gguf::TensorType::Q8_0) {
    const __m512 d = _mm512_set1_ps(half(b));
    for (int k = 0; k < 2; ++k) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * k));
      w[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
  } else {
    const __m512 d = _mm512_set1_ps(half(b)), m = _mm512_set1_ps(half(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(15);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask))), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask))), d, m);
  }
}

// Y[r, i] = W_i . X_r for rows i of [i0, i1) and the N rows r of X: each block of W is dequantized into
// registers once and multiplied into N accumulators that stay in registers (2 chains each below N = 8,
// so FMA latency does not bound the loop).
template <gguf::TensorType T, int N>
void fused_rows(const Linear& W, const float* X, float* Y, int64_t i0, int64_t i1) {
  const int64_t n_blocks = W.n_in / 32;
  constexpr int C = N >= 8 ? 1 : 2;
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* row = W.q.data() + uint64_t(i) * W.row_bytes;
    __m512 acc[N][C];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      __m512 w[2];
      load_block16<T>(row + b * Block<T>::bytes, w);
      for (int r = 0; r < N; ++r) {
        const float* x = X + r * W.n_in + b * 32;
        acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), acc[r][0]);
        acc[r][C - 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), acc[r][C - 1]);
      }
    }
    for (int r = 0; r < N; ++r) {
      __m512 t = acc[r][0];
      if constexpr (C > 1) t = _mm512_add_ps(t, acc[r][1]);
      Y[r * W.n_out + i] = _mm512_reduce_add_ps(t);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The 32 values of a block as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31).
template <gguf::TensorType T>
inline void load_block(const uint8_t* b, __m256 w[4]) {
  if constexpr (T == gguf::TensorType::Q8_0) {
    const __m256 d = _mm256_set1_ps(half(b));
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Y[r, i] = W_i . X_r for rows i of [i0, i1) and the N rows r of X: each block of W is dequantized into
// registers once and multiplied into N accumulators that stay in registers.
template <gguf::TensorType T, int N>
void fused_rows(const Linear& W, const float* X, float* Y, int64_t i0, int64_t i1) {
  const int64_t n_blocks = W.n_in / 32;
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* row = W.q.data() + uint64_t(i) * W.row_bytes;
    // C independent chains per row of X: FMA latency (4 cycles) would otherwise bound a single chain.
    constexpr int C = N >= 8 ? 1 : N >= 3 ? 2 : 4;
    __m256 acc[N][C];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      __m256 w[4];
      load_block<T>(row + b * Block<T>::bytes, w);
      for (int r = 0; r < N; ++r) {
        const float* x = X + r * W.n_in + b * 32;
        for (int k = 0; k < 4; ++k) acc[r][k % C] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + 8 * k), acc[r][k % C]);
      }
    }
    for (int r = 0; r < N; ++r) {
      __m256 t = acc[r][0];
      for (int c = 1; c < C; ++c) t = _mm256_add_ps(t, acc[r][c]);
      Y[r * W.n_out + i] = hsum(t);
    }
  }
}
#else
// Y[r, i] = W_i . X_r for rows i of [i0, i1) and the N rows r of X: every block of W is dequantized into
// registers and multiplied into N accumulators of 32 lanes (N fixed so they stay in registers; the lanes are
// summed once per row, keeping the loops free of reductions the compiler would not vectorize).
template <gguf::TensorType T, int N>
void fused_rows(const Linear& W, const float* X, float* Y, int64_t i0, int64_t i1) {
  const int64_t n_blocks = W.n_in / 32;
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* row = W.q.data() + uint64_t(i) * W.row_bytes;
    float acc[N][32] = {};
    for (int64_t b = 0; b < n_blocks; ++b) {
      float w[32];
      Block<T>::dequant(row + b * Block<T>::bytes, w);
      for (int r = 0; r < N; ++r) {
        const float* x = X + r * W.n_in + b * 32;
        for (int j = 0; j < 32; ++j) acc[r][j] += w[j] * x[j];
      }
    }
    for (int r = 0; r < N; ++r) {
      float s = 0;
      for (int j = 0; j < 32; ++j) s += acc[r][j];
      Y[r * W.n_out + i] = s;
    }
  }
}

#endif

// All n rows of X, 8 or 4 at a time (W's rows are re-read from L1/L2 per group, not from memory).
template <gguf::TensorType T>
void fused_all(const Linear& W, const float* X, int64_t n, float* Y, int64_t i0, int64_t i1) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) fused_rows<T, 8>(W, X + r * W.n_in, Y + r * W.n_out, i0, i1);
  for (; r + 4 <= n; r += 4) fused_rows<T, 4>(W, X + r * W.n_in, Y + r * W.n_out, i0, i1);
  switch (n - r) {
    case 3: return fused_rows<T, 3>(W, X + r * W.n_in, Y + r * W.n_out, i0, i1);
    case 2: return fused_rows<T, 2>(W, X + r * W.n_in, Y + r * W.n_out, i0, i1);
    case 1: return fused_rows<T, 1>(W, X + r * W.n_in, Y + r * W.n_out, i0, i1);
    default: return;
  }
}

template <class F>
decltype(auto) dispatch_block(gguf::TensorType t, F&& f) {
  switch (t) {
    case gguf::TensorType::Q8_0: return f.template operator()<gguf::TensorType::Q8_0>();
    case gguf::TensorType::Q4_1: return f.template operator()<gguf::TensorType::Q4_1>();
    default: detail::fail("linear: type ", gguf::type_name(t), " is not kept quantized");
  }
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

void Linear::row(int64_t i, float* out) const {
  if (type == gguf::TensorType::F32) {
    std::copy_n(w.data() + i * n_in, n_in, out);
    return;
  }
  dispatch_block(type, [&]<gguf::TensorType T>() { dequant_row<T>(q.data() + uint64_t(i) * row_bytes, out, n_in); });
}

void linear(const Linear& W, const float* X, int64_t n, float* Y) {
  if (n == 0) return;
  using Map = Eigen::Map<const RowMat>;
  using OutMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
  const Map x(X, n, W.n_in);
  if (W.type == gguf::TensorType::F32) {
    // Blocks of output rows: big enough for Eigen's kernels, small enough to balance over threads.
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, W.n_out, 64), [&](const tbb::blocked_range<int64_t>& r) {
      const int64_t m = r.end() - r.begin();
      const Map w(W.w.data() + r.begin() * W.n_in, m, W.n_in);
      OutMap y(Y + r.begin(), n, m, Eigen::OuterStride<>(W.n_out));
      y.noalias() = x * w.transpose();
    });
    return;
  }
  dispatch_block(W.type, [&]<gguf::TensorType T>() {
    if (n <= kFusedRows) {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, W.n_out, 32), [&](const tbb::blocked_range<int64_t>& r) {
        fused_all<T>(W, X, n, Y, r.begin(), r.end());
      });
      return;
    }
    // Prefill: dequantize a tile of 64 rows (at most 64 x n_in floats, L2-sized) and multiply it with Eigen.
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, W.n_out, 64), [&](const tbb::blocked_range<int64_t>& r) {
      thread_local std::vector<float> tile;
      const int64_t m = r.end() - r.begin();
      tile.resize(size_t(m * W.n_in));
      for (int64_t i = 0; i < m; ++i)
        dequant_row<T>(W.q.data() + uint64_t(r.begin() + i) * W.row_bytes, tile.data() + i * W.n_in, W.n_in);
      const Map w(tile.data(), m, W.n_in);
      OutMap y(Y + r.begin(), n, m, Eigen::OuterStride<>(W.n_out));
      y.noalias() = x * w.transpose();
    });
  });
}

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
  size_t n = w_.tok_embd.bytes() + w_.output.bytes() + w_.output_norm.size() * sizeof(float);
  for (const Layer& l : w_.layers)
    n += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes() + l.ffn_gate.bytes() + l.ffn_up.bytes() +
         l.ffn_down.bytes() + (l.attn_norm.size() + l.ffn_norm.size()) * sizeof(float);
  return n;
}

Model Model::load(const gguf::File& f, bool keep_quantized) {
  Model m;
  m.hp_ = Hparams::from_gguf(f);
  const Hparams& hp = m.hp_;
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
  Weights& w = m.w_;
  w.tok_embd = load_linear(f, "token_embd.weight", d, hp.n_vocab, keep_quantized);
  w.output_norm = load_vector(f, "output_norm.weight", d);
  w.tied = f.find_tensor("output.weight") == nullptr;
  if (!w.tied) w.output = load_linear(f, "output.weight", d, hp.n_vocab, keep_quantized);
  // Layer by layer, so a block_count larger than the file's tensors fails at the first missing tensor
  // instead of allocating every layer up front.
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer& l = w.layers.emplace_back();
    l.attn_norm = load_vector(f, p + "attn_norm.weight", d);
    l.wq = load_linear(f, p + "attn_q.weight", d, dq, keep_quantized);
    l.wk = load_linear(f, p + "attn_k.weight", d, dkv, keep_quantized);
    l.wv = load_linear(f, p + "attn_v.weight", d, dkv, keep_quantized);
    l.wo = load_linear(f, p + "attn_output.weight", dq, d, keep_quantized);
    l.ffn_norm = load_vector(f, p + "ffn_norm.weight", d);
    l.ffn_gate = load_linear(f, p + "ffn_gate.weight", d, hp.n_ff, keep_quantized);
    l.ffn_up = load_linear(f, p + "ffn_up.weight", d, hp.n_ff, keep_quantized);
    l.ffn_down = load_linear(f, p + "ffn_down.weight", hp.n_ff, d, keep_quantized);
  }
  m.inv_freq_.resize(size_t(hp.n_rot / 2));
  for (int64_t i = 0; i < hp.n_rot / 2; ++i)
    m.inv_freq_[i] = float(std::pow(double(hp.rope_base), -2.0 * double(i) / double(hp.n_rot)));
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
  double t_attn = 0;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    const Layer& l = w_.layers[il];
    rms_norm(x.data(), l.attn_norm.data(), n, d, hp.rms_eps, h.data());
    linear(l.wq, h.data(), n, q.data());
    linear(l.wk, h.data(), n, k.data());
    linear(l.wv, h.data(), n, v.data());
    rope(q.data(), n, hp.n_head, hp.head_dim, hp.n_rot, rope_cos, rope_sin);
    rope(k.data(), n, hp.n_head_kv, hp.head_dim, hp.n_rot, rope_cos, rope_sin);
    cache.store(int(il), k.data(), v.data());
    const auto t0 = Clock::now();  // attention alone: storing K/V is not part of it
    cache.attend(int(il), q.data(), att.data());
    t_attn += seconds_since(t0);
    linear(l.wo, att.data(), n, tmp.data());
    for (int64_t i = 0; i < n * d; ++i) x[i] += tmp[i];

    rms_norm(x.data(), l.ffn_norm.data(), n, d, hp.rms_eps, h.data());
    linear(l.ffn_gate, h.data(), n, g.data());
    linear(l.ffn_up, h.data(), n, u.data());
    for (int64_t i = 0; i < n * hp.n_ff; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    linear(l.ffn_down, g.data(), n, tmp.data());
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
  linear(w_.lm_head(), sel.data(), n_out, logits.data());
  if (timings) {
    timings->attention += t_attn;
    timings->total += seconds_since(t_start);
  }
}

}  // namespace cascade::llama
