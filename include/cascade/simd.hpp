// x86 intrinsics and what this CPU can run.
//
// Include this header before anything that may include <immintrin.h> (Eigen, oneTBB): it is where the
// intrinsics enter a translation unit of this project.
//
// cpu_features() reads CPUID (and XGETBV: the OS must save the wide registers) once. Kernels compiled for
// an instruction set with __attribute__((target(...))) are called only when cpu_features() says the CPU has
// it, so one build runs on any x86-64 and picks the widest path the machine offers.
//
// Isa names the tiers the kernels are written for. active_isa() is the widest tier the CPU has, lowered by
// set_isa_limit() (tests run every tier the machine can; benchmarks and tools report the one they ran).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "cascade/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#define CASCADE_X86 1
// GCC 12.1 and 12.2 ship AVX-512 intrinsics whose "undefined" pass-through operand (`__m512 __Y = __Y;` in
// _mm512_undefined_ps and friends) draws -Wmaybe-uninitialized at every inlined use, in Eigen's code as in
// ours (GCC bug 105593, fixed in 12.3). The pragma covers only the compiler's own header, and only where it
// is first included: our code keeps the warning.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12 && __GNUC_MINOR__ < 3
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define CASCADE_X86 0
#endif

// Target regions. Functions defined between CASCADE_TARGET_<TIER>_BEGIN and CASCADE_TARGET_END are compiled
// for that tier whatever the build's flags (templates too: an instantiation takes the options of its
// definition), so one build carries every tier. Call them only where cpu_features() has the tier. A region
// never includes headers: code outside it (the standard library, Eigen) keeps the build's own flags.
#if CASCADE_X86 && defined(__clang__)
#define CASCADE_TARGET_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define CASCADE_TARGET_AVX512_BEGIN                                                                         \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\"))), \
          apply_to = function)")
#define CASCADE_TARGET_AVX512_BF16_BEGIN                                                                         \
  _Pragma("clang attribute push(__attribute__((target(\"avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\"))), \
          apply_to = function)")
#define CASCADE_TARGET_AVX512_VNNI_BEGIN                                                                         \
  _Pragma("clang attribute push(__attribute__((target(\"avx512vnni,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\"))), \
          apply_to = function)")
#define CASCADE_TARGET_END _Pragma("clang attribute pop")
#elif CASCADE_X86 && defined(__GNUC__)
#define CASCADE_TARGET_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define CASCADE_TARGET_AVX512_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#define CASCADE_TARGET_AVX512_BF16_BEGIN \
  _Pragma("GCC push_options")            \
      _Pragma("GCC target(\"avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#define CASCADE_TARGET_AVX512_VNNI_BEGIN \
  _Pragma("GCC push_options")            \
      _Pragma("GCC target(\"avx512vnni,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#define CASCADE_TARGET_END _Pragma("GCC pop_options")
#endif

// CASCADE_UNROLL(n): unroll the next loop n times (register-blocked kernels keep their accumulators in
// registers only when their small loops are unrolled); nothing under nvcc, whose front end does not know it.
#define CASCADE_PRAGMA(x) _Pragma(#x)
#if defined(__CUDACC__)
#define CASCADE_UNROLL(n)
#else
#define CASCADE_UNROLL(n) CASCADE_PRAGMA(GCC unroll n)
#endif

// CASCADE_ALWAYS_INLINE: a small function the kernels call in their inner loops, inlined whatever the
// compiler's estimate of its size.
#if defined(__GNUC__) || defined(__clang__)
#define CASCADE_ALWAYS_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define CASCADE_ALWAYS_INLINE __forceinline
#else
#define CASCADE_ALWAYS_INLINE inline
#endif

namespace cascade {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;                // the AVX2 + FMA tier (Haswell, Zen 1 and later)
  bool avx_vnni = false;                                       // 256-bit vpdpbusd (Alder Lake, Zen 5)
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false;               // vpdpbusd, vdpbf16ps on zmm
  bool amx_tile = false, amx_bf16 = false;                     // AMX tiles, tdpbf16ps (Sapphire Rapids)
  bool amd = false;                                            // "AuthenticAMD": prefetch hints differ by vendor
  int family = 0;                                              // CPUID's display family (AMD: 25 Zen 3/4, 26 Zen 5)
  // The tiers the kernels are written for.
  bool has_avx2_tier() const { return avx2 && fma && f16c; }
  bool has_avx512_tier() const { return has_avx2_tier() && avx512f && avx512bw && avx512vl && avx512dq; }
};

namespace detail {

inline CpuFeatures read_cpu_features() {
  CpuFeatures f;
#if CASCADE_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.family = int((a >> 8) & 0xF);
  if (f.family == 0xF) f.family += int((a >> 20) & 0xFF);
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave || !avx) return CpuFeatures{};
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (uint64_t(hi) << 32) | lo;            // the register state the OS saves
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;                 // SSE and AVX
  const bool zmm_saved = ymm_saved && (xcr0 & 0xe0) == 0xe0;  // opmask, upper ZMM0-15, ZMM16-31
  const bool tiles_saved = (xcr0 & 0x60000) == 0x60000;       // XTILECFG, XTILEDATA
  if (!ymm_saved) return CpuFeatures{};
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    if (zmm_saved) {
      f.avx512f = b & (1u << 16);
      f.avx512dq = b & (1u << 17);
      f.avx512bw = b & (1u << 30);
      f.avx512vl = b & (1u << 31);
      f.avx512_vnni = c & (1u << 11);
    }
    if (tiles_saved) {
      f.amx_bf16 = d & (1u << 22);
      f.amx_tile = d & (1u << 24);
    }
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = a & (1u << 4);
    if (zmm_saved) f.avx512_bf16 = a & (1u << 5);
  }
#endif
  return f;
}

}  // namespace detail

// What this CPU (and its OS) can run; read once.
inline const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detail::read_cpu_features();
  return features;
}

// Where the attention kernels' software prefetches of K/V go: into L1 (prefetcht0) on AMD cores from Zen 5 on
// (family 26 and later), into L2 (prefetcht1) elsewhere: each was faster from memory on the machines measured
// (docs/study.md §16, §18, §20). Intel cores keep prefetcht1, where the kernels were tuned (prefetcht0 was not
// measured there). The linear layers keep prefetcht1 on every CPU: prefetcht0 slowed them on a Zen 5.
inline bool prefetch_to_l1() {
  static const bool to_l1 = cpu_features().amd && cpu_features().family >= 26;
  return to_l1;
}

// Whether this process may run AMX bf16 tiles: the CPU has them, and the OS grants the process their state
// (Linux asks a process to request it once: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; other systems are not
// asked and run without tiles). Asked once, on the first call.
inline bool amx_usable() {
  static const bool usable = [] {
    const CpuFeatures& f = cpu_features();
    if (!f.amx_tile || !f.amx_bf16 || !f.avx512_bf16) return false;
#if CASCADE_X86 && defined(__linux__) && defined(__x86_64__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

// Kernel tiers, each a superset of the one before: plain C++ (any CPU), AVX2 + FMA + F16C, AVX-512
// (F, BW, VL, DQ). Finer features inside a tier (VNNI, BF16) are read from cpu_features() by the kernel.
enum class Isa : uint8_t { portable = 0, avx2 = 1, avx512 = 2 };

inline constexpr detail::Named<Isa> kIsaNames[] = {
    {Isa::portable, "portable"}, {Isa::avx2, "avx2"}, {Isa::avx512, "avx512"}};
inline const char* isa_name(Isa isa) { return detail::name_of(isa, kIsaNames); }
inline Isa parse_isa(std::string_view s) { return detail::parse_named(s, kIsaNames, "instruction set"); }

// The widest tier this CPU runs.
inline Isa detected_isa() {
  const CpuFeatures& f = cpu_features();
  return f.has_avx512_tier() ? Isa::avx512 : f.has_avx2_tier() ? Isa::avx2 : Isa::portable;
}

namespace detail {
inline std::atomic<uint8_t>& isa_limit() {
  static std::atomic<uint8_t> limit{uint8_t(Isa::avx512)};
  return limit;
}
}  // namespace detail

// Caps the tier every kernel may use from now on, in every thread (default: no cap). A cap above what the
// CPU has changes nothing.
inline void set_isa_limit(Isa isa) { detail::isa_limit().store(uint8_t(isa), std::memory_order_relaxed); }

// The tier kernels use: the CPU's widest, at most the limit.
inline Isa active_isa() {
  const uint8_t cap = detail::isa_limit().load(std::memory_order_relaxed);
  const Isa found = detected_isa();
  return uint8_t(found) < cap ? found : Isa(cap);
}

// Sets a limit for one scope and puts the previous one back after it.
class IsaLimit {
 public:
  explicit IsaLimit(Isa isa) : saved_(Isa(detail::isa_limit().load())) { set_isa_limit(isa); }
  ~IsaLimit() { set_isa_limit(saved_); }
  IsaLimit(const IsaLimit&) = delete;
  IsaLimit& operator=(const IsaLimit&) = delete;

 private:
  Isa saved_;
};

// The CPU's model as CPUID names it ("AMD EPYC 9R14 96-Core Processor"), trimmed; empty when it does not.
inline std::string cpu_model_name() {
  std::string name;
#if CASCADE_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000004u) return name;
  for (unsigned leaf = 0x80000002u; leaf <= 0x80000004u; ++leaf) {
    __get_cpuid(leaf, &a, &b, &c, &d);
    for (unsigned r : {a, b, c, d})
      for (int i = 0; i < 4; ++i) name += char((r >> (8 * i)) & 0xff);
  }
  name.resize(std::min(name.size(), name.find('\0')));
  const size_t first = name.find_first_not_of(' ');
  name = first == std::string::npos ? std::string() : name.substr(first, name.find_last_not_of(' ') - first + 1);
#endif
  return name;
}

// The features of cpu_features() this CPU has, space-separated in a fixed order ("avx2 fma f16c ...").
inline std::string cpu_feature_names() {
  const CpuFeatures& f = cpu_features();
  const std::pair<const char*, bool> all[] = {
      {"avx2", f.avx2},         {"fma", f.fma},           {"f16c", f.f16c},         {"avx_vnni", f.avx_vnni},
      {"avx512f", f.avx512f},   {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl}, {"avx512dq", f.avx512dq},
      {"avx512_vnni", f.avx512_vnni}, {"avx512_bf16", f.avx512_bf16}, {"amx_tile", f.amx_tile},
      {"amx_bf16", f.amx_bf16}};
  std::string names;
  for (const auto& [name, has] : all) {
    if (!has) continue;
    if (!names.empty()) names += ' ';
    names += name;
  }
  return names;
}

}  // namespace cascade
