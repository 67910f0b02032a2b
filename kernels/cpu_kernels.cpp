// Explicit instantiations of the CPU kernels for every K/V type, head dims 64 and 128 (fixed-size fast paths)
// and any other head dim, under both masks.
#include "cascade/cpu/kernel.hpp"

namespace cascade::cpu {

#define CASCADE_CPU_KERNEL_INSTANTIATE(T, D, M)                                                                \
  template void attend_range<T, D, M>(const float*, int64_t, const KvView&, int, int64_t, int64_t, const M&, \
                                      float*, float*, Scratch&);
#define CASCADE_CPU_KERNEL_INSTANTIATE_ALL(M)            \
  CASCADE_CPU_KERNEL_INSTANTIATE(float, 64, M)           \
  CASCADE_CPU_KERNEL_INSTANTIATE(float, 128, M)          \
  CASCADE_CPU_KERNEL_INSTANTIATE(float, Eigen::Dynamic, M) \
  CASCADE_CPU_KERNEL_INSTANTIATE(f16, 64, M)             \
  CASCADE_CPU_KERNEL_INSTANTIATE(f16, 128, M)            \
  CASCADE_CPU_KERNEL_INSTANTIATE(f16, Eigen::Dynamic, M) \
  CASCADE_CPU_KERNEL_INSTANTIATE(bf16, 64, M)            \
  CASCADE_CPU_KERNEL_INSTANTIATE(bf16, 128, M)           \
  CASCADE_CPU_KERNEL_INSTANTIATE(bf16, Eigen::Dynamic, M)

CASCADE_CPU_KERNEL_INSTANTIATE_ALL(LimitMask)
CASCADE_CPU_KERNEL_INSTANTIATE_ALL(UnifiedMask)

// The dispatcher, which also holds the few-rows kernels.
template void attend_range_dispatch<LimitMask>(const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                               const LimitMask&, float*, float*, Scratch&);
template void attend_range_dispatch<UnifiedMask>(const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                                 const UnifiedMask&, float*, float*, Scratch&);

}  // namespace cascade::cpu
