// The avx512-vnni tier's tiles by lanes of X (linear_tile_x.inc): 16 lanes of X on 512-bit vectors (tile_x on
// V512, two vectors of rows a call where there are more than 16), and 8 lanes on 512-bit dot products (tile_x8h).
#pragma once

#include "model/linear_avx512_decode.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {
namespace {  // internal linkage, as linear_x86.inc

// tile_x for 4-8 rows of X (lanes-8 form) on 512-bit vectors: lane 2t + h holds row t of X and the codes of its
// k4 units 2m + h, so that a 64-bit broadcast of a weight row's 8 codes at k = 8m meets two units of every row
// of X in one dot product, and its two halves, both in the same group (G/4 units of 4 values are even), take
// the same scale; they are added once at the end. Per group and weight row: G/8 dot products and one scaling
// (convert, scale, FMA, offset FMA), where tile_x on 8 lanes takes G/4 and the same scaling: the scaling is per
// weight row and group, whatever the lanes hold. The offsets (q4_1, K-quants) go into lanes h = 0 only.
// out[r * 8 + t] as tile_x<V256, D, G, R, 1>.
template <class D, int G, int R>
__attribute__((noinline)) void tile_x8h(const Panel& p, const Int8Form& x, int64_t t0, float* out) {
  static_assert(G % 8 == 0);
  const int64_t K = x.n_in, n_groups = K / G, n_pad = x.n_pad;
  const float* s_base = G == 16 ? x.s16.data() : x.s32.data();
  const __m512i pair_idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i dup_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < n_groups; ++g) {
    __m512i ia[R];
    for (int r = 0; r < R; ++r) ia[r] = _mm512_setzero_si512();
    for (int m = 0; m < G / 8; ++m) {
      const int64_t k4 = g * G / 4 + 2 * m;
      const int8_t* x0 = x.q.data() + (k4 * n_pad + t0) * 4;
      const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0));  // unit k4, rows t0 ..
      const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + n_pad * 4));  // unit k4 + 1
      const __m512i xv = _mm512_permutexvar_epi32(pair_idx, _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1));
      for (int r = 0; r < R; ++r) {
        int64_t w8;
        std::memcpy(&w8, p.code + r * p.k_pad + g * G + 8 * m, 8);
        ia[r] = D::dot(ia[r], _mm512_set1_epi64(w8), xv);
      }
    }
    const __m256 d8 = _mm256_loadu_ps(x.d.data() + (g * G / 32) * n_pad + t0);
    const __m256 s8 = _mm256_loadu_ps(s_base + g * n_pad + t0);
    const __m512 dv = _mm512_permutexvar_ps(dup_idx, _mm512_castps256_ps512(d8));
    const __m512 sv = _mm512_maskz_permutexvar_ps(__mmask16(0x5555), dup_idx, _mm512_castps256_ps512(s8));
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(p.sc[r * p.g_pad + g]), dv);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p.off[r * p.g_pad + g]), sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 both = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));  // lane 2t: h = 0 plus h = 1
    _mm256_storeu_ps(out + r * 8, _mm512_castps512_ps256(_mm512_maskz_compress_ps(__mmask16(0x5555), both)));
  }
}

// rows_by_x's tile for 16 lanes of X (the lanes-16 form, more than 8 rows): 4 weight rows against one or two
// vectors of 16 rows of X.
template <TensorType T>
struct TileX16 {
  using Codes = Codes64<T>;
  static constexpr int R = 4, kWidth = 32;
  static int run(const Panel& p, const Int8Form& x, int64_t t, int64_t t1, float* out) {
    if (t1 - t > 16) {
      tile_x<V512, Dot, Codes::G, R, 2, false>(p, x, t, out);
      return 32;
    }
    tile_x<V512, Dot, Codes::G, R, 1, false>(p, x, t, out);
    return 16;
  }
};

// rows_by_x's tile for 8 lanes of X (4-8 rows): 8 weight rows per panel keep 16 accumulators in the 32 registers,
// and the 8 lanes' products run on 512-bit vpdpbusd (docs/study.md, section 17).
template <TensorType T>
struct TileX8h {
  using Codes = Codes64<T>;
  static constexpr int R = 8, kWidth = 8;
  static int run(const Panel& p, const Int8Form& x, int64_t t, int64_t, float* out) {
    tile_x8h<Dot, Codes::G, R>(p, x, t, out);
    return 8;
  }
};

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
