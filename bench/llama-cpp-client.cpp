// llama-cpp-client: the decode loop of cascade-generate, run by llama.cpp through its C API, so the study can
// put llama.cpp beside cascade on the same model, prompt and machine. Built by bench/llama-cpp.sh (not by the
// project's CMake: the project does not depend on llama.cpp).
//
//   llama-cpp-client -m MODEL -f PROMPT_FILE [-np N] [-n N] [-t N] [-b N] [--kv-unified 0|1] [--flash-attn 0|1]
//                    [--temp T] [-s SEED]
//
// The loop (as cascade-generate's): the prompt (the file's first line) is evaluated once as sequence 0 and
// copied to the other sequences; each sequence samples its first token from the prompt's last logits; then every
// decode step feeds one token per sequence in one batch, n - 1 steps, end-of-generation tokens ignored (fixed
// length, as cascade-generate --ignore-eos). Sampling: temperature, then a draw (llama.cpp's own samplers), one
// random stream per sequence.
//
// The four configurations of the study: --kv-unified 1 keeps every sequence in one KV buffer, attended with a
// mask (the prompt stored once); --kv-unified 0 gives each sequence its own stream (the prompt copied into each);
// --flash-attn turns llama.cpp's fused attention kernel on or off.
//
// stdout: one JSON object with cascade-generate --json's timing fields (prompt_ms, step_ms, decode_tokens_per_s,
// ...). Any problem: one line `llama-cpp-client: error: ...` on stderr and exit code 1.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "llama.h"

namespace {

struct Options {
  std::string model, prompt_file;
  int n_parallel = 8, n_predict = 64, n_threads = 0, n_batch = 512;
  bool kv_unified = false, flash_attn = true;
  float temp = 1.5f;
  uint32_t seed = 42;
};

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

int to_int(const std::string& flag, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end || x < lo || x > hi)
    fail(flag + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "] (got '" + v + "')");
  return int(x);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail("missing value after " + a);
      return argv[++i];
    };
    if (a == "-m") o.model = value();
    else if (a == "-f") o.prompt_file = value();
    else if (a == "-np") o.n_parallel = to_int(a, value(), 1, 256);
    else if (a == "-n") o.n_predict = to_int(a, value(), 1, 1 << 20);
    else if (a == "-t") o.n_threads = to_int(a, value(), 0, 1024);
    else if (a == "-b") o.n_batch = to_int(a, value(), 1, 1 << 16);
    else if (a == "--kv-unified") o.kv_unified = to_int(a, value(), 0, 1) == 1;
    else if (a == "--flash-attn") o.flash_attn = to_int(a, value(), 0, 1) == 1;
    else if (a == "--temp") o.temp = std::strtof(value().c_str(), nullptr);
    else if (a == "-s") o.seed = uint32_t(to_int(a, value(), 0, 1 << 30));
    else fail("unknown argument '" + a + "'");
  }
  if (o.model.empty() || o.prompt_file.empty()) fail("give -m MODEL and -f PROMPT_FILE");
  return o;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void quiet(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// A batch of tokens, each at its position in one sequence, with or without logits.
struct Batch {
  llama_batch b;
  explicit Batch(int n) : b(llama_batch_init(n, 0, 1)) {}
  ~Batch() { llama_batch_free(b); }
  void clear() { b.n_tokens = 0; }
  void add(llama_token t, llama_pos pos, llama_seq_id seq, bool logits) {
    const int i = b.n_tokens++;
    b.token[i] = t;
    b.pos[i] = pos;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = logits;
  }
};

// The prompt file's first line (without a trailing CR); an empty one is an error.
std::string read_prompt(const std::string& file) {
  std::string prompt;
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot open prompt file '" + file + "'");
  std::getline(in, prompt);
  if (!prompt.empty() && prompt.back() == '\r') prompt.pop_back();
  if (prompt.empty()) fail("prompt file '" + file + "' starts with an empty line");
  return prompt;
}

std::vector<llama_token> tokenize(const llama_vocab* vocab, const std::string& prompt) {
  std::vector<llama_token> ids(prompt.size() + 8);
  const int n_ids = llama_tokenize(vocab, prompt.data(), int32_t(prompt.size()), ids.data(), int32_t(ids.size()),
                                   /*add_special=*/true, /*parse_special=*/false);
  if (n_ids <= 0) fail("the prompt gives no tokens");
  ids.resize(size_t(n_ids));
  return ids;
}

// Cells for the whole run. Unified: the prompt's cells are shared by every sequence. Streams: each stream holds
// its own copy.
int context_cells(const Options& o, int n_prompt) {
  return o.kv_unified ? n_prompt + o.n_parallel * o.n_predict : o.n_parallel * (n_prompt + o.n_predict);
}

llama_context* make_context(llama_model* model, const Options& o, int n_ctx, int n_threads) {
  const int np = o.n_parallel;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = uint32_t(n_ctx);
  cp.n_batch = uint32_t(std::max(o.n_batch, np));
  cp.n_ubatch = uint32_t(std::max(o.n_batch, np));
  cp.n_seq_max = uint32_t(np);
  cp.n_threads = n_threads;
  cp.n_threads_batch = n_threads;
  cp.flash_attn_type = o.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.kv_unified = o.kv_unified;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) fail("cannot create a context of " + std::to_string(n_ctx) + " cells");
  return ctx;
}

// One sampler chain per sequence: temperature, then a draw from its own random stream (seed + sequence).
std::vector<llama_sampler*> make_samplers(const Options& o) {
  std::vector<llama_sampler*> samplers;
  for (int s = 0; s < o.n_parallel; ++s) {
    llama_sampler* c = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(c, llama_sampler_init_temp(o.temp));
    llama_sampler_chain_add(c, llama_sampler_init_dist(o.seed + uint32_t(s)));
    samplers.push_back(c);
  }
  return samplers;
}

// The prompt, once as sequence 0 in batches of n_batch, then copied to the other sequences. Returns each
// sequence's first token, sampled from the prompt's last logits.
std::vector<llama_token> run_prompt(llama_context* ctx, const Options& o, const std::vector<llama_token>& ids,
                                    const std::vector<llama_sampler*>& samplers, Batch& batch) {
  const int np = o.n_parallel, n_prompt = int(ids.size());
  llama_memory_t mem = llama_get_memory(ctx);
  for (int i0 = 0; i0 < n_prompt; i0 += o.n_batch) {
    batch.clear();
    const int i1 = std::min(n_prompt, i0 + o.n_batch);
    for (int i = i0; i < i1; ++i) batch.add(ids[size_t(i)], i, 0, i == n_prompt - 1);
    if (llama_decode(ctx, batch.b) != 0) fail("llama_decode failed on the prompt");
  }
  std::vector<llama_token> last(static_cast<size_t>(np));
  for (int s = 0; s < np; ++s) last[size_t(s)] = llama_sampler_sample(samplers[size_t(s)], ctx, -1);
  for (int s = 1; s < np; ++s) llama_memory_seq_cp(mem, 0, s, -1, -1);
  if (!o.kv_unified && np > 1) {
    // a stream copy is made at the next decode: one token for sequence 0, then taken back
    batch.clear();
    batch.add(last[0], n_prompt, 0, false);
    if (llama_decode(ctx, batch.b) != 0) fail("llama_decode failed copying the prompt to the streams");
    llama_memory_seq_rm(mem, 0, n_prompt, -1);
  }
  llama_synchronize(ctx);
  return last;
}

// n_predict - 1 decode steps, one token per sequence each (from last, which each step's samples replace).
// Returns each step's milliseconds.
std::vector<double> run_decode(llama_context* ctx, const Options& o, int n_prompt,
                               const std::vector<llama_sampler*>& samplers, Batch& batch,
                               std::vector<llama_token>& last) {
  const int np = o.n_parallel;
  std::vector<double> step_ms;
  for (int step = 0; step + 1 < o.n_predict; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    batch.clear();
    for (int s = 0; s < np; ++s) batch.add(last[size_t(s)], n_prompt + step, s, true);
    const int rc = llama_decode(ctx, batch.b);
    if (rc != 0) fail("llama_decode failed at step " + std::to_string(step) + " (" + std::to_string(rc) + ")");
    for (int s = 0; s < np; ++s) last[size_t(s)] = llama_sampler_sample(samplers[size_t(s)], ctx, s);
    step_ms.push_back(ms_since(t0));
  }
  return step_ms;
}

// The run as one JSON object on stdout, with cascade-generate --json's timing fields.
void print_json(const Options& o, int n_threads, int n_ctx, int n_prompt, double prompt_ms,
                const std::vector<double>& step_ms) {
  const int np = o.n_parallel;
  double decode_ms = 0;
  for (double m : step_ms) decode_ms += m;
  const double n_decode = double(step_ms.size()) * np;

  std::ostringstream js;
  js.precision(6);
  js << "{\"engine\":\"llama.cpp\",\"attn\":\"" << (o.kv_unified ? "unified" : "streams")
     << (o.flash_attn ? "+fa" : "") << "\",\"kv_unified\":" << (o.kv_unified ? "true" : "false")
     << ",\"flash_attn\":" << (o.flash_attn ? "true" : "false") << ",\"kv_type\":\"f16\",\"n_threads\":" << n_threads
     << ",\"n_ctx\":" << n_ctx << ",\"n_parallel\":" << np << ",\"n_predict\":" << o.n_predict
     << ",\"n_prompt_tokens\":" << n_prompt << ",\"n_prompt_stored\":" << n_prompt << ",\"prompt_ms\":" << prompt_ms
     << ",\"prompt_tokens_per_s\":" << 1e3 * n_prompt / prompt_ms << ",\"n_decode_tokens\":" << int64_t(n_decode)
     << ",\"decode_ms\":" << decode_ms
     << ",\"decode_tokens_per_s\":" << (decode_ms > 0 ? 1e3 * n_decode / decode_ms : 0) << ",\"step_ms\":[";
  for (size_t i = 0; i < step_ms.size(); ++i) js << (i ? "," : "") << step_ms[i];
  js << "]}\n";
  std::fputs(js.str().c_str(), stdout);
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::string prompt = read_prompt(o.prompt_file);
  llama_log_set(quiet, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(o.model.c_str(), mp);
  if (!model) fail("cannot load model '" + o.model + "'");
  const std::vector<llama_token> ids = tokenize(llama_model_get_vocab(model), prompt);

  const int np = o.n_parallel, n_prompt = int(ids.size());
  const int n_ctx = context_cells(o, n_prompt);
  const int n_threads = o.n_threads > 0 ? o.n_threads : int(std::thread::hardware_concurrency());
  llama_context* ctx = make_context(model, o, n_ctx, n_threads);
  std::vector<llama_sampler*> samplers = make_samplers(o);

  const auto t_prompt = std::chrono::steady_clock::now();
  Batch batch(std::max(o.n_batch, np));
  std::vector<llama_token> last = run_prompt(ctx, o, ids, samplers, batch);
  const double prompt_ms = ms_since(t_prompt);
  const std::vector<double> step_ms = run_decode(ctx, o, n_prompt, samplers, batch, last);
  print_json(o, n_threads, n_ctx, n_prompt, prompt_ms, step_ms);

  for (llama_sampler* s : samplers) llama_sampler_free(s);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "llama-cpp-client: error: %s\n", e.what());
    return 1;
  }
}
