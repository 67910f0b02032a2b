// The attention state on the device: the same math as state.hpp (natural-log lse; the empty state is
// (o = 0, lse = -inf); merging with it is the identity; two empties stay empty, never NaN), as device
// functions and as stream-ordered kernels for any number of rows and any head dim (grid-stride loops, one
// warp per row, so no launch-size limit applies).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cascade/cuda/common.cuh"

namespace cascade::cuda {

namespace state_detail {
__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
inline unsigned grid_for(int64_t n_warps, int threads) {
  const int64_t blocks = (n_warps * 32 + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));  // the loops stride the rest
}
}  // namespace state_detail

// Weights of two states in their merge: o = ca * o_a + cb * o_b, lse = *lse_out. Empty inputs follow the
// host rules exactly (state.hpp's merge_state_inplace).
__device__ __forceinline__ void merge_weights(float lse_a, float lse_b, float* ca, float* cb, float* lse_out) {
  if (lse_b == -INFINITY) {
    *ca = 1.0f, *cb = 0.0f, *lse_out = lse_a;
    return;
  }
  if (lse_a == -INFINITY) {
    *ca = 0.0f, *cb = 1.0f, *lse_out = lse_b;
    return;
  }
  const float m = fmaxf(lse_a, lse_b);
  const float wa = expf(lse_a - m), wb = expf(lse_b - m);
  const float inv = 1.0f / (wa + wb);
  *ca = wa * inv, *cb = wb * inv, *lse_out = m + logf(wa + wb);
}

// Row-wise in-place merge: o_a (n_rows, head_dim), lse_a (n_rows) absorb o_b, lse_b of the same shape.
template <int Unused = 0>
__global__ void merge_states_inplace_kernel(float* __restrict__ o_a, float* __restrict__ lse_a,
                                            const float* __restrict__ o_b, const float* __restrict__ lse_b,
                                            int64_t n_rows, int64_t head_dim) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = warp; r < n_rows; r += n_warps) {
    float ca, cb, l;
    merge_weights(lse_a[r], lse_b[r], &ca, &cb, &l);
    __syncwarp();  // every lane has read lse_a[r] before lane 0 overwrites it
    float* oa = o_a + r * head_dim;
    const float* ob = o_b + r * head_dim;
    if (ca == 0.0f) {  // a empty: take b
      for (int64_t i = lane; i < head_dim; i += 32) oa[i] = ob[i];
    } else if (cb != 0.0f) {
      for (int64_t i = lane; i < head_dim; i += 32) oa[i] = ca * oa[i] + cb * ob[i];
    }
    if (lane == 0) lse_a[r] = l;
  }
}

// n-ary merge: state j of row r is o[(j * n_rows + r) * head_dim ...], lse[j * n_rows + r]. Writes
// o_out (n_rows, head_dim) and lse_out (n_rows; may be nullptr). One pass over the weights, as
// state.hpp's merge_states.
template <int Unused = 0>
__global__ void merge_states_kernel(int64_t n, const float* __restrict__ o, const float* __restrict__ lse,
                                    float* __restrict__ o_out, float* __restrict__ lse_out, int64_t n_rows,
                                    int64_t head_dim) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = warp; r < n_rows; r += n_warps) {
    float m = -INFINITY;
    for (int64_t j = lane; j < n; j += 32) m = fmaxf(m, lse[j * n_rows + r]);
    m = state_detail::warp_max(m);
    float* out = o_out + r * head_dim;
    if (m == -INFINITY) {
      for (int64_t i = lane; i < head_dim; i += 32) out[i] = 0.0f;
      if (lane == 0 && lse_out) lse_out[r] = -INFINITY;
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = lane; j < n; j += 32) sum += expf(lse[j * n_rows + r] - m);  // exp(-inf) = 0 for empties
    sum = state_detail::warp_sum(sum);
    const float inv = 1.0f / sum;
    for (int64_t i = lane; i < head_dim; i += 32) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float w = expf(lse[j * n_rows + r] - m);
        if (w != 0.0f) acc += w * o[(j * n_rows + r) * head_dim + i];
      }
      out[i] = acc * inv;
    }
    if (lane == 0 && lse_out) lse_out[r] = m + logf(sum);
  }
}

// Merges the partial states listed per output: output i merges slots[begin[i], begin[i + 1]) of the
// partial buffers part_o (slots, head_dim), part_lse (slots). Writes o (n_out, head_dim), lse (n_out; may
// be nullptr). Outputs with no slot get the empty state.
template <int Unused = 0>
__global__ void merge_slots_kernel(const int64_t* __restrict__ begin, const int64_t* __restrict__ slots,
                                   const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                   int64_t n_out, int64_t head_dim, float* __restrict__ o,
                                   float* __restrict__ lse) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t i = warp; i < n_out; i += n_warps) {
    const int64_t b = begin[i], n = begin[i + 1] - b;
    float* out = o + i * head_dim;
    if (n == 1) {  // one part: a copy
      const int64_t s = slots[b];
      for (int64_t d = lane; d < head_dim; d += 32) out[d] = part_o[s * head_dim + d];
      if (lane == 0 && lse) lse[i] = part_lse[s];
      continue;
    }
    float m = -INFINITY;
    for (int64_t j = lane; j < n; j += 32) m = fmaxf(m, part_lse[slots[b + j]]);
    m = state_detail::warp_max(m);
    if (m == -INFINITY) {
      for (int64_t d = lane; d < head_dim; d += 32) out[d] = 0.0f;
      if (lane == 0 && lse) lse[i] = -INFINITY;
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = lane; j < n; j += 32) sum += expf(part_lse[slots[b + j]] - m);
    sum = state_detail::warp_sum(sum);
    const float inv = 1.0f / sum;
    for (int64_t d = lane; d < head_dim; d += 32) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = slots[b + j];
        const float w = expf(part_lse[s] - m);
        if (w != 0.0f) acc += w * part_o[s * head_dim + d];
      }
      out[d] = acc * inv;
    }
    if (lane == 0 && lse) lse[i] = m + logf(sum);
  }
}

// Host launchers: stream-ordered, no allocation, every launch checked.
inline void merge_states_inplace(cudaStream_t stream, float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                                 int64_t n_rows, int64_t head_dim) {
  CASCADE_CHECK(n_rows >= 0 && head_dim > 0, "cuda::merge_states_inplace: n_rows (", n_rows,
                ") must be >= 0 and head_dim (", head_dim, ") > 0");
  if (n_rows == 0) return;
  CASCADE_CHECK(o_a && lse_a && o_b && lse_b, "cuda::merge_states_inplace: null state pointer with ", n_rows, " rows");
  merge_states_inplace_kernel<<<state_detail::grid_for(n_rows, 256), 256, 0, stream>>>(o_a, lse_a, o_b, lse_b, n_rows,
                                                                                        head_dim);
  CASCADE_CUDA_CHECK(cudaGetLastError(), "launching merge_states_inplace");
}

inline void merge_states(cudaStream_t stream, int64_t n, const float* o, const float* lse, float* o_out,
                         float* lse_out, int64_t n_rows, int64_t head_dim) {
  CASCADE_CHECK(n >= 0 && n_rows >= 0 && head_dim > 0, "cuda::merge_states: bad sizes (n ", n, ", rows ", n_rows,
                ", head_dim ", head_dim, ")");
  if (n_rows == 0) return;
  CASCADE_CHECK(o_out && (n == 0 || (o && lse)), "cuda::merge_states: null pointer with ", n_rows, " rows");
  merge_states_kernel<<<state_detail::grid_for(n_rows, 256), 256, 0, stream>>>(n, o, lse, o_out, lse_out, n_rows,
                                                                               head_dim);
  CASCADE_CUDA_CHECK(cudaGetLastError(), "launching merge_states");
}

// merge_slots_kernel's launcher (device pointers; see the kernel).
inline void merge_slots(cudaStream_t stream, const int64_t* begin, const int64_t* slots, const float* part_o,
                        const float* part_lse, int64_t n_out, int64_t head_dim, float* o, float* lse) {
  if (n_out == 0) return;
  merge_slots_kernel<<<state_detail::grid_for(n_out, 256), 256, 0, stream>>>(begin, slots, part_o, part_lse, n_out,
                                                                            head_dim, o, lse);
  CASCADE_CUDA_CHECK(cudaGetLastError(), "launching the merge of ", n_out, " outputs");
}

}  // namespace cascade::cuda
