// What cascade-bench and cascade-bench-cuda share: the flags and their parsing, the head-shape presets, a result
// row, its statistics, and the md / csv / json outputs (one format for both, so rows can be compared).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/simd.hpp"
#include "cascade/tree.hpp"

namespace bench {

using cascade::DType;
using cascade::HeadShape;

// Prints "PROGRAM: error: msg" and exits 1; each program defines it.
[[noreturn]] void die(const std::string& msg);

inline int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end || errno) die(flag + ": '" + s + "' is not an integer");
  if (v < lo || v > hi) die(flag + ": " + s + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  if (out.empty()) out.push_back("");
  return out;
}

inline std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(s)) out.push_back(parse_int(flag, item, lo, hi));
  return out;
}

inline const std::map<std::string, HeadShape>& presets() {
  static const std::map<std::string, HeadShape> p = {
      {"smollm2-135m", {9, 3, 64}},   {"llama3-8b", {32, 8, 128}},  {"llama3.2-1b", {32, 8, 64}},
      {"llama2-7b", {32, 32, 128}},   {"qwen2.5-7b", {28, 4, 128}}, {"mistral-7b", {32, 8, 128}},
  };
  return p;
}

// The flags both benchmarks take. Each program starts from its own defaults.
struct Args {
  std::vector<int64_t> batch{32}, prefix{1230}, suffix{1024};
  HeadShape shape{9, 3, 64};
  std::string shape_name = "smollm2-135m";
  std::vector<DType> dtypes{DType::f16};
  std::vector<std::string> methods;
  std::vector<int> threads{0};
  std::vector<cascade::Isa> isas;  // instruction-set tiers to run (CPU only; empty: the widest the CPU has)
  int bf16_products = -1;  // bf16 K/V on bf16 dot products: 1 yes, 0 no, -1 the library's choice (CPU only)
  bool amx = true;         // bf16 products on AMX tiles where the process may run them (CPU only)
  int int8_products = -1;  // q8_0 K/V on int8 dot products: 1 yes, 0 no, -1 the library's choice (CPU only)
  bool batch_invariant = true;  // attention in the batch-invariant order (CPU only; --nondeterministic: false)
  int reps = 5, warmup = 1;
  std::string format = "md";
  bool flush = true;
};

// Parses argv into a. `known` lists the methods --method accepts; `usage` prints --help; `extra(flag,
// value)` takes the program's own flags (value() reads the next argument) and returns false for an
// unknown one.
template <class Extra>
void parse_flags(int argc, char** argv, Args& a, const std::vector<std::string>& known, void (*usage)(),
                 Extra extra) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(f + " needs a value");
      return argv[++i];
    };
    if (f == "-h" || f == "--help") {
      usage();
      std::exit(0);
    } else if (f == "--batch") {
      a.batch = parse_int_list(f, value(), 1, 4096);
    } else if (f == "--prefix") {
      a.prefix = parse_int_list(f, value(), 0, 1 << 24);
    } else if (f == "--suffix") {
      a.suffix = parse_int_list(f, value(), 0, 1 << 24);
    } else if (f == "--shape") {
      const std::string name = value();
      auto it = presets().find(name);
      if (it == presets().end()) die("--shape: unknown preset '" + name + "' (see --help)");
      a.shape = it->second;
      a.shape_name = name;
    } else if (f == "--heads") {
      const std::string v = value();
      int q, kv, d;
      char tail;
      if (std::sscanf(v.c_str(), "%d/%d/%d%c", &q, &kv, &d, &tail) != 3) die("--heads: expected Q/KV/D, got '" + v + "'");
      a.shape = {q, kv, d};
      try {
        a.shape.validate();
      } catch (const cascade::Error& e) {
        die(std::string("--heads: ") + e.what());
      }
      a.shape_name = v;
    } else if (f == "--kv-dtype") {
      a.dtypes.clear();
      for (const auto& s : split_list(value())) {
        try {
          a.dtypes.push_back(cascade::parse_dtype(s));
        } catch (const cascade::Error& e) {
          die(std::string("--kv-dtype: ") + e.what());
        }
      }
    } else if (f == "--method") {
      a.methods = split_list(value());
      for (const auto& m : a.methods)
        if (std::find(known.begin(), known.end(), m) == known.end()) {
          std::string list;
          for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
          die("--method: unknown method '" + m + "' (" + list + ")");
        }
    } else if (f == "--threads") {
      a.threads.clear();
      for (auto t : parse_int_list(f, value(), 0, 1024)) a.threads.push_back(int(t));
    } else if (f == "--reps") {
      a.reps = int(parse_int(f, value(), 1, 100000));
    } else if (f == "--warmup") {
      a.warmup = int(parse_int(f, value(), 0, 100000));
    } else if (f == "--no-flush") {
      a.flush = false;
    } else if (f == "-o") {
      a.format = value();
      if (a.format != "md" && a.format != "csv" && a.format != "json") die("-o: expected md, csv or json");
    } else if (!extra(f, value)) {
      die("unknown flag '" + f + "' (see --help)");
    }
  }
}

struct Row {
  std::string method;
  std::string path;  // the kernels that ran: an instruction-set tier (+bf16: bf16 products), or the device
  std::string kernels;  // the plan's kernel choices, as cpu::kernel_names gives them (empty: not a CPU plan)
  int64_t batch, prefix, suffix;
  HeadShape shape;
  DType dtype;
  int threads;
  double median_ms, mean_ms, stdev_ms, min_ms, max_ms;
  double min_bytes, min_flops, bytes_read;
  double bw_ms, flop_ms;  // the minimum bytes at the read bandwidth, the minimum FLOPs at the peak rate
  double limit_ms;        // the larger of the two
  double bw_gbs, peak_gflops;
};

inline void fill_stats(Row& r, std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  r.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  double sum = 0, sq = 0;
  for (double x : ms) sum += x;
  r.mean_ms = sum / double(n);
  for (double x : ms) sq += (x - r.mean_ms) * (x - r.mean_ms);
  r.stdev_ms = n > 1 ? std::sqrt(sq / double(n - 1)) : 0.0;
  r.min_ms = ms.front();
  r.max_ms = ms.back();
}

inline std::string fmt(double x, int prec = 3) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", prec, x);
  return b;
}

// "of limit" is limit_ms / median_ms; "of bw" and "of peak" are the same for each limit alone: the share of
// the read bandwidth and of the multiply-add peak the run reached.
inline void print_md(const std::vector<Row>& rows) {
  std::printf("| method  | path        |   B |      P |      t | heads     | kv   | thr | median ms |     ± ms | limit ms | "
              "of limit |  of bw | of peak |\n");
  std::printf("|---------|-------------|----:|-------:|-------:|-----------|------|----:|----------:|---------:|---------:|"
              "---------:|-------:|--------:|\n");
  for (const Row& r : rows) {
    const std::string heads = std::to_string(r.shape.n_q_heads) + "/" + std::to_string(r.shape.n_kv_heads) + "/" +
                              std::to_string(r.shape.head_dim);
    std::printf("| %-7s | %-11s | %3lld | %6lld | %6lld | %-9s | %-4s | %3d | %9s | %8s | %8s | %7.1f%% | %5.1f%% | "
                "%6.1f%% |\n",
                r.method.c_str(), r.path.c_str(), (long long)r.batch, (long long)r.prefix, (long long)r.suffix,
                heads.c_str(), cascade::dtype_name(r.dtype), r.threads, fmt(r.median_ms).c_str(),
                fmt(r.stdev_ms).c_str(), fmt(r.limit_ms).c_str(), 100.0 * r.limit_ms / r.median_ms,
                100.0 * r.bw_ms / r.median_ms, 100.0 * r.flop_ms / r.median_ms);
  }
  // Speedups of cascade over the baselines measured in the same configuration.
  bool header = false;
  for (const Row& c : rows) {
    if (c.method != "cascade") continue;
    std::string line;
    for (const Row& b : rows) {
      if (b.method == "cascade" || b.batch != c.batch || b.prefix != c.prefix || b.suffix != c.suffix ||
          b.dtype != c.dtype || b.threads != c.threads || b.path != c.path)
        continue;
      line += "  " + fmt(b.median_ms / c.median_ms, 2) + "x vs " + b.method;
    }
    if (line.empty()) continue;
    if (!header) std::printf("\ncascade speedup (median over median):\n");
    header = true;
    std::printf("  B=%lld P=%lld t=%lld %s %d thr %s:%s\n", (long long)c.batch, (long long)c.prefix,
                (long long)c.suffix, cascade::dtype_name(c.dtype), c.threads, c.path.c_str(), line.c_str());
  }
  // Each method's time on the other kernel paths over its time on the first path listed.
  header = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& f = rows[i];
    std::string line;
    bool first = true;
    for (size_t j = 0; j < rows.size(); ++j) {
      const Row& b = rows[j];
      if (b.method != f.method || b.batch != f.batch || b.prefix != f.prefix || b.suffix != f.suffix ||
          b.dtype != f.dtype || b.threads != f.threads)
        continue;
      if (j < i) first = false;
      if (j != i) line += "  " + b.path + " " + fmt(b.median_ms / f.median_ms, 2) + "x";
    }
    if (!first || line.empty()) continue;
    if (!header) std::printf("\ntime on the other kernel paths, over the first path's:\n");
    header = true;
    std::printf("  %-7s B=%lld P=%lld t=%lld %s %d thr, %s:%s\n", f.method.c_str(), (long long)f.batch,
                (long long)f.prefix, (long long)f.suffix, cascade::dtype_name(f.dtype), f.threads, f.path.c_str(),
                line.c_str());
  }
}

inline void print_csv(const std::vector<Row>& rows) {
  std::printf(
      "method,path,batch,prefix,suffix,n_q_heads,n_kv_heads,head_dim,kv_dtype,threads,median_ms,mean_ms,stdev_ms,"
      "min_ms,max_ms,min_bytes,min_flops,bytes_read,limit_ms,fraction,bw_ms,bw_fraction,flop_ms,peak_fraction,bw_gbs,"
      "peak_gflops,kernels\n");
  for (const Row& r : rows)
    std::printf("%s,%s,%lld,%lld,%lld,%d,%d,%d,%s,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.0f,%.0f,%.0f,%.6f,%.6f,%.6f,%.6f,%.6f,"
                "%.6f,%.3f,%.3f,\"%s\"\n",
                r.method.c_str(), r.path.c_str(), (long long)r.batch, (long long)r.prefix, (long long)r.suffix,
                r.shape.n_q_heads, r.shape.n_kv_heads, r.shape.head_dim, cascade::dtype_name(r.dtype), r.threads,
                r.median_ms, r.mean_ms, r.stdev_ms, r.min_ms, r.max_ms, r.min_bytes, r.min_flops, r.bytes_read,
                r.limit_ms, r.limit_ms / r.median_ms, r.bw_ms, r.bw_ms / r.median_ms, r.flop_ms,
                r.flop_ms / r.median_ms, r.bw_gbs, r.peak_gflops, r.kernels.c_str());
}

inline void print_json(const std::vector<Row>& rows) {
  std::printf("[\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf(
        "  {\"method\": \"%s\", \"path\": \"%s\", \"batch\": %lld, \"prefix\": %lld, \"suffix\": %lld, "
        "\"n_q_heads\": %d, \"n_kv_heads\": %d, \"head_dim\": %d, \"kv_dtype\": \"%s\", \"threads\": %d, "
        "\"median_ms\": %.6f, \"mean_ms\": %.6f, \"stdev_ms\": %.6f, \"min_ms\": %.6f, \"max_ms\": %.6f, "
        "\"min_bytes\": %.0f, \"min_flops\": %.0f, \"bytes_read\": %.0f, \"limit_ms\": %.6f, \"fraction\": %.6f, "
        "\"bw_ms\": %.6f, \"bw_fraction\": %.6f, \"flop_ms\": %.6f, \"peak_fraction\": %.6f, \"bw_gbs\": %.3f, "
        "\"peak_gflops\": %.3f, \"kernels\": \"%s\"}%s\n",
        r.method.c_str(), r.path.c_str(), (long long)r.batch, (long long)r.prefix, (long long)r.suffix,
        r.shape.n_q_heads, r.shape.n_kv_heads, r.shape.head_dim, cascade::dtype_name(r.dtype), r.threads, r.median_ms,
        r.mean_ms, r.stdev_ms, r.min_ms, r.max_ms, r.min_bytes, r.min_flops, r.bytes_read, r.limit_ms,
        r.limit_ms / r.median_ms, r.bw_ms, r.bw_ms / r.median_ms, r.flop_ms, r.flop_ms / r.median_ms, r.bw_gbs,
        r.peak_gflops, r.kernels.c_str(), i + 1 < rows.size() ? "," : "");
  }
  std::printf("]\n");
}

}  // namespace bench
