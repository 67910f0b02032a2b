// Batch invariance: a row's attention output (o, lse) has the same bits whatever else the step holds -- the rows
// stacked beside it, the segmentation of its keys (a shared prefix of any length, a chain of segments), the
// chunking of its passes over threads, the kernel its pass takes (tiled or few-rows) and the method (cascade,
// auto, split). Fresh random inputs every run; the outputs compared bit for bit, and against the double
// reference within the accuracy suite's tolerance.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <string>

#include "attention_problem.hpp"
#include "cascade/cascade.hpp"

namespace test_attention_invariance {

using namespace cascade;
using test::Rng;

namespace {

constexpr double kAtol = 5e-6, kRtol = 5e-5;  // test_attention.cpp's bound

// The tiers whose f32 kernels are batch-invariant on this CPU: all of them.
std::vector<Isa> invariant_tiers() {
  std::vector<Isa> t;
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512})
    if (isa <= detected_isa()) t.push_back(isa);
  return t;
}

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, size_t(n) * sizeof(float)) == 0; }

// One row's state on one kernel call: q (head_dim) stacked as row `at` of n_rows rows of head `head` of n_heads
// (the others random), seeing keys [t0, limit) of kv from KV head kvh - head on; or, with first >= 0 (a sliding
// window), keys [first, limit), the other rows from random firsts too.
struct RowCall {
  std::vector<float> o, lse;
};
RowCall call(Rng& rng, const KernelChoice& k, const std::vector<float>& q, int64_t n_rows, int64_t at, int n_heads,
             int head, const KvView& kv, int kvh, int64_t t0, int64_t t1, int64_t limit, int64_t first = -1) {
  const int64_t d = kv.head_dim;
  std::vector<float> qs(size_t(n_heads * n_rows * d)), o(qs.size()), lse(size_t(n_heads * n_rows));
  for (float& x : qs) x = rng.uniform(-1, 1);
  std::copy(q.begin(), q.end(), qs.begin() + (head * n_rows + at) * d);
  std::vector<int64_t> limits(static_cast<size_t>(n_rows)), firsts(limits.size());
  for (int64_t& x : limits) x = rng.uniform_int(t0, t1);
  for (size_t r = 0; r < firsts.size(); ++r) firsts[r] = rng.uniform_int(t0 - 3, limits[r] + 3);
  limits[size_t(at)] = limit;
  firsts[size_t(at)] = first;
  cpu::Scratch sc;
  cpu::run_kernel(k, qs.data(), n_rows, n_heads, kv, kvh - head, t0, t1,
                  cpu::LimitMask{limits.data(), first >= 0 ? firsts.data() : nullptr}, 0.125f, o.data(), lse.data(),
                  sc);
  const int64_t r = head * n_rows + at;
  return {{o.begin() + r * d, o.begin() + (r + 1) * d}, {lse[size_t(r)]}};
}

// A random kernel call of the tests below: head dim, K/V type, KV heads and keys, the call's keys [t0, t1) (t0 on a
// key step), the row's limit, its KV head and q.
struct KernelCase {
  int d = 0, n_kvh = 0, kvh = 0;
  DType dt = DType::f32;
  int64_t n_keys = 0, t0 = 0, t1 = 0, limit = 0;
  std::unique_ptr<test::Segment> seg;
  std::vector<float> q;

  KernelCase(Rng& rng, int max_kv_heads) {
    d = rng.pick<int>({32, 64, 80, 128});
    dt = d % 32 == 0 ? rng.pick<DType>({DType::f32, DType::f16, DType::bf16, DType::q8_0})
                     : rng.pick<DType>({DType::f32, DType::f16});
    n_kvh = int(rng.uniform_int(1, max_kv_heads));
    n_keys = rng.uniform_int(1, 700);
    seg = test::make_segment(rng, dt, n_keys, n_kvh, d, false, rng.uniform(0.5f, 4.0f));
    t0 = rng.uniform_int(0, (n_keys - 1) / 8) * 8;
    t1 = rng.uniform_int(t0 + 1, n_keys);
    limit = rng.uniform_int(t0, t1);
    kvh = int(rng.uniform_int(0, n_kvh - 1));
    q.resize(size_t(d));
    for (float& x : q) x = rng.uniform(-2, 2);
  }
};

}  // namespace

TEST_CASE("kernels: a row's bits on the tiled and the few-rows kernel, alone and stacked with up to 40 others") {
  const uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  Rng rng(seed);
  for (Isa isa : invariant_tiers())
    for (int it = 0; it < test::sweep(40); ++it) {
      const KernelCase c(rng, 4);
      const auto& [d, n_kvh, kvh, dt, n_keys, t0, t1, limit, seg, q] = c;
      CAPTURE(std::string(isa_name(isa)));
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(d);
      CAPTURE(n_keys);
      CAPTURE(t0);
      CAPTURE(t1);
      CAPTURE(limit);
      const KernelChoice tiled{KernelShape::tiled, isa, Products::f32, true};
      const KernelChoice few{KernelShape::few_rows, isa, Products::f32, true};
      const RowCall alone = call(rng, few, q, 1, 0, 1, 0, seg->view, kvh, t0, t1, limit);
      std::vector<RowCall> others;
      others.push_back(call(rng, tiled, q, 1, 0, 1, 0, seg->view, kvh, t0, t1, limit));
      const int64_t n_tiled = rng.uniform_int(2, 41);
      others.push_back(call(rng, tiled, q, n_tiled, rng.uniform_int(0, n_tiled - 1), 1, 0, seg->view, kvh, t0, t1,
                            limit));
      const int64_t n_few = rng.uniform_int(2, cpu::kFewRows);
      const int first = int(rng.uniform_int(0, kvh)), head = kvh - first;  // heads [first, first + heads)
      const int heads = int(rng.uniform_int(head + 1, n_kvh - first));
      others.push_back(call(rng, few, q, n_few, rng.uniform_int(0, n_few - 1), heads, head, seg->view, kvh, t0, t1,
                            limit));
      for (size_t k = 0; k < others.size(); ++k) {
        CAPTURE(k);
        CHECK(same_bits(alone.o.data(), others[k].o.data(), d));
        CHECK(same_bits(alone.lse.data(), others[k].lse.data(), 1));
      }
    }
}

// Under a sliding window a block's first keys are masked from the front (LimitMask::first): they must leave a row's
// state as it was before any key, so that its bits are those of a call from the key step holding its first key (the
// schedule starts a tile's first item there, schedule.hpp) whichever kernel, rows and heads the call has, and a row
// that sees no key of the call gets the empty state exactly.
TEST_CASE("kernels: keys masked from the front leave a row's bits as a call from the step of its first key") {
  const uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  Rng rng(seed);
  for (Isa isa : invariant_tiers())
    for (int it = 0; it < test::sweep(40); ++it) {
      const KernelCase c(rng, 3);
      const auto& [d, n_kvh, kvh, dt, n_keys, t0, t1, limit, seg, q] = c;
      // The row's first key: anywhere up to its limit (none seen when equal), on a key step and one past it.
      const int64_t first = rng.pick<int64_t>({rng.uniform_int(t0, limit), t0 + (limit - t0) / 8 * 8,
                                               std::min(limit, t0 + (limit - t0) / 8 * 8 + 1), limit});
      const int64_t from = first / 8 * 8;  // the step holding it
      CAPTURE(std::string(isa_name(isa)));
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(d);
      CAPTURE(t0);
      CAPTURE(t1);
      CAPTURE(first);
      CAPTURE(limit);
      const KernelChoice tiled{KernelShape::tiled, isa, Products::f32, true};
      const KernelChoice few{KernelShape::few_rows, isa, Products::f32, true};
      std::vector<RowCall> calls;
      if (from < t1) calls.push_back(call(rng, few, q, 1, 0, 1, 0, seg->view, kvh, from, t1, limit, first));
      calls.push_back(call(rng, few, q, 1, 0, 1, 0, seg->view, kvh, t0, t1, limit, first));
      calls.push_back(call(rng, tiled, q, 1, 0, 1, 0, seg->view, kvh, t0, t1, limit, first));
      const int64_t n_tiled = rng.uniform_int(2, 41);
      calls.push_back(call(rng, tiled, q, n_tiled, rng.uniform_int(0, n_tiled - 1), 1, 0, seg->view, kvh, t0, t1,
                           limit, first));
      if (from < t1)
        calls.push_back(call(rng, tiled, q, n_tiled, rng.uniform_int(0, n_tiled - 1), 1, 0, seg->view, kvh, from, t1,
                             limit, first));
      const int64_t n_few = rng.uniform_int(2, cpu::kFewRows);
      const int lo = int(rng.uniform_int(0, kvh)), head = kvh - lo;  // heads [lo, lo + heads)
      const int heads = int(rng.uniform_int(head + 1, n_kvh - lo));
      calls.push_back(call(rng, few, q, n_few, rng.uniform_int(0, n_few - 1), heads, head, seg->view, kvh, t0, t1,
                           limit, first));
      for (size_t k = 0; k < calls.size(); ++k) {
        CAPTURE(k);
        CHECK(same_bits(calls[0].o.data(), calls[k].o.data(), d));
        CHECK(same_bits(calls[0].lse.data(), calls[k].lse.data(), 1));
        if (first >= limit) {  // nothing seen: the empty state
          CHECK(calls[k].lse[0] == -INFINITY);
          CHECK(std::all_of(calls[k].o.begin(), calls[k].o.end(), [](float x) { return x == 0.0f && !std::signbit(x); }));
        }
      }
    }
}

namespace {

// Keys of one sequence, contiguous: views of any part of them.
struct Keys {
  std::unique_ptr<test::Segment> seg;
  KvView part(int64_t a, int64_t n) const {
    KvView v = seg->view;
    const int64_t es = dtype_size(v.dtype);
    v.k = static_cast<const char*>(v.k) + a * v.stride_token * es;
    v.v = static_cast<const char*>(v.v) + a * v.stride_token * es;
    if (v.dtype == DType::q8_0) {
      v.k_scales = static_cast<const f16*>(v.k_scales) + a * v.stride_token / kQ8Block;
      v.v_scales = static_cast<const f16*>(v.v_scales) + a * v.stride_token / kQ8Block;
    }
    v.n_tokens = n;
    return v;
  }
};

// A step around one sequence (its keys `own`, its queries q): its keys cut at `cuts` into a chain of segments,
// other sequences branching off below the chain's segments (each with keys of its own), every sequence with
// n_query rows, every row seeing its last `window` keys (0: all). Returns the sequence's rows of o and lse (n_query,
// n_q_heads, ...).
struct Step {
  std::vector<int64_t> cuts;  // ascending, inside (0, n_keys): the chain's joins
  std::vector<int> branch;    // per other sequence: the chain segment it shares up to (its parent)
  int64_t at = 0;             // the sequence's index among the sequences
};

void run_step(Rng& rng, const HeadShape& shape, const Keys& keys, int64_t n_keys, int64_t n_query, int64_t window,
              const std::vector<float>& q_own, const Step& st, const cpu::Options& opt, int method,
              std::vector<float>& o_own, std::vector<float>& lse_own) {
  std::vector<int64_t> len;
  std::vector<KvView> views;
  std::vector<std::unique_ptr<test::Segment>> store;
  auto add = [&](const KvView& v) {
    len.push_back(v.n_tokens);
    views.push_back(v);
    return int(len.size()) - 1;
  };
  auto add_random = [&](int64_t lo, int64_t hi) {
    store.push_back(test::make_segment(rng, keys.seg->view.dtype, rng.uniform_int(lo, hi), shape.n_kv_heads,
                                       shape.head_dim, false));
    return add(store.back()->view);
  };
  std::vector<int> chain;
  if (method != 2)
    for (size_t k = 0, a = 0; k <= st.cuts.size(); ++k) {
      const int64_t b = k < st.cuts.size() ? st.cuts[k] : n_keys;
      chain.push_back(add(keys.part(int64_t(a), b - int64_t(a))));
      a = size_t(b);
    }
  const int64_t n_seqs = int64_t(st.branch.size()) + 1;
  std::vector<std::vector<int>> paths;
  for (int64_t s = 0, o = 0; s < n_seqs; ++s) {
    if (method == 2) {  // split: every sequence alone on a copy of all of its keys
      paths.push_back({s == st.at ? add(keys.part(0, n_keys)) : add_random(1, 900)});
    } else if (s == st.at) {
      paths.push_back(chain);
    } else {
      std::vector<int> path(chain.begin(), chain.begin() + st.branch[size_t(o++)] + 1);
      path.push_back(add_random(0, 300));
      paths.push_back(path);
    }
  }
  const Tree tree = Tree::build(shape, len, paths, std::vector<int64_t>(size_t(n_seqs), n_query), 0.0f, window);
  const int64_t row_d = int64_t(shape.n_q_heads) * shape.head_dim;
  std::vector<float> q(size_t(tree.n_rows() * row_d)), o(q.size()), lse(size_t(tree.n_rows() * shape.n_q_heads));
  for (float& x : q) x = rng.uniform(-1, 1);
  const int64_t r0 = tree.sequence(int(st.at)).row_begin;
  std::copy(q_own.begin(), q_own.end(), q.begin() + r0 * row_d);
  CostModel model;
  cpu::Options o2 = opt;
  if (method == 1) o2.cost_model = &model;
  const Plan plan = cpu::plan(tree, o2);
  REQUIRE(plan.schedule().block == cpu::kBlockKeys);  // blocks, with a window too
  verify_schedule(plan.attended(), plan.schedule());
  cpu::run(plan, std::span<const KvView>(views), q.data(), o.data(), lse.data());
  o_own.assign(o.begin() + r0 * row_d, o.begin() + (r0 + n_query) * row_d);
  lse_own.assign(lse.begin() + r0 * shape.n_q_heads, lse.begin() + (r0 + n_query) * shape.n_q_heads);
}

// A random segmentation and stacking; `at`: joins wanted besides the random ones (those inside the keys).
Step random_step(Rng& rng, int64_t n_keys, bool aligned, const std::vector<int64_t>& at = {}) {
  Step st;
  const int n_cuts = int(rng.uniform_int(0, std::min<int64_t>(3, n_keys - 1)));
  for (int k = 0; k < n_cuts; ++k) {
    int64_t c = rng.uniform_int(1, n_keys - 1);
    if (aligned) c = std::max<int64_t>(cpu::kBlockKeys, c / cpu::kBlockKeys * cpu::kBlockKeys);
    if (c < n_keys) st.cuts.push_back(c);
  }
  for (int64_t c : at)
    if (c > 0 && c < n_keys) st.cuts.push_back(c);
  std::sort(st.cuts.begin(), st.cuts.end());
  st.cuts.erase(std::unique(st.cuts.begin(), st.cuts.end()), st.cuts.end());
  const int64_t n_others = rng.coin(0.2) ? 0 : rng.uniform_int(1, 40);
  for (int64_t s = 0; s < n_others; ++s) st.branch.push_back(int(rng.uniform_int(0, int64_t(st.cuts.size()))));
  st.at = rng.uniform_int(0, n_others);
  return st;
}

// A window drawn at the edges: 1, around a block, a fold span and a key count, past everything, and windows whose
// last row's first key is a block's first or the key after it.
int64_t edge_window(Rng& rng, int64_t n_keys) {
  const int64_t C = cpu::kBlockKeys, last = n_keys - 1;  // the last row's position
  const int64_t b = rng.uniform_int(0, last / C) * C;    // a block start at or before it
  return std::max<int64_t>(1, rng.pick<int64_t>({1, 2, C - 1, C, C + 1, 2 * C + 1, cpu::kFoldKeys - 1, n_keys - 1,
                                                 n_keys, n_keys + 7, last - b + 1, last - b,
                                                 rng.uniform_int(1, n_keys)}));
}

// One sequence at a time, its bits alone against those beside 1..40 others, under random segmentations (some cut
// where its rows' windows start, with a window), thread counts and methods, on a random tier; alone, within
// tolerance of the reference.
void sequence_sweep(bool windowed) {
  const uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  Rng rng(seed);
  for (int it = 0; it < test::sweep(12); ++it) {
    const HeadShape shape = rng.pick<HeadShape>({{9, 3, 64}, {8, 2, 128}, {4, 4, 32}, {6, 2, 80}});
    const DType dt = shape.head_dim % 32 == 0 ? rng.pick<DType>({DType::f16, DType::f16, DType::f32, DType::bf16,
                                                                 DType::q8_0})
                                              : rng.pick<DType>({DType::f16, DType::f32, DType::bf16});
    // bf16 and q8_0 on f32 products (their dot-product kernels are not batch-invariant: docs/serving.md)
    cpu::KernelOptions ko = cpu::KernelOptions::process();
    ko.bf16_products = 0;
    ko.int8_products = 0;
    ko.amx_tiles = false;
    const std::vector<Isa> tiers = invariant_tiers();
    ko.isa_limit = rng.pick(tiers);
    const int64_t n_keys = rng.uniform_int(1, windowed ? 2400 : 1400), n_query = rng.pick<int64_t>({1, 1, 2, 5, 12});
    const int64_t window = windowed ? edge_window(rng, n_keys) : 0;
    Keys keys{test::make_segment(rng, dt, n_keys, shape.n_kv_heads, shape.head_dim, false)};
    std::vector<float> q(size_t(n_query * shape.n_q_heads * shape.head_dim));
    for (float& x : q) x = rng.uniform(-1, 1);
    CAPTURE(it);
    CAPTURE(std::string(isa_name(ko.isa_limit)));
    CAPTURE(std::string(dtype_name(dt)));
    CAPTURE(shape.head_dim);
    CAPTURE(n_keys);
    CAPTURE(n_query);
    CAPTURE(window);
    std::vector<float> o0, lse0;
    run_step(rng, shape, keys, n_keys, n_query, window, q, Step{}, cpu::Options{1, nullptr, dt, ko}, 0, o0, lse0);
    // Within tolerance of the reference: the sequence alone.
    const Tree alone = Tree::build(shape, {n_keys}, {{0}}, {n_query}, 0.0f, window);
    const std::vector<KvView> all{keys.part(0, n_keys)};
    std::vector<double> ref_o(o0.size()), ref_lse(lse0.size());
    reference_attention(alone, all, q.data(), ref_o.data(), ref_lse.data());
    for (size_t i = 0; i < o0.size(); ++i) CHECK(std::abs(o0[i] - ref_o[i]) <= kAtol + kRtol * std::abs(ref_o[i]));
    for (size_t i = 0; i < lse0.size(); ++i)  // a row that sees no key: -inf on both sides
      CHECK((lse0[i] == ref_lse[i] || std::abs(lse0[i] - ref_lse[i]) <= kAtol + kRtol * std::abs(ref_lse[i])));
    // Joins where the first and the last row's windows start, and a key either side of the last's.
    std::vector<int64_t> at;
    if (windowed) {
      const int64_t w_last = n_keys - window, w_first = n_keys - n_query + 1 - window;
      at = rng.pick<std::vector<int64_t>>({{w_last}, {w_first}, {w_last - 1}, {w_last + 1}, {w_first, w_last}});
    }
    for (int v = 0; v < 6; ++v) {
      const Step st = random_step(rng, n_keys, v == 0, v % 2 == 1 ? at : std::vector<int64_t>{});
      const int method = int(rng.uniform_int(0, 2)), n_threads = int(rng.uniform_int(1, 3));
      CAPTURE(v);
      CAPTURE(method);
      CAPTURE(n_threads);
      CAPTURE(st.branch.size());
      CAPTURE(st.cuts.size());
      std::vector<float> o, lse;
      run_step(rng, shape, keys, n_keys, n_query, window, q, st, cpu::Options{n_threads, nullptr, dt, ko}, method, o,
               lse);
      CHECK(same_bits(o0.data(), o.data(), int64_t(o.size())));
      CHECK(same_bits(lse0.data(), lse.data(), int64_t(lse.size())));
    }
  }
}

}  // namespace

TEST_CASE("run: a sequence's bits alone, beside 1..40 others, under any segmentation, thread count and method") {
  sequence_sweep(false);
}

TEST_CASE("run: under a sliding window, a sequence's bits alone, beside others, under any segmentation and method") {
  sequence_sweep(true);
}

TEST_CASE("schedule: blocks of absolute positions, passes below a shared one starting on a block") {
  const HeadShape shape{4, 2, 64};
  cpu::Options opt{2};
  const int64_t C = cpu::kBlockKeys;
  // A prefix of 1.5 blocks shared by three sequences: the shared pass stops at one block, the rest goes below.
  const Tree tree = Tree::two_level(shape, C + C / 2, {10, 0, 3 * C});
  const Plan plan = cpu::plan(tree, opt);
  const Schedule& sc = plan.schedule();
  verify_schedule(tree, sc);
  CHECK(sc.block == C);
  for (const Schedule::Item& it : sc.items) {
    CHECK(it.t0 % C == 0);
    int64_t n = 0, at = it.t0;
    sc.item_states(it, [&](int64_t k, int64_t a, int64_t b) {
      CHECK(k == n++);
      CHECK(a == at);  // states tile the item in order, each of whole blocks
      CHECK((a - it.t0) % C == 0);
      CHECK(b > a);
      at = b;
    });
    CHECK(at == it.t1);
    CHECK(n == it.n_states);
  }
  int n_below = 0;
  for (const Schedule::Pass& ps : sc.passes) {
    const Schedule::PassSegment& first = sc.segs[size_t(ps.seg_begin)];
    if (first.seg == 0 && first.from == 0) {  // the shared pass: its rows stop at the block
      for (int64_t r = ps.row_begin; r < ps.row_begin + ps.n_token_rows; ++r) CHECK(sc.rows[size_t(r)].limit == C);
      continue;
    }
    ++n_below;  // a pass below starts with the prefix's last half block
    CHECK(first.seg == 0);
    CHECK(first.from == C);
    CHECK(first.n_tokens == C / 2);
  }
  CHECK(n_below == 3);
  cpu::KernelOptions fast = cpu::KernelOptions::process();
  fast.batch_invariant = false;
  const Plan plain = cpu::plan(tree, cpu::Options{2, nullptr, DType::f16, fast});
  CHECK(plain.schedule().block == 0);
  verify_schedule(tree, plain.schedule());
}

TEST_CASE("schedule: under a sliding window, blocks of absolute positions, each row's first key moved with its keys") {
  const HeadShape shape{4, 2, 64};
  const int64_t C = cpu::kBlockKeys;
  // The prefix of 1.5 blocks shared by three sequences (own keys 10, 0 and 3 blocks), each row seeing its last 100
  // keys: the first two rows' windows start in the prefix's last half block (moved below), the third's far below it.
  const Tree tree = Tree::two_level(shape, C + C / 2, {10, 0, 3 * C}, 1, 0.0f, 100);
  const Plan plan = cpu::plan(tree, cpu::Options{2});
  const Schedule& sc = plan.schedule();
  verify_schedule(tree, sc);
  REQUIRE(sc.block == C);
  // Absolute window starts 294, 284 and 1052; the passes below start at 256.
  const int64_t want_first[] = {294 - C, 284 - C, 1052 - C};
  for (int p = 0; p < int(sc.passes.size()); ++p) {
    const Schedule::Pass& ps = sc.passes[size_t(p)];
    const Schedule::PassSegment& first = sc.segs[size_t(ps.seg_begin)];
    if (first.seg == 0 && first.from == 0) {  // the shared pass: behind every window, no work
      for (const Schedule::Item& it : sc.items) CHECK(it.pass != p);
      continue;
    }
    CHECK(ps.origin == C);
    REQUIRE(ps.n_token_rows == 1);
    const Schedule::Row& row = sc.rows[size_t(ps.row_begin)];
    CHECK(row.first == want_first[row.q_row]);
    CHECK(row.limit == ps.n_tokens);
  }
  // Each row's only item starts on the key step of its first key, inside its block.
  REQUIRE(sc.items.size() == 3);
  for (const Schedule::Item& it : sc.items) {
    const Schedule::Row& row = sc.rows[size_t(sc.passes[size_t(it.pass)].row_begin)];
    CHECK(it.t0 == row.first / cpu::kTileStep * cpu::kTileStep);
    CHECK(it.t1 == row.limit);
  }
}

TEST_CASE("schedule: random trees under a sliding window keep blocks, a tile's first item starts on a key step") {
  const uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  Rng rng(seed);
  const int64_t C = cpu::kBlockKeys;
  for (int it = 0; it < test::sweep(300); ++it) {
    CAPTURE(it);
    HeadShape shape;
    shape.n_kv_heads = int(rng.uniform_int(1, 4));
    shape.n_q_heads = shape.n_kv_heads * rng.pick<int>({1, 2, 4});
    shape.head_dim = 64;
    const test::Tree t = test::random_tree(rng, int(rng.uniform_int(1, 4)), int(rng.uniform_int(1, 40)));
    std::vector<int64_t> len(t.parent.size());
    for (int64_t& n : len) n = rng.coin(0.1) ? 0 : rng.coin(0.3) ? C * rng.uniform_int(0, 3) : rng.uniform_int(0, 900);
    std::vector<int64_t> n_query(t.paths.size());
    for (int64_t& n : n_query) n = rng.pick<int64_t>({0, 1, 1, 3, 40});
    const int64_t window = rng.pick<int64_t>({1, 7, 8, C - 1, C, C + 1, 500, 512, 3000});
    CAPTURE(window);
    const Tree tree = Tree::build(shape, len, t.paths, n_query, 0.0f, window);
    cpu::Options opt{int(rng.uniform_int(1, 8))};
    CostModel model;
    if (rng.coin(0.3)) opt.cost_model = &model;  // auto's regrouping
    const Plan plan = cpu::plan(tree, opt);
    const Schedule& sc = plan.schedule();
    REQUIRE(sc.block == C);
    CHECK_NOTHROW(verify_schedule(plan.attended(), sc));
    const int group = shape.group();
    for (size_t i = 0; i < sc.items.size(); ++i) {
      const Schedule::Item& item = sc.items[i];
      const Schedule::Pass& ps = sc.passes[size_t(item.pass)];
      CHECK(ps.origin % C == 0);
      CHECK(item.t0 % cpu::kTileStep == 0);
      // Keys of the item's first block before its first key: seen by none of its rows, and the item is its tile's
      // first.
      int64_t lo = ps.n_tokens;
      for (int64_t e = item.e0; e < item.e1; ++e) {
        const Schedule::Row& row = sc.rows[size_t(ps.row_begin + e / group)];
        if (row.first < row.limit) lo = std::min(lo, row.first);
      }
      if (item.t0 % C != 0) {
        CHECK(lo >= item.t0);
        CHECK(lo < item.t0 + cpu::kTileStep);
        CHECK((i == 0 || sc.items[i - 1].pass != item.pass || sc.items[i - 1].e0 != item.e0 ||
               sc.items[i - 1].kvh != item.kvh));
      }
    }
  }
}

}  // namespace test_attention_invariance
