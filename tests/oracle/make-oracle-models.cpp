// make-oracle-models: writes the oracle tests' tiny random models (tiny_models.hpp, oracle_specs) into a folder,
// with cases.txt, the list of prompts whose logits scripts/oracle.sh asks llama.cpp for:
//
//   make-oracle-models OUT_DIR
//
// cases.txt: one case per line, `NAME FILE MODE TOKEN...`: the case's name (its logits go to NAME.logits), the
// model file, how llama.cpp is to run it (`full`: the prompt in one batch; `window=W`: each position's logits from
// a fresh sequence of its last W tokens, the sliding-window model computed by a runtime that has no window for
// that architecture; exact for one layer, and only used on one-layer models), and the prompt's token ids.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "oracle/tiny_models.hpp"

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fprintf(stderr, "usage: make-oracle-models OUT_DIR\n");
    return argc == 2 ? 0 : 2;
  }
  const std::string dir = argv[1];
  try {
    std::ofstream cases(dir + "/cases.txt");
    CASCADE_CHECK(bool(cases), "cannot write ", dir, "/cases.txt");
    cases << "# NAME FILE MODE TOKEN... (make-oracle-models; scripts/oracle.sh)\n";
    for (const cascade::oracle::TinySpec& s : cascade::oracle::oracle_specs()) {
      const std::vector<uint8_t> bytes = cascade::oracle::write_tiny(s);
      const std::string file = s.name + ".gguf";
      std::ofstream out(dir + "/" + file, std::ios::binary);
      out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
      CASCADE_CHECK(bool(out), "cannot write ", dir, "/", file);
      const auto line = [&](const std::string& name, const std::string& mode, int n) {
        cases << name << ' ' << file << ' ' << mode;
        for (int32_t t : cascade::oracle::tiny_prompt(s, n)) cases << ' ' << t;
        cases << '\n';
      };
      line(s.name, "full", s.n_prompt);
      if (s.n_prompt_long > 0) {
        // llama.cpp windows gemma3's layers itself; for the other architectures it has no window.
        const std::string mode = s.arch == "gemma3" ? "full" : "window=" + std::to_string(s.n_swa);
        line(s.name + "-long", mode, s.n_prompt_long);
      }
      std::printf("%s: %zu bytes\n", file.c_str(), bytes.size());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make-oracle-models: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
