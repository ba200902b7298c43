// KIVI kernels for head_dim 128, bf16 activations: one instantiation per translation unit (compile-time budget).
#include "kiviLaunchTemplates.cuh"

namespace trtllm_kivi
{
namespace kernels
{
KIVI_INSTANTIATE_LAUNCHERS(__nv_bfloat16, 128)
} // namespace kernels
} // namespace trtllm_kivi
