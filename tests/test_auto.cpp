// auto.hpp: the chosen plan computes what the tree computes (every element against the reference), the
// decisions are the obvious ones where the answer is clear, calibration gives a usable model, and a
// profile survives save/load.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "attention_problem.hpp"
#include "cascade/auto.hpp"
#include "cascade/cpu/calibrate.hpp"
#include "model/kv_cache.hpp"

namespace test_auto {

using namespace cascade;
using test::Rng;

namespace {

// Tolerances as in test_attention.cpp: the chosen plan only regroups the same exact merges.
constexpr double kAtol = 5e-6, kRtol = 5e-5;

// A fixed synthetic machine: ~10 GB/s memory, a few-rows kernel near the memory rate, a tiled kernel
// with 4x the multiply rate but a costlier item and staging, 3 us per work item.
CostModel synthetic_model() {
  CostModel c;
  c.read_bw = 10e9;
  c.small_bw = 12e9;
  c.small_mac = 15e9;
  c.tiled_bw = 8e9;
  c.tiled_mac = 60e9;
  c.item_s = 3e-6;
  return c;
}

// Log-uniform random rates: decisions of every kind show up across seeds.
CostModel random_model(Rng& rng) {
  auto lu = [&](double lo, double hi) { return lo * std::pow(hi / lo, rng.uniform(0, 1)); };
  CostModel c;
  c.read_bw = lu(1e9, 1e11);
  c.small_bw = lu(1e9, 1e11);
  c.small_mac = lu(1e9, 1e11);
  c.tiled_bw = lu(1e9, 1e11);
  c.tiled_mac = lu(1e9, 1e12);
  c.item_s = lu(1e-8, 1e-3);
  return c;
}

struct Problem {
  std::vector<std::unique_ptr<test::Segment>> store;
  std::vector<KvView> views;
  Tree tree;
  DType dtype = DType::f16;
};

Problem make(Rng& rng, const HeadShape& shape, DType dt, bool paged, const test::Tree& tree,
             const std::vector<int64_t>& seg_len, const std::vector<int64_t>& n_query) {
  Problem p;
  p.dtype = dt;
  for (int64_t len : seg_len) {
    p.store.push_back(test::make_segment(rng, dt, len, shape.n_kv_heads, shape.head_dim, paged));
    p.views.push_back(p.store.back()->view);
  }
  p.tree = Tree::build(shape, seg_len, tree.paths, n_query);
  return p;
}

// The plan auto makes for p on n_threads threads under model m; why: its recorded choice. On f32 products: the
// tests check the regrouping at the tight bound (bf16 products round q; test_attention.cpp checks them).
Plan choose_plan(const Problem& p, const CostModel& m, AutoChoice* why, int n_threads = 0) {
  cpu::Options opt{n_threads};
  opt.cost_model = &m;
  opt.kv_dtype = p.dtype;
  opt.kernels = cpu::KernelOptions::process();
  opt.kernels->bf16_products = 0;
  Plan plan = cpu::plan(p.tree, opt);
  REQUIRE(plan.choice().has_value());
  if (why) *why = *plan.choice();
  return plan;
}

// Runs `chosen` and compares o and lse with the reference of p's tree.
void expect_same_function(Rng& rng, const Problem& p, const Plan& chosen) {
  const Tree& tree = p.tree;
  REQUIRE(chosen.attended().n_rows() == tree.n_rows());
  REQUIRE(chosen.attended().n_sequences() == tree.n_sequences());
  const HeadShape& sh = tree.shape();
  const size_t n_out = size_t(tree.n_rows() * sh.n_q_heads * sh.head_dim), n_lse = size_t(tree.n_rows() * sh.n_q_heads);
  std::vector<float> q(n_out);
  for (float& x : q) x = rng.uniform(-1, 1);
  std::vector<double> ref_o(n_out), ref_lse(n_lse);
  reference_attention(tree, p.views, q.data(), ref_o.data(), ref_lse.data());
  std::vector<float> o(n_out, 123.0f), lse(n_lse, 123.0f);
  cpu::run(chosen, p.views, q.data(), o.data(), lse.data());
  test::expect_close(o, ref_o, kAtol, kRtol, "auto o");
  test::expect_close(lse, ref_lse, kAtol, kRtol, "auto lse");
}

// Two levels: B sequences, one query each, below one prefix of P tokens; own segments of t tokens.
test::Tree two_level_tree(int n_seq) {
  test::Tree t;
  t.parent.push_back(-1);
  for (int s = 0; s < n_seq; ++s) {
    t.parent.push_back(0);
    t.paths.push_back({0, s + 1});
  }
  return t;
}

}  // namespace

TEST_CASE("auto: the chosen plan equals the reference on random trees and random cost models") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  static const std::vector<HeadShape> shapes = {{9, 3, 64}, {32, 8, 128}, {8, 1, 64}, {4, 2, 96}, {28, 4, 128}};
  int n_changed = 0, n_cases = 0;
  for (int iter = 0; iter < 40; ++iter) {
    const HeadShape shape = rng.pick(shapes);
    const DType dt = rng.pick<DType>({DType::f32, DType::f16, DType::bf16});
    const bool paged = rng.coin();
    const test::Tree tree = test::random_tree(rng, int(rng.uniform_int(1, 4)), int(rng.uniform_int(1, 24)));
    std::vector<int64_t> seg_len(tree.parent.size());
    for (auto& len : seg_len) len = rng.coin(0.1) ? 0 : rng.uniform_int(0, rng.coin() ? 600 : 8);
    std::vector<int64_t> n_query(tree.paths.size());
    const bool multi = rng.coin(0.3);
    for (auto& n : n_query) n = multi ? rng.uniform_int(0, 4) : 1;
    Problem p = make(rng, shape, dt, paged, tree, seg_len, n_query);
    const CostModel model = rng.coin(0.2) ? synthetic_model() : random_model(rng);
    AutoChoice why;
    const Plan chosen = choose_plan(p, model, &why, int(rng.uniform_int(0, 3)));
    INFO("iter " << iter << ": " << tree.paths.size() << " sequences, " << seg_len.size() << " segments, changed "
                 << why.changed);
    CHECK(why.chosen_s <= why.tree_s * (1 + 1e-9));
    // The choice prices the very schedule the plan runs.
    CHECK(model.plan_seconds(chosen.attended(), chosen.target(), dt) == doctest::Approx(why.chosen_s).epsilon(1e-6));
    CHECK_NOTHROW(verify_schedule(chosen.attended(), chosen.schedule()));
    n_changed += why.changed;
    ++n_cases;
    expect_same_function(rng, p, chosen);
  }
  MESSAGE(n_changed << " of " << n_cases << " trees were regrouped");
  CHECK(n_changed > 0);
}

TEST_CASE("auto: folding everything gives per-sequence attention with the same result") {
  Rng rng(test::fresh_seed());
  // Tiny item cost, very slow tiled kernel: stacking never pays, so every shared segment is folded.
  CostModel m = synthetic_model();
  m.item_s = 1e-12;
  m.small_mac = 1e15;
  m.small_bw = 1e15;
  m.read_bw = 1e15;
  m.tiled_bw = 1e3;
  const HeadShape shape{28, 4, 128};  // group 7: two sequences stack 14 rows, past the few-rows kernel
  test::Tree tree = test::random_tree(rng, 3, 16);
  std::vector<int64_t> seg_len(tree.parent.size(), 40), n_query(tree.paths.size(), 1);
  Problem p = make(rng, shape, DType::f16, false, tree, seg_len, n_query);
  AutoChoice why;
  const Plan chosen = choose_plan(p, m, &why, 2);
  const Tree& at = chosen.attended();
  for (int s = 0; s < at.n_sequences(); ++s)
    for (int g : at.sequence(s).path) CHECK(at.segment_rows(g).size() == size_t(n_query[size_t(s)]));
  expect_same_function(rng, p, chosen);
}

TEST_CASE("auto: clear-cut decisions under a fixed synthetic model") {
  Rng rng(1);
  const CostModel m = synthetic_model();
  SUBCASE("a 2-token span shared by 2 sequences is folded") {
    // 28/4/128 (Qwen2.5-7B's heads): stacking two sequences gives 14 rows per KV head, past the few-rows
    // kernel; two few-rows passes over 2 tokens cost less than 4 tiled items.
    const HeadShape shape{28, 4, 128};
    Problem p = make(rng, shape, DType::f16, false, two_level_tree(2), {2, 30, 30}, {1, 1});
    AutoChoice why;
    const Plan chosen = choose_plan(p, m, &why, 2);
    CHECK(why.changed);
    CHECK_FALSE(why.segments[0].shared);
    CHECK(why.segments[0].n_passes == 2);
    CHECK(why.segments[1].shared);
    expect_same_function(rng, p, chosen);
  }
  SUBCASE("a 2-token span shared by 2 sequences is folded at every depth") {
    // A 2-token root above a 2-token middle span, each shared by 2 sequences.
    test::Tree t;
    t.parent = {-1, 0, 1, 1};
    t.paths = {{0, 1, 2}, {0, 1, 3}};
    Problem p = make(rng, HeadShape{28, 4, 128}, DType::f16, false, t, {2, 2, 10, 10}, {1, 1});
    AutoChoice why;
    const Plan chosen = choose_plan(p, m, &why, 1);
    CHECK_FALSE(why.segments[0].shared);
    CHECK_FALSE(why.segments[1].shared);
    expect_same_function(rng, p, chosen);
  }
  SUBCASE("a 4000-token prefix over 32 sequences stays shared") {
    for (const HeadShape& shape : {HeadShape{9, 3, 64}, HeadShape{32, 8, 128}, HeadShape{28, 4, 128}}) {
      std::vector<int64_t> len(33, 16);
      len[0] = 4000;
      Problem p = make(rng, shape, DType::f16, false, two_level_tree(32), len, std::vector<int64_t>(32, 1));
      AutoChoice why;
      const Plan chosen = choose_plan(p, m, &why);
      CHECK_FALSE(why.changed);
      CHECK(why.segments[0].shared);
      CHECK(chosen.attended().n_segments() == 33);
    }
  }
  SUBCASE("nothing shared: the tree is returned as it is") {
    test::Tree t;
    t.parent = {-1, -1, -1};
    t.paths = {{0}, {1}, {2}};
    Problem p = make(rng, HeadShape{9, 3, 64}, DType::f32, false, t, {100, 5, 0}, {1, 2, 1});
    AutoChoice why;
    const Plan chosen = choose_plan(p, m, &why);
    CHECK_FALSE(why.changed);
    CHECK(chosen.attended().n_segments() == 3);
  }
}

TEST_CASE("auto: the cost model favours stacking as the prefix grows") {
  const CostModel m = synthetic_model();
  const HeadShape shape{9, 3, 64};
  const Target t = cpu::target(2, shape.head_dim);
  // Shared pass over P tokens with 8 sequences, against 8 separate passes: the ratio grows with P.
  double prev = 0;
  for (int64_t P : {64, 256, 1024, 4096, 16384}) {
    const double shared = m.pass_seconds(shape, t, DType::f16, P, 8);
    const double folded = 8 * m.pass_seconds(shape, t, DType::f16, P, 1);
    const double gain = folded / shared;
    CHECK(gain >= prev * 0.999);
    prev = gain;
  }
  CHECK(prev > 2.0);
  CHECK(m.pass_seconds(shape, t, DType::f16, 0, 8) == 0.0);
  CHECK(m.pass_seconds(shape, t, DType::f16, 100, 0) == 0.0);
}

TEST_CASE("auto: calibration gives finite positive rates for several head shapes, profiles round-trip") {
  const auto t0 = std::chrono::steady_clock::now();
  const CostModel c = calibrate(0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("calibration took " << secs << " s:\n" << c.to_string());
  for (double v : {c.read_bw, c.small_bw, c.small_mac, c.tiled_bw, c.tiled_mac, c.item_s, c.tiled_item_s}) {
    CHECK(std::isfinite(v));
    CHECK(v > 0);
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("cascade-cost-" + std::to_string(::getpid()) + ".txt")).string();
  c.save(path);
  const CostModel d = CostModel::load(path);
  std::filesystem::remove(path);
  CHECK(d.n_threads == c.n_threads);
  CHECK(d.read_bw == doctest::Approx(c.read_bw).epsilon(1e-7));
  CHECK(d.tiled_mac == doctest::Approx(c.tiled_mac).epsilon(1e-7));
  CHECK(d.item_s == doctest::Approx(c.item_s).epsilon(1e-7));
  CHECK(d.tiled_item_s == doctest::Approx(c.tiled_item_s).epsilon(1e-7));
  for (const HeadShape like : {HeadShape{8, 8, 128}, HeadShape{1, 1, 80}}) {
    const CostModel e = calibrate(1, like);
    for (double v : {e.read_bw, e.small_bw, e.small_mac, e.tiled_bw, e.tiled_mac, e.item_s, e.tiled_item_s}) {
      CHECK(std::isfinite(v));
      CHECK(v > 0);
    }
  }
  CHECK_THROWS_AS(CostModel::parse("nonsense"), Error);
  CHECK_THROWS_AS(CostModel::parse("cascade-cost-model 1\nread_bw -3\n"), Error);
  CHECK_THROWS_AS(CostModel::parse("cascade-cost-model 1\nwhat 3\n"), Error);
  CHECK_THROWS_AS(CostModel::load("/nonexistent/dir/profile.txt"), Error);
}

TEST_CASE("auto: the runtime knows the method by name") {
  CHECK(parse_attn_method("auto") == AttnMethod::auto_);
  CHECK(std::string(attn_method_name(AttnMethod::auto_)) == "auto");
  CHECK_THROWS_AS(parse_attn_method("automatic"), Error);
}

}  // namespace test_auto
