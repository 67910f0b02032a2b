// Arguments the bindings take as plain Python objects and read themselves (arrays.hpp), under the names the type
// stubs give them: `Array` (a NumPy array or PyTorch CPU tensor; the stubs define it as a Protocol, see
// python/stubs.pat), `Array | Q8_0 | Sequence[Array | Q8_0]` for K and V (Q8_0: q8.hpp), `int | Sequence[int]`
// for n_query and `Sequence[int]` for starts (stubgen adds its default's None); results are `tuple[Any, Any]`,
// or `Any` for one.
// Converting one accepts any object; the function's own checks raise TypeError / ValueError naming it.
#pragma once

#include <nanobind/nanobind.h>

namespace cascade::py {

template <class Label>
struct NamedHandle {
  nanobind::handle h;
  operator nanobind::handle() const { return h; }  // NOLINT: implicit, where a handle is taken
};

namespace names {
struct Array {
  static constexpr auto name = nanobind::detail::const_name("Array");
};
struct Arrays {
  static constexpr auto name = nanobind::detail::const_name("Array | Q8_0 | Sequence[Array | Q8_0]");
};
struct Result {
  static constexpr auto name = nanobind::detail::const_name("Any");
};
struct Counts {
  static constexpr auto name = nanobind::detail::const_name("int | Sequence[int]");
};
struct Starts {
  static constexpr auto name = nanobind::detail::const_name("Sequence[int]");
};
}  // namespace names

using ArrayArg = NamedHandle<names::Array>;        // one array
using ArraysArg = NamedHandle<names::Arrays>;      // K or V: one array (or Q8_0), or one per segment
using CountsArg = NamedHandle<names::Counts>;      // an int, or one per sequence
using StartsArg = NamedHandle<names::Starts>;      // None, or one token index per segment

// One result typed Any in the stubs (an array of the caller's framework), holding its reference.
struct AnyResult {
  nanobind::object obj;
};

// (o, lse), in the caller's framework: NumPy arrays or PyTorch tensors as q (or o_a) was, so typed Any for the
// caller's own framework's methods.
using ArrayPair = nanobind::typed<nanobind::tuple, NamedHandle<names::Result>, NamedHandle<names::Result>>;

}  // namespace cascade::py

namespace nanobind::detail {

template <class Label>
struct type_caster<cascade::py::NamedHandle<Label>> {
  NB_TYPE_CASTER(cascade::py::NamedHandle<Label>, Label::name)
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    value.h = src;
    return true;
  }
  static handle from_cpp(const cascade::py::NamedHandle<Label>& v, rv_policy, cleanup_list*) noexcept {
    return v.h.inc_ref();
  }
};

template <>
struct type_caster<cascade::py::AnyResult> {
  NB_TYPE_CASTER(cascade::py::AnyResult, const_name("Any"))
  bool from_python(handle, uint8_t, cleanup_list*) noexcept { return false; }  // a result only
  static handle from_cpp(const cascade::py::AnyResult& v, rv_policy, cleanup_list*) noexcept {
    return v.obj.inc_ref();
  }
};

}  // namespace nanobind::detail
