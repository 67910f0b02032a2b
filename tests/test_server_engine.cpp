// The serving engine (server/engine.hpp) with the real model (SmolLM2-135M-Instruct Q4_1), stepped by the test
// itself: the same greedy text as generate() for every attention method, the same seeded text alone or beside
// other requests, cached prefixes reused and evicted under a budget, cancellations giving their K/V back.
// Every step is followed by the engine's own bookkeeping check (check_state).
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "server/engine.hpp"

namespace test_server_engine {

using namespace cascade;
using server::Engine;
using server::EngineConfig;
using server::Event;
using server::GenRequest;
using server::Ticket;

namespace {

const char* kModel = CASCADE_MODEL_PATH;

struct Loaded {
  gguf::File file;
  Tokenizer tok;
  llama::Model model;
  Loaded(const char* path, llama::LinearPath linear)
      : file(gguf::File::open(path)), tok(load_vocab(file)), model(llama::Model::load(file, linear)) {}
};
// The model on the runtime's default (int8) linear path. The tests that compare texts token for token across
// batches and cached prefixes run on it: its reductions are batch-invariant (docs/serving.md), so a text does not
// depend on what ran beside it. `f32_linear`: the f32 linear path, for the one comparison that includes the
// unified method, whose masked pass over one shared buffer is not batch-invariant (on f32 activations its
// last-bit differences do not move a greedy token in these prompts; on int8 ones they do).
const Loaded& loaded(bool f32_linear = false) {
  REQUIRE_MESSAGE(std::filesystem::exists(kModel),
                  "the model file " << kModel << " is missing: run `bash scripts/setup.sh` in the repository");
  if (f32_linear) {
    static std::unique_ptr<Loaded> f32 = std::make_unique<Loaded>(kModel, llama::LinearPath::f32);
    return *f32;
  }
  static std::unique_ptr<Loaded> l = std::make_unique<Loaded>(kModel, llama::LinearPath::quantized);
  return *l;
}

// What a request's events amount to.
struct Answer {
  std::vector<std::string> text, finish;
  std::vector<std::vector<server::TokenInfo>> tokens;  // per choice, when logprobs were asked for
  server::Usage usage;
  std::string error;
  int status = 0;
  bool ended = false;
};

struct Client {
  std::shared_ptr<Ticket> ticket;
  Answer answer;
  void take() {
    std::vector<Event> ev;
    ticket->wait(ev, std::chrono::milliseconds(0));
    for (const Event& e : ev) {
      if (size_t(e.index) >= answer.text.size()) {
        answer.text.resize(size_t(e.index) + 1);
        answer.finish.resize(size_t(e.index) + 1);
        answer.tokens.resize(size_t(e.index) + 1);
      }
      switch (e.kind) {
        case Event::Kind::text:
          answer.text[size_t(e.index)] += e.text;
          for (const server::TokenInfo& t : e.tokens) answer.tokens[size_t(e.index)].push_back(t);
          break;
        case Event::Kind::finish: answer.finish[size_t(e.index)] = e.text; break;
        case Event::Kind::done:
          answer.usage = e.usage;
          answer.ended = true;
          break;
        case Event::Kind::error:
          answer.error = e.text;
          answer.status = e.status;
          answer.ended = true;
          break;
      }
    }
  }
};

GenRequest request(const std::vector<int32_t>& prompt, int n, int max_tokens, float temp = 0, uint64_t seed = 1) {
  GenRequest r;
  r.prompt = prompt;
  r.n = n;
  r.max_tokens = max_tokens;
  r.sampling.temp = temp;
  r.sampling.seed = seed;
  return r;
}

std::shared_ptr<Ticket> submit(Engine& e, GenRequest r) {
  REQUIRE(e.check(r).ok());
  Engine::Admission why;
  std::shared_ptr<Ticket> t = e.submit(std::move(r), &why);
  REQUIRE(t);
  return t;
}

// Steps until every client has its answer (bounded), checking the engine's bookkeeping after each step and,
// when given, that the stored K/V never exceeds the budget. What requests store beside the cached prefixes (their
// own segments, the copies their method makes) stays within what they reserved (a unified buffer keeps an ended
// sequence's keys until it compacts, so it is left out).
void run(Engine& e, std::vector<Client*> clients, int64_t budget = 0) {
  for (int step = 0; step < 5000; ++step) {
    bool all = true;
    for (Client* c : clients) {
      c->take();
      all = all && c->answer.ended;
    }
    if (all) return;
    e.step();
    e.check_state();
    const server::EngineMetrics mt = e.metrics();
    if (budget) REQUIRE(mt.kv_bytes <= budget);
    if (e.config().attn != AttnMethod::unified) REQUIRE(mt.kv_bytes <= mt.kv_cached_bytes + mt.kv_reserved_bytes);
  }
  FAIL("the requests did not finish in 5000 steps");
}

Answer run_one(Engine& e, GenRequest r) {
  Client c{submit(e, std::move(r)), {}};
  run(e, {&c});
  return c.answer;
}

const std::vector<std::string> kPrompts = {
    "The history of the city of Paris begins with a small settlement on an island in the river. Over the centuries",
    "The history of the city of Paris begins with a small settlement on an island in the river. The first bridges",
    "The history of the city of Paris begins with a small settlement on an island in the river. Today, visitors",
    "The history of the city of Rome begins with",
};

std::vector<std::vector<int32_t>> encode_all(const Tokenizer& tok, const std::vector<std::string>& texts) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& t : texts) out.push_back(tok.encode(t));
  return out;
}

EngineConfig config(AttnMethod m, int n_parallel = 8) {
  EngineConfig c;
  c.attn = m;
  c.n_parallel = n_parallel;
  c.n_ctx = 1024;
  c.n_batch = 32;  // several prefill steps per prompt, interleaved with decoding
  c.max_queue = 64;
  return c;
}

}  // namespace

TEST_CASE("server engine: greedy texts equal generate()'s, with every attention method, prompts arriving together") {
  GenerateParams gp;
  gp.n_predict = 24;
  gp.n_parallel = 2;
  gp.sampling.temp = 0;
  gp.attn = AttnMethod::cascade;
  std::map<const Loaded*, GenerateResult> refs;  // generate()'s texts, once per linear path
  for (AttnMethod method : {AttnMethod::cascade, AttnMethod::auto_, AttnMethod::split, AttnMethod::unified}) {
    CAPTURE(std::string(attn_method_name(method)));
    const Loaded& m = loaded(method == AttnMethod::unified);
    const auto prompts = encode_all(m.tok, kPrompts);
    if (!refs.count(&m))
      refs.emplace(&m, generate(m.model, prompts, gp, [&](int32_t id) { return m.tok.is_eog(id); }));
    const GenerateResult& ref = refs.at(&m);
    Engine e(m.model, m.tok, config(method));
    std::vector<Client> clients;
    for (const auto& p : prompts) clients.push_back({submit(e, request(p, 2, 24)), {}});
    std::vector<Client*> all;
    for (Client& c : clients) all.push_back(&c);
    run(e, all);
    for (size_t p = 0; p < prompts.size(); ++p)
      for (int j = 0; j < 2; ++j) {
        CAPTURE(p);
        CAPTURE(j);
        const SequenceResult& want = ref.sequences[p * 2 + size_t(j)];
        CHECK(clients[p].answer.text[size_t(j)] == m.tok.decode(want.tokens, false));
        CHECK(clients[p].answer.finish[size_t(j)] == (want.stop == "eog" ? "stop" : "length"));
      }
    // Every sequence's K/V went with it; the prompts stay cached (minus each one's last token).
    const server::EngineMetrics mt = e.metrics();
    CHECK(mt.active_sequences == 0);
    CHECK(mt.kv_reserved_bytes == 0);
    CHECK(mt.kv_bytes == mt.kv_cached_bytes);
    CHECK(mt.kv_cached_bytes == (ref.tree.n_tokens() - int64_t(prompts.size())) * e.kv_token_bytes());
    // The cached prompts hold no room beyond their tokens; a unified buffer keeps its own until it compacts.
    if (method != AttnMethod::unified) CHECK(mt.kv_allocated_bytes == mt.kv_bytes);
    CHECK(mt.generated_tokens == 8 * 24);
  }
}

TEST_CASE("server engine: a seeded request writes the same text alone and beside others (sampled and greedy)") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  for (float temp : {0.9f, 0.0f}) {
    CAPTURE(temp);
    Engine alone(m.model, m.tok, config(AttnMethod::auto_));
    const Answer a = run_one(alone, request(prompts[0], 3, 20, temp, 42));
    // Beside others: requests sharing its beginning arrive before and after it, with other seeds.
    Engine busy(m.model, m.tok, config(AttnMethod::auto_));
    Client x{submit(busy, request(prompts[1], 2, 30, 0.7f, 1)), {}};
    Client y{submit(busy, request(prompts[3], 1, 40, 1.0f, 2)), {}};
    for (int i = 0; i < 3; ++i) busy.step();
    Client r{submit(busy, request(prompts[0], 3, 20, temp, 42)), {}};
    Client z{submit(busy, request(prompts[2], 1, 12, 0.5f, 3)), {}};
    run(busy, {&x, &y, &r, &z});
    CHECK(r.answer.text == a.text);
    CHECK(r.answer.usage.cached_tokens > 10);  // it found the beginning x brought
  }
}

TEST_CASE("server engine: a prompt reuses the longest cached prefix, and reusing it changes no token") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  Engine cold(m.model, m.tok, config(AttnMethod::cascade));
  const Answer want = run_one(cold, request(prompts[1], 1, 16));
  CHECK(want.usage.cached_tokens == 0);
  CHECK(want.usage.prompt_tokens == int64_t(prompts[1].size()));

  Engine e(m.model, m.tok, config(AttnMethod::cascade));
  run_one(e, request(prompts[0], 1, 4));
  const int64_t prefilled = e.metrics().prompt_tokens_prefilled;
  const Answer got = run_one(e, request(prompts[1], 1, 16));
  size_t shared = 0;
  while (prompts[0][shared] == prompts[1][shared]) ++shared;
  CHECK(got.usage.cached_tokens == int64_t(shared));
  CHECK(e.metrics().prompt_tokens_prefilled - prefilled == int64_t(prompts[1].size() - shared));
  CHECK(e.metrics().prompt_tokens_cached == int64_t(shared));
  CHECK(got.text == want.text);
  // The same prompt again: all but its last token come from the cache.
  const Answer again = run_one(e, request(prompts[1], 1, 16));
  CHECK(again.usage.cached_tokens == int64_t(prompts[1].size()) - 1);
  CHECK(again.text == want.text);
}

TEST_CASE("server engine: cancelled requests, mid-prefill or mid-decode, give their K/V back at once") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  for (AttnMethod method : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified}) {
    CAPTURE(attn_method_name(method));
    Engine e(m.model, m.tok, config(method));
    run_one(e, request(prompts[0], 1, 2));
    const int64_t baseline = e.metrics().kv_bytes, baseline_held = e.metrics().kv_allocated_bytes;
    // Decoding: two requests on the cached prompt, cancelled after a few steps.
    Client a{submit(e, request(prompts[0], 3, 200)), {}}, b{submit(e, request(prompts[0], 1, 200)), {}};
    for (int i = 0; i < 6; ++i) {
      e.step();
      e.check_state();
    }
    CHECK(e.metrics().active_sequences == 4);
    CHECK(e.metrics().kv_bytes > baseline);
    a.ticket->cancel();
    b.ticket->cancel();
    e.step();
    e.check_state();
    a.take();
    b.take();
    CHECK(a.answer.status == 499);
    CHECK(b.answer.status == 499);
    CHECK(e.metrics().kv_bytes == baseline);
    CHECK(e.metrics().kv_reserved_bytes == 0);
    if (method != AttnMethod::unified) CHECK(e.metrics().kv_allocated_bytes == baseline_held);
    // Prefilling a long new prompt (32 tokens per step): cancelled after one step, what it stored stays cached and
    // nothing else.
    std::vector<int32_t> longp = prompts[3];
    for (int i = 0; i < 8; ++i) longp.insert(longp.end(), prompts[2].begin(), prompts[2].end());
    Client c{submit(e, request(longp, 2, 50)), {}};
    e.step();
    e.check_state();
    const int64_t stored = e.metrics().kv_bytes - baseline;
    CHECK(stored > 0);
    c.ticket->cancel();
    e.step();
    e.check_state();
    c.take();
    CHECK(c.answer.status == 499);
    CHECK(e.metrics().kv_bytes == e.metrics().kv_cached_bytes);
    CHECK(e.metrics().kv_bytes <= baseline + stored);
    CHECK(e.metrics().requests_cancelled == 3);
  }
}

// q8_0 K/V: the budget counts its real bytes (a byte a code, two a scale of 32 codes).
TEST_CASE("server engine: under a small K/V budget unused prefixes are evicted, running requests keep theirs") {
  const Loaded& m = loaded();  // texts compared across batches of 6 and of 2
  // q8_0 on f32 products: its int8 and bf16 dot-product kernels are not batch-invariant (docs/serving.md), so on a
  // CPU that takes them by default (VNNI) the texts of a batch of 6 and of 2 may part.
  const cpu::Int8Products int8(false);
  const cpu::Bf16Products bf16(false);
  for (DType dt : {DType::f16, DType::q8_0}) {
    CAPTURE(std::string(dtype_name(dt)));
    // Prompts of ~75 tokens, each its own beginning; the budget holds about three of them with their output.
    std::vector<std::string> texts;
    for (int i = 0; i < 6; ++i)
      texts.push_back("Story number " + std::to_string(i) + ". " + kPrompts[size_t(i) % kPrompts.size()] + " " +
                      kPrompts[size_t(i + 1) % kPrompts.size()] + " " + kPrompts[size_t(i + 2) % kPrompts.size()]);
    const auto prompts = encode_all(m.tok, texts);
    EngineConfig rc = config(AttnMethod::cascade, 6);
    rc.kv_dtype = dt;
    Engine roomy(m.model, m.tok, rc);
    std::vector<Client> want;
    for (const auto& p : prompts) want.push_back({submit(roomy, request(p, 1, 8)), {}});
    std::vector<Client*> all_want;
    for (Client& cl : want) all_want.push_back(&cl);
    run(roomy, all_want);

    EngineConfig c = config(AttnMethod::cascade, 2);
    c.kv_dtype = dt;
    const llama::Hparams& hp = m.model.hparams();
    const int64_t elems = hp.n_layer * 2 * hp.n_head_kv * hp.head_dim;  // K and V of one token, every layer
    CHECK(Engine(m.model, m.tok, c).kv_token_bytes() == (dt == DType::q8_0 ? elems + elems / 32 * 2 : elems * 2));
    c.kv_budget = 250 * Engine(m.model, m.tok, c).kv_token_bytes();
    Engine e(m.model, m.tok, c);
    std::vector<Client> clients;
    for (const auto& p : prompts) clients.push_back({submit(e, request(p, 1, 8)), {}});
    std::vector<Client*> all;
    for (Client& cl : clients) all.push_back(&cl);
    run(e, all, c.kv_budget);
    for (size_t i = 0; i < prompts.size(); ++i) {
      CAPTURE(i);
      CHECK(clients[i].answer.text == want[i].answer.text);
    }
    CHECK(e.metrics().evicted_tokens > 0);
    // A request that could never fit is refused up front.
    CHECK(e.check(request(prompts[0], 2, 300)).message.find("--kv-budget") != std::string::npos);
  }
}

TEST_CASE("server engine: stop strings, max_tokens 0, the queue's bound, requests that cannot fit") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  Engine e(m.model, m.tok, config(AttnMethod::cascade, 4));
  const Answer full = run_one(e, request(prompts[3], 1, 24));
  REQUIRE(full.text[0].size() > 12);
  GenRequest r = request(prompts[3], 1, 24);
  r.stop = {"@never@", full.text[0].substr(6, 5)};
  const Answer cut = run_one(e, r);
  CHECK(cut.text[0] == full.text[0].substr(0, full.text[0].find(r.stop[1])));
  CHECK(cut.finish[0] == "stop");

  const Answer none = run_one(e, request(prompts[3], 2, 0));
  CHECK(none.text == std::vector<std::string>{"", ""});
  CHECK(none.finish == std::vector<std::string>{"length", "length"});
  CHECK(none.usage.completion_tokens == 0);

  EngineConfig c = config(AttnMethod::cascade, 4);
  c.max_queue = 1;
  Engine small(m.model, m.tok, c);
  Engine::Admission why;
  CHECK(small.submit(request(prompts[0], 1, 4), &why));
  CHECK(!small.submit(request(prompts[0], 1, 4), &why));
  CHECK(why == Engine::Admission::queue_full);
  CHECK(small.metrics().requests_refused == 1);

  CHECK(e.check(request(prompts[0], 5, 4)).message.find("-np") != std::string::npos);
  CHECK(e.check(request(prompts[0], 1, 1024)).message.find("context") != std::string::npos);
  CHECK(e.check(request({}, 1, 4)).message.find("no tokens") != std::string::npos);
  CHECK(e.check(request({1, 2, int32_t(m.tok.n_vocab())}, 1, 4)).message.find("vocabulary") != std::string::npos);
}

namespace {

// The logits of every position of `tokens`, from one prefill pass of its own (f16 K/V, as the engine's):
// (rows, n_vocab).
std::vector<float> reference_logits(const llama::Model& model, const std::vector<int32_t>& tokens) {
  const llama::Hparams& hp = model.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f16);
  const int seg = cache.add_segment(-1, 0);
  std::vector<int32_t> pos;
  std::vector<int64_t> rows;
  for (size_t i = 0; i < tokens.size(); ++i) pos.push_back(int32_t(i)), rows.push_back(int64_t(i));
  cache.begin_step({{seg, int64_t(tokens.size()), 0}});
  std::vector<float> logits;
  model.forward(tokens, pos, cache, rows, logits);
  return logits;
}

}  // namespace

TEST_CASE("server engine: logprobs are the log-softmax of the model's logits, penalties and bias pick the token") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  const int64_t V = m.tok.n_vocab();
  Engine e(m.model, m.tok, config(AttnMethod::cascade, 4));
  // Greedy, so the token each step takes is the argmax of the adjusted logits, computed below from the reference.
  GenRequest r = request(prompts[3], 2, 24);
  r.logprobs = 5;
  r.sampling.repetition_penalty = 1.3f;
  r.sampling.frequency_penalty = 0.3f;
  r.sampling.presence_penalty = 0.4f;
  r.sampling.logit_bias = {{m.tok.encode(" the", false)[0], 1.5f}, {m.tok.encode(",", false)[0], -2.0f}};
  const Answer got = run_one(e, r);
  const Answer plain = run_one(e, request(prompts[3], 1, 24));
  CHECK(got.text[0] != plain.text[0]);  // the adjustments changed the text
  double worst = 0;
  CHECK(got.text[0] == got.text[1]);  // greedy: both choices agree
  {
    const std::vector<server::TokenInfo>& toks = got.tokens[0];
    REQUIRE(int64_t(toks.size()) == got.usage.completion_tokens / 2);
    std::vector<int32_t> seq = r.prompt;
    std::string text;
    int64_t chars = 0;
    for (const server::TokenInfo& t : toks) {
      CHECK(t.byte_offset == int64_t(text.size()));
      CHECK(t.text_offset == chars);
      const std::string piece = m.tok.token_piece(t.lp.token);
      text += piece;
      for (unsigned char c : piece) chars += (c & 0xC0) != 0x80;
      seq.push_back(t.lp.token);
    }
    CHECK(text == got.text[0]);
    const std::vector<float> logits = reference_logits(m.model, seq);
    std::vector<int32_t> drawn;
    for (size_t k = 0; k < toks.size(); ++k) {
      CAPTURE(k);
      const float* row = logits.data() + (r.prompt.size() - 1 + k) * size_t(V);
      // The reference log-softmax, in double.
      double mx = -INFINITY, sum = 0;
      for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(row[i]));
      for (int64_t i = 0; i < V; ++i) sum += std::exp(double(row[i]) - mx);
      const auto ref = [&](int32_t id) { return double(row[id]) - mx - std::log(sum); };
      const server::TokenInfo& t = toks[k];
      // (The engine's decode steps and this one prefill pass round differently: 0.0009 at most on AVX-512.)
      const auto close = [](double a, double b) { return std::fabs(a - b) <= 3e-3 + 1e-3 * std::fabs(b); };
      CHECK(close(t.lp.logprob, ref(t.lp.token)));
      worst = std::max(worst, std::fabs(t.lp.logprob - ref(t.lp.token)));
      REQUIRE(t.lp.top.size() == 5);
      for (size_t q = 0; q < 5; ++q) {
        CHECK(close(t.lp.top[q].second, ref(t.lp.top[q].first)));
        if (q) CHECK(t.lp.top[q].second <= t.lp.top[q - 1].second);
      }
      // No token outside the five beats the fifth (beyond rounding).
      int n_above = 0;
      for (int64_t i = 0; i < V; ++i) n_above += ref(int32_t(i)) > double(t.lp.top[4].second) + 3e-3;
      CHECK(n_above <= 4);
      // The token is the argmax of the logits adjusted as sampler.hpp defines it (within rounding of the best).
      std::map<int32_t, int> count;
      for (int32_t d : drawn) ++count[d];
      const auto adjusted = [&](int32_t id) {
        double x = row[id];
        for (const auto& [b_id, b] : r.sampling.logit_bias) x += b_id == id ? b : 0;
        const bool seen = count.count(id) || std::find(r.prompt.begin(), r.prompt.end(), id) != r.prompt.end();
        if (seen) x = x > 0 ? x / r.sampling.repetition_penalty : x * r.sampling.repetition_penalty;
        if (count.count(id)) x -= count[id] * double(r.sampling.frequency_penalty) + r.sampling.presence_penalty;
        return x;
      };
      double best = -INFINITY;
      for (int64_t i = 0; i < V; ++i) best = std::max(best, adjusted(int32_t(i)));
      CHECK(adjusted(t.lp.token) >= best - 3e-3);
      drawn.push_back(t.lp.token);
    }
  }
  MESSAGE("largest logprob difference from the reference: " << worst);

  // A stop string that begins where a token does: the tokens reported are those whose text begins before the
  // cut (that token not), and the text is theirs.
  GenRequest s = request(prompts[3], 1, 24);
  s.logprobs = 0;
  const Answer full = run_one(e, s);
  size_t k = 3;
  const auto at = [&](size_t i) { return size_t(full.tokens[0][i].byte_offset); };
  while (k + 1 < full.tokens[0].size() &&
         (at(k + 1) - at(k) < 2 || full.text[0].find(full.text[0].substr(at(k), 2)) != at(k)))
    ++k;
  REQUIRE(k + 1 < full.tokens[0].size());
  s.stop = {full.text[0].substr(at(k), 2)};
  const Answer cut = run_one(e, s);
  const std::string& kept = cut.text[0];
  CHECK(kept == full.text[0].substr(0, full.text[0].find(s.stop[0])));
  size_t n_before = 0;
  while (n_before < full.tokens[0].size() && full.tokens[0][n_before].byte_offset < int64_t(kept.size())) ++n_before;
  CHECK(n_before == k);
  REQUIRE(cut.tokens[0].size() == n_before);
  for (size_t k = 0; k < n_before; ++k) {
    CHECK(cut.tokens[0][k].lp.token == full.tokens[0][k].lp.token);
    CHECK(cut.tokens[0][k].lp.top.empty());
  }
}

TEST_CASE("server engine: draining lets running requests finish, refuses queued ones, and stops the loop") {
  const Loaded& m = loaded();
  const auto prompts = encode_all(m.tok, kPrompts);
  EngineConfig c = config(AttnMethod::cascade, 2);
  Engine e(m.model, m.tok, c);
  e.start();
  Client a{submit(e, request(prompts[0], 2, 20)), {}};
  // Wait (bounded) until it runs, so it is not merely queued when the drain starts.
  for (int i = 0; i < 500 && e.metrics().active_requests == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  Client q{submit(e, request(prompts[1], 1, 20)), {}};  // waits: both slots are taken
  CHECK(e.drain(std::chrono::seconds(60)));
  a.take();
  q.take();
  CHECK(a.answer.ended);
  CHECK(a.answer.error.empty());
  CHECK(a.answer.text.size() == 2);
  CHECK(q.answer.status == 503);
  Engine::Admission why;
  CHECK(!e.submit(request(prompts[0], 1, 4), &why));
  CHECK(why == Engine::Admission::draining);

  // A drain that runs out of time cuts what runs, with an error.
  Engine f(m.model, m.tok, c);
  f.start();
  Client b{submit(f, request(prompts[0], 1, 1000 - int(prompts[0].size()))), {}};
  for (int i = 0; i < 500 && f.metrics().active_requests == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK_FALSE(f.drain(std::chrono::milliseconds(0)));
  b.take();
  CHECK(b.answer.status == 503);
}

}  // namespace test_server_engine
