#include "model/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cascade/error.hpp"

namespace cascade {

void SamplerParams::validate() const {
  CASCADE_CHECK(std::isfinite(temp) && temp >= 0, "temperature must be >= 0 (got ", temp, ")");
  CASCADE_CHECK(top_p >= 0 && top_p <= 1, "top-p must be in [0, 1] (got ", top_p, ")");
  CASCADE_CHECK(min_p >= 0 && min_p <= 1, "min-p must be in [0, 1] (got ", min_p, ")");
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed, uint64_t stream) {
  uint64_t x = seed;
  const uint64_t a = splitmix64(x);
  x = a ^ (stream * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull);
  for (uint64_t& w : s_) w = splitmix64(x);
}

uint64_t Rng::next() {
  const uint64_t r = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return r;
}

double Rng::uniform() { return double(next() >> 11) * 0x1p-53; }

int32_t argmax(const float* logits, int64_t n) {
  CASCADE_CHECK(n > 0, "argmax of an empty vector");
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return int32_t(best);
}

Sampler::Sampler(const SamplerParams& params, uint64_t stream) : params_(params), rng_(params.seed, stream) {
  params_.validate();
}

// The kept tokens and their renormalized probabilities, in no particular order. Sorting (the costly part on a
// large vocabulary) happens only when top-k or top-p needs it.
std::vector<std::pair<int32_t, double>> Sampler::filtered(const float* logits, int64_t n) const {
  CASCADE_CHECK(n > 0, "sampler: no logits");
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  const auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const bool top_k = params_.top_k > 0 && params_.top_k < n, top_p = params_.top_p < 1;
  if (top_k) {
    std::partial_sort(ids.begin(), ids.begin() + params_.top_k, ids.end(), better);
    ids.resize(size_t(params_.top_k));
  } else if (top_p) {
    std::sort(ids.begin(), ids.end(), better);
  }
  double mx = logits[ids[0]];
  for (int32_t id : ids) mx = std::max(mx, double(logits[id]));
  const double inv_t = 1.0 / double(params_.temp);
  std::vector<std::pair<int32_t, double>> p(ids.size());
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) sum += (p[i] = {ids[i], std::exp((double(logits[ids[i]]) - mx) * inv_t)}).second;
  for (auto& e : p) e.second /= sum;
  if (top_p) {  // p is sorted, most probable first
    double cum = 0;
    size_t keep = 0;
    while (keep < p.size()) {
      cum += p[keep++].second;
      if (cum >= params_.top_p) break;
    }
    p.resize(keep);
  }
  if (params_.min_p > 0) {
    double pmax = 0;
    for (const auto& e : p) pmax = std::max(pmax, e.second);
    const double floor = params_.min_p * pmax;
    std::erase_if(p, [&](const auto& e) { return e.second < floor; });
  }
  sum = 0;
  for (const auto& e : p) sum += e.second;
  for (auto& e : p) e.second /= sum;
  return p;
}

std::vector<std::pair<int32_t, double>> Sampler::distribution(const float* logits, int64_t n) const {
  if (params_.temp <= 0) return {{argmax(logits, n), 1.0}};
  auto p = filtered(logits, n);
  std::sort(p.begin(), p.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  return p;
}

// Neither top-k nor top-p: nothing to sort, and the weights w_i = exp((logit_i - max) / temp) have their largest
// exactly 1, so min-p keeps w_i >= min_p without normalizing first. One pass computes the weights (in f32, a
// relative error of ~1e-7 on each, the sum in f64) into a kept buffer, one walks them in id order to u * sum.
int32_t Sampler::sample_unsorted(const float* logits, int64_t n) {
  CASCADE_CHECK(n > 0, "sampler: no logits");
  float mx = logits[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, logits[i]);
  weights_.resize(size_t(n));
  const float inv_t = 1.0f / params_.temp, floor = params_.min_p;
  double part[4] = {0, 0, 0, 0};  // four sums: one chain of dependent additions would take longer than the rest
  for (int64_t i = 0; i < n; ++i) {
    const float w = std::exp((logits[i] - mx) * inv_t);
    weights_[size_t(i)] = w >= floor ? w : 0.0f;
    part[i % 4] += weights_[size_t(i)];
  }
  const double u = rng_.uniform() * ((part[0] + part[1]) + (part[2] + part[3]));
  double cum = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (weights_[size_t(i)] == 0.0f) continue;
    cum += weights_[size_t(i)];
    last = i;
    if (u < cum) return int32_t(i);
  }
  return int32_t(last);  // u beyond the rounded total
}

int32_t Sampler::sample(const float* logits, int64_t n) {
  if (params_.temp <= 0) return argmax(logits, n);
  if ((params_.top_k <= 0 || params_.top_k >= n) && params_.top_p >= 1) return sample_unsorted(logits, n);
  auto p = filtered(logits, n);
  // The draw walks the kept tokens in id order: logits that differ by rounding (another attention method,
  // another thread count) then move each token's interval by as little, never reorder the intervals.
  if (!std::is_sorted(p.begin(), p.end())) std::sort(p.begin(), p.end());
  const double u = rng_.uniform();
  double cum = 0;
  for (const auto& e : p) {
    cum += e.second;
    if (u < cum) return e.first;
  }
  return p.back().first;  // u beyond the rounded total
}

}  // namespace cascade
