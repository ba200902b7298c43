// KIVI kernels for head_dim 128, fp16 activations: one instantiation per translation unit (compile-time budget).
#include "kiviLaunchTemplates.cuh"

namespace trtllm_kivi
{
namespace kernels
{
KIVI_INSTANTIATE_LAUNCHERS(half, 128)
} // namespace kernels
} // namespace trtllm_kivi
