/*
 * KIVI prefill / long-chunk attention on tensor cores, header-only (FlashAttention-2 style over dequantized history
 * tiles). trtllm_kivi/cuda/prefill_model.py is its CPU emulation (same tile walk, dequantization scatter, roundings
 * and online softmax); tests/test_kernels_prefill_model.py checks it against the reference.
 *
 * Why a second kernel: the decode kernel's CTA owns 8 query rows (the MMA's N), so a chunk of c tokens reads the
 * whole history c x groupHeads / 8 times. Here a CTA owns 64 query rows (4 warps x 16, the MMA's M) and reads the
 * history once per 64 rows, dequantizing each 32-key tile ONCE into shared memory for all of them.
 *
 *   grid (numPrefillTiles, Hkv, numSplits), 128 threads. Rows are flattened as in the decode kernel (row r of a
 *   sequence's chunk = token r / groupHeads, query head r % groupHeads of KV head blockIdx.y); sequence b runs here
 *   when chunk_len[b] x groupHeads >= kPREFILL_TILE_ROWS (kiviPrepareKernel assigns every sequence to exactly one of
 *   the two kernels), with the same split of its keys as the decode kernel (same partials, same combine kernel).
 *   Per 32-key tile (keys in the decode kernel's order: store, sinks, ring, chunk; only the chunk is causally
 *   masked):
 *     1. the CTA fills K [32 keys][D] and V^T [D][32 keys] in shared memory with values of the activation dtype T:
 *        quantized keys from FRAGMENT-order words (each word's (key, channel) pairs follow the mma A layout, so every
 *        pair is one 32-bit, bank-conflict-free store), dequantized as the reference does (fp32 code * scale + zero,
 *        rounded once to T: the same history values as reference/attention.py); full-precision rows copied;
 *     2. each warp: S = Q K^T (Q = rnd_T(q log2(e) / sqrt(D)) as A fragments held in registers for the whole loop,
 *        K as B), online softmax in log2 units (ex2), P = rnd_T(p) re-used in registers as the A fragments of
 *        O += P V (V^T rows as B), fp32 accumulators; l sums the rounded P (numerator and denominator alike).
 *   numSplits == 1: out = O / l. Otherwise (m, l, O) partials as the decode kernel (m in natural-log units).
 */
#pragma once

#include "kiviDecodeMma.cuh"

namespace trtllm_kivi
{
namespace kernels
{

constexpr int32_t kPF_THREADS = 128;
constexpr int32_t kPF_WARPS = 4;
constexpr int32_t kPF_ROWS = kPREFILL_TILE_ROWS; //!< 4 warps x 16 rows (the MMA's M)
constexpr int32_t kPF_KEYS = kKEY_TILE;          //!< keys per tile: one FRAGMENT chunk; a K group never straddles it
constexpr int32_t kPF_VSTRIDE = kPF_KEYS + 8;    //!< V^T row: 40 halves = 20 words, conflict-free B loads and stores
static_assert(kPF_ROWS == 16 * kPF_WARPS, "one 16-row MMA tile per warp");

//! The CTA's dequantized tile (static shared memory: 21 KB at D = 128).
template <typename T, int kD>
struct __align__(16) PrefillSmem
{
    T k[kPF_KEYS][kD + 8]; //!< K [key][channel]; row = 68 words at D = 128: B loads (key g, word t) hit 4g + t
    T vt[kD][kPF_VSTRIDE]; //!< V^T [channel][key]; B loads (channel g, word t) hit 20g + t (mod 32)
    float kScale[kD];      //!< the tile's K group (G >= 32: one group per 32-key tile)
    float kZero[kD];
    float vScale[kPF_KEYS][kD / 32]; //!< per key, per V group (Gv >= 32)
    float vZero[kPF_KEYS][kD / 32];
};

//! Dequantize one 32-key FRAGMENT chunk (words [tile tau][lane][j], nw per lane) into the tile. Word j of a lane holds,
//! at bit position pos, the pair of A register pi = j (16 / b) + pos: 16-block pi / 4, register pi % 4
//! (mma_model.register_of), at A row g + 8 (reg & 1), columns 2t + 8 (reg >> 1) + {0, 1} (mma_model.a_coord).
//! K: rows keys, columns channels (one store into K); V: rows channels, columns keys (one store into V^T).
template <typename T, int kD, bool kVALUES>
__device__ __forceinline__ void dequantizeChunkPf(
    uint32_t const* words, int32_t bits, int32_t gv, PrefillSmem<T, kD>& sm)
{
    int32_t const per = 16 / bits;
    int32_t const nw = kD * bits / 64;
    uint32_t const mask = (1U << bits) - 1U;
    for (int32_t u = threadIdx.x; u < 64 * nw; u += kPF_THREADS)
    {
        int32_t const lane = u & 31;
        int32_t const tau = (u >> 5) & 1;
        int32_t const j = u >> 6;
        uint32_t const w = __ldg(words + (tau * 32 + lane) * nw + j);
        for (int32_t pos = 0; pos < per; ++pos)
        {
            int32_t const pi = j * per + pos;
            int32_t const reg = pi & 3;
            int32_t const row = (lane >> 2) + 8 * (reg & 1);     // A row
            int32_t const col = 2 * (lane & 3) + 8 * (reg >> 1); // A column (pair col, col + 1)
            float const c0 = float((w >> (pos * bits)) & mask);
            float const c1 = float((w >> (16 + pos * bits)) & mask);
            if constexpr (kVALUES)
            {
                int32_t const ch = 16 * (pi >> 2) + row;
                int32_t const key = 16 * tau + col;
                int32_t const grpIdx = ch / gv;
                *reinterpret_cast<uint32_t*>(&sm.vt[ch][key])
                    = MmaTraits<T>::pack(dequantize(c0, sm.vScale[key][grpIdx], sm.vZero[key][grpIdx]),
                        dequantize(c1, sm.vScale[key + 1][grpIdx], sm.vZero[key + 1][grpIdx]));
            }
            else
            {
                int32_t const key = 16 * tau + row;
                int32_t const ch = 16 * (pi >> 2) + col;
                *reinterpret_cast<uint32_t*>(&sm.k[key][ch]) = MmaTraits<T>::pack(
                    dequantize(c0, sm.kScale[ch], sm.kZero[ch]), dequantize(c1, sm.kScale[ch + 1], sm.kZero[ch + 1]));
            }
        }
    }
}

//! Fill the tile from the quantized store: keys [kt, kt + 32) are store rows [kt, kt + 32) (block table entry
//! kt / BS, rows kt % BS ..). Word u of a FRAGMENT chunk ([tile tau][lane][j], nw words per lane) holds, at bit
//! position pos, the pair of A register pi = j (16 / b) + pos of that lane: 16-block pi / 4, register pi % 4
//! (mma_model.register_of); its (row, column) is the PTX A layout (mma_model.a_coord). K: rows keys, columns
//! channels; V: rows channels, columns keys.
template <typename T, int kD>
__device__ __forceinline__ void loadQuantizedTilePf(
    KiviStepParams const& p, MmaWork const& wk, int32_t const* table, int32_t kt, PrefillSmem<T, kD>& sm)
{
    int32_t const bs = p.blockSize;
    int32_t const blk = table[kt / bs];
    int32_t const r = kt % bs; // a multiple of 32
    int64_t const headRows = (int64_t(blk) * p.numKvHeads + wk.h) * bs;
    int32_t const gv = valueGroupSizeDev(p.groupSize, kD);
    int32_t const vGroups = kD / gv;
    int64_t const ks = ((int64_t(blk) * p.numKvHeads + wk.h) * (bs / p.groupSize) + r / p.groupSize) * kD;
    for (int32_t u = threadIdx.x; u < kD; u += kPF_THREADS)
    {
        sm.kScale[u] = loadScale(p.kScale, ks + u, p.scaleDtype);
        sm.kZero[u] = loadScale(p.kZero, ks + u, p.scaleDtype);
    }
    for (int32_t u = threadIdx.x; u < kPF_KEYS * vGroups; u += kPF_THREADS)
    {
        int64_t const idx = (headRows + r + u / vGroups) * vGroups + u % vGroups;
        sm.vScale[u / vGroups][u % vGroups] = loadScale(p.vScale, idx, p.scaleDtype);
        sm.vZero[u / vGroups][u % vGroups] = loadScale(p.vZero, idx, p.scaleDtype);
    }
    __syncthreads();
    // a warp takes one (tau, j) for its 32 lanes, so a store instruction covers keys g (+8), words t: no conflict
    uint32_t const* kWords = static_cast<uint32_t const*>(p.kCodes) + (headRows + r) * (kD * p.kBits / 32);
    uint32_t const* vWords = static_cast<uint32_t const*>(p.vCodes) + (headRows + r) * (kD * p.vBits / 32);
    dequantizeChunkPf<T, kD, false>(kWords, p.kBits, gv, sm);
    dequantizeChunkPf<T, kD, true>(vWords, p.vBits, gv, sm);
}

//! Fill the tile from full-precision rows (sinks, ring, chunk: fullPrecisionRow; zeros past k1, masked anyway).
template <typename T, int kD>
__device__ __forceinline__ void loadFullPrecisionTilePf(
    KiviStepParams const& p, MmaWork const& wk, int32_t kt, PrefillSmem<T, kD>& sm)
{
    constexpr int32_t kVECS = kD / 8; // 16-byte vectors per row
    for (int32_t u = threadIdx.x; u < kPF_KEYS * kVECS; u += kPF_THREADS)
    {
        int32_t const key = u / kVECS;
        int32_t const c8 = u % kVECS;
        T const* row = fullPrecisionRow<T, kD>(p, wk, false, kt + key);
        *reinterpret_cast<uint4*>(&sm.k[key][8 * c8])
            = row ? *reinterpret_cast<uint4 const*>(row + 8 * c8) : make_uint4(0, 0, 0, 0);
    }
    // V^T: a thread transposes keys (2 kp, 2 kp + 1) x 8 channels into 8 key pairs
    for (int32_t u = threadIdx.x; u < (kPF_KEYS / 2) * kVECS; u += kPF_THREADS)
    {
        int32_t const kp = u % (kPF_KEYS / 2);
        int32_t const c8 = u / (kPF_KEYS / 2);
        T const* r0 = fullPrecisionRow<T, kD>(p, wk, true, kt + 2 * kp);
        T const* r1 = fullPrecisionRow<T, kD>(p, wk, true, kt + 2 * kp + 1);
        uint4 const x0 = r0 ? *reinterpret_cast<uint4 const*>(r0 + 8 * c8) : make_uint4(0, 0, 0, 0);
        uint4 const x1 = r1 ? *reinterpret_cast<uint4 const*>(r1 + 8 * c8) : make_uint4(0, 0, 0, 0);
        uint32_t const a[4] = {x0.x, x0.y, x0.z, x0.w};
        uint32_t const b[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int32_t i = 0; i < 4; ++i)
        {
            *reinterpret_cast<uint32_t*>(&sm.vt[8 * c8 + 2 * i][2 * kp]) = __byte_perm(a[i], b[i], 0x5410);
            *reinterpret_cast<uint32_t*>(&sm.vt[8 * c8 + 2 * i + 1][2 * kp]) = __byte_perm(a[i], b[i], 0x7632);
        }
    }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kPF_THREADS, 3) kiviPrefillMmaKernel(
    KiviStepParams p, KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl)
{
    constexpr int32_t kKB = kD / 16; // 16-channel blocks: the k steps of S = Q K^T
    constexpr int32_t kNT = kD / 8;  // 8-channel n-tiles of O
    __shared__ PrefillSmem<T, kD> sm;

    MmaWork const wk
        = resolveTile<T, kD, kPF_ROWS, &SeqInfo::prefillTileOffset, &SeqInfo::prefillTileCount>(p, plan, seqInfo);
    if (!wk.run)
    {
        return;
    }
    int32_t const grp = plan.groupHeads;
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    // This lane's two rows (C fragment rows g and g + 8 of the warp's 16); dead rows take row 0's position (never
    // written) so that every row sees at least one key and stays NaN-free.
    int32_t rowN[2];
    bool live[2];
    int32_t pos[2];
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        rowN[j] = warp * 16 + g + 8 * j;
        live[j] = rowN[j] < wk.nRows;
        pos[j] = wk.s + (wk.row0 + (live[j] ? rowN[j] : 0)) / grp;
    }
    bool const warpLive = warp * 16 < wk.nRows; // warp-uniform: dead warps only help fill the tiles

    // A fragments of Q: qsc = rnd_T(q log2(e) / sqrt(D)) (row g + 8 (r & 1), channels 16 kb + 2t + 8 (r >> 1))
    float const smScale = kD == 64 ? 0.18033688011112042F : 0.12751743082459868F;
    T const* q = static_cast<T const*>(p.q);
    uint32_t qa[kKB][4];
#pragma unroll
    for (int32_t kb = 0; kb < kKB; ++kb)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            int32_t const j = r & 1;
            float2 x = make_float2(0.F, 0.F);
            if (live[j])
            {
                int32_t const row = wk.row0 + rowN[j];
                int64_t const token = wk.info.tokenOffset + row / grp;
                int32_t const ch = 16 * kb + 2 * t + 8 * (r >> 1);
                x = MmaTraits<T>::unpack(
                    *reinterpret_cast<uint32_t const*>(q + (token * p.numHeads + wk.h * grp + row % grp) * kD + ch));
            }
            qa[kb][r] = MmaTraits<T>::pack(x.x * smScale, x.y * smScale);
        }
    }

    float o[kNT][4];
#pragma unroll
    for (int32_t nt = 0; nt < kNT; ++nt)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            o[nt][r] = 0.F;
        }
    }
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.F, 0.F};
    int32_t const* table = p.blockTable + int64_t(wk.b) * p.maxBlocksPerSeq;
    // tiles ending at or before maskFrom need no mask: all their keys are below k1 and every row's limit
    int32_t const maskFrom = min(wk.k1, wk.s + wk.row0 / grp + 1);
    for (int32_t kt = wk.k0; kt < wk.k1; kt += kPF_KEYS)
    {
        __syncthreads(); // every warp is done with the previous tile
        if (kt < wk.nq)
        {
            loadQuantizedTilePf<T, kD>(p, wk, table, kt, sm);
        }
        else
        {
            loadFullPrecisionTilePf<T, kD>(p, wk, kt, sm);
        }
        __syncthreads();
        if (!warpLive)
        {
            continue;
        }
        // S = Q K^T: C fragment s[nt][r] = (row g + 8 (r >> 1), key 8 nt + 2t + (r & 1))
        float s[4][4];
#pragma unroll
        for (int32_t nt = 0; nt < 4; ++nt)
        {
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                s[nt][r] = 0.F;
            }
#pragma unroll
            for (int32_t kb = 0; kb < kKB; ++kb)
            {
                uint32_t const b0 = *reinterpret_cast<uint32_t const*>(&sm.k[8 * nt + g][16 * kb + 2 * t]);
                uint32_t const b1 = *reinterpret_cast<uint32_t const*>(&sm.k[8 * nt + g][16 * kb + 8 + 2 * t]);
                mma16816<T>(s[nt], qa[kb], b0, b1);
            }
        }
        if (kt + kPF_KEYS > maskFrom) // keys past the split or past a row's causal limit (uniform branch)
        {
#pragma unroll
            for (int32_t nt = 0; nt < 4; ++nt)
            {
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    int32_t const key = kt + 8 * nt + 2 * t + (r & 1);
                    if (!(key < wk.k1 && key <= pos[r >> 1]))
                    {
                        s[nt][r] = -INFINITY;
                    }
                }
            }
        }
        // online softmax per row (4 lanes t of group g hold a row's 32 scores)
        float mUse[2];
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
            float mx = m[j];
#pragma unroll
            for (int32_t nt = 0; nt < 4; ++nt)
            {
                mx = fmaxf(mx, fmaxf(s[nt][2 * j], s[nt][2 * j + 1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffU, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffU, mx, 2));
            float const alpha = mx == m[j] ? 1.F : fastExp2(m[j] - mx); // ex2(-inf) = 0
            m[j] = mx;
            mUse[j] = mx == -INFINITY ? 0.F : mx;
            l[j] *= alpha;
#pragma unroll
            for (int32_t nt = 0; nt < kNT; ++nt)
            {
                o[nt][2 * j] *= alpha;
                o[nt][2 * j + 1] *= alpha;
            }
        }
        // P = rnd_T(2^(s - m)) as the A fragments of the two 16-key blocks (C of n-tiles 2kk, 2kk + 1)
        uint32_t pa[2][4];
#pragma unroll
        for (int32_t kk = 0; kk < 2; ++kk)
        {
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                int32_t const nt = 2 * kk + (r >> 1);
                int32_t const j = r & 1;
                pa[kk][r] = MmaTraits<T>::pack(
                    fastExp2(s[nt][2 * j] - mUse[j]), fastExp2(s[nt][2 * j + 1] - mUse[j]));
                float2 const w = MmaTraits<T>::unpack(pa[kk][r]);
                l[j] += w.x + w.y;
            }
        }
        // O += P V: B = V^T rows (channel 8 nt + g, keys 16 kk + 2t (+8))
#pragma unroll
        for (int32_t nt = 0; nt < kNT; ++nt)
        {
#pragma unroll
            for (int32_t kk = 0; kk < 2; ++kk)
            {
                uint32_t const b0 = *reinterpret_cast<uint32_t const*>(&sm.vt[8 * nt + g][16 * kk + 2 * t]);
                uint32_t const b1 = *reinterpret_cast<uint32_t const*>(&sm.vt[8 * nt + g][16 * kk + 8 + 2 * t]);
                mma16816<T>(o[nt], pa[kk], b0, b1);
            }
        }
    }
    if (!warpLive)
    {
        return;
    }
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        l[j] += __shfl_xor_sync(0xffffffffU, l[j], 1);
        l[j] += __shfl_xor_sync(0xffffffffU, l[j], 2);
    }
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        if (!live[j])
        {
            continue;
        }
        int32_t const row = wk.row0 + rowN[j];
        int64_t const token = wk.info.tokenOffset + row / grp;
        int64_t const head = wk.h * grp + row % grp;
#pragma unroll
        for (int32_t nt = 0; nt < kNT; ++nt)
        {
            int32_t const ch = 8 * nt + 2 * t;
            if (plan.numSplits == 1)
            {
                float const x0 = l[j] > 0.F ? __fdiv_rn(o[nt][2 * j], l[j]) : 0.F;
                float const x1 = l[j] > 0.F ? __fdiv_rn(o[nt][2 * j + 1], l[j]) : 0.F;
                *reinterpret_cast<uint32_t*>(out + (token * p.numHeads + head) * kD + ch) = MmaTraits<T>::pack(x0, x1);
            }
            else
            {
                int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;
                *reinterpret_cast<float2*>(partialAcc + idx * kD + ch) = make_float2(o[nt][2 * j], o[nt][2 * j + 1]);
                if (nt == 0 && t == 0)
                {
                    partialMl[idx * 2] = m[j] * kLN2; // the combine kernel weighs splits in natural-log units
                    partialMl[idx * 2 + 1] = l[j];
                }
            }
        }
    }
}

} // namespace kernels
} // namespace trtllm_kivi
