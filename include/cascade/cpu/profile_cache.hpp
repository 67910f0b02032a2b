// auto's calibrated profile, kept per machine. calibrate() (calibrate.hpp) takes about a third of a second
// and its result depends only on the machine, the build and a few settings, so it is stored in the user's
// cache folder and reused by every later run, of any program using the library, with the same key.
//
//   const cpu::CachedProfile p = cpu::calibrate_cached(n_threads, model_shape, DType::f16);
//   plan_options.cost_model = &p.model;   // p.source: read from the cache or calibrated now; p.note: why
//                                         // the cache could not be used (empty when it could)
//
// The key (ProfileKey) is everything the profile depends on: the CPU's model and features, the instruction
// set tier the kernels run (simd.hpp), the build (compiler, instruction set compiled for), the thread
// count, the KV heads and head dim, the K/V type, the library's version and its kernels' revision. A
// profile file is named by a hash of the key and begins with the key itself, which is compared in full on
// reading: a profile is used only for exactly its key.
//
// The folder: $XDG_CACHE_HOME/cascade, else $HOME/.cache/cascade (an XDG_CACHE_HOME that is not an
// absolute path is ignored, as the XDG base directory specification says). A profile is written to a
// temporary file in the folder and renamed over its name, so programs running at the same time never read
// a half-written one.
//
// The cache is never a reason to fail: a folder that cannot be made or written, a damaged file or a file
// of another key ends in calibrating as without a cache, with a note saying what happened (the library
// never prints: the caller shows the note). Only calibration's own errors are thrown.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/info.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>

#include "cascade/auto.hpp"
#include "cascade/cpu/calibrate.hpp"
#include "cascade/cpu/kernel.hpp"
#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/tree.hpp"
#include "cascade/version.hpp"

namespace cascade::cpu {

// The thread count calibrate(n_threads) and the CPU path run with: n_threads (0: all) capped at the
// threads this process may use (oneTBB's default concurrency: the hardware threads in its affinity mask).
inline int effective_threads(int n_threads) {
  const int available = tbb::info::default_concurrency();
  return n_threads > 0 ? std::min(n_threads, available) : available;
}

// What a calibrated profile depends on. Every field is one line of the profile file's header.
struct ProfileKey {
  std::string cpu_model;     // the CPU's name (CPUID, else /proc/cpuinfo), "unknown" when neither says
  std::string cpu_features;  // cpu_feature_names()
  std::string isa;           // the tier the kernels run (active_isa()), "+bf16" (or "+amx") where bf16 or q8_0 K/V
                             // run on bf16 products, "+int8" where q8_0 K/V run on int8 ones
  std::string build;         // the compiler and the instruction set the library was compiled for
  int n_threads = 0;         // threads calibrated with (effective_threads: never 0)
  int n_kv_heads = 0, head_dim = 0;
  DType kv_dtype = DType::f16;
  std::string version = CASCADE_VERSION_STRING;
  int kernels = kKernelRevision;  // kernel_common.hpp

  // The key of a calibration on this machine, in this build, with n_threads threads (0: all), a model
  // of `shape` (its KV heads and head dim) and K/V stored as kv_dtype.
  static ProfileKey here(int n_threads, const HeadShape& shape, DType kv_dtype);

  // "name value" lines, in a fixed order, each value on one line.
  std::string text() const;
  // The profile's file name in the cache folder: "cost-model-" and 16 hex digits of a hash of text().
  std::string file_name() const;
};

namespace profile_detail {

// s with every control character made a space and runs of spaces collapsed, trimmed: one line of text.
inline std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) {
    const char d = (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? ' ' : c;
    if (d == ' ' && (out.empty() || out.back() == ' ')) continue;
    out += d;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// The "model name" line of /proc/cpuinfo (CPUs whose CPUID does not name them), or empty.
inline std::string proc_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
      return one_line(line.substr(line.find(':') + 1));
  return {};
}

inline std::string build_description() {
  std::string compiler;
#if defined(__clang__)
  compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  compiler = "gcc " __VERSION__;
#else
  compiler = "unknown compiler";
#endif
#if defined(__AVX512F__)
  const char* target = "avx512f";
#elif defined(__AVX2__)
  const char* target = "avx2";
#elif defined(__x86_64__)
  const char* target = "x86-64";
#else
  const char* target = "other";
#endif
  return one_line(compiler) + ", compiled for " + target;
}

// 64-bit FNV-1a: a stable hash (std::hash may differ between builds) to name a key's file.
inline uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

constexpr const char* kHeader = "cascade-profile 1\n";

// What went wrong, in a few words: the system's message for a file system error (the path is named by
// the caller), else the exception's own.
inline std::string reason(const std::exception& e) {
  if (const auto* fe = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) return fe->code().message();
  return e.what();
}

inline std::string errno_message() { return std::error_code(errno, std::generic_category()).message(); }

}  // namespace profile_detail

inline ProfileKey ProfileKey::here(int n_threads, const HeadShape& shape, DType kv_dtype) {
  using namespace profile_detail;
  ProfileKey k;
  k.cpu_model = one_line(cpu_model_name());
  if (k.cpu_model.empty()) k.cpu_model = proc_cpu_model();
  if (k.cpu_model.empty()) k.cpu_model = "unknown";
  k.cpu_features = cpu_feature_names();
  if (k.cpu_features.empty()) k.cpu_features = "none";
  k.isa = isa_name(active_isa());
  if (kv_dtype == DType::bf16 || kv_dtype == DType::q8_0) {  // bf16 or int8 products: other rates than f32 ones
    const KernelOptions o = KernelOptions::process();
    const Products p = choose_kernel(KernelShape::tiled, kv_dtype, shape.head_dim, o).products;
    k.isa += p == Products::amx_bf16 ? "+amx" : p == Products::bf16_dot ? "+bf16" : "";
    if (choose_kernel(KernelShape::few_rows, kv_dtype, shape.head_dim, o).products == Products::int8_dot)
      k.isa += "+int8";
  }
  k.build = build_description();
  k.n_threads = effective_threads(n_threads);
  k.n_kv_heads = shape.n_kv_heads;
  k.head_dim = shape.head_dim;
  k.kv_dtype = kv_dtype;
  return k;
}

inline std::string ProfileKey::text() const {
  using profile_detail::one_line;
  std::ostringstream os;
  os << "cpu_model " << one_line(cpu_model) << "\ncpu_features " << one_line(cpu_features) << "\nisa "
     << one_line(isa) << "\nbuild " << one_line(build) << "\nn_threads " << n_threads << "\nn_kv_heads "
     << n_kv_heads << "\nhead_dim " << head_dim << "\nkv_type " << dtype_name(kv_dtype) << "\nversion "
     << one_line(version) << "\nkernels " << kernels << "\n";
  return os.str();
}

inline std::string ProfileKey::file_name() const {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(profile_detail::fnv1a(text())));
  return std::string("cost-model-") + hex + ".txt";
}

// The cache folder: $XDG_CACHE_HOME/cascade, else $HOME/.cache/cascade; nullopt when neither variable
// holds an absolute path.
inline std::optional<std::filesystem::path> profile_cache_dir() {
  for (const auto& [var, sub] : {std::pair{"XDG_CACHE_HOME", "cascade"}, std::pair{"HOME", ".cache/cascade"}}) {
    const char* v = std::getenv(var);
    if (v && *v && std::filesystem::path(v).is_absolute()) return std::filesystem::path(v) / sub;
  }
  return std::nullopt;
}

// The profile stored for `key` in folder `dir`: nullopt when there is no file of that name or the file
// holds another key. Throws (cascade::Error or a std::exception of the library) when the file cannot be read
// or is damaged.
inline std::optional<CostModel> read_cached_profile(const std::filesystem::path& dir, const ProfileKey& key) {
  const std::filesystem::path file = dir / key.file_name();
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return std::nullopt;
  std::ifstream in(file, std::ios::binary);
  CASCADE_CHECK(bool(in), profile_detail::errno_message());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string head = profile_detail::kHeader + key.text();
  CASCADE_CHECK(text.rfind(profile_detail::kHeader, 0) == 0, "not a cascade profile");
  if (text.compare(0, head.size(), head) != 0) return std::nullopt;  // another key (a hash collision)
  return CostModel::parse(text.substr(head.size()));
}

// Stores `model` as the profile of `key` in `dir` (made if missing), replacing any older one at once (a
// temporary file renamed over it). Throws (cascade::Error or std::filesystem::filesystem_error) when it
// cannot; no temporary file is left behind.
inline std::filesystem::path write_cached_profile(const std::filesystem::path& dir, const ProfileKey& key,
                                                  const CostModel& model) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const fs::path file = dir / key.file_name();
  static std::atomic<unsigned> n_written{0};
  const fs::path tmp = dir / ("." + key.file_name() + "." + std::to_string(getpid()) + "." +
                              std::to_string(n_written.fetch_add(1)) + ".tmp");
  try {
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      CASCADE_CHECK(bool(out), profile_detail::errno_message());
      out << profile_detail::kHeader << key.text() << model.to_string();
      out.close();
      CASCADE_CHECK(bool(out), "writing failed: ", profile_detail::errno_message());
    }
    fs::rename(tmp, file);
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  return file;
}

struct ProfileCacheOptions {
  std::optional<std::filesystem::path> dir = profile_cache_dir();  // nullopt: no cache, calibrate every time
  bool recalibrate = false;  // measure anew even when the cache holds a profile, and store it
};

struct CachedProfile {
  enum class Source { cache, calibrated };
  CostModel model;
  Source source = Source::calibrated;
  std::filesystem::path path;  // the file read, or written; empty when the profile is not kept
  double calibrate_s = 0;      // time spent measuring (0 when read from the cache)
  std::string note;            // why the cache was not read or not written; empty when all went as planned
};

// The profile of `key`: read from the cache folder when it holds one (and recalibrate is off), else
// measured by `measure` and stored there. Never throws for the cache's sake (see the file comment); what
// `measure` throws passes through.
inline CachedProfile cached_profile(const ProfileKey& key, const ProfileCacheOptions& opt,
                                    const std::function<CostModel()>& measure) {
  CachedProfile p;
  if (!opt.dir) {
    p.note = "no cache folder (neither XDG_CACHE_HOME nor HOME is an absolute path): calibrated for this run only";
  } else if (!opt.recalibrate) {
    const std::filesystem::path file = *opt.dir / key.file_name();
    try {
      if (std::optional<CostModel> m = read_cached_profile(*opt.dir, key)) {
        p.model = *m;
        p.source = CachedProfile::Source::cache;
        p.path = file;
        return p;
      }
    } catch (const std::exception& e) {
      p.note = "the cached profile " + file.string() + " is unusable (" + profile_detail::reason(e) +
               "): calibrated again";
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  p.model = measure();
  p.calibrate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.source = CachedProfile::Source::calibrated;
  if (!opt.dir) return p;
  try {
    p.path = write_cached_profile(*opt.dir, key, p.model);
  } catch (const std::exception& e) {
    p.note = (p.note.empty() ? "" : p.note + "; ") + "cannot keep the profile in " + opt.dir->string() + " (" +
             profile_detail::reason(e) + "): calibrated for this run only";
  }
  return p;
}

// calibrate(n_threads, shape, kv_dtype) through the cache: the key is ProfileKey::here(...).
inline CachedProfile calibrate_cached(int n_threads, const HeadShape& shape, DType kv_dtype,
                                      const ProfileCacheOptions& opt = {}) {
  const ProfileKey key = ProfileKey::here(n_threads, shape, kv_dtype);
  return cached_profile(key, opt, [&] { return calibrate(key.n_threads, shape, kv_dtype); });
}

}  // namespace cascade::cpu
