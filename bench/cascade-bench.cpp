// cascade-bench: one decode step of attention for B sequences sharing a P-token prefix, each with t tokens
// of its own, computed by cascade, split (prefix copied per sequence) and unified (one buffer + mask),
// timed side by side against the machine's limits measured in the same run.
//
// Each row carries the minimum bytes and FLOPs the step needs (DESIGN.md's table: K/V of P + B*t tokens
// read once, 4*B*n_q_heads*(P + t)*head_dim FLOPs), the times those imply at the machine's limits measured in
// the same run (bw_ms: the bytes at the read bandwidth; flop_ms: the FLOPs at the vector units' multiply-add
// peak, the bf16 dot-product peak where bf16 K/V are multiplied as bf16), limit_ms, the larger of the two,
// and the fractions reached: of the limit, of the bandwidth and of the peak. `path` says which kernels ran.
// Caches are flushed before every timed repetition, so K/V comes from memory as in a real decode step.
#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <tbb/info.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cascade/cascade.hpp"
#include "machine.hpp"
#include "report.hpp"

[[noreturn]] void bench::die(const std::string& msg) {
  std::fprintf(stderr, "cascade-bench: error: %s\n", msg.c_str());
  std::exit(1);
}

namespace {

using namespace bench;

using cascade::DType;
using cascade::HeadShape;

void usage() {
  std::printf(
      "usage: cascade-bench [options]\n"
      "  --batch LIST        sequences sharing the prefix (default 32)\n"
      "  --prefix LIST       shared prefix tokens (default 1230)\n"
      "  --suffix LIST       tokens of each sequence's own (default 1024)\n"
      "  --shape NAME        head-shape preset: smollm2-135m (9/3/64, default), llama3-8b (32/8/128),\n"
      "                      llama3.2-1b (32/8/64), llama2-7b (32/32/128), qwen2.5-7b (28/4/128), mistral-7b\n"
      "  --heads Q/KV/D      explicit query heads / KV heads / head dim\n"
      "  --kv-dtype LIST     f32, f16, bf16, q8_0 (default f16; q8_0's bytes: 1.0625 an element)\n"
      "  --method LIST       cascade, split, unified, auto (default: all four). auto: the plan\n"
      "                      auto.hpp chooses per segment from a cost model calibrated once per thread count\n"
      "  --threads LIST      threads (0 = all; default 0)\n"
      "  --isa LIST          kernel tiers to run, each method on each in the same rounds: avx512, avx2, portable\n"
      "                      (default: the widest this CPU has)\n"
      "  --f32-products      bf16 K/V multiplied in f32; --bf16-products: on bf16 dot products (default: the\n"
      "                      library's choice, bf16 dot products where this CPU runs them faster than f32 FMAs)\n"
      "  --no-amx            bf16 products on vdpbf16ps, not on AMX tiles (default: tiles where the CPU and OS\n"
      "                      allow them)\n"
      "  --int8-products     q8_0 K/V on int8 dot products wherever the CPU has them (q quantized to int8);\n"
      "                      --no-int8-products: codes times scales, f32 products (default: the library's choice)\n"
      "  --nondeterministic  attention in the faster order whose last bits depend on the other rows of the step\n"
      "                      (default: the batch-invariant order, as the runtime and the server use)\n"
      "  --reps N            timed repetitions of each method, interleaved (default 5; up to 5x as many\n"
      "                      when the fastest method takes under 1 ms), --warmup N (default 1)\n"
      "  --no-flush          keep caches warm between repetitions\n"
      "  -o md|csv|json      output format (default md)\n");
}

Args parse_args(int argc, char** argv) {
  Args a;
  a.methods = {"cascade", "split", "unified", "auto"};
  parse_flags(argc, argv, a, {"cascade", "split", "unified", "auto"}, usage, [&a](const std::string& f, auto& value) {
    if (f == "--isa") {
      a.isas.clear();
      for (const auto& s : split_list(value())) {
        try {
          a.isas.push_back(cascade::parse_isa(s));
        } catch (const cascade::Error& e) {
          die(std::string("--isa: ") + e.what());
        }
        if (a.isas.back() > cascade::detected_isa())
          die("--isa: this CPU does not run " + s + " (its widest is " + cascade::isa_name(cascade::detected_isa()) +
              ")");
      }
      return true;
    }
    if (f == "--f32-products" || f == "--bf16-products") {
      a.bf16_products = f == "--bf16-products";
      return true;
    }
    if (f == "--no-amx") {
      a.amx = false;
      return true;
    }
    if (f == "--int8-products" || f == "--no-int8-products") {
      a.int8_products = f == "--int8-products";
      return true;
    }
    if (f == "--nondeterministic") {
      a.batch_invariant = false;
      return true;
    }
    return false;
  });
  if (a.isas.empty()) a.isas.push_back(cascade::detected_isa());
  return a;
}


// One span's K or V, dense (tokens, kv heads, dim) in the chosen dtype (q8_0: codes, and scales (tokens, kv heads,
// dim / 32)).
struct Span {
  std::vector<uint8_t> data;
  std::vector<cascade::f16> scales;
};

// The problem's K/V: one prefix, B suffixes; its tree (segment 0 the prefix, s + 1 sequence s's own tokens) and the
// views of its segments.
struct Problem {
  Span pk, pv;
  std::vector<Span> sk, sv;
  std::vector<float> q;
  cascade::Tree tree;
  std::vector<cascade::KvView> views;
};

std::unique_ptr<Problem> make_problem(const HeadShape& shape, DType dt, int64_t batch, int64_t prefix, int64_t suffix,
                                      std::mt19937& rng) {
  auto p = std::make_unique<Problem>();
  const int64_t row = int64_t(shape.n_kv_heads) * shape.head_dim;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](Span& b, int64_t n_tokens) {
    const int64_t n = n_tokens * row;
    b.data.resize(size_t(n * cascade::dtype_size(dt)));
    cascade::dispatch_dtype(dt, [&]<class T>() {
      if constexpr (std::is_same_v<T, cascade::Q8Code>) {
        std::vector<float> x(static_cast<size_t>(n));
        for (float& e : x) e = u(rng);
        b.scales.resize(size_t(n / cascade::kQ8Block));
        cascade::quantize_q8_0(x.data(), n, reinterpret_cast<int8_t*>(b.data.data()), b.scales.data());
      } else {
        T* x = reinterpret_cast<T*>(b.data.data());
        for (int64_t i = 0; i < n; ++i) x[i] = T(u(rng));
      }
    });
  };
  fill(p->pk, prefix);
  fill(p->pv, prefix);
  p->sk.resize(size_t(batch));
  p->sv.resize(size_t(batch));
  auto view = [&](const Span& k, const Span& v, int64_t n) {
    cascade::KvView kv = cascade::KvView::contiguous(reinterpret_cast<const float*>(k.data.data()),
                                                     reinterpret_cast<const float*>(v.data.data()), n,
                                                     shape.n_kv_heads, shape.head_dim);
    kv.dtype = dt;
    kv.k_scales = k.scales.data();
    kv.v_scales = v.scales.data();
    return kv;
  };
  p->views.push_back(view(p->pk, p->pv, prefix));
  for (int64_t s = 0; s < batch; ++s) {
    fill(p->sk[size_t(s)], suffix);
    fill(p->sv[size_t(s)], suffix);
    p->views.push_back(view(p->sk[size_t(s)], p->sv[size_t(s)], suffix));
  }
  p->tree = cascade::Tree::two_level(shape, prefix, std::vector<int64_t>(size_t(batch), suffix));
  p->q.resize(size_t(batch * shape.n_q_heads * shape.head_dim));
  for (float& x : p->q) x = u(rng);
  return p;
}

// Times every method of one problem in interleaved rounds (round r runs the methods starting from the
// (r mod n)-th), so that a drift in the machine's speed (other jobs, clock changes) lands on all of them
// alike instead of on whichever ran last. Each run is preceded by a cache flush when `flusher` is given.
// Problems whose fastest method runs under 1 ms get more rounds (up to 5x --reps): their times carry the
// most jitter (thread wake-ups, cold pages) relative to the differences between methods.
std::vector<std::vector<double>> time_interleaved(const Args& a, bench::CacheFlusher* flusher,
                                                  const std::vector<std::function<void()>>& runs) {
  const size_t n = runs.size();
  double fastest = 1e30;
  for (int i = 0; i < std::max(1, a.warmup); ++i)
    for (const auto& run : runs) {
      if (flusher) flusher->flush();
      const double t0 = bench::now_s();
      run();
      fastest = std::min(fastest, (bench::now_s() - t0) * 1e3);
    }
  const int reps = a.reps * int(std::clamp(std::ceil(1.0 / std::max(fastest, 1e-6)), 1.0, 5.0));
  std::vector<std::vector<double>> ms(n);
  for (int rep = 0; rep < reps; ++rep)
    for (size_t k = 0; k < n; ++k) {
      const size_t m = (size_t(rep) + k) % n;
      if (flusher) flusher->flush();
      const double t0 = bench::now_s();
      runs[m]();
      ms[m].push_back((bench::now_s() - t0) * 1e3);
    }
  return ms;
}

// The machine's limits at one thread count, measured once and shared by every row of that count.
struct Limits {
  double bw = 0, bf16 = 0, amx = 0;     // bytes/s; bf16 dot-product and AMX tile FLOP/s (0: none)
  std::map<cascade::Isa, double> fma;  // f32 FMA FLOP/s with each tier's vectors
};

// Measures them with thr threads (the f32 FMA peak on each of `isas`) and says what it found on stderr.
Limits measure_limits(int thr, const std::vector<cascade::Isa>& isas) {
  Limits l;
  l.bw = bench::measure_read_bandwidth(thr);
  l.bf16 = bench::measure_bf16_peak(thr);
  l.amx = bench::measure_amx_peak(thr);
  std::string fmas;
  for (cascade::Isa isa : isas) {
    l.fma[isa] = bench::measure_fma_peak(thr, isa);
    fmas += std::string(fmas.empty() ? "" : ", ") + cascade::isa_name(isa) + " " + fmt(l.fma[isa] / 1e9, 1);
  }
  std::fprintf(stderr,
               "machine, %d threads: read bandwidth %.1f GB/s, f32 FMA peak (%s) GFLOP/s, bf16 dot-product peak "
               "%.1f GFLOP/s, AMX bf16 tile peak %.1f GFLOP/s; Eigen's f32 matrix multiply %.1f GFLOP/s\n",
               thr, l.bw / 1e9, fmas.c_str(), l.bf16 / 1e9, l.amx / 1e9,
               bench::measure_gemm_rate(thr, 256, 256, 256) / 1e9);
  return l;
}

// (threads, tier, K/V type) -> auto's model, calibrated on that type
using CostModels = std::map<std::tuple<int, cascade::Isa, DType>, cascade::CostModel>;

// One point of the sweep (K/V type, B, P, t at one thread count): its problem, and every method on every tier
// set up (layouts, plans) before any is timed, so that they are timed together: each run is one layer's
// attention with the step's plan made beforehand (under its tier), as a model runs it. rows_[k] is the row
// runs_[k] fills.
class Point {
 public:
  Point(const Args& a, int thr, const Limits& lim, DType dt, int64_t B, int64_t P, int64_t t, std::mt19937& rng)
      : a_(a), lim_(lim), prob_(make_problem(a.shape, dt, B, P, t, rng)), opt_{thr} {
    const HeadShape& sh = a.shape;
    kv_token_bytes_ = 2.0 * sh.n_kv_heads * sh.head_dim * cascade::kv_element_bytes(dt);
    qo_bytes_ = 2.0 * B * sh.n_q_heads * sh.head_dim * 4;
    base_.batch = B;
    base_.prefix = P;
    base_.suffix = t;
    base_.shape = sh;
    base_.dtype = dt;
    base_.threads = thr;
    base_.min_bytes = kv_token_bytes_ * double(P + B * t) + qo_bytes_;
    base_.min_flops = 4.0 * B * sh.n_q_heads * double(P + t) * sh.head_dim;
    base_.bw_ms = 1e3 * base_.min_bytes / lim.bw;
    base_.bw_gbs = lim.bw / 1e9;
    o_.resize(prob_->q.size());
    opt_.kv_dtype = dt;
  }

  // Sets up method m on every tier of --isa.
  void add_method(const std::string& m, CostModels& models) {
    if (m == "split")
      splits_.push_back(std::make_unique<cascade::SplitLayout>(cascade::make_split(prob_->tree, prob_->views)));
    if (m == "unified")
      unifieds_.push_back(std::make_unique<cascade::UnifiedLayout>(cascade::make_unified(prob_->tree, prob_->views)));
    for (cascade::Isa isa : a_.isas) {
      const cascade::IsaLimit isa_limit(isa);
      Row r = tier_row(m, isa);
      if (m == "cascade") {
        r.bytes_read = base_.min_bytes;
        add_run(plan(prob_->tree, opt_, r), &prob_->views, isa);
      } else if (m == "auto") {
        add_auto(r, isa, models);
      } else if (m == "split") {
        r.bytes_read = kv_token_bytes_ * double(base_.batch) * double(base_.prefix + base_.suffix) + qo_bytes_;
        add_run(plan(splits_.back()->tree, opt_, r), &splits_.back()->views, isa);
      } else {
        r.bytes_read = base_.min_bytes;
        add_unified(r, isa);
      }
      rows_.push_back(r);
    }
  }

  // Times every run set up, interleaved, and appends their rows to `out` (a line each on stderr).
  void time(bench::CacheFlusher* flusher, std::vector<Row>& out) {
    const auto ms = time_interleaved(a_, flusher, runs_);
    for (size_t k = 0; k < rows_.size(); ++k) {
      Row& r = rows_[k];
      fill_stats(r, ms[k]);
      out.push_back(r);
      std::fprintf(stderr, "  %-7s %-11s B=%lld P=%lld t=%lld %s thr=%d: %.3f ms\n", r.method.c_str(),
                   r.path.c_str(), (long long)r.batch, (long long)r.prefix, (long long)r.suffix,
                   cascade::dtype_name(r.dtype), r.threads, r.median_ms);
    }
  }

 private:
  // Method m's row on tier isa, before timing: the kernels' path and the limits it is held to.
  Row tier_row(const std::string& m, cascade::Isa isa) const {
    Row r = base_;
    r.method = m;
    // bf16 products where the tiled kernel takes them (kernel.hpp): their rate is the limit, the
    // AMX tiles' where it runs on those (every FLOP priced at it, the per-sequence pass's too).
    const cascade::Products bk =
        cascade::cpu::choose_kernel(cascade::KernelShape::tiled, r.dtype, a_.shape.head_dim,
                                    cascade::cpu::KernelOptions::process())
            .products;
    const double bk_rate = bk == cascade::Products::amx_bf16   ? lim_.amx
                           : bk == cascade::Products::bf16_dot ? lim_.bf16
                                                               : 0.0;
    const double peak = bk_rate > 0 ? bk_rate : lim_.fma.at(isa);
    r.path = std::string(cascade::isa_name(isa)) + (bk == cascade::Products::amx_bf16   ? "+amx"
                                                    : bk == cascade::Products::bf16_dot ? "+bf16"
                                                                                        : "");
    r.flop_ms = 1e3 * base_.min_flops / peak;
    r.limit_ms = std::max(r.bw_ms, r.flop_ms);
    r.peak_gflops = peak / 1e9;
    return r;
  }

  // The plan of `tree` under opt (made under the row's tier: the kernels are chosen then), named in r.
  const cascade::Plan* plan(const cascade::Tree& tree, const cascade::cpu::Options& opt, Row& r) {
    plans_.push_back(std::make_unique<cascade::Plan>(cascade::cpu::plan(tree, opt)));
    r.kernels = cascade::cpu::kernel_names(*plans_.back(), r.dtype);
    return plans_.back().get();
  }

  void add_run(const cascade::Plan* plan, const std::vector<cascade::KvView>* views, cascade::Isa isa) {
    runs_.push_back([this, plan, views, isa] {
      const cascade::IsaLimit run_limit(isa);
      cascade::cpu::run(*plan, *views, prob_->q.data(), o_.data());
    });
  }

  // auto: the plan of the cost model calibrated once per (threads, tier); what it chose on stderr. Folding the
  // prefix into the sequences reads it once per sequence.
  void add_auto(Row& r, cascade::Isa isa, CostModels& models) {
    const int thr = base_.threads;
    const auto key = std::make_tuple(thr, isa, base_.dtype);
    if (!models.count(key)) models[key] = cascade::calibrate(thr, a_.shape, base_.dtype);
    cascade::cpu::Options auto_opt = opt_;
    auto_opt.cost_model = &models[key];
    const cascade::Plan* p = plan(prob_->tree, auto_opt, r);
    const cascade::AutoChoice& why = *p->choice();
    const int folded = int(std::count_if(why.segments.begin(), why.segments.end(),
                                         [](const cascade::SegmentChoice& c) { return !c.shared; }));
    r.bytes_read = base_.min_bytes + (why.segments.empty() || why.segments[0].shared
                                          ? 0.0
                                          : kv_token_bytes_ * double(base_.batch - 1) * double(base_.prefix));
    std::fprintf(stderr, "  auto %s: %s (%d of %d segments folded; predicted %.3f ms, tree %.3f ms)\n",
                 r.path.c_str(), why.changed ? "regrouped" : "the tree as given", folded, int(why.segments.size()),
                 1e3 * why.chosen_s, 1e3 * why.tree_s);
    add_run(p, &prob_->views, isa);
  }

  void add_unified(Row& r, cascade::Isa isa) {
    const cascade::UnifiedLayout* uni = unifieds_.back().get();
    unified_plans_.push_back(std::make_unique<cascade::cpu::UnifiedPlan>(cascade::cpu::plan_unified(
        a_.shape, uni->batch.kv.n_tokens, uni->batch.n_rows, opt_, prob_->tree.scale())));
    const cascade::cpu::UnifiedPlan* up = unified_plans_.back().get();
    r.kernels = cascade::cpu::kernel_name(up->target, up->schedule.passes.empty() ? 0 : up->schedule.passes[0].kernel,
                                          r.dtype);
    runs_.push_back([this, uni, up, isa] {
      const cascade::IsaLimit run_limit(isa);
      cascade::cpu::run_unified(*up, uni->batch, prob_->q.data(), o_.data());
    });
  }

  const Args& a_;
  const Limits& lim_;
  std::unique_ptr<Problem> prob_;
  cascade::cpu::Options opt_;
  double kv_token_bytes_ = 0, qo_bytes_ = 0;
  Row base_{};
  std::vector<float> o_;
  std::vector<Row> rows_;
  std::vector<std::function<void()>> runs_;
  std::vector<std::unique_ptr<cascade::SplitLayout>> splits_;
  std::vector<std::unique_ptr<cascade::UnifiedLayout>> unifieds_;
  std::vector<std::unique_ptr<cascade::Plan>> plans_;
  std::vector<std::unique_ptr<cascade::cpu::UnifiedPlan>> unified_plans_;
};

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  std::mt19937 rng(1234);
  std::vector<Row> rows;
  std::unique_ptr<bench::CacheFlusher> flusher;
  if (a.flush) flusher = std::make_unique<bench::CacheFlusher>();
  std::map<int, Limits> limits;  // threads -> the machine's limits
  CostModels models;
  std::optional<cascade::cpu::Bf16Products> products;
  if (a.bf16_products >= 0) products.emplace(a.bf16_products == 1);
  std::optional<cascade::cpu::AmxTiles> tiles;
  if (!a.amx) tiles.emplace(false);
  std::optional<cascade::cpu::Int8Products> int8;
  if (a.int8_products >= 0) int8.emplace(a.int8_products == 1);
  cascade::cpu::set_batch_invariant(a.batch_invariant);
  try {
    for (int thr_req : a.threads) {
      const int thr = thr_req > 0 ? std::min(thr_req, tbb::info::default_concurrency())
                                  : tbb::info::default_concurrency();
      if (!limits.count(thr)) limits[thr] = measure_limits(thr, a.isas);
      for (DType dt : a.dtypes)
        for (int64_t B : a.batch)
          for (int64_t P : a.prefix)
            for (int64_t t : a.suffix) {
              Point point(a, thr, limits[thr], dt, B, P, t, rng);
              for (const std::string& m : a.methods) point.add_method(m, models);
              point.time(flusher.get(), rows);
            }
    }
  } catch (const std::exception& e) {
    die(e.what());
  }
  if (a.format == "md") print_md(rows);
  else if (a.format == "csv") print_csv(rows);
  else print_json(rows);
  return 0;
}
