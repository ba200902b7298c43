/*
 * KIVI append (quantize-and-store), header-only: the second half of a step (attend, then append), as
 * trtllm_kivi/reference/attention.py `append`, in ONE launch (kiviAppendKernel, grid (batch, 1 + chunkGroups, Hkv)):
 *   - CTA y = 0 of (sequence, KV head) quantizes the G-token groups [n_q(s), n_q(e)) that read any window row
 *     (tokens < s; at most ceil(W / G) + 1 groups), then writes the chunk's sink rows and the ring's last W rows:
 *     the flush reads window rows that the window write may overwrite, and one CTA orders the two by a barrier;
 *   - CTAs y >= 1 quantize the groups that lie entirely in the chunk (a prefill chunk's bulk), gridDim.y - 1 apart.
 * A group: its K [G][D] rows are staged in shared memory with 16-byte loads (each element read from device memory
 * once), K scales per channel (NaN-propagating packed min / max: exact), codes one thread per FRAGMENT-order word
 * (trtllm_kivi/format.py), then V staged transposed ([D][G]: each code pair of a V word is one 32-bit load), scales
 * per token, codes. Codes are bit-identical to reference/quant.py: code = clamp(rint(fl((x - z) / s)), 0, levels),
 * computed as rint((x - z) * fl(1 / s)) where that provably rounds alike (quantizeCodeFast), else by the IEEE
 * division.
 */
#pragma once

#include "kiviCommon.cuh"

#include <type_traits>

namespace trtllm_kivi
{
namespace kernels
{

//! Row of token t (K or V) of the sequence: window row windowRow(t) of the slot's S + W rows for t < s, else the
//! chunk's row.
template <typename T, int kD>
__device__ __forceinline__ T const* appendSourceRow(T const* window, T const* chunk, int32_t slot, int32_t h,
    int32_t numKvHeads, int32_t sinks, int32_t w, int64_t t, int64_t s, int32_t tokenOffset)
{
    if (t < s)
    {
        return window
            + ((int64_t(slot) * numKvHeads + h) * (sinks + w) + windowRowDev(static_cast<int32_t>(t), sinks, w)) * kD;
    }
    return chunk + ((tokenOffset + (t - s)) * int64_t(numKvHeads) + h) * kD;
}

//! NaN-propagating min / max of packed 16-bit pairs (exact: no rounding), as torch.amin / amax.
template <typename T>
__device__ __forceinline__ uint32_t pairMin(uint32_t a, uint32_t b)
{
    if constexpr (std::is_same<T, half>::value)
    {
        __half2 const r = __hmin2_nan(*reinterpret_cast<__half2 const*>(&a), *reinterpret_cast<__half2 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
    else
    {
        __nv_bfloat162 const r = __hmin2_nan(
            *reinterpret_cast<__nv_bfloat162 const*>(&a), *reinterpret_cast<__nv_bfloat162 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
}

template <typename T>
__device__ __forceinline__ uint32_t pairMax(uint32_t a, uint32_t b)
{
    if constexpr (std::is_same<T, half>::value)
    {
        __half2 const r = __hmax2_nan(*reinterpret_cast<__half2 const*>(&a), *reinterpret_cast<__half2 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
    else
    {
        __nv_bfloat162 const r = __hmax2_nan(
            *reinterpret_cast<__nv_bfloat162 const*>(&a), *reinterpret_cast<__nv_bfloat162 const*>(&b));
        return *reinterpret_cast<uint32_t const*>(&r);
    }
}

//! Element `which` (0 low, 1 high) of a packed pair as fp32.
template <typename T>
__device__ __forceinline__ float pairElement(uint32_t x, int32_t which)
{
    uint16_t const bits = static_cast<uint16_t>(which ? x >> 16 : x & 0xFFFFU);
    if constexpr (std::is_same<T, half>::value)
    {
        return __half2float(__ushort_as_half(bits));
    }
    else
    {
        return __bfloat162float(__ushort_as_bfloat16(bits));
    }
}

//! fl(a / levels) for levels = 2^b - 1 without a division: fl32(fl64(a fl64(1 / levels))). Exact: a = A 2^p (A < 2^24)
//! and an fp32 rounding midpoint m = M 2^q (M odd, < 2^25) near a / levels have p >= q, so a / levels != m lies at a
//! relative distance >= 2^-33 from m, far beyond the 2^-52 error of the fp64 product.
__device__ __forceinline__ float divideByLevels(float a, int32_t bits)
{
    double const inv = bits == 2 ? 1.0 / 3.0 : (bits == 4 ? 1.0 / 15.0 : 1.0 / 255.0);
    return __double2float_rn(__dmul_rn(double(a), inv));
}

//! 1 / s for quantizeCodeFast: rcp.approx (relative error <= 2^-23); 0 for a zero scale (every code 0, as
//! quantizeCode); NaN where it is not finite (subnormal or tiny scale), which sends that scale's codes to the IEEE
//! division.
__device__ __forceinline__ float codeReciprocal(float scale)
{
    if (scale == 0.F)
    {
        return 0.F;
    }
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(scale));
    return fabsf(r) < INFINITY ? r : __int_as_float(0x7fffffff);
}

//! quantizeCode without a division per code: q = fl(fl(x - z) inv), inv = codeReciprocal(s), code =
//! min(sat_u32(rint(q)), levels), levels = 2^b - 1. |q - fl((x - z) / s)| <= 2^-22 |q| (inv's 2^-23, the product's and
//! the division's 2^-24) < 2^(b - 21) for |q| < 2^(b + 1), so rint agrees unless a half-integer lies within
//! kTIE = 2^(b - 20) of q; beyond that range both clamp alike. ok = false (near-ties, NaN, inf; a share ~2^(b - 19) of
//! the codes): the caller recomputes the word with quantizeCode.
template <int kBITS>
__device__ __forceinline__ uint32_t quantizeCodeFast(float x, float zero, float inv, bool& ok)
{
    constexpr float kTIE = float(1 << kBITS) * 0x1p-20F;
    constexpr uint32_t kLEVELS = (1U << kBITS) - 1U;
    float const q = __fmul_rn(__fsub_rn(x, zero), inv);
    float const r = rintf(q);
    ok = ok & (fabsf(__fsub_rn(q, r)) < 0.5F - kTIE); // false for NaN
    uint32_t const c = __float2uint_rn(r);          // saturating: negative and NaN -> 0
    return c < kLEVELS ? c : kLEVELS;
}

//! (token within the 16-token tile, channel) of the code at bit position `pos` of half `half` of word j of `lane`
//! (format.py fragment_coord): pair pi = j * (16 / bits) + pos, register r = pi % 4, block i = pi / 4.
__device__ __forceinline__ void fragmentCoord(bool values, int32_t lane, int32_t j, int32_t half, int32_t pos,
    int32_t bits, int32_t& tok, int32_t& ch)
{
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    int32_t const pi = j * (16 / bits) + pos;
    int32_t const r = pi % 4;
    int32_t const i = pi / 4;
    if (values)
    {
        tok = 8 * (r >> 1) + 2 * t + half;
        ch = 16 * i + g + 8 * (r & 1);
    }
    else
    {
        tok = g + 8 * (r & 1);
        ch = 16 * i + 8 * (r >> 1) + 2 * t + half;
    }
}

constexpr int32_t kAPPEND_THREADS = 128;

//! Shared memory of kiviAppendKernel for one group of kG tokens: the staged tile (K [G][D + 8] or V^T [D][G + 8],
//! 16-bit; the pads make the code loops' pair loads conflict-free) and fp32 scale, zero and 1 / scale of K [D] and
//! V [G][D / Gv].
template <typename T, int kD, int kG>
struct AppendSmem
{
    static constexpr int32_t kGV = kG < kD ? kG : kD;
    static constexpr int32_t kVGROUPS = kD / kGV;
    static constexpr int32_t kKROW = kD + 8; //!< K tile row: 68 words at D = 128, pair loads hit banks 4g + t
    static constexpr int32_t kVROW = kG + 8; //!< V^T tile row
    static constexpr int32_t kTILE = kG * kKROW > kD * kVROW ? kG * kKROW : kD * kVROW;
    T tile[kTILE];
    float kScale[kD]; //!< stored scale of each channel, its zero, fl(1 / scale) (codeReciprocal)
    float kZero[kD];
    float kInv[kD];
    float vScale[kG * kVGROUPS]; //!< [token][group]
    float vZero[kG * kVGROUPS];
    float vInv[kG * kVGROUPS];
};

//! Bytes of AppendSmem for the run-time group size (dynamic shared memory of the launch).
template <typename T, int kD>
__host__ __device__ inline int32_t appendSmemBytes(int32_t groupSize)
{
    return groupSize == 32 ? int32_t(sizeof(AppendSmem<T, kD, 32>))
                           : (groupSize == 64 ? int32_t(sizeof(AppendSmem<T, kD, 64>)) : int32_t(sizeof(AppendSmem<T, kD, 128>)));
}

//! Word j of `lane` in 16-token tile `tile` of the staged group, every code by quantizeCode (the IEEE division):
//! the fallback of the code loops.
template <typename T, int kD, int kG, int kBITS>
__device__ __forceinline__ uint32_t exactWord(AppendSmem<T, kD, kG> const& sm, bool values, int32_t lane, int32_t j, int32_t tile)
{
    using Sm = AppendSmem<T, kD, kG>;
    constexpr int32_t kPER = 16 / kBITS;
    constexpr float kLEVELS = float((1 << kBITS) - 1);
    uint32_t word = 0;
    for (int32_t k = 0; k < 2 * kPER; ++k)
    {
        int32_t tok = 0;
        int32_t ch = 0;
        fragmentCoord(values, lane, j, k & 1, k >> 1, kBITS, tok, ch);
        int32_t const i = 16 * tile + tok;
        uint32_t code = 0;
        if (values)
        {
            int32_t const sv = i * Sm::kVGROUPS + ch / Sm::kGV;
            code = quantizeCode(ActTraits<T>::toFloat(sm.tile[ch * Sm::kVROW + i]), sm.vScale[sv], sm.vZero[sv], kLEVELS);
        }
        else
        {
            code = quantizeCode(ActTraits<T>::toFloat(sm.tile[i * Sm::kKROW + ch]), sm.kScale[ch], sm.kZero[ch], kLEVELS);
        }
        word |= code << (16 * (k & 1) + (k >> 1) * kBITS);
    }
    return word;
}

//! K codes of the staged group: one thread per FRAGMENT-order word; the 32 lanes of a warp take one (tile, word j),
//! so each pair load (channels ch, ch + 1 of token g (+8)) is conflict-free. Register pi = j (16 / b) + pos of a lane
//! is 16-channel block pi / 4, register pi % 4 (format.py): for b <= 4 both are compile-time offsets from the lane's
//! base address.
template <typename T, int kD, int kG, int kBITS>
__device__ __forceinline__ void writeKeyCodes(AppendSmem<T, kD, kG> const& sm, int32_t* codes, int64_t base)
{
    using Sm = AppendSmem<T, kD, kG>;
    constexpr int32_t kNW = kD * kBITS / 64;
    constexpr int32_t kPER = 16 / kBITS;
    constexpr int32_t kWARP_WORDS = (kG / 16) * kNW; // (tile, j) pairs, one per warp iteration
    int32_t const lane = threadIdx.x & 31;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    static_assert(kWARP_WORDS % (kAPPEND_THREADS / 32) == 0, "every warp runs the same iterations");
    for (int32_t it = 0; it < kWARP_WORDS / (kAPPEND_THREADS / 32); ++it) // KIVI_MODEL_LOOP(kcodes)
    {
        int32_t const wv = (threadIdx.x >> 5) + it * (kAPPEND_THREADS / 32); // warp-uniform
        int32_t const j = wv % kNW;
        int32_t const tile = wv / kNW;
        T const* row = sm.tile + (16 * tile + g) * Sm::kKROW + 2 * t; // token g of the tile, channel 2t
        float const* zero = sm.kZero + 2 * t;
        float const* inv = sm.kInv + 2 * t;
        uint32_t word = 0;
        bool ok = true; // every code of the word took the fast path
#pragma unroll
        for (int32_t pos = 0; pos < kPER; ++pos)
        {
            int32_t const pi = j * kPER + pos;
            int32_t const reg = pi & 3;
            int32_t const off = 16 * (pi >> 2) + 8 * (reg >> 1); // channel past 2t; token g + 8 (reg & 1)
            uint32_t const x = *reinterpret_cast<uint32_t const*>(row + 8 * (reg & 1) * Sm::kKROW + off);
#pragma unroll
            for (int32_t hf = 0; hf < 2; ++hf)
            {
                uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[off + hf], inv[off + hf], ok);
                word += c << (16 * hf + pos * kBITS); // disjoint fields: + is |
            }
        }
        if (!ok) // rare (near-ties, NaN, inf)
        {
            word = exactWord<T, kD, kG, kBITS>(sm, false, lane, j, tile); // the IEEE division (K)
        }
        codes[base + (tile * 32 + lane) * kNW + j] = static_cast<int32_t>(word); // KIVI_MODEL_ANCHOR(kcodes)
    }
}

//! V codes of the staged group (V^T: rows = channels): each pair (tokens tok, tok + 1 of channel 16 blk + g (+8)) is
//! one 32-bit load; its scales are those of tokens tok, tok + 1 for channel group 16 blk / Gv.
template <typename T, int kD, int kG, int kBITS>
__device__ __forceinline__ void writeValueCodes(AppendSmem<T, kD, kG> const& sm, int32_t* codes, int64_t base)
{
    using Sm = AppendSmem<T, kD, kG>;
    constexpr int32_t kNW = kD * kBITS / 64;
    constexpr int32_t kPER = 16 / kBITS;
    constexpr int32_t kWARP_WORDS = (kG / 16) * kNW;
    constexpr int32_t kBLOCKS_PER_GROUP = Sm::kGV / 16; // 16-channel blocks of one V group (Gv >= 32)
    int32_t const lane = threadIdx.x & 31;
    int32_t const g = lane >> 2;
    int32_t const t = lane & 3;
    static_assert(kWARP_WORDS % (kAPPEND_THREADS / 32) == 0, "every warp runs the same iterations");
    for (int32_t it = 0; it < kWARP_WORDS / (kAPPEND_THREADS / 32); ++it) // KIVI_MODEL_LOOP(vcodes)
    {
        int32_t const wv = (threadIdx.x >> 5) + it * (kAPPEND_THREADS / 32); // warp-uniform
        int32_t const j = wv % kNW;
        int32_t const tile = wv / kNW;
        T const* col = sm.tile + g * Sm::kVROW + 16 * tile + 2 * t; // channel g, tokens 16 tile + 2t (+1)
        float const* zero = sm.vZero + (16 * tile + 2 * t) * Sm::kVGROUPS;
        float const* inv = sm.vInv + (16 * tile + 2 * t) * Sm::kVGROUPS;
        uint32_t word = 0;
        bool ok = true;
#pragma unroll
        for (int32_t pos = 0; pos < kPER; ++pos)
        {
            int32_t const pi = j * kPER + pos;
            int32_t const reg = pi & 3;
            int32_t const blk = pi >> 2;
            uint32_t const x
                = *reinterpret_cast<uint32_t const*>(col + (16 * blk + 8 * (reg & 1)) * Sm::kVROW + 8 * (reg >> 1));
            int32_t const si = 8 * (reg >> 1) * Sm::kVGROUPS + blk / kBLOCKS_PER_GROUP;
#pragma unroll
            for (int32_t hf = 0; hf < 2; ++hf)
            {
                int32_t const sk = si + hf * Sm::kVGROUPS;
                uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[sk], inv[sk], ok);
                word += c << (16 * hf + pos * kBITS); // disjoint fields: + is |
            }
        }
        if (!ok) // rare (near-ties, NaN, inf)
        {
            word = exactWord<T, kD, kG, kBITS>(sm, true, lane, j, tile); // the IEEE division (V)
        }
        codes[base + (tile * 32 + lane) * kNW + j] = static_cast<int32_t>(word); // KIVI_MODEL_ANCHOR(vcodes)
    }
}

//! Scales of one 16-bit pair of channels (K: over the group's tokens) or tokens (V: over a channel group), from their
//! NaN-propagating min / max: scale = (max - min) / levels (IEEE), zero = min, both stored in the scale dtype.
__device__ __forceinline__ void storePairScales(KiviStepParams const& p, bool values, int64_t sIdx0, int64_t offset,
    float lo, float hi, int32_t bits, float* scale, float* zero, float* inv)
{
    int64_t const sIdx = sIdx0 + offset;
    float const s = storeScale(values ? p.vScale : p.kScale, sIdx, p.scaleDtype, divideByLevels(__fsub_rn(hi, lo), bits));
    *scale = s;
    *zero = storeScale(values ? p.vZero : p.kZero, sIdx, p.scaleDtype, lo);
    *inv = codeReciprocal(s);
}

//! K of the staged group: per channel pair (thread c2 < D / 2), min / max over the kG tokens.
template <typename T, int kD, int kG>
__device__ __forceinline__ void keyScales(KiviStepParams const& p, AppendSmem<T, kD, kG>& sm, int64_t sIdx0)
{
    using Sm = AppendSmem<T, kD, kG>;
    static_assert(kD / 2 <= kAPPEND_THREADS, "one channel pair per thread");
    int32_t const c2 = threadIdx.x;
    if (c2 < kD / 2)
    {
        uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + 2 * c2);
        uint32_t mx = mn;
#pragma unroll
        for (int32_t i = 1; i < kG; ++i)
        {
            uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + i * Sm::kKROW + 2 * c2);
            mn = pairMin<T>(mn, x);
            mx = pairMax<T>(mx, x);
        }
#pragma unroll
        for (int32_t k = 0; k < 2; ++k)
        {
            int32_t const d = 2 * c2 + k;
            storePairScales(p, false, sIdx0, d, pairElement<T>(mn, k), pairElement<T>(mx, k), p.kBits, &sm.kScale[d],
                &sm.kZero[d], &sm.kInv[d]);
        }
    }
}

//! V of the staged group (V^T): per (token pair tp, channel group cg), min / max over the group's Gv channels.
template <typename T, int kD, int kG>
__device__ __forceinline__ void valueScales(KiviStepParams const& p, AppendSmem<T, kD, kG>& sm, int64_t sIdx0)
{
    using Sm = AppendSmem<T, kD, kG>;
    static_assert((kG / 2) * Sm::kVGROUPS <= kAPPEND_THREADS, "one (token pair, channel group) per thread");
    int32_t const u = threadIdx.x;
    if (u < (kG / 2) * Sm::kVGROUPS)
    {
        int32_t const tp = u % (kG / 2);
        int32_t const cg = u / (kG / 2);
        uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV) * Sm::kVROW + 2 * tp);
        uint32_t mx = mn;
#pragma unroll
        for (int32_t c = 1; c < Sm::kGV; ++c)
        {
            uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV + c) * Sm::kVROW + 2 * tp);
            mn = pairMin<T>(mn, x);
            mx = pairMax<T>(mx, x);
        }
#pragma unroll
        for (int32_t k = 0; k < 2; ++k)
        {
            int32_t const si = (2 * tp + k) * Sm::kVGROUPS + cg;
            storePairScales(p, true, sIdx0, si, pairElement<T>(mn, k), pairElement<T>(mx, k), p.vBits,
                &sm.vScale[si], &sm.vZero[si], &sm.vInv[si]);
        }
    }
}

//! Row i of the group (token tok0 + i) of K or V: from the window or the chunk (kCHUNK: the whole group lies in the
//! chunk, so the row is chunkRow0 + i rows of the chunk, no window arithmetic).
template <typename T, int kD, bool kCHUNK>
__device__ __forceinline__ T const* groupRow(T const* window, T const* chunkRow0, int64_t rowStride, int32_t slot,
    int32_t h, int32_t hkv, int32_t sinks, int32_t w, int64_t tok, int64_t s, T const* chunk, int32_t tokenOffset,
    int32_t i)
{
    if constexpr (kCHUNK)
    {
        return chunkRow0 + i * rowStride;
    }
    else
    {
        return appendSourceRow<T, kD>(window, chunk, slot, h, hkv, sinks, w, tok, s, tokenOffset);
    }
}

//! Quantize the group of store indices [j0, j0 + kG) (tokens S + j0 ..) of sequence b, KV head h (kCHUNK: all its
//! tokens are chunk tokens).
template <typename T, int kD, int kG, bool kCHUNK>
__device__ __forceinline__ void flushGroup(KiviStepParams const& p, SeqInfo const& info, int32_t b, int32_t h, int64_t s, int64_t j0,
    AppendSmem<T, kD, kG>& sm)
{
    using Sm = AppendSmem<T, kD, kG>;
    constexpr int32_t kVECS = kD / 8; // 16-byte vectors per row
    int32_t const sinks = p.sinkTokens;
    int32_t const slot = p.slotIds[b];
    int32_t const w = p.residualLength + kG - 1;
    int32_t const hkv = p.numKvHeads;
    int32_t const bs = p.blockSize;
    int32_t const j32 = static_cast<int32_t>(j0); // kiviValidate caps store indices below 2^31: 32-bit division
    int64_t const blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + j32 / bs];
    int32_t const r = j32 % bs;
    int64_t const headBase = blk * hkv + h;
    int64_t const tok0 = sinks + j0;
    T const* kWin = static_cast<T const*>(p.kWindow);
    T const* vWin = static_cast<T const*>(p.vWindow);
    int64_t const rowStride = int64_t(hkv) * kD; // chunk rows of one KV head
    int64_t const chunkRow0 = ((info.tokenOffset + (tok0 - s)) * hkv + h) * kD;
    T const* kChunk0 = static_cast<T const*>(p.k) + (kCHUNK ? chunkRow0 : 0);
    T const* vChunk0 = static_cast<T const*>(p.v) + (kCHUNK ? chunkRow0 : 0);
    __syncthreads(); // the previous group's shared memory is no longer read

    // K: stage [G][D + 8] (each element read once, 16-byte loads), scales per channel, codes
    if constexpr (kCHUNK) // rows kChunk0 + i rowStride: one pointer per thread, fixed steps
    {
        constexpr int32_t kPASS_ROWS = kAPPEND_THREADS / kVECS;
        int32_t const i0 = threadIdx.x / kVECS;
        int32_t const c8 = threadIdx.x % kVECS;
        T const* src = kChunk0 + i0 * int32_t(rowStride) + 8 * c8;
        T* dst = sm.tile + i0 * Sm::kKROW + 8 * c8;
#pragma unroll
        for (int32_t k = 0; k < kG / kPASS_ROWS; ++k)
        {
            *reinterpret_cast<uint4*>(dst + k * kPASS_ROWS * Sm::kKROW)
                = *reinterpret_cast<uint4 const*>(src + k * kPASS_ROWS * int32_t(rowStride)); // K staging (chunk)
        }
    }
    else
    {
        for (int32_t u = threadIdx.x; u < kG * kVECS; u += kAPPEND_THREADS)
        {
            int32_t const i = u / kVECS;
            int32_t const c8 = u % kVECS;
            T const* row = groupRow<T, kD, kCHUNK>(kWin, kChunk0, rowStride, slot, h, hkv, sinks, w, tok0 + i, s,
                static_cast<T const*>(p.k), info.tokenOffset, i);
            *reinterpret_cast<uint4*>(sm.tile + i * Sm::kKROW + 8 * c8) = *reinterpret_cast<uint4 const*>(row + 8 * c8);
        }
    }
    __syncthreads();
    keyScales<T, kD, kG>(p, sm, (headBase * (bs / kG) + r / kG) * kD);
    __syncthreads();
    {
        int32_t* codes = static_cast<int32_t*>(p.kCodes);
        int64_t const base = headBase * (int64_t(bs) * kD * p.kBits / 32) + int64_t(r / 16) * 32 * (kD * p.kBits / 64);
        if (p.kBits == 2)
        {
            writeKeyCodes<T, kD, kG, 2>(sm, codes, base);
        }
        else if (p.kBits == 4)
        {
            writeKeyCodes<T, kD, kG, 4>(sm, codes, base);
        }
        else
        {
            writeKeyCodes<T, kD, kG, 8>(sm, codes, base);
        }
    }
    __syncthreads(); // the K tile is consumed: V reuses it

    // V: stage transposed [D][G + 8] (a thread turns tokens 2 tp, 2 tp + 1 x 8 channels into 8 pairs), scales per
    // (token, channel group), codes
    static_assert(kAPPEND_THREADS % (kG / 2) == 0 && (kG / 2) * kVECS % kAPPEND_THREADS == 0, "whole passes");
    int32_t const tp = threadIdx.x % (kG / 2); // tokens 2 tp, 2 tp + 1; channel octets c8, c8 + 128 / (G / 2), ...
    int32_t const c80 = threadIdx.x / (kG / 2);
    T const* r0 = groupRow<T, kD, kCHUNK>(vWin, vChunk0, rowStride, slot, h, hkv, sinks, w, tok0 + 2 * tp, s,
        static_cast<T const*>(p.v), info.tokenOffset, 2 * tp);
    T const* r1 = groupRow<T, kD, kCHUNK>(vWin, vChunk0, rowStride, slot, h, hkv, sinks, w, tok0 + 2 * tp + 1, s,
        static_cast<T const*>(p.v), info.tokenOffset, 2 * tp + 1);
#pragma unroll
    for (int32_t pass = 0; pass < (kG / 2) * kVECS / kAPPEND_THREADS; ++pass)
    {
        int32_t const c8 = c80 + pass * (kAPPEND_THREADS / (kG / 2));
        uint4 const x0 = *reinterpret_cast<uint4 const*>(r0 + 8 * c8);
        uint4 const x1 = *reinterpret_cast<uint4 const*>(r1 + 8 * c8);
        uint32_t const a[4] = {x0.x, x0.y, x0.z, x0.w};
        uint32_t const c[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int32_t i = 0; i < 4; ++i)
        {
            T* dst = sm.tile + (8 * c8 + 2 * i) * Sm::kVROW + 2 * tp;
            *reinterpret_cast<uint32_t*>(dst) = __byte_perm(a[i], c[i], 0x5410);
            *reinterpret_cast<uint32_t*>(dst + Sm::kVROW) = __byte_perm(a[i], c[i], 0x7632);
        }
    }
    __syncthreads();
    valueScales<T, kD, kG>(p, sm, (headBase * bs + r) * Sm::kVGROUPS);
    __syncthreads();
    {
        int32_t* codes = static_cast<int32_t*>(p.vCodes);
        int64_t const base = headBase * (int64_t(bs) * kD * p.vBits / 32) + int64_t(r / 16) * 32 * (kD * p.vBits / 64);
        if (p.vBits == 2)
        {
            writeValueCodes<T, kD, kG, 2>(sm, codes, base);
        }
        else if (p.vBits == 4)
        {
            writeValueCodes<T, kD, kG, 4>(sm, codes, base);
        }
        else
        {
            writeValueCodes<T, kD, kG, 8>(sm, codes, base);
        }
    }
}

//! Window rows of the chunk's sink tokens [s, min(S, e)) and of its tokens [max(s, S, e - W), e) (the ring's last
//! W) at windowRow(t) of the slot's S + W rows, 16-byte vectors.
template <typename T, int kD>
__device__ __forceinline__ void writeWindowRows(KiviStepParams const& p, SeqInfo const& info, int32_t b, int32_t h)
{
    int64_t const s = p.pastLen[b];
    int64_t const e = s + p.chunkLen[b];
    int32_t const w = p.residualLength + p.groupSize - 1;
    int32_t const sinks = p.sinkTokens;
    int64_t const sinkEnd = e < sinks ? e : sinks;               // sinks of this chunk: [s, sinkEnd)
    int64_t const nSinks = sinkEnd > s ? sinkEnd - s : 0;
    int64_t first = e - w > s ? e - w : s;                       // the ring: [max(s, S, e - W), e)
    first = first > sinks ? first : (e > sinks ? int64_t(sinks) : e);
    int32_t const slot = p.slotIds[b];
    constexpr int32_t kVEC = 16 / sizeof(T);
    constexpr int32_t kVECS = kD / kVEC;
    int64_t const n = (nSinks + (e - first)) * kVECS;
    for (int64_t u = threadIdx.x; u < n; u += blockDim.x)
    {
        int64_t const i = u / kVECS;
        int64_t const t = i < nSinks ? s + i : first + (i - nSinks);
        int32_t const c = static_cast<int32_t>(u % kVECS);
        int64_t const src = ((info.tokenOffset + (t - s)) * p.numKvHeads + h) * kVECS + c;
        int64_t const dst
            = ((int64_t(slot) * p.numKvHeads + h) * (sinks + w) + windowRowDev(static_cast<int32_t>(t), sinks, w)) * kVECS
            + c;
        static_cast<uint4*>(p.kWindow)[dst] = static_cast<uint4 const*>(p.k)[src];
        static_cast<uint4*>(p.vWindow)[dst] = static_cast<uint4 const*>(p.v)[src];
    }
}

//! The groups of one (sequence, KV head) for group size kG. Groups k of the step (store indices n_q(s) + k G ..)
//! with k < kWin read window rows: CTA y = 0 flushes them, then writes the window rows (with gridDim.y == 1 it
//! flushes every group). CTAs y >= 1 take groups kWin + y - 1, + gridDim.y - 1, ...
template <typename T, int kD, int kG>
__device__ __forceinline__ void appendSequence(KiviStepParams const& p, SeqInfo const& info, int32_t b, int32_t h,
    char* smem)
{
    AppendSmem<T, kD, kG>& sm = *reinterpret_cast<AppendSmem<T, kD, kG>*>(smem);
    int64_t const s = p.pastLen[b];
    int64_t const e = s + p.chunkLen[b];
    int64_t const q0 = numQuantizedDev(s, p.sinkTokens, p.residualLength, kG); // store indices; token = S + index
    int64_t const q1 = numQuantizedDev(e, p.sinkTokens, p.residualLength, kG);
    // group counts are int32 (at most maxChunkLen / G + window groups): no 64-bit division in the loop bounds
    int32_t const groups = static_cast<int32_t>((q1 - q0) / kG);
    int64_t const fromWindow = s - p.sinkTokens - q0; // store indices [q0, q0 + fromWindow) are window rows
    int32_t kWin = fromWindow > 0 ? static_cast<int32_t>((fromWindow + kG - 1) / kG) : 0;
    kWin = gridDim.y == 1 ? groups : (kWin < groups ? kWin : groups);
    if (blockIdx.y == 0)
    {
        for (int32_t k = 0; k < kWin; ++k)
        {
            flushGroup<T, kD, kG, false>(p, info, b, h, s, q0 + int64_t(kG) * k, sm); // a window group
        }
        __syncthreads(); // every window row the flushes read is read before it is overwritten
        writeWindowRows<T, kD>(p, info, b, h);
        return;
    }
    int32_t const stride = static_cast<int32_t>(gridDim.y) - 1;
    for (int32_t k = kWin + static_cast<int32_t>(blockIdx.y) - 1; k < groups; k += stride) // KIVI_MODEL_LOOP(tile)
    {
        flushGroup<T, kD, kG, true>(p, info, b, h, s, q0 + int64_t(k) * kG, sm);
    }
}

//! Grid (batch, 1 + chunkGroups, Hkv), dynamic shared memory appendSmemBytes<T, kD>(G); see appendSequence.
//! A sequence whose window row the attention kernel of this step already wrote (SeqInfo::windowWritten: a valid
//! one-token chunk that flushes nothing, kiviDecodeSplit.cuh) is left alone.
template <typename T, int kD>
__global__ void __launch_bounds__(kAPPEND_THREADS, 4) kiviAppendKernel(KiviStepParams p, SeqInfo const* seqInfo)
{
    extern __shared__ __align__(16) char appendSmem[];
    gridDependencyWait(); // a programmatic dependent of the attention kernel (sm_90): its reads come first
    int32_t const b = blockIdx.x;
    int32_t const h = blockIdx.z;
    SeqInfo const info = seqInfo[b];
    if (!info.valid || info.windowWritten)
    {
        return;
    }
    if (p.groupSize == 32) // uniform: the group size is compiled into the loops
    {
        appendSequence<T, kD, 32>(p, info, b, h, appendSmem);
    }
    else if (p.groupSize == 64)
    {
        appendSequence<T, kD, 64>(p, info, b, h, appendSmem);
    }
    else
    {
        appendSequence<T, kD, 128>(p, info, b, h, appendSmem);
    }
}

} // namespace kernels
} // namespace trtllm_kivi
