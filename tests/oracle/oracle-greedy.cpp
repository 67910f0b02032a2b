// oracle-greedy: llama.cpp's greedy continuation of prompts on a real model, with its top-2 logit margin at every
// step, for the real-model greedy tests (tests/data/gemma3). Built by scripts/greedy-oracle.sh against the
// llama.cpp that bench/llama-cpp.sh builds (not by the project's CMake: the project does not depend on llama.cpp).
//
//   oracle-greedy -m MODEL -f PROMPTS -o OUT [-n N] [-t THREADS]
//
// PROMPTS: one prompt a line, `\n` for a newline and `\\` for a backslash. Each is tokenized by llama.cpp (its
// special tokens added, none parsed from the text), run as one sequence, and continued N tokens (default 32) by
// the argmax of the logits (the lowest id among equals), end-of-generation tokens included as any other.
// The context is llama.cpp's as its tools make it (llama-cli, llama-server): f16 K/V cache, flash attention
// chosen by llama.cpp (auto), a sliding-window cache of the window's size (swa_full off), prompt batches of 512.
//
// OUT, text, per prompt three lines:
//   prompt P ids  N  ID...           llama.cpp's token ids of prompt P
//   prompt P greedy  ID...           the N tokens chosen
//   prompt P margin  M...            logit of the chosen token minus the next largest logit, at each step
// after a first line `# ...` naming the settings. Any problem: one line `oracle-greedy: error: ...` on stderr and
// exit code 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama.h"

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

struct Options {
  std::string model, prompts, out;
  int n_predict = 32, n_threads = 2;
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
    else if (a == "-f") o.prompts = value();
    else if (a == "-o") o.out = value();
    else if (a == "-n") o.n_predict = std::atoi(value().c_str());
    else if (a == "-t") o.n_threads = std::atoi(value().c_str());
    else fail("unknown argument '" + a + "'");
  }
  if (o.model.empty() || o.prompts.empty() || o.out.empty()) fail("give -m MODEL -f PROMPTS -o OUT");
  if (o.n_predict <= 0 || o.n_threads <= 0) fail("-n and -t must be positive");
  return o;
}

std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open " + path);
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    std::string p;
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] != '\\') {
        p += line[i];
        continue;
      }
      if (i + 1 == line.size() || (line[i + 1] != 'n' && line[i + 1] != '\\')) fail("bad escape in " + path);
      p += line[++i] == 'n' ? '\n' : '\\';
    }
    if (p.empty()) fail("an empty prompt in " + path);
    prompts.push_back(p);
  }
  if (prompts.empty()) fail(path + " holds no prompt");
  return prompts;
}

std::vector<llama_token> tokenize(const llama_vocab* vocab, const std::string& text) {
  std::vector<llama_token> ids(text.size() + 8);
  const int n = llama_tokenize(vocab, text.data(), int32_t(text.size()), ids.data(), int32_t(ids.size()),
                               /*add_special=*/true, /*parse_special=*/false);
  if (n <= 0) fail("a prompt gives no tokens");
  ids.resize(size_t(n));
  return ids;
}

// Decodes tokens at positions pos0.. of sequence 0 in batches of n_batch; the last token's logits are kept.
void decode(llama_context* ctx, const std::vector<llama_token>& tokens, int pos0, int n_batch) {
  llama_batch batch = llama_batch_init(n_batch, 0, 1);
  const int n = int(tokens.size());
  for (int i0 = 0; i0 < n; i0 += n_batch) {
    batch.n_tokens = 0;
    for (int i = i0; i < n && i < i0 + n_batch; ++i) {
      const int j = batch.n_tokens++;
      batch.token[j] = tokens[size_t(i)];
      batch.pos[j] = pos0 + i;
      batch.n_seq_id[j] = 1;
      batch.seq_id[j][0] = 0;
      batch.logits[j] = i == n - 1;
    }
    if (llama_decode(ctx, batch) != 0) {
      llama_batch_free(batch);
      fail("llama_decode failed");
    }
  }
  llama_batch_free(batch);
}

struct Step {
  llama_token token;
  float margin;
};

// The argmax of the last logits (lowest id among equals) and its lead over the next largest logit.
Step choose(llama_context* ctx, int n_vocab) {
  const float* z = llama_get_logits_ith(ctx, -1);
  if (z == nullptr) fail("no logits");
  int best = 0;
  for (int i = 1; i < n_vocab; ++i)
    if (z[i] > z[best]) best = i;
  float second = -1e30f;
  for (int i = 0; i < n_vocab; ++i)
    if (i != best && z[i] > second) second = z[i];
  return {llama_token(best), z[best] - second};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const std::vector<std::string> prompts = read_prompts(o.prompts);
    llama_log_set([](ggml_log_level level, const char* text, void*) {
      if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void*) { return true; };
    llama_model* model = llama_model_load_from_file(o.model.c_str(), mp);
    if (model == nullptr) fail("llama.cpp cannot load " + o.model);
    const llama_vocab* vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = o.n_threads;
    cp.swa_full = false;  // as llama.cpp's tools (common's default)
    cp.no_perf = true;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) fail("llama.cpp cannot make a context for " + o.model);

    std::ostringstream out;
    out << "# llama.cpp greedy, " << o.n_predict << " tokens per prompt; f16 K/V, flash attention auto, swa_full off, "
        << "n_ubatch 512, " << o.n_threads << " threads\n";
    for (size_t p = 0; p < prompts.size(); ++p) {
      const std::vector<llama_token> ids = tokenize(vocab, prompts[p]);
      if (int(ids.size()) + o.n_predict > int(cp.n_ctx)) fail("prompt " + std::to_string(p) + " is too long");
      llama_memory_clear(llama_get_memory(ctx), true);
      decode(ctx, ids, 0, int(cp.n_batch));
      std::vector<Step> steps;
      for (int i = 0; i < o.n_predict; ++i) {
        steps.push_back(choose(ctx, n_vocab));
        if (i + 1 < o.n_predict) decode(ctx, {steps.back().token}, int(ids.size()) + i, 1);
      }
      out << "prompt " << p << " ids " << ids.size();
      for (llama_token t : ids) out << ' ' << t;
      out << "\nprompt " << p << " greedy";
      for (const Step& s : steps) out << ' ' << s.token;
      out << "\nprompt " << p << " margin";
      char buf[32];
      for (const Step& s : steps) {
        std::snprintf(buf, sizeof buf, " %.4f", double(s.margin));
        out << buf;
      }
      out << '\n';
    }
    std::ofstream f(o.out, std::ios::binary);
    f << out.str();
    if (!f) fail("cannot write " + o.out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oracle-greedy: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
