// Byte-level BPE and SentencePiece-style BPE; see tokenizer.hpp for the contract.
#include "model/tokenizer.hpp"

#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <optional>
#include <queue>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/utf8.hpp"

namespace cascade {

namespace {

// --- code points -----------------------------------------------------------------------------------

constexpr uint32_t kReplacement = 0xFFFD;

// Decodes one code point at s[pos] and advances pos. Lenient on purpose, like the reference tokenizer the
// test vectors come from: overlong forms and surrogates decode as their value; a byte that cannot start a
// sequence, a truncated sequence or a value above U+10FFFF becomes U+FFFD and consumes exactly one byte.
uint32_t next_codepoint(std::string_view s, size_t& pos) {
  const utf8::Decoded d = utf8::decode(s, pos, /*strict=*/false);
  pos += d.len ? d.len : 1;
  return d.len ? d.cp : kReplacement;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {  // surrogates included: they round-trip the lenient decoder
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::vector<uint32_t> decode_utf8(std::string_view s) {
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) cps.push_back(next_codepoint(s, pos));
  return cps;
}

// The classes the pre-tokenizer regexes use.
enum : uint8_t { kLetter = 1, kNumber = 2, kSpace = 4 };

// Unicode White_Space (what \s means in the tokenizers' regexes).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

uint8_t classify(uint32_t cp) {
  if (cp < 0x80) {  // fast path for ASCII
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return kLetter;
    if (cp >= '0' && cp <= '9') return kNumber;
    return is_white_space(cp) ? kSpace : 0;
  }
  if (is_white_space(cp)) return kSpace;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      return kLetter;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return kNumber;
    default:
      return 0;
  }
}

uint32_t to_lower(uint32_t cp) { return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))); }

// --- pre-tokenizers ----------------------------------------------------------------------------------
// Each splitter appends the end index of every word of cps[b, e) to `ends`. Look-ahead never crosses e:
// a segment boundary acts like the end of the text, as it does for a regex run on each segment alone.

struct Segment {
  const std::vector<uint32_t>& cps;
  std::vector<uint8_t> cls;  // classify() of each code point
  explicit Segment(const std::vector<uint32_t>& c) : cps(c), cls(c.size()) {
    for (size_t i = 0; i < c.size(); ++i) cls[i] = classify(c[i]);
  }
};

bool is_other(uint8_t cls) { return (cls & (kLetter | kNumber | kSpace)) == 0; }

// 's|'t|'re|'ve|'m|'ll|'d (case-insensitive when fold): length of the match at p, or 0.
size_t contraction_len(const std::vector<uint32_t>& cps, size_t p, size_t e, bool fold) {
  if (cps[p] != '\'' || p + 1 >= e) return 0;
  const auto low = [&](size_t k) { return fold ? to_lower(cps[k]) : cps[k]; };
  const uint32_t a = low(p + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (p + 2 >= e) return 0;
  const uint32_t b = low(p + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(const Segment& s, size_t b, size_t e, std::vector<size_t>& ends) {
  const auto& cps = s.cps;
  const auto& cls = s.cls;
  size_t p = b;
  while (p < e) {
    if (size_t n = contraction_len(cps, p, e, false)) {
      p += n;
      ends.push_back(p);
      continue;
    }
    // An optional space, then a run of one class (letters, numbers or "other").
    const size_t q = (cps[p] == ' ' && p + 1 < e) ? p + 1 : p;
    const bool lead_ok = q == p + 1 || cps[p] != ' ';
    if (lead_ok) {
      const uint8_t c = cls[q];
      if (c == kLetter || c == kNumber || is_other(c)) {
        size_t r = q + 1;
        if (is_other(c)) {
          while (r < e && is_other(cls[r])) ++r;
        } else {
          while (r < e && cls[r] == c) ++r;
        }
        p = r;
        ends.push_back(p);
        continue;
      }
    }
    // Whitespace: \s+(?!\S) leaves the last space to the next word when something follows; else \s+.
    size_t r = p;
    while (r < e && cls[r] == kSpace) ++r;
    if (r == p) {
      ++p;  // cannot happen (every code point has a class), but never loop forever
    } else if (r - p > 1 && r < e) {
      p = r - 1;
    } else {
      p = r;
    }
    ends.push_back(p);
  }
}

// Llama 3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//          \s*[\r\n]+|\s+(?!\S)|\s+
// with n_digits_max = 3; Qwen 2 (n_digits_max = 1) has \p{N} in place of \p{N}{1,3}, the rest alike.
void split_llama3(const Segment& s, size_t b, size_t e, size_t n_digits_max, std::vector<size_t>& ends) {
  const auto& cps = s.cps;
  const auto& cls = s.cls;
  const auto is_nl = [&](size_t k) { return cps[k] == '\r' || cps[k] == '\n'; };
  size_t p = b;
  while (p < e) {
    if (size_t n = contraction_len(cps, p, e, true)) {
      p += n;
      ends.push_back(p);
      continue;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (!is_nl(p) && cls[p] != kNumber && (cls[p] == kLetter || (p + 1 < e && cls[p + 1] == kLetter))) {
      size_t r = p + 1;
      while (r < e && cls[r] == kLetter) ++r;
      p = r;
      ends.push_back(p);
      continue;
    }
    // \p{N}{1,n_digits_max}
    if (cls[p] == kNumber) {
      size_t r = p;
      while (r < e && r - p < n_digits_max && cls[r] == kNumber) ++r;
      p = r;
      ends.push_back(p);
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    {
      const size_t q = cps[p] == ' ' ? p + 1 : p;
      if (q < e && is_other(cls[q])) {
        size_t r = q + 1;
        while (r < e && is_other(cls[r])) ++r;
        while (r < e && is_nl(r)) ++r;
        p = r;
        ends.push_back(p);
        continue;
      }
    }
    // Whitespace runs: \s*[\r\n]+ up to the last newline of the run; else as in GPT-2.
    size_t r = p;
    size_t last_nl = 0;
    while (r < e && cls[r] == kSpace) {
      if (is_nl(r)) last_nl = r + 1;
      ++r;
    }
    if (last_nl > 0) {
      p = last_nl;
    } else if (r == p) {
      ++p;
    } else if (r - p > 1 && r < e) {
      p = r - 1;
    } else {
      p = r;
    }
    ends.push_back(p);
  }
}

// SmolLM / StarCoder: every \p{N} is a word of its own, the text between is split as GPT-2 splits it.
void split_digits_first(const Segment& s, size_t b, size_t e, std::vector<size_t>& ends) {
  size_t run = b;
  for (size_t p = b; p < e; ++p) {
    if (s.cls[p] != kNumber) continue;
    if (run < p) split_gpt2(s, run, p, ends);
    ends.push_back(p + 1);
    run = p + 1;
  }
  if (run < e) split_gpt2(s, run, e, ends);
}

// --- byte-level mapping ------------------------------------------------------------------------------

struct ByteMap {
  uint32_t to_cp[256];
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteMap() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? uint32_t(b) : next++;
      to_byte[to_cp[b]] = uint8_t(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

std::string spaces_to_sentencepiece(std::string_view text, bool prefix_space) {
  static constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581
  std::string out;
  out.reserve(text.size() + 8);
  if (prefix_space) out += kSpaceMark;
  for (char c : text) {
    if (c == ' ') {
      out += kSpaceMark;
    } else {
      out += c;
    }
  }
  return out;
}

// Byte length of the UTF-8 sequence a lead byte announces (continuation and invalid bytes: 1 or 4).
size_t utf8_len(uint8_t lead) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

// Parses "<0xNN>"; -1 if the text is not of that form.
int parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (size_t k = 3; k < 5; ++k) {
    const char c = t[k];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return -1;
    }
    v = v * 16 + d;
  }
  return v;
}

// --- the pieces of tokens ------------------------------------------------------------------------------

// A byte-level token's bytes: each code point of the byte mapping stands for its byte; others (not produced by
// the mapping) are kept as their UTF-8.
std::string byte_level_piece(const std::string& t) {
  std::string out;
  size_t pos = 0;
  while (pos < t.size()) {
    const size_t start = pos;
    const uint32_t cp = next_codepoint(t, pos);
    auto it = byte_map().to_byte.find(cp);
    if (it != byte_map().to_byte.end()) {
      out += char(it->second);
    } else {
      out.append(t, start, pos - start);
    }
  }
  return out;
}

// A SentencePiece token's bytes: U+2581 is a space.
std::string sentencepiece_piece(const std::string& t) {
  std::string out;
  size_t pos = 0;
  while (pos < t.size()) {
    if (t.compare(pos, 3, "\xE2\x96\x81") == 0) {
      out += ' ';
      pos += 3;
    } else {
      out += t[pos++];
    }
  }
  return out;
}

// --- pre-tokenizer names -------------------------------------------------------------------------------

// The `tokenizer.ggml.pre` names this tokenizer implements, with the settings llama.cpp gives each.
struct PreTokenizerName {
  std::string_view name;
  PreTokenizer pre;
  bool ignore_merges;  // a word that is a token is emitted whole, not merged
};

constexpr PreTokenizerName kPreTokenizers[] = {
    {"default", PreTokenizer::gpt2, false},         {"gpt-2", PreTokenizer::gpt2, false},
    {"gpt2", PreTokenizer::gpt2, false},            {"llama-bpe", PreTokenizer::llama3, true},
    {"llama3", PreTokenizer::llama3, true},         {"llama-v3", PreTokenizer::llama3, true},
    {"qwen2", PreTokenizer::qwen2, false},          {"deepseek-r1-qwen", PreTokenizer::qwen2, false},
    {"smollm", PreTokenizer::digits_first, false},  {"starcoder", PreTokenizer::digits_first, false},
};

const PreTokenizerName* find_pre_tokenizer(std::string_view name) {
  for (const PreTokenizerName& p : kPreTokenizers) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string supported_pre_tokenizers() {
  std::string out;
  for (const PreTokenizerName& p : kPreTokenizers) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return byte_map().to_cp[b]; }

// --- Tokenizer ---------------------------------------------------------------------------------------

Tokenizer::Tokenizer(Vocab vocab) : vocab_(std::move(vocab)) {
  select_algorithm();
  check_vocab();
  index_tokens();
  build_pieces();
  build_byte_tokens();
  build_merges();
  for (int32_t id : {vocab_.eos_id, vocab_.eot_id, vocab_.eom_id}) {
    if (id >= 0) eog_.insert(id);
  }
  eog_.insert(vocab_.eog_ids.begin(), vocab_.eog_ids.end());
  rstrip_.insert(vocab_.rstrip_ids.begin(), vocab_.rstrip_ids.end());
}

void Tokenizer::select_algorithm() {
  const Vocab& v = vocab_;
  if (v.model == "gpt2") {
    kind_ = Kind::bpe;
  } else if (v.model == "llama") {
    kind_ = Kind::spm;
    return;
  } else {
    detail::fail("tokenizer: unsupported tokenizer model '", v.model,
                 "' (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece BPE)");
  }
  const PreTokenizerName* pre = find_pre_tokenizer(v.pre.empty() ? "default" : v.pre);
  if (!pre) {
    detail::fail("tokenizer: unsupported pre-tokenizer '", v.pre, "' (supported: ", supported_pre_tokenizers(), ")");
  }
  pre_ = pre->pre;
  ignore_merges_ = pre->ignore_merges;
}

void Tokenizer::check_vocab() const {
  const Vocab& v = vocab_;
  const size_t n = v.tokens.size();
  CASCADE_CHECK(n > 0, "tokenizer: the vocabulary has no tokens");
  CASCADE_CHECK(n <= size_t(INT32_MAX), "tokenizer: too many tokens (", n, ")");
  CASCADE_CHECK(v.token_types.empty() || v.token_types.size() == n, "tokenizer: ", v.token_types.size(),
                " token types for ", n, " tokens");
  for (size_t i = 0; i < v.token_types.size(); ++i) {
    const auto t = static_cast<int32_t>(v.token_types[i]);
    CASCADE_CHECK(t >= 0 && t <= 6, "tokenizer: token ", i, " has unknown type ", t);
  }
  CASCADE_CHECK(v.scores.empty() || v.scores.size() == n, "tokenizer: ", v.scores.size(), " scores for ", n,
                " tokens");
  const auto check_special = [&](int32_t id, const char* what) {
    CASCADE_CHECK(id >= -1 && id < int64_t(n), "tokenizer: ", what, " id ", id, " is outside the vocabulary of ",
                  n, " tokens");
  };
  check_special(v.bos_id, "BOS");
  check_special(v.eos_id, "EOS");
  check_special(v.eot_id, "EOT");
  check_special(v.eom_id, "EOM");
  check_special(v.unk_id, "unknown-token");
  check_special(v.pad_id, "padding");
  for (int32_t id : v.eog_ids) check_special(id, "end-of-generation");
  for (int32_t id : v.rstrip_ids) check_special(id, "right-stripping");
  CASCADE_CHECK(!v.add_bos || v.bos_id >= 0, "tokenizer: add_bos_token is true but there is no BOS id");
  CASCADE_CHECK(!v.add_eos || v.eos_id >= 0, "tokenizer: add_eos_token is true but there is no EOS id");
}

// Text -> id; a text that appears twice maps to the later id.
void Tokenizer::index_tokens() {
  const size_t n = vocab_.tokens.size();
  token_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) token_to_id_[vocab_.tokens[i]] = int32_t(i);
}

// The bytes of each token, and the special tokens matched in text (longest text first).
void Tokenizer::build_pieces() {
  const Vocab& v = vocab_;
  const size_t n = v.tokens.size();
  piece_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = v.tokens[i];
    const TokenType type = token_type(int32_t(i));
    std::string& out = piece_[i];
    if (type == TokenType::control || type == TokenType::user_defined || type == TokenType::unknown) {
      out = t;
      if (!t.empty()) specials_.push_back(int32_t(i));
    } else if (type == TokenType::unused) {
      out.clear();
    } else if (kind_ == Kind::bpe) {
      out = byte_level_piece(t);
    } else if (type == TokenType::byte && parse_byte_token(t) >= 0) {
      out = char(parse_byte_token(t));
    } else {
      out = sentencepiece_piece(t);
    }
  }
  std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
    return v.tokens[size_t(a)].size() > v.tokens[size_t(b)].size();
  });
}

// BPE: the token of each byte's code point. SPM: <0xNN>, else the one-byte token, else the unknown token.
void Tokenizer::build_byte_tokens() {
  for (int b = 0; b < 256; ++b) {
    if (kind_ == Kind::bpe) {
      std::string s;
      append_utf8(s, byte_to_codepoint(uint8_t(b)));
      byte_token_[b] = token_id(s);
    } else {
      static const char* hex = "0123456789ABCDEF";
      const char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
      int32_t id = token_id(std::string_view(name, 6));
      if (id < 0) id = token_id(std::string(1, char(b)));
      byte_token_[b] = id >= 0 ? id : vocab_.unk_id;
    }
  }
}

// BPE merge ranks keyed by the pair of ids.
void Tokenizer::build_merges() {
  if (kind_ != Kind::bpe) return;
  const std::vector<std::string>& merges = vocab_.merges;
  merges_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ', 1);
    CASCADE_CHECK(sp != std::string::npos, "tokenizer: merge ", r, " ('", m, "') has no space separating its parts");
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    const int32_t a = token_id(left), b = token_id(right);
    std::string joined(left);
    joined += right;
    const int32_t ab = token_id(joined);
    // A merge whose parts or result are not tokens can never produce a token: skip it.
    if (a < 0 || b < 0 || ab < 0) continue;
    const uint64_t key = (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
    merges_.try_emplace(key, Merge{int32_t(r), ab});  // the first (best) rank wins
  }
}

TokenType Tokenizer::token_type(int32_t id) const {
  check_id(id);
  if (vocab_.token_types.empty()) return TokenType::normal;
  const TokenType t = vocab_.token_types[size_t(id)];
  return t == TokenType::undefined ? TokenType::normal : t;
}

int32_t Tokenizer::token_id(std::string_view text) const {
  auto it = token_to_id_.find(text);
  return it == token_to_id_.end() ? -1 : it->second;
}

bool Tokenizer::is_eog(int32_t id) const { return eog_.count(id) != 0; }

void Tokenizer::check_id(int32_t id) const {
  CASCADE_CHECK(id >= 0 && size_t(id) < vocab_.tokens.size(), "tokenizer: token id ", id,
                " is outside the vocabulary of ", vocab_.tokens.size(), " tokens");
}

std::string Tokenizer::token_piece(int32_t id) const {
  check_id(id);
  return piece_[size_t(id)];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool render_special) const {
  std::string out;
  DecodeState state;
  for (const int32_t id : ids) out += decode_next(id, state, render_special);
  return out;
}

std::string Tokenizer::decode_next(int32_t id, DecodeState& state, bool render_special) const {
  check_id(id);
  const TokenType type = token_type(id);
  if (type == TokenType::control || type == TokenType::unknown) return render_special ? piece_[size_t(id)] : "";
  std::string_view p = piece_[size_t(id)];
  // SentencePiece: encode prefixed the text with a space; its first text piece gives it back.
  if (state.first_text && kind_ == Kind::spm && vocab_.add_space_prefix && type == TokenType::normal && !p.empty() &&
      p[0] == ' ') {
    p.remove_prefix(1);
  }
  state.first_text = false;
  return std::string(p);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  std::vector<int32_t> out;
  if (add_special && vocab_.add_bos) out.push_back(vocab_.bos_id);
  bool after_special = true;  // SentencePiece: a space is prefixed at the start and after a special token
  for (const Fragment& f : split_specials(text, parse_special)) {
    if (f.id >= 0) {
      out.push_back(f.id);
      after_special = true;
      continue;
    }
    const std::string_view raw = text.substr(f.off, f.len);
    if (kind_ == Kind::bpe) {
      encode_bpe(raw, out);
    } else {
      encode_spm(spaces_to_sentencepiece(raw, vocab_.add_space_prefix && after_special), out);
    }
    after_special = false;
  }
  if (add_special && vocab_.add_eos) out.push_back(vocab_.eos_id);
  return out;
}

// Cuts the special tokens out of the text, longest first, each in turn through every raw fragment left. A token
// with right-stripping drops the ASCII whitespace that follows it (up to the end of its fragment).
std::vector<Tokenizer::Fragment> Tokenizer::split_specials(std::string_view text, bool parse_special) const {
  std::vector<Fragment> frags;
  if (!text.empty()) frags.push_back({-1, 0, text.size()});
  std::vector<Fragment> next;
  const auto is_space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  for (int32_t sid : specials_) {
    const TokenType type = token_type(sid);
    if (!parse_special && type != TokenType::user_defined) continue;
    const std::string& st = vocab_.tokens[size_t(sid)];
    const bool rstrip = rstrip_.count(sid) != 0;
    next.clear();
    bool changed = false;
    for (const Fragment& f : frags) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      const std::string_view raw = text.substr(f.off, f.len);
      size_t pos = 0;
      for (size_t hit; (hit = raw.find(st, pos)) != std::string_view::npos;) {
        if (hit > pos) next.push_back({-1, f.off + pos, hit - pos});
        next.push_back({sid, 0, 0});
        changed = true;
        pos = hit + st.size();
        while (rstrip && pos < raw.size() && is_space(raw[pos])) ++pos;
      }
      if (pos < raw.size()) next.push_back({-1, f.off + pos, raw.size() - pos});
    }
    if (changed) frags.swap(next);
  }
  return frags;
}

void Tokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<uint32_t> cps = decode_utf8(text);
  const Segment seg(cps);
  std::vector<size_t> ends;
  ends.reserve(cps.size() / 3 + 4);
  switch (pre_) {
    case PreTokenizer::gpt2:
      split_gpt2(seg, 0, cps.size(), ends);
      break;
    case PreTokenizer::llama3:
      split_llama3(seg, 0, cps.size(), 3, ends);
      break;
    case PreTokenizer::qwen2:
      split_llama3(seg, 0, cps.size(), 1, ends);
      break;
    case PreTokenizer::digits_first:
      split_digits_first(seg, 0, cps.size(), ends);
      break;
  }
  std::string word;
  size_t begin = 0;
  for (size_t end : ends) {
    word.clear();
    for (size_t k = begin; k < end; ++k) append_utf8(word, cps[k]);
    begin = end;
    bpe_word(word, out);
  }
}

// Merges the bytes of one word, best-ranked adjacent pair first (leftmost among equal ranks).
void Tokenizer::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    std::string mapped;
    for (char c : word) append_utf8(mapped, byte_to_codepoint(uint8_t(c)));
    const int32_t id = token_id(mapped);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  struct Symbol {
    int32_t id;    // -1: a byte the vocabulary lacks (never merges; dropped from the output)
    int32_t prev;  // -1 at the start
    int32_t next;  // -1 at the end
  };
  struct Pair {
    int32_t rank;
    int32_t left, right;
    int32_t left_id, right_id;
    bool operator<(const Pair& o) const {  // priority_queue: top = smallest rank, then leftmost
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  const int32_t n = int32_t(word.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) sym[size_t(i)] = {byte_token_[uint8_t(word[size_t(i)])], i - 1, i + 1 < n ? i + 1 : -1};
  if (n == 1) {
    if (sym[0].id >= 0) out.push_back(sym[0].id);
    return;
  }

  std::priority_queue<Pair> queue;
  const auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const int32_t a = sym[size_t(l)].id, b = sym[size_t(r)].id;
    if (a < 0 || b < 0) return;
    auto it = merges_.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
    if (it == merges_.end()) return;
    queue.push({it->second.rank, l, r, a, b});
  };
  for (int32_t i = 0; i + 1 < n; ++i) try_pair(i, i + 1);

  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = sym[size_t(p.left)];
    Symbol& r = sym[size_t(p.right)];
    // Stale if either side has merged since the pair was queued (ids change on every merge).
    if (l.id != p.left_id || r.id != p.right_id || l.next != p.right) continue;
    l.id = merges_.at((uint64_t(uint32_t(p.left_id)) << 32) | uint32_t(p.right_id)).id;
    l.next = r.next;
    if (r.next >= 0) sym[size_t(r.next)].prev = p.left;
    r.id = -2;  // dead
    r.next = r.prev = -1;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) {
    if (sym[size_t(i)].id >= 0) out.push_back(sym[size_t(i)].id);
  }
}

int32_t Tokenizer::spm_byte_token(uint8_t byte) const { return byte_token_[byte]; }

// SentencePiece BPE over UTF-8 characters: repeatedly merge the adjacent pair whose concatenation is the
// highest-scoring token (leftmost among equal scores); characters left that are not tokens become bytes.
void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  struct Symbol {
    int32_t prev, next;
    size_t off, len;  // len 0: merged away
  };
  std::vector<Symbol> sym;
  sym.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    size_t len = std::min(utf8_len(uint8_t(text[off])), text.size() - off);
    // A broken sequence ends at the first byte that does not continue it, so a lead byte cannot swallow what
    // follows (a space mark, say, which would then fall back to bytes and decode as U+2581, not a space).
    for (size_t k = 1; k < len; ++k) {
      if ((uint8_t(text[off + k]) & 0xC0) != 0x80) {
        len = k;
        break;
      }
    }
    const int32_t i = int32_t(sym.size());
    sym.push_back({i - 1, off + len < text.size() ? i + 1 : -1, off, len});
    off += len;
  }
  struct Pair {
    float score;
    int32_t left, right;
    size_t len;
    bool operator<(const Pair& o) const {  // top = highest score, then leftmost
      return score != o.score ? score < o.score : left > o.left;
    }
  };
  std::priority_queue<Pair> queue;
  const auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const Symbol& a = sym[size_t(l)];
    const size_t len = a.len + sym[size_t(r)].len;
    const int32_t id = token_id(text.substr(a.off, len));
    if (id < 0) return;
    const float score = vocab_.scores.empty() ? 0.0f : vocab_.scores[size_t(id)];
    queue.push({score, l, r, len});
  };
  for (int32_t i = 0; i + 1 < int32_t(sym.size()); ++i) try_pair(i, i + 1);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Symbol& l = sym[size_t(p.left)];
    Symbol& r = sym[size_t(p.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != p.len) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[size_t(r.next)].prev = p.left;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) {
    const Symbol& s = sym[size_t(i)];
    const std::string_view piece = text.substr(s.off, s.len);
    const int32_t id = token_id(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (char c : piece) {
      const int32_t b = spm_byte_token(uint8_t(c));
      if (b >= 0) out.push_back(b);
    }
  }
}

// --- GGUF --------------------------------------------------------------------------------------------

namespace {

// Fails with the file's name and the parts when bad.
struct FileCheck {
  const std::string& fname;
  template <class... Parts>
  void operator()(bool bad, const Parts&... parts) const {
    if (bad) detail::fail(fname, ": ", parts...);
  }
};

// tokenizer.ggml.model and, for byte-level BPE, tokenizer.ggml.pre.
void read_algorithm(const gguf::File& file, const FileCheck& fail_if, Vocab& v) {
  const auto model = file.get_string_opt("tokenizer.ggml.model");
  fail_if(!model, "no tokenizer in the file (key tokenizer.ggml.model is missing)");
  v.model = std::string(*model);
  fail_if(v.model != "gpt2" && v.model != "llama", "tokenizer.ggml.model is '", v.model,
          "'; supported: \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE)");
  // SentencePiece vocabularies have no pre-tokenizer (llama.cpp ignores the key for them too).
  v.pre = v.model == "gpt2" ? std::string(file.get_string_opt("tokenizer.ggml.pre").value_or("default")) : "default";
  fail_if(!find_pre_tokenizer(v.pre), "tokenizer.ggml.pre '", v.pre, "' is not supported (supported: ",
          supported_pre_tokenizers(), ")");
}

// tokenizer.ggml.tokens, .token_type, .scores and (byte-level BPE) .merges.
void read_tokens(const gguf::File& file, const FileCheck& fail_if, Vocab& v) {
  fail_if(!file.find("tokenizer.ggml.tokens"), "key tokenizer.ggml.tokens is missing");
  for (std::string_view t : file.get_string_array("tokenizer.ggml.tokens")) v.tokens.emplace_back(t);
  const size_t n = v.tokens.size();
  fail_if(n == 0, "tokenizer.ggml.tokens is empty");
  fail_if(n > size_t(INT32_MAX), "tokenizer.ggml.tokens has too many tokens (", n, ")");

  if (file.find("tokenizer.ggml.token_type")) {
    const std::vector<int32_t> types = file.get_int_array("tokenizer.ggml.token_type");
    fail_if(types.size() != n, "tokenizer.ggml.token_type has ", types.size(), " entries for ", n, " tokens");
    v.token_types.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      fail_if(types[i] < 0 || types[i] > 6, "tokenizer.ggml.token_type[", i, "] is ", types[i],
              " (known types: 0-6)");
      v.token_types.push_back(static_cast<TokenType>(types[i]));
    }
  }
  if (file.find("tokenizer.ggml.scores")) {
    v.scores = file.get_float_array("tokenizer.ggml.scores");
    fail_if(v.scores.size() != n, "tokenizer.ggml.scores has ", v.scores.size(), " entries for ", n, " tokens");
  }
  if (v.model != "gpt2") return;
  fail_if(!file.find("tokenizer.ggml.merges"), "key tokenizer.ggml.merges is missing (required for gpt2)");
  const auto merges = file.get_string_array("tokenizer.ggml.merges");
  v.merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    fail_if(merges[r].size() < 3 || merges[r].find(' ', 1) == std::string_view::npos, "tokenizer.ggml.merges[", r,
            "] ('", merges[r], "') is not two parts separated by a space");
    v.merges.emplace_back(merges[r]);
  }
}

// The special token ids and what encode adds. SentencePiece files default to the Llama ids; absent means
// none for BPE. BOS is added by default for SentencePiece and Llama 3, as llama.cpp does.
void read_special_ids(const gguf::File& file, const FileCheck& fail_if, Vocab& v) {
  const size_t n = v.tokens.size();
  const bool spm = v.model == "llama";
  const auto read_id = [&](const char* key, int32_t dflt) -> int32_t {
    const auto id = file.get_uint_opt(key);
    if (!id) return dflt;
    fail_if(*id >= n, key, " is ", *id, ", outside the vocabulary of ", n, " tokens");
    return int32_t(*id);
  };
  v.bos_id = read_id("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  v.eos_id = read_id("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  v.unk_id = read_id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  v.eot_id = read_id("tokenizer.ggml.eot_token_id", -1);
  v.eom_id = read_id("tokenizer.ggml.eom_token_id", -1);
  v.pad_id = read_id("tokenizer.ggml.padding_token_id", -1);
  for (int32_t* id : {&v.bos_id, &v.eos_id, &v.unk_id}) {
    fail_if(*id >= int64_t(n), "special token id ", *id, " is outside the vocabulary of ", n,
            " tokens (the default for a key that is absent)");
  }
  const bool llama3 = find_pre_tokenizer(v.pre)->pre == PreTokenizer::llama3;
  v.add_bos = file.get_bool_opt("tokenizer.ggml.add_bos_token").value_or(spm || llama3);
  v.add_eos = file.get_bool_opt("tokenizer.ggml.add_eos_token").value_or(false);
  v.add_space_prefix = spm && file.get_bool_opt("tokenizer.ggml.add_space_prefix").value_or(true);
  fail_if(v.add_bos && v.bos_id < 0, "tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing");
  fail_if(v.add_eos && v.eos_id < 0, "tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is missing");
  // Settings that would change the ids and that this tokenizer does not implement.
  for (const char* key : {"tokenizer.ggml.add_sep_token", "tokenizer.ggml.remove_extra_whitespaces"}) {
    fail_if(file.get_bool_opt(key).value_or(false), key, " is true, which is not supported");
  }
}

// Special tokens found by their text, as llama.cpp 0.3.36 finds them (its vocabulary loader), so that both
// stop generating at the same tokens and split text the same way: the end-of-turn tokens of the common chat
// formats (and </s>) end generation; they and the fill-in-the-middle tokens become control tokens (matched in
// text only when asked, rendered only when asked). Two exceptions, as llama.cpp: a vocabulary with <|return|>
// and <|call|> uses <|end|> inside a turn (user-defined, not an end); one with <|tool_response> or
// <|plamo:eos|> has a normal </s>.
void mark_special_tokens(const gguf::File& file, Vocab& v) {
  // Fill-in-the-middle tokens by role: prefix, suffix, middle, pad, repository, file separator; the last three
  // end generation. A role whose id the file gives (the key, or its older name) is not looked up by text.
  struct FimRole {
    const char* key;
    const char* old_key;
    std::vector<std::string_view> texts;
  };
  static const FimRole kFim[] = {
      {"tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id",
       {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\xE2\x96\x81<PRE>", "<|code_prefix|>",
        "<|prefix|>"}},
      {"tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id",
       {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\xE2\x96\x81<SUF>", "<|code_suffix|>",
        "<|suffix|>"}},
      {"tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id",
       {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\xE2\x96\x81<MID>", "<|code_middle|>",
        "<|middle|>"}},
      {"tokenizer.ggml.fim_pad_token_id", nullptr, {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}},
      {"tokenizer.ggml.fim_rep_token_id", nullptr,
       {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}},
      {"tokenizer.ggml.fim_sep_token_id", nullptr, {"<|file_sep|>"}},
  };
  constexpr int kFirstEndingRole = 3;
  static const std::vector<std::string_view> kEndOfGeneration = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
      "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
      "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
      "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",  // DeepSeek's, in full-width bars
      "[e~[",
  };
  constexpr int kEnds = -1;
  const size_t n = v.tokens.size();
  // Text -> FIM role, or kEnds; a role given by its key is left out.
  std::unordered_map<std::string_view, int> wanted;
  std::vector<int32_t> eog;
  for (int r = 0; r < int(std::size(kFim)); ++r) {
    std::optional<uint64_t> id = file.get_uint_opt(kFim[r].key);
    if (!id && kFim[r].old_key) id = file.get_uint_opt(kFim[r].old_key);
    if (id && *id < n) {
      if (r >= kFirstEndingRole) eog.push_back(int32_t(*id));
      continue;
    }
    for (std::string_view t : kFim[r].texts) wanted.emplace(t, r);
  }
  for (std::string_view t : kEndOfGeneration) wanted.emplace(t, kEnds);

  if (v.token_types.empty()) v.token_types.assign(n, TokenType::normal);
  const auto has = [&](std::string_view t) { return std::find(v.tokens.begin(), v.tokens.end(), t) != v.tokens.end(); };
  const bool end_is_inner = has("<|return|>") && has("<|call|>");
  const bool normal_slash_s = has("<|tool_response>") || has("<|plamo:eos|>");
  for (size_t i = 0; i < n; ++i) {
    const auto it = wanted.find(v.tokens[i]);
    if (it == wanted.end()) continue;
    const bool ends = it->second == kEnds || it->second >= kFirstEndingRole;
    if (ends && end_is_inner && v.tokens[i] == "<|end|>") {
      v.token_types[i] = TokenType::user_defined;
    } else if (ends && normal_slash_s && v.tokens[i] == "</s>") {
      v.token_types[i] = TokenType::normal;
    } else {
      v.token_types[i] = TokenType::control;
      if (ends) eog.push_back(int32_t(i));
    }
  }
  v.eog_ids = std::move(eog);
}

// Phi-3 (llama.cpp keys this on general.name containing "phi-3" or "phi3"): every special token but <unk>, <s>
// and <|endoftext|> swallows the whitespace after it in text, and so does </s>.
void mark_right_stripping(const gguf::File& file, Vocab& v) {
  std::string name(file.get_string_opt("general.name").value_or(""));
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (name.find("phi-3") == std::string::npos && name.find("phi3") == std::string::npos) return;
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    const std::string& t = v.tokens[i];
    const TokenType type = v.token_types.empty() ? TokenType::normal : v.token_types[i];
    const bool special = type == TokenType::control || type == TokenType::user_defined || type == TokenType::unknown;
    if ((special || t == "</s>") && t != "<unk>" && t != "<s>" && t != "<|endoftext|>") {
      v.rstrip_ids.push_back(int32_t(i));
    }
  }
}

}  // namespace

Vocab load_vocab(const gguf::File& file) {
  const FileCheck fail_if{file.name()};
  Vocab v;
  read_algorithm(file, fail_if, v);
  read_tokens(file, fail_if, v);
  read_special_ids(file, fail_if, v);
  mark_special_tokens(file, v);
  mark_right_stripping(file, v);
  v.chat_template = std::string(file.get_string_opt("tokenizer.chat_template").value_or(""));
  return v;
}

}  // namespace cascade
