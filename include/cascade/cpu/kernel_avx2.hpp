// The AVX2 + FMA + F16C tier (8 lanes): Haswell, Zen 1 and every x86-64 server and laptop since. Its vector type,
// the drivers and the f32 products policies on it. Compiled for that instruction set whatever the build's flags;
// the plan chooses this tier (kernel.hpp: choose_kernel) only where cpu_features() has it.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cascade/cpu/kernel_common.hpp"

#if CASCADE_X86

CASCADE_TARGET_AVX2_BEGIN
namespace cascade::cpu::avx2 {

// The parts of V the x86 tiers share (the AVX-512 tier's V derives from it too): sum4's 128-bit result and its
// stores, one f16 as f32, fmadd on one float, and the prefetches.
struct X86Common {
  using quad = __m128;  // sum4's result
  static void store4(float* p, quad x) { _mm_storeu_ps(p, x); }
  static void store_lo2(float* p, quad x) { _mm_storel_pi(reinterpret_cast<__m64*>(p), x); }
  static void store_hi2(float* p, quad x) { _mm_storeh_pi(reinterpret_cast<__m64*>(p), x); }
  static float half(uint16_t bits) { return _cvtsh_ss(bits); }
  static float fma1(float a, float b, float c) { return std::fma(a, b, c); }  // fmadd on one lane
  static void prefetch(const void* p, bool to_l1) {
    if (to_l1) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
    else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  }
};

struct V : X86Common {
  using reg = __m256;
  using msk = __m256;  // all-ones lanes
  static constexpr int W = 8;
  // p * 2^n as (p + p) * 2^(n - 1), 2^(n - 1) built in the exponent field: n = kExp2Min gives the field 0, exactly 0,
  // and every other result is a normal number (a subnormal costs a microcode assist on Intel cores).
  static constexpr float kExp2Min = -126.0f;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg round(reg x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg ldexp(reg p, reg n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    return _mm256_mul_ps(_mm256_add_ps(p, p), _mm256_castsi256_ps(e));
  }
  static msk eq(reg a, reg b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static bool all_eq(reg a, reg b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) == 0xFF; }
  static reg select(msk m, reg if_set, reg if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
  static msk mask_from_bits(uint32_t bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), lane), lane));
  }
  static float hsum(reg a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(reg a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  // The horizontal sums of a0..a3 in lanes 0..3.
  static __m128 sum4(reg a0, reg a1, reg a2, reg a3) {
    const reg h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  // Transposes 8 x 8 floats in registers: lane c of r[i] becomes lane i of r[c].
  static void transpose(reg (&r)[8]) {
    reg t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + k]: lanes k (low half) and k + 4 (high half) of rows 4g..4g+3
    for (int g = 0; g < 2; ++g) {
      u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
      u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
      u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
      u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
      r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
      r[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
  }
  // The f16 elements [0, 8) of n <= 8 rows (stride elements apart; rows past n read as 0) as f32 columns: lane j of
  // col[i] = element i of row j.
  static void f16_columns(const f16* p, int64_t stride, int64_t n, reg (&col)[8]) {
    for (int j = 0; j < 8; ++j) col[j] = j < n ? kv<f16>(p + j * stride) : zero();
    transpose(col);
  }
  // 8 int8 codes (q8_0 K/V) as f32.
  static reg q8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  template <class T>
  static reg kv(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::is_same_v<T, f16>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      return _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
  }
};

#include "cascade/cpu/kernel_simd.inc"
#include "cascade/cpu/kernel_driver.inc"
#include "cascade/cpu/kernel_products_f32.inc"

// Row blocks of the tiled kernel: one register of 8 rows against 8 keys (16 registers in all).
inline constexpr int kTileRV = 1, kTileNK = 8;
static_assert(kTileNK == kTileStep, "the batch-invariant order steps the tiled kernel's keys");

}  // namespace cascade::cpu::avx2
CASCADE_TARGET_END

#endif  // CASCADE_X86
