#include "model/generate.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>

#include "cascade/cpu/calibrate.hpp"
#include "cascade/error.hpp"

namespace cascade {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Adds the nodes of the prompts idx (sorted by their tokens, all equal on [0, depth)) below parent.
void add_nodes(PromptTree& tree, const std::vector<std::vector<int32_t>>& prompts, const std::vector<int>& idx,
               size_t depth, int parent) {
  const auto& first = prompts[idx.front()];
  const auto& last = prompts[idx.back()];
  // Sorted: the common prefix of the group is the common prefix of its first and last members.
  size_t lcp = depth;
  while (lcp < first.size() && lcp < last.size() && first[lcp] == last[lcp]) ++lcp;
  int node = parent;
  if (lcp > depth) {
    PromptTree::Node n;
    n.parent = parent;
    n.start = int64_t(depth);
    n.tokens.assign(first.begin() + depth, first.begin() + lcp);
    tree.nodes.push_back(std::move(n));
    node = int(tree.nodes.size()) - 1;
  }
  size_t i = 0;
  for (; i < idx.size() && prompts[idx[i]].size() == lcp; ++i) tree.prompt_node[idx[i]] = node;
  while (i < idx.size()) {  // the rest, grouped by their token at lcp
    size_t j = i;
    while (j < idx.size() && prompts[idx[j]][lcp] == prompts[idx[i]][lcp]) ++j;
    add_nodes(tree, prompts, std::vector<int>(idx.begin() + i, idx.begin() + j), lcp, node);
    i = j;
  }
}

}  // namespace

int64_t PromptTree::n_tokens() const {
  int64_t n = 0;
  for (const Node& nd : nodes) n += int64_t(nd.tokens.size());
  return n;
}

PromptTree make_prompt_tree(const std::vector<std::vector<int32_t>>& prompts) {
  PromptTree tree;
  tree.prompt_node.assign(prompts.size(), -1);
  if (prompts.empty()) return tree;
  for (size_t p = 0; p < prompts.size(); ++p) CASCADE_CHECK(!prompts[p].empty(), "prompt ", p, " has no tokens");
  std::vector<int> idx(prompts.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return prompts[a] < prompts[b]; });
  add_nodes(tree, prompts, idx, 0, -1);
  return tree;
}

void GenerateParams::validate() const {
  CASCADE_CHECK(n_predict >= 0, "the number of tokens to predict must be >= 0 (got ", n_predict, ")");
  CASCADE_CHECK(n_parallel >= 1, "the number of sequences per prompt must be >= 1 (got ", n_parallel, ")");
  CASCADE_CHECK(n_ctx >= 0, "the context size must be >= 0 (got ", n_ctx, ")");
  CASCADE_CHECK(n_threads >= 0, "the number of threads must be >= 0 (got ", n_threads, ")");
  CASCADE_CHECK(n_batch >= 1, "the prefill batch must be >= 1 token (got ", n_batch, ")");
  sampling.validate();
}

namespace {

// One generate() call: the prompts' prefill, the sequences' start, then decode steps until every sequence
// has stopped. Runs inside generate's task arena.
class Generation {
 public:
  Generation(const llama::Model& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateParams& params,
             const std::function<bool(int32_t)>& is_eog, const std::function<void(int, int32_t)>& on_token,
             GenerateResult& res)
      : model_(model), hp_(model.hparams()), prompts_(prompts), params_(params), is_eog_(is_eog),
        on_token_(on_token), res_(res), n_seq_(int(prompts.size()) * params.n_parallel) {}

  void prefill(const std::function<void(int64_t, int64_t)>& on_prefill);
  void start_sequences();
  bool decode_step(int step, const std::function<void(int, const StepStat&)>& on_step);
  void finish();

 private:
  void accept(int s, int32_t tok);

  const llama::Model& model_;
  const llama::Hparams& hp_;
  const std::vector<std::vector<int32_t>>& prompts_;
  const GenerateParams& params_;
  const std::function<bool(int32_t)>& is_eog_;
  const std::function<void(int, int32_t)>& on_token_;
  GenerateResult& res_;
  const int n_seq_;
  std::unique_ptr<KvMethod> kv_;       // the prompts' tree, then the sequences as the method lays them out
  std::vector<float> prompt_logits_;  // (n_prompts, n_vocab): each prompt's last row
  std::vector<Sampler> samplers_;
  std::vector<int> seq_id_;        // each sequence's id in kv_ (KvMethod::start)
  std::vector<int64_t> next_pos_;  // position of each sequence's last sampled token
  std::vector<char> active_;
};

// Every node of the prompt tree once, in order (parents first), in passes of at most n_batch rows; each
// node (or piece of one) in a pass is one entry of its step, its rows attending its ancestors and
// causally itself. Keeps the last row's logits of every prompt.
void Generation::prefill(const std::function<void(int64_t, int64_t)>& on_prefill) {
  const PromptTree& tree = res_.tree;
  kv_ = KvMethod::make(params_.attn, int(hp_.n_layer), hp_.head_shape(), params_.kv_dtype, n_seq_,
                       params_.cost_model);
  TreeCache& prompt_cache = kv_->tree();
  struct Row {
    int node;
    int64_t i;  // index in the node
  };
  std::vector<Row> all_rows;
  for (size_t i = 0; i < tree.nodes.size(); ++i) {
    const int seg = prompt_cache.add_segment(tree.nodes[i].parent, tree.nodes[i].start);
    CASCADE_CHECK(seg == int(i), "internal: segment ids follow node ids");
    for (size_t t = 0; t < tree.nodes[i].tokens.size(); ++t) all_rows.push_back({int(i), int64_t(t)});
  }
  std::vector<std::vector<int>> node_prompts(tree.nodes.size());  // the prompts ending at each node
  for (size_t p = 0; p < prompts_.size(); ++p) node_prompts[size_t(tree.prompt_node[p])].push_back(int(p));
  prompt_logits_.assign(prompts_.size() * size_t(hp_.n_vocab), 0.0f);
  std::vector<float> logits;
  llama::Timings tm;
  for (size_t r0 = 0; r0 < all_rows.size(); r0 += size_t(params_.n_batch)) {
    const size_t r1 = std::min(all_rows.size(), r0 + size_t(params_.n_batch));
    std::vector<KvCache::Entry> entries;
    std::vector<int32_t> tokens, pos;
    std::vector<int64_t> logit_rows;
    std::vector<int> logit_nodes;
    for (size_t r = r0; r < r1; ++r) {
      const PromptTree::Node& nd = tree.nodes[size_t(all_rows[r].node)];
      if (entries.empty() || entries.back().id != all_rows[r].node)
        entries.push_back({all_rows[r].node, 0, nd.start + all_rows[r].i});
      ++entries.back().n_rows;
      tokens.push_back(nd.tokens[size_t(all_rows[r].i)]);
      pos.push_back(int32_t(nd.start + all_rows[r].i));
      if (all_rows[r].i + 1 == int64_t(nd.tokens.size()) && !node_prompts[size_t(all_rows[r].node)].empty()) {
        logit_rows.push_back(int64_t(r - r0));
        logit_nodes.push_back(all_rows[r].node);
      }
    }
    kv_->begin_steps({}, entries);
    model_.forward(tokens, pos, *kv_, logit_rows, logits, &tm);
    for (size_t j = 0; j < logit_rows.size(); ++j)
      for (int p : node_prompts[size_t(logit_nodes[j])])
        std::copy_n(logits.data() + j * size_t(hp_.n_vocab), hp_.n_vocab,
                    prompt_logits_.data() + p * size_t(hp_.n_vocab));
    if (on_prefill) on_prefill(int64_t(r1), int64_t(all_rows.size()));
  }
  res_.prompt_attn_ms = tm.attention * 1e3;
}

// n_parallel sequences per prompt: sequence s = prompt * n_parallel + j, laid out as the method says
// (kv_cache.hpp), samples its first token from its prompt's last logits with its own random stream s.
void Generation::start_sequences() {
  res_.sequences.resize(size_t(n_seq_));
  next_pos_.resize(size_t(n_seq_));
  active_.assign(size_t(n_seq_), 1);
  std::vector<int> prompt_leaf(static_cast<size_t>(n_seq_));
  for (int s = 0; s < n_seq_; ++s) {
    const int p = s / params_.n_parallel;
    res_.sequences[size_t(s)].prompt = p;
    samplers_.emplace_back(params_.sampling, uint64_t(s));
    samplers_.back().set_prompt(prompts_[size_t(p)]);
    next_pos_[size_t(s)] = int64_t(prompts_[size_t(p)].size());
    prompt_leaf[size_t(s)] = res_.tree.prompt_node[size_t(p)];
  }
  seq_id_ = kv_->start_after_prompts(prompt_leaf);
  for (int s = 0; s < n_seq_; ++s) {
    if (params_.n_predict == 0) {
      res_.sequences[size_t(s)].stop = "length";
      active_[size_t(s)] = 0;
      continue;
    }
    const int p = s / params_.n_parallel;
    accept(s, samplers_[size_t(s)].sample(prompt_logits_.data() + int64_t(p) * hp_.n_vocab, hp_.n_vocab));
  }
}

// A sequence stops at an end-of-generation token ("eog", not part of its tokens), after n_predict tokens
// ("length"), or when its next token would not fit the context ("context").
void Generation::accept(int s, int32_t tok) {
  SequenceResult& sq = res_.sequences[size_t(s)];
  if (is_eog_ && is_eog_(tok)) {
    sq.stop = "eog";
    active_[size_t(s)] = 0;
    return;
  }
  sq.tokens.push_back(tok);
  if (on_token_) on_token_(s, tok);
  if (int64_t(sq.tokens.size()) >= params_.n_predict) {
    sq.stop = "length";
    active_[size_t(s)] = 0;
  } else if (next_pos_[size_t(s)] + 1 >= res_.n_ctx) {
    sq.stop = "context";
    active_[size_t(s)] = 0;
  }
}

// One decode step: every active sequence's last token goes through the model at once (the step's
// attention planned once, then run in every layer), and each sequence samples its next token. Returns
// false when no sequence is active.
bool Generation::decode_step(int step, const std::function<void(int, const StepStat&)>& on_step) {
  const auto t_step = Clock::now();
  std::vector<KvCache::Entry> entries;
  std::vector<int32_t> tokens, pos;
  std::vector<int> row_seq;
  for (int s = 0; s < n_seq_; ++s) {
    if (!active_[size_t(s)]) continue;
    entries.push_back({seq_id_[size_t(s)], 1, next_pos_[size_t(s)]});
    tokens.push_back(res_.sequences[size_t(s)].tokens.back());
    pos.push_back(int32_t(next_pos_[size_t(s)]));
    row_seq.push_back(s);
  }
  if (row_seq.empty()) return false;
  const auto t_plan = Clock::now();
  kv_->begin_step(entries);
  const double plan_ms = ms_since(t_plan);
  std::vector<int64_t> logit_rows(row_seq.size());
  std::iota(logit_rows.begin(), logit_rows.end(), 0);
  std::vector<float> logits;
  llama::Timings tm;
  model_.forward(tokens, pos, *kv_, logit_rows, logits, &tm);
  // Each sequence draws from its own sampler and random stream, so the draws run side by side (what a draw
  // at a temperature costs beside a small model's step: docs/study.md §19); what follows from them (stops,
  // callbacks) stays in sequence order.
  std::vector<int32_t> drawn(row_seq.size());
  tbb::parallel_for(size_t(0), row_seq.size(), [&](size_t r) {
    drawn[r] = samplers_[size_t(row_seq[r])].sample(logits.data() + int64_t(r) * hp_.n_vocab, hp_.n_vocab);
  });
  for (size_t r = 0; r < row_seq.size(); ++r) {
    const int s = row_seq[r];
    ++next_pos_[size_t(s)];
    accept(s, drawn[r]);
  }
  const StepStat stat{ms_since(t_step), tm.attention * 1e3, plan_ms, int(row_seq.size()), kv_->kv_bytes()};
  res_.n_decode_tokens += stat.n_active;
  res_.steps.push_back(stat);
  if (on_step) on_step(step, stat);
  return true;
}

void Generation::finish() {
  res_.kv_tokens = kv_->stored_tokens();
  res_.kv_bytes = kv_->kv_bytes();
  if (params_.attn == AttnMethod::auto_) res_.cost_model = params_.cost_model;
}

}  // namespace

GenerateResult generate(const llama::Model& model, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateParams& params, const std::function<bool(int32_t)>& is_eog,
                        const std::function<void(int, const StepStat&)>& on_step,
                        const std::function<void(int, int32_t)>& on_token,
                        const std::function<void(int64_t, int64_t)>& on_prefill) {
  params.validate();
  CASCADE_CHECK(!prompts.empty(), "no prompts");
  const llama::Hparams& hp = model.hparams();
  GenerateResult res;
  res.n_ctx = params.n_ctx > 0 ? params.n_ctx : hp.n_ctx_train;
  for (size_t p = 0; p < prompts.size(); ++p) {
    CASCADE_CHECK(!prompts[p].empty(), "prompt ", p + 1, " is empty");
    CASCADE_CHECK(int64_t(prompts[p].size()) < res.n_ctx, "prompt ", p + 1, " has ", prompts[p].size(),
                  " tokens, which leaves no room in the context of ", res.n_ctx, " tokens");
    res.n_prompt_tokens += int64_t(prompts[p].size());
  }
  const int n_seq = int(prompts.size()) * params.n_parallel;
  CASCADE_CHECK(params.attn != AttnMethod::unified || n_seq <= 64 * 1024, "too many sequences (", n_seq, ")");

  // Never more threads than the machine has: oneTBB would warn on stderr and run with fewer anyway.
  tbb::task_arena arena(params.n_threads > 0 ? std::min(params.n_threads, tbb::info::default_concurrency())
                                            : tbb::task_arena::automatic);
  arena.execute([&] {
    res.tree = make_prompt_tree(prompts);
    res.n_prompt_stored = res.tree.n_tokens();
    GenerateParams p = params;
    if (!p.cost_model && p.attn == AttnMethod::auto_ && n_seq >= 2) {
      // Calibrated once up front, timed on its own, so no prefill or decode step carries it.
      const auto t_cal = Clock::now();
      p.cost_model = calibrate(p.n_threads, hp.head_shape(), p.kv_dtype);
      res.calibrate_ms = ms_since(t_cal);
    }
    Generation gen(model, prompts, p, is_eog, on_token, res);
    const auto t_prompt = Clock::now();
    gen.prefill(on_prefill);
    gen.start_sequences();
    res.prompt_ms = ms_since(t_prompt);
    for (int step = 0; gen.decode_step(step, on_step); ++step) {
    }
    gen.finish();
  });
  return res;
}

}  // namespace cascade
