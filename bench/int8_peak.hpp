// The machine's integer multiply-add peak, measured with the instruction each linear path's kernels are built
// on (model/linear.hpp), in int8 operations per second (a multiply-add counts 2), all threads at once.
//
//   avx512-vnni  vpdpbusd on 16 lanes (64 multiply-adds per instruction)
//   avx-vnni     vpdpbusd on 8 lanes (32)
//   avx2         vpmaddubsw + vpmaddwd + vpaddd on 8 lanes (32 per three instructions)
// Each thread runs 12 independent accumulator chains, enough to cover the instructions' latency; the best of 5
// runs is kept. The portable path has no such peak (0). measure_amx_int8_peak: AMX tiles' tdpbsud (16,384
// multiply-adds per instruction) on four independent 16 x 16 sums, where the process may run them.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "model/linear.hpp"

namespace bench {

namespace int8_peak_detail {

constexpr int kChains = 12;
constexpr int64_t kIters = 1 << 18;

#if CASCADE_X86
// Each returns a value derived from every chain, so nothing is optimized away.
__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) inline int64_t run_vnni512(int64_t iters, int seed) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c + seed);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(int8_t(seed | 1));
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_epi32(s, acc[c]);
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2,avxvnni"), noinline)) inline int64_t run_vnni256(int64_t iters, int seed) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c + seed);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(int8_t(seed | 1));
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
  __m256i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}

__attribute__((target("avx2"), noinline)) inline int64_t run_maddubs(int64_t iters, int seed) {
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c + seed);
  // The products take no accumulator, so with constant operands the compiler would make them once, outside the
  // loop, and time the additions alone: `a` is made opaque every iteration, and each chain has its own b (no
  // product is the same as another's).
  __m256i a = _mm256_set1_epi8(3), b[kChains];
  for (int c = 0; c < kChains; ++c) b[c] = _mm256_set1_epi8(int8_t((seed + 2 * c) | 1));
  const __m256i one = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+x"(a));
    for (int c = 0; c < kChains; ++c)
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[c]), one));
  }
  __m256i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#endif

#if CASCADE_X86 && defined(__x86_64__)
// tdpbsud into four C tiles from two A and two B tiles (16 x 64 bytes each), iters times; tiles configured and
// released here (per-thread state).
inline void run_amx_int8(int64_t iters) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  alignas(64) static const int8_t ones[16 * 64] = {};
  __asm__ volatile("ldtilecfg\t%0" ::"m"(cfg));
  __asm__ volatile(
      "{tileloadd\t(%0,%1,1), %%tmm4|tileloadd\t%%tmm4, [%0+%1*1]}\n\t"
      "{tileloadd\t(%0,%1,1), %%tmm5|tileloadd\t%%tmm5, [%0+%1*1]}\n\t"
      "{tileloadd\t(%0,%1,1), %%tmm6|tileloadd\t%%tmm6, [%0+%1*1]}\n\t"
      "{tileloadd\t(%0,%1,1), %%tmm7|tileloadd\t%%tmm7, [%0+%1*1]}\n\t"
      "tilezero\t%%tmm0\n\ttilezero\t%%tmm1\n\ttilezero\t%%tmm2\n\ttilezero\t%%tmm3" ::"r"(ones),
      "r"(int64_t(64))
      : "memory");
  for (int64_t i = 0; i < iters; ++i)
    __asm__ volatile(
        "{tdpbsud\t%%tmm6, %%tmm4, %%tmm0|tdpbsud\t%%tmm0, %%tmm4, %%tmm6}\n\t"
        "{tdpbsud\t%%tmm7, %%tmm4, %%tmm1|tdpbsud\t%%tmm1, %%tmm4, %%tmm7}\n\t"
        "{tdpbsud\t%%tmm6, %%tmm5, %%tmm2|tdpbsud\t%%tmm2, %%tmm5, %%tmm6}\n\t"
        "{tdpbsud\t%%tmm7, %%tmm5, %%tmm3|tdpbsud\t%%tmm3, %%tmm5, %%tmm7}" ::);
  __asm__ volatile("tilerelease" ::: "memory");
}
#endif

}  // namespace int8_peak_detail

// int8 operations per second of AMX tiles' tdpbsud with n_threads threads; 0 where the process may not run them
// (cascade::linear::amx_int8_usable()).
inline double measure_amx_int8_peak(int n_threads) {
  namespace d = int8_peak_detail;
  if (!cascade::linear::amx_int8_usable()) return 0;
  double best = 0;
#if CASCADE_X86 && defined(__x86_64__)
  const int64_t iters = 1 << 16;
  const double ops = 2.0 * 4 * 16 * 16 * 64 * double(iters);
  tbb::task_arena arena(n_threads);
  arena.execute([&] {
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<double> rate(static_cast<size_t>(n_threads));
      tbb::parallel_for(0, n_threads, [&](int t) {
        const auto t0 = std::chrono::steady_clock::now();
        d::run_amx_int8(iters);
        rate[size_t(t)] = ops / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }, tbb::static_partitioner());
      double total = 0;
      for (double v : rate) total += v;
      best = std::max(best, total);
    }
  });
#endif
  return best;
}

// int8 operations per second of path's instruction with n_threads threads; 0 for the portable path.
inline double measure_int8_peak(cascade::linear::Path path, int n_threads) {
  using cascade::linear::Path;
  namespace d = int8_peak_detail;
  if (path == Path::portable || !cascade::linear::can_run(path)) return 0;
  const double ops_per_iter = 2.0 * d::kChains * (path == Path::avx512_vnni ? 64 : 32);
  tbb::task_arena arena(n_threads);
  double best = 0;
  arena.execute([&] {
    // Each thread times itself and the rates add up (as machine.hpp's measure_peak): a timing around them all
    // would count a worker that starts late.
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<double> rate(static_cast<size_t>(n_threads));
      tbb::parallel_for(0, n_threads, [&](int t) {
        const auto t0 = std::chrono::steady_clock::now();
        int64_t r = 0;
#if CASCADE_X86
        if (path == Path::avx512_vnni) r = d::run_vnni512(d::kIters, t);
        else if (path == Path::avx_vnni) r = d::run_vnni256(d::kIters, t);
        else r = d::run_maddubs(d::kIters, t);
#endif
        volatile int64_t sink = r;
        (void)sink;
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        rate[size_t(t)] = ops_per_iter * double(d::kIters) / s;
      }, tbb::static_partitioner());
      double total = 0;
      for (double v : rate) total += v;
      best = std::max(best, total);
    }
  });
  return best;
}

}  // namespace bench
