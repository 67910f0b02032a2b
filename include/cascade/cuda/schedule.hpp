// The plan-to-launch translation of the CUDA path: which thread block attends which query rows to which
// keys, where it writes its partial state, and which partial states every output merges. Plain C++ (no
// CUDA headers), so the CPU tests check it on machines without a GPU.
//
// Work item. One thread block attends the stacked rows [e0, e0 + n_rows) of one pass (a plan segment, or
// the unified buffer) for one KV head to the tokens [t0, t1) of that pass. Stacked row e of a pass is
// query token row e / group (the pass's token rows in Plan::segment_rows order) and query head
// kvh * group + e % group: all query rows below a segment, of all sequences and all heads of a GQA group,
// are the M dimension of one matrix product. The block writes one partial state (o: head_dim floats, lse)
// per row into slots [slot, slot + n_rows) of the partial buffers.
//
// Two tile shapes (kernel configurations):
//   narrow: 16 rows per block, the warps split each KV tile between them (the per-sequence pass: a few
//           rows against a long own segment; memory bound);
//   wide:   64 rows per block, every warp takes 16 rows of one shared KV tile (the shared-segment pass: many
//           rows against one prefix; bound by the tensor cores).
// A pass whose stacked rows fit in 16 runs narrow, any other wide. Long passes are split into chunks of
// tokens across blocks (flash-decoding), so that the launch has a few blocks per multiprocessor.
//
// Merge. Output (row, q head) is the exact merge (state.hpp) of the slots listed in
// out_slots[out_begin[i], out_begin[i + 1]) with i = row * n_q_heads + qh. An output with no slot (a row
// that sees no key) gets the empty state (0, -inf).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cascade/cuda/work.hpp"
#include "cascade/error.hpp"
#include "cascade/plan.hpp"

namespace cascade::cuda {

struct Schedule {
  std::vector<WorkItem> items[2];  // per configuration, longest first
  std::vector<RowDesc> rows;       // every pass's token rows, pass after pass
  std::vector<int32_t> pass_row_begin;
  std::vector<int64_t> out_begin;  // (n_rows * n_q_heads + 1)
  std::vector<int64_t> out_slots;
  int64_t n_slots = 0;

  int64_t n_items() const { return int64_t(items[0].size() + items[1].size()); }
};

struct ScheduleOptions {
  int n_sm = 132;          // multiprocessors of the device
  int blocks_per_sm = 4;   // aim for about this many blocks per multiprocessor in all
};

namespace detail {

inline int32_t to_i32(int64_t x, const char* what) {
  CASCADE_CHECK(x >= 0 && x <= std::numeric_limits<int32_t>::max(), "CUDA schedule: ", what, " (", x,
                ") does not fit in 32 bits");
  return int32_t(x);
}

// Builds the items of n_pass passes. n_token_rows(p): token rows of pass p; length(p): its tokens;
// reach(p, r0, r1): how many of its tokens token rows [r0, r1) see at most (the work past it is skipped).
// group: q heads per KV head. Fills sc.items and returns, per pass, the index of its first item group
// (pass, kvh, row tile) in `group_first` (-1: no work), and each pass's configuration and tile count.
struct Groups {
  std::vector<int64_t> first;     // per group: first item (in `order` below); plus a final sentinel
  std::vector<int> order_cfg;     // per item in build order: configuration
  std::vector<int64_t> order_idx; //                        and index in sc.items[cfg] before sorting
  std::vector<int64_t> pass_group, pass_tiles;
  std::vector<int> pass_cfg;
};

template <class NRows, class Len, class Reach>
Groups build_items(Schedule& sc, int n_pass, int n_kv_heads, int group, const ScheduleOptions& opt,
                   NRows n_token_rows, Len length, Reach reach) {
  Groups g;
  g.pass_group.assign(n_pass, -1);
  g.pass_tiles.assign(n_pass, 0);
  g.pass_cfg.assign(n_pass, kNarrow);
  // Cost of a block: its tokens, times 4 for the wide tile (four warps of rows per token, against one).
  double total = 0;
  for (int p = 0; p < n_pass; ++p) {
    const int64_t m = n_token_rows(p) * group;
    if (m == 0 || length(p) == 0) continue;
    const int cfg = m <= kTileRows[kNarrow] ? kNarrow : kWide;
    const int64_t n_tiles = (m + kTileRows[cfg] - 1) / kTileRows[cfg];
    total += double(n_tiles) * n_kv_heads * double(length(p)) * (cfg == kWide ? 4 : 1);
  }
  const double target_blocks = double(std::max(1, opt.n_sm) * std::max(1, opt.blocks_per_sm));
  const double per_block = std::max(1.0, total / target_blocks);
  for (int p = 0; p < n_pass; ++p) {
    const int64_t m = n_token_rows(p) * group, len = length(p);
    if (m == 0 || len == 0) continue;
    const int cfg = m <= kTileRows[kNarrow] ? kNarrow : kWide;
    const int64_t rows = kTileRows[cfg];
    const int64_t n_tiles = (m + rows - 1) / rows;
    g.pass_group[p] = int64_t(g.first.size());
    g.pass_tiles[p] = n_tiles;
    g.pass_cfg[p] = cfg;
    for (int kvh = 0; kvh < n_kv_heads; ++kvh) {
      for (int64_t tile = 0; tile < n_tiles; ++tile) {
        g.first.push_back(int64_t(g.order_cfg.size()));
        const int64_t e0 = tile * rows, e1 = std::min(m, e0 + rows);
        const int64_t span = std::min(len, reach(p, e0 / group, (e1 + group - 1) / group));
        if (span <= 0) continue;  // every row of the tile is masked out of this pass
        const double cost = double(span) * (cfg == kWide ? 4 : 1);
        int64_t n_chunks = int64_t(cost / per_block + 0.5);
        n_chunks = std::clamp<int64_t>(n_chunks, 1, std::max<int64_t>(1, span / kMinChunk));
        int64_t step = (span + n_chunks - 1) / n_chunks;
        step = (step + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
        for (int64_t t0 = 0; t0 < span; t0 += step) {
          WorkItem it;
          it.pass = p;
          it.kvh = kvh;
          it.e0 = to_i32(e0, "stacked row");
          it.n_rows = int32_t(e1 - e0);
          it.t0 = to_i32(t0, "token");
          it.t1 = to_i32(std::min(span, t0 + step), "token");
          it.slot = sc.n_slots;
          sc.n_slots += e1 - e0;
          g.order_cfg.push_back(cfg);
          g.order_idx.push_back(int64_t(sc.items[cfg].size()));
          sc.items[cfg].push_back(it);
        }
      }
    }
  }
  g.first.push_back(int64_t(g.order_cfg.size()));
  return g;
}

// Fills out_begin/out_slots: parts(row, qh, add) calls add(pass, e) for every pass the output merges.
template <class Parts>
void build_merge(Schedule& sc, const Groups& g, int64_t n_rows, int n_q_heads, int group, Parts parts) {
  sc.out_begin.assign(size_t(n_rows * n_q_heads + 1), 0);
  sc.out_slots.clear();
  for (int64_t row = 0; row < n_rows; ++row) {
    for (int qh = 0; qh < n_q_heads; ++qh) {
      sc.out_begin[size_t(row * n_q_heads + qh)] = int64_t(sc.out_slots.size());
      const int kvh = qh / group;
      parts(row, qh, [&](int p, int64_t e) {
        if (g.pass_group[p] < 0) return;  // nothing to merge from this pass
        const int cfg = g.pass_cfg[p];
        const int64_t gi = g.pass_group[p] + int64_t(kvh) * g.pass_tiles[p] + e / kTileRows[cfg];
        for (int64_t k = g.first[gi]; k < g.first[gi + 1]; ++k) {
          const WorkItem& it = sc.items[g.order_cfg[k]][g.order_idx[k]];
          sc.out_slots.push_back(it.slot + (e - it.e0));
        }
      });
    }
  }
  sc.out_begin.back() = int64_t(sc.out_slots.size());
}

// Longest items first, so the last wave of blocks is made of short ones.
inline void sort_items(Schedule& sc) {
  for (auto& list : sc.items)
    std::stable_sort(list.begin(), list.end(),
                     [](const WorkItem& a, const WorkItem& b) { return a.t1 - a.t0 > b.t1 - b.t0; });
}

}  // namespace detail

// The schedule of a plan: pass g is segment g.
inline Schedule make_schedule(const Plan& plan, const ScheduleOptions& opt = {}) {
  const HeadShape& shape = plan.shape();
  const int group = shape.group();
  Schedule sc;
  sc.pass_row_begin.resize(size_t(plan.n_segments()));
  for (int g = 0; g < plan.n_segments(); ++g) {
    sc.pass_row_begin[size_t(g)] = detail::to_i32(int64_t(sc.rows.size()), "row count");
    detail::to_i32(plan.segment(g).n_tokens, "segment length");
    for (const Plan::SegmentRow& r : plan.segment_rows(g)) {
      RowDesc d;
      d.q_row = detail::to_i32(r.row, "query row");
      d.limit = int32_t(r.limit);
      sc.rows.push_back(d);
    }
  }
  detail::to_i32(int64_t(sc.rows.size()), "row count");
  const auto rows_of = [&](int g) { return int64_t(plan.segment_rows(g).size()); };
  const detail::Groups groups = detail::build_items(
      sc, plan.n_segments(), shape.n_kv_heads, group, opt, rows_of, [&](int g) { return plan.segment(g).n_tokens; },
      [&](int g, int64_t r0, int64_t r1) {
        int64_t reach = 0;
        for (int64_t r = r0; r < r1; ++r) reach = std::max(reach, plan.segment_rows(g)[size_t(r)].limit);
        return reach;
      });
  std::vector<int32_t> row_seq(size_t(plan.n_rows()));
  for (int s = 0; s < plan.n_sequences(); ++s) {
    const Plan::Sequence& sq = plan.sequence(s);
    std::fill(row_seq.begin() + sq.row_begin, row_seq.begin() + sq.row_begin + sq.n_query, s);
  }
  detail::build_merge(sc, groups, plan.n_rows(), shape.n_q_heads, group, [&](int64_t row, int qh, auto&& add) {
    const Plan::Sequence& sq = plan.sequence(row_seq[size_t(row)]);
    const int64_t i = row - sq.row_begin;
    for (size_t k = 0; k < sq.path.size(); ++k) add(sq.path[k], (sq.seg_row_begin[k] + i) * group + qh % group);
  });
  detail::sort_items(sc);
  return sc;
}

// The schedule of the unified baseline: one pass over n_keys keys; every one of the n_rows query token rows
// (row_seq/row_pos: its sequence and position) scores every key under the sequence mask.
inline Schedule make_unified_schedule(const HeadShape& shape, int64_t n_keys, int64_t n_rows, const int32_t* row_seq,
                                      const int32_t* row_pos, const ScheduleOptions& opt = {}) {
  const int group = shape.group();
  Schedule sc;
  detail::to_i32(n_keys, "unified buffer length");
  sc.pass_row_begin = {0};
  for (int64_t r = 0; r < n_rows; ++r) {
    RowDesc d;
    d.q_row = detail::to_i32(r, "query row");
    d.limit = int32_t(n_keys);
    d.seq = row_seq[r];
    d.pos = row_pos[r];
    sc.rows.push_back(d);
  }
  const detail::Groups groups = detail::build_items(
      sc, 1, shape.n_kv_heads, group, opt, [&](int) { return n_rows; }, [&](int) { return n_keys; },
      [&](int, int64_t, int64_t) { return n_keys; });
  detail::build_merge(sc, groups, n_rows, shape.n_q_heads, group,
                      [&](int64_t row, int qh, auto&& add) { add(0, row * group + qh % group); });
  detail::sort_items(sc);
  return sc;
}

}  // namespace cascade::cuda
