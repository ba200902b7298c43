// KIVI kernels for head_dim 64, bf16 activations: one instantiation per translation unit (compile-time budget).
#include "kiviLaunchTemplates.cuh"

namespace trtllm_kivi
{
namespace kernels
{
KIVI_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 64)
} // namespace kernels
} // namespace trtllm_kivi
