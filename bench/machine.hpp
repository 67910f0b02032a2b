// The machine's own limits, measured in the run that uses them: memory read bandwidth (a streaming sum
// over a buffer far larger than the caches) and f32 matrix-multiply rate (Eigen products of the shape the
// shared pass uses, one per thread). Both use the thread count of the rows they are compared with.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdint>
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

}  // namespace bench
