// cascade-server: an OpenAI-compatible HTTP server. Concurrent requests share their prompts' K/V through a
// prefix tree that lives across requests, and each decode step attends every shared span once for all the
// sequences below it (server/engine.hpp, server/api.hpp).
//
//   cascade-server [-m MODEL.gguf] [--host H] [--port P] [-np N] [-c N] [-t N] [-b N] [--queue N]
//                  [--attn auto|cascade|split|unified] [--kv-budget MIB] [--kv-type f16|bf16|q8_0|f32]
//                  [--api-key KEY] [--chat-template NAME|FILE] [--alias NAME] [--max-tokens N] [--http-threads N]
//                  [--max-body BYTES] [--nondeterministic]
//                  [--read-timeout S] [--request-timeout S] [--idle-timeout S] [--shutdown-timeout S]
//
// stderr: one line when listening (`cascade-server: listening on http://HOST:PORT ...`), one when stopping.
// SIGINT or SIGTERM: stop taking new requests (503), let running ones finish for up to --shutdown-timeout
// seconds, then exit 0. Any problem at start: one line `cascade-server: error: ...` and exit code 1.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <pthread.h>
#include <signal.h>

#include <tbb/info.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

#include "cascade/cpu/profile_cache.hpp"
#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "server/api.hpp"
#include "server/engine.hpp"
#include "server/http.hpp"

namespace {

using cascade::detail::fail;

constexpr const char* kUsage =
    "usage: cascade-server [options]\n"
    "  -m, --model FILE        GGUF model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  --host ADDR             address to listen on (default 127.0.0.1)\n"
    "  --port N                port (default 8080; 0: any free port, printed at start)\n"
    "  -np, --parallel N       sequences decoding at once, at most (default 4); a request with n choices\n"
    "                          takes n\n"
    "  -c, --ctx-size N        positions per sequence, prompt included (default 0: the model's)\n"
    "  -t, --threads N         threads for the forward passes (default: all)\n"
    "  -b, --batch-size N      prompt tokens prefilled per step, at most, beside the decoding sequences\n"
    "                          (default 256)\n"
    "  --queue N               requests waiting to start, at most; more get 503 (default 4 x -np)\n"
    "  --attn METHOD           auto (default: cascade, each shared span attended once for all the sequences\n"
    "                          below it or folded into them, as a cost model predicts faster; its profile\n"
    "                          is calibrated once per machine and kept in the cache cascade-generate uses),\n"
    "                          cascade, split (each sequence a copy of its prompt) or unified (one buffer\n"
    "                          with masks, as llama.cpp)\n"
    "  --kv-budget MIB         K/V kept, cached prefixes included; unused cached prefixes are evicted least\n"
    "                          recently used first (default: 2 x -np x -c tokens' worth)\n"
    "  --nondeterministic      attention in a faster order whose last bits depend on the other sequences\n"
    "                          of a step (docs/serving.md: Determinism); default: a request's tokens\n"
    "                          depend on the request alone\n"
    "  --kv-type TYPE          K/V storage: f16 (default), bf16 (multiplied on bf16 dot products where the\n"
    "                          CPU runs them faster than f32 FMAs), q8_0 (int8 codes and a scale per 32\n"
    "                          values, about half of f16's bytes, as llama.cpp's -ctk q8_0 -ctv q8_0) or f32\n"
    "  --api-key KEY           require `Authorization: Bearer KEY` (all endpoints but /health)\n"
    "  --chat-template NAME    chatml, llama3, phi3, gemma, mistral, or a file holding a template to recognize\n"
    "                          (default: the model's)\n"
    "  --alias NAME            the model's name in the API (default: the file's name without .gguf); a request\n"
    "                          naming another model gets 404 model_not_found, so give clients' name here\n"
    "  --max-tokens N          tokens a request generates when it omits max_tokens, and at most when it asks\n"
    "                          more (default: no cap but the context; omitted, 16 for completions and 1024 for\n"
    "                          chat)\n"
    "  --http-threads N        connections served at once (default -np + --queue + 8, at least 16); 64 more\n"
    "                          wait for a thread, the rest in the kernel's listen queue\n"
    "  --max-body BYTES        largest request body; larger ones get 413 (default 4194304)\n"
    "  --read-timeout S        seconds the server waits for a request's next bytes (default 10)\n"
    "  --request-timeout S     seconds a whole request (line, headers, body) may take to arrive (default 30;\n"
    "                          past it the connection is closed, or a body's request answered 408)\n"
    "  --idle-timeout S        seconds an idle connection is kept open (default 5)\n"
    "  --shutdown-timeout S    on SIGINT/SIGTERM, seconds running requests may take to finish (default 30)\n";

struct Options {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string alias, chat_template;
  cascade::server::EngineConfig engine;
  cascade::server::HttpConfig http;
  std::string api_key;
  int64_t kv_budget_mib = 0;
  int queue = -1, http_threads = 0, max_tokens = 0;
  int shutdown_s = 30;
};

int64_t parse_int(std::string_view flag, const std::string& s, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  CASCADE_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0, "invalid number '", s, "' for ", flag);
  CASCADE_CHECK(v >= lo && v <= hi, flag, " must be in [", lo, ", ", hi, "] (got ", v, ")");
  return v;
}

std::optional<Options> parse_args(int argc, char** argv) {
  Options o;
  o.http.port = 8080;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      CASCADE_CHECK(i + 1 < argc, "missing value after ", a);
      return argv[++i];
    };
    constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
    if (a == "-m" || a == "--model") {
      o.model = value();
    } else if (a == "--host") {
      o.http.host = value();
    } else if (a == "--port") {
      o.http.port = int(parse_int(a, value(), 0, 65535));
    } else if (a == "-np" || a == "--parallel") {
      o.engine.n_parallel = int(parse_int(a, value(), 1, 4096));
    } else if (a == "-c" || a == "--ctx-size") {
      o.engine.n_ctx = parse_int(a, value(), 0, kMaxInt);
    } else if (a == "-t" || a == "--threads") {
      o.engine.n_threads = int(parse_int(a, value(), 1, 4096));
    } else if (a == "-b" || a == "--batch-size") {
      o.engine.n_batch = int(parse_int(a, value(), 1, kMaxInt));
    } else if (a == "--queue") {
      o.queue = int(parse_int(a, value(), 0, 1 << 20));
    } else if (a == "--attn") {
      o.engine.attn = cascade::parse_attn_method(value());
    } else if (a == "--kv-budget") {
      o.kv_budget_mib = parse_int(a, value(), 1, int64_t(1) << 30);
    } else if (a == "--nondeterministic") {
      cascade::cpu::set_batch_invariant(false);
    } else if (a == "--kv-type") {
      const std::string v = value();
      CASCADE_CHECK(v == "f16" || v == "bf16" || v == "q8_0" || v == "f32",
                    "--kv-type must be f16, bf16, q8_0 or f32 (got '", v, "')");
      o.engine.kv_dtype = cascade::parse_dtype(v);
    } else if (a == "--api-key") {
      o.api_key = value();
      CASCADE_CHECK(!o.api_key.empty(), "--api-key needs a key");
    } else if (a == "--chat-template") {
      o.chat_template = value();
      CASCADE_CHECK(!o.chat_template.empty(), "--chat-template needs a name or a file");
    } else if (a == "--alias") {
      o.alias = value();
      CASCADE_CHECK(!o.alias.empty(), "--alias needs a name");
    } else if (a == "--max-tokens") {
      o.max_tokens = int(parse_int(a, value(), 1, kMaxInt));
    } else if (a == "--http-threads") {
      o.http_threads = int(parse_int(a, value(), 1, 4096));
    } else if (a == "--max-body") {
      o.http.max_body = size_t(parse_int(a, value(), 1, int64_t(1) << 30));
    } else if (a == "--read-timeout") {
      o.http.read_timeout_s = int(parse_int(a, value(), 1, 3600));
    } else if (a == "--request-timeout") {
      o.http.request_timeout_s = int(parse_int(a, value(), 1, 3600));
    } else if (a == "--idle-timeout") {
      o.http.keep_alive_s = int(parse_int(a, value(), 1, 3600));
    } else if (a == "--shutdown-timeout") {
      o.shutdown_s = int(parse_int(a, value(), 0, 24 * 3600));
    } else if (a == "-h" || a == "--help") {
      return std::nullopt;
    } else {
      fail("unknown argument '", a, "' (see --help)");
    }
  }
  return o;
}

// The chat template's text: --chat-template's (a name or a file), else the model's; empty when neither is
// one the chat formatter knows (chat requests then get a 400 naming the flag).
std::string chat_template(const Options& o, const cascade::Tokenizer& tok) {
  std::string t = cascade::builtin_chat_template(o.chat_template);
  if (!t.empty()) return t;
  if (!o.chat_template.empty()) {
    std::ifstream in(o.chat_template, std::ios::binary);
    CASCADE_CHECK(in.good(), "--chat-template: '", o.chat_template,
                  "' is neither a format name (chatml, llama3, phi3, gemma, mistral) nor a readable file");
    std::stringstream ss;
    ss << in.rdbuf();
    t = ss.str();
    cascade::detect_chat_format(t);  // an unknown template is an error here, not at the first chat request
    return t;
  }
  t = tok.vocab().chat_template;
  try {
    if (!t.empty()) cascade::detect_chat_format(t);
  } catch (const cascade::Error&) {
    std::fprintf(stderr, "cascade-server: the model's chat template is not one this server knows; "
                         "/v1/chat/completions needs --chat-template chatml, llama3, phi3, gemma or mistral\n");
    return {};
  }
  return t;
}

std::string model_id(const Options& o) {
  if (!o.alias.empty()) return o.alias;
  std::string name = std::filesystem::path(o.model).filename().string();
  if (name.size() > 5 && name.ends_with(".gguf")) name.resize(name.size() - 5);
  return name;
}

std::string one_line(std::string s);

int run(int argc, char** argv) {
  // SIGINT and SIGTERM are taken by sigwait below: every thread made from here on inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  const std::optional<Options> opt = parse_args(argc, argv);
  if (!opt) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Options o = *opt;
  const cascade::gguf::File file = cascade::gguf::File::open(o.model);
  const cascade::Tokenizer tok(cascade::load_vocab(file));
  const cascade::llama::Model model = cascade::llama::Model::load(file);
  if (o.kv_budget_mib > 0) o.engine.kv_budget = o.kv_budget_mib << 20;
  o.engine.max_queue = o.queue >= 0 ? o.queue : 4 * o.engine.n_parallel;
  o.http.n_threads = o.http_threads > 0 ? o.http_threads : std::max(16, o.engine.n_parallel + o.engine.max_queue + 8);
  cascade::server::ApiConfig api_cfg{model_id(o), o.api_key, chat_template(o, tok), o.max_tokens};

  // auto's profile: this machine's from the per-machine cache cascade-generate keeps, else calibrated now and
  // kept there (a problem with the cache is a note, never an error).
  std::string profile;
  if (o.engine.attn == cascade::AttnMethod::auto_ && !o.engine.cost_model) {
    const cascade::cpu::CachedProfile c =
        cascade::cpu::calibrate_cached(o.engine.n_threads, model.hparams().head_shape(), o.engine.kv_dtype);
    if (!c.note.empty()) std::fprintf(stderr, "cascade-server: note: %s\n", one_line(c.note).c_str());
    o.engine.cost_model = c.model;
    profile = c.source == cascade::cpu::CachedProfile::Source::cache
                  ? ", auto's profile from the cache"
                  : ", auto's profile calibrated in " + std::to_string(int(c.calibrate_s * 1e3 + 0.5)) + " ms";
  }
  cascade::server::Engine engine(model, tok, o.engine);
  cascade::server::Api api(engine, tok, api_cfg);
  cascade::server::HttpServer http(api, o.http);
  const int port = http.bind();
  engine.start();
  std::thread http_thread([&] {
    http.run();
    kill(getpid(), SIGTERM);  // the listener ended on its own: stop the process too
  });
  const auto& cfg = engine.config();
  const int n_threads = cfg.n_threads > 0 ? cfg.n_threads : tbb::info::default_concurrency();
  std::fprintf(stderr,
               "cascade-server: listening on http://%s:%d (model %s, -np %d, -c %lld, --attn %s, K/V budget %.0f MiB, "
               "%d thread%s%s)\n",
               o.http.host.c_str(), port, api_cfg.model_id.c_str(), cfg.n_parallel, static_cast<long long>(cfg.n_ctx),
               cascade::attn_method_name(cfg.attn), double(cfg.kv_budget) / (1 << 20), n_threads,
               n_threads == 1 ? "" : "s", profile.c_str());
  std::fflush(stderr);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "cascade-server: %s: finishing running requests (up to %d s), refusing new ones\n",
               sig == SIGINT ? "SIGINT" : "SIGTERM", o.shutdown_s);
  api.set_draining();
  const bool clean = engine.drain(std::chrono::seconds(o.shutdown_s));
  http.stop();
  http_thread.join();
  std::fprintf(stderr, "cascade-server: stopped (%s)\n",
               clean ? "every request finished" : "requests cut at the timeout");
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
    std::fprintf(stderr, "cascade-server: error: %s\n", one_line(e.what()).c_str());
    return 1;
  }
}
