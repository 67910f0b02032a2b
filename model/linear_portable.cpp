// The portable tier of the linear kernels (linear_kernels.hpp): plain C++ on any CPU. Weights are decoded row by row
// with quant.hpp's own decoders (either layout, through Matrix::row_blocks), then multiplied group by group in
// int32 and added in linear.hpp's order with std::fma (quantized types), or in f32 (F32, F16, BF16).
#include "model/linear_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/quant.hpp"

namespace cascade::linear::detail::portable {

namespace {

// sum over k < n of code[k] * q[k], in 4 int32 lanes the compiler can vectorize.
int32_t dot_codes(const uint8_t* code, const int8_t* q, int64_t n) {
  int32_t acc[4] = {0, 0, 0, 0};
  for (int64_t k = 0; k < n; k += 4)
    for (int j = 0; j < 4; ++j) acc[j] += int32_t(code[k + j]) * int32_t(q[k + j]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// sum over k < n of a[k] * b[k], in 8 f32 lanes.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

}  // namespace

void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f) {
  const int64_t nb = n_in / 32;
  f.n = n;
  f.n_in = n_in;
  f.q.resize(size_t(n * n_in));
  f.d.resize(size_t(n * nb));
  f.s16.resize(size_t(n * nb * 2));
  f.s32.resize(size_t(n * nb));
  f.qs16.resize(size_t(n * nb * 2));
  f.qs32.resize(size_t(n * nb));
  for (int64_t r = 0; r < n; ++r)
    quantize_row(x + r * n_in, n_in, f.q.data() + r * n_in, f.d.data() + r * nb, f.s16.data() + r * 2 * nb,
                 f.s32.data() + r * nb);
  for (int64_t h = 0; h < 2 * n * nb; ++h) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) s += f.q[size_t(16 * h + j)];
    f.qs16[size_t(h)] = s;
  }
  for (int64_t b = 0; b < n * nb; ++b) f.qs32[size_t(b)] = f.qs16[size_t(2 * b)] + f.qs16[size_t(2 * b + 1)];
  f.made = true;
}

// The weight type comes from w (quant.hpp's decoders dispatch on it); T only names the instantiation and the
// offsets folded into the integer sums (linear_kernels.hpp: offset_codes).
template <gguf::TensorType T>
void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y, Tiles) {
  constexpr int32_t kFold = offset_codes(T);
  const int64_t K = w.n_in, G = gguf::code_group_size(w.type), n_groups = K / G;
  thread_local std::vector<uint8_t> code, blocks;
  thread_local std::vector<float> sc, off;
  code.resize(size_t(K));
  blocks.resize(size_t(w.row_bytes));
  sc.resize(size_t(n_groups));
  off.resize(size_t(n_groups));
  for (int64_t i = i0; i < i1; ++i) {
    gguf::decode_codes(w.type, w.row_blocks(i, blocks.data()), K, code.data(), sc.data(), off.data());
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* q = x.q.data() + t * K;
      const float* d = x.d.data() + t * K / 32;
      const float* s = G == 16 ? x.s16.data() + t * K / 16 : x.s32.data() + t * K / 32;
      const int32_t* qs = G == 16 ? x.qs16.data() + t * K / 16 : x.qs32.data() + t * K / 32;
      float acc = 0;
      for (int64_t g = 0; g < n_groups; ++g) {
        const int32_t I = dot_codes(code.data() + g * G, q + g * G, G);
        const float c = sc[g] * d[g * G / 32];
        if (kFold != 0) {
          acc = std::fma(static_cast<float>(I + kFold * qs[g]), c, acc);
        } else {
          acc = std::fma(static_cast<float>(I), c, acc);
          acc = std::fma(off[g], s[g], acc);
        }
      }
      y[t * w.n_out + i] = acc;
    }
  }
}

template <gguf::TensorType T>
void rows_float(const Matrix& w, const float* x, const uint16_t*, int64_t i0, int64_t i1, int64_t t0, int64_t t1,
                float* y) {
  thread_local std::vector<float> row;
  row.resize(size_t(w.n_in));
  for (int64_t i = i0; i < i1; ++i) {
    gguf::dequantize_row(w.type, w.data + uint64_t(i) * w.row_bytes, row.data(), w.n_in);
    for (int64_t t = t0; t < t1; ++t) y[t * w.n_out + i] = dot_f32(row.data(), x + t * w.n_in, w.n_in);
  }
}

CASCADE_LINEAR_TIER_TEMPLATES(template)

}  // namespace cascade::linear::detail::portable
