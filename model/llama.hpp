// The Llama-family models: hyperparameters, weights and the forward pass over one batch of tokens, for the
// architectures whose files llama.cpp runs with the same block (`general.architecture`):
//
//   llama   RMSNorm, RoPE on consecutive pairs, GQA, SwiGLU; optional Q/K/V, output-projection and FFN biases,
//           RoPE frequency factors (`rope_freqs.weight`, Llama 3.1's scaling), a sliding window (Mistral)
//   qwen2   llama's block with RoPE on halves ("neox"), Q/K/V biases, an optional output bias
//   qwen3   qwen2's block without biases, per-head RMSNorm of Q and K before RoPE
//   phi3    neox RoPE (possibly on part of each head), Q/K/V fused in one matrix, gate and up in one
//   gemma3  embeddings times sqrt(n_embd), norms after the attention and the FFN too, per-head Q/K norms,
//           GELU (tanh form), sliding-window layers with their own RoPE base, an optional final logit soft-cap
//
// Every key of the architecture (`ARCH.*`) and every tensor of the file is either used or refused by name: a
// file that loads is the model it describes, as llama.cpp reads it (model/hparams.cpp lists the keys; the
// oracle tests compare the logits with llama.cpp's on a tiny random file of each architecture, in several weight
// types).
//
// Hyperparameters: counts may be u32 or u64; `head_count_kv` absent means head_count (no GQA);
// `attention.key_length` (= `value_length`) absent means n_embd / n_head; `rope.dimension_count` absent means the
// head dim; `rope.freq_base` absent means 10000; `rope.scaling.type` none, linear or yarn with
// `rope.scaling.factor`, `rope.scaling.attn_factor` and `rope.scaling.original_context_length` (longrope, or phi3:
// long and short factor tensors).
//
// Weights stay as the file stores them (every type quant.hpp reads; Q5_0 matrices are widened to Q8_0 at load, the
// same values, since the linear layers have no Q5_0 product): a linear layer is a linear::Matrix viewing the
// tensor's bytes, (n_out, n_in) row-major as GGUF stores it, so y = W x is a dot of each row with x; a step's
// tokens are stacked into a matrix and multiplied at once, Y (n_tokens, n_out) = X (n_tokens, n_in) W^T
// (linear.hpp: activations quantized once per layer input, integer dot products). A fused matrix (phi3's QKV,
// gate-and-up) is viewed as its row blocks, one Matrix each. On the quantized path the quantized matrices are
// packed in blocks of 16 rows when the model loads (linear::pack: the same bytes, laid out for the products).
// Norm vectors and biases are copied, as f32. The model keeps the bytes alive: the memory-mapped file itself and
// its packed matrices (load of a shared File, whose pages of the packed ones it drops), or one copy of the
// tensors (load of a File the caller keeps).
//
// The forward pass (per step, all rows of the step together):
//   x = token_embd[token] * embd_scale                          (n, n_embd)
//   per layer: h = rmsnorm(x) * attn_norm
//              q = h Wq^T + bq, k = h Wk^T + bk, v = h Wv^T + bv
//              q, k = rmsnorm per head * attn_q_norm, attn_k_norm  (qwen3, gemma3)
//              RoPE on q and k (the layer's table: base, scaling, factors; pairs or halves)
//              the cache stores k, v and runs attention (cascade / split / unified, kv_cache.hpp)
//              a = attn Wo^T + bo;  a = rmsnorm(a) * attn_post_norm  (gemma3);  x += a
//              h = rmsnorm(x) * ffn_norm;  f = (act(h Wgate^T + bg) * (h Wup^T + bu)) Wdown^T + bd
//              f = rmsnorm(f) * ffn_post_norm  (gemma3);  x += f
//   logits = (rmsnorm(x) * output_norm) Woutput^T + b_output, soft-capped    only for the rows asked for
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cascade/plan.hpp"
#include "model/gguf.hpp"
#include "model/linear.hpp"

namespace cascade {

class KvCache;

namespace llama {

enum class Arch { llama, qwen2, qwen3, phi3, gemma3 };
const char* arch_name(Arch a);  // as in `general.architecture`

enum class Activation { silu, gelu };  // gelu: the tanh form, as llama.cpp's

// How RoPE turns a position into angles, as llama.cpp computes it (ggml's rope with YaRN): pair i of a layer is
// rotated by pos * base^(-2i / n_rot) / factor[i] (factor: rope_freqs.weight, else 1), mixed between that and
// freq_scale times it by YaRN's ramp over the pairs (ext_factor 0: freq_scale times it throughout), and cos and
// sin are multiplied by a magnitude (attn_factor, and YaRN's own).
struct RopeScaling {
  enum class Type { none, linear, yarn, longrope };  // longrope: factors for long and short contexts
  Type type = Type::none;
  float freq_scale = 1.0f;   // 1 / rope.scaling.factor (type none: 1)
  float ext_factor = 0.0f;   // 1 for yarn, else 0
  float attn_factor = 1.0f;  // magnitude of cos and sin before YaRN's own (rope.scaling.attn_factor, and yarn's)
  float beta_fast = 32.0f, beta_slow = 1.0f;  // YaRN's ramp, in rotations over the original context
  int64_t n_ctx_orig = 0;    // rope.scaling.original_context_length, else context_length
};

struct Hparams {
  Arch arch = Arch::llama;
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;  // ARCH.context_length
  int64_t n_embd = 0;
  int64_t n_layer = 0;
  int64_t n_ff = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;  // attention.key_length (= value_length), else n_embd / n_head
  int64_t n_rot = 0;     // rotated dims per head (<= head_dim, even)
  bool rope_neox = false;            // rotate (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1])
  float rope_base = 10000.0f;
  float rope_base_swa = 10000.0f;    // the sliding-window layers' base (gemma3: rope.freq_base_swa)
  RopeScaling rope_scaling;          // the full-attention layers' (the window layers' is unscaled)
  float rms_eps = 1e-5f;
  float attn_scale = 0.0f;           // the softmax scale: 0 for 1/sqrt(head_dim)
  float embd_scale = 1.0f;           // token embeddings are multiplied by it (gemma3: sqrt(n_embd))
  float logit_softcap = 0.0f;        // logits = c tanh(logits / c) where c > 0 (final_logit_softcapping)
  Activation act = Activation::silu;
  // Sliding window: a row sees its last n_swa keys; 0 for none. Read for llama and phi3 too, whose windows
  // llama.cpp does not apply (it runs those architectures with full attention whatever the file says).
  int64_t n_swa = 0;
  // Which layers attend within the window: those given by swa_layers ((n_layer), 1 for a windowed layer) when
  // the file lists them, else every layer but each swa_period-th (il % swa_period == swa_period - 1; 0: all).
  int64_t swa_period = 0;
  std::vector<uint8_t> swa_layers;
  bool swa_rope = false;             // the window layers rotate by rope_base_swa, unscaled (gemma3)

  bool is_swa(int64_t il) const {
    if (n_swa == 0) return false;
    if (!swa_layers.empty()) return swa_layers[size_t(il)] != 0;
    return swa_period == 0 || il % swa_period < swa_period - 1;
  }
  HeadShape head_shape() const { return {int(n_head), int(n_head_kv), int(head_dim)}; }
  // Reads the keys (n_vocab from token_embd.weight); throws Error naming the key or the inconsistency, a key
  // of the architecture that this runtime does not read included.
  static Hparams from_gguf(const gguf::File& file);
  void validate() const;
};

using Linear = linear::Matrix;

// One transformer block (llama.cpp's llama_layer; the names are the GGUF tensor names without blk.N.). A vector
// that is empty is absent from the file: an absent bias adds nothing, an absent norm is not applied.
struct Layer {
  std::vector<float> attn_norm;  // (n_embd)
  Linear wq;                     // (n_head * head_dim, n_embd)
  Linear wk, wv;                 // (n_head_kv * head_dim, n_embd)
  std::vector<float> bq, bk, bv; // attn_{q,k,v}.bias: (n_head * head_dim), (n_head_kv * head_dim) twice
  std::vector<float> attn_q_norm, attn_k_norm;  // (head_dim): qwen3, gemma3
  Linear wo;                     // (n_embd, n_head * head_dim)
  std::vector<float> bo;         // (n_embd): attn_output.bias (llama)
  std::vector<float> attn_post_norm;  // (n_embd): gemma3
  std::vector<float> ffn_norm;   // (n_embd)
  Linear ffn_gate, ffn_up;       // (n_ff, n_embd)
  Linear ffn_down;               // (n_embd, n_ff)
  std::vector<float> ffn_gate_b, ffn_up_b;  // (n_ff): llama
  std::vector<float> ffn_down_b;            // (n_embd): llama
  std::vector<float> ffn_post_norm;         // (n_embd): gemma3
};

struct Weights {
  Linear tok_embd;                 // (n_vocab, n_embd): row t is token t's embedding
  std::vector<Layer> layers;
  std::vector<float> output_norm;  // (n_embd)
  Linear output;                   // (n_vocab, n_embd); empty when tied (tok_embd is used)
  std::vector<float> output_b;     // (n_vocab): output.bias (qwen2)
  std::vector<float> rope_freqs;   // (n_rot / 2): rope_freqs.weight, the factors angles are divided by (llama)
  // (n_rot / 2): rope_factors_long.weight and rope_factors_short.weight (Phi-3's 128k models: phi3, and llama
  // with longrope scaling), the factors for contexts longer than the original one and for the others
  std::vector<float> rope_long, rope_short;
  bool tied = false;
  const Linear& lm_head() const { return tied ? tok_embd : output; }
};

// The angles of one RoPE table: pair i turns by pos * freq[i]; cos and sin are multiplied by mscale.
struct RopeTable {
  std::vector<float> freq;  // (n_rot / 2)
  float mscale = 1.0f;
  // The table of layers with this base and frequency scale (llama.cpp's rope with YaRN, RopeScaling above);
  // factors: empty, or (n_rot / 2) divisors of the angles.
  static RopeTable make(const Hparams& hp, float base, float freq_scale, const std::vector<float>& factors);
};

// Wall time spent in a forward pass, in seconds.
struct Timings {
  double total = 0;
  double attention = 0;  // the cache's attention calls only (KvCache::attend; not storing K/V)
};

// How the forward pass multiplies its linear layers.
enum class LinearPath {
  quantized,  // linear.hpp: activations quantized once per layer input, integer dot products (the default)
  f32,        // weights dequantized tile by tile, f32 activations: the reference the quantized path is checked with
};

class Model {
 public:
  // The architectures above; shapes are checked against the hyperparameters (an Error names the tensor), a
  // tensor of a type the runtime cannot read is an Error naming tensor and type, and so is a tensor of the file
  // this runtime does not use.
  // This form copies the tensors' bytes (the File may go away); the shared form keeps the File and reads its
  // bytes in place (a memory-mapped file: no copy, pages touched once at load so the first step does not fault).
  static Model load(const gguf::File& file, LinearPath path = LinearPath::quantized);
  static Model load(std::shared_ptr<const gguf::File> file, LinearPath path = LinearPath::quantized);
  // Bytes the weights of a file take once loaded: the tensors' own, and a Q8_0 copy of each Q5_0 one.
  static uint64_t bytes_needed(const gguf::File& file);

  // RoPE factors chosen for a context of n_ctx tokens per sequence, as llama.cpp chooses them: the long ones when
  // n_ctx exceeds the original context (rope.scaling.original_context_length), else the short ones. load chooses
  // for n_ctx_train, which is llama.cpp's default context. Only models with both sets depend on it. Not to be
  // called while a forward pass runs.
  void set_context_length(int64_t n_ctx);
  int64_t context_length() const { return n_ctx_; }

  const Hparams& hparams() const { return hp_; }
  const Weights& weights() const { return w_; }
  LinearPath linear_path() const { return path_; }
  size_t weight_bytes() const;  // the matrices' bytes (as stored) plus the f32 norms

  // Runs tokens[0..n) at positions pos[0..n) through the model. The cache's current step (begin_step)
  // must describe exactly these rows, in this order. logits: (logit_rows.size(), n_vocab), row j for
  // token logit_rows[j]. Timings are added to *t when given.
  void forward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& pos, KvCache& cache,
               const std::vector<int64_t>& logit_rows, std::vector<float>& logits, Timings* t = nullptr) const;

 private:
  static Model load_from(const gguf::File& file, const uint8_t* base, LinearPath path);
  Hparams hp_;
  Weights w_;
  LinearPath path_ = LinearPath::quantized;
  std::shared_ptr<const void> bytes_;  // what the matrices view: the File, or a copy of its tensors
  std::shared_ptr<const void> widened_;  // and the Q5_0 matrices widened to Q8_0 (Tensors::rows)
  RopeTable rope_, rope_swa_;          // for the full-attention layers, for the sliding-window layers
  int64_t n_ctx_ = 0;                  // the context the RoPE factors were chosen for
};

}  // namespace llama
}  // namespace cascade
