// The structure of one step of attention: a forest of KV segments (their lengths only) and the sequences
// that attend them. No K/V pointers: the same Tree describes every layer of a step, and a Plan (plan.hpp)
// made from it runs each layer with that layer's K/V views.
//
// A sequence's keys are the concatenation of the segments on its path, from a root to its leaf. Every
// segment is attended once by all query rows of all sequences below it (their rows stacked into one
// matrix), and the partial states are merged along each path (state.hpp).
//
// Queries. Sequence s brings n_query(s) query tokens; they are laid out one after another in sequence
// order, so q has shape (n_rows, n_q_heads, head_dim) with n_rows = sum of n_query, and sequence s owns
// rows [row_begin(s), row_begin(s) + n_query(s)). Its query tokens are the LAST n_query(s) positions of its
// key sequence: token i sits at position n_keys(s) - n_query(s) + i and sees the keys at positions <= its
// own (causal inside the sequence's own tokens; decode, n_query = 1, sees everything). A row whose position
// is negative sees nothing: it gets the empty state (o = 0, lse = -inf).
//
// Sliding window. With window W > 0, a row at position p sees only its last W keys: positions [p - W + 1, p].
// A segment outside every window of the rows below it is attended by none of them (the schedule skips it), one
// partly inside is masked, and the merge stays exact: the same function as W keys read per sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cascade/error.hpp"

namespace cascade {

struct HeadShape {
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int group() const { return n_q_heads / n_kv_heads; }
  void validate() const {
    CASCADE_CHECK(n_q_heads > 0 && n_kv_heads > 0 && head_dim > 0, "head shape ", n_q_heads, "/", n_kv_heads, "/",
                  head_dim, ": counts and head_dim must be positive");
    CASCADE_CHECK(n_q_heads % n_kv_heads == 0, "n_q_heads (", n_q_heads, ") is not a multiple of n_kv_heads (",
                  n_kv_heads, ")");
  }
};

class Tree {
 public:
  struct Sequence {
    std::vector<int> path;  // segment ids, root first
    int64_t n_query = 0;
    int64_t row_begin = 0;  // first query row
    int64_t n_keys = 0;     // total keys on the path
    // For each path entry k: index of this sequence's first query token in segment_rows(path[k]).
    std::vector<int64_t> seg_row_begin;
  };
  // One query token below a segment: global row, and the segment's tokens it sees, [first, limit).
  struct SegmentRow {
    int64_t row = 0;
    int64_t limit = 0;
    int64_t first = 0;  // > 0 only under a sliding window
  };

  // n_tokens[g]: length of segment g (>= 0); paths[s]: segment ids of sequence s, root first; n_query[s] >= 0.
  // scale: the softmax scale (0: 1/sqrt(head_dim)); window: the sliding window in keys (0: none). Throws Error on
  // any inconsistency.
  static Tree build(const HeadShape& shape, std::vector<int64_t> n_tokens, const std::vector<std::vector<int>>& paths,
                    const std::vector<int64_t>& n_query, float scale = 0.0f, int64_t window = 0) {
    shape.validate();
    CASCADE_CHECK(paths.size() == n_query.size(), "plan: ", paths.size(), " paths but ", n_query.size(),
                  " query counts");
    CASCADE_CHECK(window >= 0, "plan: negative sliding window (", window, ")");
    Tree t;
    t.shape_ = shape;
    t.window_ = window;
    t.scale_ = scale != 0.0f ? scale : 1.0f / std::sqrt(float(shape.head_dim));
    CASCADE_CHECK(std::isfinite(t.scale_), "plan: softmax scale is not finite");
    for (size_t g = 0; g < n_tokens.size(); ++g)
      CASCADE_CHECK(n_tokens[g] >= 0, "plan: segment ", g, " has a negative length (", n_tokens[g], ")");
    t.n_tokens_ = std::move(n_tokens);
    t.add_sequences(paths, n_query);
    t.add_segment_rows();
    return t;
  }

  // The common case: one shared prefix of n_prefix tokens (segment 0), and below it one own segment per
  // sequence (segment s + 1, n_own[s] tokens, possibly 0), n_query query tokens per sequence.
  static Tree two_level(const HeadShape& shape, int64_t n_prefix, const std::vector<int64_t>& n_own,
                        int64_t n_query = 1, float scale = 0.0f, int64_t window = 0) {
    std::vector<int64_t> len{n_prefix};
    len.insert(len.end(), n_own.begin(), n_own.end());
    std::vector<std::vector<int>> paths;
    for (size_t s = 0; s < n_own.size(); ++s) paths.push_back({0, int(s) + 1});
    return build(shape, std::move(len), paths, std::vector<int64_t>(n_own.size(), n_query), scale, window);
  }

  // Every sequence on its own: sequence s attends only segment s (the "split" layout).
  static Tree independent(const HeadShape& shape, std::vector<int64_t> n_tokens, const std::vector<int64_t>& n_query,
                          float scale = 0.0f, int64_t window = 0) {
    std::vector<std::vector<int>> paths(n_tokens.size());
    for (size_t s = 0; s < n_tokens.size(); ++s) paths[s] = {int(s)};
    return build(shape, std::move(n_tokens), paths, n_query, scale, window);
  }

  // The same tree under another sliding window (0: none).
  Tree with_window(int64_t window) const {
    std::vector<std::vector<int>> paths;
    std::vector<int64_t> n_query;
    for (const Sequence& sq : seqs_) {
      paths.push_back(sq.path);
      n_query.push_back(sq.n_query);
    }
    return build(shape_, n_tokens_, paths, n_query, scale_, window);
  }

  const HeadShape& shape() const { return shape_; }
  float scale() const { return scale_; }
  int64_t window() const { return window_; }  // 0: none
  int64_t n_rows() const { return n_rows_; }
  int n_segments() const { return int(n_tokens_.size()); }
  int n_sequences() const { return int(seqs_.size()); }
  int64_t n_tokens(int g) const { return n_tokens_[size_t(g)]; }
  int parent(int g) const { return parent_[size_t(g)]; }  // kRoot for a root, kUnused for a segment on no path
  const Sequence& sequence(int s) const { return seqs_[size_t(s)]; }
  const std::vector<SegmentRow>& segment_rows(int g) const { return seg_rows_[size_t(g)]; }

  static constexpr int kRoot = -1;
  static constexpr int kUnused = -2;

 private:
  static constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();

  // Lays out the sequences' rows and checks that their paths form a forest.
  void add_sequences(const std::vector<std::vector<int>>& paths, const std::vector<int64_t>& n_query) {
    const int n_seg = n_segments();
    parent_.assign(size_t(n_seg), kUnused);
    seqs_.resize(paths.size());
    int64_t row = 0;
    for (size_t s = 0; s < paths.size(); ++s) {
      Sequence& sq = seqs_[s];
      CASCADE_CHECK(n_query[s] >= 0, "plan: sequence ", s, " has a negative query count (", n_query[s], ")");
      sq.path = paths[s];
      sq.n_query = n_query[s];
      sq.row_begin = row;
      CASCADE_CHECK(sq.n_query <= kMaxCount - row, "plan: the query rows overflow int64 at sequence ", s);
      row += sq.n_query;
      int prev = kRoot;
      for (size_t k = 0; k < sq.path.size(); ++k) {
        const int g = sq.path[k];
        CASCADE_CHECK(g >= 0 && g < n_seg, "plan: sequence ", s, " names segment ", g, ", out of range [0, ", n_seg,
                      ")");
        for (size_t k2 = 0; k2 < k; ++k2)
          CASCADE_CHECK(sq.path[k2] != g, "plan: sequence ", s, " visits segment ", g, " twice");
        CASCADE_CHECK(parent_[size_t(g)] == kUnused || parent_[size_t(g)] == prev, "plan: segment ", g,
                      " has two parents (", parent_[size_t(g)], " and ", prev, "): the paths do not form a tree");
        parent_[size_t(g)] = prev;
        CASCADE_CHECK(n_tokens_[size_t(g)] <= kMaxCount - sq.n_keys, "plan: sequence ", s,
                      " has more keys than int64 holds");
        sq.n_keys += n_tokens_[size_t(g)];
        prev = g;
      }
    }
    n_rows_ = row;
  }

  // Which query tokens attend each segment, and how far each sees into it.
  void add_segment_rows() {
    seg_rows_.assign(size_t(n_segments()), {});
    for (Sequence& sq : seqs_) {
      int64_t start = 0;
      for (int g : sq.path) {
        auto& rows = seg_rows_[size_t(g)];
        sq.seg_row_begin.push_back(int64_t(rows.size()));
        const int64_t len = n_tokens_[size_t(g)];
        for (int64_t i = 0; i < sq.n_query; ++i) {
          const int64_t pos = sq.n_keys - sq.n_query + i;
          const int64_t seen = pos + 1 - start;  // keys of the segment at or before the row's position
          const int64_t lim = std::clamp<int64_t>(seen, 0, len);
          const int64_t first = window_ > 0 && seen > window_ ? std::min(seen - window_, lim) : 0;
          rows.push_back({sq.row_begin + i, lim, first});
        }
        start += len;
      }
    }
  }

  HeadShape shape_;
  float scale_ = 1.0f;
  int64_t window_ = 0;
  int64_t n_rows_ = 0;
  std::vector<int64_t> n_tokens_;
  std::vector<int> parent_;
  std::vector<Sequence> seqs_;
  std::vector<std::vector<SegmentRow>> seg_rows_;
};

}  // namespace cascade
