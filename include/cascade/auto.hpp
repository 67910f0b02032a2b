// Choosing, per segment of a cascade tree, whether to attend it once for all the rows below it (shared)
// or separately for each group of rows below it (folded), from a cost model fitted on this machine.
//
// Why a choice exists. A shared pass reads a segment's K/V once and stacks every row below it into one
// matrix; that is a win when the segment is long and many rows share it. It is a loss when the segment
// is short, or when stacking pushes the pass past the few-rows kernel (kernel.hpp: <= kSmallRows stacked
// rows per KV head take the AVX-512 kernel, that reads K/V once for all heads) into the tiled-product
// kernel, whose per-head items and f32 tile staging cost more than reading a few tokens twice. Folding
// costs no copy: the chosen plan lists the same KvView in several segment slots, one per group of rows.
//
// The choice is per segment of the tree (not only for the root prefix, as vLLM's use_cascade_attention
// decides): every segment is marked shared (S) or folded (F). A folded segment's rows are grouped by the
// nearest shared segments below it on each path (each sequence that ends below it with no shared segment
// on the way is a group of its own). Any S/F marking gives a valid tree: a slot's group is always a
// union of the groups of the slots below it. The marking of least predicted time is found exactly by a
// dynamic program over (segment, number of folded ancestors just above it). A tree where no segment has
// two sequences below it is returned as it is (plain per-sequence attention).
//
// The chosen plan computes exactly the same function as the tree (same rows, same keys in the same
// order on every path); only the partial states that get merged differ.
//
// Cost model (seconds for one pass of L tokens attended by m stacked rows per KV head, H KV heads, head
// dim d, b bytes per K/V element; kv = 2 L H d b bytes, mac = 2 m L H d multiply-adds):
//   few-rows kernel: kv / small_bw + mac / small_mac + item_s
//   tiled kernel:    ceil(m / kMaxRows) (kv / tiled_bw + H item_s) + mac / tiled_mac
//   and never less than kv / read_bw (the memory's streaming read rate).
// calibrate() fits the rates by running cpu::attend on synthetic plans that isolate each term.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cascade/cpu/attention.hpp"
#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/plan.hpp"

namespace cascade {

struct CostModel {
  int n_threads = 0;        // the thread count it was measured with (0: all of the machine's)
  int n_kv_heads = 0, head_dim = 0;  // the head shape it was measured with (0: not recorded)
  double read_bw = 10e9;    // bytes/s, streaming read of a buffer
  double small_bw = 10e9;   // few-rows kernel: K/V bytes/s
  double small_mac = 20e9;  // few-rows kernel: multiply-adds/s
  double tiled_bw = 10e9;   // tiled kernel: K/V bytes/s per tile of kMaxRows rows (reads + f32 staging)
  double tiled_mac = 50e9;  // tiled kernel: multiply-adds/s
  double item_s = 2e-6;     // fixed cost of one work item (query gather, state write, its share of the merge)
  double tiled_item_s = 4e-6;  // the same for one item of the tiled kernel (per KV head and row tile)

  // Predicted seconds of one pass: n_tokens keys (kv_bytes of K and V in all) attended by n_token_rows
  // query tokens (times the GQA group stacked rows per KV head). 0 when either is 0.
  double pass_seconds(const HeadShape& shape, double kv_bytes, int64_t n_tokens, int64_t n_token_rows) const {
    if (n_tokens <= 0 || n_token_rows <= 0) return 0.0;
    const double m = double(n_token_rows) * shape.group();
    const double mac = 2.0 * m * double(n_tokens) * shape.n_kv_heads * shape.head_dim;
    double t;
    if (cpu::use_small_kernel(int64_t(m), shape.head_dim)) {
      t = kv_bytes / small_bw + mac / small_mac + item_s;
    } else {
      const double tiles = std::ceil(m / double(cpu::kMaxRows));
      t = tiles * (kv_bytes / tiled_bw + shape.n_kv_heads * tiled_item_s) + mac / tiled_mac;
    }
    return std::max(t, kv_bytes / read_bw);
  }
  double pass_seconds(const HeadShape& shape, DType dtype, int64_t n_tokens, int64_t n_token_rows) const {
    return pass_seconds(shape, kv_bytes(shape, dtype, n_tokens), n_tokens, n_token_rows);
  }
  static double kv_bytes(const HeadShape& shape, DType dtype, int64_t n_tokens) {
    return 2.0 * double(n_tokens) * shape.n_kv_heads * shape.head_dim * double(dtype_size(dtype));
  }

  // Predicted seconds of a whole plan: the sum of its passes (cpu/attention.hpp: a chain of segments with
  // the same rows is one pass).
  double plan_seconds(const Plan& plan) const {
    const cpu::detail::Passes pp = cpu::detail::make_passes(plan);
    double t = 0;
    for (const auto& ps : pp.pass) {
      double bytes = 0;
      for (int g : ps.segs) bytes += kv_bytes(plan.shape(), plan.segment(g).dtype, plan.segment(g).n_tokens);
      t += pass_seconds(plan.shape(), bytes, ps.n_tokens, int64_t(ps.limit.size()));
    }
    return t;
  }

  // The profile as text, one "key value" line each; parse() reads it back (unknown keys are refused).
  std::string to_string() const {
    std::ostringstream os;
    os.precision(9);
    os << "cascade-cost-model 1\n"
       << "n_threads " << n_threads << "\nn_kv_heads " << n_kv_heads << "\nhead_dim " << head_dim << "\nread_bw " << read_bw << "\nsmall_bw " << small_bw << "\nsmall_mac "
       << small_mac << "\ntiled_bw " << tiled_bw << "\ntiled_mac " << tiled_mac << "\nitem_s " << item_s
       << "\ntiled_item_s " << tiled_item_s << "\n";
    return os.str();
  }
  static CostModel parse(const std::string& text) {
    std::istringstream is(text);
    std::string key;
    int version = 0;
    CASCADE_CHECK(is >> key >> version && key == "cascade-cost-model" && version == 1,
                  "cost model profile: missing 'cascade-cost-model 1' header");
    CostModel c;
    const std::map<std::string, double*> fields = {{"read_bw", &c.read_bw},   {"small_bw", &c.small_bw},
                                                   {"small_mac", &c.small_mac}, {"tiled_bw", &c.tiled_bw},
                                                   {"tiled_mac", &c.tiled_mac}, {"item_s", &c.item_s},
                                                   {"tiled_item_s", &c.tiled_item_s}};
    while (is >> key) {
      if (key == "n_threads" || key == "n_kv_heads" || key == "head_dim") {
        int& v = key == "n_threads" ? c.n_threads : key == "n_kv_heads" ? c.n_kv_heads : c.head_dim;
        CASCADE_CHECK(is >> v && v >= 0, "cost model profile: bad ", key);
        continue;
      }
      auto it = fields.find(key);
      CASCADE_CHECK(it != fields.end(), "cost model profile: unknown key '", key, "'");
      double v = 0;
      CASCADE_CHECK(is >> v && std::isfinite(v) && v > 0, "cost model profile: '", key,
                    "' needs a positive finite number");
      *it->second = v;
    }
    return c;
  }
  void save(const std::string& path) const {
    std::ofstream f(path);
    CASCADE_CHECK(bool(f), "cost model: cannot write '", path, "'");
    f << to_string();
    CASCADE_CHECK(bool(f), "cost model: writing '", path, "' failed");
  }
  static CostModel load(const std::string& path) {
    std::ifstream f(path);
    CASCADE_CHECK(bool(f), "cost model: cannot read '", path, "'");
    std::stringstream ss;
    ss << f.rdbuf();
    return parse(ss.str());
  }
};

// The last-level cache's size in bytes as the C library reports it (64 MiB when it does not).
inline int64_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return int64_t(l3);
#endif
  return int64_t(64) << 20;
}

namespace auto_detail {

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
// n_groups segments, each shared by n_seq sequences.
struct Problem {
  std::vector<f16> k, v;
  std::vector<float> q, o;
  Plan plan;
};

inline Problem make_problem(const HeadShape& shape, int64_t n_tokens, int n_seq, bool shared, std::mt19937& rng,
                            int n_groups = 1) {
  Problem p;
  const int64_t row = int64_t(shape.n_kv_heads) * shape.head_dim;
  const int64_t n_seg = shared ? n_groups : n_seq;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  p.k.resize(size_t(n_seg * n_tokens * row));
  p.v.resize(p.k.size());
  for (size_t i = 0; i < p.k.size(); ++i) {
    p.k[i] = f16(u(rng));
    p.v[i] = f16(u(rng));
  }
  std::vector<KvView> segs;
  std::vector<std::vector<int>> paths;
  for (int64_t g = 0; g < n_seg; ++g)
    segs.push_back(KvView::contiguous(p.k.data() + g * n_tokens * row, p.v.data() + g * n_tokens * row, n_tokens,
                                      shape.n_kv_heads, shape.head_dim));
  for (int64_t g = 0; g < (shared ? n_groups : 1); ++g)
    for (int s = 0; s < n_seq; ++s) paths.push_back({shared ? int(g) : s});
  const size_t n_paths = paths.size();
  p.plan = Plan::build(shape, std::move(segs), paths, std::vector<int64_t>(n_paths, 1));
  p.q.resize(n_paths * shape.n_q_heads * shape.head_dim);
  for (float& x : p.q) x = u(rng);
  p.o.resize(p.q.size());
  return p;
}

// Streaming read rate of a buffer of `bytes` with n_threads threads, best of 3.
inline double read_bandwidth(int n_threads, int64_t bytes) {
  std::vector<float> buf(size_t(bytes / 4), 1.0f);
  double best = 0;
  cpu::detail::in_arena(n_threads, [&] {
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

}  // namespace auto_detail

// Fits a CostModel on this machine with n_threads threads (0: all), using the library's own kernels on
// f16 K/V with `like`'s KV heads and head dim and no GQA (so stacked rows = query tokens): the kernels'
// rates depend on the head dim and the number of heads an item carries, so calibrate with the shape the
// model will price (the default stands for small models). Takes about half a second. The kernels' rates are measured on K/V of 16 MiB at most, which may sit in the last-level
// cache; the streaming read rate, the floor of every pass, is measured on a buffer twice the last-level
// cache (64 to 256 MiB), because a decode step finds most K/V in memory, not in cache (the layers
// and weights read since the last step have evicted it). So a segment folded into several passes
// costs its full memory traffic each time, and folding is chosen only where it saves more than that.
inline CostModel calibrate(int n_threads = 0, const HeadShape& like = HeadShape{4, 4, 64}) {
  using namespace auto_detail;
  CASCADE_CHECK(n_threads >= 0, "calibrate: n_threads is negative (", n_threads, ")");
  CASCADE_CHECK(like.n_kv_heads > 0 && like.head_dim > 0, "calibrate: bad head shape ", like.n_kv_heads, " KV heads of ",
                like.head_dim);
  CostModel c;
  c.n_threads = n_threads;
  c.n_kv_heads = like.n_kv_heads;
  c.head_dim = like.head_dim;
  const HeadShape shape{like.n_kv_heads, like.n_kv_heads, like.head_dim};
  const cpu::Options opt{n_threads};
  std::mt19937 rng(7);
  const int reps = 5;
  auto time_plan = [&](Problem& p) {
    return best_of(reps, [&] { cpu::attend(p.plan, p.q.data(), p.o.data(), nullptr, opt); });
  };
  const auto kv_bytes = [&](int64_t n_tokens) { return 2.0 * double(n_tokens) * shape.n_kv_heads * shape.head_dim * 2; };
  const auto macs = [&](int64_t n_tokens, int m) { return 2.0 * m * double(n_tokens) * shape.n_kv_heads * shape.head_dim; };

  c.read_bw = read_bandwidth(n_threads, std::clamp<int64_t>(2 * last_level_cache_bytes(), int64_t(64) << 20,
                                                             int64_t(256) << 20));

  // Few-rows kernel: 1 and 8 rows over the same 16 MiB segment; the difference is the multiply-adds.
  const int64_t n_small = std::max<int64_t>(256, (int64_t(16) << 20) / int64_t(kv_bytes(1)));
  const int m_hi = int(std::min<int64_t>(8, cpu::use_small_kernel(8, shape.head_dim) ? 8 : 1));
  {
    Problem p1 = make_problem(shape, n_small, 1, true, rng);
    const double t1 = time_plan(p1);
    double per_mac = 0;
    if (m_hi > 1) {
      Problem p8 = make_problem(shape, n_small, m_hi, true, rng);
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
    Problem a = make_problem(shape, n_tiled, 32, true, rng);
    Problem b = make_problem(shape, n_tiled, 128, true, rng);
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
    Problem p = make_problem(shape, n_tok, n_seq, false, rng);
    const double t = time_plan(p);
    const double work = n_seq * (kv_bytes(n_tok) / c.small_bw + macs(n_tok, 1) / c.small_mac);
    c.item_s = std::max(t - work, 0.5 * t) / n_seq;
  }
  // Tiled-kernel item overhead: 32 segments of 4 tokens, each shared by 32 sequences (one tile, one
  // item per KV head).
  {
    const int n_groups = 32, n_seq = 32;
    const int64_t n_tok = 4;
    Problem p = make_problem(shape, n_tok, n_seq, true, rng, n_groups);
    const double t = time_plan(p);
    const double items = double(n_groups) * shape.n_kv_heads;
    const double work = n_groups * (kv_bytes(n_tok) / c.tiled_bw + macs(n_tok, n_seq) / c.tiled_mac);
    c.tiled_item_s = std::max(t - work, 0.5 * t) / items;
  }
  return c;
}

// What choose_plan decided for one segment of the tree.
struct SegmentChoice {
  bool shared = true;     // attended once by all rows below it
  int n_passes = 0;       // passes over its K/V in the chosen plan (1 when shared and attended)
  double shared_s = 0;    // predicted seconds as one shared pass
  double chosen_s = 0;    // predicted seconds of its passes in the chosen plan
};

struct AutoChoice {
  std::vector<SegmentChoice> segments;  // per segment of the tree
  double tree_s = 0;                    // predicted seconds of the tree as given (every segment shared)
  double chosen_s = 0;                  // predicted seconds of the chosen plan
  bool changed = false;                 // false: the tree itself was returned
};

// The plan of least predicted time under `model` that computes what `tree` computes: same sequences,
// rows, keys and scale. Segments on no sequence's path are dropped. `why`, when given, receives the
// per-segment decisions.
// A folded alternative must be predicted this much faster (as a fraction) to be chosen.
inline constexpr double kFoldMargin = 0.05;

inline Plan choose_plan(const Plan& tree, const CostModel& model, AutoChoice* why = nullptr) {
  const HeadShape& shape = tree.shape();
  const int n_seg = tree.n_segments(), n_seq = tree.n_sequences();
  std::vector<std::vector<int>> children(n_seg), ends(n_seg);
  std::vector<int64_t> rows(n_seg, 0), n_below(n_seg, 0);
  std::vector<int> roots;
  for (int g = 0; g < n_seg; ++g) {
    const int p = tree.parent(g);
    if (p == Plan::kRoot) roots.push_back(g);
    else if (p >= 0) children[p].push_back(g);
  }
  for (int s = 0; s < n_seq; ++s) {
    const Plan::Sequence& sq = tree.sequence(s);
    if (sq.path.empty()) continue;
    ends[sq.path.back()].push_back(s);
    for (int g : sq.path) {
      rows[g] += sq.n_query;
      n_below[g] += 1;
    }
  }
  const auto pass = [&](int g, int64_t n_rows) {
    return model.pass_seconds(shape, tree.segment(g).dtype, tree.segment(g).n_tokens, n_rows);
  };
  AutoChoice local;
  AutoChoice& out = why ? *why : local;
  out = AutoChoice{};
  out.segments.assign(size_t(n_seg), SegmentChoice{});
  for (int g = 0; g < n_seg; ++g) {
    out.segments[g].shared_s = pass(g, rows[g]);
    out.segments[g].chosen_s = out.segments[g].shared_s;
    out.segments[g].n_passes = rows[g] > 0 && tree.segment(g).n_tokens > 0 ? 1 : 0;
  }
  out.tree_s = model.plan_seconds(tree);
  out.chosen_s = out.tree_s;
  const bool any_shared = std::any_of(n_below.begin(), n_below.end(), [](int64_t n) { return n >= 2; });
  if (!any_shared) return tree;

  // best(g, j): least cost of g's subtree plus, for the j folded ancestors just above g (chain[g][0..j),
  // nearest first), the passes their K/V makes over the groups inside g's subtree.
  std::vector<std::vector<int>> chain(n_seg);  // ancestors, nearest first
  for (int g = 0; g < n_seg; ++g)
    for (int a = tree.parent(g); a >= 0; a = tree.parent(a)) chain[g].push_back(a);
  std::vector<std::vector<double>> memo(n_seg), fold_memo(n_seg);
  std::vector<std::vector<char>> pick_fold(n_seg);
  for (int g = 0; g < n_seg; ++g) {
    memo[g].assign(chain[g].size() + 1, -1.0);
    pick_fold[g].assign(chain[g].size() + 1, 0);
  }
  // Children before parents: a segment's id order need not be, so recurse with an explicit order.
  std::vector<int> order;
  {
    std::vector<int> stack(roots.rbegin(), roots.rend());
    while (!stack.empty()) {
      const int g = stack.back();
      stack.pop_back();
      order.push_back(g);
      for (int c : children[g]) stack.push_back(c);
    }
  }
  // A group's passes over g and over the j folded ancestors above it have the same rows, so they run as
  // one pass over all their tokens (cpu/attention.hpp's chains).
  const auto fused = [&](int g, size_t j, int64_t n_rows) {
    double bytes = CostModel::kv_bytes(shape, tree.segment(g).dtype, tree.segment(g).n_tokens);
    int64_t n_tok = tree.segment(g).n_tokens;
    for (size_t a = 0; a < j; ++a) {
      const KvView& kv = tree.segment(chain[g][a]);
      bytes += CostModel::kv_bytes(shape, kv.dtype, kv.n_tokens);
      n_tok += kv.n_tokens;
    }
    return model.pass_seconds(shape, bytes, n_tok, n_rows);
  };
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int g = *it;
    for (size_t j = 0; j <= chain[g].size(); ++j) {
      // Shared: one group, all rows below g, attended by g and by the j folded ancestors.
      double s_cost = fused(g, j, rows[g]);
      for (int c : children[g]) s_cost += memo[c][0];
      // Folded: the chain grows by g; every sequence ending here is its own group.
      double f_cost = 0;
      for (int c : children[g]) f_cost += memo[c][j + 1];
      for (int s : ends[g]) f_cost += fused(g, j, tree.sequence(s).n_query);
      // Fold only for a clear predicted gain: the rates are fitted on short runs, and a shared pass is
      // never far from its minimum traffic, while a wrongly folded long segment re-reads it.
      const bool fold = f_cost < s_cost * (1 - kFoldMargin);
      memo[g][j] = fold ? f_cost : s_cost;
      pick_fold[g][j] = fold;
    }
  }
  std::vector<char> folded(n_seg, 0);
  {
    std::vector<std::pair<int, int>> stack;
    for (int r : roots) stack.push_back({r, 0});
    while (!stack.empty()) {
      const auto [g, j] = stack.back();
      stack.pop_back();
      folded[g] = pick_fold[g][j];
      for (int c : children[g]) stack.push_back({c, folded[g] ? j + 1 : 0});
    }
  }
  if (std::none_of(folded.begin(), folded.end(), [](char f) { return f != 0; })) return tree;

  // Slots: (segment, group) in order of first use; a group is the nearest shared segment at or below
  // the slot on the sequence's path, or the sequence itself (-1 - s) when there is none.
  std::map<std::pair<int, int64_t>, int> slot_of;
  std::vector<KvView> slots;
  std::vector<int> slot_seg;
  std::vector<std::vector<int>> paths(static_cast<size_t>(n_seq));
  std::vector<int64_t> n_query(static_cast<size_t>(n_seq));
  for (int s = 0; s < n_seq; ++s) {
    const Plan::Sequence& sq = tree.sequence(s);
    n_query[s] = sq.n_query;
    std::vector<int64_t> group(sq.path.size());
    int64_t below = -1 - int64_t(s);
    for (size_t k = sq.path.size(); k-- > 0;) {
      const int g = sq.path[k];
      if (!folded[g]) below = g;
      group[k] = below;
    }
    for (size_t k = 0; k < sq.path.size(); ++k) {
      const int g = sq.path[k];
      auto [it, fresh] = slot_of.try_emplace({g, group[k]}, int(slots.size()));
      if (fresh) {
        slots.push_back(tree.segment(g));
        slot_seg.push_back(g);
      }
      paths[s].push_back(it->second);
    }
  }
  Plan chosen = Plan::build(shape, std::move(slots), paths, n_query, tree.scale());
  // The dynamic program prices each group's chain on its own; the whole plan, priced pass by pass, must
  // still beat the tree.
  const double chosen_s = model.plan_seconds(chosen);
  if (chosen_s >= out.tree_s) return tree;
  out.chosen_s = chosen_s;
  for (int g = 0; g < n_seg; ++g) {
    out.segments[g].shared = !folded[g];
    out.segments[g].n_passes = 0;
    out.segments[g].chosen_s = 0;
  }
  for (int k = 0; k < chosen.n_segments(); ++k) {
    const int g = slot_seg[k];
    const int64_t r = int64_t(chosen.segment_rows(k).size());
    out.segments[g].n_passes += r > 0 && chosen.segment(k).n_tokens > 0 ? 1 : 0;
    out.segments[g].chosen_s += pass(g, r);
  }
  out.changed = true;
  return chosen;
}

}  // namespace cascade
