#include "model/generate.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <numeric>

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

GenerateResult generate(const llama::Model& model, const std::vector<std::vector<int32_t>>& prompts,
                        const GenerateParams& params, const std::function<bool(int32_t)>& is_eog,
                        const std::function<void(int, const StepStat&)>& on_step) {
  params.validate();
  CASCADE_CHECK(!prompts.empty(), "no prompts");
  const llama::Hparams& hp = model.hparams();
  GenerateResult res;
  res.n_ctx = params.n_ctx > 0 ? params.n_ctx : hp.n_ctx_train;
  for (size_t p = 0; p < prompts.size(); ++p) {
    CASCADE_CHECK(!prompts[p].empty(), "prompt ", p + 1, " is empty");
    CASCADE_CHECK(int64_t(prompts[p].size()) < res.n_ctx, "prompt ", p + 1, " has ", prompts[p].size(),
                  " tokens, more than the context of ", res.n_ctx, " leaves room for (-c)");
    res.n_prompt_tokens += int64_t(prompts[p].size());
  }
  const int n_seq = int(prompts.size()) * params.n_parallel;
  CASCADE_CHECK(params.attn != AttnMethod::unified || n_seq <= 64 * 1024, "too many sequences (", n_seq, ")");

  tbb::task_arena arena(params.n_threads > 0 ? params.n_threads : tbb::task_arena::automatic);
  arena.execute([&] {
    res.tree = make_prompt_tree(prompts);
    const PromptTree& tree = res.tree;
    res.n_prompt_stored = tree.n_tokens();
    KvCache cache(int(hp.n_layer), hp.head_shape(), params.kv_dtype, params.attn);
    if (params.cost_model) {
      cache.set_cost_model(*params.cost_model);
    } else if (params.attn == AttnMethod::auto_ && n_seq >= 2) {
      // Calibrated once up front, timed on its own, so no prefill or decode step carries it.
      const auto t_cal = Clock::now();
      cache.set_cost_model(calibrate(params.n_threads, hp.head_shape()));
      res.calibrate_ms = ms_since(t_cal);
    }

    // --- prefill: every tree node once, in order (parents first), in chunks of at most n_batch rows ---
    const auto t_prompt = Clock::now();
    struct Row {
      int node;
      int64_t i;  // index in the node
    };
    std::vector<Row> all_rows;
    for (size_t i = 0; i < tree.nodes.size(); ++i) {
      const int seg = cache.add_segment(tree.nodes[i].parent, tree.nodes[i].start);  // segment id == node id
      CASCADE_CHECK(seg == int(i), "internal: segment ids follow node ids");
      for (size_t t = 0; t < tree.nodes[i].tokens.size(); ++t) all_rows.push_back({int(i), int64_t(t)});
    }
    // The prompts ending at each node (their logits come from the node's last row).
    std::vector<std::vector<int>> node_prompts(tree.nodes.size());
    for (size_t p = 0; p < prompts.size(); ++p) node_prompts[tree.prompt_node[p]].push_back(int(p));
    std::vector<float> prompt_logits(prompts.size() * size_t(hp.n_vocab)), logits;
    std::vector<KvCache::Entry> entries;
    std::vector<int32_t> tokens, pos;
    std::vector<int64_t> logit_rows;
    llama::Timings tm;
    for (size_t r0 = 0; r0 < all_rows.size(); r0 += size_t(params.n_batch)) {
      const size_t r1 = std::min(all_rows.size(), r0 + size_t(params.n_batch));
      entries.clear();
      tokens.clear();
      pos.clear();
      logit_rows.clear();
      std::vector<int> logit_prompts;
      for (size_t r = r0; r < r1; ++r) {
        const PromptTree::Node& nd = tree.nodes[all_rows[r].node];
        if (entries.empty() || entries.back().id != all_rows[r].node)
          entries.push_back({all_rows[r].node, 0, nd.start + all_rows[r].i});
        ++entries.back().n_rows;
        tokens.push_back(nd.tokens[all_rows[r].i]);
        pos.push_back(int32_t(nd.start + all_rows[r].i));
        if (all_rows[r].i + 1 == int64_t(nd.tokens.size()) && !node_prompts[all_rows[r].node].empty()) {
          logit_rows.push_back(int64_t(r - r0));
          logit_prompts.push_back(all_rows[r].node);
        }
      }
      cache.begin_step(entries);
      model.forward(tokens, pos, cache, logit_rows, logits, &tm);
      for (size_t j = 0; j < logit_rows.size(); ++j)
        for (int p : node_prompts[logit_prompts[j]])
          std::copy_n(logits.data() + j * size_t(hp.n_vocab), hp.n_vocab, prompt_logits.data() + p * size_t(hp.n_vocab));
    }
    res.prompt_attn_ms = tm.attention * 1e3;

    // --- sequences ---
    std::vector<Sampler> samplers;
    res.sequences.resize(n_seq);
    std::vector<int> seq_id(n_seq);      // the cache's id for the sequence: a segment, or s when unified
    std::vector<int64_t> next_pos(n_seq);  // position of its last sampled token
    std::vector<bool> active(n_seq, true);
    const auto accept = [&](int s, int32_t tok) {
      SequenceResult& sq = res.sequences[s];
      if (is_eog && is_eog(tok)) {
        sq.stop = "eog";
        active[s] = false;
        return;
      }
      sq.tokens.push_back(tok);
      if (int64_t(sq.tokens.size()) >= params.n_predict) {
        sq.stop = "length";
        active[s] = false;
      } else if (next_pos[s] + 1 >= res.n_ctx) {  // its last token would not fit
        sq.stop = "context";
        active[s] = false;
      }
    };
    for (int s = 0; s < n_seq; ++s) {
      const int p = s / params.n_parallel;
      res.sequences[s].prompt = p;
      samplers.emplace_back(params.sampling, uint64_t(s));
      next_pos[s] = int64_t(prompts[p].size());
    }
    std::vector<int> prompt_leaf(n_seq);
    for (int s = 0; s < n_seq; ++s) prompt_leaf[s] = tree.prompt_node[s / params.n_parallel];
    switch (params.attn) {
      case AttnMethod::cascade:
      case AttnMethod::auto_:
        for (int s = 0; s < n_seq; ++s) seq_id[s] = cache.add_segment(prompt_leaf[s]);
        break;
      case AttnMethod::split:
        for (int s = 0; s < n_seq; ++s) {
          seq_id[s] = cache.add_segment(-1);
          cache.copy_path(seq_id[s], prompt_leaf[s]);
        }
        for (int g = 0; g < int(tree.nodes.size()); ++g) cache.release(g);
        break;
      case AttnMethod::unified:
        cache.build_unified(prompt_leaf);
        std::iota(seq_id.begin(), seq_id.end(), 0);
        break;
    }
    for (int s = 0; s < n_seq; ++s) {
      if (params.n_predict == 0) {
        res.sequences[s].stop = "length";
        active[s] = false;
        continue;
      }
      const int p = s / params.n_parallel;
      accept(s, samplers[s].sample(prompt_logits.data() + int64_t(p) * hp.n_vocab, hp.n_vocab));
    }
    res.prompt_ms = ms_since(t_prompt);

    // --- decode ---
    for (int step = 0;; ++step) {
      const auto t_step = Clock::now();
      entries.clear();
      tokens.clear();
      pos.clear();
      std::vector<int> rows_seq;
      for (int s = 0; s < n_seq; ++s) {
        if (!active[s]) continue;
        entries.push_back({seq_id[s], 1, next_pos[s]});
        tokens.push_back(res.sequences[s].tokens.back());
        pos.push_back(int32_t(next_pos[s]));
        rows_seq.push_back(s);
      }
      if (rows_seq.empty()) break;
      logit_rows.resize(rows_seq.size());
      std::iota(logit_rows.begin(), logit_rows.end(), 0);
      llama::Timings st;
      cache.begin_step(std::move(entries));
      entries = {};
      model.forward(tokens, pos, cache, logit_rows, logits, &st);
      for (size_t r = 0; r < rows_seq.size(); ++r) {
        const int s = rows_seq[r];
        ++next_pos[s];
        accept(s, samplers[s].sample(logits.data() + int64_t(r) * hp.n_vocab, hp.n_vocab));
      }
      StepStat stat{ms_since(t_step), st.attention * 1e3, int(rows_seq.size())};
      res.n_decode_tokens += stat.n_active;
      res.steps.push_back(stat);
      if (on_step) on_step(step, stat);
    }
    res.kv_tokens = cache.stored_tokens();
    res.kv_bytes = cache.kv_bytes();
    res.cost_model = cache.cost_model();
  });
  return res;
}

}  // namespace cascade
