// What linear.cpp and the kernel tiers share: the activation forms, the entry points every tier defines, the rows16
// layout of packed weights (linear_pack.cpp), and the target regions of the tiers that cascade/simd.hpp does not
// name. Not part of the runtime's interface.
//
// The kernels come in tiers, one per linear::Path, each in its own namespace and compiled once, in its own unit,
// for its own instruction set, as the attention kernels are (cascade/cpu/kernel.hpp):
//   portable      linear_portable.cpp   plain C++, quant.hpp's decoders
//   avx2          linear_avx2.cpp       8 lanes, vpmaddubsw + vpmaddwd, FMA, F16C
//   avx_vnni      linear_avx_vnni.cpp   8 lanes, VEX vpdpbusd
//   avx512_vnni   linear_avx512.cpp     16 lanes, vpdpbusd; AMX tiles (linear_amx.hpp); vdpbf16ps for BF16
//                                       weights where the CPU has AVX512_BF16
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

// X (n, n_in) quantized to int8 blocks of 32 (linear.hpp), row-major: q (n, n_in); d, s32 and qs32 (n, n_in / 32);
// s16 and qs16 (n, n_in / 16). qs16 and qs32 are the integer sums of the codes over each 16 and 32 values (the
// groups' qs of linear.hpp's order). Every tier makes the same numbers (Input::int8_natural defines q, d, s).
struct Int8Form {
  bool made = false;
  int64_t n = 0, n_in = 0;
  Buffer<int8_t> q;
  Buffer<float> d, s16, s32;
  Buffer<int32_t> qs16, qs32;
};

struct Forms {
  Int8Form int8;
  Buffer<uint16_t> bf16;  // (n, n_in) x rounded to bf16; empty until a kernel asks
  bool has_bf16 = false;
};

// The multiple c of the scale that a type's offset is (linear.hpp: folded into the group's integer sum as c times
// the activations' sum of codes): -8 for q4_0, -128 for q8_0 (unsigned codes), -32 for q6_K; 0 for the types
// whose offsets stand apart (q4_1, q4_K, q5_K).
constexpr int32_t offset_codes(gguf::TensorType t) {
  return t == gguf::TensorType::Q4_0 ? -8 : t == gguf::TensorType::Q8_0 ? -128 : t == gguf::TensorType::Q6_K ? -32 : 0;
}

// Output rows per block: the row ranges linear.cpp hands to a tier's products start at multiples of it, and the
// rows16 layout interleaves this many rows.
inline constexpr int64_t kBlockRows = 16;

// How rows_int8 multiplies (the avx512-vnni tier alone reads it; the others always take vectors):
//   vectors       vpdpbusd (vpmaddubsw) on 16 output rows per vector
//   amx           rows of X 16 at a time on AMX tiles (where linear::amx_int8_usable()), the rest on vectors
//   amx_emulated  the AMX driver with its tile instructions done in plain C++ (tests, on any CPU)
// All three give the same bits (linear.hpp).
enum class Tiles : uint8_t { vectors = 0, amx = 1, amx_emulated = 2 };

// The entry points of tier `tier`, defined in its namespace:
//   quantize(x, n, n_in, f)   x (n, n_in) -> f; n_in a multiple of 32
//   rows_int8<T>(w, x, i0, i1, t0, t1, y, tiles)   Y[t, i] for t in [t0, t1), i in [i0, i1), W of quantized type
//                        T in either layout; y (x.n, w.n_out) row-major; i0 a multiple of kBlockRows
//   rows_float<T>(w, x, xb, i0, i1, t0, t1, y)   the same for F32, F16 and BF16 weights (rows layout): x (n, n_in)
//                        f32, xb its bf16 form (n, n_in) where BF16 weights multiply bf16 activations
//                        (bf16_dot), else nullptr
// The products are compiled once per weight type, in the tier's unit (CASCADE_LINEAR_TIER_TEMPLATES(template)).
#define CASCADE_LINEAR_ROWS_INT8(T)                                                                        \
  void rows_int8<gguf::TensorType::T>(const Matrix&, const Int8Form&, int64_t, int64_t, int64_t, int64_t, \
                                      float*, Tiles);
#define CASCADE_LINEAR_ROWS_FLOAT(T)                                                                     \
  void rows_float<gguf::TensorType::T>(const Matrix&, const float*, const uint16_t*, int64_t, int64_t, \
                                       int64_t, int64_t, float*);
#define CASCADE_LINEAR_TIER_TEMPLATES(prefix)                                                                  \
  prefix CASCADE_LINEAR_ROWS_INT8(Q4_0) prefix CASCADE_LINEAR_ROWS_INT8(Q4_1) prefix CASCADE_LINEAR_ROWS_INT8(Q8_0) \
  prefix CASCADE_LINEAR_ROWS_INT8(Q4_K) prefix CASCADE_LINEAR_ROWS_INT8(Q5_K) prefix CASCADE_LINEAR_ROWS_INT8(Q6_K) \
  prefix CASCADE_LINEAR_ROWS_FLOAT(F32) prefix CASCADE_LINEAR_ROWS_FLOAT(F16) prefix CASCADE_LINEAR_ROWS_FLOAT(BF16)
#define CASCADE_LINEAR_TIER(tier)                                                                                \
  namespace tier {                                                                                               \
  void quantize(const float* x, int64_t n, int64_t n_in, Int8Form& f);                                           \
  template <gguf::TensorType T>                                                                                  \
  void rows_int8(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y,   \
                 Tiles tiles);                                                                                   \
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

// The tier of `path` (linear.cpp): x quantized.
void quantize(Path path, const float* x, int64_t n, int64_t n_in, Int8Form& f);
// Whether BF16 weights multiply bf16 activations (vdpbf16ps) on `path`.
bool bf16_dot(Path path);
// The tiles rows_int8 takes on `path` for n rows of X: amx from kAmxRows rows on where the path is avx512-vnni
// and linear::amx_int8_usable(), else vectors. set_tiles overrides that for every call until reset_tiles (tests).
Tiles tiles_for(Path path, int64_t n);
void set_tiles(Tiles tiles);
void reset_tiles();

// The reference quantizer (Input::int8_natural): one row of n_in values into q, d, s16, s32 (natural layout
// pointers to that row). Every tier's quantize must produce the same numbers.
void quantize_row(const float* x, int64_t n_in, int8_t* q, float* d, float* s16, float* s32);
// A block whose largest |x| is below kTinyBlock is multiplied by kTinyScale before its codes are taken (linear.cpp).
inline constexpr float kTinyBlock = 0x1p-100f, kTinyScale = 0x1p100f;

// The rows16 layout (linear_pack.cpp). A block of 16 rows is a run of super-columns, one per file block of
// those rows (16 block_bytes each). In a super-column, 64-byte code chunks hold the same values of all 16 rows,
// row j in bytes 4j .. 4j + 3; the per-row fields (f16 scales, 6-bit scale words, i8 scales) are arrays of 16.
//   4-bit codes (q4_0, q4_1, q4_K, q5_K, q6_K): chunk z holds values 8z .. 8z + 7 of the block: byte e of row j
//     has value 8z + e in its low nibble and 8z + 4 + e in its high nibble; q5_K's fifth bits and q6_K's two
//     high bits come in 64-byte vectors of the same byte positions, one bit (two) per code vector (the low and
//     the high nibbles of each chunk: 8 code vectors per q5_K vector, 4 per q6_K one)
//   q8_0: chunk z holds values 4z .. 4z + 3, as unsigned codes (q + 128)
// Offsets in a super-column (bytes):
//   q4_0  d[16] f16 0; chunks 32 (4)                 q4_1  d 0, m 32; chunks 64 (4)
//   q8_0  d 0; chunks 32 (8)
//   q4_K  d 0, dmin 32, scale words 64 (3 x 16 u32: row j's 12 scale bytes as words w0 w1 w2); chunks 256 (32)
//   q5_K  as q4_K; fifth bits 256 (8 vectors: bit 2s / 2s + 1 for the low / high nibbles of chunk 4v + s);
//         chunks 768 (32)
//   q6_K  d 0; scales 32 (16 groups x 16 rows, i8); chunks 288 (32); high bits 2336 (16 vectors: bits 4s, 4s + 1
//         for the low nibbles of chunk 2v + s, 4s + 2, 4s + 3 for its high ones)
struct Rows16 {
  uint64_t d = 0, m = 0, words = 0, scales = 0, high = 0, chunks = 0;
};
Rows16 rows16_offsets(gguf::TensorType t);
// Packs rows [i, i + 16) of w (rows layout; rows past n_out are zero) into dst (16 row_bytes bytes).
void pack_block(const Matrix& w, int64_t i, uint8_t* dst);
// The first byte of the block of 16 rows at row i (a multiple of 16) of w in the rows16 layout, packing it into
// scratch (16 row_bytes) where w does not hold it packed (the rows layout, or the last rows of a rows16 matrix).
const uint8_t* block_at(const Matrix& w, int64_t i, uint8_t* scratch);

}  // namespace cascade::linear::detail
