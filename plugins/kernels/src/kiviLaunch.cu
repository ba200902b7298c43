// KIVI kernels: host launchers (invokeKivi*) and the per-step prepare kernel. Validation is host-only C++
// (kiviParams.cpp); lengths stay on the device (no host synchronization).
#include "kiviKernels.h"
#include "kiviLaunchTemplates.cuh"

#include <atomic>
#include <cstdio>

namespace trtllm_kivi
{
namespace kernels
{

// Instantiated in src/instantiations/kiviKernels_d<D>_<dtype>.cu.
#define KIVI_EXTERN_LAUNCHERS(T, D)                                                                                    \
    extern template cudaError_t launchKiviAttention<T, D>(KiviStepParams const&, KiviLaunchPlan const&,               \
        SeqInfo const*, float*, float*, int32_t*, bool, cudaStream_t);                                                 \
    extern template cudaError_t launchKiviAppend<T, D>(                                                                \
        KiviStepParams const&, KiviLaunchPlan const&, SeqInfo const*, bool, cudaStream_t);                             \
    extern template int32_t mmaCtasPerSm<T, D>(KiviStepParams const&, int32_t);
KIVI_EXTERN_LAUNCHERS(half, 64)
KIVI_EXTERN_LAUNCHERS(half, 128)
KIVI_EXTERN_LAUNCHERS(__nv_bfloat16, 64)
KIVI_EXTERN_LAUNCHERS(__nv_bfloat16, 128)
#undef KIVI_EXTERN_LAUNCHERS

namespace
{

//! Sequence with chunk length c (clamped at 0; the prefix sums and the sequence itself use the same rule, so the
//! two kernels' tiles never overlap) runs in the prefill kernel.
__device__ __forceinline__ bool isPrefillSequence(KiviLaunchPlan const& plan, int64_t c)
{
    return plan.numPrefillTiles > 0 && c * plan.groupHeads >= kPREFILL_TILE_ROWS;
}

//! One CTA per sequence: token/tile offsets (block-wide sums over the earlier sequences) and the device-side checks
//! of DESIGN.md (lengths, capacity, slot, block ids). A failing sequence is marked invalid (skipped by every later
//! kernel) and its KiviErrorBits are OR-ed into *errorFlag. Also zeroes the numCounters arrival counters of the
//! fused split merge (kiviDecodeSplit.cuh), marks the sequences whose window row the attention kernel writes
//! (windowByAttention: a whole step of a fused variant), and lets a programmatic dependent start at once.
__global__ void __launch_bounds__(128) kiviPrepareKernel(KiviStepParams p, KiviLaunchPlan plan, SeqInfo* seqInfo,
    int32_t* counters, int32_t numCounters, int32_t windowByAttention)
{
    gridDependencyLaunch();
    for (int32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < numCounters; u += gridDim.x * blockDim.x)
    {
        counters[u] = 0;
    }
    __shared__ int64_t sTokens[128];
    __shared__ int64_t sTiles[128];
    __shared__ int64_t sPrefillTiles[128];
    __shared__ int32_t sBadBlock;
    int32_t const b = blockIdx.x;
    int64_t tokens = 0;
    int64_t tiles = 0;
    int64_t prefillTiles = 0;
    for (int32_t j = threadIdx.x; j < b; j += blockDim.x)
    {
        int64_t const c = max(p.chunkLen[j], 0);
        tokens += c;
        if (isPrefillSequence(plan, c))
        {
            prefillTiles += (c * plan.groupHeads + kPREFILL_TILE_ROWS - 1) / kPREFILL_TILE_ROWS;
        }
        else
        {
            tiles += (c * plan.groupHeads + plan.tileRows - 1) / plan.tileRows;
        }
    }
    sTokens[threadIdx.x] = tokens;
    sTiles[threadIdx.x] = tiles;
    sPrefillTiles[threadIdx.x] = prefillTiles;
    if (threadIdx.x == 0)
    {
        sBadBlock = 0;
    }
    __syncthreads();
    for (int32_t o = blockDim.x / 2; o > 0; o >>= 1)
    {
        if (threadIdx.x < o)
        {
            sTokens[threadIdx.x] += sTokens[threadIdx.x + o];
            sTiles[threadIdx.x] += sTiles[threadIdx.x + o];
            sPrefillTiles[threadIdx.x] += sPrefillTiles[threadIdx.x + o];
        }
        __syncthreads();
    }
    int64_t const tokenOffset = sTokens[0];
    int64_t const tileOffset = sTiles[0];
    int64_t const prefillTileOffset = sPrefillTiles[0];
    int64_t const s = p.pastLen[b];
    int64_t const c = p.chunkLen[b];
    int64_t const e = s + c;
    int32_t err = 0;
    if (s < 0 || c < 0 || c > plan.maxChunkLen || tokenOffset + c > p.numTokens)
    {
        err |= kKIVI_ERR_LENGTH;
    }
    int64_t const nq = numQuantizedDev(e, p.sinkTokens, p.residualLength, p.groupSize);
    if (err == 0 && (e > plan.maxSeqLen || nq > int64_t(p.maxBlocksPerSeq) * p.blockSize))
    {
        err |= kKIVI_ERR_CAPACITY;
    }
    int32_t const slot = p.slotIds[b];
    if (slot < 0 || slot >= p.numSlots)
    {
        err |= kKIVI_ERR_SLOT;
    }
    if (err == 0)
    {
        int64_t const usedBlocks = (nq + p.blockSize - 1) / p.blockSize;
        for (int64_t j = threadIdx.x; j < usedBlocks; j += blockDim.x)
        {
            int32_t const blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + j];
            if (blk < 0 || blk >= p.numBlocks)
            {
                sBadBlock = 1;
            }
        }
        __syncthreads();
        if (sBadBlock)
        {
            err |= kKIVI_ERR_BLOCK_ID;
        }
    }
    if (threadIdx.x == 0)
    {
        int64_t const avail = p.numTokens - tokenOffset;
        int64_t const rows = c < 0 ? 0 : (c < avail ? c : (avail > 0 ? avail : 0));
        SeqInfo info;
        info.tokenOffset = static_cast<int32_t>(tokenOffset < p.numTokens ? tokenOffset : p.numTokens);
        bool const prefill = isPrefillSequence(plan, c < 0 ? 0 : c);
        info.tileOffset = static_cast<int32_t>(tileOffset);
        info.tileCount
            = prefill ? 0 : static_cast<int32_t>((rows * plan.groupHeads + plan.tileRows - 1) / plan.tileRows);
        info.prefillTileOffset = static_cast<int32_t>(prefillTileOffset);
        info.prefillTileCount = prefill
            ? static_cast<int32_t>((rows * plan.groupHeads + kPREFILL_TILE_ROWS - 1) / kPREFILL_TILE_ROWS)
            : 0;
        info.valid = err == 0 ? 1 : 0;
        info.windowWritten = err == 0 && windowByAttention && c == 1
                && numQuantizedDev(e, p.sinkTokens, p.residualLength, p.groupSize)
                    == numQuantizedDev(s, p.sinkTokens, p.residualLength, p.groupSize)
            ? 1
            : 0;
        // This sequence's length e spread over all numSplits splits (whole 32-key tiles, at least kMIN_SPLIT_LEN),
        // so a short sequence in an engine sized for long ones still uses the splits: numSplits * splitLen >= e.
        int64_t const perSplit = (e > 0 ? e : 0) + plan.numSplits - 1;
        int64_t const len = (perSplit / plan.numSplits + kKEY_TILE - 1) / kKEY_TILE * kKEY_TILE;
        info.splitLen = static_cast<int32_t>(len > kMIN_SPLIT_LEN ? len : kMIN_SPLIT_LEN);
        seqInfo[b] = info;
        if (err != 0 && p.errorFlag != nullptr)
        {
            atomicOr(p.errorFlag, err);
        }
    }
}

//! Zero the output rows no sequence covers: [covered, numTokens) with covered = the token offset of the last
//! sequence + its chunk length (the prepare kernel's prefix sum, clamped to numTokens). With numSplits > 1
//! kiviCombineKernel writes those zeros; with one split no attention CTA owns those rows. Rows are whole 16-byte
//! vectors (numHeads x headDim x 2 bytes, headDim in {64, 128}).
__global__ void __launch_bounds__(128) kiviZeroUncoveredRowsKernel(KiviStepParams p, SeqInfo const* seqInfo)
{
    SeqInfo const last = seqInfo[p.batch - 1];
    int64_t const c = max(p.chunkLen[p.batch - 1], 0);
    int64_t const covered = min(int64_t(last.tokenOffset) + c, int64_t(p.numTokens));
    int64_t const vecsPerRow = int64_t(p.numHeads) * p.headDim / 8;
    uint4* const out = static_cast<uint4*>(p.out);
    int64_t const end = int64_t(p.numTokens) * vecsPerRow;
    for (int64_t u = covered * vecsPerRow + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < end;
         u += int64_t(gridDim.x) * blockDim.x)
    {
        out[u] = make_uint4(0, 0, 0, 0);
    }
}

//! Compute capability (major * 10 + minor) of the current device, queried once per device and cached.
cudaError_t currentSmVersion(int32_t& sm)
{
    constexpr int32_t kMAX_DEVICES = 64;
    static std::atomic<int32_t> sCache[kMAX_DEVICES]; // 0 = not queried yet
    int32_t dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess)
    {
        return err;
    }
    if (dev >= 0 && dev < kMAX_DEVICES && (sm = sCache[dev].load(std::memory_order_relaxed)) > 0)
    {
        return cudaSuccess;
    }
    int32_t major = 0;
    int32_t minor = 0;
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaSuccess)
    {
        err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    }
    if (err != cudaSuccess)
    {
        return err;
    }
    sm = major * 10 + minor;
    if (dev >= 0 && dev < kMAX_DEVICES)
    {
        sCache[dev].store(sm, std::memory_order_relaxed);
    }
    return cudaSuccess;
}

//! Virtual architecture (major * 10 + minor) the library's kernels were compiled from, as the current device runs
//! them (cudaFuncAttributes::ptxVersion of the prepare kernel: every kernel of the library is compiled for the same
//! architectures), queried once per device and cached. A library without sm_90 code (built for 80 only) runs on a
//! Hopper GPU through its compute_80 PTX, where griddepcontrol.wait is compiled out (kiviCommon.cuh): a
//! programmatic launch would then let the decode kernel read the prepare kernel's seqInfo and counters, and the
//! append kernel overwrite window rows, before they are ready. Programmatic launches need this >= 90 too.
cudaError_t kernelPtxVersion(int32_t& ptx)
{
    constexpr int32_t kMAX_DEVICES = 64;
    static std::atomic<int32_t> sCache[kMAX_DEVICES]; // 0 = not queried yet
    int32_t dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess)
    {
        return err;
    }
    if (dev >= 0 && dev < kMAX_DEVICES && (ptx = sCache[dev].load(std::memory_order_relaxed)) > 0)
    {
        return cudaSuccess;
    }
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, kiviPrepareKernel);
    if (err != cudaSuccess)
    {
        return err;
    }
    ptx = attr.ptxVersion;
    if (dev >= 0 && dev < kMAX_DEVICES)
    {
        sCache[dev].store(ptx, std::memory_order_relaxed);
    }
    return cudaSuccess;
}

//! Fused variants on sm_90 chain prepare -> decode -> append with programmatic dependent launches (each waits for
//! its predecessor where it reads its results); everything else launches as before.
template <typename T, int kD>
cudaError_t dispatchPhases(KiviStepParams const& p, KiviLaunchPlan const& plan, SeqInfo const* seqInfo,
    float* partialAcc, float* partialMl, int32_t* counters, bool programmatic, int32_t phase, cudaStream_t stream)
{
    if (phase & kPHASE_ATTENTION)
    {
        cudaError_t const err
            = launchKiviAttention<T, kD>(p, plan, seqInfo, partialAcc, partialMl, counters, programmatic, stream);
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    if (phase & kPHASE_APPEND)
    {
        return launchKiviAppend<T, kD>(p, plan, seqInfo, programmatic, stream);
    }
    return cudaSuccess;
}

cudaError_t invokePhases(KiviStepParams const& p, int32_t phase, cudaStream_t stream)
{
    char msg[512];
    if (kiviValidate(p, phase, msg, sizeof(msg)) != 0)
    {
        kiviSetLastErrorMessage(msg);
        return cudaErrorInvalidValue;
    }
    kiviSetLastErrorMessage("");
    if (p.batch == 0 || p.numTokens == 0)
    {
        return cudaSuccess;
    }
    int32_t sm = 0;
    cudaError_t err = currentSmVersion(sm);
    if (err != cudaSuccess)
    {
        return err;
    }
    if ((phase & kPHASE_ATTENTION) && kiviCheckArch(p, sm, msg, sizeof(msg)) != 0)
    {
        kiviSetLastErrorMessage(msg);
        return cudaErrorInvalidValue;
    }
    KiviLaunchPlan const plan = kiviLaunchPlan(p, sm); // auto resolved for this device's arch
    char* ws = static_cast<char*>(p.workspace);
    SeqInfo* seqInfo = reinterpret_cast<SeqInfo*>(ws);
    float* partialAcc = nullptr;
    float* partialMl = nullptr;
    int32_t* counters = nullptr;
    if (plan.numSplits > 1)
    {
        // [numTokens, numHeads, numSplits, D] then [numTokens, numHeads, numSplits, 2]: within partialBytes, which
        // is sized for an upper bound of numTokens x numSplits.
        size_t const rows = size_t(p.numTokens) * p.numHeads * plan.numSplits;
        partialAcc = reinterpret_cast<float*>(ws + plan.seqInfoBytes);
        partialMl = reinterpret_cast<float*>(
            ws + plan.seqInfoBytes + (rows * p.headDim * sizeof(float) + 255) / 256 * 256);
    }
    int32_t const numCounters = plan.fusedCombine ? plan.numTiles * p.numKvHeads : 0;
    if (numCounters > 0)
    {
        counters = reinterpret_cast<int32_t*>(ws + plan.seqInfoBytes + plan.partialBytes);
    }
    // one half alone: the attention kernel never writes the cache, the append kernel all of it
    int32_t const windowByAttention = phase == kPHASE_STEP && plan.windowByAttention ? 1 : 0;
    kiviPrepareKernel<<<p.batch, 128, 0, stream>>>(p, plan, seqInfo, counters, numCounters, windowByAttention);
    err = cudaGetLastError();
    if (err != cudaSuccess)
    {
        return err;
    }
    bool const fused = kKIVI_DECODE_VARIANTS[plan.decodeVariant].fused != 0;
    if ((phase & kPHASE_ATTENTION) && plan.numSplits == 1 && !fused)
    {
        int64_t const vecs = int64_t(p.numTokens) * p.numHeads * p.headDim / 8;
        int64_t const blocks = (vecs + 127) / 128;
        kiviZeroUncoveredRowsKernel<<<static_cast<uint32_t>(blocks < 1024 ? blocks : 1024), 128, 0, stream>>>(
            p, seqInfo);
        err = cudaGetLastError();
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    // programmatic only where the kernels run sm_90 code: their griddepcontrol.wait is what orders them
    int32_t ptx = 0;
    if (fused && sm >= 90)
    {
        err = kernelPtxVersion(ptx);
        if (err != cudaSuccess)
        {
            return err;
        }
    }
    bool const programmatic = fused && sm >= 90 && ptx >= 90;
    bool const bf16 = p.actDtype == kKIVI_BFLOAT16;
    if (p.headDim == 64)
    {
        return bf16 ? dispatchPhases<__nv_bfloat16, 64>(
                   p, plan, seqInfo, partialAcc, partialMl, counters, programmatic, phase, stream)
                    : dispatchPhases<half, 64>(
                        p, plan, seqInfo, partialAcc, partialMl, counters, programmatic, phase, stream);
    }
    return bf16 ? dispatchPhases<__nv_bfloat16, 128>(
               p, plan, seqInfo, partialAcc, partialMl, counters, programmatic, phase, stream)
                : dispatchPhases<half, 128>(
                    p, plan, seqInfo, partialAcc, partialMl, counters, programmatic, phase, stream);
}

} // namespace

int32_t kiviAttentionCtasPerSm(KiviStepParams const& p)
{
    // Only the kernel choice (variant, head_dim, dtype, bits, scale dtype, G) matters: no pointers are needed.
    int32_t sm = kKIVI_PLAN_ARCH;
    if (currentSmVersion(sm) != cudaSuccess)
    {
        return -1;
    }
    int32_t const variant = kiviDecodeVariantFor(p, sm, p.numSms);
    if (variant <= 0 || variant >= kKIVI_DECODE_VARIANT_COUNT
        || (variant != kKIVI_VARIANT_DEFAULT && !kiviVariantCompiled(variant, p.headDim, p.kBits, p.vBits)))
    {
        return -1;
    }
    bool const bf16 = p.actDtype == kKIVI_BFLOAT16;
    if (p.headDim == 64)
    {
        return bf16 ? mmaCtasPerSm<__nv_bfloat16, 64>(p, variant) : mmaCtasPerSm<half, 64>(p, variant);
    }
    if (p.headDim == 128)
    {
        return bf16 ? mmaCtasPerSm<__nv_bfloat16, 128>(p, variant) : mmaCtasPerSm<half, 128>(p, variant);
    }
    return -1;
}

cudaError_t invokeKiviStep(KiviStepParams const& params, cudaStream_t stream)
{
    return invokePhases(params, kPHASE_STEP, stream);
}

cudaError_t invokeKiviAttention(KiviStepParams const& params, cudaStream_t stream)
{
    return invokePhases(params, kPHASE_ATTENTION, stream);
}

cudaError_t invokeKiviAppend(KiviStepParams const& params, cudaStream_t stream)
{
    return invokePhases(params, kPHASE_APPEND, stream);
}

} // namespace kernels
} // namespace trtllm_kivi
