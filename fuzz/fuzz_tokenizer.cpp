// Bytes -> Tokenizer::encode and Tokenizer::decode with fixed vocabularies, loaded once:
//   0 gpt-2 byte-level BPE (testdata ggml-vocab-gpt-2.gguf, pre-tokenizer "gpt-2")
//   1 the same vocabulary with SmolLM2's pre-tokenizer ("smollm": every digit a word of its own)
//   2 the same vocabulary with Llama 3's pre-tokenizer ("llama-bpe": whole-word tokens skip the merges)
//   3 Llama SentencePiece BPE (testdata ggml-vocab-llama-spm.gguf)
//   4 Qwen 2 byte-level BPE (testdata ggml-vocab-qwen2.gguf, pre-tokenizer "qwen2", user-defined tokens)
//   5 Phi-3 SentencePiece BPE (testdata ggml-vocab-phi-3.gguf: special tokens that swallow whitespace)
//   6 the real SmolLM2 vocabulary, when the model file exists (CASCADE_FUZZ_MODEL overrides its path)
// The testdata folder is CASCADE_TESTDATA_DIR/tokenizer (CASCADE_FUZZ_TESTDATA overrides it).
//
// Input: byte 0 picks the vocabulary (low 3 bits, modulo the count) and the flags (bit 4 add_special, bit 5
// parse_special, bit 6 render_special, bit 7: the rest is token ids, 3 bytes each, not text).
// Checked: encode never throws and yields ids inside the vocabulary; decode of such ids never throws; decode
// of ids outside it throws cascade::Error and nothing else; text round-trips through encode and decode where
// the tokenizer promises it (SentencePiece: any bytes without U+2581; byte-level BPE with every byte token: valid UTF-8).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <utf8proc.h>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace {

using namespace cascade;

struct Entry {
  const char* name;
  std::unique_ptr<Tokenizer> tok;
  bool round_trips;  // encode then decode gives the text back (see above)
};

std::string env_or(const char* var, const std::string& dflt) {
  const char* v = std::getenv(var);
  return v && *v ? std::string(v) : dflt;
}

Vocab load(const std::string& path) { return load_vocab(gguf::File::open(path)); }

std::vector<Entry> load_all() {
  const std::string dir = env_or("CASCADE_FUZZ_TESTDATA", CASCADE_TESTDATA_DIR "/tokenizer");
  std::vector<Entry> out;
  try {
    const Vocab gpt2 = load(dir + "/ggml-vocab-gpt-2.gguf");
    Vocab smol = gpt2, llama3 = gpt2;
    smol.pre = "smollm";
    llama3.pre = "llama-bpe";
    out.push_back({"gpt-2", std::make_unique<Tokenizer>(gpt2), true});
    out.push_back({"gpt-2 vocab, smollm pre-tokenizer", std::make_unique<Tokenizer>(smol), true});
    out.push_back({"gpt-2 vocab, llama-bpe pre-tokenizer", std::make_unique<Tokenizer>(llama3), true});
    out.push_back({"llama-spm", std::make_unique<Tokenizer>(load(dir + "/ggml-vocab-llama-spm.gguf")), true});
    out.push_back({"qwen2", std::make_unique<Tokenizer>(load(dir + "/ggml-vocab-qwen2.gguf")), true});
    out.push_back({"phi-3", std::make_unique<Tokenizer>(load(dir + "/ggml-vocab-phi-3.gguf")), true});
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_tokenizer: cannot load the test vocabularies: %s\n", e.what());
    std::exit(2);
  }
  const std::string model = env_or("CASCADE_FUZZ_MODEL", CASCADE_MODEL_PATH);
  if (std::FILE* f = std::fopen(model.c_str(), "rb")) {
    std::fclose(f);
    // SmolLM2 lacks the byte tokens of a few control bytes (they are dropped): no round-trip promise.
    out.push_back({"SmolLM2", std::make_unique<Tokenizer>(load(model)), false});
  }
  return out;
}

const std::vector<Entry>& tokenizers() {
  static const std::vector<Entry> all = load_all();
  return all;
}

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = utf8proc_ssize_t(s.size());
  while (left > 0) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0) return false;
    p += n;
    left -= n;
  }
  return true;
}

[[noreturn]] void fail(const Entry& e, const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_tokenizer: %s: %s (input of %zu bytes)\n", e.name, what, text.size());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& all = tokenizers();
  const Entry& e = all[(data[0] & 7) % all.size()];
  const Tokenizer& tok = *e.tok;
  const bool add_special = data[0] & 0x10, parse_special = data[0] & 0x20, render_special = data[0] & 0x40;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);

  if (data[0] & 0x80) {
    // Ids: 3 bytes each, spread a little past both ends of the vocabulary.
    std::vector<int32_t> ids;
    bool all_in = true;
    for (size_t k = 0; k + 3 <= rest.size(); k += 3) {
      const uint32_t raw = uint8_t(rest[k]) | uint32_t(uint8_t(rest[k + 1])) << 8 | uint32_t(uint8_t(rest[k + 2])) << 16;
      const int32_t id = int32_t(raw % uint32_t(tok.n_vocab() + 16)) - 8;
      all_in = all_in && id >= 0 && id < tok.n_vocab();
      ids.push_back(id);
      if (id >= 0 && id < tok.n_vocab()) {
        if (tok.token_piece(id).size() > tok.vocab().tokens[size_t(id)].size())
          fail(e, "a piece is longer than its token text", rest);
        (void)tok.token_type(id);
        (void)tok.is_eog(id);
      }
    }
    try {
      (void)tok.decode(ids, render_special);
      if (!all_in) fail(e, "decode accepted an id outside the vocabulary", rest);
    } catch (const Error&) {
      if (all_in) fail(e, "decode threw on ids inside the vocabulary", rest);
    }
    return 0;
  }

  const std::vector<int32_t> ids = tok.encode(rest, add_special, parse_special);  // must never throw
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) fail(e, "encode produced an id outside the vocabulary", rest);
  const std::string text = tok.decode(ids, render_special);
  (void)tok.token_id(rest);
  if (e.round_trips && !parse_special && !render_special) {
    const bool spm = tok.vocab().model == "llama";
    // SentencePiece writes spaces as U+2581, so a U+2581 in the text comes back as a space.
    const bool has_space_mark = rest.find("\xe2\x96\x81") != std::string_view::npos;
    if (((spm && !has_space_mark) || (!spm && valid_utf8(rest))) &&
        tok.decode(tok.encode(rest, true, false), false) != rest)
      fail(e, "decode(encode(text)) differs from the text", rest);
  }
  return 0;
}
