// The machine's own limits, measured in the run that uses them: memory read bandwidth (a streaming sum
// over a buffer far larger than the caches), the multiply-add peak of its vector units (f32 FMA, and bf16
// dot products where the CPU has them), and Eigen's f32 matrix-multiply rate for comparison. All use the
// thread count of the rows they are compared with.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <Eigen/Core>

#include "cascade/cpu/kernel.hpp"  // the AMX tiles (kernel_amx.hpp)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace bench {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes of the last-level cache, or 64 MiB when the system doesn't say.
inline int64_t llc_bytes() {
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? int64_t(l3) : int64_t(64) << 20;
}

// Reads a buffer larger than the last-level cache, so the next timed run finds its data in memory, not
// in cache. Reading (not writing) leaves no dirty lines whose write-back would slow the timed run.
class CacheFlusher {
 public:
  CacheFlusher() : buf_(size_t(std::min<int64_t>(2 * llc_bytes(), int64_t(1) << 30) / 4), 1.0f) {}
  void flush() {
    tbb::enumerable_thread_specific<float> sums(0.0f);
    tbb::parallel_for(tbb::blocked_range<size_t>(0, buf_.size(), 1 << 16), [&](const tbb::blocked_range<size_t>& r) {
      sums.local() += Eigen::Map<const Eigen::ArrayXf>(buf_.data() + r.begin(), Eigen::Index(r.size())).sum();
    });
    sink_ = sink_ + sums.combine([](float a, float b) { return a + b; });
  }

 private:
  std::vector<float> buf_;
  volatile float sink_ = 0;
};

// Best-of-5 read bandwidth in bytes/s with n_threads threads over a buffer of `bytes` (default: 4x the
// last-level cache, at least 256 MiB, at most 2 GiB).
inline double measure_read_bandwidth(int n_threads, int64_t bytes = 0) {
  if (bytes == 0) bytes = std::clamp<int64_t>(4 * llc_bytes(), int64_t(256) << 20, int64_t(2) << 30);
  const size_t n = size_t(bytes / 4);
  std::vector<float> buf(n);
  tbb::task_arena arena(n_threads);
  double best = 0;
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 16), [&](const tbb::blocked_range<size_t>& r) {
      for (size_t i = r.begin(); i < r.end(); ++i) buf[i] = float(i & 7);
    });
    for (int rep = 0; rep < 5; ++rep) {
      tbb::enumerable_thread_specific<double> sums(0.0);
      const double t0 = now_s();
      tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 1 << 18), [&](const tbb::blocked_range<size_t>& r) {
        Eigen::Map<const Eigen::ArrayXf> a(buf.data() + r.begin(), Eigen::Index(r.size()));
        sums.local() += a.sum();
      });
      const double dt = now_s() - t0;
      volatile double sink = sums.combine([](double x, double y) { return x + y; });
      (void)sink;
      best = std::max(best, double(bytes) / dt);
    }
  });
  return best;
}

// Best-of-5 f32 matrix-multiply rate in FLOP/s: every thread multiplies (m x k) by (k x n) repeatedly.
inline double measure_gemm_rate(int n_threads, int m = 128, int n = 128, int k = 128) {
  tbb::task_arena arena(n_threads);
  double best = 0;
  const int per_task = 64;
  arena.execute([&] {
    const int n_tasks = 4 * n_threads;
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = now_s();
      tbb::parallel_for(0, n_tasks, [&](int) {
        Eigen::MatrixXf a = Eigen::MatrixXf::Random(m, k), b = Eigen::MatrixXf::Random(k, n), c(m, n);
        c.setZero();
        for (int i = 0; i < per_task; ++i) c.noalias() += a * b;
        volatile float sink = c(0, 0);
        (void)sink;
      });
      const double dt = now_s() - t0;
      best = std::max(best, 2.0 * m * n * k * per_task * n_tasks / dt);
    }
  });
  return best;
}

// ---- multiply-add peaks --------------------------------------------------------------------------------------
// Each thread runs kChains independent multiply-add chains in registers (enough to cover the latency on any
// current core), so the loop is bound by the vector units alone.

inline constexpr int kPeakChains = 12;
inline constexpr long kPeakIters = 2000000;

#if CASCADE_X86
CASCADE_TARGET_AVX512_BEGIN
// f32 FLOPs done (2 per multiply-add).
inline double fma_loop_avx512(long iters, float* sink) {
  __m512 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_set1_ps(1e-3f * float(c));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  for (long i = 0; i < iters; ++i) {
    CASCADE_UNROLL(12)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < kPeakChains; ++c) s = _mm512_add_ps(s, acc[c]);
  *sink = _mm512_cvtss_f32(s);
  return 2.0 * 16 * kPeakChains * double(iters);
}
CASCADE_TARGET_END

CASCADE_TARGET_AVX512_BF16_BEGIN
// bf16 FLOPs done: vdpbf16ps does 32 multiply-adds of bf16 pairs into 16 f32 lanes.
inline double bf16_loop(long iters, float* sink) {
  __m512 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_set1_ps(1e-3f * float(c));
  const __m512bh a = __m512bh(_mm512_set1_epi16(0x3f80)), b = __m512bh(_mm512_set1_epi16(0x3800));  // 1, 2^-15
  for (long i = 0; i < iters; ++i) {
    CASCADE_UNROLL(12)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < kPeakChains; ++c) s = _mm512_add_ps(s, acc[c]);
  *sink = _mm512_cvtss_f32(s);
  return 2.0 * 32 * kPeakChains * double(iters);
}
CASCADE_TARGET_END

CASCADE_TARGET_AVX2_BEGIN
inline double fma_loop_avx2(long iters, float* sink) {
  __m256 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm256_set1_ps(1e-3f * float(c));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  for (long i = 0; i < iters; ++i) {
    CASCADE_UNROLL(12)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  __m256 s = acc[0];
  for (int c = 1; c < kPeakChains; ++c) s = _mm256_add_ps(s, acc[c]);
  *sink = _mm256_cvtss_f32(s);
  return 2.0 * 8 * kPeakChains * double(iters);
}
CASCADE_TARGET_END
#endif

// SSE multiply and add (any x86-64; separate instructions, as code built for the baseline runs them): the
// portable tier's bound.
inline double fma_loop_portable(long iters, float* sink) {
#if CASCADE_X86
  __m128 acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm_set1_ps(1e-3f * float(c));
  const __m128 a = _mm_set1_ps(0.999f), b = _mm_set1_ps(1e-4f);
  for (long i = 0; i < iters; ++i) {
    CASCADE_UNROLL(12)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], a), b);
  }
  __m128 s = acc[0];
  for (int c = 1; c < kPeakChains; ++c) s = _mm_add_ps(s, acc[c]);
  *sink = _mm_cvtss_f32(s);
  return 2.0 * 4 * kPeakChains * double(iters);
#else
  float acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = 1e-3f * float(c);
  for (long i = 0; i < iters; ++i)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = acc[c] * 0.999f + 1e-4f;
  float s = 0;
  for (int c = 0; c < kPeakChains; ++c) s += acc[c];
  *sink = s;
  return 2.0 * kPeakChains * double(iters);
#endif
}

// Best-of-3 rate in FLOP/s of `loop` run on n_threads threads at once (each its own chains), as the sum of each
// thread's own rate. The loops run on a oneTBB arena's threads, and each times itself: threads of their own
// would share the cores with the pool's workers, which spin for a while after the bandwidth measurement before
// them (the bf16 peak swung from run to run with that: docs/study.md §7), and one timing around them all would
// count a worker that starts late.
inline double measure_peak(int n_threads, double (*loop)(long, float*)) {
  double best = 0;
  n_threads = std::max(1, n_threads);
  std::vector<float> sink(size_t(n_threads) * 16);
  tbb::task_arena arena(n_threads);
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<double> rate(static_cast<size_t>(n_threads));
    arena.execute([&] {
      tbb::parallel_for(0, n_threads, [&](int t) {
        const double t0 = now_s();
        const double flops = loop(kPeakIters, &sink[size_t(t) * 16]);
        rate[size_t(t)] = flops / (now_s() - t0);
      }, tbb::static_partitioner());
    });
    double total = 0;
    for (double r : rate) total += r;
    best = std::max(best, total);
  }
  return best;
}

// The f32 multiply-add peak of n_threads threads with the widest vectors of tier `isa`, in FLOP/s.
inline double measure_fma_peak(int n_threads, cascade::Isa isa = cascade::detected_isa()) {
#if CASCADE_X86
  if (isa == cascade::Isa::avx512) return measure_peak(n_threads, fma_loop_avx512);
  if (isa == cascade::Isa::avx2) return measure_peak(n_threads, fma_loop_avx2);
#endif
  (void)isa;
  return measure_peak(n_threads, fma_loop_portable);
}

#if defined(CASCADE_AMX_KERNEL)
CASCADE_TARGET_AVX512_BF16_BEGIN
// bf16 FLOPs done on AMX tiles: four accumulator tiles in turn, each tdpbf16ps 16 x 16 x 32 multiply-adds (a
// step is ~64 cycles where an FMA loop's is ~6: a tenth of the iterations).
inline double amx_loop(long iters, float* sink) {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  std::fill(a, a + 16 * 32, uint16_t(0x3f80));  // 1
  std::fill(b, b + 16 * 32, uint16_t(0x3800));  // 2^-15
  const long steps = iters / 10;
  {
    const cascade::cpu::amx::Tiles tiles;
    CASCADE_TILE_LOAD(4, a, 64);
    CASCADE_TILE_LOAD(5, b, 64);
    CASCADE_TILE_ZERO(0);
    CASCADE_TILE_ZERO(1);
    CASCADE_TILE_ZERO(2);
    CASCADE_TILE_ZERO(3);
    for (long i = 0; i < steps; ++i) {
      CASCADE_TILE_DPBF16(0, 4, 5);
      CASCADE_TILE_DPBF16(1, 4, 5);
      CASCADE_TILE_DPBF16(2, 4, 5);
      CASCADE_TILE_DPBF16(3, 4, 5);
    }
    CASCADE_TILE_STORE(0, c, 64);
  }
  *sink = c[0];
  return 2.0 * 16 * 16 * 32 * 4 * double(steps);
}
CASCADE_TARGET_END
#endif

// The AMX bf16 tile peak (tdpbf16ps) of n_threads threads in FLOP/s; 0 where the process may not run tiles.
inline double measure_amx_peak(int n_threads) {
#if defined(CASCADE_AMX_KERNEL)
  if (cascade::amx_usable()) return measure_peak(n_threads, amx_loop);
#endif
  (void)n_threads;
  return 0.0;
}

// The bf16 dot-product peak (vdpbf16ps) of n_threads threads in FLOP/s; 0 where the CPU lacks AVX512_BF16.
inline double measure_bf16_peak(int n_threads) {
#if CASCADE_X86
  if (cascade::detected_isa() == cascade::Isa::avx512 && cascade::cpu_features().avx512_bf16)
    return measure_peak(n_threads, bf16_loop);
#endif
  (void)n_threads;
  return 0.0;
}

}  // namespace bench
