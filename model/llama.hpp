// The Llama-style model: hyperparameters, weights and the forward pass over one batch of tokens.
//
// Hyperparameters come from the `llama.*` keys of a GGUF file (FORMATS.md): counts may be u32 or u64,
// `head_count_kv` absent means head_count (no GQA), `rope.freq_base` absent means 10000,
// `rope.dimension_count` absent means the head dim.
//
// Weights: Q8_0 and Q4_1 matrices stay in their blocks (decode is memory-bound), every other supported type
// (quant.hpp) is dequantized to f32 at load; Model::load(file, false) makes everything f32. A linear layer is
// stored as GGUF stores it: (n_out, n_in) row-major, so y = W x is a dot of each row with x; a step's
// tokens are stacked into a matrix and multiplied at once, Y (n_tokens, n_out) = X (n_tokens, n_in) W^T.
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
#include <string>
#include <vector>

#include "cascade/plan.hpp"
#include "model/gguf.hpp"

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

// A linear layer, y = W x, W (n_out, n_in) row-major. Stored either as f32 (w) or, for Q8_0 and Q4_1
// tensors when the model is loaded with keep_quantized, as the file's blocks (q: n_out rows of row_bytes):
// decode is memory-bound, and those blocks are 3.8x (Q8_0) and 6.4x (Q4_1) smaller than f32.
struct Linear {
  int64_t n_in = 0, n_out = 0;
  gguf::TensorType type = gguf::TensorType::F32;  // F32 (w) or Q8_0 / Q4_1 (q)
  std::vector<float> w;
  std::vector<uint8_t> q;
  uint64_t row_bytes = 0;
  void row(int64_t i, float* out) const;  // dequantizes row i into out (n_in floats)
  size_t bytes() const { return w.size() * sizeof(float) + q.size(); }
};

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

class Model {
 public:
  // Architecture "llama" only; shapes are checked against the hyperparameters (an Error names the tensor),
  // and a tensor of a type that cannot be dequantized is an Error naming tensor and type.
  // keep_quantized: Q8_0 and Q4_1 matrices stay in their blocks (see Linear); else all are f32.
  static Model load(const gguf::File& file, bool keep_quantized = true);

  const Hparams& hparams() const { return hp_; }
  const Weights& weights() const { return w_; }
  size_t weight_bytes() const;

  // Runs tokens[0..n) at positions pos[0..n) through the model. The cache's current step (begin_step)
  // must describe exactly these rows, in this order. logits: (logit_rows.size(), n_vocab), row j for
  // token logit_rows[j]. Timings are added to *t when given.
  void forward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& pos, KvCache& cache,
               const std::vector<int64_t>& logit_rows, std::vector<float>& logits, Timings* t = nullptr) const;

 private:
  Hparams hp_;
  Weights w_;
  std::vector<float> inv_freq_;  // (n_rot / 2): base^(-2i / n_rot)
};

// Y (n, W.n_out) = X (n, W.n_in) W^T, row-major; the output rows of W are split across the current
// oneTBB arena's threads. Eigen runs single-threaded inside each block: the project builds without OpenMP,
// so Eigen::setNbThreads has no effect, and nesting Eigen's threads under oneTBB's would oversubscribe.
// Quantized W: few rows (decode) take a fused dequantize-and-dot over all rows of X at once (each block is
// read once per step); many rows (prefill) dequantize tiles of W for Eigen.
void linear(const Linear& W, const float* X, int64_t n, float* Y);

}  // namespace llama
}  // namespace cascade
