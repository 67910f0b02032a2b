// The avx-vnni path of linear.hpp: the VEX vpdpbusd on 8 lanes (Alder Lake, Zen 5), F16C, FMA. The same
// templates as the avx2 path with one dot product changed (the avx512-vnni path has its own 512-bit forms:
// linear_avx512.cpp).
#if defined(__x86_64__) || defined(__i386__)
#define CASCADE_LINEAR_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define CASCADE_LINEAR_512 0
#include "model/linear_simd.hpp"

namespace cascade::linear::detail {
namespace {

struct DotVnniVex {
  LT static __m256i dot(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
};

using VnniShape = Shape<V256, DotVnniVex, 2, V256, DotVnniVex, 4, 1>;

int lanes(int64_t n) { return n <= 3 ? 0 : 8; }

LT void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) { quantize_rows(x, n, n_in, f); }

void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  with_int8_type(w.type, [&]<TensorType T>() { rows_typed<VnniShape, T, false>(w, x, i0, i1, t0, t1, y); });
}

void rows_float(const Matrix& w, const float* x, const uint16_t*, int64_t i0, int64_t i1, int64_t t0, int64_t t1,
                float* y) {
  switch (w.type) {
    case TensorType::F32: return rows_float_typed<TensorType::F32, 2>(w, x, i0, i1, t0, t1, y);
    case TensorType::F16: return rows_float_typed<TensorType::F16, 2>(w, x, i0, i1, t0, t1, y);
    case TensorType::BF16: return rows_float_typed<TensorType::BF16, 2>(w, x, i0, i1, t0, t1, y);
    default: return;
  }
}

}  // namespace

const Kernels* avx_vnni_kernels() {
  static const Kernels k{Path::avx_vnni, 8, lanes, quantize, rows_int8, rows_float, false};
  return &k;
}

}  // namespace cascade::linear::detail
#else
#include "model/linear_kernels.hpp"
namespace cascade::linear::detail {
const Kernels* avx_vnni_kernels() { return nullptr; }
}  // namespace cascade::linear::detail
#endif
