#include "server/prefix_cache.hpp"

#include <algorithm>
#include <queue>

#include "cascade/error.hpp"

namespace cascade::server {

PrefixCache::Node& PrefixCache::node(int seg) {
  CASCADE_CHECK(is_node(seg), "prefix cache: segment ", seg, " is not a node");
  return nodes_[size_t(seg)];
}
const PrefixCache::Node& PrefixCache::node(int seg) const {
  CASCADE_CHECK(is_node(seg), "prefix cache: segment ", seg, " is not a node");
  return nodes_[size_t(seg)];
}

int64_t PrefixCache::length(int n) const { return int64_t(node(n).tokens.size()); }
const std::vector<int32_t>& PrefixCache::tokens(int n) const { return node(n).tokens; }
int PrefixCache::pins(int n) const { return node(n).pins; }

int PrefixCache::add_node(int parent, int64_t start, std::span<const int32_t> tokens) {
  const int seg = cache_.add_segment(parent, start);
  cache_.reserve(seg, int64_t(tokens.size()));  // its K/V is stored to exactly that length
  if (size_t(seg) >= nodes_.size()) nodes_.resize(size_t(seg) + 1);
  Node& n = nodes_[size_t(seg)];
  n = Node{};
  n.live = true;
  n.tokens.assign(tokens.begin(), tokens.end());
  n.last_use = clock_;
  children_of(parent)[tokens.front()] = seg;
  return seg;
}

// seg keeps its first n_keep tokens; the rest go to a new child that takes over seg's children and pins.
int PrefixCache::split(int seg, int64_t n_keep) {
  const int tail = stored(seg) > n_keep ? cache_.split(seg, n_keep) : cache_.split_ahead(seg, n_keep);
  if (size_t(tail) >= nodes_.size()) nodes_.resize(size_t(tail) + 1);
  Node& head = nodes_[size_t(seg)];
  Node& t = nodes_[size_t(tail)];
  t = Node{};
  t.live = true;
  t.tokens.assign(head.tokens.begin() + n_keep, head.tokens.end());
  cache_.reserve(tail, int64_t(t.tokens.size()));
  t.children = std::move(head.children);
  t.pins = head.pins;
  t.last_use = head.last_use;
  head.tokens.resize(size_t(n_keep));
  head.children.clear();
  head.children[t.tokens.front()] = tail;
  return tail;
}

PrefixCache::Inserted PrefixCache::insert(std::span<const int32_t> tokens) {
  ++clock_;
  Inserted r;
  int at = -1;  // the deepest node matched so far
  size_t i = 0;
  while (i < tokens.size()) {
    const auto& ch = children_of(at);
    const auto it = ch.find(tokens[i]);
    if (it == ch.end()) break;
    const int c = it->second;
    const std::vector<int32_t>& ct = node(c).tokens;
    size_t k = 0;
    while (k < ct.size() && i + k < tokens.size() && ct[k] == tokens[i + k]) ++k;
    const bool midway = k < ct.size();
    r.n_stored += std::min<int64_t>(int64_t(k), stored(c));
    i += k;
    at = c;
    if (midway) {  // the list leaves c (or ends) inside it
      split(c, int64_t(k));
      break;
    }
  }
  r.n_found = int64_t(i);
  if (i < tokens.size()) at = add_node(at, int64_t(i), tokens.subspan(i));
  r.node = at;
  pin(at);
  return r;
}

void PrefixCache::pin(int n) {
  ++clock_;
  for (int g = n; g >= 0; g = cache_.parent(g)) {
    Node& nd = node(g);
    ++nd.pins;
    nd.last_use = clock_;
  }
}

void PrefixCache::unpin(int n) {
  ++clock_;
  for (int g = n; g >= 0;) {
    Node& nd = node(g);
    CASCADE_CHECK(nd.pins > 0, "prefix cache: node ", g, " unpinned more often than pinned");
    --nd.pins;
    nd.last_use = clock_;
    const int parent = cache_.parent(g);
    if (nd.pins == 0 && stored(g) < length(g)) drop_unstored(g);
    g = parent;
  }
}

// Unpinned and not fully stored: its children hold nothing yet (a node is filled after its parent) and go; the
// node keeps what it stores, or goes too.
void PrefixCache::drop_unstored(int seg) {
  std::vector<int> below;
  for (const auto& [tok, c] : node(seg).children) below.push_back(c);
  for (int c : below) {
    drop_unstored(c);
  }
  if (stored(seg) == 0) {
    release_node(seg);
  } else {
    node(seg).tokens.resize(size_t(stored(seg)));
  }
}

void PrefixCache::release_node(int seg) {
  Node& nd = node(seg);
  CASCADE_CHECK(nd.pins == 0 && nd.children.empty(), "prefix cache: releasing node ", seg,
                " that is pinned or has children");
  const int parent = cache_.parent(seg);
  children_of(parent).erase(nd.tokens.front());
  cache_.release(seg);
  nd = Node{};
}

int64_t PrefixCache::evict(int64_t n_tokens) {
  if (n_tokens <= 0) return 0;
  using Item = std::pair<uint64_t, int>;  // (last use, segment): the least recent on top
  std::priority_queue<Item, std::vector<Item>, std::greater<>> leaves;
  const auto evictable = [&](int g) { return is_node(g) && node(g).pins == 0 && cache_.n_children(g) == 0; };
  for (int g = 0; g < int(nodes_.size()); ++g)
    if (evictable(g)) leaves.push({nodes_[size_t(g)].last_use, g});
  int64_t freed = 0;
  while (freed < n_tokens && !leaves.empty()) {
    const int g = leaves.top().second;
    leaves.pop();
    const int parent = cache_.parent(g);
    freed += stored(g);
    release_node(g);
    if (parent >= 0 && evictable(parent)) leaves.push({nodes_[size_t(parent)].last_use, parent});
  }
  n_evicted_ += freed;
  return freed;
}

int PrefixCache::n_nodes() const {
  return int(std::count_if(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.live; }));
}

int64_t PrefixCache::pinned_tokens() const {
  int64_t n = 0;
  for (const Node& nd : nodes_)
    if (nd.live && nd.pins > 0) n += int64_t(nd.tokens.size());
  return n;
}

int64_t PrefixCache::unpinned_tokens() const {
  int64_t n = 0;
  for (int g = 0; g < int(nodes_.size()); ++g)
    if (nodes_[size_t(g)].live && nodes_[size_t(g)].pins == 0) n += stored(g);
  return n;
}

void PrefixCache::check() const {
  const auto check_children = [&](int parent, const std::map<int32_t, int>& ch) {
    for (const auto& [tok, c] : ch) {
      CASCADE_CHECK(is_node(c), "prefix cache: child ", c, " of ", parent, " is not a node");
      const Node& n = nodes_[size_t(c)];
      CASCADE_CHECK(!n.tokens.empty() && n.tokens.front() == tok, "prefix cache: node ", c, " is filed under token ",
                    tok, " but starts with another");
      CASCADE_CHECK(cache_.parent(c) == parent, "prefix cache: node ", c, "'s segment has parent ", cache_.parent(c),
                    ", its radix parent is ", parent);
      const int64_t start = parent < 0 ? 0 : cache_.start(parent) + int64_t(nodes_[size_t(parent)].tokens.size());
      CASCADE_CHECK(cache_.start(c) == start, "prefix cache: node ", c, " starts at ", cache_.start(c), ", not ",
                    start);
    }
  };
  check_children(-1, roots_);
  for (int g = 0; g < int(nodes_.size()); ++g) {
    const Node& n = nodes_[size_t(g)];
    if (!n.live) continue;
    CASCADE_CHECK(cache_.live(g), "prefix cache: node ", g, "'s segment was released");
    CASCADE_CHECK(stored(g) <= length(g), "prefix cache: node ", g, " stores more tokens than it has");
    CASCADE_CHECK(stored(g) == length(g) || n.pins > 0, "prefix cache: node ", g, " is neither stored nor pinned");
    const int p = cache_.parent(g);
    CASCADE_CHECK(p < 0 || is_node(p), "prefix cache: node ", g, " hangs below segment ", p, ", not a node");
    CASCADE_CHECK(p < 0 || nodes_[size_t(p)].pins >= n.pins, "prefix cache: node ", g,
                  " has more pins than its parent");
    CASCADE_CHECK(p < 0 || stored(p) == length(p) || stored(g) == 0,
                  "prefix cache: node ", g, " stores tokens below an incomplete parent");
    const auto& siblings = p < 0 ? roots_ : nodes_[size_t(p)].children;
    const auto it = siblings.find(n.tokens.front());
    CASCADE_CHECK(it != siblings.end() && it->second == g, "prefix cache: node ", g,
                  " is missing from its parent's children");
    check_children(g, n.children);
  }
}

}  // namespace cascade::server
