// oracle-logits: the logits llama.cpp computes for a prompt of token ids, every position's, for the oracle tests.
// Built by scripts/oracle.sh against the llama.cpp that bench/llama-cpp.sh builds (not by the project's CMake:
// the project does not depend on llama.cpp).
//
//   oracle-logits -m MODEL -o OUT [--mode full|window=W] [-t THREADS] TOKEN...
//
// OUT: n_tokens x n_vocab float32, little-endian, row i the logits after token i. The K/V cache holds f32 and
// flash attention is off, so that the attention adds no rounding of its own beside the weights' and
// activations' (llama.cpp's default f16 cache would round every K and V).
//   --mode full      the prompt as one batch of one sequence (the default)
//   --mode window=W  row i from a fresh sequence of tokens max(0, i-W+1)..i at their own positions: the model with
//                    a sliding window of W, for an architecture llama.cpp runs without one. Exact for a model of
//                    one layer only (with more, a layer's keys would have seen more than the window), so other
//                    models are refused.
// Any problem: one line `oracle-logits: error: ...` on stderr and exit code 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama.h"

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

struct Options {
  std::string model, out;
  int window = 0;  // 0: full
  int n_threads = 1;
  std::vector<llama_token> tokens;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail("missing value after " + a);
      return argv[++i];
    };
    if (a == "-m") o.model = value();
    else if (a == "-o") o.out = value();
    else if (a == "-t") o.n_threads = std::atoi(value().c_str());
    else if (a == "--mode") {
      const std::string m = value();
      if (m.rfind("window=", 0) == 0) o.window = std::atoi(m.c_str() + 7);
      else if (m != "full") fail("unknown --mode '" + m + "'");
      if (m != "full" && o.window <= 0) fail("--mode window=W needs W > 0");
    } else {
      char* end = nullptr;
      const long t = std::strtol(a.c_str(), &end, 10);
      if (a.empty() || *end || t < 0) fail("unknown argument '" + a + "'");
      o.tokens.push_back(llama_token(t));
    }
  }
  if (o.model.empty() || o.out.empty() || o.tokens.empty()) fail("give -m MODEL -o OUT and the prompt's token ids");
  return o;
}

// Decodes tokens[first..last] at their positions as a fresh sequence 0; returns the last row's logits, or every
// row's when all is set.
std::vector<float> run(llama_context* ctx, const std::vector<llama_token>& tokens, size_t first, size_t last,
                       int n_vocab, bool all) {
  llama_memory_clear(llama_get_memory(ctx), true);
  const int n = int(last - first + 1);
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[first + size_t(i)];
    batch.pos[i] = llama_pos(first + size_t(i));
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = all || i == n - 1;
  }
  batch.n_tokens = n;
  const int rc = llama_decode(ctx, batch);
  llama_batch_free(batch);
  if (rc != 0) fail("llama_decode returned " + std::to_string(rc));
  std::vector<float> out;
  for (int i = all ? 0 : n - 1; i < n; ++i) {
    const float* row = llama_get_logits_ith(ctx, i);
    if (row == nullptr) fail("no logits for row " + std::to_string(i));
    out.insert(out.end(), row, row + n_vocab);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    llama_log_set([](ggml_log_level level, const char* text, void*) {
      if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void*) { return true; };  // no progress dots
    llama_model* model = llama_model_load_from_file(o.model.c_str(), mp);
    if (model == nullptr) fail("llama.cpp cannot load " + o.model);
    if (o.window > 0 && llama_model_n_layer(model) != 1)
      fail("--mode window=W is exact for one-layer models only; " + o.model + " has " +
           std::to_string(llama_model_n_layer(model)));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 256;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = o.n_threads;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) fail("llama.cpp cannot make a context for " + o.model);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> logits;
    if (o.window == 0) {
      logits = run(ctx, o.tokens, 0, o.tokens.size() - 1, n_vocab, true);
    } else {
      for (size_t i = 0; i < o.tokens.size(); ++i) {
        const size_t first = i + 1 >= size_t(o.window) ? i + 1 - size_t(o.window) : 0;
        const std::vector<float> row = run(ctx, o.tokens, first, i, n_vocab, false);
        logits.insert(logits.end(), row.begin(), row.end());
      }
    }
    std::ofstream out(o.out, std::ios::binary);
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
    if (!out) fail("cannot write " + o.out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oracle-logits: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
