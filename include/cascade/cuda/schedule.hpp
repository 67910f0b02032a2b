// The CUDA path's side of the one schedule (cascade/schedule.hpp): its target (kernel configurations,
// chunking for the device's multiprocessors) and the translation of a plan's schedule into the device's
// work list. Plain C++ (no CUDA headers), so the CPU tests check it on machines without a GPU.
//
// Two tile shapes (kernel configurations, work.hpp):
//   narrow: 16 rows per block, the warps split each KV tile between them (the per-sequence pass: a few
//           rows against a long own segment; memory bound);
//   wide:   64 rows per block, every warp takes 16 rows of one shared KV tile (the shared-segment pass: many
//           rows against one prefix; bound by the tensor cores).
// A pass whose stacked rows per KV head fit in 16 runs narrow, any other wide. Long passes are split into
// chunks of at least kMinChunk tokens, on multiples of kChunkAlign, so that the launch has a few blocks per
// multiprocessor. A block reads one K/V span, so the schedule cuts items at the joins of a chain's segments.
//
// The device work list. Device pass k is segment k of the plan's attended tree; its token rows are the
// segment's rows (RowDesc: query row and how many of the segment's keys it sees), from
// rows[pass_row_begin[k]]. A block (WorkItem) attends stacked rows [e0, e0 + n_rows) of its pass for one KV
// head to the tokens [t0, t1) of the segment, and writes one partial state per row into slots
// [slot, slot + n_rows). Output (row, q head) merges out_slots[out_begin[i], out_begin[i + 1]),
// i = row * n_q_heads + qh: the schedule's own merge lists.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

#include "cascade/cuda/work.hpp"
#include "cascade/error.hpp"
#include "cascade/plan.hpp"
#include "cascade/schedule.hpp"
#include "cascade/tree.hpp"

namespace cascade::cuda {

struct ScheduleOptions {
  int n_sm = 132;          // multiprocessors of the device
  int blocks_per_sm = 4;   // aim for about this many blocks per multiprocessor in all
};

// The schedule's view of a device. An item's work per key: 1 for a narrow block, 4 for a wide one (four
// warps of rows per token, against one).
inline Target target(const ScheduleOptions& opt = {}) {
  Target t;
  t.backend = "cuda";
  t.kernels[kNarrow] = {kTileRows[kNarrow], false, 1.0, 0.0};
  t.kernels[kWide] = {kTileRows[kWide], false, 4.0, 0.0};
  t.few_rows = kTileRows[kNarrow];  // passes of at most a narrow block's rows per KV head take it
  t.few_kernel = kNarrow;
  t.n_items = double(std::max(1, opt.n_sm) * std::max(1, opt.blocks_per_sm));
  t.min_chunk = kMinChunk;
  t.chunk_align = kChunkAlign;
  t.cut_at_joins = true;
  return t;
}

// The plan of a step's tree for a device with opt's multiprocessors.
inline Plan plan(Tree tree, const ScheduleOptions& opt = {}) { return Plan::make(std::move(tree), target(opt)); }

struct DeviceSchedule {
  std::vector<WorkItem> items[2];       // per configuration, longest first
  std::vector<RowDesc> rows;            // every device pass's token rows, pass after pass
  std::vector<int32_t> pass_row_begin;  // per device pass
  std::vector<int64_t> out_begin;       // (n_rows * n_q_heads + 1)
  std::vector<int64_t> out_slots;
  int64_t n_slots = 0;

  int64_t n_items() const { return int64_t(items[0].size() + items[1].size()); }
};

namespace detail {

inline int32_t to_i32(int64_t x, const char* what) {
  CASCADE_CHECK(x >= 0 && x <= std::numeric_limits<int32_t>::max(), "CUDA schedule: ", what, " (", x,
                ") does not fit in 32 bits");
  return int32_t(x);
}

// The schedule's items as blocks: each lies inside one segment of its pass (the target cuts at joins);
// `pass` becomes that segment, t0/t1 its tokens. Longest first per configuration, so the last wave of
// blocks is made of short ones.
inline void add_blocks(DeviceSchedule& ds, const Schedule& sc) {
  for (const Schedule::Item& it : sc.items) {
    const Schedule::Pass& ps = sc.passes[size_t(it.pass)];
    int64_t k = ps.seg_end - 1;
    while (k > ps.seg_begin && sc.segs[size_t(k)].start > it.t0) --k;
    const Schedule::PassSegment& seg = sc.segs[size_t(k)];
    CASCADE_CHECK(it.heads == 1, "CUDA schedule: an item carries ", it.heads, " KV heads");
    WorkItem w;
    w.pass = seg.seg;
    w.kvh = it.kvh;
    w.e0 = to_i32(it.e0, "stacked row");
    w.n_rows = to_i32(it.e1 - it.e0, "stacked rows");
    w.t0 = to_i32(it.t0 - seg.start, "token");
    w.t1 = to_i32(it.t1 - seg.start, "token");
    w.slot = it.slot;
    ds.items[ps.kernel].push_back(w);
  }
  for (auto& list : ds.items)
    std::stable_sort(list.begin(), list.end(),
                     [](const WorkItem& a, const WorkItem& b) { return a.t1 - a.t0 > b.t1 - b.t0; });
}

inline void copy_merge_lists(DeviceSchedule& ds, const Schedule& sc) {
  ds.out_begin = sc.out_begin;
  ds.out_slots = sc.out_slots;
  ds.n_slots = sc.n_slots;
}

}  // namespace detail

// The device work list of a plan made for the CUDA target.
inline DeviceSchedule lower(const Plan& plan) {
  CASCADE_CHECK(std::string_view(plan.target().backend) == "cuda", "CUDA schedule: the plan was made for the ",
                plan.target().backend, " backend, not CUDA (cuda::plan)");
  const Tree& at = plan.attended();
  DeviceSchedule ds;
  ds.pass_row_begin.resize(size_t(at.n_segments()));
  for (int g = 0; g < at.n_segments(); ++g) {
    ds.pass_row_begin[size_t(g)] = detail::to_i32(int64_t(ds.rows.size()), "row count");
    detail::to_i32(at.n_tokens(g), "segment length");
    for (const Tree::SegmentRow& r : at.segment_rows(g)) {
      RowDesc d;
      d.q_row = detail::to_i32(r.row, "query row");
      d.limit = int32_t(r.limit);
      d.first = int32_t(r.first);
      ds.rows.push_back(d);
    }
  }
  detail::to_i32(int64_t(ds.rows.size()), "row count");
  detail::add_blocks(ds, plan.schedule());
  detail::copy_merge_lists(ds, plan.schedule());
  return ds;
}

// The device work list of the unified baseline: one pass over n_keys keys; every one of the n_rows query
// token rows (row_seq/row_pos: its sequence and position) scores every key under the sequence mask.
inline DeviceSchedule lower_unified(const HeadShape& shape, int64_t n_keys, int64_t n_rows, const int32_t* row_seq,
                                    const int32_t* row_pos, const ScheduleOptions& opt = {}) {
  detail::to_i32(n_keys, "unified buffer length");
  const Schedule sc = make_unified_schedule(shape, n_keys, n_rows, target(opt));
  DeviceSchedule ds;
  ds.pass_row_begin = {0};
  for (int64_t r = 0; r < n_rows; ++r) {
    RowDesc d;
    d.q_row = detail::to_i32(r, "query row");
    d.limit = int32_t(n_keys);
    d.seq = row_seq[r];
    d.pos = row_pos[r];
    ds.rows.push_back(d);
  }
  detail::add_blocks(ds, sc);
  detail::copy_merge_lists(ds, sc);
  return ds;
}

}  // namespace cascade::cuda
