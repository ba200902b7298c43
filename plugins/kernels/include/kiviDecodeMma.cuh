/*
 * KIVI decode attention on tensor cores, header-only: the default attention kernel (attention_impl 0 / 3).
 * trtllm_kivi/cuda/mma_model.py is its lane-level CPU emulation (same fragments, conversions, folded arithmetic,
 * warp and split decomposition); tests/test_kernels_mma_model.py checks it against the reference.
 *
 *   grid (numTiles, Hkv, numSplits), 128 threads = 4 warps. A CTA owns one tile = 8 query rows of one sequence's
 *   chunk (row r = token r / groupHeads, query head r % groupHeads of KV head blockIdx.y) and one split of the keys.
 *   mma.sync.m16n8k16 with fp32 accumulation, the KV tile as A and the 8 query rows as N:
 *     S^T (16 keys x 8 rows)  = K (16 keys x 16 channels) . q'^T            D/16 MMAs per 16 keys
 *     O^T (16 channels x 8)  += V^T (16 channels x 16 keys) . P''^T        D/16 MMAs per 16 keys
 *   so each dequantized code serves every query head of its KV head.
 *   Codes come in FRAGMENT order (trtllm_kivi/format.py): a lane's words hold exactly its A registers. One shift +
 *   one lop3 per register puts the b-bit code in the top mantissa bits of 1.0 (fp16 0x3C00, bf16 0x3F80): the
 *   register is the exact pair 1 + c 2^-b (bf16 with 8-bit codes, 7 mantissa bits: through fp32, exactly c).
 *   Scales are folded, per group, never applied per code:
 *     K (per channel over G tokens): q' = rnd(qsc * s_k * 2^b), score bias = sum_ch (qsc * z_k - q') per row,
 *       qsc = q / sqrt(D); the '1' of every register times q' cancels against the same rounded q';
 *     V (per token over Gv channels): P'' = rnd(p * s_v * 2^b) per channel group, and the bias
 *       sum_keys (z_v * p - P'') per (group, row) accumulated per lane, reduced once at the end.
 *   Keeping the code in the top mantissa bits (not 1024 + c with 0x6400) keeps the cancelled term within 2^b of
 *   the signal, so the fp32 accumulation over a whole split stays accurate (see mma_model.attention_tolerance).
 *   P moves from the C fragment of S to the B fragment of P^T with two movmatrix.trans per 16 keys (no shared
 *   memory). Only packed codes and scales pass through shared memory: each warp owns kSTAGES = 3 stages of
 *   32-key chunks filled by cp.async (no CTA barrier in the key loop); accumulators stay in registers. The 4 warps
 *   take contiguous chunk ranges of the split, each with its own online softmax, merged once at the end through
 *   shared memory. Full-precision keys (window rows t % W, then the chunk) are a second segment read straight from
 *   global memory (a few hundred keys at most per decode step); a sink-token segment (issue 9) would be a third
 *   source in loadFullPrecisionChunk.
 *   numSplits == 1: the CTA writes out = O / l. Otherwise (m, l, O) go to the workspace and kiviCombineKernel
 *   (kiviAttention.cuh) merges the splits with their log-sum-exp weights. The launcher refuses devices below sm_80
 *   (kiviCheckArch) by name.
 */
#pragma once

#include "kiviAttention.cuh"
#include "kiviCommon.cuh"

#include <type_traits>

namespace trtllm_kivi
{
namespace kernels
{

constexpr int32_t kMMA_THREADS = 128;
constexpr int32_t kMMA_WARPS = 4;
constexpr int32_t kMMA_CHUNK = 32; //!< keys per warp iteration: two 16-key MMA tiles
constexpr int32_t kMMA_STAGES = 3;
//! Register budget: 65536 / (128 x 3) = 170 per thread, 0 spills; 3 CTAs x 4 warps x 3 stages of ~3 KB keep
//! ~100 KB of KIVI bytes in flight per SM, more than the H200's bandwidth-latency product per SM (~40 KB). With an
//! 8-bit operand a stage is 2-3x larger, shared memory allows 2 CTAs per SM anyway, and bf16's fp32 conversion of
//! 8-bit codes needs the registers: 2.
constexpr int32_t mmaMinCtas(int32_t kBits, int32_t vBits)
{
    return kBits == 8 || vBits == 8 ? 2 : 3;
}

//! Per (head_dim, bits) sizes of one 32-key chunk in shared memory (scale/zero bytes depend on the run-time dtype).
template <int kD, int kKB, int kVB>
struct MmaChunkGeometry
{
    static constexpr int32_t kNWK = kD * kKB / 64; //!< K words per lane and 16-token tile
    static constexpr int32_t kNWV = kD * kVB / 64;
    static constexpr int32_t kKWORDS = 2 * 32 * kNWK; //!< K words of a chunk (two tiles)
    static constexpr int32_t kVWORDS = 2 * 32 * kNWV;
};

//! Bytes of one stage: K words, V words, K scale + zero [D], V scale + zero [32 keys][D / Gv] (16-byte multiples).
template <int kD, int kKB, int kVB>
__host__ __device__ inline int32_t mmaStageBytes(int32_t scaleBytes, int32_t groupSize)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    int32_t const gv = groupSize < kD ? groupSize : kD;
    return (Geo::kKWORDS + Geo::kVWORDS) * 4 + 2 * kD * scaleBytes + 2 * kMMA_CHUNK * (kD / gv) * scaleBytes;
}

//! Dynamic shared memory of the kernel: the warps' stages, reused at the end for the warp merge.
template <int kD, int kKB, int kVB>
__host__ __device__ inline int32_t mmaSmemBytes(int32_t scaleBytes, int32_t groupSize)
{
    int32_t const stages = kMMA_WARPS * kMMA_STAGES * mmaStageBytes<kD, kKB, kVB>(scaleBytes, groupSize);
    int32_t const merge = kMMA_WARPS * kTILE_ROWS * (kD + 2) * 4;
    return stages > merge ? stages : merge;
}

//! The MMA element type of an activation type and its 1.0 bit pattern (format.py: fragment conversion).
template <typename T>
struct MmaTraits;

template <>
struct MmaTraits<half>
{
    static constexpr uint32_t kONE2 = kONE_FP16 * 0x00010001U;
    static constexpr int32_t kMANTISSA = 10;

    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 const h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t const*>(&h);
    }

    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __half22float2(*reinterpret_cast<__half2 const*>(&x));
    }
};

template <>
struct MmaTraits<__nv_bfloat16>
{
    static constexpr uint32_t kONE2 = kONE_BF16 * 0x00010001U;
    static constexpr int32_t kMANTISSA = 7;

    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 const h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t const*>(&h);
    }

    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&x));
    }
};

//! alpha of a converted register element alpha + c * 2^-b (0 for bf16 with 8-bit codes, converted through fp32).
template <typename T, int kBITS>
struct CodeAffine
{
    static constexpr bool kVIA_FP32 = MmaTraits<T>::kMANTISSA < kBITS;
    static constexpr float kALPHA = kVIA_FP32 ? 0.F : 1.F;
    static constexpr float kINV_BETA = kVIA_FP32 ? 1.F : float(1 << kBITS); //!< folded into q' and P''
};

//! The A register of bit position `pos` of a FRAGMENT-order word: one shift + one lop3 (mma_model.convert_register).
//! Called from fully unrolled loops, so `pos` and the shift are compile-time constants after unrolling.
template <typename T, int kBITS>
__device__ __forceinline__ uint32_t convertRegister(uint32_t w, int32_t pos)
{
    if constexpr (CodeAffine<T, kBITS>::kVIA_FP32)
    {
        return MmaTraits<T>::pack(float((w >> (pos * kBITS)) & 0xFFU), float((w >> (16 + pos * kBITS)) & 0xFFU));
    }
    else
    {
        constexpr uint32_t kMASK = ((1U << kBITS) - 1U) << (MmaTraits<T>::kMANTISSA - kBITS);
        int32_t const shift = (MmaTraits<T>::kMANTISSA - kBITS) - pos * kBITS;
        uint32_t const x = shift >= 0 ? (w << shift) : (w >> -shift);
        return (x & (kMASK * 0x00010001U)) | MmaTraits<T>::kONE2; // LOP3 (a & b) | c
    }
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same<T, half>::value)
    {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    else
    {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    __trap(); // the launcher refuses devices below sm_80
#endif
}

//! movmatrix.m8n8.trans.b16: the C fragment of an 8x8 b16 matrix -> the same fragment of its transpose.
__device__ __forceinline__ uint32_t movTrans(uint32_t x)
{
    uint32_t y = x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
#endif
    return y;
}

__device__ __forceinline__ void cpAsync16(void* smem, void const* gmem)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t const s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#endif
}

__device__ __forceinline__ void cpAsyncCommit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int kN>
__device__ __forceinline__ void cpAsyncWait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kN));
#endif
}

//! A warp copies `bytes` (a multiple of 16) from global to shared memory with cp.async.
__device__ __forceinline__ void warpCopy(char* dst, char const* src, int32_t bytes, int32_t lane)
{
    for (int32_t o = lane * 16; o < bytes; o += 32 * 16)
    {
        cpAsync16(dst + o, src + o);
    }
}

//! Scale/zero element i of a staged array of run-time dtype.
__device__ __forceinline__ float stagedScale(char const* base, int32_t i, int32_t dtype)
{
    return loadScale(base, i, dtype);
}

//! What a CTA works on (resolveMmaTile); run == false: nothing to do (rows of invalid sequences already zeroed).
struct MmaWork
{
    bool run;
    int32_t h;
    int32_t split;
    int32_t b;
    SeqInfo info;
    int32_t row0;  //!< first flattened row of the tile within the chunk
    int32_t nRows; //!< live rows (<= 8)
    int32_t slot;
    int32_t s; //!< key positions are int32: kiviValidate caps the capacity at INT32_MAX / 2 tokens
    int32_t k0;
    int32_t k1;
    int32_t nq;
};

template <typename T, int kD>
__device__ __forceinline__ MmaWork resolveMmaTile(KiviStepParams const& p, KiviLaunchPlan const& plan,
    SeqInfo const* seqInfo)
{
    MmaWork wk{};
    int32_t const tile = blockIdx.x;
    wk.h = blockIdx.y;
    wk.split = blockIdx.z;
    int32_t const grp = plan.groupHeads;
    T* out = static_cast<T*>(p.out);
    // Rows no sequence covers are zeroed by kiviZeroUncoveredRowsKernel (one split) or kiviCombineKernel.
    wk.b = findSequence<&SeqInfo::tileOffset>(seqInfo, p.batch, tile);
    wk.info = seqInfo[wk.b];
    if (tile >= wk.info.tileOffset + wk.info.tileCount)
    {
        return wk;
    }
    int32_t const c = p.chunkLen[wk.b];
    wk.row0 = (tile - wk.info.tileOffset) * kTILE_ROWS;
    int32_t const rowsAll = min(c, p.numTokens - wk.info.tokenOffset) * grp;
    wk.nRows = min(kTILE_ROWS, rowsAll - wk.row0);
    if (!wk.info.valid)
    {
        if (plan.numSplits == 1 && wk.split == 0)
        {
            for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += blockDim.x)
            {
                int32_t const row = wk.row0 + u / kD;
                int64_t const token = wk.info.tokenOffset + row / grp;
                out[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD] = ActTraits<T>::fromFloat(0.F);
            }
        }
        return wk;
    }
    wk.s = p.pastLen[wk.b];
    int32_t const lastToken = (wk.row0 + wk.nRows - 1) / grp;
    int32_t const keyEnd = wk.s + lastToken + 1;
    wk.k0 = wk.split * wk.info.splitLen;
    if (wk.k0 >= keyEnd)
    {
        return wk;
    }
    wk.k1 = min(wk.k0 + wk.info.splitLen, keyEnd);
    wk.nq = static_cast<int32_t>(numQuantizedDev(wk.s, p.residualLength, p.groupSize));
    wk.slot = p.slotIds[wk.b];
    wk.run = true;
    return wk;
}

//! Issue the cp.async copies of quantized chunk kt (block row r of block blk) into stage `st`; one commit group.
template <int kD, int kKB, int kVB>
__device__ __forceinline__ void issueChunk(KiviStepParams const& p, char* st, int64_t blk, int32_t h, int32_t r,
    int32_t scaleBytes, int32_t gv, int32_t lane)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    int64_t const headBase = blk * p.numKvHeads + h;
    int32_t const bs = p.blockSize;
    char const* kw = static_cast<char const*>(p.kCodes)
        + (headBase * (int64_t(bs) * kD * kKB / 32) + int64_t(r / 16) * 32 * Geo::kNWK) * 4;
    char const* vw = static_cast<char const*>(p.vCodes)
        + (headBase * (int64_t(bs) * kD * kVB / 32) + int64_t(r / 16) * 32 * Geo::kNWV) * 4;
    int64_t const kIdx = (headBase * (bs / p.groupSize) + r / p.groupSize) * kD;
    int32_t const vGroups = kD / gv;
    int64_t const vIdx = (headBase * bs + r) * vGroups;
    char* dst = st;
    warpCopy(dst, kw, Geo::kKWORDS * 4, lane);
    dst += Geo::kKWORDS * 4;
    warpCopy(dst, vw, Geo::kVWORDS * 4, lane);
    dst += Geo::kVWORDS * 4;
    warpCopy(dst, static_cast<char const*>(p.kScale) + kIdx * scaleBytes, kD * scaleBytes, lane);
    dst += kD * scaleBytes;
    warpCopy(dst, static_cast<char const*>(p.kZero) + kIdx * scaleBytes, kD * scaleBytes, lane);
    dst += kD * scaleBytes;
    warpCopy(dst, static_cast<char const*>(p.vScale) + vIdx * scaleBytes, kMMA_CHUNK * vGroups * scaleBytes, lane);
    dst += kMMA_CHUNK * vGroups * scaleBytes;
    warpCopy(dst, static_cast<char const*>(p.vZero) + vIdx * scaleBytes, kMMA_CHUNK * vGroups * scaleBytes, lane);
}

//! One warp's running state (lane = (g, t): score columns / O^T columns = rows 2t, 2t + 1 of the CTA).
template <int kD>
struct MmaWarpState
{
    static constexpr int32_t kMT = kD / 16;
    float o[kMT][4];    //!< O^T C fragments: channel 16 mt + g (+8), rows 2t, 2t + 1
    float m[2];         //!< running max of rows 2t, 2t + 1
    float l[2];         //!< this lane's partial sums of p (keys g, g + 8 of every tile)
    float vb[kD / 32 > 0 ? kD / 32 : 1][2]; //!< V bias partials per channel group (at most D / 32 groups)
};

//! Online-softmax update of one 32-key chunk's scores sc[tile][reg] -> probabilities (in place), rescaling.
template <int kD, int kVG>
__device__ __forceinline__ void softmaxUpdate(MmaWarpState<kD>& st, float (&sc)[2][4])
{
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            mx[r & 1] = fmaxf(mx[r & 1], sc[tau][r]);
        }
    }
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
#pragma unroll
        for (int32_t o = 4; o < 32; o <<= 1)
        {
            mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffU, mx[j], o));
        }
        float const mNew = fmaxf(st.m[j], mx[j]);
        float const alpha = mNew == -INFINITY ? 1.F : expf(st.m[j] - mNew);
        st.m[j] = mNew;
        mx[j] = mNew;
        st.l[j] *= alpha;
#pragma unroll
        for (int32_t mt = 0; mt < MmaWarpState<kD>::kMT; ++mt)
        {
            st.o[mt][j] *= alpha;
            st.o[mt][j + 2] *= alpha;
        }
#pragma unroll
        for (int32_t vg = 0; vg < kVG; ++vg)
        {
            st.vb[vg][j] *= alpha;
        }
    }
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            float const mNew = mx[r & 1];
            sc[tau][r] = mNew == -INFINITY ? 0.F : expf(sc[tau][r] - mNew);
        }
#pragma unroll
        for (int32_t half = 0; half < 2; ++half) // lane g: key g, then key g + 8 (mma_model order)
        {
            st.l[0] += sc[tau][2 * half];
            st.l[1] += sc[tau][2 * half + 1];
        }
    }
}

//! Row of full-precision key `key` of the tile's sequence (window row key % W for key < s, else the chunk), or
//! nullptr past k1 (those keys are masked; reading zeros keeps NaN/Inf garbage out of 0 * x).
template <typename T, int kD>
__device__ __forceinline__ T const* fullPrecisionRow(KiviStepParams const& p, MmaWork const& wk, bool values,
    int32_t key)
{
    if (key >= wk.k1)
    {
        return nullptr;
    }
    // Sink-token hook (issue 9, FORMAT_VERSION 2): keys [0, S) would be a second full-precision segment read here
    // from a sink buffer, with the quantized segment starting at S (cq below counts chunks from there).
    if (key < wk.s)
    {
        int32_t const w = p.residualLength + p.groupSize - 1;
        T const* win = static_cast<T const*>(values ? p.vWindow : p.kWindow);
        return win + ((int64_t(wk.slot) * p.numKvHeads + wk.h) * w + key % w) * kD;
    }
    T const* chunk = static_cast<T const*>(values ? p.v : p.k);
    return chunk + ((wk.info.tokenOffset + (key - wk.s)) * int64_t(p.numKvHeads) + wk.h) * kD;
}

//! Scores of a full-precision 32-key chunk: A = K rows as stored, B = rnd(qsc) (no scale, no bias).
template <typename T, int kD>
__device__ __forceinline__ void loadFullPrecisionScores(KiviStepParams const& p, MmaWork const& wk,
    float const (*qS)[kD + 8], int32_t kt, int32_t g, int32_t t, float (&sc)[2][4])
{
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
        T const* row0 = fullPrecisionRow<T, kD>(p, wk, false, kt + 16 * tau + g);
        T const* row1 = fullPrecisionRow<T, kD>(p, wk, false, kt + 16 * tau + g + 8);
        float c[4] = {0.F, 0.F, 0.F, 0.F};
#pragma unroll
        for (int32_t kb = 0; kb < kD / 16; ++kb)
        {
            int32_t const ch = 16 * kb + 2 * t;
            uint32_t a[4];
            a[0] = row0 ? *reinterpret_cast<uint32_t const*>(row0 + ch) : 0U;
            a[1] = row1 ? *reinterpret_cast<uint32_t const*>(row1 + ch) : 0U;
            a[2] = row0 ? *reinterpret_cast<uint32_t const*>(row0 + ch + 8) : 0U;
            a[3] = row1 ? *reinterpret_cast<uint32_t const*>(row1 + ch + 8) : 0U;
            uint32_t const b0 = MmaTraits<T>::pack(qS[g][ch], qS[g][ch + 1]);
            uint32_t const b1 = MmaTraits<T>::pack(qS[g][ch + 8], qS[g][ch + 9]);
            mma16816<T>(c, a, b0, b1);
        }
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            sc[tau][r] = c[r];
        }
    }
}

//! O^T += V^T rnd(P)^T for a full-precision chunk: A registers are pairs of V rows (keys 2t, 2t + 1) of a channel.
template <typename T, int kD, typename State>
__device__ __forceinline__ void accumulateFullPrecisionValues(KiviStepParams const& p, MmaWork const& wk,
    int32_t kt, int32_t g, int32_t t, float const (&pr)[2][4], State& st)
{
#pragma unroll
    for (int32_t tau = 0; tau < 2; ++tau)
    {
        uint32_t const b0 = movTrans(MmaTraits<T>::pack(pr[tau][0], pr[tau][1]));
        uint32_t const b1 = movTrans(MmaTraits<T>::pack(pr[tau][2], pr[tau][3]));
        T const* rows[4];
#pragma unroll
        for (int32_t i = 0; i < 4; ++i) // keys 2t, 2t + 1, 2t + 8, 2t + 9 of the tile
        {
            rows[i] = fullPrecisionRow<T, kD>(p, wk, true, kt + 16 * tau + 2 * t + (i & 1) + 8 * (i >> 1));
        }
#pragma unroll
        for (int32_t mt = 0; mt < kD / 16; ++mt)
        {
            uint32_t a[4];
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                int32_t const ch = 16 * mt + g + 8 * (r & 1);
                T const* lo = rows[2 * (r >> 1)];
                T const* hi = rows[2 * (r >> 1) + 1];
                uint16_t const xl = lo ? *reinterpret_cast<uint16_t const*>(lo + ch) : uint16_t(0);
                uint16_t const xh = hi ? *reinterpret_cast<uint16_t const*>(hi + ch) : uint16_t(0);
                a[r] = uint32_t(xl) | (uint32_t(xh) << 16);
            }
            mma16816<T>(st.o[mt], a, b0, b1);
        }
    }
}

//! Two consecutive staged scale/zero values (channels ch, ch + 1) of storage type S as fp32.
template <typename S>
__device__ __forceinline__ float2 stagedPair(char const* base, int32_t ch)
{
    if constexpr (std::is_same<S, half>::value)
    {
        return __half22float2(*reinterpret_cast<__half2 const*>(base + ch * 2));
    }
    else if constexpr (std::is_same<S, __nv_bfloat16>::value)
    {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(base + ch * 2));
    }
    else
    {
        return *reinterpret_cast<float2 const*>(base + ch * 4);
    }
}

//! The B fragments of S for a new key group and the score bias of this lane's columns (mma_model order):
//! q' = rnd(qsc * s_k * 2^b) for row g, channels 16 kb + 8 reg + 2t + {0, 1}; bias(row) = sum(qsc z_k - alpha q')
//! over the lane's channels, reduced over the 4 lanes of a groupID, then fetched for rows 2t, 2t + 1.
template <typename T, int kD, typename S, typename Aff>
__device__ __forceinline__ void computeQPrime(float const (*qS)[kD + 8], char const* kScale, char const* kZero,
    int32_t g, int32_t t, uint32_t (&qB)[kD / 16][2], float (&biasS)[2])
{
    float part = 0.F;
#pragma unroll
    for (int32_t kb = 0; kb < kD / 16; ++kb)
    {
#pragma unroll
        for (int32_t reg = 0; reg < 2; ++reg)
        {
            int32_t const ch = 16 * kb + 8 * reg + 2 * t;
            float2 const qq = *reinterpret_cast<float2 const*>(&qS[g][ch]);
            float2 const sc = stagedPair<S>(kScale, ch);
            float2 const zr = stagedPair<S>(kZero, ch);
            float const a0 = __fmul_rn(__fmul_rn(qq.x, sc.x), Aff::kINV_BETA);
            float const a1 = __fmul_rn(__fmul_rn(qq.y, sc.y), Aff::kINV_BETA);
            qB[kb][reg] = MmaTraits<T>::pack(a0, a1);
            float2 const qr = MmaTraits<T>::unpack(qB[kb][reg]);
            part = __fmaf_rn(qq.x, zr.x, part);
            part = __fmaf_rn(-Aff::kALPHA, qr.x, part);
            part = __fmaf_rn(qq.y, zr.y, part);
            part = __fmaf_rn(-Aff::kALPHA, qr.y, part);
        }
    }
    part += __shfl_xor_sync(0xffffffffU, part, 1);
    part += __shfl_xor_sync(0xffffffffU, part, 2);
    biasS[0] = __shfl_sync(0xffffffffU, part, (2 * t) * 4);
    biasS[1] = __shfl_sync(0xffffffffU, part, (2 * t + 1) * 4);
}

template <typename T, int kD, int kKB, int kVB>
__global__ void __launch_bounds__(kMMA_THREADS, mmaMinCtas(kKB, kVB)) kiviDecodeMmaKernel(
    KiviStepParams p, KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    using AffK = CodeAffine<T, kKB>;
    using AffV = CodeAffine<T, kVB>;
    constexpr int32_t kMT = kD / 16;
    extern __shared__ __align__(16) char smem[];
    // qsc = q / sqrt(D) of the 8 rows (0 for dead rows); rows padded by 8 floats so the 8 groupIDs' float2 reads
    // of one B fragment hit distinct banks (2 wavefronts per warp instead of 8)
    __shared__ float qS[kTILE_ROWS][kD + 8];

    MmaWork const wk = resolveMmaTile<T, kD>(p, plan, seqInfo);
    if (!wk.run)
    {
        return;
    }
    int32_t const grp = plan.groupHeads;
    int32_t const lane = threadIdx.x % 32;
    int32_t const warp = threadIdx.x / 32;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    int32_t const gv = valueGroupSizeDev(p.groupSize, kD);
    int32_t const scaleBytes = p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2;
    int32_t const stageBytes = mmaStageBytes<kD, kKB, kVB>(scaleBytes, p.groupSize);
    float const smScale = kD == 64 ? 0.125F : 0.0883883476483184405F; // fl32(1 / sqrt(D)), as mma_model

    T const* q = static_cast<T const*>(p.q);
    for (int32_t u = threadIdx.x; u < kTILE_ROWS * kD; u += kMMA_THREADS)
    {
        int32_t const n = u / kD;
        float x = 0.F;
        if (n < wk.nRows)
        {
            int32_t const row = wk.row0 + n;
            int64_t const token = wk.info.tokenOffset + row / grp;
            x = ActTraits<T>::toFloat(q[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD]) * smScale;
        }
        qS[n][u % kD] = x;
    }
    __syncthreads();

    // Causal limit and liveness of this lane's score columns (rows 2t, 2t + 1).
    int32_t pos[2];
    bool live[2];
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        int32_t const n = 2 * t + j;
        live[j] = n < wk.nRows;
        pos[j] = wk.s + (wk.row0 + (live[j] ? n : 0)) / grp;
    }

    // This warp's contiguous range of 32-key chunks of the split.
    int32_t const nChunks = (wk.k1 - wk.k0 + kMMA_CHUNK - 1) / kMMA_CHUNK;
    int32_t const per = (nChunks + kMMA_WARPS - 1) / kMMA_WARPS;
    int32_t const c0 = min(warp * per, nChunks);
    int32_t const c1 = min(c0 + per, nChunks);
    // Chunks [c0, cq) are quantized (keys < n_q(s)), [cq, c1) full precision (window, then chunk rows).
    int32_t const cq = max(c0, min(c1, (wk.nq - wk.k0 + kMMA_CHUNK - 1) / kMMA_CHUNK));
    char* stages = smem + warp * kMMA_STAGES * stageBytes;
    int32_t const* table = p.blockTable + int64_t(wk.b) * p.maxBlocksPerSeq;

    auto issue = [&](int32_t ci) {
        if (ci < cq)
        {
            int32_t const kt = wk.k0 + ci * kMMA_CHUNK;
            int64_t const blk = table[kt / p.blockSize];
            issueChunk<kD, kKB, kVB>(p, stages + (ci - c0) % kMMA_STAGES * stageBytes, blk, wk.h, kt % p.blockSize,
                scaleBytes, gv, lane);
        }
        cpAsyncCommit(); // always one group per chunk slot: wait_group counts stay uniform
    };

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
    st.l[0] = st.l[1] = 0.F;
    constexpr int32_t kVGMAX = kD / 32;
#pragma unroll
    for (int32_t vg = 0; vg < kVGMAX; ++vg)
    {
        st.vb[vg][0] = st.vb[vg][1] = 0.F;
    }

    for (int32_t i = 0; i < kMMA_STAGES - 1; ++i)
    {
        issue(c0 + i);
    }
    uint32_t qB[kMT][2]; // B of S for the current key group: q' = rnd(qsc * s_k * 2^b), lane: row g
    float biasS[2] = {0.F, 0.F};
    int32_t curGroup = -1;

    for (int32_t ci = c0; ci < c1; ++ci)
    {
        int32_t const kt = wk.k0 + ci * kMMA_CHUNK;
        float sc[2][4];
        bool const quant = ci < cq;
        char const* stg = stages + (ci - c0) % kMMA_STAGES * stageBytes;
        char const* kWords = stg;
        char const* vWords = kWords + Geo::kKWORDS * 4;
        char const* kScale = vWords + Geo::kVWORDS * 4;
        char const* kZero = kScale + kD * scaleBytes;
        char const* vScale = kZero + kD * scaleBytes;
        char const* vZero = vScale + kMMA_CHUNK * (kD / gv) * scaleBytes;
        if (quant)
        {
            cpAsyncWait<kMMA_STAGES - 2>();
            __syncwarp();
            int32_t const group = kt / p.groupSize;
            if (group != curGroup)
            {
                curGroup = group;
                // one uniform branch per group on the scale dtype; the loop inside loads (scale, zero) pairs
                if (p.scaleDtype == kKIVI_FLOAT16)
                {
                    computeQPrime<T, kD, half, AffK>(qS, kScale, kZero, g, t, qB, biasS);
                }
                else if (p.scaleDtype == kKIVI_BFLOAT16)
                {
                    computeQPrime<T, kD, __nv_bfloat16, AffK>(qS, kScale, kZero, g, t, qB, biasS);
                }
                else
                {
                    computeQPrime<T, kD, float, AffK>(qS, kScale, kZero, g, t, qB, biasS);
                }
            }
            // S = K q'^T + bias: registers straight from this lane's words (FRAGMENT order)
#pragma unroll
            for (int32_t tau = 0; tau < 2; ++tau)
            {
                uint32_t w[Geo::kNWK];
                uint32_t const* src = reinterpret_cast<uint32_t const*>(kWords) + (tau * 32 + lane) * Geo::kNWK;
#pragma unroll
                for (int32_t j = 0; j < Geo::kNWK; ++j)
                {
                    w[j] = src[j];
                }
                float c[4] = {0.F, 0.F, 0.F, 0.F};
#pragma unroll
                for (int32_t kb = 0; kb < kMT; ++kb)
                {
                    uint32_t a[4];
#pragma unroll
                    for (int32_t r = 0; r < 4; ++r)
                    {
                        constexpr int32_t kPER = 16 / kKB;
                        int32_t const pi = 4 * kb + r;
                        a[r] = convertRegister<T, kKB>(w[pi / kPER], pi % kPER);
                    }
                    mma16816<T>(c, a, qB[kb][0], qB[kb][1]);
                }
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    sc[tau][r] = c[r] + biasS[r & 1];
                }
            }
        }
        else
        {
            loadFullPrecisionScores<T, kD>(p, wk, qS, kt, g, t, sc);
        }
        // mask: keys past the split / the causal limit, dead rows
#pragma unroll
        for (int32_t tau = 0; tau < 2; ++tau)
        {
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                int32_t const key = kt + 16 * tau + g + 8 * (r >> 1);
                int32_t const j = r & 1;
                if (!(key < wk.k1 && key <= pos[j] && live[j]))
                {
                    sc[tau][r] = -INFINITY;
                }
            }
        }
        softmaxUpdate<kD, kVGMAX>(st, sc);
        // O^T += V^T P''^T (+ biases)
        if (quant)
        {
#pragma unroll
            for (int32_t tau = 0; tau < 2; ++tau)
            {
                uint32_t w[Geo::kNWV];
                uint32_t const* src = reinterpret_cast<uint32_t const*>(vWords) + (tau * 32 + lane) * Geo::kNWV;
#pragma unroll
                for (int32_t j = 0; j < Geo::kNWV; ++j)
                {
                    w[j] = src[j];
                }
                int32_t const vGroups = kD / gv;
                uint32_t b0 = 0;
                uint32_t b1 = 0;
#pragma unroll
                for (int32_t mt = 0; mt < kMT; ++mt)
                {
                    if ((16 * mt) % gv == 0) // first m-tile of a V channel group: its P'' and bias
                    {
                        int32_t const vg = 16 * mt / gv;
                        int32_t const k0i = (16 * tau + g) * vGroups + vg;
                        int32_t const k1i = (16 * tau + g + 8) * vGroups + vg;
                        float const s0 = __fmul_rn(stagedScale(vScale, k0i, p.scaleDtype), AffV::kINV_BETA);
                        float const s1 = __fmul_rn(stagedScale(vScale, k1i, p.scaleDtype), AffV::kINV_BETA);
                        float const z0 = stagedScale(vZero, k0i, p.scaleDtype);
                        float const z1 = stagedScale(vZero, k1i, p.scaleDtype);
                        uint32_t const h0 = MmaTraits<T>::pack(__fmul_rn(sc[tau][0], s0), __fmul_rn(sc[tau][1], s0));
                        uint32_t const h1 = MmaTraits<T>::pack(__fmul_rn(sc[tau][2], s1), __fmul_rn(sc[tau][3], s1));
                        float2 const r0 = MmaTraits<T>::unpack(h0);
                        float2 const r1 = MmaTraits<T>::unpack(h1);
#pragma unroll
                        for (int32_t vgi = 0; vgi < kVGMAX; ++vgi)
                        {
                            if (vgi == vg) // lane g: key g, then key g + 8 (fma z * p, then -alpha * P'')
                            {
                                float& vb0 = st.vb[vgi][0];
                                float& vb1 = st.vb[vgi][1];
                                vb0 = __fmaf_rn(z0, sc[tau][0], vb0);
                                vb0 = __fmaf_rn(-AffV::kALPHA, r0.x, vb0);
                                vb1 = __fmaf_rn(z0, sc[tau][1], vb1);
                                vb1 = __fmaf_rn(-AffV::kALPHA, r0.y, vb1);
                                vb0 = __fmaf_rn(z1, sc[tau][2], vb0);
                                vb0 = __fmaf_rn(-AffV::kALPHA, r1.x, vb0);
                                vb1 = __fmaf_rn(z1, sc[tau][3], vb1);
                                vb1 = __fmaf_rn(-AffV::kALPHA, r1.y, vb1);
                            }
                        }
                        b0 = movTrans(h0);
                        b1 = movTrans(h1);
                    }
                    uint32_t a[4];
#pragma unroll
                    for (int32_t r = 0; r < 4; ++r)
                    {
                        constexpr int32_t kPER = 16 / kVB;
                        int32_t const pi = 4 * mt + r;
                        a[r] = convertRegister<T, kVB>(w[pi / kPER], pi % kPER);
                    }
                    mma16816<T>(st.o[mt], a, b0, b1);
                }
            }
            __syncwarp(); // every lane has read this stage before it is refilled
        }
        else
        {
            accumulateFullPrecisionValues<T, kD>(p, wk, kt, g, t, sc, st);
        }
        issue(ci + kMMA_STAGES - 1);
    }
    cpAsyncWait<0>();

    // End of the key loop: reduce l and the V bias over the 8 groupID lanes, add the bias into O.
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
#pragma unroll
        for (int32_t o = 4; o < 32; o <<= 1)
        {
            st.l[j] += __shfl_xor_sync(0xffffffffU, st.l[j], o);
        }
#pragma unroll
        for (int32_t vg = 0; vg < kVGMAX; ++vg)
        {
#pragma unroll
            for (int32_t o = 4; o < 32; o <<= 1)
            {
                st.vb[vg][j] += __shfl_xor_sync(0xffffffffU, st.vb[vg][j], o);
            }
        }
    }
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
        int32_t const vg = 16 * mt / gv;
#pragma unroll
        for (int32_t vgi = 0; vgi < kVGMAX; ++vgi)
        {
            if (vgi == vg)
            {
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    st.o[mt][r] += st.vb[vgi][r & 1];
                }
            }
        }
    }

    // Merge the 4 warps once through shared memory (the stages are free now).
    __syncthreads();
    float* mS = reinterpret_cast<float*>(smem);                    // [warps][8]
    float* lS = mS + kMMA_WARPS * kTILE_ROWS;                       // [warps][8]
    float* oS = lS + kMMA_WARPS * kTILE_ROWS;                       // [warps][8][D]
    if (g == 0)
    {
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
            mS[warp * kTILE_ROWS + 2 * t + j] = st.m[j];
            lS[warp * kTILE_ROWS + 2 * t + j] = st.l[j];
        }
    }
#pragma unroll
    for (int32_t mt = 0; mt < kMT; ++mt)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            int32_t const n = 2 * t + (r & 1);
            int32_t const ch = 16 * mt + g + 8 * (r >> 1);
            oS[(warp * kTILE_ROWS + n) * kD + ch] = st.o[mt][r];
        }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out);
    for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += kMMA_THREADS)
    {
        int32_t const n = u / kD;
        int32_t const ch = u % kD;
        float mx = -INFINITY;
#pragma unroll
        for (int32_t w2 = 0; w2 < kMMA_WARPS; ++w2)
        {
            mx = fmaxf(mx, mS[w2 * kTILE_ROWS + n]);
        }
        float l = 0.F;
        float o = 0.F;
#pragma unroll
        for (int32_t w2 = 0; w2 < kMMA_WARPS; ++w2)
        {
            float const mw = mS[w2 * kTILE_ROWS + n];
            float const f = mw == -INFINITY ? 0.F : expf(mw - mx);
            l = __fmaf_rn(lS[w2 * kTILE_ROWS + n], f, l);
            o = __fmaf_rn(oS[(w2 * kTILE_ROWS + n) * kD + ch], f, o);
        }
        int32_t const row = wk.row0 + n;
        int64_t const token = wk.info.tokenOffset + row / grp;
        int64_t const head = wk.h * grp + row % grp;
        if (plan.numSplits == 1)
        {
            out[(token * p.numHeads + head) * kD + ch] = ActTraits<T>::fromFloat(l > 0.F ? __fdiv_rn(o, l) : 0.F);
        }
        else
        {
            int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;
            partialAcc[idx * kD + ch] = o;
            if (ch == 0)
            {
                partialMl[idx * 2] = mx;
                partialMl[idx * 2 + 1] = l;
            }
        }
    }
}

} // namespace kernels
} // namespace trtllm_kivi
