// The OpenAI-compatible API over an Engine, without sockets: routing, the API key, parsing and validating
// request bodies, admission, and turning a request's events into response bodies. The HTTP layer (http.hpp)
// only moves bytes; a test or a fuzzer can call Api::handle directly.
//
// Endpoints:
//   POST /v1/completions        prompt (text, or token ids), n, max_tokens (default 16), temperature, top_p,
//                               top_k, min_p, seed, stop, stream, ignore_eos
//   POST /v1/chat/completions   messages through the chat template; the same sampling fields; max_tokens or
//                               max_completion_tokens (default: the rest of the context)
//   GET  /v1/models, /v1/models/ID, /health, /metrics (Prometheus text format)
// Sampling defaults are llama.cpp's (and cascade-generate's): temperature 0.8, top_k 40, top_p 0.95, min_p 0.05;
// temperature 0 is greedy. Without a seed the server draws one per request.
//
// Every answer carries usage (prompt, completion and total tokens, and prompt_tokens_details.cached_tokens:
// prompt tokens found in the prefix cache). A stream is server-sent events, one OpenAI chunk per event, then a
// chunk with no choices and the usage, then `data: [DONE]`; while nothing is ready it sends an SSE comment
// line now and then, so a client that left is noticed. Errors are OpenAI error objects:
//   400  malformed JSON, a field of the wrong type or out of range, a prompt that does not fit the context or
//        the K/V budget, an unknown model, a feature not supported (logprobs, echo, tools, ...)
//   401  --api-key set and the request's `Authorization: Bearer KEY` missing or wrong (/health needs no key)
//   404  no such endpoint; 405 a known endpoint with the wrong method; 413 (http.hpp) a body over the limit
//   503  the queue is full or the server is shutting down, with Retry-After
// Fields the API defines that this server does not use (user, ...) and unknown fields are ignored.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/engine.hpp"

namespace cascade::server {

struct ApiConfig {
  std::string model_id;       // the name clients give as `model` (GET /v1/models lists it)
  std::string api_key;        // empty: no key needed
  std::string chat_template;  // the template's text (the model's, or one named by --chat-template)
};

class Responder;

// An answer: whole (body), or a generation whose body comes from `pending` as the engine runs.
struct Reply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  std::shared_ptr<Responder> pending;
};

// Turns one request's events into its response body.
class Responder {
 public:
  enum class Kind { completion, chat };
  Responder(std::shared_ptr<Ticket> ticket, Kind kind, bool stream, int n, std::string model_id);
  ~Responder();  // a request whose body was not finished is cancelled (its client left)

  bool streamed() const { return stream_; }
  // Streamed: appends to out the body's next pieces, waiting up to `wait` for the engine (nothing new: an SSE
  // comment line). Returns false once the body is complete.
  bool next(std::string& out, std::chrono::milliseconds wait);
  // Not streamed: waits for the end and gives the status and the whole body.
  void finish(int& status, std::string& body);
  void cancel() { ticket_->cancel(); }

 private:
  std::string chunk(int index, const std::string& text, const char* finish) const;
  std::string usage_json(const Usage& u) const;

  std::shared_ptr<Ticket> ticket_;
  Kind kind_;
  bool stream_;
  int n_;
  std::string model_id_, id_;
  int64_t created_;
  bool started_ = false, ended_ = false;
};

class Api {
 public:
  Api(Engine& engine, const Tokenizer& tok, ApiConfig config);

  // Everything that happens to a request before bytes go to a socket. Any thread.
  Reply handle(std::string_view method, std::string_view path, std::string_view authorization,
               std::string_view body);
  // From now on generation requests and /health get 503 (the engine drains).
  void set_draining() { draining_.store(true); }
  std::string metrics_text() const;
  // Counts an answer by status for /metrics. handle() counts the answers it completes; the caller counts a
  // generation's (pending) once its status is known, and answers it makes itself (http.hpp: 413, ...).
  void count_status(int status);

 private:
  Reply generate(std::string_view body, Responder::Kind kind);
  Reply models(std::string_view id) const;
  Reply health() const;
  Reply error(int status, std::string_view message, std::string_view param = {}, std::string_view code = {}) const;
  uint64_t draw_seed();

  Engine& engine_;
  const Tokenizer& tok_;
  ApiConfig cfg_;
  int64_t created_;
  std::atomic<bool> draining_{false};
  std::mutex mu_;
  std::mt19937_64 seeds_;
  mutable std::mutex count_mu_;
  std::map<int, int64_t> status_counts_;
};

// An OpenAI error object for a status and message.
std::string error_json(int status, std::string_view message, std::string_view param = {}, std::string_view code = {});

}  // namespace cascade::server
