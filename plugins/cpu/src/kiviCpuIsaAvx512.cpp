// AVX-512 (F + BW + VL + DQ) path (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only
// called when the CPU reports avx512f/bw/vl/dq). kiviCpuIsaAvx512Vnni.cpp compiles this file again with
// KIVI_AVX512_VNNI (and -mavx512vnni -mavx512vbmi): the 2-bit quantized keys and values then take the integer dot
// products below (S::kDOT8) instead of decode + fp32 FMA.
#include "kiviCpuCommon.h"
#include "kiviCpuIsa.h"
#include <array>
#include <cfloat>
#include <immintrin.h>

#ifdef KIVI_AVX512_VNNI
#define KIVI_AVX512_NS avx512vnni
#else
#define KIVI_AVX512_NS avx512
#endif

namespace trtllm_kivi
{
namespace cpu
{
namespace KIVI_AVX512_NS
{

alignas(64) static const int32_t kShift2[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
alignas(64) static const int32_t kShift4[16] = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
alignas(64) static const int32_t kShift8[16] = {0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
alignas(64) static const int32_t kPerm8[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
// transpose8: lane l = 8 e + r reads lane 8 (r % 2) + e of z[r % 4 / 2] (+ 2 o for output o)
alignas(64) static const int32_t kT8[16] = {0, 8, 16, 24, 0, 8, 16, 24, 1, 9, 17, 25, 1, 9, 17, 25};

#ifdef KIVI_AVX512_VNNI
// Constants of the integer dot-product routines of S (kDOT8).
// vpmultishiftqb selectors (output byte B of 32-bit lane L = B / 4 takes 8 bits from bit sel of L's qword;
// lanes 8..15 read the same 8 words as lanes 0..7, broadcast, at par = 1). Keys, half h: byte b of lane L (token
// L) = channel 8 (4 j + b) + 2 tq + h, at bit 16 h + 4 b + 2 par of its word.
constexpr std::array<uint8_t, 64> keySel(int h)
{
    std::array<uint8_t, 64> a{};
    for (int B = 0; B < 64; ++B)
        a[B] = uint8_t(32 * (B / 4 % 2) + 16 * h + 4 * (B % 4) + 2 * (B / 32));
    return a;
}
// Values, quarter q2: byte b of lane L (channel 32 j + 16 q2 + L) = token 8 (b >> 1) + 2 tq + (b & 1), at bit
// 16 (b & 1) + 8 q2 + 4 (b >> 1) + 2 par.
constexpr std::array<uint8_t, 64> valueSel(int q2)
{
    std::array<uint8_t, 64> a{};
    for (int B = 0; B < 64; ++B)
        a[B] = uint8_t(32 * (B / 4 % 2) + 16 * (B % 2) + 8 * q2 + 4 * (B % 4 / 2) + 2 * (B / 32));
    return a;
}
constexpr std::array<uint8_t, 64> kKEY_SEL[2] = {keySel(0), keySel(1)};
constexpr std::array<uint8_t, 64> kVALUE_SEL[2] = {valueSel(0), valueSel(1)};

// Byte gather of the key digits, per 32-channel block j (one vpermt2b over its two digit vectors, 128 bytes):
// row layout dig[24 j + 8 k + 2 tq + h] (dwords), byte b = digit k of channel 32 j + 8 b + 2 tq + h (source byte
// 4 (8 b + 2 tq + h) + k). Table 0 makes digits 0 and 1 (64 bytes), table 1 digit 2 (its low 32 bytes).
static_assert(kDOT8_DIGITS == 3, "the key digit layout (24 dwords per 32-channel block) assumes 3 digits");
constexpr std::array<uint8_t, 64> keyGather(int t)
{
    std::array<uint8_t, 64> a{};
    for (int p = 0; p < 64; ++p)
    {
        const int k = t == 0 ? p / 32 : 2, q = p % 32, d = q / 4, b = q % 4;
        a[p] = uint8_t(4 * (8 * b + 2 * (d / 2) + d % 2) + k);
    }
    return a;
}
constexpr std::array<uint8_t, 64> kKEY_GATHER[2] = {keyGather(0), keyGather(1)};

// Byte gather of the value digits (ng = 1, 2, 4 groups; gi): output byte 16 k + 4 tq + b = digit k of token
// tok = 8 (b >> 1) + 2 tq + (b & 1) of group gi, i.e. byte k of digit word e = tok ng + gi: source byte
// 4 e + k of the tile's ng digit vectors (bytes 48..63 are padding); bit 7 picks vectors 2, 3 (ng = 4).
struct ValueGather
{
    std::array<uint8_t, 64> idx[7]; // [ng - 1 + gi]: ng 1 -> 0, ng 2 -> 1, 2, ng 4 -> 3..6
    uint64_t hi[7];
};
constexpr ValueGather valueGather()
{
    ValueGather g{};
    for (int ng = 1; ng <= 4; ng *= 2)
        for (int gi = 0; gi < ng; ++gi)
            for (int B = 0; B < 48; ++B)
            {
                const int k = B / 16, tq = B % 16 / 4, b = B % 4;
                const int src = 4 * ((8 * (b >> 1) + 2 * tq + (b & 1)) * ng + gi) + k;
                g.idx[ng - 1 + gi][B] = uint8_t(src & 127);
                g.hi[ng - 1 + gi] |= uint64_t(src >= 128) << B;
            }
    return g;
}
constexpr ValueGather kVALUE_GATHER = valueGather();

#endif

struct S
{
    static constexpr int W = 16;
    using F = __m512;
#ifdef KIVI_AVX512_VNNI
    static constexpr bool kDOT8 = true;
#else
    static constexpr bool kDOT8 = false;
#endif
    static constexpr bool kDENORMAL2 = false; // no subnormal decode (kiviCpuDenormal2.h, the avx2denormal path)

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
    // exp for softmax arguments (x <= 0; NaN propagates, below kEXP_LO exact 0) as 2^t, t = x log2 e: n = round(t)
    // (vrndscaleps), f = t - n (exact) in [-1/2, 1/2], 2^f by a degree-5 polynomial (relative-error minimax fit on
    // the interval: 7.5e-8 exact, 2.4e-7 evaluated in fp32), times 2^n by vscalefps: 10 vector operations, where
    // expScalar's formula lane-wise took 19 (softmax was ~9% of the op's time on an Intel Xeon). t's rounding
    // (relative 2^-24) moves the result by at most |x| 2^-24 ln 2 relative, below 2^-24 where exp(x) > 2^-24.
    static F exp(F x)
    {
        const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
        const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_sub_ps(t, n); // -inf - -inf = NaN: masked below
        __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(0.0013276461977511644f), f, _mm512_set1_ps(0.009675540961325169f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05550713464617729f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24022120237350464f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931469440460205f));
        y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192092896f));
        // x >= kEXP_LO or NaN: 2^n y (n >= -126: a normal number); below: 0, as expScalar
        return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kEXP_LO), _CMP_NLT_UQ), y, n);
    }
    // dst[c * 8 + r] = src[r * srcStride + c] for r, c in [0, 8): rows 2 i, 2 i + 1 in z[i] (source (r, c) at lane
    // 8 (r % 2) + c of z[r / 2]); output columns 2 o, 2 o + 1 from two 2-source permutes (rows 0..3, 4..7) and a
    // blend: 8 permutes + 4 inserts, half the shuffles of the 256-bit transpose (kiviCpuTranspose.h).
    __attribute__((always_inline)) static inline void transpose8(const int32_t* src, int srcStride, int32_t* dst)
    {
        __m512i z[4];
        for (int i = 0; i < 4; ++i)
            z[i] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i * srcStride))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * i + 1) * srcStride)), 1);
        for (int o = 0; o < 4; ++o)
        {
            // lane l = 8 e + r of output o: column 2 o + e, row r (r % 4 selects z[2 (r >= 4) + r % 4 / 2])
            const __m512i idx = _mm512_add_epi32(_mm512_load_si512(kT8), _mm512_set1_epi32(2 * o));
            const __m512i lo = _mm512_permutex2var_epi32(z[0], idx, z[1]);
            const __m512i hi = _mm512_permutex2var_epi32(z[2], idx, z[3]);
            _mm512_storeu_si512(dst + 16 * o, _mm512_mask_blend_epi32(0xF0F0, lo, hi));
        }
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

#ifdef KIVI_AVX512_VNNI
    // ---- 2-bit codes as integer dot products: vpdpbusd does 64 u8 x s8 products per instruction against fp32 FMA's
    // 16, and 2-bit codes need no conversion to float. The codes are the u8 operand (one vpmultishiftqb + AND per 64);
    // the other side, q * key scale (keys) or p * value scale (values), is fixed point in three signed base-256 digits
    // broadcast from memory: x in [-F, F] -> n = round(x 2^22 / F) = d0 + 256 d1 + 65536 d2, the digits being the
    // bytes of ((n + 0x808080) ^ 0x808080) (byte - 128 in two's complement). Step F 2^-22 against fp32's relative
    // 2^-23 per term: for sums of D or 512 terms the rounding error is no larger than an fp32 FMA chain's.

    static constexpr float kFIX = 4194304.0f; // 2^22: |n| <= 2^22 keeps n + 0x808080 in [0, 2^24)

    // n + 0x808080 in one rounding: fma(x, inv, 0x808080) is exact to the integer (|x inv| <= 2^22, the sum in
    // [0, 2^24)) and rounds half to even like vcvtps2dq (0x808080 is even)
    static __m512i fixDigits(__m512 x, __m512 inv)
    {
        return _mm512_xor_si512(_mm512_cvtps_epi32(_mm512_fmadd_ps(x, inv, _mm512_set1_ps(float(0x808080)))),
            _mm512_set1_epi32(0x808080));
    }

    // acc += codes . broadcast(*d) (vpdpbusd with an embedded {1to16} broadcast): g++ 12 neither folds
    // _mm512_set1_epi32(*d) into the instruction nor keeps loop-carried accumulators in place (it copies every one
    // of them each iteration), which doubles the front end's work in keyTileDot8 (Zen 4 A/B: Llama-3-8B geometry
    // 0.97x the op's time with this asm). The accumulator must go in and out by value, as an intrinsic's: with a
    // reference operand g++ 12 keeps the accumulator array in memory wherever the loop is not inlined into
    // scoresPerChannel (cpu_inner_loops_vnni.cpp's keyTileDot8, D 128, 4 rows: 603 cycles per tile against 427).
    static __m512i dpbusdBcast(__m512i acc, __m512i codes, const int32_t* d)
    {
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*d));
        return acc;
    }

    static __m512i codes2(__m512i ws, const std::array<uint8_t, 64>& sel)
    {
        return _mm512_and_si512(
            _mm512_multishift_epi64_epi8(_mm512_loadu_si512(sel.data()), ws), _mm512_set1_epi8(3));
    }

    // Lane 4 i of the result: op-reduction of x[i] (i < 4), from 6 shuffles and 4 ops for all four.
    template <class Op>
    static __m128 reduce4(const __m512* x, Op op)
    {
        const __m512 s01 = op(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
        const __m512 s23 = op(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
        const __m512 t = op(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
        const __m512 u = op(t, _mm512_permute_ps(t, 0xB1));                                  // pairs
        const __m512 v = op(u, _mm512_permute_ps(u, 0x4E));                                  // quads
        return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0), v));
    }

    // Scale maxima by bit patterns: a non-negative IEEE float orders as its bits read unsigned, and every infinite or
    // NaN magnitude has bits >= +inf's, so one unsigned max per 32 fp16 / bf16 (16 fp32) scales finds the maximum
    // and whether all are finite, with no conversion (converting and comparing each vector took ~5x the operations).
    // B: the scales' bits (16: fp16 / bf16, 32: fp32); infBits: +inf's bits in that width.
    static uint32_t infBits(int32_t dtype)
    {
        return dtype == kiviCpuFloat32 ? 0x7F800000u : dtype == kiviCpuFloat16 ? 0x7C00u : 0x7F80u;
    }
    // unsigned max of B-bit lanes, 512- or 128-bit vectors
    template <int B, class V>
    static V umax(V a, V b)
    {
        if constexpr (sizeof(V) == 64)
            return B == 16 ? _mm512_max_epu16(a, b) : _mm512_max_epu32(a, b);
        else
            return B == 16 ? _mm_max_epu16(a, b) : _mm_max_epu32(a, b);
    }

    // |key scale| maxima of ng consecutive key groups (D scales each from entry off): smax[d] = max |scale_d|; false
    // if a scale is not finite.
    template <int D, int B>
    static bool keyScaleMaxBits(const void* base, int64_t off, int ng, int32_t dtype, float* smax)
    {
        constexpr int L = 512 / B; // scales per vector
        const __m512i magnitude = B == 16 ? _mm512_set1_epi16(0x7FFF) : _mm512_set1_epi32(0x7FFFFFFF);
        const char* p = static_cast<const char*>(base) + off * (B / 8);
        __m512i m[D / L];
        for (int n = 0; n < D / L; ++n)
            m[n] = _mm512_setzero_si512();
        for (int gi = 0; gi < ng; ++gi)
            for (int n = 0; n < D / L; ++n)
                m[n] = umax<B>(m[n], _mm512_and_si512(_mm512_loadu_si512(p + (int64_t(gi) * D + L * n) * (B / 8)),
                    magnitude));
        __m512i all = m[0];
        for (int n = 0; n < D / L; ++n)
        {
            all = umax<B>(all, m[n]);
            if constexpr (B == 32)
                _mm512_storeu_si512(smax + 16 * n, m[n]);
            else
                for (int h = 0; h < 2; ++h)
                {
                    const __m256i x = h == 0 ? _mm512_castsi512_si256(m[n]) : _mm512_extracti64x4_epi64(m[n], 1);
                    _mm512_storeu_ps(smax + 32 * n + 16 * h, dtype == kiviCpuFloat16 ? _mm512_cvtph_ps(x)
                        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
                }
        }
        if constexpr (B == 32)
            return _mm512_cmpge_epu32_mask(all, _mm512_set1_epi32(int32_t(infBits(dtype)))) == 0;
        return _mm512_cmpge_epu16_mask(all, _mm512_set1_epi16(int16_t(infBits(dtype)))) == 0;
    }

    template <int D>
    static bool keyScaleMax(const void* base, int64_t off, int ng, int32_t dtype, float* smax)
    {
        return dtype == kiviCpuFloat32 ? keyScaleMaxBits<D, 32>(base, off, ng, dtype, smax)
                                       : keyScaleMaxBits<D, 16>(base, off, ng, dtype, smax);
    }

    // The key digits' fixed-point scale of NR <= 4 rows for the key groups of one block (qf: the rows' q / sqrt(D),
    // stride D; smax: keyScaleMax over the block's groups, finite): F_i = max_d |qf_id| smax_d bounds |qf * scale| in
    // each of them, so one inverse serves them all (an F per group would cost a max pass and a division per 32
    // tokens). A group whose products are far below the block's largest gets the block's step, F 2^-22: the score
    // error bound stays D 1.5 F 2^-22, absolute (test_key_outlier_groups). qi = qf 2^22 / F_i, rec[i] = F_i 2^-22.
    // False (the fp32 path) when a q is not finite, a product overflows, an F is too small to invert, or a q * 2^22 / F
    // overflows (a channel whose scales are all 0 bounds nothing). qmax (Attn::loadQ: max_d |qf_id|, NaN if a q is not
    // finite) makes these per-row scalar checks (not a compare per vector): with q and smax finite no product
    // is NaN, so an overflow shows in F, and |qf_d| / F <= qmax / F.
    template <int D, int NR>
    static bool keyBlockScale(const float* qf, const float* smax, const float* qmax, float* qi, float* rec)
    {
        constexpr int NV = D / 16;
        for (int i = 0; i < NR; ++i)
            if (!(qmax[i] <= FLT_MAX))
                return false;
        __m512 mx[4];
        for (int i = 0; i < 4; ++i)
            mx[i] = _mm512_setzero_ps();
        for (int i = 0; i < NR; ++i)
            for (int n = 0; n < NV; ++n)
                mx[i] = _mm512_max_ps(mx[i],
                    _mm512_mul_ps(_mm512_abs_ps(_mm512_loadu_ps(qf + i * D + 16 * n)), _mm512_loadu_ps(smax + 16 * n)));
        alignas(16) float f[4];
        _mm_store_ps(f, reduce4(mx, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }));
        for (int i = 0; i < NR; ++i)
        {
            const float inv = f[i] == 0.0f ? 0.0f : kFIX / f[i];
            if (!(f[i] <= FLT_MAX) || (f[i] != 0.0f && f[i] < 1e-30f) || !(qmax[i] * inv <= FLT_MAX))
                return false;
            rec[i] = f[i] * (1.0f / kFIX);
            for (int n = 0; n < NV; ++n)
                _mm512_storeu_ps(qi + i * D + 16 * n, _mm512_mul_ps(_mm512_loadu_ps(qf + i * D + 16 * n),
                    _mm512_set1_ps(inv)));
        }
        return true;
    }

    // Key preparation of NR <= 4 rows for one group (qf: rows' q / sqrt(D), qi: keyBlockScale's, stride D; the group's
    // per-channel scales and zeros from entry off): cz[i] = sum_d qf kzr, and the digits of qi * scale for
    // keyTileDot8: dig[i kDOT8_DIGITS D / 4 + 24 j + 8 k + 2 tq + h] (dwords; kKEY_GATHER).
    template <int D, int NR>
    static void keyPrep(const float* qf, const float* qi, const void* kScale, const void* kZero, int64_t off,
        int32_t dtype, int32_t* dig, float* cz)
    {
        constexpr int NV = D / 16;
        __m512 sc[NV], zr[NV], z[4];
        for (int n = 0; n < NV; ++n)
        {
            sc[n] = loadAct(kScale, off + 16 * n, dtype);
            zr[n] = loadAct(kZero, off + 16 * n, dtype);
        }
        for (int i = 0; i < 4; ++i)
            z[i] = _mm512_setzero_ps();
        for (int i = 0; i < NR; ++i)
            for (int n = 0; n < NV; ++n)
                z[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i * D + 16 * n), zr[n], z[i]);
        alignas(16) float czv[4];
        _mm_store_ps(czv, reduce4(z, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
        for (int i = 0; i < NR; ++i)
            cz[i] = czv[i];
        const __m512i idx0 = _mm512_loadu_si512(kKEY_GATHER[0].data());
        const __m512i idx1 = _mm512_loadu_si512(kKEY_GATHER[1].data());
        for (int i = 0; i < NR; ++i)
        {
            __m512i w[NV];
            for (int n = 0; n < NV; ++n)
                w[n] = fixDigits(sc[n], _mm512_loadu_ps(qi + i * D + 16 * n));
            int32_t* row = dig + i * kDOT8_DIGITS * D / 4;
            for (int j = 0; j < D / 32; ++j)
            {
                _mm512_storeu_si512(row + 24 * j, _mm512_permutex2var_epi8(w[2 * j], idx0, w[2 * j + 1]));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 24 * j + 16),
                    _mm512_castsi512_si256(_mm512_permutex2var_epi8(w[2 * j], idx1, w[2 * j + 1])));
            }
        }
    }

    // Scores of NR rows over one transposed 16-token 2-bit key tile (Attn::transposeTile; lanes = tokens):
    // acc[i][k] += codes . digit k, score = cz + rec (A0 + 256 A1 + 65536 A2) (exact in int32 for D <= 128).
    // dig: row i's digits (keyPrep) at dig + i kDOT8_DIGITS D / 4.
    template <int D, int NR>
    static void keyTileDot8(const int32_t* tw, const int32_t* dig, const float* rec, const float* cz, float* scores,
        int64_t stride)
    {
        constexpr int NW = D / 32;
        __m512i acc[NR][kDOT8_DIGITS];
        for (int i = 0; i < NR; ++i)
            for (int k = 0; k < kDOT8_DIGITS; ++k)
                acc[i][k] = _mm512_setzero_si512();
        for (int tq = 0; tq < 4; ++tq)
            for (int j = 0; j < NW; ++j)
            {
                const __m512i ws = loadWords(tw + 8 * (tq * NW + j));
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h)
                {
                    const __m512i codes = codes2(ws, kKEY_SEL[h]);
                    for (int i = 0; i < NR; ++i)
                        for (int k = 0; k < kDOT8_DIGITS; ++k)
                            acc[i][k] = dpbusdBcast(
                                acc[i][k], codes, dig + i * kDOT8_DIGITS * D / 4 + 24 * j + 8 * k + 2 * tq + h);
                }
            }
        for (int i = 0; i < NR; ++i)
        {
            const __m512i n = _mm512_add_epi32(_mm512_add_epi32(acc[i][0], _mm512_slli_epi32(acc[i][1], 8)),
                _mm512_slli_epi32(acc[i][2], 16));
            _mm512_storeu_ps(scores + i * stride,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(rec[i]), _mm512_set1_ps(cz[i])));
        }
    }

    // mx = the unsigned max of mx and the bit patterns of n value scales from entry idx (lanes of 16 bits for fp16 /
    // bf16, 32 for fp32; lane l holds entries l mod its lane count, so group l % ng, as entries are token-major and
    // idx is a multiple of ng). n is a multiple of 64: a run is whole key groups (G >= 32 tokens, kSPLIT_LEN and the
    // block size are multiples of G) and n = tokens D / Gv. Negative scales (sign bit set) also read above +inf:
    // groupMaxBits refuses them with the non-finite ones (-0.0 too: the fp32 path, which is exact for it as well).
    using MX = __m512i;
    static MX maxBitsInit() { return _mm512_setzero_si512(); }
    static void maxBits(const void* base, int64_t idx, int n, int32_t dtype, MX& mx)
    {
        if (dtype == kiviCpuFloat32)
            maxBitsOf<32>(base, idx, n, mx);
        else
            maxBitsOf<16>(base, idx, n, mx);
    }
    template <int B>
    static void maxBitsOf(const void* base, int64_t idx, int n, MX& mx)
    {
        const char* p = static_cast<const char*>(base) + idx * (B / 8);
        for (int e = 0; e < n; e += 512 / B)
            mx = umax<B>(mx, _mm512_loadu_si512(p + e * (B / 8)));
    }

    // f[gi] = the largest scale of group gi (lanes l with l % ng == gi) from maxBits' mx; false if a scale was
    // negative, infinite or NaN.
    static bool groupMaxBits(MX mx, int ng, int32_t dtype, float* f)
    {
        return dtype == kiviCpuFloat32 ? groupMaxBitsOf<32>(mx, ng, dtype, f) : groupMaxBitsOf<16>(mx, ng, dtype, f);
    }
    template <int B>
    static bool groupMaxBitsOf(MX mx, int ng, int32_t dtype, float* f)
    {
        // fold to one 128-bit lane (128 / B lanes), then halve it down to ng lanes (ng in {1, 2, 4})
        __m128i x = umax<B>(_mm512_castsi512_si128(mx), _mm512_extracti32x4_epi32(mx, 1));
        x = umax<B>(x, umax<B>(_mm512_extracti32x4_epi32(mx, 2), _mm512_extracti32x4_epi32(mx, 3)));
        if (ng < 128 / B)
            x = umax<B>(x, _mm_bsrli_si128(x, 8));
        if (ng < 64 / B)
            x = umax<B>(x, _mm_bsrli_si128(x, 4));
        if (B == 16 && ng == 1)
            x = umax<B>(x, _mm_bsrli_si128(x, 2));
        alignas(16) uint32_t bits[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(bits), B == 16 ? _mm_cvtepu16_epi32(x) : x); // lanes 0..3
        uint32_t top = 0;
        for (int gi = 0; gi < ng; ++gi)
        {
            top = bits[gi] > top ? bits[gi] : top;
            f[gi] = B == 32 ? bitsF32(bits[gi])
                : dtype == kiviCpuFloat16 ? _cvtsh_ss(uint16_t(bits[gi])) : bitsF32(bits[gi] << 16);
        }
        return top < infBits(dtype);
    }

    // The value digits of NR <= 4 rows over nt tiles of one block (stageCoefs and the digits in one pass, no fp32
    // coefficient array: staging one and converting it measured 1.1x the op's time on an Intel Xeon). Entry e = t NG
    // + gi (token-major, as stored, from store entry idx): n = round(p_t * (scale_e * inv[gi])) (inv: 2^22 / F per
    // group; one rounding), zacc[i 8 + gi] += sum_t p_t zero_e; dig + i digStride: [(gi kSPLIT_LEN / 16 + tile) 16 + 4 k + tq]
    // (dwords), byte b = token 16 tile + 8 (b >> 1) + 2 tq + (b & 1). p: row 0's p of the block's first token (row
    // stride pStride). A NaN p (a NaN score) makes garbage digits, in its row only: that row's softmax sum is NaN,
    // so its output is NaN, as the reference's: no NaN check is needed here.
    // EXP: p holds the scores s and the softmax numerators are made here, p = exp(s - m[i]) (the bits softmaxRows
    // would store), l[i] += their sum: the exp pass's store and reload of every p are saved.
    template <int NR, int NG, bool EXP>
    static void valueCoefDigits(const void* vScale, const void* vZero, int64_t idx, int32_t dtype, int nt,
        const float* p, int64_t pStride, const float* inv, float* zacc, int32_t* dig, int64_t digStride,
        const float* m, float* l)
    {
        constexpr int SH = NG == 1 ? 0 : NG == 2 ? 1 : 2; // e / NG
        alignas(64) float il[16];
        for (int k = 0; k < 16; ++k)
            il[k] = inv[k & (NG - 1)];
        const __m512 iv = _mm512_load_ps(il);
        __m512 z[NR];
        for (int i = 0; i < NR; ++i)
            z[i] = _mm512_setzero_ps();
        __m512i gidx[NG];
        for (int gi = 0; gi < NG; ++gi)
            gidx[gi] = _mm512_loadu_si512(kVALUE_GATHER.idx[NG - 1 + gi].data());
        // n + 0x808080 in one rounding: fma(p, scale inv, 0x808080) is exact to the integer (|p scale inv| <= 2^22,
        // the sum below 2^24) and rounds half to even like vcvtps2dq (0x808080 is even)
        const __m512 biasF = _mm512_set1_ps(float(0x808080));
        const __m512i bias = _mm512_set1_epi32(0x808080);
        __m512 ms[NR], ls[NR];
        for (int i = 0; i < NR; ++i)
        {
            ms[i] = _mm512_set1_ps(EXP ? m[i] : 0.0f);
            ls[i] = _mm512_setzero_ps();
        }
        __m512i sidx[NG]; // EXP: the tile's p to the lanes of entry vector v (lane l: token 16 v / NG + l / NG)
        for (int v = 0; v < NG; ++v)
            sidx[v] = _mm512_add_epi32(_mm512_set1_epi32(16 / NG * v),
                _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), SH));
        for (int tile = 0; tile < nt; ++tile)
        {
            __m512 pt[NR];
            if constexpr (EXP)
                for (int i = 0; i < NR; ++i)
                {
                    pt[i] = exp(_mm512_sub_ps(_mm512_loadu_ps(p + i * pStride + 16 * tile), ms[i]));
                    ls[i] = _mm512_add_ps(ls[i], pt[i]);
                }
            __m512i w[NR][NG];
            for (int v = 0; v < NG; ++v)
            {
                const int e = (tile * NG + v) * 16;
                const __m512 sc = _mm512_mul_ps(loadAct(vScale, idx + e, dtype), iv);
                const __m512 zr = loadAct(vZero, idx + e, dtype);
                for (int i = 0; i < NR; ++i)
                {
                    const __m512 pv = !EXP ? spread(p + i * pStride + (e >> SH), NG)
                        : NG == 1          ? pt[i]
                                           : _mm512_permutexvar_ps(sidx[v], pt[i]);
                    w[i][v] = _mm512_xor_si512(_mm512_cvtps_epi32(_mm512_fmadd_ps(pv, sc, biasF)), bias);
                    z[i] = _mm512_fmadd_ps(pv, zr, z[i]);
                }
            }
            for (int i = 0; i < NR; ++i)
                for (int gi = 0; gi < NG; ++gi)
                {
                    __m512i r;
                    if (NG == 1)
                        r = _mm512_permutexvar_epi8(gidx[gi], w[i][0]);
                    else
                    {
                        r = _mm512_permutex2var_epi8(w[i][0], gidx[gi], w[i][1 % NG]);
                        if (NG == 4)
                            r = _mm512_mask_mov_epi8(r, kVALUE_GATHER.hi[NG - 1 + gi],
                                _mm512_permutex2var_epi8(w[i][2 % NG], gidx[gi], w[i][3 % NG]));
                    }
                    _mm512_storeu_si512(dig + i * digStride + (gi * (kSPLIT_LEN / 16) + tile) * 16, r);
                }
        }
        for (int i = 0; i < NR; ++i)
        {
            alignas(64) float zl[16];
            _mm512_store_ps(zl, z[i]);
            for (int k = 0; k < 16; ++k) // lane k holds group k % NG
                zacc[i * 8 + (k & (NG - 1))] += zl[k];
            if constexpr (EXP)
                l[i] += hsum(ls[i]);
        }
    }

    // acc[i][32 j + c] += rec sum_t coef_it code_tc over nt transposed 2-bit value tiles (consecutive, D words
    // each) for channels [32 j, 32 j + 32): lanes = 16 channels, a lane's 4 bytes = tokens (2 tq, + 1, + 8, + 9)
    // against their digits. dig[i]: row i's valueCoefDigits of this channel group. One pass per 16-channel half q2:
    // NR 3 kDOT8_DIGITS accumulators (NR <= 4) stay in registers. Not inlined: inlined into splitPartial, g++ 12
    // keeps the accumulator array in memory (a store after every vpdpbusd, 1.2x the op's time).
    // test_dot_product_accumulators_stay_in_registers checks the build.
    template <int D, int NR>
    __attribute__((noinline)) static void valueSpanDot8(
        const int32_t* tw, int nt, int j, const int32_t* const* dig, float rec, float* acc)
    {
        constexpr int NW = D / 32;
        const __m512 r = _mm512_set1_ps(rec);
        for (int q2 = 0; q2 < 2; ++q2)
        {
            __m512i a[NR][kDOT8_DIGITS];
            for (int i = 0; i < NR; ++i)
                for (int k = 0; k < kDOT8_DIGITS; ++k)
                    a[i][k] = _mm512_setzero_si512();
            const int32_t* t = tw;
            for (int tile = 0; tile < nt; ++tile, t += D)
                for (int tq = 0; tq < 4; ++tq)
                {
                    const __m512i codes = codes2(loadWords(t + 8 * (tq * NW + j)), kVALUE_SEL[q2]);
                    for (int i = 0; i < NR; ++i)
                        for (int k = 0; k < kDOT8_DIGITS; ++k)
                            a[i][k] = dpbusdBcast(a[i][k], codes, dig[i] + 16 * tile + 4 * k + tq);
                }
            for (int i = 0; i < NR; ++i)
            {
                // each digit sum is below 2^24 (512 tokens x 3 x 128): exact in fp32
                const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][2]), _mm512_set1_ps(65536.0f),
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][1]), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(a[i][0])));
                float* p = acc + i * D + 32 * j + 16 * q2;
                _mm512_storeu_ps(p, _mm512_fmadd_ps(f, r, _mm512_loadu_ps(p)));
            }
        }
    }
#endif
};

#include "kiviCpuKernel.h"

} // namespace KIVI_AVX512_NS

#ifdef KIVI_AVX512_VNNI
const IsaKernels kAvx512VnniKernels = {avx512vnni::kernel::attendItem, avx512vnni::kernel::mergeItem};
#else
const IsaKernels kAvx512Kernels = {avx512::kernel::attendItem, avx512::kernel::mergeItem};
#endif

} // namespace cpu
} // namespace trtllm_kivi
