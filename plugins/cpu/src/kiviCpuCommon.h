// Internal types shared by the dispatcher (kiviCpuAttention.cpp) and the per-ISA kernel translation units.
// Plain data and internal-linkage (static) helpers only: the ISA units are compiled with different -m flags, so no
// inline function with external linkage may be shared between them (the linker would keep one copy for all paths).
#pragma once
#include "kiviCpuApi.h"
#include <cstdint>
#include <cstring>

namespace trtllm_kivi
{
namespace cpu
{

constexpr int32_t kSPLIT_LEN = 512; // keys per log-sum-exp split; a multiple of every block/group/tile size
constexpr int32_t kMAX_SINKS = 128; // format.MAX_SINK_TOKENS: split 0 is [0, S + kSPLIT_LEN), so it holds the sinks
constexpr int32_t kSCORE_STRIDE = kSPLIT_LEN + kMAX_SINKS + 16; // floats per scratch row of one split's keys
constexpr int32_t kQ_TILE = 8;      // query positions per work item in chunked prefill
constexpr int32_t kK_TILE = 16;     // quantized keys decoded per step: one 16-token fragment tile (format.py)
// softmax exp (kernel::expScalar, S::exp): below kEXP_LO the result is 0; expScalar and the portable / AVX2 S::exp
// clamp to [kEXP_LO, kEXP_HI] and round x log2 e by adding kEXP_SHIFTER = 1.5 * 2^23 (the integer lands in the low
// mantissa bits)
constexpr float kEXP_LO = -87.33654f, kEXP_HI = 80.0f, kEXP_SHIFTER = 12582912.0f;

// Key splits (fixed, so results do not depend on threads or batch): split 0 = [0, S + kSPLIT_LEN), split j >= 1 =
// [S + j kSPLIT_LEN, S + (j + 1) kSPLIT_LEN). Their quantized parts start at store index j kSPLIT_LEN: whole tiles.
static inline int32_t splitStart(int32_t j, int32_t sinks)
{
    return j == 0 ? 0 : sinks + j * kSPLIT_LEN;
}

// Window row of token t (format.py; kiviFormat.h's windowRow, restated with internal linkage for the ISA units).
static inline int64_t windowRowOf(int64_t t, int32_t sinks, int32_t ringRows)
{
    return t < sinks ? t : sinks + (t - sinks) % ringRows;
}

// Splits before the one holding the window's ring rows that prefetch them (kernel::Attn::prefetchWindowShare)
constexpr int32_t kWINDOW_LEAD = 4;

// Splits that hold keys [0, n) (at least 1).
static inline int32_t numSplitsOf(int32_t n, int32_t sinks)
{
    return n <= sinks + kSPLIT_LEN ? 1 : (n - sinks + kSPLIT_LEN - 1) / kSPLIT_LEN;
}

// One sequence of the step, as the kernels see it.
struct SeqPlan
{
    int32_t seq;       // index in the batch (block-table row)
    int32_t slot;      // window / dense slot
    int32_t past;      // s
    int32_t chunk;     // c = e - s (> 0)
    int32_t tokOffset; // first row of the sequence in q/k/v/out
    int32_t sink;      // min(S, s): full-precision sink keys [0, sink) at window rows [0, sink)
    int32_t nq;        // n_q(s): quantized keys [sink, sink + nq) at store index t - sink (0 for the dense cache)
    int32_t nKeys;     // s + c
    int32_t numSplits; // numSplitsOf(nKeys, S)
    int32_t numQTiles; // ceil(c / kQ_TILE)
    int32_t parallel;  // 1: one work item per split, partials merged afterwards; 0: one item runs every split
    int64_t partialBase; // float offset of this sequence's partials (parallel only)
};

// Everything a kernel needs, resolved once per step.
struct Ctx
{
    bool dense;
    int32_t H, Hkv, D, grp;
    int32_t kBits, vBits, G, Gv, BS, R, W, sinks, winRows, keyGrouping, scaleDtype, actDtype, cacheDtype, maxBlocks, maxSeqLen;
    float smScale; // 1 / sqrt(D)
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int32_t* blockTable;
    const int32_t* kCodes;
    const void* kScale;
    const void* kZero;
    const int32_t* vCodes;
    const void* vScale;
    const void* vZero;
    const void* kWin; // KIVI windows, or the dense caches
    const void* vWin;
    const SeqPlan* seqs;
    float* partials; // [sum over parallel seqs of Hkv * numSplits * rowsPerTile * (D + 2)]
};

struct WorkItem
{
    // split >= 0 (decode): that split of KV heads [kvHead, kvHead + numHeads), partials stored; split < 0: every
    // split of head kvHead's query tile qTile in order, output written
    int32_t seqIdx, kvHead, qTile, split, numHeads;
};

// A decode work item computes one split of as many KV heads at a time as fit this much scratch (3/4 of a 512 KiB L2;
// one scratch per head, at most kMAX_HEADS_PER_PASS): SmolLM2 (91 KiB per head) passes all 3, Llama-3-8B's geometry
// (147 KiB) 2 of its 8 (all 8 measured 5% slower: their scratch spills the L2).
constexpr int64_t kPASS_SCRATCH_FLOATS = 96 * 1024;
constexpr int32_t kMAX_HEADS_PER_PASS = 8;

// Per-thread scratch sizes (floats) for a tile of `rows` query rows.
// Integer dot-product paths (S::kDOT8): fixed-point digits per operand, and the dwords of one row's value digits
// ([4 value groups at most][a split's tiles][16]: the digits' 4 token quads, padded to 64 bytes).
constexpr int32_t kDOT8_DIGITS = 3;
constexpr int32_t kDOT8_VALUE_DWORDS = 4 * (kSPLIT_LEN / 16) * 16;

static inline int64_t scratchFloats(int32_t rows, int32_t D)
{
    // + the transposed fragment tiles of one split's quantized span (at most 8-bit codes: 4 D words per tile)
    // + per row: key and value digits, their scales, q scaled for the key digits and max |q| (kDOT8 paths)
    return int64_t(rows) * (6 * D + 5 * kSCORE_STRIDE + 64) + 4 * kSCORE_STRIDE + 8 * D + 256
        + int64_t(kSPLIT_LEN / 16) * 4 * D + 64 + int64_t(rows) * (kDOT8_DIGITS * D / 4 + kDOT8_VALUE_DWORDS + 1) + 8
        + int64_t(rows) * (D + 1);
}

// KV heads per pass of a decode work item whose rows (chunk x grp) take scratchFloats(rows, D) each.
static inline int32_t headsPerPass(int32_t rows, int32_t Hkv, int32_t D)
{
    int64_t n = kPASS_SCRATCH_FLOATS / scratchFloats(rows, D);
    n = n < Hkv ? n : Hkv;
    n = n < kMAX_HEADS_PER_PASS ? n : kMAX_HEADS_PER_PASS;
    return n < 1 ? 1 : int32_t(n);
}

// Per-thread scratch (floats): a prefill tile (kQ_TILE positions, one head) or a decode pass (headsPerPass heads).
static inline int64_t scratchFloatsPerThread(int32_t grp, int32_t D)
{
    const int64_t tile = scratchFloats(kQ_TILE * grp, D);
    return tile > kPASS_SCRATCH_FLOATS ? tile : kPASS_SCRATCH_FLOATS;
}

// ------------------------------------------------------------------------------------ exact scalar conversions

static inline uint32_t f32Bits(float x)
{
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}

static inline float bitsF32(uint32_t u)
{
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

// IEEE binary16 -> binary32, exact (subnormals, inf, NaN).
static inline float halfToFloat(uint16_t h)
{
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    if (exp == 0x1F)
        return bitsF32(sign | 0x7F800000u | (man << 13));
    if (exp == 0)
    {
        if (man == 0)
            return bitsF32(sign);
        // subnormal: man * 2^-24, exact in fp32
        float f = float(man) * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    return bitsF32(sign | ((exp + 112) << 23) | (man << 13));
}

// binary32 -> binary16 with round-to-nearest-even (what torch's .to(float16) and F16C's vcvtps2ph with imm 0 do).
static inline uint16_t floatToHalf(float f)
{
    uint32_t x = f32Bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) // inf or NaN (quiet, keep the top payload bits)
        return uint16_t(sign | 0x7C00 | (ax > 0x7F800000u ? (0x200 | ((ax >> 13) & 0x3FF)) : 0));
    if (ax >= 0x477FF000u) // rounds to >= 65520: overflow to inf
        return uint16_t(sign | 0x7C00);
    if (ax < 0x38800000u) // below the smallest normal half 2^-14: subnormal or zero
    {
        if (ax < 0x33000000u) // < 2^-25: rounds to zero (2^-25 exactly ties to even = 0)
            return uint16_t(sign);
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7FFFFF) | 0x800000;
        uint32_t shift = 126 - e; // value = m * 2^(e-150); half subnormal unit 2^-24 -> shift by (126 - e)
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (q & 1)))
            ++q;
        return uint16_t(sign | q);
    }
    uint32_t r = ax + 0xC8000FFFu + ((ax >> 13) & 1); // rebias exponent (-112 << 23) and round half to even
    return uint16_t(sign | (r >> 13));
}

static inline float bf16ToFloat(uint16_t b)
{
    return bitsF32(uint32_t(b) << 16);
}

// binary32 -> bfloat16, round-to-nearest-even, NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even).
static inline uint16_t floatToBf16(float f)
{
    uint32_t x = f32Bits(f);
    if (f != f)
        return uint16_t(0x7FC0);
    return uint16_t((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

static inline float loadScalar(const void* base, int64_t i, int32_t dtype)
{
    switch (dtype)
    {
    case kiviCpuFloat16: return halfToFloat(static_cast<const uint16_t*>(base)[i]);
    case kiviCpuBfloat16: return bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
    }
}

static inline void storeScalar(void* base, int64_t i, int32_t dtype, float x)
{
    switch (dtype)
    {
    case kiviCpuFloat16: static_cast<uint16_t*>(base)[i] = floatToHalf(x); break;
    case kiviCpuBfloat16: static_cast<uint16_t*>(base)[i] = floatToBf16(x); break;
    default: static_cast<float*>(base)[i] = x;
    }
}

static inline int32_t dtypeBytes(int32_t dtype)
{
    return dtype == kiviCpuFloat32 ? 4 : 2;
}

} // namespace cpu
} // namespace trtllm_kivi
