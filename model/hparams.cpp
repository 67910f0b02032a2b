// The hyperparameters of each architecture (llama.hpp) from a file's keys, and the RoPE tables they imply.
//
// Every key named `ARCH.*` is read here or refused by name: those that change the math are implemented as llama.cpp
// implements them for that architecture, or are an Error when they ask for what is not (a RoPE scaling type,
// experts, per-layer arrays). Informational keys (the vocabulary size, `rope.scaling.finetuned`) are checked or
// accepted as they are.
#include "model/llama.hpp"

#include <cmath>
#include <optional>
#include <set>
#include <string>

#include "cascade/error.hpp"
#include "model/gguf.hpp"

namespace cascade::llama {

namespace {

// The keys of one architecture, `ARCH.` + suffix; remembers which were read so that the rest can be refused.
class Keys {
 public:
  Keys(const gguf::File& f, std::string arch) : f_(f), prefix_(std::move(arch) + ".") {}

  std::string name(const std::string& suffix) const { return prefix_ + suffix; }
  bool has(const std::string& suffix) {
    read_.insert(suffix);
    return f_.find(name(suffix)) != nullptr;
  }
  // A count: u32 in real files, u64 allowed by the spec. The limit keeps a hostile file from asking for absurd
  // allocations.
  int64_t count(const std::string& suffix, std::optional<int64_t> fallback = std::nullopt) {
    read_.insert(suffix);
    const auto v = f_.get_uint_opt(name(suffix));
    if (!v) {
      CASCADE_CHECK(fallback.has_value(), f_.name(), ": missing key '", name(suffix), "'");
      return *fallback;
    }
    CASCADE_CHECK(*v <= (uint64_t(1) << 30), f_.name(), ": key '", name(suffix), "' = ", *v, " is out of range");
    return int64_t(*v);
  }
  std::optional<float> real(const std::string& suffix) {
    read_.insert(suffix);
    return f_.get_float_opt(name(suffix));
  }
  std::optional<std::string_view> string(const std::string& suffix) {
    read_.insert(suffix);
    return f_.get_string_opt(name(suffix));
  }
  const gguf::Value* value(const std::string& suffix) {
    read_.insert(suffix);
    return f_.find(name(suffix));
  }
  // A key that may only hold the value llama.cpp assumes for it (so reading it or not computes the same).
  void expect_real(const std::string& suffix, float neutral, const char* what) {
    const auto v = real(suffix);
    CASCADE_CHECK(!v || *v == neutral, f_.name(), ": key '", name(suffix), "' = ", *v, ": ", what,
                  " other than ", neutral, " is not implemented");
  }
  void expect_count(const std::string& suffix, int64_t neutral, const char* what) {
    const int64_t v = count(suffix, neutral);
    CASCADE_CHECK(v == neutral, f_.name(), ": key '", name(suffix), "' = ", v, ": ", what, " not implemented");
  }
  // Every ARCH.* key of the file was read.
  void check_all_read() const {
    for (const gguf::KeyValue& kv : f_.kvs()) {
      if (kv.key.substr(0, prefix_.size()) != prefix_) continue;
      const std::string suffix(kv.key.substr(prefix_.size()));
      CASCADE_CHECK(read_.count(suffix), f_.name(), ": key '", kv.key,
                    "' is not one this runtime reads (it may change the model's math)");
    }
  }

 private:
  const gguf::File& f_;
  std::string prefix_;
  std::set<std::string> read_;
};

Arch parse_arch(const gguf::File& f) {
  const std::string_view name = f.architecture();
  for (Arch a : {Arch::llama, Arch::qwen2, Arch::qwen3, Arch::phi3, Arch::gemma3})
    if (name == arch_name(a)) return a;
  detail::fail(f.name(), ": unsupported architecture '", std::string(name),
               "' (this runtime runs llama, qwen2, qwen3, phi3 and gemma3)");
}

// Sizes: heads, their dims, the FFN.
void read_shape(const gguf::File& f, Keys& keys, Hparams& hp) {
  hp.n_ctx_train = keys.count("context_length");
  hp.n_embd = keys.count("embedding_length");
  hp.n_layer = keys.count("block_count");
  hp.n_ff = keys.count("feed_forward_length");
  hp.n_head = keys.count("attention.head_count");
  hp.n_head_kv = keys.count("attention.head_count_kv", hp.n_head);
  const bool has_head_dim = keys.has("attention.key_length");
  CASCADE_CHECK(has_head_dim || (hp.n_head > 0 && hp.n_embd % hp.n_head == 0), f.name(), ": embedding_length (",
                hp.n_embd, ") is not a positive multiple of head_count (", hp.n_head,
                ") and attention.key_length is absent");
  hp.head_dim = keys.count("attention.key_length", hp.n_head > 0 ? hp.n_embd / hp.n_head : 0);
  const int64_t v_dim = keys.count("attention.value_length", hp.head_dim);
  CASCADE_CHECK(v_dim == hp.head_dim, f.name(), ": attention.value_length (", v_dim,
                ") differs from attention.key_length (", hp.head_dim, "), which this runtime does not implement");
  hp.n_rot = keys.count("rope.dimension_count", hp.head_dim);
  // llama.cpp's llama, qwen2 and qwen3 graphs rotate whole heads (it refuses anything else for these).
  const bool whole_heads = hp.arch == Arch::llama || hp.arch == Arch::qwen2 || hp.arch == Arch::qwen3;
  CASCADE_CHECK(!whole_heads || hp.n_rot == hp.head_dim, f.name(), ": rope.dimension_count (", hp.n_rot,
                ") differs from the head dim (", hp.head_dim, "), which architecture '", arch_name(hp.arch),
                "' does not allow");
  // llama.cpp's qwen2 and phi3 make Q and the output projection n_embd wide, whatever the head dim.
  const bool q_is_embd = hp.arch == Arch::qwen2 || hp.arch == Arch::phi3;
  CASCADE_CHECK(!q_is_embd || hp.n_head * hp.head_dim == hp.n_embd, f.name(), ": head_count x head dim (",
                hp.n_head, " x ", hp.head_dim, ") differs from embedding_length (", hp.n_embd,
                "), which architecture '", arch_name(hp.arch), "' does not allow");
  const auto eps = keys.real("attention.layer_norm_rms_epsilon");
  CASCADE_CHECK(eps.has_value(), f.name(), ": missing key '", keys.name("attention.layer_norm_rms_epsilon"), "'");
  hp.rms_eps = *eps;
  keys.expect_count("expert_count", 0, "experts (mixture of experts) are");
  keys.expect_count("expert_used_count", 0, "experts (mixture of experts) are");
  const gguf::Value* causal = keys.value("attention.causal");
  CASCADE_CHECK(causal == nullptr || (causal->type == gguf::ValueType::BOOL && causal->u == 1), f.name(), ": key '",
                keys.name("attention.causal"), "' is not true: non-causal attention is not implemented");
}

// RoPE: base and scaling (llama.cpp's llama_model::load_hparams and its context's YaRN parameters).
void read_rope(const gguf::File& f, Keys& keys, Hparams& hp) {
  hp.rope_neox = hp.arch != Arch::llama;
  hp.rope_base = keys.real("rope.freq_base").value_or(10000.0f);
  RopeScaling& rs = hp.rope_scaling;
  const std::string type(keys.string("rope.scaling.type").value_or("linear"));
  float factor = keys.real("rope.scaling.factor").value_or(0.0f);
  if (factor == 0.0f) factor = keys.real("rope.scale_linear").value_or(0.0f);
  rs.freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
  if (type == "none") {
    rs.type = RopeScaling::Type::none;
    rs.freq_scale = 1.0f;
  } else if (type == "linear") {
    rs.type = RopeScaling::Type::linear;
  } else if (type == "yarn") {
    rs.type = RopeScaling::Type::yarn;
    rs.ext_factor = 1.0f;
  } else if (type == "longrope" && (hp.arch == Arch::llama || hp.arch == Arch::phi3)) {
    rs.type = RopeScaling::Type::longrope;  // the factors are tensors (Model::set_context_length)
  } else {
    detail::fail(f.name(), ": key '", keys.name("rope.scaling.type"), "' = '", type, "': RoPE scaling of that type is ",
                 "not implemented for architecture '", arch_name(hp.arch), "' (none, linear and yarn are; longrope ",
                 "for llama and phi3)");
  }
  rs.n_ctx_orig = keys.count("rope.scaling.original_context_length", hp.n_ctx_train);
  (void)keys.value("rope.scaling.finetuned");  // informational
  // Keys llama.cpp does not read for these architectures: only the values it assumes are accepted.
  keys.expect_real("rope.scaling.yarn_beta_fast", rs.beta_fast, "a YaRN beta_fast");
  keys.expect_real("rope.scaling.yarn_beta_slow", rs.beta_slow, "a YaRN beta_slow");
  keys.expect_real("rope.scaling.yarn_log_multiplier", 0.0f, "a YaRN log multiplier");
  // The magnitude, as llama.cpp's context sets it: YaRN's cos/sin scale 1 + 0.1 ln(factor) (applied with the
  // angles, RopeTable::make) is cancelled here unless the factor is above 1 (its get_mscale).
  float attn = 1.0f;
  if (rs.ext_factor != 0.0f) {
    const float fac = 1.0f / rs.freq_scale;
    attn = (fac <= 1.0f ? 1.0f : 0.1f * std::log(fac) + 1.0f) * (1.0f / (1.0f + 0.1f * std::log(fac)));
  }
  rs.attn_factor = attn * keys.real("rope.scaling.attn_factor").value_or(1.0f);
}

// Windows, soft-caps, scales: what differs between the architectures beyond their tensors.
void read_arch(const gguf::File& f, Keys& keys, Hparams& hp) {
  // llama and phi3: a window is every layer's.
  if (hp.arch == Arch::llama || hp.arch == Arch::phi3 || hp.arch == Arch::gemma3)
    hp.n_swa = keys.count("attention.sliding_window", 0);
  if (hp.arch != Arch::gemma3) return;
  hp.act = Activation::gelu;
  hp.embd_scale = std::sqrt(float(hp.n_embd));
  hp.logit_softcap = keys.real("final_logit_softcapping").value_or(0.0f);
  hp.rope_base_swa = keys.real("rope.freq_base_swa").value_or(10000.0f);
  hp.swa_rope = true;
  // Sliding-window layers: a per-layer bool array, or a period (6 when absent).
  const gguf::Value* pattern = keys.value("attention.sliding_window_pattern");
  if (pattern != nullptr && pattern->is_array()) {
    CASCADE_CHECK(pattern->elem_type == gguf::ValueType::BOOL && int64_t(pattern->count) == hp.n_layer, f.name(),
                  ": key '", keys.name("attention.sliding_window_pattern"), "' must be ", hp.n_layer,
                  " bools (one per layer)");
    hp.swa_layers.assign(pattern->elems, pattern->elems + pattern->count);
  } else {
    hp.swa_period = keys.count("attention.sliding_window_pattern", 6);
  }
  // llama.cpp: 1/sqrt(head_dim), except for the 62-layer model (Gemma 3 27B), whose queries are scaled by
  // 1/sqrt(n_embd / n_head) (gemma_pytorch's query_pre_attn_scalar); the file says which only by its depth.
  hp.attn_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(float(hp.n_embd / hp.n_head))
                                   : 1.0f / std::sqrt(float(hp.head_dim));
}

// n_vocab: token_embd's rows, which the vocabulary and vocab_size (when present) must agree with.
void read_vocab(const gguf::File& f, Keys& keys, Hparams& hp) {
  const gguf::TensorInfo* embd = f.find_tensor("token_embd.weight");
  CASCADE_CHECK(embd != nullptr, f.name(), ": missing tensor 'token_embd.weight'");
  CASCADE_CHECK(embd->ne.size() == 2, f.name(), ": tensor 'token_embd.weight' has ", embd->ne.size(),
                " dimensions, expected [n_embd, n_vocab]");
  hp.n_vocab = embd->ne[1];
  // Token ids index token_embd's rows: a vocabulary (or vocab_size) of another length would let the tokenizer
  // make ids the model has no row for, or the model sample ids the tokenizer has no text for.
  const gguf::Value* tokens = f.find("tokenizer.ggml.tokens");
  if (tokens != nullptr && tokens->is_array())
    CASCADE_CHECK(int64_t(tokens->count) == hp.n_vocab, f.name(), ": the vocabulary has ", tokens->count,
                  " tokens but token_embd.weight has ", hp.n_vocab, " rows");
  if (keys.has("vocab_size")) {
    const int64_t n = keys.count("vocab_size");
    CASCADE_CHECK(n == hp.n_vocab, f.name(), ": ", keys.name("vocab_size"), " is ", n,
                  " but token_embd.weight has ", hp.n_vocab, " rows");
  }
}

}  // namespace

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
    case Arch::phi3: return "phi3";
    case Arch::gemma3: return "gemma3";
  }
  return "unknown";
}

Hparams Hparams::from_gguf(const gguf::File& f) {
  Hparams hp;
  hp.arch = parse_arch(f);
  Keys keys(f, arch_name(hp.arch));
  read_shape(f, keys, hp);
  read_rope(f, keys, hp);
  read_arch(f, keys, hp);
  read_vocab(f, keys, hp);
  (void)keys.value("tensor_data_layout");  // informational (old llama files)
  keys.check_all_read();
  if (const auto n = f.get_uint_opt("split.count"))
    CASCADE_CHECK(*n <= 1, f.name(), ": the model is split across ", *n, " files, which this runtime does not read");
  try {
    hp.validate();
  } catch (const Error& e) {
    detail::fail(f.name(), ": ", e.what());
  }
  return hp;
}

void Hparams::validate() const {
  CASCADE_CHECK(n_vocab <= INT32_MAX, "n_vocab ", n_vocab, " does not fit a token id (int32)");
  CASCADE_CHECK(n_vocab > 0 && n_embd > 0 && n_layer > 0 && n_ff > 0 && n_head > 0 && n_head_kv > 0 && head_dim > 0,
                "hyperparameters must be positive (n_vocab ", n_vocab, ", n_embd ", n_embd, ", n_layer ", n_layer,
                ", n_ff ", n_ff, ", n_head ", n_head, ", n_head_kv ", n_head_kv, ", head_dim ", head_dim, ")");
  CASCADE_CHECK(n_ctx_train > 0, "context_length must be positive (it is the default context)");
  CASCADE_CHECK(n_head % n_head_kv == 0, "head_count (", n_head, ") is not a multiple of head_count_kv (",
                n_head_kv, ")");
  CASCADE_CHECK(n_head * head_dim <= (int64_t(1) << 30), "head_count x head dim is out of range");
  CASCADE_CHECK(n_rot > 0 && n_rot <= head_dim && n_rot % 2 == 0, "rope.dimension_count ", n_rot,
                " must be even and in [2, head_dim = ", head_dim, "]");
  const auto positive = [](float v) { return std::isfinite(v) && v > 0; };
  CASCADE_CHECK(positive(rope_base) && positive(rope_base_swa), "rope.freq_base ", rope_base, " (sliding window: ",
                rope_base_swa, ") must be positive");
  CASCADE_CHECK(positive(rope_scaling.freq_scale) && std::isfinite(rope_scaling.attn_factor),
                "rope.scaling.factor ", 1.0f / rope_scaling.freq_scale, " must be positive, attn_factor finite");
  CASCADE_CHECK(rope_scaling.n_ctx_orig > 0, "rope.scaling.original_context_length must be positive");
  CASCADE_CHECK(std::isfinite(rms_eps) && rms_eps >= 0, "layer_norm_rms_epsilon ", rms_eps, " must be non-negative");
  CASCADE_CHECK(std::isfinite(attn_scale) && attn_scale >= 0, "attention scale ", attn_scale, " must be finite");
  CASCADE_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0, "final_logit_softcapping ", logit_softcap,
                " must be non-negative");
  CASCADE_CHECK(n_swa >= 0 && swa_period >= 0 && (swa_layers.empty() || int64_t(swa_layers.size()) == n_layer),
                "sliding window ", n_swa, " with a layer pattern of ", swa_layers.size(), " layers for ", n_layer);
}

RopeTable RopeTable::make(const Hparams& hp, float base, float freq_scale, const std::vector<float>& factors) {
  const RopeScaling& rs = hp.rope_scaling;
  const int64_t half = hp.n_rot / 2;
  // YaRN's correction range: the pairs that turn between beta_fast and beta_slow times over the original context
  // keep a mix of the scaled and unscaled angle (ggml_rope_yarn_corr_dims).
  const auto corr_dim = [&](float n_turns) {
    return float(hp.n_rot) * std::log(float(rs.n_ctx_orig) / (n_turns * 2.0f * float(M_PI))) /
           (2.0f * std::log(base));
  };
  const float lo = std::max(0.0f, std::floor(corr_dim(rs.beta_fast)));
  const float hi = std::min(float(hp.n_rot - 1), std::ceil(corr_dim(rs.beta_slow)));
  RopeTable t;
  t.freq.resize(size_t(half));
  for (int64_t i = 0; i < half; ++i) {
    double theta = std::pow(double(base), -2.0 * double(i) / double(hp.n_rot));
    if (!factors.empty()) theta /= double(factors[size_t(i)]);
    double mix = freq_scale;
    if (rs.ext_factor != 0.0f) {
      const float y = (float(i) - lo) / std::max(0.001f, hi - lo);
      const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * rs.ext_factor;
      mix = double(freq_scale) * (1.0 - ramp) + ramp;
    }
    t.freq[size_t(i)] = float(theta * mix);
  }
  t.mscale = rs.attn_factor;
  if (rs.ext_factor != 0.0f) t.mscale *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
  return t;
}

}  // namespace cascade::llama
