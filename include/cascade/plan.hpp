// The cascade plan: a forest of KV segments and the sequences that attend them.
//
// A sequence's keys are the concatenation of the segments on its path, from a root to its leaf. Every
// segment is attended once by all query rows of all sequences below it (their rows stacked into one
// matrix), and the partial states are merged along each path (state.hpp).
//
// Queries. Sequence s brings n_query(s) query tokens; the plan lays them out one after another in
// sequence order, so q has shape (n_rows, n_q_heads, head_dim) with n_rows = sum of n_query, and
// sequence s owns rows [row_begin(s), row_begin(s) + n_query(s)). Its query tokens are the LAST
// n_query(s) positions of its key sequence: token i sits at position n_keys(s) - n_query(s) + i and sees
// the keys at positions <= its own (causal inside the sequence's own tokens; decode, n_query = 1, sees
// everything). A row whose position is negative sees nothing: it gets the empty state (o = 0).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "cascade/kv.hpp"

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

class Plan {
 public:
  struct Sequence {
    std::vector<int> path;  // segment ids, root first
    int64_t n_query = 0;
    int64_t row_begin = 0;  // first query row
    int64_t n_keys = 0;     // total keys on the path
    // For each path entry k: index of this sequence's first query token in segment_rows(path[k]).
    std::vector<int64_t> seg_row_begin;
  };
  // One query token below a segment: global row, and how many of the segment's tokens it sees.
  struct SegmentRow {
    int64_t row = 0;
    int64_t limit = 0;
  };

  // segments: the KV spans; paths[s]: segment ids of sequence s, root first; n_query[s] >= 0.
  // scale: the softmax scale (default 1/sqrt(head_dim)). Throws Error on any inconsistency.
  static Plan build(const HeadShape& shape, std::vector<KvView> segments, const std::vector<std::vector<int>>& paths,
                    const std::vector<int64_t>& n_query, float scale = 0.0f) {
    shape.validate();
    CASCADE_CHECK(paths.size() == n_query.size(), "plan: ", paths.size(), " paths but ", n_query.size(),
                  " query counts");
    Plan p;
    p.shape_ = shape;
    p.scale_ = scale != 0.0f ? scale : 1.0f / std::sqrt(float(shape.head_dim));
    CASCADE_CHECK(std::isfinite(p.scale_), "plan: softmax scale is not finite");
    const int n_seg = int(segments.size());
    for (int g = 0; g < n_seg; ++g) {
      const KvView& kv = segments[g];
      const std::string what = "segment " + std::to_string(g);
      kv.validate(what.c_str());
      CASCADE_CHECK(kv.n_kv_heads == shape.n_kv_heads, "segment ", g, " has ", kv.n_kv_heads,
                    " KV heads but the plan has ", shape.n_kv_heads);
      CASCADE_CHECK(kv.head_dim == shape.head_dim, "segment ", g, " has head_dim ", kv.head_dim,
                    " but the plan has ", shape.head_dim);
    }
    p.segments_ = std::move(segments);
    p.parent_.assign(n_seg, kUnused);
    p.seg_rows_.assign(n_seg, {});
    p.seqs_.resize(paths.size());
    int64_t row = 0;
    for (size_t s = 0; s < paths.size(); ++s) {
      Sequence& sq = p.seqs_[s];
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
        CASCADE_CHECK(p.parent_[g] == kUnused || p.parent_[g] == prev, "plan: segment ", g,
                      " has two parents (", p.parent_[g], " and ", prev, "): the paths do not form a tree");
        p.parent_[g] = prev;
        CASCADE_CHECK(p.segments_[g].n_tokens <= kMaxCount - sq.n_keys, "plan: sequence ", s,
                      " has more keys than int64 holds");
        sq.n_keys += p.segments_[g].n_tokens;
        prev = g;
      }
    }
    p.n_rows_ = row;
    // Which query tokens attend each segment, and how far each sees into it.
    for (size_t s = 0; s < p.seqs_.size(); ++s) {
      Sequence& sq = p.seqs_[s];
      int64_t start = 0;
      for (int g : sq.path) {
        sq.seg_row_begin.push_back(int64_t(p.seg_rows_[g].size()));
        const int64_t len = p.segments_[g].n_tokens;
        for (int64_t i = 0; i < sq.n_query; ++i) {
          const int64_t pos = sq.n_keys - sq.n_query + i;
          int64_t lim = pos + 1 - start;
          lim = lim < 0 ? 0 : (lim > len ? len : lim);
          p.seg_rows_[g].push_back({sq.row_begin + i, lim});
        }
        start += len;
      }
    }
    return p;
  }

  // The common case: one shared prefix, one own segment per sequence (suffixes[s] may be empty),
  // n_query query tokens per sequence.
  static Plan two_level(const HeadShape& shape, const KvView& prefix, const std::vector<KvView>& suffixes,
                        int64_t n_query = 1, float scale = 0.0f) {
    std::vector<KvView> segs;
    segs.reserve(suffixes.size() + 1);
    segs.push_back(prefix);
    std::vector<std::vector<int>> paths;
    for (size_t s = 0; s < suffixes.size(); ++s) {
      segs.push_back(suffixes[s]);
      paths.push_back({0, int(s) + 1});
    }
    return build(shape, std::move(segs), paths, std::vector<int64_t>(suffixes.size(), n_query), scale);
  }

  // Every sequence on its own: sequence s attends only kv[s] (the "split" layout).
  static Plan independent(const HeadShape& shape, std::vector<KvView> kv, const std::vector<int64_t>& n_query,
                          float scale = 0.0f) {
    std::vector<std::vector<int>> paths(kv.size());
    for (size_t s = 0; s < kv.size(); ++s) paths[s] = {int(s)};
    return build(shape, std::move(kv), paths, n_query, scale);
  }

  const HeadShape& shape() const { return shape_; }
  float scale() const { return scale_; }
  int64_t n_rows() const { return n_rows_; }
  int n_segments() const { return int(segments_.size()); }
  int n_sequences() const { return int(seqs_.size()); }
  const KvView& segment(int g) const { return segments_[g]; }
  int parent(int g) const { return parent_[g]; }  // -1 for a root, -2 for a segment on no path
  const Sequence& sequence(int s) const { return seqs_[s]; }
  const std::vector<SegmentRow>& segment_rows(int g) const { return seg_rows_[g]; }

  static constexpr int kRoot = -1;
  static constexpr int kUnused = -2;

 private:
  static constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();

  HeadShape shape_;
  float scale_ = 1.0f;
  int64_t n_rows_ = 0;
  std::vector<KvView> segments_;
  std::vector<int> parent_;
  std::vector<Sequence> seqs_;
  std::vector<std::vector<SegmentRow>> seg_rows_;
};

}  // namespace cascade
