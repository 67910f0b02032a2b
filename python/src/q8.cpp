#include "q8.hpp"

#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "typed.hpp"
#include "cascade/q8_0.hpp"

namespace cascade::py {

namespace {

// head_dim of an array whose last dimension it is: ValueError naming `name` unless it is a positive multiple of
// kQ8Block.
int64_t q8_head_dim(const ArrayRef& a, Name name) {
  if (a.ndim() == 0) value_error(name, ": expected at least one dimension (head_dim last), got a scalar");
  const int64_t d = int64_t(a.shape(a.ndim() - 1));
  if (d == 0 || d % kQ8Block != 0)
    value_error(name, ": q8_0 needs a head_dim (the last dimension) that is a positive multiple of ", kQ8Block,
                ", got ", d);
  return d;
}

constexpr const char* kQ8Doc =
    "q8_0 K or V, as Plan.run, Plan.bind and the layouts take them: Q8_0(codes, scales).\n\n"
    "codes: int8, (tokens, n_kv_heads, head_dim); scales: float16, (tokens, n_kv_heads, head_dim // 32), one per\n"
    "32 codes of a head's row: element i of a row is codes[..., i] * scales[..., i // 32] (head_dim a multiple of\n"
    "32). NumPy arrays or PyTorch CPU tensors, read in place: dense, or views whose scales' strides are the codes'\n"
    "divided by 32 (slices of both along the token axis are). quantize_q8_0(x) makes one from float values;\n"
    "`codes, scales = q` unpacks it; q.dequantize() gives the float32 values the kernels see.";

constexpr const char* kQuantizeDoc =
    "x (..., head_dim) of float32, float16 or bfloat16 as q8_0, by the library's quantizer: a Q8_0 of int8 codes\n"
    "(x's shape) and float16 scales (x's shape with head_dim // 32), in x's framework. Each block of 32 values\n"
    "gets the scale d = float16(max |x| / 127) and codes round(x / d) (to nearest even, within [-127, 127]), so\n"
    "every value is within d / 2 of what is stored; a block holding a NaN or an infinity reads back as NaN.\n"
    "head_dim must be a multiple of 32.";

}  // namespace

const Q8Arrays* as_q8(nb::handle h) { return nb::isinstance<Q8Arrays>(h) ? nb::inst_ptr<Q8Arrays>(h) : nullptr; }

void check_q8(const ArrayRef& codes, const ArrayRef& scales, Name cn, Name sn) {
  if (!is_int8(codes.dtype())) type_error(cn, ": expected int8 elements (q8_0 codes), got ", dtype_str(codes.dtype()));
  if (!is_float16(scales.dtype()))
    type_error(sn, ": expected float16 elements (one q8_0 scale per ", kQ8Block, " codes), got ",
               dtype_str(scales.dtype()));
  std::vector<int64_t> want = codes.shape_vector();
  want.back() = q8_head_dim(codes, cn) / kQ8Block;
  if (scales.shape_vector() != want)
    value_error(sn, ": expected shape ", shape_str(want), " (the codes' shape with head_dim / ", kQ8Block,
                "), got ", shape_str(scales.shape_vector()));
}

void bind_q8(nb::module_& m) {
  nb::class_<Q8Arrays>(m, "Q8_0", kQ8Doc)
      .def(
          "__init__",
          [](Q8Arrays* self, ArrayArg codes, ArrayArg scales) {
            check_q8(as_array(codes, {"codes"}), as_array(scales, {"scales"}), {"codes"}, {"scales"});
            new (self) Q8Arrays{nb::borrow(codes.h), nb::borrow(scales.h)};
          },
          nb::arg("codes"), nb::arg("scales"))
      .def_prop_ro("codes", [](const Q8Arrays& q) { return AnyResult{q.codes}; }, "The int8 codes, as given.")
      .def_prop_ro("scales", [](const Q8Arrays& q) { return AnyResult{q.scales}; }, "The float16 scales, as given.")
      .def("__iter__",
           [](const Q8Arrays& q) {
             return nb::typed<nb::iterator, AnyResult>(nb::iter(nb::make_tuple(q.codes, q.scales)));
           },
           "codes, then scales: `codes, scales = q`.")
      .def(
          "dequantize",
          [](const Q8Arrays& q) {
            const ArrayRef codes = as_array(q.codes, {"codes"});
            const ArrayRef scales = as_array(q.scales, {"scales"});
            check_q8(codes, scales, {"codes"}, {"scales"});  // the arrays may have been resized in place since
            NewArray y = new_array(framework_of(q.codes), DType::f32, codes.shape_vector());
            {
              nb::gil_scoped_release release;
              std::vector<int8_t> c(codes.size());
              std::vector<f16> s(scales.size());
              copy_dense(codes, c.data());
              copy_dense(scales, s.data());
              dequantize_q8_0(c.data(), s.data(), int64_t(c.size()), static_cast<float*>(y.data));
            }
            return AnyResult{std::move(y.obj)};
          },
          "The values as float32 (codes times their scales), in the codes' framework.")
      .def("__repr__", [](const Q8Arrays& q) {
        const ArrayRef codes = as_array(q.codes, {"codes"});
        const ArrayRef scales = as_array(q.scales, {"scales"});
        return cat("Q8_0(codes ", shape_str(codes.shape_vector()), " ", dtype_str(codes.dtype()), ", scales ",
                   shape_str(scales.shape_vector()), " ", dtype_str(scales.dtype()), ")");
      });

  m.def(
      "quantize_q8_0",
      [](ArrayArg x_obj) {
        const ArrayRef x = as_array(x_obj, {"x"});
        const DType dt = float_dtype(x, {"x"});
        const int64_t d = q8_head_dim(x, {"x"});
        const Framework fw = framework_of(x_obj);
        std::vector<int64_t> shape = x.shape_vector();
        NewArray codes = new_int8_array(fw, shape);
        shape.back() = d / kQ8Block;
        NewArray scales = new_array(fw, DType::f16, shape);
        {
          nb::gil_scoped_release release;
          std::vector<float> tmp;
          const float* xf = as_f32(x, dt, tmp);
          quantize_q8_0(xf, int64_t(x.size()), static_cast<int8_t*>(codes.data), static_cast<f16*>(scales.data));
        }
        return Q8Arrays{std::move(codes.obj), std::move(scales.obj)};
      },
      nb::arg("x"), kQuantizeDoc);
}

}  // namespace cascade::py
