/*
 * KIVI decode attention, the split design (decode variants >= 2, kiviDecodeVariants.h): header-only.
 * trtllm_kivi/cuda/split_model.py is its lane-level CPU emulation (same tiles, split and warp assignment, fold
 * chains, partial softmax states and merge order); tests/test_kernels_mma_model.py checks it against the reference.
 *
 * The arithmetic of a quantized 32-key chunk is kiviDecodeMma.cuh's (FRAGMENT-order codes, one shift + one lop3 per
 * register, K scales folded into q'' per group, V scales into P', the V bias and l by one MMA per 16 keys), with a
 * shorter dependency chain: the score MMAs start from zero and the group's bias is added after them, the bias
 * itself is two independent m16n8k8 chains per term (even / odd 16-channel blocks), the register-only asm is not
 * volatile, the running maximum is reduced across lanes only when a score exceeds it (a warp vote first), and a
 * key row's V scales are one 8-byte load. What differs is where the bytes come from and who reads them:
 *
 *   grid (numTiles, Hkv, numSplits), 128 threads = 4 warps; a CTA owns 8 query rows of one sequence (the MMA's N,
 *   all query heads of its KV head: GQA packing) and one split.
 *   Quantized keys (store indices [0, n_q)) in 32-key chunks: split y takes chunks [y Lc, (y + 1) Lc), Lc =
 *   max(8, ceil(n_q / 32 / numSplits)), and its 4 warps contiguous quarters. Each warp streams its chunks through
 *   its own ring of kSTAGES cp.async stages; the refill is issued right after the wait, so kSTAGES - 1 chunks are in
 *   flight while one is computed. The block-table row is read 32 entries per lane-parallel load, one batch ahead.
 *   Full-precision keys (sinks, ring, the chunk's own rows: [n_q, keyEnd) in kernel key order) in 16-key tiles:
 *   tile j goes to split j % numSplits, and within it to warp 3 or 2 (the warps with the shorter quantized ranges),
 *   alternately. A tile is staged by cp.async (16-byte rows, XOR-swizzled, zero-filled past keyEnd) into the warp's
 *   own tile buffer, issued before the warp's first quantized chunk and consumed after its last one, and read with
 *   ldmatrix (K) / ldmatrix.trans (V^T): no per-lane global load of a full-precision row in the key loop, and no
 *   split or warp holds the whole window.
 *   Splits: with plan.fusedCombine the last CTA of a (tile, KV head) to arrive (an atomic counter the prepare kernel
 *   zeroes each step) merges the splits' (m, l, O) from the workspace in split order and writes out; otherwise one
 *   split writes out directly or kiviCombineKernel merges them (every split of a row: full-precision tiles may lie
 *   in any split).
 *   Decode mode (plan.decodeMode, every chunk at most one token): tile x = sequence x tilesPerSeq + i; the CTA finds
 *   its token offset and the scalar checks itself, so it streams keys while kiviPrepareKernel runs (programmatic
 *   dependent launch on sm_90) and waits for it (griddepcontrol.wait) only before its first write: the validity
 *   verdict (block ids), the counters, the output.
 *   A whole step of a fused variant: the first CTA of each (sequence, KV head) writes the window row of a valid
 *   one-token chunk that flushes nothing (SeqInfo::windowWritten, the prepare kernel's decision; the append kernel
 *   skips those sequences). That row held token s - W, already quantized, so no CTA of this step reads it (streaming
 *   contract: attend, then append; W = R + G - 1 rows); a flush step, n_q(s + 1) > n_q(s), reads it and is left to
 *   kiviAppendKernel. Fused variants also zero the rows no sequence covers here (no zero-rows kernel).
 */
#pragma once

#include "kiviDecodeVariants.h"
#include "kiviSplitHelpers.cuh"

namespace trtllm_kivi
{
namespace kernels
{

constexpr int32_t kSPLIT_THREADS = 128;
constexpr int32_t kSPLIT_WARPS = 4;
constexpr int32_t kFP_TILE = 16; //!< keys per full-precision tile (the S MMA's M)
constexpr int32_t kFP_WARPS = 2; //!< warps 3 and 2 own a full-precision tile buffer each
constexpr int32_t kMIN_SPLIT_CHUNKS = kMIN_SPLIT_LEN / kMMA_CHUNK;

//! What one CTA of the split kernel works on.
struct SplitWork
{
    bool run;      //!< the CTA has rows (a valid-looking sequence, a tile inside it)
    bool valid;    //!< decode mode: the scalar checks passed; general mode: SeqInfo::valid
    int32_t b;     //!< -1: past the batch's tiles
    int32_t h;
    int32_t split;
    int32_t tileInSeq; //!< tile index within the sequence (decode mode: blockIdx.x % tilesPerSeq)
    int32_t tokenOffset;
    int32_t c;     //!< chunk_len as given
    int32_t rowsAll; //!< query rows of the sequence in this step: clamped chunk tokens x groupHeads
    int32_t row0;
    int32_t nRows;
    int32_t s;
    int32_t slot;
    int32_t nq;
    int32_t keyEnd; //!< keys [0, keyEnd) are visible to some row of the tile
};

//! One quantized 32-key chunk of a warp from its stage `stg` (kiviDecodeMma.cuh's arithmetic; see the top).
template <typename T, int kD, int kKB, int kVB, typename S, int kVG>
__device__ __forceinline__ void splitQuantizedChunk(char const* stg, uint4 const* qaS, bool newGroup, int32_t vGroups,
    int32_t vSliceShift, int32_t lane, uint32_t one2, uint32_t (&qK)[kD / 16][2], float (&biasS)[2],
    MmaWarpState<kD>& st)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    using AffV = CodeAffine<T, kVB>;
    constexpr int32_t kMT = kD / 16;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    char const* kWords = stg;
    char const* vWords = kWords + Geo::kKWORDS * 4;
    char const* kScale = vWords + Geo::kVWORDS * 4;
    char const* kZero = kScale + kD * sizeof(S);
    char const* vScale = kZero + kD * sizeof(S);
    char const* vZero = vScale + kMMA_CHUNK * vGroups * sizeof(S);
    if (newGroup)
    {
        foldKeyGroupSplit<T, kD, kKB, S>(qaS, kScale, kZero, g, t, qK, biasS);
    }
    // S = K q''^T from zero (two independent chains, one per 16-key tile), then + bias
    float sc[2][4];
    uint32_t w[2][Geo::kNWK];
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
        uint32_t const* src = reinterpret_cast<uint32_t const*>(kWords) + (tau * 32 + lane) * Geo::kNWK;
#pragma unroll
        for (int32_t j = 0; j < Geo::kNWK; ++j)
        {
            w[tau][j] = src[j];
        }
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            sc[tau][r] = 0.F;
        }
    }
#pragma unroll
    for (int32_t kb = 0; kb < kMT; ++kb)
    {
#pragma unroll
        for (int32_t tau = 0; tau < 2; ++tau)
        {
            uint32_t a[4];
            convertBlock<T, kKB, Geo::kNWK>(w[tau], kb, one2, a);
            mmaReg<T>(sc[tau], a, qK[kb][0], qK[kb][1]);
        }
    }
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            sc[tau][r] = __fadd_rn(sc[tau][r], biasS[r & 1]);
        }
    }
    softmaxUpdate<kD, 2>(sc, st);
    // O^T += V^T P'^T; [V bias ; l] += [u ; 1] w^T
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
        uint32_t b0;
        uint32_t b1;
        probabilities<T, kD>(sc[tau], st, b0, b1);
        ValueScaleRows<T, kVB, S, kVG> vt;
        vt.loadRows(vScale, vZero, 16 * tau, vGroups, vSliceShift, t);
        uint32_t av[4];
        vt.biasOperand(g, av);
        uint32_t wv[Geo::kNWV];
        uint32_t const* src = reinterpret_cast<uint32_t const*>(vWords) + (tau * 32 + lane) * Geo::kNWV;
#pragma unroll
        for (int32_t j = 0; j < Geo::kNWV; ++j)
        {
            wv[j] = src[j];
        }
        uint32_t const wb0 = MmaTraits<T>::mul2(b0, AffV::kINV_BETA2); // exact: a power of two
        uint32_t const wb1 = MmaTraits<T>::mul2(b1, AffV::kINV_BETA2);
        uint32_t pb0 = 0;
        uint32_t pb1 = 0;
#pragma unroll
        for (int32_t mt = 0; mt < kMT; ++mt)
        {
            if (mt % 2 == 0) // a 32-channel slice lies in one V group (Gv >= 32): P' = rnd(w / beta * s_v)
            {
                pb0 = MmaTraits<T>::mul2(wb0, vt.scalePair(mt / 2, false));
                pb1 = MmaTraits<T>::mul2(wb1, vt.scalePair(mt / 2, true));
            }
            uint32_t a[4];
            convertBlock<T, kVB, Geo::kNWV>(wv, mt, one2, a);
            mmaReg<T>(st.o[mt], a, pb0, pb1);
        }
        mmaReg<T>(st.vb, av, b0, b1);
    }
}

//! Issue the cp.async copies of full-precision tile j (keys n_q + 16 j ..) into the warp's tile buffer: K rows at
//! `buf`, V rows after them, zeros for keys at or past keyEnd. Keys in kernel order: [n_q, n_q + S) the sink rows,
//! then the ring (token = key, window row S + (key - S) % W), then the chunk's rows from k / v.
template <typename T, int kD>
__device__ __forceinline__ void issueFullPrecisionTile(KiviStepParams const& p, SplitWork const& wk, uint32_t buf,
    int32_t j, int32_t lane)
{
    constexpr int32_t kCHUNKS = kD / 8;          // 16-byte chunks per row
    constexpr int32_t kROWS_PER = 32 / kCHUNKS;  // rows one pass of the warp covers
    int32_t const c = lane % kCHUNKS;
    int32_t const w = p.residualLength + p.groupSize - 1;
    int32_t const sinks = p.sinkTokens;
    int64_t const winBase = (int64_t(wk.slot) * p.numKvHeads + wk.h) * (sinks + w);
#pragma unroll
    for (int32_t i = 0; i < kFP_TILE / kROWS_PER; ++i)
    {
        int32_t const r = lane / kCHUNKS + kROWS_PER * i;
        int32_t const key = wk.nq + kFP_TILE * j + r;
        bool const valid = key < wk.keyEnd;
        int64_t row; // element offset of the key's row in the window (key < s) or in k / v
        T const* kSrc;
        T const* vSrc;
        if (key < wk.s)
        {
            int32_t const wr = key < wk.nq + sinks ? key - wk.nq : sinks + (key - sinks) % w;
            row = (winBase + wr) * kD;
            kSrc = static_cast<T const*>(p.kWindow);
            vSrc = static_cast<T const*>(p.vWindow);
        }
        else
        {
            row = ((int64_t(wk.tokenOffset) + (valid ? key - wk.s : 0)) * p.numKvHeads + wk.h) * kD;
            kSrc = static_cast<T const*>(p.k);
            vSrc = static_cast<T const*>(p.v);
        }
        uint32_t const off = fpTileOffset<kD>(r, c);
        cpAsync16Zfill(buf + off, kSrc + row + 8 * c, valid);
        cpAsync16Zfill(buf + kFP_TILE * kD * 2 + off, vSrc + row + 8 * c, valid);
    }
}

//! One full-precision 16-key tile from the warp's buffer: S = K rnd(qsc)^T (ldmatrix A, no scale, no bias), the
//! causal / length mask, the online softmax, O^T += V^T P^T (ldmatrix.trans A) and l += 1 P^T.
template <typename T, int kD>
__device__ __forceinline__ void splitFullPrecisionTile(uint32_t buf, uint4 const* qfS, int32_t key0, int32_t keyEnd,
    int32_t const (&pos)[2], int32_t vGroups, int32_t lane, MmaWarpState<kD>& st)
{
    constexpr int32_t kMT = kD / 16;
    int32_t const g = lane >> 2;
    uint32_t qf[kMT][2];
    loadQa<kD>(qfS, lane, qf);
    float sc[1][4] = {{0.F, 0.F, 0.F, 0.F}};
    int32_t const rowK = lane % 16;
#pragma unroll
    for (int32_t kb = 0; kb < kMT; ++kb)
    {
        uint32_t a[4];
        ldmatrixX4(a, buf + fpTileOffset<kD>(rowK, 2 * kb + lane / 16));
        mmaReg<T>(sc[0], a, qf[kb][0], qf[kb][1]);
    }
#pragma unroll
    for (int32_t r = 0; r < 4; ++r)
    {
        int32_t const key = key0 + g + 8 * (r >> 1);
        if (!(key < keyEnd && key <= pos[r & 1]))
        {
            sc[0][r] = -INFINITY;
        }
    }
    softmaxUpdate<kD, 1>(sc, st);
    uint32_t b0;
    uint32_t b1;
    probabilities<T, kD>(sc[0], st, b0, b1);
    int32_t const mi = lane / 8; // ldmatrix.trans matrix: channel half mi & 1, key half mi >> 1
    int32_t const rowV = (lane % 8) + 8 * (mi >> 1);
    uint32_t const vBuf = buf + kFP_TILE * kD * 2;
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
        uint32_t a[4];
        ldmatrixX4Trans(a, vBuf + fpTileOffset<kD>(rowV, 2 * mt + (mi & 1)));
        mmaReg<T>(st.o[mt], a, b0, b1);
    }
    constexpr uint32_t kONE2 = MmaTraits<T>::kONE * 0x00010001U;
    uint32_t av[4];
    av[0] = g == vGroups ? kONE2 : 0U; // l only: full-precision keys have no V bias
    av[2] = av[0];
    av[1] = 0U;
    av[3] = 0U;
    mmaReg<T>(st.vb, av, b0, b1);
}

//! One warp's keys: its quantized chunks [wc0, wc1) (store indices 32 wc0 ..) through the stage ring, then its
//! full-precision tiles j = split + numSplits (f + kFP_WARPS k), the first of which was issued before the ring.
template <typename T, int kD, int kKB, int kVB, int kSTAGES, typename S, int kVG>
__device__ __forceinline__ void splitKeyLoop(KiviStepParams const& p, KiviLaunchPlan const& plan,
    SplitWork const& wk, char* ring, uint32_t fpBuf, uint4 const* qaS, uint4 const* qfS, int32_t wc0, int32_t wc1,
    int32_t fpFirst, int32_t nft, int32_t const (&pos)[2], int32_t lane, MmaWarpState<kD>& st)
{
    int32_t const gv = valueGroupSizeDev(p.groupSize, kD);
    int32_t const vGroups = kD / gv;
    int32_t const vSliceShift = __ffs(gv / 32) - 1;
    int32_t const log2Group = __ffs(p.groupSize) - 1;
    int32_t const stageBytes = mmaStageBytes<kD, kKB, kVB>(sizeof(S), p.groupSize);
    uint32_t one2 = MmaTraits<T>::kONE * 0x00010001U;
    asm volatile("" : "+r"(one2)); // keep the lop3 constant in a register (one LOP3 per code register)

    // block-table entries, 32 per lane-parallel load: `cur` holds entries [tblBase, tblBase + 32), `nxt` the next 32
    int32_t const* table = p.blockTable + int64_t(wk.b) * p.maxBlocksPerSeq;
    int32_t const key0 = wc0 * kMMA_CHUNK;
    ChunkCursor issueAt{key0 / p.blockSize, key0 % p.blockSize};
    int32_t tblBase = issueAt.entry;
    auto tableAt = [&](int32_t e) { return e < p.maxBlocksPerSeq ? table[e] : 0; };
    int32_t cur = wc0 < wc1 ? tableAt(tblBase + lane) : 0;
    int32_t nxt = wc0 < wc1 ? tableAt(tblBase + 32 + lane) : 0;
    int32_t issueStage = 0;
    auto issue = [&](int32_t ci) {
        if (ci < wc1)
        {
            int32_t e = issueAt.entry - tblBase;
            if (e >= 32) // uniform: the next batch was loaded one batch ago
            {
                cur = nxt;
                tblBase += 32;
                e -= 32;
                nxt = tableAt(tblBase + 32 + lane);
            }
            int32_t blk = __shfl_sync(0xffffffffU, cur, e);
            blk = blk >= 0 && blk < p.numBlocks ? blk : 0; // decode mode checks block ids later: never address past
            issueChunk<kD, kKB, kVB, S>(p, ring + issueStage * stageBytes, blk, wk.h, issueAt.row,
                kVG > 0 ? kVG : vGroups, log2Group, lane);
            issueAt.advance(p.blockSize);
        }
        issueStage = issueStage == kSTAGES - 1 ? 0 : issueStage + 1;
        cpAsyncCommit(); // one group per chunk slot: wait_group counts stay uniform
    };
#pragma unroll
    for (int32_t i = 0; i < kSTAGES - 1; ++i)
    {
        issue(wc0 + i);
    }

    uint32_t qK[kD / 16][2];
    float biasS[2] = {0.F, 0.F};
    int32_t useStage = 0;
    for (int32_t ci = wc0; ci < wc1; ++ci)
    {
        cpAsyncWait<kSTAGES - 2>();
        __syncwarp(); // every lane's copies of chunk ci landed; every lane finished reading chunk ci - 1's stage
        issue(ci + kSTAGES - 1); // refill the stage chunk ci - 1 used: kSTAGES - 1 chunks in flight
        bool const newGroup = ci == wc0 || ((ci * kMMA_CHUNK) & (p.groupSize - 1)) == 0; // G: a power of two
        splitQuantizedChunk<T, kD, kKB, kVB, S, kVG>(ring + useStage * stageBytes, qaS, newGroup, vGroups,
            vSliceShift, lane, one2, qK, biasS, st);
        useStage = useStage == kSTAGES - 1 ? 0 : useStage + 1;
    }
    cpAsyncWait<0>();
    __syncwarp();
    for (int32_t j = fpFirst; j < nft; j += kFP_WARPS * plan.numSplits)
    {
        if (j != fpFirst) // later tiles reuse the buffer: one round trip each (only with few splits)
        {
            issueFullPrecisionTile<T, kD>(p, wk, fpBuf, j, lane);
            cpAsyncCommit();
            cpAsyncWait<0>();
            __syncwarp();
        }
        splitFullPrecisionTile<T, kD>(fpBuf, qfS, wk.nq + kFP_TILE * j, wk.keyEnd, pos, vGroups, lane, st);
        __syncwarp(); // every lane has read the buffer before the next tile overwrites it
    }
}

//! Sum of max(chunk_len[j], 0) over j < b (the prepare kernel's token offset), by the whole CTA.
__device__ __forceinline__ int64_t tokenPrefix(KiviStepParams const& p, int32_t b, int64_t* red)
{
    int64_t x = 0;
    for (int32_t j = threadIdx.x; j < b; j += kSPLIT_THREADS)
    {
        x += max(p.chunkLen[j], 0);
    }
#pragma unroll
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        x += __shfl_xor_sync(0xffffffffU, x, o);
    }
    if (threadIdx.x % 32 == 0)
    {
        red[threadIdx.x / 32] = x;
    }
    __syncthreads();
    return red[0] + red[1] + red[2] + red[3];
}

//! The CTA's sequence and rows. Decode mode: from blockIdx.x = b x tilesPerSeq + i with the prepare kernel's scalar
//! checks (lengths, capacity, slot) done here; the block ids are checked by the prepare kernel, whose verdict the
//! CTA reads before writing anything. General mode: from the prepare kernel's SeqInfo (waited for first).
template <int kD>
__device__ __forceinline__ SplitWork resolveSplitWork(KiviStepParams const& p, KiviLaunchPlan const& plan,
    SeqInfo const* seqInfo, int64_t* red)
{
    SplitWork wk{};
    wk.h = blockIdx.y;
    wk.split = blockIdx.z;
    int32_t const grp = plan.groupHeads;
    bool valid;
    if (plan.decodeMode)
    {
        wk.b = blockIdx.x / plan.tilesPerSeq;
        wk.tileInSeq = blockIdx.x % plan.tilesPerSeq;
        int64_t const offset = tokenPrefix(p, wk.b, red);
        wk.tokenOffset = static_cast<int32_t>(offset < p.numTokens ? offset : p.numTokens);
        int64_t const s = p.pastLen[wk.b];
        int64_t const c = p.chunkLen[wk.b];
        int64_t const e = s + c;
        int32_t const slot = p.slotIds[wk.b];
        valid = !(s < 0 || c < 0 || c > plan.maxChunkLen || offset + c > p.numTokens);
        int64_t const nqEnd = numQuantizedDev(e, p.sinkTokens, p.residualLength, p.groupSize);
        valid = valid && !(e > plan.maxSeqLen || nqEnd > int64_t(p.maxBlocksPerSeq) * p.blockSize);
        valid = valid && slot >= 0 && slot < p.numSlots;
        wk.c = static_cast<int32_t>(c);
        int64_t const avail = p.numTokens - wk.tokenOffset;
        int64_t const rows = c < 0 ? 0 : (c < avail ? c : (avail > 0 ? avail : 0));
        wk.rowsAll = static_cast<int32_t>(rows * grp);
        wk.s = static_cast<int32_t>(s);
        wk.slot = slot;
    }
    else
    {
        gridDependencyWait(); // the prepare kernel's SeqInfo
        int32_t const tile = blockIdx.x;
        wk.b = findSequence<&SeqInfo::tileOffset>(seqInfo, p.batch, tile);
        SeqInfo const info = seqInfo[wk.b];
        if (tile >= info.tileOffset + info.tileCount)
        {
            wk.b = -1; // past the batch's decode tiles (numTiles is an upper bound)
            return wk;
        }
        wk.tileInSeq = tile - info.tileOffset;
        wk.tokenOffset = info.tokenOffset;
        wk.c = p.chunkLen[wk.b];
        wk.rowsAll = min(wk.c, p.numTokens - info.tokenOffset) * grp;
        valid = info.valid != 0;
        wk.s = valid ? p.pastLen[wk.b] : 0;
        wk.slot = valid ? p.slotIds[wk.b] : 0;
    }
    wk.valid = valid;
    wk.row0 = wk.tileInSeq * kTILE_ROWS;
    wk.nRows = min(kTILE_ROWS, wk.rowsAll - wk.row0);
    if (!valid || wk.nRows <= 0)
    {
        return wk;
    }
    wk.keyEnd = wk.s + (wk.row0 + wk.nRows - 1) / grp + 1;
    wk.nq = static_cast<int32_t>(numQuantizedDev(wk.s, p.sinkTokens, p.residualLength, p.groupSize));
    wk.run = true;
    return wk;
}

//! Zero the output rows of tokens [t0, t1) of the heads of KV head h (h < 0: every head), 16-byte vectors.
template <typename T, int kD>
__device__ __forceinline__ void zeroRows(KiviStepParams const& p, int32_t grp, int64_t t0, int64_t t1, int32_t h)
{
    constexpr int32_t kVECS = kD / 8;
    int32_t const heads = h < 0 ? p.numHeads : grp;
    int64_t const n = (t1 - t0) * heads * kVECS;
    uint4* const out = static_cast<uint4*>(p.out);
    for (int64_t u = threadIdx.x; u < n; u += kSPLIT_THREADS)
    {
        int64_t const token = t0 + u / (heads * kVECS);
        int32_t const head = (h < 0 ? 0 : h * grp) + static_cast<int32_t>(u / kVECS % heads);
        out[(token * p.numHeads + head) * kVECS + u % kVECS] = make_uint4(0, 0, 0, 0);
    }
}

template <typename T, int kD, int kKB, int kVB, int kSTAGES>
__global__ void __launch_bounds__(kSPLIT_THREADS, mmaMinCtas(kKB, kVB)) kiviDecodeSplitKernel(KiviStepParams p,
    KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl, int32_t* counters)
{
    using AffK = CodeAffine<T, kKB>;
    constexpr int32_t kMT = kD / 16;
    extern __shared__ __align__(16) char smem[];
    __shared__ uint4 qaS[kD / 32 * 32]; // B fragments of qa = rnd(qsc) / beta, [kb / 2][lane]
    __shared__ uint4 qfS[kD / 32 * 32]; // B fragments of rnd(qsc) (full-precision keys)
    __shared__ int64_t red[kSPLIT_WARPS];
    __shared__ int32_t sLast;

    SplitWork const wk = resolveSplitWork<kD>(p, plan, seqInfo, red);
    int32_t const grp = plan.groupHeads;
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    int32_t const scaleBytes = p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2;
    int32_t const stageBytes = mmaStageBytes<kD, kKB, kVB>(scaleBytes, p.groupSize);
    char* const ring = smem + warp * kSTAGES * stageBytes;
    uint32_t const fpBase = static_cast<uint32_t>(__cvta_generic_to_shared(smem + kSPLIT_WARPS * kSTAGES * stageBytes));
    int32_t const f = kSPLIT_WARPS - 1 - warp; // full-precision slot of warps 3 and 2
    uint32_t const fpBuf = fpBase + (f < kFP_WARPS ? f : 0) * (2 * kFP_TILE * kD * 2);

    MmaWarpState<kD> st;
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            st.o[mt][r] = 0.F;
        }
    }
    st.m[0] = st.m[1] = -INFINITY;
#pragma unroll
    for (int32_t r = 0; r < 4; ++r)
    {
        st.vb[r] = 0.F;
    }

    if (wk.run)
    {
        // This split's quantized chunks [qc0, qc1) and the warp's quarter; full-precision tiles j = split + numSplits
        // (f + kFP_WARPS k) of the keys [n_q, keyEnd).
        int32_t const nqc = wk.nq / kMMA_CHUNK;
        int32_t const lc = max(kMIN_SPLIT_CHUNKS, (nqc + plan.numSplits - 1) / plan.numSplits);
        int32_t const qc0 = min(wk.split * lc, nqc);
        int32_t const n = min(qc0 + lc, nqc) - qc0;
        int32_t const per = (n + kSPLIT_WARPS - 1) / kSPLIT_WARPS;
        int32_t const wc0 = qc0 + min(warp * per, n);
        int32_t const wc1 = qc0 + min((warp + 1) * per, n);
        int32_t const nft = (wk.keyEnd - wk.nq + kFP_TILE - 1) / kFP_TILE;
        int32_t const fpFirst = f < kFP_WARPS ? wk.split + plan.numSplits * f : nft;
        if (fpFirst < nft) // the warp's first tile: the oldest cp.async group, landed before its first chunk
        {
            issueFullPrecisionTile<T, kD>(p, wk, fpBuf, fpFirst, lane);
            cpAsyncCommit();
        }
        // B fragments of q for row g, channels 16 kb + 8 reg + 2t + {0, 1}, straight from global memory: qf =
        // rnd(q log2(e) / sqrt(D)), qa = qf / beta (exact); warp w writes uint4 group w (0 for dead rows)
        float const smScale = kD == 64 ? 0.18033688011112042F : 0.12751743082459868F; // fl32(log2(e) / sqrt(D))
        if (warp < kD / 32)
        {
            int32_t const row = wk.row0 + g;
            T const* qRow = static_cast<T const*>(p.q)
                + ((int64_t(wk.tokenOffset) + row / grp) * p.numHeads + wk.h * grp + row % grp) * kD;
            uint32_t xf[4];
            uint32_t xa[4];
#pragma unroll
            for (int32_t k = 0; k < 4; ++k)
            {
                int32_t const ch = 16 * (2 * warp + k / 2) + 8 * (k % 2) + 2 * t;
                float2 qq = make_float2(0.F, 0.F);
                if (g < wk.nRows)
                {
                    uint32_t const bits = *reinterpret_cast<uint32_t const*>(qRow + ch);
                    float2 const v = MmaTraits<T>::unpack(bits);
                    qq = make_float2(v.x * smScale, v.y * smScale);
                }
                xf[k] = MmaTraits<T>::pack(qq.x, qq.y);
                xa[k] = MmaTraits<T>::mul2(xf[k], AffK::kINV_BETA2); // exact: 2^b
            }
            qfS[warp * 32 + lane] = make_uint4(xf[0], xf[1], xf[2], xf[3]);
            qaS[warp * 32 + lane] = make_uint4(xa[0], xa[1], xa[2], xa[3]);
        }
        __syncthreads();
        // causal limit of this lane's score columns (rows 2t, 2t + 1; dead rows take row 0's, never written)
        int32_t pos[2];
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
            int32_t const nn = 2 * t + j;
            pos[j] = wk.s + (wk.row0 + (nn < wk.nRows ? nn : 0)) / grp;
        }
        bool const actScales = p.scaleDtype == (std::is_same<T, half>::value ? kKIVI_FLOAT16 : kKIVI_BFLOAT16);
        int32_t const vGroups = kD / valueGroupSizeDev(p.groupSize, kD);
        if (actScales && vGroups == kD / 32)
        {
            splitKeyLoop<T, kD, kKB, kVB, kSTAGES, T, kD / 32>(
                p, plan, wk, ring, fpBuf, qaS, qfS, wc0, wc1, fpFirst, nft, pos, lane, st);
        }
        else if (p.scaleDtype == kKIVI_FLOAT16)
        {
            splitKeyLoop<T, kD, kKB, kVB, kSTAGES, half, 0>(
                p, plan, wk, ring, fpBuf, qaS, qfS, wc0, wc1, fpFirst, nft, pos, lane, st);
        }
        else if (p.scaleDtype == kKIVI_BFLOAT16)
        {
            splitKeyLoop<T, kD, kKB, kVB, kSTAGES, __nv_bfloat16, 0>(
                p, plan, wk, ring, fpBuf, qaS, qfS, wc0, wc1, fpFirst, nft, pos, lane, st);
        }
        else
        {
            splitKeyLoop<T, kD, kKB, kVB, kSTAGES, float, 0>(
                p, plan, wk, ring, fpBuf, qaS, qfS, wc0, wc1, fpFirst, nft, pos, lane, st);
        }
    }

    // Everything below writes: the prepare kernel's verdict first (decode mode: block ids; counters zeroed).
    if (plan.decodeMode)
    {
        gridDependencyWait();
    }
    bool const combineKernel = plan.numSplits > 1 && !plan.fusedCombine;
    if (plan.windowByAttention && !combineKernel && wk.h == 0 && wk.split == 0
        && int32_t(blockIdx.x) == (plan.decodeMode ? (p.batch - 1) * plan.tilesPerSeq : 0))
    {
        // rows no sequence covers (kiviCombineKernel writes them when it runs; unfused variants: the zero-rows kernel)
        int64_t const covered = min(int64_t(seqInfo[p.batch - 1].tokenOffset) + max(p.chunkLen[p.batch - 1], 0),
            int64_t(p.numTokens));
        zeroRows<T, kD>(p, grp, covered, p.numTokens, -1);
    }
    if (wk.b < 0)
    {
        return;
    }
    bool const valid = plan.decodeMode ? seqInfo[wk.b].valid != 0 : wk.valid;
    bool const firstCta = wk.tileInSeq == 0 && wk.split == 0;
    if (!valid || !wk.run)
    {
        // an invalid sequence: zero rows (kiviCombineKernel writes them when it runs), cache untouched
        if (!valid && !combineKernel && wk.split == 0)
        {
            if (plan.decodeMode)
            {
                if (wk.tileInSeq == 0)
                {
                    zeroRows<T, kD>(p, grp, wk.tokenOffset, wk.tokenOffset + wk.rowsAll / grp, wk.h);
                }
            }
            else
            {
                T* out = static_cast<T*>(p.out);
                for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += kSPLIT_THREADS)
                {
                    int32_t const row = wk.row0 + u / kD;
                    int64_t const token = wk.tokenOffset + row / grp;
                    out[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD] = ActTraits<T>::fromFloat(0.F);
                }
            }
        }
        return;
    }

    // This sequence's window row (a one-token chunk that flushes nothing; see the top of the file).
    if (firstCta && seqInfo[wk.b].windowWritten) // the prepare kernel's decision: the append kernel skips it
    {
        constexpr int32_t kVECS = kD / 8;
        int32_t const w = p.residualLength + p.groupSize - 1;
        int64_t const dst
            = ((int64_t(wk.slot) * p.numKvHeads + wk.h) * (p.sinkTokens + w) + windowRowDev(wk.s, p.sinkTokens, w))
            * kVECS;
        int64_t const src = (int64_t(wk.tokenOffset) * p.numKvHeads + wk.h) * kVECS;
        if (threadIdx.x < 2 * kVECS)
        {
            int32_t const u = threadIdx.x % kVECS;
            uint4* win = static_cast<uint4*>(threadIdx.x < kVECS ? p.kWindow : p.vWindow);
            uint4 const* in = static_cast<uint4 const*>(threadIdx.x < kVECS ? p.k : p.v);
            win[dst + u] = in[src + u];
        }
    }

    // End of the key loop: l and the V bias of group (16 mt + g) / Gv come from lane (group, t) of st.vb.
    int32_t gEnd = p.groupSize;
    asm volatile("" : "+r"(gEnd));
    int32_t const gvEnd = valueGroupSizeDev(gEnd, kD);
    int32_t const vGroupsEnd = kD / gvEnd;
    float l[2];
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        l[j] = __shfl_sync(0xffffffffU, st.vb[j], vGroupsEnd * 4 + t);
    }
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
        int32_t const src = (16 * mt / gvEnd) * 4 + t;
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
            float const bias = __shfl_sync(0xffffffffU, st.vb[j], src);
            st.o[mt][j] += bias;
            st.o[mt][j + 2] += bias;
        }
    }

    // Merge the 4 warps once through shared memory (the stages are free now).
    __syncthreads();
    float* mS = reinterpret_cast<float*>(smem); // [warps][8]
    float* lS = mS + kSPLIT_WARPS * kTILE_ROWS;  // [warps][8]
    float* oS = lS + kSPLIT_WARPS * kTILE_ROWS;  // [warps][8][D]
    if (g == 0)
    {
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
            mS[warp * kTILE_ROWS + 2 * t + j] = st.m[j];
            lS[warp * kTILE_ROWS + 2 * t + j] = l[j];
        }
    }
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            oS[(warp * kTILE_ROWS + 2 * t + (r & 1)) * kD + 16 * mt + g + 8 * (r >> 1)] = st.o[mt][r];
        }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out);
    for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += kSPLIT_THREADS)
    {
        int32_t const n = u / kD;
        int32_t const ch = u % kD;
        float mx = -INFINITY;
#pragma unroll
        for (int32_t w2 = 0; w2 < kSPLIT_WARPS; ++w2)
        {
            mx = fmaxf(mx, mS[w2 * kTILE_ROWS + n]);
        }
        float lsum = 0.F;
        float o = 0.F;
#pragma unroll
        for (int32_t w2 = 0; w2 < kSPLIT_WARPS; ++w2)
        {
            float const mw = mS[w2 * kTILE_ROWS + n];
            float const fw = mw == -INFINITY ? 0.F : fastExp2(mw - mx);
            lsum = __fmaf_rn(lS[w2 * kTILE_ROWS + n], fw, lsum);
            o = __fmaf_rn(oS[(w2 * kTILE_ROWS + n) * kD + ch], fw, o);
        }
        int32_t const row = wk.row0 + n;
        int64_t const token = wk.tokenOffset + row / grp;
        int64_t const head = wk.h * grp + row % grp;
        if (plan.numSplits == 1)
        {
            // l == 0: no key attended (a zero row); a NaN l (non-finite K/V or q) must stay NaN, as the reference's
            // (docs/design.md: never silently finite); tests/test_kernels_mma_model.py non_finite test
            out[(token * p.numHeads + head) * kD + ch] = ActTraits<T>::fromFloat(lsum == 0.F ? 0.F : __fdiv_rn(o, lsum));
        }
        else
        {
            int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;
            partialAcc[idx * kD + ch] = o;
            if (ch == 0)
            {
                // the fused merge works in log2 units; kiviCombineKernel weighs splits in natural-log units
                partialMl[idx * 2] = plan.fusedCombine ? mx : mx * kLN2;
                partialMl[idx * 2 + 1] = lsum;
            }
        }
    }
    if (!plan.fusedCombine)
    {
        return;
    }
    // The last CTA of this (tile, KV head) to arrive merges the splits in split order (release: every thread's
    // partial stores, then one arrival; acquire: the reader's fence before its L2 loads).
    __threadfence();
    __syncthreads();
    int32_t* const counter = counters + int64_t(blockIdx.x) * p.numKvHeads + wk.h;
    if (threadIdx.x == 0)
    {
        sLast = atomicAdd(counter, 1) == plan.numSplits - 1;
    }
    __syncthreads();
    if (!sLast)
    {
        return;
    }
    __threadfence();
    for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += kSPLIT_THREADS)
    {
        int32_t const n = u / kD;
        int32_t const ch = u % kD;
        int32_t const row = wk.row0 + n;
        int64_t const token = wk.tokenOffset + row / grp;
        int64_t const head = wk.h * grp + row % grp;
        int64_t const idx0 = (token * p.numHeads + head) * plan.numSplits;
        float mx = -INFINITY;
        for (int32_t y = 0; y < plan.numSplits; ++y)
        {
            mx = fmaxf(mx, __ldcg(partialMl + (idx0 + y) * 2));
        }
        float lsum = 0.F;
        float o = 0.F;
        for (int32_t y = 0; y < plan.numSplits; ++y)
        {
            float const my = __ldcg(partialMl + (idx0 + y) * 2);
            float const wy = my == -INFINITY ? 0.F : fastExp2(my - mx);
            lsum = __fmaf_rn(__ldcg(partialMl + (idx0 + y) * 2 + 1), wy, lsum);
            o = __fmaf_rn(__ldcg(partialAcc + (idx0 + y) * kD + ch), wy, o);
        }
        out[(token * p.numHeads + head) * kD + ch] = ActTraits<T>::fromFloat(lsum == 0.F ? 0.F : __fdiv_rn(o, lsum));
    }
    if (threadIdx.x == 0)
    {
        *counter = 0; // not relied on (the prepare kernel zeroes the counters each step)
    }
}

} // namespace kernels
} // namespace trtllm_kivi
