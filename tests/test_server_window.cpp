// The serving engine (server/engine.hpp) on sliding-window models, through its radix prefix cache: prompts longer
// than the window share prefixes that end inside, at the edge of, or wholly before the window of the rows that
// decode after them, so cached K/V (stored by an earlier request, or still being prefilled by one beside it) is
// reused across requests while each row sees only its last W keys. Every choice's greedy tokens must equal its
// prompt's decoded alone, one sequence per prompt, by two references:
//   - generate() with the split method (each sequence its own copy of its prompt, the project's per-sequence
//     layout), one prompt at a time;
//   - a plain cache of this file (ReferenceCache): one sequence's K/V in f32, attended by reference.hpp's double
//     loops, which apply the window key by key themselves, sharing nothing with the tree's plans or kernels.
// Tokens are compared up to the first step where the plain reference's top two logits are within kTie of each
// other (a near-tie, where rounding may pick either); the cases check that nearly all tokens were compared, and
// that the window changes the tokens (the same prompts decoded without it differ), so that an engine ignoring
// the window cannot pass. And on f16 K/V, with a window longer than an attention block, a request's log-probabilities
// have the same bits alone and beside requests that share its beginning (batch invariance, docs/serving.md).
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cascade/reference.hpp"
#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "oracle/tiny_models.hpp"
#include "server/engine.hpp"

namespace test_server_window {

using namespace cascade;
using server::Engine;
using server::EngineConfig;
using server::Event;
using server::GenRequest;
using server::Ticket;

namespace {

constexpr int kWindow = 16;
constexpr int kGen = 24;        // tokens per choice: more than the window, so decoding rows leave the prompt behind
constexpr float kTie = 1e-3f;   // top-two logit gap below which the greedy token is rounding's choice

// A tiny random model whose layers see their last kWindow keys: llama with a window on every layer (Mistral), or
// gemma3 whose window layers alternate with global ones.
struct TinyModel {
  gguf::File file;
  Tokenizer tok;
  llama::Model model;
  explicit TinyModel(const oracle::TinySpec& s, llama::LinearPath linear = llama::LinearPath::f32)
      : file(gguf::File::from_bytes(oracle::write_tiny(s), s.name + ".gguf")),
        tok(load_vocab(file)),
        model(llama::Model::load(file, linear)) {}
};

oracle::TinySpec window_spec(const std::string& arch) {
  oracle::TinySpec s = oracle::tiny_spec(arch + "-window", arch, "f32");
  s.n_layer = 3;
  s.n_swa = kWindow;
  s.n_ctx = 256;
  s.seed = 11;
  s.tied = false;
  if (arch == "gemma3") s.swa_pattern = 2, s.rope_base_swa = 100.0f, s.head_dim = 32;
  return s;
}

// One sequence's K/V in f32 (positions from 0), attended by reference_attention in double precision, each row
// seeing its last layer_window(il) keys (none left out when `windows` is false).
class ReferenceCache final : public KvCache {
 public:
  ReferenceCache(int n_layer, const HeadShape& shape, bool windows)
      : KvCache(n_layer, shape, DType::f32), k_(size_t(n_layer)), v_(size_t(n_layer)), windows_(windows) {}

  void begin_step(const std::vector<Entry>& entries) override {
    REQUIRE(entries.size() == 1);
    REQUIRE(entries[0].pos == stored_tokens());
    count_rows(entries);
  }
  void store(int il, const float* k, const float* v) override {
    const size_t n = size_t(step_rows_ * row_elems());
    k_[size_t(il)].insert(k_[size_t(il)].end(), k, k + n);
    v_[size_t(il)].insert(v_[size_t(il)].end(), v, v + n);
  }
  void attend(int il, const float* q, float* o) override {
    const std::vector<float>& k = k_[size_t(il)];
    const KvView kv = KvView::contiguous(k.data(), v_[size_t(il)].data(), int64_t(k.size()) / row_elems(),
                                         shape_.n_kv_heads, shape_.head_dim);
    const size_t n_out = size_t(step_rows_ * shape_.n_q_heads * shape_.head_dim);
    std::vector<double> od(n_out), lse(size_t(step_rows_ * shape_.n_q_heads));
    reference_attention(shape_, 1.0 / std::sqrt(double(shape_.head_dim)), {{kv}}, {step_rows_}, q, od.data(),
                        lse.data(), windows_ ? layer_window(il) : 0);
    for (size_t i = 0; i < n_out; ++i) o[i] = float(od[i]);
  }
  int64_t stored_tokens() const override { return int64_t(k_[0].size()) / row_elems(); }
  size_t allocated_bytes() const override { return size_t(stored_tokens() * n_layer_ * 2 * row_elems() * 4); }

 private:
  int64_t row_elems() const { return int64_t(shape_.n_kv_heads) * shape_.head_dim; }
  std::vector<std::vector<float>> k_, v_;  // (n_layer) x (tokens, n_kv_heads, head_dim)
  bool windows_;
};

struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<float> margin;  // per token: its logit less the runner-up's
};

// The prompt's greedy continuation of n tokens, decoded alone on a ReferenceCache.
Greedy reference_greedy(const llama::Model& m, const std::vector<int32_t>& prompt, int n, bool windows) {
  const llama::Hparams& hp = m.hparams();
  ReferenceCache cache(int(hp.n_layer), hp.head_shape(), windows);
  std::vector<int32_t> pos(prompt.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = int32_t(i);
  std::vector<float> logits;
  cache.begin_step({{0, int64_t(prompt.size()), 0}});
  m.forward(prompt, pos, cache, {int64_t(prompt.size()) - 1}, logits);
  Greedy g;
  for (int i = 0; i < n; ++i) {
    const auto best = std::max_element(logits.begin(), logits.end());
    float second = -INFINITY;
    for (auto it = logits.begin(); it != logits.end(); ++it)
      if (it != best) second = std::max(second, *it);
    g.tokens.push_back(int32_t(best - logits.begin()));
    g.margin.push_back(*best - second);
    if (i + 1 == n) break;
    const int32_t p = int32_t(prompt.size()) + i;
    cache.begin_step({{0, 1, p}});
    m.forward({g.tokens.back()}, {p}, cache, {0}, logits);
  }
  return g;
}

// Tokens of `got` that must equal the reference's: those before its first near-tie (the near-tie's own included
// only when equal). Counts the compared tokens into n_compared; returns whether they all agree.
bool agrees(const std::vector<int32_t>& got, const Greedy& want, int64_t& n_compared) {
  if (got.size() != want.tokens.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (want.margin[i] < kTie) return true;
    ++n_compared;
    if (got[i] != want.tokens[i]) return false;
  }
  return true;
}

// Prompts of random tokens (ids 3.. : no control tokens) around one shared beginning. With P a prompt's length
// and L the prefix it shares with a prompt before it, its last row (position P - 1) sees keys P - kWindow.. P - 1,
// and the rows after it less and less of the shared span:
//   0  52 tokens, decoded first and alone (the cache's first entry);
//   1  prompt 0 again: all but its last token cached, the windows of its first rows wholly inside the cached span;
//   2  L = 46 of prompt 0, P = 56: the shared span ends inside the window (keys 40..45 of it);
//   3  L = 30 of prompt 0, P = 60: the shared span ends before the window, which starts at 44;
//   4  L = 50 of prompt 3 (a split inside 3's own tail, while 3 is still prefilled), P = 58;
//   5  L = 44 of prompt 0, P = 60: the last shared key (43) just outside the window, which starts at 44;
//   6  L = 45 of prompt 0, P = 60: the last shared key (44) the window's first;
//   7  L = 20 of prompt 0, P = 28: the window (12..27) holds the shared span's end and the prompt's own tokens;
//   8  the first 40 tokens of prompt 0 (a split of its node): the window wholly inside the cached span.
std::vector<std::vector<int32_t>> window_prompts(uint32_t seed) {
  std::mt19937 rng(seed);
  const auto random_token = [&] { return int32_t(3 + rng() % 61); };
  // from's first n_shared tokens, then a token other than from's next, then random ones: n tokens in all.
  const auto extend = [&](const std::vector<int32_t>& from, int n_shared, int n) {
    std::vector<int32_t> p(from.begin(), from.begin() + n_shared);
    p.push_back(int32_t(3 + (from[size_t(n_shared)] - 3 + 1 + int32_t(rng() % 60)) % 61));
    while (int(p.size()) < n) p.push_back(random_token());
    return p;
  };
  std::vector<std::vector<int32_t>> p(1);
  for (int i = 0; i < 52; ++i) p[0].push_back(random_token());
  p.push_back(p[0]);
  p.push_back(extend(p[0], 46, 56));
  p.push_back(extend(p[0], 30, 60));
  p.push_back(extend(p[3], 50, 58));
  p.push_back(extend(p[0], 44, 60));
  p.push_back(extend(p[0], 45, 60));
  p.push_back(extend(p[0], 20, 28));
  p.push_back(std::vector<int32_t>(p[0].begin(), p[0].begin() + 40));
  return p;
}

GenRequest greedy_request(const std::vector<int32_t>& prompt, int n) {
  GenRequest r;
  r.prompt = prompt;
  r.n = n;
  r.max_tokens = kGen;
  r.sampling.temp = 0;
  r.ignore_eos = true;
  return r;
}

struct Client {
  std::shared_ptr<Ticket> ticket;
  std::vector<std::vector<int32_t>> tokens;  // per choice
  server::Usage usage;
  std::string error;
  bool ended = false;
  void take() {
    std::vector<Event> ev;
    ticket->wait(ev, std::chrono::milliseconds(0));
    for (Event& e : ev) {
      if (e.kind == Event::Kind::finish) {
        if (size_t(e.index) >= tokens.size()) tokens.resize(size_t(e.index) + 1);
        tokens[size_t(e.index)] = std::move(e.token_ids);
      }
      if (e.kind == Event::Kind::error) error = e.text;
      if (e.kind == Event::Kind::done) usage = e.usage;
      ended = ended || e.kind == Event::Kind::done || e.kind == Event::Kind::error;
    }
  }
};

Client submit(Engine& e, GenRequest r) {
  REQUIRE(e.check(r).ok());
  Engine::Admission why;
  std::shared_ptr<Ticket> t = e.submit(std::move(r), &why);
  REQUIRE(t);
  return Client{t, {}, {}, {}, false};
}

// Steps until every client has ended (bounded), checking the engine's bookkeeping after each step.
void run(Engine& e, std::vector<Client>& clients) {
  for (int step = 0; step < 2000; ++step) {
    bool all = true;
    for (Client& c : clients) {
      c.take();
      all = all && c.ended;
    }
    if (all) return;
    e.step();
    e.check_state();
  }
  FAIL("the requests did not finish in 2000 steps");
}

}  // namespace

TEST_CASE("server window: prefixes cached across requests around the window's edge decode as each prompt alone") {
  for (const std::string arch : {"llama", "gemma3"}) {
    CAPTURE(arch);
    const TinyModel m(window_spec(arch));
    REQUIRE(m.model.hparams().n_swa == kWindow);
    const std::vector<std::vector<int32_t>> prompts = window_prompts(arch == "llama" ? 5 : 6);

    // The references, each prompt alone.
    std::vector<Greedy> want;
    int64_t n_compared = 0, n_tokens = 0, n_window_changes = 0;
    for (const auto& p : prompts) {
      want.push_back(reference_greedy(m.model, p, kGen, true));
      n_window_changes += reference_greedy(m.model, p, kGen, false).tokens != want.back().tokens;
      GenerateParams gp;
      gp.n_predict = kGen;
      gp.n_parallel = 1;
      gp.n_threads = 2;
      gp.attn = AttnMethod::split;
      gp.kv_dtype = DType::f32;
      gp.sampling.temp = 0;
      const GenerateResult split = generate(m.model, {p}, gp, [](int32_t) { return false; });
      CHECK(agrees(split.sequences[0].tokens, want.back(), n_compared));
      n_tokens += kGen;
    }
    // The window matters for these prompts: an engine that ignored it would decode other tokens.
    CHECK(n_window_changes >= int64_t(prompts.size()) - 1);

    for (AttnMethod method : {AttnMethod::cascade, AttnMethod::auto_, AttnMethod::split, AttnMethod::unified}) {
      CAPTURE(attn_method_name(method));
      EngineConfig c;
      c.attn = method;
      c.n_parallel = 12;
      c.n_ctx = 256;
      c.n_batch = 7;  // prefill chunks that end anywhere against the window's edge
      c.n_threads = 2;
      c.max_queue = 16;
      c.kv_dtype = DType::f32;
      Engine e(m.model, m.tok, c);
      // Prompt 0 alone, so the others find it cached; then the rest together, sharing what each prefills.
      std::vector<Client> first{submit(e, greedy_request(prompts[0], 1))};
      run(e, first);
      std::vector<Client> rest;
      for (size_t i = 1; i < prompts.size(); ++i)
        rest.push_back(submit(e, greedy_request(prompts[i], i % 3 == 1 ? 2 : 1)));
      run(e, rest);
      rest.insert(rest.begin(), first[0]);
      for (size_t i = 0; i < prompts.size(); ++i) {
        CAPTURE(i);
        REQUIRE(rest[i].error.empty());
        CHECK(rest[i].tokens.size() == size_t(i % 3 == 1 ? 2 : 1));
        for (size_t j = 0; j < rest[i].tokens.size(); ++j) {
          CAPTURE(j);
          CHECK(agrees(rest[i].tokens[j], want[i], n_compared));
          n_tokens += kGen;
        }
      }
      // Each prompt found the prefix it shares (stored, or being prefilled beside it: prompt 4's in prompt 3).
      const int64_t shared[] = {0, int64_t(prompts[1].size()) - 1, 46, 30, 50, 44, 45, 20, 39};
      for (size_t i = 0; i < prompts.size(); ++i) CHECK(rest[i].usage.cached_tokens == shared[i]);
    }
    // Near-ties are rare: nearly every token was compared.
    CHECK(n_compared >= n_tokens * 9 / 10);
    MESSAGE(arch << ": " << n_compared << " of " << n_tokens << " tokens compared");
  }
}

namespace {

// What a request's events say of each choice: its tokens' ids and log-probabilities (the chosen token's and the top
// alternatives'), whose bits follow the bits of the logits.
struct Logprobs {
  std::vector<std::vector<TokenLogprob>> choices;
  bool ended = false;
  std::string error;
};

Logprobs run_logprobs(Engine& e, std::vector<std::pair<GenRequest, bool>> requests, int steps_between) {
  std::vector<std::shared_ptr<Ticket>> tickets;
  std::vector<Logprobs> got(requests.size());
  size_t next = 0;
  for (int step = 0; step < 20000; ++step) {
    if (next < requests.size() && (step % std::max(1, steps_between) == 0 || steps_between == 0)) {
      REQUIRE(e.check(requests[next].first).ok());
      Engine::Admission why;
      tickets.push_back(e.submit(requests[next].first, &why));
      REQUIRE(tickets.back());
      ++next;
    }
    bool all = next == requests.size();
    for (size_t i = 0; i < tickets.size(); ++i) {
      std::vector<Event> ev;
      tickets[i]->wait(ev, std::chrono::milliseconds(0));
      for (const Event& x : ev) {
        if (x.kind == Event::Kind::text)
          for (const server::TokenInfo& t : x.tokens) {
            if (size_t(x.index) >= got[i].choices.size()) got[i].choices.resize(size_t(x.index) + 1);
            got[i].choices[size_t(x.index)].push_back(t.lp);
          }
        if (x.kind == Event::Kind::error) got[i].error = x.text;
        got[i].ended = got[i].ended || x.kind == Event::Kind::done || x.kind == Event::Kind::error;
      }
      all = all && got[i].ended;
    }
    if (all) break;
    e.step();
    e.check_state();
  }
  for (size_t i = 0; i < requests.size(); ++i)
    if (requests[i].second) return got[i];
  return {};
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

}  // namespace

// Batch invariance under sliding windows (docs/serving.md, "Determinism"): on the default path (f16 K/V, the linear
// layers' quantized path; the f32 path's products are not batch-invariant), a request's log-probabilities have the
// same bits alone and beside other requests that share its beginning up to a block's end, its windows' starts and
// points around them, prefilled in other chunks, by every method but unified. The window (300 keys) is longer than a
// block of attention keys (256), so its rows' windows start inside blocks.
TEST_CASE("server window: a request's log-probabilities have the same bits alone and beside others") {
  oracle::TinySpec s = window_spec("gemma3");
  s.name = "gemma3-window-blocks";
  s.n_swa = 300;
  s.n_ctx = 1024;
  const TinyModel m(s, llama::LinearPath::quantized);
  REQUIRE(m.model.hparams().n_swa == s.n_swa);
  std::mt19937 rng(17);
  const auto random_tokens = [&](std::vector<int32_t> p, int n) {
    while (int(p.size()) < n) p.push_back(int32_t(3 + rng() % 61));
    return p;
  };
  const std::vector<int32_t> prompt = random_tokens({}, 700);
  // Its last prompt row (position 699) sees keys 400.. and its first decoding rows from 401 on.
  const auto sharing = [&](int n_shared, int n) {
    std::vector<int32_t> p(prompt.begin(), prompt.begin() + n_shared);
    p.push_back(int32_t(3 + (prompt[size_t(n_shared)] - 3 + 1) % 61));
    return random_tokens(p, n);
  };
  GenRequest want;
  want.prompt = prompt;
  want.n = 2;
  want.max_tokens = 40;
  want.sampling.temp = 0.8f;
  want.sampling.seed = 5;
  want.ignore_eos = true;
  want.logprobs = 4;
  const auto other = [&](std::vector<int32_t> p, int max_tokens, uint64_t seed) {
    GenRequest r = want;
    r.prompt = std::move(p);
    r.n = 1;
    r.max_tokens = max_tokens;
    r.sampling.seed = seed;
    return r;
  };
  const auto config = [](AttnMethod method, int n_batch) {
    EngineConfig c;
    c.attn = method;
    c.n_parallel = 8;
    c.n_ctx = 1024;
    c.n_batch = n_batch;
    c.n_threads = 2;
    c.max_queue = 16;
    return c;
  };
  Engine e0(m.model, m.tok, config(AttnMethod::cascade, 256));
  const Logprobs alone = run_logprobs(e0, {{want, true}}, 0);
  REQUIRE(alone.error.empty());
  REQUIRE(alone.choices.size() == 2);
  REQUIRE(alone.choices[0].size() == 40);
  for (AttnMethod method : {AttnMethod::cascade, AttnMethod::auto_, AttnMethod::split}) {
    CAPTURE(std::string(attn_method_name(method)));
    Engine e(m.model, m.tok, config(method, 37));
    const Logprobs busy = run_logprobs(e,
                                       {{other(sharing(256, 720), 30, 1), false},
                                        {other(sharing(400, 650), 50, 2), false},
                                        {want, true},
                                        {other(sharing(401, 705), 20, 3), false},
                                        {other(sharing(130, 300), 45, 4), false},
                                        {other(sharing(520, 800), 10, 6), false},
                                        {other(prompt, 35, 7), false}},
                                       3);
    REQUIRE(busy.error.empty());
    REQUIRE(busy.choices.size() == alone.choices.size());
    for (size_t c = 0; c < alone.choices.size(); ++c) {
      CAPTURE(c);
      REQUIRE(busy.choices[c].size() == alone.choices[c].size());
      int64_t differ = 0;
      for (size_t i = 0; i < alone.choices[c].size(); ++i) {
        const TokenLogprob &a = alone.choices[c][i], &b = busy.choices[c][i];
        bool same = a.token == b.token && same_bits(a.logprob, b.logprob) && a.top.size() == b.top.size();
        for (size_t k = 0; same && k < a.top.size(); ++k)
          same = a.top[k].first == b.top[k].first && same_bits(a.top[k].second, b.top[k].second);
        differ += !same;
      }
      CHECK(differ == 0);
    }
  }
}

}  // namespace test_server_window
