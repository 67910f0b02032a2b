// The avx512-vnni tier's decoders beside the shared 256-bit ones (linear_decode.inc): 64-code chunks for tile_k
// on 16 lanes, q4_1's scales 16 blocks at a time, and the four-block steps of q4_0 and q4_1 (tile_q4).
#pragma once

#include "model/linear_avx512.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {
namespace {  // internal linkage, as linear_x86.inc

// Codes<T> on 512-bit vectors: tile_k's chunks are 64 codes (two units), and q4_1's scales come 16 blocks at a
// time (scales16). The same numbers as Codes<T>.
template <TensorType T>
struct Codes64 : Codes<T> {
  using Base = Codes<T>;
  using Base::bb;
  // Chunk c: units 2c and 2c + 1. kChecked: a unit past the row (n_units) is zero and not read.
  template <bool kChecked>
  static __m512i chunk(const uint8_t* row, int64_t c, int64_t n_units, const uint8_t*) {
    const __m256i lo = Base::unit(row, 2 * c);
    const __m256i hi = !kChecked || 2 * c + 1 < n_units ? Base::unit(row, 2 * c + 1) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // The chunks every row may read unchecked: those of two whole units.
  static int64_t fast_chunks(const uint8_t*, int64_t n_units, int64_t n_chunks, const uint8_t*) {
    return std::min(n_chunks, n_units / 2);
  }
  static void scales(const uint8_t* row, int64_t g0, int64_t n, float* sc, float* off) {
    int64_t g = 0;
    if constexpr (T == TensorType::Q4_1) {
      // 16 blocks (320 bytes, five loads) at a time
      for (; g + 16 <= n; g += 16) {
        __m512 d, m;
        scales16<true>(row + g0 * bb, g, 16, d, m);
        _mm512_storeu_ps(sc + g, d);
        _mm512_storeu_ps(off + g, m);
      }
    }
    Base::scales(row, g0 + g, n - g, sc + g, off + g);
  }

  // The scales and offsets of blocks u .. u + n - 1 (1 <= n <= 16) of a row in f32 lanes, lanes n .. 15 zero,
  // from five loads of 64 bytes and three permutes. kRoom: the 320 bytes from block u may be read (the loads then
  // pass the n blocks into the next row at most); else loads are masked to the n blocks.
  template <bool kRoom>
  static void scales16(const uint8_t* row, int64_t u, int64_t n, __m512& sc, __m512& off) {
    const uint8_t* p = row + u * bb;
    __m512i r[5];
    for (int k = 0; k < 5; ++k) {
      if constexpr (kRoom) {
        r[k] = _mm512_loadu_si512(p + 64 * k);
      } else {
        r[k] = _mm512_maskz_loadu_epi8(first_bytes(n * int64_t(bb) - 64 * k), p + 64 * k);  // the n blocks only
      }
    }
    const __mmask16 lanes = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    if constexpr (T == TensorType::Q4_1) {
      // (d, m) dwords at 0, 5, .., 30 of the first two loads, 35, .., 60 of the next two, 65, 70, 75 of the last
      const __m512i i01 = _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i i23 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 3, 8, 13, 18, 23, 28, 0, 0, 0);
      const __m512i i4 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 11);
      __m512i v = _mm512_permutex2var_epi32(r[0], i01, r[1]);
      v = _mm512_mask_blend_epi32(__mmask16(0x1f80), v, _mm512_permutex2var_epi32(r[2], i23, r[3]));
      v = _mm512_mask_blend_epi32(__mmask16(0xe000), v, _mm512_permutexvar_epi32(i4, r[4]));
      v = _mm512_maskz_mov_epi32(lanes, v);
      sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
      off = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    } else {
      // d words at 0, 9, .., 63 of the first two loads, 72, .., 126 of the next two, 135 of the last
      alignas(64) static constexpr int16_t i01[32] = {0, 9, 18, 27, 36, 45, 54, 63};
      alignas(64) static constexpr int16_t i23[32] = {0, 0, 0, 0, 0, 0, 0, 0, 8, 17, 26, 35, 44, 53, 62};
      alignas(64) static constexpr int16_t i4[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7};
      __m512i v = _mm512_permutex2var_epi16(r[0], _mm512_load_si512(i01), r[1]);
      v = _mm512_mask_blend_epi16(__mmask32(0x7f00), v, _mm512_permutex2var_epi16(r[2], _mm512_load_si512(i23), r[3]));
      v = _mm512_mask_blend_epi16(__mmask32(0x8000), v, _mm512_permutexvar_epi16(_mm512_load_si512(i4), r[4]));
      v = _mm512_maskz_mov_epi16(__mmask32(lanes), v);
      sc = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
      off = _mm512_mul_ps(sc, _mm512_set1_ps(-8.0f));
    }
  }
  // scales16 for n <= 4 blocks, from four small loads: the 64 bytes from block u must be readable.
  static void scales4(const uint8_t* row, int64_t u, int64_t n, __m512& sc, __m512& off) {
    const uint8_t* p = row + u * bb;
    const __mmask16 lanes = __mmask16((1u << n) - 1);
    if constexpr (T == TensorType::Q4_1) {
      // d0 m0 d1 m1 .. d3 m3
      const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32(load_i32(p), load_i32(p + bb), load_i32(p + 2 * bb),
                                                        load_i32(p + 3 * bb)));
      const __m512 v = _mm512_castps256_ps512(dm);
      sc = _mm512_maskz_permutexvar_ps(lanes, _mm512_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v);
      off = _mm512_maskz_permutexvar_ps(lanes, _mm512_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v);
    } else {
      const auto h = [&](int k) {
        uint16_t v;
        std::memcpy(&v, p + k * bb, 2);
        return short(v);
      };
      const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0));
      sc = _mm512_maskz_mov_ps(lanes, _mm512_castps128_ps512(d));
      off = _mm512_mul_ps(sc, _mm512_set1_ps(-8.0f));
    }
  }
  // The 16 code bytes of blocks u .. u + 3 interleaved by dwords: dword 4m + k holds bytes 4m .. 4m + 3 of block
  // k, so that 32-bit lane j of a dot product belongs to block j % 4. Blocks at or past n (n < 4: the row's last,
  // partial quad) are zero and not read. Two loads that stay inside the four blocks (80 bytes for q4_1, 72 for
  // q4_0) and one two-source permute (dwords for q4_1's 20-byte blocks, words for q4_0's 18-byte ones).
  template <bool kPartial>
  static __m512i quad(const uint8_t* row, int64_t u, int64_t n) {
    const uint8_t* p = row + u * bb;
    constexpr int second = T == TensorType::Q4_1 ? 16 : 8;  // where the second load starts: it ends the quad
    __m512i a, b;
    if constexpr (kPartial) {
      const int64_t bytes = n * int64_t(bb);  // what may be read from p
      a = _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
      b = _mm512_maskz_loadu_epi8(first_bytes(bytes - second), p + second);
    } else {
      a = _mm512_loadu_si512(p);
      b = _mm512_loadu_si512(p + second);
    }
    if constexpr (T == TensorType::Q4_1) {
      // blocks 0-2's codes are dwords 1-4, 6-9, 11-14 of a; block 3's (bytes 64-79) dwords 12-15 of b
      return _mm512_permutex2var_epi32(a, _mm512_setr_epi32(1, 6, 11, 28, 2, 7, 12, 29, 3, 8, 13, 30, 4, 9, 14, 31), b);
    } else {
      // blocks 0-2's codes are words 1-8, 10-17, 19-26 of a; block 3's (bytes 56-71) words 24-31 of b
      alignas(64) static constexpr int16_t idx[32] = {1, 2, 10, 11, 19, 20, 56, 57, 3, 4, 12, 13, 21, 22, 58, 59,
                                                      5, 6, 14, 15, 23, 24, 60, 61, 7, 8, 16, 17, 25, 26, 62, 63};
      return _mm512_permutex2var_epi16(a, _mm512_load_si512(idx), b);
    }
  }
};

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
