// Choosing the next token from logits: greedy, or a draw from a filtered, renormalized distribution.
//
// With temp > 0 a draw is made from
//   1. top-k:  the k largest logits (k <= 0 or k >= n_vocab: all), ties broken by the lower id;
//   2. p_i = softmax(logit_i / temp) over those;
//   3. top-p:  the smallest set of most probable tokens whose probability sums to >= top_p (top_p >= 1: all);
//   4. min-p:  of those, the tokens with p_i >= min_p * max p (min_p <= 0: all);
//   5. renormalized, one uniform draw u in [0, 1) picks the token whose cumulative interval holds u, the
//      kept tokens taken in id order (so logits that differ by rounding shift the intervals slightly but
//      never reorder them).
// temp <= 0 is greedy: the argmax (the lowest id among equal maxima); no random number is used.
//
// Each sequence owns its random stream, seeded from (seed, stream index): what a sequence samples does not
// depend on the attention method or on how many sequences run beside it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace cascade {

struct SamplerParams {
  float temp = 0.8f;
  int32_t top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  uint64_t seed = 0;
  void validate() const;  // Error on temp < 0, top_p outside [0, 1], min_p outside [0, 1], NaN
};

// xoshiro256** seeded through splitmix64 from (seed, stream): a fixed, portable sequence.
class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream);
  uint64_t next();
  double uniform();  // [0, 1), 53 random bits
 private:
  uint64_t s_[4];
};

int32_t argmax(const float* logits, int64_t n);

class Sampler {
 public:
  Sampler(const SamplerParams& params, uint64_t stream);
  int32_t sample(const float* logits, int64_t n);
  // The distribution sample() draws from: (id, probability), most probable first, summing to 1.
  // Greedy gives {(argmax, 1)}.
  std::vector<std::pair<int32_t, double>> distribution(const float* logits, int64_t n) const;
  const SamplerParams& params() const { return params_; }

 private:
  std::vector<std::pair<int32_t, double>> filtered(const float* logits, int64_t n) const;
  int32_t sample_unsorted(const float* logits, int64_t n);
  SamplerParams params_;
  Rng rng_;
  std::vector<float> weights_;  // sample_unsorted's, kept between draws
};

}  // namespace cascade
