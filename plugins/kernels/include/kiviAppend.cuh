/*
 * KIVI append (quantize-and-store), header-only: the second half of a step (attend, then append), as
 * trtllm_kivi/reference/attention.py `append`:
 *   1. kiviFlushKernel: quantize tokens [n_q(s), n_q(e)) in whole G-token groups, taken from the window (t < s) or
 *      the chunk (t >= s); K per channel (codes packed along tokens), V per token (packed along channels).
 *   2. kiviWindowKernel: write the window rows of tokens [max(s, e - W), e) at row t % W.
 * Two launches because a flush reads window rows that step 2 may overwrite (stream order separates them).
 * Grid of the flush: (batch, flushGroupsPerSeq, Hkv); each CTA strides over its sequence's groups.
 */
#pragma once

#include "kiviCommon.cuh"

namespace trtllm_kivi
{
namespace kernels
{

//! Element (token t, KV head h, channel d) of the sequence's K or V: window row t % W for t < s, else chunk row.
template <typename T, int kD>
__device__ __forceinline__ float loadHistoryOrChunk(T const* window, T const* chunk, int32_t slot, int32_t h,
    int32_t numKvHeads, int32_t w, int64_t t, int64_t s, int32_t tokenOffset, int32_t d)
{
    if (t < s)
    {
        return ActTraits<T>::toFloat(window[((int64_t(slot) * numKvHeads + h) * w + t % w) * kD + d]);
    }
    return ActTraits<T>::toFloat(chunk[((tokenOffset + (t - s)) * int64_t(numKvHeads) + h) * kD + d]);
}

template <typename T, int kD>
__global__ void __launch_bounds__(128) kiviFlushKernel(KiviStepParams p, SeqInfo const* seqInfo)
{
    int32_t const b = blockIdx.x;
    int32_t const h = blockIdx.z;
    SeqInfo const info = seqInfo[b];
    if (!info.valid)
    {
        return;
    }
    int64_t const s = p.pastLen[b];
    int64_t const e = s + p.chunkLen[b];
    int32_t const g = p.groupSize;
    int64_t const q0 = numQuantizedDev(s, p.residualLength, g);
    int64_t const q1 = numQuantizedDev(e, p.residualLength, g);
    int32_t const slot = p.slotIds[b];
    int32_t const w = p.residualLength + g - 1;
    int32_t const hkv = p.numKvHeads;
    int32_t const bs = p.blockSize;
    T const* kWin = static_cast<T const*>(p.kWindow);
    T const* vWin = static_cast<T const*>(p.vWindow);
    T const* kIn = static_cast<T const*>(p.k);
    T const* vIn = static_cast<T const*>(p.v);
    int32_t* kCodes = static_cast<int32_t*>(p.kCodes);
    int32_t* vCodes = static_cast<int32_t*>(p.vCodes);
    float const kLevels = float((1 << p.kBits) - 1);
    float const vLevels = float((1 << p.vBits) - 1);
    int32_t const kpw = kWORD_BITS / p.kBits;
    int32_t const vpw = kWORD_BITS / p.vBits;
    int32_t const gv = valueGroupSizeDev(g, kD);

    for (int64_t grp = blockIdx.y; q0 + grp * g < q1; grp += gridDim.y)
    {
        int64_t const t0 = q0 + grp * g;
        int64_t const blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + t0 / bs];
        int32_t const r = static_cast<int32_t>(t0 % bs);
        int64_t const headBase = blk * hkv + h;

        // Keys, per channel: one thread per channel d (coalesced over d), G tokens each.
        for (int32_t d = threadIdx.x; d < kD; d += blockDim.x)
        {
            float mn = INFINITY;
            float mx = -INFINITY;
            for (int32_t i = 0; i < g; ++i)
            {
                float const x = loadHistoryOrChunk<T, kD>(kWin, kIn, slot, h, hkv, w, t0 + i, s, info.tokenOffset, d);
                mn = nanMin(mn, x);
                mx = nanMax(mx, x);
            }
            int64_t const sIdx = (headBase * (bs / g) + r / g) * kD + d;
            float const scale = storeScale(p.kScale, sIdx, p.scaleDtype, __fdiv_rn(__fsub_rn(mx, mn), kLevels));
            float const zero = storeScale(p.kZero, sIdx, p.scaleDtype, mn);
            for (int32_t wi = 0; wi < g / kpw; ++wi)
            {
                uint32_t word = 0;
                for (int32_t j = 0; j < kpw; ++j)
                {
                    float const x = loadHistoryOrChunk<T, kD>(
                        kWin, kIn, slot, h, hkv, w, t0 + wi * kpw + j, s, info.tokenOffset, d);
                    word |= quantizeCode(x, scale, zero, kLevels) << (j * p.kBits);
                }
                kCodes[(headBase * (bs / kpw) + r / kpw + wi) * kD + d] = static_cast<int32_t>(word);
            }
        }

        // Values, per token: one thread per (token, channel group).
        int32_t const groupsPerToken = kD / gv;
        for (int32_t u = threadIdx.x; u < g * groupsPerToken; u += blockDim.x)
        {
            int32_t const i = u / groupsPerToken;
            int32_t const cg = u % groupsPerToken;
            float mn = INFINITY;
            float mx = -INFINITY;
            for (int32_t c = 0; c < gv; ++c)
            {
                float const x
                    = loadHistoryOrChunk<T, kD>(vWin, vIn, slot, h, hkv, w, t0 + i, s, info.tokenOffset, cg * gv + c);
                mn = nanMin(mn, x);
                mx = nanMax(mx, x);
            }
            int64_t const row = headBase * bs + r + i;
            int64_t const sIdx = row * groupsPerToken + cg;
            float const scale = storeScale(p.vScale, sIdx, p.scaleDtype, __fdiv_rn(__fsub_rn(mx, mn), vLevels));
            float const zero = storeScale(p.vZero, sIdx, p.scaleDtype, mn);
            for (int32_t wi = 0; wi < gv / vpw; ++wi)
            {
                uint32_t word = 0;
                for (int32_t j = 0; j < vpw; ++j)
                {
                    int32_t const c = cg * gv + wi * vpw + j;
                    float const x
                        = loadHistoryOrChunk<T, kD>(vWin, vIn, slot, h, hkv, w, t0 + i, s, info.tokenOffset, c);
                    word |= quantizeCode(x, scale, zero, vLevels) << (j * p.vBits);
                }
                vCodes[row * (kD / vpw) + (cg * gv) / vpw + wi] = static_cast<int32_t>(word);
            }
        }
    }
}

//! Window rows of tokens [max(s, e - W), e) at row t % W, 16-byte vectors. Grid (batch, Hkv).
template <typename T, int kD>
__global__ void __launch_bounds__(128) kiviWindowKernel(KiviStepParams p, SeqInfo const* seqInfo)
{
    int32_t const b = blockIdx.x;
    int32_t const h = blockIdx.y;
    SeqInfo const info = seqInfo[b];
    if (!info.valid)
    {
        return;
    }
    int64_t const s = p.pastLen[b];
    int64_t const e = s + p.chunkLen[b];
    int32_t const w = p.residualLength + p.groupSize - 1;
    int64_t const first = e - w > s ? e - w : s;
    int32_t const slot = p.slotIds[b];
    constexpr int32_t kVEC = 16 / sizeof(T);
    constexpr int32_t kVECS = kD / kVEC;
    int64_t const n = (e - first) * kVECS;
    for (int64_t u = threadIdx.x; u < n; u += blockDim.x)
    {
        int64_t const t = first + u / kVECS;
        int32_t const c = static_cast<int32_t>(u % kVECS);
        int64_t const src = ((info.tokenOffset + (t - s)) * p.numKvHeads + h) * kVECS + c;
        int64_t const dst = ((int64_t(slot) * p.numKvHeads + h) * w + t % w) * kVECS + c;
        static_cast<uint4*>(p.kWindow)[dst] = static_cast<uint4 const*>(p.k)[src];
        static_cast<uint4*>(p.vWindow)[dst] = static_cast<uint4 const*>(p.v)[src];
    }
}

} // namespace kernels
} // namespace trtllm_kivi
