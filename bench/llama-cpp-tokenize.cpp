// llama-cpp-tokenize: llama.cpp's token ids for a file of test strings, the reference the tokenizer tests compare
// against where llama.cpp ships no expectations (tests/data/tokenizer/README.md). Built and run by
// scripts/tokenizer-vectors.sh against the llama.cpp that bench/llama-cpp.sh builds; not part of the project's
// build (the project does not depend on llama.cpp).
//
//   llama-cpp-tokenize MODEL INP OUT [--special]
//
// INP holds the strings, each followed by "\n__ggml_vocab_test__\n" (the last one may end the file without it), as
// llama.cpp's own NAME.gguf.inp files. OUT gets one line per string: its ids, each after a space. Without
// --special: no BOS/EOS and special tokens not parsed (llama.cpp's test-tokenizer-0); with --special: BOS/EOS as
// the vocabulary asks and special tokens parsed. Only the vocabulary is loaded. Any problem: one line on stderr and
// exit code 1.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

int fail(const std::string& why) {
  std::fprintf(stderr, "llama-cpp-tokenize: error: %s\n", why.c_str());
  return 1;
}

std::vector<std::string> read_strings(const std::string& text) {
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> out;
  for (size_t pos = 0; pos < text.size();) {
    const size_t next = text.find(sep, pos);
    if (next == std::string::npos) {
      out.push_back(text.substr(pos));
      break;
    }
    out.push_back(text.substr(pos, next - pos));
    pos = next + sep.size();
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && !(argc == 5 && std::string(argv[4]) == "--special"))
    return fail("usage: llama-cpp-tokenize MODEL INP OUT [--special]");
  const bool special = argc == 5;
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) return fail(std::string("cannot read ") + argv[2]);
  std::stringstream ss;
  ss << in.rdbuf();

  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail(std::string("cannot load the vocabulary of ") + argv[1]);
  const llama_vocab* vocab = llama_model_get_vocab(model);

  std::ofstream out(argv[3], std::ios::binary);
  if (!out) return fail(std::string("cannot write ") + argv[3]);
  for (const std::string& s : read_strings(ss.str())) {
    std::vector<llama_token> ids(s.size() + 8);
    int32_t n = llama_tokenize(vocab, s.data(), int32_t(s.size()), ids.data(), int32_t(ids.size()), special, special);
    if (n < 0) return fail("more tokens than bytes + 8 for one string");
    for (int32_t i = 0; i < n; ++i) out << " " << ids[size_t(i)];  // as llama.cpp's own .out files
    out << "\n";
  }
  llama_model_free(model);
  llama_backend_free();
  return out.good() ? 0 : fail(std::string("writing ") + argv[3] + " failed");
}
