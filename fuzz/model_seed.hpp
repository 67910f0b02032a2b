// Valid GGUF contents for the fuzz targets' seeds and the regression tests that replay what the targets found
// (fuzz_seeds writes them; tests/test_regressions.cpp rebuilds the same bytes): tensor data with plausible block
// scales, the chat templates of SmolLM2 (ChatML) and Llama 3, and tiny Llama models with or without a vocabulary.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/quant.hpp"

namespace cascade::fuzz {

using gguf::TensorType;
using gguf::Writer;

// Block bytes of a tensor with plausible scales: f16 fields 1.0 where the layout has them (or the given scale d
// and the second field m of q4_1 / q4_K / q5_K), f32 values k / 64 - 1 (times 2^f32_exp), the rest a pattern.
inline std::vector<uint8_t> tensor_bytes(TensorType t, const std::vector<int64_t>& ne, float d = 1.0f,
                                         float m = 1.0f, int f32_exp = 0) {
  uint64_t n = gguf::row_bytes(t, ne[0]);
  for (size_t i = 1; i < ne.size(); ++i) n *= uint64_t(ne[i]);
  std::vector<uint8_t> b(n);
  for (size_t k = 0; k < n; ++k) b[k] = uint8_t(k * 37 + 11);
  const uint16_t hd = gguf::fp32_to_fp16(d), hm = gguf::fp32_to_fp16(m);
  const auto put_half = [&](size_t at, uint16_t h) { std::memcpy(&b[at], &h, 2); };
  const uint64_t bb = gguf::block_bytes(t);
  for (uint64_t blk = 0; blk * bb < n; ++blk) {
    const size_t at = size_t(blk * bb);
    switch (t) {
      case TensorType::Q4_0: case TensorType::Q8_0: put_half(at, hd); break;
      case TensorType::Q4_1: case TensorType::Q4_K: case TensorType::Q5_K:
        put_half(at, hd);
        put_half(at + 2, hm);
        break;
      case TensorType::Q6_K: put_half(at + 208, hd); break;
      default: break;
    }
  }
  if (t == TensorType::F32) {
    for (size_t k = 0; k + 4 <= n; k += 4) {
      const float x = std::ldexp(float(k) / 64.0f - 1.0f, f32_exp);
      std::memcpy(&b[k], &x, 4);
    }
  }
  return b;
}

inline const char* const kChatml =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
inline const char* const kLlama3 =
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}";

// A tiny Llama model (model_file writes it): every matrix of one type, every norm of another, the vocabulary
// (if any) in the same file. The defaults make a valid f32 model of 12 tokens; fields below the vocabulary make
// the inconsistent files the regression tests replay.
struct ModelSeed {
  int n_layer = 1, n_embd = 8, n_head = 2, n_head_kv = 1, n_ff = 16, n_vocab = 12, n_rot = 0;  // n_rot 0: head dim
  TensorType matrices = TensorType::F32;  // every matrix (row lengths must be whole blocks)
  TensorType norms = TensorType::F32;
  bool tied = true, u64 = false, write_head_count_kv = true, rope_base = false;
  int vocab = 0;  // 0 none, 1 byte-level BPE, 2 SentencePiece
  int vocab_tokens = 0;        // tokens in the vocabulary; 0: n_vocab (a valid model)
  uint64_t block_count = 0;    // llama.block_count as written; 0: n_layer (a valid model)
  int n_ctx = 64;              // llama.context_length
  uint32_t random = 0;         // nonzero: f32 tensors drawn uniformly from [-1, 1] with this seed instead of the
                               // pattern, Q8_0 matrices' codes uniformly from [-127, 127] (their scales stay
                               // `scale`): tests that compare greedy texts want logits without its regularity
  float scale = 1.0f, min = 1.0f;  // the matrices' f16 block scales and q4_1 / K-quant mins (tensor_bytes)
  int f32_exp = 0;                 // f32 matrices' values times 2^f32_exp
};

// A byte-level BPE vocabulary of n >= 13 tokens: single letters, a few merges of them, ChatML specials last.
inline void put_bpe_vocab(Writer& w, int n) {
  std::vector<std::string> tokens;
  const std::vector<std::string> merges = {"h e", "l l", "he ll", "\xc4\xa0 w"};
  for (const std::string& m : merges) {
    std::string joined = m;
    joined.erase(joined.find(' '), 1);
    tokens.push_back(joined);
  }
  tokens.insert(tokens.begin(), {"h", "e", "l", "o", "\xc4\xa0", "w"});
  for (char c = 'a'; int(tokens.size()) < n - 3; ++c) tokens.push_back(std::string(1, c));
  tokens.push_back("<|endoftext|>");
  tokens.push_back("<|im_start|>");
  tokens.push_back("<|im_end|>");
  CASCADE_CHECK(int(tokens.size()) == n, "model_seed: a BPE vocabulary of ", n, " tokens cannot be made");
  std::vector<int32_t> types(tokens.size(), 1);
  for (size_t k = tokens.size() - 3; k < tokens.size(); ++k) types[k] = 3;
  w.set_string("tokenizer.ggml.model", "gpt2").set_string("tokenizer.ggml.pre", "smollm");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_int_array("tokenizer.ggml.token_type", types);
  w.set_string_array("tokenizer.ggml.merges", merges);
  w.set_u32("tokenizer.ggml.bos_token_id", uint32_t(n - 2)).set_u32("tokenizer.ggml.eos_token_id", uint32_t(n - 1));
  w.set_string("tokenizer.chat_template", kChatml);
}

// A SentencePiece vocabulary of n >= 6 tokens: <unk> <s> </s>, two byte tokens, scored pieces.
inline void put_spm_vocab(Writer& w, int n) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "<0x0A>", "<0x41>", "\xe2\x96\x81"};
  std::vector<int32_t> types = {2, 3, 3, 6, 6, 1};
  for (char c = 'a'; int(tokens.size()) < n; ++c) {
    tokens.push_back(std::string(1, c));
    types.push_back(1);
  }
  std::vector<float> scores(tokens.size());
  for (size_t k = 0; k < scores.size(); ++k) scores[k] = -float(k);
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_int_array("tokenizer.ggml.token_type", types);
  w.set_float_array("tokenizer.ggml.scores", scores);
  w.set_u32("tokenizer.ggml.bos_token_id", 1).set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_string("tokenizer.chat_template", kLlama3);
}

// The GGUF bytes of s: keys, vocabulary, then token_embd, the layers, output_norm and (untied) output.
inline std::vector<uint8_t> model_file(const ModelSeed& s) {
  Writer w;
  w.set_string("general.architecture", "llama");
  const auto count = [&](const char* key, uint64_t v) {
    if (s.u64) w.set_u64(key, v);
    else w.set_u32(key, uint32_t(v));
  };
  const int head_dim = s.n_embd / s.n_head;
  count("llama.context_length", uint64_t(s.n_ctx));
  count("llama.embedding_length", uint64_t(s.n_embd));
  count("llama.block_count", s.block_count ? s.block_count : uint64_t(s.n_layer));
  count("llama.feed_forward_length", uint64_t(s.n_ff));
  count("llama.attention.head_count", uint64_t(s.n_head));
  if (s.write_head_count_kv) count("llama.attention.head_count_kv", uint64_t(s.n_head_kv));
  count("llama.rope.dimension_count", uint64_t(s.n_rot > 0 ? s.n_rot : head_dim));
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  if (s.rope_base) w.set_f32("llama.rope.freq_base", 500000.0f);
  const int n_tokens = s.vocab_tokens ? s.vocab_tokens : s.n_vocab;
  if (s.vocab == 1) put_bpe_vocab(w, n_tokens);
  if (s.vocab == 2) put_spm_vocab(w, n_tokens);
  std::mt19937 rng(s.random);
  const auto tensor = [&](const std::string& name, TensorType t, std::vector<int64_t> ne) {
    const bool matrix = ne.size() == 2;
    std::vector<uint8_t> b = matrix ? tensor_bytes(t, ne, s.scale, s.min, s.f32_exp) : tensor_bytes(t, ne);
    if (s.random && t == TensorType::F32) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (size_t k = 0; k + 4 <= b.size(); k += 4) {
        const float x = u(rng);
        std::memcpy(&b[k], &x, 4);
      }
    } else if (s.random && t == TensorType::Q8_0 && matrix) {
      std::uniform_int_distribution<int> u(-127, 127);
      for (size_t k = 0; k + 34 <= b.size(); k += 34)  // a block: the f16 scale, then 32 int8 codes
        for (size_t j = 2; j < 34; ++j) b[k + j] = uint8_t(int8_t(u(rng)));
    }
    w.add_tensor(name, t, std::move(ne), b.data());
  };
  const int64_t d = s.n_embd, dq = int64_t(s.n_head) * head_dim, dkv = int64_t(s.n_head_kv) * head_dim;
  tensor("token_embd.weight", s.matrices, {d, s.n_vocab});
  for (int il = 0; il < s.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    tensor(p + "attn_norm.weight", s.norms, {d});
    tensor(p + "attn_q.weight", s.matrices, {d, dq});
    tensor(p + "attn_k.weight", s.matrices, {d, dkv});
    tensor(p + "attn_v.weight", s.matrices, {d, dkv});
    tensor(p + "attn_output.weight", s.matrices, {dq, d});
    tensor(p + "ffn_norm.weight", s.norms, {d});
    tensor(p + "ffn_gate.weight", s.matrices, {d, s.n_ff});
    tensor(p + "ffn_up.weight", s.matrices, {d, s.n_ff});
    tensor(p + "ffn_down.weight", s.matrices, {s.n_ff, d});
  }
  tensor("output_norm.weight", s.norms, {d});
  if (!s.tied) tensor("output.weight", s.matrices, {d, s.n_vocab});
  return w.to_bytes();
}

}  // namespace cascade::fuzz
