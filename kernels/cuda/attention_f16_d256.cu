// Explicit instantiation of the CUDA attention kernels for f16 K/V, head dim 256 (both tile shapes).
// One file per (dtype, head dim) so a parallel build spreads the kernels over the cores.
#include "cascade/cuda/kernel.cuh"

namespace cascade::cuda {
template void launch_attention<__half, 256>(const LaunchArgs&, int, cudaStream_t);
template void configure_attention<__half, 256>();
}  // namespace cascade::cuda
