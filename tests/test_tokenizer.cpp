// Tokenizer conformance: llama.cpp's vectors for GPT-2 BPE and Llama SentencePiece, the real SmolLM2 vocab,
// hostile input, and vocabulary validation.
#include <doctest/doctest.h>
#include <utf8proc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace test_tokenizer {

using cascade::Tokenizer;
using cascade::TokenType;
using cascade::Vocab;

namespace {

const std::string kVectors = CASCADE_TESTDATA_DIR "/tokenizer/";
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

// INP holds the strings, each followed by "\n__ggml_vocab_test__\n"; OUT one line of ids per string.
std::vector<Case> read_cases(const std::string& inp_path, const std::string& out_path) {
  const std::string inp = read_file(inp_path);
  const std::string out = read_file(out_path);
  REQUIRE_MESSAGE(!inp.empty(), "missing or empty ", inp_path);
  REQUIRE_MESSAGE(!out.empty(), "missing or empty ", out_path);
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
    REQUIRE_MESSAGE(i < texts.size(), out_path, " has more lines than ", inp_path, " has strings");
    Case c{texts[i], {}};
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  REQUIRE_MESSAGE(cases.size() == texts.size(), inp_path, ": ", texts.size(), " strings but ", cases.size(),
                  " id lines");
  return cases;
}

// llama.cpp's own files: NAME.inp and NAME.out beside the vocabulary NAME.
std::vector<Case> read_cases(const std::string& vocab_path) {
  return read_cases(vocab_path + ".inp", vocab_path + ".out");
}

Tokenizer load(const std::string& path) {
  REQUIRE_MESSAGE(std::filesystem::exists(path), "missing file ", path,
                  " (tokenizer vectors: tests/data/tokenizer; the model: run scripts/setup.sh)");
  return Tokenizer(cascade::load_vocab(cascade::gguf::File::open(path)));
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// Checks that encode gives llama.cpp's ids for every case: with special, BOS/EOS as the vocabulary asks and
// special tokens parsed; without, neither (llama.cpp's own test). With check_decode, the ids also decode back to
// the exact text. For a string that is not valid UTF-8 the two kinds of vocabulary differ: SentencePiece
// byte-falls back the raw bytes (so it round-trips too), byte-level BPE encodes each invalid byte as U+FFFD (so
// decoding yields EF BF BD where the bad byte was); only valid strings are decoded for BPE.
void check_cases(const Tokenizer& tok, const std::vector<Case>& cases, const std::string& label, bool special,
                 bool check_decode) {
  size_t n_pass = 0, n_round = 0, n_round_checked = 0;
  for (const Case& c : cases) {
    const std::vector<int32_t> got = tok.encode(c.text, special, special);
    CHECK_MESSAGE(got == c.ids, label, ": text '", c.text, "': got ", show(got), "expected ", show(c.ids));
    n_pass += got == c.ids;
    if (check_decode && (valid_utf8(c.text) || tok.vocab().model == "llama")) {
      ++n_round_checked;
      const std::string back = tok.decode(c.ids);
      CHECK_MESSAGE(back == c.text, label, ": decode of the ids of '", c.text, "' gave '", back, "'");
      n_round += back == c.text;
    }
  }
  MESSAGE(label, ": ", n_pass, "/", cases.size(), " vectors encode exactly, ", n_round, "/", n_round_checked,
          " decode back");
}

// llama.cpp's vectors for a vocabulary kept in tests/data/tokenizer.
void run_vectors(const std::string& name) {
  const std::string path = kVectors + name;
  check_cases(load(path), read_cases(path), name, /*special=*/false, /*check_decode=*/true);
}

// extra.inp (whitespace, digits, emoji, CJK, the chat formats' special tokens) against the ids llama.cpp gave
// for it (scripts/tokenizer-vectors.sh): NAME.extra.out plain, NAME.extra-special.out with specials.
void run_extra(const Tokenizer& tok, const std::string& name) {
  check_cases(tok, read_cases(kVectors + "extra.inp", kVectors + name + ".extra.out"), name + " extra",
              /*special=*/false, /*check_decode=*/true);
  check_cases(tok, read_cases(kVectors + "extra.inp", kVectors + name + ".extra-special.out"),
              name + " extra, specials", /*special=*/true, /*check_decode=*/false);
}

// Where llama.cpp's source (bench/llama-cpp.sh fetches it) keeps its test vocabularies; empty if absent.
std::string llama_cpp_models() {
  std::vector<std::string> dirs;
  if (const char* src = std::getenv("CASCADE_LLAMA_CPP_SRC")) dirs.push_back(std::string(src) + "/models");
  std::string cache;
  if (const char* c = std::getenv("CASCADE_LLAMA_CPP_CACHE")) {
    cache = c;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME")) {
    cache = std::string(x) + "/cascade-llama-cpp";
  } else if (const char* h = std::getenv("HOME")) {
    cache = std::string(h) + "/.cache/cascade-llama-cpp";
  }
  if (!cache.empty()) dirs.push_back(cache + "/llama_cpp_python-0.3.36/vendor/llama.cpp/models");
  for (const std::string& d : dirs) {
    if (std::filesystem::exists(d + "/ggml-vocab-llama-bpe.gguf")) return d;
  }
  return {};
}

}  // namespace

TEST_CASE("tokenizer: gpt-2 byte-level BPE reproduces llama.cpp's vectors") {
  run_vectors("ggml-vocab-gpt-2.gguf");
  run_extra(load(kVectors + "ggml-vocab-gpt-2.gguf"), "ggml-vocab-gpt-2.gguf");
}

TEST_CASE("tokenizer: llama SentencePiece BPE reproduces llama.cpp's vectors") {
  run_vectors("ggml-vocab-llama-spm.gguf");
  run_extra(load(kVectors + "ggml-vocab-llama-spm.gguf"), "ggml-vocab-llama-spm.gguf");
}

TEST_CASE("tokenizer: Qwen 2 (pre-tokenizer qwen2) reproduces llama.cpp's vectors") {
  run_vectors("ggml-vocab-qwen2.gguf");
  const Tokenizer tok = load(kVectors + "ggml-vocab-qwen2.gguf");
  run_extra(tok, "ggml-vocab-qwen2.gguf");
  CHECK(tok.vocab().pre == "qwen2");
  CHECK_FALSE(tok.vocab().add_bos);
  // <|endoftext|> (EOS) and <|im_end|> end generation; so does the ordinary token </s> (128247), as in llama.cpp.
  for (int32_t id : {151643, 151645, 128247}) CHECK_MESSAGE(tok.is_eog(id), id);
  CHECK_FALSE(tok.is_eog(151644));  // <|im_start|>
  CHECK(tok.token_type(128247) == TokenType::control);
  // Digits one by one (Llama 3 takes up to three).
  CHECK(tok.encode("2024", false, false).size() == 4);
}

TEST_CASE("tokenizer: Phi-3 (SentencePiece) reproduces llama.cpp's vectors") {
  run_vectors("ggml-vocab-phi-3.gguf");
  const Tokenizer tok = load(kVectors + "ggml-vocab-phi-3.gguf");
  run_extra(tok, "ggml-vocab-phi-3.gguf");
  CHECK(tok.vocab().add_bos);
  CHECK(tok.vocab().add_space_prefix);
  for (int32_t id : {32000, 32007, 2}) CHECK_MESSAGE(tok.is_eog(id), id);  // <|endoftext|>, <|end|>, </s>
  CHECK_FALSE(tok.is_eog(32001));                                            // <|assistant|>
  // Its special tokens swallow the whitespace after them (general.name "Phi3"), <|endoftext|> does not.
  const int32_t user = tok.token_id("<|user|>"), end = tok.token_id("<|end|>"), eot = tok.token_id("<|endoftext|>");
  CHECK(tok.encode("<|user|>\n \tHi<|end|>\n", false, true) == tok.encode("<|user|>Hi<|end|>", false, true));
  CHECK(tok.encode("<|user|>\n", false, true) == std::vector<int32_t>{user});
  CHECK(tok.encode("<|endoftext|> x", false, true).front() == eot);
  CHECK(tok.encode("<|endoftext|> x", false, true) != tok.encode("<|endoftext|>x", false, true));
  CHECK(tok.encode("a<|end|>", false, true).back() == end);
}

TEST_CASE("tokenizer: Llama 3 (pre-tokenizer llama-bpe) reproduces llama.cpp's vectors") {
  // The vocabulary (7.8 MB) is not kept here: it is read from llama.cpp's source when bench/llama-cpp.sh
  // has fetched it.
  const std::string dir = llama_cpp_models();
  if (dir.empty()) {
    MESSAGE("ggml-vocab-llama-bpe.gguf (llama.cpp's source: bench/llama-cpp.sh --build-only fetches it) is not "
            "present: skipped");
    return;
  }
  const std::string path = dir + "/ggml-vocab-llama-bpe.gguf";
  const Tokenizer tok = load(path);
  check_cases(tok, read_cases(path), "ggml-vocab-llama-bpe.gguf", /*special=*/false, /*check_decode=*/true);
  run_extra(tok, "ggml-vocab-llama-bpe.gguf");
  for (int32_t id : {128001, 128009}) CHECK_MESSAGE(tok.is_eog(id), id);  // <|end_of_text|>, <|eot_id|>
}

TEST_CASE("tokenizer: Gemma 3 (SentencePiece, no space prefix) reproduces llama.cpp") {
  const std::string model = CASCADE_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
  if (!std::filesystem::exists(model)) {
    MESSAGE(model, " (scripts/setup.sh --models fetches it) is not present: skipped");
    return;
  }
  const Tokenizer tok = load(model);
  const std::string name = "gemma-3-270m-q4_k_m.gguf";
  check_cases(tok, read_cases(kVectors + name), name, /*special=*/false, /*check_decode=*/true);
  run_extra(tok, name);
  CHECK(tok.n_vocab() == 262144);
  CHECK(tok.vocab().model == "llama");
  CHECK_FALSE(tok.vocab().add_space_prefix);
  CHECK(tok.vocab().add_bos);
  CHECK(tok.vocab().bos_id == 2);
  for (int32_t id : {1, 106}) CHECK_MESSAGE(tok.is_eog(id), id);  // <eos>, <end_of_turn>
  CHECK_FALSE(tok.is_eog(105));                                   // <start_of_turn>
  // Byte fallback: a character that is no token becomes its UTF-8 bytes, and decodes back.
  const std::string rare = "\xF0\x9F\xA7\xAC";  // U+1F9EC
  CHECK(tok.decode(tok.encode(rare, false, false)) == rare);
}

// --- the real SmolLM2 vocabulary (byte-level BPE, pre-tokenizer "smollm": every digit on its own) -------
//
// The expected ids below were computed by a separate, naive implementation (regex split with Python's
// `regex` module, digits split first, then "merge the best-ranked pair everywhere" over the file's merges)
// and checked by hand against the token strings, which the test prints on failure.

namespace {

const Tokenizer& smollm() {
  static const Tokenizer tok = load(kModel);
  return tok;
}

std::string pieces(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += "[" + tok.vocab().tokens[size_t(id)] + "]";
  return s;
}

}  // namespace

TEST_CASE("tokenizer: SmolLM2: vocabulary metadata") {
  const Tokenizer& tok = smollm();
  CHECK(tok.n_vocab() == 49152);
  CHECK(tok.vocab().model == "gpt2");
  CHECK(tok.vocab().pre == "smollm");
  CHECK(tok.vocab().merges.size() == 48900);
  CHECK(tok.vocab().bos_id == 1);
  CHECK(tok.vocab().eos_id == 2);
  CHECK(tok.vocab().unk_id == 0);
  CHECK(tok.vocab().pad_id == 2);
  CHECK_FALSE(tok.vocab().add_bos);
  CHECK(tok.is_eog(0));  // <|endoftext|>
  CHECK(tok.is_eog(2));  // <|im_end|>
  CHECK_FALSE(tok.is_eog(1));
  CHECK_FALSE(tok.is_eog(19556));
  CHECK(tok.token_piece(216) == " ");
  CHECK(tok.token_piece(198) == "\n");
  CHECK(tok.token_piece(1) == "<|im_start|>");
  CHECK(tok.token_type(1) == TokenType::control);
}

TEST_CASE("tokenizer: SmolLM2: ids of known strings") {
  const Tokenizer& tok = smollm();
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"Hello world! 123", {19556, 905, 17, 216, 33, 34, 35}},  // digits one by one, the space alone
      {"The capital of France is Paris.", {504, 3575, 282, 4649, 314, 7042, 30}},
      {"  multiple   spaces", {216, 2701, 256, 5600}},  // \s+(?!\S) leaves one space to the word
      {"I'll be there in 2024, won't you?", {57, 3060, 325, 665, 281, 216, 34, 32, 34, 36, 28, 3763, 982, 346, 47}},
      {"def foo(x):\n    return x**2\n", {1604, 29856, 24, 104, 727, 472, 1003, 1792, 828, 34, 198}},
      {"Tokenizers aren't unbelievably hard", {20855, 7927, 4775, 982, 33282, 102, 1756, 1759}},
      {"\n\n", {1116}},
      {"Café déjà vu.", {51, 1939, 2756, 32564, 90, 16739, 386, 101, 30}},
      // ½ and Arabic-Indic digits are \p{N}: each is a word of its own, like 0-9.
      {"Ünïcödé ½ 日本語 ١٢٣", {142, 246, 94, 25972, 83, 7466, 84, 2756, 216, 16738, 17097, 241, 115, 40993, 179, 120,
                                248, 216, 164, 111, 164, 112, 164, 113}},
      {"emoji 🚀!", {391, 33777, 15107, 244, 218, 17}},
  };
  for (const auto& [text, want] : cases) {
    const std::vector<int32_t> got = tok.encode(text, /*add_special=*/true, /*parse_special=*/false);
    CHECK_MESSAGE(got == want, "'", text, "': got ", show(got), pieces(tok, got), " expected ", show(want),
                  pieces(tok, want));
    CHECK(tok.decode(got) == text);
  }
  // A few of the ids, checked against the vocabulary's own strings.
  CHECK(tok.vocab().tokens[19556] == "Hello");
  CHECK(tok.vocab().tokens[905] == "\xC4\xA0world");  // "Ġworld": the space maps to U+0120
  CHECK(tok.vocab().tokens[33] == "1");
  CHECK(tok.vocab().tokens[216] == "\xC4\xA0");
  CHECK(tok.vocab().tokens[1116] == "\xC4\x8A\xC4\x8A");  // "ĊĊ"
}

TEST_CASE("tokenizer: SmolLM2: special tokens parse only when asked") {
  const Tokenizer& tok = smollm();
  const std::string text = "<|im_start|>user\nHi<|im_end|>\n";
  const std::vector<int32_t> parsed = tok.encode(text, true, /*parse_special=*/true);
  CHECK(parsed == std::vector<int32_t>{1, 4093, 198, 26843, 2, 198});
  CHECK(tok.decode(parsed) == text);
  CHECK(tok.decode(parsed, /*render_special=*/false) == "user\nHi\n");
  const std::vector<int32_t> plain = tok.encode("<|im_start|>", true, /*parse_special=*/false);
  CHECK(plain == std::vector<int32_t>{44, 108, 306, 79, 3738, 108, 46});
  CHECK(tok.decode(plain) == "<|im_start|>");
  // Adjacent specials and specials at both ends.
  CHECK(tok.encode("<|im_end|><|im_start|><|endoftext|>", true, true) == std::vector<int32_t>{2, 1, 0});
  CHECK(tok.encode("", true, true).empty());
}

TEST_CASE("tokenizer: SmolLM2: random text round-trips") {
  const Tokenizer& tok = smollm();
  std::mt19937 rng(1234);
  // Code points drawn from ASCII, Latin-1, Greek/Cyrillic, CJK, emoji and whitespace (no surrogates).
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x20, 0x7E}, {0x09, 0x0D}, {0xA0, 0xFF}, {0x370, 0x4FF}, {0x4E00, 0x4FFF}, {0x1F300, 0x1F64F}, {0x2000, 0x206F}};
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    const int len = int(rng() % 60);
    const bool ascii_only = trial % 2 == 0;
    for (int k = 0; k < len; ++k) {
      const auto& r = ascii_only ? ranges[rng() % 2] : ranges[rng() % ranges.size()];
      const uint32_t cp = r.first + rng() % (r.second - r.first + 1);
      utf8proc_uint8_t buf[4];
      text.append(reinterpret_cast<char*>(buf), size_t(utf8proc_encode_char(utf8proc_int32_t(cp), buf)));
    }
    const std::vector<int32_t> ids = tok.encode(text, true, false);
    REQUIRE_MESSAGE(tok.decode(ids) == text, "round trip failed for '", text, "'");
  }
}

TEST_CASE("tokenizer: SmolLM2: random bytes never throw, invalid bytes become U+FFFD") {
  const Tokenizer& tok = smollm();
  std::mt19937 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes(size_t(rng() % 80), '\0');
    for (char& c : bytes) c = char(rng() & 0xFF);
    std::vector<int32_t> ids;
    REQUIRE_NOTHROW(ids = tok.encode(bytes, true, true));
    for (int32_t id : ids) REQUIRE((id >= 0 && id < tok.n_vocab()));
    REQUIRE_NOTHROW(tok.decode(ids));
  }
  // A lone continuation byte, a truncated sequence and a byte that never starts one.
  CHECK(tok.decode(tok.encode("a\x80z", false, false)) == "a\xEF\xBF\xBDz");
  CHECK(tok.decode(tok.encode("\xE2\x82", false, false)) == "\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tok.decode(tok.encode("\xFF", false, false)) == "\xEF\xBF\xBD");
  // SmolLM2's vocabulary lacks the byte-level tokens of a few control bytes (0x04, 0x06, 0x13, 0x14, 0x16,
  // 0x1D) and of bytes that valid UTF-8 never uses: such bytes are dropped, as llama.cpp drops them.
  CHECK(tok.decode(tok.encode("a\x13z", false, false)) == "az");
}

TEST_CASE("tokenizer: SmolLM2: long prompts encode quickly") {
  const Tokenizer& tok = smollm();
  std::string text;
  for (int k = 0; k < 400; ++k) {
    text += "Line " + std::to_string(k) + ": the quick brown fox jumps over the lazy dog; ";
    text += "naïve café résumé — 東京 🚀\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.encode(text, true, true);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE(text.size(), " bytes -> ", ids.size(), " tokens in ", ms, " ms");
  CHECK(ids.size() > 10000);
  CHECK(tok.decode(ids) == text);
  CHECK(ms < 2000.0);
  // One enormous word (a run of 20000 letters) must not be quadratic.
  const std::string word(20000, 'a');
  CHECK(tok.decode(tok.encode(word, false, false)) == word);
}

TEST_CASE("tokenizer: decode rejects ids outside the vocabulary") {
  const Tokenizer& tok = smollm();
  CHECK_THROWS_AS(tok.decode({-1}), cascade::Error);
  CHECK_THROWS_AS(tok.decode({19556, 49152}), cascade::Error);
  CHECK_THROWS_AS(tok.token_piece(1 << 30), cascade::Error);
}

// --- synthetic vocabularies ------------------------------------------------------------------------------

namespace {

// The 256 byte-level tokens (in byte order) followed by `words` (written with the byte-level code points,
// e.g. "Ġworld"), each with the prefixes and left-to-right merges that build it; so a pre-tokenizer word
// equal to one of `words` encodes to that one token, and any other word encodes to several.
Vocab byte_level_vocab(const std::string& pre, const std::vector<std::string>& words) {
  Vocab v;
  v.model = "gpt2";
  v.pre = pre;
  for (int b = 0; b < 256; ++b) {
    utf8proc_uint8_t buf[4];
    const auto n = utf8proc_encode_char(utf8proc_int32_t(cascade::byte_to_codepoint(uint8_t(b))), buf);
    v.tokens.emplace_back(reinterpret_cast<char*>(buf), size_t(n));
  }
  for (const std::string& w : words) {
    size_t k = 0;
    const auto next_char = [&] {
      const size_t start = k;
      for (++k; k < w.size() && (uint8_t(w[k]) & 0xC0) == 0x80;) ++k;
      return w.substr(start, k - start);
    };
    std::string prefix = next_char();
    while (k < w.size()) {
      const std::string c = next_char();
      if (std::find(v.tokens.begin(), v.tokens.end(), prefix + c) == v.tokens.end()) v.tokens.push_back(prefix + c);
      v.merges.push_back(prefix + " " + c);
      prefix += c;
    }
  }
  return v;
}

// The words encode() split the text into, as token strings; the vocab must hold each word whole.
std::vector<std::string> words_of(const Tokenizer& tok, const std::string& text) {
  std::vector<std::string> out;
  for (int32_t id : tok.encode(text, false, false)) out.push_back(tok.vocab().tokens[size_t(id)]);
  return out;
}

}  // namespace

TEST_CASE("tokenizer: llama-bpe pre-tokenizer splits like the Llama 3 regex") {
  // Each word of the text that is one of the vocabulary's words comes out as one token: the ids show the
  // word boundaries.
  const Tokenizer tok(byte_level_vocab(
      "llama-bpe", {"Hello", "Ġworld", "'VE", "Ġ'", "Ll", "123", "45", "ĊĊ", "ĠĠĊ", "Ġy", "!!!ĊĊ", "ok", "ĉHello",
                    "14", "Ġ123", "Ġ(", "normal", ")", "Ġ!!", "ĊĠĠ"}));
  using W = std::vector<std::string>;
  CHECK(words_of(tok, "Hello world") == W{"Hello", "Ġworld"});
  CHECK(words_of(tok, "I'VE 'Ll") == W{"I", "'VE", "Ġ'", "Ll"});        // contractions ignore case
  CHECK(words_of(tok, "12345") == W{"123", "45"});                      // \p{N}{1,3}
  CHECK(words_of(tok, " 123") == W{"Ġ", "123"});                        // no space before numbers
  CHECK(words_of(tok, "a\n\nb") == W{"a", "ĊĊ", "b"});                   // \s*[\r\n]+
  CHECK(words_of(tok, "x  \n  y") == W{"x", "ĠĠĊ", "Ġ", "Ġy"});           // up to the last newline of a run
  CHECK(words_of(tok, "!!!\n\nok") == W{"!!!ĊĊ", "ok"});                 // punctuation takes trailing newlines
  CHECK(words_of(tok, "\tHello") == W{"ĉHello"});                       // one non-letter may lead a word
  CHECK(words_of(tok, "3.14") == W{"3", ".", "14"});
  CHECK(words_of(tok, " (normal)") == W{"Ġ(", "normal", ")"});
  CHECK(words_of(tok, " !!") == W{"Ġ!!"});
}

TEST_CASE("tokenizer: qwen2 pre-tokenizer splits like the Qwen 2 regex") {
  // As Llama 3's, but every digit is a word of its own (Qwen's vocabulary has no token of two digits, so its
  // vectors cannot tell the two apart).
  const Tokenizer tok(byte_level_vocab("qwen2", {"123", "45", "Hello", "Ġworld", "'VE", "ĊĊ"}));
  using W = std::vector<std::string>;
  CHECK(words_of(tok, "12345") == W{"1", "2", "3", "4", "5"});
  CHECK(words_of(tok, "Hello world") == W{"Hello", "Ġworld"});
  CHECK(words_of(tok, "I'VE") == W{"I", "'VE"});
  CHECK(words_of(tok, "a\n\nb") == W{"a", "ĊĊ", "b"});
}

TEST_CASE("tokenizer: gpt-2 and smollm pre-tokenizers on a synthetic vocabulary") {
  using W = std::vector<std::string>;
  const std::vector<std::string> words = {"Ġ123", "123", "ĠHello", "'re", "ĠĠ", "Ġ!!", "Ġ'", "re"};
  const Tokenizer gpt2(byte_level_vocab("gpt-2", words));
  const Tokenizer smol(byte_level_vocab("smollm", words));
  CHECK(words_of(gpt2, "they're") == W{"t", "h", "e", "y", "'re"});
  CHECK(words_of(gpt2, "  Hello") == W{"Ġ", "ĠHello"});  // \s+(?!\S)
  CHECK(words_of(gpt2, " !!") == W{"Ġ!!"});
  CHECK(words_of(gpt2, "a 're") == W{"a", "Ġ'", "re"});  // a contraction never takes the space before it
  CHECK(words_of(smol, " 123") == W{"Ġ", "1", "2", "3"});  // digits split before anything else
  CHECK(words_of(smol, "Hi !!") == W{"H", "i", "Ġ!!"});
  CHECK(words_of(gpt2, " 123") == W{"Ġ123"});
}

TEST_CASE("tokenizer: SentencePiece: BOS, space prefix and its removal") {
  const Tokenizer tok = load(kVectors + "ggml-vocab-llama-spm.gguf");
  CHECK(tok.vocab().add_bos);
  CHECK(tok.vocab().add_space_prefix);
  const std::vector<int32_t> ids = tok.encode("Hello world", /*add_special=*/true, false);
  REQUIRE(ids.size() >= 2);
  CHECK(ids[0] == 1);
  CHECK(tok.decode(ids, /*render_special=*/false) == "Hello world");
  CHECK(tok.decode(ids) == "<s>Hello world");
  // A special token parsed from the text is followed by a fresh space prefix, like llama.cpp.
  const std::vector<int32_t> with_special = tok.encode("<s>Hi", false, /*parse_special=*/true);
  CHECK(with_special.front() == 1);
  CHECK(with_special == std::vector<int32_t>{1, tok.token_id("\xE2\x96\x81Hi")});
  CHECK(tok.encode("<s>Hi", false, /*parse_special=*/false).front() != 1);
  CHECK(tok.is_eog(2));
  // Invalid UTF-8 falls back to byte tokens and decodes to the same bytes.
  const std::string bad = "a\xC3\x28z\xFF";
  CHECK(tok.decode(tok.encode(bad, false, false)) == bad);
}

TEST_CASE("tokenizer: decode_next, one token at a time, gives the text decode gives") {
  for (const char* name : {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"}) {
    CAPTURE(name);
    const Tokenizer tok = load(kVectors + name);
    // The vectors' own texts are the reference where they round-trip (see run_vectors).
    for (const Case& c : read_cases(kVectors + name)) {
      const std::vector<int32_t> ids = tok.encode(c.text, /*add_special=*/true, false);
      for (bool special : {false, true}) {
        Tokenizer::DecodeState state;
        std::string streamed;
        for (int32_t id : ids) streamed += tok.decode_next(id, state, special);
        CHECK(streamed == tok.decode(ids, special));
        if (!special && (valid_utf8(c.text) || tok.vocab().model == "llama")) CHECK(streamed == c.text);
      }
    }
    // Random ids, control tokens among them, in every order.
    std::mt19937 rng(11);
    std::uniform_int_distribution<int32_t> any(0, tok.n_vocab() - 1);
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<int32_t> ids(size_t(1 + rep % 7));
      for (int32_t& id : ids) id = rep % 3 == 0 ? int32_t(rng() % 4) : any(rng);
      Tokenizer::DecodeState state;
      std::string streamed;
      for (int32_t id : ids) streamed += tok.decode_next(id, state, false);
      CHECK(streamed == tok.decode(ids, false));
    }
    Tokenizer::DecodeState state;
    CHECK_THROWS_AS(tok.decode_next(tok.n_vocab(), state), cascade::Error);
  }
}

TEST_CASE("tokenizer: vocabulary validation") {
  SUBCASE("Tokenizer checks a hand-made Vocab") {
    Vocab v = byte_level_vocab("gpt-2", {});
    {
      Vocab bad = v;
      bad.model = "bert";
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.pre = "no-such-pre";
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.bos_id = 256;
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.token_types.assign(10, TokenType::normal);
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.merges = {"nospace"};
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.add_bos = true;  // but no BOS id
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    {
      Vocab bad = v;
      bad.tokens.clear();
      CHECK_THROWS_AS(Tokenizer{bad}, cascade::Error);
    }
    CHECK_NOTHROW(Tokenizer{v});
  }

  SUBCASE("load_vocab checks the GGUF keys") {
    const std::vector<std::string> tokens = {"a", "b", "ab", "<s>"};
    const auto base = [&] {
      cascade::gguf::Writer w;
      w.set_string("general.architecture", "llama");
      w.set_string("tokenizer.ggml.model", "gpt2");
      w.set_string("tokenizer.ggml.pre", "gpt-2");
      w.set_string_array("tokenizer.ggml.tokens", tokens);
      const std::vector<std::string> merges = {"a b"};
      w.set_string_array("tokenizer.ggml.merges", merges);
      return w;
    };
    const auto open = [](const cascade::gguf::Writer& w) {
      return cascade::load_vocab(cascade::gguf::File::from_bytes(w.to_bytes(), "test.gguf"));
    };
    const auto error_of = [&](const cascade::gguf::Writer& w) -> std::string {
      try {
        open(w);
      } catch (const cascade::Error& e) {
        return e.what();
      }
      return "";
    };
    {
      const Vocab v = open(base());
      CHECK(v.tokens == tokens);
      CHECK(v.bos_id == -1);
      CHECK_FALSE(v.add_bos);
      const Tokenizer tok(v);
      CHECK(tok.encode("ab", true, false) == std::vector<int32_t>{2});
    }
    {
      auto w = base();
      const std::vector<int32_t> types = {1, 1, 1};
      w.set_int_array("tokenizer.ggml.token_type", types);
      CHECK(error_of(w).find("token_type") != std::string::npos);
    }
    {
      auto w = base();
      const std::vector<int32_t> types = {1, 1, 1, 9};
      w.set_int_array("tokenizer.ggml.token_type", types);
      CHECK(error_of(w).find("token_type") != std::string::npos);
    }
    {
      auto w = base();
      w.set_u32("tokenizer.ggml.bos_token_id", 4);
      CHECK(error_of(w).find("bos_token_id") != std::string::npos);
    }
    {
      auto w = base();
      w.set_string("tokenizer.ggml.model", "bert");
      CHECK(error_of(w).find("bert") != std::string::npos);
    }
    {
      auto w = base();
      w.set_string("tokenizer.ggml.pre", "qwen35");
      CHECK(error_of(w).find("qwen35") != std::string::npos);
    }
    {
      auto w = base();
      const std::vector<float> scores = {0.0f, 1.0f};
      w.set_float_array("tokenizer.ggml.scores", scores);
      CHECK(error_of(w).find("scores") != std::string::npos);
    }
    {
      auto w = base();
      w.set_bool("tokenizer.ggml.add_bos_token", true);
      CHECK(error_of(w).find("add_bos_token") != std::string::npos);
    }
    // Settings that would change the ids and are not implemented: refused when on, accepted when off.
    for (const char* key : {"tokenizer.ggml.add_sep_token", "tokenizer.ggml.remove_extra_whitespaces"}) {
      auto on = base(), off = base();
      on.set_bool(key, true);
      off.set_bool(key, false);
      CHECK_MESSAGE(error_of(on).find(key) != std::string::npos, key);
      CHECK_MESSAGE(error_of(off).empty(), key);
    }
    {
      cascade::gguf::Writer w;
      w.set_string("general.architecture", "llama");
      CHECK(error_of(w).find("tokenizer.ggml.model") != std::string::npos);
    }
  }
}

// --- the cascade-tokenize tool ---------------------------------------------------------------------------

namespace {

struct RunResult {
  int rc;
  std::string out, err;
};

// Runs the tool with a shell command line of arguments (in the folder cwd, when given); stdout and stderr captured
// through files.
RunResult run_tool(const std::string& args, const std::string& cwd = {}) {
  const std::string tool = CASCADE_BINARY_DIR "/tools/cascade-tokenize";
  REQUIRE_MESSAGE(std::filesystem::exists(tool), "missing ", tool, " (build the cascade-tokenize target)");
  const std::string dir = std::filesystem::temp_directory_path() / ("cascade-tok-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string cmd =
      (cwd.empty() ? "" : "cd '" + cwd + "' && ") + tool + " " + args + " >" + dir + "/out 2>" + dir + "/err";
  const int status = std::system(cmd.c_str());
  RunResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(dir + "/out"), read_file(dir + "/err")};
  std::filesystem::remove_all(dir);
  return r;
}

}  // namespace

TEST_CASE("tokenizer: cascade-tokenize prints ids and pieces, and one-line errors") {
  const std::string model = "'" + kModel + "'";
  RunResult r = run_tool("-m " + model + " -p 'Hello world! 1'");
  CHECK(r.rc == 0);
  CHECK(r.out == "19556\t'Hello'\n905\t' world'\n17\t'!'\n216\t' '\n33\t'1'\n");
  CHECK(r.err.empty());

  r = run_tool("-m " + model + " -p '<|im_start|>user' --ids");
  CHECK(r.rc == 0);
  CHECK(r.out == "1 4093\n");

  // Without -m, models/SmolLM2-135M-Instruct.Q4_1.gguf under the working folder, as the other tools.
  const std::filesystem::path path(kModel);
  if (path.filename() == "SmolLM2-135M-Instruct.Q4_1.gguf" && path.parent_path().filename() == "models") {
    r = run_tool("-p 'Hello world! 1'", path.parent_path().parent_path().string());
    CHECK(r.rc == 0);
    CHECK(r.out == "19556\t'Hello'\n905\t' world'\n17\t'!'\n216\t' '\n33\t'1'\n");
  }

  // A vocabulary-only file; its add_bos_token adds <s> unless --no-bos.
  const std::string spm = "'" + kVectors + "ggml-vocab-llama-spm.gguf'";
  r = run_tool("-m " + spm + " -p 'Hello world' --ids");
  CHECK(r.out == "1 15043 3186\n");
  r = run_tool("-m " + spm + " -p 'Hello world' --ids --no-bos");
  CHECK(r.out == "15043 3186\n");

  for (const std::string& bad : {std::string(""), std::string("-m"), "-m " + model, "-m " + model + " -p x --bogus",
                                 std::string("-m /nonexistent.gguf -p x"), std::string("-m /dev/null -p x"),
                                 "-m '" + kVectors + "README.md' -p x"}) {
    r = run_tool(bad);
    CHECK_MESSAGE(r.rc == 1, "args: ", bad);
    CHECK_MESSAGE(r.out.empty(), "args: ", bad);
    CHECK_MESSAGE(r.err.rfind("cascade-tokenize: error: ", 0) == 0, "args: ", bad, " stderr: ", r.err);
    CHECK_MESSAGE(std::count(r.err.begin(), r.err.end(), '\n') == 1, "args: ", bad, " stderr: ", r.err);
  }
}

}  // namespace test_tokenizer
