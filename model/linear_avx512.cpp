// The avx512-vnni tier of the linear kernels (linear_kernels.hpp), its entry points: vpdpbusd on 16 lanes by lanes
// of K (tile_q4, tile_q4k, tile_q6k, tile_k on 64-code chunks) and for more than 8 rows of X, and for 4 to 8 rows
// on 8 lanes of X whose halves take two units of 4 codes each (tile_x8h); F16C; vdpbf16ps for BF16 weights where
// the CPU has AVX512_BF16.
#include "model/linear_avx512_k.hpp"
#include "model/linear_avx512_x.hpp"

#include <type_traits>

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {
namespace {

// A products policy (linear_float.inc) for BF16 weights against bf16 activations: 32 pairs of products per
// vdpbf16ps.
struct Bf16Dot {
  using X = uint16_t;
  using W = __m512i;
  using Acc = __m512;
  static constexpr int64_t kStep = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static W load_w(const uint8_t* row, int64_t k) { return _mm512_loadu_si512(row + 2 * k); }
  static W load_x(const uint16_t* x) { return _mm512_loadu_si512(x); }
  static Acc madd(Acc acc, W w, W x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static float hsum(Acc a) { return _mm512_reduce_add_ps(a); }
  static float tail(float s, const uint8_t* row, const uint16_t* x, int64_t k) {
    return s + w_at<TensorType::BF16>(row, k) * gguf::bf16_to_fp32(x[k]);
  }
};

// The tile of weight type T by lanes of K: 4 weight rows on 512-bit vectors.
template <TensorType T>
using TileByK = std::conditional_t<
    T == TensorType::Q4_0 || T == TensorType::Q4_1, TileQ4<Codes64<T>, 4>,
    std::conditional_t<T == TensorType::Q4_K || T == TensorType::Q5_K, TileQ4K<T, 4>,
                       std::conditional_t<T == TensorType::Q6_K, TileQ6K<4>, TileK<V512, Dot, Codes64<T>, 4>>>>;

}  // namespace

// 1-3 rows of X by lanes of K, 4-8 on 8 lanes of X (tile_x8h), more on 16.
int int8_lanes(int64_t n) { return n <= 3 ? 0 : n <= 8 ? 8 : 16; }

void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) { quantize_rows(x, n, n_in, f); }

template <TensorType T>
void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  if (x.lanes == 0) rows_by_k<TileByK<T>>(w, x, i0, i1, t0, t1, y);
  else if (x.lanes == 8) rows_by_x<TileX8h<T>>(w, x, i0, i1, t0, t1, y);
  else rows_by_x<TileX16<T>>(w, x, i0, i1, t0, t1, y);
}

template <TensorType T>
void rows_float(const Matrix& w, const float* x, const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0, int64_t t1,
                float* y) {
  if constexpr (T == TensorType::BF16)
    if (xb) return rows_dot<Bf16Dot, 4>(w, xb, i0, i1, t0, t1, y);
  rows_dot<FmaDot<T>, 4>(w, x, i0, i1, t0, t1, y);
}

CASCADE_LINEAR_TIER_TEMPLATES(template)

}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
