// UTF-8 decoding, one rule for the whole runtime. A sequence is a lead byte and its continuation bytes
// (10xxxxxx): 0xxxxxxx alone, 110xxxxx + 1, 1110xxxx + 2, 11110xxx + 3, decoding to at most U+10FFFF.
// Strict decoding (Unicode's well-formed UTF-8) also refuses overlong forms and surrogates (U+D800-DFFF);
// lenient decoding accepts them as their value, as the reference tokenizers whose test vectors the tokenizer
// follows do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cascade::utf8 {

struct Decoded {
  uint32_t cp = 0;
  size_t len = 0;  // bytes of the sequence; 0: the bytes at i are not one
};

// The sequence at s[i] (i < s.size()).
inline Decoded decode(std::string_view s, size_t i, bool strict = true) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  const uint8_t c = b(0);
  if (c < 0x80) return {c, 1};
  size_t n;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0) n = 2, cp = c & 0x1Fu, min = 0x80;
  else if ((c & 0xF0) == 0xE0) n = 3, cp = c & 0x0Fu, min = 0x800;
  else if ((c & 0xF8) == 0xF0) n = 4, cp = c & 0x07u, min = 0x10000;
  else return {};
  if (n > s.size() - i) return {};
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return {};
    cp = (cp << 6) | (b(k) & 0x3Fu);
  }
  if (cp > 0x10FFFF) return {};
  if (strict && (cp < min || (cp >= 0xD800 && cp <= 0xDFFF))) return {};
  return {cp, n};
}

// Offset of the first byte of s that is not part of strict UTF-8, or -1 when s is all valid.
inline int64_t first_invalid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = decode(s, i).len;
    if (n == 0) return int64_t(i);
    i += n;
  }
  return -1;
}

// The length of s without its last sequence when that one is cut short (a lead byte followed by fewer
// continuation bytes than it announces): what can be shown now of a text whose next bytes are still to come.
inline size_t complete_prefix(std::string_view s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto c = static_cast<uint8_t>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: its lead is further back
    const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

}  // namespace cascade::utf8
