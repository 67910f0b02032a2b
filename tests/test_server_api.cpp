// The server's text handling (server/text.hpp) and its API without sockets (server/api.hpp: Api::handle, as the
// HTTP layer and a fuzzer call it): stop strings across token boundaries, UTF-8 held back, routing, keys,
// refusals that leave the engine untouched, and whole and streamed answers.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>

#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "server/api.hpp"
#include "server/text.hpp"

using namespace cascade;
using json = nlohmann::json;
using server::StopText;

TEST_CASE("server text: stop strings end the text, across token boundaries, earliest first") {
  StopText t({"END", "ab"});
  CHECK_FALSE(t.append("hello E"));
  CHECK(t.take() == "hello ");  // "E" may begin "END"
  CHECK_FALSE(t.append("Nx a"));
  CHECK(t.take() == "ENx ");  // "ENx" cannot become "END"; "a" may begin "ab"
  CHECK(t.append("bcd"));
  CHECK(t.text() == "hello ENx ");
  CHECK(t.take() == "");
  CHECK(t.append("more"));  // nothing changes once stopped
  CHECK(t.text() == "hello ENx ");

  StopText two({"cd", "bcd"});
  CHECK(two.append("xabcde"));
  CHECK(two.text() == "xa");  // "bcd" starts first
  StopText none;
  CHECK_FALSE(none.append("abc"));
  CHECK(none.take() == "abc");
}

TEST_CASE("server text: a UTF-8 character split across tokens waits for its last byte") {
  StopText t;
  const std::string euro = "\xE2\x82\xAC";  // U+20AC, three bytes
  t.append("price " + euro.substr(0, 1));
  CHECK(t.take() == "price ");
  t.append(euro.substr(1, 1));
  CHECK(t.take() == "");
  t.append(euro.substr(2) + "5");
  CHECK(t.take() == euro + "5");
  t.append("\xF0\x9F");  // half of a 4-byte character, then the end: given out as it is
  CHECK(t.take() == "");
  CHECK(t.take(true) == "\xF0\x9F");
}

namespace {

struct Served {
  gguf::File file;
  Tokenizer tok;
  llama::Model model;
  server::Engine engine;
  server::Api api;
  // The f32 linear path, so that two greedy choices of one prompt are the same text (see test_server_engine.cpp).
  explicit Served(const char* path, const std::string& key)
      : file(gguf::File::open(path)), tok(load_vocab(file)), model(llama::Model::load(file, llama::LinearPath::f32)),
        engine(model, tok, [] {
          server::EngineConfig c;
          c.attn = AttnMethod::cascade;
          c.n_parallel = 2;
          c.n_ctx = 128;
          c.max_queue = 2;
          return c;
        }()),
        api(engine, tok, {"tiny-model", key, tok.vocab().chat_template}) {}
};

json parse(const std::string& s) { return json::parse(s); }

}  // namespace

TEST_CASE("server api: routing, keys and refusals without a socket; refusals leave the engine untouched") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "k3y");
  const std::string key = "Bearer k3y";
  CHECK(s.api.handle("GET", "/health", "", "").status == 200);
  CHECK(s.api.handle("GET", "/v1/models", "", "").status == 401);
  CHECK(s.api.handle("GET", "/v1/models", "Bearer k3", "").status == 401);
  const server::Reply models = s.api.handle("GET", "/v1/models", key, "");
  CHECK(models.status == 200);
  CHECK(parse(models.body)["data"][0]["id"] == "tiny-model");
  CHECK(s.api.handle("GET", "/v1/completions", key, "").status == 405);
  CHECK(s.api.handle("GET", "/nope", key, "").status == 404);
  for (const char* body : {"", "{", "null", "[]", R"({"prompt": 1})", R"({"prompt": "x", "n": 3})",
                           R"({"prompt": "x", "model": "other"})", R"({"prompt": "x", "max_tokens": 128})",
                           R"({"prompt": "x", "temperature": 9})", R"({"prompt": [0, 49152]})"}) {
    CAPTURE(body);
    const server::Reply r = s.api.handle("POST", "/v1/completions", key, body);
    CHECK(r.status == 400);
    CHECK(!r.pending);
    const json e = parse(r.body)["error"];
    CHECK(e["type"] == "invalid_request_error");
    CHECK(!e["message"].get<std::string>().empty());
  }
  CHECK(s.engine.metrics().requests == 0);
  CHECK(s.engine.metrics().kv_bytes == 0);
  const std::string m = s.api.metrics_text();
  CHECK(m.find("cascade_http_responses_total{code=\"400\"} 10") != std::string::npos);
  CHECK(m.find("cascade_http_responses_total{code=\"401\"} 2") != std::string::npos);
}

TEST_CASE("server api: a completion, whole and streamed, and a full queue, through handle()") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "");
  // Queued before the loop runs: the queue holds two, the third is refused with Retry-After.
  const std::string body = R"({"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "n": 2})";
  server::Reply whole = s.api.handle("POST", "/v1/completions", "", body);
  server::Reply streamed =
      s.api.handle("POST", "/v1/completions", "", R"({"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "n": 2, "stream": true})");
  const server::Reply full = s.api.handle("POST", "/v1/completions", "", body);
  CHECK(full.status == 503);
  CHECK(full.headers.size() == 1);
  CHECK(full.headers[0].first == "Retry-After");
  REQUIRE(whole.pending);
  REQUIRE(streamed.pending);
  s.engine.start();
  int status = 0;
  std::string text;
  whole.pending->finish(status, text);
  CHECK(status == 200);
  const json j = parse(text);
  CHECK(j["object"] == "text_completion");
  CHECK(j["choices"].size() == 2);
  CHECK(j["choices"][0]["text"] == j["choices"][1]["text"]);
  CHECK(j["usage"]["prompt_tokens"] == 3);
  CHECK(j["usage"]["completion_tokens"] == 12);
  std::string sse;
  for (int i = 0; i < 1000 && streamed.pending->next(sse, std::chrono::milliseconds(100));) ++i;
  CHECK(sse.ends_with("data: [DONE]\n\n"));
  std::string joined;
  size_t at = 0;
  while ((at = sse.find("data: {", at)) != std::string::npos) {
    const size_t end = sse.find("\n\n", at);
    const json c = parse(sse.substr(at + 6, end - at - 6));
    for (const json& ch : c["choices"])
      if (ch["index"] == 0) joined += ch["text"].get<std::string>();
    at = end;
  }
  CHECK(joined == j["choices"][0]["text"]);
  CHECK(s.engine.drain(std::chrono::seconds(10)));
}

TEST_CASE("server api: malformed chat content parts are refused with 400, not thrown (found by fuzz_request)") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "");
  // The fuzzer's input had a part whose "type" was an array; nlohmann's value() threw a type_error for it, which
  // escaped the API (a 500 over HTTP).
  for (const char* body : {R"({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": null, "text": "hi"}]}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": 3, "text": "hi"}]}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": "text", "text": ["hi"]}]}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "hi"}]}]})",
                           R"({"messages": [{"role": "user", "content": ["hi"]}]})"}) {
    CAPTURE(body);
    server::Reply r;
    REQUIRE_NOTHROW(r = s.api.handle("POST", "/v1/chat/completions", "", body));
    CHECK(r.status == 400);
    CHECK(!r.pending);
    const json e = parse(r.body)["error"];
    CHECK(e["param"] == "messages");
    CHECK(e["message"].get<std::string>().find("content parts") != std::string::npos);
  }
  CHECK(s.engine.metrics().requests == 0);
}
