// Inputs the fuzz targets (fuzz/) found to break a promise, replayed byte for byte. Each case names the target,
// what went wrong and where it was fixed; the bytes are the fuzzer's crashing input (for fuzz_tokenizer, its first
// byte picks the vocabulary and flags, the rest is the text).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/cpu/attention.hpp"
#include "cascade/error.hpp"
#include "cascade/plan.hpp"
#include "fuzz/model_seed.hpp"
#include "fuzz/plan_input.hpp"
#include "model/gguf.hpp"
#include "model/linear.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace test_regressions {

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
cascade::Plan build_huge_plan(const std::vector<uint8_t>& input, const cascade::cpu::Options& options = {}) {
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
  return cascade::cpu::plan(cascade::Tree::build(shape, n_tokens, paths, n_query), options);
}

// Model::load's error on a fuzz_model seed (fuzz/model_seed.hpp) changed as the case says; "" when it loads.
std::string model_load_error(const cascade::fuzz::ModelSeed& seed) {
  const cascade::gguf::File file = cascade::gguf::File::from_bytes(cascade::fuzz::model_file(seed), "seed.gguf");
  try {
    (void)cascade::llama::Model::load(file);
  } catch (const cascade::Error& e) {
    return e.what();
  }
  return "";
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

// fuzz_plan, a 38-byte mutation of a seed: 04 08 08 c3 00 02 | 0 as u64, 02 01 | 67,174,402 as u64, 00 00 | 02 |
// 01 02 00 01 | 04 00 | 6 zero bytes: a sequence through an empty segment and one of 67 million keys. Its one item
// spans 65,601 blocks of keys (16,403 states, a block or a fold span each), and verify_schedule walked the item's
// blocks again for every slot an output merges: about 10^10 steps (a replay ran past CI's hour). Now each item's
// key ranges are listed once. Fixed in include/cascade/schedule.hpp (verify_schedule); the replay's --timeout now
// ends such an input.
TEST_CASE("regression: plan: verifying the schedule of an item of 65,601 blocks is linear, not quadratic") {
  const std::vector<uint8_t> input = {0x04, 0x08, 0x08, 0xc3, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                      0x00, 0x02, 0x01, 0x02, 0x00, 0x01, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                      0x02, 0x01, 0x02, 0x00, 0x01, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  const cascade::Plan plan = build_huge_plan(input, cascade::cpu::Options{1});  // one thread, as the input said
  const cascade::Schedule& sc = plan.schedule();
  int64_t most_blocks = 0, most_states = 0;
  for (const cascade::Schedule::Item& it : sc.items) {
    most_blocks = std::max(most_blocks, sc.block > 0 ? (it.t1 - it.t0) / sc.block : 0);
    most_states = std::max(most_states, it.n_states);
  }
  CAPTURE(most_states);
  CHECK(most_blocks > 50000);  // still the input that took hours
  CHECK_NOTHROW(cascade::verify_schedule(plan.attended(), plan.schedule()));
}

// fuzz_model, a 10 KB mutation of the seed q8_0_spm.gguf whose llama.block_count (u64) read 16,580,352 with the
// tensors of one layer: Model::load sized the layer list from block_count before reading any layer's tensors,
// asking for 10 GB (out of memory under the fuzzer; std::bad_alloc, not an Error, at block_count 2^30). Now layers
// are read one after another and the first missing tensor ends the load. Fixed in model/llama.cpp (Model::load).
TEST_CASE("regression: model: a block_count far beyond the file's tensors is a missing tensor, not an allocation") {
  cascade::fuzz::ModelSeed seed;  // one layer of f32 tensors
  for (uint64_t block_count : {uint64_t(16580352), uint64_t(1) << 30}) {
    seed.block_count = block_count;
    CAPTURE(block_count);
    const std::string e = model_load_error(seed);
    CHECK(e.find("missing tensor 'blk.1.attn_norm.weight'") != std::string::npos);
  }
  seed.block_count = 0;
  CHECK(model_load_error(seed).empty());
}

// fuzz_model, the seed bf16_bpe.gguf as first written: 13 tokens in its vocabulary, 12 rows in token_embd. The
// model loaded and its tokenizer made id 12, which the model has no embedding for (the target's check that the
// two agree stopped it). Now a vocabulary, or a llama.vocab_size, that differs from token_embd's rows is an
// Error. Fixed in model/llama.cpp (Hparams::from_gguf).
TEST_CASE("regression: model: a vocabulary longer or shorter than token_embd is refused") {
  cascade::fuzz::ModelSeed seed;
  seed.n_vocab = 16;
  seed.vocab = 1;  // byte-level BPE
  CHECK(model_load_error(seed).empty());
  for (int n_tokens : {13, 17}) {
    seed.vocab_tokens = n_tokens;
    const std::string e = model_load_error(seed);
    CHECK(e.find("the vocabulary has " + std::to_string(n_tokens) + " tokens but token_embd.weight has 16 rows") !=
          std::string::npos);
  }
  seed.vocab = 2;  // SentencePiece
  seed.vocab_tokens = 9;
  CHECK(model_load_error(seed).find("the vocabulary has 9 tokens") != std::string::npos);
}

// fuzz_model, the seed f32_bpe.gguf with "attn_v.weight" (13 bytes, from the dictionary) inserted at byte 2774,
// inside the f32 data of blk.0.attn_q, and one byte 0xe3 inserted 153 bytes later (inside blk.0.attn_k). The
// tensor offsets stay, so blk.0.attn_output reads its bytes 14 places late: each of its floats is the high half
// of one seed float (0x3f.. or 0x40..) followed by the zero low half of the next, a subnormal of about 2.3e-41.
// Its row 6 (bits 0x3fe0, 0x3fe8, 0x3ff0, 0x3ff8, 0x4000, 0x4004, 0x4008, 0x400c) against the target's first
// activation row (-1.125, 1.125, 1, 0.875, 0.75, 0.625, 0.5, 0.375) makes products of 10242.5 and 6148.5 times
// 2^-149 among others; f32 rounds each to the even neighbour on the subnormal grid, so every path gives
// 67580 * 2^-149 where the exact sum is 67581 * 2^-149: 1.4e-45 off, beside a bound of 2.3e-46 that assumed
// every rounding relative. The kernels are right; the bound now adds 2^-149 per product that can underflow (and
// scales vdpbf16ps's flushes by |x|). Fixed in model/linear.cpp (linear::reference).
TEST_CASE("regression: model: products of subnormal f32 weights are within the reference's bound") {
  cascade::fuzz::ModelSeed seed;  // the seed f32_bpe.gguf (fuzz/fuzz_seeds.cpp)
  seed.n_vocab = 16;
  seed.vocab = 1;
  std::vector<uint8_t> b = cascade::fuzz::model_file(seed);
  REQUIRE(b.size() == 4992);
  const std::string ins = "attn_v.weight";
  b.insert(b.begin() + 2774 + 153, uint8_t(0xe3));
  b.insert(b.begin() + 2774, ins.begin(), ins.end());
  const cascade::gguf::File file = cascade::gguf::File::from_bytes(b, "crash.gguf");
  const cascade::llama::Model m = cascade::llama::Model::load(file);
  const cascade::linear::Matrix& wo = m.weights().layers.at(0).wo;
  REQUIRE(wo.type == cascade::gguf::TensorType::F32);
  REQUIRE(wo.n_in == 8);
  std::vector<float> row(8);
  wo.row(6, row.data());
  const uint32_t expect[8] = {0x3fe0, 0x3fe8, 0x3ff0, 0x3ff8, 0x4000, 0x4004, 0x4008, 0x400c};
  for (int k = 0; k < 8; ++k) {
    uint32_t bits;
    std::memcpy(&bits, &row[size_t(k)], 4);
    CHECK(bits == expect[k]);
  }
  // fuzz_model's check: two rows of moderate activations, every matrix on every path within the bound
  const auto check = [&](const cascade::linear::Matrix& w, const char* name) {
    std::vector<float> x(size_t(2 * w.n_in));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 37 % 19) - 9) * 0.125f;
    const cascade::linear::Input in(x.data(), 2, w.n_in);
    for (auto path : {cascade::linear::Path::portable, cascade::linear::Path::avx2, cascade::linear::Path::avx_vnni,
                      cascade::linear::Path::avx512_vnni}) {
      if (!cascade::linear::can_run(path)) continue;
      CAPTURE(name);
      CAPTURE(cascade::linear::path_name(path));
      std::vector<float> y(size_t(2 * w.n_out));
      cascade::linear::matmul(w, in, y.data(), path);
      std::vector<double> ref, bound;
      cascade::linear::reference(w, in, path, ref, bound);
      int bad = 0;
      for (size_t i = 0; i < y.size(); ++i)
        if (std::isfinite(ref[i]) && std::fabs(ref[i]) + bound[i] <= 1e30)
          bad += !(std::fabs(double(y[i]) - ref[i]) <= bound[i]);
      CHECK(bad == 0);
      if (&w == &wo) {  // the output the target stopped at, as the comment above works it out
        CHECK(double(y[6]) == std::ldexp(67580.0, -149));
        CHECK(ref[6] == std::ldexp(67581.0, -149));
        CHECK(bound[6] >= std::ldexp(1.0, -149));
      }
    }
  };
  const cascade::llama::Weights& w = m.weights();
  check(w.tok_embd, "token_embd");
  for (const cascade::llama::Layer& l : w.layers)
    for (const auto* p : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_gate, &l.ffn_up, &l.ffn_down})
      check(*p, "a layer's matrix");
}

}  // namespace test_regressions
