// The KV cache: a tree of segments per layer, and the step's attention through the cascade library.
//
// A segment is a span of consecutive tokens; a sequence's keys are the segments on its path from a root,
// root first (plan.hpp). Prompts are prefilled into the upper levels of the tree (shared spans once);
// every generating sequence then appends its own tokens to a segment of its own. What a sequence's own
// segment hangs from decides the method:
//   cascade  the sequence's segment is a child of its prompt's last segment: the prompt is stored once
//            and attended once per step for all sequences below it (cpu::attend on the tree's Plan);
//   split    the sequence's segment is a root holding a copy of its whole prompt (copy_path), attended
//            alone (Plan::independent), as llama.cpp's per-sequence KV streams;
//   unified  build_unified() moves every token into one buffer per layer, each key carrying the set of
//            sequences that see it and its position; each step appends the new tokens to the same buffer
//            and every query row scores every key under a mask (cpu::attend_unified, llama.cpp's default).
//
// Storage: K and V of a segment are dense (n_tokens, n_kv_heads, head_dim) buffers per layer, grown by
// amortized reallocation (views are rebuilt every step, so moving a buffer is harmless). The element
// type is chosen per cache: f16 by default (llama.cpp's default cache type, so the comparison with it is
// like for like, and attention reads half the bytes of f32), f32 where a test wants the forward pass
// exact to f32 rounding.
//
// A step: begin_step() names, in row order, which segment (or sequence, when unified) each group of the
// step's rows belongs to; then for every layer store() appends their K/V and attend() runs attention for
// their queries, each row seeing its own position and everything before it on its path.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/cpu/attention.hpp"
#include "cascade/dtype.hpp"
#include "cascade/plan.hpp"

namespace cascade {

enum class AttnMethod { cascade, split, unified, auto_ };
const char* attn_method_name(AttnMethod m);
AttnMethod parse_attn_method(std::string_view s);  // "cascade", "split", "unified", "auto"; else Error

class KvCache {
 public:
  KvCache(int n_layer, const HeadShape& shape, DType dtype, AttnMethod method);

  AttnMethod method() const { return method_; }
  // auto's cost model: set one (a saved profile) to skip calibration; empty until set or calibrated.
  void set_cost_model(const CostModel& m) { cost_ = m; }
  const std::optional<CostModel>& cost_model() const { return cost_; }
  DType dtype() const { return dtype_; }
  const HeadShape& shape() const { return shape_; }
  int n_layer() const { return n_layer_; }
  bool unified() const { return unified_built_; }

  // --- the tree ---
  // A new empty segment below parent (-1: a new root) whose first token will sit at position `start`;
  // start < 0: right after the parent's tokens (a fork). Returns its id.
  int add_segment(int parent, int64_t start = -1);
  int n_segments() const { return int(segs_.size()); }
  int parent(int seg) const;
  int64_t n_tokens(int seg) const;     // tokens stored (equal in every layer between steps)
  int64_t start(int seg) const;        // position of its first token: the tokens of its ancestors
  std::vector<int> path(int seg) const;  // root first, seg last
  // Appends to dst, in every layer, the K/V of every segment on leaf's path (root first). dst must be empty.
  void copy_path(int dst, int leaf);
  // Frees a segment's memory; it keeps its id but must no longer be on any path a step uses.
  void release(int seg);

  // --- unified ---
  // Builds the one-buffer layout: sequence s (s < seq_leaf.size()) sees the segments on seq_leaf[s]'s
  // path. Each of those segments is copied into the buffer once, then released. After this, step entries
  // name sequences, not segments.
  void build_unified(const std::vector<int>& seq_leaf);
  int n_sequences() const { return n_seq_; }

  // --- a step ---
  struct Entry {
    int id = 0;          // a segment (tree) or a sequence (unified)
    int64_t n_rows = 0;  // the step's rows for it, consecutive, in entry order
    int64_t pos = 0;     // position of its first row; the tree checks it equals start + n_tokens
  };
  void begin_step(std::vector<Entry> entries);
  int64_t step_rows() const { return step_rows_; }
  // k, v: (step_rows, n_kv_heads, head_dim) f32. Appends them to layer il.
  void store(int il, const float* k, const float* v);
  // q, o: (step_rows, n_q_heads, head_dim) f32. Must follow store(il, ...).
  void attend(int il, const float* q, float* o, const cpu::Options& opt = {});

  // --- what is stored ---
  int64_t stored_tokens() const;  // tokens held (per layer), each stored copy counted
  size_t kv_bytes() const;        // K and V bytes over all layers

 private:
  struct Buf {
    std::vector<uint8_t> k, v;
    int64_t n = 0;
  };
  struct Segment {
    int parent = -1;
    int64_t start = 0;
    bool released = false;
    std::vector<Buf> layers;  // (n_layer)
  };
  int64_t row_bytes() const { return int64_t(shape_.n_kv_heads) * shape_.head_dim * dtype_size(dtype_); }
  KvView view(const Buf& b) const;
  void append(Buf& b, const float* k, const float* v, int64_t n);
  void append_raw(Buf& b, const uint8_t* k, const uint8_t* v, int64_t n);
  void check_seg(int seg) const;

  int n_layer_;
  HeadShape shape_;
  DType dtype_;
  AttnMethod method_;
  std::optional<CostModel> cost_;  // auto: given, or calibrated at the first attend() with a shared span
  std::vector<Segment> segs_;

  // unified layout
  bool unified_built_ = false;
  int n_seq_ = 0;
  int64_t n_words_ = 1;
  std::vector<Buf> ubuf_;            // (n_layer)
  std::vector<uint64_t> key_seqs_;   // (keys, n_words)
  std::vector<int32_t> key_pos_;     // (keys)

  // current step
  std::vector<Entry> entries_;
  int64_t step_rows_ = 0;
  std::vector<std::vector<int>> step_paths_;  // tree: per entry, its path in compact segment ids
  std::vector<int> step_segs_;                // tree: compact id -> segment
  bool step_independent_ = false;             // every path is one segment (split)
  std::vector<int32_t> row_seq_, row_pos_;    // unified
};

}  // namespace cascade
