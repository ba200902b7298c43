/*
 * KIVI kernels: device helpers shared by the append and attention kernels (header-only, raw pointers).
 *
 * Numerics follow trtllm_kivi/reference/quant.py exactly where the result is stored (codes, scales): fp32 with
 * explicit round-to-nearest intrinsics (__fsub_rn/__fmul_rn/__fadd_rn/__fdiv_rn) so nvcc cannot contract a multiply
 * and an add into one FMA, IEEE division, and rintf (round half to even). These translation units are never built
 * with --use_fast_math.
 */
#pragma once

#include "kiviFormat.h"
#include "kiviParams.h"

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace trtllm_kivi
{
namespace kernels
{

//! Activation storage type <-> fp32 (round to nearest even), FasterTransformer style.
template <typename T>
struct ActTraits;

template <>
struct ActTraits<half>
{
    static __device__ __forceinline__ float toFloat(half x)
    {
        return __half2float(x);
    }

    static __device__ __forceinline__ half fromFloat(float x)
    {
        return __float2half_rn(x);
    }
};

template <>
struct ActTraits<__nv_bfloat16>
{
    static __device__ __forceinline__ float toFloat(__nv_bfloat16 x)
    {
        return __bfloat162float(x);
    }

    static __device__ __forceinline__ __nv_bfloat16 fromFloat(float x)
    {
        return __float2bfloat16_rn(x);
    }
};

//! Round an fp32 value to the activation type and back: what the reference's `.to(window dtype)` does.
template <typename T>
__device__ __forceinline__ float roundToAct(float x)
{
    return ActTraits<T>::toFloat(ActTraits<T>::fromFloat(x));
}

//! Scale/zero element `idx` of a buffer of dtype `dtype` (KiviDataType) as fp32.
__device__ __forceinline__ float loadScale(void const* ptr, int64_t idx, int32_t dtype)
{
    if (dtype == kKIVI_FLOAT16)
    {
        return __half2float(static_cast<half const*>(ptr)[idx]);
    }
    if (dtype == kKIVI_BFLOAT16)
    {
        return __bfloat162float(static_cast<__nv_bfloat16 const*>(ptr)[idx]);
    }
    return static_cast<float const*>(ptr)[idx];
}

//! Store fp32 `x` cast to `dtype`; returns the stored value as fp32 (the codes are computed from it).
__device__ __forceinline__ float storeScale(void* ptr, int64_t idx, int32_t dtype, float x)
{
    if (dtype == kKIVI_FLOAT16)
    {
        half const h = __float2half_rn(x);
        static_cast<half*>(ptr)[idx] = h;
        return __half2float(h);
    }
    if (dtype == kKIVI_BFLOAT16)
    {
        __nv_bfloat16 const h = __float2bfloat16_rn(x);
        static_cast<__nv_bfloat16*>(ptr)[idx] = h;
        return __bfloat162float(h);
    }
    static_cast<float*>(ptr)[idx] = x;
    return x;
}

//! IEEE fp32 division (correctly rounded a / b) without a subroutine call (div.rn.f32 / div.rn.f64 call a slow path
//! whose register saves count as spills). Finite a, finite nonzero b: r = 1 / b in fp64 (rcp.approx + 2 Newton
//! steps), q = a r corrected once by the residual: |q - a / b| <= 2^-52 |a / b|, while a / b (24-bit operands) is
//! never an fp32 rounding midpoint and lies at a relative distance >= 2^-49 from each, so rounding q to fp32 gives
//! fl(a / b). Special operands (NaN, inf, zero divisor) by one fp32 product with IEEE's results.
__device__ __forceinline__ float ieeeDiv(float a, float b)
{
    if (!(fabsf(a) < INFINITY) || !(fabsf(b) < INFINITY) || b == 0.F)
    {
        float const rb = b == 0.F ? copysignf(INFINITY, b) : (fabsf(b) < INFINITY ? copysignf(1.F, b) : copysignf(0.F, b));
        return __fmul_rn(a, rb); // NaN, inf / x, x / inf, x / 0, inf / inf, 0 / 0 as IEEE
    }
    double const x = a;
    double const y = b;
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;\n" : "=d"(r) : "d"(y));
    r = __fma_rn(r, __fma_rn(-y, r, 1.0), r);
    r = __fma_rn(r, __fma_rn(-y, r, 1.0), r);
    double const q = __dmul_rn(x, r);
    return __double2float_rn(__fma_rn(__fma_rn(-y, q, x), r, q));
}

//! Code of x: clamp(round_half_even((x - zero) / scale), 0, levels), 0 when the stored scale is 0 or the result is
//! NaN (fmaxf(NaN, 0) = 0), as reference/quant.py quantize_groups.
__device__ __forceinline__ uint32_t quantizeCode(float x, float scale, float zero, float levels)
{
    if (scale == 0.F)
    {
        return 0U;
    }
    float const q = rintf(ieeeDiv(__fsub_rn(x, zero), scale));
    return static_cast<uint32_t>(fminf(fmaxf(q, 0.F), levels));
}

//! Dequantized value q * scale + zero in fp32 (no FMA contraction), as reference/quant.py dequantize_groups.
__device__ __forceinline__ float dequantize(float code, float scale, float zero)
{
    return __fadd_rn(__fmul_rn(code, scale), zero);
}

//! Codes i and i + n/2 of an LSB-first word holding n = 32 / kBITS codes, as exact fp32, via the fp16
//! magic-number trick: OR-ing a code c into the mantissa of 1024.0h (0x6400) gives the half 1024 + c exactly
//! (c < 1024, fp16 spacing is 1 in [1024, 2048)), so one AND-OR (a single lop3) and one __hsub2 convert two codes.
//! trtllm_kivi/cuda/model.py emulates this with numpy bit views.
template <int kBITS>
__device__ __forceinline__ float2 codePairToFloat(uint32_t word, int32_t i)
{
    constexpr uint32_t kMASK = ((1U << kBITS) - 1U) * 0x00010001U;
    constexpr uint32_t kMAGIC = 0x64006400U;
    uint32_t const bits = ((word >> (i * kBITS)) & kMASK) | kMAGIC;
    __half2 h;
    static_assert(sizeof(h) == sizeof(bits), "half2 is 32 bits");
    memcpy(&h, &bits, sizeof(bits));
    __half2 const magic = __half2half2(__ushort_as_half(static_cast<unsigned short>(0x6400U)));
    return __half22float2(__hsub2(h, magic));
}

//! Per-sequence info the prepare kernel writes into the workspace (kSEQ_INFO_INTS ints per sequence).
struct SeqInfo
{
    int32_t tokenOffset; //!< first row of this sequence in q/k/v/out (sum of clamped chunk_len before it)
    int32_t tileOffset;  //!< first attention tile of this sequence
    int32_t tileCount;   //!< decode-kernel tiles: ceil(rows x groupHeads / kTILE_ROWS), 0 for a prefill sequence
    int32_t valid;       //!< 1 when every device-side check passed
    int32_t splitLen;    //!< keys per split of this sequence: its length spread over all numSplits (see KiviLaunchPlan)
    int32_t prefillTileOffset; //!< first prefill-kernel tile of this sequence
    int32_t prefillTileCount;  //!< ceil(rows x groupHeads / kPREFILL_TILE_ROWS) for a prefill sequence, else 0
    int32_t windowWritten;     //!< 1: the attention kernel writes this sequence's window row (plan.windowByAttention,
                               //!< a valid one-token chunk that flushes nothing); the append kernel skips it
};

static_assert(sizeof(SeqInfo) == kSEQ_INFO_INTS * sizeof(int32_t), "SeqInfo layout");

//! Gv = min(G, D) (kiviFormat.h valueGroupSize, usable in device code without --expt-relaxed-constexpr).
__host__ __device__ constexpr int32_t valueGroupSizeDev(int32_t groupSize, int32_t headDim)
{
    return groupSize < headDim ? groupSize : headDim;
}

//! n_q(T) = max(0, floor((T - S - R) / G)) * G: tokens in the quantized store (tokens [S, S + n_q)), format.py.
__device__ __forceinline__ int64_t numQuantizedDev(
    int64_t seqLen, int32_t sinkTokens, int32_t residualLength, int32_t groupSize)
{
    int64_t const free = seqLen - sinkTokens - residualLength;
    return free < 0 ? 0 : free / groupSize * groupSize;
}

//! Window row of token t: t for a sink (t < S), else S + (t - S) % W (format.py window_row).
//! 32-bit: kiviValidate caps token positions below 2^31, and a 64-bit remainder is a subroutine call.
__device__ __forceinline__ int32_t windowRowDev(int32_t t, int32_t sinkTokens, int32_t w)
{
    return t < sinkTokens ? t : sinkTokens + (t - sinkTokens) % w;
}

//! Programmatic dependent launch (sm_90): wait until the preceding kernel of the stream has completed and its
//! writes are visible; a no-op when the kernel was not launched as a dependent (and on older archs, where the
//! launcher never asks for it).
__device__ __forceinline__ void gridDependencyWait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

//! Let the dependent kernel of the stream start now (its CTAs wait with gridDependencyWait where they need us).
__device__ __forceinline__ void gridDependencyLaunch()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float warpMax(float x)
{
#pragma unroll
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffU, x, o));
    }
    return x;
}

__device__ __forceinline__ float warpSum(float x)
{
#pragma unroll
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        x += __shfl_xor_sync(0xffffffffU, x, o);
    }
    return x;
}

} // namespace kernels
} // namespace trtllm_kivi
