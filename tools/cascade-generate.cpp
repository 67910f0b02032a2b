// cascade-generate: n parallel continuations of one or more prompts, with per-step timings, through the
// attention method of your choice.
//
//   cascade-generate [-m MODEL.gguf] [-p TEXT | -f FILE] [-n N] [-np N] [-c N] [-t N] [-b N] [--temp T]
//                    [--top-k K] [--top-p P] [--min-p P] [--repeat-penalty R] [--presence-penalty P]
//                    [--frequency-penalty F] [-s SEED] [--attn auto|cascade|split|unified]
//                    [--cost-model FILE] [--recalibrate] [--kv-type f16|bf16|q8_0|f32] [--chat] [--ignore-eos]
//                    [--stats-every N] [--stream] [--json] [--nondeterministic]
//
// stdout: each sequence's text (or, with --json, one JSON object). stderr: the startup line, notes, the
// periodic `decode[STEP]: X ms, avg Y ms` lines and the final timings. Any problem: exactly one line
// `cascade-generate: error: ...` on stderr, nothing on stdout, exit code 1.
//
// On a terminal (terminal.hpp), and never with --json: stderr shows a progress line that updates in place,
// and with -np 1 the first sequence's text streams to stdout as it is generated (then, stdout being the
// same terminal, it is the progress and the line is not drawn). Written to a file or a pipe, both outputs
// are exactly as without a terminal.
//
// JSON strings: valid UTF-8 is written as is (control characters as \u00XX, `"` and `\` escaped); every
// byte that is not part of valid UTF-8 becomes \uFFFD, so the output is always valid JSON and valid UTF-8.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/info.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/cpu/calibrate.hpp"
#include "cascade/cpu/profile_cache.hpp"
#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/linear.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "model/utf8.hpp"
#include "tools/terminal.hpp"

namespace {

using cascade::detail::fail;

constexpr const char* kUsage =
    "usage: cascade-generate [options]\n"
    "  -m, --model FILE      GGUF model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  -p, --prompt TEXT     prompt (default: a short story opening)\n"
    "  -f, --file FILE       prompts, one per line (blank lines skipped); each gets -np continuations\n"
    "  -n, --n-predict N     tokens to generate per sequence (default 64)\n"
    "  -np, --parallel N     sequences per prompt (default 4)\n"
    "  -c, --ctx-size N      positions per sequence, prompt included (default 0: the model's)\n"
    "  -t, --threads N       threads (default: all; more than the machine's hardware threads: all)\n"
    "  -b, --batch-size N    prompt tokens per prefill pass (default 512)\n"
    "  --temp T              temperature, 0 = greedy (default 0.8)\n"
    "  --top-k K             keep the K most likely tokens, 0 = all (default 40)\n"
    "  --top-p P             nucleus sampling, 1 = off (default 0.95)\n"
    "  --min-p P             drop tokens below P times the top probability, 0 = off (default 0.05)\n"
    "  --repeat-penalty R    divide (multiply, when negative) the logit of every token in the prompt or\n"
    "                        generated so far by R, 1 = off (default 1; model/sampler.hpp)\n"
    "  --presence-penalty P  subtract P from the logit of every token generated so far (default 0)\n"
    "  --frequency-penalty F subtract F times its count from the logit of every token generated so far\n"
    "                        (default 0)\n"
    "  -s, --seed N          random seed, -1 = random (default -1)\n"
    "  --attn METHOD         auto (default: cascade, with each shared span attended once for all the\n"
    "                        sequences or folded into them, as a cost model calibrated on this machine\n"
    "                        predicts faster, include/cascade/auto.hpp), cascade, split or unified\n"
    "                        auto's profile is kept per machine, thread count, head shape and K/V type in\n"
    "                        $XDG_CACHE_HOME/cascade (else ~/.cache/cascade) and calibrated (about 0.3 s)\n"
    "                        only when none matches; the startup line says which is used\n"
    "  --cost-model FILE     auto's profile from FILE instead of the cache: read when FILE exists, else\n"
    "                        calibrated at the start and written to FILE\n"
    "  --recalibrate         calibrate auto's profile anew and store it (in the cache, or FILE)\n"
    "  --nondeterministic    attention in a faster order whose last bits depend on the other sequences\n"
    "                        of a step (docs/serving.md: Determinism); default: a request's tokens\n"
    "                        depend on the request alone\n"
    "  --kv-type TYPE        K/V storage: f16 (default), bf16 (multiplied on bf16 dot products where the\n"
    "                        CPU runs them faster than f32 FMAs), q8_0 (int8 codes and a scale per 32 values,\n"
    "                        about half of f16's bytes, as llama.cpp's -ctk q8_0 -ctv q8_0) or f32\n"
    "  --chat                wrap each prompt in the model's chat template as a user message\n"
    "  --ignore-eos          keep generating past end-of-generation tokens (fixed-length runs for timing)\n"
    "  --stats-every N       print the decode step time every N steps (default 0: off)\n"
    "  --stream              print the first sequence's text as it is generated (default: with -np 1\n"
    "                        when stdout is a terminal); on a terminal stderr shows a progress line\n"
    "  --json                print one JSON object on stdout instead of the texts (no progress, no stream)\n";

struct Options {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::optional<std::string> prompt, file, cost_model;
  cascade::GenerateParams gen;
  bool random_seed = true;
  bool chat = false;
  bool ignore_eos = false;
  bool json = false;
  bool stream = false;
  bool recalibrate = false;
  int stats_every = 0;
};

int64_t parse_int(std::string_view flag, const std::string& s, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  CASCADE_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0, "invalid number '", s, "' for ", flag);
  CASCADE_CHECK(v >= lo && v <= hi, flag, " must be in [", lo, ", ", hi, "] (got ", v, ")");
  return v;
}

float parse_float(std::string_view flag, const std::string& s, double lo, double hi) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  CASCADE_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0 && std::isfinite(v), "invalid number '", s,
                "' for ", flag);
  CASCADE_CHECK(v >= lo && v <= hi, flag, " must be in [", lo, ", ", hi, "] (got ", s, ")");
  return float(v);
}

// -s: a number in [0, 2^64), or -1 for a random one.
void parse_seed(const std::string& v, Options& o) {
  if (v == "-1") {
    o.random_seed = true;
    return;
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long s = std::strtoull(v.c_str(), &end, 10);
  CASCADE_CHECK(!v.empty() && v[0] != '-' && end == v.c_str() + v.size() && errno == 0, "invalid seed '", v,
                "' (a number in [0, 2^64) or -1 for a random one)");
  o.gen.sampling.seed = s;
  o.random_seed = false;
}

// Returns nullopt when help was asked for.
std::optional<Options> parse_args(int argc, char** argv) {
  Options o;
  o.gen.n_predict = 64;
  o.gen.n_parallel = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      CASCADE_CHECK(i + 1 < argc, "missing value after ", a);
      return argv[++i];
    };
    constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
    if (a == "-m" || a == "--model") {
      o.model = value();
    } else if (a == "-p" || a == "--prompt") {
      o.prompt = value();
    } else if (a == "-f" || a == "--file") {
      o.file = value();
    } else if (a == "-n" || a == "--n-predict") {
      o.gen.n_predict = int(parse_int(a, value(), 0, kMaxInt));
    } else if (a == "-np" || a == "--parallel") {
      o.gen.n_parallel = int(parse_int(a, value(), 1, 4096));
    } else if (a == "-c" || a == "--ctx-size") {
      o.gen.n_ctx = parse_int(a, value(), 0, kMaxInt);
    } else if (a == "-t" || a == "--threads") {
      o.gen.n_threads = int(parse_int(a, value(), 1, 4096));
    } else if (a == "-b" || a == "--batch-size") {
      o.gen.n_batch = int(parse_int(a, value(), 1, kMaxInt));
    } else if (a == "--temp") {
      o.gen.sampling.temp = parse_float(a, value(), 0, 1e6);
    } else if (a == "--top-k") {
      o.gen.sampling.top_k = int32_t(parse_int(a, value(), 0, kMaxInt));
    } else if (a == "--top-p") {
      o.gen.sampling.top_p = parse_float(a, value(), 0, 1);
    } else if (a == "--min-p") {
      o.gen.sampling.min_p = parse_float(a, value(), 0, 1);
    } else if (a == "--repeat-penalty") {
      o.gen.sampling.repetition_penalty = parse_float(a, value(), 1e-3, 1e3);
    } else if (a == "--presence-penalty") {
      o.gen.sampling.presence_penalty = parse_float(a, value(), -100, 100);
    } else if (a == "--frequency-penalty") {
      o.gen.sampling.frequency_penalty = parse_float(a, value(), -100, 100);
    } else if (a == "-s" || a == "--seed") {
      parse_seed(value(), o);
    } else if (a == "--attn") {
      o.gen.attn = cascade::parse_attn_method(value());
    } else if (a == "--cost-model") {
      o.cost_model = value();
      CASCADE_CHECK(!o.cost_model->empty(), "--cost-model needs a file name");
    } else if (a == "--recalibrate") {
      o.recalibrate = true;
    } else if (a == "--nondeterministic") {
      cascade::cpu::set_batch_invariant(false);
    } else if (a == "--kv-type") {
      const std::string v = value();
      CASCADE_CHECK(v == "f16" || v == "bf16" || v == "q8_0" || v == "f32",
                    "--kv-type must be f16, bf16, q8_0 or f32 (got '", v, "')");
      o.gen.kv_dtype = cascade::parse_dtype(v);
    } else if (a == "--chat") {
      o.chat = true;
    } else if (a == "--ignore-eos") {
      o.ignore_eos = true;
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--stream") {
      o.stream = true;
    } else if (a == "--stats-every") {
      o.stats_every = int(parse_int(a, value(), 0, kMaxInt));
    } else if (a == "-h" || a == "--help") {
      return std::nullopt;
    } else {
      fail("unknown argument '", a, "' (see --help)");
    }
  }
  CASCADE_CHECK(!(o.prompt && o.file), "give either -p or -f, not both");
  CASCADE_CHECK(!(o.stream && o.json), "give either --stream or --json, not both");
  CASCADE_CHECK(!o.recalibrate || o.gen.attn == cascade::AttnMethod::auto_,
                "--recalibrate is for --attn auto (got --attn ", cascade::attn_method_name(o.gen.attn), ")");
  if (o.random_seed) o.gen.sampling.seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  return o;
}

std::vector<std::string> read_prompt_texts(const Options& o) {
  if (!o.file) {
    const std::string p = o.prompt.value_or("Once upon a time, in a small village by the sea, there lived");
    CASCADE_CHECK(!p.empty(), "the prompt is empty");
    return {p};
  }
  std::ifstream in(*o.file, std::ios::binary);
  CASCADE_CHECK(in.good(), "cannot open prompt file '", *o.file, "'");
  std::vector<std::string> prompts;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) prompts.push_back(line);
  }
  CASCADE_CHECK(in.eof(), "error reading prompt file '", *o.file, "'");
  CASCADE_CHECK(!prompts.empty(), "prompt file '", *o.file, "' holds no prompt");
  return prompts;
}

// The prompts' texts (-p, or -f one per line), each valid UTF-8.
std::vector<std::string> read_prompts(const Options& o) {
  std::vector<std::string> prompts = read_prompt_texts(o);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const int64_t bad = cascade::utf8::first_invalid(prompts[p]);
    CASCADE_CHECK(bad < 0, "prompt ", p + 1, " is not valid UTF-8 (byte ", bad, ")");
  }
  return prompts;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const size_t n = cascade::utf8::decode(s, i).len;
    if (n == 0) {
      out += "\\ufffd";
      ++i;
      continue;
    }
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// Bytes of memory the system can still give (MemAvailable), or 0 when it doesn't say.
uint64_t available_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kib;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(uint64_t(1) << 30));
  return buf;
}

// A byte count from /proc/self/status ("VmRSS:" now, "VmHWM:" the peak), or 0 when the system doesn't say.
uint64_t resident_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == field) {
      uint64_t kib = 0;
      f >> kib;
      return kib * 1024;
    }
    f.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

// Refuses a model whose weights would not fit in the memory the system can still give.
void check_weights_fit(const cascade::gguf::File& file, uint64_t avail) {
  const double need = double(cascade::llama::Model::bytes_needed(file));
  CASCADE_CHECK(avail == 0 || need <= double(avail), "loading the model's weights would need ", gib(need),
                ", but only ", gib(double(avail)), " of memory is available");
}

// What the loaded model takes and which instructions its linear layers and attention run on (--json, startup line).
struct ModelFacts {
  const char* linear_path;
  std::string linear_products;    // linear::products_name: the path, and "+amx-int8" where AMX tiles take many rows
  std::string attention_kernels;  // "shared: avx512 tiled f32; per-sequence: avx512 few-rows f32"
  uint64_t model_bytes, gguf_bytes, rss_after_load;
};

// The kernels the plans choose for heads of head_dim on K/V of type kv, the shared passes' and the per-sequence ones'.
std::string attention_kernels(int head_dim, cascade::DType kv) {
  namespace cpu = cascade::cpu;
  const cascade::Target t = cpu::target(1, head_dim);
  return "shared: " + cpu::kernel_name(t, cpu::kTiledKernel, kv) +
         "; per-sequence: " + cpu::kernel_name(t, cpu::kFewRowsKernel, kv);
}

// The prompts' token ids (through the chat template with --chat), each leaving room in the context.
std::vector<std::vector<int32_t>> tokenize_prompts(const Options& o, const cascade::Tokenizer& tok,
                                                   const std::vector<std::string>& texts, int64_t n_ctx) {
  std::vector<std::vector<int32_t>> prompts;
  for (size_t p = 0; p < texts.size(); ++p) {
    std::vector<int32_t> ids;
    if (o.chat) {
      const std::string chat = cascade::apply_chat_template(tok.vocab().chat_template, {{"user", texts[p]}}, true);
      ids = tok.encode(chat, /*add_special=*/true, /*parse_special=*/true);
    } else {
      ids = tok.encode(texts[p], /*add_special=*/true, /*parse_special=*/false);
    }
    CASCADE_CHECK(!ids.empty(), "prompt ", p + 1, " gives no tokens");
    CASCADE_CHECK(int64_t(ids.size()) < n_ctx, "prompt ", p + 1, " has ", ids.size(),
                  " tokens, which leaves no room in the context of ", n_ctx, " (-c)");
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

// Refuses, before any work starts, a run whose K/V cache at its largest (kv_cache.hpp's estimate for the
// method: the prompt tree, the copies a method makes, every token each sequence may generate) would not fit.
void check_cache_fits(const Options& o, const cascade::llama::Hparams& hp,
                      const std::vector<std::vector<int32_t>>& prompts, int64_t n_ctx, uint64_t avail) {
  int64_t prompt_tokens = 0;
  double gen_tokens = 0;
  for (const auto& ids : prompts) {
    prompt_tokens += int64_t(ids.size());
    gen_tokens += double(o.gen.n_parallel) * double(std::min<int64_t>(o.gen.n_predict, n_ctx - int64_t(ids.size())));
  }
  const double tokens = cascade::peak_kv_tokens(o.gen.attn, cascade::make_prompt_tree(prompts).n_tokens(),
                                                prompt_tokens, o.gen.n_parallel, gen_tokens);
  const double need = tokens * double(hp.n_layer) * 2.0 *
                      double(cascade::kv_row_bytes(o.gen.kv_dtype, hp.n_head_kv, hp.head_dim));
  CASCADE_CHECK(avail == 0 || need <= double(avail), "the K/V cache would need ", gib(need), " (",
                int64_t(tokens), " tokens x ", hp.n_layer, " layers), but only ", gib(double(avail)),
                " of memory is available: lower -np, -n or -c");
}

// --cost-model FILE, checked before any work starts: the profile it holds when it exists (and
// --recalibrate is not given); else FILE must be writable, for the profile calibrated at the start.
std::optional<cascade::CostModel> read_cost_model_file(const Options& o) {
  if (!o.cost_model) return std::nullopt;
  const std::string& path = *o.cost_model;
  CASCADE_CHECK(o.gen.attn == cascade::AttnMethod::auto_, "--cost-model is for --attn auto (got --attn ",
                cascade::attn_method_name(o.gen.attn), ")");
  std::error_code ec;
  const bool exists = std::filesystem::exists(path, ec);
  if (exists)
    CASCADE_CHECK(std::filesystem::is_regular_file(path, ec), "cost model profile '", path, "' is not a file");
  if (exists && !o.recalibrate) {
    cascade::CostModel m = cascade::CostModel::load(path);
    // A profile measured on another K/V type prices other kernels and element sizes.
    CASCADE_CHECK(!m.kv_dtype || *m.kv_dtype == o.gen.kv_dtype, "cost model profile '", path,
                  "' was calibrated for --kv-type ", cascade::dtype_name(m.kv_dtype.value_or(o.gen.kv_dtype)),
                  ", not ", cascade::dtype_name(o.gen.kv_dtype), " (--recalibrate measures it anew)");
    return m;
  }
  {
    std::ofstream probe(path, std::ios::app);
    CASCADE_CHECK(bool(probe), "cannot write the cost model profile '", path, "'");
  }
  if (!exists) std::filesystem::remove(path, ec);
  return std::nullopt;
}

// The threads to run with: -t, capped at the hardware threads this process may use (oneTBB's default
// concurrency) with one note when it was above them (oneTBB would print its own warning and use fewer).
int threads_to_use(const Options& o) {
  const int available = tbb::info::default_concurrency();
  if (o.gen.n_threads <= 0) return available;
  if (o.gen.n_threads <= available) return o.gen.n_threads;
  std::fprintf(stderr, "cascade-generate: note: -t %d is more than the %d hardware threads this process may use; "
               "using %d\n", o.gen.n_threads, available, available);
  return available;
}

// auto's profile for this run and where it came from.
struct Profile {
  enum class Source { none, file, cache, calibrated };
  Source source = Source::none;  // none: another method, or one sequence (nothing to choose)
  std::string path;              // the file read or written; empty when none
  double calibrate_ms = 0;       // 0 unless calibrated now
  const char* source_name() const {
    switch (source) {
      case Source::file: return "file";
      case Source::cache: return "cache";
      case Source::calibrated: return "calibrated";
      case Source::none: break;
    }
    return "none";
  }
  // For the startup line: ", auto's profile ..." or nothing.
  std::string describe() const {
    char ms[32];
    std::snprintf(ms, sizeof ms, "%.2f s", calibrate_ms / 1e3);
    switch (source) {
      case Source::none: return "";
      case Source::file: return ", auto's profile read from " + path;
      case Source::cache: return ", auto's profile from the cache (" + path + ")";
      case Source::calibrated:
        return ", auto's profile calibrated in " + std::string(ms) +
               (path.empty() ? " for this run only" : " and written to " + path);
    }
    return "";
  }
};

// Puts auto's profile into gen when the run needs one: from --cost-model FILE (given as from_file when it
// exists), else the per-machine cache (cpu/profile_cache.hpp), else calibrated now and written to FILE or the
// cache. Cache problems are one note on stderr, never an error.
Profile get_profile(const Options& o, cascade::GenerateParams& gen, const cascade::HeadShape& shape,
                    std::optional<cascade::CostModel> from_file, bool needed, cascade::term::Progress& progress) {
  Profile p;
  if (from_file) {
    gen.cost_model = std::move(from_file);
    p.source = Profile::Source::file;
    p.path = *o.cost_model;
    return p;
  }
  if (!needed) return p;
  const auto calibrate = [&] {
    progress.status("calibrating auto's cost model on this machine...");
    cascade::CostModel m = cascade::calibrate(gen.n_threads, shape, gen.kv_dtype);
    progress.clear();
    return m;
  };
  if (o.cost_model) {
    const auto t0 = std::chrono::steady_clock::now();
    gen.cost_model = calibrate();
    p.calibrate_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    gen.cost_model->save(*o.cost_model);
    p.source = Profile::Source::calibrated;
    p.path = *o.cost_model;
    return p;
  }
  cascade::cpu::ProfileCacheOptions opt;
  opt.recalibrate = o.recalibrate;
  const cascade::cpu::CachedProfile c =
      cascade::cpu::cached_profile(cascade::cpu::ProfileKey::here(gen.n_threads, shape, gen.kv_dtype), opt, calibrate);
  if (!c.note.empty()) progress.print("cascade-generate: note: " + c.note + "\n");
  gen.cost_model = c.model;
  p.source = c.source == cascade::cpu::CachedProfile::Source::cache ? Profile::Source::cache
                                                                    : Profile::Source::calibrated;
  p.path = c.path.string();
  p.calibrate_ms = c.calibrate_s * 1e3;
  return p;
}

// The most decode steps the run can take: a sequence's first token comes from its prompt's prefill, each
// step adds one, up to -n tokens or the context.
int64_t most_decode_steps(const Options& o, const std::vector<std::vector<int32_t>>& prompts, int64_t n_ctx) {
  int64_t most = 0;
  for (const auto& ids : prompts)
    most = std::max(most, std::min<int64_t>(o.gen.n_predict, n_ctx - int64_t(ids.size())) - 1);
  return most;
}

// The decode steps summed: wall time, attention, planning, and attention's mean share of a step.
struct DecodeTotals {
  double ms = 0, attn_ms = 0, plan_ms = 0, attn_share = 0, plan_share = 0, tokens_per_s = 0;
  explicit DecodeTotals(const cascade::GenerateResult& r) {
    for (const cascade::StepStat& st : r.steps) {
      ms += st.ms;
      attn_ms += st.attn_ms;
      plan_ms += st.plan_ms;
      attn_share += st.ms > 0 ? st.attn_ms / st.ms : 0;
      plan_share += st.ms > 0 ? st.plan_ms / st.ms : 0;
    }
    const double n_steps = double(r.steps.size());
    if (n_steps > 0) attn_share /= n_steps, plan_share /= n_steps;
    tokens_per_s = ms > 0 ? 1e3 * double(r.n_decode_tokens) / ms : 0;
  }
};

template <class F>
void json_array(std::ostringstream& js, const char* key, const std::vector<cascade::StepStat>& steps, F field) {
  js << ",\"" << key << "\":[";
  for (size_t i = 0; i < steps.size(); ++i) js << (i ? "," : "") << json_number(field(steps[i]));
  js << "]";
}

// --json: one object with the run's settings, timings, tree, per-step times and every sequence.
void print_json(const Options& o, const cascade::GenerateResult& r, const std::vector<std::string>& texts,
                int n_threads, size_t n_prompts, const Profile& profile, const ModelFacts& m) {
  const DecodeTotals d(r);
  std::ostringstream js;
  js << "{\"model\":" << json_string(o.model) << ",\"attn\":\"" << cascade::attn_method_name(o.gen.attn)
     << "\",\"kv_type\":\"" << cascade::dtype_name(o.gen.kv_dtype) << "\",\"n_threads\":" << n_threads
     << ",\"seed\":" << o.gen.sampling.seed << ",\"n_ctx\":" << r.n_ctx << ",\"n_parallel\":" << o.gen.n_parallel
     << ",\"n_predict\":" << o.gen.n_predict << ",\"n_prompts\":" << n_prompts
     << ",\"n_prompt_tokens\":" << r.n_prompt_tokens << ",\"n_prompt_stored\":" << r.n_prompt_stored
     << ",\"prompt_ms\":" << json_number(r.prompt_ms) << ",\"prompt_attn_ms\":" << json_number(r.prompt_attn_ms)
     << ",\"calibrate_ms\":" << json_number(profile.calibrate_ms) << ",\"cost_model_source\":\""
     << profile.source_name() << "\",\"cost_model_path\":"
     << (profile.path.empty() ? std::string("null") : json_string(profile.path)) << ",\"prompt_tokens_per_s\":"
     << json_number(r.prompt_ms > 0 ? 1e3 * double(r.n_prompt_stored) / r.prompt_ms : 0)
     << ",\"n_decode_tokens\":" << r.n_decode_tokens << ",\"decode_ms\":" << json_number(d.ms)
     << ",\"decode_tokens_per_s\":" << json_number(d.tokens_per_s) << ",\"attn_ms\":" << json_number(d.attn_ms)
     << ",\"attn_share\":" << json_number(d.attn_share) << ",\"plan_ms\":" << json_number(d.plan_ms)
     << ",\"plan_share\":" << json_number(d.plan_share) << ",\"kv_tokens\":" << r.kv_tokens
     << ",\"kv_bytes\":" << r.kv_bytes << ",\"linear_path\":\"" << m.linear_path << "\",\"linear_products\":\""
     << m.linear_products << "\",\"attention_kernels\":" << json_string(m.attention_kernels) << ",\"model_bytes\":"
     << m.model_bytes << ",\"gguf_bytes\":" << m.gguf_bytes << ",\"rss_after_load_bytes\":" << m.rss_after_load
     << ",\"rss_peak_bytes\":" << resident_bytes("VmHWM:") << ",\"tree\":[";
  for (size_t i = 0; i < r.tree.nodes.size(); ++i)
    js << (i ? "," : "") << "{\"parent\":" << r.tree.nodes[i].parent << ",\"start\":" << r.tree.nodes[i].start
       << ",\"n_tokens\":" << r.tree.nodes[i].tokens.size() << "}";
  js << "]";
  json_array(js, "step_ms", r.steps, [](const cascade::StepStat& st) { return st.ms; });
  json_array(js, "step_attn_ms", r.steps, [](const cascade::StepStat& st) { return st.attn_ms; });
  json_array(js, "step_plan_ms", r.steps, [](const cascade::StepStat& st) { return st.plan_ms; });
  js << ",\"sequences\":[";
  for (size_t s = 0; s < r.sequences.size(); ++s) {
    js << (s ? "," : "") << "{\"prompt\":" << r.sequences[s].prompt << ",\"stop\":\"" << r.sequences[s].stop
       << "\",\"text\":" << json_string(texts[s]) << ",\"tokens\":[";
    for (size_t k = 0; k < r.sequences[s].tokens.size(); ++k) js << (k ? "," : "") << r.sequences[s].tokens[k];
    js << "]}";
  }
  js << "]}\n";
  std::fputs(js.str().c_str(), stdout);
}

// The line that opens the run on stderr: what runs, with how many threads, on which linear path, and auto's profile.
std::string startup_line(const Options& o, size_t n_prompts, int n_threads, const ModelFacts& m,
                         const Profile& profile) {
  char head[320];
  std::snprintf(head, sizeof head,
                "cascade-generate: %zu prompt(s), %d sequence(s) each, -n %d, --attn %s, K/V %s, %d threads, "
                "linear layers %s (products %s), weights %.1f MiB",
                n_prompts, o.gen.n_parallel, o.gen.n_predict, cascade::attn_method_name(o.gen.attn),
                cascade::dtype_name(o.gen.kv_dtype), n_threads, m.linear_path, m.linear_products.c_str(),
                double(m.model_bytes) / (1 << 20));
  return std::string(head) + ", attention (" + m.attention_kernels + ")" + profile.describe() + "\n";
}

// The sequences' texts on stdout, from sequence `first` on (those before it were streamed).
void print_texts(const cascade::GenerateResult& r, const std::vector<std::string>& texts, size_t first) {
  for (size_t s = first; s < r.sequences.size(); ++s)
    std::printf("--- sequence %zu (prompt %d, %s) ---\n%s\n", s, r.sequences[s].prompt + 1, r.sequences[s].stop.c_str(),
                texts[s].c_str());
}

// The final timings on stderr, llama.cpp's lines and ours.
void print_timings(const cascade::GenerateResult& r, const Profile& profile) {
  const DecodeTotals d(r);
  const double n_steps = double(r.steps.size());
  for (size_t s = 0; s < r.sequences.size(); ++s)
    if (r.sequences[s].stop == "context")
      std::fprintf(stderr, "note: sequence %zu stopped at the context limit (%lld positions, -c)\n", s,
                   static_cast<long long>(r.n_ctx));
  std::fprintf(stderr, "prompt eval time = %10.2f ms / %5lld tokens (%8.2f ms per token, %8.2f tokens per second)\n",
               r.prompt_ms, static_cast<long long>(r.n_prompt_stored),
               r.n_prompt_stored ? r.prompt_ms / double(r.n_prompt_stored) : 0.0,
               r.prompt_ms > 0 ? 1e3 * double(r.n_prompt_stored) / r.prompt_ms : 0.0);
  std::fprintf(stderr,
               "decode time      = %10.2f ms / %5lld tokens (%8.2f ms per token, %8.2f tokens per second), "
               "%zu steps, %.2f ms per step\n",
               d.ms, static_cast<long long>(r.n_decode_tokens),
               r.n_decode_tokens ? d.ms / double(r.n_decode_tokens) : 0.0, d.tokens_per_s, r.steps.size(),
               n_steps > 0 ? d.ms / n_steps : 0.0);
  std::fprintf(stderr, "attention        = %10.2f ms of decode (%.1f%% of each step on average), %.2f ms of prefill\n",
               d.attn_ms, 100 * d.attn_share, r.prompt_attn_ms);
  std::fprintf(stderr,
               "attention plans  = %10.2f ms of decode (%.2f%% of each step), one plan per step for all layers\n",
               d.plan_ms, 100 * d.plan_share);
  if (profile.source == Profile::Source::calibrated)
    std::fprintf(stderr, "auto calibration = %10.2f ms, once, before the prefill (%s)\n", profile.calibrate_ms,
                 profile.path.empty() ? "for this run only" : ("kept in " + profile.path + " for later runs").c_str());
  std::fprintf(stderr, "prompt tokens    = %lld in the prompts, %lld stored in the tree (%zu nodes); K/V at the end: "
               "%lld tokens, %.2f MiB\n",
               static_cast<long long>(r.n_prompt_tokens), static_cast<long long>(r.n_prompt_stored),
               r.tree.nodes.size(), static_cast<long long>(r.kv_tokens), double(r.kv_bytes) / (1 << 20));
}

int run(int argc, char** argv) {
  const std::optional<Options> opt = parse_args(argc, argv);
  if (!opt) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const Options& o = *opt;
  const std::vector<std::string> texts = read_prompts(o);
  const auto file = std::make_shared<const cascade::gguf::File>(cascade::gguf::File::open(o.model));
  const cascade::Tokenizer tok(cascade::load_vocab(*file));
  const uint64_t avail = available_memory();
  check_weights_fit(*file, avail);
  cascade::llama::Model model = cascade::llama::Model::load(file);
  const cascade::linear::Path linear_path = cascade::linear::active_path();
  const ModelFacts facts{cascade::linear::path_name(linear_path), cascade::linear::products_name(linear_path),
                         attention_kernels(int(model.hparams().head_dim), o.gen.kv_dtype), model.weight_bytes(),
                         file->size(), resident_bytes("VmRSS:")};
  const int64_t n_ctx = o.gen.n_ctx > 0 ? o.gen.n_ctx : model.hparams().n_ctx_train;
  model.set_context_length(n_ctx);  // long or short RoPE factors, as llama.cpp picks them for -c
  const std::vector<std::vector<int32_t>> prompts = tokenize_prompts(o, tok, texts, n_ctx);
  check_cache_fits(o, model.hparams(), prompts, n_ctx, avail);
  std::optional<cascade::CostModel> profile_file = read_cost_model_file(o);

  // From here on nothing fails on bad input: notes and progress may go to stderr.
  cascade::GenerateParams gen = o.gen;
  gen.n_threads = threads_to_use(o);
  namespace term = cascade::term;
  const bool stream = !o.json && (o.stream || (o.gen.n_parallel == 1 && term::is_terminal(stdout)));
  term::Progress progress(stderr, !o.json && term::is_terminal(stderr) && !(stream && term::is_terminal(stdout)),
                          most_decode_steps(o, prompts, n_ctx));
  const bool needs_profile = o.gen.attn == cascade::AttnMethod::auto_ && prompts.size() * size_t(o.gen.n_parallel) >= 2;
  const Profile profile =
      get_profile(o, gen, model.hparams().head_shape(), std::move(profile_file), needs_profile, progress);
  progress.print(startup_line(o, prompts.size(), gen.n_threads, facts, profile));

  progress.status("prefill: " + std::to_string(cascade::make_prompt_tree(prompts).n_tokens()) + " prompt tokens...");
  term::TextStream text0(tok, stdout);
  if (stream) {
    std::printf("--- sequence 0 (prompt 1) ---\n");
    std::fflush(stdout);
  }
  double sum_ms = 0;
  const auto on_step = [&](int step, const cascade::StepStat& st) {
    sum_ms += st.ms;
    progress.step(st);
    if (o.stats_every > 0 && (step + 1) % o.stats_every == 0) {
      char line[96];
      std::snprintf(line, sizeof line, "decode[%d]: %.1f ms, avg %.1f ms\n", step + 1, st.ms, sum_ms / (step + 1));
      progress.print(line);
    }
  };
  const auto on_token = [&](int s, int32_t id) {
    if (stream && s == 0) text0.token(id);
  };
  const cascade::GenerateResult r = cascade::generate(
      model, prompts, gen, [&](int32_t id) { return !o.ignore_eos && tok.is_eog(id); }, on_step, on_token);
  progress.clear();
  std::vector<std::string> out_texts;
  for (const cascade::SequenceResult& sq : r.sequences) out_texts.push_back(tok.decode(sq.tokens, false));
  if (o.json) {
    print_json(o, r, out_texts, gen.n_threads, prompts.size(), profile, facts);
  } else {
    if (stream) text0.finish();
    print_texts(r, out_texts, stream ? 1 : 0);
  }
  std::fflush(stdout);
  print_timings(r, profile);
  return 0;
}

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "cascade-generate: error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
