// The K/V cache: one small interface (KvCache, what the forward pass calls), one type per layout.
//
//   TreeCache     a tree of segments per layer. A segment is a span of consecutive tokens; a sequence's keys
//                 are the segments on its path from a root, root first (tree.hpp). Shared spans are stored
//                 once and attended once per step for every sequence below them (cpu::run on the step's
//                 plan). The tree may change between any two steps: segments added, split, forked and
//                 released while other sequences keep running (a server's prefix tree).
//   UnifiedCache  every token in one buffer per layer, each key carrying the set of sequences that see it
//                 and its position; each step appends the new tokens and every query row scores every key
//                 under a mask (cpu::run_unified, llama.cpp's default).
//
// What each --attn method means lives in one place, below: one KvMethod per method, which generate() and the
// server's engine both run on (prompts prefilled into a tree, then sequences started, decoded and ended):
//   cascade  a sequence is a segment below its prompt's last one, so shared spans are attended once per step;
//   auto     the same, and each step's plan regroups spans where a shared pass does not pay (auto.hpp);
//   split    a sequence is a root segment holding a copy of its whole prompt, attended alone (llama.cpp's
//            per-sequence KV streams);
//   unified  a sequence is an id in a UnifiedCache beside the tree, which holds its prompt's K/V once for the
//            sequences that start from it.
//
// Storage: K and V of a segment (or of the unified buffer) are dense (n_tokens, n_kv_heads, head_dim)
// buffers per layer, grown by amortized reallocation (views are made per layer per step, so moving a buffer
// is harmless) or reserved at their final length where it is known (TreeCache::reserve). The element type is
// chosen per cache: f16 by default (llama.cpp's default cache type, so the comparison with it is like for like,
// and attention reads half the bytes of f32), f32 where a test wants the forward pass exact to f32 rounding, bf16,
// or q8_0 (int8 codes with their f16 scales (n_tokens, n_kv_heads, head_dim / 32) beside them, kv.hpp: K/V
// quantized as they are stored, about half of f16's bytes).
//
// A step: begin_step() names, in row order, whose (a segment's, or a unified sequence's) each group of the
// step's rows is, and plans the step's attention once; then for every layer store() appends their K/V and
// attend() runs the plan on that layer, each row seeing its own position and everything before it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/cpu/attention.hpp"
#include "cascade/dtype.hpp"
#include "cascade/kv.hpp"
#include "cascade/plan.hpp"

namespace cascade {

enum class AttnMethod { cascade, split, unified, auto_ };
const char* attn_method_name(AttnMethod m);
AttnMethod parse_attn_method(std::string_view s);  // "cascade", "split", "unified", "auto"; else Error

// One layer's K and V rows of one span: dense (n, n_kv_heads, head_dim) elements of the cache's type; q8_0: the
// codes, and their scales (n, n_kv_heads, head_dim / 32) in k_scales and v_scales (empty for the other types).
struct KvBuffer {
  std::vector<uint8_t> k, v, k_scales, v_scales;
  int64_t n = 0;
};

class KvCache {
 public:
  struct Entry {
    int id = 0;          // a segment (TreeCache) or a sequence (UnifiedCache)
    int64_t n_rows = 0;  // the step's rows for it, consecutive, in entry order
    int64_t pos = 0;     // position of its first row: right after the tokens it already holds
  };

  KvCache(int n_layer, const HeadShape& shape, DType dtype);
  virtual ~KvCache() = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int n_layer() const { return n_layer_; }
  const HeadShape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }

  // Starts a step and plans its attention (once for every layer). Throws Error naming a bad entry.
  virtual void begin_step(const std::vector<Entry>& entries) = 0;
  int64_t step_rows() const { return step_rows_; }
  // k, v: (step_rows, n_kv_heads, head_dim) f32. Appends them to layer il.
  virtual void store(int il, const float* k, const float* v) = 0;
  // q, o: (step_rows, n_q_heads, head_dim) f32. Must follow store(il, ...).
  virtual void attend(int il, const float* q, float* o) = 0;

  // Sliding windows, per layer (0: none; empty: none anywhere): layer il's rows see their last windows[il] keys
  // (tree.hpp). Kept until set again, for every step after; set between steps or right after begin_step.
  // Error on a count other than n_layer or a negative window.
  virtual void set_layer_windows(const std::vector<int64_t>& windows);
  int64_t layer_window(int il) const { return layer_windows_.empty() ? 0 : layer_windows_[size_t(il)]; }

  virtual int64_t stored_tokens() const = 0;  // tokens held (per layer), each stored copy counted
  size_t kv_bytes() const { return size_t(stored_tokens()) * size_t(n_layer_) * size_t(token_bytes()); }
  // Bytes one token's K and V take in one layer (q8_0: its scales counted).
  int64_t token_bytes() const { return 2 * (row_bytes() + scale_row_bytes()); }
  // Bytes the K/V buffers hold in memory: kv_bytes() plus room reserved or left by growth.
  virtual size_t allocated_bytes() const = 0;

 protected:
  int64_t row_bytes() const { return int64_t(shape_.n_kv_heads) * shape_.head_dim * dtype_size(dtype_); }
  // q8_0: bytes of one token's scales of K (or V); 0 for the other types.
  int64_t scale_row_bytes() const {
    return dtype_ == DType::q8_0 ? int64_t(shape_.n_kv_heads) * shape_.head_dim / kQ8Block * 2 : 0;
  }
  // A KvBuffer's buffers in the order K, V, K's scales, V's scales, and the bytes a token takes in each (a buffer
  // of 0 bytes a token stays empty).
  static std::array<std::vector<uint8_t>*, 4> planes(KvBuffer& b) { return {&b.k, &b.v, &b.k_scales, &b.v_scales}; }
  static std::array<const std::vector<uint8_t>*, 4> planes(const KvBuffer& b) {
    return {&b.k, &b.v, &b.k_scales, &b.v_scales};
  }
  std::array<size_t, 4> plane_bytes() const {
    const size_t r = size_t(row_bytes()), s = size_t(scale_row_bytes());
    return {r, r, s, s};
  }
  void append(KvBuffer& b, const float* k, const float* v, int64_t n) const;  // converts to the cache's type
  void append_raw(KvBuffer& b, const KvBuffer& src) const;                     // src's rows as they are
  void append_view(KvBuffer& b, const KvView& src) const;                      // a dense view of this cache's type
  KvView view(const KvBuffer& b) const;
  int64_t count_rows(const std::vector<Entry>& entries);  // sets step_rows_

  int n_layer_;
  HeadShape shape_;
  DType dtype_;
  int64_t step_rows_ = 0;
  std::vector<int64_t> layer_windows_;  // (n_layer), or empty
};

class TreeCache final : public KvCache {
 public:
  // regroup: auto's cost model regroups each step's tree (calibrated at the first step that shares a span
  // when none is set).
  TreeCache(int n_layer, const HeadShape& shape, DType dtype, bool regroup = false);

  // --- the tree; any of these may run between steps, while other sequences keep decoding ---
  // A new empty segment below parent (-1: a new root) whose first token will sit at position `start`;
  // start < 0: right after the parent's tokens (a fork). Reuses a released id. Returns its id.
  int add_segment(int parent, int64_t start = -1);
  // Splits seg after its first n_keep tokens: the rest move to a new child that takes over seg's children
  // (a radix tree's split when a new prefix diverges inside seg). Returns the new child's id.
  int split(int seg, int64_t n_keep);
  // The same split where seg holds at most n_keep tokens yet (it is still being filled): seg keeps what it holds
  // and will hold tokens up to start + n_keep; a new empty child starting there takes over seg's children.
  int split_ahead(int seg, int64_t n_keep);
  // Appends to dst, in every layer, the K/V of every segment on leaf's path (root first). dst must be an
  // empty root.
  void copy_path(int dst, int leaf);
  // Frees a segment without children; its id may be handed out again by add_segment.
  void release(int seg);
  // Frees every segment on the leaves' paths, each after its children. Error when one of them has a child off
  // those paths.
  void release_paths(const std::vector<int>& leaves);
  // Makes room in every layer of seg for n_tokens tokens in all, so that appends up to that length do not
  // reallocate (and a segment whose final length is known holds no more than that).
  void reserve(int seg, int64_t n_tokens);

  bool live(int seg) const { return seg >= 0 && seg < int(segs_.size()) && segs_[size_t(seg)].live; }
  int n_ids() const { return int(segs_.size()); }  // segment ids are below this
  int parent(int seg) const;
  int n_children(int seg) const;
  int64_t n_tokens(int seg) const;       // tokens stored (equal in every layer between steps)
  int64_t start(int seg) const;          // position of its first token: the tokens of its ancestors
  std::vector<int> path(int seg) const;  // root first, seg last
  KvView view(int seg, int il) const;    // layer il's K/V of the segment

  // auto's cost model: set one (a saved profile) to skip calibration; empty until set or calibrated.
  void set_cost_model(const CostModel& m) { cost_ = m; }
  const std::optional<CostModel>& cost_model() const { return cost_; }

  // Entries name segments; each appends its rows to its segment, which must hold exactly the tokens before
  // pos. Every segment on an entry's path must be complete: its tokens end where its child starts.
  void begin_step(const std::vector<Entry>& entries) override;
  void store(int il, const float* k, const float* v) override;
  void attend(int il, const float* q, float* o) override;
  const Plan& step_plan() const { return plan_; }
  // The step's plan for layers of sliding window `window` (0: step_plan()), made at the first layer that asks.
  const Plan& step_plan(int64_t window);

  int64_t stored_tokens() const override;
  size_t allocated_bytes() const override;

 private:
  struct Segment {
    int parent = -1;
    int64_t start = 0;
    bool live = false;
    int n_children = 0;
    std::vector<KvBuffer> layers;  // (n_layer)
  };
  void check_seg(int seg) const;
  void hand_children(int from, int to);  // every child of `from` but `to` moves below `to`
  Tree step_tree(const std::vector<Entry>& entries);

  bool regroup_;
  std::optional<CostModel> cost_;
  std::vector<Segment> segs_;
  std::vector<int> free_ids_;

  // the current step
  std::vector<Entry> entries_;
  std::vector<int> step_segs_;  // plan segment -> cache segment
  std::vector<int> compact_;    // cache segment -> plan segment, or -1
  Plan plan_;
  cpu::Options plan_opt_;                             // what plan_ was made with
  std::vector<std::pair<int64_t, Plan>> window_plans_;  // the step's plans under each layer window asked for
  bool in_step_ = false;
};

class UnifiedCache final : public KvCache {
 public:
  // An empty buffer for at most max_sequences sequences at once, which come and go (add_sequences,
  // remove_sequence): a server's unified K/V, as llama.cpp keeps its slots in one buffer.
  UnifiedCache(int n_layer, const HeadShape& shape, DType dtype, int max_sequences);

  int n_sequences() const { return n_seq_; }  // ids are in [0, n_sequences())
  bool live(int seq) const { return seq >= 0 && seq < n_seq_ && live_[size_t(seq)]; }
  // New sequences, sequence i continuing from segment seq_leaf[i] of `tree`: copies the K/V of every segment
  // on their paths into the buffer once, seen by the sequences below it (segments in order of first sight along
  // the paths, each root first). Returns their ids, in order. Error when fewer ids are free.
  std::vector<int> add_sequences(const TreeCache& tree, const std::vector<int>& seq_leaf);
  // The sequence stops seeing its keys and its id is free again; keys no sequence sees are dropped once they
  // outnumber the others (the buffer is compacted between steps).
  void remove_sequence(int seq);

  // Entries name sequences; each one's first row sits at pos.
  void begin_step(const std::vector<Entry>& entries) override;
  void store(int il, const float* k, const float* v) override;
  void attend(int il, const float* q, float* o) override;
  // Keys held, including keys no sequence sees any more that wait for the next compaction.
  int64_t stored_tokens() const override { return buf_.empty() ? 0 : buf_[0].n; }
  size_t allocated_bytes() const override;

 private:
  void compact();

  int n_seq_ = 0;
  int64_t n_words_ = 1;
  std::vector<char> live_;          // (n_seq)
  std::vector<int> free_ids_;
  int64_t n_dead_ = 0;              // keys no live sequence sees
  std::vector<KvBuffer> buf_;       // (n_layer)
  std::vector<uint64_t> key_seqs_;  // (keys, n_words)
  std::vector<int32_t> key_pos_;    // (keys)
  std::vector<int32_t> row_seq_, row_pos_;  // the current step's rows
  cpu::UnifiedPlan plan_;
};

// Two caches in one step: the step's first rows are the first cache's, the rest the second's (unified: sequences
// decoding in the buffer while prompts are prefilled into the tree). Neither is owned.
class JoinedCache final : public KvCache {
 public:
  JoinedCache(KvCache& first, KvCache& second);  // same layers, head shape and K/V type
  // Begins the step in each cache that gets rows (a cache without entries sits the step out).
  void begin_steps(const std::vector<Entry>& first, const std::vector<Entry>& second);
  void begin_step(const std::vector<Entry>& entries) override { begin_steps(entries, {}); }
  void store(int il, const float* k, const float* v) override;
  void attend(int il, const float* q, float* o) override;
  void set_layer_windows(const std::vector<int64_t>& windows) override;
  int64_t stored_tokens() const override { return first_.stored_tokens() + second_.stored_tokens(); }
  size_t allocated_bytes() const override { return first_.allocated_bytes() + second_.allocated_bytes(); }

 private:
  KvCache& first_;
  KvCache& second_;
  int64_t n_first_ = 0, n_second_ = 0;
};

// --- what each --attn method means (the one place) ---

// A run's K/V under one method: the tree every method prefills prompts into (tree()), and how sequences start
// after a prompt in it, end, and what they store beside it. As a KvCache it is the cache the forward pass runs
// on: begin_step() names running sequences by the ids start() gave them; begin_steps() adds, after theirs, rows
// prefilled into the tree.
class KvMethod : public KvCache {
 public:
  // max_sequences: sequences running at once, at most (a unified buffer's ids). cost_model: auto's profile (else
  // calibrated at the first step that shares a span).
  static std::unique_ptr<KvMethod> make(AttnMethod m, int n_layer, const HeadShape& shape, DType dtype,
                                        int max_sequences, const std::optional<CostModel>& cost_model = {});
  // The same around a tree that holds prompts already (made by make_prefill_cache for m).
  static std::unique_ptr<KvMethod> make(AttnMethod m, std::unique_ptr<TreeCache> tree, int max_sequences);

  // K/V tokens that starting sequences stores beside the tree: the copies of their prompts. The prompts' paths
  // hold path_tokens tokens, each segment counted once; seq_prompt_tokens counts each prompt once per sequence.
  static int64_t copied_tokens(AttnMethod m, int64_t path_tokens, int64_t seq_prompt_tokens);

  AttnMethod method() const { return method_; }
  TreeCache& tree() { return *tree_; }
  const TreeCache& tree() const { return *tree_; }
  // Whether running sequences read their prompts in the tree (cascade, auto). Otherwise they read copies, and
  // the prompts' segments may go once the sequences started.
  virtual bool reads_tree() const = 0;

  struct StartOptions {
    int64_t n_reserve = -1;  // tokens each sequence adds at most, reserved at the start; < 0: grown as they come
    bool own_leaf = false;   // the leaf is the caller's and nothing else hangs below it: a lone sequence may
                             // continue in it (cascade, auto); it stays the caller's to release
  };
  // Starts sequence i after the prompt ending at tree segment seq_leaf[i] (its path stored complete). Returns
  // their ids, in order.
  virtual std::vector<int> start(const std::vector<int>& seq_leaf, const StartOptions& opt) = 0;
  // start() for a tree that holds nothing but the prompts (generate()): their segments go once the sequences
  // read copies of them.
  std::vector<int> start_after_prompts(const std::vector<int>& seq_leaf);
  // The sequence's K/V goes; its id may be handed out again.
  virtual void end(int seq) = 0;
  // Checks that `running` are the live sequences (Error naming the first that is not); appends the tree
  // segments they hold to `segments`.
  virtual void check_sequences(const std::vector<int>& running, std::vector<int>& segments) const = 0;

  // A step: the rows of running sequences (entries name ids from start()), then rows prefilled into the tree
  // (entries name tree segments).
  virtual void begin_steps(const std::vector<Entry>& seqs, const std::vector<Entry>& prefill) = 0;
  void begin_step(const std::vector<Entry>& seqs) override { begin_steps(seqs, {}); }
  void store(int il, const float* k, const float* v) override { step_->store(il, k, v); }
  void attend(int il, const float* q, float* o) override { step_->attend(il, q, o); }
  void set_layer_windows(const std::vector<int64_t>& windows) override;
  int64_t stored_tokens() const override { return tree_->stored_tokens(); }
  size_t allocated_bytes() const override { return tree_->allocated_bytes(); }

 protected:
  KvMethod(AttnMethod m, std::unique_ptr<TreeCache> tree);
  AttnMethod method_;
  std::unique_ptr<TreeCache> tree_;
  KvCache* step_;  // the cache the current step runs on
};

// The K/V tokens a run holds at its largest: prompts of prompt_tokens tokens in all, stored as a tree of
// tree_tokens tokens, n_parallel sequences per prompt generating gen_tokens tokens in all (every sequence's
// own tokens summed).
double peak_kv_tokens(AttnMethod m, int64_t tree_tokens, int64_t prompt_tokens, int n_parallel, double gen_tokens);

// A cache to prefill the prompts into: every method prefills the same tree (auto's regroups its plans).
std::unique_ptr<TreeCache> make_prefill_cache(AttnMethod m, int n_layer, const HeadShape& shape, DType dtype);

// The sequences' start over a prefilled tree that holds nothing but the prompts: sequence s continues the prompt
// ending at segment seq_leaf[s]. Returns the method's cache (KvMethod::start_after_prompts) and, in seq_id, each
// sequence's id in it.
std::unique_ptr<KvCache> start_sequences(AttnMethod m, std::unique_ptr<TreeCache> prefilled,
                                         const std::vector<int>& seq_leaf, std::vector<int>& seq_id);

}  // namespace cascade
