// cascade._cascade: the extension module behind the Python package `cascade` (python/cascade/__init__.py).
// The library's errors (cascade::Error) become ValueError with the same text.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "cascade/error.hpp"

namespace nb = nanobind;

NB_MODULE(_cascade, m) {
  m.doc() = "cascade's kernels and generation (see the package cascade)";
  m.attr("__version__") = CASCADE_VERSION;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const cascade::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  cascade::py::bind_states(m);
  cascade::py::bind_q8(m);
  cascade::py::bind_attention(m);
  cascade::py::bind_generate(m);
}
