// cascade-perplexity: a model's perplexity over a text, and the KL divergence of its next-token distributions from
// a saved run's (model/perplexity.hpp: the definition, llama.cpp's perplexity tool's).
//
//   cascade-perplexity -m MODEL.gguf -f TEXT [-c N] [-b N] [-t N] [--kv-type f16|bf16|q8_0|f32]
//                      [--linear quantized|f32] [--save-logits FILE] [--kl-divergence FILE]
//
// stdout: `perplexity: P +/- E (W windows of C tokens, N tokens scored, K/V T)`, and with --kl-divergence
// `KL divergence: mean M, top-1 agreement A%, worst X at scored token I` (scored tokens counted from 0, window by
// window). stderr: a progress line per window. Any problem (an unknown flag, a missing file, a text shorter than
// two windows, a saved file of another text): one line `cascade-perplexity: error: ...` and exit code 1.
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/perplexity.hpp"
#include "model/tokenizer.hpp"

namespace {

constexpr const char* kUsage =
    "usage: cascade-perplexity -m MODEL.gguf -f TEXT [options]\n"
    "  -m, --model FILE        GGUF model\n"
    "  -f, --file FILE         the text (UTF-8), encoded once as a whole\n"
    "  -c, --ctx-size N        tokens per window (default 512); the second half of each window is scored\n"
    "  -b, --batch-size N      rows per forward pass (default 512)\n"
    "  -t, --threads N         threads (default: every core)\n"
    "  --kv-type TYPE          K/V storage: f16 (default), bf16, q8_0 or f32\n"
    "  --linear PATH           linear layers: quantized (default: activations to int8, as generation runs) or\n"
    "                          f32 (dequantized weights, f32 activations: what the K/V type alone changes)\n"
    "  --save-logits FILE      save the scored positions' log-probabilities (2 bytes per vocabulary entry each)\n"
    "  --kl-divergence FILE    KL divergence from the run saved in FILE (same model vocabulary, text and -c)\n";

struct Options {
  std::string model, text, save, kl;
  cascade::PerplexityParams params;
  cascade::llama::LinearPath linear = cascade::llama::LinearPath::quantized;
};

int64_t parse_int(std::string_view flag, const std::string& v, int64_t lo, int64_t hi) {
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  CASCADE_CHECK(used == v.size() && !v.empty() && x >= lo && x <= hi, flag, " takes an integer in [", lo, ", ", hi,
                "] (got '", v, "')");
  return x;
}

// Returns nullopt when help was asked for.
std::optional<Options> parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      CASCADE_CHECK(i + 1 < argc, "missing value after ", a);
      return argv[++i];
    };
    if (a == "-m" || a == "--model") {
      o.model = value();
    } else if (a == "-f" || a == "--file") {
      o.text = value();
    } else if (a == "-c" || a == "--ctx-size") {
      o.params.n_ctx = parse_int(a, value(), 4, int64_t(1) << 20);
      CASCADE_CHECK(o.params.n_ctx % 2 == 0, a, " must be even (got ", o.params.n_ctx, ")");
    } else if (a == "-b" || a == "--batch-size") {
      o.params.n_batch = parse_int(a, value(), 1, int64_t(1) << 20);
    } else if (a == "-t" || a == "--threads") {
      o.params.n_threads = int(parse_int(a, value(), 1, 4096));
    } else if (a == "--kv-type") {
      const std::string v = value();
      CASCADE_CHECK(v == "f16" || v == "bf16" || v == "q8_0" || v == "f32",
                    "--kv-type must be f16, bf16, q8_0 or f32 (got '", v, "')");
      o.params.kv_dtype = cascade::parse_dtype(v);
    } else if (a == "--linear") {
      const std::string v = value();
      CASCADE_CHECK(v == "quantized" || v == "f32", "--linear must be quantized or f32 (got '", v, "')");
      o.linear = v == "f32" ? cascade::llama::LinearPath::f32 : cascade::llama::LinearPath::quantized;
    } else if (a == "--save-logits") {
      o.save = value();
    } else if (a == "--kl-divergence") {
      o.kl = value();
    } else if (a == "-h" || a == "--help") {
      return std::nullopt;
    } else {
      cascade::detail::fail("unknown argument '", a, "' (see --help)");
    }
  }
  CASCADE_CHECK(!o.model.empty(), "no model given (-m MODEL.gguf)");
  CASCADE_CHECK(!o.text.empty(), "no text given (-f FILE)");
  return o;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  CASCADE_CHECK(in.good(), "cannot read ", path);
  std::ostringstream s;
  s << in.rdbuf();
  CASCADE_CHECK(!in.bad(), "reading ", path, " failed");
  return s.str();
}

int run(int argc, char** argv) {
  const std::optional<Options> opt = parse_args(argc, argv);
  if (!opt) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const Options& o = *opt;
  const std::string text = read_text(o.text);
  const auto file = std::make_shared<const cascade::gguf::File>(cascade::gguf::File::open(o.model));
  const cascade::Tokenizer tok(cascade::load_vocab(*file));
  const cascade::llama::Model model = cascade::llama::Model::load(file, o.linear);
  const int64_t n_vocab = model.hparams().n_vocab;
  cascade::PerplexityParams p = o.params;
  if (tok.vocab().add_bos) p.bos = tok.vocab().bos_id;
  const std::vector<int32_t> tokens = tok.encode(text, /*add_special=*/true, /*parse_special=*/false);
  const int64_t n_ctx = p.n_ctx, n_win = cascade::n_windows(int64_t(tokens.size()), n_ctx);
  CASCADE_CHECK(int64_t(tokens.size()) >= 2 * n_ctx, o.text, " encodes to ", tokens.size(),
                " tokens; windows of ", n_ctx, " tokens need at least ", 2 * n_ctx, " (lower -c or give a longer text)");
  std::unique_ptr<cascade::LogProbReader> base;
  if (!o.kl.empty()) base = std::make_unique<cascade::LogProbReader>(o.kl, n_ctx, n_vocab, tokens);
  std::unique_ptr<cascade::LogProbWriter> save;
  if (!o.save.empty()) save = std::make_unique<cascade::LogProbWriter>(o.save, n_ctx, n_vocab, tokens);

  cascade::NllSum nll;
  cascade::KlSum kl;
  const int64_t n_rows = cascade::n_scored_per_window(n_ctx);
  cascade::run_windows(model, tokens, p, [&](int64_t w, const std::vector<float>& logits, const int32_t* targets) {
    for (int64_t r = 0; r < n_rows; ++r)
      nll.add(cascade::token_nll(logits.data() + r * n_vocab, n_vocab, targets[r]));
    if (save) save->add_window(logits);
    if (base) {
      const std::vector<cascade::f16>& b = base->next_window();
      for (int64_t r = 0; r < n_rows; ++r) kl.add(b.data() + r * n_vocab, logits.data() + r * n_vocab, n_vocab);
    }
    std::fprintf(stderr, "[%lld/%lld] perplexity %.4f", static_cast<long long>(w + 1),
                 static_cast<long long>(n_win), nll.perplexity());
    if (base) std::fprintf(stderr, ", KL %.6f, top-1 %.2f%%", kl.mean(), 100.0 * kl.top1_agreement());
    std::fputc('\n', stderr);
  });
  if (save) save->close();
  std::printf("perplexity: %.4f +/- %.4f (%lld windows of %lld tokens, %lld tokens scored, K/V %s)\n",
              nll.perplexity(), nll.perplexity_sd(), static_cast<long long>(n_win), static_cast<long long>(n_ctx),
              static_cast<long long>(nll.n), cascade::dtype_name(p.kv_dtype));
  if (base)
    std::printf("KL divergence: mean %.6f, top-1 agreement %.2f%%, worst %.4f at scored token %lld\n", kl.mean(),
                100.0 * kl.top1_agreement(), kl.worst, static_cast<long long>(kl.worst_at));
  std::fflush(stdout);
  return 0;
}

void print_error(std::string msg) {
  for (char& c : msg) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::fprintf(stderr, "cascade-perplexity: error: %s\n", msg.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unexpected failure");
  }
  return 1;
}
