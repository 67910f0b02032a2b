// The server's prompt cache: a radix tree over token ids that lives across requests, whose nodes are segments
// of a TreeCache (kv_cache.hpp). A prompt reuses the longest prefix any earlier request brought, whether its
// K/V is stored already or still being prefilled for another request; where a prompt leaves a node midway, the
// node is split (TreeCache::split, or split_ahead for the part not stored yet). The engine prefills a node's
// tokens parents first; sequences hang below nodes as segments of their own, outside the radix tree.
//
// Pins: a request pins the path of its prompt (the node holding its last token and every ancestor) while it
// needs that K/V; pinned nodes are never evicted. A node is evictable when no one pins it and it has no child
// segment (radix node or a sequence's segment); evict() frees evictable nodes, least recently used first,
// parents becoming evictable as their last child goes.
//
// Invariant: every token of a node is either stored or pinned (about to be prefilled). When the last pin of a
// node that is not fully stored goes (a request cancelled during its prefill), its unstored part leaves the
// tree: its children (all empty) are released and its tokens cut to what is stored, or the node released.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "model/kv_cache.hpp"

namespace cascade::server {

class PrefixCache {
 public:
  explicit PrefixCache(TreeCache& cache) : cache_(cache) {}

  struct Inserted {
    int node = -1;          // the node holding the last token; -1 for no tokens
    int64_t n_found = 0;    // leading tokens the tree had already (stored, or pinned by another request)
    int64_t n_stored = 0;   // of them, stored already when inserted
  };
  // Puts tokens into the tree and pins the result's path (unpin(result.node) when done with it). A node whose
  // tokens the list leaves (or ends in) midway is split there, so the result's node ends at the last token.
  Inserted insert(std::span<const int32_t> tokens);

  void pin(int node);    // node and its ancestors; node < 0: nothing
  void unpin(int node);  // undoes one pin(node)

  bool is_node(int seg) const { return seg >= 0 && seg < int(nodes_.size()) && nodes_[size_t(seg)].live; }
  int64_t length(int node) const;  // tokens of the node, stored or not
  int64_t stored(int node) const { return cache_.n_tokens(node); }
  const std::vector<int32_t>& tokens(int node) const;
  int pins(int node) const;
  // The node's segment and its ancestors, root first.
  std::vector<int> path(int node) const { return cache_.path(node); }

  // Frees evictable nodes, least recently used first, until at least n_tokens stored tokens are freed or none
  // is left. Returns the stored tokens freed.
  int64_t evict(int64_t n_tokens);

  int n_nodes() const;
  int64_t pinned_tokens() const;    // tokens (stored or not) of pinned nodes
  int64_t unpinned_tokens() const;  // stored tokens of nodes no one pins (the cache proper, evictable in time)
  int64_t evicted_tokens() const { return n_evicted_; }

  // Checks the invariants above and the tree's agreement with the cache (tests); Error naming the first broken.
  void check() const;

 private:
  struct Node {
    bool live = false;
    std::vector<int32_t> tokens;
    std::map<int32_t, int> children;  // by first token
    int pins = 0;
    uint64_t last_use = 0;
  };
  Node& node(int seg);
  const Node& node(int seg) const;
  std::map<int32_t, int>& children_of(int seg) { return seg < 0 ? roots_ : node(seg).children; }
  int add_node(int parent, int64_t start, std::span<const int32_t> tokens);
  int split(int seg, int64_t n_keep);
  void release_node(int seg);
  void drop_unstored(int seg);

  TreeCache& cache_;
  std::vector<Node> nodes_;  // by segment id; entries of segments that are not radix nodes stay dead
  std::map<int32_t, int> roots_;
  uint64_t clock_ = 0;
  int64_t n_evicted_ = 0;
};

}  // namespace cascade::server
