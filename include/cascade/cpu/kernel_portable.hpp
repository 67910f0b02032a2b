// The portable tier: the drivers and the f32 products policies (the AVX2 tier's, kernel_avx2.hpp) on a vector type
// of 8 plain floats, with no instruction-set intrinsics. It is the path of CPUs without AVX2 + FMA + F16C and of
// every CPU that is not x86 (AArch64 among them), where the compiler turns the lane loops into its own vectors.
// Being the same drivers, it has both kernel shapes (the few-rows one for head dims that are a multiple of 8) and
// the batch-invariant order: a row's (o, lse) has the same bits whatever the rows beside it and the kernel its pass
// takes, as on the other tiers (docs/serving.md, "Determinism").
//
// fmadd is a * b + c on the vectors: one rounding where the compiler contracts it into a fused multiply-add
// (AArch64, x86 with FMA), two where the target has none. Every kernel of the tier inlines that one expression, so
// they agree bit for bit; the bits differ from the AVX2 tier's, as tiers' do.
//
// Measured against the Eigen kernel this tier ran before (cascade-kernel-variants, one thread, an x86 build without
// -march=native, so SSE2 without FMA, 128-bit like NEON; the Intel Xeon of docs/study.md §29): the few-rows kernel
// (4 rows, 8 KV heads, 1,024 keys, head dim 64) 1.5x the time for f32 K/V and 1.4x for f16, the tiled one (96
// rows, 1,230 keys) 1.4x, which is the batch-invariant order's price on this tier. AArch64 was not measured.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cascade/cpu/kernel_common.hpp"

// GCC notes that a 32-byte vector argument would be passed differently with AVX enabled (-Wpsabi; for the unit as a
// whole too, which the project's CMake turns off): these functions are inline and never cross a library boundary.
// It also takes the arrays of reg that few_exact_pv_rows fills in unrolled loops for used before they are set (each
// is loaded before it is read).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace cascade::cpu::portable {

struct V {
  static constexpr int W = 8;
#if defined(__GNUC__)
  // GCC's and Clang's vector extension: the target's own registers (two of SSE or NEON), lane-wise operators.
  typedef float reg __attribute__((vector_size(32)));
  typedef int32_t ireg __attribute__((vector_size(32)));
#else
  struct reg {
    float v[W];
    float& operator[](int i) { return v[i]; }
    float operator[](int i) const { return v[i]; }
  };
#endif
  struct quad {  // sum4's result: four floats
    float v[4];
  };
  // p * 2^n as (p + p) * 2^(n - 1), 2^(n - 1) built in the exponent field (as the AVX2 tier does).
  static constexpr float kExp2Min = -126.0f;

  template <class F>
  CASCADE_ALWAYS_INLINE static reg map(F f) {
    reg r;
    CASCADE_UNROLL(8)
    for (int i = 0; i < W; ++i) r[i] = f(i);
    return r;
  }
  static reg zero() { return set1(0.0f); }
  static reg set1(float x) {
#if defined(__GNUC__)
    return reg{x, x, x, x, x, x, x, x};  // a splat (reg{} + x is built lane by lane through memory by GCC)
#else
    return map([&](int) { return x; });
#endif
  }
  static reg load(const float* p) {
    reg r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }
  static void store(float* p, reg a) { std::memcpy(p, &a, sizeof a); }
  static reg bcast(const float* p) { return set1(*p); }
#if defined(__GNUC__)
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  // One rounding where the target has a fused multiply-add (the compiler contracts the expression: AArch64, x86
  // with FMA), two elsewhere; every kernel of the tier inlines this same expression.
  static reg fmadd(reg a, reg b, reg c) { return a * b + c; }
  // fmadd on one lane: the same expression, so the same rounding.
  static float fma1(float a, float b, float c) { return fmadd(set1(a), set1(b), set1(c))[0]; }
  // As maxps: b where either is NaN or they compare equal.
  static reg max(reg a, reg b) { return a > b ? a : b; }
#else
  static reg add(reg a, reg b) {
    return map([&](int i) { return a[i] + b[i]; });
  }
  static reg sub(reg a, reg b) {
    return map([&](int i) { return a[i] - b[i]; });
  }
  static reg mul(reg a, reg b) {
    return map([&](int i) { return a[i] * b[i]; });
  }
  static reg fmadd(reg a, reg b, reg c) {
    return map([&](int i) { return std::fma(a[i], b[i], c[i]); });
  }
  static float fma1(float a, float b, float c) { return std::fma(a, b, c); }
  static reg max(reg a, reg b) {
    return map([&](int i) { return a[i] > b[i] ? a[i] : b[i]; });
  }
#endif
  // To nearest, ties to even, for |x| < 2^22 (the exponents exp2_neg takes lie in [-126, 0]).
  static reg round(reg x) {
    constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
    return sub(add(x, set1(kShift)), set1(kShift));
  }
#if defined(__GNUC__)
  using msk = ireg;  // all-ones lanes
  static reg ldexp(reg p, reg n) {
    const ireg e = (__builtin_convertvector(n, ireg) + 126) << 23;
    return (p + p) * reg(e);
  }
  static msk eq(reg a, reg b) { return a == b; }
  static bool all_eq(reg a, reg b) {
    const ireg m = a == b;
    bool all = true;
    for (int i = 0; i < W; ++i) all &= m[i] != 0;
    return all;
  }
  static reg select(msk m, reg if_set, reg if_clear) { return reg((m & ireg(if_set)) | (~m & ireg(if_clear))); }
  static msk mask_from_bits(uint32_t bits) {
    const ireg lane = {1, 2, 4, 8, 16, 32, 64, 128};
    const int32_t b = int32_t(bits);
    return (ireg{b, b, b, b, b, b, b, b} & lane) != 0;
  }
#else
  struct msk {
    bool v[W];
  };
  static reg ldexp(reg p, reg n) {
    return map([&](int i) {
      const float e = std::bit_cast<float>(uint32_t(int32_t(n[i]) + 126) << 23);
      return (p[i] + p[i]) * e;
    });
  }
  static msk eq(reg a, reg b) {
    msk m;
    for (int i = 0; i < W; ++i) m.v[i] = a[i] == b[i];
    return m;
  }
  static bool all_eq(reg a, reg b) {
    bool all = true;
    for (int i = 0; i < W; ++i) all &= a[i] == b[i];
    return all;
  }
  static reg select(msk m, reg if_set, reg if_clear) {
    return map([&](int i) { return m.v[i] ? if_set[i] : if_clear[i]; });
  }
  static msk mask_from_bits(uint32_t bits) {
    msk m;
    for (int i = 0; i < W; ++i) m.v[i] = (bits >> i & 1u) != 0;
    return m;
  }
#endif
  // Horizontal sum and max in the AVX2 tier's tree: halves, then quarters, then the last pair.
  static float hsum(reg a) {
    float x[4];
    for (int i = 0; i < 4; ++i) x[i] = a[i] + a[i + 4];
    const float y0 = x[0] + x[2], y1 = x[1] + x[3];
    return y0 + y1;
  }
  static float hmax(reg a) {
    float m = a[0];
    for (int i = 1; i < W; ++i) m = std::max(m, a[i]);
    return m;
  }
  // The horizontal sums of a0..a3.
  static quad sum4(reg a0, reg a1, reg a2, reg a3) { return {{hsum(a0), hsum(a1), hsum(a2), hsum(a3)}}; }
  static void store4(float* p, quad x) {
    for (int i = 0; i < 4; ++i) p[i] = x.v[i];
  }
  static void store_lo2(float* p, quad x) { p[0] = x.v[0], p[1] = x.v[1]; }
  static void store_hi2(float* p, quad x) { p[0] = x.v[2], p[1] = x.v[3]; }
  // Transposes 8 x 8 floats: lane c of r[i] becomes lane i of r[c].
  static void transpose(reg (&r)[8]) {
#if defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 12)
    // Three butterfly stages: rows s apart swap their blocks of s lanes (s = 1, 2, 4).
    const auto stage = [&]<int S>(auto lo, auto hi) {
      for (int i = 0; i < W; ++i)
        if ((i & S) == 0) {
          const reg a = r[i], b = r[i + S];
          r[i] = lo(a, b);
          r[i + S] = hi(a, b);
        }
    };
    stage.template operator()<1>([](reg a, reg b) { return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14); },
                                 [](reg a, reg b) { return __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15); });
    stage.template operator()<2>([](reg a, reg b) { return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13); },
                                 [](reg a, reg b) { return __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15); });
    stage.template operator()<4>([](reg a, reg b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11); },
                                 [](reg a, reg b) { return __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15); });
#else
    reg t[8];
    for (int i = 0; i < W; ++i)
      for (int c = 0; c < W; ++c) t[c][i] = r[i][c];
    for (int i = 0; i < W; ++i) r[i] = t[i];
#endif
  }
  // The f16 elements [0, 8) of n <= 8 rows (stride elements apart; rows past n read as 0) as f32 columns: lane j of
  // col[i] = element i of row j.
  static void f16_columns(const f16* p, int64_t stride, int64_t n, reg (&col)[8]) {
    for (int j = 0; j < 8; ++j) col[j] = j < n ? kv<f16>(p + j * stride) : zero();
    transpose(col);
  }
  // 8 int8 codes (q8_0 K/V) as f32.
  static reg q8(const int8_t* p) {
    return map([&](int i) { return float(p[i]); });
  }
  // One f16 as f32, exactly, without branches (so that the lane loops vectorize): normal numbers rebiased, subnormals
  // and zero as an integer times 2^-24, infinities and NaNs to the all-ones exponent.
  static float half(uint16_t bits) {
    const uint32_t em = bits & 0x7FFFu, sign = uint32_t(bits & 0x8000u) << 16;
    const uint32_t normal = (em << 13) + (112u << 23);
    const uint32_t tiny = std::bit_cast<uint32_t>(float(int32_t(em)) * 0x1p-24f);
    const uint32_t special = (em << 13) | 0x7F800000u;
    return std::bit_cast<float>((em < 0x400u ? tiny : em >= 0x7C00u ? special : normal) | sign);
  }
  template <class T>
  static reg kv(const T* p) {
    if constexpr (std::is_same_v<T, f16>) {
#if defined(__GNUC__)
      typedef uint16_t hreg __attribute__((vector_size(16)));
      hreg h;
      std::memcpy(&h, p, sizeof h);
      const ireg x = __builtin_convertvector(h, ireg), em = x & 0x7FFF, sign = (x & 0x8000) << 16;
      const ireg normal = (em << 13) + (112 << 23), special = (em << 13) | 0x7F800000;
      const ireg tiny = ireg(__builtin_convertvector(em, reg) * 0x1p-24f);  // the bits of em * 2^-24
      const ireg lo = em < 0x400, hi = em >= 0x7C00;  // lanes all ones where true
      return reg((lo & tiny) | (~lo & ((hi & special) | (~hi & normal))) | sign);
#else
      return map([&](int i) { return half(std::bit_cast<uint16_t>(p[i])); });
#endif
    } else {
      return map([&](int i) { return to_float(p[i]); });
    }
  }
  static void prefetch(const void* p, bool to_l1) {
#if defined(__GNUC__)
    if (to_l1) __builtin_prefetch(p, 0, 3);
    else __builtin_prefetch(p, 0, 2);
#else
    (void)p, (void)to_l1;
#endif
  }
};

#include "cascade/cpu/kernel_simd.inc"
#include "cascade/cpu/kernel_driver.inc"
#include "cascade/cpu/kernel_products_f32.inc"

// Row blocks of the tiled kernel: one register of 8 rows against 8 keys, as on the AVX2 tier.
inline constexpr int kTileRV = 1, kTileNK = 8;
static_assert(kTileNK == kTileStep, "the batch-invariant order steps the tiled kernel's keys");

}  // namespace cascade::cpu::portable

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
