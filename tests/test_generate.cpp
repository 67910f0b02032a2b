// Generation with the real model (SmolLM2-135M-Instruct Q4_1, fetched by scripts/setup.sh): the three attention
// methods give the same greedy text, prompts sharing a beginning share it, and cascade-generate's seeds, chat
// mode and bad-input handling.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/linear.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "tool_run.hpp"

namespace test_generate {

using namespace cascade;

namespace {

const char* kModel = CASCADE_MODEL_PATH;
const std::string kTool = CASCADE_BINARY_DIR "/tools/cascade-generate";

void require_model() {
  REQUIRE_MESSAGE(std::filesystem::exists(kModel),
                  "the model file " << kModel << " is missing: run `bash scripts/setup.sh` in the repository");
}

// The model, loaded once for the whole file, on both linear paths (views of one mapping); the f32 path only where a
// case asks for it (loaded_f32()): it dequantizes every weight, 3 s of each case under ASan.
//
// The attention methods sum in different orders, so their outputs differ in the last bits. On the f32 path
// that never changes a greedy choice; on the quantized path such a difference can move an activation across a
// rounding boundary of its int8 code, which changes the next layer by a code step and then flips further codes:
// the continuations stay equally likely but part ways after some tokens. Tests that compare the methods' or
// batches' texts token for token therefore run the f32 path (loaded_f32()); test_llama.cpp checks every method on
// the quantized path step by step against the reference.
struct Loaded {
  std::shared_ptr<const gguf::File> file;
  Tokenizer tok;
  llama::Model model;
  explicit Loaded(const char* path)
      : file(std::make_shared<const gguf::File>(gguf::File::open(path))),
        tok(load_vocab(*file)),
        model(llama::Model::load(file)) {}
};
const Loaded& loaded() {
  static std::unique_ptr<Loaded> l = std::make_unique<Loaded>(kModel);
  return *l;
}
const llama::Model& loaded_f32() {
  static const llama::Model f32 = llama::Model::load(loaded().file, llama::LinearPath::f32);
  return f32;
}

using tool_run::read_file;
using tool_run::Run;

// Runs the tool with args (already shell-quoted), capturing stdout and stderr; auto's profile cache is
// the suite's (tool_run.hpp), not the user's.
Run run_tool(const std::string& args, const std::string& env = "") { return tool_run::run(kTool, args, env); }

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// Prompts sharing their first words, 4 of them x 2 sequences = 8 sequences.
const std::vector<std::string> kPrompts = {
    "The history of the city of Paris begins with a small settlement on an island in the river. Over the centuries",
    "The history of the city of Paris begins with a small settlement on an island in the river. The first bridges",
    "The history of the city of Paris begins with a small settlement on an island in the river. Today, visitors",
    "The history of the city of Rome begins with",
};

}  // namespace

TEST_CASE("generate: greedy continuations are identical with cascade, split, unified and auto attention (f32 path)") {
  require_model();
  const Loaded& m = loaded();
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : kPrompts) prompts.push_back(m.tok.encode(p));
  GenerateParams gp;
  gp.n_predict = 64;
  gp.n_parallel = 2;
  gp.sampling.temp = 0;
  std::vector<GenerateResult> res;
  for (AttnMethod a : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
    gp.attn = a;
    res.push_back(generate(loaded_f32(), prompts, gp, [&](int32_t id) { return m.tok.is_eog(id); }));
  }
  REQUIRE(res[0].sequences.size() == 8);
  for (int s = 0; s < 8; ++s) {
    CAPTURE(s);
    CAPTURE(m.tok.decode(res[0].sequences[s].tokens));
    CHECK(res[1].sequences[s].tokens == res[0].sequences[s].tokens);
    CHECK(res[2].sequences[s].tokens == res[0].sequences[s].tokens);
    CHECK(res[3].sequences[s].tokens == res[0].sequences[s].tokens);  // auto: whatever it regrouped
    CHECK(res[0].sequences[s].tokens.size() >= 8);  // the prompts invite a long continuation
  }
  // Different prompts, different texts; the two sequences of a prompt agree (greedy).
  CHECK(res[0].sequences[0].tokens == res[0].sequences[1].tokens);
  CHECK(res[0].sequences[0].tokens != res[0].sequences[2].tokens);

  // The shared beginning is stored once: a tree with one root above the three long prompts.
  const GenerateResult& r = res[0];
  CHECK(r.n_prompt_stored < r.n_prompt_tokens);
  int64_t sum = 0;
  for (const auto& p : prompts) sum += int64_t(p.size());
  CHECK(r.n_prompt_tokens == sum);
  // "The history of the city of" is shared by all four; the long sentence about Paris by the first three.
  REQUIRE(r.tree.nodes.size() == 6);
  CHECK(r.tree.nodes[0].parent == -1);
  CHECK(r.tree.nodes[1].parent == 0);
  CHECK(r.tree.nodes[1].tokens.size() >= 10);
  for (int p = 0; p < 3; ++p) CHECK(r.tree.nodes[r.tree.prompt_node[p]].parent == 1);
  // Split stores the prompt once per sequence; cascade and unified once.
  CHECK(res[1].kv_tokens > res[0].kv_tokens);
  CHECK(res[2].kv_tokens == res[0].kv_tokens);
}

// The real model's logits on the quantized path against the f32 path, over the 22 positions of a prompt. Each
// linear layer's int8 activations move its outputs by ~0.5% of their size (test_llama.cpp); over 30 layers that
// compounds to a root-mean-square deviation of ~3% of the logits' standard deviation (measured 2.6%) with tails
// to ~16% (measured), so: rms within 5% of the sd, every logit within 25% of the sd plus 2% of itself, and the
// next-token choice agreeing wherever the f32 path's top two logits are more than 10% of the sd apart (2.7 rms
// of the difference of two deviations).
TEST_CASE("generate: the real model's logits on the quantized path against the f32 path") {
  require_model();
  const auto file = std::make_shared<const gguf::File>(gguf::File::open(kModel));
  const Tokenizer tok(load_vocab(*file));
  const std::vector<int32_t> ids = tok.encode(kPrompts[0]);
  std::vector<std::vector<float>> out;
  for (llama::LinearPath path : {llama::LinearPath::quantized, llama::LinearPath::f32}) {
    const llama::Model model = llama::Model::load(file, path);
    const llama::Hparams& hp = model.hparams();
    TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
    const int seg = cache.add_segment(-1, 0);
    std::vector<int32_t> pos;
    std::vector<int64_t> rows;
    for (size_t i = 0; i < ids.size(); ++i) pos.push_back(int32_t(i)), rows.push_back(int64_t(i));
    cache.begin_step({{seg, int64_t(ids.size()), 0}});
    out.emplace_back();
    model.forward(ids, pos, cache, rows, out.back());
  }
  const std::vector<float>&q = out[0], &f = out[1];
  REQUIRE(q.size() == f.size());
  const size_t V = q.size() / ids.size();
  double mean = 0, var = 0;
  for (float v : f) mean += v;
  mean /= double(f.size());
  for (float v : f) var += (v - mean) * (v - mean);
  const double sd = std::sqrt(var / double(f.size()));
  double worst = 0, sq = 0;
  int bad = 0, agree = 0, decided = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    const double err = std::fabs(double(q[i]) - f[i]);
    worst = std::max(worst, err / sd);
    sq += err * err;
    bad += !(err <= 0.25 * sd + 0.02 * std::fabs(f[i]));
  }
  const double rms = std::sqrt(sq / double(f.size())) / sd;
  for (size_t r = 0; r < ids.size(); ++r) {
    const float* fr = f.data() + r * V;
    const float* qr = q.data() + r * V;
    std::vector<float> top(fr, fr + V);
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
    if (top[0] - top[1] <= 0.1 * sd) continue;
    ++decided;
    agree += std::max_element(qr, qr + V) - qr == std::max_element(fr, fr + V) - fr;
  }
  INFO("logits' sd " << sd << ", |quantized - f32| / sd: rms " << rms << ", worst " << worst
                     << "; next token agrees at " << agree << " of " << decided << " clear positions");
  CHECK(bad == 0);
  CHECK(rms <= 0.05);
  CHECK(agree == decided);
  CHECK(decided >= 10);
}

TEST_CASE("generate: a sequence samples the same text whatever the method and the sequences beside it (f32 path)") {
  require_model();
  const Loaded& m = loaded();
  const std::vector<std::vector<int32_t>> prompts = {m.tok.encode("My favourite animal is")};
  GenerateParams gp;
  gp.n_predict = 16;
  gp.sampling.temp = 1.0f;
  gp.sampling.seed = 99;
  const auto eog = [&](int32_t id) { return m.tok.is_eog(id); };
  gp.n_parallel = 2;
  gp.attn = AttnMethod::cascade;
  const GenerateResult a = generate(loaded_f32(), prompts, gp, eog);
  gp.n_parallel = 4;
  gp.attn = AttnMethod::unified;
  const GenerateResult b = generate(loaded_f32(), prompts, gp, eog);
  for (int s = 0; s < 2; ++s) CHECK(a.sequences[s].tokens == b.sequences[s].tokens);
  CHECK(a.sequences[0].tokens != a.sequences[1].tokens);  // own streams
}

// The default path (int8 linear layers, f16 K/V) is batch-invariant (docs/serving.md, "Determinism"): a prompt's
// tokens, greedy or seeded, do not depend on the sequences beside it, the attention method (unified aside), the
// prefill's chunks or the segmentation of the prompt tree.
TEST_CASE("generate: on the default path a prompt's tokens are the same alone or beside others, any method but "
          "unified, any prefill chunks") {
  require_model();
  const Loaded& m = loaded();
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : kPrompts) prompts.push_back(m.tok.encode(p));
  const auto eog = [&](int32_t id) { return m.tok.is_eog(id); };
  for (float temp : {0.0f, 0.8f}) {
    CAPTURE(temp);
    GenerateParams gp;
    gp.n_predict = 24;
    gp.sampling.temp = temp;
    gp.sampling.seed = 7;
    gp.n_parallel = 1;
    gp.attn = AttnMethod::cascade;
    const GenerateResult alone = generate(m.model, {prompts[0]}, gp, eog);
    REQUIRE(alone.sequences.size() == 1);
    struct Step {
      AttnMethod attn;
      int n_parallel, n_batch;
    };
    for (const Step& r : {Step{AttnMethod::cascade, 4, 7}, Step{AttnMethod::split, 8, 512},
                          Step{AttnMethod::auto_, 4, 512}}) {
      CAPTURE(attn_method_name(r.attn));
      CAPTURE(r.n_parallel);
      gp.attn = r.attn;
      gp.n_parallel = r.n_parallel;
      gp.n_batch = r.n_batch;
      const GenerateResult res = generate(m.model, prompts, gp, eog);
      REQUIRE(res.sequences.size() == prompts.size() * size_t(r.n_parallel));
      CHECK(res.sequences[0].tokens == alone.sequences[0].tokens);
      if (temp == 0.0f) CHECK(res.sequences[size_t(r.n_parallel) - 1].tokens == alone.sequences[0].tokens);
    }
  }
}

TEST_CASE("generate: a prefill in small chunks gives the same text as one pass (f32 path)") {
  require_model();
  const Loaded& m = loaded();
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : kPrompts) prompts.push_back(m.tok.encode(p));
  GenerateParams gp;
  gp.n_predict = 8;
  gp.n_parallel = 1;
  gp.sampling.temp = 0;
  const auto eog = [&](int32_t id) { return m.tok.is_eog(id); };
  const GenerateResult a = generate(loaded_f32(), prompts, gp, eog);
  gp.n_batch = 5;  // chunks that split nodes and straddle parent/child boundaries
  const GenerateResult b = generate(loaded_f32(), prompts, gp, eog);
  for (size_t s = 0; s < prompts.size(); ++s) CHECK(a.sequences[s].tokens == b.sequences[s].tokens);
}

TEST_CASE("generate: on_prefill runs after every prefill pass, and what it throws stops the prefill") {
  require_model();
  const Loaded& m = loaded();
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : kPrompts) prompts.push_back(m.tok.encode(p));
  GenerateParams gp;
  gp.n_predict = 2;
  gp.n_parallel = 1;
  gp.sampling.temp = 0;
  gp.n_batch = 3;
  std::vector<std::pair<int64_t, int64_t>> calls;
  int steps = 0;
  const GenerateResult r = generate(
      m.model, prompts, gp, nullptr, [&](int, const StepStat&) { ++steps; }, {},
      [&](int64_t done, int64_t total) { calls.emplace_back(done, total); });
  const int64_t total = r.n_prompt_stored;
  REQUIRE(calls.size() == size_t((total + 2) / 3));  // one call per pass of at most 3 tokens
  for (size_t i = 0; i < calls.size(); ++i) {
    CHECK(calls[i].second == total);
    CHECK(calls[i].first == std::min(total, int64_t(3 * (i + 1))));
  }
  CHECK(steps >= 1);
  // Thrown from the second pass: generate() leaves there, before any decode step.
  struct Stop {};
  int passes = 0;
  steps = 0;
  CHECK_THROWS_AS(generate(
                      m.model, prompts, gp, nullptr, [&](int, const StepStat&) { ++steps; }, {},
                      [&](int64_t, int64_t) {
                        if (++passes == 2) throw Stop{};
                      }),
                  Stop);
  CHECK(passes == 2);
  CHECK(steps == 0);
}

TEST_CASE("generate: a sequence that fills the context stops there, with a note from the tool") {
  require_model();
  const Loaded& m = loaded();
  const std::vector<int32_t> p = m.tok.encode("Once upon a time");
  GenerateParams gp;
  gp.n_predict = 64;
  gp.n_parallel = 1;
  gp.sampling.temp = 0;
  gp.n_ctx = int64_t(p.size()) + 5;
  const GenerateResult r = generate(m.model, {p}, gp, [&](int32_t id) { return m.tok.is_eog(id); });
  CHECK(r.sequences[0].stop == "context");
  CHECK(r.sequences[0].tokens.size() == 5);  // prompt + generated = the context
  const Run t = run_tool(std::string("-m ") + kModel + " -p 'Once upon a time' -c 9 -n 64 -np 1 --temp 0 -t 2");
  CHECK(t.rc == 0);
  CHECK(t.err.find("note: sequence 0 stopped at the context limit") != std::string::npos);
}

TEST_CASE("generate: the prompt tree shares longest common prefixes") {
  const PromptTree t = make_prompt_tree({{1, 2, 3, 4}, {1, 2, 3, 5, 6}, {1, 2}, {7, 8}, {1, 2, 3, 4}});
  // Nodes: [1 2] root, [3] below it, [4] and [5 6] below that, [7 8] a second root.
  CHECK(t.n_tokens() == 8);
  REQUIRE(t.prompt_node.size() == 5);
  CHECK(t.prompt_node[0] == t.prompt_node[4]);  // equal prompts share every node
  const auto& n2 = t.nodes[t.prompt_node[2]];
  CHECK(n2.tokens == std::vector<int32_t>{1, 2});
  CHECK(n2.parent == -1);
  const auto& n1 = t.nodes[t.prompt_node[1]];
  CHECK(n1.tokens == std::vector<int32_t>{5, 6});
  CHECK(n1.start == 3);
  CHECK(t.nodes[n1.parent].tokens == std::vector<int32_t>{3});
  CHECK(t.nodes[t.prompt_node[3]].parent == -1);
  for (size_t i = 0; i < t.nodes.size(); ++i) CHECK(t.nodes[i].parent < int(i));
  CHECK_THROWS_AS(make_prompt_tree({{1}, {}}), Error);
}

TEST_CASE("generate: a chat prompt gives coherent English") {
  require_model();
  const Run r = run_tool(std::string("-m ") + kModel +
                         " --chat -p 'What is the capital of France? Answer in one sentence.' --temp 0 -n 40 -np 1 -t 2");
  INFO(r.err);
  REQUIRE(r.rc == 0);
  INFO(r.out);
  CHECK(r.out.find("Paris") != std::string::npos);
  int words = 0;
  for (const char* w : {" the ", " is ", " of ", "The "}) words += r.out.find(w) != std::string::npos;
  CHECK(words >= 2);
  for (char c : r.out) CHECK(((c >= 0x20 && c < 0x7f) || c == '\n'));
  CHECK(r.err.find("prompt eval time =") != std::string::npos);
}

// --attn cascade: auto's plan comes from a calibration timed at start, and two plans sum attention in different
// orders (see Loaded), so with auto a seed reproduces the text given the same --cost-model profile.
TEST_CASE("generate: --seed reproduces the text, other seeds give other text, --json is well formed") {
  require_model();
  const std::string base =
      std::string("-m ") + kModel + " -p 'My favourite animal is' --temp 1 -n 16 -np 2 -t 2 --attn cascade --json";
  const Run a = run_tool(base + " -s 123"), b = run_tool(base + " -s 123"), c = run_tool(base + " -s 124");
  REQUIRE(a.rc == 0);
  REQUIRE(b.rc == 0);
  REQUIRE(c.rc == 0);
  const auto texts = [](const std::string& json) { return json.substr(json.find("\"sequences\"")); };
  CHECK(texts(a.out) == texts(b.out));
  CHECK(texts(a.out) != texts(c.out));
  for (const char* key : {"\"sequences\":[", "\"text\":", "\"tokens\":[", "\"step_ms\":[", "\"prompt_ms\":",
                          "\"decode_tokens_per_s\":", "\"attn\":\"cascade\"", "\"attn_share\":", "\"n_prompt_tokens\":",
                          "\"linear_path\":\"", "\"linear_products\":\"", "\"model_bytes\":", "\"rss_after_load_bytes\":"})
    CHECK_MESSAGE(a.out.find(key) != std::string::npos, key);
  // The attention kernels it names are those its plans choose here: SmolLM2's heads of 64 on f16 K/V.
  namespace cpu = cascade::cpu;
  const cascade::Target t = cpu::target(1, 64);
  const std::string kernels = "\"attention_kernels\":\"shared: " + cpu::kernel_name(t, cpu::kTiledKernel, DType::f16) +
                              "; per-sequence: " + cpu::kernel_name(t, cpu::kFewRowsKernel, DType::f16) + "\"";
  CHECK_MESSAGE(a.out.find(kernels) != std::string::npos, kernels);
  CHECK(count_lines(a.out) == 1);
  CHECK(a.out.back() == '\n');
  // The weights stay as the file stores them: the model holds about the file's bytes, and the process after
  // loading is not much more (no f32 copy, no second copy of the blocks).
  const auto number = [&](const std::string& key) {
    const size_t at = a.out.find("\"" + key + "\":");
    REQUIRE(at != std::string::npos);
    return std::strtod(a.out.c_str() + at + key.size() + 3, nullptr);
  };
  const double gguf_bytes = number("gguf_bytes"), model_bytes = number("model_bytes");
  CHECK(model_bytes <= gguf_bytes);
  CHECK(model_bytes >= 0.95 * gguf_bytes);
  CHECK(number("rss_after_load_bytes") >= model_bytes);
#if !defined(__SANITIZE_ADDRESS__)  // AddressSanitizer's shadow memory and quarantine add their own
  CHECK(number("rss_after_load_bytes") <= 1.4 * gguf_bytes);
#endif
  CHECK(a.err.find(std::string("linear layers ") + linear::path_name(linear::active_path()) + " (products " +
                   linear::products_name(linear::active_path()) + ")") != std::string::npos);
}

TEST_CASE("generate: --json escapes bytes that are not valid UTF-8 as \\ufffd") {
  require_model();
  // Greedy after a run of emojis: the first token is the first bytes of an emoji, an incomplete character.
  const std::string smile = "\xF0\x9F\x99\x82";  // U+1F642
  const Run r = run_tool(std::string("-m ") + kModel + " -p 'I love emojis: " + smile + smile + smile + smile + smile + smile + "'" +
                         " --temp 0 -n 1 -np 1 -t 2 --json");
  REQUIRE(r.rc == 0);
  INFO(r.out);
  CHECK(r.out.find("\"text\":\"\\ufffd\\ufffd\"") != std::string::npos);
  int non_ascii = 0;
  for (unsigned char c : r.out) non_ascii += c >= 0x80;
  CHECK(non_ascii == 0);  // nothing but ASCII and escapes in this output
}

TEST_CASE("generate: bad input gives one error line, nothing on stdout, exit code 1") {
  require_model();
  const std::string m = std::string("-m ") + kModel + " ";
  const std::string long_prompt(2000, 'a');
  const std::vector<std::string> cases = {
      "--bogus",
      "-n",
      "-n -5",
      "-n abc",
      "--temp -1",
      "--top-p 2",
      "--min-p 1.5",
      "-np 0",
      "-t 0",
      "-b 0",
      "-c -1",
      "--attn flash",
      "-p ''",
      "-f /nonexistent/prompts.txt",
      "-m /nonexistent/model.gguf",
      "-s x",
      m + "-c 8 -p 'This prompt is certainly longer than eight tokens, by a wide margin.'",
      "-p a -f b",
      "--cost-model",
      "--cost-model ''",
      "--stream --json",
      "--attn split --recalibrate",
  };
  for (const std::string& args : cases) {
    CAPTURE(args);
    const Run r = run_tool(args);
    INFO(r.err);
    CHECK(r.rc != 0);
    CHECK(r.rc < 128);
    CHECK(r.out.empty());
    CHECK(count_lines(r.err) == 1);
    CHECK(r.err.rfind("cascade-generate: error: ", 0) == 0);
  }
}

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Writes bytes to a fresh file under the build folder and returns its path.
std::string write_temp(const std::string& name, const std::string& bytes) {
  const std::string path = std::string(CASCADE_BINARY_DIR "/tests/") + std::to_string(getpid()) + "_" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// The real model with the first occurrence of `from` after `anchor` replaced by `to` (same length).
std::string patched_model(const std::string& anchor, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  std::string bytes = read_bytes(kModel);
  const size_t a = bytes.find(anchor);
  REQUIRE(a != std::string::npos);
  const size_t at = bytes.find(from, a + anchor.size());
  REQUIRE(at != std::string::npos);
  bytes.replace(at, from.size(), to);
  return bytes;
}

// The real model with its chat template's ChatML markers renamed, so the template is of no known format.
std::string unknown_template_model() {
  std::string bytes = read_bytes(kModel);
  const std::string key = "tokenizer.chat_template";
  const size_t k = bytes.find(key);
  REQUIRE(k != std::string::npos);
  uint64_t len = 0;  // the value: u32 type (string), u64 length, bytes
  std::memcpy(&len, bytes.data() + k + key.size() + 4, 8);
  const size_t begin = k + key.size() + 12;
  REQUIRE(begin + len <= bytes.size());
  for (size_t at = bytes.find("im_start", begin); at != std::string::npos && at < begin + len;
       at = bytes.find("im_start", at + 1))
    bytes.replace(at, 8, "im_stxrt");
  return bytes;
}

}  // namespace

TEST_CASE("generate: bad files and bad prompts give one error line naming the problem") {
  require_model();
  const std::string p = " -p 'Hello' -n 4 -np 1 ";
  std::string norm_type;  // blk.0.attn_norm.weight's tensor info: n_dims 1, ne0, then type F32 (0) -> I32 (26)
  {
    const std::string name = "blk.0.attn_norm.weight";
    std::string bytes = read_bytes(kModel);
    const size_t at = bytes.find(name);
    REQUIRE(at != std::string::npos);
    const size_t type_at = at + name.size() + 4 + 8;
    REQUIRE(bytes[type_at] == 0);
    bytes[type_at] = 26;
    norm_type = write_temp("i32_norm.gguf", bytes);
  }
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"-m " CASCADE_BINARY_DIR + p, "not a regular file"},
      {"-m " + write_temp("truncated.gguf", read_bytes(kModel).substr(0, 5000)) + p, "gguf file"},
      {"-m " + write_temp("text.gguf", "this is not a model\n") + p, "magic"},
      {"-m " + norm_type + p, "type i32"},
      {"-m " + write_temp("arch.gguf", patched_model("general.architecture", "llama", "llamb")) + p, "llamb"},
      {"-m " + write_temp("chat.gguf", unknown_template_model()) +
           " --chat" + p,
       "template"},
      {std::string("-m ") + kModel + " -p \"$(printf 'caf\\303 au lait')\" -n 4", "UTF-8"},
      {std::string("-m ") + kModel + " -p 'Hello' -np 4096 -n 8000 -c 8192", "K/V cache would need"},
      {"-m " + std::string(kModel) + p + "--cost-model " + write_temp("cost.txt", "read_bw 1e9\n"),
       "cost model profile"},
      {"-m " + std::string(kModel) + p + "--cost-model " + write_temp("cost2.txt", "cascade-cost-model 1\nread_bw -3\n"),
       "read_bw"},
      {"-m " + std::string(kModel) + p + "--cost-model " CASCADE_BINARY_DIR, "not a file"},
      {"-m " + std::string(kModel) + p + "--kv-type q8_0 --cost-model " +
           write_temp("cost3.txt", "cascade-cost-model 1\nkv_type f16\n"),
       "calibrated for --kv-type f16, not q8_0"},
      {"-m " + std::string(kModel) + p + "--cost-model /nonexistent/dir/cost.txt", "cannot write"},
      {"-m " + std::string(kModel) + p + "--attn cascade --cost-model x.txt", "--attn auto"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.args);
    const Run r = run_tool(c.args);
    INFO(r.err);
    CHECK(r.rc != 0);
    CHECK(r.rc < 128);
    CHECK(r.out.empty());
    CHECK(count_lines(r.err) == 1);
    CHECK(r.err.find(c.needle) != std::string::npos);
  }
  for (const char* name : {"i32_norm.gguf", "truncated.gguf", "text.gguf", "arch.gguf", "chat.gguf", "cost.txt",
                           "cost2.txt", "cost3.txt"})
    std::remove((std::string(CASCADE_BINARY_DIR "/tests/") + std::to_string(getpid()) + "_" + name).c_str());
}

TEST_CASE("generate: --cost-model writes the calibrated profile once and reads it on later runs") {
  require_model();
  const std::string path = std::string(CASCADE_BINARY_DIR "/tests/") + std::to_string(getpid()) + "_profile.txt";
  std::remove(path.c_str());
  const std::string args = std::string("-m ") + kModel + " -p 'The best way to learn a language is' --temp 0 -n 12 -np 3 -t 2 --cost-model " + path;
  const Run first = run_tool(args);
  REQUIRE(first.rc == 0);
  CHECK(first.err.find("written to") != std::string::npos);
  const CostModel m = CostModel::load(path);
  CHECK(m.n_kv_heads == 3);  // calibrated with the model's own head shape
  CHECK(m.head_dim == 64);
  const Run second = run_tool(args);
  REQUIRE(second.rc == 0);
  CHECK(second.err.find("written to") == std::string::npos);
  CHECK(second.out == first.out);
  // A profile that makes every shared pass look dear folds every span; greedy text stays the same.
  CostModel dear = m;
  dear.tiled_item_s = 1.0;
  dear.item_s = 1e-9;
  dear.read_bw = 1e15;
  dear.save(path);
  const Run third = run_tool(args);
  REQUIRE(third.rc == 0);
  CHECK(third.out == first.out);
  std::remove(path.c_str());
}

TEST_CASE("generate: on_token gives every sequence's tokens in order, and each step its K/V bytes") {
  require_model();
  const Loaded& m = loaded();
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : kPrompts) prompts.push_back(m.tok.encode(p));
  GenerateParams gp;
  gp.n_predict = 12;
  gp.n_parallel = 2;
  gp.sampling.temp = 1.0f;
  gp.sampling.seed = 5;
  for (AttnMethod method : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified}) {
    CAPTURE(attn_method_name(method));
    gp.attn = method;
    std::vector<std::vector<int32_t>> seen(prompts.size() * 2);
    std::vector<size_t> step_bytes;
    const GenerateResult r = generate(
        m.model, prompts, gp, [&](int32_t id) { return m.tok.is_eog(id); },
        [&](int, const StepStat& st) { step_bytes.push_back(st.kv_bytes); },
        [&](int s, int32_t id) {
          REQUIRE(s >= 0);
          REQUIRE(size_t(s) < seen.size());
          seen[size_t(s)].push_back(id);
        });
    for (size_t s = 0; s < seen.size(); ++s) CHECK(seen[s] == r.sequences[s].tokens);
    REQUIRE(!step_bytes.empty());
    CHECK(step_bytes.back() == r.kv_bytes);
    for (size_t i = 1; i < step_bytes.size(); ++i) CHECK(step_bytes[i] > step_bytes[i - 1]);  // one token more each
  }
}

namespace {

// The hardware threads this process may use, from the kernel (the reference for the tool's cap).
int affinity_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  return CPU_COUNT(&set);
}

// What f writes to this process's stderr (fd 2, where oneTBB writes its warnings).
template <class F>
std::string stderr_of(F&& f) {
  const std::string path = tool_run::temp_path("stderr");
  std::fflush(stderr);
  const int saved = dup(2);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(saved >= 0);
  REQUIRE(fd >= 0);
  dup2(fd, 2);
  close(fd);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  const std::string text = read_file(path);
  std::remove(path.c_str());
  return text;
}

}  // namespace

TEST_CASE("generate: -t above the hardware threads is capped with one note of ours, no oneTBB warning") {
  require_model();
  const int hw = affinity_threads();
  const std::string base = std::string("-m ") + kModel + " -p 'Tell me a story' --temp 0 -n 6 -np 2 --json ";
  for (const int t : {hw + 1, 1000, 4096}) {
    CAPTURE(t);
    const Run r = run_tool(base + "-t " + std::to_string(t));
    INFO(r.err);
    REQUIRE(r.rc == 0);
    CHECK(count_lines(r.err.substr(0, r.err.find("cascade-generate: 1 prompt"))) == 1);  // the note, alone
    CHECK(r.err.find("cascade-generate: note: -t " + std::to_string(t) + " is more than the " + std::to_string(hw) +
                     " hardware threads this process may use; using " + std::to_string(hw) + "\n") == 0);
    CHECK(r.err.find(", " + std::to_string(hw) + " threads") != std::string::npos);  // the startup line
    CHECK(r.out.find("\"n_threads\":" + std::to_string(hw) + ",") != std::string::npos);
    CHECK(r.err.find("TBB") == std::string::npos);
    CHECK(r.err.find("note:") == r.err.rfind("note:"));  // one note
  }
  for (const int t : {1, hw}) {
    const Run r = run_tool(base + "-t " + std::to_string(t));
    REQUIRE(r.rc == 0);
    CHECK(r.err.find("note:") == std::string::npos);
    CHECK(r.out.find("\"n_threads\":" + std::to_string(t) + ",") != std::string::npos);
  }
  // The library caps too: generate() with more threads than the machine prints nothing (oneTBB included).
  const Loaded& m = loaded();
  GenerateParams gp;
  gp.n_predict = 4;
  gp.n_parallel = 2;
  gp.n_threads = 1000;
  gp.attn = AttnMethod::cascade;
  GenerateResult r;
  const std::string err = stderr_of([&] { r = generate(m.model, {m.tok.encode("Hello")}, gp, nullptr); });
  CHECK(err.empty());
  CHECK(r.sequences.size() == 2);
}

// cascade-perplexity on the real model over the start of bench/coriolanus.txt, on the default (int8) linear path: a
// perplexity that says something, a saved run read back (its KL divergence from itself nothing but the rounding of
// the saved log-probabilities), q8_0 K/V measurably but slightly apart from it (every token's top choice nearly
// always kept), and bad input as one error line. Its definition is checked in test_llama.cpp. 1,200 characters in
// windows of 64 tokens: under ASan the tool's three runs take about a minute (with 3,000 characters, windows of
// 128 and f32 linear layers they took 11).
TEST_CASE("perplexity tool: a run, a saved run and the KL divergence from it, bad input") {
  require_model();
  const std::string tool = CASCADE_BINARY_DIR "/tools/cascade-perplexity";
  const std::string text = tool_run::temp_path("ppl_text"), saved = tool_run::temp_path("ppl_saved");
  {
    std::ofstream out(text, std::ios::binary);
    out << read_file(CASCADE_SOURCE_DIR "/bench/coriolanus.txt").substr(0, 800);  // 3 windows of 64 tokens
  }
  const std::string base = std::string("-m ") + kModel + " -f " + text + " -c 64 -t 2 ";
  const Run f32 = tool_run::run(tool, base + "--kv-type f32 --save-logits " + saved);
  INFO(f32.err);
  REQUIRE(f32.rc == 0);
  double ppl = 0;
  REQUIRE(std::sscanf(f32.out.c_str(), "perplexity: %lf", &ppl) == 1);
  CHECK(ppl > 2.0);
  CHECK(ppl < 1000.0);
  CHECK(count_lines(f32.err) >= 3);  // a progress line per window
  for (const char* t : {"f32", "q8_0"}) {
    CAPTURE(t);
    const Run r = tool_run::run(tool, base + "--kv-type " + t + " --kl-divergence " + saved);
    INFO(r.err);
    REQUIRE(r.rc == 0);
    double p = 0, kl = -1, top1 = 0;
    REQUIRE(std::sscanf(r.out.c_str(), "perplexity: %lf", &p) == 1);
    const size_t at = r.out.find("KL divergence: mean ");
    REQUIRE(at != std::string::npos);
    REQUIRE(std::sscanf(r.out.c_str() + at, "KL divergence: mean %lf, top-1 agreement %lf", &kl, &top1) == 2);
    if (std::string(t) == "f32") {  // the same run: the same perplexity, and the saved rounding only
      CHECK(p == ppl);
      CHECK(std::fabs(kl) < 1e-4);
      CHECK(top1 > 98.0);
    } else {
      CHECK(std::fabs(p - ppl) < 0.05 * ppl);
      CHECK((kl > 1e-4 && kl < 0.05));
      CHECK(top1 > 90.0);
    }
  }
  const std::string m = std::string("-m ") + kModel + " ";
  const std::string mf = m + "-f " + text + " ";
  for (const std::string& args : {mf + "--bogus", m + "-f /nonexistent/text.txt", mf + "-c 4096", mf + "-c 7",
                                  mf + "--kv-type q4_0", mf + "-c 32 --kl-divergence " + saved,
                                  mf + "--kl-divergence " + text, "-f " + text}) {
    CAPTURE(args);
    const Run r = tool_run::run(tool, args);
    INFO(r.err);
    CHECK(r.rc == 1);
    CHECK(r.out.empty());
    CHECK(count_lines(r.err) == 1);
    CHECK(r.err.rfind("cascade-perplexity: error: ", 0) == 0);
  }
  std::remove(text.c_str());
  std::remove(saved.c_str());
}

}  // namespace test_generate
