// Choosing the next token from logits: greedy, or a draw from a filtered, renormalized distribution.
//
// Before anything else the logits are adjusted, token by token (x_t: the logit of token t):
//   a. logit_bias:          x_t += bias_t;
//   b. repetition_penalty:  for every token t in the prompt or generated so far, x_t / r when x_t > 0, else x_t * r
//                           (CTRL's penalty, as Hugging Face, vLLM and llama.cpp define it; r = 1: off);
//   c. frequency_penalty, presence_penalty:  x_t -= c_t * frequency + (c_t > 0) * presence, c_t the times t was
//                           generated so far (OpenAI's definition; the prompt does not count).
// Only the tokens named by the bias, the prompt or the generated tokens change, so the adjustment costs as many
// operations as there are such distinct tokens, not the vocabulary. The sampler counts the tokens it draws
// itself; the prompt is given once (set_prompt).
//
// Then, with temp > 0, a draw is made from
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
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cascade {

struct SamplerParams {
  float temp = 0.8f;
  int32_t top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  uint64_t seed = 0;
  float repetition_penalty = 1;  // > 0; 1: off
  float frequency_penalty = 0;   // any finite value (the API takes [-2, 2]); 0: off
  float presence_penalty = 0;    // any finite value (the API takes [-2, 2]); 0: off
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, added to its logit); ids checked by the caller
  // Error on temp < 0, top_p outside [0, 1], min_p outside [0, 1], repetition_penalty <= 0, NaN or infinity
  void validate() const;
  bool adjusts() const {
    return repetition_penalty != 1 || frequency_penalty != 0 || presence_penalty != 0 || !logit_bias.empty();
  }
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

// A token's log-probability under the model, log softmax(logits)_token (natural log), and the n_top most probable
// tokens with theirs, most probable first (equal ones: lower id first). From the logits as given: the sampler's
// adjustments, temperature and filters change what is drawn, not these.
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // (id, logprob), n_top of them (fewer when n is smaller)
};
// logits: (n). n_top in [0, n]. One pass for the log-sum-exp and one for the top tokens.
TokenLogprob token_logprob(const float* logits, int64_t n, int32_t token, int n_top);

class Sampler {
 public:
  Sampler(const SamplerParams& params, uint64_t stream);
  // The prompt the drawn tokens follow (repetition_penalty counts its tokens); a no-op when the penalty is off.
  void set_prompt(std::span<const int32_t> prompt);
  // Draws the next token from logits (n), adjusted as above, and counts it as generated. The mutable overload
  // adjusts the row in place for the draw and puts every value back before it returns (rows shared by several
  // samplers stay as they were); the const one copies the row first when there is something to adjust. The two
  // draw the same token.
  int32_t sample(float* logits, int64_t n);
  int32_t sample(const float* logits, int64_t n);
  // The distribution sample() draws from next: (id, probability), most probable first, summing to 1.
  // Greedy gives {(argmax, 1)}.
  std::vector<std::pair<int32_t, double>> distribution(const float* logits, int64_t n) const;
  const SamplerParams& params() const { return params_; }

 private:
  struct Seen {
    int32_t generated = 0;   // times drawn
    bool in_prompt = false;  // repetition_penalty only
  };
  bool penalizes() const {
    return params_.repetition_penalty != 1 || params_.frequency_penalty != 0 || params_.presence_penalty != 0;
  }
  // Adjusts logits (n) in place; with `saved`, appends each changed value's original, in the order of the changes.
  void adjust(float* logits, int64_t n, std::vector<std::pair<int32_t, float>>* saved) const;
  int32_t draw(const float* logits, int64_t n);
  std::vector<std::pair<int32_t, double>> filtered(const float* logits, int64_t n) const;
  int32_t sample_unsorted(const float* logits, int64_t n);
  SamplerParams params_;
  Rng rng_;
  std::vector<float> weights_;      // sample_unsorted's, kept between draws
  std::vector<double> block_sums_;  // sample_unsorted's
  std::vector<float> copy_;         // the const sample()'s adjusted copy of the row
  std::unordered_map<int32_t, Seen> seen_;  // tokens of the prompt and the draws (only when adjusting)
  std::vector<std::pair<int32_t, float>> saved_;  // (id, original logit), in the order they were changed
};

}  // namespace cascade
