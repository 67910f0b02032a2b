// Generation from Python: a Llama-style GGUF model (model/llama.hpp) with its tokenizer, and generate()
// (model/generate.hpp), which runs with the GIL released and checks for Ctrl-C after every prefill pass and
// every decode step.
#include "bindings.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "cascade/cpu/profile_cache.hpp"
#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/generate.hpp"
#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

namespace cascade::py {

namespace {

struct PyModel {
  std::string path;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<llama::Model> model;
};

std::vector<int32_t> encode(const PyModel& m, const std::string& text, bool chat) {
  if (chat) {
    const std::string wrapped = apply_chat_template(m.tok->vocab().chat_template, {{"user", text}}, true);
    return m.tok->encode(wrapped, /*add_special=*/true, /*parse_special=*/true);
  }
  return m.tok->encode(text, /*add_special=*/true, /*parse_special=*/false);
}

struct GenerateArgs {
  std::vector<std::string> prompts;
  int n, max_tokens;
  float temperature, top_p, min_p;
  int top_k;
  std::optional<uint64_t> seed;
  std::string attn;
  bool chat, ignore_eos;
  int64_t n_ctx;
  int threads, batch_size;
  std::string kv_type;
  std::optional<CostModel> cost_model;
  bool recalibrate;
};

GenerateParams params_of(const GenerateArgs& a) {
  if (a.n < 1) value_error("n: sequences per prompt must be >= 1, got ", a.n);
  if (a.max_tokens < 0) value_error("max_tokens: must be >= 0, got ", a.max_tokens);
  if (a.threads < 0) value_error("threads: must be >= 0 (0: all), got ", a.threads);
  if (a.batch_size < 1) value_error("batch_size: must be >= 1, got ", a.batch_size);
  if (a.n_ctx < 0) value_error("n_ctx: must be >= 0 (0: the model's), got ", a.n_ctx);
  DType kv_dtype;
  if (a.kv_type == "float16" || a.kv_type == "f16") kv_dtype = DType::f16;
  else if (a.kv_type == "bfloat16" || a.kv_type == "bf16") kv_dtype = DType::bf16;
  else if (a.kv_type == "float32" || a.kv_type == "f32") kv_dtype = DType::f32;
  else if (a.kv_type == "q8_0") kv_dtype = DType::q8_0;
  else value_error("kv_type: expected 'float16', 'bfloat16', 'q8_0' or 'float32', got '", a.kv_type, "'");
  GenerateParams p;
  p.n_predict = a.max_tokens;
  p.n_parallel = a.n;
  p.n_ctx = a.n_ctx;
  p.n_threads = a.threads;
  p.n_batch = a.batch_size;
  try {
    p.attn = parse_attn_method(a.attn);
  } catch (const Error& e) {
    value_error("attn: ", e.what());
  }
  if (a.cost_model && p.attn != AttnMethod::auto_)
    value_error("cost_model: given with attn='", a.attn, "' (it is for 'auto')");
  if (a.cost_model && a.cost_model->kv_dtype && *a.cost_model->kv_dtype != kv_dtype)
    value_error("cost_model: calibrated on ", python_dtype_name(*a.cost_model->kv_dtype), " K/V, but kv_type is '",
                a.kv_type, "' (CostModel.calibrate(kv_dtype=...) measures that type's kernels)");
  if (a.cost_model && a.recalibrate)
    value_error("recalibrate: given with a cost_model (there is nothing to measure)");
  if (a.recalibrate && p.attn != AttnMethod::auto_)
    value_error("recalibrate: given with attn='", a.attn, "' (it is for 'auto')");
  p.kv_dtype = kv_dtype;
  p.sampling.temp = a.temperature;
  p.sampling.top_k = a.top_k;
  p.sampling.top_p = a.top_p;
  p.sampling.min_p = a.min_p;
  p.sampling.seed = a.seed ? *a.seed : (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  p.cost_model = a.cost_model;
  return p;
}

// auto's profile, when the run needs one and none was given: the per-machine cache's (cpu/profile_cache.hpp), else
// calibrated now and kept there, as cascade-generate does. A problem with the cache is a note (a RuntimeWarning
// on the Python side), never an error.
struct Profile {
  const char* source = nullptr;  // "given", "cache" or "calibrated"; nullptr: the run needs none
  std::string path, note;
  double calibrate_ms = 0;
};

// Sets params.cost_model where the run needs one. Runs without the GIL.
Profile find_profile(const PyModel& m, const GenerateArgs& a, size_t n_prompts, GenerateParams& params) {
  Profile prof;
  if (params.cost_model) prof.source = "given";
  if (params.cost_model || params.attn != AttnMethod::auto_ || n_prompts * size_t(params.n_parallel) < 2) return prof;
  cpu::ProfileCacheOptions opt;
  opt.recalibrate = a.recalibrate;
  const cpu::CachedProfile c =
      cpu::calibrate_cached(params.n_threads, m.model->hparams().head_shape(), params.kv_dtype, opt);
  params.cost_model = c.model;
  prof.source = c.source == cpu::CachedProfile::Source::cache ? "cache" : "calibrated";
  prof.path = c.path.string();
  prof.note = c.note;
  prof.calibrate_ms = c.calibrate_s * 1e3;
  return prof;
}

// generate() without the GIL. After every prefill pass (at most batch_size tokens) and every decode step it takes
// the GIL for a moment and lets Python run its signal handlers; a KeyboardInterrupt (Ctrl-C) raised there unwinds
// generate() as a C++ exception and reaches the caller.
GenerateResult run_generate(const PyModel& m, const std::vector<std::vector<int32_t>>& prompts,
                            const GenerateParams& params, bool ignore_eos) {
  const auto check_signals = [] {
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  };
  const auto on_step = [&](int, const StepStat&) { check_signals(); };
  const auto on_prefill = [&](int64_t, int64_t) { check_signals(); };
  const Tokenizer& tok = *m.tok;
  return generate(*m.model, prompts, params, [&](int32_t id) { return !ignore_eos && tok.is_eog(id); }, on_step, {},
                  on_prefill);
}

nb::dict timings_of(const GenerateResult& r, double calibrate_ms) {
  nb::list step_ms, step_attn_ms, step_plan_ms;
  double decode_ms = 0, attn_ms = 0, plan_ms = 0;
  for (const StepStat& st : r.steps) {
    step_ms.append(st.ms);
    step_attn_ms.append(st.attn_ms);
    step_plan_ms.append(st.plan_ms);
    decode_ms += st.ms;
    attn_ms += st.attn_ms;
    plan_ms += st.plan_ms;
  }
  nb::dict timings;
  timings["prompt_ms"] = r.prompt_ms;
  timings["prompt_attn_ms"] = r.prompt_attn_ms;
  timings["calibrate_ms"] = calibrate_ms + r.calibrate_ms;
  timings["decode_ms"] = decode_ms;
  timings["decode_attn_ms"] = attn_ms;
  timings["decode_plan_ms"] = plan_ms;
  timings["decode_tokens_per_s"] = decode_ms > 0 ? 1e3 * double(r.n_decode_tokens) / decode_ms : 0.0;
  timings["step_ms"] = step_ms;
  timings["step_attn_ms"] = step_attn_ms;
  timings["step_plan_ms"] = step_plan_ms;
  return timings;
}

nb::dict result_of(const GenerateResult& r, const std::vector<std::string>& texts, uint64_t seed,
                   const Profile& prof) {
  nb::list seqs_tokens, seqs_prompt, seqs_stop;
  for (const SequenceResult& sq : r.sequences) {
    seqs_tokens.append(nb::cast(sq.tokens));
    seqs_prompt.append(sq.prompt);
    seqs_stop.append(sq.stop);
  }
  nb::dict d;
  d["texts"] = nb::cast(texts);
  d["tokens"] = seqs_tokens;
  d["prompt"] = seqs_prompt;
  d["stop"] = seqs_stop;
  d["timings"] = timings_of(r, prof.calibrate_ms);
  d["n_prompt_tokens"] = r.n_prompt_tokens;
  d["n_prompt_stored"] = r.n_prompt_stored;
  d["n_decode_tokens"] = r.n_decode_tokens;
  d["n_ctx"] = r.n_ctx;
  d["kv_tokens"] = r.kv_tokens;
  d["kv_bytes"] = r.kv_bytes;
  d["seed"] = seed;
  d["cost_model"] = r.cost_model ? nb::cast(*r.cost_model) : nb::none();
  d["profile_source"] = prof.source ? nb::cast(std::string(prof.source)) : nb::none();
  d["profile_path"] = prof.path.empty() ? nb::none() : nb::cast(prof.path);
  d["profile_note"] = prof.note;
  return d;
}

nb::dict generate_py(const PyModel& m, const GenerateArgs& a) {
  if (a.prompts.empty()) value_error("prompts: no prompt given");
  GenerateParams params = params_of(a);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t p = 0; p < a.prompts.size(); ++p) {
    if (a.prompts[p].empty()) value_error("prompts[", p, "]: the prompt is empty");
    prompts.push_back(encode(m, a.prompts[p], a.chat));
  }
  GenerateResult r;
  std::vector<std::string> texts;
  Profile prof;
  {
    nb::gil_scoped_release release;
    prof = find_profile(m, a, prompts.size(), params);
    r = run_generate(m, prompts, params, a.ignore_eos);
    for (const SequenceResult& sq : r.sequences) texts.push_back(m.tok->decode(sq.tokens, false));
  }
  return result_of(r, texts, params.sampling.seed, prof);
}

}  // namespace

void bind_generate(nb::module_& m) {
  nb::class_<PyModel>(m, "_Model")
      .def(
          "__init__",
          [](PyModel* self, const std::string& path) {
            nb::gil_scoped_release release;
            const gguf::File file = gguf::File::open(path);
            auto tok = std::make_unique<Tokenizer>(load_vocab(file));
            auto model = std::make_unique<llama::Model>(llama::Model::load(file));
            new (self) PyModel{path, std::move(tok), std::move(model)};
          },
          nb::arg("path"))
      .def_ro("path", &PyModel::path)
      .def(
          "generate",
          [](const PyModel& self, std::vector<std::string> prompts, int n, int max_tokens, float temperature,
             int top_k, float top_p, float min_p, std::optional<uint64_t> seed, std::string attn, bool chat,
             bool ignore_eos, int64_t n_ctx, int threads, int batch_size, std::string kv_type,
             std::optional<CostModel> cost_model, bool recalibrate) {
            return generate_py(self, GenerateArgs{std::move(prompts), n, max_tokens, temperature, top_p, min_p, top_k,
                                                  seed, std::move(attn), chat, ignore_eos, n_ctx, threads,
                                                  batch_size, std::move(kv_type), std::move(cost_model),
                                                  recalibrate});
          },
          nb::arg("prompts"), nb::arg("n"), nb::arg("max_tokens"), nb::arg("temperature"), nb::arg("top_k"),
          nb::arg("top_p"), nb::arg("min_p"), nb::arg("seed").none(), nb::arg("attn"), nb::arg("chat"),
          nb::arg("ignore_eos"), nb::arg("n_ctx"), nb::arg("threads"), nb::arg("batch_size"), nb::arg("kv_type"),
          nb::arg("cost_model").none(), nb::arg("recalibrate"))
      .def("tokenize",
           [](const PyModel& self, const std::string& text, bool chat) { return encode(self, text, chat); },
           nb::arg("text"), nb::arg("chat") = false)
      .def(
          "detokenize",
          [](const PyModel& self, const std::vector<int32_t>& ids) { return self.tok->decode(ids, false); },
          nb::arg("ids"))
      .def("is_eog", [](const PyModel& self, int32_t id) { return self.tok->is_eog(id); }, nb::arg("id"))
      .def_prop_ro("hparams", [](const PyModel& self) {
        const llama::Hparams& hp = self.model->hparams();
        nb::dict d;
        d["n_vocab"] = hp.n_vocab;
        d["n_ctx_train"] = hp.n_ctx_train;
        d["n_embd"] = hp.n_embd;
        d["n_layer"] = hp.n_layer;
        d["n_head"] = hp.n_head;
        d["n_head_kv"] = hp.n_head_kv;
        d["head_dim"] = hp.head_dim;
        d["n_ff"] = hp.n_ff;
        return d;
      });
}

}  // namespace cascade::py
