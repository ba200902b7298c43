/*
 * KIVI kernels: per-(head_dim, dtype) launch templates. Explicitly instantiated once per combination in
 * src/instantiations/kiviKernels_d<D>_<dtype>.cu (TensorRT-LLM style) and declared extern in src/kiviLaunch.cu,
 * so each translation unit compiles one head_dim and one activation type (bits and scale dtype dispatch at run time).
 */
#pragma once

#include "kiviAppend.cuh"
#include "kiviAttention.cuh"
#include "kiviAttentionTc.cuh"

#include <cuda_runtime_api.h>

namespace trtllm_kivi
{
namespace kernels
{

//! Attention (+ combine when the keys are split). seqInfo: the prepare kernel's output in the workspace.
template <typename T, int kD>
cudaError_t launchKiviAttention(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    float* partialAcc, float* partialMl, cudaStream_t stream)
{
    dim3 const grid(plan.numTiles, p.numKvHeads, plan.numSplits);
    if (p.attentionImpl == kKIVI_ATTN_TENSOR_CORE)
    {
        kiviAttentionTcKernel<T, kD><<<grid, kATTN_THREADS, 0, stream>>>(p, plan, seqInfo, partialAcc, partialMl);
    }
    else
    {
        kiviAttentionKernel<T, kD><<<grid, kATTN_THREADS, 0, stream>>>(p, plan, seqInfo, partialAcc, partialMl);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || plan.numSplits == 1)
    {
        return err;
    }
    int64_t const pairs = int64_t(p.numTokens) * p.numHeads;
    int64_t const blocks = (pairs + kATTN_WARPS - 1) / kATTN_WARPS;
    kiviCombineKernel<T, kD>
        <<<static_cast<uint32_t>(blocks), kATTN_THREADS, 0, stream>>>(p, plan, seqInfo, partialAcc, partialMl);
    return cudaGetLastError();
}

//! Append: flush whole groups into the store, then write the window rows.
template <typename T, int kD>
cudaError_t launchKiviAppend(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    cudaStream_t stream)
{
    if (plan.flushGroupsPerSeq > 0)
    {
        int32_t const gy = plan.flushGroupsPerSeq < 1024 ? plan.flushGroupsPerSeq : 1024; // CTAs stride past it
        kiviFlushKernel<T, kD><<<dim3(p.batch, gy, p.numKvHeads), 128, 0, stream>>>(p, seqInfo);
        cudaError_t const err = cudaGetLastError();
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    kiviWindowKernel<T, kD><<<dim3(p.batch, p.numKvHeads), 128, 0, stream>>>(p, seqInfo);
    return cudaGetLastError();
}

#define KIVI_INSTANTIATE_LAUNCHERS(T, D)                                                                               \
    template cudaError_t launchKiviAttention<T, D>(                                                                    \
        KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*, float*, float*, cudaStream_t);                   \
    template cudaError_t launchKiviAppend<T, D>(KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*,          \
        cudaStream_t);

} // namespace kernels
} // namespace trtllm_kivi
