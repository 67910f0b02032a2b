// The server's text handling (server/text.hpp) and its API without sockets (server/api.hpp: Api::handle, as the
// HTTP layer and a fuzzer call it): stop strings across token boundaries, UTF-8 held back, routing, keys,
// refusals that leave the engine untouched, and whole and streamed answers.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "server/api.hpp"
#include "server/text.hpp"

namespace test_server_api {

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
  // The default (int8) linear path: its reductions are batch-invariant, so two greedy choices of one prompt are
  // the same text.
  explicit Served(const char* path, const std::string& key, int max_tokens = 0)
      : file(gguf::File::open(path)), tok(load_vocab(file)), model(llama::Model::load(file)),
        engine(model, tok, [] {
          server::EngineConfig c;
          c.attn = AttnMethod::cascade;
          c.n_parallel = 2;
          c.n_ctx = 128;
          c.max_queue = 2;
          return c;
        }()),
        api(engine, tok, {"tiny-model", key, tok.vocab().chat_template, max_tokens}) {}
};

json parse(const std::string& s) { return json::parse(s); }

}  // namespace

TEST_CASE("server api: routing, keys and refusals without a socket, refusals leave the engine untouched") {
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
                           R"({"prompt": "x", "max_tokens": 128})",
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
  CHECK(m.find("cascade_http_responses_total{code=\"400\"} 9") != std::string::npos);
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

namespace {

// A generation through handle(), the engine running: the whole body, or the stream's data events (JSON, without
// [DONE], which must end it).
json whole(Served& s, const std::string& path, const json& body) {
  server::Reply r = s.api.handle("POST", path, "", body.dump());
  REQUIRE_MESSAGE(r.pending, r.body);
  int status = 0;
  std::string text;
  r.pending->finish(status, text);
  REQUIRE_MESSAGE(status == 200, text);
  return parse(text);
}

std::vector<json> streamed(Served& s, const std::string& path, const json& body) {
  server::Reply r = s.api.handle("POST", path, "", body.dump());
  REQUIRE_MESSAGE(r.pending, r.body);
  std::string sse;
  for (int i = 0; i < 10000 && r.pending->next(sse, std::chrono::milliseconds(100));) ++i;
  REQUIRE(sse.ends_with("data: [DONE]\n\n"));
  std::vector<json> out;
  for (size_t at = 0; (at = sse.find("data: {", at)) != std::string::npos;) {
    const size_t end = sse.find("\n\n", at);
    out.push_back(parse(sse.substr(at + 6, end - at - 6)));
    at = end;
  }
  return out;
}

}  // namespace

TEST_CASE("server api: the usage chunk only when stream_options.include_usage asks for it") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "");
  s.engine.start();
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    CAPTURE(path);
    json body = {{"max_tokens", 4}, {"temperature", 0}, {"n", 2}, {"stream", true}};
    if (std::string(path) == "/v1/completions") body["prompt"] = "The sky is";
    else body["messages"] = {{{"role", "user"}, {"content", "Hi"}}};
    for (const json& c : streamed(s, path, body)) {
      CHECK(c["choices"].size() == 1);  // every chunk has its choice: `chunk.choices[0]` always works
      CHECK_FALSE(c.contains("usage"));
    }
    body["stream_options"] = {{"include_usage", true}};
    const std::vector<json> with = streamed(s, path, body);
    REQUIRE(!with.empty());
    for (size_t i = 0; i + 1 < with.size(); ++i) {
      CHECK(with[i]["choices"].size() == 1);
      CHECK(with[i]["usage"].is_null());
    }
    CHECK(with.back()["choices"].empty());
    CHECK(with.back()["usage"]["completion_tokens"] == 8);
    body["stream_options"] = {{"include_usage", false}};
    for (const json& c : streamed(s, path, body)) CHECK(c["choices"].size() == 1);
  }
  CHECK(s.engine.drain(std::chrono::seconds(10)));
}

TEST_CASE("server api: logprobs, whole and streamed, in OpenAI's shapes") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "");
  s.engine.start();
  // Completions: tokens, token_logprobs, top_logprobs (the alternatives and the token itself), text_offset.
  const json body = {{"prompt", "The capital of France is"}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", 3}};
  // Each prompt is cached first, so that the answers compared find it so alike (a cached prompt's logits may
  // differ from a computed one's in the last bits).
  whole(s, "/v1/completions", {{"prompt", "The capital of France is"}, {"max_tokens", 1}});
  const json w = whole(s, "/v1/completions", body);
  const json& lp = w["choices"][0]["logprobs"];
  const std::string text = w["choices"][0]["text"];
  REQUIRE(lp["tokens"].size() == 6);
  std::string joined;
  for (size_t k = 0; k < 6; ++k) {
    CHECK(lp["text_offset"][k] == joined.size());  // ASCII text: characters are bytes
    joined += lp["tokens"][k].get<std::string>();
    const json& top = lp["top_logprobs"][k];
    CHECK((top.size() == 3 || top.size() == 4));
    CHECK(top.contains(lp["tokens"][k].get<std::string>()));
    double best = -INFINITY;
    for (const auto& [tok, v] : top.items()) best = std::max(best, v.get<double>());
    CHECK(lp["token_logprobs"][k].get<double>() == best);  // greedy: the token is the most probable
    CHECK(best <= 0);
  }
  CHECK(joined == text);
  // Streamed: the same tokens and numbers, spread over the chunks.
  json sb = body;
  sb["stream"] = true;
  json tokens = json::array(), values = json::array(), offsets = json::array();
  for (const json& c : streamed(s, "/v1/completions", sb)) {
    const json& l = c["choices"][0]["logprobs"];
    if (l.is_null()) continue;  // the finishing chunk
    for (size_t k = 0; k < l["tokens"].size(); ++k) {
      tokens.push_back(l["tokens"][k]);
      values.push_back(l["token_logprobs"][k]);
      offsets.push_back(l["text_offset"][k]);
    }
  }
  CHECK(tokens == lp["tokens"]);
  CHECK(values == lp["token_logprobs"]);
  CHECK(offsets == lp["text_offset"]);

  // Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}; top_logprobs 0 gives [].
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Say hello."}}}},
                     {"max_tokens", 5},
                     {"temperature", 0},
                     {"logprobs", true},
                     {"top_logprobs", 2}};
  whole(s, "/v1/chat/completions", {{"messages", chat["messages"]}, {"max_tokens", 1}});
  const json cw = whole(s, "/v1/chat/completions", chat);
  const json& content = cw["choices"][0]["logprobs"]["content"];
  CHECK(cw["choices"][0]["logprobs"]["refusal"].is_null());
  REQUIRE(content.size() == size_t(cw["usage"]["completion_tokens"].get<int>()));
  for (const json& t : content) {
    std::string bytes;
    for (const json& b : t["bytes"]) bytes += char(b.get<int>());
    CHECK(bytes == t["token"].get<std::string>());
    REQUIRE(t["top_logprobs"].size() == 2);
    CHECK(t["top_logprobs"][0]["token"] == t["token"]);
    CHECK(t["top_logprobs"][0]["logprob"] == t["logprob"]);
    CHECK(t["top_logprobs"][1]["logprob"].get<double>() <= t["logprob"].get<double>());
  }
  json cs = chat;
  cs["stream"] = true;
  json streamed_content = json::array();
  for (const json& c : streamed(s, "/v1/chat/completions", cs)) {
    const json& l = c["choices"][0]["logprobs"];
    if (!l.is_null())
      for (const json& t : l["content"]) streamed_content.push_back(t);
  }
  CHECK(streamed_content == content);
  json no_top = chat;
  no_top.erase("top_logprobs");
  const json without_top = whole(s, "/v1/chat/completions", no_top);  // kept: the loop reads into it
  for (const json& t : without_top["choices"][0]["logprobs"]["content"]) CHECK(t["top_logprobs"].empty());
  no_top.erase("logprobs");
  CHECK(whole(s, "/v1/chat/completions", no_top)["choices"][0]["logprobs"].is_null());
  CHECK(s.engine.drain(std::chrono::seconds(10)));
}

TEST_CASE("server api: every error carries a code, and param where one field is at fault") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  Served s(CASCADE_MODEL_PATH, "");
  struct Row {
    const char* path;
    const char* body;
    int status;
    const char* param;  // nullptr: none
    const char* code;
  };
  const std::vector<Row> rows = {
      {"/v1/completions", "{", 400, nullptr, "invalid_json"},
      {"/v1/completions", "[]", 400, nullptr, "invalid_json"},
      {"/v1/completions", R"({})", 400, "prompt", "missing_required_parameter"},
      {"/v1/completions", R"({"prompt": 1})", 400, "prompt", "invalid_type"},
      {"/v1/completions", R"({"prompt": "x", "n": 3})", 400, "n", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "model": "other"})", 404, "model", "model_not_found"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 128})", 400, "max_tokens", "context_length_exceeded"},
      {"/v1/completions", R"({"prompt": "x", "temperature": 9})", 400, "temperature", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "echo": true})", 400, "echo", "unsupported_parameter"},
      {"/v1/completions", R"({"prompt": "x", "logprobs": 21})", 400, "logprobs", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "logprobs": true})", 400, "logprobs", "invalid_type"},
      {"/v1/completions", R"({"prompt": "x", "presence_penalty": 2.5})", 400, "presence_penalty", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "frequency_penalty": "a"})", 400, "frequency_penalty", "invalid_type"},
      {"/v1/completions", R"({"prompt": "x", "repetition_penalty": 0})", 400, "repetition_penalty", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": [1]})", 400, "logit_bias", "invalid_type"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"-1": 1}})", 400, "logit_bias", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"49152": 1}})", 400, "logit_bias", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"12": 101}})", 400, "logit_bias", "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"12": "up"}})", 400, "logit_bias", "invalid_type"},
      {"/v1/completions", R"({"prompt": "x", "stream_options": {"include_usage": true}})", 400, "stream_options",
       "invalid_value"},
      {"/v1/completions", R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})", 400,
       "include_usage", "invalid_type"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", 400,
       "top_logprobs", "invalid_value"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", 400, "logprobs",
       "invalid_type"},
  };
  for (const Row& row : rows) {
    CAPTURE(row.body);
    const server::Reply r = s.api.handle("POST", row.path, "", row.body);
    CHECK(r.status == row.status);
    const json e = parse(r.body)["error"];
    CHECK(e["code"] == row.code);
    if (row.param) CHECK(e["param"] == row.param);
    else CHECK(e["param"].is_null());
    CHECK(e["type"] == "invalid_request_error");
  }
  for (const auto& [method, path, status, code] :
       std::vector<std::tuple<const char*, const char*, int, const char*>>{
           {"GET", "/nope", 404, "not_found"},
           {"GET", "/v1/completions", 405, "method_not_allowed"},
           {"GET", "/v1/models/other", 404, "model_not_found"}}) {
    const server::Reply r = s.api.handle(method, path, "", "");
    CHECK(r.status == status);
    CHECK(parse(r.body)["error"]["code"] == code);
  }
  CHECK(parse(server::error_json(413, "too large"))["error"]["code"] == "request_too_large");
  // A model without a chat template the server knows: the refusal names every format --chat-template takes.
  server::Api no_template(s.engine, s.tok, {"tiny-model", "", "", 0});
  const server::Reply t =
      no_template.handle("POST", "/v1/chat/completions", "", R"({"messages": [{"role": "user", "content": "x"}]})");
  CHECK(t.status == 400);
  CHECK(parse(t.body)["error"]["message"].get<std::string>().find("chatml, llama3, phi3, gemma or mistral") !=
        std::string::npos);
  s.api.set_draining();
  const server::Reply r = s.api.handle("POST", "/v1/completions", "", R"({"prompt": "x"})");
  CHECK(r.status == 503);
  CHECK(parse(r.body)["error"]["code"] == "server_shutting_down");
  CHECK(s.engine.metrics().requests == 0);
}

TEST_CASE("server api: max_tokens by default and at most --max-tokens, a chat without it stops within the context") {
  REQUIRE_MESSAGE(std::filesystem::exists(CASCADE_MODEL_PATH), "run `bash scripts/setup.sh` for the model");
  {
    Served s(CASCADE_MODEL_PATH, "", 3);
    const json meta = parse(s.api.handle("GET", "/v1/models", "", "").body)["data"][0]["meta"];
    CHECK(meta["max_tokens"] == 3);
    CHECK(meta["default_max_tokens"]["chat"] == 3);
    CHECK(meta["n_ctx"] == 128);
    s.engine.start();
    json body = {{"prompt", "The sky is"}, {"temperature", 0}, {"ignore_eos", true}};
    CHECK(whole(s, "/v1/completions", body)["usage"]["completion_tokens"] == 3);
    body["max_tokens"] = 50;
    json w = whole(s, "/v1/completions", body);
    CHECK(w["usage"]["completion_tokens"] == 3);
    CHECK(w["choices"][0]["finish_reason"] == "length");
    body["max_tokens"] = 2;
    CHECK(whole(s, "/v1/completions", body)["usage"]["completion_tokens"] == 2);
    CHECK(s.engine.drain(std::chrono::seconds(10)));
  }
  Served s(CASCADE_MODEL_PATH, "");
  const json meta = parse(s.api.handle("GET", "/v1/models", "", "").body)["data"][0]["meta"];
  CHECK(meta["max_tokens"].is_null());
  CHECK(meta["default_max_tokens"]["completions"] == server::kCompletionMaxTokens);
  CHECK(meta["default_max_tokens"]["chat"] == server::kChatMaxTokens);
  s.engine.start();
  // Completions: OpenAI's 16. Chat: kChatMaxTokens, but never past the context (128 positions here).
  CHECK(whole(s, "/v1/completions", {{"prompt", "The sky is"}, {"ignore_eos", true}})["usage"]["completion_tokens"] ==
        16);
  const json c = whole(s, "/v1/chat/completions",
                       {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"ignore_eos", true}});
  CHECK(c["usage"]["prompt_tokens"].get<int>() + c["usage"]["completion_tokens"].get<int>() == 128);
  CHECK(c["choices"][0]["finish_reason"] == "length");
  CHECK(s.engine.drain(std::chrono::seconds(10)));
}

}  // namespace test_server_api
