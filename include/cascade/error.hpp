// cascade::Error and the checks that raise it. The library never exits or prints: every problem with
// its input becomes an Error whose message says what was wrong (tools turn it into one line on stderr).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace cascade {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
[[noreturn]] inline void fail(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw Error(os.str());
}

// An enum's names: {value, name} pairs, in the order messages list them.
template <class E>
struct Named {
  E value;
  const char* name;
};

// The name of v in names ("?" when it has none).
template <class E, size_t N>
const char* name_of(E v, const Named<E> (&names)[N]) {
  for (const Named<E>& n : names)
    if (n.value == v) return n.name;
  return "?";
}

// The value named s; else an Error "unknown WHAT 's' (expected a, b or c)".
template <class E, size_t N>
E parse_named(std::string_view s, const Named<E> (&names)[N], const char* what) {
  std::string expected;
  for (size_t i = 0; i < N; ++i) {
    if (names[i].name == s) return names[i].value;
    expected += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + names[i].name;
  }
  fail("unknown ", what, " '", s, "' (expected ", expected, ")");
}
}  // namespace detail

}  // namespace cascade

// CASCADE_CHECK(cond, "message parts", value, ...): throws cascade::Error with the parts concatenated.
#define CASCADE_CHECK(cond, ...)                 \
  do {                                           \
    if (!(cond)) ::cascade::detail::fail(__VA_ARGS__); \
  } while (0)
