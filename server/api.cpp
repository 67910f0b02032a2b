#include "server/api.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>

#include "model/chat.hpp"

namespace cascade::server {

using json = nlohmann::json;

namespace {

constexpr int kRetryAfterSeconds = 1;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A request the API refuses: status, message, and the field at fault.
struct Refusal {
  int status;
  std::string message, param, code;
};

[[noreturn]] void refuse(std::string message, std::string param = {}, std::string code = {}) {
  throw Refusal{400, std::move(message), std::move(param), std::move(code)};
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
  if (!f->is_number()) refuse(std::string("'") + key + "' must be a number", key);
  const double v = f->get<double>();
  if (!(v >= lo && v <= hi))
    refuse(std::string("'") + key + "' must be in [" + num(lo) + ", " + num(hi) + "] (got " + num(v) + ")", key);
  return v;
}

std::optional<int64_t> get_int(const json& body, const char* key, int64_t lo, int64_t hi) {
  const json* f = field(body, key);
  if (!f) return std::nullopt;
  if (!f->is_number_integer()) refuse(std::string("'") + key + "' must be an integer", key);
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
  if (!f->is_boolean()) refuse(std::string("'") + key + "' must be true or false", key);
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
      if (!s.is_string()) refuse("'stop' must be a string or an array of strings", "stop");
      out.push_back(s.get<std::string>());
    }
  } else {
    refuse("'stop' must be a string or an array of strings", "stop");
  }
  for (const std::string& s : out)
    if (s.empty() || s.size() > 256) refuse("each stop string must have 1 to 256 bytes", "stop");
  return out;
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
  for (const char* key : {"logprobs", "top_logprobs", "logit_bias", "frequency_penalty", "presence_penalty", "suffix",
                          "echo", "tools", "functions", "tool_choice", "function_call"})
    if (asks(key)) refuse(std::string("'") + key + "' is not supported by this server", key);
  if (const json* f = field(body, "best_of"); f && !(f->is_number_integer() && f->get<int64_t>() == 1))
    refuse("'best_of' is not supported by this server (use n)", "best_of");
  if (kind == Responder::Kind::chat)
    if (const json* f = field(body, "response_format")) {
      if (!f->is_object() || !f->contains("type") || (*f)["type"] != "text")
        refuse("'response_format' other than {\"type\": \"text\"} is not supported by this server", "response_format");
    }
}

// The prompt's token ids: a text, token ids, or an array holding one of those.
std::vector<int32_t> parse_prompt(const json& body, const Tokenizer& tok) {
  const json* f = field(body, "prompt");
  if (!f) refuse("'prompt' is required", "prompt");
  const json* p = f;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  std::vector<int32_t> ids;
  if (p->is_string()) {
    ids = tok.encode(p->get<std::string>(), /*add_special=*/true, /*parse_special=*/true);
  } else if (p->is_array()) {
    for (const json& e : *p) {
      if (e.is_string() || e.is_array()) refuse("this server takes one prompt per request", "prompt");
      if (!e.is_number_integer()) refuse("'prompt' must be a string or an array of token ids", "prompt");
      const int64_t id = e.is_number_unsigned() && e.get<uint64_t>() > uint64_t(INT64_MAX) ? -1 : e.get<int64_t>();
      if (id < 0 || id >= tok.n_vocab())
        refuse("token id " + dump(e) + " in 'prompt' is outside the vocabulary [0, " + std::to_string(tok.n_vocab()) +
                   ")",
               "prompt");
      ids.push_back(int32_t(id));
    }
  } else {
    refuse("'prompt' must be a string or an array of token ids", "prompt");
  }
  if (ids.empty()) refuse("the prompt is empty", "prompt");
  return ids;
}

std::vector<ChatMessage> parse_messages(const json& body) {
  const json* f = field(body, "messages");
  if (!f) refuse("'messages' is required", "messages");
  if (!f->is_array() || f->empty()) refuse("'messages' must be a non-empty array of messages", "messages");
  std::vector<ChatMessage> msgs;
  for (const json& m : *f) {
    if (!m.is_object()) refuse("each message must be an object with 'role' and 'content'", "messages");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) refuse("each message needs a 'role' string", "messages");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant")
      refuse("message role '" + r + "' is not supported (system, user, assistant)", "messages");
    if (field(m, "tool_calls")) refuse("tool calls are not supported by this server", "messages");
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

// The OpenAI error type for a status.
const char* error_type(int status) {
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

std::string error_json(int status, std::string_view message, std::string_view param, std::string_view code) {
  json e = {{"message", std::string(message)}, {"type", error_type(status)}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = std::string(param);
  if (!code.empty()) e["code"] = std::string(code);
  return dump(json{{"error", e}});
}

// --- Responder ---

Responder::Responder(std::shared_ptr<Ticket> ticket, Kind kind, bool stream, int n, std::string model_id)
    : ticket_(std::move(ticket)), kind_(kind), stream_(stream), n_(n), model_id_(std::move(model_id)),
      id_(random_id(kind == Kind::chat ? "chatcmpl-" : "cmpl-")), created_(unix_now()) {}

Responder::~Responder() {
  if (!ended_) ticket_->cancel();
}

std::string Responder::usage_json(const Usage& u) const {
  return dump(json{{"prompt_tokens", u.prompt_tokens},
                   {"completion_tokens", u.completion_tokens},
                   {"total_tokens", u.prompt_tokens + u.completion_tokens},
                   {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}});
}

// One SSE event: a chunk for choice `index` with new text and/or its finish reason (nullptr: none yet).
std::string Responder::chunk(int index, const std::string& text, const char* finish) const {
  json choice = {{"index", index}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
  json j = {{"id", id_}, {"created", created_}, {"model", model_id_}};
  if (kind_ == Kind::chat) {
    j["object"] = "chat.completion.chunk";
    choice["delta"] = finish ? json::object() : json{{"content", text}};
    choice["logprobs"] = nullptr;
  } else {
    j["object"] = "text_completion";
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  j["choices"] = json::array({choice});
  return "data: " + dump(j) + "\n\n";
}

bool Responder::next(std::string& out, std::chrono::milliseconds wait) {
  if (ended_) return false;
  if (!started_) {
    started_ = true;
    if (kind_ == Kind::chat)  // each choice's first chunk names the role
      for (int i = 0; i < n_; ++i) {
        json j = {{"id", id_},
                  {"object", "chat.completion.chunk"},
                  {"created", created_},
                  {"model", model_id_},
                  {"choices", json::array({{{"index", i},
                                            {"delta", {{"role", "assistant"}, {"content", ""}}},
                                            {"logprobs", nullptr},
                                            {"finish_reason", nullptr}}})}};
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
      case Event::Kind::text: out += chunk(e.index, e.text, nullptr); break;
      case Event::Kind::finish: out += chunk(e.index, "", e.text.c_str()); break;
      case Event::Kind::done: {
        json j = {{"id", id_}, {"created", created_}, {"model", model_id_}, {"choices", json::array()},
                  {"object", kind_ == Kind::chat ? "chat.completion.chunk" : "text_completion"}};
        j["usage"] = json::parse(usage_json(e.usage));
        out += "data: " + dump(j) + "\n\ndata: [DONE]\n\n";
        ended_ = true;
        break;
      }
      case Event::Kind::error:
        out += "data: " + error_json(e.status, e.text) + "\n\n";
        ended_ = true;
        break;
    }
    if (ended_) break;
  }
  return !ended_;
}

void Responder::finish(int& status, std::string& body) {
  std::vector<std::string> text(static_cast<size_t>(n_));
  std::vector<std::string> reason(size_t(n_), "length");
  for (;;) {
    std::vector<Event> events;
    const bool more = ticket_->wait(events, std::chrono::milliseconds(1000));
    for (const Event& e : events) {
      switch (e.kind) {
        case Event::Kind::text: text[size_t(e.index)] += e.text; break;
        case Event::Kind::finish: reason[size_t(e.index)] = e.text; break;
        case Event::Kind::done: {
          json choices = json::array();
          for (int i = 0; i < n_; ++i) {
            json c = {{"index", i}, {"logprobs", nullptr}, {"finish_reason", reason[size_t(i)]}};
            if (kind_ == Kind::chat) c["message"] = {{"role", "assistant"}, {"content", text[size_t(i)]}};
            else c["text"] = text[size_t(i)];
            choices.push_back(std::move(c));
          }
          json j = {{"id", id_},
                    {"object", kind_ == Kind::chat ? "chat.completion" : "text_completion"},
                    {"created", created_},
                    {"model", model_id_},
                    {"choices", std::move(choices)},
                    {"usage", json::parse(usage_json(e.usage))}};
          status = 200;
          body = dump(j);
          ended_ = true;
          return;
        }
        case Event::Kind::error:
          status = e.status == 499 ? 503 : e.status;
          body = error_json(status, e.text);
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

Reply Api::models(std::string_view id) const {
  const json m = {{"id", cfg_.model_id}, {"object", "model"}, {"created", created_}, {"owned_by", "cascade"}};
  Reply r;
  if (id.empty()) {
    r.body = dump(json{{"object", "list"}, {"data", json::array({m})}});
  } else if (id == cfg_.model_id) {
    r.body = dump(m);
  } else {
    r = error(404, "no model '" + std::string(id) + "' here (this server serves '" + cfg_.model_id + "')", "model",
              "model_not_found");
  }
  return r;
}

Reply Api::generate(std::string_view body_text, Responder::Kind kind) {
  GenRequest req;
  bool stream = false;
  try {
    json body;
    try {
      body = json::parse(body_text);
    } catch (const json::exception& e) {
      refuse(std::string("malformed JSON: ") + e.what());
    }
    if (!body.is_object()) refuse("the request body must be a JSON object");
    if (const json* m = field(body, "model")) {
      if (!m->is_string()) refuse("'model' must be a string", "model");
      if (m->get<std::string>() != cfg_.model_id)
        refuse("the model '" + m->get<std::string>() + "' does not exist here (this server serves '" + cfg_.model_id +
                   "')",
               "model", "model_not_found");
    }
    refuse_unsupported(body, kind);
    const int64_t n_ctx = engine_.n_ctx();
    req.n = int(get_int(body, "n", 1, 128).value_or(1));
    req.sampling.temp = float(get_number(body, "temperature", 0, 2).value_or(0.8));
    req.sampling.top_p = float(get_number(body, "top_p", 0, 1).value_or(0.95));
    req.sampling.top_k = int32_t(get_int(body, "top_k", 0, std::numeric_limits<int32_t>::max()).value_or(40));
    req.sampling.min_p = float(get_number(body, "min_p", 0, 1).value_or(0.05));
    if (const json* s = field(body, "seed")) {
      if (!s->is_number_integer()) refuse("'seed' must be an integer", "seed");
      req.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : uint64_t(s->get<int64_t>());
    } else {
      req.sampling.seed = draw_seed();
    }
    req.stop = get_stop(body);
    stream = get_bool(body, "stream").value_or(false);
    if (const json* so = field(body, "stream_options"); so && !so->is_object())
      refuse("'stream_options' must be an object", "stream_options");
    req.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
    std::optional<int64_t> max_tokens = get_int(body, "max_tokens", 0, n_ctx);
    if (kind == Responder::Kind::chat) {
      if (const auto m = get_int(body, "max_completion_tokens", 0, n_ctx)) max_tokens = m;
      if (cfg_.chat_template.empty())
        refuse("this model has no chat template; start the server with --chat-template chatml or llama3");
      const std::string text = apply_chat_template(cfg_.chat_template, parse_messages(body), true);
      req.prompt = tok_.encode(text, /*add_special=*/true, /*parse_special=*/true);
      if (req.prompt.empty()) refuse("the messages give no tokens", "messages");
    } else {
      req.prompt = parse_prompt(body, tok_);
    }
    const int64_t len = int64_t(req.prompt.size());
    if (len >= n_ctx)
      refuse("the prompt has " + std::to_string(len) + " tokens, but this model's context is " + std::to_string(n_ctx) +
                 " tokens",
             kind == Responder::Kind::chat ? "messages" : "prompt", "context_length_exceeded");
    req.max_tokens = int(max_tokens.value_or(kind == Responder::Kind::chat ? n_ctx - len : 16));
    if (const std::string why = engine_.check(req); !why.empty())
      refuse(why, {}, why.find("context") != std::string::npos ? "context_length_exceeded" : "");
  } catch (const Refusal& f) {
    return error(f.status, f.message, f.param, f.code);
  }
  if (draining_.load()) return error(503, "the server is shutting down");
  const int n = req.n;
  Engine::Admission why;
  std::shared_ptr<Ticket> t = engine_.submit(std::move(req), &why);
  if (!t) {
    return why == Engine::Admission::draining ? error(503, "the server is shutting down")
                                              : error(503, "the server is busy: its queue is full; retry later", {},
                                                      "queue_full");
  }
  Reply r;
  r.pending = std::make_shared<Responder>(std::move(t), kind, stream, n, cfg_.model_id);
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
