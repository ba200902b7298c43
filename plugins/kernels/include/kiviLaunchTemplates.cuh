/*
 * KIVI kernels: per-(head_dim, dtype) launch templates. Explicitly instantiated once per combination in
 * src/instantiations/kiviKernels_d<D>_<dtype>.cu (TensorRT-LLM style) and declared extern in src/kiviLaunch.cu,
 * so each translation unit compiles one head_dim and one activation type (bits and scale dtype dispatch at run time).
 */
#pragma once

#include "kiviAppend.cuh"
#include "kiviAttention.cuh"
#include "kiviDecodeMma.cuh"
#include "kiviDecodeSplit.cuh"
#include "kiviDecodeVariants.h"
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

//! The baseline kernel (decode variant 1): compiled for the headline combination only (head_dim 128, 2-bit K and
//! V); kiviValidate refuses it elsewhere.
template <typename T, int kD>
cudaError_t selectMmaKernel(KiviStepParams const& p, void const** fn, int32_t* smemBytes)
{
    if constexpr (kiviIsHeadlineCombo(kD, 2, 2))
    {
        if (p.kBits == 2 && p.vBits == 2)
        {
            return mmaKernelFor<T, kD, 2, 2>(p, fn, smemBytes);
        }
    }
    return cudaErrorInvalidValue;
}

//! The split kernel with kS stages for (T, D, bits), its dynamic shared memory opted in whatever its size.
template <typename T, int kD, int kKB, int kVB, int kS>
cudaError_t splitKernelWith(KiviStepParams const& p, void const** fn, int32_t* smemBytes)
{
    *fn = reinterpret_cast<void const*>(&kiviDecodeSplitKernel<T, kD, kKB, kVB, kS>);
    *smemBytes = kiviSplitSmemBytes(kD, kKB, kVB, kS, p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2, p.groupSize);
    return cudaFuncSetAttribute(*fn, cudaFuncAttributeMaxDynamicSharedMemorySize, *smemBytes);
}

//! The stage counts compiled: every combination's default (kiviSplitDefaultStages) and, for the headline
//! combination only, the tuning variants' 3 and 6 (kiviDecodeVariants.h).
template <typename T, int kD, int kKB, int kVB>
cudaError_t splitKernelFor(KiviStepParams const& p, int32_t variant, void const** fn, int32_t* smemBytes)
{
    constexpr int32_t kDEFAULT = kiviSplitDefaultStages(kD, kKB, kVB);
    int32_t const stages = kiviVariantStages(variant, kD, kKB, kVB);
    if (stages == kDEFAULT)
    {
        return splitKernelWith<T, kD, kKB, kVB, kDEFAULT>(p, fn, smemBytes);
    }
    if constexpr (kiviIsHeadlineCombo(kD, kKB, kVB))
    {
        if (stages == 3)
        {
            return splitKernelWith<T, kD, kKB, kVB, 3>(p, fn, smemBytes);
        }
        if (stages == 6)
        {
            return splitKernelWith<T, kD, kKB, kVB, 6>(p, fn, smemBytes);
        }
    }
    return cudaErrorInvalidValue; // kiviValidate refuses a variant not compiled for the combination
}

template <typename T, int kD>
cudaError_t selectSplitKernel(KiviStepParams const& p, int32_t variant, void const** fn, int32_t* smemBytes)
{
#define KIVI_SPLIT_CASE(KB, VB)                                                                                        \
    if (p.kBits == KB && p.vBits == VB)                                                                                \
    {                                                                                                                  \
        return splitKernelFor<T, kD, KB, VB>(p, variant, fn, smemBytes);                                               \
    }
    KIVI_SPLIT_CASE(2, 2)
    KIVI_SPLIT_CASE(2, 4)
    KIVI_SPLIT_CASE(2, 8)
    KIVI_SPLIT_CASE(4, 2)
    KIVI_SPLIT_CASE(4, 4)
    KIVI_SPLIT_CASE(4, 8)
    KIVI_SPLIT_CASE(8, 2)
    KIVI_SPLIT_CASE(8, 4)
    KIVI_SPLIT_CASE(8, 8)
#undef KIVI_SPLIT_CASE
    return cudaErrorInvalidValue; // kiviValidate admits bits 2, 4, 8 only
}

//! The decode attention kernel of a (resolved) variant.
template <typename T, int kD>
cudaError_t selectDecodeKernel(KiviStepParams const& p, int32_t variant, void const** fn, int32_t* smemBytes)
{
    if (kKIVI_DECODE_VARIANTS[variant].kernel == kKIVI_KERNEL_BASELINE)
    {
        return selectMmaKernel<T, kD>(p, fn, smemBytes);
    }
    return selectSplitKernel<T, kD>(p, variant, fn, smemBytes);
}

//! Resident CTAs per SM of the decode kernel of variant `variant` (resolved) for these params (occupancy query).
template <typename T, int kD>
int32_t mmaCtasPerSm(KiviStepParams const& p, int32_t variant)
{
    void const* fn = nullptr;
    int32_t smem = 0;
    if (selectDecodeKernel<T, kD>(p, variant, &fn, &smem) != cudaSuccess)
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

//! cudaLaunchKernel, or with programmatic stream serialization (sm_90: the kernel may start while the previous
//! kernel of the stream runs; it waits with griddepcontrol.wait where it reads that kernel's results).
inline cudaError_t launchKernel(void const* fn, dim3 grid, dim3 block, void** args, size_t smem, cudaStream_t stream,
    bool programmatic)
{
    if (!programmatic)
    {
        return cudaLaunchKernel(fn, grid, block, args, smem, stream);
    }
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    return cudaLaunchKernelExC(&config, fn, args);
}

//! Attention (+ the prefill kernel, + the combine when the keys are split and the decode kernel does not merge
//! them itself). seqInfo: the prepare kernel's output in the workspace; counters: the fused merge's arrival
//! counters (plan.fusedCombine). programmatic: launch the decode kernel as a dependent of the prepare kernel.
template <typename T, int kD>
cudaError_t launchKiviAttention(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    float* partialAcc, float* partialMl, int32_t* counters, bool programmatic, cudaStream_t stream)
{
    dim3 const grid(plan.numTiles, p.numKvHeads, plan.numSplits);
    void const* fn = nullptr;
    int32_t smem = 0;
    cudaError_t err = selectDecodeKernel<T, kD>(p, plan.decodeVariant, &fn, &smem);
    if (err != cudaSuccess)
    {
        return err;
    }
    bool const split = kKIVI_DECODE_VARIANTS[plan.decodeVariant].kernel == kKIVI_KERNEL_SPLIT;
    KiviStepParams pc = p;
    KiviLaunchPlan planc = plan;
    if (split)
    {
        void* args[] = {&pc, &planc, &seqInfo, &partialAcc, &partialMl, &counters};
        err = launchKernel(fn, grid, dim3(kSPLIT_THREADS), args, static_cast<size_t>(smem), stream, programmatic);
    }
    else
    {
        void* args[] = {&pc, &planc, &seqInfo, &partialAcc, &partialMl};
        err = cudaLaunchKernel(fn, grid, dim3(kMMA_THREADS), args, static_cast<size_t>(smem), stream);
    }
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
    if (plan.numSplits == 1 || plan.fusedCombine)
    {
        return cudaSuccess;
    }
    int64_t const pairs = int64_t(p.numTokens) * p.numHeads;
    int64_t const blocks = (pairs + kATTN_WARPS - 1) / kATTN_WARPS;
    kiviCombineKernel<T, kD><<<static_cast<uint32_t>(blocks), kATTN_THREADS, 0, stream>>>(
        p, plan, seqInfo, partialAcc, partialMl, split ? 1 : 0);
    return cudaGetLastError();
}

//! Append (one launch): CTA y = 0 of each (sequence, KV head) flushes the groups that read window rows, then writes
//! the window; CTAs y >= 1 flush the groups inside the chunk (at most floor(maxChunkLen / G) per sequence).
//! programmatic: launch as a dependent of the previous kernel (the append kernel waits for it before reading).
template <typename T, int kD>
cudaError_t launchKiviAppend(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    bool programmatic, cudaStream_t stream)
{
    int32_t const chunkGroups = plan.maxChunkLen / p.groupSize;
    int32_t const gy = 1 + (chunkGroups < 1023 ? chunkGroups : 1023); // chunk CTAs stride past 1023
    int32_t const smem = appendSmemBytes<T, kD>(p.groupSize);
    void const* fn = reinterpret_cast<void const*>(&kiviAppendKernel<T, kD>);
    cudaError_t const err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
    {
        return err;
    }
    KiviStepParams pc = p;
    void* args[] = {&pc, &seqInfo};
    return launchKernel(fn, dim3(p.batch, gy, p.numKvHeads), dim3(kAPPEND_THREADS), args, static_cast<size_t>(smem),
        stream, programmatic);
}

#define KIVI_INSTANTIATE_LAUNCHERS(T, D)                                                                               \
    template cudaError_t launchKiviAttention<T, D>(KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*,      \
        float*, float*, int32_t*, bool, cudaStream_t);                                                                 \
    template int32_t mmaCtasPerSm<T, D>(KiviStepParams const&, int32_t);                                               \
    template cudaError_t launchKiviAppend<T, D>(                                                                       \
        KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*, bool, cudaStream_t);

} // namespace kernels
} // namespace trtllm_kivi
