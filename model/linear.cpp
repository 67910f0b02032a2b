#include "model/linear.hpp"

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "cascade/error.hpp"
#include "model/linear_kernels.hpp"
#include "model/quant.hpp"

namespace cascade::linear {

using gguf::TensorType;

namespace {

constexpr bool is_float_type(TensorType t) {
  return t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16;
}

// Calls f.template operator()<T>() for the weight type t (one the runtime reads: Matrix::view checked it).
template <class F>
void with_type(TensorType t, F&& f) {
  switch (t) {
    case TensorType::Q4_0: return f.template operator()<TensorType::Q4_0>();
    case TensorType::Q4_1: return f.template operator()<TensorType::Q4_1>();
    case TensorType::Q8_0: return f.template operator()<TensorType::Q8_0>();
    case TensorType::Q4_K: return f.template operator()<TensorType::Q4_K>();
    case TensorType::Q5_K: return f.template operator()<TensorType::Q5_K>();
    case TensorType::Q6_K: return f.template operator()<TensorType::Q6_K>();
    case TensorType::F32: return f.template operator()<TensorType::F32>();
    case TensorType::F16: return f.template operator()<TensorType::F16>();
    case TensorType::BF16: return f.template operator()<TensorType::BF16>();
    default: ::cascade::detail::fail("linear: tensor type ", gguf::type_name(t), " has no kernels");
  }
}

}  // namespace

// The one place that picks a tier: `call` (an entry point of linear_kernels.hpp) in the namespace of path `path`.
#if CASCADE_X86
#define CASCADE_LINEAR_ON_TIER(path, call)                  \
  switch (path) {                                           \
    case Path::portable: return ::cascade::linear::detail::portable::call;       \
    case Path::avx2: return ::cascade::linear::detail::avx2::call;               \
    case Path::avx_vnni: return ::cascade::linear::detail::avx_vnni::call;       \
    case Path::avx512_vnni: return ::cascade::linear::detail::avx512_vnni::call; \
  }                                                         \
  ::cascade::detail::fail("linear: unknown path ", int(path))
#else
#define CASCADE_LINEAR_ON_TIER(path, call)                                                        \
  CASCADE_CHECK(path == Path::portable, "linear: the ", path_name(path), " kernels are not part of this build"); \
  return ::cascade::linear::detail::portable::call
#endif

namespace detail {

void quantize(Path path, const float* x, int64_t n, int64_t n_in, Int8Form& f) {
  CASCADE_LINEAR_ON_TIER(path, quantize(x, n, n_in, f));
}

bool bf16_dot(Path path) { return path == Path::avx512_vnni && cpu_features().avx512_bf16; }

namespace {
std::atomic<int> g_tiles{-1};  // set_tiles' choice; -1: none
}  // namespace

Tiles tiles_for(Path path, int64_t n) {
  const int forced = g_tiles.load(std::memory_order_relaxed);
  if (forced >= 0) return Tiles(forced);
  return path == Path::avx512_vnni && n >= kAmxRows && linear::amx_int8_usable() ? Tiles::amx : Tiles::vectors;
}

void set_tiles(Tiles tiles) { g_tiles.store(int(tiles), std::memory_order_relaxed); }
void reset_tiles() { g_tiles.store(-1, std::memory_order_relaxed); }

}  // namespace detail

namespace {

// Y[t, i] for t in [t0, t1), i in [i0, i1) on path's tier: the int8 form f for quantized weights (on `tiles`), x
// (and xb, the bf16 form where BF16 weights take it) for float ones.
void rows_on(Path path, detail::Tiles tiles, const Matrix& w, const detail::Int8Form* f, const float* x,
             const uint16_t* xb, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  with_type(w.type, [&]<TensorType T>() {
    if constexpr (is_float_type(T)) {
      CASCADE_LINEAR_ON_TIER(path, rows_float<T>(w, x, xb, i0, i1, t0, t1, y));
    } else {
      CASCADE_LINEAR_ON_TIER(path, rows_int8<T>(w, *f, i0, i1, t0, t1, y, tiles));
    }
  });
}

}  // namespace

// --- Matrix --------------------------------------------------------------------------------------------

Matrix Matrix::view(TensorType type, const void* data, int64_t n_in, int64_t n_out) {
  CASCADE_CHECK(gguf::can_dequantize(type), "linear: tensor type ", gguf::type_name(type), " (",
                static_cast<uint32_t>(type), ") is not supported");
  CASCADE_CHECK(n_in > 0 && n_out > 0, "linear: a matrix of ", n_out, " x ", n_in, " values");
  CASCADE_CHECK(n_in % gguf::block_size(type) == 0, "linear: rows of ", n_in, " values of type ",
                gguf::type_name(type), " are not a whole number of blocks of ", gguf::block_size(type));
  CASCADE_CHECK(data != nullptr, "linear: null weights");
  Matrix m;
  m.type = type;
  m.n_in = n_in;
  m.n_out = n_out;
  m.row_bytes = gguf::row_bytes(type, n_in);
  m.data = static_cast<const uint8_t*>(data);
  return m;
}

void Matrix::row(int64_t i, float* out) const {
  CASCADE_CHECK(i >= 0 && i < n_out, "linear: row ", i, " of a matrix of ", n_out, " rows");
  thread_local std::vector<uint8_t> scratch;
  if (layout != Layout::rows) scratch.resize(size_t(row_bytes));
  gguf::dequantize_row(type, row_blocks(i, scratch.data()), out, n_in);
}

// --- paths ---------------------------------------------------------------------------------------------

const char* path_name(Path p) {
  switch (p) {
    case Path::portable: return "portable";
    case Path::avx2: return "avx2";
    case Path::avx_vnni: return "avx-vnni";
    case Path::avx512_vnni: return "avx512-vnni";
  }
  return "?";
}

bool can_run(Path p) {
  const CpuFeatures& f = cpu_features();
  const Isa isa = active_isa();
  switch (p) {
    case Path::portable: return true;
    case Path::avx2: return CASCADE_X86 && isa >= Isa::avx2;
    case Path::avx_vnni: return CASCADE_X86 && isa >= Isa::avx2 && f.avx_vnni;
    case Path::avx512_vnni: return CASCADE_X86 && isa >= Isa::avx512 && f.avx512_vnni;
  }
  return false;
}

Path active_path() {
  for (Path p : {Path::avx512_vnni, Path::avx_vnni, Path::avx2})
    if (can_run(p)) return p;
  return Path::portable;
}

std::string products_name(Path path) {
  std::string name = path_name(path);
  if (path == Path::avx512_vnni && amx_int8_usable()) name += "+amx-int8";
  return name;
}

bool amx_int8_usable() {
  static const bool usable = [] {
#if CASCADE_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    return (d & (1u << 25)) != 0 && amx_usable();  // AMX-INT8, and the tiles granted
#else
    return false;
#endif
  }();
  return usable;
}


// --- activations ---------------------------------------------------------------------------------------

namespace detail {

// d = amax / 127 and q = round-to-nearest-even(x * (127 / amax)): two correctly rounded f32 operations, so
// every path that follows them gets the same codes. |x * (127 / amax)| <= 127 (1 + 2^-23) rounds to at most 127.
// A block whose amax is below 2^-100 is first scaled by 2^100 (exact: no value overflows or loses a bit), since
// 127 / amax overflows to infinity for amax < 127 / FLT_MAX (about 3.7e-37): every nonzero code would be +-127
// and a zero would be 0 * inf = NaN. After scaling, amax >= 2^-149 * 2^100 and 127 / amax <= 2^56.
// Non-finite inputs give unspecified (but in-range) codes.
void quantize_row(const float* x, int64_t n_in, int8_t* q, float* d, float* s16, float* s32) {
  for (int64_t b = 0; b < n_in / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.0f;
    const float pre = amax < kTinyBlock ? kTinyScale : 1.0f;
    const float id = amax > 0 ? 127.0f / (amax * pre) : 0.0f;
    int sum[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      float v = (xb[j] * pre) * id;
      v = v >= 127.0f ? 127.0f : v <= -127.0f ? -127.0f : v;
      if (!(v == v)) v = 0;  // NaN
      const int c = static_cast<int>(std::nearbyint(v));
      q[32 * b + j] = static_cast<int8_t>(c);
      sum[j / 16] += c;
    }
    d[b] = db;
    s16[2 * b] = db * static_cast<float>(sum[0]);
    s16[2 * b + 1] = db * static_cast<float>(sum[1]);
    s32[b] = db * static_cast<float>(sum[0] + sum[1]);
  }
}

}  // namespace detail

Input::Input(const float* x, int64_t n, int64_t n_in) : x_(x), n_(n), n_in_(n_in) {
  CASCADE_CHECK(n >= 0 && n_in > 0, "linear: input of ", n, " x ", n_in, " values");
  CASCADE_CHECK(x != nullptr || n == 0, "linear: null input");
}

Input::~Input() = default;

detail::Forms& Input::forms() const {
  if (!forms_) forms_ = std::make_unique<detail::Forms>();
  return *forms_;
}

Input::Int8 Input::int8_natural() const {
  CASCADE_CHECK(n_in_ % 32 == 0, "linear: int8 activations need rows of a multiple of 32 values, not ", n_in_);
  Int8 f;
  f.q.resize(size_t(n_ * n_in_));
  f.d.resize(size_t(n_ * n_in_ / 32));
  f.s16.resize(size_t(n_ * n_in_ / 16));
  f.s32.resize(size_t(n_ * n_in_ / 32));
  for (int64_t r = 0; r < n_; ++r)
    detail::quantize_row(x_ + r * n_in_, n_in_, f.q.data() + r * n_in_, f.d.data() + r * n_in_ / 32,
                         f.s16.data() + r * n_in_ / 16, f.s32.data() + r * n_in_ / 32);
  return f;
}

std::vector<uint16_t> Input::bf16() const {
  std::vector<uint16_t> v(size_t(n_ * n_in_));
  for (size_t i = 0; i < v.size(); ++i) v[i] = gguf::fp32_to_bf16(x_[i]);
  return v;
}

// --- products ------------------------------------------------------------------------------------------

namespace {

// The same numbers on every path (Input::int8_natural), so made once whatever path asks.
const detail::Int8Form& int8_form(Path path, const Input& x) {
  detail::Int8Form& f = x.forms().int8;
  if (!f.made) detail::quantize(path, x.data(), x.n(), x.n_in(), f);
  return f;
}

const uint16_t* bf16_form(const Input& x) {
  detail::Forms& f = x.forms();
  if (!f.has_bf16) {
    f.bf16.resize(size_t(x.n() * x.n_in()));
    for (size_t i = 0; i < f.bf16.size(); ++i) f.bf16[i] = gguf::fp32_to_bf16(x.data()[i]);
    f.has_bf16 = true;
  }
  return f.bf16.data();
}

}  // namespace

void matmul(const Matrix& w, const Input& x, float* y, Path path) { matmul_group({{&w, y}}, x, path); }

void matmul(const Matrix& w, const Input& x, float* y) { matmul(w, x, y, active_path()); }

void matmul_group(std::initializer_list<Product> products, const Input& x) {
  matmul_group(products, x, active_path());
}

void matmul_group(std::initializer_list<Product> products, const Input& x, Path path) {
  CASCADE_CHECK(can_run(path), "linear: this CPU cannot run the ", path_name(path), " path");
  const Product* ps = products.begin();
  const int64_t n_products = int64_t(products.size());
  bool any_int8 = false, any_bf16 = false;
  for (const Product& p : products) {
    CASCADE_CHECK(x.n_in() == p.w->n_in, "linear: input rows of ", x.n_in(), " values for a matrix of ",
                  p.w->n_in, " columns");
    any_int8 |= !is_float_type(p.w->type);
    any_bf16 |= p.w->type == TensorType::BF16;
  }
  if (x.n() == 0 || n_products == 0) return;
  const detail::Int8Form* f = any_int8 ? &int8_form(path, x) : nullptr;
  const uint16_t* xb = any_bf16 && detail::bf16_dot(path) ? bf16_form(x) : nullptr;
  const detail::Tiles tiles = detail::tiles_for(path, x.n());
  // Blocks of 16 rows of all the products in one index space: product j's are [first[j], first[j + 1]).
  const int64_t pr = detail::kBlockRows;
  std::vector<int64_t> first(size_t(n_products + 1), 0);
  for (int64_t j = 0; j < n_products; ++j)
    first[size_t(j + 1)] = first[size_t(j)] + (ps[j].w->n_out + pr - 1) / pr;
  // Rows of X in blocks whose codes (or values) stay in the cache while every block of W passes over them: 256 KiB
  // of them, or 4 MiB where a product goes to AMX tiles, whose driver unpacks each block of W into B tiles once per
  // block of X and reads X's codes packed by group, contiguous, ahead of the prefetchers (1,231 rows of a
  // llama3.2-1b prefill, 2 cores of a Xeon with AMX: 1 MiB blocks 6.1 s, 4 MiB 5.6 s, 16 MiB 5.6 s; study §28).
  const int64_t x_bytes = int64_t(any_int8 && tiles != detail::Tiles::vectors ? 4096 : 256) << 10;
  const int64_t n = x.n(), block = std::max<int64_t>(16, x_bytes / x.n_in() / 16 * 16);
  for (int64_t t0 = 0; t0 < n; t0 += block) {
    const int64_t t1 = std::min(n, t0 + block);
    // One contiguous share of the blocks per thread (static_partitioner): each thread streams one run of W, and a
    // call forks and joins once. The auto partitioner's splitting and stealing cost more a call and started more
    // runs cold (docs/study.md, section 14).
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, first.back()), [&](const tbb::blocked_range<int64_t>& r) {
      // the range may span products: one kernel call per product it covers
      int64_t j = int64_t(std::upper_bound(first.begin(), first.end(), r.begin()) - first.begin()) - 1;
      for (int64_t p0 = r.begin(); p0 < r.end(); ++j) {
        const int64_t p1 = std::min(r.end(), first[size_t(j + 1)]);
        const Matrix& w = *ps[j].w;
        const int64_t i0 = (p0 - first[size_t(j)]) * pr, i1 = std::min(w.n_out, (p1 - first[size_t(j)]) * pr);
        if (i1 <= i0) continue;  // a matrix of no rows
        rows_on(path, tiles, w, f, x.data(), w.type == TensorType::BF16 ? xb : nullptr, i0, i1, t0, t1, ps[j].y);
        p0 = p1;
      }
    }, tbb::static_partitioner());
  }
}

void matmul(const Matrix& w, const float* x, int64_t n, float* y) {
  const Input in(x, n, w.n_in);
  matmul(w, in, y);
}

void matmul_f32(const Matrix& w, const float* x, int64_t n, float* y) {
  if (n == 0) return;
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Map = Eigen::Map<const RowMat>;
  using OutMap = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
  const Map xm(x, n, w.n_in);
  // Tiles of 64 rows of W (at most 64 x n_in floats, L2-sized), dequantized and multiplied with Eigen.
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, w.n_out, 64), [&](const tbb::blocked_range<int64_t>& r) {
    thread_local std::vector<float> tile;
    const int64_t m = r.end() - r.begin();
    tile.resize(size_t(m * w.n_in));
    for (int64_t i = 0; i < m; ++i) w.row(r.begin() + i, tile.data() + i * w.n_in);
    const Map wm(tile.data(), m, w.n_in);
    OutMap ym(y + r.begin(), n, m, Eigen::OuterStride<>(w.n_out));
    ym.noalias() = xm * wm.transpose();
  });
}

// --- the reference and its bound ----------------------------------------------------------------------
//
// Let u = 2^-24 (f32 rounding) and gamma(m) = m u / (1 - m u). Every path computes each output as a sum of terms,
// each term a product of exact values rounded at most twice before it is added:
//   int8:  scale[g] d[b] I   (I the group's int32 sum of code * q, plus c times its sum of q where linear.hpp's
//                             order folds the offset into it: the signed codes' sum; exact in f32 since |I| <
//                             32 * 255 * 127 < 2^24; scale[g] d[b] rounded once, the product once inside the FMA)
//          offset[g] s[g]    (not folded: s[g] = d[b] * sum q rounded once, the product once inside the FMA)
//   float: w[k] x[k]         (exact inputs; the product rounded at most once inside the FMA)
// and the terms are added in one order (linear.hpp; lanes, then the lanes together, for the float types) with at
// most m additions on any path from a term to the result. While no result falls below 2^-126 (f32's smallest
// normal), every rounding is fl(v) = v (1 + delta), |delta| <= u, and the classic bound for such a sum of
// perturbed terms t_j (Higham, Accuracy and Stability of Numerical Algorithms, 3.1 and 4.2) is
//   |fast - exact| <= gamma(m + 2) * sum |t_j|,
// with m <= 2 * (n_in / 16) + 16 for the int8 paths (at most two terms per group of 16) and m <= n_in + 16 for the
// float paths. A folded term is at most |scale d| sum |code * q| + |offset s| over its group.
//
// Underflow. Below 2^-126 f32 has subnormals spaced 2^-149 apart, and a product or an FMA whose exact result
// lies there is rounded with an absolute error of up to eta = 2^-150 instead of a relative one:
// fl(a b) = a b (1 + delta) + eta, delta eta = 0 (the standard model with gradual underflow; a sum or difference
// that lands there is exact, so only products and FMAs add an eta). The relative bound alone is then wrong: f32
// weights of about 2.3e-41 times activations of 0.625 and 0.375 give products of 10242.5 and 6148.5 times 2^-149,
// each rounded by half a step, and an output of 67581 * 2^-149 comes out as 67580 * 2^-149 (off by 1.4e-45)
// where gamma(m + 2) sum |t_j| is 2.3e-46. Each eta is carried to the result by at most m further roundings,
// (1 + u)^m < 2, so every place a product can underflow adds 2 eta = 2^-149 times what multiplies its error
// afterwards:
//   float: one product or FMA per term:                                        n_in * 2^-149
//   int8:  per group, scale d (times the sum it scales: at most sum |code * q| + |c| sum |q|), s (times
//          |offset|), and the FMAs that add the group (at most two, fewer than G):
//                                          (sum over groups of sum |code * q| + |c| sum |q| + |offset| + G) * 2^-149
// vdpbf16ps (BF16 weights on the avx512-vnni path with AVX512_BF16) has no subnormals at all: it reads subnormal
// inputs as zero (losing |w x| < 2^-126 |x| for a subnormal w, < 2^-126 |w| for a subnormal x) and flushes each
// FMA result below 2^-126 to zero (losing < 2^-126, one FMA per term), so instead of the above it adds
//   2 * 2^-126 * sum over k of (1 + |w[k]| + |x[k]|).
namespace {

constexpr double kU = 0x1p-24, kEta2 = 0x1p-149;  // u and 2 eta above
double gamma(double m) { return m * kU / (1 - m * kU); }

// reference() for F32, F16 and BF16 weights; y and bound sized (x.n(), w.n_out), zero.
void reference_float(const Matrix& w, const Input& x, Path path, std::vector<double>& y, std::vector<double>& bound) {
  const int64_t n = x.n(), K = w.n_in;
  std::vector<float> wr(static_cast<size_t>(K));
  const bool bf16 = w.type == TensorType::BF16 && detail::bf16_dot(path);
  std::vector<double> xq(size_t(n * K));
  for (size_t i = 0; i < xq.size(); ++i)
    xq[i] = bf16 ? double(gguf::bf16_to_fp32(gguf::fp32_to_bf16(x.data()[i]))) : double(x.data()[i]);
  const double g = gamma(double(K + 16) + 2);
  for (int64_t i = 0; i < w.n_out; ++i) {
    w.row(i, wr.data());
    for (int64_t r = 0; r < n; ++r) {
      double s = 0, a = 0, flushed = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = double(wr[k]) * xq[r * K + k];
        s += t;
        a += std::fabs(t);
        flushed += 1 + std::fabs(double(wr[k])) + std::fabs(xq[r * K + k]);
      }
      y[r * w.n_out + i] = s;
      bound[r * w.n_out + i] = g * a + (bf16 ? 2 * flushed * 0x1p-126 : double(K) * kEta2);
    }
  }
}

// reference() for quantized weights, on the activations' int8 codes; y and bound as reference_float's.
void reference_int8(const Matrix& w, const Input& x, std::vector<double>& y, std::vector<double>& bound) {
  const int64_t n = x.n(), K = w.n_in;
  std::vector<float> wr(static_cast<size_t>(K));
  const Input::Int8 f = x.int8_natural();
  const int64_t G = gguf::code_group_size(w.type), n_groups = K / G;
  const double fold = std::fabs(double(detail::offset_codes(w.type)));
  std::vector<uint8_t> code(static_cast<size_t>(K));
  std::vector<float> sc(static_cast<size_t>(n_groups)), off(static_cast<size_t>(n_groups));
  const double g = gamma(double(2 * (K / 16) + 16) + 2);
  std::vector<uint8_t> blocks(static_cast<size_t>(w.row_bytes));
  for (int64_t i = 0; i < w.n_out; ++i) {
    w.row(i, wr.data());
    gguf::decode_codes(w.type, w.row_blocks(i, blocks.data()), K, code.data(), sc.data(), off.data());
    for (int64_t r = 0; r < n; ++r) {
      const int8_t* q = f.q.data() + r * K;
      const float* d = f.d.data() + r * K / 32;
      const float* s = (G == 16 ? f.s16.data() + r * K / 16 : f.s32.data() + r * K / 32);
      double sum = 0, mag = 0, under = 0;
      for (int64_t k = 0; k < K; ++k) sum += double(wr[k]) * double(d[k / 32]) * double(q[k]);
      for (int64_t gi = 0; gi < n_groups; ++gi) {
        double cq = 0, qa = 0;
        for (int64_t k = gi * G; k < (gi + 1) * G; ++k) {
          cq += std::fabs(double(code[k]) * double(q[k]));
          qa += std::fabs(double(q[k]));
        }
        mag += std::fabs(double(sc[gi]) * double(d[gi * G / 32])) * cq + std::fabs(double(off[gi]) * double(s[gi]));
        under += cq + fold * qa + std::fabs(double(off[gi])) + double(G);
      }
      y[r * w.n_out + i] = sum;
      // The dequantized weights wr are f32 roundings of scale * code + offset (quant.hpp): within u |w| of it
      // (never below 2^-126: scale and offset are multiples of 2^-24).
      double wx = 0;
      for (int64_t k = 0; k < K; ++k) wx += std::fabs(double(wr[k]) * double(d[k / 32]) * double(q[k]));
      bound[r * w.n_out + i] = g * mag + kU * wx + under * kEta2;
    }
  }
}

}  // namespace

void reference(const Matrix& w, const Input& x, Path path, std::vector<double>& y, std::vector<double>& bound) {
  CASCADE_CHECK(x.n_in() == w.n_in, "linear reference: input rows of ", x.n_in(), " values for ", w.n_in,
                " columns");
  y.assign(size_t(x.n() * w.n_out), 0.0);
  bound.assign(y.size(), 0.0);
  if (is_float_type(w.type)) reference_float(w, x, path, y, bound);
  else reference_int8(w, x, y, bound);
}

}  // namespace cascade::linear
