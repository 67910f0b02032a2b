// What linear.cpp and the per-path kernel files share: the activation forms and one table of kernels per path.
// Not part of the runtime's interface.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "model/linear.hpp"

namespace cascade::linear::detail {

// A zero-initialised buffer aligned to 64 bytes, with `slack` bytes past its end that kernels may read (always
// zero) so that a vector load at the last element stays inside the allocation.
template <class T>
class Buffer {
 public:
  static constexpr size_t slack = 128;
  void resize(size_t n) {
    if (n > cap_) {
      const size_t bytes = (n * sizeof(T) + slack + 63) / 64 * 64;
      p_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
      if (!p_) throw std::bad_alloc();
      cap_ = n;
    }
    n_ = n;
    std::fill_n(reinterpret_cast<char*>(p_.get()), n * sizeof(T) + slack, char(0));
  }
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_.get()[i]; }
  const T& operator[](size_t i) const { return p_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
  size_t n_ = 0, cap_ = 0;
};

// X (n, n_in) quantized to int8 blocks of 32 (linear.hpp), in one of two layouts:
//   natural (lanes 0)   q (n, n_in); d (n, n_in/32); s16 (n, n_in/16); s32 (n, n_in/32)
//   by lanes (8, 16)    rows padded to n_pad, a multiple of lanes, with zeros; the 4 codes k..k+3 of row r at
//                       q[((k/4) * n_pad + r) * 4]; d (n_in/32, n_pad); s16 (n_in/16, n_pad); s32 (n_in/32, n_pad)
// The numbers are the same in both (Input::int8_natural defines them).
struct Int8Form {
  int lanes = -1;  // -1: not made yet
  int64_t n = 0, n_in = 0, n_pad = 0;
  Buffer<int8_t> q;
  Buffer<float> d, s16, s32;
};

struct Forms {
  Int8Form int8;
  Buffer<uint16_t> bf16;  // (n, n_in) x rounded to bf16; empty until a kernel asks
  bool has_bf16 = false;
};

// One path's kernels. A kernel file fills one of these; linear.cpp splits rows across threads and calls it.
struct Kernels {
  Path path;
  // Output rows per panel: the row ranges handed to rows_* start at multiples of it.
  int panel_rows;
  // The int8 layout the path multiplies n rows of X in (0: natural, else lanes).
  int (*int8_lanes)(int64_t n);
  // x (n, n_in) -> f, in f.lanes's layout (set by the caller); n_in a multiple of 32.
  void (*quantize)(const float* x, int64_t n, int64_t n_in, Int8Form& f);
  // Y[t, i] for t in [t0, t1), i in [i0, i1), W quantized; y (x.n, w.n_out) row-major. i0 is a multiple of
  // panel_rows, t0 a multiple of 16.
  void (*rows_int8)(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y);
  // The same for F32, F16 and BF16 weights: x (n, n_in) f32, xb its bf16 form (n, n_in) when bf16_dot.
  void (*rows_float)(const Matrix& w, const float* x, const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0,
                     int64_t t1, float* y);
  bool bf16_dot;  // BF16 weights multiply bf16 activations (vdpbf16ps)
};

const Kernels& portable_kernels();
const Kernels* avx2_kernels();         // nullptr where the build's compiler cannot target it
const Kernels* avx_vnni_kernels();
const Kernels* avx512_vnni_kernels();

// The reference quantizer (Input::int8_natural): one row of n_in values into q, d, s16, s32 (natural layout
// pointers to that row). Kernel files must produce the same numbers.
void quantize_row(const float* x, int64_t n_in, int8_t* q, float* d, float* s16, float* s32);
// A block whose largest |x| is below kTinyBlock is multiplied by kTinyScale before its codes are taken (linear.cpp).
inline constexpr float kTinyBlock = 0x1p-100f, kTinyScale = 0x1p100f;

}  // namespace cascade::linear::detail
