// The CPU attention kernels: the one table that chooses among them, and the one switch that runs a choice.
//
// A kernel attends stacked query rows to one token range of a KV span with online softmax and writes the
// normalized partial state (o, lse). It is the one compute routine behind every method: the shared-segment
// pass (all rows below a segment), the per-sequence pass (the group's heads times the sequence's query
// tokens) and the unified baseline (every row of the batch, with a sequence mask). A kernel is a driver and a
// products policy (kernel_driver.inc):
//   shapes     tiled: many rows per KV head, one head per call: lanes hold query rows, S stays in registers;
//              few-rows: up to kFewRows rows per KV head, all KV heads of a token range in one call, so K and V
//              stream from memory once and in order: lanes run along the head dim.
//   tiers      AVX-512 (kernel_avx512.hpp), AVX2 + FMA + F16C (kernel_avx2.hpp), and the portable tier: the same
//              drivers on 8 plain floats (kernel_portable.hpp). All are compiled into every build.
//   products   f32 multiply-adds on K/V converted to f32 (kernel_products_f32.inc, every tier); bf16 K/V on
//              vdpbf16ps (kernel_bf16.hpp) where the CPU has AVX512_BF16 and runs them faster than its f32 FMAs;
//              the tiled kernel's bf16 products on AMX tiles (kernel_amx.hpp) where the CPU has them and the OS
//              grants them.
// choose_kernel says which of these runs a pass, from the K/V type, the head dim, the kernel shape, the CPU's
// features and the planning options; the plan keeps the choice (its target's kernel_choices) and run_kernel runs
// it. A new products policy touches its own file, choose_kernel and run_kernel's switch for its tier.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cascade/cpu/kernel_amx.hpp"
#include "cascade/cpu/kernel_avx2.hpp"
#include "cascade/cpu/kernel_avx512.hpp"
#include "cascade/cpu/kernel_bf16.hpp"
#include "cascade/cpu/kernel_common.hpp"
#include "cascade/cpu/kernel_portable.hpp"
#include "cascade/cpu/kernel_q8.hpp"
#include "cascade/kernel_choice.hpp"

namespace cascade::cpu {

namespace detail {
// -1: not set (the measured choice below); 0 or 1: set.
inline std::atomic<int>& bf16_products_flag() {
  static std::atomic<int> on{-1};
  return on;
}
// Whether this CPU's bf16 dot products out-run its f32 FMAs by a margin (20%), measured once per process: far
// apart where they differ at all (docs/study.md §18), so the choice does not move between runs on one machine.
inline bool bf16_dots_faster() {
#if CASCADE_X86
  static const bool faster = detected_isa() == Isa::avx512 && cpu_features().avx512_bf16 &&
                             avx512_bf16::bf16_over_fma_rate() > 1.2;
  return faster;
#else
  return false;
#endif
}
// Whether bf16 products pay on this CPU by default: on AMX tiles where the process may run them (many times the
// f32 FMA rate), else where vdpbf16ps itself is faster.
inline bool bf16_products_faster() {
  static const bool faster = detected_isa() == Isa::avx512 && cpu_features().avx512_bf16 &&
                             (amx_usable() || bf16_dots_faster());
  return faster;
}
// -1: not set (on where amx_usable()); 0 or 1: set.
inline std::atomic<int>& amx_tiles_flag() {
  static std::atomic<int> on{-1};
  return on;
}
// -1: not set (the rule in choose_kernel); 0 or 1: set.
inline std::atomic<int>& int8_products_flag() {
  static std::atomic<int> on{-1};
  return on;
}
inline std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace detail

// ---- planning options and the process-wide switches behind their defaults --------------------------------------

// What planning may choose from (cpu::Options::kernels; tests and benchmarks set them, or the switches below).
struct KernelOptions {
  Isa isa_limit = Isa::avx512;  // the widest tier; the CPU's own caps it further
  int bf16_products = -1;       // bf16 K/V on bf16 products: 1 wherever the CPU has them, 0 never, -1 where they
                                // are faster than this CPU's f32 FMAs (measured once per process)
  bool amx_tiles = true;        // the tiled kernel's bf16 products on AMX tiles where the process may run them
  int int8_products = -1;       // q8_0 K/V on int8 dot products: 1 wherever the CPU has them, 0 never, -1 where
                                // choose_kernel's rule says they are faster
  bool batch_invariant = true;  // a row's (o, lse) the same bits whatever else the step holds (cpu::Options,
                                // docs/serving.md "Determinism"); false: the faster order of the few-rows kernel
  // The process-wide switches as they are now (set_isa_limit, set_bf16_products, set_amx_tiles,
  // set_int8_products).
  static KernelOptions process() {
    KernelOptions o;
    o.isa_limit = active_isa();
    o.bf16_products = detail::bf16_products_flag().load(std::memory_order_relaxed);
    o.amx_tiles = detail::amx_tiles_flag().load(std::memory_order_relaxed) != 0;
    o.int8_products = detail::int8_products_flag().load(std::memory_order_relaxed);
    o.batch_invariant = detail::batch_invariant_flag().load(std::memory_order_relaxed);
    return o;
  }
};

// bf16 K/V on bf16 products (vdpbf16ps, or AMX tiles): by default where they are faster than this CPU's f32
// FMAs (twice the rate on some CPUs, half on others), else in f32. Process-wide, as the tier limit (simd.hpp), and
// read when a plan is made; Bf16Products sets it for one scope.
inline void set_bf16_products(bool on) { detail::bf16_products_flag().store(on ? 1 : 0, std::memory_order_relaxed); }
inline bool bf16_products() {
  const int v = detail::bf16_products_flag().load(std::memory_order_relaxed);
  return v >= 0 ? v != 0 : detail::bf16_products_faster();
}
class Bf16Products {
 public:
  explicit Bf16Products(bool on) : saved_(detail::bf16_products_flag().load(std::memory_order_relaxed)) {
    set_bf16_products(on);
  }
  ~Bf16Products() { detail::bf16_products_flag().store(saved_, std::memory_order_relaxed); }
  Bf16Products(const Bf16Products&) = delete;
  Bf16Products& operator=(const Bf16Products&) = delete;

 private:
  int saved_;  // -1 (the measured choice) is restored as such
};

// bf16 products on AMX tiles rather than vdpbf16ps, where the process may run them (amx_usable()): on by default
// there. Process-wide, read when a plan is made; AmxTiles sets it for one scope (the tests run both).
inline void set_amx_tiles(bool on) { detail::amx_tiles_flag().store(on ? 1 : 0, std::memory_order_relaxed); }
inline bool amx_tiles() {
  const int v = detail::amx_tiles_flag().load(std::memory_order_relaxed);
  return v != 0 && amx_usable();
}
class AmxTiles {
 public:
  explicit AmxTiles(bool on) : saved_(detail::amx_tiles_flag().load(std::memory_order_relaxed)) { set_amx_tiles(on); }
  ~AmxTiles() { detail::amx_tiles_flag().store(saved_, std::memory_order_relaxed); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

 private:
  int saved_;
};

// Batch-invariant attention (KernelOptions::batch_invariant): on by default; process-wide, read when a plan is made.
inline void set_batch_invariant(bool on) { detail::batch_invariant_flag().store(on, std::memory_order_relaxed); }

// q8_0 K/V on int8 dot products (q quantized to int8): by default where choose_kernel's rule takes them.
// Process-wide, read when a plan is made; Int8Products sets it for one scope (the tests run both).
inline void set_int8_products(bool on) { detail::int8_products_flag().store(on ? 1 : 0, std::memory_order_relaxed); }
class Int8Products {
 public:
  explicit Int8Products(bool on) : saved_(detail::int8_products_flag().load(std::memory_order_relaxed)) {
    set_int8_products(on);
  }
  ~Int8Products() { detail::int8_products_flag().store(saved_, std::memory_order_relaxed); }
  Int8Products(const Int8Products&) = delete;
  Int8Products& operator=(const Int8Products&) = delete;

 private:
  int saved_;
};

// ---- the choice ------------------------------------------------------------------------------------------------

// Whether this CPU's AMX tiles may run the tiled kernel's bf16 products under o.
inline bool amx_allowed(const KernelOptions& o) {
#if defined(CASCADE_AMX_KERNEL)
  return o.amx_tiles && amx_usable();
#else
  return false;
#endif
}

// The kernel that runs a pass of `shape` over K/V of type dt and head dim head_dim under o, on this CPU:
//   tier      AVX-512 where the CPU has it (the few-rows shape: head dims that are a multiple of 16), else AVX2
//             (few-rows: multiples of 8), else portable;
//   products  bf16 K/V on the AVX-512 tier of a CPU with AVX512_BF16 where o allows bf16 products: the tiled
//             shape on AMX tiles (head dims a multiple of 32) where allowed, else on vdpbf16ps (even head dims);
//             the few-rows shape on vdpbf16ps (multiples of 32), except where the tiled one runs on AMX tiles and
//             vdpbf16ps is slower than the f32 FMAs (as on Sapphire Rapids) unless o asks for bf16
//             products outright; q8_0 K/V: the few-rows shape on int8 dot products on the AVX-512 tier of a CPU
//             with AVX512_VNNI (head dims a multiple of 64) unless o turns them off, the tiled shape on tiles
//             converted to bf16 where bf16 K/V would take bf16 products (AMX tiles where allowed, else
//             vdpbf16ps), on codes times scales in f32 elsewhere (measured: docs/study.md §23); f32 everywhere
//             else.
inline KernelChoice choose_kernel_products(KernelShape shape, DType dt, int head_dim, const KernelOptions& o) {
  const Isa isa = std::min(detected_isa(), o.isa_limit);
  const bool few = shape == KernelShape::few_rows;
  KernelChoice c{shape, Isa::portable, Products::f32};
  if (isa == Isa::avx512 && (!few || head_dim % 16 == 0)) c.tier = Isa::avx512;
  else if (isa >= Isa::avx2 && (!few || head_dim % 8 == 0)) c.tier = Isa::avx2;
  const bool products_on = o.bf16_products >= 0 ? o.bf16_products == 1 : detail::bf16_products_faster();
  if (dt == DType::q8_0) {
    if (head_dim % kQ8Block != 0) return c;  // no q8_0 view has such a head dim
    if (few && c.tier == Isa::avx512 && cpu_features().avx512_vnni && head_dim % 64 == 0 && o.int8_products != 0)
      c.products = Products::int8_dot;
    else if (!few && c.tier == Isa::avx512 && cpu_features().avx512_bf16 && products_on)
      c.products = amx_allowed(o) ? Products::amx_bf16 : Products::bf16_dot;  // head dims: multiples of 32
    return c;
  }
  if (dt != DType::bf16 || c.tier != Isa::avx512 || !cpu_features().avx512_bf16 || !products_on) return c;
  if (!few) {
    if (amx_allowed(o) && head_dim % 32 == 0) c.products = Products::amx_bf16;
    else if (head_dim % 2 == 0) c.products = Products::bf16_dot;
  } else if (head_dim % 32 == 0 && (!amx_allowed(o) || o.bf16_products == 1 || detail::bf16_dots_faster())) {
    c.products = Products::bf16_dot;
  }
  return c;
}

// As choose_kernel_products, in the batch-invariant order where o asks for it and the choice has one (f32
// products, on every tier).
inline KernelChoice choose_kernel(KernelShape shape, DType dt, int head_dim, const KernelOptions& o) {
  KernelChoice c = choose_kernel_products(shape, dt, head_dim, o);
  c.batch_invariant = o.batch_invariant && c.products == Products::f32;
  return c;
}

// Every choice a plan's target keeps: both shapes, every K/V type.
inline KernelChoices choose_kernels(int head_dim, const KernelOptions& o) {
  KernelChoices k;
  for (int kernel = 0; kernel < 2; ++kernel)
    for (int t = 0; t < kNumDTypes; ++t)
      k.by[kernel][t] = choose_kernel(kernel == 0 ? KernelShape::tiled : KernelShape::few_rows, DType(t), head_dim, o);
  return k;
}

// Whether choice c can run K/V of type dt and head dim head_dim on this CPU (a choice made elsewhere is checked
// before it runs: an instruction the CPU lacks would end the process).
inline bool kernel_runs_here(const KernelChoice& c, DType dt, int head_dim) {
  if (c.tier > detected_isa()) return false;
  const bool few = c.shape == KernelShape::few_rows;
  if (few && c.tier != Isa::portable && head_dim % (c.tier == Isa::avx512 ? 16 : 8) != 0) return false;
  switch (c.products) {
    case Products::f32: return true;
    case Products::bf16_dot:
      return (dt == DType::bf16 || (dt == DType::q8_0 && !few)) && c.tier == Isa::avx512 &&
             cpu_features().avx512_bf16 && head_dim % (few ? 32 : 2) == 0;
    case Products::amx_bf16:
      return (dt == DType::bf16 || dt == DType::q8_0) && c.tier == Isa::avx512 && !few && head_dim % 32 == 0 &&
             amx_allowed(KernelOptions{});
    case Products::int8_dot:
      return dt == DType::q8_0 && c.tier == Isa::avx512 && few && cpu_features().avx512_vnni && head_dim % 64 == 0;
  }
  return false;
}

// Whether a pass with rows_per_head stacked rows per KV head may run on the few-rows kernel on this CPU under o:
// it needs a head dim that is a multiple of a vector width (an AVX-512 CPU runs the AVX2 one for head dims like 72
// or 200), and so does the portable tier's 8-lane one.
inline int64_t few_rows_limit(int head_dim, const KernelOptions&) {
  return head_dim % 8 == 0 ? kFewRows : 0;
}

}  // namespace cascade::cpu

// ---- running a choice ------------------------------------------------------------------------------------------

namespace cascade::cpu::detail {
// f.template operator()<D / Unit>() with D = 64, 128 or 0 (any head dim): the head dims compiled on their own.
// CASCADE_KERNELS_ANY_HEAD_DIM (the sanitizer builds: CMake's CASCADE_KERNELS_ANY_HEAD_DIM) compiles the any-dim
// kernels alone, a third of the instantiations: the same code with the head dim read at run time, which is what
// ASan and TSan look at; the Release suite runs the head dims compiled on their own.
template <int Unit, class F>
void with_head_dim(int64_t d, F&& f) {
#if defined(CASCADE_KERNELS_ANY_HEAD_DIM)
  (void)d;
  return f.template operator()<0>();
#else
  switch (d) {
    case 64: return f.template operator()<64 / Unit>();
    case 128: return f.template operator()<128 / Unit>();
    default: return f.template operator()<0>();
  }
#endif
}
}  // namespace cascade::cpu::detail

#if CASCADE_X86
CASCADE_TARGET_AVX512_BEGIN
namespace cascade::cpu::avx512 {

// One head on the tiled kernel with products p.
template <class T, int D, class Mask>
void tile_head(Products p, const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
               const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  if constexpr (std::is_same_v<T, bf16>) {
#if defined(CASCADE_AMX_KERNEL)
    if (p == Products::amx_bf16) return amx::tile_attend<D, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
#endif
    if (p == Products::bf16_dot)
      return avx512_bf16::tile_attend<D, kTileRV, kTileNK, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
  }
  if constexpr (std::is_same_v<T, Q8Code>) {
#if defined(CASCADE_AMX_KERNEL)
    if (p == Products::amx_bf16)
      return amx::tile_attend_q8<D, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
#endif
    if (p == Products::bf16_dot)
      return avx512_bf16::tile_attend_q8<D, kTileRV, kTileNK, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse,
                                                                     sc);
  }
  tile_attend<T, D, kTileRV, kTileNK, Mask, NarrowTail>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

// Heads [kvh, kvh + n_heads) (q, o: (n_heads, n_rows, head_dim), q times `scale`; lse: (n_heads, n_rows)) on the
// kernel k names (its tier this one).
template <class Mask>
void attend(const KernelChoice& k, const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh,
            int64_t t0, int64_t t1, const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  const int64_t d = kv.head_dim;
  dispatch_dtype(kv.dtype, [&]<class T>() {
    if (k.shape == KernelShape::few_rows) {
      if constexpr (std::is_same_v<T, bf16>)
        if (k.products == Products::bf16_dot)
          return cpu::detail::with_head_dim<32>(d, [&]<int NB>() {
            avx512_bf16::few_attend<NB, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
          });
      if constexpr (std::is_same_v<T, Q8Code>)
        if (k.products == Products::int8_dot)
          return cpu::detail::with_head_dim<64>(d, [&]<int NC>() {
            avx512_vnni::few_attend<NC, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
          });
      return cpu::detail::with_head_dim<16>(d, [&]<int NV>() {
        if (k.batch_invariant)
          few_attend_exact<T, NV, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
        else
          few_attend<T, NV, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
      });
    }
    for (int h = 0; h < n_heads; ++h)
      cpu::detail::with_head_dim<1>(d, [&]<int D>() {
        tile_head<T, D, Mask>(k.products, q + h * n_rows * d, n_rows, kv, kvh + h, t0, t1, mask, scale,
                              o + h * n_rows * d, lse + h * n_rows, sc);
      });
  });
}

}  // namespace cascade::cpu::avx512
CASCADE_TARGET_END

CASCADE_TARGET_AVX2_BEGIN
namespace cascade::cpu::avx2 {
#include "cascade/cpu/kernel_attend_f32.inc"
}  // namespace cascade::cpu::avx2
CASCADE_TARGET_END
#endif  // CASCADE_X86

namespace cascade::cpu::portable {
#include "cascade/cpu/kernel_attend_f32.inc"
}  // namespace cascade::cpu::portable

namespace cascade::cpu {

// Attends heads [kvh, kvh + n_heads) of kv (q, o: (n_heads, n_rows, head_dim), f32; lse: (n_heads, n_rows),
// natural log) to tokens [t0, t1) under mask (row and key indices relative to the first row and to token 0 of kv),
// q times `scale`, on the kernel k names (choose_kernel; the few-rows shape takes at most kFewRows rows). Rows
// that see no key get (0, -inf).
template <class Mask>
void run_kernel(const KernelChoice& k, const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh,
                int64_t t0, int64_t t1, const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  CASCADE_CHECK(k.shape != KernelShape::few_rows || n_rows <= kFewRows,
                "kernel: ", n_rows, " rows per KV head on the few-rows kernel (at most ", kFewRows, ")");
#if CASCADE_X86
  switch (k.tier) {
    case Isa::avx512: return avx512::attend(k, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
    case Isa::avx2: return avx2::attend(k, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
    case Isa::portable: break;
  }
#endif
  portable::attend(k, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

#if defined(CASCADE_EXTERN_KERNELS)
// Compiled once, one unit per tier, in kernels/.
#define CASCADE_CPU_KERNEL_EXTERN(M)                                                                              \
  extern template void portable::attend<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int,     \
                                           int64_t, int64_t, const M&, float, float*, float*, Scratch&);           \
  CASCADE_CPU_KERNEL_EXTERN_X86(M)                                                                                \
  extern template void run_kernel<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t, \
                                     int64_t, const M&, float, float*, float*, Scratch&);
#if CASCADE_X86
#define CASCADE_CPU_KERNEL_EXTERN_X86(M)                                                                         \
  extern template void avx512::attend<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int,     \
                                         int64_t, int64_t, const M&, float, float*, float*, Scratch&);           \
  extern template void avx2::attend<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int,       \
                                       int64_t, int64_t, const M&, float, float*, float*, Scratch&);
#else
#define CASCADE_CPU_KERNEL_EXTERN_X86(M)
#endif
CASCADE_CPU_KERNEL_EXTERN(LimitMask)
CASCADE_CPU_KERNEL_EXTERN(UnifiedMask)
#endif

}  // namespace cascade::cpu
