// The machine's integer multiply-add peak, measured with the instruction each linear path's kernels are built
// on (model/linear.hpp), in int8 operations per second (a multiply-add counts 2), all threads at once.
//
//   avx512-vnni  vpdpbusd on 16 lanes (64 multiply-adds per instruction)
//   avx-vnni     vpdpbusd on 8 lanes (32)
//   avx2         vpmaddubsw + vpmaddwd + vpaddd on 8 lanes (32 per three instructions)
// Each thread runs 12 independent accumulator chains, enough to cover the instructions' latency; the best of 5
// runs is kept. The portable path has no such peak (0).
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
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(int8_t(seed | 1)), one = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c)
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), one));
  __m256i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}
#endif

}  // namespace int8_peak_detail

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
