// Bytes -> one request through the server's API without sockets (server/api.hpp: Api::handle, as the HTTP layer
// calls it) -> routing, the API key, parsing and validation of the body, admission into an Engine, and the answer
// as the HTTP layer would send it: the whole body, or a stream read piece by piece. The engine runs a tiny Llama
// model from the project's GGUF writer (model_seed.hpp: 24-token byte-level BPE vocabulary, ChatML template,
// 64-token context), stepped on this thread, so every generation is short and each input is replayable alone.
//
// Input: byte 0 selects the request, the rest is the body.
//   bits 0-2  path: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/tiny, /health, /metrics,
//             /v1/models/ + the body's bytes, /v1/embeddings (unknown)
//   bit 3     the other method (GET for POST endpoints, POST for GET ones)
//   bit 4     a server started with an API key; bit 5: the request carries it (else a wrong one, or none)
//   bit 6     a server that is draining (shutting down)
//   bit 7     a streamed answer's client leaves after the first piece
// Fine answers: 200, 400, 401, 404, 405, and 503 from the draining server only, each with a well-formed body (an
// OpenAI error object with a code for every error but /health's 503, which says {"status": "shutting down"}). A
// crash, UB, an exception, a 5xx otherwise, a malformed body or a stream that does not end with [DONE], a choice
// count other than `n`, or K/V left behind by a request that ended is not.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/error.hpp"
#include "tiny_model.hpp"
#include "server/api.hpp"
#include "server/engine.hpp"
#include "one_thread.hpp"

namespace {

using namespace cascade;
using json = nlohmann::json;

constexpr int kMaxSteps = 2000;  // a request of the tiny model ends in at most ~70 steps
constexpr const char* kKey = "sesame";

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_request: %s\n", what.c_str());
  std::abort();
}

// 24-token byte-level BPE vocabulary with ChatML specials and template, the rest model_seed.hpp's defaults.
const fuzz::TinyModel& tiny() {
  static const fuzz::TinyModel* t = [] {
    fuzz::ModelSeed s;
    s.n_vocab = 24;
    s.vocab = 1;
    return new fuzz::TinyModel(s);
  }();  // never destroyed: the fuzzer exits without running destructors anyway
  return *t;
}

server::EngineConfig engine_config() {
  server::EngineConfig c;
  c.n_parallel = 4;
  c.n_ctx = 64;
  c.n_threads = 1;
  c.n_batch = 16;
  c.max_queue = 4;
  c.attn = AttnMethod::cascade;  // auto would calibrate at every engine's start
  c.kv_dtype = DType::f32;
  return c;
}

// Steps the engine until nothing runs or waits (bounded).
void run_engine(server::Engine& e) {
  for (int i = 0; i < kMaxSteps; ++i) {
    e.step();
    e.check_state();
    const server::EngineMetrics m = e.metrics();
    if (m.active_requests == 0 && m.queue_depth == 0) return;
  }
  fail("a request did not end in " + std::to_string(kMaxSteps) + " steps");
}

json parse_or_fail(std::string_view text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(what + " is not JSON (" + e.what() + "): " + std::string(text.substr(0, 200)));
  }
}

void check_error_body(int status, std::string_view body) {
  const json j = parse_or_fail(body, "an error body (" + std::to_string(status) + ")");
  if (!j.is_object() || !j.contains("error") || !j["error"].is_object() || !j["error"].contains("message") ||
      !j["error"]["message"].is_string() || !j["error"].contains("code") || !j["error"]["code"].is_string())
    fail("an error body is not an OpenAI error object with a code: " + std::string(body.substr(0, 200)));
}

void check_usage(const json& u) {
  if (!u.is_object()) fail("usage is not an object");
  const int64_t p = u.at("prompt_tokens"), c = u.at("completion_tokens"), t = u.at("total_tokens");
  const int64_t cached = u.at("prompt_tokens_details").at("cached_tokens");
  if (p < 1 || c < 0 || t != p + c || cached < 0 || cached > p) fail("usage does not add up: " + u.dump());
}

// The number of choices an admitted request asked for.
int choices_asked(std::string_view body) {
  const json j = json::parse(body);
  const auto it = j.find("n");
  return it == j.end() || it->is_null() ? 1 : it->get<int>();
}

void check_whole(std::string_view body, int n, bool chat) {
  const json j = parse_or_fail(body, "an answer");
  const json& choices = j.at("choices");
  if (!choices.is_array() || int(choices.size()) != n)
    fail("an answer has " + std::to_string(choices.size()) + " choices for n = " + std::to_string(n));
  for (int i = 0; i < n; ++i) {
    const json& c = choices[size_t(i)];
    if (c.at("index") != i) fail("choices out of order");
    const std::string reason = c.at("finish_reason");
    if (reason != "stop" && reason != "length") fail("finish_reason '" + reason + "'");
    if (!(chat ? c.at("message").at("content") : c.at("text")).is_string()) fail("a choice without its text");
  }
  check_usage(j.at("usage"));
}

// Splits a stream's bytes into SSE events; each is a comment, `data: [DONE]` (last) or `data: ` and JSON.
void check_stream(const std::string& s, int n, bool complete) {
  size_t at = 0;
  bool done = false;
  std::vector<bool> finished(size_t(n), false);
  while (at < s.size()) {
    const size_t end = s.find("\n\n", at);
    if (end == std::string::npos) fail("a stream piece does not end an event: " + s.substr(at, 200));
    const std::string ev = s.substr(at, end - at);
    at = end + 2;
    if (done) fail("an event after [DONE]");
    if (ev == ":") continue;
    if (!ev.starts_with("data: ")) fail("a stream event that is not data: " + ev.substr(0, 200));
    if (ev == "data: [DONE]") {
      done = true;
      continue;
    }
    const json j = parse_or_fail(std::string_view(ev).substr(6), "a stream event");
    if (j.contains("error")) {
      check_error_body(200, ev.substr(6));
      fail("a stream ended with an error: " + ev.substr(0, 200));
    }
    const json& choices = j.at("choices");
    if (choices.empty()) {
      check_usage(j.at("usage"));
      continue;
    }
    const int i = choices.at(0).at("index");
    if (i < 0 || i >= n) fail("a chunk for choice " + std::to_string(i) + " of " + std::to_string(n));
    if (!choices[0].at("finish_reason").is_null()) finished[size_t(i)] = true;
  }
  if (complete) {
    if (!done) fail("a stream without [DONE]");
    for (bool f : finished)
      if (!f) fail("a stream choice without its finish_reason");
  }
}

struct Case {
  std::string method, path, auth;
  bool keyed, draining, leave;
};

Case decode(uint8_t sel, std::string_view body) {
  static const char* const paths[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/tiny",
                                      "/health", "/metrics", nullptr, "/v1/embeddings"};
  Case c;
  const int p = sel & 7;
  c.path = paths[p] ? paths[p] : "/v1/models/" + std::string(body);
  const bool post = p <= 1 || p == 7;
  c.method = (post != bool(sel & 8)) ? "POST" : "GET";
  c.keyed = sel & 16;
  if (sel & 32) c.auth = std::string("Bearer ") + kKey;
  else if (c.keyed) c.auth = body.empty() ? "" : "Bearer x";
  c.draining = sel & 64;
  c.leave = sel & 128;
  return c;
}

}  // namespace

// As fuzz_model.cpp: the attention's per-thread scratch lives in oneTBB's allocator, which LeakSanitizer does not
// scan; scripts/sanitize.sh still checks it at exit.
extern "C" const char* __lsan_default_suppressions() { return "leak:cascade::cpu::detail::run_items\n"; }

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_on_one_thread();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const fuzz::TinyModel& t = tiny();
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);  // exact size for ASan
  const Case c = decode(data[0], body);
  try {
    server::Engine engine(t.model, t.tok, engine_config());
    server::ApiConfig cfg{"tiny", c.keyed ? kKey : "", t.tok.vocab().chat_template};
    server::Api api(engine, t.tok, cfg);
    if (c.draining) api.set_draining();
    server::Reply r = api.handle(c.method, c.path, c.auth, body);
    const bool chat = c.path == "/v1/chat/completions";
    if (!r.pending) {
      if (r.status >= 500 && !(r.status == 503 && c.draining)) fail("status " + std::to_string(r.status));
      if (r.status != 200 && r.status != 400 && r.status != 401 && r.status != 404 && r.status != 405 &&
          r.status != 503)
        fail("status " + std::to_string(r.status));
      const bool health = c.path == "/health" && c.method == "GET";  // {"status": ...}, 503 while draining
      if (health) {
        if (!parse_or_fail(r.body, "/health's answer").contains("status")) fail("/health without a status");
      } else if (r.status != 200) {
        check_error_body(r.status, r.body);
      } else if (c.path != "/metrics") {
        parse_or_fail(r.body, "an answer of " + c.path);
      }
      engine.check_state();
      return 0;
    }
    if (c.draining) fail("a draining server admitted a request");
    if (c.method != "POST") fail("a generation admitted through " + c.method);
    const int n = choices_asked(body);
    std::shared_ptr<server::Responder> gen = std::move(r.pending);
    if (!gen->streamed()) {
      run_engine(engine);
      int status = 0;
      std::string answer;
      gen->finish(status, answer);
      if (status != 200) fail("an admitted request ended with " + std::to_string(status) + ": " + answer);
      check_whole(answer, n, chat);
    } else {
      std::string stream;
      bool more = true;
      for (int i = 0; more && i < kMaxSteps; ++i) {
        std::string piece;
        more = gen->next(piece, std::chrono::milliseconds(0));
        stream += piece;
        if (c.leave && !piece.empty()) {
          gen->cancel();
          break;
        }
        engine.step();
        engine.check_state();
      }
      if (more && !c.leave) fail("a stream did not end in " + std::to_string(kMaxSteps) + " pieces");
      check_stream(stream, n, !c.leave);
      gen.reset();  // a stream's client gone before its end cancels the request
      run_engine(engine);
    }
    const server::EngineMetrics m = engine.metrics();
    if (m.active_requests || m.active_sequences || m.kv_reserved_bytes)
      fail("an ended request left running state or reserved K/V behind");
    if (m.kv_bytes != m.kv_cached_bytes) fail("K/V stored beside the cached prefixes after every request ended");
  } catch (const Error& e) {
    fail(std::string("cascade::Error escaped the API: ") + e.what());
  } catch (const json::exception& e) {
    fail(std::string("an answer lacks a field: ") + e.what());
  }
  return 0;
}
