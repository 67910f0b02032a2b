// Inputs the fuzz targets (fuzz/) found to break a promise, replayed byte for byte. Each case names the target,
// what went wrong and where it was fixed; the bytes are the fuzzer's crashing input (for fuzz_tokenizer, its first
// byte picks the vocabulary and flags, the rest is the text).
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

using cascade::Tokenizer;

namespace {

const std::string kVectors = CASCADE_SHARED_DIR "/testdata/tokenizer/";

const Tokenizer& llama_spm() {
  static const Tokenizer tok(cascade::load_vocab(cascade::gguf::File::open(kVectors + "ggml-vocab-llama-spm.gguf")));
  return tok;
}

std::string bytes(std::initializer_list<unsigned char> b) { return std::string(b.begin(), b.end()); }

}  // namespace

// fuzz_tokenizer, input 03 fb*14 20 0a. A lead byte announcing a 4-byte sequence took the 3 bytes after it as
// its own even when they did not continue it: here the U+2581 space mark, which then fell back to byte tokens and
// decoded as "\xe2\x96\x81" instead of a space. Fixed in Tokenizer::encode_spm.
TEST_CASE("regression: SentencePiece: a broken UTF-8 lead byte does not swallow the space after it") {
  const Tokenizer& tok = llama_spm();
  std::string text(14, '\xfb');
  text += " \n";
  CHECK(tok.decode(tok.encode(text, true), false) == text);

  const std::vector<int32_t> ids = tok.encode("\xfb \xf0" "a", false);
  const int32_t space = tok.token_id("\xe2\x96\x81");
  REQUIRE(space >= 0);
  // ▁ <0xFB> ▁ <0xF0> a: each broken byte stands alone, the space stays a space token.
  CHECK(ids == std::vector<int32_t>{space, tok.token_id("<0xFB>"), space, tok.token_id("<0xF0>"), tok.token_id("a")});
  for (const std::string& t : {bytes({0xf4, 0x20}), bytes({0xe2, 0x20, 0x96}), bytes({0xc3, 0x20, 0xa9}),
                               bytes({0x20, 0xf0, 0x9f, 0x20}), bytes({0xf0, 0x9f, 0x98, 0x80, 0x20})})
    CHECK(tok.decode(tok.encode(t, true), false) == t);
}
