// The avx-vnni tier of the linear kernels (linear_kernels.hpp): the VEX vpdpbusd on 8 lanes (Alder Lake, Zen 5),
// F16C, FMA; the avx2 tier's kernels with its dot product changed (linear_lanes8.inc).
#include "model/linear_kernels.hpp"  // cascade/simd.hpp first

#include <cstring>
#include <utility>
#include <vector>

#include "model/quant.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX_VNNI_BEGIN
namespace cascade::linear::detail::avx_vnni {
namespace {

struct Dot {
  static __m256i dot(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
};
inline constexpr bool kSignedQ8 = false;  // vpdpbusd does not saturate

}  // namespace

#include "model/linear_lanes8.inc"

CASCADE_LINEAR_TIER_TEMPLATES(template)

}  // namespace cascade::linear::detail::avx_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
