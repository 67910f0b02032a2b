#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include "server/engine.hpp"

#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>

#include "cascade/cpu/calibrate.hpp"
#include "cascade/error.hpp"

namespace cascade::server {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

struct Engine::Arena {
  tbb::task_arena arena;
  explicit Arena(int n) : arena(n > 0 ? n : tbb::task_arena::automatic) {}
};

struct Engine::Sequence {
  int index = 0;  // the choice
  int id = -1;    // its id in the method's K/V (KvMethod::start), -1 once ended
  Sampler sampler;
  StopText text;
  int32_t last = -1;  // the last sampled token, which the next step feeds
  std::vector<int32_t> tokens;  // generated, end-of-generation tokens not counted
  int64_t pos = 0;    // its position
  std::vector<TokenInfo> held;  // logprobs: tokens whose text has not begun to go out
  int64_t n_chars = 0;          // logprobs: characters in the text's first n_counted bytes
  size_t n_counted = 0;
  bool done = false;
  Sequence(int index, const SamplerParams& p, std::vector<std::string> stop)
      : index(index), sampler(p, uint64_t(index)), text(std::move(stop)) {}
};

struct Engine::Active {
  // A request's life: queued until admitted (slots and K/V taken); prefilling while its prompt's new tokens go
  // into the tree; last_token in the step that prefills its prompt's last token, whose logits start its
  // sequences; running while they decode; ended once its K/V is gone (its last events still to push).
  enum class State { queued, prefilling, last_token, running, ended };
  std::shared_ptr<Ticket> ticket;
  GenRequest req;
  State state = State::queued;
  int s0 = -1;            // while held: its own segment, the prompt's last token below the prompt's pinned node
  int64_t n_cached = 0;   // prompt tokens found in the tree
  int64_t reserved = 0;   // K/V tokens reserved for its own segments
  std::vector<Sequence> seqs;
  int n_generated = 0;
  std::vector<Event> events;  // pushed to the ticket after the step

  // The slots it holds: one per choice from admission, then one per running sequence.
  int n_live() const {
    switch (state) {
      case State::prefilling:
      case State::last_token: return req.n;
      case State::running:
        return int(std::count_if(seqs.begin(), seqs.end(), [](const Sequence& s) { return !s.done; }));
      case State::queued:
      case State::ended: return 0;
    }
    return 0;
  }
};

// A step's rows: running sequences' first, then prompt tokens prefilled into the tree (KvMethod::begin_steps).
struct Engine::StepBatch {
  std::vector<KvCache::Entry> seq_entries, prefill_entries;
  std::vector<int32_t> tokens, pos;  // (rows)
  struct Out {
    Active* a;
    int seq;      // a sequence's index in a.seqs, or -1: the last prompt token (the choices' first tokens)
    int64_t row;  // the row whose logits it takes
  };
  std::vector<Out> outs;
  int64_t n_prefill = 0;
};

void EngineConfig::validate() const {
  CASCADE_CHECK(n_parallel >= 1, "the number of parallel sequences must be >= 1 (got ", n_parallel, ")");
  CASCADE_CHECK(n_ctx >= 0, "the context size must be >= 0 (got ", n_ctx, ")");
  CASCADE_CHECK(n_threads >= 0, "the number of threads must be >= 0 (got ", n_threads, ")");
  CASCADE_CHECK(n_batch >= 1, "the prefill batch must be >= 1 token (got ", n_batch, ")");
  CASCADE_CHECK(max_queue >= 0, "the queue length must be >= 0 (got ", max_queue, ")");
  CASCADE_CHECK(kv_budget >= 0, "the K/V budget must be >= 0 (got ", kv_budget, ")");
}

// --- Ticket ---

bool Ticket::wait(std::vector<Event>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  while (!events_.empty()) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return !ended_;
}

void Ticket::push(std::vector<Event>& events) {
  if (events.empty()) return;
  {
    std::lock_guard lock(mu_);
    for (Event& e : events) {
      ended_ = ended_ || e.kind == Event::Kind::done || e.kind == Event::Kind::error;
      events_.push_back(std::move(e));
    }
  }
  events.clear();
  cv_.notify_all();
}

// --- Engine ---

Engine::Engine(const llama::Model& model, const Tokenizer& tok, EngineConfig config)
    : model_(model), tok_(tok), cfg_(std::move(config)) {
  cfg_.validate();
  const llama::Hparams& hp = model.hparams();
  CASCADE_CHECK(tok.n_vocab() == hp.n_vocab, "the tokenizer has ", tok.n_vocab(), " tokens, the model ", hp.n_vocab);
  if (cfg_.n_ctx == 0) cfg_.n_ctx = hp.n_ctx_train;
  token_bytes_ = hp.n_layer * 2 * kv_row_bytes(cfg_.kv_dtype, hp.n_head_kv, hp.head_dim);
  if (cfg_.kv_budget == 0) cfg_.kv_budget = 2 * int64_t(cfg_.n_parallel) * cfg_.n_ctx * token_bytes_;
  budget_tokens_ = cfg_.kv_budget / token_bytes_;
  CASCADE_CHECK(budget_tokens_ >= 2, "the K/V budget of ", cfg_.kv_budget, " bytes holds less than two tokens");
  arena_ = std::make_unique<Arena>(cfg_.n_threads);
  if (cfg_.attn == AttnMethod::auto_ && !cfg_.cost_model)
    arena_->arena.execute([&] { cfg_.cost_model = calibrate(cfg_.n_threads, hp.head_shape(), cfg_.kv_dtype); });
  reset_kv();
  m_.kv_budget = cfg_.kv_budget;
  m_.step_buckets.assign(std::size(EngineMetrics::kStepBuckets), 0);
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Whoever still waits learns the request will not finish.
  for (auto* list : {&incoming_, &waiting_, &active_})
    for (auto& a : *list) {
      std::vector<Event> ev{Event{Event::Kind::error, 0, "the server stopped", 503, {}, {}, {}}};
      a->ticket->push(ev);
    }
}

// An empty tree and prefix cache under the method.
void Engine::reset_kv() {
  const llama::Hparams& hp = model_.hparams();
  prefix_.reset();  // it refers to the tree
  kv_ = KvMethod::make(cfg_.attn, int(hp.n_layer), hp.head_shape(), cfg_.kv_dtype, cfg_.n_parallel, cfg_.cost_model);
  prefix_ = std::make_unique<PrefixCache>(kv_->tree());
}

// The K/V tokens a request may add beside its prompt's nodes in the tree, at their largest: its own segment (the
// prompt's last token), the copies its method makes of the prompt, every token its choices may generate.
int64_t Engine::reserve_tokens(const GenRequest& r) const {
  const int64_t n = r.n, len = int64_t(r.prompt.size());
  return 1 + KvMethod::copied_tokens(cfg_.attn, len, n * len) + n * r.max_tokens;
}

CheckResult Engine::check(const GenRequest& r) const {
  const int64_t len = int64_t(r.prompt.size());
  if (len == 0) return {"the prompt has no tokens", "prompt", "invalid_value"};
  if (r.n < 1) return {"n must be at least 1", "n", "invalid_value"};
  if (r.n > cfg_.n_parallel)
    return {"n is " + std::to_string(r.n) + ", but this server decodes at most " + std::to_string(cfg_.n_parallel) +
                " sequences at once (-np)",
            "n", "invalid_value"};
  if (r.max_tokens < 0) return {"max_tokens must be at least 0", "max_tokens", "invalid_value"};
  if (r.logprobs > tok_.n_vocab()) return {"logprobs asks for more tokens than the vocabulary has", "logprobs",
                                           "invalid_value"};
  if (len + r.max_tokens > cfg_.n_ctx)
    return {"this model's context is " + std::to_string(cfg_.n_ctx) + " tokens; the prompt has " + std::to_string(len) +
                " and max_tokens asks for " + std::to_string(r.max_tokens) + " more",
            "max_tokens", "context_length_exceeded"};
  for (int32_t t : r.prompt)
    if (t < 0 || t >= tok_.n_vocab())
      return {"token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(tok_.n_vocab()) +
                  ")",
              "prompt", "invalid_value"};
  for (const auto& [t, bias] : r.sampling.logit_bias)
    if (t < 0 || t >= tok_.n_vocab())
      return {"token id " + std::to_string(t) + " in logit_bias is outside the vocabulary [0, " +
                  std::to_string(tok_.n_vocab()) + ")",
              "logit_bias", "invalid_value"};
  const int64_t need = len - 1 + reserve_tokens(r);
  if (need > budget_tokens_)
    return {"the request needs the K/V of " + std::to_string(need) +
                " tokens at most, more than the server's budget of " + std::to_string(budget_tokens_) +
                " (--kv-budget)",
            "max_tokens", "kv_budget_exceeded"};
  return {};
}

std::shared_ptr<Ticket> Engine::submit(GenRequest r, Admission* why) {
  auto a = std::make_unique<Active>();
  a->ticket = std::make_shared<Ticket>();
  a->ticket->t_submit = Clock::now();
  a->req = std::move(r);
  std::shared_ptr<Ticket> t = a->ticket;
  {
    std::lock_guard lock(mu_);
    if (draining_ || stop_ || n_queued_ >= cfg_.max_queue) {
      if (why) *why = draining_ || stop_ ? Admission::draining : Admission::queue_full;
      ++m_.requests_refused;
      return nullptr;
    }
    ++n_queued_;
    ++m_.requests;
    m_.queue_depth = n_queued_;
    incoming_.push_back(std::move(a));
  }
  if (why) *why = Admission::queued;
  cv_.notify_all();
  return t;
}

void Engine::start() {
  CASCADE_CHECK(!thread_.joinable(), "the engine's loop runs already");
  thread_ = std::thread([this] { loop(); });
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (stop_) return;
    }
    if (step()) continue;
    std::unique_lock lock(mu_);
    // Idle: wake for a new request, a stop, or now and then for cancellations of queued requests.
    cv_.wait_for(lock, std::chrono::milliseconds(50), [&] { return stop_ || !incoming_.empty(); });
  }
}

bool Engine::drain(std::chrono::milliseconds timeout) {
  std::vector<std::unique_ptr<Active>> refused;
  {
    std::lock_guard lock(mu_);
    draining_ = true;
    refused.swap(incoming_);
  }
  // Queued requests that did not start are refused; the loop thread owns waiting_, so they are taken there.
  for (auto& a : refused) {
    std::vector<Event> ev{Event{Event::Kind::error, 0, "the server is shutting down", 503, {}, {}, {}}};
    a->ticket->push(ev);
  }
  {
    std::lock_guard lock(mu_);
    n_queued_ -= int(refused.size());
  }
  const auto deadline = Clock::now() + timeout;
  bool finished = false;
  while (Clock::now() < deadline) {
    {
      std::lock_guard lock(mu_);
      finished = m_.active_requests == 0 && n_queued_ == 0 && incoming_.empty();
    }
    if (finished) break;
    if (!thread_.joinable()) step();
    else std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& a : waiting_) {
    std::vector<Event> ev{Event{Event::Kind::error, 0, "the server is shutting down", 503, {}, {}, {}}};
    a->ticket->push(ev);
  }
  waiting_.clear();
  for (auto& a : active_)
    if (a->state != Active::State::ended) end_request(*a, "the server shut down before the request finished", 503);
  finish_requests();
  publish_metrics(-1);
  return finished;
}

void Engine::take_new() {
  std::vector<std::unique_ptr<Active>> fresh;
  {
    std::lock_guard lock(mu_);
    fresh.swap(incoming_);
  }
  for (auto& a : fresh) waiting_.push_back(std::move(a));
  bool draining;
  {
    std::lock_guard lock(mu_);
    draining = draining_;
  }
  if (!draining || waiting_.empty()) return;
  for (auto& a : waiting_) {  // queued requests that did not start are refused
    std::vector<Event> ev{Event{Event::Kind::error, 0, "the server is shutting down", 503, {}, {}, {}}};
    a->ticket->push(ev);
  }
  std::lock_guard lock(mu_);
  n_queued_ -= int(waiting_.size());
  m_.requests_refused += int64_t(waiting_.size());
  waiting_.clear();
}

void Engine::end_cancelled() {
  int n_dropped = 0;
  std::erase_if(waiting_, [&](const std::unique_ptr<Active>& a) {
    if (!a->ticket->cancelled()) return false;
    std::vector<Event> ev{Event{Event::Kind::error, 0, "cancelled", 499, {}, {}, {}}};
    a->ticket->push(ev);
    ++n_dropped;
    return true;
  });
  if (n_dropped) {
    std::lock_guard lock(mu_);
    n_queued_ -= n_dropped;
    m_.requests_cancelled += n_dropped;
  }
  for (auto& a : active_)
    if (a->state != Active::State::ended && a->ticket->cancelled()) {
      end_request(*a, "cancelled", 499);
      std::lock_guard lock(mu_);
      ++m_.requests_cancelled;
    }
  finish_requests();
}

int64_t Engine::kv_tokens_in_use() const {
  return prefix_->pinned_tokens() + prefix_->unpinned_tokens() + reserved_tokens_;
}

// Admits queued requests in order while the first fits (slots, then K/V after evicting unpinned prefixes).
void Engine::admit() {
  int n_admitted = 0;
  while (!waiting_.empty() && try_admit(waiting_.front())) {
    active_.push_back(std::move(waiting_.front()));
    waiting_.erase(waiting_.begin());
    ++n_admitted;
  }
  if (n_admitted) {
    std::lock_guard lock(mu_);
    n_queued_ -= n_admitted;
  }
}

bool Engine::try_admit(std::unique_ptr<Active>& ap) {
  Active& a = *ap;
  const GenRequest& r = a.req;
  if (slots_used_ + r.n > cfg_.n_parallel) return false;
  const int64_t len = int64_t(r.prompt.size());
  const PrefixCache::Inserted ins = prefix_->insert(std::span(r.prompt).first(size_t(len - 1)));
  const int64_t reserve = reserve_tokens(r);
  int64_t over = kv_tokens_in_use() + reserve - budget_tokens_;
  if (over > 0) over -= prefix_->evict(over);
  if (over > 0) {
    prefix_->unpin(ins.node);  // its new node, stored nowhere yet, leaves the tree
    return false;
  }
  a.s0 = kv_->tree().add_segment(ins.node, len - 1);
  kv_->tree().reserve(a.s0, 1);  // the prompt's last token (a sequence continuing there reserves its own)
  a.state = Active::State::prefilling;
  a.n_cached = ins.n_found;
  a.reserved = reserve;
  reserved_tokens_ += reserve;
  slots_used_ += r.n;
  std::lock_guard lock(mu_);
  m_.prompt_tokens += len;
  m_.prompt_tokens_cached += ins.n_found;
  return true;
}

// The step's rows: one per running sequence, then prompt tokens in admission order, at most n_batch of them.
void Engine::plan_step(StepBatch& b) {
  for (auto& ap : active_) {
    Active& a = *ap;
    if (a.state != Active::State::running) continue;
    for (size_t j = 0; j < a.seqs.size(); ++j) {
      const Sequence& s = a.seqs[j];
      if (s.done) continue;
      b.outs.push_back({&a, int(j), int64_t(b.tokens.size())});
      b.seq_entries.push_back({s.id, 1, s.pos});
      b.tokens.push_back(s.last);
      b.pos.push_back(int32_t(s.pos));
    }
  }
  int64_t budget = cfg_.n_batch;
  std::map<int, int64_t> planned;  // node -> rows it gets this step
  for (auto& ap : active_) {
    if (budget == 0) break;
    Active& a = *ap;
    if (a.state == Active::State::prefilling && plan_prompt(a, b, planned, budget)) {
      const int64_t last = int64_t(a.req.prompt.size()) - 1;
      b.outs.push_back({&a, -1, int64_t(b.tokens.size())});
      b.prefill_entries.push_back({a.s0, 1, last});
      b.tokens.push_back(a.req.prompt.back());
      b.pos.push_back(int32_t(last));
      a.state = Active::State::last_token;
      --budget;
      ++b.n_prefill;
    }
  }
}

// Plans rows for the prompt's nodes that are not stored yet, parents first, within the budget. A node takes rows
// once its parent is stored (or completed in this step), from one entry per step. Returns true when the whole
// path is stored or completed in this step and a row is left for the prompt's last token.
bool Engine::plan_prompt(Active& a, StepBatch& b, std::map<int, int64_t>& planned, int64_t& budget) {
  const int node = kv_->tree().parent(a.s0);
  for (int g : node >= 0 ? prefix_->path(node) : std::vector<int>{}) {
    const auto it = planned.find(g);
    const int64_t have = prefix_->stored(g) + (it == planned.end() ? 0 : it->second);
    const int64_t need = prefix_->length(g) - have;
    if (need == 0) continue;
    if (it != planned.end() || budget == 0) return false;  // another request's rows fill it this step, partly
    const int64_t take = std::min(need, budget);
    const std::vector<int32_t>& toks = prefix_->tokens(g);
    const int64_t start = kv_->tree().start(g);
    b.prefill_entries.push_back({g, take, start + have});
    for (int64_t i = have; i < have + take; ++i) {
      b.tokens.push_back(toks[size_t(i)]);
      b.pos.push_back(int32_t(start + i));
    }
    planned[g] = take;
    budget -= take;
    b.n_prefill += take;
    if (take < need) return false;
  }
  return budget > 0;
}

void Engine::run_step(StepBatch& b) {
  const int64_t n_vocab = model_.hparams().n_vocab;
  std::vector<int64_t> logit_rows;
  for (const StepBatch::Out& o : b.outs) logit_rows.push_back(o.row);
  kv_->begin_steps(b.seq_entries, b.prefill_entries);
  std::vector<float> logits;
  model_.forward(b.tokens, b.pos, *kv_, logit_rows, logits);
  // The running sequences draw side by side (each from its own sampler and stream); what follows from the
  // draws, and the new requests' first draws, stay in order. A draw puts its row back as it was, so the
  // log-probabilities are the model's.
  std::vector<int32_t> drawn(b.outs.size());
  std::vector<TokenLogprob> lps(b.outs.size());
  tbb::parallel_for(size_t(0), b.outs.size(), [&](size_t j) {
    const StepBatch::Out& o = b.outs[j];
    if (o.seq < 0) return;
    float* row = logits.data() + int64_t(j) * n_vocab;
    drawn[j] = o.a->seqs[size_t(o.seq)].sampler.sample(row, n_vocab);
    if (o.a->req.logprobs >= 0) lps[j] = token_logprob(row, n_vocab, drawn[j], o.a->req.logprobs);
  });
  for (size_t j = 0; j < b.outs.size(); ++j) {
    const StepBatch::Out& o = b.outs[j];
    if (o.seq < 0) {
      start_sequences(*o.a, logits.data() + int64_t(j) * n_vocab);
      continue;
    }
    Sequence& s = o.a->seqs[size_t(o.seq)];
    ++s.pos;
    accept(*o.a, s, drawn[j], o.a->req.logprobs >= 0 ? &lps[j] : nullptr, o.a->events);
  }
}

// The prompt's last token is stored: the choices start, laid out as the method says, each sampling its first
// token from the same logits with its own stream.
void Engine::start_sequences(Active& a, float* logits) {
  const GenRequest& r = a.req;
  const std::vector<int> ids = kv_->start(std::vector<int>(size_t(r.n), a.s0), {r.max_tokens, true});
  if (!kv_->reads_tree()) release_prompt(a);  // the copies stand alone
  a.state = Active::State::running;
  for (int j = 0; j < r.n; ++j) {
    a.seqs.emplace_back(j, r.sampling, r.stop);
    Sequence& s = a.seqs.back();
    s.id = ids[size_t(j)];
    s.pos = int64_t(r.prompt.size());
    s.sampler.set_prompt(r.prompt);
  }
  const int64_t n_vocab = model_.hparams().n_vocab;
  for (Sequence& s : a.seqs) {
    if (r.max_tokens == 0) {
      a.events.push_back({Event::Kind::finish, s.index, "length", 0, {}, {}, {}});
      end_sequence(a, s);
      continue;
    }
    const int32_t tok = s.sampler.sample(logits, n_vocab);
    TokenLogprob lp;
    if (r.logprobs >= 0) lp = token_logprob(logits, n_vocab, tok, r.logprobs);
    accept(a, s, tok, r.logprobs >= 0 ? &lp : nullptr, a.events);
  }
}

// A sampled token (with its log-probabilities when asked for): the sequence stops at end-of-generation, a stop
// string, max_tokens or the context's end; else the next step feeds it.
void Engine::accept(Active& a, Sequence& s, int32_t tok, TokenLogprob* lp, std::vector<Event>& ev) {
  const GenRequest& r = a.req;
  std::string reason;
  if (!r.ignore_eos && tok_.is_eog(tok)) {
    reason = "stop";
  } else {
    s.tokens.push_back(tok);
    ++a.n_generated;
    ++n_generated_;
    if (lp) {
      const std::string& t = s.text.text();
      for (; s.n_counted < t.size(); ++s.n_counted) s.n_chars += (uint8_t(t[s.n_counted]) & 0xC0) != 0x80;
      s.held.push_back({std::move(*lp), s.n_chars, int64_t(t.size())});
    }
    const TokenType type = tok_.token_type(tok);
    const bool stopped =
        s.text.append(type == TokenType::control || type == TokenType::unknown ? std::string() : tok_.token_piece(tok));
    if (stopped) reason = "stop";
    else if (int64_t(s.tokens.size()) >= r.max_tokens || s.pos + 1 >= cfg_.n_ctx) reason = "length";
  }
  const bool final = !reason.empty();
  Event e{Event::Kind::text, s.index, s.text.take(final), 0, {}, {}, {}};
  // The held tokens whose text begins in what went out; at the end all of them, but those past a stop string's cut.
  const int64_t out = int64_t(final ? s.text.text().size() : s.text.sent());
  const auto goes = [&](const TokenInfo& t) { return t.byte_offset < out || (final && !s.text.stopped()); };
  const auto it = std::partition_point(s.held.begin(), s.held.end(), goes);
  e.tokens.assign(std::make_move_iterator(s.held.begin()), std::make_move_iterator(it));
  s.held.erase(s.held.begin(), it);
  if (final) s.held.clear();
  if (!e.text.empty() || !e.tokens.empty()) ev.push_back(std::move(e));
  if (reason.empty()) {
    s.last = tok;
    return;
  }
  ev.push_back({Event::Kind::finish, s.index, reason, 0, {}, {}, std::move(s.tokens)});
  end_sequence(a, s);
}

// A sequence's K/V goes as soon as it ends; the request's own K/V when its last sequence ends.
void Engine::end_sequence(Active& a, Sequence& s) {
  kv_->end(s.id);
  s.id = -1;
  s.done = true;
  --slots_used_;
  if (a.n_live() > 0) return;
  close_request(a);
  a.events.push_back({Event::Kind::done, 0, {}, 0, {int64_t(a.req.prompt.size()), a.n_generated, a.n_cached}, {}, {}});
}

// The request's hold on its prompt goes: its own segment and the pin on the prompt's path.
void Engine::release_prompt(Active& a) {
  if (a.s0 < 0) return;
  const int node = kv_->tree().parent(a.s0);
  kv_->tree().release(a.s0);
  a.s0 = -1;
  if (node >= 0) prefix_->unpin(node);
}

// Everything the request holds goes: its prompt and its reservation. Its sequences have ended (or never started).
void Engine::close_request(Active& a) {
  release_prompt(a);
  reserved_tokens_ -= a.reserved;
  a.reserved = 0;
  a.state = Active::State::ended;
}

// Ends a request early (cancelled, shutting down): its sequences stop, its K/V goes, the client gets an error.
void Engine::end_request(Active& a, const std::string& error, int status) {
  if (a.state == Active::State::ended) return;
  if (a.state == Active::State::running) {
    for (Sequence& s : a.seqs)
      if (!s.done) end_sequence(a, s);
  } else {
    slots_used_ -= a.n_live();  // nothing runs yet: its slots were taken at admission
    close_request(a);
  }
  a.events.clear();
  a.events.push_back({Event::Kind::error, 0, error, status, {}, {}, {}});
}

// Pushes every request's events and drops the requests that ended.
void Engine::finish_requests() {
  int64_t n_done = 0;
  for (auto& a : active_) {
    if (a->state == Active::State::ended && !a->events.empty() && a->events.back().kind == Event::Kind::done) ++n_done;
    a->ticket->push(a->events);
  }
  std::erase_if(active_, [](const std::unique_ptr<Active>& a) { return a->state == Active::State::ended; });
  if (n_done) {
    std::lock_guard lock(mu_);
    m_.requests_done += n_done;
  }
}

bool Engine::step() {
  take_new();
  end_cancelled();
  admit();
  if (active_.empty()) {
    publish_metrics(-1);
    return false;
  }
  StepBatch b;
  plan_step(b);
  if (b.tokens.empty()) {
    publish_metrics(-1);
    return false;
  }
  const auto t0 = Clock::now();
  try {
    arena_->arena.execute([&] { run_step(b); });
  } catch (const std::exception& e) {
    fail_all(e);
    return true;
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    std::lock_guard lock(mu_);
    m_.prompt_tokens_prefilled += b.n_prefill;
  }
  finish_requests();
  publish_metrics(secs);
  return true;
}

// A step failed. Nothing valid reaches here (requests are checked on entry); if it does, every running request
// fails and the K/V starts over, since a pass that failed midway may have stored some layers and not others.
void Engine::fail_all(const std::exception& e) {
  for (auto& a : active_) {
    a->events.clear();
    a->events.push_back({Event::Kind::error, 0, std::string("internal error: ") + e.what(), 500, {}, {}, {}});
    a->state = Active::State::ended;
  }
  finish_requests();
  slots_used_ = 0;
  reserved_tokens_ = 0;
  reset_kv();
  publish_metrics(-1);
}

void Engine::publish_metrics(double step_s) {
  int n_seq = 0;
  for (const auto& a : active_) n_seq += a->state == Active::State::running ? a->n_live() : 0;
  const int64_t kv_tokens = kv_->stored_tokens();
  std::lock_guard lock(mu_);
  if (step_s >= 0) {
    ++m_.steps;
    m_.step_seconds += step_s;
    for (size_t i = 0; i < m_.step_buckets.size(); ++i) m_.step_buckets[i] += step_s <= EngineMetrics::kStepBuckets[i];
  }
  m_.generated_tokens += n_generated_;
  n_generated_ = 0;
  m_.queue_depth = n_queued_;
  m_.active_requests = int(active_.size());
  m_.active_sequences = n_seq;
  m_.kv_bytes = kv_tokens * token_bytes_;
  m_.kv_allocated_bytes = int64_t(kv_->allocated_bytes());
  m_.kv_cached_bytes = prefix_->unpinned_tokens() * token_bytes_;
  m_.kv_reserved_bytes = (prefix_->pinned_tokens() + reserved_tokens_) * token_bytes_;
  m_.evicted_tokens = prefix_->evicted_tokens();
  m_.prefix_nodes = prefix_->n_nodes();
}

EngineMetrics Engine::metrics() const {
  std::lock_guard lock(mu_);
  return m_;
}

void Engine::check_state() const {
  prefix_->check();
  std::vector<int> own, running;  // segments of live requests; ids of running sequences
  int slots = 0;
  for (const auto& a : active_) {
    using State = Active::State;
    const bool holds_prompt = a->state == State::prefilling || a->state == State::last_token ||
                              (a->state == State::running && kv_->reads_tree());
    CASCADE_CHECK((a->s0 >= 0) == holds_prompt, "engine: a request ", a->s0 >= 0 ? "holds" : "lost",
                  " its prompt's segment in state ", int(a->state));
    if (a->s0 >= 0) own.push_back(a->s0);
    for (const Sequence& s : a->seqs)
      if (!s.done) running.push_back(s.id);
    slots += a->n_live();
  }
  kv_->check_sequences(running, own);
  const TreeCache& tree = kv_->tree();
  for (int g = 0; g < tree.n_ids(); ++g)
    CASCADE_CHECK(!tree.live(g) || prefix_->is_node(g) || std::find(own.begin(), own.end(), g) != own.end(),
                  "engine: segment ", g, " belongs to no request and no prefix");
  CASCADE_CHECK(slots == slots_used_, "engine: ", slots_used_, " slots taken, ", slots, " by requests");
}

}  // namespace cascade::server
