// AVX2 + FMA + F16C path (compiled with -mavx2 -mfma -mf16c; only called when the CPU reports them).
// kiviCpuIsaAvx2Denormal.cpp compiles this file again with KIVI_AVX2_DENORMAL: 2-bit keys and values then take the
// one-AND decode of kiviCpuDenormal2.h (S::kDENORMAL2).
#include "kiviCpuCommon.h"
#include "kiviCpuIsa.h"
#include "kiviCpuTranspose.h"
#include <immintrin.h>

#ifdef KIVI_AVX2_DENORMAL
#define KIVI_AVX2_NS avx2denormal
#else
#define KIVI_AVX2_NS avx2
#endif

namespace trtllm_kivi
{
namespace cpu
{
namespace KIVI_AVX2_NS
{
#ifdef KIVI_AVX2_DENORMAL
#include "kiviCpuDenormal2.h"
#endif

alignas(32) static const int32_t kShift2[2][8] = {{0, 2, 4, 6, 8, 10, 12, 14}, {16, 18, 20, 22, 24, 26, 28, 30}};
alignas(32) static const int32_t kShift4[8] = {0, 4, 8, 12, 16, 20, 24, 28};
alignas(32) static const int32_t kShift8[8] = {0, 8, 16, 24, 0, 8, 16, 24};

// 2-bit codes: byte b -> its 4 codes as floats (one 16-byte load per 4 codes instead of shift/mask/convert).
struct Lut2
{
    alignas(64) float v[256][4];
    Lut2()
    {
        for (int b = 0; b < 256; ++b)
            for (int i = 0; i < 4; ++i)
                v[b][i] = float((b >> (2 * i)) & 3);
    }
};
static const Lut2 kLut2;

struct S
{
    static constexpr int W = 8;
    static constexpr bool kDOT8 = false; // no integer dot-product path (kiviCpuIsaAvx512.cpp, KIVI_AVX512_VNNI)
#ifdef KIVI_AVX2_DENORMAL
    static constexpr bool kDENORMAL2 = true; // kiviCpuDenormal2.h
    // MXCSR with DAZ cleared (subnormal codes must not read as 0); returns the caller's, for restoreCsr
    static uint32_t clearDaz()
    {
        const uint32_t csr = _mm_getcsr();
        if (csr & 0x40u)
            _mm_setcsr(csr & ~0x40u);
        return csr;
    }
    static void restoreCsr(uint32_t csr)
    {
        if (csr & 0x40u)
            _mm_setcsr(csr);
    }
    template <int D, int NR>
    static void keyTileDn(const int32_t* tw, const float* qs, const float* cz, float* scores, int64_t stride)
    {
        dnKeyTile<D, NR>(tw, qs, cz, scores, stride);
    }
    template <int D, int NR>
    static void valueBlockDn(const int32_t* tw, int nt, int k, const float* coef, int ng, int64_t cs, float* acc)
    {
        if (ng == 1)
            dnValueBlock<D, 1, NR>(tw, nt, k, coef, cs, acc);
        else if (ng == 2)
            dnValueBlock<D, 2, NR>(tw, nt, k, coef, cs, acc);
        else
            dnValueBlock<D, 4, NR>(tw, nt, k, coef, cs, acc);
    }
    static float keyScaleFactor(int n) { return dnKeyScaleFactor(n); }
    static float valueTokenFactor(int t) { return dnValueTokenFactor(t); }
#else
    static constexpr bool kDENORMAL2 = false;
#endif
    using F = __m256;

    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float x) { return _mm256_set1_ps(x); }
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
    __attribute__((always_inline)) static inline F loadAct(const void* base, int64_t off, int32_t dtype)
    {
        if (dtype == kiviCpuFloat32)
            return _mm256_loadu_ps(static_cast<const float*>(base) + off);
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + off));
        if (dtype == kiviCpuFloat16)
            return _mm256_cvtph_ps(h);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static float hsum(F x)
    {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        return _mm_cvtss_f32(s);
    }
    static float hmax(F x)
    {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
        return _mm_cvtss_f32(s);
    }
    static void hsum4(F a, F b, F c, F d, float* out)
    {
        const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
    }
    static float scale(const void* base, int64_t i, int32_t dtype)
    {
        if (dtype == kiviCpuFloat16)
            return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
        return loadScalar(base, i, dtype);
    }
    // exp for softmax arguments (x <= 0): n = round(x log2 e) as kernel::expScalar, but f = x log2 e - n (two-part
    // log2 e, 1.7e-7 relative error) and 2^f by Cephes' exp2f polynomial in Estrin's scheme: a dependency chain half
    // as long as expScalar's Horner form (1.4 instead of 2.0 cycles per score on Zen 3: the chains, not the FMA count,
    // bound softmaxRows). Exact 0 below kEXP_LO (so masked -inf gives 0); NaN propagates (the final mask's unordered
    // compare is true and the product keeps the NaN).
    static F exp(F x)
    {
        const __m256 shifter = _mm256_set1_ps(kEXP_SHIFTER);
        const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shifter);
        const __m256 n = _mm256_sub_ps(t, shifter);
        const __m256 f = _mm256_fmadd_ps(x, _mm256_set1_ps(1.925963033e-8f),
            _mm256_fmsub_ps(x, _mm256_set1_ps(1.44269502162933349609375f), n));
        const __m256 f2 = _mm256_mul_ps(f, f), f4 = _mm256_mul_ps(f2, f2);
        const __m256 e0 = _mm256_fmadd_ps(_mm256_set1_ps(6.931472028550421E-1f), f, _mm256_set1_ps(1.0f));
        const __m256 e1 = _mm256_fmadd_ps(_mm256_set1_ps(5.550332471162809E-2f), f, _mm256_set1_ps(2.402264791363012E-1f));
        __m256 e2 = _mm256_fmadd_ps(_mm256_set1_ps(1.339887440266574E-3f), f, _mm256_set1_ps(9.618437357674640E-3f));
        e2 = _mm256_fmadd_ps(_mm256_set1_ps(1.535336188319500E-4f), f2, e2);
        const __m256 p = _mm256_fmadd_ps(f4, e2, _mm256_fmadd_ps(f2, e1, e0));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23);
        return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_cmp_ps(x, _mm256_set1_ps(kEXP_LO), _CMP_NLT_UQ));
    }
    // dst[c * 8 + r] = src[r * srcStride + c] for r, c in [0, 8) (kiviCpuTranspose.h).
    __attribute__((always_inline)) static inline void transpose8(const int32_t* src, int srcStride, int32_t* dst)
    {
        transposeWords8x8(src, srcStride, dst);
    }
    // Lane i = p[i / ng] (ng = 1, 2, 4): one permute instead of a gather (vgatherdps is slow on Zen).
    static F spread(const float* p, int ng)
    {
        if (ng == 1)
            return _mm256_loadu_ps(p);
        const __m256i idx = ng == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), idx);
    }
    // FRAGMENT order (kiviCpuKernel.h): the 8 words of lanes gq = 0..7 of one (tq, j), from a transposed tile.
    using WS = __m256i;
    static WS loadWords(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    // Vector v (par) of the codes at bit `shift + BITS v` of the 8 words, as floats.
    template <int BITS>
    static F decodeFrag(WS ws, int shift, int v)
    {
        const int sh = shift + BITS * v;
        const __m256i c = _mm256_srli_epi32(ws, sh);
        if (sh == 32 - BITS) // the top code needs no mask
            return _mm256_cvtepi32_ps(c);
        return _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32((1 << BITS) - 1)));
    }
    // Lane i = code (part * 8 + i) of the sequence whose word j is p[j * stride] (32 / BITS codes per word).
    template <int BITS>
    static F decode(const int32_t* p, int stride, int part)
    {
        __m256i w, sh;
        if (BITS == 2)
        {
            const uint8_t* b = reinterpret_cast<const uint8_t*>(p + int64_t(part >> 1) * stride) + (part & 1) * 2;
            return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(kLut2.v[b[0]])), _mm_load_ps(kLut2.v[b[1]]), 1);
        }
        if (BITS == 4)
        {
            w = _mm256_set1_epi32(p[int64_t(part) * stride]);
            sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(kShift4));
        }
        else
        {
            w = _mm256_set_m128i(_mm_set1_epi32(p[int64_t(2 * part + 1) * stride]),
                _mm_set1_epi32(p[int64_t(2 * part) * stride]));
            sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(kShift8));
        }
        const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32((1 << BITS) - 1));
        return _mm256_cvtepi32_ps(c);
    }
};

#include "kiviCpuKernel.h"

} // namespace KIVI_AVX2_NS

#ifdef KIVI_AVX2_DENORMAL
const IsaKernels kAvx2DenormalKernels = {avx2denormal::kernel::attendItem, avx2denormal::kernel::mergeItem};
#else
const IsaKernels kAvx2Kernels = {avx2::kernel::attendItem, avx2::kernel::mergeItem};
#endif

} // namespace cpu
} // namespace trtllm_kivi
