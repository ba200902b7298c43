/*
 * KIVI kernels: per-(head_dim, dtype) launch templates. Explicitly instantiated once per combination in
 * src/instantiations/kiviKernels_d<D>_<dtype>.cu (TensorRT-LLM style) and declared extern in src/kiviLaunch.cu,
 * so each translation unit compiles one head_dim and one activation type (bits and scale dtype dispatch at run time).
 */
#pragma once

#include "kiviAppend.cuh"
#include "kiviAttention.cuh"
#include "kiviDecodeMma.cuh"
#include "kiviPrefillMma.cuh"

#include <cuda_runtime_api.h>

namespace trtllm_kivi
{
namespace kernels
{

//! The default attention kernel for (T, D) and run-time bits, with its dynamic shared memory. Always opted in: the
//! 48 KB default limit counts static shared memory too (6.4 KB at D = 128), so a 48 KB stage ring (2/4-bit, D = 128)
//! does not launch without it (seen on an H200: cudaErrorInvalidValue, occupancy 0).
template <typename T, int kD, int kKB, int kVB>
cudaError_t mmaKernelFor(KiviStepParams const& p, void const** fn, int32_t* smemBytes)
{
    *fn = reinterpret_cast<void const*>(&kiviDecodeMmaKernel<T, kD, kKB, kVB>);
    *smemBytes = mmaSmemBytes<kD, kKB, kVB>(p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2, p.groupSize);
    return cudaFuncSetAttribute(*fn, cudaFuncAttributeMaxDynamicSharedMemorySize, *smemBytes);
}

template <typename T, int kD>
cudaError_t selectMmaKernel(KiviStepParams const& p, void const** fn, int32_t* smemBytes)
{
#define KIVI_MMA_CASE(KB, VB)                                                                                          \
    if (p.kBits == KB && p.vBits == VB)                                                                                \
    {                                                                                                                  \
        return mmaKernelFor<T, kD, KB, VB>(p, fn, smemBytes);                                                          \
    }
    KIVI_MMA_CASE(2, 2)
    KIVI_MMA_CASE(2, 4)
    KIVI_MMA_CASE(2, 8)
    KIVI_MMA_CASE(4, 2)
    KIVI_MMA_CASE(4, 4)
    KIVI_MMA_CASE(4, 8)
    KIVI_MMA_CASE(8, 2)
    KIVI_MMA_CASE(8, 4)
    KIVI_MMA_CASE(8, 8)
#undef KIVI_MMA_CASE
    return cudaErrorInvalidValue; // kiviValidate admits bits 2, 4, 8 only
}

//! Resident CTAs per SM of the default attention kernel for these params (occupancy query; no launch).
template <typename T, int kD>
int32_t mmaCtasPerSm(KiviStepParams const& p)
{
    void const* fn = nullptr;
    int32_t smem = 0;
    if (selectMmaKernel<T, kD>(p, &fn, &smem) != cudaSuccess)
    {
        return -1;
    }
    int32_t n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kMMA_THREADS, smem) != cudaSuccess)
    {
        return -1;
    }
    return n;
}

//! Attention (+ combine when the keys are split). seqInfo: the prepare kernel's output in the workspace.
template <typename T, int kD>
cudaError_t launchKiviAttention(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    float* partialAcc, float* partialMl, cudaStream_t stream)
{
    dim3 const grid(plan.numTiles, p.numKvHeads, plan.numSplits);
    void const* fn = nullptr;
    int32_t smem = 0;
    cudaError_t err = selectMmaKernel<T, kD>(p, &fn, &smem);
    if (err != cudaSuccess)
    {
        return err;
    }
    KiviStepParams pc = p;
    KiviLaunchPlan planc = plan;
    void* args[] = {&pc, &planc, &seqInfo, &partialAcc, &partialMl};
    err = cudaLaunchKernel(fn, grid, dim3(kMMA_THREADS), args, static_cast<size_t>(smem), stream);
    if (err != cudaSuccess)
    {
        return err;
    }
    if (plan.numPrefillTiles > 0) // sequences with >= kPREFILL_TILE_ROWS query rows (the prepare kernel's choice)
    {
        dim3 const pgrid(plan.numPrefillTiles, p.numKvHeads, plan.numSplits);
        kiviPrefillMmaKernel<T, kD><<<pgrid, kPF_THREADS, 0, stream>>>(p, plan, seqInfo, partialAcc, partialMl);
        err = cudaGetLastError();
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    if (plan.numSplits == 1)
    {
        return cudaSuccess;
    }
    int64_t const pairs = int64_t(p.numTokens) * p.numHeads;
    int64_t const blocks = (pairs + kATTN_WARPS - 1) / kATTN_WARPS;
    kiviCombineKernel<T, kD>
        <<<static_cast<uint32_t>(blocks), kATTN_THREADS, 0, stream>>>(p, plan, seqInfo, partialAcc, partialMl);
    return cudaGetLastError();
}

//! Append (one launch): CTA y = 0 of each (sequence, KV head) flushes the groups that read window rows, then writes
//! the window; CTAs y >= 1 flush the groups inside the chunk (at most floor(maxChunkLen / G) per sequence).
template <typename T, int kD>
cudaError_t launchKiviAppend(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    cudaStream_t stream)
{
    int32_t const chunkGroups = plan.maxChunkLen / p.groupSize;
    int32_t const gy = 1 + (chunkGroups < 1023 ? chunkGroups : 1023); // chunk CTAs stride past 1023
    int32_t const smem = appendSmemBytes<T, kD>(p.groupSize);
    cudaError_t const err
        = cudaFuncSetAttribute(&kiviAppendKernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
    {
        return err;
    }
    kiviAppendKernel<T, kD><<<dim3(p.batch, gy, p.numKvHeads), kAPPEND_THREADS, smem, stream>>>(p, seqInfo);
    return cudaGetLastError();
}

#define KIVI_INSTANTIATE_LAUNCHERS(T, D)                                                                               \
    template cudaError_t launchKiviAttention<T, D>(                                                                    \
        KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*, float*, float*, cudaStream_t);                   \
    template int32_t mmaCtasPerSm<T, D>(KiviStepParams const&);                                                        \
    template cudaError_t launchKiviAppend<T, D>(KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*,          \
        cudaStream_t);

} // namespace kernels
} // namespace trtllm_kivi
