// The baselines' layouts, built from a cascade tree and its K/V views (owning copies of the K/V):
//   split   : every sequence gets its own contiguous buffer holding all keys on its path (shared
//             segments copied once per sequence), as llama.cpp's per-sequence KV streams do;
//   unified : one buffer holding every segment once; each key carries the set of sequences that may see
//             it and its position, and the queries are masked (llama.cpp's unified KV cache).
// Both compute exactly what the tree computes; the tests and the benchmark use them side by side.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cascade/cpu/attention.hpp"
#include "cascade/kv.hpp"
#include "cascade/tree.hpp"

namespace cascade {

namespace layout_detail {
// K/V stored dense, (n_tokens, n_kv_heads, head_dim) elements; q8_0 scales (n_tokens, n_kv_heads, head_dim / 32)
// beside them (empty for the other types).
struct DenseKv {
  std::vector<uint8_t> k, v, k_scales, v_scales;
  size_t bytes() const { return k.size() + v.size() + k_scales.size() + v_scales.size(); }
};

// Appends tokens [0, kv.n_tokens) of kv to out.
inline void append_tokens(const KvView& kv, DenseKv& out) {
  const int64_t es = dtype_size(kv.dtype);
  const int64_t row_bytes = es * kv.head_dim, scale_bytes = kv.head_dim / kQ8Block * 2;
  const auto bytes = [](const void* p) { return static_cast<const uint8_t*>(p); };
  for (int64_t t = 0; t < kv.n_tokens; ++t) {
    for (int h = 0; h < kv.n_kv_heads; ++h) {
      const int64_t off = kv.offset(t, h) * es;
      out.k.insert(out.k.end(), bytes(kv.k) + off, bytes(kv.k) + off + row_bytes);
      out.v.insert(out.v.end(), bytes(kv.v) + off, bytes(kv.v) + off + row_bytes);
      if (kv.dtype != DType::q8_0) continue;
      const int64_t so = kv.scale_offset(t, h) * 2;
      out.k_scales.insert(out.k_scales.end(), bytes(kv.k_scales) + so, bytes(kv.k_scales) + so + scale_bytes);
      out.v_scales.insert(out.v_scales.end(), bytes(kv.v_scales) + so, bytes(kv.v_scales) + so + scale_bytes);
    }
  }
}

inline KvView dense_view(DType dt, const DenseKv& b, int64_t n_tokens, int n_kv_heads, int head_dim) {
  KvView kv;
  kv.dtype = dt;
  kv.n_tokens = n_tokens;
  kv.n_kv_heads = n_kv_heads;
  kv.head_dim = head_dim;
  kv.k = b.k.data();
  kv.v = b.v.data();
  if (dt == DType::q8_0) {
    kv.k_scales = b.k_scales.data();
    kv.v_scales = b.v_scales.data();
  }
  kv.stride_head = head_dim;
  kv.stride_token = int64_t(n_kv_heads) * head_dim;
  return kv;
}
}  // namespace layout_detail

struct SplitLayout {
  std::vector<layout_detail::DenseKv> kv;  // per sequence: (n_keys, n_kv_heads, head_dim)
  Tree tree;                               // Tree::independent: sequence s attends segment s
  std::vector<KvView> views;               // segment s: sequence s's buffer
  SplitLayout() = default;
  SplitLayout(SplitLayout&&) = default;  // the views point into the buffers: move, never copy
  SplitLayout& operator=(SplitLayout&&) = default;
  size_t kv_bytes() const {
    size_t n = 0;
    for (const auto& b : kv) n += b.bytes();
    return n;
  }
};

// All segments of a split layout take the dtype of the sequence's first segment; paths mixing dtypes
// are refused.
inline SplitLayout make_split(const Tree& tree, std::span<const KvView> kv) {
  const HeadShape& shape = tree.shape();
  const size_t n_seq = size_t(tree.n_sequences());
  SplitLayout out;
  out.kv.resize(n_seq);
  out.views.resize(n_seq);
  std::vector<int64_t> n_query(n_seq), n_keys(n_seq);
  for (size_t s = 0; s < n_seq; ++s) {
    const Tree::Sequence& sq = tree.sequence(int(s));
    const DType dt = sq.path.empty() ? DType::f32 : kv[size_t(sq.path[0])].dtype;
    for (int g : sq.path) {
      CASCADE_CHECK(kv[size_t(g)].dtype == dt, "make_split: sequence ", s, " mixes K/V dtypes");
      layout_detail::append_tokens(kv[size_t(g)], out.kv[s]);
    }
    out.views[s] = layout_detail::dense_view(dt, out.kv[s], sq.n_keys, shape.n_kv_heads, shape.head_dim);
    n_query[s] = sq.n_query;
    n_keys[s] = sq.n_keys;
  }
  out.tree = Tree::independent(shape, std::move(n_keys), n_query, tree.scale(), tree.window());
  return out;
}

struct UnifiedLayout {
  layout_detail::DenseKv kv;          // (n_keys, n_kv_heads, head_dim)
  std::vector<uint64_t> key_seqs;     // (n_keys, n_words)
  std::vector<int32_t> key_pos;       // (n_keys)
  std::vector<int32_t> row_seq, row_pos;  // (n_rows)
  cpu::UnifiedBatch batch;            // points into the vectors above
  float scale = 0;
  UnifiedLayout() = default;
  UnifiedLayout(UnifiedLayout&&) = default;  // batch points into the vectors: move, never copy
  UnifiedLayout& operator=(UnifiedLayout&&) = default;
  size_t kv_bytes() const { return kv.bytes(); }
};

// Every segment stored once, in segment order; all segments must share one dtype.
inline UnifiedLayout make_unified(const Tree& tree, std::span<const KvView> kv) {
  const HeadShape& shape = tree.shape();
  UnifiedLayout u;
  u.scale = tree.scale();
  const int n_seq = tree.n_sequences();
  const size_t n_seg = size_t(tree.n_segments());
  const int64_t n_words = std::max<int64_t>(1, (n_seq + 63) / 64);
  DType dt = n_seg ? kv[0].dtype : DType::f32;
  // Each segment's start position (the same in every sequence that passes through it) and its sequences.
  std::vector<int64_t> seg_start(n_seg, 0);
  std::vector<std::vector<int>> seg_seqs(n_seg);
  for (int s = 0; s < n_seq; ++s) {
    int64_t start = 0;
    for (int g : tree.sequence(s).path) {
      seg_start[size_t(g)] = start;
      seg_seqs[size_t(g)].push_back(s);
      start += tree.n_tokens(g);
    }
  }
  int64_t n_keys = 0;
  for (size_t g = 0; g < n_seg; ++g) {
    CASCADE_CHECK(kv[g].dtype == dt, "make_unified: segments mix K/V dtypes");
    layout_detail::append_tokens(kv[g], u.kv);
    for (int64_t t = 0; t < kv[g].n_tokens; ++t) {
      u.key_pos.push_back(int32_t(seg_start[g] + t));
      const size_t w0 = u.key_seqs.size();
      u.key_seqs.resize(w0 + size_t(n_words), 0);
      for (int s : seg_seqs[g]) u.key_seqs[w0 + size_t(s / 64)] |= uint64_t(1) << (s % 64);
    }
    n_keys += kv[g].n_tokens;
  }
  for (int s = 0; s < n_seq; ++s) {
    const Tree::Sequence& sq = tree.sequence(s);
    for (int64_t i = 0; i < sq.n_query; ++i) {
      u.row_seq.push_back(s);
      u.row_pos.push_back(int32_t(sq.n_keys - sq.n_query + i));
    }
  }
  u.batch.kv = layout_detail::dense_view(dt, u.kv, n_keys, shape.n_kv_heads, shape.head_dim);
  u.batch.key_seqs = u.key_seqs.data();
  u.batch.n_words = n_words;
  u.batch.key_pos = u.key_pos.data();
  u.batch.n_rows = int64_t(u.row_seq.size());
  u.batch.row_seq = u.row_seq.data();
  u.batch.row_pos = u.row_pos.data();
  u.batch.window = tree.window();
  return u;
}

}  // namespace cascade
