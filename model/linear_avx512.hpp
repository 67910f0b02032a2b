// The avx512-vnni tier of the linear kernels (linear_kernels.hpp), its base: the shared x86 kernels
// (linear_x86.inc) compiled for AVX-512 with VNNI and BF16, the 512-bit vector V512 and dot product Dot that its
// products run on (linear_avx512.cpp), and the AMX driver (linear_amx.hpp). Ice Lake, Sapphire Rapids, Zen 4 and
// later; called only where cpu_features() has AVX-512 VNNI (linear.cpp).
#pragma once

#include "model/linear_kernels.hpp"  // cascade/simd.hpp first

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
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
  static I bcasti(int32_t v) { return _mm512_set1_epi32(v); }
  static I set8(int v) { return _mm512_set1_epi8(char(v)); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I and_or(I a, I m, I b) { return _mm512_ternarylogic_epi32(a, m, b, 0xea); }  // (a & m) | b
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  template <int N>
  static I shl16(I v) {
    if constexpr (N > 0) return _mm512_slli_epi16(v, N);
    else if constexpr (N < 0) return _mm512_srli_epi16(v, -N);
    else return v;
  }
  static I srl32(I v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F bcastf(const float* p) { return _mm512_set1_ps(*p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F negate(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_half(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
