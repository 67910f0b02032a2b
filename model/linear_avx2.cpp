// The avx2 path of linear.hpp: vpmaddubsw + vpmaddwd on 8 lanes (Haswell, Zen 1 and later), F16C, FMA.
#if defined(__x86_64__) || defined(__i386__)
#define CASCADE_LINEAR_TARGET __attribute__((target("avx2,fma,f16c")))
#define CASCADE_LINEAR_512 0
#include "model/linear_simd.hpp"

namespace cascade::linear::detail {
namespace {

// Pairs of u8 * s8 products saturate at 16 bits: codes stay <= 63 (2 * 63 * 127 < 2^15), and q8_0 goes through
// the sign trick (|w| * sign(x, w), 2 * 128 * 127 < 2^15).
struct DotMaddubs {
  LT static __m256i dot(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
  }
};

using Avx2Shape = Shape<V256, DotMaddubs, 2, V256, DotMaddubs, 4, 1>;

int lanes(int64_t n) { return n <= 3 ? 0 : 8; }

LT void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) { quantize_rows(x, n, n_in, f); }

void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  with_int8_type(w.type, [&]<TensorType T>() {
    rows_typed<Avx2Shape, T, T == TensorType::Q8_0>(w, x, i0, i1, t0, t1, y);
  });
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

const Kernels* avx2_kernels() {
  static const Kernels k{Path::avx2, 8, lanes, quantize, rows_int8, rows_float, false};
  return &k;
}

}  // namespace cascade::linear::detail
#else
#include "model/linear_kernels.hpp"
namespace cascade::linear::detail {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace cascade::linear::detail
#endif
