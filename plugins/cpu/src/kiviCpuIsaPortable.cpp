// Portable path: 8-lane arrays the compiler may vectorize for the baseline ISA; no -m flags.
#include "kiviCpuCommon.h"
#include "kiviCpuIsa.h"

namespace trtllm_kivi
{
namespace cpu
{
namespace portable
{

struct S
{
    static constexpr int W = 8;
    static constexpr bool kDOT8 = false; // no integer dot-product path (kiviCpuIsaAvx512.cpp, KIVI_AVX512_VNNI)
    static constexpr bool kDENORMAL2 = false; // no subnormal decode (kiviCpuDenormal2.h)
    struct F
    {
        float v[W];
    };

    static F zero() { return set1(0.0f); }
    static F set1(float x)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = x;
        return r;
    }
    static F load(const float* p)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = p[i];
        return r;
    }
    static void store(float* p, F x)
    {
        for (int i = 0; i < W; ++i)
            p[i] = x.v[i];
    }
    static F loadAct(const void* base, int64_t off, int32_t dtype)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = loadScalar(base, off + i, dtype);
        return r;
    }
    static F fma(F a, F b, F c)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = a.v[i] * b.v[i] + c.v[i];
        return r;
    }
    static F mul(F a, F b)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = a.v[i] * b.v[i];
        return r;
    }
    static F add(F a, F b)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = a.v[i] + b.v[i];
        return r;
    }
    static F sub(F a, F b)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = a.v[i] - b.v[i];
        return r;
    }
    static F max(F a, F b)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
        return r;
    }
    static float hsum(F x)
    {
        // pairwise, like the SIMD paths' halving reductions
        float a0 = x.v[0] + x.v[4], a1 = x.v[1] + x.v[5], a2 = x.v[2] + x.v[6], a3 = x.v[3] + x.v[7];
        return (a0 + a2) + (a1 + a3);
    }
    static float hmax(F x)
    {
        float m = x.v[0];
        for (int i = 1; i < W; ++i)
            m = x.v[i] > m ? x.v[i] : m;
        return m;
    }
    static void hsum4(F a, F b, F c, F d, float* out)
    {
        out[0] = hsum(a);
        out[1] = hsum(b);
        out[2] = hsum(c);
        out[3] = hsum(d);
    }
    static float scale(const void* base, int64_t i, int32_t dtype) { return loadScalar(base, i, dtype); }
    static F exp(F x);
    // dst[c * 8 + r] = src[r * srcStride + c] for r, c in [0, 8): an 8 x 8 transpose of words.
    static void transpose8(const int32_t* src, int srcStride, int32_t* dst)
    {
        for (int r = 0; r < 8; ++r)
            for (int c = 0; c < 8; ++c)
                dst[c * 8 + r] = src[r * srcStride + c];
    }
    // Lane i = p[i / ng] (ng = 1, 2, 4).
    static F spread(const float* p, int ng)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = p[i / ng];
        return r;
    }
    // FRAGMENT order (kiviCpuKernel.h): the 8 words of lanes gq = 0..7 of one (tq, j), from a transposed tile.
    struct WS
    {
        uint32_t w[8];
    };
    static WS loadWords(const int32_t* p)
    {
        WS r;
        for (int i = 0; i < 8; ++i)
            r.w[i] = uint32_t(p[i]);
        return r;
    }
    // Vector v of the 16 codes at `shift` (lanes 0..7 = words 0..7) and shift + BITS (the next 8): W = 8, v = par.
    template <int BITS>
    static F decodeFrag(const WS& ws, int shift, int v)
    {
        F r;
        for (int i = 0; i < W; ++i)
            r.v[i] = float((ws.w[i] >> (shift + BITS * v)) & ((1u << BITS) - 1));
        return r;
    }
    template <int BITS>
    static F decode(const int32_t* p, int stride, int part)
    {
        constexpr int CPW = 32 / BITS;
        F r;
        for (int i = 0; i < W; ++i)
        {
            const int idx = part * W + i;
            const uint32_t w = uint32_t(p[int64_t(idx / CPW) * stride]);
            r.v[i] = float((w >> ((idx % CPW) * BITS)) & ((1u << BITS) - 1));
        }
        return r;
    }
};

#include "kiviCpuKernel.h"

S::F S::exp(F x)
{
    F r;
    for (int i = 0; i < W; ++i)
        r.v[i] = kernel::expScalar(x.v[i]);
    return r;
}

} // namespace portable

const IsaKernels kPortableKernels = {portable::kernel::attendItem, portable::kernel::mergeItem};

} // namespace cpu
} // namespace trtllm_kivi
