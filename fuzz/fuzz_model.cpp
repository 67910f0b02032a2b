// Bytes -> gguf::File -> what cascade-generate makes of a model file before it generates: the vocabulary
// (load_vocab, Tokenizer), the weights (llama::Model::load, Q8_0/Q4_1 kept in their blocks) and the chat template.
// cascade::Error is a fine answer to a bad file; a crash, UB, an allocation past libFuzzer's limit or another
// exception is not, and neither is a model that loads but is not the model its file describes:
//   - every weight has the shape the hyperparameters promise (rows, columns, bytes of the kept blocks);
//   - the tokenizer, when the file has one, has as many tokens as token_embd has rows;
//   - small models only (kMaxWeights): loaded again as all-f32, every row of a kept matrix dequantizes to the
//     f32 model's row, and one forward pass of two tokens (the first and the last id) through a TreeCache gives
//     one row of n_vocab logits.
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
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace {

using namespace cascade;
using llama::Hparams;
using llama::Linear;
using llama::Model;

// Budgets per input: weights (values) of a model that is loaded twice and run; context length is free.
constexpr int64_t kMaxWeights = int64_t(1) << 18;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_model: %s\n", what.c_str());
  std::abort();
}

volatile uint64_t g_sink;  // keeps results from being optimized away

void check_linear(const Linear& l, int64_t n_in, int64_t n_out, const std::string& name) {
  if (l.n_in != n_in || l.n_out != n_out) fail(name + ": shape differs from the hyperparameters");
  if (l.type == gguf::TensorType::F32) {
    if (int64_t(l.w.size()) != n_in * n_out || !l.q.empty()) fail(name + ": f32 weights of the wrong size");
  } else {
    if (l.type != gguf::TensorType::Q8_0 && l.type != gguf::TensorType::Q4_1) fail(name + ": a type not kept");
    if (l.row_bytes != gguf::row_bytes(l.type, n_in) || l.q.size() != l.row_bytes * uint64_t(n_out) || !l.w.empty())
      fail(name + ": kept blocks of the wrong size");
  }
}

void check_vector(const std::vector<float>& v, int64_t n, const std::string& name) {
  if (int64_t(v.size()) != n) fail(name + ": length differs from the hyperparameters");
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
  }
  const int64_t per_layer = 2 * d + 2 * d * dq + 2 * d * dkv + 3 * d * hp.n_ff;
  return d * hp.n_vocab * (w.tied ? 1 : 2) + d + hp.n_layer * per_layer;
}

// Row by row, a kept matrix and the same tensor loaded as f32 agree (both dequantize the same blocks; the
// kept path may fuse d * q + m, so within a few ulps of the row's largest value).
void check_same(const Linear& kept, const Linear& f32, const std::string& name) {
  if (f32.type != gguf::TensorType::F32 || f32.n_in != kept.n_in || f32.n_out != kept.n_out)
    fail(name + ": the all-f32 load differs in type or shape");
  std::vector<float> row(size_t(kept.n_in));
  for (int64_t i = 0; i < kept.n_out; ++i) {
    kept.row(i, row.data());
    const float* ref = f32.w.data() + i * kept.n_in;
    float big = 0;
    bool finite = true;
    for (int64_t j = 0; j < kept.n_in; ++j) {
      finite = finite && std::isfinite(ref[j]) && std::isfinite(row[size_t(j)]);
      big = std::max(big, std::fabs(ref[j]));
    }
    if (!finite) continue;  // inf/NaN scales: no tolerance to speak of
    for (int64_t j = 0; j < kept.n_in; ++j)
      if (std::fabs(row[size_t(j)] - ref[j]) > 1e-6f * big)
        fail(name + ": a kept row dequantizes differently from the all-f32 load");
  }
}

void check_against_f32(const Model& m, const gguf::File& file) {
  std::optional<Model> f;
  try {
    f = Model::load(file, false);
  } catch (const Error& e) {
    fail(std::string("loads with blocks kept but not as all-f32: ") + e.what());
  }
  const llama::Weights &a = m.weights(), &b = f->weights();
  check_same(a.tok_embd, b.tok_embd, "token_embd");
  if (a.tied != b.tied) fail("tied differs between the two loads");
  if (!a.tied) check_same(a.output, b.output, "output");
  for (size_t il = 0; il < a.layers.size(); ++il) {
    const llama::Layer &x = a.layers[il], &y = b.layers[il];
    check_same(x.wq, y.wq, "attn_q");
    check_same(x.wk, y.wk, "attn_k");
    check_same(x.wv, y.wv, "attn_v");
    check_same(x.wo, y.wo, "attn_output");
    check_same(x.ffn_gate, y.ffn_gate, "ffn_gate");
    check_same(x.ffn_up, y.ffn_up, "ffn_up");
    check_same(x.ffn_down, y.ffn_down, "ffn_down");
  }
}

// Prefill of the first and the last token id at positions 0 and 1, logits for the last.
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
      check_against_f32(m, file);
      run_forward(m);
    }
  } catch (const Error&) {
  }
  return 0;
}
