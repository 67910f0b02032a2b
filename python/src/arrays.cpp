#include "arrays.hpp"

#include <bit>
#include <cstring>

namespace cascade::py {

namespace {

constexpr uint8_t kFloat = uint8_t(nb::dlpack::dtype_code::Float);
constexpr uint8_t kBfloat = uint8_t(nb::dlpack::dtype_code::Bfloat);

const char* device_name(int type) {
  switch (type) {
    case nb::device::cuda::value: return "cuda";
    case nb::device::cuda_host::value: return "cuda_host";
    case nb::device::cuda_managed::value: return "cuda_managed";
    case nb::device::rocm::value: return "rocm";
    case nb::device::metal::value: return "mps";
    default: return "a non-CPU device";
  }
}

// torch and the few of its objects the fast path compares with, looked up once torch has been imported
// (cascade never imports it); references kept for the process's life. GIL held.
struct Torch {
  PyObject* tensor = nullptr;
  PyObject* f32 = nullptr;
  PyObject* f16 = nullptr;
  PyObject* bf16 = nullptr;
  PyObject* i8 = nullptr;  // q8_0 codes
  PyObject* strided = nullptr;
  PyObject* empty = nullptr;
  PyObject* cpu = nullptr;  // torch.device("cpu"): results are made there whatever torch's default device
};

const Torch& torch_objects() {
  static Torch t;
  if (t.tensor) return t;
  static PyObject* const s_torch = PyUnicode_InternFromString("torch");  // kept for the process's life
  PyObject* torch = PyDict_GetItem(PyImport_GetModuleDict(), s_torch);  // borrowed
  if (!torch) return t;
  Torch found;
  found.f32 = PyObject_GetAttrString(torch, "float32");
  found.f16 = PyObject_GetAttrString(torch, "float16");
  found.bf16 = PyObject_GetAttrString(torch, "bfloat16");
  found.i8 = PyObject_GetAttrString(torch, "int8");
  found.strided = PyObject_GetAttrString(torch, "strided");
  found.tensor = PyObject_GetAttrString(torch, "Tensor");
  found.empty = PyObject_GetAttrString(torch, "empty");
  if (PyObject* device = PyObject_GetAttrString(torch, "device")) {
    found.cpu = PyObject_CallFunction(device, "s", "cpu");
    Py_DECREF(device);
  }
  PyErr_Clear();
  if (found.f32 && found.f16 && found.bf16 && found.i8 && found.strided && found.tensor && found.empty && found.cpu &&
      PyType_Check(found.tensor))
    return t = found;
  for (PyObject* o : {found.f32, found.f16, found.bf16, found.i8, found.strided, found.tensor, found.empty, found.cpu})
    Py_XDECREF(o);
  return t;
}

bool is_tensor(const Torch& t, nb::handle obj) {
  return t.tensor && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(t.tensor));
}

PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }  // kept for the process's life

// Reads a strided CPU tensor of a float type (or int8: q8_0 codes) through its attributes; false (error
// indicator clear) for anything else, which then goes through DLPack and its messages.
bool read_tensor(const Torch& t, nb::handle obj, nb::dlpack::dtype& dtype, size_t& ndim, int64_t* shape,
                 int64_t* strides, void*& data) {
  static PyObject* const s_is_cpu = interned("is_cpu");
  static PyObject* const s_layout = interned("layout");
  static PyObject* const s_dtype = interned("dtype");
  static PyObject* const s_shape = interned("shape");
  static PyObject* const s_stride = interned("stride");
  static PyObject* const s_data_ptr = interned("data_ptr");
  const auto get = [&](PyObject* name) { return nb::steal(PyObject_GetAttr(obj.ptr(), name)); };
  const nb::object is_cpu = get(s_is_cpu), layout = get(s_layout), dt = get(s_dtype), sh = get(s_shape);
  if (!is_cpu || !layout || !dt || !sh) {
    PyErr_Clear();
    return false;
  }
  if (is_cpu.ptr() != Py_True || layout.ptr() != t.strided || !PyTuple_Check(sh.ptr())) return false;
  if (dt.ptr() == t.f32) dtype = {uint8_t(nb::dlpack::dtype_code::Float), 32, 1};
  else if (dt.ptr() == t.f16) dtype = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
  else if (dt.ptr() == t.bf16) dtype = {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  else if (dt.ptr() == t.i8) dtype = {uint8_t(nb::dlpack::dtype_code::Int), 8, 1};
  else return false;
  ndim = size_t(PyTuple_GET_SIZE(sh.ptr()));
  if (ndim > ArrayRef::kMaxDims) return false;
  const nb::object st = nb::steal(PyObject_CallMethodNoArgs(obj.ptr(), s_stride));
  const nb::object ptr = nb::steal(PyObject_CallMethodNoArgs(obj.ptr(), s_data_ptr));
  if (!st || !ptr || !PyTuple_Check(st.ptr()) || size_t(PyTuple_GET_SIZE(st.ptr())) != ndim) {
    PyErr_Clear();
    return false;
  }
  for (size_t i = 0; i < ndim; ++i) {
    shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(sh.ptr(), Py_ssize_t(i)));
    strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(st.ptr(), Py_ssize_t(i)));
  }
  data = PyLong_AsVoidPtr(ptr.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// obj.requires_grad, false when it has none.
bool requires_grad(nb::handle obj) {
  static PyObject* const s_requires_grad = interned("requires_grad");
  const nb::object r = nb::steal(PyObject_GetAttr(obj.ptr(), s_requires_grad));
  if (!r) PyErr_Clear();
  return r.ptr() == Py_True;
}

// obj.is_neg(), false when it has none.
bool negative_bit(nb::handle obj) {
  static PyObject* const s_is_neg = interned("is_neg");
  const nb::object r = nb::steal(PyObject_CallMethodNoArgs(obj.ptr(), s_is_neg));
  if (!r) PyErr_Clear();
  return r.ptr() == Py_True;
}

// Calls f(element offset) for every element of a in row-major order (offsets in elements).
template <class F>
void for_each_offset(const ArrayRef& a, F&& f) {
  const size_t nd = a.ndim();
  if (a.size() == 0) return;
  if (nd == 0) {
    f(int64_t(0));
    return;
  }
  const int64_t inner = int64_t(a.shape(nd - 1)), inner_stride = a.stride(nd - 1);
  std::vector<int64_t> idx(nd, 0);
  for (;;) {
    int64_t base = 0;
    for (size_t i = 0; i + 1 < nd; ++i) base += idx[i] * a.stride(i);
    for (int64_t j = 0; j < inner; ++j) f(base + j * inner_stride);
    size_t i = nd - 1;
    for (;;) {
      if (i == 0) return;
      --i;
      if (++idx[i] < int64_t(a.shape(i))) break;
      idx[i] = 0;
    }
  }
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const Name& n) {
  os << n.base;
  if (n.index >= 0) os << "[" << n.index << "]";
  if (n.field) os << "." << n.field;
  return os;
}

Framework framework_of(nb::handle obj) { return is_tensor(torch_objects(), obj) ? Framework::torch : Framework::numpy; }

bool ArrayRef::c_contiguous() const {
  int64_t expect = 1;
  for (size_t i = ndim_; i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expect) return false;
    expect *= shape_[i];
  }
  return true;
}

bool ArrayRef::has_shape(std::initializer_list<int64_t> s) const {
  if (s.size() != ndim_) return false;
  size_t i = 0;
  for (int64_t x : s)
    if (shape_[i++] != x && x >= 0) return false;
  return true;
}

ArrayRef& ArrayRef::operator=(ArrayRef&& o) noexcept {
  if (this == &o) return *this;
  if (view_.obj) PyBuffer_Release(&view_);
  owner_ = std::move(o.owner_);
  view_ = o.view_;
  o.view_ = Py_buffer{};
  nd_ = std::move(o.nd_);
  data_ = o.data_;
  dtype_ = o.dtype_;
  ndim_ = o.ndim_;
  shape_ = o.shape_;
  strides_ = o.strides_;
  return *this;
}

ArrayRef::~ArrayRef() {
  if (view_.obj) PyBuffer_Release(&view_);
}

namespace {

// The element type a buffer's struct-module format names (native byte order), or code 0 when unknown.
nb::dlpack::dtype format_dtype(const char* f) {
  using code = nb::dlpack::dtype_code;
  if (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!') ++f;  // the byte order: checked by the caller
  if (f[0] == 0 || f[1] != 0) return {};
  const auto t = [](code c, int bits) { return nb::dlpack::dtype{uint8_t(c), uint8_t(bits), 1}; };
  switch (f[0]) {
    case 'e': return t(code::Float, 16);
    case 'f': return t(code::Float, 32);
    case 'd': return t(code::Float, 64);
    case 'g': return t(code::Float, 128);
    case 'b': return t(code::Int, 8);
    case 'h': return t(code::Int, 16);
    case 'i': return t(code::Int, 32);
    case 'l': case 'q': return t(code::Int, 64);
    case 'B': return t(code::UInt, 8);
    case 'H': return t(code::UInt, 16);
    case 'I': return t(code::UInt, 32);
    case 'L': case 'Q': return t(code::UInt, 64);
    case '?': return t(code::Bool, 8);
    default: return {};
  }
}

}  // namespace

// Reads obj through the buffer protocol (NumPy arrays); false for an object without one, or whose elements
// are not a plain number type (those go through DLPack).
bool ArrayRef::from_buffer(nb::handle obj, Name name, bool writable) {
  if (!PyObject_CheckBuffer(obj.ptr())) return false;
  if (PyObject_GetBuffer(obj.ptr(), &view_, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    view_ = Py_buffer{};
    if (writable) type_error(name, ": expected a writable NumPy array or PyTorch CPU tensor, got a read-only ",
                             nb::inst_name(obj).c_str());
    return false;
  }
  const char* format = view_.format ? view_.format : "B";
  dtype_ = format_dtype(format);
  const bool little = std::endian::native == std::endian::little;
  if (dtype_.bits > 8 && ((format[0] == '<' && !little) || ((format[0] == '>' || format[0] == '!') && little))) {
    PyBuffer_Release(&view_);
    view_ = Py_buffer{};
    type_error(name, ": its elements are in the other byte order; pass ", name, ".astype(", name,
               ".dtype.newbyteorder('='))");
  }
  if (dtype_.code == 0 && dtype_.bits == 0) {
    PyBuffer_Release(&view_);
    view_ = Py_buffer{};
    return false;
  }
  if (size_t(view_.ndim) > kMaxDims) value_error(name, ": more than ", kMaxDims, " dimensions");
  ndim_ = size_t(view_.ndim);
  data_ = view_.buf;
  for (size_t i = 0; i < ndim_; ++i) {
    shape_[i] = view_.shape[i];
    if (view_.strides[i] % view_.itemsize != 0)
      value_error(name, ": its strides are not a multiple of its element size; pass a copy");
    strides_[i] = view_.strides[i] / view_.itemsize;
  }
  return true;
}

ArrayRef as_array(nb::handle obj, Name name, bool writable) {
  ArrayRef a;
  const Torch& t = torch_objects();
  if (is_tensor(t, obj) && read_tensor(t, obj, a.dtype_, a.ndim_, a.shape_.data(), a.strides_.data(), a.data_)) {
    // A lazily negated view (its negative bit set, as z.conj().imag) holds the elements' opposites.
    if (negative_bit(obj))
      value_error(name, ": the tensor is a lazily negated view (its negative bit is set); pass ", name,
                  ".resolve_neg()");
    // As torch's own out= arguments: writing behind autograd's back is refused.
    if (writable && requires_grad(obj))
      type_error(name, ": a tensor that requires grad cannot be written to (autograd would not see it); pass one "
                 "that does not, or ", name, ".detach() to write anyway");
    a.owner_ = nb::borrow(obj);
    return a;
  }
  if (a.from_buffer(obj, name, writable)) return a;
  // No conversion: an array is read where it lies, or refused with a message naming the argument.
  bool ok;
  if (writable) {
    nb::ndarray<> w;
    ok = nb::try_cast(obj, w, false);
    if (ok) a.nd_ = nb::ndarray<nb::ro>(w);
  } else {
    ok = nb::try_cast(obj, a.nd_, false);
  }
  if (!ok) {
    if (nb::hasattr(obj, "detach") && requires_grad(obj))
      type_error(name, ": a tensor that requires grad cannot be read in place; pass ", name, ".detach()");
    type_error(name, ": expected ", writable ? "a writable NumPy array or PyTorch CPU tensor" : "a NumPy array or a PyTorch CPU tensor",
               ", got ", nb::inst_name(obj).c_str());
  }
  const auto& nd = a.nd_;
  if (nd.device_type() != nb::device::cpu::value)
    value_error(name, ": the array is on ", device_name(nd.device_type()),
                "; cascade's Python kernels run on the CPU (move it with .cpu())");
  if (nd.ndim() > ArrayRef::kMaxDims) value_error(name, ": more than ", ArrayRef::kMaxDims, " dimensions");
  a.ndim_ = nd.ndim();
  for (size_t i = 0; i < a.ndim_; ++i) {
    a.shape_[i] = int64_t(nd.shape(i));
    a.strides_[i] = nd.stride(i);
  }
  a.dtype_ = nd.dtype();
  a.data_ = const_cast<void*>(static_cast<const void*>(nd.data()));
  return a;
}

std::string dtype_str(const nb::dlpack::dtype& dt) {
  const char* kind = "?";
  switch (nb::dlpack::dtype_code(dt.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: break;
  }
  return cat(kind, int(dt.bits));
}

const char* python_dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::q8_0: return "q8_0";
  }
  return "?";
}

DType float_dtype(const ArrayRef& a, Name name) {
  const nb::dlpack::dtype& dt = a.dtype();
  if (dt.lanes == 1) {
    if (dt.code == kFloat && dt.bits == 32) return DType::f32;
    if (dt.code == kFloat && dt.bits == 16) return DType::f16;
    if (dt.code == kBfloat && dt.bits == 16) return DType::bf16;
  }
  type_error(name, ": expected float32, float16 or bfloat16 elements, got ", dtype_str(dt));
}

bool is_int8(const nb::dlpack::dtype& dt) {
  return dt.lanes == 1 && dt.code == uint8_t(nb::dlpack::dtype_code::Int) && dt.bits == 8;
}
bool is_float16(const nb::dlpack::dtype& dt) { return dt.lanes == 1 && dt.code == kFloat && dt.bits == 16; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

void check_shape(const ArrayRef& a, std::initializer_list<int64_t> want, Name name, const char* dims) {
  if (a.has_shape(want)) return;
  std::string w = "(";
  for (int64_t x : want) w += (w.size() > 1 ? ", " : "") + (x < 0 ? std::string("any") : std::to_string(x));
  value_error(name, ": expected shape ", w, want.size() == 1 ? ",) " : ") ", dims, ", got ",
              shape_str(a.shape_vector()));
}

void read_f32(const ArrayRef& a, DType dt, float* dst) {
  dispatch_float_dtype(dt, [&]<class T>() {
    const T* src = static_cast<const T*>(a.data());
    if (a.c_contiguous()) {
      convert_to_f32(src, dst, int64_t(a.size()));
      return;
    }
    for_each_offset(a, [&](int64_t off) { *dst++ = to_float(src[off]); });
  });
}

void write_from_f32(const float* src, void* dst, DType dt, int64_t n) {
  dispatch_float_dtype(dt, [&]<class T>() {
    T* d = static_cast<T*>(dst);
    if constexpr (std::is_same_v<T, float>) std::memcpy(d, src, size_t(n) * sizeof(float));
    else
      for (int64_t i = 0; i < n; ++i) d[i] = T(src[i]);
  });
}

void copy_dense(const ArrayRef& a, void* dst) {
  const size_t size = a.dtype().bits / 8;
  const char* src = static_cast<const char*>(a.data());
  char* d = static_cast<char*>(dst);
  if (a.size() == 0) return;
  if (a.c_contiguous()) {
    std::memcpy(d, src, a.size() * size);
    return;
  }
  for_each_offset(a, [&](int64_t off) {
    std::memcpy(d, src + off * int64_t(size), size);
    d += size;
  });
}

namespace {

// An empty array of `shape` by the framework's own empty() (cheaper than exporting memory of ours through
// DLPack): PyTorch's with torch_dtype, else NumPy's with np_name.
NewArray empty_array(Framework fw, PyObject* torch_dtype, const char* np_name, const std::vector<int64_t>& shape) {
  static PyObject* const s_dtype = interned("dtype");
  static PyObject* const s_device = interned("device");
  static PyObject* const kw_torch = PyTuple_Pack(2, s_dtype, s_device);  // kept for the process's life
  nb::tuple sh = nb::steal<nb::tuple>(PyTuple_New(Py_ssize_t(shape.size())));
  for (size_t i = 0; i < shape.size(); ++i) PyTuple_SET_ITEM(sh.ptr(), Py_ssize_t(i), PyLong_FromLongLong(shape[i]));
  const Torch& t = torch_objects();
  NewArray out;
  if (fw == Framework::torch && t.empty) {
    PyObject* args[] = {sh.ptr(), torch_dtype, t.cpu};
    out.obj = nb::steal(PyObject_Vectorcall(t.empty, args, 1, kw_torch));
  } else {
    static PyObject* const np_empty = [] {
      nb::object np = nb::module_::import_("numpy");
      return nb::getattr(np, "empty").release().ptr();
    }();
    nb::object np_dtype = nb::str(np_name);
    PyObject* args[] = {sh.ptr(), np_dtype.ptr()};
    out.obj = nb::steal(PyObject_Vectorcall(np_empty, args, 2, nullptr));
  }
  if (!out.obj.is_valid()) throw nb::python_error();
  out.data = as_array(out.obj, {"result"}, true).data();
  return out;
}

}  // namespace

NewArray new_array(Framework fw, DType dt, const std::vector<int64_t>& shape) {
  const Torch& t = torch_objects();
  if (fw != Framework::torch && dt == DType::bf16)
    type_error("q: bfloat16 results need PyTorch (NumPy has no bfloat16)");
  return empty_array(fw, dt == DType::f32 ? t.f32 : dt == DType::f16 ? t.f16 : t.bf16, python_dtype_name(dt), shape);
}

NewArray new_int8_array(Framework fw, const std::vector<int64_t>& shape) {
  return empty_array(fw, torch_objects().i8, "int8", shape);
}

const float* as_f32(const ArrayRef& a, DType dt, std::vector<float>& tmp) {
  if (dt == DType::f32 && a.c_contiguous()) return static_cast<const float*>(a.data());
  tmp.resize(a.size());
  read_f32(a, dt, tmp.data());
  return tmp.data();
}

}  // namespace cascade::py
