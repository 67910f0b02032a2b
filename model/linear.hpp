// Linear layers on weights as the file stores them: Y (n, n_out) = X (n, n_in) W^T, W (n_out, n_in) row-major in
// any type the runtime reads (quant.hpp), never copied to f32.
//
// Quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) are read as integer codes (quant.hpp: value =
// scale[g] * code + offset[g] per group of 16 or 32), and the activations are quantized once per layer input
// (Input) to int8 blocks of 32:
//
//   x[k] ~ xq[k] = d[b] * q[k],   d[b] = max |x| over block b / 127,   q[k] = round(x[k] / d[b]) in [-127, 127]
//
// so that each group of a dot product is an integer sum of code * q:
//
//   sum over k in group g of w[k] xq[k] = scale[g] d[b] I[g] + offset[g] s[g],
//   I[g] = sum code[k] q[k] (exact in int32),   s[g] = d[b] * sum q[k]  (the activations' group sums)
//
// F32 and F16 weights multiply f32 activations (F16 through F16C); BF16 weights multiply activations rounded to
// bf16 where the CPU has AVX512_BF16 (vdpbf16ps), else f32 activations.
//
// The products run on one of these paths, chosen at run time from what the CPU reports (cascade/simd.hpp; tests
// and benchmarks cap it with set_isa_limit), so one build runs on any x86-64:
//
//   avx512-vnni  vpdpbusd on 16 lanes (several tokens) or 8 (up to 8 tokens); F16C, vdpbf16ps where present
//   avx-vnni     vpdpbusd on 8 lanes (the VEX form of Alder Lake and Zen 5)
//   avx2         vpmaddubsw + vpmaddwd on 8 lanes, FMA, F16C
//   portable     plain C++
//
// Each reads a block of W once per step for all the rows of X: with few rows, registers hold several output
// rows x every row of X (the weights' bytes spread across the lanes); with more, the lanes hold rows of X and a
// weight's code is broadcast to them, output rows split across threads.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "model/gguf.hpp"

namespace cascade::linear {

// A weight matrix as stored: n_out rows of n_in values of `type`, row i at data + i * row_bytes. Not owned.
struct Matrix {
  gguf::TensorType type = gguf::TensorType::F32;
  int64_t n_in = 0, n_out = 0;
  uint64_t row_bytes = 0;
  const uint8_t* data = nullptr;

  // Checks that the type is one the runtime reads (gguf::can_dequantize) and that n_in is a whole number of
  // its blocks; throws an Error naming the type otherwise.
  static Matrix view(gguf::TensorType type, const void* data, int64_t n_in, int64_t n_out);
  uint64_t bytes() const { return row_bytes * uint64_t(n_out); }
  void row(int64_t i, float* out) const;  // dequantizes row i into out (n_in floats)
};

// The instruction paths, widest last. active_path() is the widest the CPU has, within cascade::active_isa().
enum class Path : uint8_t { portable = 0, avx2 = 1, avx_vnni = 2, avx512_vnni = 3 };
const char* path_name(Path p);  // "portable", "avx2", "avx-vnni", "avx512-vnni"
Path active_path();
bool can_run(Path p);            // the CPU has what p needs (and the ISA limit allows it)

namespace detail {
struct Forms;  // the quantized forms an Input holds (linear_kernels.hpp)
}

// The activations of one layer input: X (n, n_in) f32 row-major, and the forms the kernels multiply (int8 codes
// with block scales and sums, or bf16), each made on first use and kept while the Input lives. X must stay
// unchanged meanwhile. Several matrices multiplied with one Input (q, k and v; gate and up) share its forms.
class Input {
 public:
  Input(const float* x, int64_t n, int64_t n_in);
  ~Input();
  Input(const Input&) = delete;
  Input& operator=(const Input&) = delete;

  const float* data() const { return x_; }
  int64_t n() const { return n_; }
  int64_t n_in() const { return n_in_; }

  // The int8 form every path uses, in the natural layout (row-major): q (n, n_in), d (n, n_in / 32), and
  // s16 (n, n_in / 16) / s32 (n, n_in / 32) = d * (sum of q over each 16 / 32). n_in a multiple of 32.
  struct Int8 {
    std::vector<int8_t> q;
    std::vector<float> d, s16, s32;
  };
  Int8 int8_natural() const;
  // The bf16 values the BF16 kernels multiply on the avx512-vnni path with AVX512_BF16: x rounded to nearest even.
  std::vector<uint16_t> bf16() const;

  detail::Forms& forms() const;  // for the kernels

 private:
  const float* x_;
  int64_t n_, n_in_;
  mutable std::unique_ptr<detail::Forms> forms_;
};

// Y (x.n(), w.n_out) = X W^T on active_path(), output rows split across the current oneTBB arena's threads.
void matmul(const Matrix& w, const Input& x, float* y);
void matmul(const Matrix& w, const float* x, int64_t n, float* y);  // a one-use Input
// The same on a given path (tests, benchmarks); Error if the CPU cannot run it.
void matmul(const Matrix& w, const Input& x, float* y, Path path);

// Several products with one Input (q, k and v; gate and up): y_j (x.n(), w_j.n_out) = X W_j^T for each, in one
// split of all their output rows across the threads. The same numbers as one matmul per matrix (bit for bit),
// without a fork and join per matrix, which small matrices pay several times over (docs/study.md, section 14).
// Every w_j has x.n_in() columns; the types may differ.
struct Product {
  const Matrix* w;
  float* y;
};
void matmul_group(std::initializer_list<Product> products, const Input& x);
void matmul_group(std::initializer_list<Product> products, const Input& x, Path path);

// Y = X W^T with W dequantized to f32 tile by tile and f32 activations (the runtime's f32 path, and the
// reference its logits are compared with).
void matmul_f32(const Matrix& w, const float* x, int64_t n, float* y);

// What a path multiplies, exactly: X as that path quantizes it (int8 codes for quantized weights; bf16 for BF16
// weights on a path that uses vdpbf16ps; else x itself), in double precision, with W dequantized (quant.hpp):
//   y[r, i] = sum over k of double(w[i, k]) * double(xq[r, k])
// and beside it bound[r, i], a bound on |fast - y| for that path's f32 arithmetic (linear.cpp derives it).
void reference(const Matrix& w, const Input& x, Path path, std::vector<double>& y, std::vector<double>& bound);

}  // namespace cascade::linear
