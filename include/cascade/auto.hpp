// Choosing, per segment of a cascade tree, whether to attend it once for all the rows below it (shared)
// or separately for each group of rows below it (folded), from a cost model fitted on this machine
// (cpu/calibrate.hpp fits one). The choice is made once per step, from the tree's structure and lengths,
// and recorded in the step's Plan (plan.hpp).
//
// Why a choice exists. A shared pass reads a segment's K/V once and stacks every row below it into one
// matrix; that is a win when the segment is long and many rows share it. It is a loss when the segment
// is short, or when stacking pushes the pass past the few-rows kernel (a kernel that carries every KV
// head in one item and reads K/V once for all of them) into the tiled-product kernel, whose per-head items
// and f32 tile staging cost more than reading a few tokens twice. Folding costs no copy: the regrouped
// tree names the same tree segment in several of its slots, one per group of rows, and every slot reads
// that segment's K/V.
//
// The choice is per segment of the tree (not only for the root prefix, as vLLM's use_cascade_attention
// decides): every segment is marked shared (S) or folded (F). A folded segment's rows are grouped by the
// nearest shared segments below it on each path (each sequence that ends below it with no shared segment
// on the way is a group of its own). Any S/F marking gives a valid tree: a slot's group is always a
// union of the groups of the slots below it. The marking of least predicted time is found exactly by a
// dynamic program over (segment, number of folded ancestors just above it). A tree where no segment has
// two sequences below it is returned as it is (plain per-sequence attention).
//
// The regrouped tree computes exactly the same function as the tree (same rows, same keys in the same
// order on every path); only the partial states that get merged differ.
//
// Cost model: the passes of the schedule (schedule.hpp), each priced by the kernel the target picks for
// it (seconds for one pass of L tokens attended by m stacked rows per KV head, H KV heads, head dim d,
// b bytes per K/V element; kv = 2 L H d b bytes, mac = 2 m L H d multiply-adds):
//   a kernel carrying all heads per item (few rows): kv / small_bw + mac / small_mac + item_s
//   a kernel with one item per head and row tile:    ceil(m / tile_rows) (kv / tiled_bw + H tiled_item_s)
//                                                    + mac / tiled_mac
//   and never less than kv / read_bw (the memory's streaming read rate).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/schedule.hpp"
#include "cascade/tree.hpp"

namespace cascade {

struct CostModel {
  int n_threads = 0;        // the thread count it was measured with (0: all of the machine's)
  int n_kv_heads = 0, head_dim = 0;  // the head shape it was measured with (0: not recorded)
  // The K/V type its kernels ran on (calibrate() records it; nullopt: not recorded). The rates differ by type
  // (other bytes per element, other kernels), so choose() refuses a model recorded for another type.
  std::optional<DType> kv_dtype;
  double read_bw = 10e9;    // bytes/s, streaming read of a buffer
  double small_bw = 10e9;   // few-rows kernel: K/V bytes/s
  double small_mac = 20e9;  // few-rows kernel: multiply-adds/s
  double tiled_bw = 10e9;   // tiled kernel: K/V bytes/s per tile of rows (reads + f32 staging)
  double tiled_mac = 50e9;  // tiled kernel: multiply-adds/s
  double item_s = 2e-6;     // fixed cost of one work item (query gather, state write, its share of the merge)
  double tiled_item_s = 4e-6;  // the same for one item of the tiled kernel (per KV head and row tile)

  // Predicted seconds of one pass: n_tokens keys (kv_bytes of K and V in all) attended by n_token_rows
  // query tokens (times the GQA group stacked rows per KV head), on the kernel `target` picks. 0 when
  // either count is 0.
  double pass_seconds(const HeadShape& shape, const Target& target, double kv_bytes, int64_t n_tokens,
                      int64_t n_token_rows) const {
    if (n_tokens <= 0 || n_token_rows <= 0) return 0.0;
    const int64_t m = n_token_rows * shape.group();
    const double mac = 2.0 * double(m) * double(n_tokens) * shape.n_kv_heads * shape.head_dim;
    const KernelTile& k = target.kernels[target.pick(m)];
    double t;
    if (k.all_heads) {
      t = kv_bytes / small_bw + mac / small_mac + item_s;
    } else {
      const double tiles = std::ceil(double(m) / double(k.tile_rows));
      t = tiles * (kv_bytes / tiled_bw + shape.n_kv_heads * tiled_item_s) + mac / tiled_mac;
    }
    return std::max(t, kv_bytes / read_bw);
  }
  double pass_seconds(const HeadShape& shape, const Target& target, DType dtype, int64_t n_tokens,
                      int64_t n_token_rows) const {
    return pass_seconds(shape, target, kv_bytes(shape, dtype, n_tokens), n_tokens, n_token_rows);
  }
  static double kv_bytes(const HeadShape& shape, DType dtype, int64_t n_tokens) {
    return 2.0 * double(n_tokens) * shape.n_kv_heads * shape.head_dim * kv_element_bytes(dtype);
  }

  // Predicted seconds of the schedule of `tree` on `target`: the sum of its passes (a chain of segments
  // with the same rows is one pass), each over the keys its rows see (under a sliding window, fewer than its own).
  double plan_seconds(const Tree& tree, const Target& target, DType dtype) const {
    double t = 0;
    const Schedule s = make_passes(tree);
    for (const Schedule::Pass& ps : s.passes) {
      int64_t lo = 0, hi = ps.n_tokens;
      if (tree.window() > 0) lo = ps.n_tokens, hi = 0;
      for (int64_t r = ps.row_begin; tree.window() > 0 && r < ps.row_begin + ps.n_token_rows; ++r) {
        lo = std::min(lo, s.rows[size_t(r)].first);
        hi = std::max(hi, s.rows[size_t(r)].limit);
      }
      t += pass_seconds(tree.shape(), target, dtype, std::max<int64_t>(0, hi - lo), ps.n_token_rows);
    }
    return t;
  }

  // The profile as text, one "key value" line each; parse() reads it back (unknown keys are refused).
  std::string to_string() const {
    std::ostringstream os;
    os.precision(9);
    os << "cascade-cost-model 1\n"
       << "n_threads " << n_threads << "\nn_kv_heads " << n_kv_heads << "\nhead_dim " << head_dim << "\n";
    if (kv_dtype) os << "kv_type " << dtype_name(*kv_dtype) << "\n";
    os << "read_bw " << read_bw << "\nsmall_bw " << small_bw << "\nsmall_mac " << small_mac << "\ntiled_bw " << tiled_bw
       << "\ntiled_mac " << tiled_mac << "\nitem_s " << item_s << "\ntiled_item_s " << tiled_item_s << "\n";
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
      if (key == "kv_type") {
        std::string name;
        CASCADE_CHECK(bool(is >> name), "cost model profile: 'kv_type' needs a K/V type");
        c.kv_dtype = parse_dtype(name);
        continue;
      }
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

// What the choice decided for one segment of the tree.
struct SegmentChoice {
  bool shared = true;     // attended once by all rows below it
  int n_passes = 0;       // passes over its K/V in the regrouped tree (1 when shared and attended)
  double shared_s = 0;    // predicted seconds as one shared pass
  double chosen_s = 0;    // predicted seconds of its passes in the regrouped tree
};

struct AutoChoice {
  std::vector<SegmentChoice> segments;  // per segment of the tree
  double tree_s = 0;                    // predicted seconds of the tree as given (every segment shared)
  double chosen_s = 0;                  // predicted seconds of the chosen tree
  bool changed = false;                 // false: the tree as given is attended
};

// The tree a plan attends, when it is not the given one.
struct Regrouping {
  std::optional<Tree> tree;  // the regrouped tree; empty: the given tree itself
  std::vector<int> source;   // per segment (slot) of *tree: the given tree's segment whose K/V it reads
  AutoChoice why;
};

// A folded alternative must be predicted this much faster (as a fraction) to be chosen.
inline constexpr double kFoldMargin = 0.05;

namespace auto_detail {

// The tree seen from its roots: children, the sequences ending at each segment, the query rows and
// sequences below each, each segment's ancestors (nearest first), and an order with parents first.
struct TreeIndex {
  std::vector<std::vector<int>> children, ends, ancestors;
  std::vector<int64_t> rows, n_below;
  std::vector<int> roots, order;
};

inline TreeIndex index_tree(const Tree& tree) {
  const int n_seg = tree.n_segments();
  TreeIndex x;
  x.children.resize(size_t(n_seg));
  x.ends.resize(size_t(n_seg));
  x.ancestors.resize(size_t(n_seg));
  x.rows.assign(size_t(n_seg), 0);
  x.n_below.assign(size_t(n_seg), 0);
  for (int g = 0; g < n_seg; ++g) {
    const int p = tree.parent(g);
    if (p == Tree::kRoot) x.roots.push_back(g);
    else if (p >= 0) x.children[size_t(p)].push_back(g);
    for (int a = p; a >= 0; a = tree.parent(a)) x.ancestors[size_t(g)].push_back(a);
  }
  for (int s = 0; s < tree.n_sequences(); ++s) {
    const Tree::Sequence& sq = tree.sequence(s);
    if (sq.path.empty()) continue;
    x.ends[size_t(sq.path.back())].push_back(s);
    for (int g : sq.path) {
      x.rows[size_t(g)] += sq.n_query;
      x.n_below[size_t(g)] += 1;
    }
  }
  std::vector<int> stack(x.roots.rbegin(), x.roots.rend());
  while (!stack.empty()) {
    const int g = stack.back();
    stack.pop_back();
    x.order.push_back(g);
    for (int c : x.children[size_t(g)]) stack.push_back(c);
  }
  return x;
}

// The dynamic program. cost[g][j]: least predicted seconds of g's subtree plus, for the j folded
// ancestors just above g (nearest first), the passes their K/V makes over the groups inside g's subtree;
// fold[g][j]: whether g is folded in that optimum.
struct FoldTable {
  std::vector<std::vector<double>> cost;
  std::vector<std::vector<char>> fold;
};

inline FoldTable fold_costs(const Tree& tree, const TreeIndex& x, const CostModel& model, const Target& target,
                            DType dtype) {
  const int n_seg = tree.n_segments();
  FoldTable t;
  t.cost.resize(size_t(n_seg));
  t.fold.resize(size_t(n_seg));
  // A group's passes over g and over the j folded ancestors above it have the same rows, so they run as
  // one pass over all their tokens (the schedule's chains).
  const auto chain_pass = [&](int g, size_t j, int64_t n_rows) {
    int64_t n_tok = tree.n_tokens(g);
    for (size_t a = 0; a < j; ++a) n_tok += tree.n_tokens(x.ancestors[size_t(g)][a]);
    return model.pass_seconds(tree.shape(), target, dtype, n_tok, n_rows);
  };
  for (auto it = x.order.rbegin(); it != x.order.rend(); ++it) {  // children before parents
    const int g = *it;
    const size_t n_anc = x.ancestors[size_t(g)].size();
    t.cost[size_t(g)].assign(n_anc + 1, 0.0);
    t.fold[size_t(g)].assign(n_anc + 1, 0);
    for (size_t j = 0; j <= n_anc; ++j) {
      // Shared: one group, all rows below g, attended by g and by the j folded ancestors.
      double s_cost = chain_pass(g, j, x.rows[size_t(g)]);
      for (int c : x.children[size_t(g)]) s_cost += t.cost[size_t(c)][0];
      // Folded: the chain grows by g; every sequence ending here is its own group.
      double f_cost = 0;
      for (int c : x.children[size_t(g)]) f_cost += t.cost[size_t(c)][j + 1];
      for (int s : x.ends[size_t(g)]) f_cost += chain_pass(g, j, tree.sequence(s).n_query);
      // Fold only for a clear predicted gain: the rates are fitted on short runs, and a shared pass is
      // never far from its minimum traffic, while a wrongly folded long segment re-reads it.
      const bool fold = f_cost < s_cost * (1 - kFoldMargin);
      t.cost[size_t(g)][j] = fold ? f_cost : s_cost;
      t.fold[size_t(g)][j] = fold;
    }
  }
  return t;
}

// The marking the table's optimum makes, from the roots down (folded[g]: g is folded).
inline std::vector<char> backtrack(const TreeIndex& x, const FoldTable& t) {
  std::vector<char> folded(x.children.size(), 0);
  std::vector<std::pair<int, size_t>> stack;
  for (int r : x.roots) stack.push_back({r, 0});
  while (!stack.empty()) {
    const auto [g, j] = stack.back();
    stack.pop_back();
    folded[size_t(g)] = t.fold[size_t(g)][j];
    for (int c : x.children[size_t(g)]) stack.push_back({c, folded[size_t(g)] ? j + 1 : 0});
  }
  return folded;
}

// The tree of a marking. Slots are (segment, group) in order of first use; a group is the nearest shared
// segment at or below the slot on the sequence's path, or the sequence itself (-1 - s) when there is none.
inline std::pair<Tree, std::vector<int>> regroup(const Tree& tree, const std::vector<char>& folded) {
  std::map<std::pair<int, int64_t>, int> slot_of;
  std::vector<int64_t> slot_len;
  std::vector<int> source;
  std::vector<std::vector<int>> paths(size_t(tree.n_sequences()));
  std::vector<int64_t> n_query(size_t(tree.n_sequences()));
  for (int s = 0; s < tree.n_sequences(); ++s) {
    const Tree::Sequence& sq = tree.sequence(s);
    n_query[size_t(s)] = sq.n_query;
    std::vector<int64_t> group(sq.path.size());
    int64_t below = -1 - int64_t(s);
    for (size_t k = sq.path.size(); k-- > 0;) {
      if (!folded[size_t(sq.path[k])]) below = sq.path[k];
      group[k] = below;
    }
    for (size_t k = 0; k < sq.path.size(); ++k) {
      const int g = sq.path[k];
      auto [it, fresh] = slot_of.try_emplace({g, group[k]}, int(source.size()));
      if (fresh) {
        source.push_back(g);
        slot_len.push_back(tree.n_tokens(g));
      }
      paths[size_t(s)].push_back(it->second);
    }
  }
  return {Tree::build(tree.shape(), std::move(slot_len), paths, n_query, tree.scale(), tree.window()),
          std::move(source)};
}

// Per-segment prediction of the tree as given.
inline AutoChoice price_tree(const Tree& tree, const TreeIndex& x, const CostModel& model, const Target& target,
                             DType dtype) {
  AutoChoice c;
  c.segments.assign(size_t(tree.n_segments()), SegmentChoice{});
  for (int g = 0; g < tree.n_segments(); ++g) {
    SegmentChoice& sc = c.segments[size_t(g)];
    sc.shared_s = model.pass_seconds(tree.shape(), target, dtype, tree.n_tokens(g), x.rows[size_t(g)]);
    sc.chosen_s = sc.shared_s;
    sc.n_passes = x.rows[size_t(g)] > 0 && tree.n_tokens(g) > 0 ? 1 : 0;
  }
  c.tree_s = model.plan_seconds(tree, target, dtype);
  c.chosen_s = c.tree_s;
  return c;
}

// Records the regrouped tree's decisions in c (its slots name their segments in `source`).
inline void record_choice(AutoChoice& c, const Tree& tree, const std::vector<char>& folded, const Tree& chosen,
                          const std::vector<int>& source, double chosen_s, const CostModel& model,
                          const Target& target, DType dtype) {
  c.chosen_s = chosen_s;
  c.changed = true;
  for (int g = 0; g < tree.n_segments(); ++g) c.segments[size_t(g)] = {!folded[size_t(g)], 0, c.segments[size_t(g)].shared_s, 0};
  for (int k = 0; k < chosen.n_segments(); ++k) {
    SegmentChoice& sc = c.segments[size_t(source[size_t(k)])];
    const int64_t r = int64_t(chosen.segment_rows(k).size());
    sc.n_passes += r > 0 && chosen.n_tokens(k) > 0 ? 1 : 0;
    sc.chosen_s += model.pass_seconds(tree.shape(), target, dtype, chosen.n_tokens(k), r);
  }
}

}  // namespace auto_detail

// The tree of least predicted time under `model` on `target` (K/V of type `dtype`) that computes what
// `tree` computes: same sequences, rows, keys and scale. Segments on no sequence's path are dropped.
inline Regrouping choose(const Tree& tree, const CostModel& model, const Target& target, DType dtype = DType::f16) {
  using namespace auto_detail;
  CASCADE_CHECK(!model.kv_dtype || *model.kv_dtype == dtype, "auto: the cost model was calibrated on ",
                dtype_name(model.kv_dtype.value_or(dtype)), " K/V, not on the ", dtype_name(dtype),
                " K/V it would price; calibrate one for ", dtype_name(dtype));
  const TreeIndex x = index_tree(tree);
  Regrouping out;
  out.why = price_tree(tree, x, model, target, dtype);
  if (std::none_of(x.n_below.begin(), x.n_below.end(), [](int64_t n) { return n >= 2; })) return out;  // nothing shared
  const std::vector<char> folded = backtrack(x, fold_costs(tree, x, model, target, dtype));
  if (std::none_of(folded.begin(), folded.end(), [](char f) { return f != 0; })) return out;
  auto [chosen, source] = regroup(tree, folded);
  // The dynamic program prices each group's chain on its own; the whole schedule, priced pass by pass,
  // must still beat the tree.
  const double chosen_s = model.plan_seconds(chosen, target, dtype);
  if (chosen_s >= out.why.tree_s) return out;
  record_choice(out.why, tree, folded, chosen, source, chosen_s, model, target, dtype);
  out.tree = std::move(chosen);
  out.source = std::move(source);
  return out;
}

}  // namespace cascade
