// The avx2 tier of the linear kernels (linear_kernels.hpp): vpmaddubsw + vpmaddwd on 8 lanes (Haswell, Zen 1 and
// later), F16C, FMA.
#include "model/linear_kernels.hpp"  // cascade/simd.hpp first

#include <cstring>
#include <utility>
#include <vector>

#include "model/quant.hpp"

#if CASCADE_X86
CASCADE_TARGET_AVX2_BEGIN
namespace cascade::linear::detail::avx2 {
namespace {

// Pairs of u8 * s8 products saturate at 16 bits: codes stay <= 63 (2 * 63 * 127 < 2^15), and q8_0 goes through
// the sign trick (|w| * sign(x, w), 2 * 128 * 127 < 2^15). pairs and widen split the product so that
// block16_words (linear_block16.inc) adds several pairs in 16 bits before widening them, as far as the codes'
// range allows (word_run).
struct Dot {
  static __m256i dot(__m256i acc, __m256i u8, __m256i s8) { return widen(acc, pairs(u8, s8)); }
  static __m256i pairs(__m256i u8, __m256i s8) { return _mm256_maddubs_epi16(u8, s8); }
  static __m256i widen(__m256i acc, __m256i w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi16(1))); }
};
inline constexpr bool kSignedQ8 = true;

}  // namespace

#include "model/linear_lanes8.inc"

CASCADE_LINEAR_TIER_TEMPLATES(template)

}  // namespace cascade::linear::detail::avx2
CASCADE_TARGET_END
#endif  // CASCADE_X86
