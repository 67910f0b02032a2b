// What linear.cpp and the kernel tiers share: the activation forms, the entry points every tier defines, and the
// target regions of the tiers that cascade/simd.hpp does not name. Not part of the runtime's interface.
//
// The kernels come in tiers, one per linear::Path, each in its own namespace and compiled once, in its own unit,
// for its own instruction set, as the attention kernels are (cascade/cpu/kernel.hpp):
//   portable      linear_portable.cpp   plain C++, quant.hpp's decoders
//   avx2          linear_avx2.cpp       8 lanes, vpmaddubsw + vpmaddwd, FMA, F16C
//   avx_vnni      linear_avx_vnni.cpp   8 lanes, VEX vpdpbusd
//   avx512_vnni   linear_avx512.cpp     16 lanes (8 rows of X on 512-bit dot products), vpdpbusd; vdpbf16ps for
//                                       BF16 weights where the CPU has AVX512_BF16 (linear_avx512*.hpp)
// The x86 tiers share one implementation written over a vector type and an integer dot product
// (linear_x86.inc lists its parts). linear.cpp picks the tier of a call's path, in one place.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "model/linear.hpp"

// Target regions of the VNNI tiers, as simd.hpp's CASCADE_TARGET_<TIER>_BEGIN (and closed by its
// CASCADE_TARGET_END): the avx2 tier plus VEX vpdpbusd; the AVX-512 tier plus vpdpbusd and vdpbf16ps on zmm.
#if CASCADE_X86 && defined(__clang__)
#define CASCADE_LINEAR_TARGET_AVX_VNNI_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,avxvnni\"))), apply_to = function)")
#define CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN                                                                      \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,\
avx2,fma,f16c\"))), apply_to = function)")
#elif CASCADE_X86 && defined(__GNUC__)
#define CASCADE_LINEAR_TARGET_AVX_VNNI_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,avxvnni\")")
#define CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN \
  _Pragma("GCC push_options")                   \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c\")")
#endif

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

// Output rows per panel: the row ranges linear.cpp hands to a tier's products start at multiples of it.
inline constexpr int64_t kPanelRows = 8;

// The entry points of tier `tier`, defined in its namespace:
//   int8_lanes(n)        the int8 layout the tier multiplies n rows of X in (0: natural, else lanes)
//   quantize(x, n, n_in, f)   x (n, n_in) -> f, in f.lanes's layout (set by the caller); n_in a multiple of 32
//   rows_int8<T>(w, x, i0, i1, t0, t1, y)   Y[t, i] for t in [t0, t1), i in [i0, i1), W of quantized type T;
//                        y (x.n, w.n_out) row-major; i0 a multiple of kPanelRows, t0 a multiple of 16
//   rows_float<T>(w, x, xb, i0, i1, t0, t1, y)   the same for F32, F16 and BF16 weights: x (n, n_in) f32, xb its
//                        bf16 form (n, n_in) where BF16 weights multiply bf16 activations (bf16_dot), else nullptr
// The products are compiled once per weight type, in the tier's unit (CASCADE_LINEAR_TIER_TEMPLATES(template)).
#define CASCADE_LINEAR_ROWS_INT8(T)                                                                        \
  void rows_int8<gguf::TensorType::T>(const Matrix&, const Int8Form&, int64_t, int64_t, int64_t, int64_t, \
                                      float*);
#define CASCADE_LINEAR_ROWS_FLOAT(T)                                                                     \
  void rows_float<gguf::TensorType::T>(const Matrix&, const float*, const uint16_t*, int64_t, int64_t, \
                                       int64_t, int64_t, float*);
#define CASCADE_LINEAR_TIER_TEMPLATES(prefix)                                                                  \
  prefix CASCADE_LINEAR_ROWS_INT8(Q4_0) prefix CASCADE_LINEAR_ROWS_INT8(Q4_1) prefix CASCADE_LINEAR_ROWS_INT8(Q8_0) \
  prefix CASCADE_LINEAR_ROWS_INT8(Q4_K) prefix CASCADE_LINEAR_ROWS_INT8(Q5_K) prefix CASCADE_LINEAR_ROWS_INT8(Q6_K) \
  prefix CASCADE_LINEAR_ROWS_FLOAT(F32) prefix CASCADE_LINEAR_ROWS_FLOAT(F16) prefix CASCADE_LINEAR_ROWS_FLOAT(BF16)
#define CASCADE_LINEAR_TIER(tier)                                                                                \
  namespace tier {                                                                                               \
  int int8_lanes(int64_t n);                                                                                     \
  void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f);                                           \
  template <gguf::TensorType T>                                                                                  \
  void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y);  \
  template <gguf::TensorType T>                                                                                  \
  void rows_float(const Matrix& w, const float* x, const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0,       \
                  int64_t t1, float* y);                                                                         \
  CASCADE_LINEAR_TIER_TEMPLATES(extern template)                                                                 \
  }

CASCADE_LINEAR_TIER(portable)
#if CASCADE_X86
CASCADE_LINEAR_TIER(avx2)
CASCADE_LINEAR_TIER(avx_vnni)
CASCADE_LINEAR_TIER(avx512_vnni)
#endif

// The tier of `path` (linear.cpp): its int8 layout for n rows of X, and x quantized in it (f.lanes set here).
int int8_lanes(Path path, int64_t n);
void quantize(Path path, const float* x, int64_t n, int64_t n_in, int lanes, Int8Form& f);
// Whether BF16 weights multiply bf16 activations (vdpbf16ps) on `path`.
bool bf16_dot(Path path);

// The reference quantizer (Input::int8_natural): one row of n_in values into q, d, s16, s32 (natural layout
// pointers to that row). Every tier's quantize must produce the same numbers.
void quantize_row(const float* x, int64_t n_in, int8_t* q, float* d, float* s16, float* s32);
// A block whose largest |x| is below kTinyBlock is multiplied by kTinyScale before its codes are taken (linear.cpp).
inline constexpr float kTinyBlock = 0x1p-100f, kTinyScale = 0x1p100f;

}  // namespace cascade::linear::detail
