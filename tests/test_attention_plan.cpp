// Plan once, run many: a plan made from a tree's lengths alone runs every layer with that layer's K/V
// (as a list or a callback), with the thread's workspace or the caller's; the one schedule (schedule.hpp)
// covers every key of every output exactly once for every backend's target; auto's choice lives in the plan.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <cmath>

#include "attention_problem.hpp"
#include "cascade/cascade.hpp"
#include "cascade/cuda/schedule.hpp"

namespace test_attention_plan {

using namespace cascade;
using test::Rng;

namespace {

// As test_attention.cpp, with f32 products: these tests check plans, not kernels (bf16 products round q and
// the weights; test_attention.cpp checks them on every kernel path).
constexpr double kAtol = 5e-6, kRtol = 5e-5;

// A random tree (depth 1 to 4, up to max_seqs sequences, some with several query tokens).
Tree random_tree(Rng& rng, const HeadShape& shape, int max_seqs, double budget) {
  const test::Tree t = test::random_tree(rng, int(rng.uniform_int(1, 4)), int(rng.uniform_int(1, max_seqs)));
  std::vector<int64_t> len(t.parent.size());
  for (size_t g = 0; g < len.size(); ++g) len[g] = rng.coin(0.1) ? 0 : rng.uniform_int(0, t.parent[g] < 0 ? 3000 : 600);
  std::vector<int64_t> n_query(t.paths.size());
  const bool multi = rng.coin(0.3);
  for (auto& n : n_query) n = multi ? rng.uniform_int(0, 5) : 1;
  test::shrink_to_budget(len, t.paths, n_query, shape, budget);
  return Tree::build(shape, len, t.paths, n_query);
}

// One layer's K/V for a tree: fresh random segments in random storage.
struct Layer {
  std::vector<std::unique_ptr<test::Segment>> store;
  std::vector<KvView> views;
};
Layer make_layer(Rng& rng, const Tree& tree, DType dt) {
  Layer l;
  const bool paged = rng.coin();
  for (int g = 0; g < tree.n_segments(); ++g) {
    l.store.push_back(test::make_segment(rng, dt, tree.n_tokens(g), tree.shape().n_kv_heads, tree.shape().head_dim,
                                         paged));
    l.views.push_back(l.store.back()->view);
  }
  return l;
}

struct Reference {
  std::vector<double> o, lse;
};
Reference reference(const Tree& tree, const Layer& layer, const std::vector<float>& q) {
  Reference r;
  r.o.resize(q.size());
  r.lse.resize(size_t(tree.n_rows() * tree.shape().n_q_heads));
  reference_attention(tree, layer.views, q.data(), r.o.data(), r.lse.data());
  return r;
}

std::vector<float> random_q(Rng& rng, const Tree& tree) {
  std::vector<float> q(size_t(tree.n_rows() * tree.shape().n_q_heads * tree.shape().head_dim));
  for (float& x : q) x = rng.uniform(-1, 1);
  return q;
}

}  // namespace

TEST_CASE("plan: one plan runs every layer, K/V given as a list, a callback or with the caller's workspace") {
  const cpu::Bf16Products f32_products(false);
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int iter = 0; iter < 12; ++iter) {
    CAPTURE(iter);
    const HeadShape shape = rng.pick<HeadShape>({{9, 3, 64}, {8, 2, 128}, {4, 4, 32}, {6, 1, 80}});
    const Tree tree = random_tree(rng, shape, 24, 4e6);
    const Plan plan = cpu::plan(tree, {int(rng.uniform_int(0, 3))});
    for (int il = 0; il < 3; ++il) {
      CAPTURE(il);
      const Layer layer = make_layer(rng, tree, rng.pick<DType>({DType::f32, DType::f16, DType::bf16}));
      const std::vector<float> q = random_q(rng, tree);
      const Reference ref = reference(tree, layer, q);
      std::vector<float> o(q.size(), 123.0f), lse(ref.lse.size(), 123.0f);
      if (il == 0) {
        cpu::run(plan, layer.views, q.data(), o.data(), lse.data());
      } else if (il == 1) {
        cpu::run(plan, [&](int g) { return layer.views[size_t(g)]; }, q.data(), o.data(), lse.data());
      } else {
        // Exactly workspace_floats(), poisoned: a run writes before it reads (sanitizers see any overrun).
        std::vector<float> ws(size_t(plan.workspace_floats()), std::nanf(""));
        cpu::run(plan, layer.views, q.data(), o.data(), lse.data(), ws.data());
      }
      test::expect_close(o, ref.o, kAtol, kRtol, "o");
      test::expect_close(lse, ref.lse, kAtol, kRtol, "lse");
    }
  }
}

TEST_CASE("plan: a plan holds no K/V: copies run from several threads at once, each with its own layer") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  const HeadShape shape{8, 2, 64};
  const Tree tree = Tree::two_level(shape, 900, {40, 0, 300, 7, 120});
  const Plan plan = cpu::plan(tree);
  std::vector<Layer> layers;
  std::vector<std::vector<float>> q, o;
  for (int il = 0; il < 16; ++il) {
    layers.push_back(make_layer(rng, tree, DType::f16));
    q.push_back(random_q(rng, tree));
    o.emplace_back(q.back().size(), 123.0f);
  }
  tbb::task_arena arena(4);
  arena.execute([&] {
    tbb::parallel_for(size_t(0), layers.size(), [&](size_t il) {
      const Plan copy = plan;
      cpu::run(copy, layers[il].views, q[il].data(), o[il].data());
    });
  });
  for (size_t il = 0; il < layers.size(); ++il) {
    const Reference ref = reference(tree, layers[il], q[il]);
    test::expect_close(o[il], ref.o, kAtol, kRtol, "o");
  }
}

TEST_CASE("schedule: every output merges each key it sees exactly once, on the CPU's and the CUDA target") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int iter = 0; iter < 200; ++iter) {
    CAPTURE(iter);
    HeadShape shape;
    shape.n_kv_heads = int(rng.uniform_int(1, 4));
    shape.n_q_heads = shape.n_kv_heads * rng.pick<int>({1, 2, 3, 4, 8});
    shape.head_dim = rng.pick<int>({32, 64, 80, 128});
    const Tree drawn = random_tree(rng, shape, 80, 1e12);  // lengths only: no budget to keep
    // A third under a sliding window (blocks and all on the CPU's target).
    const Tree tree = rng.coin(0.3) ? drawn.with_window(rng.pick<int64_t>({1, 9, 255, 256, 257, 600, 5000})) : drawn;
    CAPTURE(tree.window());
    Target cpu_target = cpu::target(0, shape.head_dim);
    cpu_target.n_items = double(rng.uniform_int(1, 64));
    cuda::ScheduleOptions copt;
    copt.n_sm = rng.pick<int>({1, 8, 132, 2000});
    for (const Target& t : {cpu_target, cuda::target(copt)}) {
      CAPTURE(t.backend);
      const Plan plan = Plan::make(tree, t);
      CHECK_NOTHROW(verify_schedule(plan.attended(), plan.schedule()));
      for (const Schedule::Item& it : plan.schedule().items) {
        const KernelTile& k = t.kernels[plan.schedule().passes[size_t(it.pass)].kernel];
        CHECK(it.e1 - it.e0 <= k.tile_rows);
        CHECK(it.heads == (k.all_heads ? shape.n_kv_heads : 1));
        if (t.cut_at_joins) {  // inside one segment of its pass
          const Schedule::Pass& ps = plan.schedule().passes[size_t(it.pass)];
          for (int64_t s = ps.seg_begin + 1; s < ps.seg_end; ++s) {
            const int64_t join = plan.schedule().segs[size_t(s)].start;
            CHECK((it.t1 <= join || it.t0 >= join));
          }
        }
      }
    }
  }
}

TEST_CASE("schedule: verify_schedule catches a dropped, a repeated and a misplaced part") {
  const Tree tree = Tree::two_level(HeadShape{4, 2, 64}, 2000, {300, 5, 0});
  const Plan plan = cpu::plan(tree, {2});
  REQUIRE_NOTHROW(verify_schedule(tree, plan.schedule()));
  Schedule dropped = plan.schedule();
  dropped.out_slots.erase(dropped.out_slots.begin() + dropped.out_begin[1]);
  for (size_t i = 2; i < dropped.out_begin.size(); ++i) --dropped.out_begin[i];
  CHECK_THROWS_AS(verify_schedule(tree, dropped), Error);
  Schedule repeated = plan.schedule();
  repeated.out_slots.insert(repeated.out_slots.begin() + repeated.out_begin[1], repeated.out_slots[size_t(repeated.out_begin[1])]);
  for (size_t i = 2; i < repeated.out_begin.size(); ++i) ++repeated.out_begin[i];
  CHECK_THROWS_AS(verify_schedule(tree, repeated), Error);
  Schedule misplaced = plan.schedule();
  std::swap(misplaced.out_slots[0], misplaced.out_slots.back());
  CHECK_THROWS_AS(verify_schedule(tree, misplaced), Error);
  Schedule short_item = plan.schedule();
  short_item.items[0].t1 -= 1;
  CHECK_THROWS_AS(verify_schedule(tree, short_item), Error);
}

TEST_CASE("plan: auto's choice is made once, recorded, and its slots read the given segments' K/V") {
  Rng rng(test::fresh_seed());
  // A cost model under which stacking never pays: every shared segment is folded into its sequences.
  CostModel m;
  m.item_s = 1e-12;
  m.small_mac = m.small_bw = m.read_bw = 1e15;
  m.tiled_bw = 1e3;
  const HeadShape shape{28, 4, 128};  // group 7: two sequences stack 14 rows, past the few-rows kernel
  const Tree tree = Tree::two_level(shape, 40, {30, 20, 10});
  cpu::Options opt;
  opt.cost_model = &m;
  const Plan plan = cpu::plan(tree, opt);
  REQUIRE(plan.choice().has_value());
  CHECK(plan.choice()->changed);
  CHECK_FALSE(plan.choice()->segments[0].shared);
  CHECK(plan.choice()->segments[0].n_passes == 3);
  REQUIRE(plan.attended().n_segments() == 6);  // the prefix once per sequence, and the three own segments
  int prefix_slots = 0;
  for (int k = 0; k < plan.attended().n_segments(); ++k) {
    prefix_slots += plan.source(k) == 0;
    CHECK(plan.attended().n_tokens(k) == tree.n_tokens(plan.source(k)));
  }
  CHECK(prefix_slots == 3);
  CHECK_NOTHROW(verify_schedule(plan.attended(), plan.schedule()));
  const Layer layer = make_layer(rng, tree, DType::f16);
  const std::vector<float> q = random_q(rng, tree);
  const Reference ref = reference(tree, layer, q);
  std::vector<float> o(q.size()), lse(ref.lse.size());
  cpu::run(plan, layer.views, q.data(), o.data(), lse.data());  // views of the given tree's 4 segments
  test::expect_close(o, ref.o, kAtol, kRtol, "auto o");
  test::expect_close(lse, ref.lse, kAtol, kRtol, "auto lse");
  // Without a cost model the plan attends the tree as given and records no choice.
  const Plan plain = cpu::plan(tree);
  CHECK_FALSE(plain.choice().has_value());
  CHECK(plain.attended().n_segments() == 4);
}

TEST_CASE("plan: a plan made for one backend is refused by another") {
  const Tree tree = Tree::two_level(HeadShape{4, 2, 64}, 10, {3});
  std::vector<f16> k(10 * 2 * 64), v(k.size());
  const KvView kv = KvView::contiguous(k.data(), v.data(), 10, 2, 64);
  const KvView own = KvView::contiguous(k.data(), v.data(), 3, 2, 64);
  std::vector<float> q(4 * 64), o(q.size());
  CHECK_THROWS_WITH_AS(cpu::run(cuda::plan(tree), std::vector<KvView>{kv, own}, q.data(), o.data()),
                       doctest::Contains("cuda backend"), Error);
  CHECK_THROWS_WITH_AS(cuda::lower(cpu::plan(tree)), doctest::Contains("cpu backend"), Error);
}

}  // namespace test_attention_plan
