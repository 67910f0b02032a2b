// A real Gemma 3 model against llama.cpp: Gemma 3 270M in Q4_K_M (scripts/setup.sh --models fetches it; the cases
// are skipped without it). tests/data/gemma3 holds five prompts and, for each, llama.cpp's token ids, its greedy
// continuation of 32 tokens and the margin of its choice over the next largest logit at every step
// (scripts/greedy-oracle.sh; VERSION names the llama.cpp). Two of the prompts are longer than the model's sliding
// window (512), so its windowed layers drop keys the global layers keep; one of those two asks the model to repeat
// a sentence from beyond the window.
//
// Both sides compute in f32 from the same weights but round activations differently before each product
// (test_oracle.cpp's header): the logits differ by a few hundredths, so where llama.cpp's top two logits are
// closer than 0.3 either token may be chosen and the continuations may part from there. Up to the first such step
// the tokens must be the same, on every prompt.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace test_gemma3 {

using namespace cascade;

namespace {

const std::string kModel = CASCADE_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
const std::string kData = std::string(CASCADE_TESTDATA_DIR) + "/gemma3/";
constexpr float kNearTie = 0.3f;  // llama.cpp's top-2 margin below which the choice may go either way

struct Expected {
  std::string text;
  std::vector<int32_t> ids, greedy;
  std::vector<float> margin;
};

// prompts.txt: a prompt a line, `\n` a newline and `\\` a backslash.
std::vector<std::string> read_prompts() {
  std::ifstream in(kData + "prompts.txt", std::ios::binary);
  REQUIRE_MESSAGE(bool(in), "no " << kData << "prompts.txt");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    std::string p;
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '\\') {
        REQUIRE(i + 1 < line.size());
        p += line[++i] == 'n' ? '\n' : '\\';
      } else {
        p += line[i];
      }
    }
    prompts.push_back(p);
  }
  return prompts;
}

// The .greedy file: `prompt P ids N ID...`, `prompt P greedy ID...`, `prompt P margin M...` (oracle-greedy.cpp).
std::vector<Expected> read_expected() {
  const std::vector<std::string> prompts = read_prompts();
  std::ifstream in(kData + "gemma-3-270m-q4_k_m.greedy");
  REQUIRE_MESSAGE(bool(in), "no " << kData << "gemma-3-270m-q4_k_m.greedy (scripts/greedy-oracle.sh makes it)");
  std::vector<Expected> e(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) e[p].text = prompts[p];
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    std::string word, what;
    size_t p = 0;
    ss >> word >> p >> what;
    REQUIRE_MESSAGE((word == "prompt" && p < e.size()), "bad line: " << line);
    if (what == "ids") {
      size_t n = 0;
      ss >> n;
      for (int32_t t; ss >> t;) e[p].ids.push_back(t);
      REQUIRE(e[p].ids.size() == n);
    } else if (what == "greedy") {
      for (int32_t t; ss >> t;) e[p].greedy.push_back(t);
    } else {
      REQUIRE(what == "margin");
      for (float m; ss >> m;) e[p].margin.push_back(m);
    }
  }
  for (const Expected& x : e) REQUIRE((!x.ids.empty() && x.greedy.size() == 32 && x.margin.size() == 32));
  return e;
}

// Steps before llama.cpp's first near-tie: the tokens both sides must choose alike.
size_t agreed_steps(const Expected& e) {
  size_t k = 0;
  while (k < e.margin.size() && e.margin[k] >= kNearTie) ++k;
  return k;
}

}  // namespace

TEST_CASE("gemma3 270M: the tokenizer gives llama.cpp's ids, and greedy continuations agree up to its near-ties") {
  if (!std::filesystem::exists(kModel)) {
    MESSAGE(kModel, " (scripts/setup.sh --models fetches it) is not present: skipped");
    return;
  }
  const std::vector<Expected> expected = read_expected();
  const auto file = std::make_shared<const gguf::File>(gguf::File::open(kModel));
  const Tokenizer tok(load_vocab(*file));
  const llama::Model model = llama::Model::load(file);
  const llama::Hparams& hp = model.hparams();
  REQUIRE(hp.arch == llama::Arch::gemma3);
  REQUIRE(hp.n_swa == 512);

  std::vector<std::vector<int32_t>> prompts;
  size_t n_long = 0;
  for (const Expected& e : expected) {
    prompts.push_back(tok.encode(e.text));
    CHECK_MESSAGE(prompts.back() == e.ids, "prompt: " << e.text.substr(0, 60));
    n_long += int64_t(e.ids.size()) > hp.n_swa;
  }
  CHECK(n_long >= 2);

  GenerateParams gp;
  gp.n_predict = 32;
  gp.n_parallel = 1;
  gp.n_ctx = 2048;
  gp.n_threads = 2;
  gp.attn = AttnMethod::cascade;
  gp.sampling.temp = 0;
  const GenerateResult r = generate(model, prompts, gp, [](int32_t) { return false; });
  REQUIRE(r.sequences.size() == expected.size());
  size_t n_compared = 0;
  for (size_t p = 0; p < expected.size(); ++p) {
    const Expected& e = expected[p];
    const std::vector<int32_t>& got = r.sequences[p].tokens;
    const size_t k = agreed_steps(e);
    CAPTURE(p);
    CAPTURE(tok.decode(got));
    CAPTURE(tok.decode(e.greedy));
    REQUIRE(got.size() == 32);
    for (size_t i = 0; i < k; ++i) {
      CAPTURE(i);
      CAPTURE(e.margin[i]);
      REQUIRE(got[i] == e.greedy[i]);
    }
    n_compared += k;
  }
  MESSAGE(n_compared, " of ", 32 * expected.size(), " tokens before llama.cpp's first near-tie on each prompt: equal");
  CHECK(n_compared >= 100);  // the prompts were chosen for long stretches of clear choices
}

}  // namespace test_gemma3
