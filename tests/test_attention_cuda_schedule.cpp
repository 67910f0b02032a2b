// The CUDA path's side of the one schedule (cascade/cuda/schedule.hpp): its target and the plan-to-launch
// translation, checked on the CPU: every work item is executed here in double precision exactly as the
// kernel reads it (rows through RowDesc, stacked
// row e = token row * group + head, tokens [t0, t1), limits or the unified mask), its partial states land in
// its slots, every output merges the slots its list names, and the result must equal the reference. A
// schedule that drops, repeats or misplaces any block of work fails here without a GPU.
#include <doctest/doctest.h>

#include <limits>
#include <set>

#include "attention_problem.hpp"
#include "cascade/cascade.hpp"
#include "cascade/cuda/schedule.hpp"

namespace test_attention_cuda_schedule {

using namespace cascade;
using test::Rng;

namespace {

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// Partial states of a schedule's slots, computed on the host.
struct Partials {
  std::vector<double> o, lse;
};

// Visibility of key j of the pass to row rd (plans: the limit; unified: sequence bit and position).
struct UnifiedKeys {
  const uint64_t* key_seqs = nullptr;
  int64_t n_words = 0;
  const int32_t* key_pos = nullptr;
};

Partials run_items(const cuda::DeviceSchedule& sc, const HeadShape& shape, double scale, const std::vector<KvView>& passes,
                   const float* q, const UnifiedKeys* uni) {
  const int64_t d = shape.head_dim;
  const int group = shape.group();
  Partials p;
  p.o.assign(size_t(sc.n_slots * d), std::nan(""));
  p.lse.assign(size_t(sc.n_slots), std::nan(""));
  std::vector<double> s;
  for (int cfg : {cuda::kNarrow, cuda::kWide}) {
    for (const cuda::WorkItem& it : sc.items[cfg]) {
      REQUIRE(it.n_rows >= 1);
      REQUIRE(it.n_rows <= cuda::kTileRows[cfg]);
      REQUIRE(it.t0 < it.t1);
      const KvView& kv = passes[size_t(it.pass)];
      REQUIRE(it.t1 <= kv.n_tokens);
      for (int r = 0; r < it.n_rows; ++r) {
        const int64_t e = it.e0 + r;
        const cuda::RowDesc rd = sc.rows[size_t(sc.pass_row_begin[size_t(it.pass)] + e / group)];
        const int qh = it.kvh * group + int(e % group);
        const float* qr = q + (int64_t(rd.q_row) * shape.n_q_heads + qh) * d;
        s.assign(size_t(it.t1 - it.t0), kNegInfD);
        double mx = kNegInfD;
        for (int64_t t = it.t0; t < it.t1; ++t) {
          bool vis;
          if (uni) {
            const uint64_t bits = uni->key_seqs[t * uni->n_words + rd.seq / 64];
            vis = ((bits >> (rd.seq % 64)) & 1u) && uni->key_pos[t] <= rd.pos;
          } else {
            vis = t < rd.limit;
          }
          if (!vis) continue;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += double(qr[c]) * kv_element(kv, kv.k, t, it.kvh, c);
          s[size_t(t - it.t0)] = dot * scale;
          mx = std::max(mx, s[size_t(t - it.t0)]);
        }
        double* o = p.o.data() + (it.slot + r) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = 0;
        if (mx == kNegInfD) {
          p.lse[size_t(it.slot + r)] = kNegInfD;
          continue;
        }
        double sum = 0;
        for (int64_t t = it.t0; t < it.t1; ++t) {
          const double w = std::exp(s[size_t(t - it.t0)] - mx);
          sum += w;
          if (w == 0) continue;
          for (int64_t c = 0; c < d; ++c) o[c] += w * kv_element(kv, kv.v, t, it.kvh, c);
        }
        for (int64_t c = 0; c < d; ++c) o[c] /= sum;
        p.lse[size_t(it.slot + r)] = mx + std::log(sum);
      }
    }
  }
  return p;
}

// Merges each output's slots (the merge kernel's work) with the host's n-ary merge.
void merge(const cuda::DeviceSchedule& sc, const Partials& p, int64_t n_out, int64_t d, std::vector<float>& o,
           std::vector<float>& lse) {
  REQUIRE(int64_t(sc.out_begin.size()) == n_out + 1);
  o.assign(size_t(n_out * d), 0.0f);
  lse.assign(size_t(n_out), 0.0f);
  std::vector<float> po, pl;
  std::vector<const float*> ptrs;
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t b = sc.out_begin[size_t(i)], e = sc.out_begin[size_t(i + 1)];
    po.assign(size_t((e - b) * d), 0.0f);
    pl.assign(size_t(e - b), 0.0f);
    ptrs.clear();
    for (int64_t j = b; j < e; ++j) {
      const int64_t slot = sc.out_slots[size_t(j)];
      REQUIRE(slot >= 0);
      REQUIRE(slot < sc.n_slots);
      for (int64_t c = 0; c < d; ++c) po[size_t((j - b) * d + c)] = float(p.o[size_t(slot * d + c)]);
      pl[size_t(j - b)] = float(p.lse[size_t(slot)]);
      ptrs.push_back(po.data() + (j - b) * d);
    }
    merge_states(e - b, ptrs.data(), pl.data(), o.data() + i * d, &lse[size_t(i)], d);
  }
}

// Structural invariants: slots are disjoint and all used, chunks respect the minimum length.
void check_structure(const cuda::DeviceSchedule& sc) {
  std::vector<int> used(size_t(sc.n_slots), 0);
  for (const auto& list : sc.items)
    for (const cuda::WorkItem& it : list)
      for (int r = 0; r < it.n_rows; ++r) ++used[size_t(it.slot + r)];
  for (size_t i = 0; i < used.size(); ++i) REQUIRE(used[i] == 1);
  std::multiset<int64_t> listed(sc.out_slots.begin(), sc.out_slots.end());
  for (int64_t slot = 0; slot < sc.n_slots; ++slot) CHECK(listed.count(slot) >= 1);  // no block's work is lost
  for (const auto& list : sc.items)
    for (size_t i = 1; i < list.size(); ++i) CHECK(list[i - 1].t1 - list[i - 1].t0 >= list[i].t1 - list[i].t0);
}

// f32 tolerance: the emulation is double; only the float merge rounds.
constexpr double kAtol = 2e-6, kRtol = 2e-5;

void check_plan(Rng& rng, const HeadShape& shape, DType dt, bool paged, const test::Tree& tree,
                const std::vector<int64_t>& seg_len, const std::vector<int64_t>& n_query, int n_sm) {
  std::vector<std::unique_ptr<test::Segment>> store;
  std::vector<KvView> views;
  for (int64_t len : seg_len) {
    store.push_back(test::make_segment(rng, dt, len, shape.n_kv_heads, shape.head_dim, paged));
    views.push_back(store.back()->view);
  }
  const Tree structure = Tree::build(shape, seg_len, tree.paths, n_query);
  const int64_t n_out = structure.n_rows() * shape.n_q_heads;
  std::vector<float> q(size_t(n_out * shape.head_dim));
  for (float& x : q) x = rng.uniform(-1, 1);
  std::vector<double> ref_o(q.size()), ref_lse(static_cast<size_t>(n_out));
  reference_attention(structure, views, q.data(), ref_o.data(), ref_lse.data());

  cuda::ScheduleOptions opt;
  opt.n_sm = n_sm;
  const Plan plan = cuda::plan(structure, opt);
  const cuda::DeviceSchedule sc = cuda::lower(plan);
  check_structure(sc);
  std::vector<KvView> pass_views;  // device pass k reads the given segment source(k)
  for (int k = 0; k < plan.attended().n_segments(); ++k) pass_views.push_back(views[size_t(plan.source(k))]);
  const Partials p = run_items(sc, shape, plan.scale(), pass_views, q.data(), nullptr);
  std::vector<float> o, lse;
  merge(sc, p, n_out, shape.head_dim, o, lse);
  test::expect_close(o, ref_o, kAtol, kRtol, "scheduled cascade o");
  test::expect_close(lse, ref_lse, kAtol, kRtol, "scheduled cascade lse");

  // The unified baseline's schedule over the same problem.
  const UnifiedLayout uni = make_unified(structure, views);
  const cuda::DeviceSchedule su = cuda::lower_unified(shape, uni.batch.kv.n_tokens, uni.batch.n_rows,
                                                      uni.batch.row_seq, uni.batch.row_pos, opt);
  check_structure(su);
  const UnifiedKeys keys{uni.batch.key_seqs, uni.batch.n_words, uni.batch.key_pos};
  const Partials pu = run_items(su, shape, plan.scale(), {uni.batch.kv}, q.data(), &keys);
  merge(su, pu, n_out, shape.head_dim, o, lse);
  test::expect_close(o, ref_o, kAtol, kRtol, "scheduled unified o");
  test::expect_close(lse, ref_lse, kAtol, kRtol, "scheduled unified lse");
}

}  // namespace

TEST_CASE("cuda schedule: executing its items and merging its lists reproduces the reference") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < 25; ++it) {
    CAPTURE(it);
    HeadShape shape;
    shape.head_dim = rng.pick<int>({64, 80, 96, 128, 256});
    shape.n_kv_heads = int(rng.uniform_int(1, 3));
    shape.n_q_heads = shape.n_kv_heads * rng.pick<int>({1, 2, 4, 8});
    const test::Tree tree = test::random_tree(rng, int(rng.uniform_int(1, 3)), int(rng.uniform_int(1, 40)));
    std::vector<int64_t> seg_len(tree.parent.size());
    for (size_t g = 0; g < seg_len.size(); ++g)
      seg_len[g] = rng.coin(0.1) ? 0 : rng.uniform_int(0, tree.parent[g] < 0 ? 3000 : 700);
    std::vector<int64_t> n_query(tree.paths.size());
    const bool multi = rng.coin(0.4);
    for (auto& n : n_query) n = multi ? rng.uniform_int(1, 5) : 1;
    // Keep the double emulation quick: 1.2e7 multiply-adds at most.
    test::shrink_to_budget(seg_len, tree.paths, n_query, shape, 1.2e7);
    INFO("heads " << shape.n_q_heads << "/" << shape.n_kv_heads << "/" << shape.head_dim << ", "
                  << tree.paths.size() << " sequences, " << seg_len.size() << " segments");
    // Few multiprocessors force long chunks; many force splitting.
    const int n_sm = rng.pick<int>({1, 8, 132, 2000});
    check_plan(rng, shape, rng.pick<DType>({DType::f32, DType::f16, DType::bf16}), rng.coin(), tree, seg_len, n_query,
               n_sm);
  }
}

TEST_CASE("cuda schedule: edges (empty segments, rows that see nothing, one key, causal queries)") {
  Rng rng(7);
  const HeadShape shape{8, 2, 64};
  const auto two_level = [](int64_t prefix, std::vector<int64_t> suffixes) {
    test::Tree t;
    t.parent.push_back(-1);
    for (size_t s = 0; s < suffixes.size(); ++s) {
      t.parent.push_back(0);
      t.paths.push_back({0, int(s) + 1});
    }
    std::vector<int64_t> len{prefix};
    len.insert(len.end(), suffixes.begin(), suffixes.end());
    return std::make_pair(t, len);
  };
  SUBCASE("empty prefix") {
    auto [t, len] = two_level(0, {5, 17, 300});
    check_plan(rng, shape, DType::f16, false, t, len, {1, 1, 1}, 132);
  }
  SUBCASE("empty suffixes, several queries: early rows see nothing") {
    auto [t, len] = two_level(2, {0, 0, 0});
    check_plan(rng, shape, DType::bf16, true, t, len, {4, 4, 4}, 132);
  }
  SUBCASE("no keys at all") {
    auto [t, len] = two_level(0, {0, 0});
    check_plan(rng, shape, DType::f16, false, t, len, {2, 2}, 132);
  }
  SUBCASE("one key") {
    auto [t, len] = two_level(1, {0});
    check_plan(rng, shape, DType::f16, false, t, len, {1}, 132);
  }
  SUBCASE("long prefix split across many blocks, 9 queries each (causal)") {
    auto [t, len] = two_level(6000, {40, 3});
    check_plan(rng, HeadShape{4, 1, 64}, DType::bf16, true, t, len, {9, 9}, 132);
  }
}

// The launch the headline point makes (llama3-8b heads, batch 128, prefix 32768, suffix 256),
// planned from lengths alone: the prefix goes to wide blocks, split into chunks; suffixes to narrow blocks.
TEST_CASE("cuda schedule: the headline decode step maps to wide prefix blocks and narrow suffix blocks") {
  const HeadShape shape{32, 8, 128};
  const int64_t batch = 128, prefix = 32768, suffix = 256;
  cuda::ScheduleOptions opt;
  opt.n_sm = 132;
  const Plan plan = cuda::plan(Tree::two_level(shape, prefix, std::vector<int64_t>(size_t(batch), suffix)), opt);
  const cuda::DeviceSchedule sc = cuda::lower(plan);
  check_structure(sc);
  // Prefix: 128 sequences x 4 heads = 512 stacked rows per KV head = 8 wide tiles, each split in chunks.
  int64_t wide_tokens = 0;
  for (const cuda::WorkItem& it : sc.items[cuda::kWide]) {
    CHECK(it.pass == 0);
    CHECK(it.n_rows == 64);
    CHECK((it.t1 - it.t0 >= cuda::kMinChunk || it.t1 == prefix));
    wide_tokens += it.t1 - it.t0;
  }
  CHECK(wide_tokens == 8 * 8 * prefix);  // every (KV head, row tile) covers the prefix exactly once
  CHECK(sc.items[cuda::kWide].size() > 64);  // split: more blocks than (KV head, tile) pairs
  // Suffixes: 4 stacked rows per KV head, one narrow block each.
  CHECK(sc.items[cuda::kNarrow].size() == size_t(batch * shape.n_kv_heads));
  for (const cuda::WorkItem& it : sc.items[cuda::kNarrow]) {
    CHECK(it.n_rows == 4);
    CHECK(it.t1 - it.t0 == suffix);
  }
  // Every output merges its prefix chunks and its one suffix part.
  const int64_t chunks = int64_t(sc.items[cuda::kWide].size()) / 64;
  for (int64_t i = 0; i < batch * shape.n_q_heads; ++i)
    CHECK(sc.out_begin[size_t(i + 1)] - sc.out_begin[size_t(i)] == chunks + 1);
}

}  // namespace test_attention_cuda_schedule
