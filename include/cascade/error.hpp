// cascade::Error and the checks that raise it. The library never exits or prints: every problem with
// its input becomes an Error whose message says what was wrong (tools turn it into one line on stderr).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
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
}  // namespace detail

}  // namespace cascade

// CASCADE_CHECK(cond, "message parts", value, ...): throws cascade::Error with the parts concatenated.
#define CASCADE_CHECK(cond, ...)                 \
  do {                                           \
    if (!(cond)) ::cascade::detail::fail(__VA_ARGS__); \
  } while (0)
