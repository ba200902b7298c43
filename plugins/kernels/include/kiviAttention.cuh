/*
 * KIVI attention, header-only: the first half of a step (attend), as trtllm_kivi/reference/attention.py `attend` over
 * `history` + the chunk, with flash-decoding:
 *
 *   grid (numTiles, Hkv, numSplits), 128 threads (4 warps). A CTA owns one tile = up to tileTokens consecutive query
 *   tokens of one sequence x the groupHeads query heads of one KV head (<= kMAX_TILE_ROWS rows, so each KV head's
 *   dequantized K/V tile serves all its query heads), and one split = keys [split * L, (split + 1) * L) with L the
 *   sequence's own split length (SeqInfo::splitLen: its length spread over all numSplits splits).
 *   Keys stream in tiles of kKEY_TILE = 32 tokens: quantized [0, n_q(s)) dequantized through the block table
 *   (fp32 q*scale+zero rounded to the activation dtype, as the reference's history), window [n_q(s), s) at row t % W,
 *   chunk [s, e) from k/v. A tile never straddles the quantized/window boundary (n_q(s) is a multiple of G, a
 *   multiple of 32).
 *   Per row, warp-level online softmax in fp32: lane j scores key j of the tile (dot over D in fp32), running (m, l)
 *   per row, acc[D] spread over lanes (D/32 channels each).
 *   numSplits == 1: out = acc / l directly. Otherwise partial (m, l, acc) go to the workspace and kiviCombineKernel
 *   merges the splits 0..floor(p / L) of the query at position p.
 *
 * This is the SIMT version (no tensor cores, no scale folding); trtllm_kivi/cuda/model.py is its CPU model.
 */
#pragma once

#include "kiviCommon.cuh"

namespace trtllm_kivi
{
namespace kernels
{

constexpr int32_t kATTN_THREADS = 128;
constexpr int32_t kATTN_WARPS = kATTN_THREADS / 32;
constexpr int32_t kROWS_PER_WARP = kMAX_TILE_ROWS / kATTN_WARPS;
// At most 65536 / (4 x 128) = 128 registers per thread: at least 4 resident CTAs (16 warps) per SM.
constexpr int32_t kATTN_MIN_CTAS_PER_SM = 4;

//! Last sequence b with seqInfo[b].field <= x (binary search; `field` is non-decreasing in b).
template <int32_t SeqInfo::*kFIELD>
__device__ __forceinline__ int32_t findSequence(SeqInfo const* seqInfo, int32_t batch, int32_t x)
{
    int32_t lo = 0;
    int32_t hi = batch - 1;
    while (lo < hi)
    {
        int32_t const mid = (lo + hi + 1) / 2;
        if (seqInfo[mid].*kFIELD <= x)
        {
            lo = mid;
        }
        else
        {
            hi = mid - 1;
        }
    }
    return lo;
}

//! Store a value of the activation dtype's grid into shared memory: as fp32 (SIMT kernel) or as T (tensor-core
//! kernel). `x` is rounded to T first, which is the reference's cast of the dequantized history.
template <typename T>
__device__ __forceinline__ void storeSmem(float& dst, float x)
{
    dst = roundToAct<T>(x);
}

template <typename T>
__device__ __forceinline__ void storeSmem(T& dst, float x)
{
    dst = ActTraits<T>::fromFloat(x);
}

//! Dequantize a 32-token K tile (per-channel groups; one G-group covers the whole tile) into kS[32][kD + 1].
//! Word u of the tile ([32 / kPW][kD], contiguous) is (wi, d) = (u / kD, u % kD).
template <typename T, int kD, int kBITS, typename S, int kLDK>
__device__ __forceinline__ void loadQuantizedKeys(
    KiviStepParams const& p, int64_t headBase, int32_t r, S (*kS)[kLDK])
{
    constexpr int32_t kPW = 32 / kBITS;
    constexpr int32_t kWORDS = kKEY_TILE / kPW;
    int32_t const bs = p.blockSize;
    int64_t const sIdx = (headBase * (bs / p.groupSize) + r / p.groupSize) * kD;
    int32_t const* codes = static_cast<int32_t const*>(p.kCodes) + (headBase * (bs / kPW) + r / kPW) * kD;
    for (int32_t u = threadIdx.x; u < kWORDS * kD; u += kATTN_THREADS) // KIVI_MODEL_LOOP(kwords)
    {
        int32_t const wi = u / kD;
        int32_t const d = u % kD;
        uint32_t const word = static_cast<uint32_t>(__ldg(codes + u)); // KIVI_MODEL_ANCHOR(kwords)
        float const scale = loadScale(p.kScale, sIdx + d, p.scaleDtype);
        float const zero = loadScale(p.kZero, sIdx + d, p.scaleDtype);
#pragma unroll
        for (int32_t i = 0; i < kPW / 2; ++i)
        {
            float2 const c = codePairToFloat<kBITS>(word, i);
            storeSmem<T>(kS[wi * kPW + i][d], dequantize(c.x, scale, zero));
            storeSmem<T>(kS[wi * kPW + i + kPW / 2][d], dequantize(c.y, scale, zero));
        }
    }
}

//! Dequantize a 32-token V tile (per-token groups of Gv channels) into vS[32][kD].
//! Word u of the tile ([32][kD / kPW], contiguous) is (tok, wi) = (u / kWORDS, u % kWORDS).
template <typename T, int kD, int kBITS, typename S, int kLDV>
__device__ __forceinline__ void loadQuantizedValues(
    KiviStepParams const& p, int64_t headBase, int32_t r, S (*vS)[kLDV])
{
    constexpr int32_t kPW = 32 / kBITS;
    constexpr int32_t kWORDS = kD / kPW; // words per token
    int32_t const gv = valueGroupSizeDev(p.groupSize, kD);
    int32_t const groupsPerToken = kD / gv;
    int64_t const row0 = headBase * p.blockSize + r;
    int32_t const* codes = static_cast<int32_t const*>(p.vCodes) + row0 * kWORDS;
    for (int32_t u = threadIdx.x; u < kKEY_TILE * kWORDS; u += kATTN_THREADS) // KIVI_MODEL_LOOP(vwords)
    {
        int32_t const tok = u / kWORDS;
        int32_t const wi = u % kWORDS;
        uint32_t const word = static_cast<uint32_t>(__ldg(codes + u)); // KIVI_MODEL_ANCHOR(vwords)
        int64_t const sIdx = (row0 + tok) * groupsPerToken + (wi * kPW) / gv; // a word never straddles a group
        float const scale = loadScale(p.vScale, sIdx, p.scaleDtype);
        float const zero = loadScale(p.vZero, sIdx, p.scaleDtype);
#pragma unroll
        for (int32_t i = 0; i < kPW / 2; ++i)
        {
            float2 const c = codePairToFloat<kBITS>(word, i);
            storeSmem<T>(vS[tok][wi * kPW + i], dequantize(c.x, scale, zero));
            storeSmem<T>(vS[tok][wi * kPW + i + kPW / 2], dequantize(c.y, scale, zero));
        }
    }
}

//! Full-precision K/V rows of tokens [kt, kt + 32): window (t < s), chunk (t < keyEnd), zeros past keyEnd.
template <typename T, int kD, typename S, int kLDK, int kLDV>
__device__ __forceinline__ void loadFullPrecision(KiviStepParams const& p, int32_t h, int32_t slot, int64_t s,
    int32_t tokenOffset, int64_t kt, int64_t keyEnd, S (*kS)[kLDK], S (*vS)[kLDV])
{
    constexpr int32_t kVEC = 8; // 8 x 16-bit = 16 bytes
    constexpr int32_t kVECS = kD / kVEC;
    int32_t const w = p.residualLength + p.groupSize - 1;
    for (int32_t u = threadIdx.x; u < kKEY_TILE * kVECS; u += kATTN_THREADS)
    {
        int32_t const tok = u / kVECS;
        int32_t const c = u % kVECS;
        int64_t const t = kt + tok;
        uint4 kv = make_uint4(0, 0, 0, 0);
        uint4 vv = make_uint4(0, 0, 0, 0);
        if (t < s)
        {
            int64_t const idx = ((int64_t(slot) * p.numKvHeads + h) * w + t % w) * kVECS + c;
            kv = static_cast<uint4 const*>(p.kWindow)[idx];
            vv = static_cast<uint4 const*>(p.vWindow)[idx];
        }
        else if (t < keyEnd)
        {
            int64_t const idx = ((tokenOffset + (t - s)) * int64_t(p.numKvHeads) + h) * kVECS + c;
            kv = __ldg(static_cast<uint4 const*>(p.k) + idx);
            vv = __ldg(static_cast<uint4 const*>(p.v) + idx);
        }
        T const* kx = reinterpret_cast<T const*>(&kv);
        T const* vx = reinterpret_cast<T const*>(&vv);
#pragma unroll
        for (int32_t i = 0; i < kVEC; ++i)
        {
            storeSmem<T>(kS[tok][c * kVEC + i], ActTraits<T>::toFloat(kx[i])); // exact either way
            storeSmem<T>(vS[tok][c * kVEC + i], ActTraits<T>::toFloat(vx[i]));
        }
    }
}

//! The 32-key tile starting at kt into kS / vS: quantized history (kt < n_q(s)), else window / chunk rows.
template <typename T, int kD, typename S, int kLDK, int kLDV>
__device__ __forceinline__ void loadKeyValueTile(KiviStepParams const& p, int32_t b, int32_t h, int32_t slot, int64_t s,
    int64_t nq, int32_t tokenOffset, int64_t kt, int64_t keyEnd, S (*kS)[kLDK], S (*vS)[kLDV])
{
    if (kt < nq)
    {
        int64_t const blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + kt / p.blockSize];
        int64_t const headBase = blk * p.numKvHeads + h;
        int32_t const r = static_cast<int32_t>(kt % p.blockSize);
        switch (p.kBits)
        {
        case 2: loadQuantizedKeys<T, kD, 2>(p, headBase, r, kS); break;
        case 4: loadQuantizedKeys<T, kD, 4>(p, headBase, r, kS); break;
        default: loadQuantizedKeys<T, kD, 8>(p, headBase, r, kS); break;
        }
        switch (p.vBits)
        {
        case 2: loadQuantizedValues<T, kD, 2>(p, headBase, r, vS); break;
        case 4: loadQuantizedValues<T, kD, 4>(p, headBase, r, vS); break;
        default: loadQuantizedValues<T, kD, 8>(p, headBase, r, vS); break;
        }
    }
    else
    {
        loadFullPrecision<T, kD>(p, h, slot, s, tokenOffset, kt, keyEnd, kS, vS);
    }
}

//! What one attention CTA (tile = blockIdx.x, KV head = blockIdx.y, split = blockIdx.z) works on. run = false: nothing
//! to do (past the batch's tiles, a split no row reads, or an invalid sequence, whose zero rows are written here).
struct TileWork
{
    bool run;
    int32_t h;
    int32_t split;
    int32_t b;
    SeqInfo info;
    int32_t i0;   //!< first query token of the tile within the chunk
    int32_t rows; //!< (tokens in the tile) x groupHeads
    int32_t slot;
    int64_t s;  //!< past_len
    int64_t k0; //!< keys [k0, k1) of this split visible to some row of the tile
    int64_t k1;
    int64_t nq; //!< n_q(past_len)
};

template <typename T, int kD>
__device__ __forceinline__ TileWork resolveTile(KiviStepParams const& p, KiviLaunchPlan const& plan,
    SeqInfo const* seqInfo)
{
    TileWork wk{};
    int32_t const tile = blockIdx.x;
    wk.h = blockIdx.y;
    wk.split = blockIdx.z;
    wk.b = findSequence<&SeqInfo::tileOffset>(seqInfo, p.batch, tile);
    wk.info = seqInfo[wk.b];
    if (tile >= wk.info.tileOffset + wk.info.tileCount)
    {
        return wk; // past the last tile of the batch (numTiles is an upper bound)
    }
    int32_t const grp = plan.groupHeads;
    int32_t const c = p.chunkLen[wk.b];
    wk.i0 = (tile - wk.info.tileOffset) * plan.tileTokens;
    int32_t const i1 = min(wk.i0 + plan.tileTokens, c);
    wk.rows = (i1 - wk.i0) * grp;
    if (!wk.info.valid)
    {
        if (plan.numSplits == 1) // else kiviCombineKernel writes the zeros
        {
            T* out = static_cast<T*>(p.out);
            for (int32_t u = threadIdx.x; u < wk.rows * kD; u += blockDim.x)
            {
                int32_t const row = u / kD;
                int64_t const token = wk.info.tokenOffset + wk.i0 + row / grp;
                if (token < p.numTokens) // an invalid chunk_len may claim rows past num_tokens
                {
                    out[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD] = ActTraits<T>::fromFloat(0.F);
                }
            }
        }
        return wk;
    }
    wk.s = p.pastLen[wk.b];
    int64_t const keyEnd = wk.s + i1; // keys [0, s + i1) are visible to some row of this tile
    wk.k0 = int64_t(wk.split) * wk.info.splitLen;
    if (wk.k0 >= keyEnd)
    {
        return wk; // no row of this tile reads this split; the combine never reads it either
    }
    wk.k1 = min(wk.k0 + wk.info.splitLen, keyEnd);
    wk.nq = numQuantizedDev(wk.s, 0, p.residualLength, p.groupSize); // legacy layout: no sinks (never launched)
    wk.slot = p.slotIds[wk.b];
    wk.run = true;
    return wk;
}

//! score[j] = q(row warp + kATTN_WARPS * j) . k(key lane) over kD channels in fp32, for the kN rows of this warp.
template <int kD, int kN>
__device__ __forceinline__ void dotRows(float const (*qS)[kD], float const (*kS)[kD + 1], int32_t warp, int32_t lane,
    float (&score)[kROWS_PER_WARP])
{
#pragma unroll 8
    for (int32_t d = 0; d < kD; ++d) // KIVI_MODEL_LOOP(dot)
    {
        float const kv = kS[lane][d]; // KIVI_MODEL_ANCHOR(dot)
#pragma unroll
        for (int32_t j = 0; j < kN; ++j)
        {
            score[j] += qS[warp + kATTN_WARPS * j][d] * kv;
        }
    }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kATTN_THREADS, kATTN_MIN_CTAS_PER_SM) kiviAttentionKernel(
    KiviStepParams p, KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl)
{
    constexpr int32_t kCH = kD / 32; // channels per lane
    __shared__ float kS[kKEY_TILE][kD + 1]; // +1: lane j reads row j conflict-free
    __shared__ float vS[kKEY_TILE][kD];
    __shared__ float qS[kMAX_TILE_ROWS][kD];

    TileWork const wk = resolveTile<T, kD>(p, plan, seqInfo);
    if (!wk.run)
    {
        return;
    }
    int32_t const h = wk.h;
    int32_t const split = wk.split;
    int32_t const b = wk.b;
    SeqInfo const info = wk.info;
    int32_t const grp = plan.groupHeads;
    int32_t const i0 = wk.i0;
    int32_t const rows = wk.rows;
    int64_t const s = wk.s;
    int64_t const k0 = wk.k0;
    int64_t const k1 = wk.k1;
    int64_t const nq = wk.nq;
    int32_t const slot = wk.slot;
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    T* out = static_cast<T*>(p.out);
    float const softmaxScale = rsqrtf(float(kD));

    T const* q = static_cast<T const*>(p.q);
    for (int32_t u = threadIdx.x; u < kMAX_TILE_ROWS * kD; u += kATTN_THREADS) // KIVI_MODEL_LOOP(qload)
    {
        int32_t const row = u / kD;
        float x = 0.F;
        if (row < rows)
        {
            int64_t const token = info.tokenOffset + i0 + row / grp;
            x = ActTraits<T>::toFloat(q[(token * p.numHeads + h * grp + row % grp) * kD + u % kD]);
        }
        qS[row][u % kD] = x; // KIVI_MODEL_ANCHOR(qload)
    }

    int32_t const warpRows = rows > warp ? (rows - warp + kATTN_WARPS - 1) / kATTN_WARPS : 0;
    float m[kROWS_PER_WARP];
    float l[kROWS_PER_WARP];
    float acc[kROWS_PER_WARP][kCH];
#pragma unroll
    for (int32_t j = 0; j < kROWS_PER_WARP; ++j)
    {
        m[j] = -INFINITY;
        l[j] = 0.F;
#pragma unroll
        for (int32_t i = 0; i < kCH; ++i)
        {
            acc[j][i] = 0.F;
        }
    }

    for (int64_t kt = k0; kt < k1; kt += kKEY_TILE) // KIVI_MODEL_LOOP(tile)
    {
        __syncthreads(); // previous tile fully consumed (and qS written on the first pass)
        loadKeyValueTile<T, kD>(p, b, h, slot, s, nq, info.tokenOffset, kt, k1, kS, vS);
        __syncthreads();

        // Scores: lane = key kt + lane, for each of this warp's rows (row = warp + kATTN_WARPS * j); only the rows
        // that exist are computed (decode with few query heads per KV head uses 1 row per warp).
        float score[kROWS_PER_WARP] = {};
        switch (warpRows)
        {
        case 0: break;
        case 1: dotRows<kD, 1>(qS, kS, warp, lane, score); break;
        case 2: dotRows<kD, 2>(qS, kS, warp, lane, score); break;
        case 3: dotRows<kD, 3>(qS, kS, warp, lane, score); break;
        default: dotRows<kD, kROWS_PER_WARP>(qS, kS, warp, lane, score); break;
        }
        int64_t const key = kt + lane;
#pragma unroll
        for (int32_t j = 0; j < kROWS_PER_WARP; ++j)
        {
            int32_t const row = warp + kATTN_WARPS * j;
            if (row >= rows)
            {
                continue; // warp-uniform
            }
            int64_t const pos = s + i0 + row / grp; // causal: keys <= pos
            float const sc = (key < k1 && key <= pos) ? score[j] * softmaxScale : -INFINITY;
            float const mNew = fmaxf(m[j], warpMax(sc));
            float const alpha = mNew == -INFINITY ? 1.F : expf(m[j] - mNew);
            float const prob = mNew == -INFINITY ? 0.F : expf(sc - mNew);
            l[j] = l[j] * alpha + warpSum(prob);
            m[j] = mNew;
#pragma unroll
            for (int32_t i = 0; i < kCH; ++i)
            {
                acc[j][i] *= alpha;
            }
            for (int32_t jj = 0; jj < kKEY_TILE; ++jj) // KIVI_MODEL_LOOP(pv)
            {
                float const pj = __shfl_sync(0xffffffffU, prob, jj); // KIVI_MODEL_ANCHOR(pv)
#pragma unroll
                for (int32_t i = 0; i < kCH; ++i)
                {
                    acc[j][i] += pj * vS[jj][lane + 32 * i];
                }
            }
        }
    }

#pragma unroll
    for (int32_t j = 0; j < kROWS_PER_WARP; ++j)
    {
        int32_t const row = warp + kATTN_WARPS * j;
        if (row >= rows)
        {
            continue;
        }
        int64_t const token = info.tokenOffset + i0 + row / grp;
        int64_t const head = h * grp + row % grp;
        if (plan.numSplits == 1)
        {
            float const inv = l[j] > 0.F ? 1.F / l[j] : 0.F;
#pragma unroll
            for (int32_t i = 0; i < kCH; ++i)
            {
                out[(token * p.numHeads + head) * kD + lane + 32 * i] = ActTraits<T>::fromFloat(acc[j][i] * inv);
            }
        }
        else
        {
            int64_t const idx = (token * p.numHeads + head) * plan.numSplits + split;
#pragma unroll
            for (int32_t i = 0; i < kCH; ++i)
            {
                partialAcc[idx * kD + lane + 32 * i] = acc[j][i];
            }
            if (lane == 0)
            {
                partialMl[idx * 2] = m[j];
                partialMl[idx * 2 + 1] = l[j];
            }
        }
    }
}

//! Merge the split partials of each (token, head): one warp per pair. Rows of invalid sequences (and rows no
//! sequence covers) get zeros. allSplitsForDecodeRows: the decode-kernel rows (sequences with decode tiles) merge
//! every split (the split kernel, kiviDecodeSplit.cuh, spreads full-precision keys over all splits and writes every
//! split's partial); otherwise a row merges the splits holding keys 0..pos (contiguous key ranges).
template <typename T, int kD>
__global__ void __launch_bounds__(kATTN_THREADS) kiviCombineKernel(KiviStepParams p, KiviLaunchPlan plan,
    SeqInfo const* seqInfo, float const* partialAcc, float const* partialMl, int32_t allSplitsForDecodeRows)
{
    constexpr int32_t kCH = kD / 32;
    int32_t const lane = threadIdx.x % 32;
    int64_t const pair = int64_t(blockIdx.x) * kATTN_WARPS + threadIdx.x / 32;
    if (pair >= int64_t(p.numTokens) * p.numHeads)
    {
        return;
    }
    int32_t const token = static_cast<int32_t>(pair / p.numHeads);
    int32_t const b = findSequence<&SeqInfo::tokenOffset>(seqInfo, p.batch, token);
    SeqInfo const info = seqInfo[b];
    int32_t const c = p.chunkLen[b];
    T* out = static_cast<T*>(p.out) + pair * kD;
    if (!info.valid || token >= info.tokenOffset + c)
    {
#pragma unroll
        for (int32_t i = 0; i < kCH; ++i)
        {
            out[lane + 32 * i] = ActTraits<T>::fromFloat(0.F);
        }
        return;
    }
    int64_t const pos = int64_t(p.pastLen[b]) + (token - info.tokenOffset);
    int32_t const used = allSplitsForDecodeRows && info.tileCount > 0
        ? plan.numSplits
        : static_cast<int32_t>(pos / info.splitLen) + 1; // splits holding keys 0..pos
    float const* ml = partialMl + pair * plan.numSplits * 2;
    float mMax = -INFINITY;
    for (int32_t y = 0; y < used; ++y)
    {
        mMax = fmaxf(mMax, ml[2 * y]);
    }
    float l = 0.F;
    float acc[kCH] = {};
    for (int32_t y = 0; y < used; ++y)
    {
        float const wgt = ml[2 * y] == -INFINITY ? 0.F : expf(ml[2 * y] - mMax);
        l += ml[2 * y + 1] * wgt;
#pragma unroll
        for (int32_t i = 0; i < kCH; ++i)
        {
            acc[i] += wgt * partialAcc[(pair * plan.numSplits + y) * kD + lane + 32 * i];
        }
    }
    float const inv = l > 0.F ? 1.F / l : 0.F;
#pragma unroll
    for (int32_t i = 0; i < kCH; ++i)
    {
        out[lane + 32 * i] = ActTraits<T>::fromFloat(acc[i] * inv);
    }
}

} // namespace kernels
} // namespace trtllm_kivi
