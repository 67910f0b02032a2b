// calibrate(): fits auto's cost model (auto.hpp) on this machine by running the CPU path (attention.hpp)
// on synthetic plans that isolate each of its terms.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <type_traits>
#include <variant>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/cpu/attention.hpp"
#include "cascade/dtype.hpp"
#include "cascade/kv.hpp"
#include "cascade/q8_0.hpp"
#include "cascade/tree.hpp"

namespace cascade {

inline int64_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return int64_t(l3);
#endif
  return int64_t(64) << 20;
}

namespace calibrate_detail {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of n runs of f, in seconds, after one warm-up run.
template <class F>
double best_of(int n, F&& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < n; ++i) {
    const double t0 = now_s();
    f();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

// One synthetic problem: `n_seq` sequences with one query each, all on one segment of n_tokens keys
// (shared), or each on its own segment of n_tokens keys (independent). With n_groups > 1 (shared only):
// n_groups segments, each shared by n_seq sequences. K/V are stored as `dtype`.
struct Problem {
  // (segment, tokens, heads, dim); q8_0: its codes, and its scales (segment, tokens, heads, dim / 32)
  std::variant<std::vector<float>, std::vector<f16>, std::vector<bf16>, std::vector<int8_t>> k, v;
  std::vector<f16> k_scales, v_scales;
  std::vector<float> q, o;
  std::vector<KvView> views;
  Tree tree;
};

inline Problem make_problem(const HeadShape& shape, DType dtype, int64_t n_tokens, int n_seq, bool shared,
                            std::mt19937& rng, int n_groups = 1) {
  Problem p;
  const int64_t row = int64_t(shape.n_kv_heads) * shape.head_dim;
  const int64_t n_seg = shared ? n_groups : n_seq;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t n = n_seg * n_tokens * row;
  dispatch_dtype(dtype, [&]<class T>() {
    if constexpr (std::is_same_v<T, Q8Code>) {
      std::vector<float> x(static_cast<size_t>(n));
      std::vector<int8_t> k(x.size()), v(x.size());
      p.k_scales.resize(x.size() / kQ8Block);
      p.v_scales.resize(x.size() / kQ8Block);
      for (float& e : x) e = u(rng);
      quantize_q8_0(x.data(), n, k.data(), p.k_scales.data());
      for (float& e : x) e = u(rng);
      quantize_q8_0(x.data(), n, v.data(), p.v_scales.data());
      for (int64_t g = 0; g < n_seg; ++g) {
        const int64_t at = g * n_tokens * row;
        p.views.push_back(KvView::contiguous_q8_0(k.data() + at, p.k_scales.data() + at / kQ8Block, v.data() + at,
                                                  p.v_scales.data() + at / kQ8Block, n_tokens, shape.n_kv_heads,
                                                  shape.head_dim));
      }
      p.k = std::move(k);  // moving a vector keeps its buffer: the views stay valid
      p.v = std::move(v);
    } else {
      std::vector<T> k(static_cast<size_t>(n)), v(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = T(u(rng));
        v[i] = T(u(rng));
      }
      for (int64_t g = 0; g < n_seg; ++g)
        p.views.push_back(KvView::contiguous(k.data() + g * n_tokens * row, v.data() + g * n_tokens * row, n_tokens,
                                             shape.n_kv_heads, shape.head_dim));
      p.k = std::move(k);
      p.v = std::move(v);
    }
  });
  std::vector<std::vector<int>> paths;
  for (int64_t g = 0; g < (shared ? n_groups : 1); ++g)
    for (int s = 0; s < n_seq; ++s) paths.push_back({shared ? int(g) : s});
  const size_t n_paths = paths.size();
  p.tree = Tree::build(shape, std::vector<int64_t>(size_t(n_seg), n_tokens), paths, std::vector<int64_t>(n_paths, 1));
  p.q.resize(n_paths * shape.n_q_heads * shape.head_dim);
  for (float& x : p.q) x = u(rng);
  p.o.resize(p.q.size());
  return p;
}

// Streaming read rate of a buffer of `bytes` with n_threads threads, best of 3.
inline double read_bandwidth(int n_threads, int64_t bytes) {
  std::vector<float> buf(size_t(bytes / 4), 1.0f);
  double best = 0;
  cpu::in_arena(n_threads, [&] {
    for (int rep = 0; rep < 3; ++rep) {
      tbb::enumerable_thread_specific<float> sums(0.0f);
      const double t0 = now_s();
      tbb::parallel_for(tbb::blocked_range<size_t>(0, buf.size(), 1 << 16), [&](const tbb::blocked_range<size_t>& r) {
        sums.local() += Eigen::Map<const Eigen::ArrayXf>(buf.data() + r.begin(), Eigen::Index(r.size())).sum();
      });
      const double dt = now_s() - t0;
      volatile float sink = sums.combine([](float a, float b) { return a + b; });
      (void)sink;
      best = std::max(best, double(bytes) / dt);
    }
  });
  return best;
}

}  // namespace calibrate_detail

// Fits a CostModel on this machine with n_threads threads (0: all), using the library's own kernels on
// K/V of type kv_dtype with `like`'s KV heads and head dim and no GQA (so stacked rows = query tokens): the
// kernels' rates depend on the head dim, the number of heads an item carries and the K/V type, so calibrate
// with the shape and type the model will price (the default stands for small models). Takes about a third
// of a second; cpu/profile_cache.hpp keeps the result per machine so that it runs once. The kernels' rates
// are measured on K/V of 16 MiB at most, which may sit in the last-level
// cache; the streaming read rate, the floor of every pass, is measured on a buffer twice the last-level
// cache (64 to 256 MiB), because a decode step finds most K/V in memory, not in cache (the layers
// and weights read since the last step have evicted it). So a segment folded into several passes
// costs its full memory traffic each time, and folding is chosen only where it saves more than that.
// The model records kv_dtype: auto refuses it for K/V of another type.
inline CostModel calibrate(int n_threads = 0, const HeadShape& like = HeadShape{4, 4, 64},
                           DType kv_dtype = DType::f16) {
  using namespace calibrate_detail;
  CASCADE_CHECK(n_threads >= 0, "calibrate: n_threads is negative (", n_threads, ")");
  CASCADE_CHECK(like.n_kv_heads > 0 && like.head_dim > 0, "calibrate: bad head shape ", like.n_kv_heads, " KV heads of ",
                like.head_dim);
  CASCADE_CHECK(kv_dtype != DType::q8_0 || like.head_dim % kQ8Block == 0, "calibrate: q8_0 K/V need a head dim that is "
                "a multiple of ", kQ8Block, " (got ", like.head_dim, ")");
  CostModel c;
  c.n_threads = n_threads;
  c.n_kv_heads = like.n_kv_heads;
  c.head_dim = like.head_dim;
  c.kv_dtype = kv_dtype;
  const HeadShape shape{like.n_kv_heads, like.n_kv_heads, like.head_dim};
  const cpu::Options opt{n_threads};
  std::mt19937 rng(7);
  const int reps = 5;
  auto time_plan = [&](Problem& p) {
    const Plan plan = cpu::plan(p.tree, opt);
    return best_of(reps, [&] { cpu::run(plan, p.views, p.q.data(), p.o.data()); });
  };
  const auto kv_bytes = [&](int64_t n_tokens) { return CostModel::kv_bytes(shape, kv_dtype, n_tokens); };
  const auto macs = [&](int64_t n_tokens, int m) { return 2.0 * m * double(n_tokens) * shape.n_kv_heads * shape.head_dim; };

  c.read_bw = read_bandwidth(n_threads, std::clamp<int64_t>(2 * last_level_cache_bytes(), int64_t(64) << 20,
                                                             int64_t(256) << 20));

  // Few-rows kernel: 1 and 8 rows over the same 16 MiB segment; the difference is the multiply-adds.
  const int64_t n_small = std::max<int64_t>(256, (int64_t(16) << 20) / int64_t(kv_bytes(1)));
  const int m_hi = int(std::min<int64_t>(8, cpu::few_rows_limit(shape.head_dim, cpu::KernelOptions::process()) >= 8 ? 8 : 1));
  {
    Problem p1 = make_problem(shape, kv_dtype, n_small, 1, true, rng);
    const double t1 = time_plan(p1);
    double per_mac = 0;
    if (m_hi > 1) {
      Problem p8 = make_problem(shape, kv_dtype, n_small, m_hi, true, rng);
      const double t8 = time_plan(p8);
      per_mac = std::max(0.0, (t8 - t1) / (macs(n_small, m_hi) - macs(n_small, 1)));
    }
    if (per_mac <= 0) per_mac = t1 / macs(n_small, 1) * 0.5;
    const double per_byte = std::max(t1 - per_mac * macs(n_small, 1), 0.25 * t1) / kv_bytes(n_small);
    c.small_mac = 1.0 / per_mac;
    c.small_bw = 1.0 / per_byte;
  }
  // Tiled kernel: 32 and 128 rows (one tile each) over one segment; the difference is the multiply-adds.
  {
    const int64_t n_tiled = std::max<int64_t>(64, (int64_t(2) << 20) / int64_t(kv_bytes(1)));
    Problem a = make_problem(shape, kv_dtype, n_tiled, 32, true, rng);
    Problem b = make_problem(shape, kv_dtype, n_tiled, 128, true, rng);
    const double ta = time_plan(a), tb = time_plan(b);
    double per_mac = std::max(0.0, (tb - ta) / (macs(n_tiled, 128) - macs(n_tiled, 32)));
    if (per_mac <= 0) per_mac = tb / macs(n_tiled, 128) * 0.5;
    const double per_byte = std::max(ta - per_mac * macs(n_tiled, 32), 0.1 * ta) / kv_bytes(n_tiled);
    c.tiled_mac = 1.0 / per_mac;
    c.tiled_bw = 1.0 / per_byte;
  }
  // Item overhead: 512 sequences, each alone on a 4-token segment: one tiny item each, plus its merge.
  {
    const int n_seq = 512;
    const int64_t n_tok = 4;
    Problem p = make_problem(shape, kv_dtype, n_tok, n_seq, false, rng);
    const double t = time_plan(p);
    const double work = n_seq * (kv_bytes(n_tok) / c.small_bw + macs(n_tok, 1) / c.small_mac);
    c.item_s = std::max(t - work, 0.5 * t) / n_seq;
  }
  // Tiled-kernel item overhead: 32 segments of 4 tokens, each shared by 32 sequences (one tile, one
  // item per KV head).
  {
    const int n_groups = 32, n_seq = 32;
    const int64_t n_tok = 4;
    Problem p = make_problem(shape, kv_dtype, n_tok, n_seq, true, rng, n_groups);
    const double t = time_plan(p);
    const double items = double(n_groups) * shape.n_kv_heads;
    const double work = n_groups * (kv_bytes(n_tok) / c.tiled_bw + macs(n_tok, n_seq) / c.tiled_mac);
    c.tiled_item_s = std::max(t - work, 0.5 * t) / items;
  }
  return c;
}

}  // namespace cascade
