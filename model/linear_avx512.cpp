// The avx512-vnni path of linear.hpp (Ice Lake, Sapphire Rapids, Zen 4 and later): vpdpbusd on 16 lanes by lanes
// of K and for more than 8 rows of X, and for 4 to 8 rows on 8 lanes of X whose halves take two units of 4 codes
// each (tile_x8h); F16C; vdpbf16ps for BF16 weights where the CPU has AVX512_BF16.
#if defined(__x86_64__) || defined(__i386__)
#define CASCADE_LINEAR_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")))
#define CASCADE_LINEAR_512 1
#include "model/linear_simd.hpp"

namespace cascade::linear::detail {
namespace {

struct DotVnni512 {
  LT static __m512i dot(__m512i acc, __m512i u8, __m512i s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
};

// 8 lanes for 4-8 rows of X: 8 weight rows per panel keep 16 accumulators in the 32 registers; the 8 lanes'
// products run on 512-bit vpdpbusd (tile_x8h). SmolLM2's layers at 8 rows of X, two threads: q4_1 7.3-7.5 ->
// 6.2 ms; Llama-3.2-1B's at 8 rows: q4_0 27.1 -> 18.3 ms, q4_K 29.8 -> 22.9, q6_K 39.5 -> 28.5 (on 256-bit
// vpdpbusd before, tile_x on V256).
using Shape8 = Shape<V512, DotVnni512, 4, V256, DotVnni512, 8, 1, true>;
using Shape16 = Shape<V512, DotVnni512, 4, V512, DotVnni512, 4, 2>;

int lanes(int64_t n) { return n <= 3 ? 0 : n <= 8 ? 8 : 16; }

LT void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) { quantize_rows(x, n, n_in, f); }

void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  with_int8_type(w.type, [&]<TensorType T>() {
    if (x.lanes == 16) rows_typed<Shape16, T, false>(w, x, i0, i1, t0, t1, y);
    else rows_typed<Shape8, T, false>(w, x, i0, i1, t0, t1, y);
  });
}

// out[r * NT + t] = row i + r of W (bf16) . row t0 + t of xb (bf16), 32 pairs of products per instruction.
// ahead: as tile_q4's.
template <int R, int NT>
LT void tile_bf16(const Matrix& w, int64_t i, const uint16_t* xb, int64_t t0, float* out, int64_t ahead) {
  const int64_t K = w.n_in;
  const RowsAhead pf(w, ahead, R, K / 32);
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    pf.step(k / 32);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(row[r] + 2 * k);
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = _mm512_loadu_si512(xb + (t0 + t) * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = _mm512_reduce_add_ps(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk)
        s += w_at<TensorType::BF16>(row[r], kk) * gguf::bf16_to_fp32(xb[(t0 + t) * K + kk]);
      out[r * NT + t] = s;
    }
}

LT void rows_bf16(const Matrix& w, const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  constexpr int R = 4, NT = 4;
  float out[R * NT];
  for (int64_t i = i0; i < i1; i += R) {
    const int n_rows = int(std::min<int64_t>(R, i1 - i));
    for (int64_t t = t0; t < t1;) {
      const int nt = int(std::min<int64_t>(NT, t1 - t));
      const int64_t ahead = t == t0 ? i + kAhead * R : w.n_out;
      switch (nt) {
        case 4: tile_bf16<R, 4>(w, i, xb, t, out, ahead); break;
        case 3: tile_bf16<R, 3>(w, i, xb, t, out, ahead); break;
        case 2: tile_bf16<R, 2>(w, i, xb, t, out, ahead); break;
        default: tile_bf16<R, 1>(w, i, xb, t, out, ahead); break;
      }
      for (int r = 0; r < n_rows; ++r)
        for (int j = 0; j < nt; ++j) y[(t + j) * w.n_out + i + r] = out[r * nt + j];
      t += nt;
    }
  }
}

void rows_float(const Matrix& w, const float* x, const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0, int64_t t1,
                float* y) {
  switch (w.type) {
    case TensorType::F32: return rows_float_typed<TensorType::F32, 4>(w, x, i0, i1, t0, t1, y);
    case TensorType::F16: return rows_float_typed<TensorType::F16, 4>(w, x, i0, i1, t0, t1, y);
    case TensorType::BF16:
      if (xb) return rows_bf16(w, xb, i0, i1, t0, t1, y);
      return rows_float_typed<TensorType::BF16, 4>(w, x, i0, i1, t0, t1, y);
    default: return;
  }
}

}  // namespace

const Kernels* avx512_vnni_kernels() {
  static const Kernels k{Path::avx512_vnni, 8, lanes, quantize, rows_int8, rows_float, cpu_features().avx512_bf16};
  return &k;
}

}  // namespace cascade::linear::detail
#else
#include "model/linear_kernels.hpp"
namespace cascade::linear::detail {
const Kernels* avx512_vnni_kernels() { return nullptr; }
}  // namespace cascade::linear::detail
#endif
