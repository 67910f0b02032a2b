// Linear layers on weights as the file stores them: Y (n, n_out) = X (n, n_in) W^T, W (n_out, n_in) row-major in
// any type the runtime reads (quant.hpp), never copied to f32.
//
// Determinism. Every output is reduced over K in ONE fixed order, whatever the number of rows of X, the rows
// beside it in the batch, the tile that ran it (few rows, many rows, AMX tiles) and the split across threads, so
// a row's output depends on that row and W alone, bit for bit:
//   quantized W:  acc = +0; for each group g of K in ascending order:
//                   I   = sum over the group of code[k] * q[k]                 (int32, exact in any order)
//                   q4_1, q4_K, q5_K:        acc = fma(float(I), fl(scale[g] * d[block of g]), acc)
//                                            acc = fma(offset[g], s[g], acc)
//                   q4_0, q8_0, q6_K, whose offset is a fixed multiple c of the scale (-8, -128, -32):
//                                            acc = fma(float(I + c * qs[g]), fl(scale[g] * d[block of g]), acc)
//                 y = acc   (codes, scales and offsets as gguf::decode_codes gives them; d, s and the group's
//                 integer sum of codes qs below; I + c qs is the sum of the signed codes' products, exact)
//   float W:      8 f32 lanes over k, each an FMA chain, then the lanes added in a fixed tree (one tier's own)
// Integer sums are exact, so a kernel may split a group's sum across lanes or instructions as it likes; the f32
// operations are the ones above, in that order, and nothing is contracted or reassociated around them. Every
// tier follows the same order for quantized W (the portable tier with std::fma), so they agree bit for bit too;
// float W agree within a tier (bf16 products on vdpbf16ps round differently from f32 FMAs). The f32 path
// (matmul_f32: Eigen's blocking, which depends on the number of rows) is the one path without this property: it
// is opt-in, the reference the quantized path is compared with. tests/test_linear.cpp checks the rule: a row
// alone, in batches of 2 to 64 and through every tile path of each tier gives the same bits.
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
// Weights in blocks of 16 rows. The products of quantized weights put 16 output rows in the lanes of a vector:
// each block of 16 rows is read once per call for every row of X, its codes against one row of X's 4 codes
// broadcast to all lanes, and each lane follows the order above on its own. pack() lays the weights out so that
// one 64-byte load holds 16 rows' codes of the same values (the rows16 layout, the file's own size); a model
// packs its matrices once when it loads. Unpacked matrices are packed 16 rows at a time as they are multiplied.
//
// The products run on one of these paths, chosen at run time from what the CPU reports (cascade/simd.hpp; tests
// and benchmarks cap it with set_isa_limit), so one build runs on any x86-64:
//
//   avx512-vnni  vpdpbusd on 16 lanes; F16C, vdpbf16ps where present; rows of X 16 at a time on AMX tiles
//                (tdpbsud) where the CPU has AMX-INT8 and the OS grants the tiles (cascade::amx_usable())
//   avx-vnni     vpdpbusd on 8 lanes (the VEX form of Alder Lake and Zen 5)
//   avx2         vpmaddubsw + vpmaddwd on 8 lanes, FMA, F16C
//   portable     plain C++
//
// Output rows are split across threads in blocks of 16.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf.hpp"

namespace cascade::linear {

// How a matrix's bytes are laid out (the same bytes in total either way):
//   rows     as the file stores them: row i at data + i * row_bytes
//   rows16   each whole block of 16 rows (rows 16r .. 16r + 15) at data + 16 r row_bytes, interleaved file block
//            by file block (linear_pack.cpp); the last n_out % 16 rows as stored, after them
enum class Layout : uint8_t { rows = 0, rows16 = 1 };

// A weight matrix: n_out rows of n_in values of `type`, laid out as `layout` says. Not owned.
struct Matrix {
  gguf::TensorType type = gguf::TensorType::F32;
  int64_t n_in = 0, n_out = 0;
  uint64_t row_bytes = 0;  // bytes of one row as the file stores it
  const uint8_t* data = nullptr;
  Layout layout = Layout::rows;

  // Checks that the type is one the runtime reads (gguf::can_dequantize) and that n_in is a whole number of
  // its blocks; throws an Error naming the type otherwise. The rows layout.
  static Matrix view(gguf::TensorType type, const void* data, int64_t n_in, int64_t n_out);
  uint64_t bytes() const { return row_bytes * uint64_t(n_out); }
  void row(int64_t i, float* out) const;  // dequantizes row i into out (n_in floats)
  // Row i's blocks as the file stores them (row_bytes bytes): in place for the rows layout, else copied into
  // scratch (row_bytes bytes), which is returned.
  const uint8_t* row_blocks(int64_t i, uint8_t* scratch) const;
};

// The types pack() lays out in blocks of 16 rows: the quantized ones (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K).
bool can_pack(gguf::TensorType t);
// Writes w (rows layout, a type can_pack accepts; else an Error) to dst (w.bytes() bytes, not overlapping w) in
// the rows16 layout, and returns the matrix that views dst. The products give the same bits on either layout.
Matrix pack(const Matrix& w, uint8_t* dst);

// The instruction paths, widest last. active_path() is the widest the CPU has, within cascade::active_isa().
enum class Path : uint8_t { portable = 0, avx2 = 1, avx_vnni = 2, avx512_vnni = 3 };
const char* path_name(Path p);  // "portable", "avx2", "avx-vnni", "avx512-vnni"
Path active_path();
bool can_run(Path p);            // the CPU has what p needs (and the ISA limit allows it)
// What `path` multiplies quantized weights with, for tools to report: the path's name, and "+amx-int8" where
// rows of X go 16 at a time to AMX tiles (from kAmxRows rows of X on).
std::string products_name(Path path);
inline constexpr int64_t kAmxRows = 32;
// Whether this process may run AMX int8 tiles: cascade::amx_usable() (the OS granted the tiles) and CPUID's
// AMX-INT8. Asked once.
bool amx_int8_usable();

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
