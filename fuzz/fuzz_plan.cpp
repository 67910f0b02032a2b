// Bytes -> a head shape, segment lengths and sequences with their paths and query counts (plan_input.hpp) ->
// cascade::Tree::build -> the plans of the CPU's and the CUDA path's targets. A tree that validates is checked
// for its own invariants and every schedule made from it for exact coverage (verify_schedule: each output
// merges each key it sees exactly once), whatever the lengths. Then, when the problem is small enough, K/V
// segments (contiguous or paged, padded strides, f32/f16/bf16) are made and the CPU plan is run, on a kernel
// path the input picks (a tier the CPU runs, bf16 products or not):
//   small problems (kRefWork) are compared, every output, with reference_attention (double precision);
//   larger ones (kMaxWork) with the same problem attended in another layout (layouts.hpp), split (every sequence
//   alone over a copy of its keys) or unified (one masked buffer), chosen by the input: attention computed
//   without any merge of partial softmaxes, through other plans and kernels, at the cost of two f32 runs
//   instead of a double one.
// cascade::Error is a fine answer to a bad plan; a crash, UB, another exception or a wrong number is not.
#include <cascade/cascade.hpp>
#include <cascade/cuda/schedule.hpp>
#include <cascade/layouts.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <vector>

#include "plan_input.hpp"
#include "one_thread.hpp"

namespace {

using namespace cascade;

// Budgets per input: outputs (rows x query heads) planned; K/V elements allocated (K's, V's as many), and
// multiply-adds of the attention (query rows x keys seen x query heads x head dim) checked against the double
// reference, or against another layout. The reference costs ~10x an f32 run: with these a campaign runs about
// 1,200 inputs a second on one core (corpus of ~7,600 inputs), a million in 7 minutes on two.
constexpr int64_t kMaxOutputs = int64_t(1) << 16;
constexpr int64_t kMaxKvElements = int64_t(1) << 16;
constexpr double kRefWork = 2e4;
constexpr double kMaxWork = 2e5;

[[noreturn]] void fail(const char* what, double got, double want, int64_t row, int head, int64_t i) {
  std::fprintf(stderr, "fuzz_plan: %s: got %.9g, expected %.9g (row %lld, head %d, element %lld)\n", what, got, want,
               static_cast<long long>(row), head, static_cast<long long>(i));
  std::abort();
}

[[noreturn]] void fail_invariant(const char* what) {
  std::fprintf(stderr, "fuzz_plan: plan invariant broken: %s\n", what);
  std::abort();
}

struct Rng {
  uint64_t s;
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(int64_t(next() >> 40) - (int64_t(1) << 23)) / float(int64_t(1) << 23); }  // [-1, 1)
};

// One segment's memory: K and V (elements of the plan's dtype) and the block table of a paged view.
struct Storage {
  std::vector<float> k32, v32;
  std::vector<f16> k16, v16;
  std::vector<bf16> kb, vb;
  std::vector<int32_t> table;
};

// Not instrumented for coverage (clang's attribute; other compilers build the replay, fuzz/replay.cmake): its loops
// say nothing about the input, and traced they cost more than the run.
#if defined(__clang__)
#define CASCADE_NO_COVERAGE __attribute__((no_sanitize("coverage")))
#else
#define CASCADE_NO_COVERAGE
#endif
CASCADE_NO_COVERAGE void fill(Storage& st, DType dtype, int64_t n, Rng& rng) {
  const auto gen = [&](auto& k, auto& v, auto conv) {
    k.resize(size_t(n));
    v.resize(size_t(n));
    for (auto& e : k) e = conv(rng.uniform());
    for (auto& e : v) e = conv(rng.uniform());
  };
  switch (dtype) {
    case DType::f32: gen(st.k32, st.v32, [](float x) { return x; }); break;
    case DType::f16: gen(st.k16, st.v16, [](float x) { return f16(x); }); break;
    case DType::bf16: gen(st.kb, st.vb, [](float x) { return bf16(x); }); break;
  }
}

void set_data(KvView& kv, Storage& st, DType dtype) {
  switch (dtype) {
    case DType::f32: kv.k = st.k32.data(); kv.v = st.v32.data(); break;
    case DType::f16: kv.k = st.k16.data(); kv.v = st.v16.data(); break;
    case DType::bf16: kv.k = st.kb.data(); kv.v = st.vb.data(); break;
  }
}

void verify_or_abort(const Plan& plan) {
  try {
    verify_schedule(plan.attended(), plan.schedule());
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_plan: %s schedule broken: %s\n", plan.target().backend, e.what());
    std::abort();
  }
}

void check_invariants(const Tree& plan, const std::vector<int64_t>& n_query) {
  int64_t rows = 0;
  for (int s = 0; s < plan.n_sequences(); ++s) {
    const Tree::Sequence& sq = plan.sequence(s);
    if (sq.row_begin != rows || sq.n_query != n_query[size_t(s)]) fail_invariant("row layout");
    rows += sq.n_query;
    int64_t keys = 0;
    int parent = Tree::kRoot;
    if (sq.seg_row_begin.size() != sq.path.size()) fail_invariant("seg_row_begin size");
    for (size_t k = 0; k < sq.path.size(); ++k) {
      const int g = sq.path[k];
      if (g < 0 || g >= plan.n_segments()) fail_invariant("segment id in path");
      if (plan.parent(g) != parent) fail_invariant("parent of a path segment");
      const int64_t b = sq.seg_row_begin[k];
      if (b < 0 || b + sq.n_query > int64_t(plan.segment_rows(g).size())) fail_invariant("seg_row_begin range");
      for (int64_t i = 0; i < sq.n_query; ++i)
        if (plan.segment_rows(g)[size_t(b + i)].row != sq.row_begin + i) fail_invariant("segment row mapping");
      keys += plan.n_tokens(g);
      parent = g;
    }
    if (keys != sq.n_keys) fail_invariant("n_keys");
  }
  if (rows != plan.n_rows()) fail_invariant("n_rows");
  for (int g = 0; g < plan.n_segments(); ++g)
    for (const Tree::SegmentRow& r : plan.segment_rows(g))
      if (r.row < 0 || r.row >= plan.n_rows() || r.limit < 0 || r.limit > plan.n_tokens(g) || r.first < 0 ||
          r.first > r.limit || (plan.window() > 0 && r.limit - r.first > plan.window()))
        fail_invariant("segment row limit");
}

}  // namespace

// run's work items keep per-thread scratch (kernel tiles, gathered queries, row limits) in a static
// enumerable_thread_specific, whose elements live in memory oneTBB takes from its own allocator (libtbbmalloc),
// which LeakSanitizer does not scan: libFuzzer's per-input leak check would report the scratch's buffers as lost.
// Only allocations made inside that item loop are exempt; they are freed at exit, where the test suite's
// LeakSanitizer run (scripts/sanitize.sh) still checks them.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:cascade::cpu::detail::run_items\n";
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_on_one_thread();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::PlanSpec spec = fuzz::decode_plan(data, size);
  const HeadShape shape{spec.n_q_heads, spec.n_kv_heads, spec.head_dim_value()};
  const DType dtype = spec.dtype == 1 ? DType::f16 : spec.dtype == 2 ? DType::bf16 : DType::f32;
  float scale = 0.0f;
  if (spec.scale == 254) {
    scale = std::numeric_limits<float>::quiet_NaN();
  } else if (spec.scale == 255) {
    scale = std::numeric_limits<float>::infinity();
  } else if (spec.scale != 0) {
    scale = float(int(spec.scale) - 128) / 16.0f;
  }

  std::vector<int64_t> n_tokens;
  for (const fuzz::SegmentSpec& s : spec.segments) n_tokens.push_back(int64_t(s.n_tokens));  // > INT64_MAX: negative
  std::vector<std::vector<int>> paths;
  std::vector<int64_t> n_query;
  for (const fuzz::SequenceSpec& s : spec.sequences) {
    paths.emplace_back(s.path.begin(), s.path.end());
    n_query.push_back(s.n_query);
  }
  // A sliding window on a quarter of the inputs, from the value seed (the input format stays as it was).
  const int64_t window = (spec.value_seed & 3) == 0 ? int64_t((spec.value_seed >> 2) % 300) : 0;
  std::optional<Tree> tree;
  try {
    tree.emplace(Tree::build(shape, n_tokens, paths, n_query, scale, window));
  } catch (const Error&) {
    return 0;
  }
  check_invariants(*tree, n_query);

  // The schedules of both backends, whatever the lengths: planning looks at lengths only (its cost grows with
  // the outputs, rows x heads, which stay bounded here).
  if (tree->n_rows() * shape.n_q_heads > kMaxOutputs) return 0;
  // The CPU kernel path, from the input's value seed: a tier up to the CPU's widest, bf16 products or not.
  Rng path_rng{~spec.value_seed};
  const Isa isa = Isa(path_rng.next() % (uint64_t(detected_isa()) + 1));
  const IsaLimit isa_limit(isa);
  const cpu::Bf16Products products(path_rng.next() & 1);
  const Plan plan = cpu::plan(*tree, cpu::Options{spec.threads + 1});
  verify_or_abort(plan);
  try {
    const Plan device_plan = cuda::plan(*tree, cuda::ScheduleOptions{1 + 37 * spec.threads, 4});
    verify_or_abort(device_plan);
    (void)cuda::lower(device_plan);  // refuses lengths past 32 bits with an Error
  } catch (const Error&) {
  }

  const bool runnable = !spec.huge && shape.n_kv_heads > 0 && shape.head_dim > 0;
  const int64_t d = shape.head_dim;
  double work = 0;
  for (int s = 0; s < tree->n_sequences(); ++s)
    work += double(tree->sequence(s).n_query) * double(tree->sequence(s).n_keys + 1) * shape.n_q_heads * double(d);
  if (!runnable || work > kMaxWork) return 0;

  Rng rng{spec.value_seed};
  int64_t kv_elements = 0;
  std::vector<Storage> store(spec.segments.size());
  std::vector<KvView> views;
  for (size_t g = 0; g < spec.segments.size(); ++g) {
    const fuzz::SegmentSpec& s = spec.segments[g];
    KvView kv;
    kv.dtype = dtype;
    kv.n_tokens = int64_t(s.n_tokens);
    kv.n_kv_heads = shape.n_kv_heads;
    kv.head_dim = shape.head_dim;
    kv.stride_head = shape.head_dim + (s.pad & 15);
    kv.stride_token = int64_t(shape.n_kv_heads) * kv.stride_head + (s.pad >> 4);
    int64_t n = 0;
    if (kv.n_tokens > 0 && s.page_size > 0) {
      const int64_t n_pages = (kv.n_tokens + s.page_size - 1) / s.page_size;
      const int64_t phys = n_pages + 1;  // one spare page, and the table walks them backwards
      kv.page_size = s.page_size;
      kv.stride_page = kv.page_size * kv.stride_token;
      store[g].table.resize(size_t(n_pages));
      for (int64_t p = 0; p < n_pages; ++p) store[g].table[size_t(p)] = int32_t(phys - 1 - p);
      kv.block_table = store[g].table.data();
      n = phys * kv.stride_page;
    } else if (kv.n_tokens > 0) {
      n = kv.n_tokens * kv.stride_token;
    }
    kv_elements += n;
    if (kv_elements > kMaxKvElements) return 0;
    if (n > 0) {
      fill(store[g], dtype, n, rng);
      set_data(kv, store[g], dtype);
    }
    views.push_back(kv);
  }

  const int64_t n_rows = tree->n_rows();
  std::vector<float> q(size_t(n_rows * shape.n_q_heads * d)), o(q.size(), std::nanf("")),
      lse(size_t(n_rows * shape.n_q_heads), std::nanf(""));
  for (float& x : q) x = rng.uniform();
  // bf16 products round q to bf16 (it gets bf16 queries, as from a bf16 model) and each softmax weight within
  // 2^-8 (|v| <= 1: o within 2^-8 per run; lse stays f32).
  const KernelChoices& chosen = plan.target().kernel_choices;
  const bool rounds = dtype == DType::bf16 && (chosen(cpu::kTiledKernel, dtype).products != Products::f32 ||
                                               chosen(cpu::kFewRowsKernel, dtype).products != Products::f32);
  if (rounds)
    for (float& x : q) x = float(bf16(x));
  cpu::run(plan, views, q.data(), o.data(), lse.data());

  // f32 scores carry an absolute error that grows with their size: |q| <= 1, |k| <= 1, so |score| <= |scale| d.
  const double score_bound = std::fabs(double(tree->scale())) * double(d);
  const double tol = 2e-4 + 4e-6 * score_bound;
  std::vector<double> want_o(o.size()), want_lse(lse.size());
  double want_tol = tol, o_tol = tol + (rounds ? 0x1p-8 : 0.0);
  if (work <= kRefWork) {
    reference_attention(*tree, views, q.data(), want_o.data(), want_lse.data());
  } else {
    // Another layout's f32 run: its error adds to the plan's.
    want_tol = 2 * tol;
    o_tol = 2 * o_tol;
    std::vector<float> o2(o.size(), std::nanf("")), lse2(lse.size(), std::nanf(""));
    cpu::Options opt;
    opt.n_threads = int(spec.value_seed >> 8 & 3);
    // Split copies every sequence's keys; unified scores every row against every key (masked). Each only
    // while that stays within a few times the budgets; the input picks one, the other when it does not fit.
    double split_elements = 0, all_keys = 0;
    for (int s = 0; s < tree->n_sequences(); ++s)
      split_elements += double(tree->sequence(s).n_keys) * double(shape.n_kv_heads) * double(d);
    for (int g = 0; g < tree->n_segments(); ++g) all_keys += double(tree->n_tokens(g));
    const bool split_fits = split_elements <= 4.0 * double(kMaxKvElements);
    const bool unified_fits = double(n_rows) * (all_keys + 1) * shape.n_q_heads * double(d) <= 4.0 * kMaxWork;
    if (!split_fits && !unified_fits) return 0;
    if (split_fits && ((spec.value_seed & 1) || !unified_fits)) {
      const SplitLayout split = make_split(*tree, views);
      cpu::run(cpu::plan(split.tree, opt), split.views, q.data(), o2.data(), lse2.data());
    } else {
      const UnifiedLayout u = make_unified(*tree, views);
      cpu::run_unified(cpu::plan_unified(shape, u.batch.kv.n_tokens, u.batch.n_rows, opt, u.scale), u.batch,
                       q.data(), o2.data(), lse2.data());
    }
    want_o.assign(o2.begin(), o2.end());
    want_lse.assign(lse2.begin(), lse2.end());
  }

  for (int64_t r = 0; r < n_rows; ++r) {
    for (int h = 0; h < shape.n_q_heads; ++h) {
      const size_t l = size_t(r * shape.n_q_heads + h);
      const double want = want_lse[l], got = lse[l];
      if (std::isinf(want)) {
        if (!(std::isinf(got) && got < 0)) fail("lse of a row that sees nothing", got, want, r, h, -1);
      } else if (!(std::fabs(got - want) <= want_tol + 1e-6 * std::fabs(want))) {
        fail("lse", got, want, r, h, -1);
      }
      for (int64_t i = 0; i < d; ++i) {
        const size_t k = l * size_t(d) + size_t(i);
        if (!(std::fabs(double(o[k]) - want_o[k]) <= o_tol + 1e-3 * std::fabs(want_o[k])))
          fail("o", o[k], want_o[k], r, h, i);
      }
    }
  }
  return 0;
}
