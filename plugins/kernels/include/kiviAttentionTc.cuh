/*
 * KIVI attention on tensor cores (WMMA 16x16x16, fp16/bf16 inputs, fp32 accumulation), header-only. EXPERIMENTAL:
 * selected with KiviStepParams::attentionImpl = kKIVI_ATTN_TENSOR_CORE; the default stays the SIMT kernel until a GPU
 * run has validated this one (tests/test_kernels_gpu.py runs both).
 *
 * Same decomposition as kiviAttentionKernel (kiviAttention.cuh): the same tiles of <= 16 query rows, the same splits
 * and combine, the same 32-key tiles and the same dequantized (activation-dtype) K/V values; only the products run on
 * tensor cores:
 *   S[16 x 32] = Q[16 x D] K^T           warps 0-1, one 16-key half each, fp32 accumulators stored to shared memory
 *   online softmax per row in fp32       8 threads per row; p is rounded to the activation dtype for the MMA and
 *                                        l sums the rounded p (so the output is a convex combination of v rows)
 *   O[16 x D] = alpha O + P[16 x 32] V   O lives in shared memory (WMMA accumulator layouts are opaque, and each
 *                                        row needs its own alpha); each warp owns D/64 16-column blocks
 * The only numerical difference to the SIMT kernel and the reference: p rounded to fp16/bf16 (relative 2^-11 / 2^-8)
 * and the tensor cores' fp32 accumulation order. trtllm_kivi/cuda/model.py (round_p=True) models it.
 */
#pragma once

#include "kiviAttention.cuh"

#include <mma.h>

namespace trtllm_kivi
{
namespace kernels
{

template <typename T, int kD>
__global__ void __launch_bounds__(kATTN_THREADS) kiviAttentionTcKernel(
    KiviStepParams p, KiviLaunchPlan plan, SeqInfo const* seqInfo, float* partialAcc, float* partialMl)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    namespace wmma = nvcuda::wmma;
    static_assert(kMAX_TILE_ROWS == 16 && kKEY_TILE == 32 && kATTN_THREADS == 128, "tile shape of this kernel");
    constexpr int32_t kLDH = kD + 8;          // 16-bit rows: ldm multiple of 8, 32-byte aligned fragment starts
    constexpr int32_t kLDS = kKEY_TILE + 4;   // fp32 score rows
    constexpr int32_t kLDP = kKEY_TILE + 8;   // 16-bit p rows
    constexpr int32_t kLDO = kD + 4;          // fp32 output rows
    constexpr int32_t kNT = kD / 16;          // 16-column blocks of O
    constexpr int32_t kNT_PER_WARP = kNT / kATTN_WARPS;
    static_assert(kNT % kATTN_WARPS == 0, "O column blocks per warp");
    __shared__ __align__(32) T qS[kMAX_TILE_ROWS][kLDH];
    __shared__ __align__(32) T kS[kKEY_TILE][kLDH];
    __shared__ __align__(32) T vS[kKEY_TILE][kLDH];
    __shared__ __align__(32) float sS[kMAX_TILE_ROWS][kLDS];
    __shared__ __align__(32) T pS[kMAX_TILE_ROWS][kLDP];
    __shared__ __align__(32) float oS[kMAX_TILE_ROWS][kLDO];
    __shared__ float alphaS[kMAX_TILE_ROWS];
    __shared__ float lS[kMAX_TILE_ROWS];
    __shared__ float mS[kMAX_TILE_ROWS];

    TileWork const wk = resolveTile<T, kD>(p, plan, seqInfo);
    if (!wk.run)
    {
        return;
    }
    int32_t const grp = plan.groupHeads;
    int32_t const warp = threadIdx.x / 32;
    float const softmaxScale = rsqrtf(float(kD));
    T const* q = static_cast<T const*>(p.q);
    for (int32_t u = threadIdx.x; u < kMAX_TILE_ROWS * kD; u += kATTN_THREADS) // KIVI_MODEL_LOOP(qload)
    {
        int32_t const row = u / kD;
        T x = ActTraits<T>::fromFloat(0.F);
        if (row < wk.rows)
        {
            int64_t const token = wk.info.tokenOffset + wk.i0 + row / grp;
            x = q[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD];
        }
        qS[row][u % kD] = x;
        oS[row][u % kD] = 0.F; // KIVI_MODEL_ANCHOR(qload)
    }

    // Softmax ownership: row = threadIdx.x / 8, keys (threadIdx.x % 8) * 4 .. + 3 of each tile; the 8 threads of a
    // row are consecutive lanes of one warp and all keep the row's running (m, l).
    int32_t const sRow = threadIdx.x / 8;
    int32_t const sCol = (threadIdx.x % 8) * 4;
    int64_t const sPos = wk.s + wk.i0 + sRow / grp; // causal: keys <= sPos
    bool const sLive = sRow < wk.rows;
    float mRow = -INFINITY;
    float lRow = 0.F;

    for (int64_t kt = wk.k0; kt < wk.k1; kt += kKEY_TILE) // KIVI_MODEL_LOOP(tile)
    {
        __syncthreads(); // previous tile consumed (qS/oS written on the first pass)
        loadKeyValueTile<T, kD>(p, wk.b, wk.h, wk.slot, wk.s, wk.nq, wk.info.tokenOffset, kt, wk.k1, kS, vS);
        __syncthreads();

        if (warp < 2) // S = Q K^T: warp w scores keys [16 w, 16 w + 16) of the tile
        {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sFrag;
            wmma::fill_fragment(sFrag, 0.F);
#pragma unroll
            for (int32_t kk = 0; kk < kD / 16; ++kk)
            {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> aFrag;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bFrag; // K^T = K row-major
                wmma::load_matrix_sync(aFrag, &qS[0][kk * 16], kLDH);
                wmma::load_matrix_sync(bFrag, &kS[warp * 16][kk * 16], kLDH);
                wmma::mma_sync(sFrag, aFrag, bFrag, sFrag);
            }
            wmma::store_matrix_sync(&sS[0][warp * 16], sFrag, kLDS, wmma::mem_row_major);
        }
        __syncthreads();

        // Online softmax (fp32), p rounded to T for the P V product; l sums the rounded p.
        float sc[4];
        float tileMax = -INFINITY;
#pragma unroll
        for (int32_t j = 0; j < 4; ++j)
        {
            int64_t const key = kt + sCol + j;
            bool const visible = sLive && key < wk.k1 && key <= sPos;
            sc[j] = visible ? sS[sRow][sCol + j] * softmaxScale : -INFINITY;
            tileMax = fmaxf(tileMax, sc[j]);
        }
#pragma unroll
        for (int32_t o = 1; o < 8; o <<= 1)
        {
            tileMax = fmaxf(tileMax, __shfl_xor_sync(0xffffffffU, tileMax, o));
        }
        float const mNew = fmaxf(mRow, tileMax);
        float const alpha = mNew == -INFINITY ? 1.F : expf(mRow - mNew);
        float sum = 0.F;
#pragma unroll
        for (int32_t j = 0; j < 4; ++j)
        {
            T const pr = ActTraits<T>::fromFloat(mNew == -INFINITY ? 0.F : expf(sc[j] - mNew));
            pS[sRow][sCol + j] = pr;
            sum += ActTraits<T>::toFloat(pr);
        }
#pragma unroll
        for (int32_t o = 1; o < 8; o <<= 1)
        {
            sum += __shfl_xor_sync(0xffffffffU, sum, o);
        }
        lRow = lRow * alpha + sum;
        mRow = mNew;
        if (threadIdx.x % 8 == 0)
        {
            alphaS[sRow] = alpha;
        }
        __syncthreads();

        // O = alpha O + P V: warp w owns the column blocks [w * kNT_PER_WARP, (w + 1) * kNT_PER_WARP).
        for (int32_t u = threadIdx.x; u < kMAX_TILE_ROWS * kD; u += kATTN_THREADS) // KIVI_MODEL_LOOP(rescale)
        {
            oS[u / kD][u % kD] *= alphaS[u / kD]; // KIVI_MODEL_ANCHOR(rescale)
        }
        __syncthreads();
#pragma unroll
        for (int32_t j = 0; j < kNT_PER_WARP; ++j)
        {
            int32_t const nt = warp * kNT_PER_WARP + j;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> oFrag;
            wmma::load_matrix_sync(oFrag, &oS[0][nt * 16], kLDO, wmma::mem_row_major);
#pragma unroll
            for (int32_t kk = 0; kk < kKEY_TILE / 16; ++kk)
            {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> aFrag;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bFrag;
                wmma::load_matrix_sync(aFrag, &pS[0][kk * 16], kLDP);
                wmma::load_matrix_sync(bFrag, &vS[kk * 16][nt * 16], kLDH);
                wmma::mma_sync(oFrag, aFrag, bFrag, oFrag);
            }
            wmma::store_matrix_sync(&oS[0][nt * 16], oFrag, kLDO, wmma::mem_row_major);
        }
    }
    if (threadIdx.x % 8 == 0)
    {
        lS[sRow] = lRow;
        mS[sRow] = mRow;
    }
    __syncthreads();

    T* out = static_cast<T*>(p.out);
    for (int32_t u = threadIdx.x; u < wk.rows * kD; u += kATTN_THREADS) // KIVI_MODEL_LOOP(out)
    {
        int32_t const row = u / kD;
        int32_t const d = u % kD;
        int64_t const token = wk.info.tokenOffset + wk.i0 + row / grp;
        int64_t const head = wk.h * grp + row % grp;
        if (plan.numSplits == 1)
        {
            float const l = lS[row];
            out[(token * p.numHeads + head) * kD + d] = ActTraits<T>::fromFloat(l > 0.F ? oS[row][d] / l : 0.F); // KIVI_MODEL_ANCHOR(out)
        }
        else
        {
            int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;
            partialAcc[idx * kD + d] = oS[row][d]; // KIVI_MODEL_ANCHOR(out)
            if (d == 0)
            {
                partialMl[idx * 2] = mS[row];
                partialMl[idx * 2 + 1] = lS[row];
            }
        }
    }
#endif
}

} // namespace kernels
} // namespace trtllm_kivi
