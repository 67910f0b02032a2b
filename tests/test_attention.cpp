// cascade == split == unified == reference on fresh random problems, the edge cases, and bad input, on every
// CPU kernel path this machine runs (kernel_paths.hpp).
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <optional>

#include "attention_problem.hpp"
#include "cascade/cascade.hpp"
#include "kernel_paths.hpp"

namespace test_attention {

using namespace cascade;
using test::Rng;

namespace {

// Tolerance, one for every K/V type. The reference reads the very same stored K/V values (f16 and bf16
// converted exactly to double) and the kernels convert them to f32 exactly too, so the storage type's
// rounding is not part of the error: what remains is the kernels' f32 arithmetic (scores, exp, and sums over
// up to ~7000 keys), a few 1e-6 relative, whatever the type. The bound sits ~20x above the largest error
// seen over many seeds and far below any real bug (a wrong mask or a dropped tile moves outputs by 1e-2 or
// more). A kernel that rounds q or the probabilities to the K/V type (as the CUDA path does) needs a bound
// per type derived from that rounding: see test_cuda_attention.cu, and the bf16-product path below
// (kernel_paths.hpp).
constexpr double kAtol = 5e-6, kRtol = 5e-5;

struct Config {
  HeadShape shape;
  DType dtype = DType::f32;
  bool paged = false;
  test::Tree tree;
  std::vector<int64_t> seg_len;
  std::vector<int64_t> n_query;
  float amp = 1.0f;  // |q|, |k| bound: scores reach amp^2 * sqrt(head_dim)
  int n_threads = 0;
  int64_t window = 0;                   // sliding window (0: none)
  const CostModel* model = nullptr;     // also run auto's plan under this model
  std::string describe() const {
    std::ostringstream os;
    os << "heads " << shape.n_q_heads << "/" << shape.n_kv_heads << "/" << shape.head_dim << " " << dtype_name(dtype)
       << (paged ? " paged" : " contiguous") << ", " << tree.paths.size() << " sequences, " << seg_len.size()
       << " segments [";
    for (size_t g = 0; g < seg_len.size(); ++g) os << (g ? "," : "") << seg_len[g];
    os << "], queries [";
    for (size_t s = 0; s < n_query.size(); ++s) os << (s ? "," : "") << n_query[s];
    os << "], threads " << n_threads << ", window " << window;
    return os.str();
  }
};

// Runs the three methods and the reference on cfg, on every kernel path, and compares every output element
// and lse.
void check(Rng& rng, const Config& cfg) {
  INFO(cfg.describe());
  std::vector<std::unique_ptr<test::Segment>> store;
  std::vector<KvView> views;
  bool bf16_exact = true;  // q8_0: every segment's elements exact in bf16
  for (int64_t len : cfg.seg_len) {
    store.push_back(test::make_segment(rng, cfg.dtype, len, cfg.shape.n_kv_heads, cfg.shape.head_dim, cfg.paged,
                                       cfg.amp));
    views.push_back(store.back()->view);
    bf16_exact = bf16_exact && store.back()->bf16_exact;
  }
  const Tree tree = Tree::build(cfg.shape, cfg.seg_len, cfg.tree.paths, cfg.n_query, 0.0f, cfg.window);
  const int64_t n_out = tree.n_rows() * cfg.shape.n_q_heads * cfg.shape.head_dim;
  const int64_t n_lse = tree.n_rows() * cfg.shape.n_q_heads;
  std::vector<float> q(static_cast<size_t>(n_out));
  for (float& x : q) x = rng.uniform(-cfg.amp, cfg.amp);
  std::vector<double> ref_o(static_cast<size_t>(n_out)), ref_lse(static_cast<size_t>(n_lse));
  reference_attention(tree, views, q.data(), ref_o.data(), ref_lse.data());
  // bf16 products round q, int8 products quantize it: those paths get queries on their grid, and a reference of
  // their own.
  std::vector<float> q_bf16 = q, q_q8 = q;
  test::round_to_bf16(q_bf16);
  if (cfg.shape.head_dim % kQ8Block == 0) test::round_to_q8_0(q_q8);
  std::vector<double> ref_o_bf16, ref_lse_bf16, ref_o_q8, ref_lse_q8;
  const cpu::Options opt{cfg.n_threads};
  const SplitLayout split = make_split(tree, views);
  const UnifiedLayout uni = make_unified(tree, views);

  for (const test::KernelPath& path : test::kernel_paths()) {
    INFO("kernel path " << path.name());
    const test::UsePath use(path);
    // q8_0 on a bf16-product path: its shared passes convert tiles to bf16, exactly only where the scales are powers
    // of two (the other problems are checked on the other paths).
    if (path.rounds_bf16() && cfg.dtype == DType::q8_0 && !bf16_exact) continue;
    const bool rounds = path.rounds_bf16() && (cfg.dtype == DType::bf16 || cfg.dtype == DType::q8_0);
    const bool quantizes = path.rounds_int8(cfg.shape.head_dim) && cfg.dtype == DType::q8_0;
    if (rounds && ref_o_bf16.empty()) {
      ref_o_bf16.resize(ref_o.size());
      ref_lse_bf16.resize(ref_lse.size());
      reference_attention(tree, views, q_bf16.data(), ref_o_bf16.data(), ref_lse_bf16.data());
    }
    if (quantizes && ref_o_q8.empty()) {
      ref_o_q8.resize(ref_o.size());
      ref_lse_q8.resize(ref_lse.size());
      reference_attention(tree, views, q_q8.data(), ref_o_q8.data(), ref_lse_q8.data());
    }
    const float* qp = rounds ? q_bf16.data() : quantizes ? q_q8.data() : q.data();
    const std::vector<double>& want_o = rounds ? ref_o_bf16 : quantizes ? ref_o_q8 : ref_o;
    const std::vector<double>& want_lse = rounds ? ref_lse_bf16 : quantizes ? ref_lse_q8 : ref_lse;
    const double atol_o =
        kAtol + (rounds ? test::kBf16WeightError : quantizes ? test::kInt8WeightError : 0.0);  // |v| <= 1

    // The plan runs twice, as it would in two layers: it keeps nothing of a run.
    const Plan plan = cpu::plan(tree, opt);
    if (cfg.window > 0) CHECK_NOTHROW(verify_schedule(plan.attended(), plan.schedule()));
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> o(static_cast<size_t>(n_out), 123.0f), lse(static_cast<size_t>(n_lse), 123.0f);
      cpu::run(plan, views, qp, o.data(), lse.data());
      test::expect_close(o, want_o, atol_o, kRtol, "cascade o");
      test::expect_close(lse, want_lse, kAtol, kRtol, "cascade lse");
    }
    std::vector<float> o(static_cast<size_t>(n_out), 123.0f), lse(static_cast<size_t>(n_lse), 123.0f);
    cpu::run(cpu::plan(split.tree, opt), split.views, qp, o.data(), lse.data());
    test::expect_close(o, want_o, atol_o, kRtol, "split o");
    test::expect_close(lse, want_lse, kAtol, kRtol, "split lse");

    std::fill(o.begin(), o.end(), 123.0f);
    std::fill(lse.begin(), lse.end(), 123.0f);
    cpu::attend_unified(cfg.shape, uni.batch, qp, o.data(), lse.data(), opt, tree.scale());
    test::expect_close(o, want_o, atol_o, kRtol, "unified o");
    test::expect_close(lse, want_lse, kAtol, kRtol, "unified lse");

    if (!cfg.model) continue;
    cpu::Options auto_opt = opt;
    auto_opt.cost_model = cfg.model;
    auto_opt.kv_dtype = cfg.dtype;
    const Plan chosen = cpu::plan(tree, auto_opt);
    CHECK_NOTHROW(verify_schedule(chosen.attended(), chosen.schedule()));
    std::fill(o.begin(), o.end(), 123.0f);
    std::fill(lse.begin(), lse.end(), 123.0f);
    cpu::run(chosen, views, qp, o.data(), lse.data());
    test::expect_close(o, want_o, atol_o, kRtol, "auto o");
    test::expect_close(lse, want_lse, kAtol, kRtol, "auto lse");
  }
}

HeadShape random_shape(Rng& rng) {
  static const std::vector<int> dims = {32, 48, 64, 72, 80, 96, 112, 128, 160, 256};
  static const std::vector<int> ratios = {1, 2, 3, 4, 8};
  HeadShape s;
  s.head_dim = rng.pick(dims);
  if (rng.coin(0.15)) {  // MQA: one KV head for all query heads
    s.n_kv_heads = 1;
    s.n_q_heads = int(rng.uniform_int(1, 8));
  } else {
    s.n_kv_heads = int(rng.uniform_int(1, 3));
    s.n_q_heads = s.n_kv_heads * rng.pick(ratios);
  }
  return s;
}

// Random lengths with the reference's cost kept near budget (multiply-adds).
Config random_config(Rng& rng, double budget) {
  Config c;
  c.shape = random_shape(rng);
  c.dtype = test::random_dtype(rng, c.shape.head_dim);
  c.paged = rng.coin();
  const int depth = int(rng.uniform_int(1, 4));
  c.tree = test::random_tree(rng, depth, int(rng.uniform_int(1, 64)));
  c.seg_len.resize(c.tree.parent.size());
  for (size_t g = 0; g < c.seg_len.size(); ++g) {
    const bool root = c.tree.parent[g] < 0;
    // roots are "prefixes" (0-5000), the rest "suffixes" (0-2000); some empty anywhere
    c.seg_len[g] = rng.coin(0.1) ? 0 : rng.uniform_int(0, root ? 5000 : 2000);
  }
  const bool multi = rng.coin(0.3);
  c.n_query.resize(c.tree.paths.size());
  for (auto& n : c.n_query) n = multi ? rng.uniform_int(1, 5) : 1;
  c.n_threads = int(rng.uniform_int(0, 3));
  test::shrink_to_budget(c.seg_len, c.tree.paths, c.n_query, c.shape, budget);
  return c;
}

}  // namespace

TEST_CASE("cascade == split == unified == reference on random problems") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < test::sweep(60); ++it) {
    CAPTURE(it);
    check(rng, random_config(rng, 2e7));
  }
}

// Log-uniform random rates: auto's decisions of every kind across seeds.
CostModel random_cost_model(Rng& rng) {
  auto lu = [&](double lo, double hi) { return lo * std::pow(hi / lo, double(rng.uniform(0, 1))); };
  CostModel c;
  c.read_bw = lu(1e9, 1e11);
  c.small_bw = lu(1e9, 1e11);
  c.small_mac = lu(1e9, 1e11);
  c.tiled_bw = lu(1e9, 1e11);
  c.tiled_mac = lu(1e9, 1e12);
  c.item_s = lu(1e-8, 1e-3);
  return c;
}

TEST_CASE("sliding window: segments outside every window skipped, partly inside masked, at the window's edges") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < test::sweep(50); ++it) {
    CAPTURE(it);
    Config c = random_config(rng, 1e7);
    if (rng.coin(0.5))
      for (auto& n : c.n_query) n = rng.uniform_int(1, 9);  // prefill rows: each row's window starts elsewhere
    // Windows at the edges of what the rows see: 1, around the first root's length and a whole path's, and beyond.
    int64_t longest = 0;
    for (const auto& path : c.tree.paths) {
      int64_t n = 0;
      for (int g : path) n += c.seg_len[size_t(g)];
      longest = std::max(longest, n);
    }
    const int64_t root = c.seg_len[0];
    const std::vector<int64_t> edges = {1, 2, root - 1, root, root + 1, longest - 1, longest, longest + 3,
                                        rng.uniform_int(1, std::max<int64_t>(1, longest))};
    c.window = std::max<int64_t>(1, rng.pick(edges));
    const CostModel model = random_cost_model(rng);
    c.model = &model;
    check(rng, c);
  }
}

TEST_CASE("sliding window: a shared prefix behind every window is attended by nobody, the rest is exact") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  const HeadShape shape{8, 2, 64};
  // The prefix (300 tokens) lies wholly behind the last 20 keys of every sequence (own segments of 40+ tokens).
  const Tree tree = Tree::two_level(shape, 300, {40, 55, 70, 41}, 3, 0.0f, 20);
  const Plan plan = cpu::plan(tree);
  // No item reads a key of the prefix (with batch-invariant blocks its last 44 keys go with each sequence's pass,
  // where they lie before every row's window: its items start past them).
  const Schedule& sc = plan.schedule();
  for (const Schedule::Item& it : sc.items) {
    const Schedule::Pass& ps = sc.passes[size_t(it.pass)];
    for (int64_t k = ps.seg_begin; k < ps.seg_end; ++k) {
      const Schedule::PassSegment& g = sc.segs[size_t(k)];
      if (g.start < it.t1 && it.t0 < g.start + g.n_tokens) CHECK(g.seg != 0);
    }
  }
  Config c;
  c.shape = shape;
  c.dtype = DType::f16;
  c.tree.parent = {-1, 0, 0, 0, 0};
  c.tree.paths = {{0, 1}, {0, 2}, {0, 3}, {0, 4}};
  c.seg_len = {300, 40, 55, 70, 41};
  c.n_query = {3, 3, 3, 3};
  c.window = 20;
  check(rng, c);
}

TEST_CASE("large prefix and batch: prefix 5000, 64 sequences, suffix up to 2000") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  Config c;
  c.shape = {2, 1, 32};
  c.dtype = DType::f16;
  c.tree.parent.push_back(-1);
  c.seg_len.push_back(5000);
  for (int s = 0; s < 64; ++s) {
    c.tree.parent.push_back(0);
    c.tree.paths.push_back({0, s + 1});
    c.seg_len.push_back(s == 0 ? 2000 : rng.uniform_int(0, 300));
    c.n_query.push_back(1);
  }
  check(rng, c);
}

TEST_CASE("every head dim 32-256 that models use, every GQA ratio, both storages") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int d : {32, 64, 80, 96, 112, 128, 256}) {
    for (auto [nq, nkv] : std::vector<std::pair<int, int>>{{4, 4}, {4, 2}, {6, 2}, {8, 2}, {8, 1}, {5, 1}}) {
      Config c;
      c.shape = {nq, nkv, d};
      c.dtype = test::random_dtype(rng, c.shape.head_dim);
      c.paged = rng.coin();
      c.tree.parent = {-1, 0, 0, 0};
      c.tree.paths = {{0, 1}, {0, 2}, {0, 3}};
      c.seg_len = {rng.uniform_int(1, 400), rng.uniform_int(0, 100), rng.uniform_int(0, 100), rng.uniform_int(0, 100)};
      c.n_query = {1, rng.uniform_int(1, 4), 1};
      check(rng, c);
    }
  }
}

// One shared prefix of [p_min, p_max] tokens and n_seq sequences of n_query query tokens, each with up to
// own_max tokens of its own besides them; storage, threads and (unless given) dtype at random.
struct FanOut {
  HeadShape shape;
  int n_seq, n_query;
};
Config fan_out(Rng& rng, const FanOut& k, int64_t p_min, int64_t p_max, int64_t own_max,
               std::optional<DType> dtype = std::nullopt) {
  const int n_seq = k.n_seq, n_query = k.n_query;
  Config c;
  c.shape = k.shape;
  c.dtype = dtype ? *dtype : test::random_dtype(rng, c.shape.head_dim);
  c.paged = rng.coin();
  c.tree.parent.push_back(-1);
  c.seg_len.push_back(rng.uniform_int(p_min, p_max));
  for (int s = 0; s < n_seq; ++s) {
    c.tree.parent.push_back(0);
    c.tree.paths.push_back({0, s + 1});
    c.seg_len.push_back(rng.uniform_int(0, own_max) + n_query);
    c.n_query.push_back(n_query);
  }
  c.n_threads = int(rng.uniform_int(0, 2));
  return c;
}

TEST_CASE("shared passes of every size of last row block: blocks of two registers, of one, and a narrow last one") {
  // The AVX-512 path cuts a pass's stacked rows into blocks of 32 rows (two registers of 16), then what is left:
  // one such block when 25-31 rows are left, 16 rows in one register and the rest (up to 8) on 8 lanes when
  // 9-24 are, and 8 lanes alone for 1-8. 24 rows = 8 sequences x 3 query heads per KV head (SmolLM2 at -np 8).
  // Masks of their own rows included (queries of 2-5 tokens).
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (const FanOut& k : std::vector<FanOut>{{{9, 3, 64}, 8, 1},    // 24 rows per KV head: 16 + 8
                                         {{8, 2, 128}, 5, 1},   // 20: 16 + 4
                                         {{2, 2, 64}, 17, 1},   // 17: 16 + 1
                                         {{4, 1, 64}, 10, 1},   // 40: 32 + 8
                                         {{6, 2, 64}, 3, 2},    // 18, two tokens each
                                         {{3, 1, 96}, 2, 3},    // 18
                                         {{8, 2, 64}, 2, 5},    // 40; 20 causal rows per own segment
                                         {{4, 1, 64}, 7, 1},    // 28: one block of 32, 4 lanes empty
                                         {{2, 1, 128}, 31, 1},  // 62: 32 + 32 (2 empty)
                                         {{6, 2, 64}, 16, 1},   // 48: 32 + 16
                                         {{4, 1, 64}, 14, 1},   // 56: 32 + 16 + 8
                                         {{4, 2, 128}, 16, 1},  // 32: one block
                                         {{8, 1, 64}, 2, 4}}) { // 64 causal rows: 32 + 32
    check(rng, fan_out(rng, k, 100, 700, 80));
  }
}

TEST_CASE("bf16 shared passes: row blocks in pairs and alone, tiles cut by pages, masked own rows (AMX tiles)") {
  // The AMX kernel (cpu/kernel_amx.hpp) takes 16-row blocks two at a time, the last alone when their number is
  // odd, and 32 keys a step from tiles of up to 128 that pages may cut short; head dims multiples of 32 only
  // (others: vdpbf16ps). Every path runs (kernel_paths), AMX tiles where this process may use them.
  MESSAGE("AMX tiles " << (amx_usable() ? "run here" : "are not available here: the other paths run"));
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (const FanOut& k : std::vector<FanOut>{{{9, 3, 64}, 8, 1},     // 24 rows per KV head: one pair, ragged
                                         {{8, 2, 128}, 8, 1},    // 32: one pair
                                         {{4, 1, 32}, 12, 1},    // 48: a pair and one alone
                                         {{32, 8, 128}, 4, 2},   // 32 rows, two causal tokens each
                                         {{4, 2, 96}, 36, 1},    // 72: two pairs and one alone, ragged
                                         {{2, 1, 256}, 5, 3},    // 30
                                         {{8, 2, 80}, 8, 1}}) {  // 32 rows, a head dim that takes vdpbf16ps
    check(rng, fan_out(rng, k, 1, 600, 60, DType::bf16));
  }
}

TEST_CASE("edges: empty prefix, empty suffix, empty segments anywhere, batch 1, one key") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  const HeadShape shape{6, 2, 64};
  auto two_level = [&](int64_t prefix, std::vector<int64_t> suffix, int64_t n_query) {
    Config c;
    c.shape = shape;
    c.dtype = test::random_dtype(rng, c.shape.head_dim);
    c.paged = rng.coin();
    c.tree.parent.push_back(-1);
    c.seg_len.push_back(prefix);
    for (size_t s = 0; s < suffix.size(); ++s) {
      c.tree.parent.push_back(0);
      c.tree.paths.push_back({0, int(s) + 1});
      c.seg_len.push_back(suffix[s]);
      c.n_query.push_back(n_query);
    }
    return c;
  };
  SUBCASE("empty prefix") { check(rng, two_level(0, {5, 17, 300}, 1)); }
  SUBCASE("empty suffixes") { check(rng, two_level(700, {0, 0, 0, 0}, 1)); }
  SUBCASE("empty suffixes, several queries: rows before the first key see nothing") {
    check(rng, two_level(2, {0, 1, 0}, 4));
  }
  SUBCASE("batch 1") { check(rng, two_level(333, {44}, 1)); }
  SUBCASE("one key in all") { check(rng, two_level(1, {0}, 1)); }
  SUBCASE("one key per suffix, nothing shared") { check(rng, two_level(0, {1, 1, 1}, 1)); }
  SUBCASE("no keys at all: every row is fully masked") { check(rng, two_level(0, {0, 0}, 2)); }
  SUBCASE("empty segments in the middle and at the leaves of a depth-4 tree") {
    Config c;
    c.shape = shape;
    c.dtype = DType::f16;
    c.paged = true;
    c.tree.parent = {-1, 0, 1, 2, 2, 0};
    c.tree.paths = {{0, 1, 2, 3}, {0, 1, 2, 4}, {0, 5}};
    c.seg_len = {100, 0, 37, 0, 9, 0};
    c.n_query = {1, 3, 2};
    check(rng, c);
  }
}

TEST_CASE("chains of segments with the same rows run as one pass, items straddling the joins") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  Config c;
  c.shape = HeadShape{8, 2, 64};
  c.dtype = test::random_dtype(rng, c.shape.head_dim);
  c.paged = rng.coin();
  // 0 -> 1 -> 2 -> {3, 4}; 3 -> 5. Sequence 0 ends at 5, sequence 1 at 4: segments 0, 1, 2 have both
  // sequences' rows (one pass), 3 and 5 only sequence 0's (one pass), 4 alone.
  c.tree.parent = {-1, 0, 1, 2, 2, 3};
  c.tree.paths = {{0, 1, 2, 3, 5}, {0, 1, 2, 4}};
  // The last segments (4, 5) hold at least the 4 query tokens a sequence may have: queries reaching back into
  // the shared segments would make them a pass of different rows (a seed with segment 4 one token long did).
  c.seg_len = {rng.uniform_int(300, 900), rng.uniform_int(1, 40), 0, rng.uniform_int(200, 700),
               rng.uniform_int(4, 300), rng.uniform_int(4, 300)};
  c.n_query = {rng.uniform_int(1, 4), rng.uniform_int(1, 4)};
  c.n_threads = int(rng.uniform_int(2, 4));  // several chunks per pass, so some cross a join
  {
    std::vector<std::unique_ptr<test::Segment>> store;
    std::vector<KvView> views;
    for (int64_t len : c.seg_len) {
      store.push_back(test::make_segment(rng, c.dtype, len, 2, 64, c.paged, 1.0f));
      views.push_back(store.back()->view);
    }
    // Without batch-invariant blocks the passes are the chains; with them, each pass below the first starts with
    // the first's keys past its last multiple of the block (schedule.hpp), pieces of segments 0 and 1.
    const Tree tree = Tree::build(c.shape, c.seg_len, c.tree.paths, c.n_query);
    for (bool blocks : {false, true}) {
      CAPTURE(blocks);
      cpu::KernelOptions ko = cpu::KernelOptions::process();
      ko.batch_invariant = blocks;
      const Plan plan = cpu::plan(tree, cpu::Options{c.n_threads, nullptr, c.dtype, ko});
      const Schedule& sc = plan.schedule();
      REQUIRE(sc.passes.size() == 3);
      std::vector<std::vector<int>> segs;
      for (const Schedule::Pass& ps : sc.passes) {
        segs.emplace_back();
        for (int64_t k = ps.seg_begin; k < ps.seg_end; ++k) {
          const int g = sc.segs[size_t(k)].seg;
          if (!blocks || g >= 3 || ps.seg_begin == 0) segs.back().push_back(g);
        }
      }
      CHECK(segs == std::vector<std::vector<int>>{{0, 1, 2}, {3, 5}, {4}});
    }
  }
  check(rng, c);
  // Several queries at the end of a one-sequence chain: the causal limit applies in the last segment only.
  c.tree.parent = {-1, 0, 1};
  c.tree.paths = {{0, 1, 2}};
  c.seg_len = {rng.uniform_int(1, 600), rng.uniform_int(0, 600), rng.uniform_int(5, 600)};
  c.n_query = {5};
  check(rng, c);
}

TEST_CASE("next_rows: the first tile of a token range, within its page, for the heads the call reads") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int round = 0; round < 50; ++round) {
    const int n_kv = int(rng.uniform_int(1, 8)), d = int(rng.pick<int64_t>({32, 64, 128}));
    const int64_t n_tokens = rng.uniform_int(1, 300), page = rng.uniform_int(1, 100);
    const bool paged = rng.coin();
    const int kvh = int(rng.uniform_int(0, n_kv - 1)), heads = int(rng.uniform_int(1, n_kv - kvh));
    const int64_t t0 = rng.uniform_int(0, n_tokens - 1), t1 = rng.uniform_int(t0 + 1, n_tokens);
    INFO("kv heads " << n_kv << " dim " << d << " tokens " << n_tokens << (paged ? " paged by " : " contiguous ")
                     << page << ", heads " << kvh << "+" << heads << ", tokens " << t0 << ".." << t1);
    const int64_t n_pages = (n_tokens + page - 1) / page;
    std::vector<f16> k(size_t(n_pages * page * n_kv * d)), v(k.size());
    std::vector<int32_t> table(static_cast<size_t>(n_pages));
    for (int64_t i = 0; i < n_pages; ++i) table[size_t(i)] = int32_t(n_pages - 1 - i);  // pages in reverse
    const KvView kv = paged ? KvView::paged_view(k.data(), v.data(), table.data(), n_tokens, page, n_kv, d)
                            : KvView::contiguous(k.data(), v.data(), n_tokens, n_kv, d);
    const cpu::NextRows r = cpu::next_rows(kv, kvh, heads, t0, t1);
    // by hand: token t0's page, its row, its head kvh; rows to the end of the range, the page, or one tile
    const int64_t row = paged ? table[size_t(t0 / page)] * page + t0 % page : t0;
    CHECK(r.k == reinterpret_cast<const char*>(k.data() + (row * n_kv + kvh) * d));
    CHECK(r.v == reinterpret_cast<const char*>(v.data() + (row * n_kv + kvh) * d));
    const int64_t to_end = paged ? std::min(t1, (t0 / page + 1) * page) - t0 : t1 - t0;
    CHECK(r.n_rows == std::min<int64_t>(to_end, cpu::kNextRows));
    CHECK(r.stride == int64_t(n_kv) * d * 2);
    CHECK(r.bytes == int64_t(heads) * d * 2);
  }
  const KvView kv = KvView::contiguous<float>(nullptr, nullptr, 10, 2, 64);
  CHECK(cpu::next_rows(kv, 0, 2, 5, 5).k == nullptr);  // an empty range: nothing to ask for
}

TEST_CASE("attend called concurrently from parallel tasks: each call keeps its own workspace") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  const HeadShape shape{4, 2, 64};
  struct Job {
    std::vector<std::unique_ptr<test::Segment>> store;
    std::vector<KvView> views;
    Tree tree;
    std::vector<float> q, o;
  };
  std::vector<Job> jobs(48);
  for (Job& j : jobs) {
    const int n_seq = int(rng.uniform_int(1, 6));
    std::vector<int64_t> len = {rng.uniform_int(1, 1500)};
    for (int s = 0; s < n_seq; ++s) len.push_back(rng.uniform_int(0, 300));
    for (int64_t n : len) {
      j.store.push_back(test::make_segment(rng, DType::f16, n, shape.n_kv_heads, shape.head_dim, false, 1.0f));
      j.views.push_back(j.store.back()->view);
    }
    std::vector<std::vector<int>> paths;
    for (int s = 0; s < n_seq; ++s) paths.push_back({0, s + 1});
    j.tree = Tree::build(shape, len, paths, std::vector<int64_t>(size_t(n_seq), 1));
    j.q.resize(size_t(j.tree.n_rows() * shape.n_q_heads * shape.head_dim));
    for (float& x : j.q) x = rng.uniform(-1.0f, 1.0f);
    j.o.assign(j.q.size(), 123.0f);
  }
  // Outer tasks each run a whole attend, on 8 threads at once (more than this machine's cores).
  tbb::task_arena arena(8);
  arena.execute([&] {
    tbb::parallel_for(size_t(0), jobs.size(), [&](size_t i) {
      cpu::run(cpu::plan(jobs[i].tree), jobs[i].views, jobs[i].q.data(), jobs[i].o.data());
    });
  });
  for (Job& j : jobs) {
    std::vector<double> ref(j.o.size()), ref_lse(size_t(j.tree.n_rows() * shape.n_q_heads));
    reference_attention(j.tree, j.views, j.q.data(), ref.data(), ref_lse.data());
    test::expect_close(j.o, ref, 5e-6, 5e-5, "nested attend o");
  }
}

TEST_CASE("workspace: a thread's kept buffer is reused, a call made while it is in use gets its own") {
  const float* kept = nullptr;
  {
    cpu::Workspace a(1000);
    kept = a.data();
    cpu::Workspace b(10);  // as an attend started while `a`'s call is still running would
    CHECK(b.data() != a.data());
  }
  {
    cpu::Workspace c(500);  // no larger than before: the same buffer again
    CHECK(c.data() == kept);
  }
  {
    cpu::Workspace big(size_t(32) << 20);  // 128 MiB of floats, then a small call gives it back
    big.data()[0] = 1.0f;
  }
  cpu::Workspace small(1000);
  CHECK(small.data() != nullptr);
  CHECK(cpu::Workspace::kept_floats() < (size_t(1) << 20));
}

TEST_CASE("extreme scores: |s| up to 1e4 stay finite and exact") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::q8_0}) {
    Config c;
    c.shape = {4, 2, 64};
    c.dtype = dt;
    // |q|,|k| <= 40: |s| <= 40*40*64/8 = 12800. f16 holds 40 exactly enough; the reference reads the same values.
    c.amp = 40.0f;
    c.tree.parent = {-1, 0, 0};
    c.tree.paths = {{0, 1}, {0, 2}};
    c.seg_len = {300, 50, 80};
    c.n_query = {1, 3};
    INFO(dtype_name(dt));
    // Scores near 1e4 lose absolute precision in f32 (ulp(1e4) ~ 1e-3), so a near-tie between the top two
    // keys could shift weights by ~1e-3; outputs are checked at that looser bound here.
    std::vector<std::unique_ptr<test::Segment>> store;
    std::vector<KvView> views;
    bool bf16_exact = true;
    for (int64_t len : c.seg_len) {
      store.push_back(test::make_segment(rng, dt, len, 2, 64, false, c.amp));
      views.push_back(store.back()->view);
      bf16_exact = bf16_exact && store.back()->bf16_exact;
    }
    const Tree tree = Tree::build(c.shape, c.seg_len, c.tree.paths, c.n_query);
    std::vector<float> q(static_cast<size_t>(tree.n_rows() * 4 * 64));
    for (float& x : q) x = rng.uniform(-c.amp, c.amp);
    // q exact on every path: bf16 products round it to bf16 and int8 products quantize it, so q8_0 K/V on the
    // int8-product path get q on the q8_0 grid, and a reference of their own.
    std::vector<float> q_q8 = q;
    test::round_to_q8_0(q_q8);
    test::round_to_bf16(q);
    std::vector<double> ref_o(q.size()), ref_lse(static_cast<size_t>(tree.n_rows() * 4));
    std::vector<double> ref_o_q8(q.size()), ref_lse_q8(ref_lse.size());
    reference_attention(tree, views, q.data(), ref_o.data(), ref_lse.data());
    reference_attention(tree, views, q_q8.data(), ref_o_q8.data(), ref_lse_q8.data());
    const UnifiedLayout uni = make_unified(tree, views);
    for (const test::KernelPath& path : test::kernel_paths()) {
      INFO("kernel path " << path.name());
      if (path.rounds_bf16() && dt == DType::q8_0 && !bf16_exact) continue;  // tiles converted to bf16 inexactly
      const bool quantizes = path.rounds_int8(64) && dt == DType::q8_0;
      const std::vector<float>& qx = quantizes ? q_q8 : q;
      const std::vector<double>& want_o = quantizes ? ref_o_q8 : ref_o;
      const test::UsePath use(path);
      std::vector<float> o(q.size()), lse(ref_lse.size());
      cpu::run(cpu::plan(tree), views, qx.data(), o.data(), lse.data());
      test::expect_close(o, want_o, 2e-2, 0, "cascade o, extreme");
      test::expect_close(lse, quantizes ? ref_lse_q8 : ref_lse, 0, 1e-5, "cascade lse, extreme");
      cpu::attend_unified(c.shape, uni.batch, qx.data(), o.data(), lse.data());
      test::expect_close(o, want_o, 2e-2, 0, "unified o, extreme");
    }
  }
}

#if CASCADE_X86
namespace {
// The kernels' exp2 of each tier over xs, 8 (or 16) at a time (xs.size() a multiple of 16).
CASCADE_TARGET_AVX2_BEGIN
void exp2_avx2(const std::vector<float>& xs, std::vector<float>& out) {
  using V = cpu::avx2::V;
  for (size_t i = 0; i < xs.size(); i += V::W) V::store(out.data() + i, cpu::avx2::exp2_neg(V::load(xs.data() + i)));
}
CASCADE_TARGET_END
CASCADE_TARGET_AVX512_BEGIN
void exp2_avx512(const std::vector<float>& xs, std::vector<float>& out) {
  using V = cpu::avx512::V;
  for (size_t i = 0; i < xs.size(); i += V::W)
    V::store(out.data() + i, cpu::avx512::exp2_neg(V::load(xs.data() + i)));
}
CASCADE_TARGET_END
}  // namespace

// The online softmax's 2^x (x <= 0): within 3e-7 of std::exp2 where that is a normal number, exactly 0 for a
// masked score (-inf) and far below the max, and never a subnormal, which costs a microcode assist per
// instruction on Intel cores (with most lanes masked, the unified baseline ran at half speed).
TEST_CASE("softmax exp2 on every tier: accurate, exactly 0 when masked, never subnormal") {
  std::vector<float> xs;
  for (double x = 0; x >= -200; x -= 1.0 / 64) xs.push_back(float(x));
  for (float x : {-0.0f, -1e-30f, -125.49f, -125.5f, -125.51f, -126.0f, -126.5f, -127.0f, -149.0f, -1e30f, kNegInf})
    xs.push_back(x);
  while (xs.size() % 16) xs.push_back(kNegInf);
  std::vector<float> out(xs.size());
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (detected_isa() < isa) continue;
    INFO(std::string(isa_name(isa)));
    if (isa == Isa::avx2) exp2_avx2(xs, out);
    else exp2_avx512(xs, out);
    for (size_t i = 0; i < xs.size(); ++i) {
      CAPTURE(xs[i]);
      const float r = out[i];
      CHECK((r == 0.0f || std::fpclassify(r) == FP_NORMAL));
      const double want = std::exp2(double(xs[i]));
      if (xs[i] >= -125.0f) CHECK(std::fabs(r - want) <= 3e-7 * want);
      else CHECK(r <= 2 * want);  // below the floor: 0, or the value itself
      if (xs[i] <= -127.0f) CHECK(r == 0.0f);
    }
  }
}
#endif

TEST_CASE("bf16 products: measured choice by default, a scope's setting restored after it") {
  const bool measured = cpu::bf16_products();
  CHECK(measured == cpu::detail::bf16_products_faster());
#if CASCADE_X86
  if (detected_isa() == Isa::avx512 && cpu_features().avx512_bf16) {
    const double r = cpu::avx512_bf16::bf16_over_fma_rate();
    MESSAGE("bf16 dot products / f32 FMAs, multiply-adds per second on this CPU: " << r);
    CHECK((r > 0.05 && r < 20));  // a rate, not a failed timing
    if (amx_usable()) CHECK(measured);  // AMX tiles out-run f32 FMAs whatever vdpbf16ps does
    else if (r < 1.0 || r > 1.45) CHECK(measured == (r > 1.2));  // near 1.2, two timings may fall either side
  } else {
    CHECK_FALSE(measured);
  }
#endif
  {
    const cpu::Bf16Products on(!measured);
    CHECK(cpu::bf16_products() == !measured);
    {
      const cpu::Bf16Products inner(measured);
      CHECK(cpu::bf16_products() == measured);
    }
    CHECK(cpu::bf16_products() == !measured);
  }
  CHECK(cpu::bf16_products() == measured);
  CHECK(cpu::detail::bf16_products_flag().load() == -1);  // back to the measured choice, not a fixed setting
}

TEST_CASE("amx tiles: on by default where the process may run them, a scope's setting restored after it") {
  MESSAGE("AMX tiles usable here: " << (amx_usable() ? "yes" : "no"));
  CHECK(cpu::amx_tiles() == amx_usable());
  if (amx_usable()) CHECK(amx_usable() == (cpu_features().amx_tile && cpu_features().amx_bf16));
  {
    const cpu::AmxTiles off(false);
    CHECK_FALSE(cpu::amx_tiles());
    CHECK(cpu::choose_kernel(KernelShape::tiled, DType::bf16, 64, cpu::KernelOptions::process()).products !=
          Products::amx_bf16);
    {
      const cpu::AmxTiles on(true);
      CHECK(cpu::amx_tiles() == amx_usable());  // never on where the OS or CPU says no
    }
    CHECK_FALSE(cpu::amx_tiles());
  }
  CHECK(cpu::detail::amx_tiles_flag().load() == -1);
  {
    const cpu::Bf16Products f32(false);  // tiles are a kind of bf16 product
    CHECK(cpu::choose_kernel(KernelShape::tiled, DType::bf16, 64, cpu::KernelOptions::process()).products ==
          Products::f32);
  }
}

TEST_CASE("kernel choice: tier by head dim and shape, products by K/V type and options, kept by the plan") {
  const Isa top = detected_isa();
  const bool bf16_dots = top == Isa::avx512 && cpu_features().avx512_bf16;
  const bool int8_dots = top == Isa::avx512 && cpu_features().avx512_vnni;
  cpu::KernelOptions opt;
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512}) {
    opt.isa_limit = isa;
    const Isa tier = std::min(isa, top);
    for (int d : {8, 16, 24, 32, 48, 64, 72, 80, 96, 128, 200, 256, 3, 66}) {
      for (int t = 0; t < kNumDTypes; ++t) {
        const DType dt = DType(t);
        for (int bp : {0, 1}) {
          opt.bf16_products = bp;
          opt.int8_products = bp;
          INFO("limit " << isa_name(isa) << ", head dim " << d << ", " << dtype_name(dt) << ", bf16 and int8 products "
                        << bp);
          const KernelChoice tiled = cpu::choose_kernel(KernelShape::tiled, dt, d, opt);
          const KernelChoice few = cpu::choose_kernel(KernelShape::few_rows, dt, d, opt);
          CHECK(tiled.shape == KernelShape::tiled);
          CHECK(tiled.tier == tier);  // the tiled kernel takes any head dim on every tier
          const Isa few_tier = tier == Isa::avx512 && d % 16 == 0 ? Isa::avx512
                               : tier >= Isa::avx2 && d % 8 == 0  ? Isa::avx2
                                                                  : Isa::portable;
          CHECK(few.tier == few_tier);
          const bool bf16_here = dt == DType::bf16 && bp == 1 && bf16_dots;
          // q8_0: tiles converted to bf16 for the shared pass, int8 products in the per-sequence one
          const bool q8 = dt == DType::q8_0 && bp == 1 && d % 32 == 0;
          const bool tiled_dots = ((bf16_here && d % 2 == 0) || (q8 && bf16_dots)) && tier == Isa::avx512;
          CHECK((tiled.products != Products::f32) == tiled_dots);
          CHECK((few.products == Products::bf16_dot) == (bf16_here && few_tier == Isa::avx512 && d % 32 == 0));
          CHECK((few.products == Products::int8_dot) == (q8 && int8_dots && few_tier == Isa::avx512 && d % 64 == 0));
          CHECK(cpu::kernel_runs_here(tiled, dt, d));
          CHECK(cpu::kernel_runs_here(few, dt, d));
          CHECK(cpu::few_rows_limit(d, opt) == (d % 8 == 0 ? cpu::kFewRows : 0));  // portable: 8 lanes too
        }
      }
    }
  }
  // What a CPU lacks never runs.
  CHECK_FALSE(cpu::kernel_runs_here({KernelShape::tiled, Isa::avx512, Products::bf16_dot}, DType::f16, 64));
  CHECK_FALSE(cpu::kernel_runs_here({KernelShape::few_rows, Isa::avx2, Products::f32}, DType::f16, 36));
  if (!amx_usable())
    CHECK_FALSE(cpu::kernel_runs_here({KernelShape::tiled, Isa::avx512, Products::amx_bf16}, DType::bf16, 64));
  if (top < Isa::avx512)
    CHECK_FALSE(cpu::kernel_runs_here({KernelShape::tiled, Isa::avx512, Products::f32}, DType::f16, 64));

  // The plan keeps what was chosen when it was made: a later change of the process-wide switches does not move it.
  const HeadShape shape{4, 2, 64};
  const Tree tree = Tree::two_level(shape, 300, {20, 30, 40, 10, 5});  // 10 rows per KV head below the prefix
  const Plan plan = [&] {
    const IsaLimit limit(Isa::portable);
    return cpu::plan(tree);
  }();
  CHECK(plan.target().kernel_choices(cpu::kTiledKernel, DType::f16).tier == Isa::portable);
  CHECK(cpu::kernel_names(plan, DType::f16) == "shared: portable tiled f32; per-sequence: portable few-rows f32");
  const cpu::Options wide{.kernels = cpu::KernelOptions{}};
  const Plan p2 = cpu::plan(tree, wide);
  if (top != Isa::portable) {
    CHECK(cpu::kernel_names(p2, DType::f16) ==
          "shared: " + KernelChoice{KernelShape::tiled, top, Products::f32}.name() +
              "; per-sequence: " + KernelChoice{KernelShape::few_rows, top, Products::f32}.name());
  }
  // A target whose choice this CPU cannot run is refused by name before anything runs.
  Target t = cpu::target(0, shape.head_dim);
  t.kernel_choices.by[cpu::kTiledKernel][int(DType::f16)] = {KernelShape::few_rows, Isa::avx2, Products::amx_bf16};
  const Plan bad = Plan::make(tree, t);
  std::vector<f16> kv(size_t(300) * 2 * 64, f16(0.5f));
  std::vector<KvView> views;
  for (int g = 0; g < tree.n_segments(); ++g)
    views.push_back(KvView::contiguous(kv.data(), kv.data(), tree.n_tokens(g), 2, 64));
  std::vector<float> q(size_t(tree.n_rows()) * 4 * 64, 0.25f), o(q.size());
  CHECK_THROWS_WITH(cpu::run(bad, views, q.data(), o.data()), doctest::Contains("cannot run on this CPU"));
}

TEST_CASE("merge: commutative, associative, empty state is the identity, two empties stay empty") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < 200; ++it) {
    const int d = int(rng.uniform_int(1, 300));
    auto rand_state = [&](std::vector<float>& o) {
      o.resize(static_cast<size_t>(d));
      for (float& x : o) x = rng.uniform(-2, 2);
      return rng.uniform(-50, 50);
    };
    std::vector<float> a, b, c;
    const float la = rand_state(a), lb = rand_state(b), lc = rand_state(c);
    // (a + b) vs (b + a)
    std::vector<float> ab(static_cast<size_t>(d)), ba(static_cast<size_t>(d));
    float lab, lba;
    merge_state(a.data(), la, b.data(), lb, ab.data(), &lab, d);
    merge_state(b.data(), lb, a.data(), la, ba.data(), &lba, d);
    for (int i = 0; i < d; ++i) REQUIRE(std::abs(ab[i] - ba[i]) <= 1e-6f + 1e-6f * std::abs(ab[i]));
    REQUIRE(std::abs(lab - lba) <= 1e-5f * std::max(1.0f, std::abs(lab)));
    // (a + b) + c vs a + (b + c) vs n-ary
    std::vector<float> ab_c(static_cast<size_t>(d)), bc(static_cast<size_t>(d)), a_bc(static_cast<size_t>(d)), nary(static_cast<size_t>(d));
    float lab_c, lbc, la_bc, lnary;
    merge_state(ab.data(), lab, c.data(), lc, ab_c.data(), &lab_c, d);
    merge_state(b.data(), lb, c.data(), lc, bc.data(), &lbc, d);
    merge_state(a.data(), la, bc.data(), lbc, a_bc.data(), &la_bc, d);
    const float* os[3] = {a.data(), b.data(), c.data()};
    const float ls[3] = {la, lb, lc};
    merge_states(3, os, ls, nary.data(), &lnary, d);
    // independent check in double: lse = log(e^la + e^lb + e^lc), o = softmax-weighted sum
    const double m = std::max({double(la), double(lb), double(lc)});
    const double wa = std::exp(la - m), wb = std::exp(lb - m), wc = std::exp(lc - m);
    const double lref = m + std::log(wa + wb + wc);
    for (int i = 0; i < d; ++i) {
      const double r = (wa * a[i] + wb * b[i] + wc * c[i]) / (wa + wb + wc);
      REQUIRE(std::abs(ab_c[i] - r) <= 1e-5 + 1e-5 * std::abs(r));
      REQUIRE(std::abs(a_bc[i] - r) <= 1e-5 + 1e-5 * std::abs(r));
      REQUIRE(std::abs(nary[i] - r) <= 1e-5 + 1e-5 * std::abs(r));
    }
    for (float l : {lab_c, la_bc, lnary}) REQUIRE(std::abs(l - lref) <= 1e-5 * std::max(1.0, std::abs(lref)));
    // identity
    std::vector<float> zero(static_cast<size_t>(d), 0.0f), x = a;
    float lx = la;
    merge_state_inplace(x.data(), &lx, zero.data(), kNegInf, d);
    REQUIRE(x == a);
    REQUIRE(lx == la);
    std::vector<float> e(static_cast<size_t>(d), 0.0f);
    float le = kNegInf;
    merge_state_inplace(e.data(), &le, a.data(), la, d);
    REQUIRE(e == a);
    REQUIRE(le == la);
    // empty + empty
    std::vector<float> e1(static_cast<size_t>(d), 0.0f), e2(static_cast<size_t>(d), 0.0f);
    float l1 = kNegInf;
    merge_state_inplace(e1.data(), &l1, e2.data(), kNegInf, d);
    REQUIRE(l1 == kNegInf);
    for (float v : e1) REQUIRE(v == 0.0f);
    const float* eo[2] = {e1.data(), e2.data()};
    const float el[2] = {kNegInf, kNegInf};
    float ln;
    merge_states(2, eo, el, nary.data(), &ln, d);
    REQUIRE(ln == kNegInf);
    for (int i = 0; i < d; ++i) REQUIRE(nary[i] == 0.0f);
  }
}

TEST_CASE("bad API input throws an Error naming the problem") {
  std::vector<float> k(64 * 10), v(64 * 10);
  const KvView ok = KvView::contiguous(k.data(), v.data(), 10, 1, 64);
  auto throws_with = [](auto&& f, const std::string& needle) {
    try {
      f();
    } catch (const Error& e) {
      const std::string msg = e.what();
      CHECK_MESSAGE(msg.find(needle) != std::string::npos, "message '" << msg << "' lacks '" << needle << "'");
      return;
    }
    FAIL("no error thrown; expected one mentioning '" << needle << "'");
  };
  // The tree: shapes, lengths, paths, query counts.
  throws_with([&] { Tree::two_level({3, 2, 64}, 10, {10}); }, "not a multiple");
  throws_with([&] { Tree::build({1, 1, 64}, {10, 10}, {{0, 2}}, {1}); }, "out of range");
  throws_with([&] { Tree::build({1, 1, 64}, {10, 10}, {{0, 1}, {1}}, {1, 1}); }, "two parents");
  throws_with([&] { Tree::build({1, 1, 64}, {10, 10}, {{0, 1}}, {1, 1}); }, "query counts");
  throws_with([&] { Tree::build({1, 1, 64}, {10}, {{0, 0}}, {1}); }, "twice");
  throws_with([&] { Tree::build({1, 1, 64}, {10}, {{0}}, {-1}); }, "negative");
  throws_with([&] { Tree::build({1, 1, 64}, {-3}, {{0}}, {1}); }, "negative length");
  throws_with([&] { cpu::plan(Tree::two_level({1, 1, 64}, 10, {10}), cpu::Options{-1}); }, "n_threads");
  // The views a run gets: each must match its segment in the plan.
  const Plan plan = cpu::plan(Tree::two_level({1, 1, 64}, 10, {10}));
  const auto run_with = [&](const KvView& prefix) {
    const std::vector<KvView> views = {prefix, ok};
    cpu::run(plan, views, k.data(), v.data());
  };
  throws_with([&] { cpu::run(cpu::plan(Tree::two_level({2, 2, 64}, 10, {10})), std::vector<KvView>{ok, ok},
                             k.data(), v.data()); }, "KV heads");
  throws_with([&] { cpu::run(cpu::plan(Tree::two_level({1, 1, 32}, 10, {10})), std::vector<KvView>{ok, ok},
                             k.data(), v.data()); }, "dim 32");
  throws_with([&] { cpu::run(cpu::plan(Tree::two_level({1, 1, 64}, 12, {10})), std::vector<KvView>{ok, ok},
                             k.data(), v.data()); }, "segment 0 has 10 tokens but the plan 12");
  throws_with([&] { cpu::run(plan, std::vector<KvView>{ok}, k.data(), v.data()); }, "K/V views");
  KvView null_data = ok;
  null_data.k = nullptr;
  throws_with([&] { run_with(null_data); }, "null");
  KvView bad_page = ok;
  const int32_t table[1] = {0};
  bad_page.block_table = table;
  bad_page.page_size = 0;
  throws_with([&] { run_with(bad_page); }, "page_size");
  throws_with([&] { cpu::run(plan, std::vector<KvView>{ok, ok}, nullptr, nullptr); }, "null");
  cpu::UnifiedBatch ub;
  ub.kv = ok;
  throws_with([&] { cpu::attend_unified({1, 1, 64}, ub, k.data(), v.data()); }, "key masks");
  throws_with([] { parse_dtype("f8"); }, "f8");
}

}  // namespace test_attention
