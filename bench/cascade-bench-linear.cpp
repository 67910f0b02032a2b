// cascade-bench-linear: the runtime's linear layers (model/linear.hpp) on a model's layer shapes, timed against
// the machine's read bandwidth and int8 multiply-add peak measured in the same run.
//
// For each shape, weight type, number of rows of X and path, two kinds of rows:
//   one matrix (q, k, v, o, gate, up, down, lm_head): the caches are flushed before every repetition, so its
//       weights come from memory as they do in a decode step;
//   layers: every linear layer of n_layer layers and the lm_head, each with its own weights, multiplied in the
//       order of a forward pass (q, k, v share their input and one split across the threads; gate and up too,
//       as linear::matmul_group) - one step's linear work.
// Each row gives the weights' bytes and GB/s (bytes / time), int8 GOP/s (2 * rows * n_in * n_out / time; f32
// FLOP/s on the f32 path), their fractions of the measured bandwidth and of the int8 peak of what multiplied them
// (the path's instruction; AMX tiles' tdpbsud where rows of X went to tiles: the products column), and the speed
// against the f32 path (weights dequantized tile by tile, f32 activations: the runtime's previous path) when
// that is among the paths run. Quantized weights are packed in blocks of 16 rows as a model packs them when it
// loads (linear::pack), unless --layout rows asks for them as the file stores them.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/global_control.h>
#include <tbb/info.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "int8_peak.hpp"
#include "machine.hpp"
#include "model/linear.hpp"
#include "model/linear_kernels.hpp"  // detail::set_tiles, for avx512-vnni-vectors
#include "model/quant.hpp"

namespace {

using cascade::gguf::TensorType;
namespace linear = cascade::linear;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "cascade-bench-linear: error: %s\n", msg.c_str());
  std::exit(1);
}

void usage() {
  std::printf(
      "usage: cascade-bench-linear [options]\n"
      "  --shape LIST      smollm2-135m (default), llama3.2-1b, llama3-8b, gemma3-270m\n"
      "  --rows LIST       rows of X, i.e. tokens of a step (default 1,8,32,128,512)\n"
      "  --type LIST       weight types: q4_0, q4_1, q8_0, q4_K, q5_K, q6_K, f16, bf16, f32 (default q4_1,q8_0)\n"
      "  --path LIST       active (the default path), portable, avx2, avx-vnni, avx512-vnni, avx512-vnni-vectors\n"
      "                    (avx512-vnni with AMX tiles off), f32 (weights dequantized tile by tile, f32\n"
      "                    activations) (default active,f32)\n"
      "  --matrices LIST   q, k, v, o, gate, up, down, lm_head, layers (default all of them)\n"
      "  --layers N        layers in the 'layers' rows (default: the model's, at most 4 for llama3.2-1b, 1 for\n"
      "                    llama3-8b)\n"
      "  --layout L        rows16 (default: quantized weights packed as a model loads them) or rows (as stored)\n"
      "  --threads N       threads (default: all)\n"
      "  --reps N          timed repetitions (default 7; the median is reported)\n"
      "  -o md|csv|json    output format (default md)\n");
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end) die(flag + ": '" + s + "' is not an integer");
  if (v < lo || v > hi) die(flag + ": " + s + " is out of range");
  return v;
}

struct Shape {
  std::string name;
  int64_t n_embd, n_q, n_kv, n_ff, n_vocab, n_layer, max_layers;
};

const std::map<std::string, Shape>& shapes() {
  static const std::map<std::string, Shape> s = {
      {"smollm2-135m", {"smollm2-135m", 576, 576, 192, 1536, 49152, 30, 30}},
      {"llama3.2-1b", {"llama3.2-1b", 2048, 2048, 512, 8192, 128256, 16, 4}},
      {"gemma3-270m", {"gemma3-270m", 640, 1024, 256, 2048, 262144, 18, 18}},
      {"llama3-8b", {"llama3-8b", 4096, 4096, 1024, 14336, 128256, 32, 1}},
  };
  return s;
}

struct MatShape {
  std::string name;
  int64_t n_in, n_out;
};

std::vector<MatShape> matrices(const Shape& s) {
  return {{"q", s.n_embd, s.n_q},     {"k", s.n_embd, s.n_kv},  {"v", s.n_embd, s.n_kv},
          {"o", s.n_q, s.n_embd},     {"gate", s.n_embd, s.n_ff}, {"up", s.n_embd, s.n_ff},
          {"down", s.n_ff, s.n_embd}, {"lm_head", s.n_embd, s.n_vocab}};
}

TensorType parse_type(const std::string& s) {
  for (TensorType t : {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0, TensorType::Q4_K, TensorType::Q5_K,
                       TensorType::Q6_K, TensorType::F16, TensorType::BF16, TensorType::F32})
    if (s == cascade::gguf::type_name(t)) return t;
  die("--type: unknown type '" + s + "'");
}

// Random weights of type t: random bytes, with every block's f16 scales set to finite values.
std::vector<uint8_t> random_weights(TensorType t, int64_t n_in, int64_t n_out, uint64_t seed) {
  const uint64_t rb = cascade::gguf::row_bytes(t, n_in);
  std::vector<uint8_t> m(rb * uint64_t(n_out));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i + 8 <= m.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(m.data() + i, &x, 8);
  }
  const auto put = [&](uint8_t* p, float v) {
    const uint16_t h = cascade::gguf::fp32_to_fp16(v);
    std::memcpy(p, &h, 2);
  };
  if (t == TensorType::F16 || t == TensorType::BF16 || t == TensorType::F32) {
    const size_t es = t == TensorType::F32 ? 4 : 2;
    for (size_t i = 0; i < m.size(); i += es) {
      const float v = float(int(m[i] % 64) - 32) / 1024.0f;
      if (t == TensorType::F32) std::memcpy(m.data() + i, &v, 4);
      else if (t == TensorType::F16) put(m.data() + i, v);
      else {
        const uint16_t h = cascade::gguf::fp32_to_bf16(v);
        std::memcpy(m.data() + i, &h, 2);
      }
    }
    return m;
  }
  const uint64_t bb = cascade::gguf::block_bytes(t);
  for (uint64_t at = 0; at < m.size(); at += bb) {
    uint8_t* b = m.data() + at;
    switch (t) {
      case TensorType::Q4_0: case TensorType::Q8_0: put(b, 0.01f); break;
      case TensorType::Q4_1: case TensorType::Q4_K: case TensorType::Q5_K: put(b, 0.01f); put(b + 2, -0.05f); break;
      case TensorType::Q6_K: put(b + 208, 0.001f); break;
      default: break;
    }
  }
  return m;
}

struct Row {
  std::string shape, matrix, type, path, products;
  int64_t rows, n_in, n_out, n_matrices;
  double ms, bytes, ops;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

linear::Path path_of(const std::string& path) {
  return path == "portable"   ? linear::Path::portable
         : path == "avx2"     ? linear::Path::avx2
         : path == "avx-vnni" ? linear::Path::avx_vnni
                              : linear::Path::avx512_vnni;  // avx512-vnni and avx512-vnni-vectors
}

// The avx512-vnni-vectors path is avx512-vnni with rows of X kept off AMX tiles, whatever their number.
void set_tiles_for(const std::string& path) {
  if (path == "avx512-vnni-vectors") linear::detail::set_tiles(linear::detail::Tiles::vectors);
  else linear::detail::reset_tiles();
}

// One call: Y = X W^T on `path` ("f32" for the f32 path).
void multiply(const std::string& path, const linear::Matrix& w, const linear::Input& x, float* y) {
  if (path == "f32") linear::matmul_f32(w, x.data(), x.n(), y);
  else linear::matmul(w, x, y, path_of(path));
}

// Several matrices against one X in one call, as the forward pass multiplies q, k, v and gate, up.
void multiply_group(const std::string& path, std::initializer_list<linear::Product> products,
                    const linear::Input& x) {
  if (path == "f32")
    for (const linear::Product& p : products) linear::matmul_f32(*p.w, x.data(), x.n(), p.y);
  else linear::matmul_group(products, x, path_of(path));
}

// The command line.
struct Args {
  std::vector<std::string> shapes = {"smollm2-135m"}, types = {"q4_1", "q8_0"}, paths = {"active", "f32"},
                           mats = {"q", "k", "v", "o", "gate", "up", "down", "lm_head", "layers"};
  std::vector<int64_t> rows = {1, 8, 32, 128, 512};
  int threads = 0, reps = 7;
  int64_t layers = 0;  // 0: the shape's max_layers
  std::string format = "md", layout = "rows16";
  bool help = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(f + " needs a value");
      return argv[++i];
    };
    if (f == "-h" || f == "--help") {
      a.help = true;
      return a;
    } else if (f == "--shape") {
      a.shapes = split_list(value());
    } else if (f == "--rows") {
      a.rows.clear();
      for (const auto& s : split_list(value())) a.rows.push_back(parse_int(f, s, 1, 1 << 16));
    } else if (f == "--type") {
      a.types = split_list(value());
    } else if (f == "--path") {
      a.paths = split_list(value());
    } else if (f == "--matrices") {
      a.mats = split_list(value());
    } else if (f == "--layers") {
      a.layers = parse_int(f, value(), 1, 1024);
    } else if (f == "--layout") {
      a.layout = value();
      if (a.layout != "rows16" && a.layout != "rows") die("--layout: expected rows16 or rows");
    } else if (f == "--threads") {
      a.threads = int(parse_int(f, value(), 0, 1024));
    } else if (f == "--reps") {
      a.reps = int(parse_int(f, value(), 1, 1000));
    } else if (f == "-o") {
      a.format = value();
      if (a.format != "md" && a.format != "csv" && a.format != "json") die("-o: expected md, csv or json");
    } else {
      die("unknown flag '" + f + "' (see --help)");
    }
  }
  return a;
}

// Resolves "active" to the default path and checks every name the arguments give; an error names the first bad
// one. Returns the weight types.
std::vector<TensorType> check_args(Args& a) {
  std::vector<TensorType> types;
  for (const auto& s : a.types) types.push_back(parse_type(s));
  for (auto& p : a.paths) {
    if (p == "active") p = linear::path_name(linear::active_path());
    if (p != "f32" && p != "portable" && p != "avx2" && p != "avx-vnni" && p != "avx512-vnni" &&
        p != "avx512-vnni-vectors")
      die("--path: unknown path '" + p + "'");
    if (p != "f32" && p != "portable" && !linear::can_run(path_of(p)))
      die("--path: this CPU cannot run the " + p + " path");
  }
  for (const auto& m : a.mats)
    if (m != "layers" && m != "q" && m != "k" && m != "v" && m != "o" && m != "gate" && m != "up" && m != "down" &&
        m != "lm_head")
      die("--matrices: unknown matrix '" + m + "'");
  for (const auto& s : a.shapes)
    if (!shapes().count(s)) die("--shape: unknown shape '" + s + "'");
  return types;
}

// The machine's limits, in this run: read bandwidth (bytes/s) and each path's peak (ops/s; 0 for portable).
struct Limits {
  double bw = 0;
  std::map<std::string, double> peak;
};

Limits measure_limits(const std::vector<std::string>& paths, int threads) {
  Limits l;
  l.bw = bench::measure_read_bandwidth(threads);
  for (const auto& p : paths) {
    if (p == "f32") l.peak[p] = bench::measure_gemm_rate(threads);
    else if (p == "portable") l.peak[p] = 0;
    else l.peak[p] = bench::measure_int8_peak(path_of(p), threads);
  }
  if (linear::amx_int8_usable()) l.peak["amx"] = bench::measure_amx_int8_peak(threads);
  std::fprintf(stderr, "cascade-bench-linear: %d threads, read bandwidth %.1f GB/s", threads, l.bw / 1e9);
  for (const auto& [p, v] : l.peak)
    if (v > 0) std::fprintf(stderr, ", %s peak %.0f G%s/s", p.c_str(), v / 1e9, p == "f32" ? "FLOP" : "OP");
  std::fprintf(stderr, "\n");
  return l;
}

// The weights of one shape and type: one copy of each matrix asked for (single), and for the 'layers' rows
// n_layers copies of the layer's seven and one lm_head (empty layer_w where a matrix's n_in is not a whole number
// of blocks, or 'layers' was not asked for).
struct Weights {
  TensorType type;
  bool packed = false;  // quantized matrices in the rows16 layout
  std::map<std::string, std::vector<uint8_t>> single;
  std::vector<std::vector<uint8_t>> store;
  std::vector<std::vector<linear::Matrix>> layer_w;
  linear::Matrix lm_head{};
};

// The matrix of type t and shape (n_in, n_out) in `bytes`, packed in place (through a copy) where w.packed.
linear::Matrix matrix_of(const Weights& w, std::vector<uint8_t>& bytes, int64_t n_in, int64_t n_out) {
  const linear::Matrix m = linear::Matrix::view(w.type, bytes.data(), n_in, n_out);
  if (!w.packed) return m;
  const std::vector<uint8_t> rows = bytes;
  return linear::pack(linear::Matrix::view(w.type, rows.data(), n_in, n_out), bytes.data());
}

void make_weights(const Shape& shape, TensorType t, const std::vector<std::string>& mats, int64_t n_layers,
                  bool rows16, Weights& w) {
  w.type = t;
  w.packed = rows16 && linear::can_pack(t);
  const int64_t bs = cascade::gguf::block_size(t);
  const auto ok = [&](const MatShape& m) { return m.n_in % bs == 0; };
  const std::vector<MatShape> all = matrices(shape);
  for (const MatShape& m : all)
    if (ok(m) && std::count(mats.begin(), mats.end(), m.name)) {
      w.single[m.name] = random_weights(t, m.n_in, m.n_out, 1);
      matrix_of(w, w.single[m.name], m.n_in, m.n_out);
    }
  if (!std::count(mats.begin(), mats.end(), "layers") || !std::all_of(all.begin(), all.end(), ok)) return;
  for (int64_t il = 0; il < n_layers; ++il) {
    std::vector<linear::Matrix> ws;
    for (size_t j = 0; j + 1 < all.size(); ++j) {
      w.store.push_back(random_weights(t, all[j].n_in, all[j].n_out, uint64_t(100 * il + j)));
      ws.push_back(matrix_of(w, w.store.back(), all[j].n_in, all[j].n_out));
    }
    w.layer_w.push_back(ws);
  }
  w.store.push_back(random_weights(t, shape.n_embd, shape.n_vocab, 7));
  w.lm_head = matrix_of(w, w.store.back(), shape.n_embd, shape.n_vocab);
}

// X (n rows of the widest input) and three outputs of the widest output.
struct Buffers {
  std::vector<float> x, y, y2, y3;
};

// The median of `reps` timed calls of f (ms), after one untimed; the caches flushed before each.
template <class F>
double time_ms(bench::CacheFlusher& flusher, int reps, F&& f) {
  std::vector<double> ms;
  for (int rep = -1; rep < reps; ++rep) {
    flusher.flush();
    const double t0 = now_s();
    f();
    if (rep >= 0) ms.push_back(1e3 * (now_s() - t0));
  }
  return median(ms);
}

// What multiplied a row's weights: "amx" where rows of X went to AMX tiles, else the path (linear.cpp decides the
// same way: the avx512-vnni path, a quantized type, at least linear::kAmxRows rows of X).
std::string products_of(const std::string& path, TensorType t, int64_t n) {
  const bool quantized = linear::can_pack(t);
  return path == "avx512-vnni" && quantized && n >= linear::kAmxRows && linear::amx_int8_usable() ? "amx" : path;
}

// One row per matrix of w.single: each multiplied alone.
void time_single(const Shape& shape, const Weights& w, const std::string& path, int64_t n, Buffers& b, int reps,
                 bench::CacheFlusher& flusher, std::vector<Row>& out) {
  for (const MatShape& m : matrices(shape)) {
    if (!w.single.count(m.name)) continue;
    linear::Matrix mat = linear::Matrix::view(w.type, w.single.at(m.name).data(), m.n_in, m.n_out);
    if (w.packed) mat.layout = linear::Layout::rows16;  // packed in place by make_weights
    const double ms = time_ms(flusher, reps, [&] {
      const linear::Input in(b.x.data(), n, m.n_in);  // quantizing X is part of the product
      multiply(path, mat, in, b.y.data());
    });
    out.push_back({shape.name, m.name, cascade::gguf::type_name(w.type), path, products_of(path, w.type, n), n,
                   m.n_in, m.n_out, 1, ms, double(mat.bytes()), 2.0 * double(n) * double(mat.n_in) * double(mat.n_out)});
  }
}

// The 'layers' row: every layer's products in the order of a forward pass, then the lm_head.
void time_layers(const Shape& shape, const Weights& w, const std::string& path, int64_t n, Buffers& b, int reps,
                 bench::CacheFlusher& flusher, std::vector<Row>& out) {
  double bytes = double(w.lm_head.bytes()), ops = 2.0 * double(n) * double(w.lm_head.n_in) * double(w.lm_head.n_out);
  for (const auto& ws : w.layer_w)
    for (const auto& m : ws) bytes += double(m.bytes()), ops += 2.0 * double(n) * double(m.n_in) * double(m.n_out);
  const double ms = time_ms(flusher, reps, [&] {
    for (const auto& ws : w.layer_w) {
      multiply_group(path, {{&ws[0], b.y.data()}, {&ws[1], b.y2.data()}, {&ws[2], b.y3.data()}},
                     linear::Input(b.x.data(), n, shape.n_embd));
      multiply(path, ws[3], linear::Input(b.x.data(), n, shape.n_q), b.y.data());
      multiply_group(path, {{&ws[4], b.y.data()}, {&ws[5], b.y2.data()}}, linear::Input(b.x.data(), n, shape.n_embd));
      multiply(path, ws[6], linear::Input(b.x.data(), n, shape.n_ff), b.y.data());
    }
    multiply(path, w.lm_head, linear::Input(b.x.data(), n, shape.n_embd), b.y.data());
  });
  const int64_t n_layers = int64_t(w.layer_w.size());
  out.push_back({shape.name, "layers", cascade::gguf::type_name(w.type), path, products_of(path, w.type, n), n,
                 shape.n_embd, n_layers, n_layers * 7 + 1, ms, bytes, ops});
}

// Every row of one shape and type, for each number of rows of X and path.
void time_shape(const Shape& shape, const Weights& w, const Args& a, bench::CacheFlusher& flusher,
                std::vector<Row>& out) {
  for (int64_t n : a.rows) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int64_t widest = std::max(shape.n_ff, shape.n_vocab);
    Buffers b;
    b.x.resize(size_t(n * std::max(shape.n_ff, shape.n_q)));
    b.y.resize(size_t(n * widest));
    b.y2.resize(size_t(n * widest));
    b.y3.resize(size_t(n * widest));
    for (auto& v : b.x) v = nd(rng);
    for (const auto& path : a.paths) {
      set_tiles_for(path);
      time_single(shape, w, path, n, b, a.reps, flusher, out);
      if (!w.layer_w.empty()) time_layers(shape, w, path, n, b, a.reps, flusher, out);
    }
    linear::detail::reset_tiles();
  }
}

// The f32 path's time of the same point as r (0 where it was not run).
double f32_ms(const std::vector<Row>& out, const Row& r) {
  for (const Row& o : out)
    if (o.path == "f32" && o.shape == r.shape && o.matrix == r.matrix && o.type == r.type && o.rows == r.rows)
      return o.ms;
  return 0;
}

void print_md(const std::vector<Row>& out, int threads, const Limits& l) {
  std::printf("threads %d, read bandwidth %.1f GB/s", threads, l.bw / 1e9);
  for (const auto& [p, v] : l.peak)
    if (v > 0) std::printf(", %s peak %.0f G%s/s", p.c_str(), v / 1e9, p == "f32" ? "FLOP" : "OP");
  std::printf("\n\n| shape | matrix | n_out x n_in | type | rows | path | products | ms | GB/s | of bw | GOP/s "
              "| of peak | vs f32 |\n");
  std::printf("|---|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : out) {
    const double gbs = r.bytes / (r.ms * 1e-3) / 1e9, gops = r.ops / (r.ms * 1e-3) / 1e9;
    const double pk = l.peak.at(r.products), f = f32_ms(out, r);
    const std::string dims = r.matrix == "layers" ? std::to_string(r.n_out) + " layers + lm_head"
                                                  : std::to_string(r.n_out) + " x " + std::to_string(r.n_in);
    std::printf("| %s | %s | %s | %s | %lld | %s | %s | %.3f | %.1f | %.0f%% | %.1f | %s | %s |\n", r.shape.c_str(),
                r.matrix.c_str(), dims.c_str(), r.type.c_str(), (long long)r.rows, r.path.c_str(), r.products.c_str(),
                r.ms, gbs,
                100 * gbs * 1e9 / l.bw, gops,
                pk > 0 ? (std::to_string(int(std::lround(100 * gops * 1e9 / pk))) + "%").c_str() : "-",
                f > 0 && r.path != "f32" ? (std::to_string(f / r.ms).substr(0, 5) + "x").c_str() : "-");
  }
}

void print_csv(const std::vector<Row>& out, const Limits& l) {
  std::printf("shape,matrix,n_in,n_out,n_matrices,type,rows,path,products,ms,bytes,ops,gb_s,gop_s,read_bw_gb_s,"
              "peak_gop_s,vs_f32\n");
  for (const Row& r : out) {
    const double f = f32_ms(out, r);
    std::printf("%s,%s,%lld,%lld,%lld,%s,%lld,%s,%s,%.6f,%.0f,%.0f,%.3f,%.3f,%.3f,%.3f,%.4f\n", r.shape.c_str(),
                r.matrix.c_str(), (long long)r.n_in, (long long)r.n_out, (long long)r.n_matrices, r.type.c_str(),
                (long long)r.rows, r.path.c_str(), r.products.c_str(), r.ms, r.bytes, r.ops, r.bytes / r.ms / 1e6,
                r.ops / r.ms / 1e6, l.bw / 1e9, l.peak.at(r.products) / 1e9, f > 0 ? f / r.ms : 0.0);
  }
}

void print_json(const std::vector<Row>& out, int threads, const Limits& l) {
  std::printf("{\"threads\": %d, \"read_bw_gb_s\": %.3f, \"peak_gop_s\": {", threads, l.bw / 1e9);
  bool first = true;
  for (const auto& [p, v] : l.peak) {
    std::printf("%s\"%s\": %.3f", first ? "" : ", ", p.c_str(), v / 1e9);
    first = false;
  }
  std::printf("}, \"rows\": [\n");
  for (size_t i = 0; i < out.size(); ++i) {
    const Row& r = out[i];
    const double f = f32_ms(out, r);
    std::printf("  {\"shape\": \"%s\", \"matrix\": \"%s\", \"n_in\": %lld, \"n_out\": %lld, \"n_matrices\": %lld, "
                "\"type\": \"%s\", \"rows\": %lld, \"path\": \"%s\", \"products\": \"%s\", \"ms\": %.6f, "
                "\"bytes\": %.0f, \"ops\": %.0f, \"gb_s\": %.3f, \"gop_s\": %.3f, \"of_bw\": %.4f, \"of_peak\": %.4f, "
                "\"vs_f32\": %.4f}%s\n",
                r.shape.c_str(), r.matrix.c_str(), (long long)r.n_in, (long long)r.n_out, (long long)r.n_matrices,
                r.type.c_str(), (long long)r.rows, r.path.c_str(), r.products.c_str(), r.ms, r.bytes, r.ops,
                r.bytes / r.ms / 1e6, r.ops / r.ms / 1e6, r.bytes / (r.ms * 1e-3) / l.bw,
                l.peak.at(r.products) > 0 ? r.ops / (r.ms * 1e-3) / l.peak.at(r.products) : 0.0, f > 0 ? f / r.ms : 0.0,
                i + 1 < out.size() ? "," : "");
  }
  std::printf("]}\n");
}

}  // namespace

int main(int argc, char** argv) try {
  Args a = parse_args(argc, argv);
  if (a.help) {
    usage();
    return 0;
  }
  const std::vector<TensorType> types = check_args(a);
  const int threads = a.threads ? a.threads : tbb::info::default_concurrency();
  tbb::global_control gc(tbb::global_control::max_allowed_parallelism, size_t(threads));
  const Limits limits = measure_limits(a.paths, threads);
  bench::CacheFlusher flusher;
  std::vector<Row> out;
  for (const auto& sn : a.shapes) {
    const Shape& shape = shapes().at(sn);
    for (TensorType t : types) {
      Weights w;
      make_weights(shape, t, a.mats, a.layers ? a.layers : shape.max_layers, a.layout == "rows16", w);
      time_shape(shape, w, a, flusher, out);
    }
  }
  if (a.format == "md") print_md(out, threads, limits);
  else if (a.format == "csv") print_csv(out, limits);
  else print_json(out, threads, limits);
  return 0;
} catch (const std::exception& e) {
  die(e.what());
}
