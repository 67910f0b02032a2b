// The runtime's tokenizer: byte-level BPE ("gpt2" vocabularies: GPT-2, SmolLM, StarCoder, Llama 3, Qwen 2/2.5/3)
// and SentencePiece-style BPE ("llama" vocabularies: Llama 1/2, TinyLlama, Mistral, Phi-3, Gemma 3), conforming
// to llama.cpp's test vectors and to llama.cpp 0.3.36's ids for the real Gemma 3 vocabulary.
//
// The core (Vocab, Tokenizer) knows nothing about files: a Vocab is plain data, load_vocab() fills one from
// the `tokenizer.*` keys of a GGUF file and validates it. load_vocab also applies what llama.cpp decides from
// token texts and the model's name rather than from keys: which tokens end generation and become control tokens
// (eog_ids), and which swallow the whitespace after them (rstrip_ids, Phi-3). A key that would change the ids
// and is not implemented (add_sep_token, remove_extra_whitespaces set to true; an unknown pre-tokenizer) is
// an error naming it.
//
// encode(text):
//   1. special/control tokens are cut out of the text as whole tokens (longest first): user-defined tokens
//      always, control and unknown tokens only when parse_special is true; a token in rstrip_ids drops the
//      ASCII whitespace that follows it;
//   2. gpt2: each remaining fragment is split into words by the pre-tokenizer (a hand-written state machine
//      over code points, per `tokenizer.ggml.pre`: "gpt-2"/"default", "llama-bpe", "qwen2", "smollm",
//      "starcoder"), each word's UTF-8 bytes are mapped to printable code points and merged by rank;
//      llama: each fragment gets a leading space (at the start of the text and after a special token) when
//      add_space_prefix, spaces become U+2581 and code points are merged by score; pieces that are not tokens
//      fall back to `<0xNN>` byte tokens;
//   3. with add_special: BOS first when add_bos, EOS last when add_eos.
// Invalid UTF-8 never throws: gpt2 replaces each invalid byte by U+FFFD, llama byte-encodes it, as llama.cpp does.
//
// A byte whose byte-level token the vocabulary lacks (SmolLM2 has none for a few control bytes such as 0x13)
// is dropped, as llama.cpp drops it.
//
// decode(ids) returns the exact bytes (no space clean-up): byte-level pieces mapped back to bytes, U+2581 back
// to spaces, `<0xNN>` to the byte; for llama vocabularies with add_space_prefix the first normal piece loses
// one leading space (the one encode added), so decode(encode(text, true), false) == text. Control tokens
// render as their text when render_special is true, else as nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace cascade {

namespace gguf {
class File;
}

// `tokenizer.ggml.token_type` values.
enum class TokenType : int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

// The word splitters of byte-level BPE vocabularies (`tokenizer.ggml.pre`; see tokenizer.cpp for the names).
enum class PreTokenizer { gpt2, llama3, qwen2, digits_first };

// Everything a tokenizer needs, as read from a model file. Ids are -1 when absent.
struct Vocab {
  std::string model;               // "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
  std::string pre = "default";     // pre-tokenizer name (gpt2 only)
  std::vector<std::string> tokens;  // token text as stored (byte-level code points / U+2581 for spaces)
  std::vector<TokenType> token_types;  // empty = all normal; else one per token
  std::vector<float> scores;           // llama: merge priority (higher first); empty = all 0
  std::vector<std::string> merges;     // gpt2: "A B", rank = index
  int32_t bos_id = -1, eos_id = -1, eot_id = -1, eom_id = -1, unk_id = -1, pad_id = -1;
  std::vector<int32_t> eog_ids;  // end-of-generation ids beyond eos/eot/eom (load_vocab fills it)
  // Special tokens that swallow the ASCII whitespace after them when matched in text (Phi-3: <|user|>\nHi
  // encodes as <|user|>Hi), as llama.cpp's RSTRIP attribute.
  std::vector<int32_t> rstrip_ids;
  bool add_bos = false;
  bool add_eos = false;
  bool add_space_prefix = false;  // llama: prefix a space to the text (and after each special token); Gemma: no
  std::string chat_template;      // `tokenizer.chat_template`, empty if absent
};

// Reads and validates the tokenizer keys of a GGUF file; throws cascade::Error naming the key at fault.
Vocab load_vocab(const gguf::File& file);

class Tokenizer {
 public:
  // Validates the vocab (array lengths, ids in range, known model, parsable merges); throws cascade::Error.
  explicit Tokenizer(Vocab vocab);

  // add_special: BOS/EOS as the vocab asks. parse_special: match control tokens such as <|im_start|> in text.
  std::vector<int32_t> encode(std::string_view text, bool add_special = true, bool parse_special = false) const;

  // The text of the ids; any id outside [0, n_vocab) throws cascade::Error.
  std::string decode(const std::vector<int32_t>& ids, bool render_special = true) const;

  // The same, one token at a time (streaming a text as it is generated): decode(ids) is the concatenation
  // of decode_next(id, state) over ids, starting from one fresh DecodeState. A piece may end inside a
  // multi-byte UTF-8 character that the next piece completes.
  struct DecodeState {
    bool first_text = true;  // no text piece decoded yet
  };
  std::string decode_next(int32_t id, DecodeState& state, bool render_special = true) const;

  // The bytes one token stands for (control tokens: their text). No leading-space removal.
  std::string token_piece(int32_t id) const;

  // True for the ids that end generation: eos, eot, eom and eog_ids.
  bool is_eog(int32_t id) const;
  int32_t n_vocab() const { return static_cast<int32_t>(vocab_.tokens.size()); }
  // -1 when the text is not a token.
  int32_t token_id(std::string_view text) const;
  const Vocab& vocab() const { return vocab_; }
  TokenType token_type(int32_t id) const;

 private:
  enum class Kind { bpe, spm };
  // A piece of the text to encode: raw text (id < 0, bytes [off, off + len)) or one special token.
  struct Fragment {
    int32_t id;
    size_t off, len;
  };

  struct StrHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  // The constructor's steps, in order.
  void select_algorithm();
  void check_vocab() const;
  void index_tokens();
  void build_pieces();
  void build_byte_tokens();
  void build_merges();

  std::vector<Fragment> split_specials(std::string_view text, bool parse_special) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  int32_t spm_byte_token(uint8_t byte) const;
  void check_id(int32_t id) const;

  Vocab vocab_;
  Kind kind_ = Kind::bpe;
  PreTokenizer pre_ = PreTokenizer::gpt2;
  bool ignore_merges_ = false;  // llama-bpe: a word that is a token is emitted whole
  std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>> token_to_id_;
  // BPE: (left id << 32 | right id) -> (rank, merged id).
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t byte_token_[256];      // BPE: id of the code point byte b maps to; SPM: <0xNN> (or fallback)
  std::vector<std::string> piece_;  // decoded bytes of each token (control tokens: their text)
  std::vector<int32_t> specials_;   // ids matched in text, longest text first
  std::unordered_set<int32_t> eog_;
  std::unordered_set<int32_t> rstrip_;
};

// Byte-level BPE's printable code point for byte b (bytes 0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF map to themselves).
uint32_t byte_to_codepoint(uint8_t b);

}  // namespace cascade
