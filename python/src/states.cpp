// Attention states from Python: (o, lse) pairs, o (..., head_dim) in float32/float16/bfloat16 and lse (...)
// in float32, natural log (state.hpp); the empty state is (0, -inf). merge_state and merge_state_in_place merge
// two, merge_states any number stacked on the first axis.
#include "bindings.hpp"

#include <cmath>
#include <vector>

#include "arrays.hpp"
#include "typed.hpp"
#include "cascade/state.hpp"

namespace cascade::py {

namespace {

// Element offsets of every index of a's dimensions [first, last), row-major.
std::vector<int64_t> index_offsets(const ArrayRef& a, size_t first, size_t last) {
  std::vector<int64_t> offs{0};
  for (size_t i = first; i < last; ++i) {
    std::vector<int64_t> next;
    next.reserve(offs.size() * a.shape(i));
    for (int64_t base : offs)
      for (size_t j = 0; j < a.shape(i); ++j) next.push_back(base + int64_t(j) * a.stride(i));
    offs = std::move(next);
  }
  return offs;
}

// One argument's states: o (lead..., head_dim) and lse (lead...), with `skip` leading dims taken apart (the
// states axis of merge_states). Rows are read as f32, in place when they are f32 and dense.
struct States {
  ArrayRef o, lse;
  DType dt = DType::f32;
  int64_t d = 0;
  std::vector<int64_t> row_off, lse_off;  // per row, in elements

  States(nb::handle o_obj, nb::handle lse_obj, const char* o_name, const char* lse_name, size_t skip = 0) {
    o = as_array(o_obj, {o_name});
    lse = as_array(lse_obj, {lse_name});
    dt = float_dtype(o, {o_name});
    if (float_dtype(lse, {lse_name}) != DType::f32)
      type_error(lse_name, ": expected float32 elements (log-sum-exp needs them), got ", dtype_str(lse.dtype()));
    if (o.ndim() < skip + 1)
      value_error(o_name, ": expected at least ", skip + 1, " dimension(s) ending in head_dim, got shape ",
                  shape_str(o.shape_vector()));
    d = int64_t(o.shape(o.ndim() - 1));
    if (d == 0) value_error(o_name, ": head_dim (its last dimension) is 0");
    std::vector<int64_t> want = o.shape_vector();
    want.pop_back();
    if (lse.shape_vector() != want)
      value_error(lse_name, ": expected shape ", shape_str(want), " (", o_name, "'s shape without head_dim), got ",
                  shape_str(lse.shape_vector()));
    row_off = index_offsets(o, skip, o.ndim() - 1);
    lse_off = index_offsets(lse, skip, lse.ndim());
  }
  int64_t n_rows() const { return int64_t(row_off.size()); }
  // Row r (of state j on the skipped axis) as f32: in place, or converted into buf (d floats).
  const float* row(int64_t r, float* buf, int64_t j = 0) const {
    const int64_t off = row_off[size_t(r)] + j * (o.ndim() > 1 ? o.stride(0) : 0);
    const int64_t s = o.stride(o.ndim() - 1);
    if (dt == DType::f32 && (s == 1 || d == 1)) return static_cast<const float*>(o.data()) + off;
    dispatch_float_dtype(dt, [&]<class T>() {
      const T* src = static_cast<const T*>(o.data()) + off;
      for (int64_t i = 0; i < d; ++i) buf[i] = to_float(src[i * s]);
    });
    return buf;
  }
  float lse_at(int64_t r, int64_t j = 0) const {
    return static_cast<const float*>(lse.data())[lse_off[size_t(r)] + j * (lse.ndim() > 0 ? lse.stride(0) : 0)];
  }
};

// A fresh result (o of o_like's leading shape + head_dim, in dt; lse float32), written one row at a time.
struct Result {
  NewArray o, lse;
  DType dt;
  int64_t d;
  Result(Framework fw, DType dt_, std::vector<int64_t> shape, int64_t d_) : dt(dt_), d(d_) {
    lse = new_array(fw, DType::f32, shape);
    shape.push_back(d);
    o = new_array(fw, dt, shape);
  }
  // Where row r's f32 values go: the result itself when f32, else buf (then commit converts).
  float* row(int64_t r, float* buf) { return dt == DType::f32 ? static_cast<float*>(o.data) + r * d : buf; }
  void commit(int64_t r, const float* buf, float lse_value) {
    if (dt != DType::f32) write_from_f32(buf, static_cast<char*>(o.data) + r * d * dtype_size(dt), dt, d);
    static_cast<float*>(lse.data)[r] = lse_value;
  }
  ArrayPair tuple() { return ArrayPair(nb::make_tuple(o.obj, lse.obj)); }
};

ArrayPair merge_state_py(ArrayArg o_a, ArrayArg lse_a, ArrayArg o_b, ArrayArg lse_b) {
  const States a(o_a, lse_a, "o_a", "lse_a"), b(o_b, lse_b, "o_b", "lse_b");
  if (a.o.shape_vector() != b.o.shape_vector())
    value_error("o_b: expected o_a's shape ", shape_str(a.o.shape_vector()), ", got ", shape_str(b.o.shape_vector()));
  std::vector<int64_t> lead = a.o.shape_vector();
  lead.pop_back();
  Result out(framework_of(o_a), a.dt, lead, a.d);
  {
    nb::gil_scoped_release release;
    std::vector<float> buf_a(size_t(a.d)), buf_b(size_t(a.d)), buf_o(size_t(a.d));
    for (int64_t r = 0; r < a.n_rows(); ++r) {
      float* o = out.row(r, buf_o.data());
      float lse;
      merge_state(a.row(r, buf_a.data()), a.lse_at(r), b.row(r, buf_b.data()), b.lse_at(r), o, &lse, a.d);
      out.commit(r, o, lse);
    }
  }
  return out.tuple();
}

void merge_state_in_place_py(ArrayArg o_a, ArrayArg lse_a, ArrayArg o_b, ArrayArg lse_b) {
  const States a(o_a, lse_a, "o_a", "lse_a"), b(o_b, lse_b, "o_b", "lse_b");
  if (a.o.shape_vector() != b.o.shape_vector())
    value_error("o_b: expected o_a's shape ", shape_str(a.o.shape_vector()), ", got ", shape_str(b.o.shape_vector()));
  const ArrayRef wo = as_array(o_a, {"o_a"}, true), wl = as_array(lse_a, {"lse_a"}, true);
  nb::gil_scoped_release release;
  std::vector<float> buf_a(size_t(a.d)), buf_b(size_t(a.d));
  const int64_t s = wo.stride(wo.ndim() - 1);
  for (int64_t r = 0; r < a.n_rows(); ++r) {
    const float* pa = a.row(r, buf_a.data());
    if (pa != buf_a.data()) std::copy_n(pa, a.d, buf_a.data());
    float lse = a.lse_at(r);
    merge_state_inplace(buf_a.data(), &lse, b.row(r, buf_b.data()), b.lse_at(r), a.d);
    dispatch_float_dtype(a.dt, [&]<class T>() {
      T* dst = static_cast<T*>(wo.data()) + a.row_off[size_t(r)];
      for (int64_t i = 0; i < a.d; ++i) dst[i * s] = T(buf_a[size_t(i)]);
    });
    static_cast<float*>(wl.data())[a.lse_off[size_t(r)]] = lse;
  }
}

ArrayPair merge_states_py(ArrayArg o, ArrayArg lse) {
  const States st(o, lse, "o", "lse", 1);
  const int64_t n = int64_t(st.o.shape(0));
  std::vector<int64_t> lead = st.o.shape_vector();
  lead.erase(lead.begin());
  lead.pop_back();
  Result out(framework_of(o), st.dt, lead, st.d);
  {
    nb::gil_scoped_release release;
    std::vector<float> bufs(static_cast<size_t>(n * st.d)), buf_o(static_cast<size_t>(st.d));
    std::vector<float> lses(static_cast<size_t>(n));
    std::vector<const float*> rows(static_cast<size_t>(n));
    for (int64_t r = 0; r < st.n_rows(); ++r) {
      for (int64_t j = 0; j < n; ++j) {
        rows[size_t(j)] = st.row(r, bufs.data() + j * st.d, j);
        lses[size_t(j)] = st.lse_at(r, j);
      }
      float* dst = out.row(r, buf_o.data());
      float l;
      merge_states(n, rows.data(), lses.data(), dst, &l, st.d);
      out.commit(r, dst, l);
    }
  }
  return out.tuple();
}

}  // namespace

void bind_states(nb::module_& m) {
  m.def("merge_state", &merge_state_py, nb::arg("o_a"), nb::arg("lse_a"), nb::arg("o_b"), nb::arg("lse_b"),
        "The exact merge of two attention states: (o, lse) of the union of their keys.\n\n"
        "o_a, o_b: (..., head_dim), float32, float16 or bfloat16; lse_a, lse_b: (...), float32, natural log.\n"
        "An empty state is (0, -inf): merging with it is the identity, two empty states give an empty one.\n"
        "Returns (o, lse): o in o_a's dtype, lse float32, in o_a's framework (NumPy or PyTorch).");
  m.def("merge_state_in_place", &merge_state_in_place_py, nb::arg("o_a"), nb::arg("lse_a"), nb::arg("o_b"),
        nb::arg("lse_b"), "merge_state, written into o_a and lse_a (which must be writable).");
  m.def("merge_states", &merge_states_py, nb::arg("o"), nb::arg("lse"),
        "The exact merge of n attention states stacked on the first axis.\n\n"
        "o: (n, ..., head_dim), lse: (n, ...). Returns (o, lse) of shapes (..., head_dim) and (...); n = 0 gives\n"
        "empty states (0, -inf).");
}

}  // namespace cascade::py
