// 2-bit codes decoded by one AND (the avx2denormal path; included by kiviCpuIsaAvx2.cpp inside its namespace).
//
// Why: on AVX2 the decode shift + mask + int->float convert of kiviCpuKernel.h costs more than the FMAs it feeds
// (vcvtdq2ps competes with the FMAs for their two pipes on Zen 3: 12 FMAs + 4 converts take 10 cycles, not 6). Here
// a 2-bit code at bit s (s < 16; the high half of a word is shifted down once) is isolated by an AND and read as the
// subnormal float c 2^(s - 149), exact. The other operand carries 2^(kDN_OPERAND_EXP - s) (folded into the key scale
// per channel, or the value coefficient per token), so every product is the true one times 2^-kDN_PRODUCT_EXP: the
// same rounding as the fp32 path (power-of-two scaling is exact in the normal range). The accumulators are scaled
// back once per tile (keys) or span (values).
//
// Subnormal inputs: AMD Zen multiplies them at full speed (measured: 6.2 cycles per 12 FMAs either way); Intel cores
// take a microcode assist per subnormal operand, so `auto` picks this path only on AMD. DAZ (denormals-are-zero) would
// read every code as 0: attendItem clears it for the item and restores MXCSR (FTZ stays: outputs here are normal).
// Range: operands must stay finite after the 2^(100 - s) scaling. A key group whose scores come out non-finite, or a
// value split with a non-finite coefficient, is computed again by the fp32 path (Attn::scoresPerChannel,
// Attn::splitPartial), which gives the true result in every case, NaN and inf inputs included.
//
// The inner steps are inline asm because GCC 12 spills the 12 accumulators of the intrinsics version (16 ymm
// registers: 12 accumulators, the word set, two codes, one broadcast): 350 -> 198 cycles per tile for the values,
// 296 -> 230 for the keys (benchmarks/cpu_inner_loops.cpp; FMA floor 192).

constexpr int kDN_OPERAND_EXP = 100;
constexpr int kDN_PRODUCT_EXP = 49; // = 149 - kDN_OPERAND_EXP

// mask m isolates the code at bits [2 m, 2 m + 2)
alignas(32) static const int32_t kDnMask2[8][8] = {
#define KIVI_DN_R8(x) {x, x, x, x, x, x, x, x}
    KIVI_DN_R8(3 << 0), KIVI_DN_R8(3 << 2), KIVI_DN_R8(3 << 4), KIVI_DN_R8(3 << 6), KIVI_DN_R8(3 << 8),
    KIVI_DN_R8(3 << 10), KIVI_DN_R8(3 << 12), KIVI_DN_R8(3 << 14)};
#undef KIVI_DN_R8

// One step: the codes of masks M0, M1 of the word set in ymm12 (ymm13, ymm15), times the coefficient at byte offset
// OFF of each row pointer p0, p1 (, p2) (broadcast into ymm14), into the accumulator pairs (T0A, T0B), (T1A, T1B)
// (, (T2A, T2B)). KIVI_DN_STEP2 serves row counts divisible by 2 but not by 3.
#define KIVI_DN_CODES(M0, M1)                                                                                       \
    "vpand " #M0 "*32(%[m]), %%ymm12, %%ymm13\n\t"                                                                  \
    "vpand " #M1 "*32(%[m]), %%ymm12, %%ymm15\n\t"
#define KIVI_DN_ROW(OFF, P, TA, TB)                                                                                 \
    "vbroadcastss " OFF "(%[" #P "]), %%ymm14\n\t"                                                                  \
    "vfmadd231ps %%ymm14, %%ymm13, %[" #TA "]\n\t"                                                                  \
    "vfmadd231ps %%ymm14, %%ymm15, %[" #TB "]\n\t"
#define KIVI_DN_STEP2(OFF, M0, M1, T0A, T0B, T1A, T1B)                                                              \
    KIVI_DN_CODES(M0, M1) KIVI_DN_ROW(OFF, p0, T0A, T0B) KIVI_DN_ROW(OFF, p1, T1A, T1B)
#define KIVI_DN_STEP3(OFF, M0, M1, T0A, T0B, T1A, T1B, T2A, T2B)                                                    \
    KIVI_DN_STEP2(OFF, M0, M1, T0A, T0B, T1A, T1B) KIVI_DN_ROW(OFF, p2, T2A, T2B)

// Keys, one word set w (tq, j) of a transposed tile: step (h, pp) is channel 8 pp + h of the row pointers (which point
// at channel 32 j + 2 tq), masks 2 pp, 2 pp + 1 (token vectors v = 0, 1: tokens gq, 8 + gq); accumulator set pp & 1
// so consecutive steps feed different chains (FMA latency 4-5 cycles). KSTEP(OFF, M0, M1, set) is one step.
// The asm is volatile and the callers put a compiler barrier before their loops: it reads memory GCC is not told of.
#define KIVI_DN_KEY_STEPS(KSTEP)                                                                                    \
    "vmovdqu (%[w]), %%ymm12\n\t"                                                                                   \
    KSTEP("0", 0, 1, 0) KSTEP("32", 2, 3, 1) KSTEP("64", 4, 5, 0) KSTEP("96", 6, 7, 1)                              \
    "vpsrld $16, %%ymm12, %%ymm12\n\t"                                                                              \
    KSTEP("4", 0, 1, 0) KSTEP("36", 2, 3, 1) KSTEP("68", 4, 5, 0) KSTEP("100", 6, 7, 1)
// accumulator a<set><row><v>
#define KIVI_DN_KSTEP3(OFF, M0, M1, S)                                                                              \
    KIVI_DN_STEP3(OFF, M0, M1, a##S##00, a##S##01, a##S##10, a##S##11, a##S##20, a##S##21)
#define KIVI_DN_KSTEP2(OFF, M0, M1, S) KIVI_DN_STEP2(OFF, M0, M1, a##S##00, a##S##01, a##S##10, a##S##11)
// 1 row: one accumulator set per pp = M0 / 2 (a<M0><v>), so each accumulator is fed every 4th step (2 FMAs a step)
#define KIVI_DN_KSTEP1(OFF, M0, M1, S) KIVI_DN_CODES(M0, M1) KIVI_DN_ROW(OFF, p0, a##M0##0, a##M0##1)

__attribute__((always_inline)) static inline void dnKeyWords3(const int32_t* w, const float* p0, const float* p1,
    const float* p2, __m256 (&a)[2][3][2])
{
    asm volatile(KIVI_DN_KEY_STEPS(KIVI_DN_KSTEP3)
        : [a000] "+x"(a[0][0][0]), [a001] "+x"(a[0][0][1]), [a010] "+x"(a[0][1][0]), [a011] "+x"(a[0][1][1]),
        [a020] "+x"(a[0][2][0]), [a021] "+x"(a[0][2][1]), [a100] "+x"(a[1][0][0]), [a101] "+x"(a[1][0][1]),
        [a110] "+x"(a[1][1][0]), [a111] "+x"(a[1][1][1]), [a120] "+x"(a[1][2][0]), [a121] "+x"(a[1][2][1])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0), [p1] "r"(p1), [p2] "r"(p2)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}

// dnKeyWords3 for 2 rows (8 accumulators)
__attribute__((always_inline)) static inline void dnKeyWords2(const int32_t* w, const float* p0, const float* p1,
    __m256 (&a)[2][2][2])
{
    asm volatile(KIVI_DN_KEY_STEPS(KIVI_DN_KSTEP2)
        : [a000] "+x"(a[0][0][0]), [a001] "+x"(a[0][0][1]), [a010] "+x"(a[0][1][0]), [a011] "+x"(a[0][1][1]),
        [a100] "+x"(a[1][0][0]), [a101] "+x"(a[1][0][1]), [a110] "+x"(a[1][1][0]), [a111] "+x"(a[1][1][1])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0), [p1] "r"(p1)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}

// dnKeyWords3 for 1 row (the rest of a row count that 3 does not divide): 4 accumulator sets (8 accumulators)
__attribute__((always_inline)) static inline void dnKeyWords1(const int32_t* w, const float* p0, __m256 (&a)[4][2])
{
    asm volatile(KIVI_DN_KEY_STEPS(KIVI_DN_KSTEP1)
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a20] "+x"(a[1][0]), [a21] "+x"(a[1][1]), [a40] "+x"(a[2][0]),
        [a41] "+x"(a[2][1]), [a60] "+x"(a[3][0]), [a61] "+x"(a[3][1])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}

// Values, word set w (tq, k) of a transposed tile (channels 32 k ..): step (h, e) is token 8 (e & 1) + h of the row
// pointers (at token 2 tq; NG floats per token), masks 2 e, 2 e + 1 into accumulators 2 (e >> 1) + {0, 1} (channels
// 32 k + 16 (e >> 1) + 8 v + gq); e ordered 0 2 1 3 so consecutive steps feed different chains.
// VSTEP(OFF, M0, M1, J0, J1) is one step into accumulators J0, J1 of each row.
#define KIVI_DN_VALUE_STEPS(VSTEP)                                                                                  \
    "vmovdqu (%[w]), %%ymm12\n\t"                                                                                   \
    VSTEP("0", 0, 1, 0, 1) VSTEP("0", 4, 5, 2, 3) VSTEP("32*%c[ng]", 2, 3, 0, 1) VSTEP("32*%c[ng]", 6, 7, 2, 3)     \
    "vpsrld $16, %%ymm12, %%ymm12\n\t"                                                                              \
    VSTEP("4*%c[ng]", 0, 1, 0, 1) VSTEP("4*%c[ng]", 4, 5, 2, 3) VSTEP("36*%c[ng]", 2, 3, 0, 1)                      \
    VSTEP("36*%c[ng]", 6, 7, 2, 3)
// accumulator a<row><j>
#define KIVI_DN_VSTEP3(OFF, M0, M1, J0, J1) KIVI_DN_STEP3(OFF, M0, M1, a0##J0, a0##J1, a1##J0, a1##J1, a2##J0, a2##J1)
#define KIVI_DN_VSTEP2(OFF, M0, M1, J0, J1) KIVI_DN_STEP2(OFF, M0, M1, a0##J0, a0##J1, a1##J0, a1##J1)
// 1 row: accumulators a<J> (J0, J1 name them directly: 0-3 for the word's low half, 4-7 for the high one)
#define KIVI_DN_VSTEP1(OFF, M0, M1, J0, J1)                                                                         \
    KIVI_DN_CODES(M0, M1) KIVI_DN_ROW(OFF, p0, a##J0, a##J1)

template <int NG>
__attribute__((always_inline)) static inline void dnValueWords3(const int32_t* w, const float* p0, const float* p1,
    const float* p2, __m256 (&a)[3][4])
{
    asm volatile(KIVI_DN_VALUE_STEPS(KIVI_DN_VSTEP3)
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a03] "+x"(a[0][3]), [a10] "+x"(a[1][0]),
        [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2]), [a13] "+x"(a[1][3]), [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]),
        [a22] "+x"(a[2][2]), [a23] "+x"(a[2][3])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0), [p1] "r"(p1), [p2] "r"(p2), [ng] "i"(NG)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}

// dnValueWords3 for 2 rows (8 accumulators)
template <int NG>
__attribute__((always_inline)) static inline void dnValueWords2(const int32_t* w, const float* p0, const float* p1,
    __m256 (&a)[2][4])
{
    asm volatile(KIVI_DN_VALUE_STEPS(KIVI_DN_VSTEP2)
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a02] "+x"(a[0][2]), [a03] "+x"(a[0][3]), [a10] "+x"(a[1][0]),
        [a11] "+x"(a[1][1]), [a12] "+x"(a[1][2]), [a13] "+x"(a[1][3])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0), [p1] "r"(p1), [ng] "i"(NG)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}
// dnValueWords3 for 1 row: two accumulator sets (the word's low / high half), 8 accumulators
#define KIVI_DN_VALUE_STEPS1                                                                                        \
    "vmovdqu (%[w]), %%ymm12\n\t"                                                                                   \
    KIVI_DN_VSTEP1("0", 0, 1, 0, 1) KIVI_DN_VSTEP1("0", 4, 5, 2, 3) KIVI_DN_VSTEP1("32*%c[ng]", 2, 3, 0, 1)         \
    KIVI_DN_VSTEP1("32*%c[ng]", 6, 7, 2, 3) "vpsrld $16, %%ymm12, %%ymm12\n\t"                                      \
    KIVI_DN_VSTEP1("4*%c[ng]", 0, 1, 4, 5) KIVI_DN_VSTEP1("4*%c[ng]", 4, 5, 6, 7)                                   \
    KIVI_DN_VSTEP1("36*%c[ng]", 2, 3, 4, 5) KIVI_DN_VSTEP1("36*%c[ng]", 6, 7, 6, 7)
template <int NG>
__attribute__((always_inline)) static inline void dnValueWords1(const int32_t* w, const float* p0, __m256 (&a)[8])
{
    asm volatile(KIVI_DN_VALUE_STEPS1
        : [a0] "+x"(a[0]), [a1] "+x"(a[1]), [a2] "+x"(a[2]), [a3] "+x"(a[3]), [a4] "+x"(a[4]), [a5] "+x"(a[5]),
        [a6] "+x"(a[6]), [a7] "+x"(a[7])
        : [w] "r"(w), [m] "r"(kDnMask2), [p0] "r"(p0), [ng] "i"(NG)
        : "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef KIVI_DN_VALUE_STEPS1
#undef KIVI_DN_VSTEP1
#undef KIVI_DN_VSTEP2
#undef KIVI_DN_VSTEP3
#undef KIVI_DN_VALUE_STEPS
#undef KIVI_DN_KSTEP2
#undef KIVI_DN_KSTEP3
#undef KIVI_DN_KSTEP1
#undef KIVI_DN_KEY_STEPS
#undef KIVI_DN_STEP3
#undef KIVI_DN_STEP2
#undef KIVI_DN_ROW
#undef KIVI_DN_CODES

// 2^e as a float (e in the normal range)
constexpr float dnPow2(int e)
{
    float x = 1.0f;
    for (; e > 0; --e)
        x *= 2.0f;
    for (; e < 0; ++e)
        x *= 0.5f;
    return x;
}

// Key scale factor of channels [8 n, 8 n + 8): their codes sit at bit 16 h + 4 pp + 2 v with pp = n % 4
// (FRAGMENT order, kiviCpuKernel.h).
static inline float dnKeyScaleFactor(int n)
{
    static constexpr float kF[4] = {dnPow2(kDN_OPERAND_EXP), dnPow2(kDN_OPERAND_EXP - 4), dnPow2(kDN_OPERAND_EXP - 8),
        dnPow2(kDN_OPERAND_EXP - 12)};
    return kF[n & 3];
}

// Value coefficient factor of tile token t (0..15): its codes sit at bit 16 (t & 1) + 4 (t >> 3) + (channel part).
static inline float dnValueTokenFactor(int t)
{
    static constexpr float kF[2] = {dnPow2(kDN_OPERAND_EXP), dnPow2(kDN_OPERAND_EXP - 4)};
    return kF[(t >> 3) & 1];
}

// Scores of one transposed 16-token tile `tw` for NR (1, 2 or 3) rows: scores[i][t] = sum_ch qs[i][ch] code(t, ch) + cz[i], qs
// scaled by dnKeyScaleFactor per channel.
template <int D, int NR>
static void dnKeyTile(const int32_t* tw, const float* qs, const float* cz, float* scores, int64_t stride)
{
    constexpr int NW = D * 2 / 64;
    asm volatile("" ::: "memory"); // the asm below reads tw and qs: the stores before must be done
    static_assert(NR >= 1 && NR <= 3, "row blocks of 1, 2 or 3");
    static constexpr float kBack0 = dnPow2(kDN_PRODUCT_EXP), kBack1 = dnPow2(kDN_PRODUCT_EXP - 2);
    if constexpr (NR == 1)
    {
        __m256 acc[4][2];
        for (int h = 0; h < 4; ++h)
            for (int v = 0; v < 2; ++v)
                acc[h][v] = _mm256_setzero_ps();
        for (int tq = 0; tq < 4; ++tq)
            for (int j = 0; j < NW; ++j)
                dnKeyWords1(tw + 8 * (tq * NW + j), qs + 32 * j + 2 * tq, acc);
        for (int v = 0; v < 2; ++v) // the sets in pairs, as the 2-set kernels add theirs
            _mm256_storeu_ps(scores + 8 * v,
                _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(acc[0][v], acc[2][v]), _mm256_add_ps(acc[1][v], acc[3][v])),
                    _mm256_set1_ps(v ? kBack1 : kBack0), _mm256_set1_ps(cz[0])));
    }
    else
    {
        __m256 acc[2][NR][2]; // index loops: GCC keeps the array in registers (range-for references: on the stack)
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < NR; ++i)
                for (int v = 0; v < 2; ++v)
                    acc[h][i][v] = _mm256_setzero_ps();
        for (int tq = 0; tq < 4; ++tq)
            for (int j = 0; j < NW; ++j)
            {
                const float* q = qs + 32 * j + 2 * tq;
                if constexpr (NR == 3)
                    dnKeyWords3(tw + 8 * (tq * NW + j), q, q + D, q + 2 * D, acc);
                else
                    dnKeyWords2(tw + 8 * (tq * NW + j), q, q + D, acc);
            }
        for (int i = 0; i < NR; ++i)
            for (int v = 0; v < 2; ++v) // code vector v sits 2 v bits higher: 2^(2 v) larger
                _mm256_storeu_ps(scores + i * stride + 8 * v,
                    _mm256_fmadd_ps(_mm256_add_ps(acc[0][i][v], acc[1][i][v]),
                        _mm256_set1_ps(v ? kBack1 : kBack0), _mm256_set1_ps(cz[i])));
    }
}

// acc[i][32 k .. 32 k + 32) += sum over the nt transposed tiles `tw` of coef[i][t] code(t, ch) for NR (1, 2 or 3) rows; coef row
// stride cs, NG floats per token, scaled by dnValueTokenFactor per token.
template <int D, int NG, int NR>
static void dnValueBlock(const int32_t* tw, int nt, int k, const float* coef, int64_t cs, float* acc)
{
    constexpr int NW = D * 2 / 64, TILE_WORDS = 16 * D * 2 / 32;
    asm volatile("" ::: "memory"); // the asm below reads tw and coef: the stores before must be done
    static_assert(NR >= 1 && NR <= 3, "row blocks of 1, 2 or 3");
    __m256 a[NR][4];
    if constexpr (NR == 1)
    {
        __m256 a1[8]; // two sets (word halves) of the 4 accumulators
        for (int j = 0; j < 8; ++j)
            a1[j] = _mm256_setzero_ps();
        for (int t = 0; t < nt; ++t, tw += TILE_WORDS, coef += 16 * NG)
            for (int tq = 0; tq < 4; ++tq)
                dnValueWords1<NG>(tw + 8 * (tq * NW + k), coef + 2 * tq * NG, a1);
        for (int j = 0; j < 4; ++j)
            a[0][j] = _mm256_add_ps(a1[j], a1[4 + j]);
    }
    else
    {
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < 4; ++j)
                a[i][j] = _mm256_setzero_ps();
        for (int t = 0; t < nt; ++t, tw += TILE_WORDS, coef += 16 * NG)
            for (int tq = 0; tq < 4; ++tq)
            {
                const float* cf = coef + 2 * tq * NG;
                if constexpr (NR == 3)
                    dnValueWords3<NG>(tw + 8 * (tq * NW + k), cf, cf + cs, cf + 2 * cs, a);
                else
                    dnValueWords2<NG>(tw + 8 * (tq * NW + k), cf, cf + cs, a);
            }
    }
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < 4; ++j) // accumulator j = 2 blk + v: its codes sit 8 blk + 2 v bits higher
        {
            static constexpr float kBack[4] = {dnPow2(kDN_PRODUCT_EXP), dnPow2(kDN_PRODUCT_EXP - 2),
                dnPow2(kDN_PRODUCT_EXP - 8), dnPow2(kDN_PRODUCT_EXP - 10)};
            float* p = acc + i * D + 32 * k + 8 * j;
            _mm256_storeu_ps(p, _mm256_fmadd_ps(a[i][j], _mm256_set1_ps(kBack[j]), _mm256_loadu_ps(p)));
        }
}
