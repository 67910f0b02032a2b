// The AVX-512 tier (F, BW, VL, DQ; 16 lanes): its vector type, the drivers and the f32 products policies on it,
// and the same on 8 lanes for the tiled kernel's narrow last block. Compiled for those instruction sets whatever
// the build's flags; the plan chooses this tier (kernel.hpp: choose_kernel) only where cpu_features() has it.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cascade/cpu/kernel_avx2.hpp"  // its 8-lane vector, for the narrow kernels
#include "cascade/cpu/kernel_common.hpp"

#if CASCADE_X86

CASCADE_TARGET_AVX512_BEGIN
namespace cascade::cpu::avx512 {

// Transposes 16 x 16 32-bit words in registers: word c of r[i] becomes word i of r[c].
CASCADE_ALWAYS_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i a[16];
  CASCADE_UNROLL(8)
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4g + k], 128-bit lane L: column 4L + k of rows 4g..4g+3
  CASCADE_UNROLL(4)
  for (int g = 0; g < 4; ++g) {
    r[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  CASCADE_UNROLL(4)
  for (int k = 0; k < 4; ++k) {
    const __m512i c0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), c1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44),
                  c3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    a[0 + k] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    a[4 + k] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    a[8 + k] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    a[12 + k] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
  CASCADE_UNROLL(16)
  for (int i = 0; i < 16; ++i) r[i] = a[i];
}

struct V : avx2::X86Common {
  using reg = __m512;
  using msk = __mmask16;
  static constexpr int W = 16;
  // n = kExp2Min gives exactly 0 (a masked score, or one 2^-125 below the row's max), and every other result
  // p * 2^n (p in [2^-0.5, 2^0.5], n > kExp2Min) is a normal number. An instruction whose result is subnormal
  // or underflows to 0 takes a microcode assist on Intel cores: with a lower floor every masked lane cost one
  // (docs/study.md §20).
  static constexpr float kExp2Min = -126.0f;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg round(reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg ldexp(reg p, reg n) {
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(kExp2Min), _CMP_GT_OQ), p, n);
  }
  static msk eq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static bool all_eq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) == 0xFFFF; }
  static reg select(msk m, reg if_set, reg if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
  static msk mask_from_bits(uint32_t bits) { return msk(bits); }
  static float hsum(reg a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(reg a) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  // The horizontal sums of a0..a3 in lanes 0..3: one transposing reduction instead of four.
  static __m128 sum4(reg a0, reg a1, reg a2, reg a3) {
    const reg b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const reg b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d x = _mm512_castps_pd(b0), y = _mm512_castps_pd(b1);
    // each 128-bit block: partial sums of a0, a1, a2, a3 over that block's lanes
    const reg c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const reg e = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
    return _mm512_castps512_ps128(_mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0xB1)));
  }
  // Transposes 16 x 16 floats in registers: lane c of r[i] becomes lane i of r[c].
  static void transpose(reg (&r)[16]) {
    __m512i x[16];
    for (int i = 0; i < 16; ++i) x[i] = _mm512_castps_si512(r[i]);
    transpose16(x);
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(x[i]);
  }
  // The f16 elements [0, 16) of n <= 16 rows (stride elements apart; rows past n read as 0) as f32 columns:
  // lane j of col[i] = element i of row j. The 16-bit words are transposed on 256-bit registers (half the shuffles
  // of 32-bit words on 512-bit ones), then converted.
  static void f16_columns(const f16* p, int64_t stride, int64_t n, reg (&col)[16]) {
    __m256i r[16], a[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * stride)) : _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {  // a[2k + h], 128-bit lane L: words 8L + 4h + t of rows 2k, 2k + 1 (pairs by t)
      a[2 * k] = _mm256_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
      a[2 * k + 1] = _mm256_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // r[4g + x], lane L: words 8L + 2x, 8L + 2x + 1 of rows 4g..4g+3
      r[4 * g + 0] = _mm256_unpacklo_epi32(a[4 * g], a[4 * g + 2]);
      r[4 * g + 1] = _mm256_unpackhi_epi32(a[4 * g], a[4 * g + 2]);
      r[4 * g + 2] = _mm256_unpacklo_epi32(a[4 * g + 1], a[4 * g + 3]);
      r[4 * g + 3] = _mm256_unpackhi_epi32(a[4 * g + 1], a[4 * g + 3]);
    }
    for (int h = 0; h < 2; ++h)  // a[8h + m], lane L: word 8L + m of rows 8h..8h+7
      for (int x = 0; x < 4; ++x) {
        a[8 * h + 2 * x] = _mm256_unpacklo_epi64(r[8 * h + x], r[8 * h + 4 + x]);
        a[8 * h + 2 * x + 1] = _mm256_unpackhi_epi64(r[8 * h + x], r[8 * h + 4 + x]);
      }
    for (int m = 0; m < 8; ++m) {
      col[m] = _mm512_cvtph_ps(_mm256_permute2x128_si256(a[m], a[8 + m], 0x20));
      col[8 + m] = _mm512_cvtph_ps(_mm256_permute2x128_si256(a[m], a[8 + m], 0x31));
    }
  }
  // 16 int8 codes (q8_0 K/V) as f32.
  static reg q8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  template <class T>
  static reg kv(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<T, f16>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    }
  }
};


#include "cascade/cpu/kernel_simd.inc"
#include "cascade/cpu/kernel_driver.inc"
#include "cascade/cpu/kernel_products_f32.inc"

// The tiled kernel's f32 products on 8 lanes (256-bit registers), compiled for AVX-512 so that they have 32
// registers, for its last row block when that holds 8 rows or fewer (NarrowTail). 16 lanes would leave half of
// them empty, and a 512-bit instruction costs two 256-bit ones on CPUs that split them (Zen 4): 24 rows (8
// sequences x 3 query heads per KV head) cost 32 rows' work on 16 lanes, 24 rows' with the narrow tail.
namespace narrow {
struct V : avx2::V {};
#include "cascade/cpu/kernel_simd.inc"
#include "cascade/cpu/kernel_driver.inc"
#include "cascade/cpu/kernel_products_f32.inc"
}  // namespace narrow

// TiledF32's last row block on 8 lanes.
struct NarrowTail {
  static constexpr int W = narrow::V::W;
  template <int D, int NK>
  static void block(const float* qt, const float* kp, const float* vp, int64_t d, int nk, const uint32_t* bits,
                    int64_t bits_stride, float* ot, float* m, float* l) {
    narrow::tile_block<D, 1, NK>(qt, kp, vp, d, nk, bits, bits_stride, ot, m, l);
  }
};

// The same from memory to memory: dst row c (stride dst_stride words) = src column c (src rows src_stride words
// apart).
inline void transpose16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16];
  CASCADE_UNROLL(16)
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  transpose16(r);
  CASCADE_UNROLL(16)
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * dst_stride, r[i]);
}

// The head dim held by lane i (< 32) of a 32-dim block of a P V accumulator whose operands pair two keys' rows of
// 16-bit elements (kernel_bf16.hpp, kernel_q8.hpp): lanes 0-15 come from vpunpcklwd, 16-31 from vpunpckhwd, and in
// each, lane 4 L + t holds word t (or 4 + t) of the block's 128-bit lane L.
constexpr int64_t few_pair_dim(int64_t i) { return (i & 15) / 4 * 8 + (i >= 16 ? 4 : 0) + i % 4; }

// Row blocks of the tiled kernel: RV registers of 16 rows against NK keys (S in registers: RV * NK of 32). Two
// registers share each broadcast key element: with one, the S product's loads (a broadcast per multiply-add)
// kept pace with the two FMA ports and no more.
inline constexpr int kTileRV = 2, kTileNK = 8;
static_assert(kTileNK == kTileStep, "the batch-invariant order steps the tiled kernel's keys");

}  // namespace cascade::cpu::avx512
CASCADE_TARGET_END

#endif  // CASCADE_X86
