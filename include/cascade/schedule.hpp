// The schedule of a step: which work item attends which query rows to which keys, where it writes its
// partial state, and which partial states every output merges. One schedule for every backend (the CPU,
// the CUDA host code, the cost model); what differs between backends is a Target: their kernels' row
// tiles, which kernel takes a pass, how many items the work is split into, where chunks may start.
//
//   1. Passes. A chain of segments attended by exactly the same rows (a segment whose rows all continue,
//      in the same order, into its one child and see all of its keys) is one pass over their tokens in
//      order, so a prefix that only one sequence (or one group of rows) reads costs no extra items or
//      merges over a copy of it. Every other segment with rows and tokens is a pass of its own.
//   2. Items. Stacked row e of a pass is query token row e / group (the pass's token rows, `rows` below)
//      and query head kvh * group + e % group: all query rows below a segment, of all sequences and all
//      heads of a GQA group, are the M dimension of one matrix product. Every (pass, KV head or all of
//      them, tile of stacked rows, chunk of the pass's tokens) is an item. Long passes are cut into chunks
//      (flash-decoding style) so that even one sequence with one KV head keeps every worker busy; a tile's
//      work stops at the last key its rows can see.
//   3. Merge. Every output (row, q head) is the exact merge (state.hpp) of the partial states listed in
//      out_slots[out_begin[i], out_begin[i + 1]), i = row * n_q_heads + qh, in key order; no slot: the empty state.
//
// Batch-invariant blocks (Target::block = C > 0). A row's keys are cut into blocks of C absolute positions (a
// pass's keys start at the sum of the tokens above it), each attended whole by one kernel call, and the output
// merges one state per block in key order: so a row's bits do not depend on how its keys are segmented, chunked or
// stacked with others. A pass that others continue below ends its shared work on a multiple of C; the keys past it
// go with each pass below (align_passes: they are read once more per pass below, fewer than C of them), and chunks
// start on multiples of C. With Target::fold = F (a multiple of C), the blocks of each span of F absolute positions
// merge left to right into one state first (fewer states to write and merge for a long shared pass): an item folds
// the blocks it holds from such a span's first one on, and its other blocks are states of their own, which the
// output folds in the same order (out_fold); the spans' states then merge as above.
//
// Under a sliding window the blocks stay those of absolute positions: a row's first visible block is masked from the
// front (its `first`) as its last may be from the back (its `limit`), and the states of blocks a row does not see at
// all are empty, which every merge passes over exactly (state.hpp). Where a tile's rows see nothing before some key of
// a pass, its first item starts there, rounded down to Target::key_step (the kernels' steps, which leave a state that
// has seen nothing as it was): so its first state has the bits of its block read whole, without reading the keys
// behind every window.
//
// Partial states live in `slots`: item it writes its state k (one per block or fold, item_states; one in all
// without blocks), KV head it.kvh + h and stacked row e to slot it.slot + (k * it.heads + h) * (it.e1 - it.e0) +
// (e - it.e0). A workspace holds o (n_slots, head_dim) then lse (n_slots), natural log: n_slots * (head_dim + 1)
// floats.
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "cascade/error.hpp"
#include "cascade/kernel_choice.hpp"
#include "cascade/tree.hpp"

namespace cascade {

// How a backend runs one pass: one of its kernels (or kernel configurations).
struct KernelTile {
  int64_t tile_rows = 128;  // stacked rows per item at most
  bool all_heads = false;   // one item carries every KV head (else one KV head per item)
  // Relative work of an item per key, to split passes evenly: tile_cost + row_cost * rows * heads.
  double tile_cost = 0;
  double row_cost = 1;
};

// What the schedule needs to know of the backend that runs it.
struct Target {
  const char* backend = "";     // who runs it ("cpu", "cuda"); a backend refuses another's plan
  KernelTile kernels[2];
  // A pass with at most few_rows stacked rows per KV head takes kernels[few_kernel], any other the other one.
  int64_t few_rows = 0;
  int few_kernel = 1;
  KernelChoices kernel_choices;  // CPU: the code each kernel runs, per K/V type (kernel_choice.hpp)
  double n_items = 8;           // aim: long passes are chunked until the work is about this many items
  int64_t min_chunk = 256;      // shortest chunk of a pass's tokens one item takes when a pass is split
  int64_t chunk_align = 1;      // chunk boundaries fall on multiples of this
  bool cut_at_joins = false;    // items never straddle two segments of a chain (kernels reading one span)
  int n_threads = 0;            // CPU: threads the items run on (0: the caller's arena); others ignore it
  int64_t block = 0;            // > 0: batch-invariant blocks of this many keys (above; chunk_align its multiple)
  int64_t key_step = 0;         // > 0 (blocks): a tile's first item may start on a multiple of this inside a block
                                // (the keys before it masked for all its rows: above); 0: items start on blocks
  int64_t fold = 0;             // > block: the blocks of a span of this many positions fold into one state

  // The kernel (0 or 1) of a pass with rows_per_head stacked rows per KV head.
  int pick(int64_t rows_per_head) const { return rows_per_head <= few_rows ? few_kernel : 1 - few_kernel; }
};

struct Schedule {
  struct Pass {
    int kernel = 0;
    int64_t n_tokens = 0;      // its segments' tokens, in key order
    int64_t origin = 0;        // blocks: the position of its first key in its sequences (else 0)
    int64_t n_token_rows = 0;  // query tokens attending it
    int64_t seg_begin = 0, seg_end = 0;  // its segments: segs[seg_begin, seg_end)
    int64_t row_begin = 0;     // its token rows: rows[row_begin, row_begin + n_token_rows)
    int64_t group_begin = -1;  // its item groups (KV head x row tile): groups[group_begin, ...); -1: no work
    int64_t n_tiles = 0;       // row tiles per KV-head group
  };
  struct PassSegment {
    int seg = 0;        // segment of the tree the schedule was made from
    int64_t start = 0;  // key offset of its first token inside the pass
    int64_t from = 0;   // its first token in the segment (> 0 only for the end of a segment above: align_passes)
    int64_t n_tokens = 0;  // tokens it takes from the segment
  };
  struct Row {
    int64_t q_row = 0;  // query row (in q, o)
    int64_t limit = 0;  // keys of the pass it sees: [first, limit)
    int64_t first = 0;  // > 0 only under a sliding window
  };
  struct Item {
    int pass = 0;
    int kvh = 0;         // first KV head
    int heads = 1;       // KV heads [kvh, kvh + heads)
    int64_t e0 = 0, e1 = 0;  // stacked rows [e0, e1) of the pass
    int64_t t0 = 0, t1 = 0;  // keys [t0, t1) of the pass
    int64_t slot = 0;    // first slot of its partial states
    int64_t n_states = 1;  // states per (head, row): item_states
  };

  std::vector<Pass> passes;
  std::vector<PassSegment> segs;
  std::vector<Row> rows;
  std::vector<Item> items;
  std::vector<int32_t> largest_first;  // item indices, the most work (rows x heads x keys) first
  std::vector<int64_t> groups;    // per item group: its first item; plus a final sentinel
  std::vector<int64_t> out_begin;  // (n_rows * n_q_heads + 1)
  std::vector<int64_t> out_slots;
  int64_t n_slots = 0;
  int64_t block = 0;  // Target::block where blocks are on, else 0
  int64_t fold = 0;   // Target::fold where blocks fold, else 0
  std::vector<char> out_fold;  // per out_slots entry: 1 where it folds into the entry before it (same span)

  int64_t workspace_floats(int head_dim) const { return n_slots * (int64_t(head_dim) + 1); }
  // Items holding the states of stacked row e of pass p for KV head kvh: [first, last).
  std::pair<int64_t, int64_t> items_of(int p, int kvh, int64_t e, const Target& target) const {
    const Pass& ps = passes[size_t(p)];
    const KernelTile& k = target.kernels[ps.kernel];
    const int64_t g = ps.group_begin + (k.all_heads ? 0 : int64_t(kvh) * ps.n_tiles) + e / k.tile_rows;
    return {groups[size_t(g)], groups[size_t(g) + 1]};
  }
  // The slot of (state k, KV head kvh, stacked row e) in item it.
  static int64_t slot_of(const Item& it, int kvh, int64_t e, int64_t k = 0) {
    return it.slot + (k * it.heads + (kvh - it.kvh)) * (it.e1 - it.e0) + (e - it.e0);
  }
  // Blocks: the end of the block holding pass key t (a pass starts on a block, align_passes).
  int64_t block_end(int64_t t) const { return (t / block + 1) * block; }
  // Whether keys from pass key t of pass p start a span of `fold` positions.
  bool starts_fold(int p, int64_t t) const { return fold > 0 && (passes[size_t(p)].origin + t) % fold == 0; }
  // Calls f(k, a, b) for the states of item it in order: state k holds keys [a, b) of its pass. Without blocks, one
  // state; with blocks, one per block (the first from the item's first key, which may lie inside its block: Target::
  // key_step), except that blocks after one that starts a fold span (in the item) join its state up to the span's end.
  template <class F>
  void item_states(const Item& it, F f) const {
    if (block <= 0) return f(int64_t(0), it.t0, it.t1);
    int64_t k = 0, a = it.t0;
    for (int64_t x = block_end(it.t0); x < it.t1; x += block)
      if (!starts_fold(it.pass, a) || starts_fold(it.pass, x)) {
        f(k++, a, x);
        a = x;
      }
    f(k, a, it.t1);
  }
};

namespace schedule_detail {

// The passes of a tree (step 1): fills s.passes, s.segs and s.rows; returns, per segment, the pass it
// heads (-1: inside a chain, or on no path).
inline std::vector<int> add_passes(Schedule& s, const Tree& tree) {
  const int n_seg = tree.n_segments();
  // fuse_into[g]: g's only child when that child has exactly g's rows (same order) and every row sees all
  // of g's keys; then the two run as one pass.
  // (Rows of siblings are disjoint, so at most one child has all of g's rows.)
  std::vector<int> fuse_into(size_t(n_seg), -1);
  std::vector<char> fused_child(size_t(n_seg), 0);
  for (int c = 0; c < n_seg; ++c) {
    const int g = tree.parent(c);
    if (g < 0) continue;
    const auto& rg = tree.segment_rows(g);
    const auto& rc = tree.segment_rows(c);
    if (rg.empty() || rg.size() != rc.size()) continue;
    bool same = true;
    for (size_t r = 0; r < rg.size() && same; ++r)
      same = rg[r].row == rc[r].row && rg[r].limit == tree.n_tokens(g) && rg[r].first == 0;
    if (!same) continue;
    fuse_into[size_t(g)] = c;
    fused_child[size_t(c)] = 1;
  }
  std::vector<int> head_pass(size_t(n_seg), -1);
  for (int g = 0; g < n_seg; ++g) {
    if (fused_child[size_t(g)] || tree.parent(g) == Tree::kUnused) continue;
    Schedule::Pass ps;
    ps.seg_begin = int64_t(s.segs.size());
    int last = g;
    for (int x = g; x >= 0; x = fuse_into[size_t(x)]) {
      s.segs.push_back({x, ps.n_tokens, 0, tree.n_tokens(x)});
      ps.n_tokens += tree.n_tokens(x);
      last = x;
    }
    ps.seg_end = int64_t(s.segs.size());
    // A row sees up to its limit in the chain's last segment, from the start of the chain's first segment with
    // tokens (a row sees all of a segment that fuses with its child), else from its first key in the last.
    const auto& rows = tree.segment_rows(last);
    const int64_t last_start = s.segs.back().start;
    int64_t chain_first = -1;
    for (int64_t k = ps.seg_begin; k + 1 < ps.seg_end && chain_first < 0; ++k)
      if (tree.n_tokens(s.segs[size_t(k)].seg) > 0) chain_first = s.segs[size_t(k)].start;
    ps.row_begin = int64_t(s.rows.size());
    ps.n_token_rows = int64_t(rows.size());
    for (const Tree::SegmentRow& r : rows)
      s.rows.push_back({r.row, last_start + r.limit, chain_first >= 0 ? chain_first : last_start + r.first});
    head_pass[size_t(g)] = int(s.passes.size());
    s.passes.push_back(ps);
  }
  return head_pass;
}

// Chunks of [0, span) for one tile (step 2): about cost * span / per_item of them, none shorter than
// min_chunk (unless the span is), boundaries on multiples of chunk_align. Safe for spans near INT64_MAX.
inline int64_t chunk_step(const Target& t, double cost_per_key, int64_t span, double per_item) {
  const double want = cost_per_key * double(span) / per_item + 0.5;
  int64_t n_chunks = want < double(span) ? int64_t(want) : span;
  n_chunks = std::clamp<int64_t>(n_chunks, 1, std::max<int64_t>(1, span / t.min_chunk));
  int64_t step = span / n_chunks + (span % n_chunks != 0);
  if (step % t.chunk_align != 0) step += std::min(t.chunk_align - step % t.chunk_align, span - step);
  return std::max<int64_t>(step, 1);
}

// Batch-invariant blocks of C keys (file comment): where a pass's keys end past a multiple of C and passes continue
// below it, its keys from that multiple on join the front of every pass below it, and its rows that continue below
// it stop there. Passes go parents first, so a pass below takes the keys its parent was given too. Every pass then
// starts on a multiple of C. Rows whose sequence ends in the pass keep seeing all of it. Under a sliding window a
// row's `first` moves with its pass's keys: a row below sees the moved keys from where its window starts among them
// (all of them where it starts above them, none where it starts below), and a row that stops at the cut sees nothing
// of its pass where its window starts past it.
inline void align_passes(Schedule& s, const Tree& tree, const std::vector<int>& row_leaf, int64_t C) {
  const size_t n_pass = s.passes.size();
  std::vector<std::vector<Schedule::PassSegment>> segs(n_pass);
  std::vector<int> depth(n_pass, 0), order(n_pass);
  std::vector<int64_t> start(n_pass, 0);  // absolute position of each pass's first key
  // A row's limit and first in the pass being moved from.
  std::vector<int64_t> above(size_t(tree.n_rows()), 0), above_first(size_t(tree.n_rows()), 0);
  for (size_t p = 0; p < n_pass; ++p) {
    const Schedule::Pass& ps = s.passes[p];
    segs[p].assign(s.segs.begin() + ps.seg_begin, s.segs.begin() + ps.seg_end);
    for (int g = tree.parent(segs[p].front().seg); g >= 0; g = tree.parent(g)) {
      start[p] += tree.n_tokens(g);
      ++depth[p];
    }
    order[p] = int(p);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return depth[size_t(a)] < depth[size_t(b)]; });
  for (int p : order) {
    Schedule::Pass& ps = s.passes[size_t(p)];
    const int64_t end = start[size_t(p)] + ps.n_tokens, cut = end / C * C - start[size_t(p)];
    const int parent_seg = segs[size_t(p)].back().seg;
    if (cut == ps.n_tokens) continue;
    std::vector<Schedule::PassSegment> tail;  // its keys [cut, n_tokens)
    for (const Schedule::PassSegment& g : segs[size_t(p)])
      if (g.n_tokens > 0 && g.start + g.n_tokens > cut) {
        const int64_t skip = std::max<int64_t>(0, cut - g.start);
        tail.push_back({g.seg, 0, g.from + skip, g.n_tokens - skip});
      }
    for (int64_t r = ps.row_begin; r < ps.row_begin + ps.n_token_rows; ++r) {
      above[size_t(s.rows[size_t(r)].q_row)] = s.rows[size_t(r)].limit;
      above_first[size_t(s.rows[size_t(r)].q_row)] = s.rows[size_t(r)].first;
    }
    bool below = false;
    for (size_t q = 0; q < n_pass; ++q) {
      if (tree.parent(s.segs[size_t(s.passes[q].seg_begin)].seg) != parent_seg) continue;  // not below p
      below = true;
      const int64_t moved = ps.n_tokens - cut;
      segs[q].insert(segs[q].begin(), tail.begin(), tail.end());
      int64_t at = 0;
      for (Schedule::PassSegment& g : segs[q]) {
        g.start = at;
        at += g.n_tokens;
      }
      s.passes[q].n_tokens += moved;
      start[q] -= moved;
      // A row below sees the moved keys up to its position: all of them where it sees any key of its own pass. Its
      // window starts where it did: inside its own pass (first > 0: as many keys further on), or at or before the
      // pass's start (first 0: from where it starts in the moved keys, at 0 where it starts above them).
      for (int64_t r = 0; r < s.passes[q].n_token_rows; ++r) {
        Schedule::Row& row = s.rows[size_t(s.passes[q].row_begin + r)];
        const int64_t from_above = std::max<int64_t>(0, above_first[size_t(row.q_row)] - cut);
        if (row.limit > 0) {
          row.first = row.first > 0 ? row.first + moved : from_above;
          row.limit += moved;
        } else {
          row.limit = std::max<int64_t>(0, above[size_t(row.q_row)] - cut);
          row.first = std::min(from_above, row.limit);
        }
      }
    }
    if (!below) continue;
    for (int64_t r = 0; r < ps.n_token_rows; ++r) {
      Schedule::Row& row = s.rows[size_t(ps.row_begin + r)];
      if (row_leaf[size_t(row.q_row)] == parent_seg) continue;
      row.limit = std::min(row.limit, cut);
      row.first = std::min(row.first, row.limit);
    }
  }
  s.segs.clear();
  for (size_t p = 0; p < n_pass; ++p) {
    s.passes[p].origin = start[p];
    s.passes[p].seg_begin = int64_t(s.segs.size());
    s.segs.insert(s.segs.end(), segs[p].begin(), segs[p].end());
    s.passes[p].seg_end = int64_t(s.segs.size());
  }
}

// One item per chunk [t0, t1), or per piece of it between segment joins when the target asks.
inline void add_chunk_items(Schedule& s, const Target& t, int p, Schedule::Item it) {
  const Schedule::Pass& ps = s.passes[size_t(p)];
  const int64_t t1 = it.t1;
  while (it.t0 < t1) {
    it.t1 = t1;
    if (t.cut_at_joins)
      for (int64_t k = ps.seg_begin + 1; k < ps.seg_end; ++k)
        if (s.segs[size_t(k)].start > it.t0) {
          it.t1 = std::min(t1, s.segs[size_t(k)].start);
          break;
        }
    it.slot = s.n_slots;
    it.n_states = 0;
    s.item_states(it, [&](int64_t, int64_t, int64_t) { ++it.n_states; });
    s.n_slots += it.n_states * it.heads * (it.e1 - it.e0);
    s.items.push_back(it);
    it.t0 = it.t1;
  }
}

// The items of every pass (step 2): picks each pass's kernel, tiles its rows, chunks its keys.
inline void add_items(Schedule& s, const HeadShape& shape, const Target& t) {
  CASCADE_CHECK((t.few_kernel == 0 || t.few_kernel == 1) && t.min_chunk > 0 && t.chunk_align > 0 && t.n_items > 0 &&
                    t.block >= 0 && t.key_step >= 0 &&
                    (t.block == 0 || (t.chunk_align % t.block == 0 && t.fold % t.block == 0 &&
                                      (t.key_step == 0 || t.block % t.key_step == 0))),
                "schedule: incomplete target");
  const int group = shape.group(), n_kvh = shape.n_kv_heads;
  const auto cost_per_key = [&](const KernelTile& k, int64_t rows, int heads) {
    return k.tile_cost + k.row_cost * double(rows) * heads;
  };
  double total = 0;
  for (Schedule::Pass& ps : s.passes) {
    const int64_t m = ps.n_token_rows * group;
    ps.kernel = t.pick(m);
    CASCADE_CHECK(ps.kernel == 0 || ps.kernel == 1, "schedule: the target picked kernel ", ps.kernel);
    const KernelTile& k = t.kernels[ps.kernel];
    CASCADE_CHECK(k.tile_rows > 0, "schedule: kernel ", ps.kernel, " has no row tile");
    ps.n_tiles = (m + k.tile_rows - 1) / k.tile_rows;
    for (int64_t tile = 0; tile < ps.n_tiles; ++tile)
      total += cost_per_key(k, std::min(k.tile_rows, m - tile * k.tile_rows), k.all_heads ? n_kvh : 1) *
               double(ps.n_tokens) * (k.all_heads ? 1 : n_kvh);
  }
  const double per_item = std::max(1.0, total / t.n_items);
  for (int p = 0; p < int(s.passes.size()); ++p) {
    Schedule::Pass& ps = s.passes[size_t(p)];
    const int64_t m = ps.n_token_rows * group;
    if (m == 0 || ps.n_tokens == 0) continue;
    const KernelTile& k = t.kernels[ps.kernel];
    const int heads = k.all_heads ? n_kvh : 1;
    ps.group_begin = int64_t(s.groups.size());
    for (int kvh = 0; kvh < n_kvh; kvh += heads) {
      for (int64_t tile = 0; tile < ps.n_tiles; ++tile) {
        s.groups.push_back(int64_t(s.items.size()));
        const int64_t e0 = tile * k.tile_rows, e1 = std::min(m, e0 + k.tile_rows);
        // Keys [lo, span) hold every key the tile's rows see: the work outside is skipped.
        int64_t lo = ps.n_tokens, span = 0;
        for (int64_t r = e0 / group; r < (e1 + group - 1) / group; ++r) {
          const Schedule::Row& row = s.rows[size_t(ps.row_begin + r)];
          if (row.first >= row.limit) continue;
          lo = std::min(lo, row.first);
          span = std::max(span, row.limit);
        }
        if (span <= lo) continue;
        // Chunk boundaries stay on the target's multiples; with blocks the first chunk starts at the key step
        // holding the tile's first key seen (the keys of its block before it are masked for every row: file
        // comment).
        const int64_t first = t.block > 0 && t.key_step > 0 ? lo - lo % t.key_step : -1;
        lo -= lo % t.chunk_align;
        const int64_t step = chunk_step(t, cost_per_key(k, e1 - e0, heads), span - lo, per_item);
        for (int64_t t0 = lo; t0 < span;) {
          const int64_t t1 = span - t0 > step ? t0 + step : span;
          add_chunk_items(s, t, p, {p, kvh, heads, e0, e1, std::max(t0, first), t1, 0});
          t0 = t1;
        }
      }
    }
  }
  s.groups.push_back(int64_t(s.items.size()));
  const auto work = [&](int32_t i) {
    const Schedule::Item& it = s.items[size_t(i)];
    return double(it.heads) * double(it.e1 - it.e0) * double(it.t1 - it.t0);
  };
  s.largest_first.resize(s.items.size());
  for (size_t i = 0; i < s.items.size(); ++i) s.largest_first[i] = int32_t(i);
  std::stable_sort(s.largest_first.begin(), s.largest_first.end(),
                   [&](int32_t a, int32_t b) { return work(a) > work(b); });
}

// The merge lists (step 3). parts(row, add) calls add(pass, token row of the pass) for every pass whose
// states output row `row` merges, in key order.
template <class Parts>
void add_merge_lists(Schedule& s, const HeadShape& shape, const Target& t, int64_t n_rows, Parts parts) {
  const int group = shape.group();
  s.out_begin.assign(size_t(n_rows * shape.n_q_heads + 1), 0);
  s.out_slots.clear();
  s.out_fold.clear();
  for (int64_t row = 0; row < n_rows; ++row) {
    for (int qh = 0; qh < shape.n_q_heads; ++qh) {
      s.out_begin[size_t(row * shape.n_q_heads + qh)] = int64_t(s.out_slots.size());
      const int kvh = qh / group;
      parts(row, [&](int p, int64_t token_row) {
        if (s.passes[size_t(p)].group_begin < 0) return;  // a pass with no work
        const int64_t e = token_row * group + qh % group;
        const auto [first, last] = s.items_of(p, kvh, e, t);
        for (int64_t i = first; i < last; ++i)
          s.item_states(s.items[size_t(i)], [&](int64_t k, int64_t a, int64_t) {
            s.out_slots.push_back(Schedule::slot_of(s.items[size_t(i)], kvh, e, k));
            s.out_fold.push_back(s.fold > 0 && !s.starts_fold(p, a));
          });
      });
    }
  }
  s.out_begin.back() = int64_t(s.out_slots.size());
}

}  // namespace schedule_detail

// The passes of a tree (step 1 alone: segs, rows and passes, no items): what the cost model prices.
inline Schedule make_passes(const Tree& tree) {
  Schedule s;
  schedule_detail::add_passes(s, tree);
  return s;
}

// The schedule of a tree for a target.
inline Schedule make_schedule(const Tree& tree, const Target& target) {
  Schedule s;
  const std::vector<int> head_pass = schedule_detail::add_passes(s, tree);
  std::vector<int> row_seq(size_t(tree.n_rows())), row_leaf(size_t(tree.n_rows()), -1);
  for (int q = 0; q < tree.n_sequences(); ++q) {
    const Tree::Sequence& sq = tree.sequence(q);
    std::fill_n(row_seq.begin() + sq.row_begin, sq.n_query, q);
    if (!sq.path.empty()) std::fill_n(row_leaf.begin() + sq.row_begin, sq.n_query, sq.path.back());
  }
  Target t = target;
  for (int q = 0; q < tree.n_sequences(); ++q)  // no blocks past 2^31 keys: states per block would not fit
    if (tree.sequence(q).n_keys > (int64_t(1) << 31)) t.block = 0;
  if (t.block > 0) schedule_detail::align_passes(s, tree, row_leaf, t.block);
  s.block = t.block;
  s.fold = t.block > 0 && t.fold > t.block ? t.fold : 0;
  schedule_detail::add_items(s, tree.shape(), t);
  // Each row merges the passes its sequence's path heads (a chain's segments after its head add nothing).
  schedule_detail::add_merge_lists(s, tree.shape(), t, tree.n_rows(), [&](int64_t row, auto&& add) {
    const Tree::Sequence& sq = tree.sequence(row_seq[size_t(row)]);
    for (size_t k = 0; k < sq.path.size(); ++k) {
      const int p = head_pass[size_t(sq.path[k])];
      if (p >= 0) add(p, sq.seg_row_begin[k] + (row - sq.row_begin));
    }
  });
  return s;
}

// The schedule of the unified baseline: one pass over a buffer of n_keys keys (segment 0) that every one of
// the n_rows query token rows scores in full; the backend masks out other sequences' keys.
inline Schedule make_unified_schedule(const HeadShape& shape, int64_t n_keys, int64_t n_rows, const Target& target) {
  shape.validate();
  CASCADE_CHECK(n_keys >= 0 && n_rows >= 0, "unified schedule: negative key (", n_keys, ") or row (", n_rows,
                ") count");
  Schedule s;
  Schedule::Pass ps;
  ps.n_tokens = n_keys;
  ps.n_token_rows = n_rows;
  ps.seg_end = 1;
  s.segs.push_back({0, 0, 0, n_keys});
  s.rows.resize(size_t(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) s.rows[size_t(r)] = {r, n_keys, 0};
  s.passes.push_back(ps);
  Target t = target;
  t.block = 0;  // a unified buffer's keys are not positions of one sequence: no blocks (docs/serving.md)
  schedule_detail::add_items(s, shape, t);
  schedule_detail::add_merge_lists(s, shape, t, n_rows, [](int64_t row, auto&& add) { add(0, row); });
  return s;
}

// Checks that a schedule of `tree` computes what the tree says, from the work list alone: every item
// stays inside its pass and row tile, every slot is written by exactly one item, and every output merges
// states of its own row and head that cover each key it sees exactly once (and no other). Throws an Error
// naming the first violation. Costs about as much as making the schedule; for tests and fuzzing.
inline void verify_schedule(const Tree& tree, const Schedule& s) {
  const HeadShape& shape = tree.shape();
  const int group = shape.group();
  std::vector<int64_t> slot_item(size_t(s.n_slots), -1);
  for (size_t i = 0; i < s.items.size(); ++i) {
    const Schedule::Item& it = s.items[i];
    CASCADE_CHECK(it.pass >= 0 && it.pass < int(s.passes.size()), "schedule: item ", i, " names pass ", it.pass);
    const Schedule::Pass& ps = s.passes[size_t(it.pass)];
    CASCADE_CHECK(it.kvh >= 0 && it.heads >= 1 && it.kvh + it.heads <= shape.n_kv_heads && it.e0 >= 0 &&
                      it.e0 < it.e1 && it.e1 <= ps.n_token_rows * group && it.t0 >= 0 && it.t0 < it.t1 &&
                      it.t1 <= ps.n_tokens,
                  "schedule: item ", i, " is out of its pass");
    CASCADE_CHECK(s.block == 0 || ps.origin % s.block == 0, "schedule: item ", i, "'s pass starts at position ",
                  ps.origin, ", off a block of ", s.block);
    for (int64_t k = it.slot; k < it.slot + it.n_states * it.heads * (it.e1 - it.e0); ++k) {
      CASCADE_CHECK(k >= 0 && k < s.n_slots && slot_item[size_t(k)] < 0, "schedule: slot ", k, " written twice");
      slot_item[size_t(k)] = int64_t(i);
    }
  }
  CASCADE_CHECK(int64_t(s.out_begin.size()) == tree.n_rows() * shape.n_q_heads + 1, "schedule: merge lists for ",
                s.out_begin.size(), " outputs");
  // Each item's states' key ranges, listed once: looking one up by walking the item's blocks for every slot
  // merged would cost (blocks of an item) squared, hours for an item of a few million blocks.
  std::vector<int64_t> state_begin(s.items.size() + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> state_keys;
  for (size_t i = 0; i < s.items.size(); ++i) {
    s.item_states(s.items[i], [&](int64_t, int64_t a, int64_t b) { state_keys.emplace_back(a, b); });
    state_begin[i + 1] = int64_t(state_keys.size());
    CASCADE_CHECK(state_begin[i + 1] - state_begin[i] == s.items[i].n_states, "schedule: item ", i, " has ",
                  s.items[i].n_states, " states per row and head, and ", state_begin[i + 1] - state_begin[i],
                  " blocks or folds");
  }
  std::vector<std::tuple<int, int64_t, int64_t>> spans;  // (pass, first key, end) that an output merges
  for (int sq_i = 0; sq_i < tree.n_sequences(); ++sq_i) {
    const Tree::Sequence& sq = tree.sequence(sq_i);
    for (int64_t i = 0; i < sq.n_query; ++i) {
      const int64_t row = sq.row_begin + i;
      int64_t visible = std::clamp<int64_t>(sq.n_keys - sq.n_query + i + 1, 0, sq.n_keys);
      if (tree.window() > 0) visible = std::min(visible, tree.window());
      for (int qh = 0; qh < shape.n_q_heads; ++qh) {
        const int64_t o = row * shape.n_q_heads + qh;
        spans.clear();
        int64_t covered = 0;
        for (int64_t k = s.out_begin[size_t(o)]; k < s.out_begin[size_t(o) + 1]; ++k) {
          const int64_t slot = s.out_slots[size_t(k)];
          CASCADE_CHECK(slot >= 0 && slot < s.n_slots && slot_item[size_t(slot)] >= 0, "schedule: output ", o,
                        " merges slot ", slot, ", which no item writes");
          const Schedule::Item& it = s.items[size_t(slot_item[size_t(slot)])];
          const Schedule::Pass& ps = s.passes[size_t(it.pass)];
          const int64_t n = it.e1 - it.e0, e = it.e0 + (slot - it.slot) % n;
          const int kvh = it.kvh + int((slot - it.slot) / n % it.heads);
          const int64_t state = (slot - it.slot) / n / it.heads;  // < it.n_states: the slot is the item's
          const auto [b0, b1] = state_keys[size_t(state_begin[size_t(slot_item[size_t(slot)])] + state)];
          const Schedule::Row& r = s.rows[size_t(ps.row_begin + e / group)];
          CASCADE_CHECK(r.q_row == row && kvh == qh / group && e % group == qh % group, "schedule: output ", o,
                        " merges the state of another row or head");
          const int64_t t0 = std::max(b0, r.first), t1 = std::min(b1, r.limit);
          if (t1 <= t0) continue;
          spans.push_back({it.pass, t0, t1});
          covered += t1 - t0;
        }
        std::sort(spans.begin(), spans.end());
        for (size_t k = 1; k < spans.size(); ++k)
          CASCADE_CHECK(std::get<0>(spans[k]) != std::get<0>(spans[k - 1]) ||
                            std::get<1>(spans[k]) >= std::get<2>(spans[k - 1]),
                        "schedule: output ", o, " merges a key twice");
        CASCADE_CHECK(covered == visible, "schedule: output ", o, " merges ", covered, " keys but sees ", visible);
      }
    }
  }
}

}  // namespace cascade
