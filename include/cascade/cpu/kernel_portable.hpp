// The portable CPU kernel: any CPU, any head dim, built on Eigen's matrix products. It is the path of CPUs
// without AVX2 + FMA + F16C, and the reference the SIMD kernels are timed against.
//
// R stacked query rows against one token range of one KV head, with online softmax: K/V tiles are converted
// to f32 in L1-sized blocks, S = Q K^T and O += P V are Eigen products, the softmax runs row by row.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cascade/cpu/kernel_common.hpp"

namespace cascade::cpu::portable {

// Keys per tile. 128 tokens x 128 dims x 4 bytes = 64 KiB per K tile: L2-resident, L1 for head_dim 64.
inline constexpr int64_t kKvTile = 128;

// Row `off` (an element offset of the view) of K, or of V where `values`, as d floats: converted, or q8_0 codes
// times their scales.
template <class T>
inline void row_to_f32(const KvView& kv, bool values, int64_t off, float* dst, int64_t d) {
  if constexpr (std::is_same_v<T, Q8Code>) {
    const int8_t* codes = static_cast<const int8_t*>(values ? kv.v : kv.k);
    const f16* scales = static_cast<const f16*>(values ? kv.v_scales : kv.k_scales);
    dequantize_q8_0(codes + off, scales + off / kQ8Block, d, dst);
  } else {
    convert_to_f32(static_cast<const T*>(values ? kv.v : kv.k) + off, dst, d);
  }
}

// Attends q (R, head_dim) times `scale` to tokens [t0, t1) of KV head kvh of kv, under mask (whose row and
// key indices are relative to the first row and to token 0 of kv). Writes the normalized partial state:
// o (R, head_dim) and lse (R), natural log; empty rows get (0, -inf). D: the head dim (Eigen::Dynamic: any).
template <class T, int D, class Mask>
void attend_range(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                  const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  using Eigen::Dynamic;
  using Eigen::Map;
  using Eigen::RowMajor;
  using RowMat = Eigen::Matrix<float, Dynamic, D, RowMajor>;
  using ScoreMat = Eigen::Matrix<float, Dynamic, Dynamic, RowMajor>;
  const int64_t d = kv.head_dim;
  float* qs = sc.get(0, n_rows * d);
  float* kt = sc.get(1, kKvTile * d);
  float* vt = sc.get(2, kKvTile * d);
  float* s = sc.get(3, n_rows * kKvTile);
  float* acc = sc.get(4, n_rows * d);
  float* m = sc.get(5, n_rows);
  float* l = sc.get(6, n_rows);
  for (int64_t i = 0; i < n_rows * d; ++i) qs[i] = q[i] * scale;
  Map<const RowMat> Q(qs, n_rows, d);
  Map<RowMat> O(acc, n_rows, d);
  O.setZero();
  std::fill(m, m + n_rows, kNegInf);
  std::fill(l, l + n_rows, 0.0f);

  for (int64_t a = t0; a < t1;) {
    const int64_t n = std::min({kKvTile, t1 - a, kv.run_length(a)});
    // Load the K/V tile (n, d) as f32, rows one token each.
    const int64_t base = kv.offset(a, kvh);
    for (int64_t j = 0; j < n; ++j) {
      row_to_f32<T>(kv, false, base + j * kv.stride_token, kt + j * d, d);
      row_to_f32<T>(kv, true, base + j * kv.stride_token, vt + j * d, d);
    }
    Map<const RowMat> K(kt, n, d);
    Map<const RowMat> V(vt, n, d);
    Map<ScoreMat> S(s, n_rows, n);
    S.noalias() = Q * K.transpose();
    if (!mask.all_visible(0, n_rows, a, n))
      for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t j = 0; j < n; ++j)
          if (!mask.visible(r, a + j)) S(r, j) = kNegInf;
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

// Heads [kvh, kvh + n_heads) one after the other (q, o: (n_heads, n_rows, head_dim); lse: (n_heads, n_rows)).
template <class T, class Mask>
void attend_heads(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                  const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  const int64_t d = kv.head_dim;
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + h * n_rows * d;
    float* oh = o + h * n_rows * d;
    float* lh = lse + h * n_rows;
    switch (kv.head_dim) {
      case 64: attend_range<T, 64, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
      case 128: attend_range<T, 128, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
      default: attend_range<T, Eigen::Dynamic, Mask>(qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
    }
  }
}

}  // namespace cascade::cpu::portable
