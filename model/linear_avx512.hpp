// The avx512-vnni tier of the linear kernels (linear_kernels.hpp), its base: the shared x86 kernels
// (linear_x86.inc) compiled for AVX-512 with VNNI and BF16, the 512-bit vector V512 and dot product Dot, and the
// helpers of the tier's own 512-bit tiles (linear_avx512_decode.hpp, linear_avx512_k.hpp, linear_avx512_x.hpp).
// Ice Lake, Sapphire Rapids, Zen 4 and later; called only where cpu_features() has AVX-512 VNNI (linear.cpp).
#pragma once

#include "model/linear_kernels.hpp"  // cascade/simd.hpp first

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "model/quant.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {

#include "model/linear_x86.inc"

namespace {  // internal linkage, as linear_x86.inc
struct Dot {
  static __m512i dot(__m512i acc, __m512i u8, __m512i s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
};

// 16 lanes (linear_vec.inc states what a vector type provides).
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  static I izero() { return _mm512_setzero_si512(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast32(const void* p) { return _mm512_set1_epi32(load_i32(p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F bcastf(const float* p) { return _mm512_set1_ps(*p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  template <int G>
  static F group_d(const float* d) {
    if constexpr (G == 32) return _mm512_loadu_ps(d);
    else
      return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                   _mm512_castps256_ps512(_mm256_loadu_ps(d)));
  }
  template <int G>
  static I chunk_groups(int j) {
    const I base = G == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                           : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_add_epi32(base, _mm512_set1_epi32(j * 64 / G));
  }
  static F permute(I idx, const float* p) { return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(p)); }
};

// A mask of the first m bytes of a 64-byte load (none for m <= 0, all for m >= 64).
inline __mmask64 first_bytes(int64_t m) {
  return m >= 64 ? ~__mmask64(0) : m <= 0 ? __mmask64(0) : (__mmask64(1) << m) - 1;
}

// The sums of the lanes of a, b, c and d, in that order: 14 instructions where four reductions take 32.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit lanes: a's halves added, then b's (ab); c's, then d's (cd); then each one's quarters (q)
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  q = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4e));
  q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xb1));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, q));
}

// out[r * T + t] = the sum of the lanes of acc[r][t], for the R (a multiple of 4) x T sums of a tile.
template <int R, int T>
inline void store_sums(const __m512 (&acc)[R][T], float* out) {
  static_assert(R % 4 == 0);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; r += 4) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, hsum4(acc[r][t], acc[r + 1][t], acc[r + 2][t], acc[r + 3][t]));
      for (int j = 0; j < 4; ++j) out[(r + j) * T + t] = sums[j];
    }
}

// Word shift counts: a in the low 256-bit half, b in the high one.
inline __m512i word_halves(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(short(a)), _mm256_set1_epi16(short(b)), 1);
}

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
