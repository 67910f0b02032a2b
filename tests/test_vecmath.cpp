// vecmath against formulas evaluated in double on fresh random inputs (and extremes), and its promise: every tier
// gives the same bits, and a value's result does not depend on where it sits in a row or how long the row is.
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cascade/simd.hpp"
#include "model/vecmath.hpp"

namespace test_vecmath {

using namespace cascade;

namespace {

std::vector<Isa> tiers() {
  std::vector<Isa> t = {Isa::portable};
  if (detected_isa() >= Isa::avx2) t.push_back(Isa::avx2);
  if (detected_isa() >= Isa::avx512) t.push_back(Isa::avx512);
  return t;
}

// Random values over the ranges activations and logits take, and the edges: zeros of both signs, large values of
// both signs, values past exp2's smallest exponent.
std::vector<float> inputs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::uniform_real_distribution<float> wide(-200.0f, 200.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = i % 7 == 3 ? wide(rng) : d(rng);
  const float edges[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 88.0f, -88.0f, 1e4f, -1e4f, 3e38f, -3e38f};
  for (size_t i = 0; i < std::size(edges) && i < x.size(); ++i) x[i * 5 % x.size()] = edges[i];
  return x;
}

// 0.5 x (1 + tanh(y)) = x / (1 + exp(-2 y)): the second form in double, as the first loses all its digits to
// cancellation where tanh(y) is near -1.
double gelu_ref(double x) { return x / (1.0 + std::exp(-2.0 * std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("vecmath: silu and gelu times u against double, within the rounding of their exponent") {
  const int64_t n = 1000 + std::random_device{}() % 64;  // a tail on every tier
  const std::vector<float> x = inputs(n, 11), u = inputs(n, 12);
  for (Isa isa : tiers()) {
    IsaLimit cap(isa);
    CAPTURE(isa_name(isa));
    std::vector<float> gs = x, gg = x;
    vecmath::silu_mul(gs.data(), u.data(), n);
    vecmath::gelu_mul(gg.data(), u.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      CAPTURE(x[size_t(i)]);
      const double rs = silu_ref(x[size_t(i)]) * u[size_t(i)], rg = gelu_ref(x[size_t(i)]) * u[size_t(i)];
      if (std::fabs(rs) > FLT_MAX || std::fabs(rg) > FLT_MAX) continue;  // past float's range: inf is right
      // The exponent is rounded to float before exp2 sees it: a relative error of a few ulps of its size, on top of
      // exp2's own 2e-7 and the products' roundings.
      const double xs = x[size_t(i)], zg = std::sqrt(8.0 / M_PI) * (xs + 0.044715 * xs * xs * xs);
      CHECK(std::fabs(gs[size_t(i)] - rs) <= (1e-6 + 3e-7 * std::fabs(xs)) * std::fabs(rs) + 1e-30);
      CHECK(std::fabs(gg[size_t(i)] - rg) <= (1e-6 + 3e-7 * std::fabs(zg)) * std::fabs(rg) + 1e-30);
    }
  }
}

TEST_CASE("vecmath: exp2 and sigmoid against double, exp weights with a floor, the max") {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> neg(-130.0f, 0.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = neg(rng);
    CAPTURE(x);
    if (x < -126.0f) {
      CHECK(vecmath::exp2_neg(x) == 0.0f);
      continue;
    }
    const double want = std::exp2(double(x));
    CHECK(std::fabs(vecmath::exp2_neg(x) - want) <= 3e-7 * want);
    CHECK(std::fpclassify(vecmath::exp2_neg(x)) == FP_NORMAL);
  }
  CHECK(vecmath::exp2_neg(0.0f) == 1.0f);
  CHECK(vecmath::sigmoid(0.0f) == 0.5f);
  CHECK(vecmath::sigmoid(1e4f) == 1.0f);
  CHECK(vecmath::sigmoid(-1e4f) == 0.0f);
  const int64_t n = 700 + std::random_device{}() % 64;
  const std::vector<float> l = inputs(n, 13);
  const float mx = *std::max_element(l.begin(), l.end());
  const float temp = 0.7f, floor = 1e-3f, scale = 1.44269504088896340736f / temp;
  for (Isa isa : tiers()) {
    IsaLimit cap(isa);
    CAPTURE(isa_name(isa));
    CHECK(vecmath::max(l.data(), n) == mx);
    CHECK(vecmath::max(l.data() + 1, 1) == l[1]);
    std::vector<float> w(static_cast<size_t>(n));
    vecmath::exp_weights(l.data(), n, mx, scale, floor, w.data());
    for (int64_t i = 0; i < n; ++i) {
      const double want = std::exp((double(l[size_t(i)]) - mx) / temp);
      CAPTURE(l[size_t(i)]);
      if (want >= floor * (1 + 1e-6)) CHECK(std::fabs(w[size_t(i)] - want) <= 1e-6 * want);
      else if (want < floor * (1 - 1e-6)) CHECK(w[size_t(i)] == 0.0f);
    }
  }
}

TEST_CASE("vecmath: every tier gives the same bits, wherever a value sits in a row of any length") {
  const int64_t n = 515;
  const std::vector<float> x = inputs(n, 21), u = inputs(n, 22);
  std::vector<std::vector<float>> silu, gelu, wts;
  const float mx = vecmath::max(x.data(), n);
  for (Isa isa : tiers()) {
    IsaLimit cap(isa);
    std::vector<float> s = x, g = x, w(static_cast<size_t>(n));
    vecmath::silu_mul(s.data(), u.data(), n);
    vecmath::gelu_mul(g.data(), u.data(), n);
    vecmath::exp_weights(x.data(), n, mx, 1.3f, 0.0f, w.data());
    silu.push_back(s), gelu.push_back(g), wts.push_back(w);
    // The same values in shorter rows that start anywhere: the same bits.
    for (int64_t off : {1, 7, 16, 100}) {
      for (int64_t len : {1, 5, 17, 64, 200}) {
        if (off + len > n) continue;
        std::vector<float> s2(x.begin() + off, x.begin() + off + len), g2 = s2, w2(static_cast<size_t>(len));
        vecmath::silu_mul(s2.data(), u.data() + off, len);
        vecmath::gelu_mul(g2.data(), u.data() + off, len);
        vecmath::exp_weights(x.data() + off, len, mx, 1.3f, 0.0f, w2.data());
        CAPTURE(off);
        CAPTURE(len);
        CHECK(same_bits(s2, std::vector<float>(s.begin() + off, s.begin() + off + len)));
        CHECK(same_bits(g2, std::vector<float>(g.begin() + off, g.begin() + off + len)));
        CHECK(same_bits(w2, std::vector<float>(w.begin() + off, w.begin() + off + len)));
      }
    }
  }
  for (size_t t = 1; t < silu.size(); ++t) {
    CAPTURE(t);
    CHECK(same_bits(silu[t], silu[0]));
    CHECK(same_bits(gelu[t], gelu[0]));
    CHECK(same_bits(wts[t], wts[0]));
  }
}

}  // namespace test_vecmath
