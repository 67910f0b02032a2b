// cascade-tokenize: prints how a model's tokenizer splits a text.
//
//   cascade-tokenize [-m MODEL.gguf] -p TEXT [--ids] [--no-bos]
//
// One line per token, `ID<TAB>'PIECE'` (PIECE: the exact bytes the token stands for), or with --ids only
// the ids, space-separated on one line. Special tokens written in TEXT (e.g. <|im_start|>) are parsed as
// such; BOS/EOS are added as the model asks unless --no-bos. Works on vocabulary-only GGUF files.
// Any problem: one line `cascade-tokenize: error: ...` on stderr and exit code 1.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace {

constexpr const char* kUsage =
    "usage: cascade-tokenize [-m MODEL.gguf] -p TEXT [--ids] [--no-bos]\n"
    "  -m, --model FILE   GGUF file with a tokenizer, a vocabulary-only file is enough (default\n"
    "                     models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  -p, --prompt TEXT  text to tokenize\n"
    "  --ids              print only the ids, space-separated on one line\n"
    "  --no-bos           do not add the BOS/EOS tokens the model asks for\n";

struct Options {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::optional<std::string> prompt;
  bool ids_only = false;
  bool add_special = true;
};

// Returns nullopt when help was asked for.
std::optional<Options> parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      CASCADE_CHECK(i + 1 < argc, "missing value after ", a);
      return argv[++i];
    };
    if (a == "-m" || a == "--model") {
      o.model = value();
    } else if (a == "-p" || a == "--prompt") {
      o.prompt = value();
    } else if (a == "--ids") {
      o.ids_only = true;
    } else if (a == "--no-bos") {
      o.add_special = false;
    } else if (a == "-h" || a == "--help") {
      return std::nullopt;
    } else {
      cascade::detail::fail("unknown argument '", a, "' (see --help)");
    }
  }
  CASCADE_CHECK(o.prompt.has_value(), "no text given (-p TEXT)");
  return o;
}

int run(int argc, char** argv) {
  const std::optional<Options> opt = parse_args(argc, argv);
  if (!opt) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const cascade::gguf::File file = cascade::gguf::File::open(opt->model);
  const cascade::Tokenizer tok(cascade::load_vocab(file));
  const std::vector<int32_t> ids = tok.encode(*opt->prompt, opt->add_special, /*parse_special=*/true);
  std::string out;
  if (opt->ids_only) {
    for (size_t k = 0; k < ids.size(); ++k) {
      if (k) out += ' ';
      out += std::to_string(ids[k]);
    }
    out += '\n';
  } else {
    for (int32_t id : ids) {
      out += std::to_string(id);
      out += "\t'";
      out += tok.token_piece(id);
      out += "'\n";
    }
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return 0;
}

void print_error(std::string msg) {
  for (char& c : msg) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::fprintf(stderr, "cascade-tokenize: error: %s\n", msg.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unexpected failure");
  }
  return 1;
}
