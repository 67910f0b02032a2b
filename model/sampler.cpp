#include "model/sampler.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

#include "cascade/error.hpp"
#include "model/vecmath.hpp"

namespace cascade {

void SamplerParams::validate() const {
  CASCADE_CHECK(std::isfinite(temp) && temp >= 0, "temperature must be >= 0 (got ", temp, ")");
  CASCADE_CHECK(top_p >= 0 && top_p <= 1, "top-p must be in [0, 1] (got ", top_p, ")");
  CASCADE_CHECK(min_p >= 0 && min_p <= 1, "min-p must be in [0, 1] (got ", min_p, ")");
  CASCADE_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0,
                "the repetition penalty must be > 0 (got ", repetition_penalty, ")");
  CASCADE_CHECK(std::isfinite(frequency_penalty) && std::isfinite(presence_penalty),
                "the frequency and presence penalties must be finite");
  for (const auto& [id, bias] : logit_bias)
    CASCADE_CHECK(std::isfinite(bias), "the logit bias of token ", id, " must be finite");
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// e^x for x <= 0 in f32, relative error ~1e-7 (and 0 below e^-87), with no call and no branch, so that a loop over
// it vectorizes: e^x = 2^n 2^f, t = x log2(e), n = t rounded, f = t - n in [-1/2, 1/2], 2^f by its Taylor series to
// the 7th power (the next term is below 6e-9), 2^n placed in the exponent field.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23: rounds to the nearest integer
  const float f = (t - n) * 0.693147180559945309f;  // (t - n) ln 2: 2^(t - n) = e^f
  float p = 1.0f / 5040;
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}
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

namespace {

// The passes over a row of logits below work on kLanes independent lanes, so that their loops vectorize.
constexpr int64_t kLanes = 16;

float max_of(const float* x, int64_t n) {
  float lane[kLanes];
  std::fill_n(lane, kLanes, x[0]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = std::max(lane[j], x[i + j]);
  float mx = *std::max_element(lane, lane + kLanes);
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// sum_i e^(x_i - mx), x_i <= mx: 16 terms a lane in f32, then in f64.
double sum_exp(const float* x, int64_t n, float mx) {
  constexpr int64_t kBlock = 16 * kLanes;
  double sum = 0;
  int64_t i0 = 0;
  for (; i0 + kBlock <= n; i0 += kBlock) {
    float lane[kLanes] = {};
    for (int64_t k = i0; k < i0 + kBlock; k += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) lane[j] += exp_nonpositive(x[k + j] - mx);
    for (float v : lane) sum += v;
  }
  for (; i0 < n; ++i0) sum += exp_nonpositive(x[i0] - mx);
  return sum;
}

// The ids of the k largest, largest first (equal ones: lower id first). One pass keeps them sorted; a block of
// lanes none of which beats the k-th kept is skipped at once (a later id must be strictly larger to enter).
std::vector<int32_t> top_ids(const float* x, int64_t n, int k) {
  std::vector<int32_t> best;
  best.reserve(size_t(k) + 1);
  const auto better = [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  for (int64_t i0 = 0; i0 < n && k > 0; i0 += kLanes) {
    const int64_t i1 = std::min(n, i0 + kLanes);
    if (int(best.size()) == k && i1 - i0 == kLanes) {
      const float floor = x[best.back()];
      bool any = false;
      for (int64_t j = 0; j < kLanes; ++j) any |= x[i0 + j] > floor;
      if (!any) continue;
    }
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t id = int32_t(i);
      if (int(best.size()) == k && !better(id, best.back())) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), id, better), id);
      if (int(best.size()) > k) best.pop_back();
    }
  }
  return best;
}

}  // namespace

TokenLogprob token_logprob(const float* logits, int64_t n, int32_t token, int n_top) {
  CASCADE_CHECK(n > 0 && token >= 0 && token < n, "token_logprob: token ", token, " outside [0, ", n, ")");
  CASCADE_CHECK(n_top >= 0 && n_top <= n, "token_logprob: ", n_top, " top tokens of ", n);
  const float mx = max_of(logits, n);
  const double lse = double(mx) + std::log(sum_exp(logits, n, mx));
  TokenLogprob out;
  out.token = token;
  out.logprob = float(double(logits[token]) - lse);
  for (int32_t id : top_ids(logits, n, n_top)) out.top.push_back({id, float(double(logits[id]) - lse)});
  return out;
}

Sampler::Sampler(const SamplerParams& params, uint64_t stream) : params_(params), rng_(params.seed, stream) {
  params_.validate();
}

void Sampler::set_prompt(std::span<const int32_t> prompt) {
  if (params_.repetition_penalty == 1) return;
  for (int32_t t : prompt) seen_[t].in_prompt = true;
}

void Sampler::adjust(float* logits, int64_t n, std::vector<std::pair<int32_t, float>>* saved) const {
  const auto set = [&](int32_t id, float v) {
    if (saved) saved->push_back({id, logits[id]});
    logits[id] = v;
  };
  for (const auto& [id, bias] : params_.logit_bias)
    if (id >= 0 && id < n) set(id, logits[id] + bias);
  const float r = params_.repetition_penalty;
  for (const auto& [id, seen] : seen_) {
    if (id < 0 || id >= n) continue;
    float v = logits[id];
    if (r != 1) v = v > 0 ? v / r : v * r;  // every token seen is in the prompt or generated
    if (seen.generated > 0) v -= float(seen.generated) * params_.frequency_penalty + params_.presence_penalty;
    set(id, v);
  }
}

int32_t Sampler::sample(float* logits, int64_t n) {
  if (!params_.adjusts()) return draw(logits, n);
  saved_.clear();
  adjust(logits, n, &saved_);
  const int32_t tok = draw(logits, n);
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) logits[it->first] = it->second;
  if (penalizes()) ++seen_[tok].generated;
  return tok;
}

int32_t Sampler::sample(const float* logits, int64_t n) {
  if (!params_.adjusts()) return draw(logits, n);
  copy_.assign(logits, logits + n);
  return sample(copy_.data(), n);
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
  for (size_t i = 0; i < ids.size(); ++i)
    sum += (p[i] = {ids[i], std::exp((double(logits[ids[i]]) - mx) * inv_t)}).second;
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

std::vector<std::pair<int32_t, double>> Sampler::distribution(const float* raw, int64_t n) const {
  std::vector<float> copy;
  const float* logits = raw;
  if (params_.adjusts()) {
    copy.assign(raw, raw + n);
    adjust(copy.data(), n, nullptr);
    logits = copy.data();
  }
  if (params_.temp <= 0) return {{argmax(logits, n), 1.0}};
  auto p = filtered(logits, n);
  std::sort(p.begin(), p.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  return p;
}

// Neither top-k nor top-p: nothing to sort, and the weights w_i = exp((logit_i - max) / temp) have their largest
// exactly 1, so min-p keeps w_i >= min_p without normalizing first. The weights come from vecmath (relative error
// ~2e-7 each) into a kept buffer; the sums of blocks of kDrawBlock of them are taken in f64, the total is their sum
// in block order, and the draw u * total finds its block from the block sums, then its token inside the block in
// id order. Every step is one fixed order, so a draw depends on the logits and the random number alone.
int32_t Sampler::sample_unsorted(const float* logits, int64_t n) {
  CASCADE_CHECK(n > 0, "sampler: no logits");
  constexpr int64_t kDrawBlock = 256;
  constexpr float kLog2e = 1.44269504088896340736f;
  const float mx = vecmath::max(logits, n);
  weights_.resize(size_t(n));
  const float* w = weights_.data();
  vecmath::exp_weights(logits, n, mx, kLog2e / params_.temp, params_.min_p, weights_.data());
  const int64_t n_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  block_sums_.resize(size_t(n_blocks));
  double total = 0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    double part[4] = {0, 0, 0, 0};  // four chains: one chain of dependent additions would take longer than the rest
    const int64_t i1 = std::min(n, (b + 1) * kDrawBlock);
    for (int64_t i = b * kDrawBlock; i < i1; ++i) part[i % 4] += w[i];
    block_sums_[size_t(b)] = (part[0] + part[1]) + (part[2] + part[3]);
    total += block_sums_[size_t(b)];
  }
  const double u = rng_.uniform() * total;
  double cum = 0;
  int64_t block = -1;  // the block the draw falls in; past the rounded total, the last with any weight
  double before = 0;   // the sum of the blocks before it
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (block_sums_[size_t(b)] == 0) continue;
    block = b;
    before = cum;
    if (u < cum + block_sums_[size_t(b)]) break;
    cum += block_sums_[size_t(b)];
  }
  if (block < 0) return 0;  // no weight at all: NaN logits
  cum = before;
  int64_t last = block * kDrawBlock;
  for (int64_t i = block * kDrawBlock, i1 = std::min(n, (block + 1) * kDrawBlock); i < i1; ++i) {
    if (w[i] == 0.0f) continue;
    cum += w[i];
    last = i;
    if (u < cum) return int32_t(i);
  }
  return int32_t(last);  // u beyond the rounded sum
}

int32_t Sampler::draw(const float* logits, int64_t n) {
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
