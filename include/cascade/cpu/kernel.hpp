// The CPU tile kernel: R stacked query rows against one token range of one KV head, with online softmax.
//
// It is the one compute routine behind every method: the shared-segment pass (R = all rows below a
// segment), the per-sequence pass (R = the group's heads times the sequence's query tokens), and the
// unified baseline (R = every row of the batch, with a sequence mask). K/V tiles are converted to f32 in
// L1-sized blocks and multiplied with Eigen's matrix products; the softmax runs row by row on the tile.
#pragma once

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

// Picks the compiled head-dim fast path (64, 128) or the generic one and the storage type.
template <class Mask>
void attend_range_dispatch(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                           const Mask& mask, float* o, float* lse, Scratch& sc) {
  dispatch_dtype(kv.dtype, [&]<class T>() {
    switch (kv.head_dim) {
      case 64: return attend_range<T, 64, Mask>(q, n_rows, kv, kvh, t0, t1, mask, o, lse, sc);
      case 128: return attend_range<T, 128, Mask>(q, n_rows, kv, kvh, t0, t1, mask, o, lse, sc);
      default: return attend_range<T, Eigen::Dynamic, Mask>(q, n_rows, kv, kvh, t0, t1, mask, o, lse, sc);
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
#endif

}  // namespace cascade::cpu
