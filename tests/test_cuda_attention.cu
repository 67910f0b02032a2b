// The CUDA path (cascade/cuda) against the double-precision reference on fresh random problems: cascade,
// split and unified through cuda::Workspace, f16, bf16 and q8_0 K/V, paged and contiguous storage (aligned rows:
// the 16-byte copy path; padded rows: the element copy path), trees, several query tokens, every head dim
// with a kernel, the edge cases, extreme scores, the device merge kernels, graph capture, and bad input.
// Without a CUDA device every case that needs one prints "no CUDA device: skipped" (ctest: skipped).
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <numeric>

#include "attention_problem.hpp"
#include "cascade/cuda/attention.cuh"
#include "cascade/layouts.hpp"
#include "cascade/reference.hpp"

using namespace cascade;
using test::Rng;

namespace {

bool have_device() {
  static const bool have = cuda::device_count() > 0;
  return have;
}

#define REQUIRE_DEVICE()                    \
  do {                                      \
    if (!have_device()) {                   \
      MESSAGE("no CUDA device: skipped");   \
      return;                               \
    }                                       \
  } while (0)

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

// Device memory owned by the test.
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) CUDA_OK(cudaMalloc(&p, n));
  }
  DeviceBuffer(const void* host, size_t n) : DeviceBuffer(n) {
    if (n) CUDA_OK(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t n) {
  std::vector<T> h(n);
  if (n) CUDA_OK(cudaMemcpy(h.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Tolerances. The reference reads the same stored K/V values, so storage rounding is not part of the error.
// What remains is the tensor-core path's own rounding, with unit roundoff u = 2^-11 (f16) or 2^-8 (bf16):
//   - q is rounded to the K/V type: each score moves by about u * scale * |sum q_i k_i| (random signs: ~u/3
//     here, at most u * sqrt(head_dim) for |q|, |k| <= 1);
//   - the probabilities are rounded to the K/V type before P V: o moves by at most u * max|v| = u;
//   - o moves by at most 2 * max|v| * max |score error|, lse by at most the largest score error.
// The element bound below is 4u (f16 2e-3, bf16 1.6e-2), absolute and relative; it holds for the typical
// errors with room to spare. Because o is an average of many random values (|o| ~ 0.6 / sqrt(keys)), an
// element bound that large could hide a dropped tile, so the whole output must also satisfy
// ||o - ref|| / ||ref|| <= u (a dropped 1% of keys moves it by ~1e-2 relative, far above f16's u and at
// bf16's; the f32 CPU suites catch the finer masking mistakes on the same schedule, test_attention_cuda_
// schedule.cpp runs that schedule exactly). Both are first estimates from the error analysis: a GPU session
// runs with CASCADE_TEST_VERBOSE=1 to print the worst ratio seen and tightens them.
struct Tol {
  double atol, rtol, rel_l2;
};
// q8_0: the tiles hold code x scale rounded to f16, one more rounding by u = 2^-11 of every K and V element beside
// f16's terms (the reference reads code x scale exactly): 1.5x f16's bounds.
Tol tolerance(DType dt) {
  if (dt == DType::bf16) return {1.6e-2, 1.6e-2, 4e-3};
  if (dt == DType::q8_0) return {3e-3, 3e-3, 7.5e-4};
  return {2e-3, 2e-3, 5e-4};
}

void expect_rel_l2(const std::vector<float>& out, const std::vector<double>& ref, double bound, const char* what) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isinf(ref[i])) continue;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return;
  const double rel = std::sqrt(num / den);
  CHECK_MESSAGE(rel <= bound, what << ": ||out - ref|| / ||ref|| = " << rel << " > " << bound);
  if (std::getenv("CASCADE_TEST_VERBOSE")) MESSAGE(what << ": relative L2 error " << rel);
}

// A device copy of the host storage behind view: its elements (q8_0: codes) and q8_0 scales, same offsets.
template <class Bytes, class Scales>
KvView to_device(KvView view, const Bytes& k, const Bytes& v, const Scales& k_scales, const Scales& v_scales,
                 std::vector<std::unique_ptr<DeviceBuffer>>& keep) {
  const auto put = [&](const auto& host) {
    keep.push_back(std::make_unique<DeviceBuffer>(host.data(), host.size() * sizeof(host[0])));
    return keep.back()->p;
  };
  view.k = put(k);
  view.v = put(v);
  if (view.dtype == DType::q8_0) {
    view.k_scales = put(k_scales);
    view.v_scales = put(v_scales);
  }
  return view;
}

// One segment: random K/V in host storage (for the reference) and the same bytes on the device.
struct Segment {
  std::unique_ptr<test::Segment> h;  // host bytes and view (block table in host memory)
  KvView host, dev;
  std::vector<std::unique_ptr<DeviceBuffer>> device;  // dev's K/V (codes or elements) and q8_0 scales
};

// aligned: every row starts on 16 bytes (the vector copy path); otherwise strides get odd padding.
std::unique_ptr<Segment> make_segment(Rng& rng, DType dt, int64_t n_tokens, int n_kv_heads, int head_dim, bool paged,
                                      bool aligned, float amp = 1.0f) {
  auto seg = std::make_unique<Segment>();
  seg->h = test::make_segment(rng, dt, n_tokens, n_kv_heads, head_dim, paged, amp,
                              aligned ? test::Rows::aligned : test::Rows::misaligned);
  seg->host = seg->h->view;
  // Same strides and (host) block table; device K/V.
  seg->dev = to_device(seg->host, seg->h->k, seg->h->v, seg->h->k_scales, seg->h->v_scales, seg->device);
  return seg;
}

struct Config {
  HeadShape shape;
  DType dtype = DType::f16;
  bool paged = false, aligned = true;
  test::Tree tree;
  std::vector<int64_t> seg_len, n_query;
  float amp = 1.0f;
  int64_t window = 0;  // sliding window (0: none)
  std::string describe() const {
    std::ostringstream os;
    os << "heads " << shape.n_q_heads << "/" << shape.n_kv_heads << "/" << shape.head_dim << " " << dtype_name(dtype)
       << (paged ? " paged" : " contiguous") << (aligned ? " aligned" : " padded") << ", " << tree.paths.size()
       << " sequences, segments [";
    for (size_t g = 0; g < seg_len.size(); ++g) os << (g ? "," : "") << seg_len[g];
    os << "], queries [";
    for (size_t s = 0; s < n_query.size(); ++s) os << (s ? "," : "") << n_query[s];
    os << "], window " << window;
    return os.str();
  }
};

// Binds views, runs ws on q and returns (o, lse) on the host; outputs are poisoned first so unwritten
// elements show.
void run(cuda::Workspace& ws, const std::vector<KvView>& views, const DeviceBuffer& q, int64_t n_out, int64_t d,
         std::vector<float>& o, std::vector<float>& lse) {
  DeviceBuffer od(static_cast<size_t>(n_out * d) * 4), ld(static_cast<size_t>(n_out) * 4);
  CUDA_OK(cudaMemset(od.p, 0x7f, od.bytes));  // 0x7f7f7f7f: a huge finite value
  CUDA_OK(cudaMemset(ld.p, 0x7f, ld.bytes));
  ws.run(nullptr, views, q.as<float>(), od.as<float>(), ld.as<float>());
  CUDA_OK(cudaDeviceSynchronize());
  o = download<float>(od, static_cast<size_t>(n_out * d));
  lse = download<float>(ld, static_cast<size_t>(n_out));
}

void check(Rng& rng, const Config& cfg, bool exact_compare = true) {
  INFO(cfg.describe());
  const HeadShape& shape = cfg.shape;
  std::vector<std::unique_ptr<Segment>> store;
  std::vector<KvView> host_views, dev_views;
  for (int64_t len : cfg.seg_len) {
    store.push_back(make_segment(rng, cfg.dtype, len, shape.n_kv_heads, shape.head_dim, cfg.paged, cfg.aligned,
                                 cfg.amp));
    host_views.push_back(store.back()->host);
    dev_views.push_back(store.back()->dev);
  }
  const Tree tree = Tree::build(shape, cfg.seg_len, cfg.tree.paths, cfg.n_query, 0.0f, cfg.window);
  const int64_t d = shape.head_dim, n_out = tree.n_rows() * shape.n_q_heads;
  std::vector<float> q(static_cast<size_t>(n_out * d));
  for (float& x : q) x = rng.uniform(-cfg.amp, cfg.amp);
  const DeviceBuffer qd(q.data(), q.size() * 4);
  std::vector<double> ref_o(q.size()), ref_lse(static_cast<size_t>(n_out));
  reference_attention(tree, host_views, q.data(), ref_o.data(), ref_lse.data());
  const Tol tol = tolerance(cfg.dtype);
  std::vector<float> o, lse;

  const auto compare = [&](const char* what) {
    if (exact_compare) {
      test::expect_close(o, ref_o, tol.atol, tol.rtol, std::string(what) + " o");
      test::expect_close(lse, ref_lse, tol.atol, tol.rtol, std::string(what) + " lse");
      expect_rel_l2(o, ref_o, tol.rel_l2, what);
    } else {
      // Extreme scores: rounding q to 16 bits moves scores by ~u |s|, which can change the winning key.
      // What must hold: finite outputs within the values' range, lse to the scores' relative precision.
      for (size_t i = 0; i < o.size(); ++i) REQUIRE((std::isfinite(o[i]) && std::abs(o[i]) <= 1.0f + 1e-2f));
      test::expect_close(lse, ref_lse, 1e-2, 2e-2, std::string(what) + " lse");
    }
  };

  {
    cuda::Workspace ws(cuda::plan_for_device(tree));
    run(ws, dev_views, qd, n_out, d, o, lse);
    compare("cascade");
  }
  {
    SplitLayout split = make_split(tree, host_views);
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<KvView> views;
    for (int s = 0; s < split.tree.n_sequences(); ++s) {
      const auto& dense = split.kv[static_cast<size_t>(s)];
      views.push_back(to_device(split.views[static_cast<size_t>(s)], dense.k, dense.v, dense.k_scales,
                                dense.v_scales, bufs));
    }
    cuda::Workspace ws(cuda::plan_for_device(split.tree));
    run(ws, views, qd, n_out, d, o, lse);
    compare("split");
  }
  {
    const UnifiedLayout uni = make_unified(tree, host_views);
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    cpu::UnifiedBatch b = uni.batch;
    b.kv = to_device(b.kv, uni.kv.k, uni.kv.v, uni.kv.k_scales, uni.kv.v_scales, bufs);
    cuda::Workspace ws = cuda::Workspace::unified(shape, b, tree.scale());
    DeviceBuffer od(static_cast<size_t>(n_out * d) * 4), ld(static_cast<size_t>(n_out) * 4);
    CUDA_OK(cudaMemset(od.p, 0x7f, od.bytes));
    CUDA_OK(cudaMemset(ld.p, 0x7f, ld.bytes));
    ws.attend(nullptr, qd.as<float>(), od.as<float>(), ld.as<float>());  // the buffer is bound already
    CUDA_OK(cudaDeviceSynchronize());
    o = download<float>(od, static_cast<size_t>(n_out * d));
    lse = download<float>(ld, static_cast<size_t>(n_out));
    compare("unified");
  }
}

HeadShape random_shape(Rng& rng) {
  HeadShape s;
  s.head_dim = rng.pick<int>({64, 80, 96, 128, 256});
  if (rng.coin(0.15)) {
    s.n_kv_heads = 1;
    s.n_q_heads = int(rng.uniform_int(1, 8));
  } else {
    s.n_kv_heads = int(rng.uniform_int(1, 3));
    s.n_q_heads = s.n_kv_heads * rng.pick<int>({1, 2, 3, 4, 8});
  }
  return s;
}

Config random_config(Rng& rng, double budget) {
  Config c;
  c.shape = random_shape(rng);
  c.dtype = c.shape.head_dim % kQ8Block == 0 ? rng.pick<DType>({DType::f16, DType::bf16, DType::q8_0})
                                              : rng.pick<DType>({DType::f16, DType::bf16});
  c.paged = rng.coin();
  c.aligned = rng.coin(0.7);
  c.tree = test::random_tree(rng, int(rng.uniform_int(1, 4)), int(rng.uniform_int(1, 64)));
  c.seg_len.resize(c.tree.parent.size());
  for (size_t g = 0; g < c.seg_len.size(); ++g)
    c.seg_len[g] = rng.coin(0.1) ? 0 : rng.uniform_int(0, c.tree.parent[g] < 0 ? 5000 : 2000);
  const bool multi = rng.coin(0.3);
  c.n_query.resize(c.tree.paths.size());
  for (auto& n : c.n_query) n = multi ? rng.uniform_int(1, 5) : 1;
  test::shrink_to_budget(c.seg_len, c.tree.paths, c.n_query, c.shape, budget);
  return c;
}

Config two_level(const HeadShape& shape, DType dt, int64_t prefix, const std::vector<int64_t>& suffixes,
                 int64_t n_query) {
  Config c;
  c.shape = shape;
  c.dtype = dt;
  c.tree.parent.push_back(-1);
  c.seg_len.push_back(prefix);
  for (size_t s = 0; s < suffixes.size(); ++s) {
    c.tree.parent.push_back(0);
    c.tree.paths.push_back({0, int(s) + 1});
    c.seg_len.push_back(suffixes[s]);
  }
  c.n_query.assign(suffixes.size(), n_query);
  return c;
}

}  // namespace

TEST_CASE("cuda: cascade, split and unified == reference on random problems") {
  REQUIRE_DEVICE();
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < 40; ++it) {
    CAPTURE(it);
    check(rng, random_config(rng, 2e7));
  }
}

TEST_CASE("cuda: sliding windows at their edges: shared segments skipped, partly inside masked") {
  REQUIRE_DEVICE();
  const uint64_t seed = test::fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  Rng rng(seed);
  for (int it = 0; it < 20; ++it) {
    CAPTURE(it);
    Config c = random_config(rng, 1e7);
    int64_t longest = 0;
    for (const auto& path : c.tree.paths) {
      int64_t n = 0;
      for (int g : path) n += c.seg_len[size_t(g)];
      longest = std::max(longest, n);
    }
    const std::vector<int64_t> edges = {1, 2, c.seg_len[0], c.seg_len[0] + 1, longest, longest + 3,
                                        rng.uniform_int(1, std::max<int64_t>(1, longest))};
    c.window = std::max<int64_t>(1, rng.pick(edges));
    check(rng, c);
  }
  check(rng, [] {
    Config c = two_level(HeadShape{8, 2, 64}, DType::f16, 300, {40, 55, 70}, 3);
    c.window = 20;  // the prefix lies behind every window
    return c;
  }());
}

TEST_CASE("cuda: every head dim, every dtype, both storages, GQA ratios 1 to 8") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  for (int d : {64, 80, 96, 128, 256})
    for (DType dt : {DType::f16, DType::bf16, DType::q8_0})
      for (int ratio : {1, 4, 8}) {
        if (dt == DType::q8_0 && d % kQ8Block != 0) continue;  // q8_0 blocks of 32 along the head dim
        Config c = two_level(HeadShape{2 * ratio, 2, d}, dt, 700, {130, 1, 64}, ratio == 4 ? 3 : 1);
        c.paged = ratio != 4;
        c.aligned = ratio != 8;
        check(rng, c);
      }
}

TEST_CASE("cuda: a long prefix split across blocks, many sequences, several query tokens") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  std::vector<int64_t> suffixes(48);
  for (auto& s : suffixes) s = rng.uniform_int(0, 300);
  Config c = two_level(HeadShape{32, 8, 128}, DType::bf16, 6000, suffixes, 1);
  check(rng, c);
  c = two_level(HeadShape{8, 2, 64}, DType::f16, 4000, {100, 3, 0, 50}, 4);
  c.paged = true;
  check(rng, c);
}

TEST_CASE("cuda: edges (empty prefix, empty suffixes, no keys, one key, empty segments in a deep tree)") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  const HeadShape shape{8, 2, 64};
  SUBCASE("empty prefix") { check(rng, two_level(shape, DType::f16, 0, {5, 17, 300}, 1)); }
  SUBCASE("empty suffixes") { check(rng, two_level(shape, DType::bf16, 700, {0, 0, 0, 0}, 1)); }
  SUBCASE("empty suffixes, several queries: rows before the first key see nothing") {
    check(rng, two_level(shape, DType::f16, 2, {0, 0, 0}, 4));
  }
  SUBCASE("batch 1") { check(rng, two_level(shape, DType::bf16, 333, {44}, 1)); }
  SUBCASE("one key in all") { check(rng, two_level(shape, DType::f16, 1, {0}, 1)); }
  SUBCASE("no keys at all: every row is fully masked") { check(rng, two_level(shape, DType::f16, 0, {0, 0}, 2)); }
  SUBCASE("empty segments in a depth-4 tree") {
    Config c;
    c.shape = shape;
    c.dtype = DType::bf16;
    c.tree = test::random_tree(rng, 4, 20);
    c.seg_len.resize(c.tree.parent.size());
    for (size_t g = 0; g < c.seg_len.size(); ++g) c.seg_len[g] = g % 2 ? 0 : rng.uniform_int(1, 200);
    c.n_query.assign(c.tree.paths.size(), 2);
    check(rng, c);
  }
}

TEST_CASE("cuda: extreme scores stay finite") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  Config c = two_level(HeadShape{8, 2, 128}, DType::f16, 500, {20, 30}, 2);
  c.amp = 30.0f;  // |q|, |k| <= 30: scores up to 900 * 128 / sqrt(128) ~ 1e4, typically a few hundred
  check(rng, c, false);
  c.dtype = DType::bf16;
  check(rng, c, false);
}

TEST_CASE("cuda: attend is stream-ordered and replays from a captured graph") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  const HeadShape shape{16, 4, 128};
  std::vector<std::unique_ptr<Segment>> store;
  std::vector<KvView> views;
  for (int64_t len : {3000, 40, 70, 0}) {
    store.push_back(make_segment(rng, DType::bf16, len, shape.n_kv_heads, shape.head_dim, true, true));
    views.push_back(store.back()->dev);
  }
  const Plan plan = cuda::plan_for_device(Tree::build(shape, {3000, 40, 70, 0}, {{0, 1}, {0, 2}, {0, 3}}, {1, 1, 1}));
  cuda::Workspace ws(plan);
  const int64_t n = plan.n_rows() * shape.n_q_heads * shape.head_dim;
  std::vector<float> q(static_cast<size_t>(n));
  for (float& x : q) x = rng.uniform(-1, 1);
  const DeviceBuffer qd(q.data(), q.size() * 4), o1(static_cast<size_t>(n) * 4), o2(static_cast<size_t>(n) * 4);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ws.bind(stream, views);  // outside the capture: it copies from the host
  ws.attend(stream, qd.as<float>(), o1.as<float>());
  CUDA_OK(cudaMemsetAsync(o2.p, 0, o2.bytes, stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  ws.attend(stream, qd.as<float>(), o2.as<float>());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto a = download<float>(o1, static_cast<size_t>(n)), b = download<float>(o2, static_cast<size_t>(n));
  CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);  // same work, same order: bit-identical
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda: device merges == host merges, for any rows and head dims, empty states included") {
  REQUIRE_DEVICE();
  Rng rng(test::fresh_seed());
  for (int64_t d : {1, 33, 64, 300}) {
    for (int64_t rows : {1, 77, 5000}) {
      CAPTURE(d);
      CAPTURE(rows);
      const int64_t n = 3;
      std::vector<float> o(static_cast<size_t>(n * rows * d)), lse(static_cast<size_t>(n * rows));
      for (float& x : o) x = rng.uniform(-1, 1);
      for (float& x : lse) x = rng.coin(0.2) ? kNegInf : rng.uniform(-30, 30);
      for (int64_t j = 0; j < n; ++j) lse[static_cast<size_t>(j * rows)] = kNegInf;  // row 0: all empty
      for (int64_t j = 0; j < n; ++j)                                     // and empty states have o = 0
        for (int64_t r = 0; r < rows; ++r)
          if (lse[static_cast<size_t>(j * rows + r)] == kNegInf)
            std::fill_n(o.begin() + (j * rows + r) * d, d, 0.0f);
      // Host: n-ary and pairwise.
      std::vector<float> ho(static_cast<size_t>(rows * d)), hl(static_cast<size_t>(rows));
      std::vector<float> pa(o.begin(), o.begin() + rows * d), pl(lse.begin(), lse.begin() + rows);
      for (int64_t r = 0; r < rows; ++r) {
        const float* parts[3] = {&o[static_cast<size_t>(r * d)], &o[static_cast<size_t>((rows + r) * d)], &o[static_cast<size_t>((2 * rows + r) * d)]};
        const float ls[3] = {lse[static_cast<size_t>(r)], lse[static_cast<size_t>(rows + r)], lse[static_cast<size_t>(2 * rows + r)]};
        merge_states(3, parts, ls, &ho[static_cast<size_t>(r * d)], &hl[static_cast<size_t>(r)], d);
      }
      merge_states_inplace(pa.data(), pl.data(), &o[static_cast<size_t>(rows * d)], &lse[static_cast<size_t>(rows)], rows, d);
      // Device.
      const DeviceBuffer od(o.data(), o.size() * 4), ld(lse.data(), lse.size() * 4);
      const DeviceBuffer out(static_cast<size_t>(rows * d) * 4), outl(static_cast<size_t>(rows) * 4);
      cuda::merge_states(nullptr, n, od.as<float>(), ld.as<float>(), out.as<float>(), outl.as<float>(), rows, d);
      cuda::merge_states_inplace(nullptr, od.as<float>(), ld.as<float>(), od.as<float>() + rows * d,
                                 ld.as<float>() + rows, rows, d);
      CUDA_OK(cudaDeviceSynchronize());
      const auto go = download<float>(out, static_cast<size_t>(rows * d)), gl = download<float>(outl, static_cast<size_t>(rows));
      const auto gpo = download<float>(od, static_cast<size_t>(rows * d)), gpl = download<float>(ld, static_cast<size_t>(rows));
      std::vector<double> ref(ho.begin(), ho.end()), refl(hl.begin(), hl.end());
      test::expect_close(go, ref, 1e-6, 1e-5, "n-ary merge o");
      test::expect_close(gl, refl, 1e-6, 1e-5, "n-ary merge lse");
      std::vector<double> ref2(pa.begin(), pa.end()), refl2(pl.begin(), pl.end());
      test::expect_close(gpo, ref2, 1e-6, 1e-5, "in-place merge o");
      test::expect_close(gpl, refl2, 1e-6, 1e-5, "in-place merge lse");
      CHECK(gl[0] == kNegInf);  // all-empty row stays empty, o = 0
      for (int64_t i = 0; i < d; ++i) CHECK(go[static_cast<size_t>(i)] == 0.0f);
    }
  }
}

// These need no device: the checks before any CUDA call, and the error a missing device gives.
TEST_CASE("cuda: bad input throws an Error naming the problem") {
  static const uint16_t dummy[64] = {};
  const auto plan_of = [](HeadShape shape) { return cuda::plan(Tree::two_level(shape, 2, {2})); };
  CHECK_THROWS_WITH_AS(cuda::Workspace(plan_of(HeadShape{4, 1, 72})), doctest::Contains("head_dim 72 has no CUDA kernel"),
                       Error);
  CHECK_THROWS_WITH_AS(cuda::Workspace(cpu::plan(Tree::two_level(HeadShape{4, 1, 64}, 2, {2}))),
                       doctest::Contains("cpu backend"), Error);
  if (!have_device()) {
    // Without a device the workspace reports the CUDA error instead of crashing.
    CHECK_THROWS_AS(cuda::Workspace(plan_of(HeadShape{4, 1, 64})), Error);
    MESSAGE("no CUDA device: checked the errors that need none");
    return;
  }
  // Host K/V: the kernels could not read it. f32 K/V: no kernel.
  cuda::Workspace host(plan_of(HeadShape{4, 1, 64}));
  const KvView hv = KvView::contiguous(reinterpret_cast<const f16*>(dummy), reinterpret_cast<const f16*>(dummy), 2, 1, 64);
  CHECK_THROWS_WITH_AS(host.bind(nullptr, std::vector<KvView>{hv, hv}), doctest::Contains("not device memory"), Error);
  Rng rng(1);
  auto seg = make_segment(rng, DType::f16, 2, 1, 64, false, true);
  KvView f32 = seg->dev;
  f32.dtype = DType::f32;
  CHECK_THROWS_WITH_AS(host.bind(nullptr, std::vector<KvView>{f32, f32}), doctest::Contains("f32 is not supported on CUDA"),
                       Error);
  CHECK_THROWS_WITH_AS(host.bind(nullptr, std::vector<KvView>{seg->dev}), doctest::Contains("K/V views"), Error);
  // Misaligned q; attend before any bind.
  cuda::Workspace ws(plan_of(HeadShape{4, 1, 64}));
  const DeviceBuffer q(4 * 64 * 4 + 16), o(4 * 64 * 4);
  CHECK_THROWS_WITH_AS(ws.attend(nullptr, q.as<float>(), o.as<float>()), doctest::Contains("bind"), Error);
  ws.bind(nullptr, std::vector<KvView>{seg->dev, seg->dev});
  CHECK_THROWS_WITH_AS(ws.attend(nullptr, q.as<float>() + 1, o.as<float>()), doctest::Contains("16-byte aligned"),
                       Error);
  CHECK_THROWS_WITH_AS(ws.attend(nullptr, nullptr, o.as<float>()), doctest::Contains("null q or o"), Error);
}
