// Tokenizer conformance: llama.cpp's vectors for GPT-2 BPE and Llama SentencePiece, the real SmolLM2 vocab,
// hostile input, and vocabulary validation.
#include <doctest/doctest.h>
#include <utf8proc.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

using cascade::Tokenizer;
using cascade::TokenType;
using cascade::Vocab;

namespace {

const std::string kVectors = CASCADE_SHARED_DIR "/testdata/tokenizer/";
const std::string kModel = CASCADE_MODEL_PATH;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Strict UTF-8 check (no overlong forms, surrogates or values above U+10FFFF).
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = utf8proc_ssize_t(s.size());
  while (left > 0) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0) return false;
    p += n;
    left -= n;
  }
  return true;
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
};

// NAME.inp holds the strings, each followed by "\n__ggml_vocab_test__\n"; NAME.out one line of ids per string.
std::vector<Case> read_cases(const std::string& vocab_path) {
  const std::string inp = read_file(vocab_path + ".inp");
  const std::string out = read_file(vocab_path + ".out");
  REQUIRE_MESSAGE(!inp.empty(), "missing or empty ", vocab_path, ".inp");
  REQUIRE_MESSAGE(!out.empty(), "missing or empty ", vocab_path, ".out");
  std::vector<std::string> texts;
  const std::string sep = "\n__ggml_vocab_test__\n";
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      texts.push_back(inp.substr(pos));
      break;
    }
    texts.push_back(inp.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::vector<Case> cases;
  std::istringstream lines(out);
  std::string line;
  for (size_t i = 0; std::getline(lines, line); ++i) {
    REQUIRE_MESSAGE(i < texts.size(), vocab_path, ".out has more lines than .inp has strings");
    Case c{texts[i], {}};
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  REQUIRE_MESSAGE(cases.size() == texts.size(), vocab_path, ": ", texts.size(), " strings but ", cases.size(),
                  " id lines");
  return cases;
}

Tokenizer load(const std::string& path) {
  REQUIRE_MESSAGE(std::filesystem::exists(path), "missing file ", path,
                  " (tokenizer vectors: the shared testdata folder; the model: run scripts/setup.sh)");
  return Tokenizer(cascade::load_vocab(cascade::gguf::File::open(path)));
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

void run_vectors(const std::string& name) {
  const std::string path = kVectors + name;
  const Tokenizer tok = load(path);
  const std::vector<Case> cases = read_cases(path);
  size_t n_pass = 0, n_round = 0, n_round_checked = 0;
  for (const Case& c : cases) {
    const std::vector<int32_t> got = tok.encode(c.text, /*add_special=*/false, /*parse_special=*/false);
    CHECK_MESSAGE(got == c.ids, "text '", c.text, "': got ", show(got), "expected ", show(c.ids));
    n_pass += got == c.ids;
    // Decoding gives back the exact bytes. For a string that is not valid UTF-8 the two vocabularies
    // differ: SentencePiece byte-falls back the raw bytes (so it round-trips too), byte-level BPE encodes
    // each invalid byte as U+FFFD (so decoding yields EF BF BD where the bad byte was); only valid strings
    // are checked for BPE.
    if (valid_utf8(c.text) || tok.vocab().model == "llama") {
      ++n_round_checked;
      const std::string back = tok.decode(c.ids);
      CHECK_MESSAGE(back == c.text, "decode of the ids of '", c.text, "' gave '", back, "'");
      n_round += back == c.text;
    }
  }
  MESSAGE(name, ": ", n_pass, "/", cases.size(), " vectors encode exactly, ", n_round, "/", n_round_checked,
          " decode back");
}

}  // namespace

TEST_CASE("gpt-2 byte-level BPE reproduces llama.cpp's vectors") { run_vectors("ggml-vocab-gpt-2.gguf"); }

TEST_CASE("llama SentencePiece BPE reproduces llama.cpp's vectors") { run_vectors("ggml-vocab-llama-spm.gguf"); }
