// The K/V cache's layouts (kv_cache.hpp), without a model: a tree that changes while sequences run (segments
// added, forked, split and released between steps, ids reused), every step's attention against the
// reference over each sequence's own copy of its keys; each attention method's sequences (KvMethod) started,
// decoded beside prefill rows and ended, and what they store against what the method declares; bad steps. Each
// runs on f32 K/V and on q8_0 (inputs on the q8_0 grid, which it stores exactly, and f32 products: the same
// bound).
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>

#include <functional>
#include <map>

#include "attention_problem.hpp"
#include "cascade/reference.hpp"
#include "kernel_paths.hpp"
#include "model/kv_cache.hpp"

namespace test_kv_cache {

using namespace cascade;
using test::Rng;

namespace {

constexpr double kAtol = 5e-6, kRtol = 5e-5;           // f32 storage: as test_attention.cpp
const HeadShape kShape{6, 2, 16}, kShapeQ8{6, 1, 32};  // q8_0: head dims of whole blocks
constexpr int64_t kRow = 2 * 16;                       // K or V elements per token (either shape)

const HeadShape& shape_for(DType dt) { return dt == DType::q8_0 ? kShapeQ8 : kShape; }

// What one sequence has seen, kept apart from the cache: its K/V rows per layer (dense, f32), and the
// cache segment it appends to.
struct Seq {
  int leaf = -1;
  std::vector<std::vector<float>> k, v;  // (n_layer) x (n_tokens, n_kv_heads, head_dim)
  int64_t n_tokens() const { return int64_t(k[0].size()) / kRow; }
};

class Harness {
 public:
  // dt: the K/V type (q8_0: values on its grid, and f32 products, so that the bound stays f32's).
  Harness(Rng& rng, int n_layer, DType dt = DType::f32)
      : rng_(rng), n_layer_(n_layer), shape_(shape_for(dt)), dtype_(dt), cache(n_layer, shape_for(dt), dt) {}

  int64_t row() const { return kRow; }

  using Begin = std::function<void(const std::vector<KvCache::Entry>&)>;

  // One step: every sequence in `ids` appends n_rows[i] tokens; checks every layer's attention. begin: how the
  // step begins with its entries, in row order (c.begin_step when empty).
  void step(KvCache& c, const std::vector<int>& ids, std::map<int, Seq>& seqs, const std::vector<int64_t>& n_rows,
            const std::vector<int>& entry_ids, const Begin& begin = {}) {
    std::vector<KvCache::Entry> entries;
    for (size_t i = 0; i < ids.size(); ++i) entries.push_back({entry_ids[i], n_rows[i], seqs[ids[i]].n_tokens()});
    if (begin)
      begin(entries);
    else
      c.begin_step(entries);
    const int64_t n = c.step_rows();
    for (int il = 0; il < n_layer_; ++il) {
      std::vector<float> k(size_t(n * row())), v(k.size()), q(size_t(n * shape_.n_q_heads * shape_.head_dim));
      for (float& x : k) x = rng_.uniform(-1, 1);
      for (float& x : v) x = rng_.uniform(-1, 1);
      for (float& x : q) x = rng_.uniform(-1, 1);
      if (dtype_ == DType::q8_0) {
        test::round_to_q8_0(k);
        test::round_to_q8_0(v);
      }
      c.store(il, k.data(), v.data());
      std::vector<float> o(q.size(), 123.0f);
      c.attend(il, q.data(), o.data());
      // Each sequence's keys as it sees them, and the reference.
      std::vector<std::vector<KvView>> seq_kv;
      int64_t r = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        Seq& s = seqs[ids[i]];
        s.k[size_t(il)].insert(s.k[size_t(il)].end(), k.begin() + r * row(), k.begin() + (r + n_rows[i]) * row());
        s.v[size_t(il)].insert(s.v[size_t(il)].end(), v.begin() + r * row(), v.begin() + (r + n_rows[i]) * row());
        r += n_rows[i];
        seq_kv.push_back(
            {KvView::contiguous(s.k[size_t(il)].data(), s.v[size_t(il)].data(), int64_t(s.k[size_t(il)].size()) / row(),
                                shape_.n_kv_heads, shape_.head_dim)});
      }
      std::vector<double> ref(o.size()), ref_lse(size_t(n * shape_.n_q_heads));
      reference_attention(shape_, 1.0 / std::sqrt(double(shape_.head_dim)), seq_kv, n_rows, q.data(), ref.data(),
                          ref_lse.data());
      test::expect_close(o, ref, kAtol, kRtol, "layer " + std::to_string(il));
    }
  }

 private:
  Rng& rng_;
  int n_layer_;
  HeadShape shape_;
  DType dtype_;
  cpu::Int8Products int8_{false};
  cpu::Bf16Products bf16_{false};

 public:
  TreeCache cache;
};
void tree_changes(DType dt) {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  const int n_layer = 2;
  Harness h(rng, n_layer, dt);
  TreeCache& c = h.cache;
  std::map<int, Seq> seqs;  // live sequences by id
  int next_id = 0;
  const auto new_seq = [&](int leaf, const Seq* from, int64_t n_keep) {
    Seq s;
    s.leaf = leaf;
    s.k.resize(size_t(n_layer));
    s.v.resize(size_t(n_layer));
    if (from)
      for (int il = 0; il < n_layer; ++il) {
        s.k[size_t(il)].assign(from->k[size_t(il)].begin(), from->k[size_t(il)].begin() + n_keep * h.row());
        s.v[size_t(il)].assign(from->v[size_t(il)].begin(), from->v[size_t(il)].begin() + n_keep * h.row());
      }
    seqs[next_id] = std::move(s);
    return next_id++;
  };
  // A prompt of 40 tokens prefilled as one sequence, then decoding.
  const int first = new_seq(c.add_segment(-1), nullptr, 0);
  int n_forks = 0, n_splits = 0, n_inner_splits = 0, n_released = 0;
  for (int step = 0; step < 60; ++step) {
    CAPTURE(step);
    const int action = int(rng.uniform_int(0, 5));
    std::vector<int> live;
    for (auto& [id, s] : seqs) live.push_back(id);
    if (action == 0 && seqs.size() < 8) {
      // Fork at a sequence's end: its leaf gets two children, one for it and one for the new sequence.
      const int id = rng.pick(live);
      Seq& s = seqs[id];
      const int parent = s.leaf;
      const int fork = new_seq(c.add_segment(parent), &seqs[id], s.n_tokens());
      seqs[id].leaf = c.add_segment(parent);
      (void)fork;
      ++n_forks;
    } else if (action == 1 && seqs.size() < 8) {
      // A new sequence sharing only part of a segment on a sequence's path (its leaf or one above it, whose
      // children then move below the split): split it there, as a radix tree does.
      const int id = rng.pick(live);
      const int g = rng.pick(c.path(seqs[id].leaf));
      const int64_t n = c.n_tokens(g);
      if (n >= 2) {
        const int64_t keep = rng.uniform_int(1, n - 1);
        const int64_t at = c.start(g) + keep;
        const int n_children = c.n_children(g);
        const int tail = c.split(g, keep);
        CHECK(c.parent(tail) == g);
        CHECK(c.start(tail) == at);
        CHECK(c.n_children(tail) == n_children);
        for (auto& [sid, s] : seqs)  // a sequence ending in the split segment continues in the tail
          if (s.leaf == g) s.leaf = tail;
        new_seq(c.add_segment(g), &seqs[id], at);
        ++n_splits;
        n_inner_splits += n_children > 0;
      }
    } else if (action == 2 && seqs.size() > 1) {
      // A sequence finishes: its leaf goes, then every ancestor no other sequence needs.
      const int id = rng.pick(live);
      int g = seqs[id].leaf;
      seqs.erase(id);
      while (g >= 0 && c.n_children(g) == 0) {
        bool used = false;
        for (auto& [sid, s] : seqs) used = used || s.leaf == g;
        if (used) break;
        const int p = c.parent(g);
        c.release(g);
        CHECK_FALSE(c.live(g));
        ++n_released;
        g = p;
      }
    }
    // Every live sequence appends 1 token (40 at the first step: the prompt), some several.
    std::vector<int> ids, entry_ids;
    std::vector<int64_t> n_rows;
    for (auto& [id, s] : seqs) {
      ids.push_back(id);
      entry_ids.push_back(s.leaf);
      n_rows.push_back(step == 0 ? 40 : rng.coin(0.2) ? rng.uniform_int(2, 4) : 1);
    }
    h.step(c, ids, seqs, n_rows, entry_ids);
    int64_t total = 0;
    for (auto& [id, s] : seqs) {
      int64_t keys = 0;
      for (int g : c.path(s.leaf)) keys += c.n_tokens(g);
      CHECK(keys == s.n_tokens());  // the cache's path holds exactly the sequence's keys
      total += s.n_tokens();
    }
    CHECK(c.stored_tokens() <= total);  // shared spans are stored once
    CHECK(c.allocated_bytes() >= c.kv_bytes());
  }
  (void)first;
  MESSAGE(dtype_name(dt) << ": " << n_forks << " forks, " << n_splits << " splits (" << n_inner_splits
                         << " above other segments), " << n_released << " segments released");
}

}  // namespace

TEST_CASE("kv cache: the tree changes between steps while sequences run: fork, split, release, ids reused") {
  tree_changes(DType::f32);
}

TEST_CASE("kv cache: q8_0 K/V while the tree changes: fork, split, release, ids reused") { tree_changes(DType::q8_0); }

TEST_CASE("kv cache: reserved segments hold exactly their final length, a split gives back the moved tokens' room") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  for (DType dt : {DType::f32, DType::q8_0}) {
    CAPTURE(dtype_name(dt));
    Rng rng(seed);
    const int n_layer = 2;
    Harness h(rng, n_layer, dt);
    TreeCache& c = h.cache;
    // K and V of one token, every layer: q8_0 holds a byte a code and a 2-byte scale per 32 codes.
    const size_t token_bytes = size_t(dt == DType::q8_0 ? kRow + kRow / 32 * 2 : kRow * 4) * 2 * n_layer;
    std::map<int, Seq> seqs;
    const auto seq = [&](int id, int leaf, const Seq* from, int64_t n_keep) {
      Seq& s = seqs[id];
      s.leaf = leaf;
      s.k.assign(size_t(n_layer), {});
      s.v.assign(size_t(n_layer), {});
      if (from)
        for (int il = 0; il < n_layer; ++il) {
          s.k[size_t(il)].assign(from->k[size_t(il)].begin(), from->k[size_t(il)].begin() + n_keep * kRow);
          s.v[size_t(il)].assign(from->v[size_t(il)].begin(), from->v[size_t(il)].begin() + n_keep * kRow);
        }
    };
    const int64_t n_prompt = rng.uniform_int(20, 60), keep = rng.uniform_int(1, n_prompt - 1);
    const int root = c.add_segment(-1);
    c.reserve(root, n_prompt);
    CHECK(c.allocated_bytes() == size_t(n_prompt) * token_bytes);
    seq(0, root, nullptr, 0);
    h.step(c, {0}, seqs, {n_prompt}, {root});  // stored in one step, into the reserved room: no growth
    CHECK(c.allocated_bytes() == size_t(n_prompt) * token_bytes);
    CHECK(c.kv_bytes() == size_t(n_prompt) * token_bytes);

    // A prompt sharing the first `keep` tokens: the root is split there and keeps only their room.
    const int tail = c.split(root, keep);
    CHECK(c.allocated_bytes() == size_t(n_prompt) * token_bytes);
    seqs[0].leaf = tail;
    seq(1, c.add_segment(root), &seqs[0], keep);

    // The new branch is reserved for 30 tokens; with 12 stored, a third prompt diverges after 20 of them:
    // split_ahead leaves the branch room for those 20, and the rest of the way is reserved below it.
    const int branch = seqs[1].leaf;
    c.reserve(branch, 30);
    h.step(c, {1}, seqs, {12}, {branch});
    CHECK(c.allocated_bytes() == size_t(n_prompt + 30) * token_bytes);
    const int rest = c.split_ahead(branch, 20);
    c.reserve(rest, 10);
    CHECK(c.allocated_bytes() == size_t(n_prompt + 20 + 10) * token_bytes);
    h.step(c, {1}, seqs, {8}, {branch});  // the branch filled to its 20 tokens, then the rest: no growth
    seqs[1].leaf = rest;
    h.step(c, {1}, seqs, {10}, {rest});
    CHECK(c.allocated_bytes() == size_t(n_prompt + 30) * token_bytes);
    CHECK(c.kv_bytes() == c.allocated_bytes());

    c.release(rest);
    c.release(branch);
    CHECK(c.allocated_bytes() == size_t(n_prompt) * token_bytes);
    CHECK(c.stored_tokens() == n_prompt);
  }
}

TEST_CASE("kv cache: a unified buffer made from a tree attends what the tree attends") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (DType dt : {DType::f32, DType::q8_0}) {
    CAPTURE(dtype_name(dt));
    Harness h(rng, 2, dt);
    auto tree = std::make_unique<TreeCache>(2, shape_for(dt), dt);
    std::map<int, Seq> seqs;
    for (int i = 0; i < 3; ++i) {
      seqs[i].k.resize(2);
      seqs[i].v.resize(2);
    }
    // Prompt tree: a root shared by 0, 1, 2; 0 and 1 continue in one child, 2 in another.
    const int root = tree->add_segment(-1);
    h.step(*tree, {0}, seqs, {12}, {root});
    seqs[1] = seqs[0];
    seqs[2] = seqs[0];
    const int a = tree->add_segment(root), b = tree->add_segment(root);
    h.step(*tree, {0, 2}, seqs, {5, 3}, {a, b});
    seqs[1] = seqs[0];
    std::vector<int> seq_id;
    const std::unique_ptr<KvCache> u = start_sequences(AttnMethod::unified, std::move(tree), {a, a, b}, seq_id);
    CHECK(seq_id == std::vector<int>{0, 1, 2});
    CHECK(u->stored_tokens() == 12 + 5 + 3);
    for (int step = 0; step < 5; ++step) h.step(*u, {0, 1, 2}, seqs, {1, step % 2 ? 2 : 1, 1}, {0, 1, 2});
    CHECK(u->stored_tokens() == 20 + 5 * 3 + 2);
  }
}

TEST_CASE("kv cache: split copies each prompt per sequence and frees the tree") {
  Rng rng(test::fresh_seed());
  for (DType dt : {DType::f32, DType::q8_0}) {
    CAPTURE(dtype_name(dt));
    Harness h(rng, 2, dt);
    const std::unique_ptr<KvMethod> c = KvMethod::make(AttnMethod::split, 2, shape_for(dt), dt, 2);
    TreeCache& tree = c->tree();
    std::map<int, Seq> seqs;
    seqs[0].k.resize(2);
    seqs[0].v.resize(2);
    const int root = tree.add_segment(-1);
    h.step(tree, {0}, seqs, {9}, {root});
    const int a = tree.add_segment(root);
    h.step(tree, {0}, seqs, {4}, {a});
    seqs[1] = seqs[0];
    const std::vector<int> seq_id = c->start_after_prompts({a, a});
    CHECK(c->stored_tokens() == 2 * 13);
    CHECK_FALSE(tree.live(root));
    CHECK_FALSE(tree.live(a));
    for (int step = 0; step < 3; ++step) h.step(*c, {0, 1}, seqs, {1, 1}, seq_id);
  }
}

// A server's use of each method: prompts stay in the tree as a cache; sequences start from them in groups,
// decode in the same steps as new prompt tokens are prefilled, and end one by one.
TEST_CASE("kv method: each method's sequences decode beside prefill rows, store what it declares, and end") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  for (DType dt : {DType::f32, DType::q8_0})
    for (AttnMethod m : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
      CAPTURE(attn_method_name(m));
      CAPTURE(dtype_name(dt));
      Rng rng(seed);
      const int n_layer = 2;
      Harness h(rng, n_layer, dt);
      // auto with a made-up profile: what it regroups does not change what a row sees.
      const std::unique_ptr<KvMethod> km = KvMethod::make(m, n_layer, shape_for(dt), dt, 4, CostModel{});
      TreeCache& tree = km->tree();
      // Keys by name: P, the prompt of the first group (root + a); Q, the second (root + b); 0..3 the sequences.
      std::map<int, Seq> seqs;
      enum { P = 10, Q = 11 };
      seqs[P].k.resize(n_layer);
      seqs[P].v.resize(n_layer);
      const auto prefill_only = [&](const std::vector<KvCache::Entry>& e) { km->begin_steps({}, e); };
      const int root = tree.add_segment(-1);
      const int64_t n_root = rng.uniform_int(5, 30), n_a = rng.uniform_int(1, 9);
      h.step(*km, {P}, seqs, {n_root}, {root}, prefill_only);
      seqs[Q] = seqs[P];
      const int a = tree.add_segment(root);
      h.step(*km, {P}, seqs, {n_a}, {a}, prefill_only);

      // Two sequences after prompt P, room reserved for 6 tokens each: stored beside the tree, the copies the
      // method declares (P's path once; P once per sequence).
      const int64_t n_p = n_root + n_a;
      const std::vector<int> g0 = km->start({a, a}, {6, false});
      CHECK(km->stored_tokens() == n_p + KvMethod::copied_tokens(m, n_p, 2 * n_p));
      CHECK(km->reads_tree() == (m == AttnMethod::cascade || m == AttnMethod::auto_));
      seqs[0] = seqs[P];
      seqs[1] = seqs[P];
      std::vector<int> ids{g0[0], g0[1]};

      // Steps: the two sequences' rows first, then prompt Q's rows prefilled into a new child of the root.
      const int b = tree.add_segment(root);
      const auto joined = [&](const std::vector<KvCache::Entry>& e) {
        km->begin_steps({e.begin(), e.begin() + 2}, {e.begin() + 2, e.end()});
      };
      h.step(*km, {0, 1, Q}, seqs, {1, 1, 4}, {ids[0], ids[1], b}, joined);
      h.step(*km, {0, 1, Q}, seqs, {1, 1, 1}, {ids[0], ids[1], b}, joined);
      // One sequence after prompt Q, whose last segment is the caller's own: under cascade it continues there.
      const std::vector<int> g1 = km->start({b}, {3, true});
      if (km->reads_tree()) CHECK(g1[0] == b);
      seqs[2] = seqs[Q];
      ids.push_back(g1[0]);
      std::vector<int> segs;
      km->check_sequences(ids, segs);
      CHECK(segs.size() == (m == AttnMethod::unified ? 0u : 3u));
      for (int step = 0; step < 3; ++step) h.step(*km, {0, 1, 2}, seqs, {1, step == 1 ? 2 : 1, 1}, ids);

      // The first sequence ends: its K/V goes (and no other's), the others keep decoding.
      const int64_t before = km->stored_tokens();
      km->end(ids[0]);
      const int64_t own = seqs[0].n_tokens() - (km->reads_tree() ? n_p : 0);     // its own segment's tokens
      if (m != AttnMethod::unified) CHECK(km->stored_tokens() == before - own);  // (unified drops keys later)
      CHECK_THROWS_AS(km->check_sequences(ids, segs), Error);
      seqs.erase(0);
      ids.erase(ids.begin());
      km->check_sequences(ids, segs);
      for (int step = 0; step < 2; ++step) h.step(*km, {1, 2}, seqs, {1, 1}, ids);
      // Under cascade the caller's own segment stays when its sequence ends: the caller releases it.
      km->end(ids[1]);
      CHECK(tree.live(b));
      km->end(ids[0]);
      km->check_sequences({}, segs);
    }
}

TEST_CASE("kv cache: bad steps and bad changes are refused with an Error") {
  TreeCache c(1, {4, 2, 8}, DType::f32);
  const int root = c.add_segment(-1);
  CHECK_THROWS_WITH_AS(c.begin_step({{root, 1, 3}}), doctest::Contains("next position is 0"), Error);
  CHECK_THROWS_WITH_AS(c.begin_step({{root, 1, 0}, {root, 1, 0}}), doctest::Contains("twice"), Error);
  CHECK_THROWS_WITH_AS(c.begin_step({{7, 1, 0}}), doctest::Contains("does not exist"), Error);
  std::vector<float> kv(4 * 2 * 8, 0.5f), q(4 * 4 * 8, 0.5f), o(q.size());
  c.begin_step({{root, 4, 0}});
  c.store(0, kv.data(), kv.data());
  c.attend(0, q.data(), o.data());
  // A child created at a position its parent does not reach yet: the parent is incomplete.
  const int child = c.add_segment(root, 6);
  CHECK_THROWS_WITH_AS(c.begin_step({{child, 1, 6}}), doctest::Contains("ends at position 4"), Error);
  CHECK_THROWS_WITH_AS(c.release(root), doctest::Contains("children"), Error);
  CHECK_THROWS_WITH_AS(c.split(root, 0), doctest::Contains("cannot split"), Error);
  CHECK_THROWS_WITH_AS(c.split(root, 4), doctest::Contains("cannot split"), Error);
  // A change ends the step: its plan names the old segments.
  c.begin_step({{root, 1, 4}});
  c.release(child);
  CHECK_THROWS_WITH_AS(c.store(0, kv.data(), kv.data()), doctest::Contains("outside a step"), Error);
  // Released ids are handed out again.
  CHECK(c.add_segment(root) == child);
}

}  // namespace test_kv_cache
