// CPU execution of a cascade plan, and of the unified (one buffer + mask) baseline.
//
// A plan is run as independent work items, spread over oneTBB's threads:
//   1. segments run as passes: a chain of segments attended by exactly the same rows (a segment whose
//      rows all continue into its one child and see all of its keys) is one pass over their tokens in
//      order, so a prefix that only one sequence (or one group of rows) reads costs no extra items or
//      merges over a copy of it.
//   2. every (pass, KV head, tile of stacked query rows, chunk of the pass's tokens) is an item; it
//      attends its rows to its tokens and writes a partial state into the workspace. Long passes are
//      split into chunks (flash-decoding style) so that even one sequence with one KV head keeps every
//      thread busy.
//   3. every output row (query token, query head) merges the partial states of all passes on its
//      sequence's path and all their chunks, exactly (state.hpp).
// The "split" baseline is a plan too (Plan::independent, the prefix copied into every sequence).
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cascade/cpu/kernel.hpp"
#include "cascade/plan.hpp"
#include "cascade/state.hpp"

namespace cascade::cpu {

struct Options {
  int n_threads = 0;  // 0: all of the machine's threads (oneTBB's default)
};

namespace detail {

// Smallest chunk of a segment's tokens one item takes when a segment is split across threads.
inline constexpr int64_t kMinChunk = 256;

struct Item {
  int pass;         // segment (or 0 for the unified buffer)
  int kvh;          // first KV head
  int heads;        // KV heads [kvh, kvh + heads): 1, or all of them for passes of a few rows
  int64_t e0, e1;   // stacked rows [e0, e1) of the pass; stacked row e = token_row * group + head_in_group
  int64_t t0, t1;   // tokens of the pass
  int64_t ws;       // offset of the partial state in the workspace: o (heads, e1-e0, d), lse (heads, e1-e0)
};

// Items of every (pass, kvh, row tile), in order, so the merge finds a row's partials directly.
struct Schedule {
  std::vector<Item> items;
  std::vector<int64_t> group_first;  // per (pass, kvh, tile) group: first item; plus a final sentinel
  std::vector<int64_t> pass_group;   // per pass: index of its first group, or -1 when it has no work
  std::vector<int64_t> pass_tiles;   // per pass: number of row tiles
  std::vector<char> all_heads;       // per pass: its items carry every KV head
  int64_t ws_floats = 0;

  // Items holding stacked row e of pass p for KV head kvh: [first, last).
  std::pair<int64_t, int64_t> items_of(int p, int kvh, int64_t e) const {
    const int64_t g = pass_group[p] + (all_heads[p] ? 0 : int64_t(kvh) * pass_tiles[p]) + e / kMaxRows;
    return {group_first[g], group_first[g + 1]};
  }
  // Where item holds the partial state of (kvh, stacked row e): o (head_dim floats) and lse.
  const float* partial_o(const float* ws, const Item& it, int kvh, int64_t e, int64_t d) const {
    const int64_t n = it.e1 - it.e0, h = kvh - it.kvh;
    return ws + it.ws + (h * n + e - it.e0) * d;
  }
  float partial_lse(const float* ws, const Item& it, int kvh, int64_t e, int64_t d) const {
    const int64_t n = it.e1 - it.e0, h = kvh - it.kvh;
    return ws[it.ws + it.heads * n * d + h * n + e - it.e0];
  }
};

// n_token_rows(p): query tokens attending pass p; length(p): its tokens; reach(p, r0, r1): how many of the
// pass's tokens the token rows [r0, r1) can see at most (work past it is skipped).
template <class NRows, class Len, class Reach>
Schedule make_schedule(int n_pass, int n_kv_heads, int group, int64_t head_dim, int n_threads, NRows n_token_rows,
                       Len length, Reach reach) {
  Schedule sc;
  sc.pass_group.assign(n_pass, -1);
  sc.pass_tiles.assign(n_pass, 0);
  sc.all_heads.assign(n_pass, 0);
  double total = 0;
  for (int p = 0; p < n_pass; ++p) total += double(n_token_rows(p)) * group * length(p) * n_kv_heads;
  const double per_item = std::max(1.0, total / (4.0 * std::max(1, n_threads)));
  for (int p = 0; p < n_pass; ++p) {
    const int64_t m = n_token_rows(p) * group, len = length(p);
    if (m == 0 || len == 0) continue;
    const int64_t n_tiles = (m + kMaxRows - 1) / kMaxRows;
    const bool together = use_small_kernel(m, int(head_dim));
    const int heads = together ? n_kv_heads : 1;
    sc.pass_group[p] = int64_t(sc.group_first.size());
    sc.pass_tiles[p] = n_tiles;
    sc.all_heads[p] = together;
    for (int kvh = 0; kvh < n_kv_heads; kvh += heads) {
      for (int64_t tile = 0; tile < n_tiles; ++tile) {
        sc.group_first.push_back(int64_t(sc.items.size()));
        const int64_t e0 = tile * kMaxRows, e1 = std::min(m, e0 + kMaxRows);
        const int64_t span = reach(p, e0 / group, (e1 + group - 1) / group);
        if (span == 0) continue;  // every row of the tile is masked out of this pass
        int64_t n_chunks = int64_t(double(e1 - e0) * heads * span / per_item + 0.5);
        n_chunks = std::clamp<int64_t>(n_chunks, 1, std::max<int64_t>(1, span / kMinChunk));
        const int64_t step = (span + n_chunks - 1) / n_chunks;
        for (int64_t t0 = 0; t0 < span; t0 += step) {
          sc.items.push_back({p, kvh, heads, e0, e1, t0, std::min(span, t0 + step), sc.ws_floats});
          sc.ws_floats += heads * (e1 - e0) * (head_dim + 1);
        }
      }
    }
  }
  sc.group_first.push_back(int64_t(sc.items.size()));
  return sc;
}

// Segments grouped into passes (step 1 above).
struct Passes {
  struct Pass {
    std::vector<int> segs;        // segments in key order, the first one is the pass's head
    std::vector<int64_t> start;   // key offset of each segment inside the pass
    int64_t n_tokens = 0;
    std::vector<int64_t> limit;   // per token row: keys of the pass it sees (the head's row order)
  };
  std::vector<Pass> pass;
  std::vector<int> head_pass;  // per segment: the pass it heads, or -1 (inside a chain, or unused)
};

inline Passes make_passes(const Plan& plan) {
  const int n_seg = plan.n_segments();
  // fuse_into[g]: g's only child when that child has exactly g's rows (same order) and every row sees all
  // of g's keys; then the two run as one pass.
  std::vector<int> fuse_into(size_t(n_seg), -1);
  std::vector<char> fused_child(size_t(n_seg), 0);
  for (int c = 0; c < n_seg; ++c) {
    const int g = plan.parent(c);
    if (g < 0) continue;
    const auto& rg = plan.segment_rows(g);
    const auto& rc = plan.segment_rows(c);
    if (rg.empty() || rg.size() != rc.size()) continue;
    bool same = true;
    for (size_t r = 0; r < rg.size() && same; ++r)
      same = rg[r].row == rc[r].row && rg[r].limit == plan.segment(g).n_tokens;
    if (!same) continue;
    fuse_into[g] = c;
    fused_child[c] = 1;
  }
  Passes out;
  out.head_pass.assign(size_t(n_seg), -1);
  for (int g = 0; g < n_seg; ++g) {
    if (fused_child[g] || plan.parent(g) == Plan::kUnused) continue;
    Passes::Pass ps;
    int last = g;
    for (int x = g; x >= 0; x = fuse_into[x]) {
      ps.segs.push_back(x);
      ps.start.push_back(ps.n_tokens);
      ps.n_tokens += plan.segment(x).n_tokens;
      last = x;
    }
    const auto& rows = plan.segment_rows(last);
    ps.limit.resize(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) ps.limit[r] = ps.start.back() + rows[r].limit;
    out.head_pass[g] = int(out.pass.size());
    out.pass.push_back(std::move(ps));
  }
  return out;
}

struct ItemScratch {
  Scratch kernel;
  std::vector<float> q, o2;
  std::vector<int64_t> limit;
  std::vector<int32_t> seq, pos;
};

inline tbb::enumerable_thread_specific<ItemScratch>& item_scratch() {
  static tbb::enumerable_thread_specific<ItemScratch> tls;
  return tls;
}

// Copies stacked rows [e0, e1) of an item's heads into buf (heads, e1 - e0, head_dim), scaled.
// token_row(r) gives the global query row of the pass's token row r.
template <class TokenRow>
void gather_queries(const float* q, const HeadShape& shape, float scale, const Item& it, TokenRow token_row,
                    std::vector<float>& buf) {
  const int group = shape.group();
  const int64_t d = shape.head_dim;
  buf.resize(it.heads * (it.e1 - it.e0) * d);
  float* dst = buf.data();
  for (int h = it.kvh; h < it.kvh + it.heads; ++h) {
    for (int64_t e = it.e0; e < it.e1; ++e, dst += d) {
      const int64_t row = token_row(e / group);
      const int qh = h * group + int(e % group);
      const float* src = q + (row * shape.n_q_heads + qh) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale;
    }
  }
}

// The workspace of partial states for one call, kept per calling thread and reused: a fresh allocation per
// call (a decode step makes one per layer) costs page faults that can exceed the attention itself on small
// problems. A call made while the thread's buffer is in use (attend called from inside a parallel task that
// waits on another attend) gets a buffer of its own.
class Workspace {
 public:
  explicit Workspace(size_t n_floats) {
    if (!busy()) {
      busy() = true;
      leased_ = true;
      buf_ = &kept();
    }
    // Grow as needed; give memory back after a call much larger than this one, so one large batch
    // does not pin its workspace for the thread's lifetime.
    if (buf_->size() > 8 * n_floats && buf_->size() > (size_t(16) << 20) / sizeof(float))
      std::vector<float>().swap(*buf_);
    if (buf_->size() < n_floats) buf_->resize(n_floats);
  }
  ~Workspace() {
    if (leased_) busy() = false;
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* data() { return buf_->data(); }
  const float* data() const { return buf_->data(); }
  // Floats held by this thread's kept buffer (for tests and memory accounting).
  static size_t kept_floats() { return kept().size(); }

 private:
  static std::vector<float>& kept() {
    thread_local std::vector<float> v;
    return v;
  }
  static bool& busy() {
    thread_local bool b = false;
    return b;
  }
  std::vector<float> own_;
  std::vector<float>* buf_ = &own_;
  bool leased_ = false;
};

// Runs f with at most n_threads threads (0: oneTBB's default). Asking for more threads than the
// machine has gives the machine's count: oversubscribing only adds switching. Arenas are made once per
// thread count and kept, so a decode step's many calls don't each pay for one.
template <class F>
void in_arena(int n_threads, F&& f) {
  if (n_threads <= 0) {
    f();
    return;
  }
  n_threads = std::min(n_threads, tbb::info::default_concurrency());
  static std::mutex mu;
  static std::map<int, std::unique_ptr<tbb::task_arena>> arenas;
  tbb::task_arena* arena;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = arenas[n_threads];
    if (!slot) slot = std::make_unique<tbb::task_arena>(n_threads);
    arena = slot.get();
  }
  arena->execute(f);
}

// Merges, for every output (row, q head), the partials that `for_each_part(row, qh, add)` names.
template <class Parts>
void merge_outputs(const HeadShape& shape, int64_t n_rows, const Schedule& sc, const Workspace& ws,
                   float* o, float* lse, Parts for_each_part) {
  const int64_t d = shape.head_dim;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n_rows), [&](const tbb::blocked_range<int64_t>& range) {
    std::vector<const float*> po;
    std::vector<float> pl;
    for (int64_t row = range.begin(); row < range.end(); ++row) {
      for (int qh = 0; qh < shape.n_q_heads; ++qh) {
        po.clear();
        pl.clear();
        for_each_part(row, qh, [&](int pass, int64_t e) {
          const auto [first, last] = sc.items_of(pass, qh / shape.group(), e);
          const int kvh = qh / shape.group();
          for (int64_t it = first; it < last; ++it) {
            const Item& item = sc.items[it];
            po.push_back(sc.partial_o(ws.data(), item, kvh, e, d));
            pl.push_back(sc.partial_lse(ws.data(), item, kvh, e, d));
          }
        });
        float lse_out;
        merge_states(int64_t(po.size()), po.data(), pl.data(), o + (row * shape.n_q_heads + qh) * d, &lse_out, d);
        if (lse) lse[row * shape.n_q_heads + qh] = lse_out;
      }
    }
  });
}

}  // namespace detail

// Runs the plan. q, o: (plan.n_rows(), n_q_heads, head_dim), f32, contiguous. lse: (n_rows, n_q_heads),
// natural log, or nullptr. Rows that see no key get o = 0 and lse = -inf.
inline void attend(const Plan& plan, const float* q, float* o, float* lse = nullptr, const Options& opt = {}) {
  const HeadShape& shape = plan.shape();
  const int64_t d = shape.head_dim;
  const int group = shape.group();
  CASCADE_CHECK(plan.n_rows() == 0 || (q != nullptr && o != nullptr), "attend: null q or o with ", plan.n_rows(),
                " query rows");
  CASCADE_CHECK(opt.n_threads >= 0, "attend: n_threads is negative (", opt.n_threads, ")");
  detail::in_arena(opt.n_threads, [&] {
    const int n_threads = tbb::this_task_arena::max_concurrency();
    const detail::Passes pp = detail::make_passes(plan);
    const int n_pass = int(pp.pass.size());
    const detail::Schedule sc = detail::make_schedule(
        n_pass, shape.n_kv_heads, group, d, n_threads, [&](int p) { return int64_t(pp.pass[p].limit.size()); },
        [&](int p) { return pp.pass[p].n_tokens; },
        [&](int p, int64_t r0, int64_t r1) {
          int64_t reach = 0;
          for (int64_t r = r0; r < r1; ++r) reach = std::max(reach, pp.pass[p].limit[r]);
          return reach;
        });
    detail::Workspace ws(size_t(sc.ws_floats));
    tbb::parallel_for(tbb::blocked_range<size_t>(0, sc.items.size(), 1), [&](const tbb::blocked_range<size_t>& br) {
      detail::ItemScratch& s = detail::item_scratch().local();
      for (size_t i = br.begin(); i < br.end(); ++i) {
        const detail::Item& it = sc.items[i];
        const detail::Passes::Pass& ps = pp.pass[it.pass];
        const auto& head_rows = plan.segment_rows(ps.segs.front());
        detail::gather_queries(q, shape, plan.scale(), it, [&](int64_t r) { return head_rows[r].row; }, s.q);
        const int64_t n = it.e1 - it.e0;
        float* o_it = ws.data() + it.ws;
        float* lse_it = o_it + it.heads * n * d;
        s.limit.resize(n);
        bool first = true;
        // The item's tokens [t0, t1) of the pass, segment by segment; the second and later segments'
        // states merge into the first's.
        for (size_t k = 0; k < ps.segs.size(); ++k) {
          const int64_t off = ps.start[k], len = plan.segment(ps.segs[k]).n_tokens;
          const int64_t a = std::max(it.t0, off), b = std::min(it.t1, off + len);
          if (a >= b) continue;
          for (int64_t e = it.e0; e < it.e1; ++e) s.limit[e - it.e0] = ps.limit[e / group] - off;
          float* o_k = o_it;
          float* lse_k = lse_it;
          if (!first) {
            s.o2.resize(size_t(it.heads * n * (d + 1)));
            o_k = s.o2.data();
            lse_k = o_k + it.heads * n * d;
          }
          attend_range_dispatch(s.q.data(), n, it.heads, plan.segment(ps.segs[k]), it.kvh, a - off, b - off,
                                LimitMask{s.limit.data()}, o_k, lse_k, s.kernel);
          if (!first) merge_states_inplace(o_it, lse_it, o_k, lse_k, it.heads * n, d);
          first = false;
        }
      }
    });
    // Map each output row back to its sequence once.
    std::vector<int32_t> row_seq(plan.n_rows());
    for (int s = 0; s < plan.n_sequences(); ++s) {
      const Plan::Sequence& sq = plan.sequence(s);
      std::fill(row_seq.begin() + sq.row_begin, row_seq.begin() + sq.row_begin + sq.n_query, s);
    }
    detail::merge_outputs(shape, plan.n_rows(), sc, ws, o, lse, [&](int64_t row, int qh, auto&& add) {
      const Plan::Sequence& sq = plan.sequence(row_seq[row]);
      const int64_t i = row - sq.row_begin;
      for (size_t k = 0; k < sq.path.size(); ++k) {
        const int p = pp.head_pass[sq.path[k]];
        if (p < 0 || sc.pass_group[p] < 0) continue;  // inside a chain, or a pass with no work
        add(p, (sq.seg_row_begin[k] + i) * group + qh % group);
      }
    });
  });
}

// The unified baseline: all sequences' tokens in one KV buffer; every query row scores every key and a
// sequence mask removes the others' (llama.cpp's unified KV cache).
struct UnifiedBatch {
  KvView kv;                          // the whole buffer
  const uint64_t* key_seqs = nullptr; // (kv.n_tokens, n_words): bit s set when the key belongs to sequence s
  int64_t n_words = 1;
  const int32_t* key_pos = nullptr;   // (kv.n_tokens): the key's position in its sequences
  int64_t n_rows = 0;                 // query tokens
  const int32_t* row_seq = nullptr;   // (n_rows): sequence of each query token
  const int32_t* row_pos = nullptr;   // (n_rows): its position
};

// q, o: (batch.n_rows, n_q_heads, head_dim); lse: (n_rows, n_q_heads) or nullptr.
inline void attend_unified(const HeadShape& shape, const UnifiedBatch& b, const float* q, float* o,
                           float* lse = nullptr, const Options& opt = {}, float scale = 0.0f) {
  shape.validate();
  b.kv.validate("unified KV buffer");
  CASCADE_CHECK(b.kv.n_kv_heads == shape.n_kv_heads && b.kv.head_dim == shape.head_dim,
                "unified KV buffer has ", b.kv.n_kv_heads, " heads of dim ", b.kv.head_dim, ", the shape says ",
                shape.n_kv_heads, "/", shape.head_dim);
  CASCADE_CHECK(b.n_rows >= 0 && b.n_words > 0, "unified batch: bad n_rows (", b.n_rows, ") or n_words (", b.n_words,
                ")");
  CASCADE_CHECK(b.n_rows == 0 || (q && o && b.row_seq && b.row_pos), "unified batch: null query data with ",
                b.n_rows, " rows");
  CASCADE_CHECK(b.kv.n_tokens == 0 || (b.key_seqs && b.key_pos), "unified batch: null key masks with ",
                b.kv.n_tokens, " keys");
  for (int64_t r = 0; r < b.n_rows; ++r)
    CASCADE_CHECK(b.row_seq[r] >= 0 && b.row_seq[r] < 64 * b.n_words, "unified batch: row ", r, " has sequence ",
                  b.row_seq[r], ", outside the ", 64 * b.n_words, " the key masks hold");
  const float sc_scale = scale != 0.0f ? scale : 1.0f / std::sqrt(float(shape.head_dim));
  const int64_t d = shape.head_dim;
  const int group = shape.group();
  detail::in_arena(opt.n_threads, [&] {
    const int n_threads = tbb::this_task_arena::max_concurrency();
    const detail::Schedule sc = detail::make_schedule(
        1, shape.n_kv_heads, group, d, n_threads, [&](int) { return b.n_rows; },
        [&](int) { return b.kv.n_tokens; }, [&](int, int64_t, int64_t) { return b.kv.n_tokens; });
    detail::Workspace ws(size_t(sc.ws_floats));
    tbb::parallel_for(tbb::blocked_range<size_t>(0, sc.items.size(), 1), [&](const tbb::blocked_range<size_t>& br) {
      detail::ItemScratch& s = detail::item_scratch().local();
      for (size_t i = br.begin(); i < br.end(); ++i) {
        const detail::Item& it = sc.items[i];
        detail::gather_queries(q, shape, sc_scale, it, [](int64_t r) { return r; }, s.q);
        const int64_t n = it.e1 - it.e0;
        s.seq.resize(n);
        s.pos.resize(n);
        for (int64_t e = it.e0; e < it.e1; ++e) {
          s.seq[e - it.e0] = b.row_seq[e / group];
          s.pos[e - it.e0] = b.row_pos[e / group];
        }
        attend_range_dispatch(s.q.data(), n, it.heads, b.kv, it.kvh, it.t0, it.t1,
                              UnifiedMask{b.key_seqs, b.n_words, b.key_pos, s.seq.data(), s.pos.data()},
                              ws.data() + it.ws, ws.data() + it.ws + it.heads * n * d, s.kernel);
      }
    });
    detail::merge_outputs(shape, b.n_rows, sc, ws, o, lse, [&](int64_t row, int qh, auto&& add) {
      if (sc.pass_group[0] >= 0) add(0, row * group + qh % group);
    });
  });
}

}  // namespace cascade::cpu
