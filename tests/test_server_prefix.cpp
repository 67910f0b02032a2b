// The server's prefix tree (server/prefix_cache.hpp) over a TreeCache, without a model. Every stored K/V row
// is a fingerprint of the whole prefix that ends at it (as a real model's K/V depends on every token before),
// so a node reused, split or kept across evictions can be checked row by row against the prompt that uses it.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "cascade/error.hpp"
#include "server/prefix_cache.hpp"

namespace test_server_prefix {

using namespace cascade;
using server::PrefixCache;

namespace {

const HeadShape kShape{2, 1, 4};

// K and V of the token at position p of `tokens`: two hashes of tokens[0..p].
std::pair<std::array<float, 4>, std::array<float, 4>> fingerprint(const std::vector<int32_t>& tokens, size_t p) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i <= p; ++i) h = (h ^ uint64_t(tokens[i] + 1)) * 0x100000001B3ull, h ^= h >> 29;
  std::array<float, 4> k, v;
  for (int i = 0; i < 4; ++i) {
    k[size_t(i)] = float((h >> (8 * i)) & 0xFF);
    v[size_t(i)] = float((h >> (8 * i + 32)) & 0xFF);
  }
  return {k, v};
}

struct Fixture {
  TreeCache cache{1, kShape, DType::f32};
  PrefixCache prefix{cache};

  // Every token of the node's path, root first.
  std::vector<int32_t> path_tokens(int node) const {
    std::vector<int32_t> t;
    for (int g : prefix.path(node)) t.insert(t.end(), prefix.tokens(g).begin(), prefix.tokens(g).end());
    return t;
  }

  // Stores up to n of the node's missing tokens (its parent must be stored), fingerprinted by its path.
  void fill(int node, int64_t n = INT64_MAX) {
    const int64_t have = prefix.stored(node), rows = std::min(n, prefix.length(node) - have);
    if (rows <= 0) return;
    const std::vector<int32_t> toks = path_tokens(node);
    const int64_t start = cache.start(node);
    std::vector<float> k, v;
    for (int64_t r = 0; r < rows; ++r) {
      const auto [kr, vr] = fingerprint(toks, size_t(start + have + r));
      k.insert(k.end(), kr.begin(), kr.end());
      v.insert(v.end(), vr.begin(), vr.end());
    }
    cache.begin_step({{node, rows, start + have}});
    cache.store(0, k.data(), v.data());
  }
  // Stores the whole path of node, parents first.
  void fill_path(int node) {
    if (node < 0) return;
    for (int g : prefix.path(node)) fill(g);
  }

  // The stored rows on the node's path are the fingerprints of `prompt`'s prefixes.
  void expect_kv(int node, const std::vector<int32_t>& prompt) const {
    if (node < 0) return;
    for (int g : prefix.path(node)) {
      const KvView kv = cache.view(g, 0);
      for (int64_t t = 0; t < prefix.stored(g); ++t) {
        const int64_t p = cache.start(g) + t;
        REQUIRE(p < int64_t(prompt.size()));
        const auto [kr, vr] = fingerprint(prompt, size_t(p));
        const float* ks = static_cast<const float*>(kv.k) + t * kv.stride_token;
        const float* vs = static_cast<const float*>(kv.v) + t * kv.stride_token;
        for (int i = 0; i < 4; ++i) {
          REQUIRE(ks[i] == kr[size_t(i)]);
          REQUIRE(vs[i] == vr[size_t(i)]);
        }
      }
    }
  }
};

size_t lcp(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// A prompt that often shares a beginning with an earlier one: a prefix of one of them plus a random tail, over a
// small vocabulary, so nodes are reused and split at every depth.
std::vector<int32_t> next_prompt(std::mt19937& rng, const std::vector<std::vector<int32_t>>& earlier) {
  std::vector<int32_t> p;
  if (!earlier.empty() && rng() % 4 != 0) {
    const auto& e = earlier[rng() % earlier.size()];
    p.assign(e.begin(), e.begin() + ptrdiff_t(rng() % (e.size() + 1)));
  }
  const size_t tail = rng() % 12 + (p.empty() ? 1 : 0);
  for (size_t i = 0; i < tail; ++i) p.push_back(int32_t(rng() % 3));
  if (p.empty()) p.push_back(0);
  return p;
}

}  // namespace

TEST_CASE("prefix cache: a prompt reuses the longest prefix any earlier prompt brought, splitting nodes where they part") {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    Fixture f;
    std::vector<std::vector<int32_t>> prompts;
    std::vector<int> nodes;
    for (int i = 0; i < 40; ++i) {
      const std::vector<int32_t> p = next_prompt(rng, prompts);
      size_t want = 0;
      for (const auto& e : prompts) want = std::max(want, lcp(p, e));
      const PrefixCache::Inserted in = f.prefix.insert(p);
      CHECK(in.n_found == int64_t(want));
      CHECK(in.n_stored == int64_t(want));  // every earlier prompt was stored in full
      REQUIRE(in.node >= 0);
      // The node ends exactly at the prompt's last token, and its path spells the prompt.
      CHECK(f.path_tokens(in.node) == p);
      f.fill_path(in.node);
      f.prefix.check();
      prompts.push_back(p);
      nodes.push_back(in.node);
      // Splits move nodes' tails to new ids: every prompt's K/V is still where its tokens lead.
      for (size_t j = 0; j < prompts.size(); ++j) {
        const PrefixCache::Inserted again = f.prefix.insert(prompts[j]);
        CHECK(again.n_found == int64_t(prompts[j].size()));
        CHECK(again.n_stored == int64_t(prompts[j].size()));
        f.expect_kv(again.node, prompts[j]);
        f.prefix.unpin(again.node);
      }
    }
    // A tree holds each distinct prefix once.
    std::set<std::vector<int32_t>> distinct;
    for (const auto& p : prompts)
      for (size_t n = 1; n <= p.size(); ++n) distinct.insert(std::vector<int32_t>(p.begin(), p.begin() + ptrdiff_t(n)));
    CHECK(f.cache.stored_tokens() == int64_t(distinct.size()));
  }
}

TEST_CASE("prefix cache: random inserts, partial prefills, cancellations and evictions keep every pinned prompt's K/V") {
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    Fixture f;
    std::vector<std::vector<int32_t>> seen;
    struct Req {
      std::vector<int32_t> prompt;
      int node;
    };
    std::vector<Req> live;
    int n_evictions = 0, n_cancelled = 0, n_splits_ahead = 0;
    for (int op = 0; op < 300; ++op) {
      const unsigned what = rng() % 10;
      if (what < 4 || live.empty()) {  // a new request
        const std::vector<int32_t> p = next_prompt(rng, seen);
        const int before = f.prefix.n_nodes();
        const PrefixCache::Inserted in = f.prefix.insert(p);
        n_splits_ahead += f.prefix.n_nodes() > before + 1;
        CHECK(f.path_tokens(in.node) == p);
        seen.push_back(p);
        live.push_back({p, in.node});
      } else if (what < 7) {  // prefill some of a request's path: the first node not stored yet
        Req& r = live[rng() % live.size()];
        for (int g : f.prefix.path(r.node))
          if (f.prefix.stored(g) < f.prefix.length(g)) {
            f.fill(g, int64_t(rng() % 6 + 1));
            break;
          }
      } else if (what < 9) {  // a request ends (or is cancelled midway through its prefill)
        const size_t i = rng() % live.size();
        // Its node may have been split since: the prompt's tokens lead to its end.
        const PrefixCache::Inserted at = f.prefix.insert(live[i].prompt);
        f.prefix.unpin(at.node);
        n_cancelled += f.prefix.stored(at.node) < f.prefix.length(at.node);
        f.prefix.unpin(at.node);
        live.erase(live.begin() + ptrdiff_t(i));
      } else {  // evict
        const int64_t want = int64_t(rng() % 20 + 1), cached = f.prefix.unpinned_tokens();
        const int64_t freed = f.prefix.evict(want);
        CHECK(f.prefix.unpinned_tokens() == cached - freed);
        if (freed < want) {  // nothing evictable is left: every unpinned node has a child
          for (int g = 0; g < f.cache.n_ids(); ++g)
            if (f.prefix.is_node(g) && f.prefix.pins(g) == 0) CHECK(f.cache.n_children(g) > 0);
        }
        n_evictions += freed > 0;
      }
      f.prefix.check();
      for (const Req& r : live) {
        const PrefixCache::Inserted at = f.prefix.insert(r.prompt);  // pinned already: found in full
        CHECK(at.n_found == int64_t(r.prompt.size()));
        f.expect_kv(at.node, r.prompt);
        f.prefix.unpin(at.node);
      }
    }
    MESSAGE(seed << ": " << n_evictions << " evictions, " << n_cancelled << " cancelled midway, " << n_splits_ahead
                 << " inserts that split a node");
    // Everything ends: nothing is pinned, and evicting everything leaves an empty tree and cache.
    for (const Req& r : live) {
      const PrefixCache::Inserted at = f.prefix.insert(r.prompt);
      f.prefix.unpin(at.node);
      f.prefix.unpin(at.node);
    }
    CHECK(f.prefix.pinned_tokens() == 0);
    f.prefix.evict(INT64_MAX);
    CHECK(f.prefix.n_nodes() == 0);
    CHECK(f.cache.stored_tokens() == 0);
  }
}

TEST_CASE("prefix cache: eviction takes the least recently used leaves first, parents after their children") {
  Fixture f;
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {1, 2, 5, 6, 7}, c = {8, 9};
  for (const auto& p : {a, b, c}) {
    const PrefixCache::Inserted in = f.prefix.insert(p);
    f.fill_path(in.node);
    f.prefix.unpin(in.node);
  }
  // Touch a: b's tail is now the least recently used leaf, then c, then a's tail.
  f.prefix.unpin(f.prefix.insert(a).node);
  CHECK(f.prefix.evict(1) == 3);  // b's own {5, 6, 7}
  const PrefixCache::Inserted ib = f.prefix.insert(b);
  CHECK(ib.n_found == 2);
  CHECK(ib.n_stored == 2);
  f.prefix.unpin(ib.node);  // never prefilled: its new node leaves with its pin
  CHECK(f.prefix.n_nodes() == 3);  // {1,2} -> {3,4}, and {8,9}
  CHECK(f.prefix.evict(1) == 2);   // c
  CHECK(f.prefix.evict(3) == 4);   // a's tail, then {1, 2}, now a leaf
  CHECK(f.prefix.n_nodes() == 0);
  f.prefix.check();
}

TEST_CASE("prefix cache: a pinned node is never evicted, nor an unpinned one above it") {
  Fixture f;
  const std::vector<int32_t> a = {1, 2, 3}, b = {1, 2, 4};
  f.fill_path(f.prefix.insert(a).node);
  const PrefixCache::Inserted ib = f.prefix.insert(b);  // splits a's node: a now ends in the tail
  f.fill_path(ib.node);
  const int a_end = f.prefix.insert(a).node;
  CHECK(f.prefix.pins(a_end) == 2);
  f.prefix.unpin(a_end);
  f.prefix.unpin(a_end);
  CHECK(f.prefix.evict(100) == 1);  // a's {3}; {1, 2} is pinned through b
  CHECK(f.prefix.pinned_tokens() == 3);
  f.expect_kv(ib.node, b);
  // A child segment that is not a node (a sequence) keeps its parent too.
  const int seq = f.cache.add_segment(ib.node);
  f.prefix.unpin(ib.node);
  CHECK(f.prefix.evict(100) == 0);
  f.cache.release(seq);
  CHECK(f.prefix.evict(100) == 3);
  CHECK_THROWS_AS(f.prefix.unpin(ib.node), Error);
}

TEST_CASE("prefix cache: a prompt that ends inside a node still being prefilled splits it ahead of its K/V") {
  Fixture f;
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6};
  const PrefixCache::Inserted ia = f.prefix.insert(a);
  f.fill(ia.node, 2);  // {1, 2} stored, {3, 4, 5, 6} still to come
  const std::vector<int32_t> b = {1, 2, 3, 4};
  const PrefixCache::Inserted ib = f.prefix.insert(b);
  CHECK(ib.n_found == 4);
  CHECK(ib.n_stored == 2);
  CHECK(ib.node == ia.node);  // the head keeps its id and ends at b's end; a continues in the tail
  CHECK(f.prefix.length(ib.node) == 4);
  f.prefix.check();
  // The head fills up to 4, then the tail.
  f.fill(ib.node);
  const PrefixCache::Inserted again = f.prefix.insert(a);
  f.fill_path(again.node);
  f.expect_kv(again.node, a);
  f.expect_kv(ib.node, b);
  f.prefix.check();
}

}  // namespace test_server_prefix
