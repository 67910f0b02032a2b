// Perplexity over a text, and the KL divergence of a run's next-token distributions from a saved run's.
//
// The definition is llama.cpp's perplexity tool's, so that the two tools' figures compare: the token list (the
// whole text, encoded once) is cut into n_windows = n_tokens / n_ctx windows of n_ctx tokens (the rest is left
// out); each window runs alone from an empty K/V cache, its first token replaced by BOS where the model adds one;
// the logits of window positions p = n_ctx / 2 .. n_ctx - 2 score the tokens at p + 1, so that every scored token
// has at least n_ctx / 2 tokens of context. NLL(p) = logsumexp(logits(p)) - logits(p)[token(p + 1)], summed in
// double; perplexity = exp(sum NLL / n_scored), n_scored = n_windows * (n_ctx - n_ctx / 2 - 1).
//
// KL divergence (a quantized K/V cache's run against an f16 or f32 one): for every scored position,
// KL(p) = sum_v P_base(v) (log P_base(v) - log P(v)), with the base run's log-probabilities saved in a file
// (LogProbWriter, as f16: 2 bytes per vocabulary entry per scored token) and read back window by window.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cascade/dtype.hpp"
#include "model/llama.hpp"

namespace cascade {

struct PerplexityParams {
  int64_t n_ctx = 512;    // tokens per window (even, >= 4)
  int64_t n_batch = 512;  // rows per forward pass
  DType kv_dtype = DType::f16;
  int n_threads = 0;      // 0: every core
  int32_t bos = -1;       // the window's first token is replaced by this one (-1: kept)
  void validate() const;  // Error naming a bad field
};

// Windows the text gives (n_tokens / n_ctx) and positions scored in each.
inline int64_t n_windows(int64_t n_tokens, int64_t n_ctx) { return n_tokens / n_ctx; }
inline int64_t n_scored_per_window(int64_t n_ctx) { return n_ctx - n_ctx / 2 - 1; }

// Runs every window of `tokens` (Error when there are fewer than 2 * n_ctx tokens, as llama.cpp asks). For each
// window w, in order: on_window(w, logits, targets), logits (n_scored_per_window, n_vocab) of the scored
// positions, targets the tokens they predict.
using WindowFn = std::function<void(int64_t w, const std::vector<float>& logits, const int32_t* targets)>;
void run_windows(const llama::Model& model, const std::vector<int32_t>& tokens, const PerplexityParams& params,
                 const WindowFn& on_window);

// -log softmax(logits)[target], in double (logits: n_vocab).
double token_nll(const float* logits, int64_t n_vocab, int32_t target);

// Sums of NLL over the scored tokens.
struct NllSum {
  double sum = 0, sum2 = 0;
  int64_t n = 0;
  void add(double nll) { sum += nll, sum2 += nll * nll, ++n; }
  double perplexity() const;     // exp(sum / n)
  double perplexity_sd() const;  // perplexity times the standard error of the mean NLL (llama.cpp's +/-)
};

// KL divergence of a run from a base run, accumulated token by token.
struct KlSum {
  double sum = 0;
  int64_t n = 0, n_top1_same = 0;
  double worst = -1;     // the largest KL of one token
  int64_t worst_at = -1;  // its index among the scored tokens
  // base_log_probs: the base run's log-probabilities of one position (n_vocab, f16); logits: this run's.
  void add(const f16* base_log_probs, const float* logits, int64_t n_vocab);
  double mean() const { return n ? sum / double(n) : 0.0; }
  double top1_agreement() const { return n ? double(n_top1_same) / double(n) : 0.0; }
};

// The log-probabilities of a run's scored positions, saved for a later run's KL divergence. File: the magic
// "CASCKL01", int32 n_ctx, n_vocab, n_windows, the windows' tokens (n_windows * n_ctx int32), then per window
// per scored position n_vocab f16 log-probabilities (clamped to f16's range). All little-endian.
class LogProbWriter {
 public:
  // Error when the file cannot be written.
  LogProbWriter(const std::string& path, int64_t n_ctx, int64_t n_vocab, const std::vector<int32_t>& tokens);
  ~LogProbWriter();
  LogProbWriter(const LogProbWriter&) = delete;
  LogProbWriter& operator=(const LogProbWriter&) = delete;
  void add_window(const std::vector<float>& logits);  // (n_scored_per_window, n_vocab)
  void close();                                       // Error when a write failed

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  int64_t n_vocab_;
};

class LogProbReader {
 public:
  // Error naming the problem when the file is not one LogProbWriter wrote for this text, window and vocabulary.
  LogProbReader(const std::string& path, int64_t n_ctx, int64_t n_vocab, const std::vector<int32_t>& tokens);
  ~LogProbReader();
  LogProbReader(const LogProbReader&) = delete;
  LogProbReader& operator=(const LogProbReader&) = delete;
  // The next window's log-probabilities: (n_scored_per_window, n_vocab).
  const std::vector<f16>& next_window();

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  int64_t n_rows_, n_vocab_;
  std::vector<f16> buf_;
};

}  // namespace cascade
