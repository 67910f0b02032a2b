// What cascade-generate shows a person at a terminal (tools/terminal.hpp): the progress line and the
// streamed text, only when the output is a terminal (the tool run under a pseudo-terminal here), never
// with --json or with the output in a file, where it prints exactly what it prints without a terminal.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "model/utf8.hpp"
#include "tool_run.hpp"
#include "tools/terminal.hpp"

namespace test_terminal {

namespace {

const std::string kTool = CASCADE_BINARY_DIR "/tools/cascade-generate";
const char* kModel = CASCADE_MODEL_PATH;

void require_model() {
  REQUIRE_MESSAGE(std::filesystem::exists(kModel),
                  "the model file " << kModel << " is missing: run `bash scripts/setup.sh` in the repository");
}

// The tool's arguments as a list (for the pseudo-terminal) and as one shell-quoted string (for files).
std::vector<std::string> tool_argv(const std::vector<std::string>& args) {
  std::vector<std::string> v = {kTool, "-m", kModel};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}
std::string shell_args(const std::vector<std::string>& args) {
  std::string s = "-m ";
  s += tool_run::quote(kModel);
  for (const std::string& a : args) {
    s += ' ';
    s += tool_run::quote(a);
  }
  return s;
}

// Greedy, fixed length: every run of these arguments decodes the same tokens and takes every step.
const std::vector<std::string> kArgs2 = {"-p", "The three best things about autumn are", "--temp", "0", "-n", "20",
                                         "--ignore-eos", "-t", "2", "-np", "2"};
const std::vector<std::string> kArgs1 = {"-p", "The three best things about autumn are", "--temp", "0", "-n", "20",
                                         "--ignore-eos", "-t", "2", "-np", "1"};

bool has_progress(const std::string& s) {
  return s.find('\r') != std::string::npos || s.find("\x1b[") != std::string::npos ||
         std::regex_search(s, std::regex("step [0-9]+/[0-9]+ \\|"));
}

// The text of the block "--- sequence S (prompt P, STOP) ---\nTEXT\n" in the tool's plain stdout.
std::string sequence_text(const std::string& out, int s) {
  const std::string head = "--- sequence " + std::to_string(s) + " (";
  const size_t h = out.find(head);
  REQUIRE(h != std::string::npos);
  const size_t begin = out.find('\n', h) + 1;
  const size_t next = out.find("\n--- sequence ", begin);
  return out.substr(begin, (next == std::string::npos ? out.size() - 1 : next) - begin);
}

}  // namespace

TEST_CASE("terminal: the progress line's text and clock") {
  CHECK(cascade::term::clock(0) == "0:00");
  CHECK(cascade::term::clock(59.9) == "0:59");
  CHECK(cascade::term::clock(61) == "1:01");
  CHECK(cascade::term::clock(3599) == "59:59");
  CHECK(cascade::term::clock(3600 + 62) == "1:01:02");
  CHECK(cascade::term::clock(-5) == "0:00");
  cascade::term::ProgressState p;
  p.steps_done = 120;
  p.steps_total = 2319;
  p.tokens_per_s = 168.34;
  p.kv_bytes = 45.2 * (1 << 20);
  p.elapsed_s = 42;
  CHECK(cascade::term::progress_text(p, 200) == "step 120/2319 | 168.3 tok/s | K/V 45.2 MiB | 0:42");
  p.remaining_s = 151;
  CHECK(cascade::term::progress_text(p, 200) == "step 120/2319 | 168.3 tok/s | K/V 45.2 MiB | 0:42, ~2:31 left");
  CHECK(cascade::term::progress_text(p, 20) == "step 120/2319 | 168.");  // never wider than the terminal
}

TEST_CASE("terminal: complete_prefix holds back exactly a character cut at the end") {
  // Random valid UTF-8 of 1- to 4-byte characters; the reference is where its characters begin.
  std::mt19937 rng(5);
  const std::vector<std::string> chars = {"a", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\n"};
  for (int rep = 0; rep < 200; ++rep) {
    std::string s;
    std::vector<size_t> starts;
    for (int i = 0; i < 12; ++i) {
      starts.push_back(s.size());
      s += chars[rng() % chars.size()];
    }
    starts.push_back(s.size());
    for (size_t cut = 0; cut <= s.size(); ++cut) {
      size_t boundary = 0;
      for (size_t st : starts)
        if (st <= cut) boundary = st;
      CHECK(cascade::utf8::complete_prefix(std::string_view(s).substr(0, cut)) == boundary);
    }
  }
  // Bytes that are not UTF-8 are not held back (nothing will complete them).
  CHECK(cascade::utf8::complete_prefix("ab\xFF") == 3);
  CHECK(cascade::utf8::complete_prefix("\x80\x80\x80\x80\x80") == 5);
}

TEST_CASE("terminal: a text stream writes each token's text at once, whole characters only") {
  const std::string vocab = CASCADE_TESTDATA_DIR "/tokenizer/ggml-vocab-gpt-2.gguf";
  REQUIRE(std::filesystem::exists(vocab));
  const cascade::Tokenizer tok(cascade::load_vocab(cascade::gguf::File::open(vocab)));
  // Byte-level BPE splits these characters across tokens.
  const std::string text = "Caf\xC3\xA9 \xF0\x9F\x98\x80\xF0\x9F\x8E\x89 \xE2\x82\xAC" "5 \xE4\xBD\xA0\xE5\xA5\xBD!";
  const std::vector<int32_t> ids = tok.encode(text, false, false);
  REQUIRE(tok.decode(ids, false) == text);
  std::FILE* f = std::tmpfile();
  REQUIRE(f != nullptr);
  const auto written = [&] {
    std::fflush(f);
    std::string s(size_t(std::ftell(f)), '\0');
    std::rewind(f);
    const size_t n = std::fread(s.data(), 1, s.size(), f);
    s.resize(n);
    std::fseek(f, 0, SEEK_END);
    return s;
  };
  cascade::term::TextStream stream(tok, f);
  bool held_back = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    stream.token(ids[i]);
    const std::string so_far = tok.decode(std::vector<int32_t>(ids.begin(), ids.begin() + long(i) + 1), false);
    const std::string w = written();
    CHECK(w == so_far.substr(0, cascade::utf8::complete_prefix(so_far)));  // already in the file: flushed
    CHECK(cascade::utf8::first_invalid(w) < 0);
    held_back |= w.size() < so_far.size();
  }
  CHECK(held_back);  // the text did cut characters between tokens
  stream.finish();
  CHECK(written() == text + "\n");
  std::fclose(f);
}

TEST_CASE("terminal: on a terminal, stderr shows the progress line and stdout in a file is unchanged") {
  require_model();
  const tool_run::Run plain = tool_run::run(kTool, shell_args(kArgs2) + " --stats-every 5");
  REQUIRE(plain.rc == 0);
  CHECK(!has_progress(plain.err));
  const tool_run::PtyRun tty = tool_run::run_in_pty(tool_argv(kArgs2), /*stdout_on_tty=*/false, {});
  REQUIRE(!tty.timed_out);
  REQUIRE(tty.rc == 0);
  INFO(tty.tty);
  CHECK(tty.out == plain.out);  // the texts, exactly as without a terminal
  // Every decode step is one of the 19 (the first token comes from the prompt): the last state drawn.
  CHECK(tty.tty.find("\r\x1b[Kstep 19/19 | ") != std::string::npos);
  CHECK(std::regex_search(tty.tty, std::regex("step 19/19 \\| [0-9.]+ tok/s \\| K/V [0-9.]+ MiB \\| [0-9]+:[0-9]{2}")));
  // The line is taken away before the summary, and the summary is the plain run's (same lines, same order).
  const size_t summary = tty.tty.find("prompt eval time");
  REQUIRE(summary != std::string::npos);
  CHECK(!has_progress(tty.tty.substr(summary)));
  CHECK(tty.tty.rfind("\r\x1b[K", summary) == summary - 4);
  // Lines printed while the progress line is up (--stats-every) come out whole, above it.
  const tool_run::PtyRun stats =
      tool_run::run_in_pty(tool_argv([] { auto a = kArgs2; a.insert(a.end(), {"--stats-every", "5"}); return a; }()),
                           false, {});
  REQUIRE(stats.rc == 0);
  for (int step : {5, 10, 15})
    CHECK(std::regex_search(stats.tty, std::regex("\r\x1b\\[Kdecode\\[" + std::to_string(step) + "\\]: [0-9.]+ ms, avg [0-9.]+ ms\n")));
}

TEST_CASE("terminal: with -np 1 on a terminal the text streams to stdout, but not into a file or with --json") {
  require_model();
  const tool_run::Run plain = tool_run::run(kTool, shell_args(kArgs1));
  REQUIRE(plain.rc == 0);
  const std::string text = sequence_text(plain.out, 0);
  REQUIRE(!text.empty());
  CHECK(plain.out.find("--- sequence 0 (prompt 1, length) ---\n") == 0);

  const tool_run::PtyRun tty = tool_run::run_in_pty(tool_argv(kArgs1), /*stdout_on_tty=*/true, {});
  REQUIRE(!tty.timed_out);
  REQUIRE(tty.rc == 0);
  INFO(tty.tty);
  // The text, streamed between its header and the summary; the stream is the progress (no line drawn).
  const std::string streamed = "--- sequence 0 (prompt 1) ---\n" + text + "\n";
  const size_t at = tty.tty.find(streamed);
  CHECK(at != std::string::npos);
  CHECK(at < tty.tty.find("prompt eval time"));
  CHECK(!has_progress(tty.tty));

  // --stream into a file: the first sequence streamed, the others as usual; same texts.
  const tool_run::Run two_plain = tool_run::run(kTool, shell_args(kArgs2));
  const tool_run::Run two_stream = tool_run::run(kTool, shell_args(kArgs2) + " --stream");
  REQUIRE(two_stream.rc == 0);
  CHECK(two_stream.out.find("--- sequence 0 (prompt 1) ---\n" + sequence_text(two_plain.out, 0) + "\n--- sequence 1 (") == 0);
  CHECK(sequence_text(two_stream.out, 1) == sequence_text(two_plain.out, 1));
  CHECK(!has_progress(two_stream.err));

  // --json on a terminal: the object alone on stdout, no progress, no stream.
  const tool_run::PtyRun json = tool_run::run_in_pty(
      tool_argv([] { auto a = kArgs1; a.push_back("--json"); return a; }()), /*stdout_on_tty=*/true, {});
  REQUIRE(json.rc == 0);
  CHECK(!has_progress(json.tty));
  CHECK(json.tty.find("--- sequence") == std::string::npos);
  CHECK(json.tty.find("{\"model\":") != std::string::npos);
  // And with only stderr on the terminal.
  const tool_run::PtyRun json2 = tool_run::run_in_pty(
      tool_argv([] { auto a = kArgs2; a.push_back("--json"); return a; }()), /*stdout_on_tty=*/false, {});
  REQUIRE(json2.rc == 0);
  CHECK(!has_progress(json2.tty));
  CHECK(json2.out.rfind("{\"model\":", 0) == 0);
}

}  // namespace test_terminal
