// K/V element types and their conversion to f32. Queries, outputs and all arithmetic are f32;
// K/V may be stored as f32, f16 (IEEE half) or bf16 (upper 16 bits of an f32).
#pragma once

#include "cascade/simd.hpp"  // first: it brings in the intrinsics

#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "cascade/error.hpp"

namespace cascade {

using f16 = Eigen::half;
using bf16 = Eigen::bfloat16;
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

enum class DType : uint8_t { f32, f16, bf16 };
inline constexpr int kNumDTypes = 3;

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

inline constexpr int64_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

inline constexpr detail::Named<DType> kDTypeNames[] = {{DType::f32, "f32"}, {DType::f16, "f16"}, {DType::bf16, "bf16"}};
inline const char* dtype_name(DType t) { return detail::name_of(t, kDTypeNames); }
inline DType parse_dtype(std::string_view s) { return detail::parse_named(s, kDTypeNames, "K/V dtype"); }

inline float to_float(float x) { return x; }
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(Eigen::numext::bit_cast<uint16_t>(x)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// dst[i] = float(src[i]) for i < n. Vectorized for f16 (F16C) and bf16 (integer shift).
template <class T>
inline void convert_to_f32(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  } else if constexpr (std::is_same_v<T, f16>) {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  } else {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#endif
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// Calls f.template operator()<T>() with T the storage type of dt.
template <class F>
decltype(auto) dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<f16>();
    case DType::bf16: return f.template operator()<bf16>();
  }
  detail::fail("invalid K/V dtype ", static_cast<int>(dt));
}

}  // namespace cascade
