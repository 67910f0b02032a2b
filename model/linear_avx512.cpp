// The avx512-vnni tier of the linear kernels (linear_kernels.hpp), its entry points: vpdpbusd on 16 output rows
// per vector (linear_block16.inc), rows of X 16 at a time on AMX tiles where the process may run them
// (linear_amx.hpp); F16C; vdpbf16ps for BF16 weights where the CPU has AVX512_BF16.
#include "model/linear_amx.hpp"

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

// Rows of X a tile of the vector kernel: eight rows' two chains and sums take 24 of the 32 registers.
inline constexpr int kTileRows = 8;

}  // namespace

void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) { quantize_rows(x, n, n_in, f); }

template <TensorType T>
void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y,
               Tiles tiles) {
#if defined(__x86_64__)
  if (tiles == Tiles::amx) return rows_amx<AmxTiles, T, kTileRows>(w, x, i0, i1, t0, t1, y);
#endif
  if (tiles == Tiles::amx_emulated) return rows_amx<AmxEmulated, T, kTileRows>(w, x, i0, i1, t0, t1, y);
  rows_block16<V512, Dot, T, false, kTileRows>(w, x, i0, i1, t0, t1, y);
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
