// The kernel switch and the portable tier's kernels, compiled once under both masks.
#include "cascade/cpu/kernel.hpp"

namespace cascade::cpu {

#define CASCADE_CPU_DISPATCH_INSTANTIATE(M)                                                                        \
  template void portable::attend<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t,  \
                                    int64_t, const M&, float, float*, float*, Scratch&);                          \
  template void run_kernel<M>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t, int64_t, \
                              const M&, float, float*, float*, Scratch&);

CASCADE_CPU_DISPATCH_INSTANTIATE(LimitMask)
CASCADE_CPU_DISPATCH_INSTANTIATE(UnifiedMask)

}  // namespace cascade::cpu
