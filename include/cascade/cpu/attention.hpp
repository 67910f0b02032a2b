// CPU execution of a plan, and of the unified (one buffer + mask) baseline.
//
//   const cascade::Tree tree = cascade::Tree::two_level(shape, n_prefix, n_own);  // structure only
//   const cascade::Plan plan = cascade::cpu::plan(tree);                            // once per step
//   for (int il = 0; il < n_layer; ++il)
//     cascade::cpu::run(plan, layer_views[il], q[il], o[il], lse[il]);              // per layer
//
// run() takes the K/V of the tree's segments either as a list (kv[g]: segment g) or as a callable
// (kv(g) returns segment g's KvView); every view must have the plan's head shape and exactly its segment's
// length. The schedule's work items (schedule.hpp) are spread over oneTBB's threads: each attends its rows
// to its keys with the kernel its pass takes (kernel.hpp) and writes partial states into the workspace; then every
// output (row, q head) merges the states its list names, exactly (state.hpp). The "split" baseline is a
// plan too (Tree::independent over the prefix copied into every sequence).
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/enumerable_thread_specific.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/cpu/kernel.hpp"
#include "cascade/kv.hpp"
#include "cascade/plan.hpp"
#include "cascade/schedule.hpp"
#include "cascade/state.hpp"
#include "cascade/tree.hpp"

namespace cascade::cpu {

struct Options {
  int n_threads = 0;                      // 0: the caller's oneTBB arena (all of the machine's threads)
  const CostModel* cost_model = nullptr;  // auto: regroup the tree where a shared pass does not pay
  DType kv_dtype = DType::f16;            // the K/V element type auto prices (run takes any)
  std::optional<KernelOptions> kernels = std::nullopt;  // what the kernel choice may use; unset: the process-wide
                                                       // switches (kernel.hpp)
};

// The CPU's kernels as the schedule sees them (kernel.hpp): the tiled-product kernel, one item per KV head
// and tile of kMaxRows stacked rows; the few-rows kernel, every KV head in one item.
inline constexpr int kTiledKernel = 0;
inline constexpr int kFewRowsKernel = 1;
// Shortest chunk of a pass's tokens one item takes when a pass is split across threads.
inline constexpr int64_t kMinChunk = 256;
// Keys per batch-invariant block (schedule.hpp, KernelOptions::batch_invariant): a multiple of both kernels' tiles
// and key steps. Larger blocks mean fewer partial states to write and merge per row, smaller ones fewer keys of a
// shared pass's unaligned end read again by every pass below it.
inline constexpr int64_t kBlockKeys = 256;
// Positions per fold span (Target::fold): a long shared pass writes one state per span, not per block.
inline constexpr int64_t kFoldKeys = 1024;

// The schedule's view of this machine for heads of head_dim, with n_threads threads (0: the caller's arena):
// about 4 items per thread, so that uneven items still balance; the kernels every pass and K/V type run on,
// chosen under `kernels` (choose_kernels).
inline Target target(int n_threads, int head_dim, const KernelOptions& kernels = KernelOptions::process()) {
  CASCADE_CHECK(n_threads >= 0, "cpu::target: n_threads is negative (", n_threads, ")");
  Target t;
  t.backend = "cpu";
  t.kernels[kTiledKernel] = {kMaxRows, false, 0.0, 1.0};
  t.kernels[kFewRowsKernel] = {kMaxRows, true, 0.0, 1.0};
  t.few_rows = few_rows_limit(head_dim, kernels);
  t.few_kernel = kFewRowsKernel;
  t.kernel_choices = choose_kernels(head_dim, kernels);
  const int n = n_threads > 0 ? std::min(n_threads, tbb::info::default_concurrency())
                              : tbb::this_task_arena::max_concurrency();
  t.n_items = 4.0 * std::max(1, n);
  t.min_chunk = kMinChunk;
  t.n_threads = n_threads;
  if (kernels.batch_invariant) {
    t.block = t.chunk_align = kBlockKeys;
    t.fold = kFoldKeys;
    // Both kernels' online softmax steps kTileStep keys from a call's first: a tile's first item under a sliding
    // window starts on the step holding its first key seen (schedule.hpp).
    t.key_step = kTileStep;
  }
  return t;
}
inline Target target(const Options& opt, int head_dim) {
  Target t = target(opt.n_threads, head_dim, opt.kernels ? *opt.kernels : KernelOptions::process());
  // Blocks buy nothing where a kernel for the K/V type has no batch-invariant order (bf16 or int8 products): none
  // there.
  if (!t.kernel_choices(kTiledKernel, opt.kv_dtype).batch_invariant ||
      !t.kernel_choices(kFewRowsKernel, opt.kv_dtype).batch_invariant) {
    t.block = t.fold = t.key_step = 0;
    t.chunk_align = 1;
  }
  return t;
}

// The plan of a step's tree on this machine (auto's regrouping first when opt.cost_model is set).
inline Plan plan(Tree tree, const Options& opt = {}) {
  CASCADE_CHECK(opt.n_threads >= 0, "cpu::plan: n_threads is negative (", opt.n_threads, ")");
  const int head_dim = tree.shape().head_dim;
  return Plan::make(std::move(tree), target(opt, head_dim), opt.cost_model, opt.kv_dtype);
}

// The kernels a target's passes of kernel `kernel` run on K/V of type dt ("avx512 tiled f32").
inline std::string kernel_name(const Target& t, int kernel, DType dt) { return t.kernel_choices(kernel, dt).name(); }

// The kernels a plan runs on K/V of type dt, its shared (tiled) passes' and its per-sequence (few-rows) ones',
// as "tiled: avx512 tiled f32; few-rows: avx512 few-rows f32", naming only the kernels its passes take.
inline std::string kernel_names(const Plan& plan, DType dt) {
  bool used[2] = {false, false};
  for (const Schedule::Pass& ps : plan.schedule().passes) used[ps.kernel] = true;
  std::string s;
  for (int k = 0; k < 2; ++k) {
    if (!used[k]) continue;
    if (!s.empty()) s += "; ";
    s += std::string(k == kTiledKernel ? "shared: " : "per-sequence: ") + kernel_name(plan.target(), k, dt);
  }
  return s;
}

// Checks that every kernel a target chose can run here; throws an Error naming the first that cannot.
inline void check_kernels(const Target& t, int head_dim) {
  for (int k = 0; k < 2; ++k)
    for (int d = 0; d < kNumDTypes; ++d)
      CASCADE_CHECK(kernel_runs_here(t.kernel_choices(k, DType(d)), DType(d), head_dim), "run: the plan's kernel ",
                    t.kernel_choices(k, DType(d)).name(), " for ", dtype_name(DType(d)), " K/V of head dim ",
                    head_dim, " cannot run on this CPU");
}

// The workspace of partial states of one run, kept per calling thread and reused: a fresh allocation per
// run (a decode step makes one per layer) costs page faults that can exceed the attention itself on small
// problems. A run made while the thread's buffer is in use (run called from inside a parallel task that
// waits on another run) gets a buffer of its own.
class Workspace {
 public:
  explicit Workspace(size_t n_floats) {
    if (!busy()) {
      busy() = true;
      leased_ = true;
      buf_ = &kept();
    }
    // Grow as needed; give memory back after a run much larger than this one, so one large batch
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

// Runs f with at most n_threads threads (0: the caller's arena). Asking for more threads than the
// machine has gives the machine's count: oversubscribing only adds switching. Arenas are made once per
// thread count and kept, so a decode step's many runs don't each pay for one.
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

namespace detail {

struct ItemScratch {
  Scratch kernel;
  std::vector<float> q, o2, o3;
  std::vector<int64_t> limit, first;
  std::vector<int32_t> seq, pos;
  std::vector<char> k, v, k_scales, v_scales;  // a block's K/V gathered from several segments (gather_keys)
};

inline tbb::enumerable_thread_specific<ItemScratch>& item_scratch() {
  static tbb::enumerable_thread_specific<ItemScratch> tls;
  return tls;
}

// Copies the stacked rows [e0, e1) of an item's heads into buf (heads, e1 - e0, head_dim).
inline void gather_queries(const float* q, const HeadShape& shape, const Schedule& sc, const Schedule::Item& it,
                           std::vector<float>& buf) {
  const int group = shape.group();
  const int64_t d = shape.head_dim;
  const int64_t row_begin = sc.passes[size_t(it.pass)].row_begin;
  buf.resize(size_t(it.heads * (it.e1 - it.e0) * d));
  float* dst = buf.data();
  for (int h = it.kvh; h < it.kvh + it.heads; ++h) {
    for (int64_t e = it.e0; e < it.e1; ++e, dst += d) {
      const int64_t row = sc.rows[size_t(row_begin + e / group)].q_row;
      const float* src = q + (row * shape.n_q_heads + h * group + int(e % group)) * d;
      std::copy(src, src + d, dst);
    }
  }
}

// Runs every item of sc: attend(item, scratch, o, lse) writes the item's partial states, o (heads, rows,
// head_dim) and lse (heads, rows), into the workspace. Items go largest first (rows x heads x keys), each thread
// taking the next one as it finishes: a range split between threads could leave one thread a shared pass's
// last large item after the other had run out of work (docs/study.md §12).
// A thread on a per-sequence item takes its next item as it starts it, and scratch.kernel.next names that
// item's first rows (first_rows(item) -> NextRows), which the kernel asks for over its last tile: the items
// at the end of the order are short, often a single tile, and would otherwise each begin with all of their
// reads missing. A shared-pass item takes its next only when it is done, as before, so no large item waits
// behind another.
template <class AttendItem, class FirstRows>
void run_items(const Schedule& sc, int64_t head_dim, float* ws, AttendItem attend, FirstRows first_rows) {
  const size_t n = sc.items.size();
  if (n == 0) return;
  CASCADE_CHECK(sc.largest_first.size() == n, "run: the schedule's item order is missing");
  std::atomic<size_t> next{0};
  const int n_workers = int(std::min<size_t>(size_t(std::max(1, tbb::this_task_arena::max_concurrency())), n));
  auto item = [&](size_t k) -> const Schedule::Item& { return sc.items[size_t(sc.largest_first[k])]; };
  tbb::parallel_for(0, n_workers, 1, [&](int) {
    ItemScratch& s = item_scratch().local();
    size_t k = next.fetch_add(1, std::memory_order_relaxed);
    while (k < n) {
      const Schedule::Item& it = item(k);
      size_t k_next = n;
      s.kernel.next = NextRows{};
      if (sc.passes[size_t(it.pass)].kernel == kFewRowsKernel) {
        k_next = next.fetch_add(1, std::memory_order_relaxed);
        if (k_next < n) s.kernel.next = first_rows(item(k_next));
      }
      attend(it, s, ws + it.slot * head_dim, ws + sc.n_slots * head_dim + it.slot);
      k = k_next < n ? k_next : next.fetch_add(1, std::memory_order_relaxed);
    }
    s.kernel.next = NextRows{};
  });
}

// Merges, for every output (row, q head), the partial states its list names into o and lse: the states that fold
// into the one before them (Schedule::out_fold) first, left to right, as the items fold theirs.
inline void merge_outputs(const Schedule& sc, const HeadShape& shape, int64_t n_rows, const float* ws, float* o,
                          float* lse) {
  const int64_t d = shape.head_dim;
  const float* ws_lse = ws + sc.n_slots * d;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n_rows), [&](const tbb::blocked_range<int64_t>& range) {
    std::vector<const float*> po;
    std::vector<float> pl;
    std::vector<float> folded;  // the folds, d floats each
    for (int64_t i = range.begin() * shape.n_q_heads; i < range.end() * shape.n_q_heads; ++i) {
      po.clear();
      pl.clear();
      const int64_t end = sc.out_begin[size_t(i) + 1];
      folded.resize(size_t((end - sc.out_begin[size_t(i)]) * d));
      for (int64_t k = sc.out_begin[size_t(i)]; k < end; ++k) {
        const int64_t slot = sc.out_slots[size_t(k)];
        const bool into = !po.empty() && !sc.out_fold.empty() && sc.out_fold[size_t(k)];
        if (!into && (k + 1 == end || sc.out_fold.empty() || !sc.out_fold[size_t(k) + 1])) {
          po.push_back(ws + slot * d);  // a state nothing folds into: read in place
          pl.push_back(ws_lse[slot]);
          continue;
        }
        if (!into) {
          float* f = folded.data() + po.size() * size_t(d);
          std::copy(ws + slot * d, ws + (slot + 1) * d, f);
          po.push_back(f);
          pl.push_back(ws_lse[slot]);
          continue;
        }
        merge_state_inplace(const_cast<float*>(po.back()), &pl.back(), ws + slot * d, ws_lse[slot], d);
      }
      float lse_out;
      merge_states(int64_t(po.size()), po.data(), pl.data(), o + i * d, &lse_out, d);
      if (lse) lse[i] = lse_out;
    }
  });
}

// The first rows an item reads from its pass's segments k_begin on: those of the first of them it attends to
// (none if it attends to none of them).
inline NextRows first_rows(const Schedule& sc, const std::vector<KvView>& kv, const Schedule::Item& it,
                           int64_t k_begin) {
  for (int64_t k = k_begin; k < sc.passes[size_t(it.pass)].seg_end; ++k) {
    const Schedule::PassSegment& seg = sc.segs[size_t(k)];
    const int64_t a = std::max(it.t0, seg.start), b = std::min(it.t1, seg.start + seg.n_tokens);
    const int64_t base = seg.start - seg.from;  // pass key of the segment's token 0
    if (a < b) return next_rows(kv[size_t(seg.seg)], it.kvh, it.heads, a - base, b - base);
  }
  return {};
}

// Keys [a, b) of pass ps, heads [kvh, kvh + heads), copied from the pass's segments into one dense view held by s
// (other heads' rows left unwritten): the keys of a batch-invariant block around a join of segments that a kernel
// step must see together (attend_block).
inline KvView gather_keys(const Schedule& sc, const Schedule::Pass& ps, const std::vector<KvView>& kv, int kvh,
                          int heads, int64_t a, int64_t b, ItemScratch& s) {
  const KvView& v0 = kv[size_t(sc.segs[size_t(ps.seg_begin)].seg)];
  const bool q8 = v0.dtype == DType::q8_0;
  const int64_t es = dtype_size(v0.dtype), d = v0.head_dim, row = int64_t(v0.n_kv_heads) * d;
  s.k.resize(size_t((b - a) * row * es));
  s.v.resize(s.k.size());
  s.k_scales.resize(q8 ? size_t((b - a) * row / kQ8Block * 2) : 0);
  s.v_scales.resize(s.k_scales.size());
  for (int64_t k = ps.seg_begin; k < ps.seg_end; ++k) {
    const Schedule::PassSegment& seg = sc.segs[size_t(k)];
    const KvView& view = kv[size_t(seg.seg)];
    CASCADE_CHECK(view.dtype == v0.dtype, "run: segments of one pass hold different K/V types");
    const int run = view.stride_head == d ? heads : 1;  // heads copied at once: dense ones side by side
    for (int64_t t = std::max(a, seg.start); t < std::min(b, seg.start + seg.n_tokens); ++t)
      for (int h = kvh; h < kvh + heads; h += run) {
        const int64_t src = view.offset(t - seg.start + seg.from, h), dst = (t - a) * row + h * d, n = run * d;
        auto copy = [](const void* from, int64_t at, std::vector<char>& to, int64_t to_at, int64_t bytes) {
          std::memcpy(to.data() + to_at, static_cast<const char*>(from) + at, size_t(bytes));
        };
        copy(view.k, src * es, s.k, dst * es, n * es);
        copy(view.v, src * es, s.v, dst * es, n * es);
        if (!q8) continue;
        copy(view.k_scales, src / kQ8Block * 2, s.k_scales, dst / kQ8Block * 2, n / kQ8Block * 2);
        copy(view.v_scales, src / kQ8Block * 2, s.v_scales, dst / kQ8Block * 2, n / kQ8Block * 2);
      }
  }
  KvView g = v0;
  g.n_tokens = b - a;
  g.k = s.k.data();
  g.v = s.v.data();
  g.k_scales = q8 ? s.k_scales.data() : nullptr;
  g.v_scales = q8 ? s.v_scales.data() : nullptr;
  g.stride_token = row;
  g.stride_head = d;
  g.block_table = nullptr;
  g.page_size = g.stride_page = 0;
  return g;
}

// One kernel call of an item: keys [x, y) of its pass, read from `view`, whose token 0 is pass key `base`.
inline void call_kernel(const Plan& plan, const Schedule::Item& it, const KvView& view, int64_t base, int64_t x,
                        int64_t y, ItemScratch& s, float* o, float* lse) {
  const Schedule& sc = plan.schedule();
  const Schedule::Pass& ps = sc.passes[size_t(it.pass)];
  const int group = plan.shape().group();
  const bool window = plan.attended().window() > 0;
  const int64_t n = it.e1 - it.e0;
  s.limit.resize(size_t(n));
  if (window) s.first.resize(size_t(n));
  for (int64_t e = it.e0; e < it.e1; ++e) {
    const Schedule::Row& row = sc.rows[size_t(ps.row_begin + e / group)];
    s.limit[size_t(e - it.e0)] = row.limit - base;
    if (window) s.first[size_t(e - it.e0)] = row.first - base;
  }
  run_kernel(plan.target().kernel_choices(ps.kernel, view.dtype), s.q.data(), n, it.heads, view, it.kvh, x - base,
             y - base, LimitMask{s.limit.data(), window ? s.first.data() : nullptr}, plan.scale(), o, lse, s.kernel);
}

// Keys [a, b) of an item's pass, segment by segment, the second and later segments' states merged into the first's.
// o: (heads, rows, head_dim), lse: (heads, rows). s.q holds the item's queries (gather_queries).
inline void attend_keys(const Plan& plan, const std::vector<KvView>& kv, const Schedule::Item& it, int64_t a,
                        int64_t b, ItemScratch& s, float* o, float* lse) {
  const Schedule& sc = plan.schedule();
  const int64_t d = plan.shape().head_dim, states = it.heads * (it.e1 - it.e0);
  const Schedule::Pass& ps = sc.passes[size_t(it.pass)];
  const NextRows after = s.kernel.next;  // what the thread attends after this item (run_items)
  bool first = true;
  for (int64_t k = ps.seg_begin; k < ps.seg_end; ++k) {
    const Schedule::PassSegment& seg = sc.segs[size_t(k)];
    const int64_t t0 = std::max(a, seg.start), t1 = std::min(b, seg.start + seg.n_tokens);
    if (t0 >= t1) continue;
    // Over this segment's last tile, the kernel asks for the start of the item's next segment, or of what follows
    // the item.
    const NextRows in_item = first_rows(sc, kv, it, k + 1);
    s.kernel.next = in_item.k ? in_item : after;
    if (!first) s.o2.resize(size_t(states * (d + 1)));
    float* o_k = first ? o : s.o2.data();
    float* lse_k = first ? lse : s.o2.data() + states * d;
    call_kernel(plan, it, kv[size_t(seg.seg)], seg.start - seg.from, t0, t1, s, o_k, lse_k);
    if (!first) merge_states_inplace(o, lse, o_k, lse_k, states, d);
    first = false;
  }
}

// A batch-invariant block: keys [a, b) of an item's pass in one running state, whatever segments it spans. Each
// segment's keys are read in place, the state carried from call to call (Scratch::carry_in, carry_out); around a
// join off a multiple of kTileStep, the step's keys are copied into one view (gather_keys), so that every step
// holds the keys one call over one view would give it. A kernel without the invariant order (bf16 or int8 products),
// or segments of different K/V types, attend the block segment by segment (attend_keys).
inline void attend_block(const Plan& plan, const std::vector<KvView>& kv, const Schedule::Item& it, int64_t a,
                         int64_t b, ItemScratch& s, float* o, float* lse) {
  const Schedule& sc = plan.schedule();
  const Schedule::Pass& ps = sc.passes[size_t(it.pass)];
  const DType dt = kv[size_t(sc.segs[size_t(ps.seg_begin)].seg)].dtype;
  bool one_type = true;  // segments of other K/V types take other kernels: nothing to carry between them
  for (int64_t k = ps.seg_begin; k < ps.seg_end; ++k)
    one_type = one_type && kv[size_t(sc.segs[size_t(k)].seg)].dtype == dt;
  if (!one_type || !plan.target().kernel_choices(ps.kernel, dt).batch_invariant)
    return attend_keys(plan, kv, it, a, b, s, o, lse);  // no invariant order to keep: segment by segment
  std::vector<int64_t> cut{a, b};  // call boundaries
  for (int64_t k = ps.seg_begin + 1; k < ps.seg_end; ++k) {
    const int64_t j = sc.segs[size_t(k)].start;
    if (j <= a || j >= b) continue;
    cut.push_back(j / kTileStep * kTileStep);
    cut.push_back(std::min(b, (j + kTileStep - 1) / kTileStep * kTileStep));
  }
  std::sort(cut.begin(), cut.end());
  cut.erase(std::unique(cut.begin(), cut.end()), cut.end());
  const NextRows after = s.kernel.next;
  const bool same_q = s.kernel.same_q;
  for (size_t i = 0; i + 1 < cut.size(); ++i) {
    const int64_t x = cut[i], y = cut[i + 1];
    int64_t k = ps.seg_begin;  // the segment holding x
    while (sc.segs[size_t(k)].start + sc.segs[size_t(k)].n_tokens <= x) ++k;
    const Schedule::PassSegment& seg = sc.segs[size_t(k)];
    const bool in_place = y <= seg.start + seg.n_tokens;
    s.kernel.carry_in = i > 0;
    s.kernel.carry_out = i + 2 < cut.size();
    s.kernel.same_q = same_q || i > 0;
    // The last call asks for the item's next block where the same view holds it.
    const int64_t more = std::max<int64_t>(0, std::min(it.t1, seg.start + seg.n_tokens) - y);
    s.kernel.keys_after = in_place && !s.kernel.carry_out ? more : 0;
    const KvView view = in_place ? kv[size_t(seg.seg)] : gather_keys(sc, ps, kv, it.kvh, it.heads, x, y, s);
    const int64_t base = in_place ? seg.start - seg.from : x;
    s.kernel.next = s.kernel.keys_after > 0 ? next_rows(view, it.kvh, it.heads, y - base, y - base + more) : after;
    call_kernel(plan, it, view, base, x, y, s, o, lse);
  }
  s.kernel.carry_in = s.kernel.carry_out = false;
  s.kernel.keys_after = 0;
}

// Attends one item of a plan: its tokens [t0, t1) of the pass; or, with batch-invariant blocks, each block in turn
// (the first from the item's first key, which may lie inside it under a sliding window), the blocks of a state after
// its first merged into it left to right (Schedule::item_states), each state at its slots (Schedule::slot_of).
inline void attend_plan_item(const Plan& plan, const std::vector<KvView>& kv, const float* q,
                             const Schedule::Item& it, ItemScratch& s, float* o_it, float* lse_it) {
  const Schedule& sc = plan.schedule();
  const int64_t states = it.heads * (it.e1 - it.e0), d = plan.shape().head_dim;
  gather_queries(q, plan.shape(), sc, it, s.q);
  const NextRows after = s.kernel.next;
  sc.item_states(it, [&](int64_t k, int64_t a, int64_t b) {
    float* o = o_it + k * states * d;
    float* lse = lse_it + k * states;
    s.kernel.next = after;
    if (sc.block <= 0) {
      s.kernel.same_q = false;
      attend_keys(plan, kv, it, a, b, s, o, lse);
      return;
    }
    for (int64_t x = a; x < b;) {
      const int64_t y = std::min(b, sc.block_end(x));
      s.kernel.next = after;
      s.kernel.same_q = x > it.t0;  // one kernel call per block: the queries packed once
      if (x == a) {
        attend_block(plan, kv, it, x, y, s, o, lse);
      } else {
        s.o3.resize(size_t(states * (d + 1)));
        attend_block(plan, kv, it, x, y, s, s.o3.data(), s.o3.data() + states * d);
        for (int64_t r = 0; r < states; ++r)
          merge_state_inplace(o + r * d, lse + r, s.o3.data() + r * d, s.o3[size_t(states * d + r)], d);
      }
      x = y;
    }
  });
  s.kernel.same_q = false;
}

// Checks a view against the plan's segment g; throws an Error naming the segment.
inline void check_view(const KvView& kv, const Tree& tree, int g) {
  try {
    kv.validate("K/V view");
  } catch (const Error& e) {
    cascade::detail::fail("run: segment ", g, ": ", e.what());
  }
  CASCADE_CHECK(kv.n_kv_heads == tree.shape().n_kv_heads && kv.head_dim == tree.shape().head_dim, "run: segment ", g,
                " has ", kv.n_kv_heads, " KV heads of dim ", kv.head_dim, " but the plan has ",
                tree.shape().n_kv_heads, " of dim ", tree.shape().head_dim);
  CASCADE_CHECK(kv.n_tokens == tree.n_tokens(g), "run: segment ", g, " has ", kv.n_tokens, " tokens but the plan ",
                tree.n_tokens(g));
}

}  // namespace detail

// Runs the plan on one layer. kv: the K/V of the plan's tree segments, kv(g) -> KvView (or a list, below).
// q, o: (plan.n_rows(), n_q_heads, head_dim), f32, contiguous. lse: (n_rows, n_q_heads), natural log, or
// nullptr. Rows that see no key get o = 0 and lse = -inf. workspace: plan.workspace_floats() floats, or
// nullptr for the calling thread's kept buffer. Throws Error on a view that does not match the plan.
template <class SegmentKv>
  requires std::is_invocable_r_v<KvView, SegmentKv&, int>
void run(const Plan& plan, SegmentKv&& kv, const float* q, float* o, float* lse = nullptr,
         float* workspace = nullptr) {
  const Tree& tree = plan.tree();
  CASCADE_CHECK(std::string_view(plan.target().backend) == "cpu", "run: the plan was made for the ",
                plan.target().backend, " backend, not the CPU");
  CASCADE_CHECK(plan.n_rows() == 0 || (q != nullptr && o != nullptr), "run: null q or o with ", plan.n_rows(),
                " query rows");
  std::vector<KvView> given(size_t(tree.n_segments()));
  for (int g = 0; g < tree.n_segments(); ++g) {
    given[size_t(g)] = kv(g);
    detail::check_view(given[size_t(g)], tree, g);
  }
  check_kernels(plan.target(), plan.shape().head_dim);
  const Tree& at = plan.attended();
  std::vector<KvView> views(size_t(at.n_segments()));
  for (int k = 0; k < at.n_segments(); ++k) views[size_t(k)] = given[size_t(plan.source(k))];
  std::optional<Workspace> kept;
  if (!workspace) workspace = kept.emplace(size_t(plan.workspace_floats())).data();
  in_arena(plan.target().n_threads, [&] {
    detail::run_items(
        plan.schedule(), plan.shape().head_dim, workspace,
        [&](const Schedule::Item& it, detail::ItemScratch& s, float* o_it, float* lse_it) {
          detail::attend_plan_item(plan, views, q, it, s, o_it, lse_it);
        },
        [&](const Schedule::Item& it) {
          return detail::first_rows(plan.schedule(), views, it, plan.schedule().passes[size_t(it.pass)].seg_begin);
        });
    detail::merge_outputs(plan.schedule(), plan.shape(), plan.n_rows(), workspace, o, lse);
  });
}

inline void run(const Plan& plan, std::span<const KvView> kv, const float* q, float* o, float* lse = nullptr,
                float* workspace = nullptr) {
  CASCADE_CHECK(int64_t(kv.size()) == plan.n_segments(), "run: ", kv.size(), " K/V views for a plan of ",
                plan.n_segments(), " segments");
  run(plan, [&](int g) { return kv[size_t(g)]; }, q, o, lse, workspace);
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
  int64_t window = 0;                 // sliding window: a row sees keys at positions > its own - window (0: none)
};

// The unified baseline's plan: n_rows query rows against a buffer of n_keys keys (its schedule has one
// pass). scale: the softmax scale (0: 1/sqrt(head_dim)).
struct UnifiedPlan {
  HeadShape shape;
  float scale = 1.0f;
  int64_t n_keys = 0, n_rows = 0;
  Target target;
  Schedule schedule;
  int64_t workspace_floats() const { return schedule.workspace_floats(shape.head_dim); }
};

inline UnifiedPlan plan_unified(const HeadShape& shape, int64_t n_keys, int64_t n_rows, const Options& opt = {},
                                float scale = 0.0f) {
  shape.validate();
  UnifiedPlan p;
  p.shape = shape;
  p.scale = scale != 0.0f ? scale : 1.0f / std::sqrt(float(shape.head_dim));
  CASCADE_CHECK(std::isfinite(p.scale), "unified plan: softmax scale is not finite");
  p.n_keys = n_keys;
  p.n_rows = n_rows;
  p.target = target(opt, shape.head_dim);
  p.schedule = make_unified_schedule(shape, n_keys, n_rows, p.target);
  return p;
}

// Checks b against p; throws an Error naming the problem.
inline void check_unified(const UnifiedPlan& p, const UnifiedBatch& b) {
  b.kv.validate("unified KV buffer");
  CASCADE_CHECK(b.kv.n_kv_heads == p.shape.n_kv_heads && b.kv.head_dim == p.shape.head_dim, "unified KV buffer has ",
                b.kv.n_kv_heads, " heads of dim ", b.kv.head_dim, ", the shape says ", p.shape.n_kv_heads, "/",
                p.shape.head_dim);
  CASCADE_CHECK(b.kv.n_tokens == p.n_keys && b.n_rows == p.n_rows, "unified batch: ", b.kv.n_tokens, " keys and ",
                b.n_rows, " rows, the plan has ", p.n_keys, " and ", p.n_rows);
  CASCADE_CHECK(b.n_words > 0, "unified batch: bad n_words (", b.n_words, ")");
  CASCADE_CHECK(b.window >= 0, "unified batch: negative sliding window (", b.window, ")");
  CASCADE_CHECK(b.n_rows == 0 || (b.row_seq && b.row_pos), "unified batch: null row data with ", b.n_rows, " rows");
  CASCADE_CHECK(b.kv.n_tokens == 0 || (b.key_seqs && b.key_pos), "unified batch: null key masks with ",
                b.kv.n_tokens, " keys");
  for (int64_t r = 0; r < b.n_rows; ++r)
    CASCADE_CHECK(b.row_seq[r] >= 0 && b.row_seq[r] < 64 * b.n_words, "unified batch: row ", r, " has sequence ",
                  b.row_seq[r], ", outside the ", 64 * b.n_words, " the key masks hold");
}

// q, o: (n_rows, n_q_heads, head_dim); lse: (n_rows, n_q_heads) or nullptr; workspace as for run().
inline void run_unified(const UnifiedPlan& p, const UnifiedBatch& b, const float* q, float* o, float* lse = nullptr,
                        float* workspace = nullptr) {
  CASCADE_CHECK(b.n_rows == 0 || (q && o), "unified batch: null q or o with ", b.n_rows, " rows");
  check_unified(p, b);
  check_kernels(p.target, p.shape.head_dim);
  const int group = p.shape.group();
  const int64_t d = p.shape.head_dim;
  std::optional<Workspace> kept;
  if (!workspace) workspace = kept.emplace(size_t(p.workspace_floats())).data();
  in_arena(p.target.n_threads, [&] {
    detail::run_items(p.schedule, d, workspace,
                      [&](const Schedule::Item& it, detail::ItemScratch& s, float* o_it, float* lse_it) {
                        detail::gather_queries(q, p.shape, p.schedule, it, s.q);
                        const int64_t n = it.e1 - it.e0;
                        s.seq.resize(size_t(n));
                        s.pos.resize(size_t(n));
                        for (int64_t e = it.e0; e < it.e1; ++e) {
                          s.seq[size_t(e - it.e0)] = b.row_seq[e / group];
                          s.pos[size_t(e - it.e0)] = b.row_pos[e / group];
                        }
                        run_kernel(
                            p.target.kernel_choices(p.schedule.passes[0].kernel, b.kv.dtype), s.q.data(), n, it.heads,
                            b.kv, it.kvh, it.t0, it.t1,
                            UnifiedMask{b.key_seqs, b.n_words, b.key_pos, s.seq.data(), s.pos.data(), b.window},
                            p.scale, o_it,
                            lse_it, s.kernel);
                      },
                      [&](const Schedule::Item& it) { return next_rows(b.kv, it.kvh, it.heads, it.t0, it.t1); });
    detail::merge_outputs(p.schedule, p.shape, b.n_rows, workspace, o, lse);
  });
}

// Plans and runs the unified baseline in one call (benchmarks and tests).
inline void attend_unified(const HeadShape& shape, const UnifiedBatch& b, const float* q, float* o,
                           float* lse = nullptr, const Options& opt = {}, float scale = 0.0f) {
  CASCADE_CHECK(b.n_rows >= 0, "unified batch: bad n_rows (", b.n_rows, ")");
  run_unified(plan_unified(shape, b.kv.n_tokens, b.n_rows, opt, scale), b, q, o, lse);
}

}  // namespace cascade::cpu
