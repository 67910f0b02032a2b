// Bytes -> gguf::File -> what cascade-generate makes of a model file before it generates: the vocabulary
// (load_vocab, Tokenizer), the weights (llama::Model::load, any architecture it runs: views of the file's own
// blocks, the keys of the architecture) and the chat template.
// cascade::Error is a fine answer to a bad file; a crash, UB, an allocation past libFuzzer's limit or another
// exception is not, and neither is a model that loads but is not the model its file describes:
//   - every weight has the shape the hyperparameters promise (rows, columns, bytes of its blocks; optional
//     biases and norms absent or of their length), and the hyperparameters validate;
//   - the tokenizer, when the file has one, has as many tokens as token_embd has rows;
//   - small models only (kMaxWeights): every matrix multiplied on the linear path the CPU runs agrees with
//     linear::reference within its bound (where the file's scales keep the numbers finite), and one forward
//     pass of two tokens (the first and the last id) through a TreeCache gives one row of n_vocab logits, on
//     the quantized and on the f32 path.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/linear.hpp"
#include "model/llama.hpp"
#include "model/quant.hpp"
#include "model/tokenizer.hpp"
#include "one_thread.hpp"

namespace {

using namespace cascade;
using llama::Hparams;
using llama::Linear;
using llama::Model;

// Budgets per input: weights (values) of a model whose matrices are checked and which is run twice; context length
// is free.
constexpr int64_t kMaxWeights = int64_t(1) << 18;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_model: %s\n", what.c_str());
  std::abort();
}

volatile uint64_t g_sink;  // keeps results from being optimized away

void check_linear(const Linear& l, int64_t n_in, int64_t n_out, const std::string& name) {
  if (l.n_in != n_in || l.n_out != n_out) fail(name + ": shape differs from the hyperparameters");
  if (!gguf::can_dequantize(l.type)) fail(name + ": a type the runtime does not read was loaded");
  if (l.row_bytes != gguf::row_bytes(l.type, n_in) || l.data == nullptr) fail(name + ": rows of the wrong size");
}

void check_vector(const std::vector<float>& v, int64_t n, const std::string& name) {
  if (int64_t(v.size()) != n) fail(name + ": length differs from the hyperparameters");
}

// An optional vector (a bias, a norm some architectures have): absent, or of its length.
void check_optional(const std::vector<float>& v, int64_t n, const std::string& name) {
  if (!v.empty()) check_vector(v, n, name);
}

// Every weight has the shape Hparams promise; returns the number of weight values.
int64_t check_shapes(const Model& m) {
  const Hparams& hp = m.hparams();
  try {
    hp.validate();
  } catch (const Error& e) {
    fail(std::string("a loaded model's hyperparameters do not validate: ") + e.what());
  }
  const llama::Weights& w = m.weights();
  const int64_t d = hp.n_embd, dq = hp.n_head * hp.head_dim, dkv = hp.n_head_kv * hp.head_dim;
  if (hp.n_vocab > INT32_MAX) fail("n_vocab does not fit a token id");
  check_linear(w.tok_embd, d, hp.n_vocab, "token_embd");
  check_vector(w.output_norm, d, "output_norm");
  if (!w.tied) check_linear(w.output, d, hp.n_vocab, "output");
  check_optional(w.output_b, hp.n_vocab, "output.bias");
  check_optional(w.rope_freqs, hp.n_rot / 2, "rope_freqs");
  check_optional(w.rope_long, hp.n_rot / 2, "rope_factors_long");
  check_optional(w.rope_short, hp.n_rot / 2, "rope_factors_short");
  if (int64_t(w.layers.size()) != hp.n_layer) fail("layer count differs from block_count");
  for (const llama::Layer& l : w.layers) {
    check_vector(l.attn_norm, d, "attn_norm");
    check_vector(l.ffn_norm, d, "ffn_norm");
    check_linear(l.wq, d, dq, "attn_q");
    check_linear(l.wk, d, dkv, "attn_k");
    check_linear(l.wv, d, dkv, "attn_v");
    check_linear(l.wo, dq, d, "attn_output");
    check_linear(l.ffn_gate, d, hp.n_ff, "ffn_gate");
    check_linear(l.ffn_up, d, hp.n_ff, "ffn_up");
    check_linear(l.ffn_down, hp.n_ff, d, "ffn_down");
    check_optional(l.bq, dq, "attn_q.bias");
    check_optional(l.bk, dkv, "attn_k.bias");
    check_optional(l.bv, dkv, "attn_v.bias");
    check_optional(l.attn_q_norm, hp.head_dim, "attn_q_norm");
    check_optional(l.attn_k_norm, hp.head_dim, "attn_k_norm");
    if (l.attn_q_norm.empty() != l.attn_k_norm.empty()) fail("one of attn_q_norm and attn_k_norm alone");
    check_optional(l.bo, d, "attn_output.bias");
    check_optional(l.attn_post_norm, d, "post_attention_norm");
    check_optional(l.ffn_gate_b, hp.n_ff, "ffn_gate.bias");
    check_optional(l.ffn_up_b, hp.n_ff, "ffn_up.bias");
    check_optional(l.ffn_down_b, d, "ffn_down.bias");
    check_optional(l.ffn_post_norm, d, "post_ffw_norm");
  }
  const int64_t per_layer = 2 * d + 2 * d * dq + 2 * d * dkv + 3 * d * hp.n_ff;
  return d * hp.n_vocab * (w.tied ? 1 : 2) + d + hp.n_layer * per_layer;
}

// X W^T on the CPU's linear path against linear::reference, for two rows of X of moderate values and two of the
// same times 2^-140, 2^-120, 2^-60 or 2^20 per block of 32 (subnormal, tiny and large activations); outputs whose
// reference or bound is not finite or beyond 1e30 (the file's scales may be anything) are skipped.
void check_product(const Linear& w, const std::string& name) {
  const int64_t n = 4;
  std::vector<float> x(size_t(n * w.n_in));
  const int exps[] = {-140, -120, -60, 20};
  for (size_t i = 0; i < x.size(); ++i) {
    const float v = float(int(i * 37 % 19) - 9) * 0.125f;
    x[i] = i < size_t(2 * w.n_in) ? v : std::ldexp(v, exps[(i / 32) % 4]);
  }
  const linear::Input in(x.data(), n, w.n_in);
  std::vector<float> y(size_t(n * w.n_out));
  linear::matmul(w, in, y.data());
  std::vector<double> ref, bound;
  linear::reference(w, in, linear::active_path(), ref, bound);
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(ref[i]) || !std::isfinite(bound[i]) || std::fabs(ref[i]) + bound[i] > 1e30) continue;
    if (!(std::fabs(double(y[i]) - ref[i]) <= bound[i])) {
      char buf[256];
      std::snprintf(buf, sizeof buf, ": %s %lld x %lld on %s, output %zu: %.9g, reference %.17g, bound %.3g",
                    gguf::type_name(w.type), (long long)w.n_out, (long long)w.n_in,
                    linear::path_name(linear::active_path()), i, double(y[i]), ref[i], bound[i]);
      fail(name + ": a product outside its bound" + buf);
    }
  }
}

void check_products(const Model& m) {
  const llama::Weights& w = m.weights();
  check_product(w.tok_embd, "token_embd");
  if (!w.tied) check_product(w.output, "output");
  for (const llama::Layer& l : w.layers) {
    check_product(l.wq, "attn_q");
    check_product(l.wk, "attn_k");
    check_product(l.wv, "attn_v");
    check_product(l.wo, "attn_output");
    check_product(l.ffn_gate, "ffn_gate");
    check_product(l.ffn_up, "ffn_up");
    check_product(l.ffn_down, "ffn_down");
  }
}

// Prefill of the first and the last token id at positions 0 and 1, logits for the last (a model whose window is
// shorter than that refuses the second with an Error).
void run_forward(const Model& m) {
  const Hparams& hp = m.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
  const int seg = cache.add_segment(-1, 0);
  cache.begin_step({{seg, 2, 0}});
  std::vector<float> logits;
  m.forward({0, int32_t(hp.n_vocab - 1)}, {0, 1}, cache, {1}, logits);
  if (int64_t(logits.size()) != hp.n_vocab) fail("forward gave the wrong number of logits");
  g_sink = g_sink + uint64_t(std::isfinite(logits.back()));
}

// The vocabulary as cascade-generate uses it: encode a prompt (with and without the chat template), decode.
void run_tokenizer(const Tokenizer& tok) {
  const std::string text = "Hello world, 123! caf\xc3\xa9";
  std::vector<int32_t> ids = tok.encode(text, true, false);
  g_sink = g_sink + tok.decode(ids, false).size();
  const std::string& tmpl = tok.vocab().chat_template;
  if (tmpl.empty()) return;
  try {
    const std::string chat = apply_chat_template(tmpl, {{"user", text}}, true);
    ids = tok.encode(chat, true, true);
    g_sink = g_sink + tok.decode(ids, true).size();
  } catch (const Error&) {  // a template in no format the runtime knows
  }
}

}  // namespace

// The attention's work items keep per-thread scratch in a static enumerable_thread_specific, whose elements live
// in memory oneTBB takes from its own allocator (libtbbmalloc), which LeakSanitizer does not scan: libFuzzer's
// per-input leak check would report the scratch's buffers as lost. Only allocations made inside that item loop
// are exempt, as in fuzz_plan.cpp; scripts/sanitize.sh still checks them at exit.
extern "C" const char* __lsan_default_suppressions() { return "leak:cascade::cpu::detail::run_items\n"; }

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz_on_one_thread();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);  // exact size: ASan sees any read past the file's end
  try {
    const gguf::File file = gguf::File::from_bytes(std::move(bytes), "fuzz.gguf");
    std::unique_ptr<Tokenizer> tok;
    if (file.find("tokenizer.ggml.model")) {
      try {
        tok = std::make_unique<Tokenizer>(load_vocab(file));
        run_tokenizer(*tok);
      } catch (const Error&) {
        tok.reset();
      }
    }
    const Model m = Model::load(file);
    const int64_t n_weights = check_shapes(m);
    if (tok && tok->n_vocab() != m.hparams().n_vocab) fail("the tokenizer and token_embd differ in vocabulary size");
    if (n_weights <= kMaxWeights) {
      check_products(m);
      run_forward(m);
      run_forward(Model::load(file, llama::LinearPath::f32));
    }
  } catch (const Error&) {
  }
  return 0;
}
