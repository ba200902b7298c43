/*
 * KIVI decode attention on tensor cores, header-only: the default attention kernel (attention_impl 0 / 3).
 * trtllm_kivi/cuda/mma_model.py is its lane-level CPU emulation (same fragments, conversions, folded arithmetic,
 * warp and split decomposition); tests/test_kernels_mma_model.py checks it against the reference.
 *
 *   grid (numTiles, Hkv, numSplits), 128 threads = 4 warps. A CTA owns one tile = 8 query rows of one sequence's
 *   chunk (row r = token r / groupHeads, query head r % groupHeads of KV head blockIdx.y) and one split of the keys.
 *   mma.sync.m16n8k16 with fp32 accumulation, the KV tile as A and the 8 query rows as N:
 *     S^T (16 keys x 8 rows)  = K (16 keys x 16 channels) . q''^T           D/16 MMAs per 16 keys
 *     O^T (16 channels x 8)  += V^T (16 channels x 16 keys) . P'^T          D/16 MMAs per 16 keys
 *   so each dequantized code serves every query head of its KV head.
 *   Codes come in FRAGMENT order (trtllm_kivi/format.py): a lane's words hold exactly its A registers. One shift +
 *   one lop3 per register puts the b-bit code in the top mantissa bits of 1.0 (fp16 0x3C00, bf16 0x3F80): the
 *   register is the exact pair alpha + beta c, alpha = 1, beta = 2^-b (bf16 with 8-bit codes, 7 mantissa bits:
 *   through fp32, alpha = 0, beta = 1).
 *   Scores are in log2 units (qsc = q log2(e) / sqrt(D)) so the softmax is one ex2 per score. Scales are folded per
 *   group, never applied per code, and every fold is a packed 16-bit multiply or an MMA (T = the activation type):
 *     K (per channel over G tokens): qa = rnd_T(qsc) / beta once per CTA (in shared memory), q'' = rnd_T(qa s_k) per
 *       group, and the score bias  beta sum_ch (qa z_k - alpha/beta q'')  by m16n8k8 MMAs over the lane's existing
 *       register pairs (foldKeyGroup); it seeds the score MMA's accumulator;
 *     V (per token over Gv channels): w = rnd_T(p) (the B fragment of P^T), P' = rnd_T((w / beta) s_v) per channel
 *       group, and ONE MMA per 16 keys of [u ; 1] w^T with u = rnd_T(z_v - alpha s_v / beta): each group's V bias
 *       and l = sum of w (ValueScaleTile::biasOperand).
 *   Sinks (FORMAT_VERSION 2): keys run in the order store (token S + j), sink rows, ring, chunk; softmax does not
 *   depend on the order and only the chunk's keys are causally masked (fullPrecisionRow).
 *   P moves from the C fragment of S to the B fragment of P^T with two movmatrix.trans per 16 keys (no shared
 *   memory). Only packed codes and scales pass through shared memory: each warp owns kSTAGES = 3 stages of
 *   32-key chunks filled by cp.async (no CTA barrier in the key loop); accumulators stay in registers. The 4 warps
 *   take contiguous chunk ranges of the split, each with its own online softmax (rescaling only when a row maximum
 *   grows), merged once at the end through shared memory. Full-precision keys (window rows t % W, then the chunk)
 *   are a second segment read straight from global memory (a few hundred keys at most per decode step).
 *   numSplits == 1: the CTA writes out = O / l. Otherwise (m, l, O) go to the workspace (m in natural-log units) and
 *   kiviCombineKernel (kiviAttention.cuh) merges the splits with their log-sum-exp weights. The launcher refuses
 *   devices below sm_80 (kiviCheckArch) by name.
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
constexpr float kLOG2E = 1.4426950408889634F;
constexpr float kLN2 = 0.6931471805599453F;
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

//! The MMA element type of an activation type: its 1.0 bit pattern and the packed 16-bit arithmetic the folds use.
template <typename T>
struct MmaTraits;

template <>
struct MmaTraits<half>
{
    static constexpr uint32_t kONE = kONE_FP16;
    static constexpr int32_t kMANTISSA = 10;
    static constexpr int32_t kBIAS = 15;

    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 const h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t const*>(&h);
    }

    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __half22float2(*reinterpret_cast<__half2 const*>(&x));
    }

    static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b)
    {
        __half2 const r = __hmul2(*reinterpret_cast<__half2 const*>(&a), *reinterpret_cast<__half2 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }

    static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c)
    {
        __half2 const r = __hfma2(*reinterpret_cast<__half2 const*>(&a), *reinterpret_cast<__half2 const*>(&b),
            *reinterpret_cast<__half2 const*>(&c));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
};

template <>
struct MmaTraits<__nv_bfloat16>
{
    static constexpr uint32_t kONE = kONE_BF16;
    static constexpr int32_t kMANTISSA = 7;
    static constexpr int32_t kBIAS = 127;

    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 const h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t const*>(&h);
    }

    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(&x));
    }

    static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b)
    {
        __nv_bfloat162 const r = __hmul2(
            *reinterpret_cast<__nv_bfloat162 const*>(&a), *reinterpret_cast<__nv_bfloat162 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }

    static __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c)
    {
        __nv_bfloat162 const r = __hfma2(*reinterpret_cast<__nv_bfloat162 const*>(&a),
            *reinterpret_cast<__nv_bfloat162 const*>(&b), *reinterpret_cast<__nv_bfloat162 const*>(&c));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
};

//! The bit pattern of the packed pair (x, x) of type T for x = sign * 2^e (exact: a power of two).
template <typename T>
__host__ __device__ constexpr uint32_t pow2Pair(bool negative, int32_t e)
{
    uint32_t const h = (negative ? 0x8000U : 0U)
        | (static_cast<uint32_t>(MmaTraits<T>::kBIAS + e) << MmaTraits<T>::kMANTISSA);
    return h * 0x00010001U;
}

//! A converted register element is alpha + beta * c exactly (beta = 2^-b; bf16 with 8-bit codes: through fp32,
//! alpha = 0, beta = 1). The folds need beta^-1 and -alpha / beta as packed powers of two.
template <typename T, int kBITS>
struct CodeAffine
{
    static constexpr bool kVIA_FP32 = MmaTraits<T>::kMANTISSA < kBITS;
    static constexpr float kALPHA = kVIA_FP32 ? 0.F : 1.F;
    static constexpr int32_t kLOG2_INV_BETA = kVIA_FP32 ? 0 : kBITS;
    static constexpr uint32_t kINV_BETA2 = pow2Pair<T>(false, kLOG2_INV_BETA);     //!< (1/beta, 1/beta)
    static constexpr uint32_t kNEG_ALPHA_INV_BETA2 = pow2Pair<T>(true, kLOG2_INV_BETA); //!< -alpha/beta (alpha = 1)
};

//! (a & b) | c in one LOP3: written in PTX because nvcc splits the C++ form into two LOP3s when both b and c are
//! immediates (each LOP3 takes one).
template <uint32_t kB>
__device__ __forceinline__ uint32_t lop3AndOr(uint32_t a, uint32_t c)
{
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "n"(kB), "r"(c));
    return d;
}

//! The A register of bit position `pos` of a FRAGMENT-order word: one shift + one lop3 (mma_model.convert_register).
//! Called from fully unrolled loops, so `pos` and the shift are compile-time constants after unrolling; `one2` is
//! the packed 1.0 pair held in a register.
template <typename T, int kBITS>
__device__ __forceinline__ uint32_t convertRegister(uint32_t w, int32_t pos, uint32_t one2)
{
    if constexpr (CodeAffine<T, kBITS>::kVIA_FP32)
    {
        return MmaTraits<T>::pack(float((w >> (pos * kBITS)) & 0xFFU), float((w >> (16 + pos * kBITS)) & 0xFFU));
    }
    else
    {
        constexpr uint32_t kMASK = (((1U << kBITS) - 1U) << (MmaTraits<T>::kMANTISSA - kBITS)) * 0x00010001U;
        int32_t const shift = (MmaTraits<T>::kMANTISSA - kBITS) - pos * kBITS;
        uint32_t const x = shift >= 0 ? (w << shift) : (w >> -shift);
        return lop3AndOr<kMASK>(x, one2);
    }
}

//! The 4 A registers of 16-wide block `kb` of a tile from the lane's words (register pi = 4 kb + r is word
//! pi / (16 / b), bit position pi % (16 / b): format.py's fragment order).
template <typename T, int kBITS, int kNW>
__device__ __forceinline__ void convertBlock(uint32_t const (&w)[kNW], int32_t kb, uint32_t one2, uint32_t (&a)[4])
{
    constexpr int32_t kPER = 16 / kBITS;
#pragma unroll
    for (int32_t r = 0; r < 4; ++r)
    {
        int32_t const pi = 4 * kb + r;
        a[r] = convertRegister<T, kBITS>(w[pi / kPER], pi % kPER, one2);
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

//! mma.sync m16n8k8: A = 2 registers (rows g, g + 8; k 2t, 2t + 1), B = 1 register (k 2t, 2t + 1; column g).
template <typename T>
__device__ __forceinline__ void mma1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same<T, half>::value)
    {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(b0));
    }
    else
    {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(b0));
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

//! 2^x (ex2.approx.ftz: relative error < 2^-22, ex2(-inf) = 0); scores are in log2 units.
__device__ __forceinline__ float fastExp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
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

//! A warp copies kBYTES (a compile-time multiple of 16) from global to shared memory with cp.async.
template <int kBYTES>
__device__ __forceinline__ void warpCopyFixed(char* dst, char const* src, int32_t lane)
{
#pragma unroll
    for (int32_t o = 0; o < kBYTES; o += 32 * 16)
    {
        if (kBYTES % (32 * 16) == 0 || o + lane * 16 < kBYTES)
        {
            cpAsync16(dst + o + lane * 16, src + o + lane * 16);
        }
    }
}

//! A warp copies `bytes` (a multiple of 16, at most 1024) from global to shared memory with cp.async.
__device__ __forceinline__ void warpCopySmall(char* dst, char const* src, int32_t bytes, int32_t lane)
{
#pragma unroll
    for (int32_t o = 0; o < 1024; o += 32 * 16)
    {
        if (o + lane * 16 < bytes)
        {
            cpAsync16(dst + o + lane * 16, src + o + lane * 16);
        }
    }
}

//! Staged scale/zero storage S (the run-time scale dtype, dispatched once per CTA) read as the MMA type T.
template <typename S>
__device__ __forceinline__ float scaleToFloat(S x)
{
    if constexpr (std::is_same<S, float>::value)
    {
        return x;
    }
    else
    {
        return ActTraits<S>::toFloat(x);
    }
}

//! Elements i, i + 1 (i even) of a staged S array as a T pair: one 32-bit load when S == T (exact), else rounded.
template <typename S, typename T>
__device__ __forceinline__ uint32_t stagedPair(char const* base, int32_t i)
{
    if constexpr (std::is_same<S, T>::value)
    {
        return *reinterpret_cast<uint32_t const*>(base + i * 2);
    }
    else
    {
        S const* s = reinterpret_cast<S const*>(base);
        return MmaTraits<T>::pack(scaleToFloat(s[i]), scaleToFloat(s[i + 1]));
    }
}

//! Elements i0, i1 (anywhere) of a staged S array as a T pair.
template <typename S, typename T>
__device__ __forceinline__ uint32_t stagedPair2(char const* base, int32_t i0, int32_t i1)
{
    if constexpr (std::is_same<S, T>::value)
    {
        uint16_t const* s = reinterpret_cast<uint16_t const*>(base);
        return uint32_t(s[i0]) | (uint32_t(s[i1]) << 16);
    }
    else
    {
        S const* s = reinterpret_cast<S const*>(base);
        return MmaTraits<T>::pack(scaleToFloat(s[i0]), scaleToFloat(s[i1]));
    }
}

//! What a CTA works on (resolveTile); run == false: nothing to do (rows of invalid sequences already zeroed).
struct MmaWork
{
    bool run;
    int32_t h;
    int32_t split;
    int32_t b;
    SeqInfo info;
    int32_t row0;  //!< first flattened row of the tile within the chunk
    int32_t nRows; //!< live rows (<= the kernel's tile rows)
    int32_t slot;
    int32_t s; //!< key positions are int32: kiviValidate caps the capacity at INT32_MAX / 2 tokens
    int32_t k0;
    int32_t k1;
    int32_t nq;
};

//! The tile of CTA (blockIdx.x, KV head blockIdx.y, split blockIdx.z): kROWS query rows of the sequence whose
//! tiles (SeqInfo fields kOFFSET, kCOUNT: the decode or the prefill kernel's) contain blockIdx.x.
template <typename T, int kD, int kROWS, int32_t SeqInfo::*kOFFSET, int32_t SeqInfo::*kCOUNT>
__device__ __forceinline__ MmaWork resolveTile(KiviStepParams const& p, KiviLaunchPlan const& plan,
    SeqInfo const* seqInfo)
{
    MmaWork wk{};
    int32_t const tile = blockIdx.x;
    wk.h = blockIdx.y;
    wk.split = blockIdx.z;
    int32_t const grp = plan.groupHeads;
    T* out = static_cast<T*>(p.out);
    // Rows no sequence covers are zeroed by kiviZeroUncoveredRowsKernel (one split) or kiviCombineKernel.
    wk.b = findSequence<kOFFSET>(seqInfo, p.batch, tile);
    wk.info = seqInfo[wk.b];
    if (tile >= wk.info.*kOFFSET + wk.info.*kCOUNT)
    {
        return wk;
    }
    int32_t const c = p.chunkLen[wk.b];
    wk.row0 = (tile - wk.info.*kOFFSET) * kROWS;
    int32_t const rowsAll = min(c, p.numTokens - wk.info.tokenOffset) * grp;
    wk.nRows = min(kROWS, rowsAll - wk.row0);
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
    wk.nq = static_cast<int32_t>(numQuantizedDev(wk.s, p.sinkTokens, p.residualLength, p.groupSize));
    wk.slot = p.slotIds[wk.b];
    wk.run = true;
    return wk;
}

//! Row of full-precision key `key` of the tile's sequence, or nullptr past k1 (those keys are masked; reading zeros
//! keeps NaN/Inf garbage out of 0 * x). Keys in kernel order: [0, n_q) the store (token S + key), [n_q, n_q + S) the
//! sink tokens (window rows key - n_q), [n_q + S, s) the ring (token = key, window row S + (key - S) % W), then the
//! chunk. Attention is the same in any key order; only the chunk's keys are causally masked, and they keep theirs.
template <typename T, int kD>
__device__ __forceinline__ T const* fullPrecisionRow(KiviStepParams const& p, MmaWork const& wk, bool values,
    int32_t key)
{
    if (key >= wk.k1)
    {
        return nullptr;
    }
    if (key < wk.s)
    {
        int32_t const w = p.residualLength + p.groupSize - 1;
        int32_t const sinks = p.sinkTokens;
        int32_t const row = key < wk.nq + sinks ? key - wk.nq : sinks + (key - sinks) % w;
        T const* win = static_cast<T const*>(values ? p.vWindow : p.kWindow);
        return win + ((int64_t(wk.slot) * p.numKvHeads + wk.h) * (sinks + w) + row) * kD;
    }
    T const* chunk = static_cast<T const*>(values ? p.v : p.k);
    return chunk + ((wk.info.tokenOffset + (key - wk.s)) * int64_t(p.numKvHeads) + wk.h) * kD;
}

//! The lane's B fragments of q, qa = rnd(qsc) / beta (row g, channels 16 kb + 8 reg + 2t + {0, 1}), from shared
//! memory ([kb / 2][lane] uint4s: conflict-free) into registers live only where they are used: registers are the
//! key loop's scarcest resource.
template <int kD>
__device__ __forceinline__ void loadQa(uint4 const* qaS, int32_t lane, uint32_t (&qa)[kD / 16][2])
{
#pragma unroll
    for (int32_t i = 0; i < kD / 32; ++i)
    {
        uint4 const x = qaS[i * 32 + lane];
        qa[2 * i][0] = x.x;
        qa[2 * i][1] = x.y;
        qa[2 * i + 1][0] = x.z;
        qa[2 * i + 1][1] = x.w;
    }
}

//! Scores of a full-precision 32-key chunk: A = K rows as stored, B = rnd(qsc) = qa * beta (exact; no scale, no bias).
template <typename T, int kD, int kKB>
__device__ __forceinline__ void loadFullPrecisionScores(KiviStepParams const& p, MmaWork const& wk,
    uint4 const* qaS, int32_t ci, int32_t g, int32_t t, float (&sc)[2][4])
{
    uint32_t qa[kD / 16][2];
    loadQa<kD>(qaS, 4 * g + t, qa);
    int32_t const kt = wk.k0 + ci * kMMA_CHUNK;
    constexpr uint32_t kBETA2 = pow2Pair<T>(false, -CodeAffine<T, kKB>::kLOG2_INV_BETA);
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
            mma16816<T>(c, a, MmaTraits<T>::mul2(qa[kb][0], kBETA2), MmaTraits<T>::mul2(qa[kb][1], kBETA2));
        }
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            sc[tau][r] = c[r];
        }
    }
}

//! O^T += V^T w^T for a full-precision 16-key tile: A registers are pairs of V rows (keys 2t, 2t + 1) of a channel.
template <typename T, int kD>
__device__ __forceinline__ void accumulateFullPrecisionValues(KiviStepParams const& p, MmaWork const& wk,
    int32_t ci, int32_t tau, int32_t g, int32_t t, uint32_t b0, uint32_t b1, float (&o)[kD / 16][4])
{
    int32_t const key0 = wk.k0 + ci * kMMA_CHUNK + 16 * tau;
    T const* rows[4];
#pragma unroll
    for (int32_t i = 0; i < 4; ++i) // keys 2t, 2t + 1, 2t + 8, 2t + 9 of the tile
    {
        rows[i] = fullPrecisionRow<T, kD>(p, wk, true, key0 + 2 * t + (i & 1) + 8 * (i >> 1));
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
        mma16816<T>(o[mt], a, b0, b1);
    }
}

//! Where a warp's next quantized chunk comes from: block-table entry and row within the block, advanced by one
//! chunk without a division.
struct ChunkCursor
{
    int32_t entry; //!< index into the sequence's block-table row
    int32_t row;   //!< key row within the block (a multiple of 32)

    __device__ __forceinline__ void advance(int32_t blockSize)
    {
        row += kMMA_CHUNK;
        if (row == blockSize)
        {
            row = 0;
            ++entry;
        }
    }
};

//! Issue the cp.async copies of the chunk at (block blk, row r) into stage `st`; one commit group. Offsets come from
//! head x blockSize times compile-time sizes (kernel parameters stay in the constant bank, not in registers).
template <int kD, int kKB, int kVB, typename S>
__device__ __forceinline__ void issueChunk(KiviStepParams const& p, char* st, int64_t blk, int32_t h, int32_t r,
    int32_t vGroups, int32_t log2Group, int32_t lane)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    int64_t const headRows = (blk * p.numKvHeads + h) * p.blockSize; // key rows before this (block, head)
    int64_t const rows = headRows + r;
    char const* kw = static_cast<char const*>(p.kCodes) + rows * (kD * kKB / 8);
    char const* vw = static_cast<char const*>(p.vCodes) + rows * (kD * kVB / 8);
    int64_t const ks = (rows >> log2Group) * (kD * int32_t(sizeof(S)));
    int64_t const vs = rows * (vGroups * int32_t(sizeof(S)));
    int32_t const vBytes = kMMA_CHUNK * vGroups * int32_t(sizeof(S));
    char* dst = st;
    warpCopyFixed<Geo::kKWORDS * 4>(dst, kw, lane);
    dst += Geo::kKWORDS * 4;
    warpCopyFixed<Geo::kVWORDS * 4>(dst, vw, lane);
    dst += Geo::kVWORDS * 4;
    warpCopyFixed<kD * int32_t(sizeof(S))>(dst, static_cast<char const*>(p.kScale) + ks, lane);
    dst += kD * sizeof(S);
    warpCopyFixed<kD * int32_t(sizeof(S))>(dst, static_cast<char const*>(p.kZero) + ks, lane);
    dst += kD * sizeof(S);
    warpCopySmall(dst, static_cast<char const*>(p.vScale) + vs, vBytes, lane);
    dst += vBytes;
    warpCopySmall(dst, static_cast<char const*>(p.vZero) + vs, vBytes, lane);
}

//! One warp's running state (lane = (g, t): score columns / O^T columns = rows 2t, 2t + 1 of the CTA).
template <int kD>
struct MmaWarpState
{
    static constexpr int32_t kMT = kD / 16;
    float o[kMT][4]; //!< O^T C fragments: channel 16 mt + g (+8), rows 2t, 2t + 1
    float m[2];      //!< running max (log2 units) of rows 2t, 2t + 1
    float vb[4];     //!< C fragment of [V bias per group ; l] (rows = groups, row Gv-count = sum of w), cols = rows
};

//! The B fragments of S for a new key group and the score bias of this lane's columns (rows 2t, 2t + 1):
//! q'' = rnd(qa * s_k) for row g, channels 16 kb + 8 reg + 2t + {0, 1}; bias = sum_ch (rnd(qsc) z_k - alpha q'') by
//! m16n8k8 MMAs whose A is the lane's existing pair (qa or q'' of channels 2t.. and 8 + 2t..: rows g and g + 8 of A
//! are the low and high channel halves of query row g) and whose B is z_k of the low half for columns 0-3 and of
//! the high half for columns 4-7 (alpha/beta for every column): row g's bias is C[g][0-3] + C[g + 8][4-7].
//! The alpha term has its own accumulator and a POSITIVE constant B, subtracted at the end: with B = (-2^b, -2^b)
//! ptxas (CUDA 13.0) emitted HMMA.1688 with the B operand negated (-R, R = 0x5C00DC00 for fp16 and 8-bit codes),
//! which is (-2^b, -2^b) only if the negation flips bit 31 alone; an H200 flipped both halves, so every even
//! channel's alpha term had the wrong sign (build_scripts/gpu_diagnose.py, "shot" cases). tests/test_kernels_sass.py
//! keeps every HMMA operand of the library unnegated.
template <typename T, int kD, int kKB, typename S>
__device__ __forceinline__ void foldKeyGroup(uint4 const* qaS, char const* kScale, char const* kZero, int32_t g,
    int32_t t, uint32_t (&qK)[kD / 16][2], float (&biasS)[2])
{
    uint32_t qa[kD / 16][2];
    loadQa<kD>(qaS, 4 * g + t, qa);
    using Aff = CodeAffine<T, kKB>;
    float c[4] = {0.F, 0.F, 0.F, 0.F};  // qa . z_k
    float ca[4] = {0.F, 0.F, 0.F, 0.F}; // q'' . alpha / beta (alpha = 1: B = kINV_BETA2)
    int32_t const zCh = 8 * (g >> 2) + 2 * t; // B column g: the low (g < 4) or high channel half
#pragma unroll
    for (int32_t kb = 0; kb < kD / 16; ++kb)
    {
        int32_t const ch = 16 * kb + 2 * t;
        qK[kb][0] = MmaTraits<T>::mul2(qa[kb][0], stagedPair<S, T>(kScale, ch));
        qK[kb][1] = MmaTraits<T>::mul2(qa[kb][1], stagedPair<S, T>(kScale, ch + 8));
        mma1688<T>(c, qa[kb][0], qa[kb][1], stagedPair<S, T>(kZero, 16 * kb + zCh));
        if constexpr (Aff::kALPHA != 0.F)
        {
            mma1688<T>(ca, qK[kb][0], qK[kb][1], Aff::kINV_BETA2);
        }
    }
    // (sum over channels of qa z - alpha/beta q'') * beta = bias of row g: rows g (low half, columns 2t < 4) and
    // g + 8 (high half, columns 2t >= 4)
    constexpr float kBETA = 1.F / float(1 << Aff::kLOG2_INV_BETA);
    float v = t < 2 ? c[0] - ca[0] : c[2] - ca[2];
    v += __shfl_xor_sync(0xffffffffU, v, 2);
    v *= kBETA;
    biasS[0] = __shfl_sync(0xffffffffU, v, (2 * t) * 4);
    biasS[1] = __shfl_sync(0xffffffffU, v, (2 * t + 1) * 4);
}

//! The V scales / zeros of one 16-key tile as one lane needs them (keys 2t, 2t + 1, 2t + 8, 2t + 9): the P' scale
//! pair of a 32-channel slice and the V bias operand of group g. kVG > 0 (S == T, Gv = 32, so kVG = D / 32 groups
//! and slice j is group j): each key's row of kVG 16-bit scales is one load, pairs are one prmt each. kVG == 0: any
//! Gv and storage type, element loads (stagedPair2).
template <typename T, int kVB, typename S, int kVG>
struct ValueScaleTile
{
    static constexpr int32_t kWORDS = kVG > 0 ? kVG / 2 : 1;
    uint32_t s[4][kWORDS]; //!< kVG > 0: rows of keys 2t, 2t + 1, 2t + 8, 2t + 9
    uint32_t z[4][kWORDS];
    char const* vScale;
    char const* vZero;
    int32_t i0; //!< kVG == 0: staged index of (key 2t, group 0)
    int32_t vGroups;
    int32_t vSliceShift;

    __device__ __forceinline__ void load(char const* sBase, char const* zBase, int32_t key0, int32_t groups,
        int32_t sliceShift, int32_t t)
    {
        vScale = sBase;
        vZero = zBase;
        vGroups = groups;
        vSliceShift = sliceShift;
        if constexpr (kVG > 0)
        {
#pragma unroll
            for (int32_t k = 0; k < 4; ++k)
            {
                int32_t const key = key0 + 2 * t + (k & 1) + 8 * (k >> 1);
#pragma unroll
                for (int32_t j = 0; j < kWORDS; ++j)
                {
                    s[k][j] = reinterpret_cast<uint32_t const*>(sBase + key * kVG * 2)[j];
                    z[k][j] = reinterpret_cast<uint32_t const*>(zBase + key * kVG * 2)[j];
                }
            }
        }
        else
        {
            i0 = (key0 + 2 * t) * groups;
        }
    }

    //! (s[key 2t][slice], s[2t + 1][slice]) (high: keys 2t + 8, 2t + 9) as a T pair; `slice` is compile-time.
    __device__ __forceinline__ uint32_t scalePair(int32_t slice, bool high) const
    {
        if constexpr (kVG > 0)
        {
            int32_t const k = high ? 2 : 0;
            return __byte_perm(s[k][slice / 2], s[k + 1][slice / 2], slice % 2 ? 0x7632 : 0x5410);
        }
        else
        {
            int32_t const i = i0 + (high ? 8 * vGroups : 0) + (slice >> vSliceShift);
            return stagedPair2<S, T>(vScale, i, i + vGroups);
        }
    }

    //! The A fragment of the V bias MMA: row g < vGroups = u = rnd(z_v - alpha s_v / beta) of group g at keys 2t,
    //! 2t + 1 (a0) and 2t + 8, 2t + 9 (a2); row vGroups = ones (its result is l); other rows 0.
    __device__ __forceinline__ void biasOperand(int32_t g, uint32_t (&a)[4]) const
    {
        using Aff = CodeAffine<T, kVB>;
        uint32_t sp[2];
        uint32_t zp[2];
        if constexpr (kVG > 0)
        {
            int32_t const gg = g < kVG ? g : 0;
            uint32_t const sel = gg % 2 ? 0x7632U : 0x5410U;
#pragma unroll
            for (int32_t h = 0; h < 2; ++h)
            {
                uint32_t const s0 = kWORDS > 1 && gg >= 2 ? s[2 * h][kWORDS - 1] : s[2 * h][0];
                uint32_t const s1 = kWORDS > 1 && gg >= 2 ? s[2 * h + 1][kWORDS - 1] : s[2 * h + 1][0];
                uint32_t const z0 = kWORDS > 1 && gg >= 2 ? z[2 * h][kWORDS - 1] : z[2 * h][0];
                uint32_t const z1 = kWORDS > 1 && gg >= 2 ? z[2 * h + 1][kWORDS - 1] : z[2 * h + 1][0];
                sp[h] = __byte_perm(s0, s1, sel);
                zp[h] = __byte_perm(z0, z1, sel);
            }
        }
        else
        {
            int32_t const i = i0 + (g < vGroups ? g : 0);
            sp[0] = stagedPair2<S, T>(vScale, i, i + vGroups);
            sp[1] = stagedPair2<S, T>(vScale, i + 8 * vGroups, i + 9 * vGroups);
            zp[0] = stagedPair2<S, T>(vZero, i, i + vGroups);
            zp[1] = stagedPair2<S, T>(vZero, i + 8 * vGroups, i + 9 * vGroups);
        }
        uint32_t u0 = zp[0];
        uint32_t u1 = zp[1];
        if constexpr (Aff::kALPHA != 0.F)
        {
            u0 = MmaTraits<T>::fma2(sp[0], Aff::kNEG_ALPHA_INV_BETA2, zp[0]);
            u1 = MmaTraits<T>::fma2(sp[1], Aff::kNEG_ALPHA_INV_BETA2, zp[1]);
        }
        constexpr uint32_t kONE2 = MmaTraits<T>::kONE * 0x00010001U;
        a[0] = g < vGroups ? u0 : (g == vGroups ? kONE2 : 0U);
        a[2] = g < vGroups ? u1 : (g == vGroups ? kONE2 : 0U);
        a[1] = 0U;
        a[3] = 0U;
    }
};

//! The full key loop of one warp over its chunk range [c0, c1), scale storage S (dispatched once per CTA).
template <typename T, int kD, int kKB, int kVB, typename S, int kVG>
__device__ __forceinline__ void mmaKeyLoop(KiviStepParams const& p, MmaWork const& wk, char* stages,
    uint4 const* qaS, int32_t c0, int32_t c1, int32_t cq,
    int32_t maskFrom, int32_t const (&pos)[2], int32_t lane, MmaWarpState<kD>& st)
{
    using Geo = MmaChunkGeometry<kD, kKB, kVB>;
    using AffV = CodeAffine<T, kVB>;
    constexpr int32_t kMT = kD / 16;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    int32_t const gv = valueGroupSizeDev(p.groupSize, kD);
    int32_t const vGroups = kD / gv;
    int32_t const vSliceShift = __ffs(gv / 32) - 1; // 32-channel slice j lies in V group j >> vSliceShift
    int32_t const log2Group = __ffs(p.groupSize) - 1;
    int32_t const stageBytes = mmaStageBytes<kD, kKB, kVB>(sizeof(S), p.groupSize);
    int32_t const* table = p.blockTable + int64_t(wk.b) * p.maxBlocksPerSeq;
    uint32_t one2 = MmaTraits<T>::kONE * 0x00010001U;
    asm volatile("" : "+r"(one2)); // keep the lop3 constant in a register (one LOP3 per code register)

    int32_t const keyC0 = wk.k0 + c0 * kMMA_CHUNK;
    ChunkCursor issueAt{keyC0 / p.blockSize, keyC0 % p.blockSize};
    int32_t issueStage = 0; // stages rotate: chunk c0 + i uses stage i % kMMA_STAGES
    auto issue = [&](int32_t ci) {
        if (ci < cq)
        {
            issueChunk<kD, kKB, kVB, S>(p, stages + issueStage * stageBytes, table[issueAt.entry], wk.h,
                issueAt.row, kVG > 0 ? kVG : vGroups, log2Group, lane);
            issueAt.advance(p.blockSize);
        }
        issueStage = issueStage == kMMA_STAGES - 1 ? 0 : issueStage + 1;
        cpAsyncCommit(); // always one group per chunk slot: wait_group counts stay uniform
    };
    for (int32_t i = 0; i < kMMA_STAGES - 1; ++i)
    {
        issue(c0 + i);
    }

    uint32_t qK[kMT][2]; // B of S for the current key group: q'' = rnd(qa * s_k), lane: row g
    float biasS[2] = {0.F, 0.F};
    int32_t rowC = keyC0 % p.blockSize; // block row of the chunk being consumed
    int32_t useStage = 0;
    bool first = true;
    for (int32_t ci = c0; ci < c1; ++ci)
    {
        bool const quant = ci < cq;
        char const* stg = stages + useStage * stageBytes;
        useStage = useStage == kMMA_STAGES - 1 ? 0 : useStage + 1;
        char const* kWords = stg;
        char const* vWords = kWords + Geo::kKWORDS * 4;
        char const* kScale = vWords + Geo::kVWORDS * 4;
        char const* kZero = kScale + kD * sizeof(S);
        char const* vScale = kZero + kD * sizeof(S);
        char const* vZero = vScale + kMMA_CHUNK * vGroups * sizeof(S);
        float sc[2][4];
        if (quant)
        {
            cpAsyncWait<kMMA_STAGES - 2>();
            __syncwarp();
            if (first || (rowC & (p.groupSize - 1)) == 0) // a new key group (G is a power of two)
            {
                foldKeyGroup<T, kD, kKB, S>(qaS, kScale, kZero, g, t, qK, biasS);
            }
            first = false;
            // S = K q''^T + bias: registers straight from this lane's words (FRAGMENT order); the two tiles'
            // accumulator chains interleave so no MMA waits on the previous one
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
                    sc[tau][r] = biasS[r & 1];
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
                    mma16816<T>(sc[tau], a, qK[kb][0], qK[kb][1]);
                }
            }
        }
        else
        {
            loadFullPrecisionScores<T, kD, kKB>(p, wk, qaS, ci, g, t, sc);
        }
        int32_t const kt = wk.k0 + ci * kMMA_CHUNK;
        if (kt + kMMA_CHUNK > maskFrom) // keys past the split or past a row's causal limit (uniform branch)
        {
#pragma unroll
            for (int32_t tau = 0; tau < 2; ++tau)
            {
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    int32_t const key = kt + 16 * tau + g + 8 * (r >> 1);
                    if (!(key < wk.k1 && key <= pos[r & 1]))
                    {
                        sc[tau][r] = -INFINITY;
                    }
                }
            }
        }
        // online softmax: row maxima over the chunk, rescale only when one grows (warp-uniform vote)
        float mx[2] = {fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2])),
            fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]))};
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
#pragma unroll
            for (int32_t o = 4; o < 32; o <<= 1)
            {
                mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffU, mx[j], o));
            }
            mx[j] = fmaxf(mx[j], st.m[j]);
        }
        if (__any_sync(0xffffffffU, mx[0] > st.m[0] || mx[1] > st.m[1]))
        {
            float alpha[2];
#pragma unroll
            for (int32_t j = 0; j < 2; ++j)
            {
                alpha[j] = mx[j] == st.m[j] ? 1.F : fastExp2(st.m[j] - mx[j]);
                st.m[j] = mx[j];
            }
#pragma unroll
            for (int32_t mt = 0; mt < kMT; ++mt)
            {
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    st.o[mt][r] *= alpha[r & 1];
                }
            }
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                st.vb[r] *= alpha[r & 1];
            }
        }
        float const mUse[2] = {st.m[0] == -INFINITY ? 0.F : st.m[0], st.m[1] == -INFINITY ? 0.F : st.m[1]};
        // O^T += V^T P'^T; [V bias ; l] += [u ; 1] w^T
#pragma unroll
        for (int32_t tau = 0; tau < 2; ++tau)
        {
            uint32_t const h0 = MmaTraits<T>::pack(fastExp2(sc[tau][0] - mUse[0]), fastExp2(sc[tau][1] - mUse[1]));
            uint32_t const h1 = MmaTraits<T>::pack(fastExp2(sc[tau][2] - mUse[0]), fastExp2(sc[tau][3] - mUse[1]));
            uint32_t const b0 = movTrans(h0); // keys 2t, 2t + 1 of the tile, row g
            uint32_t const b1 = movTrans(h1); // keys 2t + 8, 2t + 9
            int32_t const key0 = 16 * tau;
            uint32_t av[4];
            if (quant)
            {
                ValueScaleTile<T, kVB, S, kVG> vt;
                vt.load(vScale, vZero, key0, vGroups, vSliceShift, t);
                vt.biasOperand(g, av);
                uint32_t w[Geo::kNWV];
                uint32_t const* src = reinterpret_cast<uint32_t const*>(vWords) + (tau * 32 + lane) * Geo::kNWV;
#pragma unroll
                for (int32_t j = 0; j < Geo::kNWV; ++j)
                {
                    w[j] = src[j];
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
                    convertBlock<T, kVB, Geo::kNWV>(w, mt, one2, a);
                    mma16816<T>(st.o[mt], a, pb0, pb1);
                }
            }
            else
            {
                constexpr uint32_t kONE2 = MmaTraits<T>::kONE * 0x00010001U;
                av[0] = g == vGroups ? kONE2 : 0U; // l only: full-precision keys have no V bias
                av[2] = av[0];
                av[1] = 0U;
                av[3] = 0U;
                accumulateFullPrecisionValues<T, kD>(p, wk, ci, tau, g, t, b0, b1, st.o);
            }
            mma16816<T>(st.vb, av, b0, b1);
        }
        if (quant)
        {
            __syncwarp(); // every lane has read this stage before it is refilled
            rowC += kMMA_CHUNK;
            rowC = rowC == p.blockSize ? 0 : rowC;
        }
        issue(ci + kMMA_STAGES - 1);
    }
    cpAsyncWait<0>();
}

template <typename T, int kD, int kKB, int kVB>
__global__ void __launch_bounds__(kMMA_THREADS, mmaMinCtas(kKB, kVB)) kiviDecodeMmaKernel(
    KiviStepParams p, KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl)
{
    using AffK = CodeAffine<T, kKB>;
    constexpr int32_t kMT = kD / 16;
    extern __shared__ __align__(16) char smem[];
    // qsc = q log2(e) / sqrt(D) of the 8 rows (0 for dead rows); rows padded by 8 floats so the 8 groupIDs' float2
    // reads of one B fragment hit distinct banks (2 wavefronts per warp instead of 8)
    __shared__ float qS[kTILE_ROWS][kD + 8];
    __shared__ uint4 qaS[kD / 32 * 32];

    MmaWork const wk = resolveTile<T, kD, kTILE_ROWS, &SeqInfo::tileOffset, &SeqInfo::tileCount>(p, plan, seqInfo);
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
    int32_t const vGroups = kD / gv;
    int32_t const scaleBytes = p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2;
    int32_t const stageBytes = mmaStageBytes<kD, kKB, kVB>(scaleBytes, p.groupSize);
    // fl32(log2(e) / sqrt(D)), as mma_model
    float const smScale = kD == 64 ? 0.18033688011112042F : 0.12751743082459868F;

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
    // B fragments of q for row g, channels 16 kb + 8 reg + 2t + {0, 1}: qa = rnd(qsc) / beta (exact), written once
    // by warp 0 as [kb / 2][lane] uint4s
    if (warp == 0)
    {
#pragma unroll
        for (int32_t i = 0; i < kMT / 2; ++i)
        {
            uint32_t x[4];
#pragma unroll
            for (int32_t k = 0; k < 4; ++k)
            {
                int32_t const kb = 2 * i + k / 2;
                float2 const qq = *reinterpret_cast<float2 const*>(&qS[g][16 * kb + 8 * (k % 2) + 2 * t]);
                x[k] = MmaTraits<T>::mul2(MmaTraits<T>::pack(qq.x, qq.y), AffK::kINV_BETA2); // exact: 2^b
            }
            qaS[i * 32 + lane] = make_uint4(x[0], x[1], x[2], x[3]);
        }
    }
    __syncthreads();

    // Causal limit of this lane's score columns (rows 2t, 2t + 1; dead rows take row 0's and are never written).
    int32_t pos[2];
#pragma unroll
    for (int32_t j = 0; j < 2; ++j)
    {
        int32_t const n = 2 * t + j;
        pos[j] = wk.s + (wk.row0 + (n < wk.nRows ? n : 0)) / grp;
    }
    // chunks ending at or before maskFrom need no mask: all their keys are below k1 and every row's limit
    int32_t const maskFrom = min(wk.k1, wk.s + wk.row0 / grp + 1);

    // This warp's contiguous range of 32-key chunks of the split.
    int32_t const nChunks = (wk.k1 - wk.k0 + kMMA_CHUNK - 1) / kMMA_CHUNK;
    int32_t const per = (nChunks + kMMA_WARPS - 1) / kMMA_WARPS;
    int32_t const c0 = min(warp * per, nChunks);
    int32_t const c1 = min(c0 + per, nChunks);
    // Chunks [c0, cq) are quantized (keys < n_q(s)), [cq, c1) full precision (window, then chunk rows).
    int32_t const cq = max(c0, min(c1, (wk.nq - wk.k0 + kMMA_CHUNK - 1) / kMMA_CHUNK));
    char* stages = smem + warp * kMMA_STAGES * stageBytes;

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
    // one uniform branch per CTA on the scale dtype: the key loop is compiled once per storage type
    // (scale dtype == activation dtype, G = 32: the default) gets the row-load V scale path
    bool const actScales = p.scaleDtype == (std::is_same<T, half>::value ? kKIVI_FLOAT16 : kKIVI_BFLOAT16);
    if (actScales && vGroups == kD / 32)
    {
        mmaKeyLoop<T, kD, kKB, kVB, T, kD / 32>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);
    }
    else if (p.scaleDtype == kKIVI_FLOAT16)
    {
        mmaKeyLoop<T, kD, kKB, kVB, half, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);
    }
    else if (p.scaleDtype == kKIVI_BFLOAT16)
    {
        mmaKeyLoop<T, kD, kKB, kVB, __nv_bfloat16, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);
    }
    else
    {
        mmaKeyLoop<T, kD, kKB, kVB, float, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);
    }

    // End of the key loop: l and the V bias of group (16 mt + g) / Gv come from lane (group, t) of st.vb. G is
    // re-read here (an opaque copy) rather than kept live through the key loop, where registers are scarce.
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
        int32_t const src = (16 * mt / gvEnd) * 4 + t; // channels 16 mt .. 16 mt + 15 share one group (Gv >= 32)
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
    float* mS = reinterpret_cast<float*>(smem);                    // [warps][8]
    float* lS = mS + kMMA_WARPS * kTILE_ROWS;                       // [warps][8]
    float* oS = lS + kMMA_WARPS * kTILE_ROWS;                       // [warps][8][D]
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
        float lsum = 0.F;
        float o = 0.F;
#pragma unroll
        for (int32_t w2 = 0; w2 < kMMA_WARPS; ++w2)
        {
            float const mw = mS[w2 * kTILE_ROWS + n];
            float const f = mw == -INFINITY ? 0.F : fastExp2(mw - mx);
            lsum = __fmaf_rn(lS[w2 * kTILE_ROWS + n], f, lsum);
            o = __fmaf_rn(oS[(w2 * kTILE_ROWS + n) * kD + ch], f, o);
        }
        int32_t const row = wk.row0 + n;
        int64_t const token = wk.info.tokenOffset + row / grp;
        int64_t const head = wk.h * grp + row % grp;
        if (plan.numSplits == 1)
        {
            out[(token * p.numHeads + head) * kD + ch] = ActTraits<T>::fromFloat(lsum > 0.F ? __fdiv_rn(o, lsum) : 0.F);
        }
        else
        {
            int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;
            partialAcc[idx * kD + ch] = o;
            if (ch == 0)
            {
                partialMl[idx * 2] = mx * kLN2; // the combine kernel weighs splits in natural-log units
                partialMl[idx * 2 + 1] = lsum;
            }
        }
    }
}

} // namespace kernels
} // namespace trtllm_kivi
