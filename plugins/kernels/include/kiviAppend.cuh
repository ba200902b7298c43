/*
 * KIVI append (quantize-and-store), header-only: the second half of a step (attend, then append), as
 * trtllm_kivi/reference/attention.py `append`:
 *   1. kiviFlushKernel: quantize tokens [n_q(s), n_q(e)) in whole G-token groups, taken from the window (t < s) or
 *      the chunk (t >= s); K per channel, V per token (IEEE fp32 division via fp64: ieeeDiv); codes in FRAGMENT
 *      order (trtllm_kivi/format.py):
 *      first the scales/zeros of the group (into the store and shared memory), then one thread per output word.
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

//! Element (token t, KV head h, channel d) of the sequence's K or V: window row windowRow(t) of the slot's S + W
//! rows for t < s, else chunk row.
template <typename T, int kD>
__device__ __forceinline__ float loadHistoryOrChunk(T const* window, T const* chunk, int32_t slot, int32_t h,
    int32_t numKvHeads, int32_t sinks, int32_t w, int64_t t, int64_t s, int32_t tokenOffset, int32_t d)
{
    if (t < s)
    {
        int64_t const row = windowRowDev(t, sinks, w);
        return ActTraits<T>::toFloat(window[((int64_t(slot) * numKvHeads + h) * (sinks + w) + row) * kD + d]);
    }
    return ActTraits<T>::toFloat(chunk[((tokenOffset + (t - s)) * int64_t(numKvHeads) + h) * kD + d]);
}

//! (token within the 16-token tile, channel) of the code at bit position `pos` of half `half` of word j of `lane`
//! (format.py fragment_coord): pair pi = j * (16 / bits) + pos, register r = pi % 4, block i = pi / 4.
__device__ __forceinline__ void fragmentCoord(bool values, int32_t lane, int32_t j, int32_t half, int32_t pos,
    int32_t bits, int32_t& tok, int32_t& ch)
{
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    int32_t const pi = j * (16 / bits) + pos;
    int32_t const r = pi % 4;
    int32_t const i = pi / 4;
    if (values)
    {
        tok = 8 * (r >> 1) + 2 * t + half;
        ch = 16 * i + g + 8 * (r & 1);
    }
    else
    {
        tok = g + 8 * (r & 1);
        ch = 16 * i + 8 * (r >> 1) + 2 * t + half;
    }
}

template <typename T, int kD>
__global__ void __launch_bounds__(128) kiviFlushKernel(KiviStepParams p, SeqInfo const* seqInfo)
{
    // stored scale/zero of the group as fp32: K [D] per channel, V [G][D / Gv] per token (G <= 128, Gv >= 32)
    __shared__ float kScaleS[kD];
    __shared__ float kZeroS[kD];
    __shared__ float vScaleS[128 * (kD / 32)];
    __shared__ float vZeroS[128 * (kD / 32)];
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
    int32_t const sinks = p.sinkTokens;
    int64_t const q0 = numQuantizedDev(s, sinks, p.residualLength, g); // store indices; token = S + index
    int64_t const q1 = numQuantizedDev(e, sinks, p.residualLength, g);
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
    int32_t const gv = valueGroupSizeDev(g, kD);
    int32_t const groupsPerToken = kD / gv;

    for (int64_t grp = blockIdx.y; q0 + grp * g < q1; grp += gridDim.y)
    {
        int64_t const t0 = q0 + grp * g;
        int64_t const blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + t0 / bs];
        int32_t const r = static_cast<int32_t>(t0 % bs);
        int64_t const headBase = blk * hkv + h;
        __syncthreads(); // the previous group's scales are no longer read

        // 1. Scales/zeros. Keys, per channel: one thread per channel d, G tokens each.
        for (int32_t d = threadIdx.x; d < kD; d += blockDim.x)
        {
            float mn = INFINITY;
            float mx = -INFINITY;
            for (int32_t i = 0; i < g; ++i)
            {
                float const x = loadHistoryOrChunk<T, kD>(
                    kWin, kIn, slot, h, hkv, sinks, w, sinks + t0 + i, s, info.tokenOffset, d);
                mn = nanMin(mn, x);
                mx = nanMax(mx, x);
            }
            int64_t const sIdx = (headBase * (bs / g) + r / g) * kD + d;
            kScaleS[d] = storeScale(p.kScale, sIdx, p.scaleDtype, ieeeDiv(__fsub_rn(mx, mn), kLevels));
            kZeroS[d] = storeScale(p.kZero, sIdx, p.scaleDtype, mn);
        }
        // Values, per token: one thread per (token, channel group).
        for (int32_t u = threadIdx.x; u < g * groupsPerToken; u += blockDim.x)
        {
            int32_t const i = u / groupsPerToken;
            int32_t const cg = u % groupsPerToken;
            float mn = INFINITY;
            float mx = -INFINITY;
            for (int32_t c = 0; c < gv; ++c)
            {
                float const x = loadHistoryOrChunk<T, kD>(
                    vWin, vIn, slot, h, hkv, sinks, w, sinks + t0 + i, s, info.tokenOffset, cg * gv + c);
                mn = nanMin(mn, x);
                mx = nanMax(mx, x);
            }
            int64_t const sIdx = (headBase * bs + r + i) * groupsPerToken + cg;
            vScaleS[u] = storeScale(p.vScale, sIdx, p.scaleDtype, ieeeDiv(__fsub_rn(mx, mn), vLevels));
            vZeroS[u] = storeScale(p.vZero, sIdx, p.scaleDtype, mn);
        }
        __syncthreads();

        // 2. Codes, one thread per FRAGMENT-order word of the group's G / 16 tiles (a contiguous word range).
        int32_t const nwk = kD * p.kBits / 64;
        int32_t const nwv = kD * p.vBits / 64;
        int32_t const kWords = (g / 16) * 32 * nwk;
        int32_t const vWords = (g / 16) * 32 * nwv;
        for (int32_t u = threadIdx.x; u < kWords + vWords; u += blockDim.x)
        {
            bool const values = u >= kWords;
            int32_t const wi = values ? u - kWords : u;
            int32_t const bits = values ? p.vBits : p.kBits;
            int32_t const nw = values ? nwv : nwk;
            int32_t const tile = wi / (32 * nw);
            int32_t const lane = (wi / nw) % 32;
            int32_t const j = wi % nw;
            uint32_t word = 0;
            for (int32_t half = 0; half < 2; ++half)
            {
                for (int32_t pos = 0; pos < 16 / bits; ++pos)
                {
                    int32_t tok = 0;
                    int32_t ch = 0;
                    fragmentCoord(values, lane, j, half, pos, bits, tok, ch);
                    int32_t const i = 16 * tile + tok; // token within the group
                    uint32_t code = 0;
                    if (values)
                    {
                        float const x = loadHistoryOrChunk<T, kD>(
                            vWin, vIn, slot, h, hkv, sinks, w, sinks + t0 + i, s, info.tokenOffset, ch);
                        int32_t const si = i * groupsPerToken + ch / gv;
                        code = quantizeCode(x, vScaleS[si], vZeroS[si], vLevels);
                    }
                    else
                    {
                        float const x = loadHistoryOrChunk<T, kD>(
                            kWin, kIn, slot, h, hkv, sinks, w, sinks + t0 + i, s, info.tokenOffset, ch);
                        code = quantizeCode(x, kScaleS[ch], kZeroS[ch], kLevels);
                    }
                    word |= code << (16 * half + pos * bits);
                }
            }
            // words of (block, head) start at headBase * BS * D * bits / 32; the group's tiles at r / 16
            int64_t const base = headBase * (int64_t(bs) * kD * bits / 32) + int64_t(r / 16) * 32 * nw;
            (values ? vCodes : kCodes)[base + wi] = static_cast<int32_t>(word);
        }
    }
}

//! Window rows of the chunk's sink tokens [s, min(S, e)) and of its tokens [max(s, S, e - W), e) (the ring's last
//! W) at windowRow(t) of the slot's S + W rows, 16-byte vectors. Grid (batch, Hkv).
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
    int32_t const sinks = p.sinkTokens;
    int64_t const sinkEnd = e < sinks ? e : sinks;               // sinks of this chunk: [s, sinkEnd)
    int64_t const nSinks = sinkEnd > s ? sinkEnd - s : 0;
    int64_t first = e - w > s ? e - w : s;                       // the ring: [max(s, S, e - W), e)
    first = first > sinks ? first : (e > sinks ? int64_t(sinks) : e);
    int32_t const slot = p.slotIds[b];
    constexpr int32_t kVEC = 16 / sizeof(T);
    constexpr int32_t kVECS = kD / kVEC;
    int64_t const n = (nSinks + (e - first)) * kVECS;
    for (int64_t u = threadIdx.x; u < n; u += blockDim.x)
    {
        int64_t const i = u / kVECS;
        int64_t const t = i < nSinks ? s + i : first + (i - nSinks);
        int32_t const c = static_cast<int32_t>(u % kVECS);
        int64_t const src = ((info.tokenOffset + (t - s)) * p.numKvHeads + h) * kVECS + c;
        int64_t const dst = ((int64_t(slot) * p.numKvHeads + h) * (sinks + w) + windowRowDev(t, sinks, w)) * kVECS + c;
        static_cast<uint4*>(p.kWindow)[dst] = static_cast<uint4 const*>(p.k)[src];
        static_cast<uint4*>(p.vWindow)[dst] = static_cast<uint4 const*>(p.v)[src];
    }
}

} // namespace kernels
} // namespace trtllm_kivi
