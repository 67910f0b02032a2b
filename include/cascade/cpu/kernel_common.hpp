// What every CPU attention kernel shares: the visibility masks, the per-thread scratch, the row tile.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/kv.hpp"
#include "cascade/state.hpp"

namespace cascade::cpu {

// Most query rows (stacked rows of one KV head) one work item carries; rows of a larger pass are split into
// tiles of this many.
inline constexpr int64_t kMaxRows = 128;
// Most stacked rows per KV head the few-rows kernel takes (kernel.hpp).
inline constexpr int64_t kFewRows = 8;
// Keys per step of the online softmax in the batch-invariant order (the tiled kernel's key step, kTileNK, and
// FewExactF32's): a row's max moves, and its weights are summed, once per step of this many keys counted from the
// call's first key.
inline constexpr int kTileStep = 8;

// The kernels' revision: raised whenever a change moves what a kernel costs, so that auto's profiles
// calibrated on older kernels (profile_cache.hpp keeps them per machine) are measured again, not reused. What
// each revision changed, and what it gained, is listed in docs/study.md (§20).
inline constexpr int kKernelRevision = 13;

// K/V token rows a kernel call asks for over its last tile: the start of what the calling thread attends next
// (the next segment of its work item, or its next item), so that a short item's reads are under way before it
// begins. An item of the per-sequence pass that is one tile long (K2's 64 own tokens) otherwise starts with
// every byte it reads missing in the cache. k == nullptr: nothing. Only the few-rows kernel reads it.
struct NextRows {
  const char* k = nullptr;  // the first row's K (the call's first KV head); V's at v
  const char* v = nullptr;
  int64_t n_rows = 0;  // token rows
  int64_t stride = 0;  // bytes from one token row to the next
  int64_t bytes = 0;   // bytes of a row the next call reads: its KV heads side by side
};

// Most token rows a NextRows names: one tile of the few-rows kernel.
inline constexpr int64_t kNextRows = 64;

// The first rows of tokens [t0, t1) of heads [kvh, kvh + n_heads) of kv, as NextRows (none if the range is empty).
inline NextRows next_rows(const KvView& kv, int kvh, int n_heads, int64_t t0, int64_t t1) {
  NextRows r;
  if (t1 <= t0 || n_heads <= 0) return r;
  const int64_t es = int64_t(dtype_size(kv.dtype));
  r.k = static_cast<const char*>(kv.k) + kv.offset(t0, kvh) * es;
  r.v = static_cast<const char*>(kv.v) + kv.offset(t0, kvh) * es;
  r.n_rows = std::min({kNextRows, t1 - t0, kv.run_length(t0)});
  r.stride = kv.stride_token * es;
  r.bytes = (int64_t(n_heads - 1) * kv.stride_head + kv.head_dim) * es;
  return r;
}

// Per-thread scratch of the kernels: numbered buffers of floats, 64-byte aligned, grown on demand and kept.
class Scratch {
 public:
  // What the thread attends after the current call (set by the caller for each call; see NextRows).
  NextRows next;
  // Set by the caller when the call's queries, rows and scale are the previous call's (the blocks of one work item):
  // a policy may keep the queries it packed then (TiledF32).
  bool same_q = false;
  // Keys of the same view after the call's range that the thread attends next (the item's next block): the tiled
  // driver asks for their first tile over its last one, as it does within a call.
  int64_t keys_after = 0;
  // The call continues the running state (max, sum, accumulated output) that the previous call on this scratch left
  // (same rows, heads and head dim: one block read from several views), and leaves its own unfinished for the next
  // (o and lse not written). The tiled driver and the few-rows kernel in the batch-invariant order honor them.
  bool carry_in = false, carry_out = false;
  static constexpr int kSlots = 8;
  // Buffer `slot` with room for at least n floats; its contents are unspecified.
  float* get(int slot, int64_t n) {
    Buf& b = bufs_[slot];
    if (b.size < n) {
      const int64_t size = std::max<int64_t>(n, b.size + b.size / 2);
      b.data.reset(static_cast<float*>(::operator new(size_t(size) * sizeof(float), std::align_val_t(64))));
      b.size = size;
    }
    return b.data.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  struct Buf {
    std::unique_ptr<float, Free> data;
    int64_t size = 0;
  };
  Buf bufs_[kSlots];
};

// Visibility: row r sees tokens [first[r], limit[r]) of the span (causal, sliding window and empty-row handling;
// first == nullptr: from token 0).
struct LimitMask {
  const int64_t* limit;            // (R): per stacked row
  const int64_t* first = nullptr;  // (R), or none
  bool visible(int64_t r, int64_t key) const { return key < limit[r] && (!first || key >= first[r]); }
  // Whether rows [r0, r0 + n_rows) all see keys [a, a + n).
  bool all_visible(int64_t r0, int64_t n_rows, int64_t a, int64_t n) const {
    for (int64_t r = r0; r < r0 + n_rows; ++r)
      if (limit[r] < a + n || (first && first[r] > a)) return false;
    return true;
  }
  // bits[j], j < n: bit i set when row r0 + i (i < n_lanes <= 32) sees key a + j.
  void lane_bits(int64_t r0, int n_lanes, int64_t a, int64_t n, uint32_t* bits) const {
    for (int64_t j = 0; j < n; ++j) bits[j] = 0;
    for (int i = 0; i < n_lanes; ++i) {
      const int64_t lo = first ? std::clamp<int64_t>(first[r0 + i] - a, 0, n) : 0;
      const int64_t vis = std::clamp<int64_t>(limit[r0 + i] - a, 0, n);
      for (int64_t j = lo; j < vis; ++j) bits[j] |= uint32_t(1) << i;
    }
  }
};

// Visibility in a unified buffer (one KV buffer for all sequences, as llama.cpp's unified cache):
// key j belongs to the sequences whose bits are set in key_seqs[j * n_words ...] and sits at key_pos[j];
// row r is a token of sequence row_seq[r] at position row_pos[r]. Visible: same sequence and pos <= pos, and
// under a sliding window (window > 0) pos > pos - window.
struct UnifiedMask {
  const uint64_t* key_seqs;  // (n_keys, n_words)
  int64_t n_words;
  const int32_t* key_pos;  // (n_keys)
  const int32_t* row_seq;  // (R)
  const int32_t* row_pos;  // (R)
  int64_t window = 0;
  bool in_window(int64_t key_p, int64_t row_p) const { return window <= 0 || key_p > row_p - window; }
  bool visible(int64_t r, int64_t key) const {
    const int32_t seq = row_seq[r];
    return (key_seqs[key * n_words + (seq >> 6)] >> (seq & 63) & 1) && key_pos[key] <= row_pos[r] &&
           in_window(key_pos[key], row_pos[r]);
  }
  bool all_visible(int64_t r0, int64_t n_rows, int64_t a, int64_t n) const {
    int32_t min_pos = INT32_MAX, max_pos = INT32_MIN;
    for (int64_t r = r0; r < r0 + n_rows; ++r) {
      min_pos = std::min(min_pos, row_pos[r]);
      max_pos = std::max(max_pos, row_pos[r]);
    }
    for (int64_t key = a; key < a + n; ++key)
      if (key_pos[key] > min_pos || !in_window(key_pos[key], max_pos)) return false;
    for (int64_t r = r0; r < r0 + n_rows; ++r) {
      const int32_t seq = row_seq[r];
      if (r > r0 && seq == row_seq[r - 1]) continue;
      for (int64_t key = a; key < a + n; ++key)
        if (!(key_seqs[key * n_words + (seq >> 6)] >> (seq & 63) & 1)) return false;
    }
    return true;
  }
  // bits[j], j < n: bit i set when row r0 + i (i < n_lanes <= 32) sees key a + j. The rows' distinct
  // sequences are collected first, so a key costs one test per sequence rather than per row.
  void lane_bits(int64_t r0, int n_lanes, int64_t a, int64_t n, uint32_t* bits) const {
    int32_t seqs[32];
    uint32_t lanes[32];
    int n_seqs = 0;
    int32_t min_pos = INT32_MAX, max_pos = INT32_MIN;
    for (int i = 0; i < n_lanes; ++i) {
      const int32_t seq = row_seq[r0 + i];
      min_pos = std::min(min_pos, row_pos[r0 + i]);
      max_pos = std::max(max_pos, row_pos[r0 + i]);
      int k = 0;
      while (k < n_seqs && seqs[k] != seq) ++k;
      if (k == n_seqs) {
        seqs[n_seqs] = seq;
        lanes[n_seqs++] = 0;
      }
      lanes[k] |= uint32_t(1) << i;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = a + j;
      const uint64_t* w = key_seqs + key * n_words;
      uint32_t b = 0;
      for (int k = 0; k < n_seqs; ++k)
        if (w[seqs[k] >> 6] >> (seqs[k] & 63) & 1) b |= lanes[k];
      if (key_pos[key] > min_pos || !in_window(key_pos[key], max_pos))
        for (int i = 0; i < n_lanes; ++i)
          if (key_pos[key] > row_pos[r0 + i] || !in_window(key_pos[key], row_pos[r0 + i])) b &= ~(uint32_t(1) << i);
      bits[j] = b;
    }
  }
};

}  // namespace cascade::cpu
