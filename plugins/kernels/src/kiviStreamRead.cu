// The read-only streaming kernel (kiviStreamRead.h): the measured memory roofline of the benchmarks.
#include "kiviParams.h"
#include "kiviStreamRead.h"

#include <cstdio>

namespace trtllm_kivi
{
namespace kernels
{
namespace
{

__device__ __forceinline__ uint32_t xorWords(uint4 const& v)
{
    return v.x ^ v.y ^ v.z ^ v.w;
}

// Grid-stride over 16-byte vectors: a warp's load is 512 contiguous bytes; each thread has kSTREAM_READ_UNROLL
// independent loads per block (ptxas keeps >= 4 in flight: >= 16 KB per CTA, where Little's law asks ~24 KB per SM
// on an H200 at ~0.7 us of DRAM latency). The tail (< 16 bytes) is read bytewise by CTA 0.
__global__ void __launch_bounds__(kSTREAM_READ_THREADS) kiviStreamReadKernel(
    uint4 const* __restrict__ src, size_t numVec, int32_t tailBytes, float* __restrict__ partial)
{
    size_t const stride = size_t(gridDim.x) * kSTREAM_READ_THREADS;
    size_t i = size_t(blockIdx.x) * kSTREAM_READ_THREADS + threadIdx.x;
    uint32_t acc = 0;
    for (; i + (kSTREAM_READ_UNROLL - 1) * stride < numVec; i += kSTREAM_READ_UNROLL * stride)
    {
        uint4 v[kSTREAM_READ_UNROLL];
#pragma unroll
        for (int32_t u = 0; u < kSTREAM_READ_UNROLL; ++u)
        {
            v[u] = __ldg(src + i + u * stride);
        }
#pragma unroll
        for (int32_t u = 0; u < kSTREAM_READ_UNROLL; ++u)
        {
            acc ^= xorWords(v[u]);
        }
    }
    for (; i < numVec; i += stride)
    {
        acc ^= xorWords(__ldg(src + i));
    }
    if (blockIdx.x == 0 && static_cast<int32_t>(threadIdx.x) < tailBytes)
    {
        // Byte j of the tail sits at offset 16 * numVec + j: byte lane j % 4 of its 32-bit word.
        uint8_t const* tail = reinterpret_cast<uint8_t const*>(src + numVec);
        acc ^= uint32_t(tail[threadIdx.x]) << (8 * (threadIdx.x & 3));
    }
#pragma unroll
    for (int32_t o = 16; o > 0; o >>= 1)
    {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    }
    __shared__ uint32_t warpAcc[kSTREAM_READ_THREADS / 32];
    if ((threadIdx.x & 31) == 0)
    {
        warpAcc[threadIdx.x >> 5] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0)
    {
        uint32_t r = 0;
#pragma unroll
        for (int32_t w = 0; w < kSTREAM_READ_THREADS / 32; ++w)
        {
            r ^= warpAcc[w];
        }
        partial[blockIdx.x] = __uint_as_float(r);
    }
}

} // namespace

cudaError_t invokeKiviStreamRead(
    void const* src, size_t bytes, float* partial, int32_t numCtas, cudaStream_t stream)
{
    char msg[256];
    msg[0] = '\0';
    if (numCtas < 1 || numCtas > kSTREAM_READ_MAX_CTAS)
    {
        std::snprintf(msg, sizeof(msg), "stream read: numCtas=%d is out of range [1, %d]", numCtas,
            kSTREAM_READ_MAX_CTAS);
    }
    else if (partial == nullptr)
    {
        std::snprintf(msg, sizeof(msg), "stream read: partial is null; it must hold numCtas=%d floats", numCtas);
    }
    else if (bytes > 0 && src == nullptr)
    {
        std::snprintf(msg, sizeof(msg), "stream read: src is null but bytes=%zu", bytes);
    }
    else if (reinterpret_cast<uintptr_t>(src) % 16 != 0)
    {
        std::snprintf(msg, sizeof(msg), "stream read: src=%p is not 16-byte aligned (16-byte vector loads)", src);
    }
    if (msg[0] != '\0')
    {
        kiviSetLastErrorMessage(msg);
        return cudaErrorInvalidValue;
    }
    kiviStreamReadKernel<<<numCtas, kSTREAM_READ_THREADS, 0, stream>>>(
        static_cast<uint4 const*>(src), bytes / 16, static_cast<int32_t>(bytes % 16), partial);
    return cudaGetLastError();
}

} // namespace kernels
} // namespace trtllm_kivi
