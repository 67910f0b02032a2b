// The CPU tile kernel: R stacked query rows against one token range of one KV head, with online softmax.
//
// It is the one compute routine behind every method: the shared-segment pass (R = all rows below a
// segment), the per-sequence pass (R = the group's heads times the sequence's query tokens), and the
// unified baseline (R = every row of the batch, with a sequence mask). K/V tiles are converted to f32 in
// L1-sized blocks and multiplied with Eigen's matrix products; the softmax runs row by row on the tile.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/kv.hpp"
#include "cascade/state.hpp"

namespace cascade::cpu {

// Keys per tile. 128 tokens x 128 dims x 4 bytes = 64 KiB per K tile: L2-resident, L1 for head_dim 64.
inline constexpr int64_t kKvTile = 128;
// Most query rows one work item carries (rows of a larger pass are split into tiles).
inline constexpr int64_t kMaxRows = 128;

// Per-thread scratch of the kernel; sized on first use, reused afterwards.
struct Scratch {
  std::vector<float> k, v, s, o, m, l;
  void reserve(int64_t rows, int64_t head_dim) {
    const auto grow = [](std::vector<float>& b, int64_t n) {
      if (int64_t(b.size()) < n) b.resize(n);
    };
    grow(k, kKvTile * head_dim);
    grow(v, kKvTile * head_dim);
    grow(s, rows * kKvTile);
    grow(o, rows * head_dim);
    grow(m, rows);
    grow(l, rows);
  }
};

// Visibility: a row sees the first limit[r] tokens of the span (causal and empty-row handling).
struct LimitMask {
  const int64_t* limit;  // (R): per stacked row
  // Sets S(r, j) = -inf for every key a + j the row may not see. S is (R, n) row-major, leading dim ld.
  void apply(float* s, int64_t ld, int64_t n_rows, int64_t a, int64_t n) const {
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t vis = limit[r] - a;
      if (vis >= n) continue;
      float* row = s + r * ld;
      for (int64_t j = vis < 0 ? 0 : vis; j < n; ++j) row[j] = kNegInf;
    }
  }
};

// Visibility in a unified buffer (one KV buffer for all sequences, as llama.cpp's unified cache):
// key j belongs to the sequences whose bits are set in key_seqs[j * n_words ...] and sits at key_pos[j];
// row r is a token of sequence row_seq[r] at position row_pos[r]. Visible: same sequence and pos <= pos.
struct UnifiedMask {
  const uint64_t* key_seqs;  // (n_keys, n_words)
  int64_t n_words;
  const int32_t* key_pos;  // (n_keys)
  const int32_t* row_seq;  // (R)
  const int32_t* row_pos;  // (R)
  void apply(float* s, int64_t ld, int64_t n_rows, int64_t a, int64_t n) const {
    for (int64_t r = 0; r < n_rows; ++r) {
      const int32_t seq = row_seq[r], pos = row_pos[r];
      const int64_t word = seq >> 6;
      const uint64_t bit = uint64_t(1) << (seq & 63);
      float* row = s + r * ld;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = a + j;
        const bool visible = (key_seqs[key * n_words + word] & bit) && key_pos[key] <= pos;
        if (!visible) row[j] = kNegInf;
      }
    }
  }
};

// Attends q (R, head_dim; already multiplied by the softmax scale) to tokens [t0, t1) of KV head kvh
// of kv, under mask (whose row and key indices are relative to the first row and to token 0 of kv).
// Writes the normalized partial state: o (R, head_dim) and lse (R), natural log; empty rows get (0, -inf).
template <class T, int D, class Mask>
void attend_range(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                  const Mask& mask, float* o, float* lse, Scratch& sc) {
  using Eigen::Dynamic;
  using Eigen::Map;
  using Eigen::RowMajor;
  using RowMat = Eigen::Matrix<float, Dynamic, D, RowMajor>;
  using ScoreMat = Eigen::Matrix<float, Dynamic, Dynamic, RowMajor>;
  const int64_t d = kv.head_dim;
  sc.reserve(n_rows, d);
  Map<const RowMat> Q(q, n_rows, d);
  Map<RowMat> O(sc.o.data(), n_rows, d);
  float* m = sc.m.data();
  float* l = sc.l.data();
  O.setZero();
  std::fill(m, m + n_rows, kNegInf);
  std::fill(l, l + n_rows, 0.0f);
  const T* kb = static_cast<const T*>(kv.k);
  const T* vb = static_cast<const T*>(kv.v);

  for (int64_t a = t0; a < t1;) {
    const int64_t n = std::min({kKvTile, t1 - a, kv.run_length(a)});
    // Load the K/V tile (n, d) as f32, rows one token each.
    const int64_t base = kv.offset(a, kvh);
    float* kt = sc.k.data();
    float* vt = sc.v.data();
    for (int64_t j = 0; j < n; ++j) {
      convert_to_f32(kb + base + j * kv.stride_token, kt + j * d, d);
      convert_to_f32(vb + base + j * kv.stride_token, vt + j * d, d);
    }
    Map<const RowMat> K(kt, n, d);
    Map<const RowMat> V(vt, n, d);
    Map<ScoreMat> S(sc.s.data(), n_rows, n);
    S.noalias() = Q * K.transpose();
    mask.apply(S.data(), n, n_rows, a, n);
    // Online softmax, row by row.
    for (int64_t r = 0; r < n_rows; ++r) {
      auto row = S.row(r).array();
      const float mx = row.maxCoeff();
      const float m_new = std::max(m[r], mx);
      if (m_new == kNegInf) {  // nothing visible yet: keep the empty state, contribute nothing
        row.setZero();
        continue;
      }
      const float alpha = std::exp(m[r] - m_new);  // 0 when m[r] = -inf
      row = (row - m_new).exp();  // Eigen's vectorized exp maps -inf (masked) to exactly 0
      l[r] = l[r] * alpha + row.sum();
      if (alpha != 1.0f) O.row(r) *= alpha;
      m[r] = m_new;
    }
    O.noalias() += S * V;
    a += n;
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    float* orow = o + r * d;
    if (l[r] > 0.0f) {
      const float inv = 1.0f / l[r];
      for (int64_t i = 0; i < d; ++i) orow[i] = O(r, i) * inv;
      lse[r] = m[r] + std::log(l[r]);
    } else {
      std::fill(orow, orow + d, 0.0f);
      lse[r] = kNegInf;
    }
  }
}

#if defined(__AVX512F__)
// The few-rows kernel (R <= kSmallRows, head_dim a multiple of 16 up to 256): the per-sequence pass, a handful of
// query rows against a long K/V, is bound by memory bandwidth, so K and V are read exactly once, converted
// in registers, and never staged: scores are dot products of each key with the rows held in L1, the PV
// update broadcasts each probability over the value vector. DV = head_dim / 16 (0: known at run time).
inline constexpr int64_t kSmallRows = 8;
inline constexpr int64_t kSmallTile = 64;

template <class T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, f16>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

// The four horizontal sums of a0..a3, in lanes 0..3: one transposing reduction instead of four.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d x = _mm512_castps_pd(b0), y = _mm512_castps_pd(b1);
  // each 128-bit block: partial sums of a0, a1, a2, a3 over that block's lanes
  const __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  const __m512 e = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
  return _mm512_castps512_ps128(_mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0xB1)));
}

// s(r, j) = q_r . k_j for n <= kSmallTile keys (rows of kt, stride apart). Keys are loaded and converted
// once, four at a time, and dotted with every row (the rows stay in L1); four scores share one reduction.
template <class T, int DV>
inline void small_scores(const float* q, int64_t n_rows, const T* kt, int64_t stride, int64_t n, int64_t nv,
                         float* s) {
  const int64_t nvv = DV > 0 ? DV : nv;
  const int64_t d = nvv * 16;
  constexpr int kMaxV = DV > 0 ? DV : 16;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 k[4][kMaxV];
    for (int u = 0; u < 4; ++u)
      for (int64_t c = 0; c < nvv; ++c) k[u][c] = load16(kt + (j + u) * stride + 16 * c);
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* qr = q + r * d;
      __m512 acc[4];
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_mul_ps(_mm512_loadu_ps(qr), k[u][0]);
      for (int64_t c = 1; c < nvv; ++c) {
        const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
        for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(qc, k[u][c], acc[u]);
      }
      _mm_storeu_ps(s + r * kSmallTile + j, reduce4(acc[0], acc[1], acc[2], acc[3]));
    }
  }
  for (; j < n; ++j) {
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* qr = q + r * d;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < nvv; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), load16(kt + j * stride + 16 * c), sum);
      s[r * kSmallTile + j] = _mm512_reduce_add_ps(sum);
    }
  }
}

// acc(r, :) += sum_j p(r, j) v_j, one 16-wide slice of the head at a time. U keys are in flight with
// their own accumulators, so R*U independent FMA chains hide the FMA latency even for one row.
template <class T, int R>
inline void small_pv_rows(const float* p, const T* vt, int64_t stride, int64_t n, int64_t nv, float* acc,
                          int64_t d) {
  constexpr int U = R <= 4 ? 4 : 2;
  for (int64_t c = 0; c < nv; ++c) {
    __m512 a[U][R];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) a[u][r] = u == 0 ? _mm512_loadu_ps(acc + r * d + 16 * c) : _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + U <= n; j += U) {
      for (int u = 0; u < U; ++u) {
        const __m512 v = load16(vt + (j + u) * stride + 16 * c);
        for (int r = 0; r < R; ++r) a[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kSmallTile + j + u]), v, a[u][r]);
      }
    }
    for (; j < n; ++j) {
      const __m512 v = load16(vt + j * stride + 16 * c);
      for (int r = 0; r < R; ++r) a[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kSmallTile + j]), v, a[0][r]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 sum = a[0][r];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, a[u][r]);
      _mm512_storeu_ps(acc + r * d + 16 * c, sum);
    }
  }
}

template <class T>
inline void small_pv(const float* p, int64_t n_rows, const T* vt, int64_t stride, int64_t n, int64_t nv, float* acc,
                     int64_t d) {
  switch (n_rows) {
    case 1: return small_pv_rows<T, 1>(p, vt, stride, n, nv, acc, d);
    case 2: return small_pv_rows<T, 2>(p, vt, stride, n, nv, acc, d);
    case 3: return small_pv_rows<T, 3>(p, vt, stride, n, nv, acc, d);
    case 4: return small_pv_rows<T, 4>(p, vt, stride, n, nv, acc, d);
    case 5: return small_pv_rows<T, 5>(p, vt, stride, n, nv, acc, d);
    case 6: return small_pv_rows<T, 6>(p, vt, stride, n, nv, acc, d);
    case 7: return small_pv_rows<T, 7>(p, vt, stride, n, nv, acc, d);
    default: return small_pv_rows<T, 8>(p, vt, stride, n, nv, acc, d);
  }
}

// Asks for the K/V rows of heads [kvh, kvh + n_heads) of tokens [a, a + n) while the current tile is
// computed: the heads of a token sit side by side, and one pass over them keeps the reads in order.
template <class T>
inline void prefetch_tile(const KvView& kv, const T* kb, const T* vb, int kvh, int n_heads, int64_t a, int64_t n) {
  const int64_t bytes = ((n_heads - 1) * kv.stride_head + kv.head_dim) * int64_t(sizeof(T));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t off = kv.offset(a + j, kvh);
    const char* kp = reinterpret_cast<const char*>(kb + off);
    const char* vp = reinterpret_cast<const char*>(vb + off);
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(kp + b, _MM_HINT_T0);
      _mm_prefetch(vp + b, _MM_HINT_T0);
    }
  }
}

// Heads [kvh, kvh + n_heads) are done together, tile by tile, so the token rows of K and V (all heads
// side by side in memory) stream from memory once and in order. q, o: (n_heads, n_rows, head_dim);
// lse: (n_heads, n_rows); the mask is the same for every head.
template <class T, int DV, class Mask>
void attend_range_small(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0,
                        int64_t t1, const Mask& mask, float* o, float* lse, Scratch& sc) {
  const int64_t d = kv.head_dim;
  const int64_t nv = DV > 0 ? DV : d / 16;
  const int64_t n_state = n_rows * n_heads;
  alignas(64) float s[kSmallRows * kSmallTile];
  sc.o.resize(n_state * d);
  sc.m.resize(n_state);
  sc.l.resize(n_state);
  float* A = sc.o.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  std::fill(A, A + n_state * d, 0.0f);
  std::fill(m, m + n_state, kNegInf);
  std::fill(l, l + n_state, 0.0f);
  const T* kb = static_cast<const T*>(kv.k);
  const T* vb = static_cast<const T*>(kv.v);
  for (int64_t a = t0; a < t1;) {
    const int64_t n = std::min({kSmallTile, t1 - a, kv.run_length(a)});
    prefetch_tile(kv, kb, vb, kvh, n_heads, a + n, std::min(kSmallTile, t1 - a - n));
    for (int h = 0; h < n_heads; ++h) {
      const T* kt = kb + kv.offset(a, kvh + h);
      const T* vt = vb + kv.offset(a, kvh + h);
      const float* qh = q + h * n_rows * d;
      float* Ah = A + h * n_rows * d;
      float* mh = m + h * n_rows;
      float* lh = l + h * n_rows;
      small_scores<T, DV>(qh, n_rows, kt, kv.stride_token, n, nv, s);
      mask.apply(s, kSmallTile, n_rows, a, n);
      for (int64_t r = 0; r < n_rows; ++r) {
        Eigen::Map<Eigen::ArrayXf> row(s + r * kSmallTile, n);
        const float m_new = std::max(mh[r], row.maxCoeff());
        if (m_new == kNegInf) {
          row.setZero();
          continue;
        }
        const float alpha = std::exp(mh[r] - m_new);
        row = (row - m_new).exp();
        lh[r] = lh[r] * alpha + row.sum();
        if (alpha != 1.0f) {
          float* ar = Ah + r * d;
          for (int64_t i = 0; i < d; ++i) ar[i] *= alpha;
        }
        mh[r] = m_new;
      }
      small_pv<T>(s, n_rows, vt, kv.stride_token, n, nv, Ah, d);
    }
    a += n;
  }
  for (int64_t r = 0; r < n_state; ++r) {
    float* orow = o + r * d;
    if (l[r] > 0.0f) {
      const float inv = 1.0f / l[r];
      for (int64_t i = 0; i < d; ++i) orow[i] = A[r * d + i] * inv;
      lse[r] = m[r] + std::log(l[r]);
    } else {
      std::fill(orow, orow + d, 0.0f);
      lse[r] = kNegInf;
    }
  }
}
#endif

// Whether a pass with this many stacked rows per head runs all KV heads in one item (the few-rows kernel).
inline bool use_small_kernel(int64_t rows_per_head, int head_dim) {
#if defined(__AVX512F__)
  return rows_per_head <= kSmallRows && head_dim % 16 == 0 && head_dim <= 256;
#else
  return false;
#endif
}

// Attends heads [kvh, kvh + n_heads) (q, o: (n_heads, n_rows, head_dim); lse: (n_heads, n_rows)) with the
// few-rows kernel when use_small_kernel says so, otherwise head by head with the tiled-product kernel
// (fixed-size fast paths for head dims 64 and 128).
template <class Mask>
void attend_range_dispatch(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0,
                           int64_t t1, const Mask& mask, float* o, float* lse, Scratch& sc) {
  const int64_t d = kv.head_dim;
  dispatch_dtype(kv.dtype, [&]<class T>() {
#if defined(__AVX512F__)
    if (use_small_kernel(n_rows, kv.head_dim)) {
      switch (kv.head_dim) {
        case 64: return attend_range_small<T, 4, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, o, lse, sc);
        case 128: return attend_range_small<T, 8, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, o, lse, sc);
        default: return attend_range_small<T, 0, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, o, lse, sc);
      }
    }
#endif
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + h * n_rows * d;
      float* oh = o + h * n_rows * d;
      float* lh = lse + h * n_rows;
      switch (kv.head_dim) {
        case 64: attend_range<T, 64, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, oh, lh, sc); break;
        case 128: attend_range<T, 128, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, oh, lh, sc); break;
        default: attend_range<T, Eigen::Dynamic, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, oh, lh, sc); break;
      }
    }
  });
}

#if defined(CASCADE_EXTERN_KERNELS)
// Compiled once in kernels/cpu_kernels.cpp.
#define CASCADE_CPU_KERNEL_EXTERN(T, D, M)                                                                     \
  extern template void attend_range<T, D, M>(const float*, int64_t, const KvView&, int, int64_t, int64_t, \
                                             const M&, float*, float*, Scratch&);
#define CASCADE_CPU_KERNEL_EXTERN_ALL(M)            \
  CASCADE_CPU_KERNEL_EXTERN(float, 64, M)           \
  CASCADE_CPU_KERNEL_EXTERN(float, 128, M)          \
  CASCADE_CPU_KERNEL_EXTERN(float, Eigen::Dynamic, M) \
  CASCADE_CPU_KERNEL_EXTERN(f16, 64, M)             \
  CASCADE_CPU_KERNEL_EXTERN(f16, 128, M)            \
  CASCADE_CPU_KERNEL_EXTERN(f16, Eigen::Dynamic, M) \
  CASCADE_CPU_KERNEL_EXTERN(bf16, 64, M)            \
  CASCADE_CPU_KERNEL_EXTERN(bf16, 128, M)           \
  CASCADE_CPU_KERNEL_EXTERN(bf16, Eigen::Dynamic, M)
CASCADE_CPU_KERNEL_EXTERN_ALL(LimitMask)
CASCADE_CPU_KERNEL_EXTERN_ALL(UnifiedMask)
#define CASCADE_CPU_DISPATCH_EXTERN(M)                                                                     \
  extern template void attend_range_dispatch<M>(const float*, int64_t, int, const KvView&, int, int64_t, \
                                                int64_t, const M&, float*, float*, Scratch&);
CASCADE_CPU_DISPATCH_EXTERN(LimitMask)
CASCADE_CPU_DISPATCH_EXTERN(UnifiedMask)
#endif

}  // namespace cascade::cpu
