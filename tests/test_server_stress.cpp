// The server's scheduler under concurrent clients (scripts/tsan.sh runs this suite under ThreadSanitizer): client
// threads send requests through the API (server/api.hpp, as the HTTP layer does) to an engine whose loop runs on
// its own thread, and read the answers whole or streamed, cancel them midway or leave without a word, at random
// for a bounded time. Every answer that completes must be well-formed; every greedy one must be the text the same
// request gets alone. The model is tiny (fuzz/model_seed.hpp, random Q8_0 weights) so that the run is many
// requests and scheduling decisions rather than a few long forward passes. It runs on the default path -- int8
// linear layers, f16 K/V, `auto` attention, batch-invariant reductions -- so "as alone" is the guarantee
// docs/serving.md ("Determinism") gives, checked under load.
//
// The random seed is printed; CASCADE_STRESS_SEED=N replays the same choices (the interleaving differs).
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fuzz/tiny_model.hpp"
#include "server/api.hpp"
#include "server/engine.hpp"

namespace test_server_stress {

using namespace cascade;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Two layers, GQA 2, a 32-token byte-level BPE vocabulary, random weights in Q8_0.
fuzz::ModelSeed tiny_seed() {
  fuzz::ModelSeed s;
  s.n_layer = 2;
  s.n_embd = 32;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.n_ff = 64;
  s.n_vocab = 32;
  s.vocab = 1;
  s.n_ctx = 128;
  s.random = 7;
  s.matrices = gguf::TensorType::Q8_0;
  s.scale = 1.0f / 127;  // codes in [-127, 127]: weights in [-1, 1]
  return s;
}

server::EngineConfig config(int n_threads) {
  server::EngineConfig c;
  c.n_parallel = 6;
  c.n_ctx = 128;
  c.n_threads = n_threads;
  c.n_batch = 24;  // several prefill steps for the longer prompts, beside decoding sequences
  c.max_queue = 6;
  c.attn = AttnMethod::auto_;
  c.kv_dtype = DType::f16;
  c.kv_budget = 0;  // 2 x n_parallel x n_ctx tokens: cached prefixes get evicted under this load
  return c;
}

// One request as a client sends it, and what it asks for.
struct Ask {
  std::string body;
  int n = 1;
  bool greedy = false, stream = false;
  bool usage = false;  // streamed: the usage chunk asked for (stream_options.include_usage)
};

Ask random_ask(std::mt19937_64& rng) {
  // Prompts share beginnings so that the prefix tree forks, holds and evicts.
  static const char* const stems[] = {"hello world ", "hell low ", "he he he ", "w w w hello "};
  std::string prompt = stems[rng() % 4];
  for (int k = int(rng() % 40); k > 0; --k) prompt += char('a' + rng() % 11);
  Ask a;
  a.n = 1 + int(rng() % 3);
  a.greedy = rng() % 2;
  a.stream = rng() % 2;
  json j = {{"prompt", prompt}, {"n", a.n}, {"max_tokens", int(rng() % 24)}, {"stream", a.stream},
            {"temperature", a.greedy ? 0.0 : 0.9}, {"seed", int(rng() % 1000)}};
  if (rng() % 4 == 0) j["stop"] = json::array({std::string(1, char('a' + rng() % 11))});
  if (rng() % 4 == 0) j["ignore_eos"] = true;
  a.usage = a.stream && rng() % 2;
  if (a.usage) j["stream_options"] = {{"include_usage", true}};
  a.body = j.dump();
  return a;
}

// The text of each choice of a whole answer; fails the test when it is malformed.
std::vector<std::string> whole_texts(const std::string& body, int n) {
  const json j = json::parse(body);
  std::vector<std::string> out;
  REQUIRE(j.at("choices").size() == size_t(n));
  for (int i = 0; i < n; ++i) {
    const json& c = j["choices"][size_t(i)];
    REQUIRE(c.at("index") == i);
    const std::string reason = c.at("finish_reason");
    REQUIRE((reason == "stop" || reason == "length"));
    out.push_back(c.at("text"));
  }
  const json& u = j.at("usage");
  REQUIRE(u.at("total_tokens") == u.at("prompt_tokens").get<int>() + u.at("completion_tokens").get<int>());
  return out;
}

// The text of each choice of a complete stream; fails the test when it is malformed, or has a usage chunk when
// none was asked for or none when one was.
std::vector<std::string> stream_texts(const std::string& sse, int n, bool want_usage) {
  std::vector<std::string> out(static_cast<size_t>(n));
  std::vector<int> finished(size_t(n), 0);
  size_t at = 0;
  bool done = false, usage = false;
  while (at < sse.size()) {
    const size_t end = sse.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    const std::string ev = sse.substr(at, end - at);
    at = end + 2;
    REQUIRE(!done);
    if (ev == ":") continue;
    REQUIRE(ev.starts_with("data: "));
    if (ev == "data: [DONE]") {
      done = true;
      continue;
    }
    const json j = json::parse(ev.substr(6));
    REQUIRE(!j.contains("error"));
    if (j.at("choices").empty()) {
      usage = true;
      continue;
    }
    const json& c = j["choices"][0];
    const int i = c.at("index");
    REQUIRE((i >= 0 && i < n));
    REQUIRE(finished[size_t(i)] == 0);
    if (!c.at("finish_reason").is_null()) finished[size_t(i)] = 1;
    else out[size_t(i)] += c.at("text").get<std::string>();
  }
  REQUIRE(done);
  REQUIRE(usage == want_usage);
  for (int f : finished) REQUIRE(f == 1);
  return out;
}

struct Tally {
  std::mutex mu;
  std::map<std::string, std::vector<std::string>> greedy;  // body without "stream" -> texts, first seen
  std::vector<std::pair<std::string, std::vector<std::string>>> checks;
  int whole = 0, streamed = 0, cancelled = 0, left = 0, refused = 0;
};

// The body with "stream" false, so a streamed and a whole greedy answer of one request compare.
std::string unstreamed(const std::string& body) {
  json j = json::parse(body);
  j["stream"] = false;
  j.erase("stream_options");
  return j.dump();
}

void client_loop(server::Api& api, uint64_t seed, Clock::time_point until, Tally& tally) {
  std::mt19937_64 rng(seed);
  while (Clock::now() < until) {
    const Ask a = random_ask(rng);
    server::Reply r = api.handle("POST", "/v1/completions", "", a.body);
    if (r.status == 503) {  // the queue is full: a client backs off
      std::lock_guard lock(tally.mu);
      ++tally.refused;
      std::this_thread::sleep_for(std::chrono::milliseconds(1 + rng() % 5));
      continue;
    }
    REQUIRE_MESSAGE(r.pending, r.status << " " << r.body);
    const int action = int(rng() % 8);  // 0: cancel midway, 1: leave (drop the answer), else read it all
    std::vector<std::string> texts;
    if (action == 1) {
      if (rng() % 2) std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 4));
      r.pending.reset();
      std::lock_guard lock(tally.mu);
      ++tally.left;
      continue;
    }
    if (!a.stream) {
      if (action == 0) {
        r.pending->cancel();
        int status = 0;
        std::string body;
        r.pending->finish(status, body);  // the whole answer, or the error a cancelled request ends with
        REQUIRE((status == 200 || status == 503));
        std::lock_guard lock(tally.mu);
        ++tally.cancelled;
        continue;
      }
      int status = 0;
      std::string body;
      r.pending->finish(status, body);
      REQUIRE_MESSAGE(status == 200, body);
      texts = whole_texts(body, a.n);
    } else {
      std::string sse;
      const int cut = action == 0 ? 1 + int(rng() % 6) : -1;
      bool more = true;
      for (int piece = 0; more && piece < 100000; ++piece) {
        if (piece == cut) break;
        more = r.pending->next(sse, std::chrono::milliseconds(int(rng() % 3)));
      }
      if (more) {
        REQUIRE(action == 0);
        r.pending->cancel();
        r.pending.reset();
        std::lock_guard lock(tally.mu);
        ++tally.cancelled;
        continue;
      }
      texts = stream_texts(sse, a.n, a.usage);
    }
    std::lock_guard lock(tally.mu);
    ++(a.stream ? tally.streamed : tally.whole);
    if (a.greedy) tally.checks.push_back({unstreamed(a.body), texts});
  }
}

// A failed assertion on a client thread throws; the thread records it and stops instead of ending the process.
void client(server::Api& api, uint64_t seed, Clock::time_point until, Tally& tally, std::atomic<int>& failures) {
  try {
    client_loop(api, seed, until, tally);
  } catch (...) {
    ++failures;
  }
}

uint64_t stress_seed() {
  if (const char* s = std::getenv("CASCADE_STRESS_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}();
}

}  // namespace

TEST_CASE("server stress: clients stream, cancel and leave at random, answers are whole, greedy ones as alone") {
  const fuzz::TinyModel t(tiny_seed());
  const uint64_t seed = stress_seed();
  std::printf("server stress: seed %llu (CASCADE_STRESS_SEED=%llu replays its choices)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  MESSAGE("seed " << seed);
  Tally tally;
  std::atomic<int> failures{0};
  constexpr int kClients = 6;
  const auto run_for = std::chrono::milliseconds(2500);
  {
    server::Engine engine(t.model, t.tok, config(2));
    server::Api api(engine, t.tok, {"tiny", "", t.tok.vocab().chat_template});
    engine.start();
    const Clock::time_point until = Clock::now() + run_for;
    std::vector<std::thread> threads;
    for (int c = 0; c < kClients; ++c)
      threads.emplace_back([&, c] { client(api, seed * 31 + uint64_t(c), until, tally, failures); });
    // Meanwhile another thread reads the metrics, as /metrics does.
    std::atomic<bool> stop{false};
    std::thread watcher([&] {
      while (!stop.load()) {
        const server::EngineMetrics m = engine.metrics();
        CHECK(m.kv_bytes <= m.kv_budget);
        (void)api.metrics_text();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    for (std::thread& th : threads) th.join();
    stop = true;
    watcher.join();
    REQUIRE(failures.load() == 0);
    REQUIRE(engine.drain(std::chrono::seconds(60)));
    engine.check_state();
    const server::EngineMetrics m = engine.metrics();
    CHECK(m.active_requests == 0);
    CHECK(m.queue_depth == 0);
    CHECK(m.kv_reserved_bytes == 0);
    CHECK(m.kv_bytes == m.kv_cached_bytes);
  }
  std::printf("server stress: %d whole, %d streamed, %d cancelled, %d left, %d refused (queue full); %zu greedy\n",
              tally.whole, tally.streamed, tally.cancelled, tally.left, tally.refused, tally.checks.size());
  CHECK(tally.whole + tally.streamed > 0);
  // Each greedy answer against the same request alone on an engine of its own (at most 40 of them).
  server::Engine alone(t.model, t.tok, config(2));  // the same threads: the same row splits
  server::Api api(alone, t.tok, {"tiny", "", t.tok.vocab().chat_template});
  alone.start();
  std::map<std::string, std::vector<std::string>> ref;
  for (size_t k = 0; k < tally.checks.size() && k < 40; ++k) {
    const auto& [body, texts] = tally.checks[k];
    auto it = ref.find(body);
    if (it == ref.end()) {
      server::Reply r = api.handle("POST", "/v1/completions", "", body);
      REQUIRE(r.pending);
      int status = 0;
      std::string answer;
      r.pending->finish(status, answer);
      REQUIRE(status == 200);
      it = ref.emplace(body, whole_texts(answer, int(texts.size()))).first;
    }
    CAPTURE(body);
    CHECK(texts == it->second);
  }
  CHECK(alone.drain(std::chrono::seconds(60)));
}

}  // namespace test_server_stress
