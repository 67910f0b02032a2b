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
      "  --kv-dtype LIST     f32, f16, bf16 (default f16)\n"
      "  --method LIST       cascade, split, unified, auto (default: all four). auto: the plan\n"
      "                      auto.hpp chooses per segment from a cost model calibrated once per thread count\n"
      "  --threads LIST      threads (0 = all; default 0)\n"
      "  --isa LIST          kernel tiers to run, each method on each in the same rounds: avx512, avx2, portable\n"
      "                      (default: the widest this CPU has)\n"
      "  --f32-products      bf16 K/V multiplied in f32; --bf16-products: on bf16 dot products (default: the\n"
      "                      library's choice, bf16 dot products where this CPU runs them faster than f32 FMAs)\n"
      "  --no-amx            bf16 products on vdpbf16ps, not on AMX tiles (default: tiles where the CPU and OS\n"
      "                      allow them)\n"
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
    return false;
  });
  if (a.isas.empty()) a.isas.push_back(cascade::detected_isa());
  return a;
}


// The problem's K/V: one prefix, B suffixes, dense (tokens, kv heads, dim) in the chosen dtype; its tree
// (segment 0 the prefix, s + 1 sequence s's own tokens) and the views of its segments.
struct Problem {
  std::vector<uint8_t> pk, pv;
  std::vector<std::vector<uint8_t>> sk, sv;
  std::vector<float> q;
  cascade::Tree tree;
  std::vector<cascade::KvView> views;
};

std::unique_ptr<Problem> make_problem(const HeadShape& shape, DType dt, int64_t batch, int64_t prefix, int64_t suffix,
                                      std::mt19937& rng) {
  auto p = std::make_unique<Problem>();
  const int64_t row = int64_t(shape.n_kv_heads) * shape.head_dim;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](std::vector<uint8_t>& b, int64_t n_tokens) {
    b.resize(size_t(n_tokens * row * cascade::dtype_size(dt)));
    cascade::dispatch_dtype(dt, [&]<class T>() {
      T* x = reinterpret_cast<T*>(b.data());
      for (int64_t i = 0; i < n_tokens * row; ++i) x[i] = T(u(rng));
    });
  };
  fill(p->pk, prefix);
  fill(p->pv, prefix);
  p->sk.resize(size_t(batch));
  p->sv.resize(size_t(batch));
  auto view = [&](const std::vector<uint8_t>& k, const std::vector<uint8_t>& v, int64_t n) {
    cascade::KvView kv = cascade::KvView::contiguous(reinterpret_cast<const float*>(k.data()),
                                                     reinterpret_cast<const float*>(v.data()), n, shape.n_kv_heads,
                                                     shape.head_dim);
    kv.dtype = dt;
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

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  std::mt19937 rng(1234);
  std::vector<Row> rows;
  std::unique_ptr<bench::CacheFlusher> flusher;
  if (a.flush) flusher = std::make_unique<bench::CacheFlusher>();
  struct Limits {
    double bw = 0, bf16 = 0, amx = 0;     // bytes/s; bf16 dot-product and AMX tile FLOP/s (0: none)
    std::map<cascade::Isa, double> fma;  // f32 FMA FLOP/s with each tier's vectors
  };
  std::map<int, Limits> limits;                                       // threads -> the machine's limits
  std::map<std::pair<int, cascade::Isa>, cascade::CostModel> models;  // (threads, tier) -> auto's cost model
  std::optional<cascade::cpu::Bf16Products> products;
  if (a.bf16_products >= 0) products.emplace(a.bf16_products == 1);
  std::optional<cascade::cpu::AmxTiles> tiles;
  if (!a.amx) tiles.emplace(false);
  try {
    for (int thr_req : a.threads) {
      const int thr = thr_req > 0 ? std::min(thr_req, tbb::info::default_concurrency())
                                  : tbb::info::default_concurrency();
      if (!limits.count(thr)) {
        Limits& l = limits[thr];
        l.bw = bench::measure_read_bandwidth(thr);
        l.bf16 = bench::measure_bf16_peak(thr);
        l.amx = bench::measure_amx_peak(thr);
        std::string fmas;
        for (cascade::Isa isa : a.isas) {
          l.fma[isa] = bench::measure_fma_peak(thr, isa);
          fmas += std::string(fmas.empty() ? "" : ", ") + cascade::isa_name(isa) + " " + fmt(l.fma[isa] / 1e9, 1);
        }
        std::fprintf(stderr,
                     "machine, %d threads: read bandwidth %.1f GB/s, f32 FMA peak (%s) GFLOP/s, bf16 dot-product peak "
                     "%.1f GFLOP/s, AMX bf16 tile peak %.1f GFLOP/s; Eigen's f32 matrix multiply %.1f GFLOP/s\n",
                     thr, l.bw / 1e9, fmas.c_str(), l.bf16 / 1e9, l.amx / 1e9,
                     bench::measure_gemm_rate(thr, 256, 256, 256) / 1e9);
      }
      const Limits& lim = limits[thr];
      for (DType dt : a.dtypes)
        for (int64_t B : a.batch)
          for (int64_t P : a.prefix)
            for (int64_t t : a.suffix) {
              auto prob = make_problem(a.shape, dt, B, P, t, rng);
              const HeadShape& sh = a.shape;
              const double kv_token_bytes = 2.0 * sh.n_kv_heads * sh.head_dim * cascade::dtype_size(dt);
              const double qo_bytes = 2.0 * B * sh.n_q_heads * sh.head_dim * 4;
              Row base{};
              base.batch = B;
              base.prefix = P;
              base.suffix = t;
              base.shape = sh;
              base.dtype = dt;
              base.threads = thr;
              base.min_bytes = kv_token_bytes * double(P + B * t) + qo_bytes;
              base.min_flops = 4.0 * B * sh.n_q_heads * double(P + t) * sh.head_dim;
              base.bw_ms = 1e3 * base.min_bytes / lim.bw;
              base.bw_gbs = lim.bw / 1e9;
              std::vector<float> o(prob->q.size());
              cascade::cpu::Options opt{thr};
              opt.kv_dtype = dt;
              // Set every method up first (layouts, plans) on every tier, then time them together: each run is
              // one layer's attention with the step's plan made beforehand (under its tier), as a model runs it.
              std::vector<Row> mrows;
              std::vector<std::function<void()>> runs;
              std::vector<std::unique_ptr<cascade::SplitLayout>> splits;
              std::vector<std::unique_ptr<cascade::UnifiedLayout>> unifieds;
              std::vector<std::unique_ptr<cascade::Plan>> plans;
              std::vector<std::unique_ptr<cascade::cpu::UnifiedPlan>> unified_plans;
              for (const std::string& m : a.methods) {
                if (m == "split")
                  splits.push_back(
                      std::make_unique<cascade::SplitLayout>(cascade::make_split(prob->tree, prob->views)));
                if (m == "unified")
                  unifieds.push_back(
                      std::make_unique<cascade::UnifiedLayout>(cascade::make_unified(prob->tree, prob->views)));
                for (cascade::Isa isa : a.isas) {
                  const cascade::IsaLimit isa_limit(isa);
                  Row r = base;
                  r.method = m;
                  // bf16 products where the tiled kernel takes them (kernel.hpp): their rate is the limit, the
                  // AMX tiles' where it runs on those (every FLOP priced at it, the per-sequence pass's too).
                  const cascade::Products bk =
                      cascade::cpu::choose_kernel(cascade::KernelShape::tiled, dt, a.shape.head_dim,
                                                  cascade::cpu::KernelOptions::process())
                          .products;
                  const double bk_rate = bk == cascade::Products::amx_bf16   ? lim.amx
                                         : bk == cascade::Products::bf16_dot ? lim.bf16
                                                                             : 0.0;
                  const double peak = bk_rate > 0 ? bk_rate : lim.fma.at(isa);
                  r.path = std::string(cascade::isa_name(isa)) + (bk == cascade::Products::amx_bf16   ? "+amx"
                                                                  : bk == cascade::Products::bf16_dot ? "+bf16"
                                                                                                      : "");
                  r.flop_ms = 1e3 * base.min_flops / peak;
                  r.limit_ms = std::max(r.bw_ms, r.flop_ms);
                  r.peak_gflops = peak / 1e9;
                  const std::vector<cascade::KvView>* views = &prob->views;
                  if (m == "cascade") {
                    r.bytes_read = base.min_bytes;
                    plans.push_back(std::make_unique<cascade::Plan>(cascade::cpu::plan(prob->tree, opt)));
                  } else if (m == "auto") {
                    if (!models.count({thr, isa})) models[{thr, isa}] = cascade::calibrate(thr, a.shape);
                    cascade::cpu::Options auto_opt = opt;
                    auto_opt.cost_model = &models[{thr, isa}];
                    plans.push_back(std::make_unique<cascade::Plan>(cascade::cpu::plan(prob->tree, auto_opt)));
                    const cascade::AutoChoice& why = *plans.back()->choice();
                    const int folded = int(std::count_if(why.segments.begin(), why.segments.end(),
                                                         [](const cascade::SegmentChoice& c) { return !c.shared; }));
                    r.bytes_read = base.min_bytes + (why.segments.empty() || why.segments[0].shared
                                                         ? 0.0
                                                         : kv_token_bytes * double(B - 1) * double(P));
                    std::fprintf(stderr, "  auto %s: %s (%d of %d segments folded; predicted %.3f ms, tree %.3f ms)\n",
                                 r.path.c_str(), why.changed ? "regrouped" : "the tree as given", folded,
                                 int(why.segments.size()), 1e3 * why.chosen_s, 1e3 * why.tree_s);
                  } else if (m == "split") {
                    r.bytes_read = kv_token_bytes * double(B) * double(P + t) + qo_bytes;
                    views = &splits.back()->views;
                    plans.push_back(std::make_unique<cascade::Plan>(cascade::cpu::plan(splits.back()->tree, opt)));
                  } else {
                    r.bytes_read = base.min_bytes;
                    const cascade::UnifiedLayout* uni = unifieds.back().get();
                    unified_plans.push_back(std::make_unique<cascade::cpu::UnifiedPlan>(cascade::cpu::plan_unified(
                        sh, uni->batch.kv.n_tokens, uni->batch.n_rows, opt, prob->tree.scale())));
                    const cascade::cpu::UnifiedPlan* up = unified_plans.back().get();
                    runs.push_back([&, uni, up, isa] {
                      const cascade::IsaLimit run_limit(isa);
                      cascade::cpu::run_unified(*up, uni->batch, prob->q.data(), o.data());
                    });
                  }
                  if (m != "unified") {
                    const cascade::Plan* plan = plans.back().get();
                    runs.push_back([&, plan, views, isa] {
                      const cascade::IsaLimit run_limit(isa);
                      cascade::cpu::run(*plan, *views, prob->q.data(), o.data());
                    });
                  }
                  mrows.push_back(r);
                }
              }
              const auto ms = time_interleaved(a, flusher.get(), runs);
              for (size_t k = 0; k < mrows.size(); ++k) {
                Row& r = mrows[k];
                fill_stats(r, ms[k]);
                rows.push_back(r);
                std::fprintf(stderr, "  %-7s %-11s B=%lld P=%lld t=%lld %s thr=%d: %.3f ms\n", r.method.c_str(),
                             r.path.c_str(), (long long)B, (long long)P, (long long)t, cascade::dtype_name(dt), thr,
                             r.median_ms);
              }
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
