// The Llama-style model: hyperparameters, weights and the forward pass over one batch of tokens.
//
// Hyperparameters come from the `llama.*` keys of a GGUF file (FORMATS.md): counts may be u32 or u64,
// `head_count_kv` absent means head_count (no GQA), `rope.freq_base` absent means 10000,
// `rope.dimension_count` absent means the head dim.
//
// Weights stay as the file stores them (every type quant.hpp reads): a linear layer is a linear::Matrix viewing
// the tensor's bytes, (n_out, n_in) row-major as GGUF stores it, so y = W x is a dot of each row with x; a step's
// tokens are stacked into a matrix and multiplied at once, Y (n_tokens, n_out) = X (n_tokens, n_in) W^T
// (linear.hpp: activations quantized once per layer input, integer dot products). On the quantized path the
// quantized matrices are packed in blocks of 16 rows when the model loads (linear::pack: the same bytes, laid out
// for the products). The norm vectors are copied, as f32. The model keeps the bytes alive: the memory-mapped file
// itself and its packed matrices (load of a shared File, whose pages of the packed ones it drops), or one copy of
// the tensors (load of a File the caller keeps).
//
// The forward pass (per step, all rows of the step together):
//   x = token_embd[token]                                      (n, n_embd)
//   per layer: h = rmsnorm(x) * attn_norm
//              q = h Wq^T, k = h Wk^T, v = h Wv^T; RoPE on q and k (consecutive pairs, "normal" mode)
//              the cache stores k, v and runs attention (cascade / split / unified, kv_cache.hpp)
//              x += attn Wo^T
//              h = rmsnorm(x) * ffn_norm;  x += (silu(h Wgate^T) * (h Wup^T)) Wdown^T
//   logits = (rmsnorm(x) * output_norm) Woutput^T              only for the rows asked for
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

struct Hparams {
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;  // llama.context_length
  int64_t n_embd = 0;
  int64_t n_layer = 0;
  int64_t n_ff = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;  // n_embd / n_head
  int64_t n_rot = 0;     // rotated dims per head (<= head_dim, even)
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;

  HeadShape head_shape() const { return {int(n_head), int(n_head_kv), int(head_dim)}; }
  // Reads the keys (n_vocab from token_embd.weight); throws Error naming the key or the inconsistency.
  static Hparams from_gguf(const gguf::File& file);
  void validate() const;
};

using Linear = linear::Matrix;

// One transformer block (llama.cpp's llama_layer; the names are the GGUF tensor names without blk.N.).
struct Layer {
  std::vector<float> attn_norm;  // (n_embd)
  Linear wq;                     // (n_head * head_dim, n_embd)
  Linear wk, wv;                 // (n_head_kv * head_dim, n_embd)
  Linear wo;                     // (n_embd, n_head * head_dim)
  std::vector<float> ffn_norm;   // (n_embd)
  Linear ffn_gate, ffn_up;       // (n_ff, n_embd)
  Linear ffn_down;               // (n_embd, n_ff)
};

struct Weights {
  Linear tok_embd;                 // (n_vocab, n_embd): row t is token t's embedding
  std::vector<Layer> layers;
  std::vector<float> output_norm;  // (n_embd)
  Linear output;                   // (n_vocab, n_embd); empty when tied (tok_embd is used)
  bool tied = false;
  const Linear& lm_head() const { return tied ? tok_embd : output; }
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
  // Architecture "llama" only; shapes are checked against the hyperparameters (an Error names the tensor),
  // and a tensor of a type the runtime cannot read is an Error naming tensor and type.
  // This form copies the tensors' bytes (the File may go away); the shared form keeps the File and reads its
  // bytes in place (a memory-mapped file: no copy, pages touched once at load so the first step does not fault).
  static Model load(const gguf::File& file, LinearPath path = LinearPath::quantized);
  static Model load(std::shared_ptr<const gguf::File> file, LinearPath path = LinearPath::quantized);
  // Bytes the weights of a file take once loaded: the tensors' own.
  static uint64_t bytes_needed(const gguf::File& file);

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
  std::vector<float> inv_freq_;        // (n_rot / 2): base^(-2i / n_rot)
};

}  // namespace llama
}  // namespace cascade
