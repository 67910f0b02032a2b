// cascade-kernel-variants: the CPU attention kernels side by side, one work item at a time.
//
//   cascade-kernel-variants VARIANT [--rows R] [--heads H] [--keys N] [--dim D]
//                           [--kv-dtype f32|f16|bf16|q8_0] [--reps N] [--cold]
//
// A work item: R stacked query rows per KV head, H KV heads, N keys, head dim D. The variant runs on one
// thread; its output is first checked element by element against a double-precision reference
// (|o - ref| <= atol + rtol |ref|, and lse), then it is timed (best of --reps; --cold reads K/V from memory,
// flushing the caches before each repetition) and reported beside the machine's measured peaks:
// GFLOP/s (4 R N H D per item) against the f32 FMA peak (or the bf16 one for bf16 products, the AMX tiles' for
// those), and GB/s of
// K/V read against the read bandwidth.
//
// Variants (production kernels are 1-7, 18-20; the rest are register-blocking alternatives of the same templates,
// kept to show why production picks what it picks). With q8_0 K/V, q is put on the q8_0 grid (which variant 20
// quantizes exactly), and variants 2, 3, 6 and 7 multiply codes times scales in f32:
//   1  portable tiled: the AVX2 tier's drivers on 8 plain floats, one head at a time
//   2  AVX2 tiled: 8 rows x 8 keys in registers
//   3  AVX-512 tiled, f32 products: 16 rows x 16 keys in registers
//   4  AVX-512 tiled, bf16 products (bf16 K/V, AVX512_BF16) on vdpbf16ps: 16 rows x 16 keys
//   5  portable few-rows: all heads of a token range, on 8 plain floats
//   6  AVX2 few-rows: all heads of a token range, lanes along the head dim
//   7  AVX-512 few-rows
//   8  AVX-512 tiled, f32 products: 32 rows x 8 keys
//   9  AVX-512 tiled, f32 products: 16 rows x 8 keys
//  10  AVX-512 tiled, bf16 products: 32 rows x 8 keys
//  11  AVX2 tiled: 8 rows x 12 keys
//  12  AVX2 tiled: 16 rows x 4 keys
//  13  AVX-512 few-rows, scores 8 rows x 2 keys at a time (production: 4 x 4)
//  14  AVX2 few-rows, scores 4 rows x 2 keys at a time (production: 2 x 4)
//  15  AVX-512 few-rows without its software prefetch (try --cold; docs/study.md §7 has what it costs)
//  16  AVX2 few-rows without its software prefetch
//  17  AVX-512 few-rows, scores head by head over a whole tile (production: every head of 16 keys, then the next)
//  18  AVX-512 tiled, bf16 products on AMX tiles (bf16 K/V, head dim a multiple of 32; where the OS grants tiles)
//  19  AVX-512 few-rows, bf16 products on vdpbf16ps (bf16 K/V, head dim a multiple of 32)
//  20  AVX-512 few-rows, int8 products on vpdpbusd and vpdpwssd (q8_0 K/V, AVX512_VNNI, head dim a multiple of 64)
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "machine.hpp"  // bench/: the measured peaks and bandwidth
#include "cascade/cpu/kernel.hpp"
#include "cascade/reference.hpp"

namespace {

using namespace cascade;
using namespace cascade::cpu;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "cascade-kernel-variants: error: %s\n", msg.c_str());
  std::exit(1);
}

struct Problem {
  int64_t rows = 32, keys = 4096;
  int heads = 1, dim = 128;
  DType dtype = DType::f16;
  std::vector<uint8_t> k, v;  // (keys, heads, dim)
  std::vector<f16> k_scales, v_scales;  // q8_0: (keys, heads, dim / 32)
  std::vector<float> q;       // (heads, rows, dim)
  std::vector<int64_t> limit;
  KvView kv;
  float scale = 0;
};

using Run = std::function<void(const Problem&, float* o, float* lse, Scratch& sc)>;

struct Variant {
  const char* name;
  Run run;
  bool bf16_products = false;  // rounds q and the weights to bf16: checked at that error bound
  bool available = true;
  bool amx = false;  // on AMX tiles: timed against their peak
  bool int8_products = false;  // P V's weights rounded to 16 bits a tile: checked at that error bound
};

template <class F>
Run per_head(F f) {
  return [f](const Problem& p, float* o, float* lse, Scratch& sc) {
    const LimitMask mask{p.limit.data()};
    for (int h = 0; h < p.heads; ++h)
      f(p, p.q.data() + h * p.rows * p.dim, p.kv, h, mask, o + h * p.rows * p.dim, lse + h * p.rows, sc);
  };
}

// The templates at a fixed (T, D): the variants below are instantiated for the problem's dtype and dim.
template <template <class, int> class K>
Run typed(const Problem& p) {
  Run r;
  dispatch_dtype(p.dtype, [&]<class T>() {
    if (p.dim == 64) r = K<T, 64>::run();
    else if (p.dim == 128) r = K<T, 128>::run();
    else r = K<T, 0>::run();
  });
  return r;
}

#if CASCADE_X86
template <int RV, int NK>
struct Avx512Tile {
  template <class T, int D>
  struct K {
    static Run run() {
      return per_head([](const Problem& p, const float* q, const KvView& kv, int h, const LimitMask& m, float* o,
                         float* lse, Scratch& sc) {
        avx512::tile_attend<T, D, RV, NK, LimitMask>(q, p.rows, kv, h, 0, p.keys, m, p.scale, o, lse, sc);
      });
    }
  };
};
template <int RV, int NK>
struct Avx512Bf16Tile {
  template <class T, int D>
  struct K {
    static Run run() {
      return per_head([](const Problem& p, const float* q, const KvView& kv, int h, const LimitMask& m, float* o,
                         float* lse, Scratch& sc) {
        avx512_bf16::tile_attend<D, RV, NK, LimitMask>(q, p.rows, kv, h, 0, p.keys, m, p.scale, o, lse, sc);
      });
    }
  };
};
template <int RV, int NK>
struct Avx2Tile {
  template <class T, int D>
  struct K {
    static Run run() {
      return per_head([](const Problem& p, const float* q, const KvView& kv, int h, const LimitMask& m, float* o,
                         float* lse, Scratch& sc) {
        avx2::tile_attend<T, D, RV, NK, LimitMask>(q, p.rows, kv, h, 0, p.keys, m, p.scale, o, lse, sc);
      });
    }
  };
};
template <int RG, int KG, bool Prefetch = true, int64_t KC = avx512::kFewChunk>
struct Avx512Few {
  template <class T, int D>
  struct K {
    static Run run() {
      return [](const Problem& p, float* o, float* lse, Scratch& sc) {
        avx512::few_attend<T, D / 16, LimitMask, RG, KG, Prefetch, KC>(
            p.q.data(), p.rows, p.heads, p.kv, 0, 0, p.keys, LimitMask{p.limit.data()}, p.scale, o, lse, sc);
      };
    }
  };
};
template <int RG, int KG, bool Prefetch = true>
struct Avx2Few {
  template <class T, int D>
  struct K {
    static Run run() {
      return [](const Problem& p, float* o, float* lse, Scratch& sc) {
        avx2::few_attend<T, D / 8, LimitMask, RG, KG, Prefetch>(p.q.data(), p.rows, p.heads, p.kv, 0, 0, p.keys,
                                                               LimitMask{p.limit.data()}, p.scale, o, lse, sc);
      };
    }
  };
};
#endif

// The production kernel chosen under tier `isa` (and bf16 products, AMX tiles), as a pass with that kernel shape
// runs it (more rows than the few-rows kernel takes go to the tiled one, as the plan would send them).
Run production(Isa isa, bool few, bool bf16_products, bool amx = false, bool int8_products = false) {
  return [=](const Problem& p, float* o, float* lse, Scratch& sc) {
    cpu::KernelOptions opt;
    opt.isa_limit = isa;
    opt.bf16_products = bf16_products ? 1 : 0;
    opt.amx_tiles = amx;
    opt.int8_products = int8_products ? 1 : 0;
    const bool few_here = few && p.rows <= kFewRows;
    const KernelChoice k =
        cpu::choose_kernel(few_here ? KernelShape::few_rows : KernelShape::tiled, p.dtype, p.dim, opt);
    const LimitMask mask{p.limit.data()};
    if (few_here) {
      run_kernel(k, p.q.data(), p.rows, p.heads, p.kv, 0, 0, p.keys, mask, p.scale, o, lse, sc);
    } else {
      for (int h = 0; h < p.heads; ++h)
        run_kernel(k, p.q.data() + h * p.rows * p.dim, p.rows, 1, p.kv, h, 0, p.keys, mask, p.scale,
                   o + h * p.rows * p.dim, lse + h * p.rows, sc);
    }
  };
}

std::vector<Variant> variants(const Problem& p) {
  const bool avx2 = detected_isa() >= Isa::avx2, avx512 = detected_isa() >= Isa::avx512;
  const bool bf16 = avx512 && cpu_features().avx512_bf16 && p.dtype == DType::bf16 && p.dim % 2 == 0;
  std::vector<Variant> v;
  v.push_back({"portable tiled 8x8", production(Isa::portable, false, false)});
  v.push_back({"AVX2 tiled 8x8", production(Isa::avx2, false, false), false, avx2});
  v.push_back({"AVX-512 tiled 16x16, f32 products", production(Isa::avx512, false, false), false, avx512});
  v.push_back({"AVX-512 tiled 16x16, bf16 products on vdpbf16ps", production(Isa::avx512, false, true), true, bf16});
  v.push_back({"portable few-rows", production(Isa::portable, true, false), false, p.dim % 8 == 0});
  v.push_back({"AVX2 few-rows", production(Isa::avx2, true, false), false, avx2 && p.dim % 8 == 0});
  v.push_back({"AVX-512 few-rows", production(Isa::avx512, true, false), false, avx512 && p.dim % 16 == 0});
#if CASCADE_X86
  const bool b = p.dtype == DType::bf16;
  v.push_back({"AVX-512 tiled 32x8, f32 products", typed<Avx512Tile<2, 8>::K>(p), false, avx512});
  v.push_back({"AVX-512 tiled 16x8, f32 products", typed<Avx512Tile<1, 8>::K>(p), false, avx512});
  v.push_back({"AVX-512 tiled 32x8, bf16 products", b ? typed<Avx512Bf16Tile<2, 8>::K>(p) : Run{}, true, bf16});
  v.push_back({"AVX2 tiled 8x12", typed<Avx2Tile<1, 12>::K>(p), false, avx2});
  v.push_back({"AVX2 tiled 16x4", typed<Avx2Tile<2, 4>::K>(p), false, avx2});
  // The few-rows alternatives run the kernel templates directly, which take at most kFewRows rows (production
  // hands more to the tiled kernel).
  const bool few = p.rows <= kFewRows;
  v.push_back({"AVX-512 few-rows, scores 8x2", typed<Avx512Few<8, 2>::K>(p), false,
               few && avx512 && p.dim % 16 == 0});
  v.push_back({"AVX2 few-rows, scores 4x2", typed<Avx2Few<4, 2>::K>(p), false, few && avx2 && p.dim % 8 == 0});
  v.push_back({"AVX-512 few-rows, no software prefetch", typed<Avx512Few<4, 4, false>::K>(p), false,
               few && avx512 && p.dim % 16 == 0});
  v.push_back({"AVX2 few-rows, no software prefetch", typed<Avx2Few<2, 4, false>::K>(p), false,
               few && avx2 && p.dim % 8 == 0});
  v.push_back({"AVX-512 few-rows, scores head by head over a whole tile",
               typed<Avx512Few<4, 4, true, avx512::kFewTile>::K>(p), false, few && avx512 && p.dim % 16 == 0});
  v.push_back({"AVX-512 tiled, bf16 products on AMX tiles", production(Isa::avx512, false, true, true), true,
               bf16 && amx_usable() && p.dim % 32 == 0, true});
  v.push_back({"AVX-512 few-rows, bf16 products on vdpbf16ps", production(Isa::avx512, true, true), true,
               bf16 && p.dim % 32 == 0});
  v.push_back({"AVX-512 few-rows, int8 products on vpdpbusd and vpdpwssd",
               production(Isa::avx512, true, false, false, true), false,
               avx512 && cpu_features().avx512_vnni && p.dtype == DType::q8_0 && p.dim % 64 == 0, false, true});
#endif
  return v;
}

// o, lse of every (head, row) in double precision, from the stored K/V values.
void reference(const Problem& p, std::vector<double>& o, std::vector<double>& lse) {
  const int64_t d = p.dim;
  o.assign(size_t(p.heads * p.rows * d), 0.0);
  lse.assign(size_t(p.heads * p.rows), 0.0);
  std::vector<double> s(static_cast<size_t>(p.keys));
  {
    const auto kb = [&](int64_t j, int h, int64_t i) { return kv_element(p.kv, p.kv.k, j, h, i); };
    const auto vb = [&](int64_t j, int h, int64_t i) { return kv_element(p.kv, p.kv.v, j, h, i); };
    for (int h = 0; h < p.heads; ++h)
      for (int64_t r = 0; r < p.rows; ++r) {
        const float* q = p.q.data() + (h * p.rows + r) * d;
        double mx = -INFINITY;
        for (int64_t j = 0; j < p.keys; ++j) {
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) dot += double(q[i]) * kb(j, h, i);
          s[size_t(j)] = dot * p.scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        double* out = o.data() + (h * p.rows + r) * d;
        for (int64_t j = 0; j < p.keys; ++j) {
          const double w = std::exp(s[size_t(j)] - mx);
          sum += w;
          for (int64_t i = 0; i < d; ++i) out[i] += w * vb(j, h, i);
        }
        for (int64_t i = 0; i < d; ++i) out[i] /= sum;
        lse[size_t(h * p.rows + r)] = mx + std::log(sum);
      }
  }
}

// The command line: the problem's sizes into p, and the run's own settings.
struct Options {
  int which = 0;  // the variant, 1-based
  int reps = 20;
  bool cold = false;
};

Options parse_args(int argc, char** argv, Problem& p) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(f + " needs a value");
      return argv[++i];
    };
    if (f == "--rows") p.rows = std::stoll(value());
    else if (f == "--heads") p.heads = std::stoi(value());
    else if (f == "--keys") p.keys = std::stoll(value());
    else if (f == "--dim") p.dim = std::stoi(value());
    else if (f == "--kv-dtype") p.dtype = parse_dtype(value());
    else if (f == "--reps") opt.reps = std::stoi(value());
    else if (f == "--cold") opt.cold = true;
    else if (f == "-h" || f == "--help") {
      std::printf("usage: cascade-kernel-variants VARIANT [--rows R] [--heads H] [--keys N] [--dim D] "
                  "[--kv-dtype f32|f16|bf16|q8_0] [--reps N] [--cold]\n(variants: see the source's header)\n");
      std::exit(0);
    } else if (f[0] != '-' && opt.which == 0) opt.which = std::stoi(f);
    else die("unknown argument '" + f + "'");
  }
  if (p.rows < 1 || p.heads < 1 || p.keys < 1 || p.dim < 1 || opt.reps < 1) die("sizes must be positive");
  return opt;
}

// Random K/V and q (uniform in [-1, 1), a fixed seed), every row seeing every key, scale 1/sqrt(dim). q8_0: K/V
// quantized, q on the q8_0 grid.
void fill_problem(Problem& p) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t n_kv = p.keys * p.heads * p.dim;
  p.k.resize(size_t(n_kv * dtype_size(p.dtype)));
  p.v.resize(p.k.size());
  const auto q8 = [&](std::vector<uint8_t>& codes, std::vector<f16>& scales, std::vector<float>& x) {
    scales.resize(x.size() / kQ8Block);
    quantize_q8_0(x.data(), int64_t(x.size()), reinterpret_cast<int8_t*>(codes.data()), scales.data());
  };
  dispatch_dtype(p.dtype, [&]<class T>() {
    if constexpr (std::is_same_v<T, Q8Code>) {
      std::vector<float> x(static_cast<size_t>(n_kv));
      for (float& e : x) e = u(rng);
      q8(p.k, p.k_scales, x);
      for (float& e : x) e = u(rng);
      q8(p.v, p.v_scales, x);
    } else {
      T* k = reinterpret_cast<T*>(p.k.data());
      T* v = reinterpret_cast<T*>(p.v.data());
      for (int64_t i = 0; i < n_kv; ++i) {
        k[i] = T(u(rng));
        v[i] = T(u(rng));
      }
    }
  });
  p.kv = KvView::contiguous(reinterpret_cast<const float*>(p.k.data()), reinterpret_cast<const float*>(p.v.data()),
                            p.keys, p.heads, p.dim);
  p.kv.dtype = p.dtype;
  p.kv.k_scales = p.k_scales.data();
  p.kv.v_scales = p.v_scales.data();
  p.q.resize(size_t(p.heads * p.rows * p.dim));
  for (float& x : p.q) x = u(rng);
  if (p.dtype == DType::q8_0) {
    std::vector<int8_t> codes(p.q.size());
    std::vector<f16> scales(p.q.size() / kQ8Block);
    quantize_q8_0(p.q.data(), int64_t(p.q.size()), codes.data(), scales.data());
    dequantize_q8_0(codes.data(), scales.data(), int64_t(p.q.size()), p.q.data());
  }
  p.limit.assign(size_t(p.rows), p.keys);
  p.scale = 1.0f / std::sqrt(float(p.dim));
}

// Runs the variant once into o, lse and checks every element against the reference; prints the verdict.
bool check(const Problem& p, const Variant& var, int which, std::vector<float>& o, std::vector<float>& lse,
           Scratch& sc) {
  std::vector<double> ref_o, ref_lse;
  reference(p, ref_o, ref_lse);
  o.resize(ref_o.size());
  lse.resize(ref_lse.size());
  var.run(p, o.data(), lse.data(), sc);
  // f32 products: a few 1e-6; bf16 products: each weight within 2^-8; int8 products: the weights of a tile of 64
  // keys within 1/65534 of their largest (|v| <= 1).
  const double atol = var.bf16_products ? 0x1p-8 + 1e-5 : var.int8_products ? 64.0 / 65534 + 1e-5 : 1e-5;
  const double rtol = var.bf16_products ? 0 : 1e-4;
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const double err = std::abs(o[i] - ref_o[i]);
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::abs(ref_o[i]))) ++bad;
  }
  for (size_t i = 0; i < lse.size(); ++i)
    if (!(std::abs(lse[i] - ref_lse[i]) <= 1e-5 + 1e-5 * std::abs(ref_lse[i]))) ++bad;
  std::printf("variant %d: %s\n  rows %lld, heads %d, keys %lld, dim %d, %s: max |o - ref| = %.2e, %s\n", which,
              var.name, (long long)p.rows, p.heads, (long long)p.keys, p.dim, dtype_name(p.dtype), worst,
              bad ? "FAILED" : "ok");
  return bad == 0;
}

// Times the variant (best of opt.reps, caches flushed before each when opt.cold) and prints its rates beside
// the peak it is held to (and the read bandwidth when cold).
void time_variant(const Problem& p, const Variant& var, const Options& opt, std::vector<float>& o,
                  std::vector<float>& lse, Scratch& sc) {
  bench::CacheFlusher flusher;
  double best = 1e30;
  for (int rep = 0; rep < opt.reps; ++rep) {
    if (opt.cold) flusher.flush();
    const double t0 = bench::now_s();
    var.run(p, o.data(), lse.data(), sc);
    best = std::min(best, bench::now_s() - t0);
  }
  const double flops = 4.0 * double(p.rows) * double(p.keys) * p.heads * p.dim;
  const double bytes = 2.0 * double(p.keys * p.heads * p.dim) * kv_element_bytes(p.dtype);
  const double peak = var.amx             ? bench::measure_amx_peak(1)
                      : var.bf16_products ? bench::measure_bf16_peak(1)
                                          : bench::measure_fma_peak(1);
  const double bw = opt.cold ? bench::measure_read_bandwidth(1) : 0;
  std::printf("  %.3f ms: %.1f GFLOP/s (%.0f%% of the %s peak %.1f), %.1f GB/s of K/V", best * 1e3,
              flops / best / 1e9, 100 * flops / best / peak,
              var.amx ? "AMX tile" : var.bf16_products ? "bf16" : "f32 FMA", peak / 1e9,
              bytes / best / 1e9);
  if (opt.cold) std::printf(" (%.0f%% of the read bandwidth %.1f)", 100 * bytes / best / bw, bw / 1e9);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Problem p;
  const Options opt = parse_args(argc, argv, p);
  fill_problem(p);
  const auto all = variants(p);
  if (opt.which < 1 || opt.which > int(all.size())) die("VARIANT must be 1.." + std::to_string(all.size()));
  const Variant& var = all[size_t(opt.which - 1)];
  if (!var.available || !var.run)
    die(std::string(var.name) + ": not available for this CPU, dtype, head dim or row count");
  if (var.bf16_products)  // bf16 products round q: give them bf16 queries, as a bf16 model would
    for (float& x : p.q) x = float(bf16(x));

  std::vector<float> o, lse;
  Scratch sc;
  if (!check(p, var, opt.which, o, lse, sc)) return 1;
  time_variant(p, var, opt, o, lse, sc);
  return 0;
}
