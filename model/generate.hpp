// Generation: n continuations of each of several prompts, decoded in parallel, one token per sequence per
// step, with the attention method of the caller's choice (kv_cache.hpp).
//
//   1. Prefill. The prompts' token ids become a radix tree (make_prompt_tree): every span shared by several
//      prompts is one node, stored and prefilled once. The nodes' tokens, parents first, are prefilled in
//      forward passes of at most n_batch rows: each node (or piece of one) is one entry of the step's tree, its
//      rows attending its ancestors and causally itself.
//   2. Sequence start. Every prompt gets n_parallel sequences, laid out as the method says (kv_cache.hpp's
//      KvMethod); sequence s = prompt * n_parallel + j samples with its own random stream s
//      (sampler.hpp), its first token from the prompt's last logits.
//   3. Decode steps (generate.cpp's decode_step) feed every active sequence's last token at once: the step's
//      attention is planned once, run in every layer, and each sequence samples its next token. A sequence
//      stops at an end-of-generation token ("eog", not part of its tokens), after n_predict tokens ("length"),
//      or when prompt + generated tokens fill the context n_ctx ("context").
// The prompt's prefill is the same for every method; only how decode steps store and attend K/V differs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cascade/dtype.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/sampler.hpp"

namespace cascade {

// Prompts as a radix tree over token ids: the longest common prefixes become shared nodes.
struct PromptTree {
  struct Node {
    int parent = -1;     // -1: a root
    int64_t start = 0;   // position of the node's first token
    std::vector<int32_t> tokens;
  };
  std::vector<Node> nodes;       // parents before children
  std::vector<int> prompt_node;  // per prompt: the node holding its last token
  int64_t n_tokens() const;      // tokens stored in the tree
};
// Prompts must not be empty (Error). Equal prompts share every node.
PromptTree make_prompt_tree(const std::vector<std::vector<int32_t>>& prompts);

struct GenerateParams {
  int n_predict = 64;   // tokens per sequence, at most
  int n_parallel = 4;   // sequences per prompt
  int64_t n_ctx = 0;    // positions per sequence (prompt + generated); 0: the model's training context
  int n_threads = 0;    // 0: all of the machine's; more than the machine has runs with all of them
  int n_batch = 512;    // prompt tokens per prefill pass (bounds the prefill's memory)
  AttnMethod attn = AttnMethod::auto_;  // cascade, regrouped where a shared pass does not pay
  DType kv_dtype = DType::f16;
  SamplerParams sampling;
  std::optional<CostModel> cost_model;  // auto: this profile instead of calibrating
  void validate() const;
};

struct SequenceResult {
  int prompt = 0;
  std::vector<int32_t> tokens;  // generated, without the end-of-generation token
  std::string stop;             // "eog", "length" or "context"
};

struct StepStat {
  double ms = 0;       // the whole step: planning, forward pass and sampling
  double attn_ms = 0;  // attention calls inside it (running the step's plan in every layer)
  double plan_ms = 0;  // planning the step's attention, once for all layers (KvCache::begin_step)
  int n_active = 0;    // sequences decoded in it
  size_t kv_bytes = 0;  // K/V stored after it, over all layers (each copy counted)
};

struct GenerateResult {
  std::vector<SequenceResult> sequences;
  PromptTree tree;
  int64_t n_prompt_tokens = 0;  // sum of the prompts' lengths
  int64_t n_prompt_stored = 0;  // of them, tokens prefilled and stored (the tree)
  int64_t n_ctx = 0;
  double prompt_ms = 0, prompt_attn_ms = 0;
  std::vector<StepStat> steps;
  int64_t n_decode_tokens = 0;   // tokens fed in decode steps
  int64_t kv_tokens = 0;         // stored K/V tokens at the end (each copy counted)
  std::optional<CostModel> cost_model;  // auto: the profile used (given or calibrated), if any was needed
  double calibrate_ms = 0;              // auto: time spent calibrating it (0 when given or not needed)
  size_t kv_bytes = 0;           // and their bytes over all layers
};

// on_step(index, stat) runs after every decode step (progress, periodic statistics). on_token(s, id) runs
// for every token that becomes part of sequence s, in order (its first from the prompt's logits, then one
// per decode step; never the end-of-generation token): streaming a sequence's text as it is generated.
// on_prefill(done, total) runs after every prefill pass, with the prompt tokens prefilled so far and in all:
// progress, or a check for interruption (an exception thrown there, as from on_step, leaves generate()).
GenerateResult generate(const llama::Model& model, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateParams& params, const std::function<bool(int32_t)>& is_eog,
                        const std::function<void(int, const StepStat&)>& on_step = {},
                        const std::function<void(int, int32_t)>& on_token = {},
                        const std::function<void(int64_t, int64_t)>& on_prefill = {});

}  // namespace cascade
