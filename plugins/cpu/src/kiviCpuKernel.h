// The CPU KiviAttention kernel, written once over a SIMD wrapper `S` (kiviCpuIsa*.cpp define S and include this
// file inside their own namespace, so every path gets private copies of every function).
//
// Decomposition (fixed, so results do not depend on threads or batch): for each sequence and KV head the keys
// [0, past + chunk) are cut at multiples of kSPLIT_LEN; a split's partial softmax state (m, l, acc[D]) per query row is
// computed from scratch, then partials are merged left to right (split 0, 1, ...). A work item computes one split of
// every KV head (decode: partials stored, merged by mergeItem) or all splits of one head's query tile in order
// (prefill); both run the same per-split function and the same merge, so they give the same bits.
//
// Keys/values are read straight from the store: per-channel K codes are decoded one 16-token tile at a time (tokens in
// SIMD lanes) against q pre-multiplied by the group's per-channel scale (score = sum_d (q_d s_d) c_td + sum_d q_d z_d);
// per-token V codes are decoded channels-in-lanes and accumulated with p_t * scale, the zero term p_t * z once per
// group. Nothing but one tile's scores lives in scratch.
//
// FRAGMENT order (format.py, FORMAT_VERSION 3; format.fragment_coord is the definition): a 16-token tile is 32 lanes
// L = 4 gq + tq of nw = D * bits / 64 words; word j of lane L holds at bits [16 h + bits (2 pp + par), + bits) the
// code of (with pi = j (16 / bits) + 2 pp + par, since 16 / bits is even par = pi & 1):
//   keys:   token gq + 8 par,                        channel 8 (j (8 / bits) + pp) + 2 tq + h
//   values: token 8 ((pi >> 1) & 1) + 2 tq + h,      channel 16 (pi >> 2) + 8 par + gq
// So the 8 words of lanes gq = 0..7 with the same (tq, j) hold, at one shift, 8 consecutive tokens of one key channel
// or 8 consecutive channels of one value token, and at shift + bits the next 8 (par = 1): one shift + mask + convert
// per 16 codes (S::decodeFrag), the same work as a linear order. A tile is the word matrix [8 gq][4 nw (tq, j)];
// transposeTile turns it into [4 nw][8 gq] with 8 x 8 transposes (S::transpose8) so each such word set is one load.
//
// Requires before inclusion: namespace trtllm_kivi::cpu::<isa> { struct S; } with the ops used below.

namespace kernel
{

// exp for softmax arguments (x <= 0 in practice): n = round(x log2 e) by adding 1.5 * 2^23 (whose low bits then hold
// n: no floor / convert), r = x - n ln 2 in two parts, Cephes' polynomial, times 2^n; exact 0 below -87.3 (so masked
// -inf gives 0), NaN propagates. The portable S::exp is this formula lane-wise; the AVX2 one the same n with
// 2^(x log2 e - n) in Estrin's scheme (a shorter dependency chain); the AVX-512 one 2^t by vrndscaleps / vscalefps
// (fewer operations). All agree to a few 1e-7 relative.
static inline float expScalar(float x)
{
    if (x != x)
        return x;
    if (x < kEXP_LO)
        return 0.0f;
    const float xc = x > kEXP_HI ? kEXP_HI : x;
    const float t = __builtin_fmaf(xc, 1.44269504088896341f, kEXP_SHIFTER);
    const float fx = t - kEXP_SHIFTER;
    float r = __builtin_fmaf(-fx, 0.693359375f, xc);
    r = __builtin_fmaf(-fx, -2.12194440e-4f, r);
    float y = 1.9875691500E-4f;
    y = __builtin_fmaf(y, r, 1.3981999507E-3f);
    y = __builtin_fmaf(y, r, 8.3334519073E-3f);
    y = __builtin_fmaf(y, r, 4.1665795894E-2f);
    y = __builtin_fmaf(y, r, 1.6666665459E-1f);
    y = __builtin_fmaf(y, r, 5.0000001201E-1f);
    y = __builtin_fmaf(y * r, r, r) + 1.0f;
    return y * bitsF32((f32Bits(t) + 127u) << 23); // t's bits are 0x4B400000 + n; the shift drops the 0x4B4
}

// Rows of the subnormal decode's next row block when `left` rows remain (kiviCpuDenormal2.h: kernels for 3, 2 and 1
// rows; 3 first: its 12 accumulators keep both FMA pipes busy, the 2- and 1-row kernels have 8)
constexpr int dnRowBlock(int left) { return left >= 3 ? 3 : left; }

// T as a type that depends on a template parameter: members only some ISAs' S have (kDENORMAL2's) are then looked up
// at instantiation, inside `if constexpr`.
template <class T, int>
struct Dependent
{
    using type = T;
};

static inline int32_t imin(int32_t a, int32_t b)
{
    return a < b ? a : b;
}

static inline int32_t imax(int32_t a, int32_t b)
{
    return a > b ? a : b;
}

template <int D>
struct Attn
{
    static constexpr int W = S::W;
    static constexpr int NV = D / W;       // vectors per head row
    static constexpr int KV = kK_TILE / W; // vectors per decoded key tile
    static constexpr int RB = 4;           // query rows per register block

    // Scratch layout (floats); sized by scratchFloats(rows, D).
    struct Scratch
    {
        float* qf;     // [rows, D] q * 1/sqrt(D)
        float* qs;     // [rows, D] qf * per-channel key scale of the current group
        float* cz;     // [rows]    sum_d qf * key zero
        float* scores; // [rows, kSCORE_STRIDE] scores, then p (softmaxRows; with vexp the quantized span keeps its scores)
        float* acc;    // [rows, D]
        float* zacc;   // [rows, 8] per value group: sum_t p_t * zero
        float* coef;   // [rows, ng kSCORE_STRIDE] p_t * value scale, entry (t - qa) ng + gi (token-major, as stored)
        float* state;  // [rows, D + 2] running (m, l, acc) of a sequential item
        float* part;   // [rows, D + 2] one split's partial
        float* kdeq;   // [4, kSCORE_STRIDE] a dequantized per-token key row
        float* ksc;    // [D] per-channel key scale of the current group
        float* kzr;    // [D]
        int32_t* tw;   // [kSPLIT_LEN / 16 tiles][4 D] transposed fragment tiles (transposeTile)
        int32_t* kdig; // [rows, kDOT8_DIGITS D / 4] key digits of the current group (S::keyPrep; kDOT8 only)
        int32_t* vdig; // [rows, kDOT8_VALUE_DWORDS] value digits of the split (S::valueCoefDigits)
        float* krec;   // [rows] key digits' scales (the current block's)
        float* vfix;   // [8] value digits' scales (4 groups), then their inverses: shared by the rows
        float* kqi;    // [rows, D] qf * 2^22 / F for the current block's key digits (S::keyBlockScale; kDOT8 only)
        float* qmax;   // [rows] max_d |qf|, NaN if a q is not finite (loadQ; kDOT8 only)
        bool kdot8;    // the current block's 2-bit keys take the integer dot products (keyDigitScales)
        bool vdot8;    // the split's 2-bit values take the integer dot products (valueDigitScales)
        bool vexp;     // vdot8, and the quantized span's p are made with the digits (softmaxRows, valueCoefDigits)
    };

    static Scratch carve(float* base, int rows)
    {
        Scratch s;
        s.qf = base;
        s.qs = s.qf + rows * D;
        s.cz = s.qs + rows * D;
        s.scores = s.cz + rows + 16;
        s.acc = s.scores + int64_t(rows) * kSCORE_STRIDE;
        s.zacc = s.acc + rows * D;
        s.coef = s.zacc + rows * 8;
        s.state = s.coef + int64_t(4) * rows * kSCORE_STRIDE;
        s.part = s.state + rows * (D + 2);
        s.kdeq = s.part + rows * (D + 2);
        s.ksc = s.kdeq + 4 * kSCORE_STRIDE;
        s.kzr = s.ksc + D;
        s.tw = reinterpret_cast<int32_t*>(s.kzr + D + 16);
        s.kdig = s.tw + (kSPLIT_LEN / 16) * 4 * D;
        s.vdig = s.kdig + rows * kDOT8_DIGITS * D / 4;
        s.krec = reinterpret_cast<float*>(s.vdig + int64_t(rows) * kDOT8_VALUE_DWORDS);
        s.vfix = s.krec + rows;
        s.kqi = s.vfix + 8;
        s.qmax = s.kqi + rows * D;
        s.kdot8 = false;
        s.vdot8 = false;
        s.vexp = false;
        return s;
    }

    static constexpr int scoreStride()
    {
        return kSCORE_STRIDE;
    }

    // q rows of a tile: row = i * grp + j is query position past + pos0 + i, head kvHead * grp + j. kDOT8: qmax too
    // (S::keyBlockScale's bounds, once per item instead of per block).
    static void loadQ(const Ctx& c, const SeqPlan& sp, int g, int pos0, int npos, float* qf, float* qmax)
    {
        for (int i = 0; i < npos; ++i)
            for (int j = 0; j < c.grp; ++j)
            {
                int64_t off = (int64_t(sp.tokOffset + pos0 + i) * c.H + g * c.grp + j) * D;
                float* dst = qf + (i * c.grp + j) * D;
                typename S::F m = S::zero(), bad = S::zero(); // bad: sum of q * 0, NaN iff a q is not finite
                for (int n = 0; n < NV; ++n)
                {
                    const typename S::F x = S::mul(S::loadAct(c.q, off + n * W, c.actDtype), S::set1(c.smScale));
                    S::store(dst + n * W, x);
                    if constexpr (S::kDOT8)
                    {
                        m = S::max(m, S::max(x, S::sub(S::zero(), x)));
                        bad = S::fma(x, S::zero(), bad);
                    }
                }
                if constexpr (S::kDOT8)
                    qmax[i * c.grp + j] = S::hmax(m) + S::hsum(bad);
            }
    }

    // A 16-token fragment tile [8 gq][4 NW] (word (4 gq + tq) NW + j) -> dst [4 NW][8 gq]: word set (tq, j) at
    // dst + 8 (tq NW + j).
    template <int BITS>
    __attribute__((always_inline)) static inline void transposeTile(const int32_t* tile, int32_t* dst)
    {
        constexpr int NW = D * BITS / 64;
        for (int m = 0; m < 4 * NW / 8; ++m)
            S::transpose8(tile + 8 * m, 4 * NW, dst + 64 * m);
    }

    // Scores of per-channel quantized keys: one transposed 16-token fragment tile `tw` for NR rows (accumulators in
    // registers).
    template <int BITS, int NR>
    static void keyTile(const int32_t* tw, const float* qs, const float* cz, float* scores)
    {
        constexpr int NW = D * BITS / 64; // words per lane
        constexpr int PP = 8 / BITS;      // code pairs per half word
        // two accumulator sets (h = 0 / 1: even / odd channels) when registers allow: the fma chain is halved
        constexpr int NA = (NR * KV <= 6) ? 2 : 1;
        typename S::F acc[NA][NR][KV];
        for (int h = 0; h < NA; ++h)
            for (int i = 0; i < NR; ++i)
                for (int v = 0; v < KV; ++v)
                    acc[h][i][v] = h == 0 ? S::set1(cz[i]) : S::zero();
        for (int tq = 0; tq < 4; ++tq)
            for (int j = 0; j < NW; ++j)
            {
                const typename S::WS ws = S::loadWords(tw + 8 * (tq * NW + j));
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
                    for (int pp = 0; pp < PP; ++pp)
                    {
                        const int ch = 8 * (j * PP + pp) + 2 * tq + h;
                        typename S::F code[KV];
#pragma GCC unroll 2
                        for (int v = 0; v < KV; ++v)
                            code[v] = S::template decodeFrag<BITS>(ws, 16 * h + 2 * BITS * pp, v);
#pragma GCC unroll 4
                        for (int i = 0; i < NR; ++i)
                        {
                            const typename S::F qd = S::set1(qs[i * D + ch]);
#pragma GCC unroll 2
                            for (int v = 0; v < KV; ++v)
                                acc[h % NA][i][v] = S::fma(qd, code[v], acc[h % NA][i][v]);
                        }
                    }
            }
        for (int i = 0; i < NR; ++i)
            for (int v = 0; v < KV; ++v)
                S::store(scores + int64_t(i) * scoreStride() + v * W,
                    NA == 2 ? S::add(acc[0][i][v], acc[NA - 1][i][v]) : acc[0][i][v]);
    }

    // Index of the first per-channel key scale / zero of head g's group at row r of physical block blk
    // (layout [block][Hkv][BS / G][D]; group sizes are powers of two, format.SUPPORTED_GROUP_SIZES).
    static int64_t keyScaleOffset(const Ctx& c, int g, int32_t blk, int r)
    {
        const int gShift = __builtin_ctz(c.G);
        return ((int64_t(blk) * c.Hkv + g) * (c.BS >> gShift) + (r >> gShift)) * D;
    }

    // Software prefetch (into L2) of head g's key group at row r of physical block blk: its scales, zeros and code
    // tiles. The hardware prefetchers see short streams (one (block, head) at a time) and start too late.
    // always_inline, as every prefetch helper here: GCC 12 treats a function whose only effects are __builtin_prefetch
    // as free of side effects and deletes its calls (the cddce1 pass; scoresPerChannel then holds no prefetch
    // instruction in any ISA; test_key_prefetch_is_compiled_in checks the build).
    template <int BITS>
    __attribute__((always_inline)) static inline void prefetchKeyGroup(const Ctx& c, int g, int32_t blk, int r)
    {
        const int64_t sOff = keyScaleOffset(c, g, blk, r);
        const int sb = dtypeBytes(c.scaleDtype);
        for (int i = 0; i < D * sb; i += 64)
        {
            __builtin_prefetch(static_cast<const char*>(c.kScale) + sOff * sb + i, 0, 2);
            __builtin_prefetch(static_cast<const char*>(c.kZero) + sOff * sb + i, 0, 2);
        }
        const char* w = reinterpret_cast<const char*>(c.kCodes
            + ((int64_t(blk) * c.Hkv + g) * (c.BS / 16) + r / 16) * (16 * D * BITS / 32));
        for (int i = 0; i < c.G * D * BITS / 8; i += 64)
            __builtin_prefetch(w + i, 0, 2);
    }

    // Software prefetch (into L2) of head g's key scales in physical block blk (all its groups: keyDigitScales reads
    // them before the block's first group is scored).
    __attribute__((always_inline)) static inline void prefetchKeyScales(const Ctx& c, int g, int32_t blk)
    {
        const int sb = dtypeBytes(c.scaleDtype);
        const char* p = static_cast<const char*>(c.kScale) + keyScaleOffset(c, g, blk, 0) * sb;
        for (int i = 0; i < c.BS / c.G * D * sb; i += 64)
            __builtin_prefetch(p + i, 0, 2);
    }

    // Software prefetch (into L2) of head g's values at rows [r, r + n) of physical block blk (whole tiles): codes,
    // scales, zeros. Issued with each key group (scoresPerChannel), so the values pass of the split finds them in L2;
    // not a whole block's at once: such a prefetch loop took 13% of splitPartial's samples (perf, Zen 4).
    __attribute__((always_inline)) static inline void prefetchValues(const Ctx& c, int g, int32_t blk, int r, int n)
    {
        const int64_t row0 = (int64_t(blk) * c.Hkv + g) * c.BS + r;
        const int wpt = D * c.vBits / 32; // words per token
        const char* w = reinterpret_cast<const char*>(c.vCodes + row0 * wpt);
        for (int64_t i = 0; i < int64_t(n) * wpt * 4; i += 64)
            __builtin_prefetch(w + i, 0, 2);
        const int64_t sb = dtypeBytes(c.scaleDtype) * (D / c.Gv);
        for (int64_t i = 0; i < n * sb; i += 64)
        {
            __builtin_prefetch(static_cast<const char*>(c.vScale) + row0 * sb + i, 0, 2);
            __builtin_prefetch(static_cast<const char*>(c.vZero) + row0 * sb + i, 0, 2);
        }
    }

    // fn(idx, n) over head g's value-scale entries of the quantized span [qa, qend), one run per block (n = tokens x
    // D / Gv entries from store index idx).
    template <class Fn>
    static void allValueScaleRuns(const Ctx& c, const SeqPlan& sp, int g, int qa, int qend, Fn fn)
    {
        const int ng = D / c.Gv;
        for (int t = qa; t < qend;)
        {
            const int jq = t - sp.sink;
            const int t1 = imin(qend, t + (c.BS - jq % c.BS));
            const int32_t blk = c.blockTable[int64_t(sp.seq) * c.maxBlocks + jq / c.BS];
            fn(((int64_t(blk) * c.Hkv + g) * c.BS + jq % c.BS) * ng, (t1 - t) * ng);
            t = t1;
        }
    }

    // kDOT8 paths (S's integer dot products; X defers the lookup of S's members to instantiation, which only the
    // ISAs with kDOT8 reach).
    // The key digit scales of head g for the groups at rows [r, r + n) of physical block blk (S::keyBlockScale over
    // their |scale| maxima); false (the fp32 path for these groups) if a scale or a row does not allow them.
    template <class X = S>
    static bool keyDigitScales(const Ctx& c, int g, int rows, int32_t blk, int r, int n, Scratch& s)
    {
        float* const smax = s.ksc; // ksc is free: the kDOT8 path loads the scales itself
        // the groups of rows [r, r + n) are consecutive in the store ([block][Hkv][BS / G][D])
        if (!X::template keyScaleMax<D>(c.kScale, keyScaleOffset(c, g, blk, r), (n + c.G - 1) / c.G, c.scaleDtype,
                smax))
            return false;
        for (int r0 = 0; r0 < rows; r0 += 4)
        {
            const float* qf = s.qf + r0 * D;
            float* qi = s.kqi + r0 * D;
            bool ok;
            switch (imin(4, rows - r0))
            {
            case 1: ok = X::template keyBlockScale<D, 1>(qf, smax, s.qmax + r0, qi, s.krec + r0); break;
            case 2: ok = X::template keyBlockScale<D, 2>(qf, smax, s.qmax + r0, qi, s.krec + r0); break;
            case 3: ok = X::template keyBlockScale<D, 3>(qf, smax, s.qmax + r0, qi, s.krec + r0); break;
            default: ok = X::template keyBlockScale<D, 4>(qf, smax, s.qmax + r0, qi, s.krec + r0); break;
            }
            if (!ok)
                return false;
        }
        return true;
    }

    // The digits of one key group (entry sOff of the scales / zeros) for every row (keyDigitScales was true).
    template <class X = S>
    static void keyPrepRows(const Ctx& c, int64_t sOff, int rows, Scratch& s)
    {
        for (int r0 = 0; r0 < rows; r0 += 4)
        {
            const float* qf = s.qf + r0 * D;
            const float* qi = s.kqi + r0 * D;
            int32_t* dig = s.kdig + r0 * kDOT8_DIGITS * D / 4;
            float* cz = s.cz + r0;
            switch (imin(4, rows - r0))
            {
            case 1: X::template keyPrep<D, 1>(qf, qi, c.kScale, c.kZero, sOff, c.scaleDtype, dig, cz); break;
            case 2: X::template keyPrep<D, 2>(qf, qi, c.kScale, c.kZero, sOff, c.scaleDtype, dig, cz); break;
            case 3: X::template keyPrep<D, 3>(qf, qi, c.kScale, c.kZero, sOff, c.scaleDtype, dig, cz); break;
            default: X::template keyPrep<D, 4>(qf, qi, c.kScale, c.kZero, sOff, c.scaleDtype, dig, cz); break;
            }
        }
    }

    template <int NR, class X = S>
    static void keyTileDot8(const int32_t* tw, const Scratch& s, int r0, float* sc)
    {
        X::template keyTileDot8<D, NR>(tw, s.kdig + r0 * kDOT8_DIGITS * D / 4, s.krec + r0, s.cz + r0, sc,
            scoreStride());
    }

    // Value digits' fixed-point scale per group, F = the largest value scale of the split's quantized tokens (p <= 1,
    // so F bounds every p_t * scale; the error bound stays relative to max |v|, as the tolerance is): s.vfix[gi] = F
    // 2^-22, s.vfix[4 + gi] = 2^22 / F. False (the fp32 path) for a negative or non-finite scale or a tiny F.
    template <class X = S>
    static bool valueDigitScales(const Ctx& c, const SeqPlan& sp, int g, int qa, int qend, Scratch& s)
    {
        const int ng = D / c.Gv;
        float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        typename X::MX mx = X::maxBitsInit(); // one vector over the runs, reduced once
        allValueScaleRuns(c, sp, g, qa, qend,
            [&](int64_t idx, int n) { X::maxBits(c.vScale, idx, n, c.scaleDtype, mx); });
        if (!X::groupMaxBits(mx, ng, c.scaleDtype, f))
            return false;
        for (int gi = 0; gi < ng; ++gi)
        {
            if (f[gi] != 0.0f && f[gi] < 1e-30f)
                return false;
            s.vfix[gi] = f[gi] * (1.0f / X::kFIX);
            s.vfix[4 + gi] = f[gi] == 0.0f ? 0.0f : X::kFIX / f[gi];
        }
        return true;
    }

    // acc += coef_t * code_t over the staged 2-bit span [qa, qend) as valuesAccumulate, from the digits valuesStage
    // wrote (valueDigitScales was true).
    template <class X = S>
    static void valuesAccumulateDot8(const Ctx& c, int rows, int qa, int qend, Scratch& s)
    {
        const int nt = (qend - qa) / 16;
        for (int j = 0; j < D / 32; ++j)
        {
            const int gi = 32 * j / c.Gv; // Gv >= 32: channels [32 j, 32 j + 32) lie in one value group
            // row blocks of RB: valueSpanDot8 makes one pass per 16-channel half (3 RB accumulators, no spill)
            for (int r0 = 0, nr; r0 < rows; r0 += nr)
            {
                const int32_t* dig[RB];
                nr = imin(RB, rows - r0);
                for (int i = 0; i < nr; ++i)
                    dig[i] = s.vdig + (r0 + i) * kDOT8_VALUE_DWORDS + gi * (kSPLIT_LEN / 16) * 16;
                float* acc = s.acc + r0 * D;
                const float rec = s.vfix[gi];
                switch (nr)
                {
                case 1: X::template valueSpanDot8<D, 1>(s.tw, nt, j, dig, rec, acc); break;
                case 2: X::template valueSpanDot8<D, 2>(s.tw, nt, j, dig, rec, acc); break;
                case 3: X::template valueSpanDot8<D, 3>(s.tw, nt, j, dig, rec, acc); break;
                default: X::template valueSpanDot8<D, 4>(s.tw, nt, j, dig, rec, acc); break;
                }
            }
        }
    }

    // The value digits (and zacc) of rows r0 .. r0 + nr of tiles [t0, t1) (one block from store entry idx;
    // valuesStage): S::valueCoefDigits. s.vexp: p holds the scores, the rows' p and their sum (into part's l) are
    // made there.
    template <class X = S>
    static void valueCoefDigitRows(const Ctx& c, int64_t idx, int nr, int ng, int qa, int t0, int t1, const float* p,
        int r0, Scratch& s)
    {
        int32_t* dig = s.vdig + int64_t(r0) * kDOT8_VALUE_DWORDS + (t0 - qa) / 16 * 16;
        float* zacc = s.zacc + r0 * 8;
        const int nt = (t1 - t0) / 16;
        float m[RB], l[RB];
        for (int i = 0; i < nr; ++i)
        {
            m[i] = s.part[(r0 + i) * (D + 2)];
            l[i] = 0.0f;
        }
#define KIVI_VCD(NR, NG, EXP)                                                                                         \
    X::template valueCoefDigits<NR, NG, EXP>(c.vScale, c.vZero, idx, c.scaleDtype, nt, p, scoreStride(),             \
        s.vfix + 4, zacc, dig, kDOT8_VALUE_DWORDS, m, l)
#define KIVI_VCD_E(NR, NG) (s.vexp ? KIVI_VCD(NR, NG, true) : KIVI_VCD(NR, NG, false))
#define KIVI_VCD_NG(NR) (ng == 1 ? KIVI_VCD_E(NR, 1) : ng == 2 ? KIVI_VCD_E(NR, 2) : KIVI_VCD_E(NR, 4))
        switch (nr)
        {
        case 1: KIVI_VCD_NG(1); break;
        case 2: KIVI_VCD_NG(2); break;
        case 3: KIVI_VCD_NG(3); break;
        default: KIVI_VCD_NG(4); break;
        }
#undef KIVI_VCD_NG
#undef KIVI_VCD_E
#undef KIVI_VCD
        if (s.vexp)
            for (int i = 0; i < nr; ++i)
                s.part[(r0 + i) * (D + 2) + 1] += l[i];
    }

    // Scores of per-channel quantized keys [t0, t0 + G) (positions; one group at row r of physical block blk) for
    // all rows; the next group (row r + G, or row 0 of block nextBlk if >= 0) is prefetched.
    template <int BITS>
    static void scoresPerChannel(const Ctx& c, int g, int rows, int32_t blk, int r, int32_t nextBlk, int t0, int a,
        Scratch& s)
    {
        constexpr int TILE_WORDS = 16 * D * BITS / 32;
        const int64_t sOff = keyScaleOffset(c, g, blk, r);
        if (r + c.G < c.BS)
            prefetchKeyGroup<BITS>(c, g, blk, r + c.G);
        else if (nextBlk >= 0)
            prefetchKeyGroup<BITS>(c, g, nextBlk, 0);
        prefetchValues(c, g, blk, r, c.G); // the group's values, for the split's value pass
        // locals: the intrinsics' stores may alias anything for the compiler, which would reload c and s each time
        const void* const kScale = c.kScale;
        const void* const kZero = c.kZero;
        const int32_t sDtype = c.scaleDtype;
        float* const ksc = s.ksc;
        float* const kzr = s.kzr;
        bool dot8 = false; // integer dot products (S::kDOT8, 2-bit keys) unless the block's scales or rows forbid them
        if constexpr (S::kDOT8 && BITS == 2)
        {
            dot8 = s.kdot8;
            if (dot8)
                keyPrepRows(c, sOff, rows, s);
        }
        for (int n = 0; n < NV && !dot8; ++n)
        {
            S::store(ksc + n * W, S::loadAct(kScale, sOff + n * W, sDtype));
            S::store(kzr + n * W, S::loadAct(kZero, sOff + n * W, sDtype));
        }
        // subnormal decode (S::kDENORMAL2: 2-bit keys, row blocks of 3, 2 or 1): qs carries keyScaleFactor per channel (exact,
        // a power of two); if a score comes out non-finite (a scaled qs overflowed, or q, a scale or a zero is not
        // finite) the group is scored again by the fp32 path, which gives the true result in every case
        bool dn = false;
        if constexpr (S::kDENORMAL2 && BITS == 2)
        {
            dn = !dot8;
            for (int n = 0; n < NV && dn; ++n)
                S::store(ksc + n * W, S::mul(S::load(ksc + n * W), S::set1(Dependent<S, BITS>::type::keyScaleFactor(n))));
        }
        const float* const qf = s.qf;
        float* const qsAll = s.qs;
        float* const czAll = s.cz;
        for (int row = 0; row < rows && !dot8; ++row)
        {
            const float* q = qf + row * D;
            float* qs = qsAll + row * D;
            typename S::F z = S::zero(), zb = S::zero(); // two chains for z: half the latency
            for (int n = 0; n < NV; ++n)
            {
                typename S::F qv = S::load(q + n * W);
                S::store(qs + n * W, S::mul(qv, S::load(ksc + n * W)));
                if (n & 1)
                    zb = S::fma(qv, S::load(kzr + n * W), zb);
                else
                    z = S::fma(qv, S::load(kzr + n * W), z);
            }
            czAll[row] = S::hsum(S::add(z, zb));
        }
        const int32_t* words = c.kCodes + (int64_t(blk) * c.Hkv + g) * int64_t(c.BS / 16) * TILE_WORDS;
        if constexpr (S::kDENORMAL2 && BITS == 2)
            if (dn)
            {
                using X = typename Dependent<S, BITS>::type;
                for (int t1 = t0; t1 < t0 + c.G; t1 += kK_TILE)
                {
                    transposeTile<BITS>(words + int64_t((r + t1 - t0) >> 4) * TILE_WORDS, s.tw);
                    for (int r0 = 0, nb; r0 < rows; r0 += nb)
                    {
                        float* sc = s.scores + int64_t(r0) * scoreStride() + (t1 - a);
                        nb = dnRowBlock(rows - r0);
                        if (nb == 3)
                            X::template keyTileDn<D, 3>(s.tw, s.qs + r0 * D, s.cz + r0, sc, scoreStride());
                        else if (nb == 2)
                            X::template keyTileDn<D, 2>(s.tw, s.qs + r0 * D, s.cz + r0, sc, scoreStride());
                        else
                            X::template keyTileDn<D, 1>(s.tw, s.qs + r0 * D, s.cz + r0, sc, scoreStride());
                    }
                }
                typename S::F bad = S::zero(); // sum of score * 0: NaN iff a score is not finite
                for (int row = 0; row < rows; ++row)
                    for (int t = 0; t < c.G; t += W)
                        bad = S::fma(S::load(s.scores + int64_t(row) * scoreStride() + (t0 - a) + t), S::zero(), bad);
                if (S::hsum(bad) == 0.0f)
                    return;
                for (int row = 0; row < rows; ++row) // plain qs for the fp32 path
                    for (int n = 0; n < NV; ++n)
                        S::store(qsAll + row * D + n * W,
                            S::mul(S::load(qf + row * D + n * W), S::loadAct(kScale, sOff + n * W, sDtype)));
            }
        for (int t1 = t0; t1 < t0 + c.G; t1 += kK_TILE)
        {
            const int32_t* tw = s.tw; // the tile's words, transposed
            transposeTile<BITS>(words + int64_t((r + t1 - t0) >> 4) * TILE_WORDS, s.tw);
            for (int r0 = 0; r0 < rows; r0 += RB)
            {
                const float* qs = s.qs + r0 * D;
                const float* cz = s.cz + r0;
                float* sc = s.scores + int64_t(r0) * scoreStride() + (t1 - a);
                if constexpr (S::kDOT8 && BITS == 2)
                    if (dot8)
                    {
                        switch (imin(RB, rows - r0))
                        {
                        case 1: keyTileDot8<1>(tw, s, r0, sc); break;
                        case 2: keyTileDot8<2>(tw, s, r0, sc); break;
                        case 3: keyTileDot8<3>(tw, s, r0, sc); break;
                        default: keyTileDot8<4>(tw, s, r0, sc); break;
                        }
                        continue;
                    }
                switch (imin(RB, rows - r0))
                {
                case 1: keyTile<BITS, 1>(tw, qs, cz, sc); break;
                case 2: keyTile<BITS, 2>(tw, qs, cz, sc); break;
                case 3: keyTile<BITS, 3>(tw, qs, cz, sc); break;
                default: keyTile<BITS, 4>(tw, qs, cz, sc); break;
                }
            }
        }
    }

    // Scores of one per-token quantized key (naive control): dequantize the row, then dot.
    template <int BITS>
    static void scorePerToken(const Ctx& c, const SeqPlan& sp, int g, int rows, int t, int a, Scratch& s)
    {
        constexpr int CPW = 32 / BITS;
        const int32_t jq = t - sp.sink; // store index (LINEAR order for per-token keys)
        const int32_t blk = c.blockTable[int64_t(sp.seq) * c.maxBlocks + jq / c.BS];
        const int32_t r = jq % c.BS;
        const int64_t rowIdx = (int64_t(blk) * c.Hkv + g) * c.BS + r;
        const int32_t* words = c.kCodes + rowIdx * (D / CPW);
        const int ng = D / c.Gv;
        for (int n = 0; n < NV; ++n)
        {
            int gi = n * W / c.Gv;
            float sc = loadScalar(c.kScale, rowIdx * ng + gi, c.scaleDtype);
            float zr = loadScalar(c.kZero, rowIdx * ng + gi, c.scaleDtype);
            S::store(s.kdeq + n * W, S::fma(S::template decode<BITS>(words, 1, n), S::set1(sc), S::set1(zr)));
        }
        for (int row = 0; row < rows; ++row)
        {
            typename S::F acc = S::zero();
            for (int n = 0; n < NV; ++n)
                acc = S::fma(S::load(s.qf + row * D + n * W), S::load(s.kdeq + n * W), acc);
            s.scores[int64_t(row) * scoreStride() + (t - a)] = S::hsum(acc);
        }
    }

    // NR rows x TT tokens of full-precision key scores; row-t dot products reduced together (hsum4).
    template <int NR, int TT, class RowOff>
    static void fullKeyBlock(const void* base, int32_t dtype, RowOff rowOff, const float* q, int t, float* scores)
    {
        typename S::F acc[NR][TT];
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < TT; ++j)
                acc[i][j] = S::zero();
        int64_t off[TT];
        for (int j = 0; j < TT; ++j)
            off[j] = rowOff(t + j);
        for (int n = 0; n < NV; ++n)
            for (int j = 0; j < TT; ++j)
            {
                const typename S::F kv = S::loadAct(base, off[j] + n * W, dtype);
                for (int i = 0; i < NR; ++i)
                    acc[i][j] = S::fma(S::load(q + i * D + n * W), kv, acc[i][j]);
            }
        for (int i = 0; i < NR; ++i)
        {
            float* sc = scores + int64_t(i) * scoreStride();
            if (TT == 4)
                S::hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sc);
            else
                for (int j = 0; j < TT; ++j)
                    sc[j] = S::hsum(acc[i][j]);
        }
    }

    // Full-precision rows are prefetched this many rows ahead (into L1): the hardware prefetchers restart at every 4 KiB
    // page and leave the FP16 op waiting on DRAM (distances 16-128 rows: 0.87-0.99x its time in 13 interleaved A/B
    // runs, 0.94x for this one; the quantized cache's window rows, 1.6% of its keys at 8K, gain less).
    static constexpr int kROW_PREFETCH = 32;

    template <class RowOff>
    __attribute__((always_inline)) static inline void prefetchRows(const void* base, int32_t dtype, RowOff rowOff,
        int t0, int t1)
    {
        const int eb = dtypeBytes(dtype);
        for (int t = t0; t < t1; ++t)
        {
            const char* p = static_cast<const char*>(base) + rowOff(t) * eb;
            for (int i = 0; i < D * eb; i += 64)
                __builtin_prefetch(p + i, 0, 3);
        }
    }

    // Scores of full-precision keys t in [t0, t1), row t at `base + rowOff(t)` in `dtype`.
    template <class RowOff>
    static void scoresFull(const void* base, int32_t dtype, RowOff rowOff, int rows, int t0, int t1, int a,
        Scratch& s)
    {
        for (int r0 = 0; r0 < rows; r0 += 3)
        {
            const int nr = imin(3, rows - r0);
            const float* q = s.qf + r0 * D;
            float* sc = s.scores + int64_t(r0) * scoreStride() - a;
            int t = t0;
            if (r0 == 0) // later row blocks find the rows in cache
                prefetchRows(base, dtype, rowOff, t0, imin(t1, t0 + kROW_PREFETCH));
            for (; t + 4 <= t1; t += 4)
            {
                if (r0 == 0)
                    prefetchRows(base, dtype, rowOff, imin(t1, t + kROW_PREFETCH), imin(t1, t + kROW_PREFETCH + 4));
                if (nr == 3)
                    fullKeyBlock<3, 4>(base, dtype, rowOff, q, t, sc + t);
                else if (nr == 2)
                    fullKeyBlock<2, 4>(base, dtype, rowOff, q, t, sc + t);
                else
                    fullKeyBlock<1, 4>(base, dtype, rowOff, q, t, sc + t);
            }
            for (; t < t1; ++t)
            {
                if (nr == 3)
                    fullKeyBlock<3, 1>(base, dtype, rowOff, q, t, sc + t);
                else if (nr == 2)
                    fullKeyBlock<2, 1>(base, dtype, rowOff, q, t, sc + t);
                else
                    fullKeyBlock<1, 1>(base, dtype, rowOff, q, t, sc + t);
            }
        }
    }

    // Full-precision values: a register block is NR <= QRB rows x NC vectors (12 accumulators). NC 4 instead of 2 x 4
    // rows halves the passes over the rows: the FP16 op 0.86x (SmolLM2) / 0.81x (Llama-3-8B) the time, interleaved
    // A/B (NC 8: 0.94x, spills).
    static constexpr int NC = 4;
    // Quantized values: a register block is NR <= QRB rows x 32 channels (2 blocks of 16). A 16-channel block
    // instead (6 accumulators, no spills on AVX2) measured no faster: the fma chains get shorter than the latency.
    static constexpr int VPB = 16 / W; // vectors per 16-channel block
    static constexpr int VNB = 2;      // 16-channel blocks per register block
    static constexpr int QRB = 3;      // rows per register block

    // acc[NR rows][channels 32 k .. 32 k + 32) += coef[row][(t - t0) ng] * code(t) over quantized values [t0, t1)
    // (positions; whole tiles). In FRAGMENT order a value token's channel pairs there are pi = 8 k + 2 e + par, e in [0, 4):
    // channels 16 (pi >> 2) + 8 par + gq of token 8 (e & 1) + 2 tq + h, in word j = pi / (16 / bits) of lane
    // (gq, tq) at position pi % (16 / bits) (independent of k since 16 / bits divides 8).
    // tw: the transposed tiles (transposeTile) of [t0, t1), consecutive; coef: the rows' entries of this block's value
    // group (row stride cs, token stride ng).
    template <int BITS, int NR>
    static void valueBlock(const int32_t* tw, int t0, int t1, int k, const float* coef, int ng, int64_t cs,
        float* acc)
    {
        constexpr int NW = D * BITS / 64, P = 16 / BITS, NA = VNB * VPB;
        constexpr int TILE_WORDS = 16 * D * BITS / 32;
        typename S::F a[NR][NA];
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < NA; ++j)
                a[i][j] = S::load(acc + i * D + 16 * VNB * k + j * W);
        for (int t = t0; t < t1; t += 16, tw += TILE_WORDS)
            for (int tq = 0; tq < 4; ++tq)
            {
                const float* cft = coef + (t - t0 + 2 * tq) * ng;
#pragma GCC unroll 4
                for (int e = 0; e < 2 * VNB; ++e)
                {
                    const int j = (4 * VNB * k + 2 * e) / P;       // word (runtime: the address only)
                    const int pp = (2 * e % P) / 2;             // compile-time position: constant shifts
                    const typename S::WS ws = S::loadWords(tw + 8 * (tq * NW + j));
#pragma GCC unroll 2
                    for (int h = 0; h < 2; ++h)
                    {
                        const int tok = 8 * (e & 1) + h; // + 2 tq
                        typename S::F cf[NR];
#pragma GCC unroll 4
                        for (int i = 0; i < NR; ++i)
                            cf[i] = S::set1(cft[i * cs + tok * ng]);
#pragma GCC unroll 2
                        for (int v = 0; v < VPB; ++v)
                        {
                            const typename S::F code = S::template decodeFrag<BITS>(ws, 16 * h + 2 * BITS * pp, v);
#pragma GCC unroll 4
                            for (int i = 0; i < NR; ++i)
                                a[i][(e >> 1) * VPB + v] = S::fma(cf[i], code, a[i][(e >> 1) * VPB + v]);
                        }
                    }
                }
            }
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < NA; ++j)
                S::store(acc + i * D + 16 * VNB * k + j * W, a[i][j]);
    }

    // coef[row][e] = p_t * scale[e] and zacc[row][gi] += sum_t p_t * zero[e] for NR rows over n store entries from idx
    // (token-major e = (t - t0) ng + gi): W consecutive entries take their p from W / ng tokens (S::spread), so scales
    // need no transpose. p, coef, zacc: row 0's (strides scoreStride, ng scoreStride, 8).
    // DN (S::kDENORMAL2): the coefficients carry S::valueTokenFactor of their token in the tile (idx is tile-aligned);
    // false if one of them is not finite (a scale near FLT_MAX / 2^100, inf or NaN, or p NaN). Else true.
    template <int NR, bool DN>
    static bool stageCoefs(const Ctx& c, int64_t idx, int n, int ng, const float* p, float* coef, float* zacc)
    {
        const void* const vScale = c.vScale; // locals: the stores below may alias c for the compiler
        const void* const vZero = c.vZero;
        const int32_t sDtype = c.scaleDtype;
        const int64_t cs = int64_t(ng) * scoreStride();
        const int ngShift = __builtin_ctz(ng); // e / ng without a division
        typename S::F z[NR];
        for (int i = 0; i < NR; ++i)
            z[i] = S::zero();
        typename S::F bad = S::zero(); // sum of coef * 0: NaN iff a coefficient is not finite (DN only)
        for (int e = 0; e < n; e += W)
        {
            typename S::F sc = S::loadAct(vScale, idx + e, sDtype);
            const typename S::F zr = S::loadAct(vZero, idx + e, sDtype);
            if constexpr (DN) // W entries: one token's half of the tile (W / ng tokens, aligned)
                sc = S::mul(sc, S::set1(Dependent<S, NR>::type::valueTokenFactor((e >> ngShift) & 15)));
            for (int i = 0; i < NR; ++i)
            {
                const typename S::F pv = S::spread(p + int64_t(i) * scoreStride() + (e >> ngShift), ng);
                const typename S::F cf = S::mul(pv, sc);
                S::store(coef + i * cs + e, cf);
                if constexpr (DN)
                    bad = S::fma(cf, S::zero(), bad);
                z[i] = S::fma(pv, zr, z[i]);
            }
        }
        for (int i = 0; i < NR; ++i)
        {
            float zl[W];
            S::store(zl, z[i]);
            for (int l = 0; l < W; ++l) // lane l holds group l % ng (ng in {1, 2, 4} divides W)
                zacc[i * 8 + (l & (ng - 1))] += zl[l];
        }
        return !DN || S::hsum(bad) == 0.0f;
    }

    // stageCoefs for a row block of nr (1..4) rows
    template <bool DN>
    static bool stageCoefRows(int nr, const Ctx& c, int64_t idx, int n, int ng, const float* p, float* coef,
        float* zacc)
    {
        switch (nr)
        {
        case 1: return stageCoefs<1, DN>(c, idx, n, ng, p, coef, zacc);
        case 2: return stageCoefs<2, DN>(c, idx, n, ng, p, coef, zacc);
        case 3: return stageCoefs<3, DN>(c, idx, n, ng, p, coef, zacc);
        default: return stageCoefs<4, DN>(c, idx, n, ng, p, coef, zacc);
        }
    }

    // Stage per-token quantized values t in [t0, t1) (whole tiles of one block) of the span starting at qa:
    // coef = p_t * scale per token and group, zacc += sum_t p_t * zero per group (added once at the end of the split),
    // and the transposed tiles. Every store byte of the values is read here (valuesAccumulate reads scratch only).
    // dot8 (S::kDOT8, valueDigitScales true): the rows' digits instead of coef (valueCoefDigitRows).
    // dn (S::kDENORMAL2): coefficients scaled for the subnormal decode; dnOk is cleared if one is not finite (then
    // the caller stages the span again without dn).
    template <int BITS>
    static void valuesStage(const Ctx& c, const SeqPlan& sp, int g, int rows, int qa, int t0, int t1, int a, Scratch& s,
        bool dot8, bool dn, bool& dnOk)
    {
        const int ng = D / c.Gv;
        const int jq = t0 - sp.sink; // store index; [t0, t1) lies in one block
        const int32_t blk = c.blockTable[int64_t(sp.seq) * c.maxBlocks + jq / c.BS];
        const int64_t idx = ((int64_t(blk) * c.Hkv + g) * c.BS + jq % c.BS) * ng;
        for (int r0 = 0; r0 < rows; r0 += RB) // each scale / zero vector converted once per RB rows
        {
            const float* p = s.scores + int64_t(r0) * scoreStride() + (t0 - a);
            float* cf = s.coef + int64_t(r0) * ng * scoreStride() + (t0 - qa) * ng;
            float* zacc = s.zacc + r0 * 8;
            const int nr = imin(RB, rows - r0), n = (t1 - t0) * ng;
            if constexpr (S::kDOT8 && BITS == 2) // the digits straight from p and the scales
                if (dot8)
                {
                    valueCoefDigitRows(c, idx, nr, ng, qa, t0, t1, p, r0, s);
                    continue;
                }
            if constexpr (S::kDENORMAL2 && BITS == 2) // stageCoefs<., true> exists only for these S
                if (dn)
                {
                    dnOk = stageCoefRows<true>(nr, c, idx, n, ng, p, cf, zacc) && dnOk;
                    continue;
                }
            stageCoefRows<false>(nr, c, idx, n, ng, p, cf, zacc);
        }
        constexpr int TILE_WORDS = 16 * D * BITS / 32;
        const int32_t* words = c.vCodes + (int64_t(blk) * c.Hkv + g) * int64_t(c.BS / 16) * TILE_WORDS
            + int64_t(jq % c.BS / 16) * TILE_WORDS;
        for (int t = t0; t < t1; t += 16, words += TILE_WORDS) // transpose every tile once (shared by all rows)
        {
            for (int i = 0; i < TILE_WORDS * 4; i += 64) // 4 tiles ahead (within the block's contiguous words)
                __builtin_prefetch(reinterpret_cast<const char*>(words + 4 * TILE_WORDS) + i, 0, 2);
            transposeTile<BITS>(words, s.tw + int64_t(t - qa) / 16 * TILE_WORDS);
        }
    }

    // acc += coef_t * code_t over the staged span [qa, qend) (valuesStage; the zero terms are in zacc). Reads scratch only.
    // dn: the coefficients were staged for the subnormal decode (valuesStage).
    template <int BITS>
    static void valuesAccumulate(const Ctx& c, int rows, int qa, int qend, Scratch& s, bool dn)
    {
        const int ng = D / c.Gv;
        const int64_t cs = int64_t(ng) * scoreStride();
        if constexpr (S::kDENORMAL2 && BITS == 2)
            if (dn) // row blocks of dnRowBlock
            {
                using X = typename Dependent<S, BITS>::type;
                const int nt = (qend - qa) / 16;
                for (int k = 0; k < D / 32; ++k)
                    for (int r0 = 0, nb; r0 < rows; r0 += nb)
                    {
                        const float* coef = s.coef + r0 * cs + 32 * k / c.Gv;
                        nb = dnRowBlock(rows - r0);
                        if (nb == 3)
                            X::template valueBlockDn<D, 3>(s.tw, nt, k, coef, ng, cs, s.acc + r0 * D);
                        else if (nb == 2)
                            X::template valueBlockDn<D, 2>(s.tw, nt, k, coef, ng, cs, s.acc + r0 * D);
                        else
                            X::template valueBlockDn<D, 1>(s.tw, nt, k, coef, ng, cs, s.acc + r0 * D);
                    }
                return;
            }
        for (int k = 0; k < D / (16 * VNB); ++k)
        {
            const int gi = 16 * VNB * k / c.Gv; // the value group of these channels (Gv >= 32 >= 16 VNB)
            for (int r0 = 0; r0 < rows; r0 += QRB)
            {
                const float* coef = s.coef + r0 * cs + gi;
                float* acc = s.acc + r0 * D;
                switch (imin(QRB, rows - r0))
                {
                case 1: valueBlock<BITS, 1>(s.tw, qa, qend, k, coef, ng, cs, acc); break;
                case 2: valueBlock<BITS, 2>(s.tw, qa, qend, k, coef, ng, cs, acc); break;
                default: valueBlock<BITS, 3>(s.tw, qa, qend, k, coef, ng, cs, acc); break;
                }
            }
        }
    }

    template <int NR, class RowOff>
    static void fullValueBlock(const void* base, int32_t dtype, RowOff rowOff, int t0, int t1, int n0,
        const float* p, float* acc, bool prefetch)
    {
        if (prefetch)
            prefetchRows(base, dtype, rowOff, t0, imin(t1, t0 + kROW_PREFETCH));
        typename S::F a[NR][NC];
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < NC; ++j)
                a[i][j] = S::load(acc + i * D + (n0 + j) * W);
        for (int t = t0; t < t1; ++t)
        {
            if (prefetch && t + kROW_PREFETCH < t1)
                prefetchRows(base, dtype, rowOff, t + kROW_PREFETCH, t + kROW_PREFETCH + 1);
            const int64_t off = rowOff(t);
            typename S::F vv[NC];
            for (int j = 0; j < NC; ++j)
                vv[j] = S::loadAct(base, off + (n0 + j) * W, dtype);
            for (int i = 0; i < NR; ++i)
            {
                const typename S::F pt = S::set1(p[int64_t(i) * scoreStride() + t]);
                for (int j = 0; j < NC; ++j)
                    a[i][j] = S::fma(pt, vv[j], a[i][j]);
            }
        }
        for (int i = 0; i < NR; ++i)
            for (int j = 0; j < NC; ++j)
                S::store(acc + i * D + (n0 + j) * W, a[i][j]);
    }

    template <class RowOff>
    static void valuesFull(const void* base, int32_t dtype, RowOff rowOff, int rows, int t0, int t1, int a,
        Scratch& s)
    {
        for (int n0 = 0; n0 < NV; n0 += NC)
            for (int r0 = 0; r0 < rows; r0 += QRB)
            {
                const float* p = s.scores + int64_t(r0) * scoreStride() - a;
                float* acc = s.acc + r0 * D;
                const bool pf = n0 == 0 && r0 == 0; // the first pass over the rows
                switch (imin(QRB, rows - r0))
                {
                case 1: fullValueBlock<1>(base, dtype, rowOff, t0, t1, n0, p, acc, pf); break;
                case 2: fullValueBlock<2>(base, dtype, rowOff, t0, t1, n0, p, acc, pf); break;
                default: fullValueBlock<3>(base, dtype, rowOff, t0, t1, n0, p, acc, pf); break;
                }
            }
    }

    // acc (+ zacc) of head g's rows over the quantized span [qa, qend) of a split (block by block; s: the head's
    // scratch, its transposed tiles, coefficients and value digits in buf's).
    static void valuesOfHead(const Ctx& c, const SeqPlan& sp, int g, int rows, int qa, int qend, int a, Scratch& s,
        const Scratch& buf)
    {
        int32_t* const ownTw = s.tw;
        int32_t* const ownVdig = s.vdig;
        float* const ownCoef = s.coef;
        s.tw = buf.tw;
        s.vdig = buf.vdig;
        s.coef = buf.coef;
        auto blockEnd = [&](int t) { return imin(qend, t + (c.BS - (t - sp.sink) % c.BS)); };
        // integer dot products for 2-bit values (S::kDOT8) unless the scales do not allow them (decided in
        // splitPartial, before the softmax); the subnormal decode (S::kDENORMAL2) for 2-bit values unless a
        // coefficient is not finite
        const bool dot8 = s.vdot8;
        bool dn = S::kDENORMAL2 && c.vBits == 2, dnOk = true;
        for (int t = qa; t < qend; t = blockEnd(t))
            switch (c.vBits)
            {
            case 2: valuesStage<2>(c, sp, g, rows, qa, t, blockEnd(t), a, s, dot8, dn, dnOk); break;
            case 4: valuesStage<4>(c, sp, g, rows, qa, t, blockEnd(t), a, s, false, false, dnOk); break;
            default: valuesStage<8>(c, sp, g, rows, qa, t, blockEnd(t), a, s, false, false, dnOk); break;
            }
        // a coefficient too large for the subnormal decode or a NaN one: the whole span again, fp32
        if (dn && !dnOk)
        {
            dn = false;
            for (int i = 0; i < rows * 8; ++i)
                s.zacc[i] = 0.0f;
            for (int t = qa; t < qend; t = blockEnd(t))
                valuesStage<2>(c, sp, g, rows, qa, t, blockEnd(t), a, s, false, false, dnOk);
        }
        if constexpr (S::kDOT8)
            if (dot8)
                valuesAccumulateDot8(c, rows, qa, qend, s);
        if (!dot8)
        {
            switch (c.vBits)
            {
            case 2: valuesAccumulate<2>(c, rows, qa, qend, s, dn); break;
            case 4: valuesAccumulate<4>(c, rows, qa, qend, s, false); break;
            default: valuesAccumulate<8>(c, rows, qa, qend, s, false); break;
            }
        }
        for (int row = 0; row < rows; ++row)
            for (int n = 0; n < NV; ++n) // Gv >= 32 >= W: a vector lies in one value group
                S::store(s.acc + row * D + n * W,
                    S::add(S::load(s.acc + row * D + n * W), S::set1(s.zacc[row * 8 + n * W / c.Gv])));
        s.tw = ownTw;
        s.vdig = ownVdig;
        s.coef = ownCoef;
    }

    // The partials (m, l, acc[D]) of every row of a tile over split `split` for KV heads [g0, g1), into hs[g - g0].part.
    // Quantized keys are read block by block and, within a block, head by head: the store keeps a block's heads
    // adjacent ([block][Hkv][...]), so every buffer is walked forward (one head at a time read 2 KB pieces Hkv apart:
    // measured 16% slower); the key groups prefetch the values into L2, which are then staged and summed head
    // by head (step 3). A head's arithmetic does not depend on g0, g1 (decode passes every head, prefill tiles one),
    // so the bits do not either.
    static void splitPartial(const Ctx& c, const SeqPlan& sp, int g0, int g1, int pos0, int npos, int split,
        Scratch* hs)
    {
        const int rows = npos * c.grp;
        const int a = splitStart(split, c.sinks);
        const int lastPos = sp.past + pos0 + npos - 1;
        const int b = imin(imin(splitStart(split + 1, c.sinks), sp.nKeys), lastPos + 1);
        // positions: sinks [0, sink), quantized [sink, qEnd) (store index t - sink), ring [qEnd, past), chunk
        const int qEnd = sp.sink + sp.nq;
        const int qa = imax(a, sp.sink), qend = imin(b, qEnd); // quantized keys of this split (whole tiles)
        auto blockEnd = [&](int t) { return imin(qend, t + (c.BS - (t - sp.sink) % c.BS)); };
        // 1. scores of keys [a, b)
        if (qa < qend)
        {
            if (c.keyGrouping == 0)
            {
                // The window's ring rows [sink + nq, past) are read by the split that holds them, at the rate of
                // the fill buffers (the fp16 op's rate: 5-6% of KIVI-2's time at 8K); the kWINDOW_LEAD splits before
                // it prefetch them into L2, a share per key group call, so that read overlaps their quantized work.
                const int wa = sp.sink + sp.nq, wsplit = numSplitsOf(wa + 1, c.sinks) - 1;
                const int lead = imin(kWINDOW_LEAD, wsplit), calls = (g1 - g0) * (kSPLIT_LEN / c.G);
                const bool pfWin = sp.past > wa && split < wsplit && split >= wsplit - lead;
                int call = (split - (wsplit - lead)) * calls;
                for (int t = qa; t < qend; t = blockEnd(t))
                {
                    // the block lookups once per block (divisions by the run-time block size)
                    const int jb = (t - sp.sink) / c.BS, r0 = (t - sp.sink) % c.BS;
                    const int tEnd = imin(qend, t + c.BS - r0); // = blockEnd(t)
                    const int32_t* row = c.blockTable + int64_t(sp.seq) * c.maxBlocks;
                    const int32_t nextBlk = (jb + 1) * c.BS < sp.nq ? row[jb + 1] : -1;
                    if constexpr (S::kDOT8) // one key digit scale per block and row (S::keyBlockScale)
                        if (c.kBits == 2)
                            for (int g = g0; g < g1; ++g)
                            {
                                if (nextBlk >= 0)
                                    prefetchKeyScales(c, g, nextBlk);
                                hs[g - g0].kdot8 = keyDigitScales(c, g, rows, row[jb], r0, tEnd - t, hs[g - g0]);
                            }
                    for (int g = g0; g < g1; ++g)
                        for (int t0 = t; t0 < tEnd; t0 += c.G)
                        {
                            if (pfWin)
                                prefetchWindowShare(c, sp, g0, g1, wa, sp.past, call++, lead * calls);
                            const int r = r0 + (t0 - t);
                            switch (c.kBits)
                            {
                            case 2: scoresPerChannel<2>(c, g, rows, row[jb], r, nextBlk, t0, a, hs[g - g0]); break;
                            case 4: scoresPerChannel<4>(c, g, rows, row[jb], r, nextBlk, t0, a, hs[g - g0]); break;
                            default: scoresPerChannel<8>(c, g, rows, row[jb], r, nextBlk, t0, a, hs[g - g0]); break;
                            }
                        }
                }
            }
            else
            {
                for (int g = g0; g < g1; ++g)
                    for (int t = qa; t < qend; ++t)
                    {
                        switch (c.kBits)
                        {
                        case 2: scorePerToken<2>(c, sp, g, rows, t, a, hs[g - g0]); break;
                        case 4: scorePerToken<4>(c, sp, g, rows, t, a, hs[g - g0]); break;
                        default: scorePerToken<8>(c, sp, g, rows, t, a, hs[g - g0]); break;
                        }
                    }
            }
        }
        for (int g = g0; g < g1; ++g)
        {
            Scratch& s = hs[g - g0];
            forFullRows(c, sp, g, a, b, true, [&](const void* base, int32_t dtype, auto rowOff, int t0, int t1) {
                scoresFull(base, dtype, rowOff, rows, t0, t1, a, s);
            });
            // 2-bit values' integer dot products (S::kDOT8) unless the scales do not allow them; then the quantized
            // span's exp is made with the digits (valueCoefDigits) where the span starts on a vector of the scores
            // (always but in split 0 with a sink count that is not a multiple of W)
            s.vdot8 = false;
            if constexpr (S::kDOT8)
                if (c.vBits == 2 && qa < qend)
                    s.vdot8 = valueDigitScales(c, sp, g, qa, qend, s);
            s.vexp = s.vdot8 && (qa - a) % W == 0;
            softmaxRows(c, sp, pos0, rows, a, b, s.vexp ? qa - a : 0, s.vexp ? qend - a : 0, s);
            for (int row = 0; row < rows; ++row) // vector stores: a scalar loop becomes rep stos, slow to start
            {
                for (int n = 0; n < NV; ++n)
                    S::store(s.acc + row * D + n * W, S::zero());
                for (int i = 0; i < 8; ++i)
                    s.zacc[row * 8 + i] = 0.0f;
            }
        }
        // 3. acc = sum_t p_t v_t, head by head: a head's staged span (transposed tiles, digits) is accumulated while it
        // is in L1, and every head stages into the first head's buffers (staging all heads first wrote a split-long
        // array per head: a write miss per store, 0.9x the op's time on an Intel Xeon). The values were prefetched
        // into L2 with the keys (scoresPerChannel).
        if (qa < qend)
            for (int g = g0; g < g1; ++g)
                valuesOfHead(c, sp, g, rows, qa, qend, a, hs[g - g0], hs[0]);
        for (int g = g0; g < g1; ++g)
        {
            Scratch& s = hs[g - g0];
            forFullRows(c, sp, g, a, b, false, [&](const void* base, int32_t dtype, auto rowOff, int t0, int t1) {
                valuesFull(base, dtype, rowOff, rows, t0, t1, a, s);
            });
            for (int row = 0; row < rows; ++row)
            {
                float* part = s.part + row * (D + 2);
                for (int d = 0; d < D; ++d)
                    part[2 + d] = s.acc[row * D + d];
            }
        }
    }

    // The full-precision keys (keys) or values of positions [a, b) of head g: fn(base, dtype, rowOff, t0, t1) per
    // range, row t at base + rowOff(t). Dense cache: every row; else sinks and ring rows from the window, the chunk's
    // own rows from k / v.
    template <class Fn>
    __attribute__((always_inline)) static inline void forFullRows(const Ctx& c, const SeqPlan& sp, int g, int a, int b,
        bool keys, Fn fn)
    {
        const int64_t headRow = int64_t(sp.slot) * c.Hkv + g;
        const void* const win = keys ? c.kWin : c.vWin;
        if (c.dense)
        {
            fn(win, c.cacheDtype, [&](int t) { return (headRow * c.maxSeqLen + t) * D; }, a, b);
            return;
        }
        auto winOff = [&](int t) { return windowOffset(c, sp, g, t); };
        const int sinkEnd = imin(b, sp.sink);
        const int winStart = imax(a, sp.sink + sp.nq), winEnd = imin(b, sp.past);
        const int chStart = imax(a, sp.past);
        if (a < sinkEnd)
            fn(win, c.actDtype, winOff, a, sinkEnd);
        if (winStart < winEnd)
            fn(win, c.actDtype, winOff, winStart, winEnd);
        if (chStart < b)
            fn(keys ? c.k : c.v, c.actDtype,
                [&](int t) { return (int64_t(sp.tokOffset + t - sp.past) * c.Hkv + g) * D; }, chStart, b);
    }

    // Element offset of position t's row of head g in the window buffers (sinks, then the ring).
    static int64_t windowOffset(const Ctx& c, const SeqPlan& sp, int g, int t)
    {
        return ((int64_t(sp.slot) * c.Hkv + g) * c.winRows + windowRowOf(t, c.sinks, c.W)) * D;
    }

    // Software prefetch (into L2) of share `part` of `parts` of the window's key and value rows of positions [a, b)
    // (ring rows) of heads [g0, g1).
    __attribute__((always_inline)) static inline void prefetchWindowShare(const Ctx& c, const SeqPlan& sp, int g0,
        int g1, int a, int b, int part, int parts)
    {
        const int n = (g1 - g0) * (b - a), eb = dtypeBytes(c.actDtype), i1 = int(int64_t(n) * (part + 1) / parts);
        const int i0 = int(int64_t(n) * part / parts);
        int g = g0 + i0 / (b - a), t = a + i0 % (b - a); // row i = (g - g0) (b - a) + t - a: divided once per call
        for (int i = i0; i < i1; ++i)
        {
            const int64_t off = windowOffset(c, sp, g, t);
            for (int kv = 0; kv < 2; ++kv)
            {
                const char* p = static_cast<const char*>(kv == 0 ? c.kWin : c.vWin) + off * eb;
                for (int j = 0; j < D * eb; j += 64)
                    __builtin_prefetch(p + j, 0, 2);
            }
            if (++t == b)
            {
                t = a;
                ++g;
            }
        }
    }

    // 2. softmax numerators per row over its causal range [a, min(b, pos + 1)); p = 0 elsewhere; (m, l) into s.part.
    // Scores [sa, se) (relative to a, multiples of W; the quantized span when s.vexp) count in m but keep their
    // values: their p are made with the value digits, which add their sum to l (valueCoefDigitRows). Quantized keys
    // precede every row's position, so those rows are never masked.
    static void softmaxRows(const Ctx& c, const SeqPlan& sp, int pos0, int rows, int a, int b, int sa, int se,
        Scratch& s)
    {
        const int span = b - a;
        const int spanPad = (span + W - 1) / W * W;
        for (int row = 0; row < rows; ++row)
        {
            float* sc = s.scores + int64_t(row) * scoreStride();
            const int pos = sp.past + pos0 + row / c.grp;
            const int valid = imax(0, imin(b, pos + 1) - a);
            for (int t = valid; t < spanPad; ++t)
                sc[t] = -__builtin_inff();
            float* part = s.part + row * (D + 2);
            if (valid == 0)
            {
                for (int t = 0; t < spanPad; ++t)
                    sc[t] = 0.0f;
                part[0] = -__builtin_inff();
                part[1] = 0.0f;
                continue;
            }
            // two chains for the max and the sum (spanPad is a multiple of W, not of 2 W): half the latency
            typename S::F mv = S::set1(-__builtin_inff()), mv2 = mv;
            int t = 0;
            for (; t + 2 * W <= spanPad; t += 2 * W)
            {
                mv = S::max(mv, S::load(sc + t));
                mv2 = S::max(mv2, S::load(sc + t + W));
            }
            if (t < spanPad)
                mv = S::max(mv, S::load(sc + t));
            const float m = S::hmax(S::max(mv, mv2));
            const typename S::F msub = S::set1(m);
            typename S::F lv = S::zero(), lv2 = S::zero();
            auto expRange = [&](int t0, int t1) {
                for (t = t0; t + 2 * W <= t1; t += 2 * W)
                {
                    const typename S::F p = S::exp(S::sub(S::load(sc + t), msub));
                    const typename S::F p2 = S::exp(S::sub(S::load(sc + t + W), msub));
                    S::store(sc + t, p);
                    S::store(sc + t + W, p2);
                    lv = S::add(lv, p);
                    lv2 = S::add(lv2, p2);
                }
                if (t < t1)
                {
                    const typename S::F p = S::exp(S::sub(S::load(sc + t), msub));
                    S::store(sc + t, p);
                    lv = S::add(lv, p);
                }
            };
            if (sa < se)
            {
                expRange(0, sa);
                expRange(se, spanPad);
            }
            else
                expRange(0, spanPad);
            part[0] = m;
            part[1] = S::hsum(S::add(lv, lv2));
        }
    }

    // state = merge(state, part) for `rows` rows (left to right; the first partial is copied).
    static void merge(float* state, const float* part, int rows, bool first)
    {
        for (int row = 0; row < rows; ++row)
        {
            float* st = state + row * (D + 2);
            const float* pt = part + row * (D + 2);
            if (first)
            {
                for (int i = 0; i < D + 2; ++i)
                    st[i] = pt[i];
                continue;
            }
            if (pt[0] == -__builtin_inff()) // empty partial (split past this row's position)
                continue;
            if (st[0] == -__builtin_inff())
            {
                for (int i = 0; i < D + 2; ++i)
                    st[i] = pt[i];
                continue;
            }
            const float m = st[0] > pt[0] ? st[0] : pt[0];
            const float x = expScalar(st[0] - m), y = expScalar(pt[0] - m);
            st[0] = m;
            st[1] = st[1] * x + pt[1] * y;
            for (int d = 0; d < D; ++d)
                st[2 + d] = st[2 + d] * x + pt[2 + d] * y;
        }
    }

    static void writeOut(const Ctx& c, const SeqPlan& sp, int g, int pos0, int npos, const float* state)
    {
        for (int i = 0; i < npos; ++i)
            for (int j = 0; j < c.grp; ++j)
            {
                const float* st = state + (i * c.grp + j) * (D + 2);
                const float l = st[1]; // divide (not multiply by 1/l), like softmax's normalization
                const int64_t off = (int64_t(sp.tokOffset + pos0 + i) * c.H + g * c.grp + j) * D;
                for (int d = 0; d < D; ++d)
                    storeScalar(c.out, off + d, c.actDtype, st[2 + d] / l);
            }
    }

    static float* partialAt(const Ctx& c, const SeqPlan& sp, int g, int split)
    {
        const int64_t rows = int64_t(sp.chunk) * c.grp;
        return c.partials + sp.partialBase + (int64_t(g) * sp.numSplits + split) * rows * (D + 2);
    }

    static void attendItem(const Ctx& c, const WorkItem& it, float* scratch)
    {
        if constexpr (S::kDENORMAL2) // subnormal codes: DAZ off for the item (kiviCpuDenormal2.h)
        {
            using X = typename Dependent<S, D>::type;
            const uint32_t csr = X::clearDaz();
            attendItemBody(c, it, scratch);
            X::restoreCsr(csr);
        }
        else
            attendItemBody(c, it, scratch);
    }

    static void attendItemBody(const Ctx& c, const WorkItem& it, float* scratch)
    {
        const SeqPlan& sp = c.seqs[it.seqIdx];
        const int pos0 = it.qTile * kQ_TILE;
        const int npos = imin(kQ_TILE, sp.chunk - pos0);
        const int rows = npos * c.grp;
        if (it.split >= 0) // one split of heads [kvHead, kvHead + numHeads), headsPerPass at a time; partials stored
        {
            Scratch hs[kMAX_HEADS_PER_PASS];
            const int pass = headsPerPass(rows, c.Hkv, D), gEnd = it.kvHead + it.numHeads;
            for (int g0 = it.kvHead; g0 < gEnd; g0 += pass)
            {
                const int g1 = imin(gEnd, g0 + pass);
                for (int g = g0; g < g1; ++g)
                {
                    hs[g - g0] = carve(scratch + (g - g0) * scratchFloats(rows, D), rows);
                    loadQ(c, sp, g, pos0, npos, hs[g - g0].qf, hs[g - g0].qmax);
                }
                splitPartial(c, sp, g0, g1, pos0, npos, it.split, hs);
                for (int g = g0; g < g1; ++g)
                {
                    float* dst = partialAt(c, sp, g, it.split);
                    for (int i = 0; i < rows * (D + 2); ++i)
                        dst[i] = hs[g - g0].part[i];
                }
            }
            return;
        }
        Scratch s = carve(scratch, rows);
        loadQ(c, sp, it.kvHead, pos0, npos, s.qf, s.qmax);
        const int lastPos = sp.past + pos0 + npos - 1;
        const int nSplits = numSplitsOf(lastPos + 1, c.sinks); // splits starting at or before the last position
        for (int j = 0; j < nSplits; ++j)
        {
            splitPartial(c, sp, it.kvHead, it.kvHead + 1, pos0, npos, j, &s);
            merge(s.state, s.part, rows, j == 0);
        }
        writeOut(c, sp, it.kvHead, pos0, npos, s.state);
    }

    static void mergeItem(const Ctx& c, const WorkItem& it, float* scratch)
    {
        const SeqPlan& sp = c.seqs[it.seqIdx];
        const int rows = sp.chunk * c.grp;
        Scratch s = carve(scratch, rows);
        for (int j = 0; j < sp.numSplits; ++j)
            merge(s.state, partialAt(c, sp, it.kvHead, j), rows, j == 0);
        writeOut(c, sp, it.kvHead, 0, sp.chunk, s.state);
    }
};

static void attendItem(const Ctx& c, const WorkItem& it, float* scratch)
{
    if (c.D == 64)
        Attn<64>::attendItem(c, it, scratch);
    else
        Attn<128>::attendItem(c, it, scratch);
}

static void mergeItem(const Ctx& c, const WorkItem& it, float* scratch)
{
    if (c.D == 64)
        Attn<64>::mergeItem(c, it, scratch);
    else
        Attn<128>::mergeItem(c, it, scratch);
}

} // namespace kernel
