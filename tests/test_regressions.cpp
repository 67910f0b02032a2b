// Inputs the fuzz targets (fuzz/) found to break a promise, replayed byte for byte. Each case names the target,
// what went wrong and where it was fixed; the bytes are the fuzzer's crashing input (for fuzz_tokenizer, its first
// byte picks the vocabulary and flags, the rest is the text).
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "cascade/cpu/attention.hpp"
#include "cascade/error.hpp"
#include "cascade/plan.hpp"
#include "fuzz/plan_input.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

using cascade::Tokenizer;

namespace {

const std::string kVectors = CASCADE_TESTDATA_DIR "/tokenizer/";

const Tokenizer& llama_spm() {
  static const Tokenizer tok(cascade::load_vocab(cascade::gguf::File::open(kVectors + "ggml-vocab-llama-spm.gguf")));
  return tok;
}

std::string bytes(std::initializer_list<unsigned char> b) { return std::string(b.begin(), b.end()); }

// The plan of a fuzz_plan input whose segments are only planned, never run (the "huge" flag), as fuzz_plan
// makes it: the tree from the lengths, then its CPU schedule.
cascade::Plan build_huge_plan(const std::vector<uint8_t>& input) {
  const cascade::fuzz::PlanSpec spec = cascade::fuzz::decode_plan(input.data(), input.size());
  REQUIRE(spec.huge);
  const cascade::HeadShape shape{spec.n_q_heads, spec.n_kv_heads, spec.head_dim_value()};
  std::vector<int64_t> n_tokens;
  for (const cascade::fuzz::SegmentSpec& s : spec.segments) n_tokens.push_back(int64_t(s.n_tokens));
  std::vector<std::vector<int>> paths;
  std::vector<int64_t> n_query;
  for (const cascade::fuzz::SequenceSpec& s : spec.sequences) {
    paths.emplace_back(s.path.begin(), s.path.end());
    n_query.push_back(s.n_query);
  }
  return cascade::cpu::plan(cascade::Tree::build(shape, n_tokens, paths, n_query));
}

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

// fuzz_plan, input 04 08 08 c3 00 02 | 2^62 as u64, 00 00 | 2^62 as u64, 00 00 | 01 01 02 00 01 | 8 zero bytes: one
// sequence through two segments of 2^62 tokens each. Summing its keys overflowed int64 (UB) inside Plan::build;
// now the plan is refused with an Error. Fixed in include/cascade/plan.hpp (the check lives in tree.hpp now).
TEST_CASE("regression: plan: a sequence with more keys than int64 holds is refused, not overflowed") {
  std::vector<uint8_t> input = {0x04, 0x08, 0x08, 0xc3, 0x00, 0x02};
  for (int seg = 0; seg < 2; ++seg) {
    for (int k = 0; k < 8; ++k) input.push_back(k == 7 ? 0x40 : 0x00);  // 2^62, little-endian
    input.insert(input.end(), {0x00, 0x00});
  }
  input.insert(input.end(), {0x01, 0x01, 0x02, 0x00, 0x01});
  input.insert(input.end(), 8, 0x00);
  CHECK_THROWS_WITH_AS(build_huge_plan(input), doctest::Contains("more keys than int64"), cascade::Error);

  // A total just below 2^63 is still a plan, and its schedule's chunks stay within int64.
  input[6 + 7] = 0x3f;  // the first segment becomes 2^62 - 2^56 tokens
  CHECK_NOTHROW(build_huge_plan(input));
  const cascade::Plan plan = build_huge_plan(input);
  CHECK_NOTHROW(cascade::verify_schedule(plan.attended(), plan.schedule()));
}
