// K/V element types and their conversion to f32. Queries, outputs and all arithmetic are f32;
// K/V may be stored as f32, f16 (IEEE half), bf16 (upper 16 bits of an f32) or q8_0: int8 codes with one f16
// scale per 32 elements of a head's row, element = code * scale (q8_0.hpp quantizes; kv.hpp says where the
// scales sit).
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

enum class DType : uint8_t { f32, f16, bf16, q8_0 };
inline constexpr int kNumDTypes = 4;

// The element dispatch_dtype names for q8_0 K/V: one int8 code as stored in the codes array. It converts to
// nothing on its own (its scale is elsewhere), so code written for the float types does not compile for it.
struct Q8Code {
  int8_t code;
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<Q8Code> { static constexpr DType value = DType::q8_0; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

// Bytes of one element of a view's K or V array as stored: for q8_0 its code (the scales are a second array).
inline constexpr int64_t dtype_size(DType t) { return t == DType::f32 ? 4 : t == DType::q8_0 ? 1 : 2; }

// Bytes an element takes in all: q8_0's code and its share of its block's f16 scale (34 bytes per 32).
inline constexpr double kv_element_bytes(DType t) { return t == DType::q8_0 ? 34.0 / 32.0 : double(dtype_size(t)); }

inline constexpr detail::Named<DType> kDTypeNames[] = {
    {DType::f32, "f32"}, {DType::f16, "f16"}, {DType::bf16, "bf16"}, {DType::q8_0, "q8_0"}};
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
    case DType::q8_0: return f.template operator()<Q8Code>();
  }
  detail::fail("invalid K/V dtype ", static_cast<int>(dt));
}

// dispatch_dtype over the float types alone, for arrays that are never q8_0 codes (queries, outputs, states).
template <class F>
decltype(auto) dispatch_float_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<f16>();
    case DType::bf16: return f.template operator()<bf16>();
    case DType::q8_0: break;
  }
  detail::fail("expected float elements (f32, f16 or bf16), got ", dtype_name(dt));
}

}  // namespace cascade
