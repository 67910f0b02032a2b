#include "server/api.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>

#include "model/chat.hpp"

namespace cascade::server {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // answers: members in OpenAI's order

namespace {

constexpr int kRetryAfterSeconds = 1;
constexpr int kMaxLogitBias = 1024;  // tokens a request's logit_bias may name

template <class J>
std::string dump(const J& j) {
  return j.dump(-1, ' ', false, J::error_handler_t::replace);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A request the API refuses: status, message, the field at fault and the error code.
struct Refusal {
  int status;
  std::string message, param, code;
};

[[noreturn]] void refuse(std::string message, std::string param = {}, std::string code = "invalid_value") {
  throw Refusal{400, std::move(message), std::move(param), std::move(code)};
}

[[noreturn]] void refuse_type(const char* key, const char* what) {
  refuse(std::string("'") + key + "' must be " + what, key, "invalid_type");
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A field that may be absent or null (nullptr), else must have the right type.
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<double> get_number(const json& body, const char* key, double lo, double hi) {
  const json* f = field(body, key);
  if (!f) return std::nullopt;
  if (!f->is_number()) refuse_type(key, "a number");
  const double v = f->get<double>();
  if (!(v >= lo && v <= hi))
    refuse(std::string("'") + key + "' must be in [" + num(lo) + ", " + num(hi) + "] (got " + num(v) + ")", key);
  return v;
}

std::optional<int64_t> get_int(const json& body, const char* key, int64_t lo, int64_t hi) {
  const json* f = field(body, key);
  if (!f) return std::nullopt;
  if (!f->is_number_integer()) refuse_type(key, "an integer");
  if (f->is_number_unsigned() && f->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    refuse(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", key);
  const int64_t v = f->get<int64_t>();
  if (v < lo || v > hi)
    refuse(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "] (got " +
               std::to_string(v) + ")",
           key);
  return v;
}

std::optional<bool> get_bool(const json& body, const char* key) {
  const json* f = field(body, key);
  if (!f) return std::nullopt;
  if (!f->is_boolean()) refuse_type(key, "true or false");
  return f->get<bool>();
}

std::vector<std::string> get_stop(const json& body) {
  const json* f = field(body, "stop");
  if (!f) return {};
  std::vector<std::string> out;
  if (f->is_string()) {
    out.push_back(f->get<std::string>());
  } else if (f->is_array()) {
    if (f->size() > 16) refuse("'stop' holds at most 16 strings", "stop");
    for (const json& s : *f) {
      if (!s.is_string()) refuse_type("stop", "a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    refuse_type("stop", "a string or an array of strings");
  }
  for (const std::string& s : out)
    if (s.empty() || s.size() > 256) refuse("each stop string must have 1 to 256 bytes", "stop");
  return out;
}

// logit_bias: {"TOKEN_ID": bias, ...}, ids in the vocabulary, biases in [-100, 100] (OpenAI's form and range).
std::vector<std::pair<int32_t, float>> get_logit_bias(const json& body, int64_t n_vocab) {
  const json* f = field(body, "logit_bias");
  if (!f) return {};
  if (!f->is_object()) refuse_type("logit_bias", "an object mapping token ids to numbers");
  if (f->size() > size_t(kMaxLogitBias))
    refuse("'logit_bias' names at most " + std::to_string(kMaxLogitBias) + " tokens", "logit_bias");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, value] : f->items()) {
    int64_t id = key.empty() || key.size() > 10 ? -1 : 0;
    for (char c : key) id = c >= '0' && c <= '9' && id >= 0 ? id * 10 + (c - '0') : -1;
    if (id < 0 || id >= n_vocab)
      refuse("'logit_bias' key '" + key + "' is not a token id in [0, " + std::to_string(n_vocab) + ")",
             "logit_bias");
    if (!value.is_number()) refuse_type("logit_bias", "an object mapping token ids to numbers");
    const double b = value.get<double>();
    if (!(b >= -100 && b <= 100))
      refuse("'logit_bias' values must be in [-100, 100] (got " + num(b) + ")", "logit_bias");
    out.push_back({int32_t(id), float(b)});
  }
  return out;
}

// The alternatives asked for per token, or -1 for no logprobs. Completions: logprobs, an integer. Chat: logprobs,
// true or false, and top_logprobs, which needs it.
int get_logprobs(const json& body, Responder::Kind kind) {
  if (kind == Responder::Kind::completion) return int(get_int(body, "logprobs", 0, kMaxLogprobs).value_or(-1));
  const bool on = get_bool(body, "logprobs").value_or(false);
  const int top = int(get_int(body, "top_logprobs", 0, kMaxLogprobs).value_or(0));
  if (top > 0 && !on) refuse("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  return on ? top : -1;
}

// Fields of the API this server does not implement: refused when they ask for something.
void refuse_unsupported(const json& body, Responder::Kind kind) {
  const auto asks = [&](const char* key) {
    const json* f = field(body, key);
    if (!f) return false;
    if (f->is_boolean()) return f->get<bool>();
    if (f->is_number()) return f->get<double>() != 0;
    if (f->is_object() || f->is_array() || f->is_string()) return !f->empty();
    return true;
  };
  for (const char* key : {"suffix", "echo", "tools", "functions", "tool_choice", "function_call"})
    if (asks(key)) refuse(std::string("'") + key + "' is not supported by this server", key, "unsupported_parameter");
  if (const json* f = field(body, "best_of"); f && !(f->is_number_integer() && f->get<int64_t>() == 1))
    refuse("'best_of' is not supported by this server (use n)", "best_of", "unsupported_parameter");
  if (kind == Responder::Kind::chat)
    if (const json* f = field(body, "response_format")) {
      if (!f->is_object() || !f->contains("type") || (*f)["type"] != "text")
        refuse("'response_format' other than {\"type\": \"text\"} is not supported by this server",
               "response_format", "unsupported_parameter");
    }
}

// The prompt's token ids: a text, token ids, or an array holding one of those.
std::vector<int32_t> parse_prompt(const json& body, const Tokenizer& tok) {
  const json* f = field(body, "prompt");
  if (!f) refuse("'prompt' is required", "prompt", "missing_required_parameter");
  const json* p = f;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  std::vector<int32_t> ids;
  if (p->is_string()) {
    ids = tok.encode(p->get<std::string>(), /*add_special=*/true, /*parse_special=*/true);
  } else if (p->is_array()) {
    for (const json& e : *p) {
      if (e.is_string() || e.is_array()) refuse("this server takes one prompt per request", "prompt");
      if (!e.is_number_integer()) refuse_type("prompt", "a string or an array of token ids");
      const int64_t id = e.is_number_unsigned() && e.get<uint64_t>() > uint64_t(INT64_MAX) ? -1 : e.get<int64_t>();
      if (id < 0 || id >= tok.n_vocab())
        refuse("token id " + dump(e) + " in 'prompt' is outside the vocabulary [0, " + std::to_string(tok.n_vocab()) +
                   ")",
               "prompt");
      ids.push_back(int32_t(id));
    }
  } else {
    refuse_type("prompt", "a string or an array of token ids");
  }
  if (ids.empty()) refuse("the prompt is empty", "prompt");
  return ids;
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* f = field(body, "messages");
  if (!f) refuse("'messages' is required", "messages", "missing_required_parameter");
  if (!f->is_array()) refuse_type("messages", "a non-empty array of messages");
  if (f->empty()) refuse("'messages' must be a non-empty array of messages", "messages");
  std::vector<ChatMessage> msgs;
  for (const json& m : *f) {
    if (!m.is_object()) refuse("each message must be an object with 'role' and 'content'", "messages");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) refuse("each message needs a 'role' string", "messages");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant")
      refuse("message role '" + r + "' is not supported (system, user, assistant)", "messages");
    if (field(m, "tool_calls")) refuse("tool calls are not supported by this server", "messages", "unsupported_value");
    std::string content;
    const json* c = field(m, "content");
    if (c && c->is_string()) {
      content = c->get<std::string>();
    } else if (c && c->is_array()) {
      for (const json& part : *c) {
        // (json::value would throw a type_error, not refuse, for a 'type' that is not a string)
        const json* type = part.is_object() ? field(part, "type") : nullptr;
        const json* text = part.is_object() ? field(part, "text") : nullptr;
        if (!type || !type->is_string() || *type != "text" || !text || !text->is_string())
          refuse("message content parts must be {\"type\": \"text\", \"text\": ...}", "messages");
        content += text->get<std::string>();
      }
    } else if (c || r != "assistant") {
      refuse("each message needs a 'content' string", "messages");
    }
    msgs.push_back({std::move(r), std::move(content)});
  }
  return msgs;
}

// The OpenAI error type for a status (and code: OpenAI answers an unknown model with 404, invalid_request_error).
const char* error_type(int status, std::string_view code) {
  if (code == "model_not_found") return "invalid_request_error";
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 500: return "server_error";
    case 503: return "unavailable_error";
    default: return "invalid_request_error";
  }
}

std::string random_id(std::string_view prefix) {
  static std::atomic<uint64_t> counter{std::random_device{}()};
  uint64_t x = counter.fetch_add(0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return std::string(prefix) + buf;
}

bool same_key(std::string_view a, std::string_view b) {
  // Compares every byte whatever the first difference, so timing does not tell how much of a key was right.
  unsigned diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= unsigned(uint8_t(a[i]) ^ uint8_t(i < b.size() ? b[i] : 0));
  return diff == 0;
}

}  // namespace

const char* error_code(int status) {
  switch (status) {
    case 401: return "invalid_api_key";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 408: return "request_timeout";
    case 413: return "request_too_large";
    case 500: return "internal_error";
    case 503: return "service_unavailable";
    default: return "invalid_request";
  }
}

std::string error_json(int status, std::string_view message, std::string_view param, std::string_view code) {
  const std::string_view c = code.empty() ? std::string_view(error_code(status)) : code;
  return dump(ojson{{"error",
                     {{"message", std::string(message)},
                      {"type", error_type(status, c)},
                      {"param", param.empty() ? ojson(nullptr) : ojson(std::string(param))},
                      {"code", std::string(c)}}}});
}

namespace {

// The code of an error a request's engine side ends with (Event::Kind::error).
const char* event_code(int status) {
  switch (status) {
    case 499: return "request_cancelled";
    case 503: return "server_shutting_down";
    default: return error_code(status);
  }
}

ojson usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

// A token and its log-probability as a chat answer gives them: its text, and its bytes (a token may hold part of a
// UTF-8 character, which the text then shows as U+FFFD).
ojson chat_token(const Tokenizer& tok, int32_t id, float logprob) {
  const std::string piece = tok.token_piece(id);
  ojson bytes = ojson::array();
  for (unsigned char c : piece) bytes.push_back(int(c));
  return {{"token", piece}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
}

// A choice's logprobs for some of its tokens, as OpenAI gives them. Chat: {"content": [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}, ...]}, ...], "refusal": null}. Completions: {"tokens", "token_logprobs",
// "top_logprobs" (per token an object token -> logprob: the alternatives and the token itself, so up to
// logprobs + 1 of them), "text_offset" (where each token's text begins in the choice's text, in characters)}.
ojson logprobs_json(const Tokenizer& tok, Responder::Kind kind, const std::vector<TokenInfo>& toks) {
  if (kind == Responder::Kind::chat) {
    ojson content = ojson::array();
    for (const TokenInfo& t : toks) {
      ojson e = chat_token(tok, t.lp.token, t.lp.logprob);
      e["top_logprobs"] = ojson::array();
      for (const auto& [id, lp] : t.lp.top) e["top_logprobs"].push_back(chat_token(tok, id, lp));
      content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top = ojson::array(), offsets = ojson::array();
  for (const TokenInfo& t : toks) {
    const std::string piece = tok.token_piece(t.lp.token);
    tokens.push_back(piece);
    token_logprobs.push_back(t.lp.logprob);
    ojson alt = ojson::object();
    for (const auto& [id, lp] : t.lp.top) alt.emplace(tok.token_piece(id), lp);  // the likelier of equal texts
    alt.emplace(piece, t.lp.logprob);
    top.push_back(std::move(alt));
    offsets.push_back(t.text_offset);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

}  // namespace

// --- Responder ---

Responder::Responder(std::shared_ptr<Ticket> ticket, Format format, const Tokenizer& tok)
    : ticket_(std::move(ticket)), f_(std::move(format)), tok_(tok),
      id_(random_id(f_.kind == Kind::chat ? "chatcmpl-" : "cmpl-")), created_(unix_now()) {}

Responder::~Responder() {
  if (!ended_) ticket_->cancel();
}

// One SSE event: a chunk for choice `index` with new text (and its tokens' logprobs) and/or its finish reason
// (nullptr: none yet).
std::string Responder::chunk(int index, const std::string& text, const char* finish,
                             const std::vector<TokenInfo>& toks) const {
  const bool chat = f_.kind == Kind::chat;
  ojson choice = {{"index", index}};
  if (chat) choice["delta"] = finish ? ojson::object() : ojson{{"content", text}};
  else choice["text"] = text;
  choice["logprobs"] = f_.logprobs >= 0 && !finish ? logprobs_json(tok_, f_.kind, toks) : ojson(nullptr);
  choice["finish_reason"] = finish ? ojson(finish) : ojson(nullptr);
  ojson j = {{"id", id_},
             {"object", chat ? "chat.completion.chunk" : "text_completion"},
             {"created", created_},
             {"model", f_.model_id},
             {"choices", ojson::array({std::move(choice)})}};
  if (f_.include_usage) j["usage"] = nullptr;
  return "data: " + dump(j) + "\n\n";
}

bool Responder::next(std::string& out, std::chrono::milliseconds wait) {
  if (ended_) return false;
  if (!started_) {
    started_ = true;
    if (f_.kind == Kind::chat)  // each choice's first chunk names the role
      for (int i = 0; i < f_.n; ++i) {
        ojson j = {{"id", id_},
                   {"object", "chat.completion.chunk"},
                   {"created", created_},
                   {"model", f_.model_id},
                   {"choices", ojson::array({{{"index", i},
                                              {"delta", {{"role", "assistant"}, {"content", ""}}},
                                              {"logprobs", nullptr},
                                              {"finish_reason", nullptr}}})}};
        if (f_.include_usage) j["usage"] = nullptr;
        out += "data: " + dump(j) + "\n\n";
      }
    return true;
  }
  std::vector<Event> events;
  ticket_->wait(events, wait);
  if (events.empty()) {
    out += ":\n\n";  // an SSE comment: a client that left makes this write fail
    return true;
  }
  for (const Event& e : events) {
    switch (e.kind) {
      case Event::Kind::text: out += chunk(e.index, e.text, nullptr, e.tokens); break;
      case Event::Kind::finish: out += chunk(e.index, "", e.text.c_str(), {}); break;
      case Event::Kind::done: {
        if (f_.include_usage) {
          const ojson j = {{"id", id_},
                           {"object", f_.kind == Kind::chat ? "chat.completion.chunk" : "text_completion"},
                           {"created", created_},
                           {"model", f_.model_id},
                           {"choices", ojson::array()},
                           {"usage", usage_json(e.usage)}};
          out += "data: " + dump(j) + "\n\n";
        }
        out += "data: [DONE]\n\n";
        ended_ = true;
        break;
      }
      case Event::Kind::error:
        out += "data: " + error_json(e.status, e.text, {}, event_code(e.status)) + "\n\n";
        ended_ = true;
        break;
    }
    if (ended_) break;
  }
  return !ended_;
}

void Responder::finish(int& status, std::string& body, const std::function<bool()>& client_left) {
  const bool chat = f_.kind == Kind::chat;
  std::vector<std::string> text(size_t(f_.n));
  std::vector<std::string> reason(size_t(f_.n), "length");
  std::vector<std::vector<TokenInfo>> toks(size_t(f_.n));
  auto checked = std::chrono::steady_clock::now();
  for (bool cancelled = false;;) {
    std::vector<Event> events;
    const bool more = ticket_->wait(events, client_left ? kLeftCheck : std::chrono::milliseconds(1000));
    for (Event& e : events) {
      const size_t i = size_t(e.index);
      switch (e.kind) {
        case Event::Kind::text:
          text[i] += e.text;
          toks[i].insert(toks[i].end(), std::make_move_iterator(e.tokens.begin()),
                         std::make_move_iterator(e.tokens.end()));
          break;
        case Event::Kind::finish: reason[i] = e.text; break;
        case Event::Kind::done: {
          ojson choices = ojson::array();
          for (size_t c = 0; c < size_t(f_.n); ++c) {
            ojson ch = {{"index", c}};
            if (chat) ch["message"] = {{"role", "assistant"}, {"content", text[c]}};
            else ch["text"] = text[c];
            ch["logprobs"] = f_.logprobs >= 0 ? logprobs_json(tok_, f_.kind, toks[c]) : ojson(nullptr);
            ch["finish_reason"] = reason[c];
            choices.push_back(std::move(ch));
          }
          status = 200;
          body = dump(ojson{{"id", id_},
                            {"object", chat ? "chat.completion" : "text_completion"},
                            {"created", created_},
                            {"model", f_.model_id},
                            {"choices", std::move(choices)},
                            {"usage", usage_json(e.usage)}});
          ended_ = true;
          return;
        }
        case Event::Kind::error:
          status = e.status == 499 ? 503 : e.status;
          body = error_json(status, e.text, {}, event_code(e.status));
          ended_ = true;
          return;
      }
    }
    if (!more && events.empty()) {
      status = 500;
      body = error_json(500, "the request ended without an answer");
      ended_ = true;
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (client_left && !cancelled && now - checked >= kLeftCheck) {
      checked = now;
      cancelled = client_left();
      if (cancelled) cancel();  // the engine's error event ends the wait
    }
  }
}

// --- Api ---

Api::Api(Engine& engine, const Tokenizer& tok, ApiConfig config)
    : engine_(engine), tok_(tok), cfg_(std::move(config)), created_(unix_now()), seeds_(std::random_device{}()) {}

uint64_t Api::draw_seed() {
  std::lock_guard lock(mu_);
  return seeds_();
}

void Api::count_status(int status) {
  std::lock_guard lock(count_mu_);
  ++status_counts_[status];
}

Reply Api::error(int status, std::string_view message, std::string_view param, std::string_view code) const {
  Reply r;
  r.status = status;
  r.body = error_json(status, message, param, code);
  if (status == 503 || status == 429) r.headers.push_back({"Retry-After", std::to_string(kRetryAfterSeconds)});
  return r;
}

Reply Api::handle(std::string_view method, std::string_view path, std::string_view authorization,
                  std::string_view body) {
  Reply r;
  const auto known = [&](std::string_view want) {
    if (method == want) return true;
    r = error(405, std::string(path) + " takes " + std::string(want) + ", not " + std::string(method));
    return false;
  };
  const bool is_health = path == "/health";
  if (!is_health && !cfg_.api_key.empty()) {
    constexpr std::string_view kBearer = "Bearer ";
    const bool ok = authorization.substr(0, kBearer.size()) == kBearer &&
                    same_key(authorization.substr(kBearer.size()), cfg_.api_key);
    if (!ok) {
      r = error(401, authorization.empty() ? "an API key is required (Authorization: Bearer KEY)" : "invalid API key",
                {}, "invalid_api_key");
      count_status(r.status);
      return r;
    }
  }
  if (is_health) {
    if (known("GET")) r = health();
  } else if (path == "/metrics") {
    if (known("GET")) {
      r.content_type = "text/plain; version=0.0.4";
      r.body = metrics_text();
    }
  } else if (path == "/v1/models") {
    if (known("GET")) r = models({});
  } else if (path.starts_with("/v1/models/")) {
    if (known("GET")) r = models(path.substr(11));
  } else if (path == "/v1/completions") {
    if (known("POST")) r = generate(body, Responder::Kind::completion);
  } else if (path == "/v1/chat/completions") {
    if (known("POST")) r = generate(body, Responder::Kind::chat);
  } else {
    r = error(404, "no endpoint " + std::string(path));
  }
  if (!r.pending) count_status(r.status);
  return r;
}

Reply Api::health() const {
  Reply r;
  if (draining_.load()) {
    r.status = 503;
    r.body = R"({"status":"shutting down"})";
  } else {
    r.body = R"({"status":"ok"})";
  }
  return r;
}

// The model, with what a client may want to know before it asks: the context, and the max_tokens it gets by
// default and at most (null: no cap but the context).
Reply Api::models(std::string_view id) const {
  const ojson meta = {{"n_ctx", engine_.n_ctx()},
                      {"n_parallel", engine_.config().n_parallel},
                      {"max_tokens", cfg_.max_tokens > 0 ? ojson(cfg_.max_tokens) : ojson(nullptr)},
                      {"default_max_tokens",
                       {{"completions", cfg_.max_tokens > 0 ? cfg_.max_tokens : kCompletionMaxTokens},
                        {"chat", cfg_.max_tokens > 0 ? cfg_.max_tokens : kChatMaxTokens}}}};
  const ojson m = {{"id", cfg_.model_id}, {"object", "model"}, {"created", created_}, {"owned_by", "cascade"},
                   {"meta", meta}};
  Reply r;
  if (id.empty()) {
    r.body = dump(ojson{{"object", "list"}, {"data", ojson::array({m})}});
  } else if (id == cfg_.model_id) {
    r.body = dump(m);
  } else {
    r = error(404, "no model '" + std::string(id) + "' here (this server serves '" + cfg_.model_id + "')", "model",
              "model_not_found");
  }
  return r;
}

namespace {

// The sampling fields but the seed.
void parse_sampling(const json& body, SamplerParams& p, int64_t n_vocab) {
  p.temp = float(get_number(body, "temperature", 0, 2).value_or(0.8));
  p.top_p = float(get_number(body, "top_p", 0, 1).value_or(0.95));
  p.top_k = int32_t(get_int(body, "top_k", 0, std::numeric_limits<int32_t>::max()).value_or(40));
  p.min_p = float(get_number(body, "min_p", 0, 1).value_or(0.05));
  p.presence_penalty = float(get_number(body, "presence_penalty", -2, 2).value_or(0));
  p.frequency_penalty = float(get_number(body, "frequency_penalty", -2, 2).value_or(0));
  if (const json* f = field(body, "repetition_penalty")) {
    if (!f->is_number()) refuse_type("repetition_penalty", "a number");
    const double r = f->get<double>();
    if (!(r > 0 && r <= 100))
      refuse("'repetition_penalty' must be in (0, 100] (got " + num(r) + "; 1: off)", "repetition_penalty");
    p.repetition_penalty = float(r);
  }
  p.logit_bias = get_logit_bias(body, n_vocab);
}

// How the answer is written: streamed or not, the usage chunk, logprobs.
Responder::Format parse_format(const json& body, Responder::Kind kind, int n, const std::string& model_id) {
  Responder::Format f;
  f.kind = kind;
  f.n = n;
  f.model_id = model_id;
  f.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) refuse_type("stream_options", "an object");
    if (!f.stream) refuse("'stream_options' is only allowed with 'stream': true", "stream_options");
    f.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  f.logprobs = get_logprobs(body, kind);
  return f;
}

}  // namespace

// A generation request: parsed and checked whole before anything is queued, so a refusal leaves the engine as it
// was.
Reply Api::generate(std::string_view body_text, Responder::Kind kind) {
  const bool chat = kind == Responder::Kind::chat;
  GenRequest req;
  Responder::Format format;
  try {
    json body;
    try {
      body = json::parse(body_text);
    } catch (const json::exception& e) {
      refuse(std::string("malformed JSON: ") + e.what(), {}, "invalid_json");
    }
    if (!body.is_object()) refuse("the request body must be a JSON object", {}, "invalid_json");
    if (const json* m = field(body, "model")) {
      if (!m->is_string()) refuse_type("model", "a string");
      if (m->get<std::string>() != cfg_.model_id)
        throw Refusal{404,
                      "the model '" + m->get<std::string>() + "' does not exist here: this server serves '" +
                          cfg_.model_id + "' (cascade-server --alias NAME serves it under another name)",
                      "model", "model_not_found"};
    }
    refuse_unsupported(body, kind);
    req.n = int(get_int(body, "n", 1, 128).value_or(1));
    parse_sampling(body, req.sampling, tok_.n_vocab());
    if (const json* s = field(body, "seed")) {
      if (!s->is_number_integer()) refuse_type("seed", "an integer");
      req.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : uint64_t(s->get<int64_t>());
    } else {
      req.sampling.seed = draw_seed();
    }
    req.stop = get_stop(body);
    req.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
    format = parse_format(body, kind, req.n, cfg_.model_id);
    req.logprobs = format.logprobs;
    constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
    std::optional<int64_t> max_tokens = get_int(body, "max_tokens", 0, kMaxInt);
    if (chat) {
      if (const auto m = get_int(body, "max_completion_tokens", 0, kMaxInt)) max_tokens = m;
      if (cfg_.chat_template.empty())
        refuse("this model has no chat template; start the server with --chat-template chatml, llama3, phi3, gemma "
               "or mistral (or a file holding a template)",
               {}, "unsupported_value");
      const std::string text = apply_chat_template(cfg_.chat_template, parse_messages(body), true);
      req.prompt = tok_.encode(text, /*add_special=*/true, /*parse_special=*/true);
      if (req.prompt.empty()) refuse("the messages give no tokens", "messages");
    } else {
      req.prompt = parse_prompt(body, tok_);
    }
    const int64_t len = int64_t(req.prompt.size()), n_ctx = engine_.n_ctx();
    if (len >= n_ctx)
      refuse("the prompt has " + std::to_string(len) + " tokens, but this model's context is " + std::to_string(n_ctx) +
                 " tokens",
             chat ? "messages" : "prompt", "context_length_exceeded");
    req.max_tokens = int(resolve_max_tokens(max_tokens, chat, n_ctx - len));
    if (const CheckResult c = engine_.check(req); !c.ok()) refuse(c.message, c.param, c.code);
  } catch (const Refusal& f) {
    return error(f.status, f.message, f.param, f.code);
  }
  return submit(std::move(req), std::move(format));
}

// What a request generates at most: what it asked, capped by --max-tokens; without a number, --max-tokens or the
// endpoint's default, within the room the context leaves.
int64_t Api::resolve_max_tokens(std::optional<int64_t> asked, bool chat, int64_t room) const {
  if (asked) return cfg_.max_tokens > 0 ? std::min<int64_t>(*asked, cfg_.max_tokens) : *asked;
  const int64_t dflt = cfg_.max_tokens > 0 ? cfg_.max_tokens : chat ? kChatMaxTokens : kCompletionMaxTokens;
  return std::min(dflt, room);
}

Reply Api::submit(GenRequest req, Responder::Format format) {
  if (draining_.load()) return error(503, "the server is shutting down", {}, "server_shutting_down");
  Engine::Admission why;
  std::shared_ptr<Ticket> t = engine_.submit(std::move(req), &why);
  if (!t) {
    return why == Engine::Admission::draining
               ? error(503, "the server is shutting down", {}, "server_shutting_down")
               : error(503, "the server is busy: its queue is full; retry later", {}, "queue_full");
  }
  Reply r;
  const bool stream = format.stream;
  r.pending = std::make_shared<Responder>(std::move(t), std::move(format), tok_);
  if (stream) {
    r.content_type = "text/event-stream";
    r.headers.push_back({"Cache-Control", "no-cache"});
  }
  return r;
}

std::string Api::metrics_text() const {
  const EngineMetrics m = engine_.metrics();
  std::string out;
  char buf[64];
  const auto integer = [&](int64_t v) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
    return std::string(buf);
  };
  const auto metric = [&](const char* type, const char* name, const char* help, int64_t v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " +
           integer(v) + "\n";
  };
  const auto counter = [&](const char* name, const char* help, int64_t v) { metric("counter", name, help, v); };
  const auto gauge = [&](const char* name, const char* help, int64_t v) { metric("gauge", name, help, v); };
  counter("cascade_requests_total", "Generation requests queued.", m.requests);
  counter("cascade_requests_finished_total", "Generation requests answered in full.", m.requests_done);
  counter("cascade_requests_cancelled_total", "Generation requests whose client left before the end.",
          m.requests_cancelled);
  counter("cascade_requests_refused_total",
          "Generation requests refused because the queue was full or the server was stopping.", m.requests_refused);
  {
    std::lock_guard lock(count_mu_);
    out += "# HELP cascade_http_responses_total Answers by HTTP status.\n# TYPE cascade_http_responses_total counter\n";
    for (const auto& [code, n] : status_counts_)
      out += "cascade_http_responses_total{code=\"" + std::to_string(code) + "\"} " + integer(n) + "\n";
  }
  counter("cascade_prompt_tokens_total", "Prompt tokens of admitted requests.", m.prompt_tokens);
  counter("cascade_prompt_tokens_cached_total",
          "Prompt tokens found in the prefix cache (stored, or being prefilled for an earlier request), "
          "not computed again.",
          m.prompt_tokens_cached);
  counter("cascade_prompt_tokens_prefilled_total", "Prompt tokens computed.", m.prompt_tokens_prefilled);
  counter("cascade_generated_tokens_total", "Tokens generated.", m.generated_tokens);
  counter("cascade_evicted_tokens_total", "Cached prefix tokens evicted under the K/V budget.", m.evicted_tokens);
  gauge("cascade_queue_depth", "Requests waiting to start.", m.queue_depth);
  gauge("cascade_active_requests", "Requests prefilling or decoding.", m.active_requests);
  gauge("cascade_active_sequences", "Sequences decoding.", m.active_sequences);
  gauge("cascade_kv_bytes", "K/V bytes stored, cached prefixes included.", m.kv_bytes);
  gauge("cascade_kv_allocated_bytes", "K/V bytes held in memory: those stored and room for tokens to come.",
        m.kv_allocated_bytes);
  gauge("cascade_kv_cached_bytes", "K/V bytes of cached prefixes no running request uses (evictable).",
        m.kv_cached_bytes);
  gauge("cascade_kv_reserved_bytes", "K/V bytes running requests hold or may still need.", m.kv_reserved_bytes);
  gauge("cascade_kv_budget_bytes", "The K/V budget (--kv-budget).", m.kv_budget);
  gauge("cascade_prefix_nodes", "Nodes of the prefix tree.", m.prefix_nodes);
  out += "# HELP cascade_step_seconds Time of one engine step (a forward pass with its sampling).\n"
         "# TYPE cascade_step_seconds histogram\n";
  for (size_t i = 0; i < m.step_buckets.size(); ++i)
    out += "cascade_step_seconds_bucket{le=\"" + num(EngineMetrics::kStepBuckets[i]) + "\"} " +
           integer(m.step_buckets[i]) + "\n";
  out += "cascade_step_seconds_bucket{le=\"+Inf\"} " + integer(m.steps) + "\n";
  char sum[32];
  std::snprintf(sum, sizeof sum, "%.9g", m.step_seconds);
  out += std::string("cascade_step_seconds_sum ") + sum + "\ncascade_step_seconds_count " + integer(m.steps) + "\n";
  return out;
}

}  // namespace cascade::server
