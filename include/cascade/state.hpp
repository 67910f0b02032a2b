// Attention state of one query row over one set of keys, and the exact merge of two such states.
//
// For a query row q and a key set I with scores s_i = scale * q.k_i:
//   lse(I) = log sum_i exp(s_i)               NATURAL log. -inf for an empty (or fully masked) set.
//   o(I)   = sum_i exp(s_i - lse(I)) * v_i    the softmax-weighted value (head_dim floats); 0 when empty.
//
// The empty state is (o = 0, lse = -inf). Merging is commutative and associative, merging with the
// empty state is the identity, and merging two empty states gives the empty state (never NaN).
// Every function here works for any head dim and is plain scalar code the compiler vectorizes.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cascade/error.hpp"

namespace cascade {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Merges (o_b, lse_b) into (o_a, lse_a) in place. o_a, o_b: (head_dim).
inline void merge_state_inplace(float* o_a, float* lse_a, const float* o_b, float lse_b, int64_t head_dim) {
  const float la = *lse_a;
  if (lse_b == kNegInf) return;  // b empty: identity (also covers both empty)
  if (la == kNegInf) {           // a empty: take b
    for (int64_t i = 0; i < head_dim; ++i) o_a[i] = o_b[i];
    *lse_a = lse_b;
    return;
  }
  const float m = la > lse_b ? la : lse_b;
  const float wa = std::exp(la - m), wb = std::exp(lse_b - m);
  const float inv = 1.0f / (wa + wb);
  const float ca = wa * inv, cb = wb * inv;
  for (int64_t i = 0; i < head_dim; ++i) o_a[i] = ca * o_a[i] + cb * o_b[i];
  *lse_a = m + std::log(wa + wb);
}

// out = merge(a, b). out may alias a or b.
inline void merge_state(const float* o_a, float lse_a, const float* o_b, float lse_b, float* o_out,
                        float* lse_out, int64_t head_dim) {
  if (o_out != o_a) {
    for (int64_t i = 0; i < head_dim; ++i) o_out[i] = o_a[i];
  }
  *lse_out = lse_a;
  merge_state_inplace(o_out, lse_out, o_b, lse_b, head_dim);
}

// Merges n states into one. State j is (o[j] : head_dim floats, lse[j]). Exact in one pass over the
// weights: every state is scaled by exp(lse_j - max_lse). out may alias none of the inputs' o.
inline void merge_states(int64_t n, const float* const* o, const float* lse, float* o_out, float* lse_out,
                         int64_t head_dim) {
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) m = lse[j] > m ? lse[j] : m;
  for (int64_t i = 0; i < head_dim; ++i) o_out[i] = 0.0f;
  if (m == kNegInf) {
    *lse_out = kNegInf;
    return;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (lse[j] == kNegInf) continue;
    const float w = std::exp(lse[j] - m);
    sum += w;
    const float* oj = o[j];
    for (int64_t i = 0; i < head_dim; ++i) o_out[i] += w * oj[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < head_dim; ++i) o_out[i] *= inv;
  *lse_out = m + std::log(sum);
}

// Merges row-wise states: o_a (n_rows, head_dim) and lse_a (n_rows) absorb o_b, lse_b of the same shape.
inline void merge_states_inplace(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t n_rows,
                                 int64_t head_dim) {
  CASCADE_CHECK(n_rows >= 0 && head_dim > 0, "merge_states_inplace: n_rows (", n_rows, ") must be >= 0 and head_dim (",
                head_dim, ") > 0");
  CASCADE_CHECK(n_rows == 0 || (o_a && lse_a && o_b && lse_b), "merge_states_inplace: null state pointer with ",
                n_rows, " rows");
  for (int64_t r = 0; r < n_rows; ++r)
    merge_state_inplace(o_a + r * head_dim, lse_a + r, o_b + r * head_dim, lse_b[r], head_dim);
}

}  // namespace cascade
