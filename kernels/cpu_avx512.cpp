// The AVX-512 kernels (and the bf16 dot-product one), compiled once under both masks.
#include "cascade/cpu/kernel.hpp"

#if CASCADE_X86
namespace cascade::cpu::avx512 {

template void attend<LimitMask>(bool, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                const LimitMask&, float, Bf16Kernel, float*, float*, Scratch&);
template void attend<UnifiedMask>(bool, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                  const UnifiedMask&, float, Bf16Kernel, float*, float*, Scratch&);

}  // namespace cascade::cpu::avx512
#endif
