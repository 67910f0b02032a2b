// What every CUDA header of cascade shares: CUDA errors as cascade::Error, the device's properties. K/V elements on the
// device are __half (f16) and __nv_bfloat16 (bf16), bit-identical to cascade::f16 and cascade::bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cascade/error.hpp"

// CASCADE_CUDA_CHECK(call, "what was being done"): throws cascade::Error naming the call's error.
#define CASCADE_CUDA_CHECK(call, ...)                                                                     \
  do {                                                                                                    \
    const cudaError_t cascade_cuda_err_ = (call);                                                         \
    if (cascade_cuda_err_ != cudaSuccess)                                                                 \
      ::cascade::detail::fail(__VA_ARGS__, ": ", cudaGetErrorName(cascade_cuda_err_), " (",              \
                              cudaGetErrorString(cascade_cuda_err_), ")");                              \
  } while (0)

namespace cascade::cuda {

// Number of CUDA devices, 0 when there is none or no driver (never throws).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

// Multiprocessors of the current device.
inline int multiprocessor_count() {
  int dev = 0, n = 0;
  CASCADE_CUDA_CHECK(cudaGetDevice(&dev), "cudaGetDevice");
  CASCADE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "reading the SM count");
  return n;
}

// Whether p points to memory the device can read (device or managed memory).
inline bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace cascade::cuda
