// The AVX-512 kernels (the vdpbf16ps and AMX policies among them), compiled once under both masks.
#include "cascade/cpu/kernel.hpp"

#if CASCADE_X86
namespace cascade::cpu::avx512 {

template void attend<LimitMask>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t, int64_t,
                                const LimitMask&, float, float*, float*, Scratch&);
template void attend<UnifiedMask>(const KernelChoice&, const float*, int64_t, int, const KvView&, int, int64_t,
                                  int64_t, const UnifiedMask&, float, float*, float*, Scratch&);

}  // namespace cascade::cpu::avx512
#endif
