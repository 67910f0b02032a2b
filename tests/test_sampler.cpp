// The sampler against direct computations: greedy is the argmax, the filtered distribution is what the
// definitions in sampler.hpp say, draws follow it within a statistical bound, and streams are reproducible.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "cascade/error.hpp"
#include "model/sampler.hpp"

using namespace cascade;

namespace {

// Logits of a known distribution over 8 tokens: p ∝ {0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02}, shuffled
// so that the order of ids is not the order of probabilities.
const std::vector<int32_t> kOrder = {5, 2, 7, 0, 3, 6, 1, 4};  // kOrder[r] = id of the r-th most likely
const std::vector<double> kProb = {0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02};

std::vector<float> known_logits() {
  std::vector<float> l(8);
  for (int r = 0; r < 8; ++r) l[kOrder[r]] = float(std::log(kProb[r]) + 1.5);
  return l;
}

// The expected filtered distribution, computed directly from kProb (temperature 1): keep ranks [0, keep).
std::map<int32_t, double> expected(int keep) {
  double sum = 0;
  for (int r = 0; r < keep; ++r) sum += kProb[r];
  std::map<int32_t, double> e;
  for (int r = 0; r < keep; ++r) e[kOrder[r]] = kProb[r] / sum;
  return e;
}

void check_distribution(const SamplerParams& p, const std::map<int32_t, double>& want) {
  const std::vector<float> l = known_logits();
  Sampler s(p, 0);
  const auto got = s.distribution(l.data(), 8);
  REQUIRE(got.size() == want.size());
  for (const auto& [id, pr] : got) {
    REQUIRE(want.count(id) == 1);
    CHECK(pr == doctest::Approx(want.at(id)).epsilon(1e-6));
  }
  // (The logits are f32, so probabilities carry ~1e-7 relative rounding.)
  // Draws: the frequency of every token within 5 standard deviations of its probability (a false alarm
  // has probability ~1e-6 per token), and no token outside the kept set.
  const int n = 40000;
  std::map<int32_t, int> count;
  for (int i = 0; i < n; ++i) ++count[s.sample(l.data(), 8)];
  for (const auto& [id, c] : count) CHECK(want.count(id) == 1);
  for (const auto& [id, pr] : want) {
    const double f = double(count[id]) / n, sd = std::sqrt(pr * (1 - pr) / n);
    CAPTURE(id);
    CHECK(std::fabs(f - pr) <= 5 * sd + 1e-12);
  }
}

}  // namespace

TEST_CASE("sampler: greedy is the argmax, lowest id on ties, and draws no random numbers") {
  SamplerParams p;
  p.temp = 0;
  Sampler s(p, 3);
  const std::vector<float> l = known_logits();
  for (int i = 0; i < 5; ++i) CHECK(s.sample(l.data(), 8) == 5);
  const std::vector<float> tie = {0.0f, 2.0f, -1.0f, 2.0f};
  CHECK(s.sample(tie.data(), 4) == 1);
  CHECK(argmax(tie.data(), 4) == 1);
  const auto d = s.distribution(l.data(), 8);
  REQUIRE(d.size() == 1);
  CHECK(d[0].first == 5);
  CHECK(d[0].second == 1.0);
}

TEST_CASE("sampler: plain temperature-1 sampling follows the softmax") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  check_distribution(p, expected(8));
}

TEST_CASE("sampler: top-k keeps the k most likely, renormalized") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 3;
  p.top_p = 1;
  p.min_p = 0;
  check_distribution(p, expected(3));
}

TEST_CASE("sampler: top-p keeps the smallest head reaching p") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.min_p = 0;
  p.top_p = 0.70f;  // 0.30 + 0.25 = 0.55 < 0.70 <= 0.70: three tokens
  check_distribution(p, expected(3));
  p.top_p = 0.71f;  // 0.70 < 0.71: four
  check_distribution(p, expected(4));
}

TEST_CASE("sampler: min-p keeps tokens with p >= min_p * max p") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0.3f;  // 0.3 * 0.30 = 0.09: keeps 0.30, 0.25, 0.15, 0.12
  check_distribution(p, expected(4));
}

TEST_CASE("sampler: filters combine (top-k then top-p then min-p)") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 5;      // 0.30 .. 0.08, renormalized by 0.90
  p.top_p = 0.8f;   // cumulative 0.333, 0.611, 0.778, 0.911: four
  p.min_p = 0.45f;  // 0.45 * 0.333 = 0.15 of the renormalized: 0.30/0.9=0.333, 0.278, 0.167 kept, 0.133 not
  check_distribution(p, expected(3));
}

TEST_CASE("sampler: temperature sharpens and flattens as softmax(logits / T)") {
  const std::vector<float> l = known_logits();
  for (float t : {0.5f, 2.0f}) {
    SamplerParams p;
    p.temp = t;
    p.top_k = 0;
    p.top_p = 1;
    p.min_p = 0;
    double z = 0;
    for (double pr : kProb) z += std::pow(pr, 1.0 / t);
    std::map<int32_t, double> want;
    for (int r = 0; r < 8; ++r) want[kOrder[r]] = std::pow(kProb[r], 1.0 / t) / z;
    check_distribution(p, want);
  }
}

TEST_CASE("sampler: same seed and stream give the same draws, other seeds or streams differ") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  p.seed = 42;
  const std::vector<float> l(100, 0.0f);  // uniform over 100 tokens
  const auto draws = [&](uint64_t seed, uint64_t stream) {
    SamplerParams q = p;
    q.seed = seed;
    Sampler s(q, stream);
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.sample(l.data(), 100));
    return out;
  };
  CHECK(draws(42, 0) == draws(42, 0));
  CHECK(draws(42, 5) == draws(42, 5));
  CHECK(draws(42, 0) != draws(43, 0));
  CHECK(draws(42, 0) != draws(42, 1));
  Rng a(1, 0), b(1, 0);
  for (int i = 0; i < 10; ++i) {
    const double u = a.uniform();
    CHECK(u == b.uniform());
    CHECK(u >= 0.0);
    CHECK(u < 1.0);
  }
}

TEST_CASE("sampler: invalid parameters are rejected") {
  SamplerParams p;
  p.temp = -1;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.top_p = 2;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.min_p = -0.1f;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.temp = NAN;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
}

TEST_CASE("sampler: logits that differ by rounding give the same draws (intervals in id order)") {
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  p.seed = 7;
  // 64 tokens of nearly equal probability, whose order by probability the perturbation scrambles.
  std::vector<float> a(64), b(64);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.0f, 1e-4f), e(-1e-6f, 1e-6f);
  for (int i = 0; i < 64; ++i) {
    a[i] = u(rng);
    b[i] = a[i] + e(rng);
  }
  Sampler sa(p, 0), sb(p, 0);
  int same = 0;
  for (int i = 0; i < 500; ++i) same += sa.sample(a.data(), 64) == sb.sample(b.data(), 64);
  CHECK(same == 500);
}
