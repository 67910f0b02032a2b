// cascade-bench-cuda: one decode step of attention on a CUDA device for B sequences sharing a P-token
// prefix, each with t tokens of its own, computed by cascade, split (prefix copied per sequence) and unified
// (one buffer + mask) through cuda::Workspace, timed side by side against the device's limits measured in
// the same run. Flags and output columns are cascade-bench's (--threads is accepted and reported as 0).
//
// Limits: copy bandwidth (a large device-to-device copy, bytes read + written over its time) and the
// tensor-core rate (cuBLAS GemmEx, 8192^3, f16/bf16 inputs as the K/V type, f16 for q8_0 K/V, whose tiles the
// kernels convert to f16; f32 accumulation). Each row
// carries the minimum bytes and FLOPs of the step (DESIGN.md: K/V of P + B*t tokens read once, q8_0 at 34 bytes
// per 32 elements,
// 4*B*n_q_heads*(P + t)*head_dim FLOPs), limit_ms (the larger of the two times they imply) and the fraction
// reached, limit_ms / median_ms. Times: CUDA events around each repetition, median over --reps after
// --warmup runs; the L2 is overwritten before every timed repetition (unless --no-flush), so K/V comes from
// memory as in a real decode step. --graph replays the step from a captured CUDA graph. After timing, each
// method's output is compared with the first method's (stderr), so a wrong kernel shows in the log.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/cuda/attention.cuh"

#include "report.hpp"

[[noreturn]] void bench::die(const std::string& msg) {
  std::fprintf(stderr, "cascade-bench-cuda: error: %s\n", msg.c_str());
  std::exit(1);
}

namespace {

using namespace bench;

using cascade::DType;
using cascade::HeadShape;


#define CHECK_CUDA(call, what) CASCADE_CUDA_CHECK(call, what)
#define CHECK_CUBLAS(call, what)                                                                  \
  do {                                                                                            \
    const cublasStatus_t st_ = (call);                                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS) cascade::detail::fail(what, ": cuBLAS status ", int(st_)); \
  } while (0)

struct CudaArgs : bench::Args {
  bool graph = false;
};


void usage() {
  std::printf(
      "usage: cascade-bench-cuda [options]\n"
      "  --batch LIST        sequences sharing the prefix (default 32)\n"
      "  --prefix LIST       shared prefix tokens (default 1230)\n"
      "  --suffix LIST       tokens of each sequence's own (default 1024)\n"
      "  --shape NAME        head-shape preset: smollm2-135m (9/3/64, default), llama3-8b (32/8/128),\n"
      "                      llama3.2-1b (32/8/64), llama2-7b (32/32/128), qwen2.5-7b (28/4/128), mistral-7b\n"
      "  --heads Q/KV/D      explicit query heads / KV heads / head dim (64, 80, 96, 128, 256)\n"
      "  --kv-dtype LIST     f16, bf16, q8_0 (default f16; q8_0: head dims 64, 96, 128, 256)\n"
      "  --method LIST       cascade, split, unified (default all three)\n"
      "  --threads LIST      accepted for cascade-bench compatibility; the device ignores it\n"
      "  --reps N            timed repetitions (default 20), --warmup N (default 3)\n"
      "  --no-flush          keep the L2 warm between repetitions\n"
      "  --graph             replay each step from a captured CUDA graph\n"
      "  -o md|csv|json      output format (default md)\n");
}

CudaArgs parse_args(int argc, char** argv) {
  CudaArgs a;
  a.methods = {"cascade", "split", "unified"};
  a.reps = 20;
  a.warmup = 3;
  parse_flags(argc, argv, a, {"cascade", "split", "unified"}, usage, [&](const std::string& f, auto&) {
    if (f != "--graph") return false;
    a.graph = true;
    return true;
  });
  // --threads is taken for cascade-bench compatibility and ignored: the device sets its own parallelism.
  if (!cascade::cuda::head_dim_supported(a.shape.head_dim))
    die("--heads: head dim " + std::to_string(a.shape.head_dim) + " has no CUDA kernel");
  for (DType dt : a.dtypes) {
    if (dt != DType::f16 && dt != DType::bf16 && dt != DType::q8_0)
      die(std::string("--kv-dtype: the CUDA kernels take f16, bf16 or q8_0 K/V, not ") + cascade::dtype_name(dt));
    if (dt == DType::q8_0 && a.shape.head_dim % cascade::kQ8Block != 0)
      die("--kv-dtype q8_0: head dim " + std::to_string(a.shape.head_dim) + " is not a multiple of 32");
  }
  return a;
}


// Device memory, freed on scope exit.
struct Buffer {
  void* p = nullptr;
  size_t bytes = 0;
  Buffer() = default;
  explicit Buffer(size_t n) : bytes(n) { CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 16)), "cudaMalloc"); }
  Buffer(Buffer&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~Buffer() {
    if (p) cudaFree(p);
  }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 30, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 27, x *= 0x94D049BB133111EBull, x ^= x >> 31;
  return float(x >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

template <class T>
__global__ void fill_kernel(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = hash_uniform(uint64_t(i), seed);
    if constexpr (std::is_same_v<T, float>) x[i] = u;
    else if constexpr (std::is_same_v<T, __half>) x[i] = __float2half_rn(u);
    else x[i] = __float2bfloat16_rn(u);
  }
}

// q8_0: codes uniform in [-127, 127], and block scales uniform in [0.5, 1.5) / 127 (elements in about [-1.5, 1.5]).
__global__ void fill_q8_kernel(int8_t* codes, __half* scales, int64_t n, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    codes[i] = int8_t(__float2int_rn(127.0f * hash_uniform(uint64_t(i), seed)));
    if (i % cascade::kQ8Block == 0)
      scales[i / cascade::kQ8Block] = __float2half_rn((1.0f + 0.5f * hash_uniform(uint64_t(i), seed + 1)) / 127.0f);
  }
}

// n random elements of type dt at p (q8_0: n codes at p, n / 32 scales at scales).
void fill(void* p, int64_t n, DType dt, uint64_t seed, void* scales = nullptr) {
  if (n == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 65535));
  if (dt == DType::f32) fill_kernel<float><<<blocks, 256>>>(static_cast<float*>(p), n, seed);
  else if (dt == DType::f16) fill_kernel<__half><<<blocks, 256>>>(static_cast<__half*>(p), n, seed);
  else if (dt == DType::bf16) fill_kernel<__nv_bfloat16><<<blocks, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  else fill_q8_kernel<<<blocks, 256>>>(static_cast<int8_t*>(p), static_cast<__half*>(scales), n, seed);
  CHECK_CUDA(cudaGetLastError(), "launching the random fill");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times f (which enqueues work on stream) with events: warm-up runs, then `reps` timed runs; `before`
// runs ahead of every timed run, outside the timed region.
template <class F, class G>
std::vector<double> time_events(cudaStream_t stream, int warmup, int reps, F&& f, G&& before) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0), "cudaEventCreate");
  CHECK_CUDA(cudaEventCreate(&e1), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    before();
    CHECK_CUDA(cudaEventRecord(e0, stream), "cudaEventRecord");
    f();
    CHECK_CUDA(cudaEventRecord(e1, stream), "cudaEventRecord");
    CHECK_CUDA(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
    ms.push_back(double(t));
  }
  CHECK_CUDA(cudaEventDestroy(e0), "cudaEventDestroy");
  CHECK_CUDA(cudaEventDestroy(e1), "cudaEventDestroy");
  return ms;
}

// Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of 10 copies of 1 GiB.
double measure_copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  Buffer a(bytes), b(bytes);
  fill(a.p, int64_t(bytes / 4), DType::f32, 1);
  const auto ms = time_events(stream, 2, 10, [&] {
    CHECK_CUDA(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, stream), "timing a device copy");
  }, [] {});
  return 2.0 * double(bytes) / (median(ms) * 1e-3);
}

// Tensor-core rate in FLOP/s: cuBLAS GemmEx, n = 8192, inputs of the K/V type, f32 accumulation, random data.
double measure_tensor_rate(cudaStream_t stream, DType dt) {
  const int n = 8192;
  Buffer a(size_t(n) * n * 2), b(size_t(n) * n * 2), c(size_t(n) * n * 4);
  fill(a.p, int64_t(n) * n, dt, 2);
  fill(b.p, int64_t(n) * n, dt, 3);
  cublasHandle_t h;
  CHECK_CUBLAS(cublasCreate(&h), "cublasCreate");
  CHECK_CUBLAS(cublasSetStream(h, stream), "cublasSetStream");
  const cudaDataType_t type = dt == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f, beta = 0.0f;
  const auto ms = time_events(stream, 3, 10, [&] {
    CHECK_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.p, type, n, b.p, type, n, &beta, c.p,
                              CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }, [] {});
  CHECK_CUBLAS(cublasDestroy(h), "cublasDestroy");
  return 2.0 * double(n) * n * n / (median(ms) * 1e-3);
}




// K or V of some tokens on the device, dense (tokens, kv heads, dim): the elements (q8_0: the codes) and, for q8_0,
// the f16 scale of every 32 codes.
struct KvBuf {
  Buffer x, scales;
  KvBuf() = default;
  KvBuf(int64_t n_tokens, int64_t row, DType dt)
      : x(size_t(n_tokens * row * cascade::dtype_size(dt))),
        scales(dt == DType::q8_0 ? size_t(n_tokens * row / cascade::kQ8Block * 2) : 0) {}
};

// A view of tokens [first, first + n) of k and v (row elements per token).
cascade::KvView view_of(const HeadShape& sh, DType dt, const KvBuf& k, const KvBuf& v, int64_t first, int64_t n) {
  const int64_t off = first * int64_t(sh.n_kv_heads) * sh.head_dim;  // in elements
  if (dt == DType::q8_0) {
    const int64_t so = off / cascade::kQ8Block;
    return cascade::KvView::contiguous_q8_0(k.x.as<const int8_t>() + off, k.scales.as<const cascade::f16>() + so,
                                            v.x.as<const int8_t>() + off, v.scales.as<const cascade::f16>() + so, n,
                                            sh.n_kv_heads, sh.head_dim);
  }
  const int64_t bytes = off * cascade::dtype_size(dt);
  cascade::KvView kv = cascade::KvView::contiguous(reinterpret_cast<const float*>(k.x.as<const char>() + bytes),
                                                   reinterpret_cast<const float*>(v.x.as<const char>() + bytes), n,
                                                   sh.n_kv_heads, sh.head_dim);
  kv.dtype = dt;
  return kv;
}

// Copies tokens [from, from + n) of src to tokens [to, to + n) of dst (row elements per token), on stream.
void copy_tokens(const KvBuf& src, int64_t from, KvBuf& dst, int64_t to, int64_t n, int64_t row, DType dt,
                 cudaStream_t stream) {
  const size_t es = size_t(cascade::dtype_size(dt));
  CHECK_CUDA(cudaMemcpyAsync(dst.x.as<char>() + size_t(to * row) * es, src.x.as<const char>() + size_t(from * row) * es,
                             size_t(n * row) * es, cudaMemcpyDeviceToDevice, stream),
             "copying K/V");
  if (dt == DType::q8_0) {
    const size_t ss = size_t(row / cascade::kQ8Block) * 2;  // scale bytes per token
    CHECK_CUDA(cudaMemcpyAsync(dst.scales.as<char>() + size_t(to) * ss, src.scales.as<const char>() + size_t(from) * ss,
                               size_t(n) * ss, cudaMemcpyDeviceToDevice, stream),
               "copying q8_0 scales");
  }
}

// The problem on the device: one prefix and B suffixes (one buffer, sequence after sequence), dense
// (tokens, kv heads, dim), random values; q for one query token per sequence.
struct Problem {
  KvBuf pk, pv, sk, sv;
  Buffer q, o, lse;
  int64_t row = 0;  // elements per token
  cascade::Tree tree;                  // segment 0 the prefix, s + 1 sequence s's own tokens
  std::vector<cascade::KvView> views;  // device K/V of its segments
};

std::unique_ptr<Problem> make_problem(const HeadShape& shape, DType dt, int64_t batch, int64_t prefix, int64_t suffix,
                                      uint64_t seed) {
  auto p = std::make_unique<Problem>();
  p->row = int64_t(shape.n_kv_heads) * shape.head_dim;
  p->pk = KvBuf(prefix, p->row, dt);
  p->pv = KvBuf(prefix, p->row, dt);
  p->sk = KvBuf(batch * suffix, p->row, dt);
  p->sv = KvBuf(batch * suffix, p->row, dt);
  fill(p->pk.x.p, prefix * p->row, dt, seed + 1, p->pk.scales.p);
  fill(p->pv.x.p, prefix * p->row, dt, seed + 2, p->pv.scales.p);
  fill(p->sk.x.p, batch * suffix * p->row, dt, seed + 3, p->sk.scales.p);
  fill(p->sv.x.p, batch * suffix * p->row, dt, seed + 4, p->sv.scales.p);
  const int64_t n_q = batch * shape.n_q_heads * shape.head_dim;
  p->q = Buffer(size_t(n_q * 4));
  p->o = Buffer(size_t(n_q * 4));
  p->lse = Buffer(size_t(batch * shape.n_q_heads * 4));
  fill(p->q.p, n_q, DType::f32, seed + 5);
  p->views.push_back(view_of(shape, dt, p->pk, p->pv, 0, prefix));
  for (int64_t s = 0; s < batch; ++s) p->views.push_back(view_of(shape, dt, p->sk, p->sv, s * suffix, suffix));
  p->tree = cascade::Tree::two_level(shape, prefix, std::vector<int64_t>(size_t(batch), suffix));
  CHECK_CUDA(cudaDeviceSynchronize(), "filling the problem");
  return p;
}

size_t free_memory() {
  size_t free = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

}  // namespace

int main(int argc, char** argv) {
  const CudaArgs a = parse_args(argc, argv);
  std::vector<Row> rows;
  try {
    if (cascade::cuda::device_count() == 0) die("no CUDA device");
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    const double bw = measure_copy_bandwidth(stream);
    std::map<DType, double> rate;
    // q8_0's tiles are f16 on the device: its FLOPs are priced at the f16 rate.
    const auto tile_type = [](DType dt) { return dt == DType::q8_0 ? DType::f16 : dt; };
    for (DType dt : a.dtypes)
      if (!rate.count(tile_type(dt))) rate[tile_type(dt)] = measure_tensor_rate(stream, tile_type(dt));
    std::fprintf(stderr, "device: %s, %d SMs, L2 %d MiB; copy bandwidth %.1f GB/s (read + write)", prop.name,
                 prop.multiProcessorCount, prop.l2CacheSize >> 20, bw / 1e9);
    for (auto [dt, r] : rate) std::fprintf(stderr, "; %s tensor cores %.1f TFLOP/s", cascade::dtype_name(dt), r / 1e12);
    std::fprintf(stderr, "\n");
    // Overwriting twice the L2 before each timed run evicts the previous run's K/V.
    Buffer flush_buf(a.flush ? size_t(2) * size_t(std::max(prop.l2CacheSize, 1 << 20)) : 16);
    int flush_value = 0;
    const auto flush = [&] {
      if (a.flush)
        CHECK_CUDA(cudaMemsetAsync(flush_buf.p, ++flush_value & 0xff, flush_buf.bytes, stream), "flushing the L2");
    };
    uint64_t seed = 1234;
    for (DType dt : a.dtypes)
      for (int64_t B : a.batch)
        for (int64_t P : a.prefix)
          for (int64_t t : a.suffix) {
            const HeadShape& sh = a.shape;
            const double kv_token_bytes = 2.0 * double(cascade::kv_row_bytes(dt, sh.n_kv_heads, sh.head_dim));
            const double qo_bytes = 2.0 * B * sh.n_q_heads * sh.head_dim * 4;
            auto prob = make_problem(sh, dt, B, P, t, seed += 10);
            Row base{};
            base.batch = B, base.prefix = P, base.suffix = t, base.shape = sh, base.dtype = dt, base.threads = 0;
            base.min_bytes = kv_token_bytes * double(P + B * t) + qo_bytes;
            base.min_flops = 4.0 * B * sh.n_q_heads * double(P + t) * sh.head_dim;
            base.path = "cuda";
            base.bw_ms = 1e3 * base.min_bytes / bw;
            base.flop_ms = 1e3 * base.min_flops / rate[tile_type(dt)];
            base.limit_ms = std::max(base.bw_ms, base.flop_ms);
            base.bw_gbs = bw / 1e9;
            base.peak_gflops = rate[tile_type(dt)] / 1e9;
            const size_t n_o = size_t(B * sh.n_q_heads * sh.head_dim);
            std::vector<float> first_o;
            std::string first_method;
            for (const std::string& m : a.methods) {
              Row r = base;
              r.method = m;
              // The method's own K/V layout (split and unified copy the problem's K/V on the device).
              KvBuf xk, xv;
              std::unique_ptr<cascade::cuda::Workspace> ws;
              if (m == "cascade") {
                r.bytes_read = base.min_bytes;
                ws = std::make_unique<cascade::cuda::Workspace>(cascade::cuda::plan_for_device(prob->tree));
                ws->bind(stream, prob->views);
              } else if (m == "split") {
                const size_t bytes = size_t(double(B) * double(P + t) * kv_token_bytes);
                if (bytes + (size_t(1) << 30) > free_memory()) {
                  std::fprintf(stderr, "  split B=%lld P=%lld t=%lld: needs %.1f GB of K/V, %.1f GB free: skipped\n",
                               (long long)B, (long long)P, (long long)t, bytes / 1e9, free_memory() / 1e9);
                  continue;
                }
                r.bytes_read = kv_token_bytes * double(B) * double(P + t) + qo_bytes;
                const int64_t n_seq = P + t;  // tokens of each sequence's copy
                xk = KvBuf(B * n_seq, prob->row, dt);
                xv = KvBuf(B * n_seq, prob->row, dt);
                std::vector<cascade::KvView> views;
                for (int64_t s = 0; s < B; ++s) {
                  copy_tokens(prob->pk, 0, xk, s * n_seq, P, prob->row, dt, stream);
                  copy_tokens(prob->pv, 0, xv, s * n_seq, P, prob->row, dt, stream);
                  copy_tokens(prob->sk, s * t, xk, s * n_seq + P, t, prob->row, dt, stream);
                  copy_tokens(prob->sv, s * t, xv, s * n_seq + P, t, prob->row, dt, stream);
                  views.push_back(view_of(sh, dt, xk, xv, s * n_seq, n_seq));
                }
                CHECK_CUDA(cudaStreamSynchronize(stream), "split copies");
                ws = std::make_unique<cascade::cuda::Workspace>(cascade::cuda::plan_for_device(
                    cascade::Tree::independent(sh, std::vector<int64_t>(size_t(B), P + t), std::vector<int64_t>(size_t(B), 1),
                                               prob->tree.scale())));
                ws->bind(stream, views);
              } else {
                r.bytes_read = base.min_bytes;
                const int64_t n_keys = P + B * t;
                xk = KvBuf(n_keys, prob->row, dt);
                xv = KvBuf(n_keys, prob->row, dt);
                copy_tokens(prob->pk, 0, xk, 0, P, prob->row, dt, stream);
                copy_tokens(prob->pv, 0, xv, 0, P, prob->row, dt, stream);
                copy_tokens(prob->sk, 0, xk, P, B * t, prob->row, dt, stream);
                copy_tokens(prob->sv, 0, xv, P, B * t, prob->row, dt, stream);
                CHECK_CUDA(cudaStreamSynchronize(stream), "unified copies");
                // Masks: prefix keys belong to every sequence, suffix s's keys to s alone.
                const int64_t n_words = (B + 63) / 64;
                std::vector<uint64_t> key_seqs(static_cast<size_t>(n_keys * n_words), 0);
                std::vector<int32_t> key_pos(static_cast<size_t>(n_keys)), row_seq(static_cast<size_t>(B)),
                    row_pos(static_cast<size_t>(B));
                for (int64_t k = 0; k < P; ++k) {
                  for (int64_t s = 0; s < B; ++s) key_seqs[size_t(k * n_words + s / 64)] |= uint64_t(1) << (s % 64);
                  key_pos[size_t(k)] = int32_t(k);
                }
                for (int64_t s = 0; s < B; ++s) {
                  for (int64_t j = 0; j < t; ++j) {
                    const int64_t k = P + s * t + j;
                    key_seqs[size_t(k * n_words + s / 64)] |= uint64_t(1) << (s % 64);
                    key_pos[size_t(k)] = int32_t(P + j);
                  }
                  row_seq[size_t(s)] = int32_t(s);
                  row_pos[size_t(s)] = int32_t(P + t - 1);
                }
                cascade::cpu::UnifiedBatch b;
                b.kv = view_of(sh, dt, xk, xv, 0, n_keys);
                b.key_seqs = key_seqs.data();
                b.n_words = n_words;
                b.key_pos = key_pos.data();
                b.n_rows = B;
                b.row_seq = row_seq.data();
                b.row_pos = row_pos.data();
                ws = std::make_unique<cascade::cuda::Workspace>(
                    cascade::cuda::Workspace::unified(sh, b, prob->tree.scale()));
              }
              const auto step = [&] { ws->attend(stream, prob->q.as<float>(), prob->o.as<float>(), prob->lse.as<float>()); };
              std::vector<double> ms;
              if (a.graph) {
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "beginning capture");
                step();
                CHECK_CUDA(cudaStreamEndCapture(stream, &graph), "ending capture");
                CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0), "instantiating the graph");
                ms = time_events(stream, a.warmup, a.reps,
                                 [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream), "launching the graph"); }, flush);
                CHECK_CUDA(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
                CHECK_CUDA(cudaGraphDestroy(graph), "cudaGraphDestroy");
              } else {
                ms = time_events(stream, a.warmup, a.reps, step, flush);
              }
              CHECK_CUDA(cudaStreamSynchronize(stream), "running " + m);
              fill_stats(r, ms);
              rows.push_back(r);
              // Cross-check against the first method's output.
              std::vector<float> o(n_o);
              CHECK_CUDA(cudaMemcpy(o.data(), prob->o.p, n_o * 4, cudaMemcpyDeviceToHost), "reading o");
              double diff = 0;
              bool finite = true;
              for (size_t i = 0; i < n_o; ++i) {
                finite = finite && std::isfinite(o[i]);
                if (!first_o.empty()) diff = std::max(diff, double(std::fabs(o[i] - first_o[i])));
              }
              if (first_o.empty()) first_o = o, first_method = m;
              std::fprintf(stderr, "  %-7s B=%lld P=%lld t=%lld %s: %.3f ms (limit %.3f ms)%s", m.c_str(),
                           (long long)B, (long long)P, (long long)t, cascade::dtype_name(dt), r.median_ms, r.limit_ms,
                           finite ? "" : " NON-FINITE OUTPUT");
              if (first_method != m) std::fprintf(stderr, ", max |o - o(%s)| = %.2e", first_method.c_str(), diff);
              std::fprintf(stderr, "\n");
            }
          }
    CHECK_CUDA(cudaStreamDestroy(stream), "cudaStreamDestroy");
  } catch (const std::exception& e) {
    die(e.what());
  }
  if (a.format == "md") print_md(rows);
  else if (a.format == "csv") print_csv(rows);
  else print_json(rows);
  return 0;
}
