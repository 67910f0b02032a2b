// The sampler against direct computations: greedy is the argmax, the filtered distribution is what the
// definitions in sampler.hpp say, draws follow it within a statistical bound, and streams are reproducible;
// log-probabilities against a log-softmax in double, logit_bias and the penalties against their definitions.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "cascade/error.hpp"
#include "model/sampler.hpp"

namespace test_sampler {

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

// --- log-probabilities, logit_bias and penalties -----------------------------------------------------------

namespace {

std::vector<float> random_logits(int64_t n, uint32_t seed, float scale = 4.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> l(static_cast<size_t>(n));
  for (float& x : l) x = d(rng);
  return l;
}

// log softmax(l) in double.
std::vector<double> log_softmax(const std::vector<float>& l) {
  double mx = -INFINITY;
  for (float x : l) mx = std::max(mx, double(x));
  double sum = 0;
  for (float x : l) sum += std::exp(double(x) - mx);
  std::vector<double> out;
  for (float x : l) out.push_back(double(x) - mx - std::log(sum));
  return out;
}

// The adjustments of sampler.hpp, written out in double from their definitions: the bias added, then every token
// of the prompt or the draws divided (positive) or multiplied (otherwise) by r, then c * frequency + presence
// subtracted for every token drawn c > 0 times.
std::vector<double> adjusted(const std::vector<float>& l, const SamplerParams& p, const std::vector<int32_t>& prompt,
                             const std::vector<int32_t>& drawn) {
  std::vector<double> x(l.begin(), l.end());
  for (const auto& [id, b] : p.logit_bias) x[size_t(id)] += double(b);
  std::map<int32_t, int> count;
  for (int32_t t : drawn) ++count[t];
  std::vector<bool> seen(l.size(), false);
  for (int32_t t : prompt) seen[size_t(t)] = true;
  for (int32_t t : drawn) seen[size_t(t)] = true;
  for (size_t i = 0; i < x.size(); ++i) {
    if (seen[i]) x[i] = x[i] > 0 ? x[i] / p.repetition_penalty : x[i] * p.repetition_penalty;
    if (count.count(int32_t(i)))
      x[i] -= count[int32_t(i)] * double(p.frequency_penalty) + double(p.presence_penalty);
  }
  return x;
}

}  // namespace

TEST_CASE("sampler: token_logprob is the log-softmax, with the most probable tokens in order") {
  for (const int64_t n : {int64_t(1), int64_t(7), int64_t(1000), int64_t(49152)}) {
    std::vector<float> l = random_logits(n, uint32_t(n));
    if (n > 10) l[3] = l[5] = l[9] = 40.0f;  // ties at the top: lower ids first
    const std::vector<double> ref = log_softmax(l);
    std::vector<int32_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)]; });
    for (const int n_top : {0, 1, 5, 20}) {
      const int k = int(std::min<int64_t>(n_top, n));
      const int32_t token = int32_t((n * 7) / 11);
      const TokenLogprob lp = token_logprob(l.data(), n, token, k);
      CAPTURE(n);
      CAPTURE(n_top);
      CHECK(lp.token == token);
      CHECK(std::fabs(lp.logprob - ref[size_t(token)]) <= 1e-5 + 1e-6 * std::fabs(ref[size_t(token)]));
      REQUIRE(lp.top.size() == size_t(k));
      for (int r = 0; r < k; ++r) {
        CHECK(lp.top[size_t(r)].first == order[size_t(r)]);
        CHECK(std::fabs(lp.top[size_t(r)].second - ref[size_t(order[size_t(r)])]) <= 1e-5);
      }
    }
  }
  const std::vector<float> l = {0.0f, 1.0f};
  CHECK_THROWS_AS(token_logprob(l.data(), 2, 2, 1), Error);
  CHECK_THROWS_AS(token_logprob(l.data(), 2, 0, 3), Error);
}

TEST_CASE("sampler: logit_bias and the penalties change the distribution as their definitions say") {
  const int64_t n = 300;
  const std::vector<float> l = random_logits(n, 11, 2.0f);
  const std::vector<int32_t> prompt = {3, 17, 17, 42, 250, 299};
  SamplerParams p;
  p.temp = 1;
  p.top_k = 0;
  p.top_p = 1;
  p.min_p = 0;
  p.seed = 5;
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = 0.7f;
  p.logit_bias = {{17, 2.5f}, {100, -3.0f}, {7, 1.0f}};
  Sampler s(p, 0);
  s.set_prompt(prompt);
  std::vector<int32_t> drawn;
  std::vector<float> row = l;
  for (int step = 0; step < 40; ++step) {
    // The distribution of the next draw against the reference, then the draw, which leaves the row as it was.
    const std::vector<double> x = adjusted(l, p, prompt, drawn);
    double mx = -INFINITY, sum = 0;
    for (double v : x) mx = std::max(mx, v);
    for (double v : x) sum += std::exp(v - mx);
    const auto got = s.distribution(l.data(), n);
    REQUIRE(got.size() == size_t(n));
    for (const auto& [id, pr] : got) CHECK(pr == doctest::Approx(std::exp(x[size_t(id)] - mx) / sum).epsilon(1e-5));
    drawn.push_back(s.sample(row.data(), n));
    REQUIRE(std::memcmp(row.data(), l.data(), size_t(n) * sizeof(float)) == 0);
  }
  // Repeats were drawn, so the penalties were exercised on counts above one.
  std::map<int32_t, int> count;
  for (int32_t t : drawn) ++count[t];
  CHECK(std::max_element(count.begin(), count.end(), [](auto& a, auto& b) { return a.second < b.second; })->second > 1);

  // Greedy takes the argmax of the adjusted logits; the const overload draws what the mutable one does.
  SamplerParams g = p;
  g.temp = 0;
  Sampler a(g, 0), b(g, 0);
  a.set_prompt(prompt);
  b.set_prompt(prompt);
  std::vector<int32_t> seq;
  for (int step = 0; step < 20; ++step) {
    const std::vector<double> x = adjusted(l, g, prompt, seq);
    const int32_t want = int32_t(std::max_element(x.begin(), x.end()) - x.begin());
    const int32_t got = a.sample(row.data(), n);
    CHECK(got == want);
    CHECK(b.sample(static_cast<const float*>(l.data()), n) == got);
    seq.push_back(got);
  }
  CHECK(std::set<int32_t>(seq.begin(), seq.end()).size() > 1);  // the penalties moved greedy off its first choice
}

TEST_CASE("sampler: invalid penalties and biases are rejected") {
  SamplerParams p;
  p.repetition_penalty = 0;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.repetition_penalty = -1;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.frequency_penalty = INFINITY;
  CHECK_THROWS_AS(Sampler(p, 0), Error);
  p = {};
  p.logit_bias = {{1, NAN}};
  CHECK_THROWS_AS(Sampler(p, 0), Error);
}

}  // namespace test_sampler
