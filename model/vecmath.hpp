// Elementwise functions of the forward pass and the sampler over whole rows: the gated activations of the
// feed-forward block and the exponentials of sampling, 16 or 8 values at a time on the AVX-512 and AVX2 tiers.
//
// One formula for every tier, made of operations IEEE rounds the same way on each (fma, division, rounding to the
// nearest integer, exact scaling by a power of two), so every tier gives the same bits for the same input, and a
// value's result depends on that value alone: not on its place in the row, the row's length or the rows beside it
// (the batch-invariance of linear.hpp carries through).
//
//   exp2(x), x <= 0:  x = n + f, n = round(x), f in [-1/2, 1/2]; 2^f by a degree-5 polynomial with its constant
//                     term exactly 1 (relative error about 2e-7), times 2^n; exactly 0 for x below -126 (and
//                     NaN), so never a subnormal
//   sigmoid(z):       t = exp2(-|z| log2 e); 1 / (1 + t) for z >= 0, t / (1 + t) otherwise (no overflow anywhere)
//   silu(x)  = x sigmoid(x)
//   gelu(x)  = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)), which is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
//              the tanh form llama.cpp's GELU computes
#pragma once

#include <cstdint>

namespace cascade::vecmath {

// g[i] = silu(g[i]) * u[i] and g[i] = gelu(g[i]) * u[i], i < n.
void silu_mul(float* g, const float* u, int64_t n);
void gelu_mul(float* g, const float* u, int64_t n);

// The largest of x[0, n), n >= 1 (NaN is not ordered: rows with NaN give one of their other values or NaN).
float max(const float* x, int64_t n);

// w[i] = exp2((x[i] - mx) * scale), i < n, where that is >= floor, else 0; scale > 0 (log2 e / temperature) and
// mx >= every x[i].
void exp_weights(const float* x, int64_t n, float mx, float scale, float floor, float* w);

// The portable tier's exp2 and sigmoid (the formulas above), for tests to compare with.
float exp2_neg(float x);
float sigmoid(float z);

}  // namespace cascade::vecmath
