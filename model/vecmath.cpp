#include "cascade/simd.hpp"  // before anything else that includes the intrinsics

#include "model/vecmath.hpp"

#include <algorithm>
#include <cmath>

namespace cascade::vecmath {
namespace {

constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kMin = -126.0f;                 // exp2's smallest exponent: 2^-126 is the smallest normal float
constexpr float kGelu2K = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
// exp2's polynomial on [-1/2, 1/2], highest degree first; the constant term is exactly 1.
constexpr float kP[6] = {0.00133087611f, 0.00967151803f, 0.0555058268f, 0.24022242f, 0.693147092f, 1.0f};

// ---- portable (and every tier's tail) ----------------------------------------------------------------------

float exp2_scalar(float x) {
  if (!(x >= kMin)) return 0.0f;      // below 2^-126, and NaN
  const float n = std::nearbyint(x);  // to nearest, ties to even: the vector tiers' rounding
  const float f = x - n;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, f, kP[i]);
  return std::ldexp(p, int(n));
}

float sigmoid_scalar(float z) {
  const float t = exp2_scalar(-std::fabs(z) * kLog2e);
  return (z >= 0.0f ? 1.0f : t) / (1.0f + t);
}

float silu_scalar(float x) { return x * sigmoid_scalar(x); }
float gelu_scalar(float x) { return x * sigmoid_scalar((x * kGelu2K) * std::fma(x * x, kGeluC, 1.0f)); }

float weight_scalar(float x, float mx, float scale, float floor) {
  const float w = exp2_scalar((x - mx) * scale);
  return w >= floor ? w : 0.0f;
}

template <float (*F)(float)>
void gated_portable(float* g, const float* u, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) g[i] = F(g[i]) * u[i];
}

}  // namespace

float exp2_neg(float x) { return exp2_scalar(x); }
float sigmoid(float z) { return sigmoid_scalar(z); }

}  // namespace cascade::vecmath

#if CASCADE_X86
// ---- AVX2 + FMA: 8 lanes ---------------------------------------------------------------------------------------
CASCADE_TARGET_AVX2_BEGIN
namespace cascade::vecmath::avx2 {
namespace {

inline __m256 exp2v(__m256 x0) {
  const __m256 x = _mm256_max_ps(x0, _mm256_set1_ps(kMin));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP[i]));
  // 2^n in the exponent field (n >= -126: a normal number), an exact product.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_cmp_ps(x0, _mm256_set1_ps(kMin), _CMP_GE_OQ));
}

inline __m256 sigmoidv(__m256 z) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 t = exp2v(_mm256_mul_ps(_mm256_xor_ps(_mm256_and_ps(z, abs_mask), _mm256_set1_ps(-0.0f)),
                                       _mm256_set1_ps(kLog2e)));
  const __m256 num = _mm256_blendv_ps(t, _mm256_set1_ps(1.0f), _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

inline __m256 siluv(__m256 x) { return _mm256_mul_ps(x, sigmoidv(x)); }
inline __m256 geluv(__m256 x) {
  const __m256 poly = _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(kGeluC), _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(x, sigmoidv(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(kGelu2K)), poly)));
}

}  // namespace

template <__m256 (*F)(__m256), float (*S)(float)>
void gated(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, _mm256_mul_ps(F(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  for (; i < n; ++i) g[i] = S(g[i]) * u[i];
}
void silu_mul(float* g, const float* u, int64_t n) { gated<siluv, silu_scalar>(g, u, n); }
void gelu_mul(float* g, const float* u, int64_t n) { gated<geluv, gelu_scalar>(g, u, n); }

float max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = x[0];
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    m = *std::max_element(t, t + 8);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

void exp_weights(const float* x, int64_t n, float mx, float scale, float floor, float* w) {
  const __m256 vm = _mm256_set1_ps(mx), vs = _mm256_set1_ps(scale), vf = _mm256_set1_ps(floor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp2v(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vs));
    _mm256_storeu_ps(w + i, _mm256_and_ps(e, _mm256_cmp_ps(e, vf, _CMP_GE_OQ)));
  }
  for (; i < n; ++i) w[i] = weight_scalar(x[i], mx, scale, floor);
}

}  // namespace cascade::vecmath::avx2
CASCADE_TARGET_END

// ---- AVX-512: 16 lanes, masked tails ---------------------------------------------------------------------------
CASCADE_TARGET_AVX512_BEGIN
namespace cascade::vecmath::avx512 {
namespace {

inline __m512 exp2v(__m512 x0) {
  const __m512 x = _mm512_max_ps(x0, _mm512_set1_ps(kMin));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP[i]));
  // p 2^n, exact (n >= -126: a normal number); 0 below 2^-126 and for NaN
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(kMin), _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}

inline __m512 sigmoidv(__m512 z) {
  const __m512 t = exp2v(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)), _mm512_set1_ps(kLog2e)));
  const __mmask16 pos = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_div_ps(_mm512_mask_blend_ps(pos, t, _mm512_set1_ps(1.0f)), _mm512_add_ps(_mm512_set1_ps(1.0f), t));
}

inline __m512 siluv(__m512 x) { return _mm512_mul_ps(x, sigmoidv(x)); }
inline __m512 geluv(__m512 x) {
  const __m512 poly = _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(kGeluC), _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(x, sigmoidv(_mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(kGelu2K)), poly)));
}

inline __mmask16 tail_mask(int64_t left) { return __mmask16(left >= 16 ? 0xffff : (1u << left) - 1); }

}  // namespace

template <__m512 (*F)(__m512)>
void gated(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 y = _mm512_mul_ps(F(_mm512_maskz_loadu_ps(k, g + i)), _mm512_maskz_loadu_ps(k, u + i));
    _mm512_mask_storeu_ps(g + i, k, y);
  }
}
void silu_mul(float* g, const float* u, int64_t n) { gated<siluv>(g, u, n); }
void gelu_mul(float* g, const float* u, int64_t n) { gated<geluv>(g, u, n); }

float max(const float* x, int64_t n) {
  __m512 v = _mm512_set1_ps(x[0]);
  for (int64_t i = 0; i < n; i += 16) v = _mm512_max_ps(v, _mm512_mask_loadu_ps(v, tail_mask(n - i), x + i));
  return _mm512_reduce_max_ps(v);
}

void exp_weights(const float* x, int64_t n, float mx, float scale, float floor, float* w) {
  const __m512 vm = _mm512_set1_ps(mx), vs = _mm512_set1_ps(scale), vf = _mm512_set1_ps(floor);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 e = exp2v(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm), vs));
    _mm512_mask_storeu_ps(w + i, k, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, vf, _CMP_GE_OQ), e));
  }
}

}  // namespace cascade::vecmath::avx512
CASCADE_TARGET_END
#endif

namespace cascade::vecmath {

void silu_mul(float* g, const float* u, int64_t n) {
#if CASCADE_X86
  switch (active_isa()) {
    case Isa::avx512: return avx512::silu_mul(g, u, n);
    case Isa::avx2: return avx2::silu_mul(g, u, n);
    case Isa::portable: break;
  }
#endif
  gated_portable<silu_scalar>(g, u, 0, n);
}

void gelu_mul(float* g, const float* u, int64_t n) {
#if CASCADE_X86
  switch (active_isa()) {
    case Isa::avx512: return avx512::gelu_mul(g, u, n);
    case Isa::avx2: return avx2::gelu_mul(g, u, n);
    case Isa::portable: break;
  }
#endif
  gated_portable<gelu_scalar>(g, u, 0, n);
}

float max(const float* x, int64_t n) {
#if CASCADE_X86
  switch (active_isa()) {
    case Isa::avx512: return avx512::max(x, n);
    case Isa::avx2: return avx2::max(x, n);
    case Isa::portable: break;
  }
#endif
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

void exp_weights(const float* x, int64_t n, float mx, float scale, float floor, float* w) {
#if CASCADE_X86
  switch (active_isa()) {
    case Isa::avx512: return avx512::exp_weights(x, n, mx, scale, floor, w);
    case Isa::avx2: return avx2::exp_weights(x, n, mx, scale, floor, w);
    case Isa::portable: break;
  }
#endif
  for (int64_t i = 0; i < n; ++i) w[i] = weight_scalar(x[i], mx, scale, floor);
}

}  // namespace cascade::vecmath
