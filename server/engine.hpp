// The serving engine: continuous batching over one model, with the prompt cache as a cascade.
//
// Requests come from any thread (submit) and wait in a bounded queue. One loop runs steps; each step is one
// forward pass holding a row for every decoding sequence and, within a budget of n_batch rows, the next
// prompt tokens to prefill, so running sequences keep flowing while prompts arrive. A request joins at the
// next step once it has room:
//   slots   at most n_parallel sequences at once (a request with n choices takes n);
//   K/V     its prompt's new tokens and the most its sequences can generate fit the K/V budget beside what
//           running requests may still use, after evicting cached prefixes no one needs, least recently used
//           first (prefix_cache.hpp). The budget counts every stored K/V token, cached prefixes included.
//
// A request's prompt goes into the prefix tree (prefix_cache.hpp) without its last token: the longest prefix
// any earlier request brought is reused, not recomputed (cached_tokens). The last prompt token is prefilled
// into a segment of the request's own below the prompt's node, and its logits give every choice's first
// token. Then the choices start as the attention method lays them out (kv_cache.hpp's KvMethod): under cascade and
// auto they fork below that segment (one choice continues in it) and the prompt stays pinned until the request
// ends; under split and unified they read copies of the prompt, and its segment and pin go at once.
// A sequence ends at an end-of-generation token (unless ignore_eos), a stop string, max_tokens, or the context
// ("length"); a cancelled request's sequences end at the next step. Either way its K/V goes at once.
//
// Each choice samples through its own Sampler (sampler.hpp: logit_bias and penalties, the prompt counted for the
// repetition penalty). With GenRequest::logprobs >= 0 every generated token also carries its log-probability
// under the model and the most probable alternatives (TokenInfo), sent with the text event that gives out the
// start of its text: a token a stop string cuts off entirely is not reported, as its text is not.
//
// Determinism: choice j of a request samples with its own random stream (seed, j) (sampler.hpp), so with a
// seed it draws the same numbers whatever runs beside it. Its logits are the same up to rounding: the forward
// pass groups rows differently when other requests share a step.
//
// Threads: submit(), the tickets and metrics() may be called from any thread; step() from one thread at a time
// (the loop thread once start() ran). The model and tokenizer must outlive the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cascade/auto.hpp"
#include "cascade/dtype.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "model/sampler.hpp"
#include "model/tokenizer.hpp"
#include "server/prefix_cache.hpp"
#include "server/text.hpp"

namespace cascade::server {

struct EngineConfig {
  int n_parallel = 4;     // sequences decoding at once, at most
  int64_t n_ctx = 0;      // positions per sequence (prompt + generated); 0: the model's training context
  int n_threads = 0;      // 0: all of the machine's
  int n_batch = 256;      // prompt tokens prefilled per step, at most
  int max_queue = 16;     // requests waiting to start, at most
  AttnMethod attn = AttnMethod::auto_;
  DType kv_dtype = DType::f16;
  int64_t kv_budget = 0;  // bytes of K/V kept, cached prefixes included; 0: 2 x n_parallel x n_ctx tokens
  std::optional<CostModel> cost_model;  // auto: this profile instead of calibrating at start
  void validate() const;
};

// A validated generation request (api.hpp makes them from JSON).
struct GenRequest {
  std::vector<int32_t> prompt;  // at least one token
  int n = 1;                    // choices
  int max_tokens = 16;          // per choice
  SamplerParams sampling;       // the seed is the request's (api.hpp draws one when the client gave none)
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int logprobs = -1;            // -1: none; else each token's log-probability and this many alternatives
};

// Why a request cannot run here (Engine::check): the message, the API field at fault and the API error code; an
// empty message when it can.
struct CheckResult {
  std::string message, param, code;
  bool ok() const { return message.empty(); }
};

// A generated token's log-probabilities, and where its text begins in its choice's text.
struct TokenInfo {
  TokenLogprob lp;
  int64_t text_offset = 0;  // in characters (Unicode code points; a character split between tokens counts once)
  int64_t byte_offset = 0;  // in bytes
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // every choice's tokens
  int64_t cached_tokens = 0;      // prompt tokens found in the prefix tree
};

// What a request produces, in order, for the thread that answers its client.
struct Event {
  enum class Kind { text, finish, done, error };
  Kind kind = Kind::text;
  int index = 0;        // text, finish: the choice
  std::string text;     // text: new text; finish: the reason ("stop", "length"); error: the message
  int status = 0;       // error: the HTTP status it calls for
  Usage usage;          // done
  std::vector<TokenInfo> tokens;   // text, when logprobs were asked for: the tokens whose text begins in it
  std::vector<int32_t> token_ids;  // finish: the choice's token ids, in order (no end-of-generation token)
};

// One request inside the engine, shared by the engine and the thread answering the client.
class Ticket {
 public:
  // Moves the events that arrived into out, waiting up to `timeout` for the first. Returns false once the
  // request has ended (a done or error event was taken) and nothing is left.
  bool wait(std::vector<Event>& out, std::chrono::milliseconds timeout);
  // The client is gone: the request's sequences end at the next step and its K/V is released.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

  void push(std::vector<Event>& events);  // engine side; clears events
  // The time it was submitted, admitted and produced its first token (for metrics and tests).
  std::chrono::steady_clock::time_point t_submit;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  bool ended_ = false;  // a done or error event was pushed
  std::atomic<bool> cancelled_{false};
};

// A snapshot of the engine's counters and gauges (metrics()).
struct EngineMetrics {
  // counters since start
  int64_t requests = 0, requests_done = 0, requests_cancelled = 0, requests_refused = 0;
  int64_t prompt_tokens = 0, prompt_tokens_cached = 0, prompt_tokens_prefilled = 0, generated_tokens = 0;
  int64_t steps = 0, evicted_tokens = 0;
  double step_seconds = 0;
  std::vector<int64_t> step_buckets;  // steps taking at most kStepBuckets[i] seconds
  // gauges
  int queue_depth = 0, active_requests = 0, active_sequences = 0;
  int64_t kv_bytes = 0, kv_cached_bytes = 0, kv_budget = 0, kv_reserved_bytes = 0;
  int64_t kv_allocated_bytes = 0;  // what the K/V buffers hold in memory, room for coming tokens included
  int prefix_nodes = 0;
  static constexpr double kStepBuckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5};
};

class Engine {
 public:
  Engine(const llama::Model& model, const Tokenizer& tok, EngineConfig config);
  ~Engine();  // stops the loop; requests still running end with an error event
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineConfig& config() const { return cfg_; }
  int64_t n_ctx() const { return cfg_.n_ctx; }
  int64_t kv_token_bytes() const { return token_bytes_; }

  // Why the request can never run here (its prompt and generation do not fit the context or the K/V budget,
  // more choices than n_parallel, a token outside the vocabulary), or ok() when it can.
  CheckResult check(const GenRequest& r) const;

  enum class Admission { queued, queue_full, draining };
  // Queues a request (check() must have passed). nullptr with *why set when it is refused.
  std::shared_ptr<Ticket> submit(GenRequest r, Admission* why);

  // The loop on a thread of its own, until drain() or the destructor.
  void start();
  // Refuses new requests, ends queued ones with an error (503), lets running ones finish for up to `timeout`,
  // then cancels the rest (error events) and stops the loop. Returns true when everything finished in time.
  bool drain(std::chrono::milliseconds timeout);

  // One step of the loop on the calling thread (without start()): takes new and cancelled requests, admits,
  // runs one forward pass when there is work. Returns false when there was nothing to do.
  bool step();

  EngineMetrics metrics() const;
  // Checks the K/V bookkeeping (tests): the prefix tree's invariants, and every segment or unified sequence
  // belonging to a live request or the tree. Error naming the first broken rule.
  void check_state() const;

 private:
  struct Sequence;
  struct Active;
  struct StepBatch;

  void loop();
  void take_new();
  void end_cancelled();
  void admit();
  bool try_admit(std::unique_ptr<Active>& a);
  int64_t reserve_tokens(const GenRequest& r) const;
  int64_t kv_tokens_in_use() const;
  void reset_kv();
  void plan_step(StepBatch& b);
  bool plan_prompt(Active& a, StepBatch& b, std::map<int, int64_t>& planned, int64_t& budget);
  void run_step(StepBatch& b);
  void fail_all(const std::exception& e);
  void start_sequences(Active& a, float* logits);
  void accept(Active& a, Sequence& s, int32_t tok, TokenLogprob* lp, std::vector<Event>& ev);
  void end_sequence(Active& a, Sequence& s);
  void release_prompt(Active& a);
  void close_request(Active& a);
  void end_request(Active& a, const std::string& error, int status);
  void finish_requests();
  void publish_metrics(double step_s);

  const llama::Model& model_;
  const Tokenizer& tok_;
  EngineConfig cfg_;
  int64_t token_bytes_ = 0;  // K/V bytes of one token over all layers
  int64_t budget_tokens_ = 0;
  struct Arena;  // the forward passes' oneTBB arena
  std::unique_ptr<Arena> arena_;

  // Owned by the stepping thread.
  std::unique_ptr<KvMethod> kv_;  // the prefix tree and the sequences, laid out as cfg_.attn says
  std::unique_ptr<PrefixCache> prefix_;
  std::vector<std::unique_ptr<Active>> waiting_, active_;
  int slots_used_ = 0;
  int64_t reserved_tokens_ = 0;  // what admitted requests may still add beside the tree's pinned nodes
  int64_t n_generated_ = 0;      // tokens generated since the last metrics update

  // Shared with submitting threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Active>> incoming_;
  int n_queued_ = 0;  // incoming + waiting
  bool draining_ = false, stop_ = false;
  std::thread thread_;
  EngineMetrics m_;  // under mu_
};

}  // namespace cascade::server
