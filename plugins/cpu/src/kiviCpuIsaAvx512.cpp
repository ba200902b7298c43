// AVX-512 (F + BW + VL + DQ) path (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only
// called when the CPU reports avx512f/bw/vl/dq).
#include "kiviCpuCommon.h"
#include "kiviCpuIsa.h"
#include "kiviCpuTranspose.h"
#include <immintrin.h>

namespace trtllm_kivi
{
namespace cpu
{
namespace avx512
{

alignas(64) static const int32_t kShift2[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
alignas(64) static const int32_t kShift4[16] = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
alignas(64) static const int32_t kShift8[16] = {0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
alignas(64) static const int32_t kPerm8[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

struct S
{
    static constexpr int W = 16;
    using F = __m512;

    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float x) { return _mm512_set1_ps(x); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
    __attribute__((always_inline)) static inline F loadAct(const void* base, int64_t off, int32_t dtype)
    {
        if (dtype == kiviCpuFloat32)
            return _mm512_loadu_ps(static_cast<const float*>(base) + off);
        const __m256i h
            = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off));
        if (dtype == kiviCpuFloat16)
            return _mm512_cvtph_ps(h);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static float hsum(F x)
    {
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        return _mm_cvtss_f32(s);
    }
    static float hmax(F x)
    {
        __m256 h = _mm256_max_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
        return _mm_cvtss_f32(s);
    }
    static __m256 half(F x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); }
    static void hsum4(F a, F b, F c, F d, float* out)
    {
        const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
    }
    static float scale(const void* base, int64_t i, int32_t dtype)
    {
        if (dtype == kiviCpuFloat16)
            return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
        return loadScalar(base, i, dtype);
    }
    // The scalar formula of kernel::expScalar, lane-wise (NaN: as in the AVX2 path).
    static F exp(F x)
    {
        const __m512 lo = _mm512_set1_ps(kEXP_LO), shifter = _mm512_set1_ps(kEXP_SHIFTER);
        const __m512 xc = _mm512_min_ps(_mm512_set1_ps(kEXP_HI), _mm512_max_ps(lo, x));
        const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), shifter);
        const __m512 fx = _mm512_sub_ps(t, shifter);
        __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
        r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 y = _mm512_set1_ps(1.9875691500E-4f);
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
        y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127)), 23);
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
    }
    // dst[c * 8 + r] = src[r * srcStride + c] for r, c in [0, 8) (kiviCpuTranspose.h).
    __attribute__((always_inline)) static inline void transpose8(const int32_t* src, int srcStride, int32_t* dst)
    {
        transposeWords8x8(src, srcStride, dst);
    }
    // Lane i = p[i / ng] (ng = 1, 2, 4).
    static F spread(const float* p, int ng)
    {
        if (ng == 1)
            return _mm512_loadu_ps(p);
        const __m512i idx = ng == 2 ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                    : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_loadu_ps(p)));
    }
    // FRAGMENT order (kiviCpuKernel.h): the 8 words of lanes gq = 0..7 of one (tq, j), from a transposed tile, in both
    // 256-bit halves.
    using WS = __m512i;
    static WS loadWords(const int32_t* p)
    {
        return _mm512_broadcast_i32x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    // The 16 codes: lanes 0..7 at bit `shift` of the 8 words (par 0), lanes 8..15 at shift + BITS (par 1); v = 0.
    template <int BITS>
    static F decodeFrag(WS ws, int shift, int /*v*/)
    {
        const __m512i sh = _mm512_add_epi32(_mm512_set1_epi32(shift),
            _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(BITS), 1));
        const __m512i c = _mm512_srlv_epi32(ws, sh);
        return _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32((1 << BITS) - 1)));
    }
    template <int BITS>
    static F decode(const int32_t* p, int stride, int part)
    {
        __m512i w, sh;
        if (BITS == 2)
        {
            w = _mm512_set1_epi32(p[int64_t(part) * stride]);
            sh = _mm512_load_si512(kShift2);
        }
        else if (BITS == 4)
        {
            w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(p[int64_t(2 * part) * stride])),
                _mm256_set1_epi32(p[int64_t(2 * part + 1) * stride]), 1);
            sh = _mm512_load_si512(kShift4);
        }
        else
        {
            const int32_t* q = p + int64_t(4 * part) * stride;
            const __m128i w4 = _mm_setr_epi32(q[0], q[stride], q[2 * int64_t(stride)], q[3 * int64_t(stride)]);
            w = _mm512_permutexvar_epi32(_mm512_load_si512(kPerm8), _mm512_castsi128_si512(w4));
            sh = _mm512_load_si512(kShift8);
        }
        const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32((1 << BITS) - 1));
        return _mm512_cvtepi32_ps(c);
    }
};

#include "kiviCpuKernel.h"

} // namespace avx512

const IsaKernels kAvx512Kernels = {avx512::kernel::attendItem, avx512::kernel::mergeItem};

} // namespace cpu
} // namespace trtllm_kivi
