// Attention over a tree of K/V segments from Python: Plan (tree.hpp + plan.hpp + cpu::plan), run once per layer
// with that layer's K/V (cpu::run); SplitLayout and UnifiedLayout (layouts.hpp) for comparison; CostModel
// (auto.hpp, cpu/calibrate.hpp) for auto's choice.
//
// K/V come as one array per segment, (tokens, n_kv_heads, head_dim), or as one array holding every segment's
// tokens one after another in segment order; any strides whose head_dim axis is dense are read in place. A q8_0
// K or V is a Q8_0 (q8.hpp) in place of an array: its codes as above, its scales (tokens, n_kv_heads,
// head_dim / 32) laid out as the codes at 1/32 of their strides (kv.hpp).
// q is (n_rows, n_q_heads, head_dim); results are o (q's shape and dtype) and lse (n_rows, n_q_heads), float32,
// in q's framework.
#include "bindings.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arrays.hpp"
#include "q8.hpp"
#include "typed.hpp"
#include "cascade/cascade.hpp"

namespace cascade::py {

namespace {

// One K or V argument as its views read it: the elements (floats, or q8_0 codes), q8_0's scales, their type.
struct KvArray {
  ArrayRef a, scales;
  DType dt = DType::f32;
};

// The K/V of a run: the plan's segment views, and the arrays they point into (kept alive for the run).
struct KvArgs {
  std::vector<KvArray> arrays;
  std::vector<KvView> views;
};

// A stride as the view uses it: 0 where the axis has one element or the array none (any value is valid there).
int64_t eff_stride(const ArrayRef& a, size_t i) { return a.shape(i) <= 1 || a.size() == 0 ? 0 : a.stride(i); }

Name part(Name n, const char* field) {
  n.field = field;
  return n;
}

// Checks a K or V array's layout (an array of floats, or a q8_0's codes): a dense head_dim axis, no negative
// strides.
void check_kv_strides(const ArrayRef& a, Name what) {
  if (a.shape(2) > 1 && a.size() > 0 && a.stride(2) != 1)
    value_error(what, ": its head_dim axis is strided (stride ", a.stride(2),
                "); cascade reads K/V rows densely: pass a copy (numpy.ascontiguousarray / .contiguous())");
  if (eff_stride(a, 0) < 0 || eff_stride(a, 1) < 0)
    value_error(what, ": negative strides; pass a copy (numpy.ascontiguousarray / .contiguous())");
}

// Reads one K or V argument of `n_tokens` tokens (n_tokens < 0: any): an array of floats, or a Q8_0.
KvArray read_kv_array(nb::handle h, const HeadShape& shape, int64_t n_tokens, Name what) {
  KvArray r;
  const Q8Arrays* q8 = as_q8(h);
  if (!q8) {
    r.a = as_array(h, what);
    if (is_int8(r.a.dtype()))
      type_error(what, ": int8 elements; q8_0 K/V are passed as cascade.Q8_0(codes, scales)");
    r.dt = float_dtype(r.a, what);
    check_shape(r.a, {n_tokens, shape.n_kv_heads, shape.head_dim}, what, "(tokens, n_kv_heads, head_dim)");
    check_kv_strides(r.a, what);
    return r;
  }
  const Name cn = part(what, "codes"), sn = part(what, "scales");
  r.a = as_array(q8->codes, cn);
  r.scales = as_array(q8->scales, sn);
  r.dt = DType::q8_0;
  check_q8(r.a, r.scales, cn, sn);
  check_shape(r.a, {n_tokens, shape.n_kv_heads, shape.head_dim}, cn, "(tokens, n_kv_heads, head_dim)");
  check_kv_strides(r.a, cn);
  // A block's scale is found at its codes' offset / 32 (kv.hpp): the scales' strides are the codes' / 32.
  const ArrayRef &c = r.a, &s = r.scales;
  if ((s.shape(2) > 1 && s.size() > 0 && s.stride(2) != 1) || eff_stride(s, 0) * kQ8Block != eff_stride(c, 0) ||
      eff_stride(s, 1) * kQ8Block != eff_stride(c, 1))
    value_error(sn, ": strides (", eff_stride(s, 0), ", ", eff_stride(s, 1), ", ", s.stride(2), ") are not those of ",
                cn, " (", eff_stride(c, 0), ", ", eff_stride(c, 1), ", 1) divided by ", kQ8Block,
                ": cascade finds a block's scale at its codes' offset / ", kQ8Block,
                "; pass both dense (numpy.ascontiguousarray / .contiguous())");
  return r;
}

// A view of tokens [t0, t0 + n) of k and v (checked arrays of the same dtype and strides).
KvView make_view(const KvArray& k, const KvArray& v, int64_t t0, int64_t n, const HeadShape& shape) {
  KvView kv;
  kv.dtype = k.dt;
  kv.n_tokens = n;
  kv.n_kv_heads = shape.n_kv_heads;
  kv.head_dim = shape.head_dim;
  kv.stride_token = eff_stride(k.a, 0);
  kv.stride_head = eff_stride(k.a, 1);
  const int64_t off = t0 * kv.stride_token * dtype_size(k.dt);
  kv.k = static_cast<const char*>(k.a.data()) + off;
  kv.v = static_cast<const char*>(v.a.data()) + off;
  if (k.dt == DType::q8_0) {
    const int64_t scale_off = t0 * kv.stride_token / kQ8Block * int64_t(sizeof(f16));
    kv.k_scales = static_cast<const char*>(k.scales.data()) + scale_off;
    kv.v_scales = static_cast<const char*>(v.scales.data()) + scale_off;
  }
  return kv;
}

// K and V of one type and layout (q8_0: the scales' layout follows the codes', checked by read_kv_array).
void check_pair(const KvArray& k, const KvArray& v, Name kn, Name vn) {
  if (k.dt != v.dt)
    type_error(vn, ": ", python_dtype_name(v.dt), " elements but ", kn, " has ", python_dtype_name(k.dt));
  if (eff_stride(k.a, 0) != eff_stride(v.a, 0) || eff_stride(k.a, 1) != eff_stride(v.a, 1))
    value_error(vn, ": strides (", eff_stride(v.a, 0), ", ", eff_stride(v.a, 1), ") differ from ", kn, "'s (",
                eff_stride(k.a, 0), ", ", eff_stride(k.a, 1), "); cascade reads K and V with one layout");
}

bool is_list(nb::handle h) { return PyList_Check(h.ptr()) || PyTuple_Check(h.ptr()); }

// Where each segment's tokens begin in one K/V array: `starts` (None: one after another from token 0), each
// segment checked to lie within the array's n_tokens.
std::vector<int64_t> segment_starts(const Tree& tree, nb::handle starts, int64_t n_tokens) {
  const int n_seg = tree.n_segments();
  std::vector<int64_t> s;
  if (starts.is_none()) {
    int64_t t0 = 0;
    for (int g = 0; g < n_seg; ++g) {
      s.push_back(t0);
      t0 += tree.n_tokens(g);
    }
    return s;
  }
  if (!nb::try_cast(starts, s)) type_error("starts: expected a sequence of ints, one per segment");
  if (s.size() != size_t(n_seg)) value_error("starts: ", s.size(), " values for a plan of ", n_seg, " segments");
  for (int g = 0; g < n_seg; ++g)
    if (s[size_t(g)] < 0 || s[size_t(g)] > n_tokens - tree.n_tokens(g))
      value_error(Name{"starts", g}, ": segment ", g, "'s tokens [", s[size_t(g)], ", ",
                  s[size_t(g)] + tree.n_tokens(g), ") are not within k's ", n_tokens, " tokens");
  return s;
}

// k, v: a list (or tuple) of one array per segment of `tree`, or one array each holding every segment's tokens,
// one after another or where `starts` says.
void kv_views(const Tree& tree, nb::handle k, nb::handle v, nb::handle starts, KvArgs& out) {
  const HeadShape& shape = tree.shape();
  const int n_seg = tree.n_segments();
  if (is_list(k) != is_list(v))
    type_error("v: ", is_list(k) ? "expected a list of arrays, as k is" : "expected one array, as k is");
  if (is_list(k)) {
    if (!starts.is_none())
      type_error("starts: only with k and v as one array each (a list gives each segment an array of its own)");
    const Py_ssize_t nk = PySequence_Fast_GET_SIZE(k.ptr()), nv = PySequence_Fast_GET_SIZE(v.ptr());
    if (nk != n_seg) value_error("k: ", nk, " arrays for a plan of ", n_seg, " segments");
    if (nv != n_seg) value_error("v: ", nv, " arrays for a plan of ", n_seg, " segments");
    out.arrays.reserve(size_t(2 * n_seg));
    for (int g = 0; g < n_seg; ++g) {
      const Name kn{"k", g}, vn{"v", g};
      // Borrowed items: the list (or tuple) holds them for the call's duration, the ArrayRefs beyond it.
      out.arrays.push_back(read_kv_array(PySequence_Fast_GET_ITEM(k.ptr(), g), shape, tree.n_tokens(g), kn));
      out.arrays.push_back(read_kv_array(PySequence_Fast_GET_ITEM(v.ptr(), g), shape, tree.n_tokens(g), vn));
      const KvArray& ka = out.arrays[out.arrays.size() - 2];
      const KvArray& va = out.arrays.back();
      check_pair(ka, va, kn, vn);
      out.views.push_back(make_view(ka, va, 0, tree.n_tokens(g), shape));
    }
    return;
  }
  int64_t total = 0;
  for (int g = 0; g < n_seg; ++g) total += tree.n_tokens(g);
  const int64_t n_tokens = starts.is_none() ? total : -1;  // with starts: any, as long as every segment fits
  out.arrays.push_back(read_kv_array(k, shape, n_tokens, {"k"}));
  out.arrays.push_back(read_kv_array(v, shape, n_tokens, {"v"}));
  const KvArray& ka = out.arrays[0];
  const KvArray& va = out.arrays[1];
  check_pair(ka, va, {"k"}, {"v"});
  if (ka.a.shape(0) != va.a.shape(0))
    value_error("v: ", va.a.shape(0), " tokens but k has ", ka.a.shape(0), "; K and V hold the same tokens");
  const std::vector<int64_t> t0 = segment_starts(tree, starts, int64_t(ka.a.shape(0)));
  for (int g = 0; g < n_seg; ++g) out.views.push_back(make_view(ka, va, t0[size_t(g)], tree.n_tokens(g), shape));
}

// One run's q and results: q read as f32 (in place when it is f32 and dense), o and lse made fresh in q's
// framework or taken from out= / lse=, and compute(q, o, lse) called with the GIL released.
template <class Compute>
ArrayPair run_with_queries(const HeadShape& shape, int64_t n_rows, nb::handle q_obj, nb::handle out_obj,
                           nb::handle lse_obj, Compute&& compute) {
  const ArrayRef q = as_array(q_obj, {"q"});
  const DType dt = float_dtype(q, {"q"});
  check_shape(q, {n_rows, shape.n_q_heads, shape.head_dim}, {"q"}, "(n_rows, n_q_heads, head_dim)");
  const Framework fw = framework_of(q_obj);
  nb::object o_res, lse_res;
  void* o_data = nullptr;
  float* lse_data = nullptr;
  if (out_obj.is_none()) {
    NewArray o = new_array(fw, dt, {n_rows, shape.n_q_heads, shape.head_dim});
    o_res = std::move(o.obj);
    o_data = o.data;
  } else {
    const ArrayRef out = as_array(out_obj, {"out"}, true);
    if (float_dtype(out, {"out"}) != dt)
      type_error("out: expected ", python_dtype_name(dt), " elements (q's dtype), got ", dtype_str(out.dtype()));
    check_shape(out, {n_rows, shape.n_q_heads, shape.head_dim}, {"out"}, "(n_rows, n_q_heads, head_dim)");
    if (!out.c_contiguous()) value_error("out: must be C-contiguous");
    o_res = nb::borrow(out_obj);
    o_data = out.data();
  }
  if (lse_obj.is_none()) {
    NewArray l = new_array(fw, DType::f32, {n_rows, shape.n_q_heads});
    lse_res = std::move(l.obj);
    lse_data = static_cast<float*>(l.data);
  } else {
    const ArrayRef l = as_array(lse_obj, {"lse"}, true);
    if (float_dtype(l, {"lse"}) != DType::f32)
      type_error("lse: expected float32 elements, got ", dtype_str(l.dtype()));
    check_shape(l, {n_rows, shape.n_q_heads}, {"lse"}, "(n_rows, n_q_heads)");
    if (!l.c_contiguous()) value_error("lse: must be C-contiguous");
    lse_res = nb::borrow(lse_obj);
    lse_data = static_cast<float*>(l.data());
  }
  {
    nb::gil_scoped_release release;
    std::vector<float> q_tmp, o_tmp;
    const float* q_f32 = as_f32(q, dt, q_tmp);
    float* o_f32 = static_cast<float*>(o_data);
    if (dt != DType::f32) {
      o_tmp.resize(q.size());
      o_f32 = o_tmp.data();
    }
    compute(q_f32, o_f32, lse_data);
    if (dt != DType::f32) write_from_f32(o_f32, o_data, dt, int64_t(q.size()));
  }
  return ArrayPair(nb::make_tuple(o_res, lse_res));
}

DType parse_kv_dtype(nb::handle h) {
  std::string s = nb::isinstance<nb::str>(h) ? nb::cast<std::string>(h) : nb::cast<std::string>(nb::str(h));
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float32" || s == "f32") return DType::f32;
  if (s == "float16" || s == "f16") return DType::f16;
  if (s == "bfloat16" || s == "bf16") return DType::bf16;
  if (s == "q8_0") return DType::q8_0;
  value_error("kv_dtype: expected float32, float16, bfloat16 or q8_0, got '", s, "'");
}

// kv_dtype as parse_kv_dtype reads it, checked against a head dim: q8_0 needs a multiple of 32.
DType kv_dtype_for(nb::handle h, int head_dim) {
  const DType dt = parse_kv_dtype(h);
  if (dt == DType::q8_0 && head_dim % kQ8Block != 0)
    value_error("kv_dtype: q8_0 K/V need a head_dim that is a multiple of ", kQ8Block, ", got ", head_dim);
  return dt;
}

// auto without a given cost model: one calibration per (threads, KV heads, head dim, K/V type), kept for the
// process.
CostModel calibrated(int n_threads, const HeadShape& shape, DType kv_dtype) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, DType>, CostModel> models;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(n_threads, shape.n_kv_heads, shape.head_dim, kv_dtype);
  auto it = models.find(key);
  if (it == models.end()) it = models.emplace(key, calibrate(n_threads, shape, kv_dtype)).first;
  return it->second;
}

std::vector<int64_t> query_counts(nb::handle n_query, size_t n_seq) {
  int64_t one = 0;
  if (nb::try_cast(n_query, one)) return std::vector<int64_t>(n_seq, one);
  std::vector<int64_t> counts;
  if (!nb::try_cast(n_query, counts)) type_error("n_query: expected an int or a list of ints, one per sequence");
  return counts;
}

// A Plan for Python: the library's plan of a tree, and how it was asked for.
struct PyPlan {
  Plan plan;
  std::string method;
  int n_threads = 0;
};

struct PlanOptions {
  int n_q_heads, n_kv_heads, head_dim;
  std::optional<float> scale;
  int64_t window;
  std::string method;
  std::optional<CostModel> cost_model;
  nb::handle kv_dtype;
  int threads;
};

PyPlan make_plan(const PlanOptions& o, const std::function<Tree(const HeadShape&, float, int64_t)>& tree_of) {
  if (o.method != "cascade" && o.method != "auto")
    value_error("method: expected 'cascade' or 'auto', got '", o.method,
                "' (split and unified are layouts: SplitLayout, UnifiedLayout)");
  if (o.cost_model && o.method != "auto") value_error("cost_model: given with method='", o.method, "' (it is for 'auto')");
  if (o.threads < 0) value_error("threads: must be >= 0 (0: all), got ", o.threads);
  if (o.scale && !(*o.scale > 0.0f)) value_error("scale: must be positive, got ", *o.scale);
  if (o.window < 0) value_error("window: must be >= 0 (0: none), got ", o.window);
  const HeadShape shape{o.n_q_heads, o.n_kv_heads, o.head_dim};
  const DType kv_dtype = kv_dtype_for(o.kv_dtype, o.head_dim);
  if (o.cost_model && o.cost_model->kv_dtype && *o.cost_model->kv_dtype != kv_dtype)
    value_error("cost_model: calibrated on ", python_dtype_name(*o.cost_model->kv_dtype), " K/V, but kv_dtype is '",
                python_dtype_name(kv_dtype), "' (CostModel.calibrate(kv_dtype=...) measures that type's kernels)");
  Tree tree = tree_of(shape, o.scale.value_or(0.0f), o.window);
  PyPlan p;
  p.method = o.method;
  p.n_threads = o.threads;
  nb::gil_scoped_release release;
  cpu::Options opt{o.threads, nullptr, kv_dtype};
  CostModel model;
  if (o.method == "auto") {
    model = o.cost_model ? *o.cost_model : calibrated(o.threads, shape, kv_dtype);
    opt.cost_model = &model;
  }
  p.plan = cpu::plan(std::move(tree), opt);
  return p;
}

std::optional<nb::dict> choice_dict(const Plan& plan) {
  if (!plan.choice()) return std::nullopt;
  const AutoChoice& c = *plan.choice();
  nb::list shared, passes;
  for (const SegmentChoice& s : c.segments) {
    shared.append(s.shared);
    passes.append(s.n_passes);
  }
  nb::dict d;
  d["changed"] = c.changed;
  d["predicted_tree_s"] = c.tree_s;
  d["predicted_chosen_s"] = c.chosen_s;
  d["shared"] = shared;
  d["n_passes"] = passes;
  return d;
}

// The layouts of layouts.hpp, each with the plan that runs it.
struct PySplit {
  SplitLayout layout;
  Plan plan;
};
struct PyUnified {
  std::unique_ptr<UnifiedLayout> layout;
  cpu::UnifiedPlan plan;
};

// A plan bound to one layer's K/V (Plan.bind): the arrays validated and their views made once, the arrays kept
// alive by the references their ArrayRefs hold, the plan by `owner`. run(q)
// then converts q, o and lse only: a call costs the same whatever the number of segments. The views see the
// arrays' memory, so K/V written in place between runs (an engine's preallocated cache) are read as they are.
struct PyBound {
  PyBound(nb::object owner_, const PyPlan* plan_) : owner(std::move(owner_)), plan(plan_) {}
  PyBound(PyBound&&) = default;
  PyBound(const PyBound&) = delete;  // move-only (its ArrayRefs are): nanobind then moves it into Python
  nb::object owner;  // the Python Plan `plan` belongs to
  const PyPlan* plan;
  KvArgs kv;
};

// Times n runs of plan on k, v, q from C++ (views made once, outside the timing), in seconds each: the
// baseline Python's call overhead is measured against (bench/python_overhead.py).
std::vector<double> time_runs(const PyPlan& p, nb::handle k, nb::handle v, nb::handle q_obj, int n) {
  KvArgs kv;
  kv_views(p.plan.tree(), k, v, nb::none(), kv);
  const ArrayRef q = as_array(q_obj, {"q"});
  if (float_dtype(q, {"q"}) != DType::f32 || !q.c_contiguous()) type_error("q: expected C-contiguous float32");
  check_shape(q, {p.plan.n_rows(), p.plan.shape().n_q_heads, p.plan.shape().head_dim}, {"q"},
              "(n_rows, n_q_heads, head_dim)");
  std::vector<float> o(q.size()), lse(size_t(p.plan.n_rows() * p.plan.shape().n_q_heads));
  std::vector<double> s(size_t(std::max(n, 0)));
  nb::gil_scoped_release release;
  for (double& t : s) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu::run(p.plan, kv.views, static_cast<const float*>(q.data()), o.data(), lse.data());
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return s;
}

constexpr const char* kPlanDoc =
    "The plan of one step of attention over a tree of K/V segments: made once, run by every layer.\n\n"
    "Plan(segments, paths, n_query=1, *, n_q_heads, n_kv_heads, head_dim, scale=None, window=0,\n"
    "     method='cascade', cost_model=None, kv_dtype='float16', threads=0)\n\n"
    "segments: the segments' lengths in tokens. paths: per sequence, its segment ids from a root to its leaf\n"
    "(its keys are those segments' tokens, in order). n_query: query tokens per sequence (an int for all, or\n"
    "a list); they are the last positions of the sequence's keys and attend causally. scale: softmax scale\n"
    "(default 1/sqrt(head_dim)). window: a sliding window in keys (0: none): each query row attends only the\n"
    "last `window` keys up to and including its own position, as Gemma 3's and Mistral's windowed layers do.\n"
    "method: 'cascade' (every segment attended once by all the queries below it)\n"
    "or 'auto' (each segment shared or folded into its sequences as a cost model predicts faster; cost_model:\n"
    "a CostModel, or None to calibrate once per process). kv_dtype: the K/V type auto prices ('float32',\n"
    "'float16', 'bfloat16' or 'q8_0'; a cost_model measured on another type is refused). threads: 0 for all of\n"
    "the machine's.\n\n"
    "Query rows are laid out sequence after sequence: sequence s owns rows [row_begin[s], row_begin[s] +\n"
    "n_query[s]).";

constexpr const char* kBindDoc =
    "This plan bound to one layer's K/V: returns a BoundPlan, whose run(q) is Plan.run(k, v, q).\n\n"
    "k, v as Plan.run takes them; they are checked and their layout read once, here, so a bound run costs the\n"
    "same whatever the number of segments (Plan.run converts every array on every call). The BoundPlan keeps\n"
    "k, v and this plan alive and reads the arrays' memory on every run: K/V written in place between runs\n"
    "are seen; an array must not be resized or reallocated in place (ndarray.resize, Tensor.resize_) meanwhile.\n"
    "Bind once per layer and step (or once per preallocated buffer) and run it with each step's q.";

constexpr const char* kRunDoc =
    "Attention of one layer: returns (o, lse).\n\n"
    "k, v: a list of one array per segment, (tokens, n_kv_heads, head_dim), or one array holding every\n"
    "segment's tokens, one segment after another or where starts= says (starts[g]: the token segment g begins\n"
    "at, in any order: a cache buffer with the segments anywhere in it); float32, float16 or bfloat16, or q8_0\n"
    "as a Q8_0(codes, scales) in place of each array (quantize_q8_0 makes one); read in place (any strides\n"
    "with a dense head_dim axis, K and V with the same layout). q: (n_rows, n_q_heads, head_dim), float32,\n"
    "float16 or bfloat16. o has q's shape and dtype, lse is (n_rows, n_q_heads) float32 (natural log; -inf for\n"
    "a row that sees no key, whose o is 0); both in q's framework, or written into out= and lse=\n"
    "(C-contiguous). Computed in float32; the GIL is released meanwhile, so threads may run plans at once.";

}  // namespace

void bind_attention(nb::module_& m) {
  nb::class_<CostModel>(m, "CostModel",
                        "auto's cost model of this machine: calibrate() measures one, save()/load() keep it.")
      .def_static(
          "calibrate",
          [](int threads, int n_kv_heads, int head_dim, nb::handle kv_dtype) {
            if (threads < 0) value_error("threads: must be >= 0 (0: all), got ", threads);
            const DType dt = kv_dtype_for(kv_dtype, head_dim);
            nb::gil_scoped_release release;
            return calibrate(threads, HeadShape{n_kv_heads, n_kv_heads, head_dim}, dt);
          },
          nb::arg("threads") = 0, nb::arg("n_kv_heads") = 4, nb::arg("head_dim") = 64,
          nb::arg("kv_dtype") = "float16",
          "Fits the cost model on this machine (about half a second), with the head shape and K/V type it will\n"
          "price: the kernels run on kv_dtype's elements ('float32', 'float16', 'bfloat16' or 'q8_0').")
      .def_static("load", &CostModel::load, nb::arg("path"), "Reads a profile written by save().")
      .def_static("parse", &CostModel::parse, nb::arg("text"), "Reads a profile from str(model).")
      .def("save", &CostModel::save, nb::arg("path"))
      .def("__str__", &CostModel::to_string)
      .def("__repr__", [](const CostModel& c) {
        return cat("CostModel(threads=", c.n_threads, ", n_kv_heads=", c.n_kv_heads, ", head_dim=", c.head_dim,
                   ", kv_dtype=", c.kv_dtype ? cat("'", python_dtype_name(*c.kv_dtype), "'") : "None",
                   ", read_bw=", c.read_bw / 1e9, " GB/s)");
      })
      .def_prop_ro(
          "kv_dtype",
          [](const CostModel& c) -> std::optional<std::string> {
            if (!c.kv_dtype) return std::nullopt;
            return python_dtype_name(*c.kv_dtype);
          },
          "The K/V type it was measured on (None: not recorded); a plan of another kv_dtype refuses it.")
      .def_ro("threads", &CostModel::n_threads)
      .def_ro("n_kv_heads", &CostModel::n_kv_heads)
      .def_ro("head_dim", &CostModel::head_dim)
      .def_ro("read_bw", &CostModel::read_bw)
      .def_ro("small_bw", &CostModel::small_bw)
      .def_ro("small_mac", &CostModel::small_mac)
      .def_ro("tiled_bw", &CostModel::tiled_bw)
      .def_ro("tiled_mac", &CostModel::tiled_mac)
      .def_ro("item_s", &CostModel::item_s)
      .def_ro("tiled_item_s", &CostModel::tiled_item_s);

  nb::class_<PyPlan>(m, "Plan", kPlanDoc)
      .def(
          "__init__",
          [](PyPlan* self, std::vector<int64_t> segments, std::vector<std::vector<int>> paths, CountsArg n_query,
             int n_q_heads, int n_kv_heads, int head_dim, std::optional<float> scale, int64_t window,
             std::string method, std::optional<CostModel> cost_model, nb::handle kv_dtype, int threads) {
            const std::vector<int64_t> nq = query_counts(n_query, paths.size());
            const PlanOptions o{n_q_heads, n_kv_heads, head_dim, scale, window, method, cost_model, kv_dtype, threads};
            new (self) PyPlan(make_plan(o, [&](const HeadShape& shape, float sc, int64_t w) {
              return Tree::build(shape, segments, paths, nq, sc, w);
            }));
          },
          nb::arg("segments"), nb::arg("paths"), nb::arg("n_query") = 1, nb::kw_only(), nb::arg("n_q_heads"),
          nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("scale") = nb::none(), nb::arg("window") = 0,
          nb::arg("method") = "cascade",
          nb::arg("cost_model") = nb::none(), nb::arg("kv_dtype") = "float16", nb::arg("threads") = 0)
      .def_static(
          "two_level",
          [](int64_t n_prefix, std::vector<int64_t> n_own, int64_t n_query, int n_q_heads, int n_kv_heads,
             int head_dim, std::optional<float> scale, int64_t window, std::string method,
             std::optional<CostModel> cost_model, nb::handle kv_dtype, int threads) {
            const PlanOptions o{n_q_heads, n_kv_heads, head_dim, scale, window, method, cost_model, kv_dtype, threads};
            return make_plan(o, [&](const HeadShape& shape, float sc, int64_t w) {
              return Tree::two_level(shape, n_prefix, n_own, n_query, sc, w);
            });
          },
          nb::arg("n_prefix"), nb::arg("n_own"), nb::arg("n_query") = 1, nb::kw_only(), nb::arg("n_q_heads"),
          nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("scale") = nb::none(), nb::arg("window") = 0,
          nb::arg("method") = "cascade",
          nb::arg("cost_model") = nb::none(), nb::arg("kv_dtype") = "float16", nb::arg("threads") = 0,
          "The common tree: one shared prefix (segment 0, n_prefix tokens) and below it one own segment per\n"
          "sequence (segment s + 1, n_own[s] tokens), n_query query tokens per sequence. Options as Plan().")
      .def_static(
          "independent",
          [](std::vector<int64_t> n_tokens, CountsArg n_query, int n_q_heads, int n_kv_heads, int head_dim,
             std::optional<float> scale, int64_t window, std::string method, std::optional<CostModel> cost_model,
             nb::handle kv_dtype, int threads) {
            const std::vector<int64_t> nq = query_counts(n_query, n_tokens.size());
            const PlanOptions o{n_q_heads, n_kv_heads, head_dim, scale, window, method, cost_model, kv_dtype, threads};
            return make_plan(o, [&](const HeadShape& shape, float sc, int64_t w) {
              return Tree::independent(shape, n_tokens, nq, sc, w);
            });
          },
          nb::arg("n_tokens"), nb::arg("n_query") = 1, nb::kw_only(), nb::arg("n_q_heads"), nb::arg("n_kv_heads"),
          nb::arg("head_dim"), nb::arg("scale") = nb::none(), nb::arg("window") = 0,
          nb::arg("method") = "cascade",
          nb::arg("cost_model") = nb::none(), nb::arg("kv_dtype") = "float16", nb::arg("threads") = 0,
          "Every sequence on its own: sequence s attends only segment s (n_tokens[s] tokens). Options as Plan().")
      .def(
          "run",
          [](const PyPlan& p, ArraysArg k, ArraysArg v, ArrayArg q, StartsArg starts, ArrayArg out, ArrayArg lse) {
            KvArgs kv;
            kv_views(p.plan.tree(), k, v, starts, kv);
            return run_with_queries(p.plan.shape(), p.plan.n_rows(), q, out, lse,
                                    [&](const float* qf, float* of, float* lf) {
                                      cpu::run(p.plan, kv.views, qf, of, lf);
                                    });
          },
          nb::arg("k"), nb::arg("v"), nb::arg("q"), nb::kw_only(), nb::arg("starts") = nb::none(),
          nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(), kRunDoc)
      .def(
          "bind",
          [](nb::handle self, ArraysArg k, ArraysArg v, StartsArg starts) {
            const PyPlan& p = nb::cast<const PyPlan&>(self);
            PyBound b(nb::borrow(self), &p);
            kv_views(p.plan.tree(), k, v, starts, b.kv);
            return b;
          },
          nb::arg("k"), nb::arg("v"), nb::kw_only(), nb::arg("starts") = nb::none(), kBindDoc)
      .def_prop_ro("n_rows", [](const PyPlan& p) { return p.plan.n_rows(); })
      .def_prop_ro("n_segments", [](const PyPlan& p) { return p.plan.n_segments(); })
      .def_prop_ro("n_sequences", [](const PyPlan& p) { return p.plan.n_sequences(); })
      .def_prop_ro("n_q_heads", [](const PyPlan& p) { return p.plan.shape().n_q_heads; })
      .def_prop_ro("n_kv_heads", [](const PyPlan& p) { return p.plan.shape().n_kv_heads; })
      .def_prop_ro("head_dim", [](const PyPlan& p) { return p.plan.shape().head_dim; })
      .def_prop_ro("scale", [](const PyPlan& p) { return p.plan.scale(); })
      .def_prop_ro("window", [](const PyPlan& p) { return p.plan.tree().window(); })
      .def_prop_ro("method", [](const PyPlan& p) { return p.method; })
      .def_prop_ro("threads", [](const PyPlan& p) { return p.n_threads; })
      .def_prop_ro("segments",
                   [](const PyPlan& p) {
                     std::vector<int64_t> s;
                     for (int g = 0; g < p.plan.n_segments(); ++g) s.push_back(p.plan.tree().n_tokens(g));
                     return s;
                   })
      .def_prop_ro("paths",
                   [](const PyPlan& p) {
                     std::vector<std::vector<int>> s;
                     for (int i = 0; i < p.plan.n_sequences(); ++i) s.push_back(p.plan.tree().sequence(i).path);
                     return s;
                   })
      .def_prop_ro("n_query",
                   [](const PyPlan& p) {
                     std::vector<int64_t> s;
                     for (int i = 0; i < p.plan.n_sequences(); ++i) s.push_back(p.plan.tree().sequence(i).n_query);
                     return s;
                   })
      .def_prop_ro("row_begin",
                   [](const PyPlan& p) {
                     std::vector<int64_t> s;
                     for (int i = 0; i < p.plan.n_sequences(); ++i) s.push_back(p.plan.tree().sequence(i).row_begin);
                     return s;
                   })
      .def_prop_ro("workspace_floats", [](const PyPlan& p) { return p.plan.workspace_floats(); })
      .def_prop_ro("choice", [](const PyPlan& p) { return choice_dict(p.plan); },
                   "auto's decision (None for method='cascade'): changed, predicted_tree_s, predicted_chosen_s,\n"
                   "and per segment shared (attended once) and n_passes (passes over its K/V).")
      .def(
          "kernels",
          [](const PyPlan& p, nb::handle kv_dtype) {
            const DType dt = kv_dtype_for(kv_dtype, p.plan.shape().head_dim);
            nb::dict d;
            for (const Schedule::Pass& ps : p.plan.schedule().passes)
              d[ps.kernel == cpu::kTiledKernel ? "shared" : "per_sequence"] =
                  cpu::kernel_name(p.plan.target(), ps.kernel, dt);
            return d;
          },
          nb::arg("kv_dtype") = "float16",
          "The kernels this plan runs on K/V of kv_dtype, chosen when it was made: {'shared': ..., 'per_sequence':\n"
          "...} for the kinds of pass it has, each named 'TIER SHAPE PRODUCTS' (e.g. 'avx512 tiled bf16-dot').")
      .def("__repr__", [](const PyPlan& p) {
        const HeadShape& s = p.plan.shape();
        return cat("Plan(", p.plan.n_segments(), " segments, ", p.plan.n_sequences(), " sequences, ",
                   p.plan.n_rows(), " query rows, heads ", s.n_q_heads, "/", s.n_kv_heads, "/", s.head_dim,
                   ", method='", p.method, "')");
      });

  nb::class_<PyBound>(m, "BoundPlan",
                      "A Plan bound to one layer's K/V (Plan.bind(k, v)): run(q) attends them, converting only\n"
                      "q and the results. It keeps the plan and the K/V arrays alive.")
      .def(
          "run",
          [](const PyBound& b, ArrayArg q, ArrayArg out, ArrayArg lse) {
            const Plan& plan = b.plan->plan;
            return run_with_queries(plan.shape(), plan.n_rows(), q, out, lse,
                                    [&](const float* qf, float* of, float* lf) {
                                      cpu::run(plan, b.kv.views, qf, of, lf);
                                    });
          },
          nb::arg("q"), nb::kw_only(), nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(),
          "As Plan.run, on the bound K/V.")
      .def_prop_ro("plan", [](const PyBound& b) { return nb::typed<nb::object, PyPlan>(b.owner); }, "The Plan it runs.")
      .def("__repr__", [](const PyBound& b) {
        return cat("BoundPlan(", b.plan->plan.n_segments(), " segments, ", b.plan->plan.n_rows(), " query rows, K/V ",
                   b.kv.arrays.size() == 2 ? "in one array" : "one array per segment", ")");
      });

  nb::class_<PySplit>(m, "SplitLayout",
                      "The split baseline: every sequence's keys copied into a buffer of its own (shared segments\n"
                      "once per sequence), attended sequence by sequence. SplitLayout(plan, k, v) copies k, v\n"
                      "(as Plan.run takes them); run(q) attends.")
      .def(
          "__init__",
          [](PySplit* self, const PyPlan& p, ArraysArg k, ArraysArg v, StartsArg starts) {
            KvArgs kv;
            kv_views(p.plan.tree(), k, v, starts, kv);
            nb::gil_scoped_release release;
            SplitLayout layout = make_split(p.plan.tree(), kv.views);
            Plan plan = cpu::plan(layout.tree, cpu::Options{p.n_threads});
            new (self) PySplit{std::move(layout), std::move(plan)};
          },
          nb::arg("plan"), nb::arg("k"), nb::arg("v"), nb::kw_only(), nb::arg("starts") = nb::none())
      .def(
          "run",
          [](const PySplit& s, ArrayArg q, ArrayArg out, ArrayArg lse) {
            return run_with_queries(s.plan.shape(), s.plan.n_rows(), q, out, lse,
                                    [&](const float* qf, float* of, float* lf) {
                                      cpu::run(s.plan, s.layout.views, qf, of, lf);
                                    });
          },
          nb::arg("q"), nb::kw_only(), nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(),
          "As Plan.run, on the copied K/V.")
      .def_prop_ro("kv_bytes", [](const PySplit& s) { return s.layout.kv_bytes(); });

  nb::class_<PyUnified>(m, "UnifiedLayout",
                        "The unified baseline: every segment stored once in one buffer, every query row scoring\n"
                        "every key under a sequence mask. UnifiedLayout(plan, k, v) copies k, v (one dtype);\n"
                        "run(q) attends.")
      .def(
          "__init__",
          [](PyUnified* self, const PyPlan& p, ArraysArg k, ArraysArg v, StartsArg starts) {
            KvArgs kv;
            kv_views(p.plan.tree(), k, v, starts, kv);
            nb::gil_scoped_release release;
            auto layout = std::make_unique<UnifiedLayout>(make_unified(p.plan.tree(), kv.views));
            cpu::UnifiedPlan plan = cpu::plan_unified(p.plan.shape(), layout->batch.kv.n_tokens, layout->batch.n_rows,
                                                      cpu::Options{p.n_threads}, p.plan.scale());
            new (self) PyUnified{std::move(layout), std::move(plan)};
          },
          nb::arg("plan"), nb::arg("k"), nb::arg("v"), nb::kw_only(), nb::arg("starts") = nb::none())
      .def(
          "run",
          [](const PyUnified& u, ArrayArg q, ArrayArg out, ArrayArg lse) {
            return run_with_queries(u.plan.shape, u.plan.n_rows, q, out, lse,
                                    [&](const float* qf, float* of, float* lf) {
                                      cpu::run_unified(u.plan, u.layout->batch, qf, of, lf);
                                    });
          },
          nb::arg("q"), nb::kw_only(), nb::arg("out") = nb::none(), nb::arg("lse") = nb::none(),
          "As Plan.run, on the copied K/V.")
      .def_prop_ro("kv_bytes", [](const PyUnified& u) { return u.layout->kv_bytes(); });

  m.def("_time_runs", &time_runs, nb::arg("plan"), nb::arg("k"), nb::arg("v"), nb::arg("q"), nb::arg("n"),
        "Seconds of each of n runs of plan timed from C++ (bench/python_overhead.py's baseline).");
}

}  // namespace cascade::py
