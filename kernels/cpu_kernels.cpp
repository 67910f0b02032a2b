// The kernel switch and the portable (Eigen) kernels, compiled once for every K/V type under both masks.
#include "cascade/cpu/kernel.hpp"

namespace cascade::cpu {

#define CASCADE_CPU_PORTABLE_INSTANTIATE(T, M)                                                                 \
  template void portable::attend_heads<T, M>(const float*, int64_t, int, const KvView&, int, int64_t, int64_t, \
                                             const M&, float, float*, float*, Scratch&);
#define CASCADE_CPU_DISPATCH_INSTANTIATE(M)                                                                       \
  CASCADE_CPU_PORTABLE_INSTANTIATE(float, M)                                                                      \
  CASCADE_CPU_PORTABLE_INSTANTIATE(f16, M)                                                                        \
  CASCADE_CPU_PORTABLE_INSTANTIATE(bf16, M)                                                                       \
  CASCADE_CPU_PORTABLE_INSTANTIATE(Q8Code, M)                                                                     \
  template void run_kernel<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t, int64_t, \
                              const M&, float, float*, float*, Scratch&);

CASCADE_CPU_DISPATCH_INSTANTIATE(LimitMask)
CASCADE_CPU_DISPATCH_INSTANTIATE(UnifiedMask)

}  // namespace cascade::cpu
