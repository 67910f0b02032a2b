// Random attention problems for the tests: segments in random storage (dtype, contiguous with padded
// strides or paged with shuffled pages), random trees, random queries; and the element-wise comparison.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cascade/cascade.hpp"

namespace test {

// Fresh inputs each run; CASCADE_TEST_SEED=N replays one. The seed is printed with every failure.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("CASCADE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
}

// Under a sanitizer (scripts/sanitize.sh, scripts/tsan.sh) code runs 10-20x slower, so the random sweeps draw a
// third as many problems of the same kinds there, and the whole number in the suite's own build; the cases that walk
// every head dim, storage and edge on purpose run whole under both. GCC defines these macros; clang reports the same
// through __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif
// n random problems, a third of them under a sanitizer (at least 1).
inline constexpr int sweep(int n) { return kSanitized ? std::max(1, n / 3) : n; }

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  int64_t uniform_int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(gen); }
  template <class T> const T& pick(const std::vector<T>& v) { return v[static_cast<size_t>(uniform_int(0, int64_t(v.size()) - 1))]; }
};

// One segment's K/V in its own storage.
struct Segment {
  std::vector<uint8_t> k, v;
  std::vector<cascade::f16> k_scales, v_scales;  // q8_0 only
  bool bf16_exact = false;  // q8_0: every element (code times a power-of-two scale) is exact in bf16
  std::vector<int32_t> table;
  cascade::KvView view;
};

template <class T>
void fill_random(std::vector<uint8_t>& bytes, int64_t n, Rng& rng, float amp) {
  bytes.assign(static_cast<size_t>(n) * sizeof(T), 0);
  T* p = reinterpret_cast<T*>(bytes.data());
  for (int64_t i = 0; i < n; ++i) p[i] = T(rng.uniform(-amp, amp));
}

// n q8_0 codes (and n / 32 scales) of random values in [-amp, amp], each block within its own random fraction of amp,
// quantized (n a multiple of 32); pow2: each
// scale then rounded to a power of two, so that every element is exact in bf16 (the bf16-product paths convert
// q8_0 tiles to bf16).
inline void fill_random_q8_0(std::vector<uint8_t>& codes, std::vector<cascade::f16>& scales, int64_t n, Rng& rng,
                             float amp, bool pow2) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; b += cascade::kQ8Block) {  // each block at its own magnitude: scales differ
    const float block_amp = amp * rng.uniform(0.05f, 1.0f);
    for (int64_t i = b; i < b + cascade::kQ8Block; ++i) x[size_t(i)] = rng.uniform(-block_amp, block_amp);
  }
  codes.assign(static_cast<size_t>(n), 0);
  scales.assign(static_cast<size_t>(n / cascade::kQ8Block), cascade::f16(0.0f));
  cascade::quantize_q8_0(x.data(), n, reinterpret_cast<int8_t*>(codes.data()), scales.data());
  if (pow2)
    for (cascade::f16& d : scales)
      if (float(d) > 0) d = cascade::f16(std::exp2(std::round(std::log2(float(d)))));
}

// A K/V type at random among those a view of head_dim takes (q8_0: multiples of 32).
inline cascade::DType random_dtype(Rng& rng, int head_dim) {
  using cascade::DType;
  if (head_dim % cascade::kQ8Block == 0) return rng.pick<DType>({DType::f32, DType::f16, DType::bf16, DType::q8_0});
  return rng.pick<DType>({DType::f32, DType::f16, DType::bf16});
}

// How rows sit in memory: any padding; aligned (every row on 16 bytes: padding in multiples of 8 elements,
// none between pages, as vector copies need); misaligned (heads always padded by 1-3 elements).
enum class Rows { any, aligned, misaligned };

// n_tokens tokens of random K/V with values in [-amp, amp], in storage chosen by the flags. q8_0 pads by whole
// blocks of 32 codes (its strides are multiples of 32).
inline std::unique_ptr<Segment> make_segment(Rng& rng, cascade::DType dt, int64_t n_tokens, int n_kv_heads,
                                             int head_dim, bool paged, float amp = 1.0f, Rows rows = Rows::any) {
  const bool aligned = rows == Rows::aligned;
  auto seg = std::make_unique<Segment>();
  cascade::KvView& kv = seg->view;
  kv.dtype = dt;
  kv.n_tokens = n_tokens;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = head_dim;
  // Padded strides: heads and tokens are not packed, so the kernels must honor the strides.
  const bool q8 = dt == cascade::DType::q8_0;
  const int64_t pad_h = q8        ? cascade::kQ8Block * rng.uniform_int(0, 1)
                        : aligned ? 8 * rng.uniform_int(0, 1)
                                  : rng.uniform_int(rows == Rows::misaligned ? 1 : 0, 3);
  const int64_t pad_t = q8 ? cascade::kQ8Block * rng.uniform_int(0, 1) : aligned ? 8 * rng.uniform_int(0, 2)
                                                                                 : rng.uniform_int(0, 5);
  kv.stride_head = head_dim + pad_h;
  kv.stride_token = n_kv_heads * kv.stride_head + pad_t;
  int64_t n_elems;
  if (paged) {
    kv.page_size = rng.pick<int64_t>({1, 7, 16, 64});
    const int64_t n_pages = (n_tokens + kv.page_size - 1) / kv.page_size;
    const int64_t pool = n_pages + rng.uniform_int(0, 3);  // spare pages nobody uses
    kv.stride_page = kv.page_size * kv.stride_token + (q8 ? cascade::kQ8Block * rng.uniform_int(0, 1)
                                                       : aligned ? 0
                                                                 : rng.uniform_int(0, 4));
    std::vector<int32_t> ids(static_cast<size_t>(pool));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng.gen);
    seg->table.assign(ids.begin(), ids.begin() + n_pages);
    kv.block_table = seg->table.empty() ? nullptr : seg->table.data();
    if (!kv.block_table) kv.page_size = 0;
    n_elems = pool * kv.stride_page;
  } else {
    n_elems = n_tokens * kv.stride_token;
  }
  n_elems = std::max<int64_t>(n_elems, q8 ? cascade::kQ8Block : 1);
  cascade::dispatch_dtype(dt, [&]<class T>() {
    if constexpr (std::is_same_v<T, cascade::Q8Code>) {
      seg->bf16_exact = rng.coin();
      fill_random_q8_0(seg->k, seg->k_scales, n_elems, rng, amp, seg->bf16_exact);
      fill_random_q8_0(seg->v, seg->v_scales, n_elems, rng, 1.0f, seg->bf16_exact);
    } else {
      fill_random<T>(seg->k, n_elems, rng, amp);
      fill_random<T>(seg->v, n_elems, rng, 1.0f);
    }
  });
  kv.k = seg->k.data();
  kv.v = seg->v.data();
  kv.k_scales = q8 ? seg->k_scales.data() : nullptr;
  kv.v_scales = q8 ? seg->v_scales.data() : nullptr;
  return seg;
}

// A random forest of segments of depth <= max_depth, with leaves becoming sequences.
struct Tree {
  std::vector<int> parent;
  std::vector<std::vector<int>> paths;  // one per sequence
};

inline Tree random_tree(Rng& rng, int depth, int max_seqs) {
  Tree t;
  std::vector<std::vector<int>> frontier;  // partial paths
  const int n_roots = int(rng.uniform_int(1, 2));
  for (int r = 0; r < n_roots; ++r) {
    t.parent.push_back(-1);
    frontier.push_back({int(t.parent.size()) - 1});
  }
  for (int level = 1; level < depth; ++level) {
    std::vector<std::vector<int>> next;
    for (const auto& path : frontier) {
      const int n_child = int(rng.uniform_int(1, 3));
      for (int c = 0; c < n_child; ++c) {
        t.parent.push_back(path.back());
        auto p = path;
        p.push_back(int(t.parent.size()) - 1);
        next.push_back(p);
      }
      if (rng.coin(0.15)) next.push_back(path);  // a leaf above the last level
    }
    frontier = std::move(next);
  }
  std::shuffle(frontier.begin(), frontier.end(), rng.gen);
  if (int(frontier.size()) > max_seqs) frontier.resize(static_cast<size_t>(max_seqs));
  t.paths = std::move(frontier);
  return t;
}

// Shrinks seg_len until the reference's work (multiply-adds over every path's keys, query and head) fits.
inline void shrink_to_budget(std::vector<int64_t>& seg_len, const std::vector<std::vector<int>>& paths,
                             const std::vector<int64_t>& n_query, const cascade::HeadShape& shape, double budget) {
  for (;;) {
    double cost = 0;
    for (size_t s = 0; s < paths.size(); ++s) {
      int64_t keys = 0;
      for (int g : paths[s]) keys += seg_len[static_cast<size_t>(g)];
      cost += double(keys) * double(n_query[s]) * shape.n_q_heads * shape.head_dim * 2;
    }
    if (cost <= budget) return;
    for (auto& len : seg_len) len = len * 2 / 3;
  }
}

// Checks every element: finite, and |out - ref| <= atol + rtol |ref|. Reports the first failure.
inline void expect_close(const std::vector<float>& out, const std::vector<double>& ref, double atol, double rtol,
                         const std::string& what) {
  REQUIRE(out.size() == ref.size());
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double r = ref[i], o = out[i];
    bool ok;
    if (std::isinf(r)) {
      ok = (o == r);  // lse of an empty row: exactly -inf
    } else {
      ok = std::isfinite(o) && std::abs(o - r) <= atol + rtol * std::abs(r);
      worst = std::max(worst, std::abs(o - r) / (atol + rtol * std::abs(r)));
    }
    if (!ok && bad++ == 0) first = int64_t(i);
  }
  if (bad) {
    FAIL_CHECK(what << ": " << bad << " of " << out.size() << " elements out of tolerance; first at " << first
                    << ": got " << out[static_cast<size_t>(first)] << ", reference " << ref[static_cast<size_t>(first)]);
  }
  if (std::getenv("CASCADE_TEST_VERBOSE")) MESSAGE(what << ": worst error / tolerance = " << worst);
}

}  // namespace test
