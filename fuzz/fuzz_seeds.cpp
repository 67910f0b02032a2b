// Writes seed corpora for the fuzz targets, built from valid inputs, so nothing binary is committed:
//   fuzz_seeds OUT_DIR   ->  OUT_DIR/gguf/*     small GGUF files from gguf::Writer: every dequantizable tensor
//                                              type, every value type, a byte-level BPE and a SentencePiece
//                                              vocabulary with chat templates
//                            OUT_DIR/tokenizer/* the tokenizer test strings (testdata *.inp) behind a
//                                              vocabulary/flags byte, chat text with special tokens, token ids
//                            OUT_DIR/plan/*     plans in fuzz_plan's format (plan_input.hpp)
//                            OUT_DIR/model/*    tiny Llama models: f32, Q8_0, Q4_1, f16/bf16/Q4_0 weights, tied
//                                              and untied outputs, GQA and not, u32 and u64 counts, with a
//                                              byte-level BPE or a SentencePiece vocabulary (ChatML / Llama 3
//                                              template) of as many tokens as token_embd has rows, or none;
//                                              subnormal and largest f16 scales and mins, subnormal f32 weights;
//                                              and every architecture's tiny model (llama, qwen2, qwen3, phi3,
//                                              gemma3) with what each may carry (tests/oracle/tiny_models.hpp:
//                                              the oracle files' options, made smaller)
//                            OUT_DIR/request/*  requests in fuzz_request's format (a selector byte, then the body):
//                                              completions and chats, whole and streamed, with every sampling
//                                              field, token-id prompts, stop strings; the GET endpoints
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/quant.hpp"
#include "model/tokenizer.hpp"
#include "model_seed.hpp"
#include "tests/oracle/tiny_models.hpp"
#include "plan_input.hpp"

namespace {

using namespace cascade;
using namespace cascade::gguf;
using namespace cascade::fuzz;

void write_file(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), std::streamsize(n));
  CASCADE_CHECK(f, "fuzz_seeds: cannot write ", path);
}

void write_file(const std::string& path, const std::vector<uint8_t>& b) { write_file(path, b.data(), b.size()); }

void make_dir(const std::string& path) {
  if (mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) detail::fail("fuzz_seeds: cannot create ", path);
}

std::vector<uint8_t> all_types_file(uint32_t alignment) {
  Writer w;
  w.set_alignment(alignment);
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", "fuzz seed");
  w.set_u8("seed.u8", 200).set_i8("seed.i8", -3).set_u16("seed.u16", 60000).set_i16("seed.i16", -30000);
  w.set_u32("llama.block_count", 2).set_i32("seed.i32", -7).set_u64("seed.u64", 1ull << 40);
  w.set_i64("seed.i64", -(1ll << 40)).set_f32("llama.rope.freq_base", 10000.0f).set_f64("seed.f64", 0.25);
  w.set_bool("seed.bool", true);
  const std::vector<std::string> strs = {"a", "", "\xe2\x96\x81x"};
  w.set_string_array("seed.strings", strs);
  const std::vector<float> fs = {1.5f, -2.0f};
  w.set_float_array("seed.floats", fs);
  const std::vector<int32_t> is = {1, -1, 3};
  w.set_int_array("seed.ints", is);
  const uint8_t bools[] = {0, 1, 1};
  w.set_array("seed.bools", ValueType::BOOL, bools, 3);
  const uint16_t u16s[] = {1, 65535};
  w.set_array("seed.u16s", ValueType::U16, u16s, 2);
  const double f64s[] = {1e300, -0.0};
  w.set_array("seed.f64s", ValueType::F64, f64s, 2);
  const struct {
    const char* name;
    TensorType type;
    std::vector<int64_t> ne;
  } tensors[] = {
      {"f32", TensorType::F32, {8, 2}},       {"f16", TensorType::F16, {4, 3}},
      {"bf16", TensorType::BF16, {4, 1, 2}},  {"q8_0", TensorType::Q8_0, {32, 2}},
      {"q4_0", TensorType::Q4_0, {64}},       {"q4_1", TensorType::Q4_1, {32, 1, 1, 2}},
      {"q4_K", TensorType::Q4_K, {256, 2}},   {"q5_K", TensorType::Q5_K, {256}},
      {"q6_K", TensorType::Q6_K, {256, 2}},   {"i8", TensorType::I8, {5}},
  };
  for (const auto& t : tensors) {
    const std::vector<uint8_t> b = tensor_bytes(t.type, t.ne);
    w.add_tensor(t.name, t.type, t.ne, b.data());
  }
  return w.to_bytes();
}

// A small byte-level BPE vocabulary: the 256 byte tokens, a few merges, ChatML specials.
std::vector<uint8_t> bpe_vocab_file() {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) {
    std::string s;
    const uint32_t cp = byte_to_codepoint(uint8_t(b));
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    tokens.push_back(s);
  }
  const std::vector<std::string> merges = {"h e", "l l", "he ll", "hell o", "\xc4\xa0 w", "o r", "\xc4\xa0w or"};
  for (const std::string& m : merges) {
    std::string joined = m;
    joined.erase(joined.find(' '), 1);
    tokens.push_back(joined);
  }
  tokens.push_back("<|endoftext|>");
  tokens.push_back("<|im_start|>");
  tokens.push_back("<|im_end|>");
  std::vector<int32_t> types(tokens.size(), 1);
  for (size_t k = tokens.size() - 3; k < tokens.size(); ++k) types[k] = 3;
  const int32_t n = int32_t(tokens.size());
  Writer w;
  w.set_string("tokenizer.ggml.model", "gpt2").set_string("tokenizer.ggml.pre", "smollm");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_int_array("tokenizer.ggml.token_type", types);
  w.set_string_array("tokenizer.ggml.merges", merges);
  w.set_u32("tokenizer.ggml.bos_token_id", uint32_t(n - 2)).set_u32("tokenizer.ggml.eos_token_id", uint32_t(n - 1));
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  w.set_string("tokenizer.chat_template", kChatml);
  return w.to_bytes();
}

// A small SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, a few scored pieces.
std::vector<uint8_t> spm_vocab_file() {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    tokens.push_back(name);
    types.push_back(6);
    scores.push_back(0);
  }
  const char* pieces[] = {"\xe2\x96\x81", "a", "b", "\xe2\x96\x81" "a", "ab", "\xe2\x96\x81" "ab", "\xc3\xa9"};
  float score = -1;
  for (const char* p : pieces) {
    tokens.push_back(p);
    types.push_back(1);
    scores.push_back(score -= 0.5f);
  }
  Writer w;
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_int_array("tokenizer.ggml.token_type", types);
  w.set_float_array("tokenizer.ggml.scores", scores);
  w.set_u32("tokenizer.ggml.bos_token_id", 1).set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_string("tokenizer.chat_template", kLlama3);
  return w.to_bytes();
}

void model_seeds(const std::string& dir) {
  ModelSeed f32_bpe;  // f32, tied, GQA 2/1, byte-level BPE vocabulary with ChatML
  f32_bpe.n_vocab = 16;
  f32_bpe.vocab = 1;
  write_file(dir + "/f32_bpe.gguf", model_file(f32_bpe));

  ModelSeed q8;  // Q8_0 matrices, untied, u64 counts, rope base, SentencePiece with Llama 3
  q8.n_embd = 32;
  q8.n_head = 4;
  q8.n_head_kv = 2;
  q8.n_ff = 32;
  q8.n_vocab = 10;
  q8.matrices = TensorType::Q8_0;
  q8.tied = false;
  q8.u64 = true;
  q8.rope_base = true;
  q8.vocab = 2;
  write_file(dir + "/q8_0_spm.gguf", model_file(q8));

  ModelSeed q4 = q8;  // Q4_1 matrices, two layers, no head_count_kv (no GQA), no vocabulary
  q4.matrices = TensorType::Q4_1;
  q4.n_head = 2;
  q4.n_layer = 2;
  q4.write_head_count_kv = false;
  q4.n_rot = 0;
  q4.vocab = 0;
  q4.tied = true;
  q4.u64 = false;
  write_file(dir + "/q4_1.gguf", model_file(q4));

  ModelSeed mixed = q4;  // Q4_0 matrices, f16 norms
  mixed.matrices = TensorType::Q4_0;
  mixed.norms = TensorType::F16;
  mixed.n_layer = 1;
  write_file(dir + "/q4_0_f16.gguf", model_file(mixed));

  ModelSeed bf = f32_bpe;  // bf16 everywhere, untied, MHA 4/4
  bf.matrices = bf.norms = TensorType::BF16;
  bf.n_head = bf.n_head_kv = 4;
  bf.tied = false;
  write_file(dir + "/bf16_bpe.gguf", model_file(bf));

  // Extreme numbers for the per-matrix check: subnormal f16 scales with the largest mins, the largest scales,
  // subnormal f32 weights
  ModelSeed tiny = q4;
  tiny.scale = 0x1p-24f;
  tiny.min = 65504.0f;
  write_file(dir + "/q4_1_extreme.gguf", model_file(tiny));
  ModelSeed huge = q8;
  huge.scale = -65504.0f;
  write_file(dir + "/q8_0_extreme.gguf", model_file(huge));
  ModelSeed sub = f32_bpe;
  sub.f32_exp = -135;
  write_file(dir + "/f32_subnormal.gguf", model_file(sub));
}

// The oracle files' models (biases, fused matrices, RoPE factors and scaling, windows, Q/K norms, soft-caps) at a
// size the fuzzer runs quickly: 16 wide, heads of 8, one layer (two for gemma3's local and global layers), f32 or
// f16 weights; one file per set of options.
void arch_seeds(const std::string& dir) {
  for (oracle::TinySpec s : oracle::oracle_specs()) {
    if (s.name == s.arch + "-" + s.type && s.type != "f32" && s.type != "f16") continue;  // the same options again
    if (s.type != "f16") s.type = "f32";
    s.n_embd = 16, s.n_head = 2, s.n_head_kv = 1, s.n_ff = 16, s.n_vocab = 12, s.n_ctx = 64;
    s.n_layer = s.arch == "gemma3" ? 2 : 1;
    if (s.head_dim > 0) s.head_dim = 8;
    if (s.n_rot > 0) s.n_rot = 4;
    if (s.n_swa > 0) s.n_swa = 3;
    write_file(dir + "/" + s.name + ".gguf", oracle::write_tiny(s));
  }
}

void gguf_seeds(const std::string& dir) {
  write_file(dir + "/all_types_a32.gguf", all_types_file(32));
  write_file(dir + "/all_types_a64.gguf", all_types_file(64));
  write_file(dir + "/bpe_vocab.gguf", bpe_vocab_file());
  write_file(dir + "/spm_vocab.gguf", spm_vocab_file());
  Writer w;
  w.set_string("general.architecture", "llama").set_u32("llama.context_length", 2048);
  write_file(dir + "/no_tensors.gguf", w.to_bytes());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void tokenizer_seeds(const std::string& dir, const std::string& testdata) {
  int n = 0;
  const auto put = [&](uint8_t selector, const std::string& text) {
    std::vector<uint8_t> b{selector};
    b.insert(b.end(), text.begin(), text.end());
    write_file(dir + "/seed_" + std::to_string(n++), b);
  };
  // The test strings, each behind one vocabulary in turn (0-2 byte-level BPE, 3 SentencePiece, 4 SmolLM2).
  for (const char* name : {"ggml-vocab-gpt-2.gguf.inp", "ggml-vocab-llama-spm.gguf.inp"}) {
    const std::string inp = read_text(testdata + "/" + name);
    const std::string sep = "\n__ggml_vocab_test__\n";
    size_t pos = 0;
    for (size_t hit; (hit = inp.find(sep, pos)) != std::string::npos; pos = hit + sep.size())
      put(uint8_t(n % 5), inp.substr(pos, hit - pos));
  }
  put(0x34, "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nHi 123<|im_end|>\n");
  put(0x33, "<s>Hello</s> world <unk>");
  put(0x72, "<|endoftext|>abc<|endoftext|>");
  std::vector<uint8_t> ids{0x80};
  for (int k = 0; k < 60; ++k) ids.push_back(uint8_t(k * 29 + 3));
  write_file(dir + "/seed_ids", ids);
  ids[0] = 0xC3;
  write_file(dir + "/seed_ids_spm", ids);
}

void plan_seeds(const std::string& dir) {
  using fuzz::PlanSpec;
  int n = 0;
  const auto put = [&](const PlanSpec& p) { write_file(dir + "/seed_" + std::to_string(n++), fuzz::encode_plan(p)); };

  PlanSpec two_level;  // decode: 4 sequences below a 300-token prefix, GQA 4/2, head_dim 64, f16
  two_level.dtype = 1;
  two_level.n_q_heads = 4;
  two_level.n_kv_heads = 2;
  two_level.head_dim = 0xC3;
  two_level.segments = {{300, 0, 0}, {20, 0, 0}, {1, 0, 0}, {0, 0, 0}, {33, 0, 0x21}};
  two_level.sequences = {{1, {0, 1}}, {1, {0, 2}}, {1, {0, 3}}, {1, {0, 4}}};
  two_level.value_seed = 1;
  put(two_level);

  PlanSpec prefill;  // prefill of 17 tokens through paged segments, head_dim 128, bf16, 2 threads
  prefill.dtype = 2;
  prefill.threads = 1;
  prefill.n_q_heads = 2;
  prefill.n_kv_heads = 1;
  prefill.head_dim = 0xC7;
  prefill.segments = {{40, 16, 0}, {17, 5, 0x12}};
  prefill.sequences = {{17, {0, 1}}};
  prefill.value_seed = 2;
  put(prefill);

  PlanSpec tree;  // a three-level tree, odd head_dim, group 3, padded strides, a custom scale
  tree.n_q_heads = 6;
  tree.n_kv_heads = 2;
  tree.head_dim = 7;
  tree.scale = 128 + 8;
  tree.segments = {{50, 0, 0x13}, {9, 0, 0}, {4, 3, 0}, {6, 0, 0}, {2, 0, 0}};
  tree.sequences = {{2, {0, 1, 2}}, {1, {0, 1, 3}}, {0, {0, 4}}, {80, {4}}};
  tree.value_seed = 3;
  put(tree);

  PlanSpec split = tree;  // the split layout: every sequence on its own segment, head_dim 32
  split.head_dim = 0xC1;
  split.scale = 0;
  split.sequences = {{1, {0}}, {3, {1}}, {1, {2}}, {2, {3}}};
  put(split);

  PlanSpec huge;  // lengths that only a plan can hold: built, never run
  huge.huge = true;
  huge.n_q_heads = 8;
  huge.n_kv_heads = 8;
  huge.head_dim = 0xC3;
  huge.segments = {{uint64_t(1) << 40, 0, 0}, {uint64_t(1) << 41, 0, 0}};
  huge.sequences = {{1, {0, 1}}, {4, {0}}};
  put(huge);

  PlanSpec bad = two_level;  // rejected: a path that is not a tree
  bad.sequences = {{1, {0, 1}}, {1, {2, 1}}};
  put(bad);
}

// fuzz_request's inputs: the selector byte (fuzz_request.cpp) and a body.
void request_seeds(const std::string& dir) {
  int k = 0;
  const auto put = [&](uint8_t sel, const std::string& body) {
    std::string b(1, char(sel));
    b += body;
    write_file(dir + "/" + std::to_string(k++), b.data(), b.size());
  };
  put(0, R"({"model":"tiny","prompt":"hello world","max_tokens":8,"temperature":0})");
  put(0, R"({"prompt":[1,2,3,4],"max_tokens":6,"n":3,"temperature":0.7,"top_p":0.9,"top_k":5,"min_p":0.1,)"
         R"("seed":42,"stop":["he","ll"],"ignore_eos":true})");
  put(0, R"({"prompt":["hello"],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"seed":7})");
  put(0x80, R"({"prompt":"hello hello hello","max_tokens":20,"stream":true,"n":2})");
  put(0, R"({"prompt":"hello","max_tokens":0,"logprobs":null,"echo":false,"best_of":1,"user":"u"})");
  put(1, R"({"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello"}],)"
         R"("max_completion_tokens":6,"temperature":0})");
  put(1, R"({"messages":[{"role":"developer","content":[{"type":"text","text":"hi"}]},{"role":"user",)"
         R"("content":"who"},{"role":"assistant"},{"role":"user","content":"ok"}],"max_tokens":5,"stream":true,)"
         R"("response_format":{"type":"text"},"n":2,"seed":3})");
  put(1 | 0x10 | 0x20, R"({"messages":[{"role":"user","content":"hello"}],"max_tokens":3,"stop":"l"})");
  put(0 | 0x10, R"({"prompt":"hello","max_tokens":3})");
  put(0 | 0x40, R"({"prompt":"hello","max_tokens":3})");
  put(0 | 0x08, "");
  for (uint8_t p = 2; p < 8; ++p) put(p, p == 6 ? "tiny" : "");
  put(0, R"({"prompt":"hello","max_tokens":64})");  // does not fit the context with its prompt
  put(0, R"({"prompt":"hello",)");                  // malformed
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds OUT_DIR\n");
    return 2;
  }
  try {
    const std::string out = argv[1];
    make_dir(out);
    for (const char* sub : {"/gguf", "/tokenizer", "/plan", "/model", "/request"}) make_dir(out + sub);
    gguf_seeds(out + "/gguf");
    tokenizer_seeds(out + "/tokenizer", CASCADE_TESTDATA_DIR "/tokenizer");
    plan_seeds(out + "/plan");
    model_seeds(out + "/model");
    arch_seeds(out + "/model");
    request_seeds(out + "/request");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
