// A fuzz target's entry point run over files, without libFuzzer: the seeds fuzz_seeds writes, a campaign's corpus,
// a crashing input. Built by any compiler (fuzz/replay.cmake), so the suite under ASan and UBSan
// (scripts/sanitize.sh) runs every target's seeds, and random mutations of them for a few seconds, as tests.
// Coverage-guided fuzzing, which finds far more, is libFuzzer's (scripts/fuzz.sh).
//
//   fuzz_replay_TARGET [--mutate SECONDS] [--seed N] PATH...
//       each PATH a file, or a folder whose files (not subfolders) run in name order. --mutate: then, for that
//       long, inputs made by a few random edits of one of them (bit flips, bytes set, inserted, erased or copied,
//       the end cut off), from --seed (default: the clock; printed). When a sanitizer ends the process during a
//       mutated input, that input is written to ./crash-TARGET-SEED first (replay it: fuzz_replay_TARGET FILE).
//       --timeout SECONDS (default 60): an input that runs longer is a failure, as under libFuzzer: a mutated one
//       is written to ./timeout-TARGET-SEED, and the process ends with status 3.
//
// Prints how many inputs ran; exits 1 when a PATH cannot be read or holds no input, 2 on a bad argument. A crash or
// a sanitizer's report ends the process as it would under libFuzzer.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);
// The sanitizers' runtime calls this before it ends the process on a report (absent without a sanitizer).
extern "C" __attribute__((weak)) void __sanitizer_set_death_callback(void (*callback)(void));

namespace {

// The mutated input being run, for the death callback.
const std::vector<uint8_t>* volatile g_current = nullptr;
char g_crash_path[512];
char g_timeout_path[512];
const char* volatile g_seed_file = nullptr;  // the seed file running, before the mutations start

// Writes the mutated input being run to `path`, and says so on stderr; only async-signal-safe calls, since
// the sanitizers' death callback and the timeout's signal handler call it.
void write_input(const char* path) {
  const std::vector<uint8_t>* current = g_current;
  if (!current) return;
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const uint8_t* p = current->data();
  size_t left = current->size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n <= 0) break;
    p += n;
    left -= size_t(n);
  }
  ::close(fd);
  static const char note[] = "fuzz replay: the mutated input that ended the process is in ";
  [[maybe_unused]] ssize_t r = ::write(2, note, sizeof note - 1);
  r = ::write(2, path, std::char_traits<char>::length(path));
  r = ::write(2, "\n", 1);
}

// The sanitizers' death callback: the timeout's alarm is cancelled first, so that it cannot cut the report short.
void write_current() {
  ::alarm(0);
  write_input(g_crash_path);
}

// SIGALRM: the input running has taken longer than --timeout.
void on_timeout(int) {
  static const char note[] = "fuzz replay: an input ran longer than --timeout allows (a hang, or work out of all "
                             "proportion to its size)";
  [[maybe_unused]] ssize_t r = ::write(2, note, sizeof note - 1);
  if (const char* f = g_seed_file) {
    r = ::write(2, ": the seed file ", 16);
    r = ::write(2, f, std::char_traits<char>::length(f));
  }
  r = ::write(2, "\n", 1);
  write_input(g_timeout_path);
  ::_exit(3);
}

bool read_file(const std::filesystem::path& p, std::vector<uint8_t>& out) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return false;
  out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return !f.bad();
}

// One to four random edits of `in`.
std::vector<uint8_t> mutate(const std::vector<uint8_t>& in, std::mt19937_64& rng) {
  std::vector<uint8_t> b = in;
  auto below = [&](size_t n) { return size_t(rng() % n); };
  const int edits = 1 + int(below(4));
  for (int e = 0; e < edits; ++e) {
    switch (below(b.empty() ? 1 : 6)) {
      case 0: b.insert(b.begin() + ptrdiff_t(below(b.size() + 1)), uint8_t(rng())); break;
      case 1: b[below(b.size())] ^= uint8_t(1u << below(8)); break;
      case 2: {  // values that parsers meet at their edges
        static const uint8_t edge[] = {0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff};
        b[below(b.size())] = rng() % 2 ? edge[below(sizeof edge)] : uint8_t(rng());
        break;
      }
      case 3: b.erase(b.begin() + ptrdiff_t(below(b.size()))); break;
      case 4: {  // copy a chunk over another place
        const size_t n = 1 + below(std::min<size_t>(b.size(), 16));
        const size_t from = below(b.size() - n + 1), to = below(b.size() - n + 1);
        std::copy_n(std::vector<uint8_t>(b.begin() + ptrdiff_t(from), b.begin() + ptrdiff_t(from + n)).begin(), n,
                    b.begin() + ptrdiff_t(to));
        break;
      }
      default: b.resize(below(b.size())); break;
    }
  }
  return b;
}

unsigned g_timeout_s = 60;

// Runs one input from an exact-size copy (as libFuzzer passes), so a sanitizer sees any read past its last byte,
// with the --timeout alarm set while it runs.
void run_one(const std::vector<uint8_t>& bytes) {
  const std::vector<uint8_t> exact(bytes.begin(), bytes.end());
  ::alarm(g_timeout_s);
  LLVMFuzzerTestOneInput(exact.data(), exact.size());
  ::alarm(0);
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const std::string self = fs::path(argv[0]).filename().string();
  double mutate_s = 0;
  uint64_t seed = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--mutate" || a == "--seed" || a == "--timeout") && i + 1 < argc) {
      char* end = nullptr;
      const std::string v = argv[++i];
      unsigned long long timeout = g_timeout_s;
      if (a == "--mutate") mutate_s = std::strtod(v.c_str(), &end);
      else if (a == "--seed") seed = std::strtoull(v.c_str(), &end, 10);
      else timeout = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || v[0] == '-' || *end != 0 || mutate_s < 0 || timeout == 0 || timeout > 86400) {
        std::fprintf(stderr, "%s: error: bad value for %s: '%s'\n", self.c_str(), a.c_str(), v.c_str());
        return 2;
      }
      g_timeout_s = unsigned(timeout);
    } else if (a.starts_with("--")) {
      std::fprintf(stderr, "%s: error: unknown or incomplete option %s\n", self.c_str(), a.c_str());
      return 2;
    } else {
      paths.push_back(a);
    }
  }
  if (paths.empty()) {
    std::fprintf(stderr,
                 "usage: %s [--mutate SECONDS] [--seed N] [--timeout SECONDS] PATH...  (files, or folders of files)\n",
                 self.c_str());
    return 2;
  }
  struct sigaction on_alarm {};
  on_alarm.sa_handler = on_timeout;
  sigaction(SIGALRM, &on_alarm, nullptr);
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<fs::path> files;
  for (const std::string& s : paths) {
    const fs::path p = s;
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> in_dir;
      for (const fs::directory_entry& e : fs::directory_iterator(p, ec))
        if (e.is_regular_file()) in_dir.push_back(e.path());
      if (ec) {
        std::fprintf(stderr, "%s: error: cannot list %s: %s\n", self.c_str(), s.c_str(), ec.message().c_str());
        return 1;
      }
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "%s: error: %s is neither a file nor a folder\n", self.c_str(), s.c_str());
      return 1;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "%s: error: no input in the paths given\n", self.c_str());
    return 1;
  }
  std::vector<std::vector<uint8_t>> inputs(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    if (!read_file(files[i], inputs[i])) {
      std::fprintf(stderr, "%s: error: cannot read %s\n", self.c_str(), files[i].c_str());
      return 1;
    }
    g_seed_file = files[i].c_str();
    run_one(inputs[i]);
    g_seed_file = nullptr;
  }
  std::printf("%s: %zu inputs ran\n", self.c_str(), inputs.size());
  if (mutate_s <= 0) return 0;

  std::snprintf(g_crash_path, sizeof g_crash_path, "crash-%s-%llu", self.c_str(), (unsigned long long)seed);
  std::snprintf(g_timeout_path, sizeof g_timeout_path, "timeout-%s-%llu", self.c_str(), (unsigned long long)seed);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(write_current);
  std::printf("%s: mutating for %g s from --seed %llu\n", self.c_str(), mutate_s, (unsigned long long)seed);
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(mutate_s);
  int64_t n = 0;
  while (std::chrono::steady_clock::now() < stop) {
    const std::vector<uint8_t> m = mutate(inputs[size_t(rng() % inputs.size())], rng);
    g_current = &m;
    run_one(m);
    g_current = nullptr;
    ++n;
  }
  std::printf("%s: %lld mutated inputs ran\n", self.c_str(), (long long)n);
  return 0;
}
