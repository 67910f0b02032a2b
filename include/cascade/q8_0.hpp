// q8_0, the 8-bit K/V element type: each block of 32 consecutive elements of a head's row is stored as 32 int8
// codes and one f16 scale d, element i = code_i * d. 34 bytes per 32 elements (1.0625 bytes an element), about
// half of f16's. Where the codes and scales of a view sit is kv.hpp's business; this header turns f32 rows into
// codes and scales and back.
//
// Quantizing a block: d = f16(max_i |x_i| / 127), code_i = round(x_i / d) to nearest (ties to even), clamped to
// [-127, 127]; an all-zero block gets d = 0 and zero codes. The codes are rounded against the stored (f16) scale,
// so |code_i * d - x_i| <= d / 2 for every element where d is a normal f16 (max |x| from 127 * 2^-14, about 7.8e-3,
// to f16's largest value times 127; below, the subnormal scale's coarser rounding can put max |x| / d past 127,
// and the clamped codes further off), and quantizing a block's dequantized values again gives the same codes and
// scale (d a normal f16). A block holding a NaN or an infinity
// gets d = NaN and zero codes: every element of it reads as NaN, as it would from an f16 cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"

namespace cascade {

// Elements per q8_0 block: a q8_0 view's head dim and strides are multiples of it.
inline constexpr int64_t kQ8Block = 32;

// codes[i], scales[i / 32] for x[i], i < n (n a multiple of kQ8Block).
inline void quantize_q8_0(const float* x, int64_t n, int8_t* codes, f16* scales) {
  CASCADE_CHECK(n % kQ8Block == 0, "quantize_q8_0: ", n, " values are not whole blocks of ", kQ8Block);
  for (int64_t b = 0; b < n; b += kQ8Block) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = b; i < b + kQ8Block; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::abs(x[i]));
    }
    if (!finite) {
      for (int64_t i = b; i < b + kQ8Block; ++i) codes[i] = 0;
      scales[b / kQ8Block] = f16(NAN);
      continue;
    }
    // The scale as stored, at most f16's largest finite value (a block beyond ~8.3e6 saturates its codes).
    const f16 d = f16(std::min(amax / 127.0f, 65504.0f));
    const float df = float(d);
    const float inv = df > 0.0f ? 1.0f / df : 0.0f;
    for (int64_t i = b; i < b + kQ8Block; ++i)
      codes[i] = int8_t(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
    scales[b / kQ8Block] = d;
  }
}

// y[i] = codes[i] * scales[i / 32], i < n (n a multiple of kQ8Block).
inline void dequantize_q8_0(const int8_t* codes, const f16* scales, int64_t n, float* y) {
  CASCADE_CHECK(n % kQ8Block == 0, "dequantize_q8_0: ", n, " values are not whole blocks of ", kQ8Block);
  for (int64_t b = 0; b < n; b += kQ8Block) {
    const float d = float(scales[b / kQ8Block]);
    for (int64_t i = b; i < b + kQ8Block; ++i) y[i] = float(codes[i]) * d;
  }
}

}  // namespace cascade
