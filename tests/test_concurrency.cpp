// The library and the runtime called from several plain threads at once, as a server's request threads would
// call them: cpu::plan and cpu::run with each thread's own trees and thread counts, forward passes of one shared
// model into each thread's own KV cache, one shared tokenizer encoding and decoding. Every thread's results are
// checked in the main thread against work done alone (attention: the double reference; forward passes and the
// tokenizer: the same calls made one thread at a time). scripts/tsan.sh runs these under ThreadSanitizer.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention_problem.hpp"
#include "cascade/cascade.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace test_concurrency {

using namespace cascade;

namespace {

// Runs body(t) on n plain threads at once and joins them.
template <class F>
void on_threads(int n, F body) {
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) threads.emplace_back(body, t);
  for (std::thread& th : threads) th.join();
}

// A random f32 Llama model (GQA 4/2, head dim 8), written with the project's GGUF writer.
std::vector<uint8_t> random_model(uint64_t seed) {
  const int n_embd = 32, n_head = 4, n_head_kv = 2, n_ff = 48, n_vocab = 40, n_layer = 2, hd = n_embd / n_head;
  std::mt19937_64 rng(seed);
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.context_length", 64).set_u32("llama.embedding_length", n_embd).set_u32("llama.block_count", n_layer);
  w.set_u32("llama.feed_forward_length", n_ff).set_u32("llama.attention.head_count", n_head);
  w.set_u32("llama.attention.head_count_kv", n_head_kv).set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  const auto tensor = [&](const std::string& name, std::vector<int64_t> ne, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> x(size_t(ne[0] * (ne.size() > 1 ? ne[1] : 1)));
    for (float& v : x) v = u(rng);
    w.add_tensor(name, gguf::TensorType::F32, std::move(ne), x.data());
  };
  const float s = 1.0f / std::sqrt(float(n_embd));
  tensor("token_embd.weight", {n_embd, n_vocab}, -1, 1);
  tensor("output_norm.weight", {n_embd}, 0.5f, 1.5f);
  for (int il = 0; il < n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    tensor(p + "attn_norm.weight", {n_embd}, 0.5f, 1.5f);
    tensor(p + "attn_q.weight", {n_embd, n_head * hd}, -2 * s, 2 * s);
    tensor(p + "attn_k.weight", {n_embd, n_head_kv * hd}, -2 * s, 2 * s);
    tensor(p + "attn_v.weight", {n_embd, n_head_kv * hd}, -s, s);
    tensor(p + "attn_output.weight", {n_head * hd, n_embd}, -s, s);
    tensor(p + "ffn_norm.weight", {n_embd}, 0.5f, 1.5f);
    tensor(p + "ffn_gate.weight", {n_embd, n_ff}, -s, s);
    tensor(p + "ffn_up.weight", {n_embd, n_ff}, -s, s);
    tensor(p + "ffn_down.weight", {n_ff, n_embd}, -s, s);
  }
  return w.to_bytes();
}

// A prefill of the prompt, then n_decode greedy steps; every step's logits, concatenated.
std::vector<float> decode(const llama::Model& m, const std::vector<int32_t>& prompt, int n_decode) {
  const llama::Hparams& hp = m.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
  const int seg = cache.add_segment(-1, 0);
  std::vector<float> all, logits;
  std::vector<int32_t> tokens = prompt, pos(prompt.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = int32_t(i);
  for (int step = 0; step <= n_decode; ++step) {
    cache.begin_step({{seg, int64_t(tokens.size()), pos.front()}});
    m.forward(tokens, pos, cache, {int64_t(tokens.size()) - 1}, logits);
    all.insert(all.end(), logits.begin(), logits.end());
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    pos = {pos.back() + 1};
    tokens = {next};
  }
  return all;
}

}  // namespace

TEST_CASE("concurrency: attention from several plain threads at once, each with its own plans and thread count") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  test::Rng rng(seed);
  const HeadShape shape{4, 2, 32};
  struct Job {
    std::vector<std::unique_ptr<test::Segment>> store;
    std::vector<KvView> views;
    Tree tree;
    std::vector<float> q;
    std::vector<std::vector<float>> o;  // one per repetition
  };
  const int n_threads = 4, n_jobs = 3, n_reps = 2;
  std::vector<std::vector<Job>> jobs(n_threads);
  for (auto& mine : jobs) {
    mine.resize(n_jobs);
    for (Job& j : mine) {
      const int n_seq = int(rng.uniform_int(1, 5));
      std::vector<int64_t> len = {rng.uniform_int(1, 700)};
      for (int s = 0; s < n_seq; ++s) len.push_back(rng.uniform_int(0, 200));
      for (int64_t n : len) {
        j.store.push_back(test::make_segment(rng, rng.pick(std::vector<DType>{DType::f32, DType::f16, DType::bf16}), n,
                                             shape.n_kv_heads, shape.head_dim, rng.coin()));
        j.views.push_back(j.store.back()->view);
      }
      std::vector<std::vector<int>> paths;
      std::vector<int64_t> n_query;
      for (int s = 0; s < n_seq; ++s) {
        paths.push_back({0, s + 1});
        n_query.push_back(std::min<int64_t>(len[size_t(s) + 1], rng.uniform_int(1, 3)));
      }
      j.tree = Tree::build(shape, len, paths, n_query);
      j.q.resize(size_t(j.tree.n_rows() * shape.n_q_heads * shape.head_dim));
      for (float& x : j.q) x = rng.uniform(-1.0f, 1.0f);
    }
  }
  // f32 products: this checks the threads' results at the tight bound (bf16 products round q; test_attention.cpp
  // checks that path at its own bound). Set before the threads start: the setting is process-wide.
  const cpu::Bf16Products f32_products(false);
  // Thread t plans for t threads (0: the caller's arena, 1: alone, 2, 3: more than this machine may have) and
  // runs each plan n_reps times.
  on_threads(n_threads, [&](int t) {
    cpu::Options opt;
    opt.n_threads = t;
    for (Job& j : jobs[size_t(t)]) {
      const Plan plan = cpu::plan(j.tree, opt);
      for (int rep = 0; rep < n_reps; ++rep) {
        std::vector<float> o(j.q.size(), 123.0f);
        cpu::run(plan, j.views, j.q.data(), o.data());
        j.o.push_back(std::move(o));
      }
    }
  });
  for (const auto& mine : jobs)
    for (const Job& j : mine) {
      std::vector<double> ref(j.q.size()), ref_lse(size_t(j.tree.n_rows() * shape.n_q_heads));
      reference_attention(j.tree, j.views, j.q.data(), ref.data(), ref_lse.data());
      for (const std::vector<float>& o : j.o) test::expect_close(o, ref, 5e-6, 5e-5, "attention run from a thread");
    }
}

TEST_CASE("concurrency: forward passes over one shared model from several plain threads, each with its own cache") {
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  const gguf::File file = gguf::File::from_bytes(random_model(seed), "random.gguf");
  const llama::Model model = llama::Model::load(file);
  const int n_threads = 3;
  std::vector<std::vector<int32_t>> prompts;
  std::mt19937_64 rng(seed);
  for (int t = 0; t < n_threads; ++t) {
    std::vector<int32_t> p(size_t(3 + t * 4));
    for (int32_t& id : p) id = int32_t(rng() % 40);
    prompts.push_back(p);
  }
  std::vector<std::vector<float>> alone(n_threads), together(n_threads);
  for (int t = 0; t < n_threads; ++t) alone[size_t(t)] = decode(model, prompts[size_t(t)], 4);
  on_threads(n_threads, [&](int t) { together[size_t(t)] = decode(model, prompts[size_t(t)], 4); });
  for (int t = 0; t < n_threads; ++t) {
    CAPTURE(t);
    const std::vector<double> ref(alone[size_t(t)].begin(), alone[size_t(t)].end());
    test::expect_close(together[size_t(t)], ref, 1e-5, 1e-5, "logits of a forward pass run beside others");
  }
}

TEST_CASE("concurrency: one tokenizer encodes and decodes from several plain threads") {
  const Tokenizer tok(load_vocab(gguf::File::open(CASCADE_TESTDATA_DIR "/tokenizer/ggml-vocab-gpt-2.gguf")));
  const std::vector<std::string> texts = {"Hello world, 123!", " caf\xc3\xa9 \xe2\x96\x81 x\n\n\ty", "\xff\xfe broken",
                                          "<|endoftext|> special", "1234567890 numbers 3.14"};
  std::vector<std::vector<int32_t>> alone;
  for (const std::string& s : texts) alone.push_back(tok.encode(s, true, true));
  const int n_threads = 4;
  std::vector<std::vector<std::vector<int32_t>>> ids(n_threads);
  std::vector<std::vector<std::string>> back(n_threads);
  on_threads(n_threads, [&](int t) {
    for (int rep = 0; rep < 20; ++rep)
      for (const std::string& s : texts) {
        ids[size_t(t)].push_back(tok.encode(s, true, true));
        back[size_t(t)].push_back(tok.decode(ids[size_t(t)].back(), true));
      }
  });
  for (int t = 0; t < n_threads; ++t)
    for (size_t k = 0; k < ids[size_t(t)].size(); ++k) {
      CHECK(ids[size_t(t)][k] == alone[k % texts.size()]);
      CHECK(back[size_t(t)][k] == tok.decode(alone[k % texts.size()], true));
    }
}

}  // namespace test_concurrency
