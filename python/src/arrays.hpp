// Arrays from Python (NumPy arrays, PyTorch CPU tensors, anything with DLPack or the buffer protocol) as the
// library sees them, and results made in the caller's framework.
//
// Inputs are read in place (no copy) whenever the library can take their layout; a wrong dtype raises
// TypeError, a wrong shape, device or layout ValueError, each message starting with the argument's name.
// PyTorch tensors are read through their own attributes (data_ptr, shape, stride), NumPy arrays through the
// buffer protocol, anything else through nanobind (DLPack): the first two are the cheap ways (what each costs:
// docs/study.md §9). Everything here runs with the GIL held, except the element loops (read_f32,
// write_from_f32), which touch array memory only.
#pragma once

#include "cascade/simd.hpp"  // before Eigen, which includes the intrinsics too

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cascade/dtype.hpp"

namespace cascade::py {

namespace nb = nanobind;

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
template <class... Args>
[[noreturn]] void type_error(Args&&... args) {
  throw nb::type_error(cat(std::forward<Args>(args)...).c_str());
}
template <class... Args>
[[noreturn]] void value_error(Args&&... args) {
  throw nb::value_error(cat(std::forward<Args>(args)...).c_str());
}

// An argument's name in messages, "k", "k[3]" or "k[3].codes"; formatted only when a message is made.
struct Name {
  const char* base;
  int index = -1;
  const char* field = nullptr;  // a part of the argument (a q8_0 K/V's codes or scales)
};
std::ostream& operator<<(std::ostream& os, const Name& n);

// The framework results are returned in: PyTorch when the model argument is a torch.Tensor, else NumPy.
enum class Framework { numpy, torch };
Framework framework_of(nb::handle obj);

// One array argument on the CPU: where its elements are, their type, shape and strides (in elements), and
// a reference that keeps its memory alive.
class ArrayRef {
 public:
  static constexpr size_t kMaxDims = 8;
  ArrayRef() = default;
  ArrayRef(ArrayRef&& o) noexcept { *this = std::move(o); }
  ArrayRef& operator=(ArrayRef&& o) noexcept;
  ArrayRef(const ArrayRef&) = delete;
  ArrayRef& operator=(const ArrayRef&) = delete;
  ~ArrayRef();  // with the GIL held
  size_t ndim() const { return ndim_; }
  size_t shape(size_t i) const { return size_t(shape_[i]); }
  int64_t stride(size_t i) const { return strides_[i]; }
  void* data() const { return data_; }
  const nb::dlpack::dtype& dtype() const { return dtype_; }
  size_t size() const {
    size_t n = 1;
    for (size_t i = 0; i < ndim_; ++i) n *= size_t(shape_[i]);
    return n;
  }
  // True when the array is laid out densely in row-major order (what the library's q, o, lse pointers mean).
  bool c_contiguous() const;
  bool has_shape(std::initializer_list<int64_t> s) const;  // a negative extent in s matches any
  std::vector<int64_t> shape_vector() const { return {shape_.begin(), shape_.begin() + ndim_}; }

 private:
  friend ArrayRef as_array(nb::handle, Name, bool);
  bool from_buffer(nb::handle obj, Name name, bool writable);
  nb::object owner_;         // a tensor read through its attributes
  Py_buffer view_{};         // an object read through the buffer protocol (view_.obj set)
  nb::ndarray<nb::ro> nd_;   // anything else, through DLPack
  void* data_ = nullptr;
  nb::dlpack::dtype dtype_{};
  size_t ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{}, strides_{};
};

// obj as an array on the CPU, or TypeError / ValueError naming it. writable: it will be written to.
ArrayRef as_array(nb::handle obj, Name name, bool writable = false);

// The element type of a (f32, f16 or bf16), else TypeError naming it.
DType float_dtype(const ArrayRef& a, Name name);
bool is_int8(const nb::dlpack::dtype& dt);
bool is_float16(const nb::dlpack::dtype& dt);
std::string dtype_str(const nb::dlpack::dtype& dt);
const char* python_dtype_name(DType dt);  // "float32", "float16", "bfloat16"

std::string shape_str(const std::vector<int64_t>& shape);
// ValueError naming the argument unless a has exactly shape `want` (a negative extent: any); `dims` names the
// dimensions in the message.
void check_shape(const ArrayRef& a, std::initializer_list<int64_t> want, Name name, const char* dims);

// An array's elements as f32, row-major, into dst (a.size() floats); any strides, any float dtype.
void read_f32(const ArrayRef& a, DType dt, float* dst);
// n floats into dst, an element type dt buffer (f16, bf16: rounded to nearest even).
void write_from_f32(const float* src, void* dst, DType dt, int64_t n);

// a's elements copied row-major into dst (a.size() elements of a's own type), any strides.
void copy_dense(const ArrayRef& a, void* dst);

// A fresh C-contiguous array of the given shape and type, owned by the returned Python object.
struct NewArray {
  nb::object obj;
  void* data = nullptr;
};
NewArray new_array(Framework fw, DType dt, const std::vector<int64_t>& shape);
// The same with int8 elements (q8_0 codes).
NewArray new_int8_array(Framework fw, const std::vector<int64_t>& shape);

// f32 data for the library: a's memory when it is f32 and C-contiguous, else a converted copy in `tmp`.
const float* as_f32(const ArrayRef& a, DType dt, std::vector<float>& tmp);

}  // namespace cascade::py
