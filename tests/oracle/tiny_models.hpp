// Tiny random-weight models of every architecture the runtime runs (model/llama.hpp), written with the project's
// GGUF writer: the files of the oracle tests (tests/data/oracle, made by scripts/oracle.sh with
// make-oracle-models), the fuzz targets' seeds, and the loader's tests, which damage copies of them.
//
// A model is a TinySpec: an architecture, its sizes, the options its architecture may carry (biases, fused
// matrices, RoPE factors and scaling, windows, a logit soft-cap) and a weight type. The weights are random: for
// F32, F16 and BF16, values uniform in [-a, a]; for the quantized types, random codes under block scales that give
// values in about the same range (a = gain * sqrt(3 / n_in), so that each layer keeps its input's size). Norms are
// uniform in [0.5, 1.5], biases in [-0.5, 0.5]. Every matrix has the spec's type where its rows are a whole number
// of that type's blocks, else Q8_0 where they are a whole number of 32, else F32 (as llama.cpp's quantizer falls
// back); "q4_K_M" mixes Q4_K with Q6_K for attn_v, ffn_down and token_embd, as the files users download do. The
// random numbers come from std::mt19937 through this file's own conversions, so the bytes are the same on every
// platform.
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

namespace cascade::oracle {

struct TinySpec {
  std::string name;         // file stem, e.g. "llama-q8_0"
  std::string arch;         // general.architecture
  std::string type = "f32"; // f32 f16 bf16 q8_0 q4_0 q4_1 q4_K q5_K q6_K, or q4_K_M (a mix)
  int n_layer = 2, n_embd = 32, n_head = 2, n_head_kv = 1, n_ff = 64, n_vocab = 64, n_ctx = 256;
  int head_dim = 0;         // attention.key_length / value_length; 0: key absent (n_embd / n_head)
  int n_rot = 0;            // rope.dimension_count; 0: key absent (the head dim)
  float rope_base = 10000.0f;
  bool tied = true;         // no output.weight
  bool fused_qkv = false;   // attn_qkv instead of attn_q, attn_k, attn_v
  bool qkv_bias = false;    // attn_q/k/v.bias (attn_qkv.bias when fused)
  bool llama_biases = false;  // attn_output.bias and the FFN's biases (llama)
  bool output_bias = false;   // output.bias (qwen2)
  bool rope_freqs = false;    // rope_freqs.weight: Llama 3.1's factors for an original context of 32
  bool rope_long_short = false;  // rope_factors_long/short.weight (Phi-3's 128k models): 1..8 and 1..1.5
  std::string rope_scaling;   // rope.scaling.type; empty: absent
  float rope_factor = 0.0f;   // rope.scaling.factor; 0: absent
  float rope_attn_factor = 0.0f;  // rope.scaling.attn_factor; 0: absent
  int rope_orig_ctx = 0;      // rope.scaling.original_context_length; 0: absent
  int n_swa = 0;              // attention.sliding_window; 0: absent
  int swa_pattern = 0;        // attention.sliding_window_pattern (gemma3); 0: absent
  float rope_base_swa = 0.0f; // rope.freq_base_swa (gemma3); 0: absent
  float softcap = 0.0f;       // final_logit_softcapping (gemma3); 0: absent
  uint32_t seed = 1;
  int n_prompt = 12;          // the oracle prompt's length
  int n_prompt_long = 0;      // a second prompt, longer than the window; 0: none
};

namespace detail {

// Uniform in [lo, hi) from 24 bits of the generator: the same numbers everywhere.
inline float uniform(std::mt19937& rng, float lo, float hi) {
  return lo + (hi - lo) * float(rng() >> 8) * (1.0f / 16777216.0f);
}

inline void put_half(std::vector<uint8_t>& b, size_t at, float v) {
  const uint16_t h = gguf::fp32_to_fp16(v);
  std::memcpy(&b[at], &h, 2);
}

// n_out rows of n_in values of type t, about uniform in [-amp, amp]: values for F32, F16 and BF16; random codes
// under scales for the quantized types (the scale bytes of Q4_K and Q5_K give 6-bit scales and mins of 32..47).
inline std::vector<uint8_t> random_tensor(gguf::TensorType t, int64_t n_in, int64_t n_out, float amp,
                                          std::mt19937& rng) {
  using gguf::TensorType;
  const int64_t n = n_in * n_out;
  std::vector<uint8_t> b(size_t(gguf::row_bytes(t, n_in) * uint64_t(n_out)));
  if (t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16) {
    for (int64_t k = 0; k < n; ++k) {
      const float v = uniform(rng, -amp, amp);
      if (t == TensorType::F32) {
        std::memcpy(&b[size_t(k) * 4], &v, 4);
      } else {
        const uint16_t h = t == TensorType::F16 ? gguf::fp32_to_fp16(v) : gguf::fp32_to_bf16(v);
        std::memcpy(&b[size_t(k) * 2], &h, 2);
      }
    }
    return b;
  }
  for (uint8_t& x : b) x = uint8_t(rng() >> 24);
  const size_t bb = size_t(gguf::block_bytes(t));
  for (size_t at = 0; at < b.size(); at += bb) {
    switch (t) {
      case TensorType::Q8_0: put_half(b, at, amp / 128); break;
      case TensorType::Q4_0: put_half(b, at, amp / 8); break;
      case TensorType::Q4_1:
        put_half(b, at, amp / 7.5f);
        put_half(b, at + 2, -amp);
        break;
      case TensorType::Q4_K: case TensorType::Q5_K: {
        const float top = t == TensorType::Q4_K ? 15.0f : 31.0f;
        put_half(b, at, 2 * amp / top / 40);
        put_half(b, at + 2, amp / 40);
        for (size_t j = 0; j < 12; ++j) b[at + 4 + j] = uint8_t(0xA0 | (rng() >> 28));
        break;
      }
      case TensorType::Q6_K:
        for (size_t j = 0; j < 16; ++j) b[at + 192 + j] = uint8_t(32 + (rng() >> 27));
        put_half(b, at + 208, amp / 32 / 48);
        break;
      default: CASCADE_CHECK(false, "random_tensor: no random blocks for ", gguf::type_name(t));
    }
  }
  return b;
}

inline gguf::TensorType type_named(const std::string& s) {
  using gguf::TensorType;
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                       TensorType::Q4_1, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K})
    if (s == gguf::type_name(t)) return t;
  CASCADE_CHECK(s == "q4_K_M", "tiny_models: unknown weight type '", s, "'");
  return TensorType::Q4_K;
}

// The type a matrix gets in a file of the spec's type (see the header).
inline gguf::TensorType matrix_type(const TinySpec& s, const std::string& name, int64_t n_in) {
  using gguf::TensorType;
  TensorType t = type_named(s.type);
  if (s.type == "q4_K_M" && (name.find("attn_v") != std::string::npos || name.find("ffn_down") != std::string::npos ||
                             name == "token_embd.weight"))
    t = TensorType::Q6_K;
  if (n_in % gguf::block_size(t) == 0) return t;
  return n_in % 32 == 0 ? TensorType::Q8_0 : TensorType::F32;
}

// A SentencePiece vocabulary of n >= 6 tokens: <unk> <s> </s>, the newline byte, then pieces.
inline void put_vocab(gguf::Writer& w, int n) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "<0x0A>", "\xe2\x96\x81"};
  std::vector<int32_t> types = {2, 3, 3, 6, 1};
  for (int k = 0; int(tokens.size()) < n; ++k) {
    const std::string letter(1, char('a' + k % 26));
    tokens.push_back(k < 26 ? letter : "\xe2\x96\x81" + letter + std::to_string(k / 26));
    types.push_back(1);
  }
  std::vector<float> scores(tokens.size());
  for (size_t k = 0; k < scores.size(); ++k) scores[k] = -float(k);
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", tokens);
  w.set_float_array("tokenizer.ggml.scores", scores);
  w.set_int_array("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1).set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
}

inline void put_keys(gguf::Writer& w, const TinySpec& s) {
  const std::string a = s.arch + ".";
  // general.name stays neutral: llama.cpp changes the vocabulary of a model whose name says "phi3".
  w.set_string("general.architecture", s.arch).set_string("general.name", "tiny random model");
  w.set_u32(a + "context_length", uint32_t(s.n_ctx)).set_u32(a + "embedding_length", uint32_t(s.n_embd));
  w.set_u32(a + "block_count", uint32_t(s.n_layer)).set_u32(a + "feed_forward_length", uint32_t(s.n_ff));
  w.set_u32(a + "attention.head_count", uint32_t(s.n_head));
  w.set_u32(a + "attention.head_count_kv", uint32_t(s.n_head_kv));
  if (s.head_dim > 0) {
    w.set_u32(a + "attention.key_length", uint32_t(s.head_dim));
    w.set_u32(a + "attention.value_length", uint32_t(s.head_dim));
  }
  if (s.n_rot > 0) w.set_u32(a + "rope.dimension_count", uint32_t(s.n_rot));
  w.set_f32(a + "rope.freq_base", s.rope_base);
  w.set_f32(a + "attention.layer_norm_rms_epsilon", s.arch == "gemma3" ? 1e-6f : 1e-5f);
  if (!s.rope_scaling.empty()) w.set_string(a + "rope.scaling.type", s.rope_scaling);
  if (s.rope_factor > 0) w.set_f32(a + "rope.scaling.factor", s.rope_factor);
  if (s.rope_attn_factor > 0) w.set_f32(a + "rope.scaling.attn_factor", s.rope_attn_factor);
  if (s.rope_orig_ctx > 0) w.set_u32(a + "rope.scaling.original_context_length", uint32_t(s.rope_orig_ctx));
  if (s.n_swa > 0) w.set_u32(a + "attention.sliding_window", uint32_t(s.n_swa));
  if (s.swa_pattern > 0) w.set_u32(a + "attention.sliding_window_pattern", uint32_t(s.swa_pattern));
  if (s.rope_base_swa > 0) w.set_f32(a + "rope.freq_base_swa", s.rope_base_swa);
  if (s.softcap > 0) w.set_f32(a + "final_logit_softcapping", s.softcap);
}

// Llama 3.1's RoPE factors (what its converter computes from rope_scaling: factor 8, low 1, high 4) for an
// original context of 32, so that they bend the angles of the tiny prompts.
inline std::vector<float> llama3_factors(int n_rot, float base) {
  std::vector<float> f;
  const double factor = 8, low = 1, high = 4, ctx = 32, pi = 3.14159265358979323846;
  for (int i = 0; i < n_rot / 2; ++i) {
    const double wavelen = 2 * pi * std::pow(double(base), 2.0 * i / n_rot);
    if (wavelen < ctx / high) f.push_back(1.0f);
    else if (wavelen > ctx / low) f.push_back(float(factor));
    else {
      const double smooth = (ctx / wavelen - low) / (high - low);
      f.push_back(float(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  return f;
}

}  // namespace detail

// The GGUF bytes of a spec.
inline std::vector<uint8_t> write_tiny(const TinySpec& s) {
  using gguf::TensorType;
  gguf::Writer w;
  detail::put_keys(w, s);
  detail::put_vocab(w, s.n_vocab);
  std::mt19937 rng(s.seed);
  const auto matrix = [&](const std::string& name, int64_t n_in, int64_t n_out, double gain) {
    const TensorType t = detail::matrix_type(s, name, n_in);
    const auto b = detail::random_tensor(t, n_in, n_out, float(gain * std::sqrt(3.0 / double(n_in))), rng);
    w.add_tensor(name, t, {n_in, n_out}, b.data());
  };
  const auto vec = [&](const std::string& name, int64_t n, float lo, float hi) {
    std::vector<float> v(size_t(n), 0.0f);
    for (float& x : v) x = detail::uniform(rng, lo, hi);
    w.add_tensor(name, TensorType::F32, {n}, v.data());
  };
  const int64_t d = s.n_embd, hd = s.head_dim > 0 ? s.head_dim : s.n_embd / s.n_head;
  const int64_t dq = s.n_head * hd, dkv = s.n_head_kv * hd;
  matrix("token_embd.weight", d, s.n_vocab, std::sqrt(double(d)));
  vec("output_norm.weight", d, 0.5f, 1.5f);
  if (!s.tied) matrix("output.weight", d, s.n_vocab, 4.0);
  if (s.output_bias) vec("output.bias", s.n_vocab, -0.5f, 0.5f);
  if (s.rope_freqs) {
    const auto f = detail::llama3_factors(s.n_rot > 0 ? s.n_rot : int(hd), s.rope_base);
    w.add_tensor("rope_freqs.weight", TensorType::F32, {int64_t(f.size())}, f.data());
  }
  if (s.rope_long_short) {
    const int64_t half = (s.n_rot > 0 ? s.n_rot : hd) / 2;
    std::vector<float> lo(static_cast<size_t>(half)), hi(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      hi[size_t(i)] = 1.0f + 7.0f * float(i) / float(half - 1);
      lo[size_t(i)] = 1.0f + 0.5f * float(i) / float(half - 1);
    }
    w.add_tensor("rope_factors_long.weight", TensorType::F32, {half}, hi.data());
    w.add_tensor("rope_factors_short.weight", TensorType::F32, {half}, lo.data());
  }
  for (int il = 0; il < s.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    vec(p + "attn_norm.weight", d, 0.5f, 1.5f);
    if (s.fused_qkv) {
      matrix(p + "attn_qkv.weight", d, dq + 2 * dkv, 2.0);
      if (s.qkv_bias) vec(p + "attn_qkv.bias", dq + 2 * dkv, -0.5f, 0.5f);
    } else {
      matrix(p + "attn_q.weight", d, dq, 2.0);
      matrix(p + "attn_k.weight", d, dkv, 2.0);
      matrix(p + "attn_v.weight", d, dkv, 1.0);
      if (s.qkv_bias) {
        vec(p + "attn_q.bias", dq, -0.5f, 0.5f);
        vec(p + "attn_k.bias", dkv, -0.5f, 0.5f);
        vec(p + "attn_v.bias", dkv, -0.5f, 0.5f);
      }
    }
    if (s.arch == "qwen3" || s.arch == "gemma3") {
      vec(p + "attn_q_norm.weight", hd, 0.5f, 1.5f);
      vec(p + "attn_k_norm.weight", hd, 0.5f, 1.5f);
    }
    matrix(p + "attn_output.weight", dq, d, 1.0);
    if (s.llama_biases) vec(p + "attn_output.bias", d, -0.5f, 0.5f);
    if (s.arch == "gemma3") vec(p + "post_attention_norm.weight", d, 0.5f, 1.5f);
    vec(p + "ffn_norm.weight", d, 0.5f, 1.5f);
    if (s.arch == "phi3") {
      matrix(p + "ffn_up.weight", d, 2 * int64_t(s.n_ff), 1.0);
    } else {
      matrix(p + "ffn_gate.weight", d, s.n_ff, 1.0);
      matrix(p + "ffn_up.weight", d, s.n_ff, 1.0);
    }
    matrix(p + "ffn_down.weight", s.n_ff, d, 1.0);
    if (s.llama_biases) {
      vec(p + "ffn_gate.bias", s.n_ff, -0.5f, 0.5f);
      vec(p + "ffn_up.bias", s.n_ff, -0.5f, 0.5f);
      vec(p + "ffn_down.bias", d, -0.5f, 0.5f);
    }
    if (s.arch == "gemma3") vec(p + "post_ffw_norm.weight", d, 0.5f, 1.5f);
  }
  return w.to_bytes();
}

// The prompt of a spec: n token ids drawn from its seed.
inline std::vector<int32_t> tiny_prompt(const TinySpec& s, int n) {
  std::mt19937 rng(s.seed * 7919u + 17u);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = int32_t(rng() % uint32_t(s.n_vocab));
  return t;
}

inline TinySpec tiny_spec(std::string name, std::string arch, std::string type) {
  TinySpec s;
  s.name = std::move(name);
  s.arch = std::move(arch);
  s.type = std::move(type);
  return s;
}

// The oracle files: each architecture in several weight types, and the options each may carry.
inline std::vector<TinySpec> oracle_specs() {
  std::vector<TinySpec> v;
  const auto add = [&](TinySpec s) {
    s.seed = uint32_t(v.size() + 1);
    v.push_back(std::move(s));
  };
  // Matrices of 256 columns for the K-quant files; head dims via key_length where n_embd / n_head is not one.
  const auto k_quant = [](TinySpec s) {
    s.n_embd = 256;
    s.n_ff = 32;
    s.n_vocab = 48;
    return s;
  };
  for (const char* type : {"f32", "f16", "q8_0", "q4_0", "q4_K_M"}) {
    TinySpec s = tiny_spec(std::string("llama-") + type, "llama", type);
    if (s.type == "q4_K_M") s = k_quant(s), s.head_dim = 32;
    add(s);
  }
  {
    TinySpec s = tiny_spec("llama3-f16", "llama", "f16");  // Llama 3.1: RoPE factors, untied output
    s.rope_base = 500.0f, s.rope_freqs = true, s.tied = false, s.head_dim = 32;
    add(s);
    TinySpec lin = tiny_spec("llama-linear-q8_0", "llama", "q8_0");
    lin.rope_base = 1000.0f, lin.rope_scaling = "linear", lin.rope_factor = 4.0f;
    add(lin);
    TinySpec yarn = tiny_spec("llama-yarn-f32", "llama", "f32");
    yarn.rope_base = 1000.0f, yarn.rope_scaling = "yarn", yarn.rope_factor = 4.0f, yarn.rope_orig_ctx = 32;
    yarn.rope_attn_factor = 1.25f;
    add(yarn);
    TinySpec bias = tiny_spec("llama-bias-q4_1", "llama", "q4_1");  // every optional bias, Q/K/V fused
    bias.qkv_bias = true, bias.llama_biases = true, bias.fused_qkv = true;
    add(bias);
    TinySpec swa = tiny_spec("llama-swa-f32", "llama", "f32");  // Mistral: a window; one layer (see oracle.sh)
    swa.n_layer = 1, swa.n_swa = 12, swa.n_prompt_long = 24;
    add(swa);
  }
  for (const char* type : {"f32", "f16", "q8_0", "q4_K_M"}) {
    TinySpec s = tiny_spec(std::string("qwen2-") + type, "qwen2", type);
    s.qkv_bias = true, s.output_bias = s.type == "f16", s.tied = s.type != "f16";
    if (s.type == "q4_K_M") s = k_quant(s), s.n_head = 2, s.n_layer = 1;
    add(s);
  }
  {
    TinySpec yarn = tiny_spec("qwen2-yarn-q8_0", "qwen2", "q8_0");
    yarn.qkv_bias = true, yarn.rope_base = 1000.0f, yarn.rope_scaling = "yarn", yarn.rope_factor = 4.0f;
    yarn.rope_orig_ctx = 32;
    add(yarn);
  }
  for (const char* type : {"f32", "bf16", "q8_0", "q4_K_M"}) {
    TinySpec s = tiny_spec(std::string("qwen3-") + type, "qwen3", type);
    s.head_dim = 32;  // key_length: n_head * head_dim != n_embd
    if (s.type == "q4_K_M") s = k_quant(s), s.head_dim = 32;
    add(s);
  }
  for (const char* type : {"f32", "f16", "q8_0", "q5_K"}) {
    TinySpec s = tiny_spec(std::string("phi3-") + type, "phi3", type);
    s.fused_qkv = true, s.n_rot = 12;  // Phi-4-mini rotates part of each head
    if (s.type == "q5_K") s = k_quant(s), s.n_rot = 0, s.n_layer = 1;
    add(s);
  }
  for (const char* type : {"f32", "f16", "q8_0", "q4_K_M"}) {
    TinySpec s = tiny_spec(std::string("gemma3-") + type, "gemma3", type);
    s.head_dim = 32, s.n_swa = 12, s.swa_pattern = 2, s.rope_base = 10000.0f, s.rope_base_swa = 100.0f;
    s.n_prompt_long = 24;
    if (s.type == "f16") s.rope_scaling = "linear", s.rope_factor = 4.0f, s.softcap = 5.0f;
    if (s.type == "q4_K_M") s = k_quant(s), s.head_dim = 32;
    add(s);
  }
  {
    // Phi-3.5 / Phi-4-mini: long and short RoPE factors, llama.cpp's context (256, oracle-logits) above the
    // original one (long factors) or not (short); no scaling type key, as their converter writes them.
    TinySpec lng = tiny_spec("phi3-longrope-f32", "phi3", "f32");
    lng.fused_qkv = true, lng.rope_long_short = true, lng.rope_orig_ctx = 64, lng.rope_attn_factor = 1.19f;
    lng.rope_base = 1000.0f;
    add(lng);
    TinySpec shrt = lng;
    shrt.name = "phi3-shortrope-f16", shrt.type = "f16", shrt.rope_orig_ctx = 256;
    add(shrt);
    TinySpec llm = tiny_spec("llama-longrope-q8_0", "llama", "q8_0");  // the same under llama, declared
    llm.rope_long_short = true, llm.rope_scaling = "longrope", llm.rope_orig_ctx = 64, llm.rope_base = 1000.0f;
    add(llm);
  }
  return v;
}

}  // namespace cascade::oracle
