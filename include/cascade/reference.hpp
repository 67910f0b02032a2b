// The plain reference: double precision, direct loops, no tiling, no merging. Obviously right, slow.
// Tests compare every kernel against it element by element.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/kv.hpp"
#include "cascade/tree.hpp"

namespace cascade {

// Element i of head h of token t of K (base = kv.k) or V (base = kv.v), as a double: the plain reading of
// a view's layout (kv.hpp), without its helpers. q8_0: the code times its block's scale, from k_scales or
// v_scales as base is K or V.
inline double kv_element(const KvView& kv, const void* base, int64_t t, int64_t h, int64_t i) {
  int64_t off;
  if (kv.block_table) {
    off = int64_t(kv.block_table[t / kv.page_size]) * kv.stride_page + (t % kv.page_size) * kv.stride_token;
  } else {
    off = t * kv.stride_token;
  }
  off += h * kv.stride_head + i;
  switch (kv.dtype) {
    case DType::f32: return static_cast<const float*>(base)[off];
    case DType::f16: return double(to_float(static_cast<const f16*>(base)[off]));
    case DType::bf16: return double(to_float(static_cast<const bf16*>(base)[off]));
    case DType::q8_0: {
      const f16* scales = static_cast<const f16*>(base == kv.v ? kv.v_scales : kv.k_scales);
      return double(static_cast<const int8_t*>(base)[off]) * double(float(scales[off / 32]));
    }
  }
  return 0;
}

// Sequence s attends the concatenation of seq_kv[s] with n_query[s] query tokens, the last positions of
// its keys, causally (tree.hpp's convention), each seeing its last `window` keys only when window > 0.
// q: (sum n_query, n_q_heads, head_dim), rows in sequence order. o: same shape, lse: (rows, n_q_heads), natural
// log; a row that sees nothing gets (0, -inf).
inline void reference_attention(const HeadShape& shape, double scale, const std::vector<std::vector<KvView>>& seq_kv,
                                const std::vector<int64_t>& n_query, const float* q, double* o, double* lse,
                                int64_t window = 0) {
  const int64_t d = shape.head_dim;
  const int group = shape.n_q_heads / shape.n_kv_heads;
  int64_t row = 0;
  std::vector<double> scores;
  for (size_t s = 0; s < seq_kv.size(); ++s) {
    int64_t n_keys = 0;
    for (const KvView& kv : seq_kv[s]) n_keys += kv.n_tokens;
    for (int64_t i = 0; i < n_query[s]; ++i, ++row) {
      const int64_t pos = n_keys - n_query[s] + i;  // sees keys at positions <= pos
      for (int qh = 0; qh < shape.n_q_heads; ++qh) {
        const int kvh = qh / group;
        const float* qr = q + (row * shape.n_q_heads + qh) * d;
        double* orow = o + (row * shape.n_q_heads + qh) * d;
        scores.clear();
        double mx = -std::numeric_limits<double>::infinity();
        int64_t key = 0;
        for (const KvView& kv : seq_kv[s]) {
          for (int64_t t = 0; t < kv.n_tokens; ++t, ++key) {
            if (key > pos) break;
            if (window > 0 && key <= pos - window) {  // outside the window: weight 0
              scores.push_back(-std::numeric_limits<double>::infinity());
              continue;
            }
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += double(qr[c]) * kv_element(kv, kv.k, t, kvh, c);
            scores.push_back(dot * scale);
            mx = std::max(mx, scores.back());
          }
        }
        for (int64_t c = 0; c < d; ++c) orow[c] = 0;
        if (scores.empty()) {
          lse[row * shape.n_q_heads + qh] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double sum = 0;
        for (double& sc : scores) sum += (sc = std::exp(sc - mx));
        key = 0;
        for (const KvView& kv : seq_kv[s]) {
          for (int64_t t = 0; t < kv.n_tokens && key < int64_t(scores.size()); ++t, ++key) {
            const double w = scores[key] / sum;
            for (int64_t c = 0; c < d; ++c) orow[c] += w * kv_element(kv, kv.v, t, kvh, c);
          }
        }
        lse[row * shape.n_q_heads + qh] = mx + std::log(sum);
      }
    }
  }
}

// The reference of a tree: each sequence attends the segments on its path; kv[g] holds segment g.
inline void reference_attention(const Tree& tree, std::span<const KvView> kv, const float* q, double* o,
                                double* lse) {
  CASCADE_CHECK(int64_t(kv.size()) == tree.n_segments(), "reference: ", kv.size(), " K/V views for ",
                tree.n_segments(), " segments");
  std::vector<std::vector<KvView>> seq_kv(size_t(tree.n_sequences()));
  std::vector<int64_t> n_query(size_t(tree.n_sequences()));
  for (int s = 0; s < tree.n_sequences(); ++s) {
    for (int g : tree.sequence(s).path) {
      CASCADE_CHECK(kv[size_t(g)].n_tokens == tree.n_tokens(g), "reference: segment ", g, " has ",
                    kv[size_t(g)].n_tokens, " tokens, the tree ", tree.n_tokens(g));
      seq_kv[size_t(s)].push_back(kv[size_t(g)]);
    }
    n_query[size_t(s)] = tree.sequence(s).n_query;
  }
  reference_attention(tree.shape(), tree.scale(), seq_kv, n_query, q, o, lse, tree.window());
}

}  // namespace cascade
