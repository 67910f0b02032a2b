// Explicit instantiation of the CUDA attention kernels for q8_0 K/V (f16 tiles), head dim 96 (both tile shapes).
// One file per (dtype, head dim) so a parallel build spreads the kernels over the cores.
#include "cascade/cuda/kernel.cuh"

namespace cascade::cuda {
template void launch_attention<Q8_0, 96>(const LaunchArgs&, int, cudaStream_t);
template void configure_attention<Q8_0, 96>();
}  // namespace cascade::cuda
