// The architectures' loaders (model/hparams.cpp, model/llama.cpp): what they read from the keys, what they refuse,
// and hostile copies of the oracle files (tests/data/oracle) with one tensor removed, renamed or added, which must
// give one error line naming the tensor, or load as the model the changed file describes.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/llama.hpp"
#include "oracle/tiny_models.hpp"
#include "tool_run.hpp"

namespace test_models {

using namespace cascade;
using gguf::TensorType;
using oracle::TinySpec;

namespace {

const std::string kDir = std::string(CASCADE_TESTDATA_DIR) + "/oracle/";

// A copy of f: keys through edit_key (return false to drop one; it may set others on w), tensors through
// edit_tensor (return false to drop; it may rename), then the extra tensors.
struct Extra {
  std::string name;
  std::vector<int64_t> ne;
};
using KeyEdit = std::function<bool(gguf::Writer&, const gguf::KeyValue&)>;
using TensorEdit = std::function<bool(std::string&)>;
std::vector<uint8_t> rewrite(const gguf::File& f, const KeyEdit& edit_key, const TensorEdit& edit_tensor,
                             const std::vector<Extra>& extra = {}) {
  gguf::Writer w;
  for (const gguf::KeyValue& kv : f.kvs())
    if (!edit_key || edit_key(w, kv)) w.set_value(kv.key, kv.value);
  for (const gguf::TensorInfo& t : f.tensors()) {
    std::string name = t.name;
    if (!edit_tensor || edit_tensor(name)) w.add_tensor(name, t.type, t.ne, f.tensor_data(t));
  }
  for (const Extra& e : extra) {
    int64_t n = 1;
    for (int64_t d : e.ne) n *= d;
    const std::vector<float> zeros(size_t(n), 0.25f);
    w.add_tensor(e.name, TensorType::F32, e.ne, zeros.data());
  }
  return w.to_bytes();
}

// The error of loading bytes, or "" when they load.
std::string load_error(std::vector<uint8_t> bytes) {
  try {
    const gguf::File f = gguf::File::from_bytes(std::move(bytes), "changed.gguf");
    (void)llama::Model::load(f);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string spec_error(const TinySpec& s, const KeyEdit& edit_key) {
  const gguf::File f = gguf::File::from_bytes(oracle::write_tiny(s), "tiny.gguf");
  return load_error(rewrite(f, edit_key, nullptr));
}

// Sets key k to a u32 (replacing it, or adding it after the architecture).
KeyEdit set_u32(const std::string& k, uint32_t v) {
  return [k, v](gguf::Writer& w, const gguf::KeyValue& kv) {
    if (kv.key == "general.architecture") w.set_value(kv.key, kv.value), w.set_u32(k, v);
    return kv.key != k && kv.key != "general.architecture";
  };
}

// Adds a key after the architecture (set: what to set on the writer).
KeyEdit add_key(std::function<void(gguf::Writer&)> set) {
  return [set](gguf::Writer& w, const gguf::KeyValue& kv) {
    if (kv.key == "general.architecture") w.set_value(kv.key, kv.value), set(w);
    return kv.key != "general.architecture";
  };
}

std::vector<float> first_logits(const gguf::File& f) {
  const llama::Model m = llama::Model::load(f, llama::LinearPath::f32);
  TreeCache cache(int(m.hparams().n_layer), m.hparams().head_shape(), DType::f32);
  const int seg = cache.add_segment(-1, 0);
  cache.begin_step({{seg, 3, 0}});
  std::vector<float> logits;
  m.forward({1, 5, 7}, {0, 1, 2}, cache, {2}, logits);
  return logits;
}

// Tensors an architecture may go without: the output (tied to the embeddings), biases, RoPE factors.
bool optional_tensor(const std::string& name) {
  return name == "output.weight" || name == "rope_freqs.weight" || name.rfind("rope_factors_", 0) == 0 ||
         (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0);
}

}  // namespace

// Every oracle file, every tensor.
TEST_CASE("models: an oracle file with one tensor removed, renamed or added is one error naming it, or its model") {
  int n_files = 0, n_changes = 0;
  for (const oracle::TinySpec& spec : oracle::oracle_specs()) {
    const std::string& name = spec.name;
    CAPTURE(name);
    const gguf::File f = gguf::File::open(kDir + name + ".gguf");
    const std::vector<float> original = first_logits(f);
    // Long or short RoPE factors: only the set the training context takes changes the logits.
    const llama::Model m = llama::Model::load(f);
    const bool long_ctx = m.context_length() > m.hparams().rope_scaling.n_ctx_orig;
    const auto in_use = [&](const std::string& n) {
      return n != (long_ctx ? "rope_factors_short.weight" : "rope_factors_long.weight");
    };
    ++n_files;
    for (const gguf::TensorInfo& t : f.tensors()) {
      CAPTURE(t.name);
      const std::string removed = load_error(rewrite(f, nullptr, [&](std::string& n) { return n != t.name; }));
      const std::string renamed_to = t.name + ".old";
      const std::string renamed = load_error(rewrite(f, nullptr, [&](std::string& n) {
        if (n == t.name) n = renamed_to;
        return true;
      }));
      n_changes += 2;
      CAPTURE(removed);
      CAPTURE(renamed);
      CHECK(removed.find('\n') == std::string::npos);
      CHECK(renamed.find('\n') == std::string::npos);
      if (optional_tensor(t.name)) {
        // The changed file is another model (no bias, tied output, no factors): it loads as that model.
        CHECK(removed.empty());
        CHECK(renamed.find("tensor '" + renamed_to + "' is not used") != std::string::npos);
        const gguf::File g = gguf::File::from_bytes(rewrite(f, nullptr, [&](std::string& n) { return n != t.name; }));
        if (in_use(t.name)) CHECK(first_logits(g) != original);
      } else {
        for (const std::string& e : {removed, renamed}) {
          CHECK(e.find("missing tensor '") != std::string::npos);
          CHECK(e.find("'" + t.name + "'") != std::string::npos);
        }
      }
    }
    // Tensors that the architecture does not have (another's, experts', or nobody's) are refused by name.
    const std::string arch(f.architecture());
    std::vector<std::string> foreign = {"blk.0.attn_extra.weight", "blk.0.ffn_gate_inp.weight",
                                        "blk.9.attn_norm.weight"};
    if (arch != "phi3") foreign.push_back("rope_factors_long.weight");
    if (arch != "qwen3" && arch != "gemma3") foreign.push_back("blk.0.attn_q_norm.weight");
    if (arch != "gemma3") foreign.push_back("blk.1.post_ffw_norm.weight");
    if (arch != "llama") foreign.push_back("blk.0.attn_output.bias"), foreign.push_back("rope_freqs.weight");
    if (arch != "qwen2") foreign.push_back("output.bias");
    for (const std::string& extra : foreign) {
      if (f.find_tensor(extra) != nullptr) continue;
      CAPTURE(extra);
      const std::string e = load_error(rewrite(f, nullptr, nullptr, {{extra, {4}}}));
      ++n_changes;
      CHECK(e.find("tensor '" + extra + "' is not used by this runtime") != std::string::npos);
      CHECK(e.find('\n') == std::string::npos);
    }
  }
  MESSAGE(n_changes << " changed copies of " << n_files << " files");
}

TEST_CASE("models: what each architecture reads from its keys") {
  SUBCASE("llama: RoPE factors from rope_freqs.weight, untied output, key_length") {
    const gguf::File f = gguf::File::open(kDir + "llama3-f16.gguf");
    const llama::Model m = llama::Model::load(f);
    CHECK(m.hparams().arch == llama::Arch::llama);
    CHECK(!m.hparams().rope_neox);
    CHECK(m.hparams().head_dim == 32);
    CHECK(m.weights().rope_freqs.size() == 16);
    CHECK(m.weights().rope_freqs.back() == 8.0f);
    CHECK(!m.weights().tied);
  }
  SUBCASE("yarn: the ramp's frequency mix and the magnitude") {
    const gguf::File f = gguf::File::open(kDir + "llama-yarn-f32.gguf");
    const llama::Hparams hp = llama::Hparams::from_gguf(f);
    CHECK(hp.rope_scaling.type == llama::RopeScaling::Type::yarn);
    CHECK(hp.rope_scaling.freq_scale == 0.25f);
    CHECK(hp.rope_scaling.ext_factor == 1.0f);
    CHECK(hp.rope_scaling.n_ctx_orig == 32);
    const llama::RopeTable t = llama::RopeTable::make(hp, hp.rope_base, hp.rope_scaling.freq_scale, {});
    // mscale = attn_factor (1.25) times YaRN's 1 + 0.1 ln 4, its cancellation undone by the factor above 1.
    CHECK(t.mscale == doctest::Approx(1.25 * (1 + 0.1 * std::log(4.0))).epsilon(1e-6));
    CHECK(t.freq[0] == doctest::Approx(1.0));  // below the ramp's start: unscaled
    CHECK(t.freq.back() == doctest::Approx(0.25 * std::pow(1000.0, -14.0 / 16)).epsilon(1e-6));  // scaled
  }
  SUBCASE("gemma3: window layers, their RoPE base, scales, soft-cap") {
    const gguf::File f = gguf::File::open(kDir + "gemma3-f16.gguf");
    const llama::Hparams hp = llama::Hparams::from_gguf(f);
    CHECK(hp.rope_neox);
    CHECK(hp.n_swa == 12);
    CHECK(hp.is_swa(0));
    CHECK(!hp.is_swa(1));
    CHECK(hp.swa_rope);
    CHECK(hp.rope_base_swa == 100.0f);
    CHECK(hp.rope_scaling.freq_scale == 0.25f);
    CHECK(hp.embd_scale == doctest::Approx(std::sqrt(32.0)));
    CHECK(hp.attn_scale == doctest::Approx(1 / std::sqrt(32.0)));
    CHECK(hp.logit_softcap == 5.0f);
    CHECK(hp.act == llama::Activation::gelu);
  }
  SUBCASE("gemma3: the window pattern as one bool per layer; the 62-layer model's attention scale") {
    TinySpec s = oracle::tiny_spec("g", "gemma3", "f32");
    s.n_swa = 4;
    const gguf::File f = gguf::File::from_bytes(oracle::write_tiny(s));
    const bool pattern[2] = {false, true};
    const auto bytes = rewrite(f, [&](gguf::Writer& w, const gguf::KeyValue& kv) {
      if (kv.key == "general.architecture")
        w.set_array("gemma3.attention.sliding_window_pattern", gguf::ValueType::BOOL, pattern, 2);
      return true;
    }, nullptr);
    const llama::Hparams hp = llama::Hparams::from_gguf(gguf::File::from_bytes(bytes));
    CHECK(!hp.is_swa(0));
    CHECK(hp.is_swa(1));
    CHECK(hp.swa_rope);
    // Without a pattern key: every sixth layer is global.
    TinySpec deep = s;
    deep.n_layer = 62;
    deep.n_embd = 16, deep.n_ff = 32, deep.head_dim = 4, deep.n_head = 2;
    const llama::Hparams h62 = llama::Hparams::from_gguf(gguf::File::from_bytes(oracle::write_tiny(deep)));
    CHECK(h62.is_swa(0));
    CHECK(!h62.is_swa(5));
    CHECK(h62.is_swa(6));
    CHECK(h62.attn_scale == doctest::Approx(1 / std::sqrt(8.0)));  // 1/sqrt(n_embd / n_head), not of the head dim
  }
  SUBCASE("phi3: long or short RoPE factors, chosen by the context length against the original context (64)") {
    const gguf::File f = gguf::File::open(kDir + "phi3-longrope-f32.gguf");
    llama::Model m = llama::Model::load(f, llama::LinearPath::f32);
    CHECK(m.context_length() == 256);  // the training context, llama.cpp's default
    CHECK(m.hparams().rope_scaling.attn_factor == doctest::Approx(1.19));
    const llama::Hparams& hp = m.hparams();
    const std::vector<float> long_angles = first_logits(f);
    for (int64_t n_ctx : {64, 65}) {
      m.set_context_length(n_ctx);
      const std::vector<float>& factors = n_ctx > 64 ? m.weights().rope_long : m.weights().rope_short;
      CHECK(factors.size() == size_t(hp.n_rot / 2));
      TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
      const int seg = cache.add_segment(-1, 0);
      cache.begin_step({{seg, 3, 0}});
      std::vector<float> logits;
      m.forward({1, 5, 7}, {0, 1, 2}, cache, {2}, logits);
      CHECK((logits == long_angles) == (n_ctx > 64));
    }
  }
  SUBCASE("qwen3 and phi3: head dims from key_length, RoPE on part of the head") {
    CHECK(llama::Hparams::from_gguf(gguf::File::open(kDir + "qwen3-f32.gguf")).head_dim == 32);
    const llama::Hparams phi = llama::Hparams::from_gguf(gguf::File::open(kDir + "phi3-f32.gguf"));
    CHECK(phi.n_rot == 12);
    CHECK(phi.head_dim == 16);
    CHECK(phi.rope_neox);
  }
}

TEST_CASE("models: keys that would change the math and are not implemented are refused by name") {
  const TinySpec llama_spec = oracle::tiny_spec("l", "llama", "f32");
  struct Bad {
    TinySpec spec;
    KeyEdit edit;
    std::string expect;
  };
  TinySpec longrope = oracle::tiny_spec("q", "qwen2", "f32");
  longrope.rope_scaling = "longrope";
  TinySpec qwen2 = oracle::tiny_spec("q", "qwen2", "f32");
  qwen2.n_rot = 8;
  TinySpec qwen2_dims = oracle::tiny_spec("q", "qwen2", "f32");
  qwen2_dims.head_dim = 32;
  TinySpec kv_len = llama_spec;
  kv_len.head_dim = 16;
  const std::vector<Bad> bad = {
      {llama_spec, set_u32("llama.attention.foo", 1), "key 'llama.attention.foo' is not one this runtime reads"},
      {llama_spec, set_u32("llama.expert_count", 8), "'llama.expert_count' = 8: experts"},
      {longrope, nullptr, "'qwen2.rope.scaling.type' = 'longrope': RoPE scaling of that type is not implemented"},
      {qwen2, nullptr, "rope.dimension_count (8) differs from the head dim (16)"},
      {qwen2_dims, nullptr, "head_count x head dim (2 x 32) differs from embedding_length (32)"},
      {kv_len, set_u32("llama.attention.value_length", 8), "attention.value_length (8) differs"},
      {llama_spec, set_u32("split.count", 2), "split across 2 files"},
      {llama_spec, add_key([](gguf::Writer& w) { w.set_f32("llama.rope.scaling.yarn_beta_fast", 16); }),
       "'llama.rope.scaling.yarn_beta_fast' = 16"},
      {llama_spec, add_key([](gguf::Writer& w) { w.set_bool("llama.attention.causal", false); }),
       "non-causal attention is not implemented"},
      {llama_spec,
       [](gguf::Writer& w, const gguf::KeyValue& kv) {
         const int32_t per_layer[2] = {64, 64};
         if (kv.key == "llama.feed_forward_length") w.set_array(kv.key, gguf::ValueType::I32, per_layer, 2);
         return kv.key != "llama.feed_forward_length";
       },
       "llama.feed_forward_length"},
      {llama_spec,
       [](gguf::Writer& w, const gguf::KeyValue& kv) {
         if (kv.key == "general.architecture") w.set_string(kv.key, "mamba");
         return kv.key != "general.architecture";
       },
       "unsupported architecture 'mamba'"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.expect);
    const std::string e = spec_error(b.spec, b.edit);
    CAPTURE(e);
    CHECK(e.find(b.expect) != std::string::npos);
    CHECK(e.find('\n') == std::string::npos);
  }
  // The same keys with the values llama.cpp assumes load.
  CHECK(spec_error(llama_spec, set_u32("llama.expert_count", 0)).empty());
  CHECK(spec_error(llama_spec, set_u32("llama.attention.sliding_window", 0)).empty());
}

// Sliding-window models decoding past their window: three sequences below one 20-token prompt (window 12), each
// method's logits against cascade's. The methods reach the window by other code (a windowed plan of the tree,
// split copies, the unified buffer's position mask), so a fault in any shows; the prefill past the window is
// checked against llama.cpp in test_oracle.
TEST_CASE("models: past the sliding window, every attention method decodes alike") {
  for (const std::string name : {"llama-swa-f32", "gemma3-f32"}) {
    CAPTURE(name);
    const gguf::File f = gguf::File::open(kDir + name + ".gguf");
    const llama::Model m = llama::Model::load(f);
    const llama::Hparams& hp = m.hparams();
    REQUIRE(hp.n_swa == 12);
    std::vector<int32_t> prompt(20), pos(20);
    for (int i = 0; i < 20; ++i) prompt[size_t(i)] = (7 * i + 3) % 60, pos[size_t(i)] = i;
    std::vector<std::vector<float>> runs;
    for (AttnMethod method : {AttnMethod::cascade, AttnMethod::split, AttnMethod::unified, AttnMethod::auto_}) {
      CAPTURE(attn_method_name(method));
      std::unique_ptr<TreeCache> tree = make_prefill_cache(method, int(hp.n_layer), hp.head_shape(), DType::f32);
      const int seg = tree->add_segment(-1, 0);
      tree->begin_step({{seg, 20, 0}});
      std::vector<float> logits, all;
      m.forward(prompt, pos, *tree, {19}, logits);
      all = logits;
      std::vector<int> id;
      const std::unique_ptr<KvCache> cache = start_sequences(method, std::move(tree), {seg, seg, seg}, id);
      for (int step = 0; step < 8; ++step) {
        const int32_t p = 20 + step;
        cache->begin_step({{id[0], 1, p}, {id[1], 1, p}, {id[2], 1, p}});
        m.forward({int32_t(step % 60), int32_t((step + 17) % 60), int32_t((5 * step + 1) % 60)}, {p, p, p}, *cache,
                  {0, 1, 2}, logits);
        all.insert(all.end(), logits.begin(), logits.end());
      }
      for (float x : all) REQUIRE(std::isfinite(x));
      runs.push_back(std::move(all));
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      CAPTURE(r);
      double worst = 0;
      for (size_t i = 0; i < runs[0].size(); ++i) worst = std::max(worst, double(std::fabs(runs[r][i] - runs[0][i])));
      CHECK(worst < 1e-3);
    }
  }
}

// cascade-generate's -c decides the RoPE factors of a model with long and short ones, as llama.cpp's -c does: the
// original context of this file is 64, so -c 64 takes the short factors and -c 65 the long ones.
TEST_CASE("models: cascade-generate -c picks long or short RoPE factors") {
  const std::string tool = CASCADE_BINARY_DIR "/tools/cascade-generate";
  std::vector<std::string> tokens;
  for (int n_ctx : {64, 65, 65}) {
    const tool_run::Run r = tool_run::run(tool, "-m " + tool_run::quote(kDir + "phi3-longrope-f32.gguf") +
                                                    " -p 'abcdefgh ijk' -n 16 --temp 0 --ignore-eos --json -t 1 -c " +
                                                    std::to_string(n_ctx));
    CAPTURE(r.err);
    REQUIRE(r.rc == 0);
    const size_t at = r.out.find("\"tokens\":");
    REQUIRE(at != std::string::npos);
    tokens.push_back(r.out.substr(at, r.out.find(']', at) - at));
  }
  CHECK(tokens[0] != tokens[1]);
  CHECK(tokens[1] == tokens[2]);
}

}  // namespace test_models
