// Explicit instantiation of the CUDA attention kernels for bf16 K/V, head dim 80 (both tile shapes).
// One file per (dtype, head dim) so a parallel build spreads the kernels over the cores.
#include "cascade/cuda/kernel.cuh"

namespace cascade::cuda {
template void launch_attention<__nv_bfloat16, 80>(const LaunchArgs&, int, cudaStream_t);
template void configure_attention<__nv_bfloat16, 80>();
}  // namespace cascade::cuda
