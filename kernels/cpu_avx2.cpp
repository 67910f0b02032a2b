// The AVX2 + FMA + F16C kernels, compiled once under both masks.
#include "cascade/cpu/kernel.hpp"

#if CASCADE_X86
namespace cascade::cpu::avx2 {

template void attend<LimitMask>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                const LimitMask&, float, float*, float*, Scratch&);
template void attend<UnifiedMask>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t,
                                  int64_t, const UnifiedMask&, float, float*, float*, Scratch&);

}  // namespace cascade::cpu::avx2
#endif
