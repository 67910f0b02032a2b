#include "server/text.hpp"

#include <algorithm>

namespace cascade::server {

StopText::StopText(std::vector<std::string> stop) : stop_(std::move(stop)) {
  std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
}

bool StopText::append(std::string_view piece) {
  if (stopped_) return true;
  const size_t old = text_.size();
  text_ += piece;
  size_t first = std::string::npos;
  for (const std::string& s : stop_) {
    // An occurrence ends in the new bytes; the part before them was searched already.
    const size_t from = old >= s.size() - 1 ? old - (s.size() - 1) : 0;
    const size_t at = text_.find(s, from);
    first = std::min(first, at);
  }
  if (first == std::string::npos) return false;
  text_.resize(first);
  sent_ = std::min(sent_, first);
  stopped_ = true;
  return true;
}

size_t StopText::held_back() const {
  const std::string_view rest = std::string_view(text_).substr(sent_);
  size_t hold = 0;
  // The longest end of the text that begins some stop string.
  for (const std::string& s : stop_)
    for (size_t k = std::min(s.size() - 1, rest.size()); k > hold; --k)
      if (rest.substr(rest.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  // An unfinished UTF-8 character: a lead byte among the last three whose sequence runs past the end.
  const size_t n = rest.size() - hold;
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(rest[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (len > back) hold += back;
    break;
  }
  return hold;
}

std::string StopText::take(bool final) {
  const size_t end = final || stopped_ ? text_.size() : text_.size() - held_back();
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

}  // namespace cascade::server
