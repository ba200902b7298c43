/*
 * The register-level helpers of the split decode kernel (kiviDecodeSplit.cuh), header-only: non-volatile tensor-core
 * and movmatrix wrappers, ldmatrix and zero-filling cp.async, the full-precision tile's swizzle, the V scale rows, the
 * key-group fold with independent chains, and the online softmax update (emulated by trtllm_kivi/cuda/split_model.py).
 */
#pragma once

#include "kiviDecodeMma.cuh"

namespace trtllm_kivi
{
namespace kernels
{

//! m16n8k16 without `volatile`: a pure register operation the compiler may schedule (kiviDecodeMma.cuh keeps the
//! baseline's volatile form unchanged).
template <typename T>
__device__ __forceinline__ void mmaReg(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same<T, half>::value)
    {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    else
    {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    __trap(); // the launcher refuses devices below sm_80
#endif
}

//! m16n8k8 without `volatile` (B must not be a constant that ptxas may encode negated: see foldKeyGroup).
template <typename T>
__device__ __forceinline__ void mmaReg1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same<T, half>::value)
    {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(b0));
    }
    else
    {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(b0));
    }
#else
    __trap();
#endif
}

__device__ __forceinline__ uint32_t movTransReg(uint32_t x)
{
    uint32_t y = x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
#endif
    return y;
}

//! ldmatrix (volatile: it reads shared memory that cp.async filled; it must stay after the wait and __syncwarp).
__device__ __forceinline__ void ldmatrixX4(uint32_t (&a)[4], uint32_t addr)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
#endif
}

__device__ __forceinline__ void ldmatrixX4Trans(uint32_t (&a)[4], uint32_t addr)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
#endif
}

//! 16-byte cp.async that writes zeros when `valid` is false (src-size 0: nothing is read).
__device__ __forceinline__ void cpAsync16Zfill(uint32_t smemAddr, void const* gmem, bool valid)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smemAddr), "l"(gmem), "r"(valid ? 16 : 0));
#endif
}

//! Byte offset of 16-byte chunk c of row r in a full-precision tile of rows of kD 16-bit elements: rows are kD * 2
//! bytes, chunk c stored at c ^ (r % 8), so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
template <int kD>
__device__ __forceinline__ uint32_t fpTileOffset(int32_t r, int32_t c)
{
    return static_cast<uint32_t>(r * kD * 2 + ((c ^ (r & 7)) << 4));
}

//! The V scales of one 16-key tile as the lane needs them (keys 2t, 2t + 1, 2t + 8, 2t + 9): as ValueScaleTile of
//! kiviDecodeMma.cuh, with each key's row of kVG 16-bit scales read as one 4- or 8-byte load (kVG = D / 32 > 0).
template <typename T, int kVB, typename S, int kVG>
struct ValueScaleRows : ValueScaleTile<T, kVB, S, kVG>
{
    __device__ __forceinline__ void loadRows(char const* sBase, char const* zBase, int32_t key0, int32_t groups,
        int32_t sliceShift, int32_t t)
    {
        if constexpr (kVG == 4)
        {
            this->vScale = sBase;
            this->vZero = zBase;
            this->vGroups = groups;
            this->vSliceShift = sliceShift;
#pragma unroll
            for (int32_t k = 0; k < 4; ++k)
            {
                int32_t const key = key0 + 2 * t + (k & 1) + 8 * (k >> 1);
                uint2 const sv = *reinterpret_cast<uint2 const*>(sBase + key * 8);
                uint2 const zv = *reinterpret_cast<uint2 const*>(zBase + key * 8);
                this->s[k][0] = sv.x;
                this->s[k][1] = sv.y;
                this->z[k][0] = zv.x;
                this->z[k][1] = zv.y;
            }
        }
        else
        {
            this->load(sBase, zBase, key0, groups, sliceShift, t);
        }
    }
};

//! The key-group fold of foldKeyGroup (kiviDecodeMma.cuh) with independent chains: each term accumulates the even
//! and the odd 16-channel blocks separately (4 chains of D / 32 MMAs instead of 2 of D / 16), summed at the end.
//! The alpha term keeps a positive constant B (never a negated operand: tests/test_kernels_sass.py).
template <typename T, int kD, int kKB, typename S>
__device__ __forceinline__ void foldKeyGroupSplit(uint4 const* qaS, char const* kScale, char const* kZero, int32_t g,
    int32_t t, uint32_t (&qK)[kD / 16][2], float (&biasS)[2])
{
    uint32_t qa[kD / 16][2];
    loadQa<kD>(qaS, 4 * g + t, qa);
    using Aff = CodeAffine<T, kKB>;
    float c[2][4] = {{0.F, 0.F, 0.F, 0.F}, {0.F, 0.F, 0.F, 0.F}};  // qa . z_k, even / odd blocks
    float ca[2][4] = {{0.F, 0.F, 0.F, 0.F}, {0.F, 0.F, 0.F, 0.F}}; // q'' . alpha / beta
    int32_t const zCh = 8 * (g >> 2) + 2 * t;
#pragma unroll
    for (int32_t kb = 0; kb < kD / 16; ++kb)
    {
        int32_t const ch = 16 * kb + 2 * t;
        qK[kb][0] = MmaTraits<T>::mul2(qa[kb][0], stagedPair<S, T>(kScale, ch));
        qK[kb][1] = MmaTraits<T>::mul2(qa[kb][1], stagedPair<S, T>(kScale, ch + 8));
        mmaReg1688<T>(c[kb & 1], qa[kb][0], qa[kb][1], stagedPair<S, T>(kZero, 16 * kb + zCh));
        if constexpr (Aff::kALPHA != 0.F)
        {
            mmaReg1688<T>(ca[kb & 1], qK[kb][0], qK[kb][1], Aff::kINV_BETA2);
        }
    }
    constexpr float kBETA = 1.F / float(1 << Aff::kLOG2_INV_BETA);
    // rows g (low channel half) for columns 2t < 4, g + 8 (high half) otherwise (a select: registers stay registers)
    float const lo = __fsub_rn(__fadd_rn(c[0][0], c[1][0]), __fadd_rn(ca[0][0], ca[1][0]));
    float const hi = __fsub_rn(__fadd_rn(c[0][2], c[1][2]), __fadd_rn(ca[0][2], ca[1][2]));
    float v = t < 2 ? lo : hi;
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffU, v, 2));
    v = __fmul_rn(v, kBETA);
    biasS[0] = __shfl_sync(0xffffffffU, v, (2 * t) * 4);
    biasS[1] = __shfl_sync(0xffffffffU, v, (2 * t + 1) * 4);
}

//! Online softmax over kN 16-key tiles of scores (C fragments): rescale (o, vb, m) only when a score exceeds its
//! row's running maximum; the cross-lane maximum is computed only then (a warp vote first). Equal to
//! m' = max(m, max of the tiles), alpha = 2^(m - m').
template <int kD, int kN>
__device__ __forceinline__ void softmaxUpdate(float (&sc)[kN][4], MmaWarpState<kD>& st)
{
    bool grow = false;
#pragma unroll
    for (int32_t tau = 0; tau < kN; ++tau)
    {
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
            grow = grow || sc[tau][r] > st.m[r & 1];
        }
    }
    if (__any_sync(0xffffffffU, grow))
    {
        float mx[2] = {sc[0][0], sc[0][1]};
#pragma unroll
        for (int32_t tau = 0; tau < kN; ++tau)
        {
#pragma unroll
            for (int32_t r = 0; r < 4; ++r)
            {
                mx[r & 1] = fmaxf(mx[r & 1], sc[tau][r]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int32_t j = 0; j < 2; ++j)
        {
#pragma unroll
            for (int32_t o = 4; o < 32; o <<= 1)
            {
                mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffU, mx[j], o));
            }
            mx[j] = fmaxf(mx[j], st.m[j]);
            alpha[j] = mx[j] == st.m[j] ? 1.F : fastExp2(st.m[j] - mx[j]);
            st.m[j] = mx[j];
        }
#pragma unroll
        for (int32_t mt = 0; mt < kD / 16; ++mt)
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
}

//! P of one 16-key tile as the two B registers of P^T (keys 2t, 2t + 1 and 2t + 8, 2t + 9 of row g): 2^(s - m)
//! rounded to T, moved from the C fragment by two movmatrix.trans.
template <typename T, int kD>
__device__ __forceinline__ void probabilities(float const (&sc)[4], MmaWarpState<kD> const& st, uint32_t& b0,
    uint32_t& b1)
{
    float const m0 = st.m[0] == -INFINITY ? 0.F : st.m[0];
    float const m1 = st.m[1] == -INFINITY ? 0.F : st.m[1];
    b0 = movTransReg(MmaTraits<T>::pack(fastExp2(sc[0] - m0), fastExp2(sc[1] - m1)));
    b1 = movTransReg(MmaTraits<T>::pack(fastExp2(sc[2] - m0), fastExp2(sc[3] - m1)));
}

} // namespace kernels
} // namespace trtllm_kivi
