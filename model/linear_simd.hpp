// The x86 kernels of linear.hpp, written once as templates over a vector width and an integer dot product, and
// compiled by each path's file (linear_avx2.cpp, linear_avx_vnni.cpp, linear_avx512.cpp) for its instruction set.
//
// The including file defines, before including this header:
//   CASCADE_LINEAR_TARGET  the function attribute of its instruction set, e.g. __attribute__((target("avx2,fma")))
//   CASCADE_LINEAR_512     1 to compile the 512-bit traits (the file's target has AVX-512F/BW/DQ/VL)
// and its integer dot products: structs with `static I dot(I acc, I u8, I s8)` adding, in each 32-bit lane, the
// four products of unsigned bytes u8 and signed bytes s8 to acc. vpmaddubsw's pairs of products saturate at 16
// bits, so the avx2 path asks for q8_0 (codes up to 255) as signed codes multiplied with the sign trick (kSigned
// below: |w| times x with w's sign), every other type's codes staying at most 63.
//
// Everything here has internal linkage: each file gets its own copy, compiled for its own target.
//
// The two shapes of an int8 product (linear.hpp):
//   by lanes of K (few rows of X: 1-3)  a vector holds 32 or 64 consecutive codes of one weight row and the
//       same columns of one row of X; R weight rows x T rows of X accumulate in registers, f32 per lane, and the
//       group scales are spread over the lanes they cover (tile_k). q4_0 and q4_1 on 512-bit vectors instead
//       take four blocks a step, their low and high nibbles as two vectors against the activations' halves of
//       each block (tile_q4); q4_K and q6_K take 128 values a step, each nibble of a 64-byte load against the
//       activations' values it meets, each half of the dot product in one group (tile_q4k, tile_q6k); q5_K
//       as q4_K.
//   by lanes of X (more rows)  a vector holds 4 consecutive activations of 8 or 16 rows of X (Int8Form's lane
//       layout); a weight's 4 codes are broadcast to all lanes; R weight rows x TV vectors of X rows accumulate
//       one group in int32, then scale it into f32.
//       On 512-bit vectors, 8 rows of X take two units of 4 codes per lane pair (tile_x8h), so that each dot
//       product is 512 bits wide as with 16 rows.
// For the lanes of X, weights are first decoded, R rows at a time, into a panel of codes, scales and offsets (a
// few KiB, in L1), by SIMD decoders that produce exactly what gguf::decode_codes produces (tested).
#pragma once

#include "cascade/simd.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "model/linear_kernels.hpp"
#include "model/quant.hpp"

#ifndef CASCADE_LINEAR_TARGET
#error "define CASCADE_LINEAR_TARGET before including linear_simd.hpp"
#endif
#define LT CASCADE_LINEAR_TARGET

namespace cascade::linear::detail {
namespace {

using gguf::TensorType;

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if CASCADE_LINEAR_512
// A mask of the first m bytes of a 64-byte load (none for m <= 0, all for m >= 64).
inline __mmask64 first_bytes(int64_t m) {
  return m >= 64 ? ~__mmask64(0) : m <= 0 ? __mmask64(0) : (__mmask64(1) << m) - 1;
}
#endif

// --- vector traits -------------------------------------------------------------------------------------

struct V256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int L = 8;  // 32-bit lanes
  LT static I izero() { return _mm256_setzero_si256(); }
  LT static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  LT static I bcast32(const void* p) { return _mm256_set1_epi32(load_i32(p)); }
  LT static I abs8(I v) { return _mm256_abs_epi8(v); }
  LT static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
  LT static F fzero() { return _mm256_setzero_ps(); }
  LT static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  LT static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  LT static F bcastf(const float* p) { return _mm256_broadcast_ss(p); }
  LT static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  LT static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  LT static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  LT static float hsum(F v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
  // The activations' block scales of L groups of G values from block scales d: d[g * G / 32] for group g.
  template <int G>
  LT static F group_d(const float* d) {
    if constexpr (G == 32) return _mm256_loadu_ps(d);
    else return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  // For chunk j of a window of L groups of G values: the group each lane's 4 values are in.
  template <int G>
  LT static I chunk_groups(int j) {
    const I base = G == 32 ? _mm256_setzero_si256() : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_add_epi32(base, _mm256_set1_epi32(j * 32 / G));
  }
  LT static F permute(I idx, const float* p) { return _mm256_permutevar8x32_ps(_mm256_loadu_ps(p), idx); }
};

#if CASCADE_LINEAR_512
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  LT static I izero() { return _mm512_setzero_si512(); }
  LT static I load(const void* p) { return _mm512_loadu_si512(p); }
  LT static I bcast32(const void* p) { return _mm512_set1_epi32(load_i32(p)); }
  LT static F fzero() { return _mm512_setzero_ps(); }
  LT static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  LT static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  LT static F bcastf(const float* p) { return _mm512_set1_ps(*p); }
  LT static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  LT static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  LT static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  LT static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  template <int G>
  LT static F group_d(const float* d) {
    if constexpr (G == 32) return _mm512_loadu_ps(d);
    else
      return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                   _mm512_castps256_ps512(_mm256_loadu_ps(d)));
  }
  template <int G>
  LT static I chunk_groups(int j) {
    const I base = G == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                           : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_add_epi32(base, _mm512_set1_epi32(j * 64 / G));
  }
  LT static F permute(I idx, const float* p) { return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(p)); }
};
#endif

// --- decoders: the codes of a weight row 32 at a time, its scales and offsets a window at a time -----------------

// The low 16 bits (kHigh: the high 16 bits) of eight 32-bit lanes, as f32 from f16.
template <bool kHigh>
LT inline __m256 halves_of(__m256i v) {
  const __m256i pick = kHigh ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                                10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                             : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8,
                                                9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);  // qwords 0 and 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}

LT inline float half1(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The codes of one weight type (quant.hpp): unit(row, u) gives the 32 codes of values 32u .. 32u + 31 of a row;
// scales(row, g0, n, sc, off) the scales and offsets of its groups g0 .. g0 + n (n <= the row's groups - g0).
// kSigned (q8_0 only): the stored signed bytes themselves and offset 0, for vpmaddubsw (whose saturation codes up
// to 255 would break). They produce exactly what gguf::decode_codes produces (the tests compare the products).
template <TensorType T, bool kSigned = false>
struct Codes;

// q4_0 / q4_1 / q8_0: one block per unit; the f16 scale (and q4_1's min) at the start of each block.
template <TensorType T, bool kSigned>
  requires(T == TensorType::Q4_0 || T == TensorType::Q4_1 || T == TensorType::Q8_0)
struct Codes<T, kSigned> {
  static constexpr int G = 32;
  static constexpr bool is_signed = kSigned;
  static constexpr size_t bb = T == TensorType::Q4_0 ? 18 : T == TensorType::Q4_1 ? 20 : 34;
  LT static __m256i unit(const uint8_t* row, int64_t u) {
    const uint8_t* b = row + u * bb;
    if constexpr (T == TensorType::Q8_0) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
      return kSigned ? v : _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));
    } else {
      const __m128i m4 = _mm_set1_epi8(15);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (T == TensorType::Q4_0 ? 2 : 4)));
      return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    }
  }
  LT static void scales(const uint8_t* row, int64_t g0, int64_t n, float* sc, float* off) {
    const float mul = T == TensorType::Q4_0 ? -8.0f : kSigned ? 0.0f : -128.0f;
    const uint8_t* b = row + g0 * bb;
    int64_t g = 0;
#if CASCADE_LINEAR_512
    if constexpr (T == TensorType::Q4_1) {
      // 16 blocks (320 bytes, five loads) at a time
      for (; g + 16 <= n; g += 16) {
        __m512 d, m;
        scales16<true>(b, g, 16, d, m);
        _mm512_storeu_ps(sc + g, d);
        _mm512_storeu_ps(off + g, m);
      }
    }
#endif
    if constexpr (T == TensorType::Q4_1) {
      // (d, m) of 4 blocks as 8 halves: d0 m0 d1 m1 ..., then apart
      for (; g + 4 <= n; g += 4) {
        __m128i h = _mm_cvtsi32_si128(load_i32(b + g * bb));
        h = _mm_insert_epi32(h, load_i32(b + (g + 1) * bb), 1);
        h = _mm_insert_epi32(h, load_i32(b + (g + 2) * bb), 2);
        h = _mm_insert_epi32(h, load_i32(b + (g + 3) * bb), 3);
        const __m256 dm = _mm256_cvtph_ps(h);
        const __m128 lo = _mm256_castps256_ps128(dm), hi = _mm256_extractf128_ps(dm, 1);
        _mm_storeu_ps(sc + g, _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm_storeu_ps(off + g, _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
      }
    } else {
      for (; g + 8 <= n; g += 8) {
        __m128i h = _mm_setzero_si128();
        h = _mm_insert_epi16(h, int(b[g * bb] | b[g * bb + 1] << 8), 0);
        h = _mm_insert_epi16(h, int(b[(g + 1) * bb] | b[(g + 1) * bb + 1] << 8), 1);
        h = _mm_insert_epi16(h, int(b[(g + 2) * bb] | b[(g + 2) * bb + 1] << 8), 2);
        h = _mm_insert_epi16(h, int(b[(g + 3) * bb] | b[(g + 3) * bb + 1] << 8), 3);
        h = _mm_insert_epi16(h, int(b[(g + 4) * bb] | b[(g + 4) * bb + 1] << 8), 4);
        h = _mm_insert_epi16(h, int(b[(g + 5) * bb] | b[(g + 5) * bb + 1] << 8), 5);
        h = _mm_insert_epi16(h, int(b[(g + 6) * bb] | b[(g + 6) * bb + 1] << 8), 6);
        h = _mm_insert_epi16(h, int(b[(g + 7) * bb] | b[(g + 7) * bb + 1] << 8), 7);
        const __m256 d = _mm256_cvtph_ps(h);
        _mm256_storeu_ps(sc + g, d);
        _mm256_storeu_ps(off + g, _mm256_mul_ps(d, _mm256_set1_ps(mul)));
      }
    }
    for (; g < n; ++g) {
      sc[g] = half1(b + g * bb);
      off[g] = T == TensorType::Q4_1 ? half1(b + g * bb + 2) : mul * sc[g];
    }
  }
#if CASCADE_LINEAR_512
  // q8_0 by 64 (two blocks), for tile_k. q4_0 and q4_1 go four blocks at a time through tile_q4 (quad below).
  LT static int64_t fast_chunks(const uint8_t*, int64_t n_units, const uint8_t*) { return n_units / 2; }
  template <bool kChecked>
  LT static __m512i chunk64(const uint8_t* row, int64_t c, int64_t n_units, const uint8_t*) {
    static_assert(T == TensorType::Q8_0);
    const __m256i lo = unit(row, 2 * c);
    const __m256i hi = !kChecked || 2 * c + 1 < n_units ? unit(row, 2 * c + 1) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // The scales and offsets of blocks u .. u + n - 1 (1 <= n <= 16) of a row in f32 lanes, lanes n .. 15 zero,
  // from five loads of 64 bytes and three permutes. kRoom: the 320 bytes from block u may be read (the loads then
  // pass the n blocks into the next row at most); else loads are masked to the n blocks.
  template <bool kRoom>
  LT static void scales16(const uint8_t* row, int64_t u, int64_t n, __m512& sc, __m512& off) {
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
  LT static void scales4(const uint8_t* row, int64_t u, int64_t n, __m512& sc, __m512& off) {
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
  LT static __m512i quad(const uint8_t* row, int64_t u, int64_t n) {
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
#endif
};

// The K-quants: 256 values per block; scales and offsets from gguf::block_scales.
template <TensorType T, bool kSigned>
  requires(T == TensorType::Q4_K || T == TensorType::Q5_K || T == TensorType::Q6_K)
struct Codes<T, kSigned> {
  static constexpr int G = T == TensorType::Q6_K ? 16 : 32;
  static constexpr bool is_signed = false;
  static constexpr size_t bb = T == TensorType::Q4_K ? 144 : T == TensorType::Q5_K ? 176 : 210;
  LT static __m256i unit(const uint8_t* row, int64_t u) {
    const uint8_t* b = row + (u / 8) * bb;
    const int j = int(u % 8);
    const __m256i m4 = _mm256_set1_epi8(15);
    if constexpr (T == TensorType::Q6_K) {
      // half h = j / 4, quarter q = j % 4: low nibbles of ql[64h + 32 (q % 2) ..] (high nibbles for q >= 2),
      // bits 2q and 2q + 1 of qh[32h ..] as bits 4 and 5
      const int h = j / 4, q = j % 4;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (q % 2)));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i lo = _mm256_and_si256(q < 2 ? l : _mm256_srli_epi16(l, 4), m4);
      __m256i hi;
      switch (q) {
        case 0: hi = _mm256_slli_epi16(hb, 4); break;
        case 1: hi = _mm256_slli_epi16(hb, 2); break;
        case 2: hi = hb; break;
        default: hi = _mm256_srli_epi16(hb, 2); break;
      }
      return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    } else {
      // group g = j / 2 reads qs[32g ..]: low nibbles for even j, high for odd; q5_K's fifth bit is bit j of qh[l]
      constexpr size_t qs = T == TensorType::Q5_K ? 48 : 16;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + qs + 32 * (j / 2)));
      __m256i c = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
      if constexpr (T == TensorType::Q5_K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        c = _mm256_or_si256(c, _mm256_slli_epi16(bit, 4));
      }
      return c;
    }
  }
#if CASCADE_LINEAR_512
  LT static int64_t fast_chunks(const uint8_t*, int64_t n_units, const uint8_t*) { return n_units / 2; }
  template <bool>
  LT static __m512i chunk64(const uint8_t* row, int64_t c, int64_t, const uint8_t*) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(unit(row, 2 * c)), unit(row, 2 * c + 1), 1);
  }
#endif
  // One block's per-group scales and offsets, the numbers gguf::block_scales gives (the same f32 products),
  // without its dispatch and its scalar half conversions. q4_K / q5_K pack eight 6-bit scales and mins in 12
  // bytes (quant.cpp, scale_min_k4): as three little-endian words w0, w1, w2, groups 0-3 are the low 6 bits of
  // w0's (scales) and w1's (mins) bytes, groups 4-7 the nibbles of w2's bytes (scales low, mins high) under
  // the top 2 bits of w0's and w1's bytes. q6_K has 16 int8 scales and one d. By `perf`, the scalar decode
  // was ~20% of the one-row q4_K product (Llama-3.2-1B's layers, one thread).
  LT static void block_scales(const uint8_t* b, float* sc, float* off) {
    const auto half = [](const uint8_t* p) LT {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return _cvtsh_ss(h);
    };
    if constexpr (T == TensorType::Q6_K) {
      const __m256 d = _mm256_set1_ps(half(b + 208));
      for (int h = 0; h < 2; ++h) {
        const __m256 v = _mm256_mul_ps(
            d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h)))));
        _mm256_storeu_ps(sc + 8 * h, v);
        _mm256_storeu_ps(off + 8 * h, _mm256_mul_ps(_mm256_set1_ps(-32.0f), v));
      }
    } else {
      __m256 s, o;
      block_scales8(b, s, o);
      _mm256_storeu_ps(sc, s);
      _mm256_storeu_ps(off, o);
    }
  }
  // q4_K / q5_K: the eight groups' scales and offsets of block b, in registers.
  LT static void block_scales8(const uint8_t* b, __m256& sc, __m256& off) {
    static_assert(T != TensorType::Q6_K);
    uint16_t d, dmin;
    std::memcpy(&d, b, 2);
    std::memcpy(&dmin, b + 2, 2);
    const uint32_t w0 = uint32_t(load_i32(b + 4)), w1 = uint32_t(load_i32(b + 8)), w2 = uint32_t(load_i32(b + 12));
    const uint32_t s_lo = w0 & 0x3f3f3f3fu, m_lo = w1 & 0x3f3f3f3fu;
    const uint32_t s_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    const __m128i sb = _mm_set_epi32(0, 0, int(s_hi), int(s_lo)), mb = _mm_set_epi32(0, 0, int(m_hi), int(m_lo));
    sc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sb)));
    off = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb)));
  }
  LT static void scales(const uint8_t* row, int64_t g0, int64_t n, float* sc, float* off) {
    constexpr int64_t per = 256 / G;  // groups per block
    float bs[per], bo[per];
    for (int64_t g = 0; g < n;) {
      const int64_t b = (g0 + g) / per, first = (g0 + g) % per, m = std::min(per - first, n - g);
      if (m == per) {
        block_scales(row + b * bb, sc + g, off + g);
      } else {
        block_scales(row + b * bb, bs, bo);
        std::memcpy(sc + g, bs + first, size_t(m) * sizeof(float));
        std::memcpy(off + g, bo + first, size_t(m) * sizeof(float));
      }
      g += m;
    }
  }
};

// A panel: R weight rows decoded, row r's codes at code + r * k_pad (zero past K), its scales and offsets at
// sc / off + r * g_pad (zero past K / G). Rows past the matrix's end are all zero.
struct Panel {
  std::vector<uint8_t> code_store;
  std::vector<float> sc_store, off_store;
  uint8_t* code = nullptr;
  float *sc = nullptr, *off = nullptr;
  int64_t k_pad = 0, g_pad = 0;

  void reserve(int R, int64_t K, int64_t G) {
    k_pad = (K + 63) / 64 * 64;
    g_pad = k_pad / G;
    code_store.resize(size_t(R * k_pad + 64));
    sc_store.resize(size_t(R * g_pad + 16));
    off_store.resize(size_t(R * g_pad + 16));
    // 64-byte alignment for the code rows (k_pad is a multiple of 64)
    const auto base = reinterpret_cast<uintptr_t>(code_store.data());
    code = code_store.data() + ((64 - base % 64) % 64);
    sc = sc_store.data();
    off = off_store.data();
  }
};

// Rows [i, i + n) of w (contiguous in memory) asked for into the L2 cache a few lines per step of a tile's loop
// over its codes, rather than all at once. The few-rows products (tile_q4, tile_k) ask for the tile kAhead
// tiles ahead this way: a burst of ~23 prefetches (4 rows of 576 q4_1 values) at each tile's
// start held the loads behind it. 1 row of X, SmolLM2's q4_1 layers and output matrix from DRAM, two threads,
// builds alternated, 3 rounds: 5.67-6.06 -> 5.20-5.28 ms (the output matrix alone 1.03-1.08 -> 0.88-0.97 ms).
// Panels too, a row of the panel kAhead ahead per row decoded (decode_panel): 8 rows of X, SmolLM2's layers,
// q4_1 12.4-12.7 -> 11.1-11.5 ms, q8_0 15.3-17.0 -> 14.0-14.7 ms; 32 rows 2-5% faster. And the float weights'
// tiles (tile_float, tile_bf16), which asked for nothing ahead: f16 at 1 row 17.8-18.2 -> 13.3-13.4 ms, at 8
// rows 31-33 -> 24 ms; bf16 on vdpbf16ps at 8 rows 37 -> 23 ms. Rows past the end are not asked for.
struct RowsAhead {
  const char* base = nullptr;
  int64_t n_lines = 0, per_step = 0;
  RowsAhead(const Matrix& w, int64_t i, int64_t n, int64_t n_steps) {
    if (i >= w.n_out || n_steps <= 0) return;
    const auto a = reinterpret_cast<uintptr_t>(w.data + uint64_t(i) * w.row_bytes) & ~uintptr_t(63);
    const auto e = reinterpret_cast<uintptr_t>(w.data + uint64_t(std::min(i + n, w.n_out)) * w.row_bytes);
    base = reinterpret_cast<const char*>(a);
    n_lines = int64_t((e - a + 63) / 64);
    per_step = (n_lines + n_steps - 1) / n_steps;
  }
  // The lines of step s of n_steps (none past the last step).
  void step(int64_t s) const {
    const int64_t l1 = std::min(n_lines, (s + 1) * per_step);
    for (int64_t l = s * per_step; l < l1; ++l) _mm_prefetch(base + 64 * l, _MM_HINT_T1);
  }
};

// Decodes rows [i, i + R) of w into p, asking meanwhile for rows [ahead, ahead + R) (none for w.n_out).
template <class Cd>
LT void decode_panel(const Matrix& w, int64_t i, int R, Panel& p, int64_t ahead) {
  const RowsAhead pf(w, ahead, R, R);
  const int64_t K = w.n_in, n_units = K / 32, n_groups = K / Cd::G;
  for (int r = 0; r < R; ++r) {
    pf.step(r);
    uint8_t* code = p.code + r * p.k_pad;
    float* sc = p.sc + r * p.g_pad;
    float* off = p.off + r * p.g_pad;
    if (i + r < w.n_out) {
      const uint8_t* row = w.data + uint64_t(i + r) * w.row_bytes;
      for (int64_t u = 0; u < n_units; ++u)
        _mm256_store_si256(reinterpret_cast<__m256i*>(code + 32 * u), Cd::unit(row, u));
      Cd::scales(row, 0, n_groups, sc, off);
      std::memset(code + K, 0, size_t(p.k_pad - K));
      std::fill(sc + n_groups, sc + p.g_pad, 0.0f);
      std::fill(off + n_groups, off + p.g_pad, 0.0f);
    } else {
      std::memset(code, 0, size_t(p.k_pad));
      std::fill(sc, sc + p.g_pad, 0.0f);
      std::fill(off, off + p.g_pad, 0.0f);
    }
  }
}

// --- the int8 product, by lanes of K ---------------------------------------------------------------------

// A chunk of 32 (V256) or 64 (V512) codes of a row. kChecked: units past the row (n_units) are zero and nothing
// at or past limit is read; without it, c must be below fast_chunk_count for this row.
template <class V, class Cd, bool kChecked>
LT typename V::I chunk_codes(const uint8_t* row, int64_t c, int64_t n_units, const uint8_t* limit) {
  if constexpr (V::L == 8) {
    return Cd::unit(row, c);
  } else {
#if CASCADE_LINEAR_512
    return Cd::template chunk64<kChecked>(row, c, n_units, limit);
#endif
  }
}

// How many leading chunks of rows up to `last` chunk_codes<V, Cd, false> may read (the rest need checks).
template <class V, class Cd>
LT int64_t fast_chunk_count(const uint8_t* last, int64_t n_units, int64_t n_chunks, const uint8_t* limit) {
  if constexpr (V::L == 8) {
    return n_chunks;  // a unit's load stays inside its block
  } else {
#if CASCADE_LINEAR_512
    return std::min(n_chunks, Cd::fast_chunks(last, n_units, limit));
#endif
  }
}

#if CASCADE_LINEAR_512
// The sums of the lanes of a, b, c and d, in that order: 14 instructions where four reductions take 32.
LT inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
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
LT inline void store_sums(const __m512 (&acc)[R][T], float* out) {
  static_assert(R % 4 == 0);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; r += 4) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, hsum4(acc[r][t], acc[r + 1][t], acc[r + 2][t], acc[r + 3][t]));
      for (int j = 0; j < 4; ++j) out[(r + j) * T + t] = sums[j];
    }
}

// Word shift counts: a in the low 256-bit half, b in the high one.
LT inline __m512i word_halves(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(short(a)), _mm256_set1_epi16(short(b)), 1);
}

// The scratch tile_q4 needs for `rows` rows x rows of X: each one's group products, whole windows of 16.
inline int64_t q4_comb_floats(int64_t rows, int64_t n_in) { return rows * ((n_in / 32 + 15) / 16 * 16); }

// tile_k for q4_0 / q4_1 on 512-bit vectors. Each row's scales and offsets come 16 groups at a time into
// registers (Codes::scales16) and go straight into the group products and the offsets' sum, so nothing is stored
// and read back narrower than it was written. Then four blocks a step (Codes::quad): their low nibbles against
// the activations' values 0-15 of each block and their high nibbles against 16-31, both into one sum whose lane
// j belongs to block j % 4, so the four blocks' group products are one 128-bit load repeated. Per four blocks and
// row: one permute, three mask/shift ops, two dot products, a convert and an FMA, where two 64-code chunks took
// four permutes, two converts and two FMAs. (Lanes by blocks, j / 4, and the products permuted into place: a
// permute more per four blocks and row, 1536 x 576 q4_1 in L2, one row of X, one thread 21.4 -> 23.0 ns per row.)
// comb: scratch of q4_comb_floats(R * T, n_in) floats.
// ahead: the first row of the tile to ask for meanwhile (RowsAhead), or w.n_out for none.
template <class D, class Cd, int R, int T>
LT void tile_q4(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, float* out, float* comb, int64_t ahead) {
  constexpr int64_t bb = Cd::bb;
  const int64_t K = x.n_in, nu = K / 32, gp = (nu + 15) / 16 * 16;
  // comb (R, T, gp): scale[g] * d[g], zero past the row's groups
  const uint8_t* row[R];
  const uint8_t* limit = w.data + w.bytes();  // the matrix's end
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r) {
    row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nu; g += 16) {
      const int64_t n = std::min<int64_t>(16, nu - g);
      __m512 sc, off;
      // 16 q4_1 blocks are the 320 bytes scales16 reads; 16 q4_0 blocks only 288. A last window of at most 4
      // groups (SmolLM2's 576 columns: 2) from four small loads: 1536 x 576 q4_1 in L2, one row of X, one thread,
      // 18.5-19.0 -> 17.2-18.0 ns per row.
      const int64_t room = limit - (row[r] + g * bb);
      if (n <= 4 && room >= 64)
        Cd::scales4(row[r], g, n, sc, off);
      else if ((n == 16 && 16 * bb >= 320) || room >= 320)
        Cd::template scales16<true>(row[r], g, n, sc, off);
      else
        Cd::template scales16<false>(row[r], g, n, sc, off);
      for (int t = 0; t < T; ++t) {
        // past the row's last group these read the next row's numbers (or the buffers' zero slack): times 0
        const float* d = x.d.data() + (t0 + t) * nu + g;
        const float* sg = x.s32.data() + (t0 + t) * nu + g;
        _mm512_storeu_ps(comb + (r * T + t) * gp + g, _mm512_mul_ps(sc, _mm512_loadu_ps(d)));
        acc[r][t] = _mm512_fmadd_ps(off, _mm512_loadu_ps(sg), acc[r][t]);
      }
    }
  }
  const int8_t* xq = x.q.data() + t0 * K;
  const RowsAhead pf(w, ahead, R, (nu + 3) / 4);
  const auto quad = [&]<bool kPartial>(int64_t q) LT {
    pf.step(q);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const __m512i v = Cd::template quad<kPartial>(row[r], 4 * q, nu - 4 * q);
      lo[r] = _mm512_and_si512(v, m4);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    for (int t = 0; t < T; ++t) {
      // values 0-15 of the four blocks (dwords 0-3 of each), interleaved as the codes are, then 16-31 (dwords
      // 4-7). A last, partial quad reads past the row, into the next one or the buffer's zero slack, against zero
      // codes or scales.
      const int8_t* xp = xq + t * K + q * 128;
      const __m512i x0 = _mm512_loadu_si512(xp), x1 = _mm512_loadu_si512(xp + 64);
      const __m512i xl = _mm512_permutex2var_epi32(
          x0, _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27), x1);
      const __m512i xh = _mm512_permutex2var_epi32(
          x0, _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31), x1);
      for (int r = 0; r < R; ++r) {
        const __m512i s = D::dot(D::dot(_mm512_setzero_si512(), lo[r], xl), hi[r], xh);
        // lane j's group is 4q + j % 4: the four products repeated, a load (no permute)
        const __m512 c = _mm512_broadcast_f32x4(_mm_loadu_ps(comb + (r * T + t) * gp + 4 * q));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), c, acc[r][t]);
      }
    }
  };
  const int64_t n_full = nu / 4;
  for (int64_t q = 0; q < n_full; ++q) quad.template operator()<false>(q);
  // A last quad of fewer blocks reads the next row's codes (against zero scales) unless that would pass the
  // matrix's end; masked loads cost as much as two whole quads.
  if (nu % 4) {
    if (limit - row[R - 1] >= (n_full + 1) * 4 * bb) quad.template operator()<false>(n_full);  // row[R - 1]: the last
    else quad.template operator()<true>(n_full);
  }
  store_sums<R, T>(acc, out);
}

// The activations' codes in the order tile_q4k reads them: per 128 values of each row of X, the 64 its low
// nibbles meet (values 0-31 and 64-95) and then the 64 its high nibbles meet (32-63 and 96-127).
LT inline void q4k_activations(const Int8Form& x, int64_t t0, int64_t t1, std::vector<int8_t>& xp) {
  const int64_t K = x.n_in;
  xp.resize(size_t((t1 - t0) * K));
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < K; c += 128) {
      const int8_t* src = x.q.data() + t * K + c;
      int8_t* dst = xp.data() + (t - t0) * K + c;
      const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 64);
      _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(a, b, 0x44));
      _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(a, b, 0xee));
    }
}

// tile_k for q4_K on 512-bit vectors, a block's 128 code bytes in two 64-byte loads. Bytes 0-31 of a load hold
// groups 4p and 4p + 1 of the block (low and high nibbles), bytes 32-63 groups 4p + 2 and 4p + 3 (p = 0, 1: which
// load), so its low nibbles against the activations' values of groups 4p and 4p + 2, and its high nibbles
// against 4p + 1 and 4p + 3 (q4k_activations' order), are two dot products whose lanes 0-7 and 8-15 each belong
// to one group. Each is scaled by its two groups' products (scale times the activations' d, one permute of the
// block's eight). Per 128 values and row: a load, three mask/shift ops, two dot products, two converts, two FMAs,
// where tile_k took four decodes of 32 codes, two inserts, two permutes, two converts and two FMAs. A block's
// scales and offsets come straight into registers (Codes::block_scales8), its offsets against the activations'
// group sums in eight lanes beside. q5_K too: its fifth bits (bit u of qh[l] for value l of group u) come from
// qh broadcast to both 256-bit halves, a per-half shift count bringing each group's bit to bit 4.
// xp: q4k_activations' codes of row t0 of X (then t0 + 1 ...). ahead: as tile_q4's.
template <class D, TensorType TT, int R, int T>
LT void tile_q4k(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, const int8_t* xp, float* out,
                 int64_t ahead) {
  static_assert(TT == TensorType::Q4_K || TT == TensorType::Q5_K);
  using Cd = Codes<TT>;
  constexpr int64_t bb = Cd::bb;
  constexpr bool q5 = TT == TensorType::Q5_K;
  constexpr int64_t qs = q5 ? 48 : 16;  // where the codes' low four bits start
  const int64_t K = x.n_in, nb = K / 256, ng = K / 32;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][T];
  __m256 acc_off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps(), acc_off[r][t] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15);
  // lanes 0-7 and 8-15: the groups of the low (lo) and high (hi) nibbles of load p
  const __m512i lo0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i hi0 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4);
  const __m512i lo1 = _mm512_add_epi32(lo0, four), hi1 = _mm512_add_epi32(hi0, four);
  // q5_K: the word shifts that bring bit u of qh to bit 4, for the groups u of lo0, hi0 (left) and lo1, hi1 (right)
  const __m512i up_l0 = word_halves(4, 2), up_h0 = word_halves(3, 1);
  const __m512i down_l1 = word_halves(0, 2), down_h1 = word_halves(1, 3);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  const RowsAhead pf(w, ahead, R, nb);
  for (int64_t b = 0; b < nb; ++b) {
    pf.step(b);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * bb;
      __m256 sc, off;
      Cd::block_scales8(blk, sc, off);
      const __m512i v0 = _mm512_loadu_si512(blk + qs), v1 = _mm512_loadu_si512(blk + qs + 64);
      __m512i l0, h0, l1, h1;
      if constexpr (q5) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
        const auto with = [&](__m512i nib, __m512i bit) LT {
          return _mm512_ternarylogic_epi32(nib, m4, _mm512_and_si512(bit, m10), 0xea);  // (nib & 15) | bit
        };
        l0 = with(v0, _mm512_sllv_epi16(q, up_l0));
        h0 = with(_mm512_srli_epi16(v0, 4), _mm512_sllv_epi16(q, up_h0));
        l1 = with(v1, _mm512_srlv_epi16(q, down_l1));
        h1 = with(_mm512_srli_epi16(v1, 4), _mm512_srlv_epi16(q, down_h1));
      } else {
        l0 = _mm512_and_si512(v0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
        l1 = _mm512_and_si512(v1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
      }
      for (int t = 0; t < T; ++t) {
        const int64_t xo = (t0 + t) * ng + 8 * b;
        const __m512 c = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(x.d.data() + xo)));
        acc_off[r][t] = _mm256_fmadd_ps(off, _mm256_loadu_ps(x.s32.data() + xo), acc_off[r][t]);
        const int8_t* xb = xp + t * K + 256 * b;
        const __m512i z = _mm512_setzero_si512();
        __m512 a = acc[r][t];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, l0, _mm512_loadu_si512(xb))), _mm512_permutexvar_ps(lo0, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, h0, _mm512_loadu_si512(xb + 64))), _mm512_permutexvar_ps(hi0, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, l1, _mm512_loadu_si512(xb + 128))), _mm512_permutexvar_ps(lo1, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, h1, _mm512_loadu_si512(xb + 192))), _mm512_permutexvar_ps(hi1, c), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_zextps256_ps512(acc_off[r][t]));
  store_sums<R, T>(acc, out);
}

// tile_k for q6_K on 512-bit vectors, as tile_q4k. Half h of a block (values 128h .. 128h + 127) is one 64-byte
// load of ql (its low nibbles are values 0-63 of the half, its high nibbles 64-127, both in the activations'
// own order) and 32 bytes of qh, broadcast to both 256-bit halves, that give the codes' bits 4 and 5: bits 0-1
// for values 0-31, 2-3 for 32-63, 4-5 for 64-95, 6-7 for 96-127, each shifted into place by a per-half shift
// count. Lanes 4m .. 4m + 3 of a dot product belong to group m of its 64 values (groups of 16).
template <class D, int R, int T>
LT void tile_q6k(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, float* out, int64_t ahead) {
  constexpr int64_t bb = Codes<TensorType::Q6_K>::bb;
  const int64_t K = x.n_in, nb = K / 256, n32 = K / 32, n16 = K / 16;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][T], acc_off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps(), acc_off[r][t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  // words of the 256-bit halves: bits 0-1 (2-3) up to 4-5 for the low nibbles, bits 4-5 (6-7) for the high
  const __m512i up_lo = word_halves(4, 2), down_hi = word_halves(0, 2);
  // the groups of 16 of each lane, for the low (values 0-63) and high (64-127) nibbles of half 0; +8 for half 1
  const __m512i g_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4), eight = _mm512_set1_epi32(8);
  const __m512i g[4] = {g_lo, _mm512_add_epi32(g_lo, four), _mm512_add_epi32(g_lo, eight),
                        _mm512_add_epi32(g_lo, _mm512_add_epi32(four, eight))};
  // group m of 16 has the activations' d of block m / 2
  const __m512i d_of_group = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const RowsAhead pf(w, ahead, R, nb);
  for (int64_t b = 0; b < nb; ++b) {
    pf.step(b);
    __m512 dx[T];
    for (int t = 0; t < T; ++t)
      dx[t] = _mm512_permutexvar_ps(d_of_group, _mm512_castps256_ps512(_mm256_loadu_ps(x.d.data() + (t0 + t) * n32 + 8 * b)));
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * bb;
      uint16_t dh;
      std::memcpy(&dh, blk + 208, 2);
      const __m512 sc = _mm512_mul_ps(
          _mm512_set1_ps(_cvtsh_ss(dh)),
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
      const __m512 off = _mm512_mul_ps(_mm512_set1_ps(-32.0f), sc);
      __m512i code[4];  // half 0 low, half 0 high, half 1 low, half 1 high
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * h);
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
        const __m512i t_lo = _mm512_and_si512(_mm512_sllv_epi16(q, up_lo), m30);
        const __m512i t_hi = _mm512_and_si512(_mm512_srlv_epi16(q, down_hi), m30);
        code[2 * h] = _mm512_ternarylogic_epi32(v, m4, t_lo, 0xea);  // (v & 15) | t_lo
        code[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, t_hi, 0xea);
      }
      for (int t = 0; t < T; ++t) {
        const __m512 c = _mm512_mul_ps(sc, dx[t]);
        acc_off[r][t] = _mm512_fmadd_ps(off, _mm512_loadu_ps(x.s16.data() + (t0 + t) * n16 + 16 * b), acc_off[r][t]);
        const int8_t* xb = x.q.data() + (t0 + t) * K + 256 * b;
        const __m512i z = _mm512_setzero_si512();
        __m512 a = acc[r][t];
        for (int k = 0; k < 4; ++k)
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, code[k], _mm512_loadu_si512(xb + 64 * k))),
                              _mm512_permutexvar_ps(g[k], c), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], acc_off[r][t]);
  store_sums<R, T>(acc, out);
}
#endif

// out[r * T + t] = row i + r of W . row t0 + t of X (natural layout), for R rows and T rows of X, the codes
// decoded straight into registers. First, per row, its scales and offsets; per (r, t), scale[g] * d[block of g]
// for every group (comb) and the offsets against the activations' group sums (as a vector). Then per chunk of
// codes each lane picks its group's product from comb with one permute (groups come in windows of L).
// ahead: as tile_q4's.
template <class V, class D, class Cd, int R, int T>
LT void tile_k(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, float* out, int64_t ahead) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int L = V::L, C = 4 * L, G = Cd::G;
  constexpr int CW = L * G / C;  // chunks per window of L groups
  const int64_t K = x.n_in, nb = K / 32, n_groups = K / G, n_units = K / 32;
  const int64_t gp = (n_groups + L - 1) / L * L, n_chunks = (K + C - 1) / C;
  const float* s_base = G == 16 ? x.s16.data() : x.s32.data();
  // A row's scales and offsets take gs floats: its gp groups and L of slack, so that one vector store zeroes
  // groups n_groups .. gp - 1 (fewer than L) without a loop.
  const int64_t gs = gp + L;
  thread_local std::vector<float> buf;
  buf.resize(size_t(2 * R * gs + R * T * gp + 16));
  float* sc = buf.data();          // (R, gs)
  float* off = sc + R * gs;        // (R, gs)
  float* comb = off + R * gs;      // (R, T, gp)
  const uint8_t* row[R];
  const uint8_t* limit = w.data + w.bytes();  // the matrix's end
  for (int r = 0; r < R; ++r) {
    row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
    Cd::scales(row[r], 0, n_groups, sc + r * gs, off + r * gs);
    V::storef(sc + r * gs + n_groups, V::fzero());
    V::storef(off + r * gs + n_groups, V::fzero());
  }
  F acc[R][T];
  for (int t = 0; t < T; ++t) {
    // past the row's last group these read the next row's numbers (or the buffer's zero slack): times 0
    const float* d = x.d.data() + (t0 + t) * nb;
    const float* sg = s_base + (t0 + t) * n_groups;
    for (int r = 0; r < R; ++r) {
      F o = V::fzero();
      for (int64_t g = 0; g < gp; g += L) {
        V::storef(comb + (r * T + t) * gp + g, V::mul(V::loadf(sc + r * gs + g), V::template group_d<G>(d + g * G / 32)));
        o = V::fma(V::loadf(off + r * gs + g), V::loadf(sg + g), o);
      }
      acc[r][t] = o;
    }
  }
  const RowsAhead pf(w, ahead, R, n_chunks);
  const auto chunk = [&]<bool kChecked>(int64_t c) LT {
    pf.step(c);
    const int64_t window = c / CW * L;
    const int j = int(c % CW);
    const I idx = V::template chunk_groups<G>(j);
    I wv[R];
    for (int r = 0; r < R; ++r) wv[r] = chunk_codes<V, Cd, kChecked>(row[r], c, n_units, limit);
    I wa[R];
    if constexpr (Cd::is_signed)
      for (int r = 0; r < R; ++r) wa[r] = V::abs8(wv[r]);
    for (int t = 0; t < T; ++t) {
      const I xv = V::load(x.q.data() + (t0 + t) * K + c * C);
      for (int r = 0; r < R; ++r) {
        I s;
        if constexpr (Cd::is_signed) s = D::dot(V::izero(), wa[r], V::sign8(xv, wv[r]));
        else s = D::dot(V::izero(), wv[r], xv);
        acc[r][t] = V::fma(V::cvt(s), V::permute(idx, comb + (r * T + t) * gp + window), acc[r][t]);
      }
    }
  };
  // The chunks every row reads whole without a bounds check, then the rest (a row's odd last unit, or the loads
  // that would pass the matrix's end) with checks. Checking every chunk cost ~12% of this product's time (one
  // thread, 1024 x 576 q4_1 in L2, 1 row of X: 33.4 -> 29.4 ns per row).
  const int64_t n_fast = fast_chunk_count<V, Cd>(row[R - 1], n_units, n_chunks, limit);
  int64_t c = 0;
  for (; c < n_fast; ++c) chunk.template operator()<false>(c);
  for (; c < n_chunks; ++c) chunk.template operator()<true>(c);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * T + t] = V::hsum(acc[r][t]);
}

// --- the int8 product, by lanes of X -----------------------------------------------------------------------

// out[r * TV * L + j] = row r of the panel . row t0 + j of X (lane layout), j < TV * L. Kept out of line, as GCC
// compiled it before rows_typed grew its staged stores (which made GCC inline it); the timings in docs/study.md
// are of this code.
template <class V, class D, int G, int R, int TV, bool kSigned>
LT __attribute__((noinline)) void tile_x(const Panel& p, const Int8Form& x, int64_t t0, float* out) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int L = V::L;
  const int64_t K = x.n_in, n_groups = K / G, n_pad = x.n_pad;
  const float* s_base = G == 16 ? x.s16.data() : x.s32.data();
  F acc[R][TV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < TV; ++v) acc[r][v] = V::fzero();
  for (int64_t g = 0; g < n_groups; ++g) {
    I ia[R][TV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < TV; ++v) ia[r][v] = V::izero();
    const int8_t* xg = x.q.data() + ((g * G / 4) * n_pad + t0) * 4;
    for (int k4 = 0; k4 < G / 4; ++k4) {
      I xv[TV];
      for (int v = 0; v < TV; ++v) xv[v] = V::load(xg + (k4 * n_pad + v * L) * 4);
      for (int r = 0; r < R; ++r) {
        const I wb = V::bcast32(p.code + r * p.k_pad + g * G + 4 * k4);
        if constexpr (kSigned) {
          const I wa = V::abs8(wb);
          for (int v = 0; v < TV; ++v) ia[r][v] = D::dot(ia[r][v], wa, V::sign8(xv[v], wb));
        } else {
          for (int v = 0; v < TV; ++v) ia[r][v] = D::dot(ia[r][v], wb, xv[v]);
        }
      }
    }
    const float* dg = x.d.data() + (g * G / 32) * n_pad + t0;
    const float* sg = s_base + g * n_pad + t0;
    for (int v = 0; v < TV; ++v) {
      const F dv = V::loadf(dg + v * L), sv = V::loadf(sg + v * L);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = V::fma(V::cvt(ia[r][v]), V::mul(V::bcastf(p.sc + r * p.g_pad + g), dv), acc[r][v]);
        acc[r][v] = V::fma(V::bcastf(p.off + r * p.g_pad + g), sv, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < TV; ++v) V::storef(out + r * TV * L + v * L, acc[r][v]);
}

#if CASCADE_LINEAR_512
// tile_x for 4-8 rows of X (lanes-8 form) on 512-bit vectors: lane 2t + h holds row t of X and the codes of its
// k4 units 2m + h, so that a 64-bit broadcast of a weight row's 8 codes at k = 8m meets two units of every row
// of X in one dot product, and its two halves, both in the same group (G/4 units of 4 values are even), take
// the same scale; they are added once at the end. Per group and weight row: G/8 dot products and one scaling
// (convert, scale, FMA, offset FMA), where tile_x on 8 lanes takes G/4 and the same scaling: the scaling is per
// weight row and group, whatever the lanes hold. The offsets (q4_1, K-quants) go into lanes h = 0 only.
// out[r * 8 + t] as tile_x<V256, D, G, R, 1>.
template <class D, int G, int R>
LT __attribute__((noinline)) void tile_x8h(const Panel& p, const Int8Form& x, int64_t t0, float* out) {
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
#endif

// How many consecutive rows of Y (n_out floats each) fall in different sets of a 64-set L1 cache of 64-byte
// lines (Zen 4, and Intel's 48 KiB L1 alike): 64 when rows are not a whole number of lines apart.
inline int64_t y_set_period(int64_t n_out) {
  const int64_t bytes = n_out * int64_t(sizeof(float));
  if (bytes % 64 != 0) return 64;
  return 64 / std::gcd<int64_t>(bytes / 64, 64);
}

// --- whole row ranges ------------------------------------------------------------------------------------

// A shape a path runs: R rows by lanes of K with vector VK and dot DK (x.lanes == 0), or RX rows by lanes of X
// with vector VX and dot DX (x.lanes == VX::L), at most TVX vectors of X rows at once.
// X8H: 8 lanes of X (VX::L == 8, TVX 1) run as tile_x8h, on 512-bit vectors with DX, a 512-bit dot product.
template <class VK, class DK, int RK, class VX, class DX, int RX, int TVX, bool X8H = false>
struct Shape {
  using KV = VK;
  using KD = DK;
  using XV = VX;
  using XD = DX;
  static constexpr int rk = RK, rx = RX, tvx = TVX;
  static constexpr bool x8h = X8H;
};

// Panels (or tiles of rows, by lanes of K) asked for ahead of the one being multiplied. Without it the first load
// of each panel waits for memory: the weights stream from DRAM once per step, and a panel (8 rows of 576 q4_1
// values, 2,880 bytes) is too short a run for the hardware prefetcher to get ahead of. 8 rows of X, one thread,
// SmolLM2's layers: 21.0 -> 18.1-19.3 ms for 2 to 16 panels ahead (prefetching into L1 instead was slower).
// 1 row of X, two threads, SmolLM2's lm_head from DRAM, 4 tiles of 4 rows ahead (with the unchecked chunks of
// tile_k; builds alternated, 3 rounds): q4_1 8.7-11.1 -> 10.0-16.1 GB/s, q8_0 10.6-12.1 -> 14.1-16.2 GB/s.
// Both ask for them a few lines per step of their loops (RowsAhead).
inline constexpr int64_t kAhead = 4;

template <class S, TensorType T, bool kSigned>
LT void rows_typed(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  using Cd = Codes<T, kSigned>;
  constexpr int G = Cd::G;
  constexpr int L = S::XV::L;
  alignas(64) float out[std::max(S::rx * S::tvx * L, S::rk * 3)];
  if (x.lanes == 0) {
    // few rows of X: codes straight into registers, R weight rows at a time
    constexpr int R = S::rk;
#if CASCADE_LINEAR_512
    constexpr bool q4 = (T == TensorType::Q4_0 || T == TensorType::Q4_1) && S::KV::L == 16;
    thread_local std::vector<float> comb;  // tile_q4's scratch, taken once per call rather than per tile
    if constexpr (q4) comb.resize(size_t(q4_comb_floats(R * 3, w.n_in)));
    constexpr bool q4k = (T == TensorType::Q4_K || T == TensorType::Q5_K) && S::KV::L == 16;
    thread_local std::vector<int8_t> xp;  // tile_q4k's activations
    if constexpr (q4k) q4k_activations(x, t0, t1, xp);
#endif
    const auto tile = [&]<int NT>(int64_t i, int64_t t) LT {
      // the tile kAhead ahead is asked for during the first tile of rows of X
      const int64_t ahead = t == t0 ? i + kAhead * R : w.n_out;
#if CASCADE_LINEAR_512
      if constexpr (q4)
        tile_q4<typename S::KD, Cd, R, NT>(w, i, x, t, out, comb.data(), ahead);
      else if constexpr (q4k)
        tile_q4k<typename S::KD, T, R, NT>(w, i, x, t, xp.data() + (t - t0) * w.n_in, out, ahead);
      else if constexpr (T == TensorType::Q6_K && S::KV::L == 16)
        tile_q6k<typename S::KD, R, NT>(w, i, x, t, out, ahead);
      else
#endif
        tile_k<typename S::KV, typename S::KD, Cd, R, NT>(w, i, x, t, out, ahead);
    };
    for (int64_t i = i0; i < i1; i += R) {
      const int n_rows = int(std::min<int64_t>(R, i1 - i));
      for (int64_t t = t0; t < t1;) {
        const int nt = int(std::min<int64_t>(3, t1 - t));
        switch (nt) {
          case 3: tile.template operator()<3>(i, t); break;
          case 2: tile.template operator()<2>(i, t); break;
          default: tile.template operator()<1>(i, t); break;
        }
        for (int r = 0; r < n_rows; ++r)
          for (int j = 0; j < nt; ++j) y[(t + j) * w.n_out + i + r] = out[r * nt + j];
        t += nt;
      }
    }
    return;
  }
  // more rows of X: R weight rows decoded into a panel once, then every vector of X rows against it. t0 is a
  // multiple of L (linear.cpp splits rows of X in blocks of 16), so a vector never reads past n_pad.
  // Rows of Y a multiple of 4 KiB apart (lm_head's 49152 floats; 2048 or 8192 outputs) fall in one set of the
  // L1 cache, so a panel storing one float into each of more rows of X than the cache has ways (8) evicts its
  // own lines. Then results go through `stage`, (t1 - t0) rows of kStage outputs, copied to Y a whole run of
  // kStage outputs per row of X; otherwise straight into Y. (SmolLM2's lm_head at 32 rows of X: 1.35x.)
  constexpr int R = S::rx;
  constexpr int64_t kStage = 32;
  static_assert(kStage % R == 0);
  const bool staged = t1 - t0 > 8 * y_set_period(w.n_out);
  thread_local Panel p;
  thread_local std::vector<float> stage;
  p.reserve(R, w.n_in, G);
  if (staged) stage.resize(size_t((t1 - t0) * kStage));
  for (int64_t ic = i0; ic < i1; ic += kStage) {
    const int64_t ie = std::min(i1, ic + kStage);
    for (int64_t i = ic; i < ie; i += R) {
      decode_panel<Cd>(w, i, R, p, i + kAhead * R);
      const int n_rows = int(std::min<int64_t>(R, ie - i));
      for (int64_t t = t0; t < t1;) {
        const int tv = S::tvx > 1 && t1 - t > L ? 2 : 1;
        if constexpr (S::tvx > 1) {
          if (tv == 2) tile_x<typename S::XV, typename S::XD, G, R, 2, kSigned>(p, x, t, out);
          else tile_x<typename S::XV, typename S::XD, G, R, 1, kSigned>(p, x, t, out);
#if CASCADE_LINEAR_512
        } else if constexpr (S::x8h) {
          static_assert(!kSigned && S::XV::L == 8);
          tile_x8h<typename S::XD, G, R>(p, x, t, out);
#endif
        } else {
          tile_x<typename S::XV, typename S::XD, G, R, 1, kSigned>(p, x, t, out);
        }
        const int nt = int(std::min<int64_t>(tv * L, t1 - t));
        if (staged) {
          float* st = stage.data() + (t - t0) * kStage + (i - ic);
          for (int j = 0; j < nt; ++j)
            for (int r = 0; r < n_rows; ++r) st[j * kStage + r] = out[r * tv * L + j];
        } else {
          for (int r = 0; r < n_rows; ++r)
            for (int j = 0; j < nt; ++j) y[(t + j) * w.n_out + i + r] = out[r * tv * L + j];
        }
        t += nt;
      }
    }
    if (staged)
      for (int64_t t = t0; t < t1; ++t)
        std::memcpy(y + t * w.n_out + ic, stage.data() + (t - t0) * kStage, size_t(ie - ic) * sizeof(float));
  }
}

// --- quantizing X ----------------------------------------------------------------------------------------

LT inline int hsum_epi32(__m256i s) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// One block of 32 values: codes into q32, and d, the sums of each half and of the whole (as quantize_row).
LT inline void quantize_block(const float* x, int8_t* q32, float& d, float& s_lo, float& s_hi, float& s_all) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], a = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float amax = _mm_cvtss_f32(m);
  d = amax / 127.0f;
  const bool tiny = amax < kTinyBlock;  // scaled first, as quantize_row does
  const __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / (tiny ? amax * kTinyScale : amax) : 0.0f);
  if (tiny)
    for (int j = 0; j < 4; ++j) v[j] = _mm256_mul_ps(v[j], _mm256_set1_ps(kTinyScale));
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], id), lo), hi));
  const int sum_lo = hsum_epi32(_mm256_add_epi32(c[0], c[1])), sum_hi = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
  s_lo = d * static_cast<float>(sum_lo);
  s_hi = d * static_cast<float>(sum_hi);
  s_all = d * static_cast<float>(sum_lo + sum_hi);
  // 32-bit -> 8-bit: packs interleave the 128-bit halves; the permute puts the values back in order
  const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q32), ordered);
}

// x (n, n_in) -> f in the layout of f.lanes (0: natural, else lanes).
LT void quantize_rows(const float* x, int64_t n, int64_t n_in, Int8Form& f) {
  const int lanes = f.lanes;
  f.n = n;
  f.n_in = n_in;
  f.n_pad = lanes > 0 ? (n + lanes - 1) / lanes * lanes : n;
  const int64_t np = f.n_pad, nb = n_in / 32;
  f.q.resize(size_t(np * n_in));
  f.d.resize(size_t(np * nb));
  f.s16.resize(size_t(np * nb * 2));
  f.s32.resize(size_t(np * nb));
  alignas(32) int8_t q32[32];
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float d, s_lo, s_hi, s_all;
      if (lanes == 0) {
        quantize_block(x + r * n_in + 32 * b, f.q.data() + r * n_in + 32 * b, d, s_lo, s_hi, s_all);
        f.d[r * nb + b] = d;
        f.s16[r * 2 * nb + 2 * b] = s_lo;
        f.s16[r * 2 * nb + 2 * b + 1] = s_hi;
        f.s32[r * nb + b] = s_all;
      } else {
        quantize_block(x + r * n_in + 32 * b, q32, d, s_lo, s_hi, s_all);
        for (int j = 0; j < 8; ++j) std::memcpy(f.q.data() + ((8 * b + j) * np + r) * 4, q32 + 4 * j, 4);
        f.d[b * np + r] = d;
        f.s16[2 * b * np + r] = s_lo;
        f.s16[(2 * b + 1) * np + r] = s_hi;
        f.s32[b * np + r] = s_all;
      }
    }
}

// --- float weights: F32, F16, BF16 against f32 activations ---------------------------------------------------

template <TensorType T>
LT inline __m256 load_w8(const uint8_t* p) {
  if constexpr (T == TensorType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  else if constexpr (T == TensorType::F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <TensorType T>
inline float w_at(const uint8_t* row, int64_t k) {
  if constexpr (T == TensorType::F32) {
    float v;
    std::memcpy(&v, row + 4 * k, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    return T == TensorType::F16 ? gguf::fp16_to_fp32(h) : gguf::bf16_to_fp32(h);
  }
}

// out[r * NT + t] = row i + r of W . row t0 + t of X, 8 values at a time (the tail of K one at a time). ahead:
// as tile_q4's.
template <TensorType T, int R, int NT>
LT void tile_float(const Matrix& w, int64_t i, const float* x, int64_t t0, float* out, int64_t ahead) {
  constexpr int64_t es = T == TensorType::F32 ? 4 : 2;
  const int64_t K = w.n_in;
  const RowsAhead pf(w, ahead, R, K / 8);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    pf.step(k / 8);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_w8<T>(row[r] + es * k);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + (t0 + t) * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = V256::hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += w_at<T>(row[r], kk) * x[(t0 + t) * K + kk];
      out[r * NT + t] = s;
    }
}

template <TensorType T, int R>
LT void rows_float_typed(const Matrix& w, const float* x, int64_t i0, int64_t i1, int64_t t0, int64_t t1,
                         float* y) {
  constexpr int NT = 4;
  float out[R * NT];
  for (int64_t i = i0; i < i1; i += R) {
    const int n_rows = int(std::min<int64_t>(R, i1 - i));
    for (int64_t t = t0; t < t1;) {
      const int nt = int(std::min<int64_t>(NT, t1 - t));
      const int64_t ahead = t == t0 ? i + kAhead * R : w.n_out;
      switch (nt) {
        case 4: tile_float<T, R, 4>(w, i, x, t, out, ahead); break;
        case 3: tile_float<T, R, 3>(w, i, x, t, out, ahead); break;
        case 2: tile_float<T, R, 2>(w, i, x, t, out, ahead); break;
        default: tile_float<T, R, 1>(w, i, x, t, out, ahead); break;
      }
      for (int r = 0; r < n_rows; ++r)
        for (int j = 0; j < nt; ++j) y[(t + j) * w.n_out + i + r] = out[r * nt + j];
      t += nt;
    }
  }
}

// Calls f.template operator()<T>() for the quantized type t.
template <class F>
void with_int8_type(TensorType t, F&& f) {
  switch (t) {
    case TensorType::Q4_0: return f.template operator()<TensorType::Q4_0>();
    case TensorType::Q4_1: return f.template operator()<TensorType::Q4_1>();
    case TensorType::Q8_0: return f.template operator()<TensorType::Q8_0>();
    case TensorType::Q4_K: return f.template operator()<TensorType::Q4_K>();
    case TensorType::Q5_K: return f.template operator()<TensorType::Q5_K>();
    case TensorType::Q6_K: return f.template operator()<TensorType::Q6_K>();
    default: return;
  }
}

}  // namespace
}  // namespace cascade::linear::detail
