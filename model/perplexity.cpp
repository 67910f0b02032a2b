#include "model/perplexity.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "cascade/error.hpp"
#include "model/kv_cache.hpp"

namespace cascade {

void PerplexityParams::validate() const {
  CASCADE_CHECK(n_ctx >= 4 && n_ctx % 2 == 0, "perplexity: the window must be an even number of at least 4 tokens "
                "(got ", n_ctx, ")");
  CASCADE_CHECK(n_batch >= 1, "perplexity: the batch must hold at least one row (got ", n_batch, ")");
  CASCADE_CHECK(n_threads >= 0, "perplexity: the number of threads must be >= 0 (got ", n_threads, ")");
}

// One window: its K/V from an empty cache, its rows in passes of n_batch; logits of the scored positions.
static void run_window(const llama::Model& model, const int32_t* window, const PerplexityParams& p,
                       std::vector<float>& logits) {
  const llama::Hparams& hp = model.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), p.kv_dtype);
  const int seg = cache.add_segment(-1, 0);
  const int64_t first = p.n_ctx / 2, last = p.n_ctx - 2;  // scored positions [first, last]
  logits.clear();
  std::vector<float> part;
  for (int64_t at = 0; at < p.n_ctx; at += p.n_batch) {
    const int64_t n = std::min(p.n_batch, p.n_ctx - at);
    std::vector<int32_t> tokens(window + at, window + at + n), pos(static_cast<size_t>(n));
    if (at == 0 && p.bos >= 0) tokens[0] = p.bos;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) {
      pos[size_t(i)] = int32_t(at + i);
      if (at + i >= first && at + i <= last) rows.push_back(i);
    }
    cache.begin_step({{seg, n, at}});
    model.forward(tokens, pos, cache, rows, part);
    logits.insert(logits.end(), part.begin(), part.end());
  }
}

void run_windows(const llama::Model& model, const std::vector<int32_t>& tokens, const PerplexityParams& params,
                 const WindowFn& on_window) {
  params.validate();
  const int64_t n_tok = int64_t(tokens.size());
  CASCADE_CHECK(n_tok >= 2 * params.n_ctx, "the text has ", n_tok, " tokens; perplexity over windows of ",
                params.n_ctx, " tokens needs at least ", 2 * params.n_ctx, " (lower -c or give a longer text)");
  CASCADE_CHECK(params.n_ctx <= model.hparams().n_ctx_train || model.hparams().n_ctx_train <= 0, "a window of ",
                params.n_ctx, " tokens is longer than the model's context of ", model.hparams().n_ctx_train);
  tbb::task_arena arena(params.n_threads > 0 ? std::min(params.n_threads, tbb::info::default_concurrency())
                                             : tbb::task_arena::automatic);
  arena.execute([&] {
    std::vector<float> logits;
    for (int64_t w = 0; w < n_windows(n_tok, params.n_ctx); ++w) {
      const int32_t* window = tokens.data() + w * params.n_ctx;
      run_window(model, window, params, logits);
      on_window(w, logits, window + params.n_ctx / 2 + 1);
    }
  });
}

double token_nll(const float* logits, int64_t n_vocab, int32_t target) {
  CASCADE_CHECK(target >= 0 && target < n_vocab, "token ", target, " is outside the vocabulary of ", n_vocab);
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < n_vocab; ++v) mx = std::max(mx, double(logits[v]));
  double sum = 0;
  for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(double(logits[v]) - mx);
  return mx + std::log(sum) - double(logits[target]);
}

double NllSum::perplexity() const { return n ? std::exp(sum / double(n)) : 0.0; }

double NllSum::perplexity_sd() const {
  if (n < 2) return 0.0;
  const double mean = sum / double(n), var = sum2 / double(n) - mean * mean;
  return var > 0 ? perplexity() * std::sqrt(var / double(n - 1)) : 0.0;
}

void KlSum::add(const f16* base_log_probs, const float* logits, int64_t n_vocab) {
  double mx = -std::numeric_limits<double>::infinity();
  int64_t top = 0, base_top = 0;
  for (int64_t v = 0; v < n_vocab; ++v) {
    if (double(logits[v]) > mx) mx = double(logits[v]), top = v;
    if (float(base_log_probs[v]) > float(base_log_probs[base_top])) base_top = v;
  }
  double z = 0;
  for (int64_t v = 0; v < n_vocab; ++v) z += std::exp(double(logits[v]) - mx);
  const double log_z = mx + std::log(z);
  double kl = 0;
  for (int64_t v = 0; v < n_vocab; ++v) {
    const double lb = double(float(base_log_probs[v]));
    kl += std::exp(lb) * (lb - (double(logits[v]) - log_z));
  }
  if (kl > worst) worst = kl, worst_at = n;
  sum += kl;
  n_top1_same += top == base_top;
  ++n;
}

namespace {

constexpr char kMagic[8] = {'C', 'A', 'S', 'C', 'K', 'L', '0', '1'};

void write_i32(std::FILE* f, int64_t x) {
  const int32_t v = int32_t(x);
  std::fwrite(&v, sizeof v, 1, f);
}

}  // namespace

LogProbWriter::LogProbWriter(const std::string& path, int64_t n_ctx, int64_t n_vocab,
                             const std::vector<int32_t>& tokens)
    : path_(path), n_vocab_(n_vocab) {
  f_ = std::fopen(path.c_str(), "wb");
  CASCADE_CHECK(f_ != nullptr, "cannot write ", path, ": ", std::strerror(errno));
  const int64_t n_win = n_windows(int64_t(tokens.size()), n_ctx);
  std::fwrite(kMagic, 1, sizeof kMagic, f_);
  write_i32(f_, n_ctx);
  write_i32(f_, n_vocab);
  write_i32(f_, n_win);
  std::fwrite(tokens.data(), sizeof(int32_t), size_t(n_win * n_ctx), f_);
}

LogProbWriter::~LogProbWriter() {
  if (f_) std::fclose(f_);
}

void LogProbWriter::add_window(const std::vector<float>& logits) {
  const int64_t n_rows = int64_t(logits.size()) / n_vocab_;
  std::vector<f16> row(static_cast<size_t>(n_vocab_));
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* x = logits.data() + r * n_vocab_;
    const double log_z = token_nll(x, n_vocab_, 0) + double(x[0]);  // logsumexp
    for (int64_t v = 0; v < n_vocab_; ++v) row[size_t(v)] = f16(float(std::max(double(x[v]) - log_z, -65504.0)));
    std::fwrite(row.data(), sizeof(f16), row.size(), f_);
  }
}

void LogProbWriter::close() {
  const bool bad = std::ferror(f_) != 0;
  const bool closed = std::fclose(f_) == 0;
  f_ = nullptr;
  CASCADE_CHECK(!bad && closed, "writing ", path_, " failed");
}

LogProbReader::LogProbReader(const std::string& path, int64_t n_ctx, int64_t n_vocab,
                             const std::vector<int32_t>& tokens)
    : path_(path), n_rows_(n_scored_per_window(n_ctx)), n_vocab_(n_vocab) {
  f_ = std::fopen(path.c_str(), "rb");
  CASCADE_CHECK(f_ != nullptr, "cannot read ", path, ": ", std::strerror(errno));
  char magic[sizeof kMagic];
  int32_t head[3] = {0, 0, 0};
  CASCADE_CHECK(std::fread(magic, 1, sizeof magic, f_) == sizeof magic &&
                    std::memcmp(magic, kMagic, sizeof kMagic) == 0 && std::fread(head, sizeof(int32_t), 3, f_) == 3,
                path, " is not a file of saved log-probabilities (--save-logits)");
  const int64_t n_win = n_windows(int64_t(tokens.size()), n_ctx);
  CASCADE_CHECK(head[0] == n_ctx && head[1] == n_vocab && head[2] == n_win, path, " was saved with windows of ",
                head[0], " tokens, a vocabulary of ", head[1], " and ", head[2], " windows; this run has ", n_ctx,
                ", ", n_vocab, " and ", n_win);
  std::vector<int32_t> saved(size_t(n_win * n_ctx));
  CASCADE_CHECK(std::fread(saved.data(), sizeof(int32_t), saved.size(), f_) == saved.size() &&
                    std::equal(saved.begin(), saved.end(), tokens.begin()),
                path, " was saved for another text (its tokens differ)");
  buf_.resize(size_t(n_rows_ * n_vocab_));
}

LogProbReader::~LogProbReader() {
  if (f_) std::fclose(f_);
}

const std::vector<f16>& LogProbReader::next_window() {
  CASCADE_CHECK(std::fread(buf_.data(), sizeof(f16), buf_.size(), f_) == buf_.size(), path_,
                " ends before its last window");
  return buf_;
}

}  // namespace cascade
