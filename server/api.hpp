// The OpenAI-compatible API over an Engine, without sockets: routing, the API key, parsing and validating
// request bodies, admission, and turning a request's events into response bodies. The HTTP layer (http.hpp)
// only moves bytes; a test or a fuzzer can call Api::handle directly.
//
// Endpoints:
//   POST /v1/completions        prompt (text, or token ids), n, max_tokens, temperature, top_p, top_k, min_p, seed,
//                               stop, stream, stream_options, ignore_eos, logprobs (an int: the alternatives per
//                               token), logit_bias, presence_penalty, frequency_penalty, repetition_penalty
//   POST /v1/chat/completions   messages through the chat template; the same fields, with logprobs (true/false)
//                               and top_logprobs, and max_tokens or max_completion_tokens
//   GET  /v1/models, /v1/models/ID (with "meta": the context and the max_tokens defaults and cap), /health,
//        /metrics (Prometheus text format)
// Sampling defaults are llama.cpp's (and cascade-generate's): temperature 0.8, top_k 40, top_p 0.95, min_p 0.05;
// temperature 0 is greedy. Without a seed the server draws one per request. logit_bias and the penalties are
// sampler.hpp's (penalties: OpenAI's presence and frequency over the generated tokens; repetition_penalty, an
// extension, over the prompt and the generated tokens, as vLLM and llama.cpp define it).
// max_tokens: a request that omits it gets ApiConfig::max_tokens, or without one 16 (completions, OpenAI's
// default) or kChatMaxTokens (chat), never more than the context leaves; one that asks more than
// ApiConfig::max_tokens gets that many (finish_reason "length").
// logprobs are the model's: log softmax of its logits (natural log), before logit_bias, the penalties, the
// temperature and the filters, as vLLM reports them by default.
//
// Every answer carries usage (prompt, completion and total tokens, and prompt_tokens_details.cached_tokens:
// prompt tokens found in the prefix cache). A stream is server-sent events, one OpenAI chunk per event, then, when
// stream_options.include_usage asks for it, a chunk with no choices and the usage (the other chunks then carry
// "usage": null), then `data: [DONE]`; while nothing is ready it sends an SSE comment line now and then, so a
// client that left is noticed. Errors are OpenAI error objects, each with a `code` and, where one field is at
// fault, its `param`:
//   400  malformed JSON, a field of the wrong type or out of range, a prompt that does not fit the context or
//        the K/V budget, a feature not supported (echo, tools, ...)
//   401  --api-key set and the request's `Authorization: Bearer KEY` missing or wrong (/health needs no key)
//   404  no such endpoint; a `model` other than the one served (model_not_found); 405 a known endpoint with the
//        wrong method; 413 (http.hpp) a body over the limit
//   503  the queue is full (queue_full) or the server is shutting down (server_shutting_down), with Retry-After
// Fields the API defines that this server does not use (user, ...) and unknown fields are ignored.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/engine.hpp"

namespace cascade::server {

// A chat request without max_tokens stops after this many tokens, unless ApiConfig::max_tokens says otherwise: enough
// for a long answer, where running to the end of the context (thousands of tokens, minutes under load) is almost
// always a model repeating itself, and what admission reserves of the K/V per choice.
constexpr int kChatMaxTokens = 1024;
// A completion request without max_tokens: OpenAI's default.
constexpr int kCompletionMaxTokens = 16;
// The most alternatives logprobs / top_logprobs may ask for per token (OpenAI's chat limit).
constexpr int kMaxLogprobs = 20;

struct ApiConfig {
  std::string model_id;       // the name clients give as `model` (GET /v1/models lists it)
  std::string api_key;        // empty: no key needed
  std::string chat_template;  // the template's text (the model's, or one named by --chat-template)
  int max_tokens = 0;         // > 0: the default for requests without max_tokens and a cap for the rest (--max-tokens)
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
  struct Format {
    Kind kind = Kind::completion;
    bool stream = false;
    bool include_usage = false;  // streamed: the usage chunk before [DONE]
    int n = 1;                   // choices
    int logprobs = -1;           // -1: none; else the alternatives given per token
    std::string model_id;
  };
  // tok names the tokens in logprobs; it must outlive the responder.
  Responder(std::shared_ptr<Ticket> ticket, Format format, const Tokenizer& tok);
  ~Responder();  // a request whose body was not finished is cancelled (its client left)

  bool streamed() const { return f_.stream; }
  // Streamed: appends to out the body's next pieces, waiting up to `wait` for the engine (nothing new: an SSE
  // comment line). Returns false once the body is complete.
  bool next(std::string& out, std::chrono::milliseconds wait);
  // Not streamed: waits for the end and gives the status and the whole body. While it waits it asks client_left
  // (when given) every kLeftCheck at most: once the client has left, the request is cancelled (its sequences end
  // and its K/V goes at the engine's next step) and the answer is an error nobody reads.
  void finish(int& status, std::string& body, const std::function<bool()>& client_left = {});
  void cancel() { ticket_->cancel(); }
  static constexpr std::chrono::milliseconds kLeftCheck{100};

 private:
  std::string chunk(int index, const std::string& text, const char* finish, const std::vector<TokenInfo>& toks) const;

  std::shared_ptr<Ticket> ticket_;
  Format f_;
  const Tokenizer& tok_;
  std::string id_;
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
  int64_t resolve_max_tokens(std::optional<int64_t> asked, bool chat, int64_t room) const;
  Reply submit(GenRequest req, Responder::Format format);
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

// An OpenAI error object for a status and message: {"error": {"message", "type", "param", "code"}}. An empty
// param is null; an empty code is the status's own (error_code).
std::string error_json(int status, std::string_view message, std::string_view param = {}, std::string_view code = {});
// The code of an error with no more specific one: invalid_request (400), invalid_api_key (401), not_found (404),
// method_not_allowed (405), request_timeout (408), request_too_large (413), internal_error (500),
// service_unavailable (503).
const char* error_code(int status);

}  // namespace cascade::server
