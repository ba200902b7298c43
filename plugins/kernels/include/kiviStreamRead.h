/*
 * The read-only streaming kernel: the memory roofline the attention kernels are judged against. The benchmarks
 * (benchmarks/bench_kernels.py) time it in the same run as the kernels, over buffers larger than the L2 and over
 * each shape's exact byte count, and report every kernel's read bandwidth as a fraction of it.
 *
 * It reads `bytes` bytes at `src` with 16-byte vector loads (kSTREAM_READ_UNROLL of them per thread in one unrolled
 * block; ptxas 13.0 keeps 4 or more in flight, i.e. >= 16 KB per CTA, >= 128 KB per SM at 8 CTAs), XOR-reduces them
 * per CTA and stores one 32-bit word per CTA: no other global memory traffic, so its bandwidth is what a read-only
 * kernel gets from this GPU. The grid is what the caller asks for (a persistent grid-stride loop: SMs x resident
 * CTAs per SM; the benchmark takes the best of a few).
 */
#pragma once

#include <cuda_runtime_api.h>

#include <stddef.h>
#include <stdint.h>

namespace trtllm_kivi
{
namespace kernels
{

constexpr int32_t kSTREAM_READ_THREADS = 256;
constexpr int32_t kSTREAM_READ_UNROLL = 8; //!< 16-byte loads per thread per unrolled block
constexpr int32_t kSTREAM_READ_MAX_CTAS = 1 << 20;

//! partial[c] = XOR over the 32-bit little-endian words CTA c read (a trailing partial word zero-padded), stored as
//! its bit pattern in a float slot; the XOR of all partials is the XOR of the whole buffer (the CPU test's oracle).
//! src: 16-byte aligned (may be null when bytes == 0); partial: numCtas floats; 1 <= numCtas <=
//! kSTREAM_READ_MAX_CTAS. Bad arguments: cudaErrorInvalidValue, message in kiviGetLastErrorMessage(); otherwise the
//! launch status. Never synchronizes; runs on `stream`.
cudaError_t invokeKiviStreamRead(
    void const* src, size_t bytes, float* partial, int32_t numCtas, cudaStream_t stream);

} // namespace kernels
} // namespace trtllm_kivi
