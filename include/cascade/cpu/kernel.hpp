// The CPU attention kernels and the one place that picks among them.
//
// A kernel attends stacked query rows to one token range of a KV span with online softmax and writes the
// normalized partial state (o, lse). It is the one compute routine behind every method: the shared-segment
// pass (all rows below a segment), the per-sequence pass (the group's heads times the sequence's query
// tokens) and the unified baseline (every row of the batch, with a sequence mask). Two shapes of kernel:
//   tiled      many rows per KV head, one head per call: lanes hold query rows, S stays in registers, the
//              products are register-blocked (kernel_simd.inc); bf16 K/V on vdpbf16ps where the CPU has
//              AVX512_BF16 (kernel_avx512.hpp), or on AMX tiles where the CPU has them and the OS grants them
//              (kernel_amx.hpp).
//   few-rows   up to kFewRows rows per KV head, all KV heads of a token range in one call, so K and V stream
//              from memory once and in order: lanes run along the head dim.
// Each comes in three tiers (simd.hpp's Isa): AVX-512 (kernel_avx512.hpp), AVX2 + FMA + F16C
// (kernel_avx2.hpp), and a portable path on Eigen (kernel_portable.hpp, which does both shapes one head at a
// time). All tiers are compiled into every build; the plan picks the shape (use_few_rows) and every call runs
// the widest tier the process may use (active_isa()).
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <atomic>
#include <cstdint>

#include "cascade/cpu/kernel_avx2.hpp"
#include "cascade/cpu/kernel_avx512.hpp"
#include "cascade/cpu/kernel_common.hpp"
#include "cascade/cpu/kernel_portable.hpp"

namespace cascade::cpu {

namespace detail {
// -1: not set (the measured choice below); 0 or 1: set.
inline std::atomic<int>& bf16_products_flag() {
  static std::atomic<int> on{-1};
  return on;
}
// Whether this CPU's bf16 dot products out-run its f32 FMAs by a margin (20%), measured once per process
// (~0.2 ms): far apart where they differ at all (2x and 0.5x on the CPUs measured), so the choice does not
// move between runs on one machine.
// Where AMX tiles may run, bf16 products are faster (16x the f32 FMA rate per core on Sapphire Rapids);
// bf16_dots_faster() says whether vdpbf16ps itself is (the per-sequence pass has no AMX form).
inline bool bf16_dots_faster() {
#if CASCADE_X86
  static const bool faster = detected_isa() == Isa::avx512 && cpu_features().avx512_bf16 &&
                             avx512_bf16::bf16_over_fma_rate() > 1.2;
  return faster;
#else
  return false;
#endif
}
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
}  // namespace detail

// bf16 K/V on the AVX-512 tiled kernel, where the CPU has AVX512_BF16: multiplied on bf16 dot products (q and
// the softmax weights rounded to bf16, kernel_avx512.hpp states the error) or in f32. By default on bf16 dot
// products where they are faster than this CPU's f32 FMAs (measured once per process: twice the rate on some
// CPUs, half on others), else in f32. Process-wide, as the tier limit (simd.hpp); Bf16Products sets it for one
// scope.
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

// Whether bf16 K/V multiply on bf16 dot products under tier `isa` (the tiled kernel only).
inline bool uses_bf16_products(Isa isa = active_isa()) {
  return bf16_products() && isa == Isa::avx512 && cpu_features().avx512_bf16;
}

// bf16 products on AMX tiles (kernel_amx.hpp) rather than vdpbf16ps, where the process may run them
// (amx_usable()): on by default there. Process-wide; AmxTiles sets it for one scope (the tests run both).
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

// How bf16 K/V multiply on the tiled kernel under tier `isa` (AMX tiles take head dims that are a multiple of
// 32; others fall back to vdpbf16ps).
inline Bf16Kernel bf16_kernel(Isa isa = active_isa()) {
  if (!uses_bf16_products(isa)) return Bf16Kernel::f32;
#if defined(CASCADE_AMX_KERNEL)
  if (amx_tiles()) return Bf16Kernel::tiles;
#endif
  return Bf16Kernel::dot;
}

// How the few-rows kernel (the per-sequence pass) multiplies bf16 K/V under tier `isa`: on vdpbf16ps wherever the
// tiled kernel takes bf16 products, except where those run on AMX tiles and vdpbf16ps is slower than this CPU's
// f32 FMAs (Sapphire Rapids: half their rate); else in f32.
inline Bf16Kernel few_bf16_kernel(Isa isa = active_isa()) {
  switch (bf16_kernel(isa)) {
    case Bf16Kernel::f32: return Bf16Kernel::f32;
    case Bf16Kernel::dot: return Bf16Kernel::dot;
    case Bf16Kernel::tiles: break;
  }
  const bool set_on = detail::bf16_products_flag().load(std::memory_order_relaxed) == 1;  // set_bf16_products(true)
  return set_on || detail::bf16_dots_faster() ? Bf16Kernel::dot : Bf16Kernel::f32;
}

// The name of the bf16 kernel (for reports): "" (f32), "+bf16" (vdpbf16ps) or "+amx".
inline const char* bf16_kernel_suffix(Bf16Kernel k) {
  return k == Bf16Kernel::tiles ? "+amx" : k == Bf16Kernel::dot ? "+bf16" : "";
}

// Whether a pass with rows_per_head stacked rows per KV head runs on the few-rows kernel (one item carries
// every KV head) under tier `isa`: it needs a head dim that is a multiple of a vector width (the AVX-512 one
// takes multiples of 16; an AVX-512 CPU runs the AVX2 one for head dims like 72 or 200). The portable tier
// runs every pass head by head.
inline bool use_few_rows(int64_t rows_per_head, int head_dim, Isa isa = active_isa()) {
  return rows_per_head <= kFewRows && isa != Isa::portable && head_dim % 8 == 0;
}

// The tier whose code runs a call of either kernel shape under tier `isa`.
inline Isa kernel_tier(bool few, int head_dim, Isa isa = active_isa()) {
  if (isa == Isa::avx512 && (!few || head_dim % 16 == 0)) return Isa::avx512;
  if (isa >= Isa::avx2 && (!few || head_dim % 8 == 0)) return Isa::avx2;
  return Isa::portable;
}

// Attends heads [kvh, kvh + n_heads) of kv (q, o: (n_heads, n_rows, head_dim), f32; lse: (n_heads, n_rows),
// natural log) to tokens [t0, t1) under mask (row and key indices relative to the first row and to token 0
// of kv), q times `scale`, on the few-rows kernel (few: at most kFewRows rows) or the tiled one, in the
// widest tier active_isa() allows. Rows that see no key get (0, -inf).
template <class Mask>
void attend_range_dispatch(bool few, const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh,
                           int64_t t0, int64_t t1, const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  few = few && n_rows <= kFewRows;  // more rows take the tiled kernel, whatever the caller planned
#if CASCADE_X86
  const Isa isa = active_isa();
  switch (kernel_tier(few, kv.head_dim, isa)) {
    case Isa::avx512:
      return avx512::attend(few, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale,
                            few ? few_bf16_kernel(isa) : bf16_kernel(isa), o, lse, sc);
    case Isa::avx2: return avx2::attend(few, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
    case Isa::portable: break;
  }
#endif
  dispatch_dtype(kv.dtype, [&]<class T>() {
    portable::attend_heads<T, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
  });
}

#if defined(CASCADE_EXTERN_KERNELS)
// Compiled once, one unit per tier, in kernels/.
#define CASCADE_CPU_KERNEL_EXTERN(M)                                                                              \
  extern template void portable::attend_heads<float, M>(const float*, int64_t, int, const KvView&, int, int64_t,  \
                                                        int64_t, const M&, float, float*, float*, Scratch&);       \
  extern template void portable::attend_heads<f16, M>(const float*, int64_t, int, const KvView&, int, int64_t,    \
                                                      int64_t, const M&, float, float*, float*, Scratch&);         \
  extern template void portable::attend_heads<bf16, M>(const float*, int64_t, int, const KvView&, int, int64_t,   \
                                                       int64_t, const M&, float, float*, float*, Scratch&);        \
  CASCADE_CPU_KERNEL_EXTERN_X86(M)                                                                                \
  extern template void attend_range_dispatch<M>(bool, const float*, int64_t, int, const KvView&, int, int64_t,    \
                                                int64_t, const M&, float, float*, float*, Scratch&);
#if CASCADE_X86
#define CASCADE_CPU_KERNEL_EXTERN_X86(M)                                                                           \
  extern template void avx512::attend<M>(bool, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,   \
                                         const M&, float, Bf16Kernel, float*, float*, Scratch&);                   \
  extern template void avx2::attend<M>(bool, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,     \
                                       const M&, float, float*, float*, Scratch&);
#else
#define CASCADE_CPU_KERNEL_EXTERN_X86(M)
#endif
CASCADE_CPU_KERNEL_EXTERN(LimitMask)
CASCADE_CPU_KERNEL_EXTERN(UnifiedMask)
#endif

}  // namespace cascade::cpu
