// The 8 x 8 word transpose of the AVX2 path (AVX instructions only; the AVX-512 path has its own, S::transpose8).
// `static` keeps one copy per translation unit, compiled with that unit's flags.
#pragma once
#include <cstdint>
#include <immintrin.h>

namespace trtllm_kivi
{
namespace cpu
{

// dst[c * 8 + r] = src[r * srcStride + c] for r, c in [0, 8): an 8 x 8 transpose of words (24 shuffles).
__attribute__((always_inline)) static inline void transposeWords8x8(const int32_t* src, int srcStride, int32_t* dst)
{
    const float* f = reinterpret_cast<const float*>(src);
    const __m256 r0 = _mm256_loadu_ps(f), r1 = _mm256_loadu_ps(f + srcStride);
    const __m256 r2 = _mm256_loadu_ps(f + 2 * srcStride), r3 = _mm256_loadu_ps(f + 3 * srcStride);
    const __m256 r4 = _mm256_loadu_ps(f + 4 * srcStride), r5 = _mm256_loadu_ps(f + 5 * srcStride);
    const __m256 r6 = _mm256_loadu_ps(f + 6 * srcStride), r7 = _mm256_loadu_ps(f + 7 * srcStride);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1); // cols 0 1 | 4 5, 2 3 | 6 7
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE); // col 0 | 4, 1 | 5
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE); // col 2 | 6, 3 | 7
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    float* o = reinterpret_cast<float*>(dst);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(o + 32, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(o + 40, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(o + 48, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(o + 56, _mm256_permute2f128_ps(u3, u7, 0x31));
}
} // namespace cpu
} // namespace trtllm_kivi
