// Host-side validation and launch planning of the KIVI kernels: plain C++ (compiled by g++ in the CPU tests).
#include "kiviParams.h"

#include "kiviDecodeVariants.h"
#include "kiviFormat.h"

#include <cstdarg>
#include <cstdio>

namespace trtllm_kivi
{
namespace kernels
{
namespace
{

int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

size_t roundUp256(size_t n)
{
    return (n + 255) / 256 * 256;
}

int32_t fail(char* msg, size_t msgLen, char const* fmt, ...)
{
    if (msg != nullptr && msgLen > 0)
    {
        va_list args;
        va_start(args, fmt);
        std::vsnprintf(msg, msgLen, fmt, args);
        va_end(args);
    }
    return -1;
}

bool isOneOf(int32_t v, int32_t const* allowed, int32_t n)
{
    for (int32_t i = 0; i < n; ++i)
    {
        if (allowed[i] == v)
        {
            return true;
        }
    }
    return false;
}

bool aligned(void const* ptr, size_t alignment)
{
    return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

//! A required device pointer: non-null and aligned. Returns 0 or fails with a message naming the buffer.
int32_t checkPointer(char const* name, void const* ptr, size_t alignment, char* msg, size_t msgLen)
{
    if (ptr == nullptr)
    {
        return fail(msg, msgLen, "%s is a null pointer; a device buffer is required", name);
    }
    if (!aligned(ptr, alignment))
    {
        return fail(msg, msgLen, "%s=%p is not %zu-byte aligned", name, ptr, alignment);
    }
    return 0;
}

//! Bytes of the split partials for numTokens x numHeads x splits rows (acc[D], then (m, l)).
size_t partialBytesOf(KiviStepParams const& p, int64_t splits)
{
    size_t const rows = size_t(p.numTokens > 0 ? p.numTokens : 0) * size_t(p.numHeads > 0 ? p.numHeads : 0)
        * size_t(splits);
    return roundUp256(rows * size_t(p.headDim > 0 ? p.headDim : 0) * sizeof(float))
        + roundUp256(rows * 2 * sizeof(float));
}

//! The split count the plan aims for: floor(waves x SMs x ctasPerSm / (tiles x KV heads)) -- the variant's number of
//! whole waves of resident CTAs -- clamped to [1, maxSplits] (maxSplits = ceil(maxSeqLen / kMIN_SPLIT_LEN)).
//! numSplits <= this, with equality unless rounding splitLen up to whole key tiles leaves the last split empty.
//! plan.numTiles, plan.numPrefillTiles, plan.maxSeqLen, plan.ctasPerSm and plan.decodeVariant must be set. Outside
//! decode mode it never increases with numTokens: the tiles of both kernels together never decrease (where the
//! prefill kernel starts, the decode cap of 8 tiles per sequence clips only batch 1, by one tile, and the prefill
//! bound adds two).
int64_t targetSplits(KiviStepParams const& p, KiviLaunchPlan const& plan)
{
    int64_t const sms = p.numSms > 0 ? p.numSms : kDEFAULT_NUM_SMS;
    int64_t const slots = sms * (plan.ctasPerSm > 0 ? plan.ctasPerSm : defaultCtasPerSm(p.kBits, p.vBits))
        * kKIVI_DECODE_VARIANTS[plan.decodeVariant].waves;
    int64_t const tiles = int64_t(plan.numTiles) + plan.numPrefillTiles; // CTAs per split of both kernels
    int64_t const base = (tiles > 0 ? tiles : 1) * (p.numKvHeads > 0 ? p.numKvHeads : 1);
    int64_t const splits = slots / base;
    int64_t const maxSplits = ceilDiv(plan.maxSeqLen > 0 ? plan.maxSeqLen : 1, kMIN_SPLIT_LEN);
    return splits < 1 ? 1 : (splits > maxSplits ? maxSplits : splits);
}

} // namespace

int32_t kiviValidate(KiviStepParams const& p, int32_t phase, char* msg, size_t msgLen)
{
    if (msg != nullptr && msgLen > 0)
    {
        msg[0] = '\0';
    }
    if (phase < kPHASE_ATTENTION || phase > kPHASE_STEP)
    {
        return fail(msg, msgLen, "phase=%d is not supported; allowed: 1 (attention), 2 (append), 3 (step)", phase);
    }
    if (!isOneOf(p.headDim, kSUPPORTED_HEAD_DIMS, 2))
    {
        return fail(msg, msgLen, "head_dim=%d is not supported by the KIVI kernels; allowed: 64, 128", p.headDim);
    }
    if (p.numKvHeads <= 0 || p.numHeads <= 0)
    {
        return fail(msg, msgLen, "num_heads=%d and num_kv_heads=%d must be positive", p.numHeads, p.numKvHeads);
    }
    if (p.numHeads % p.numKvHeads != 0)
    {
        return fail(msg, msgLen, "num_heads=%d must be a multiple of num_kv_heads=%d", p.numHeads, p.numKvHeads);
    }
    if (p.numHeads / p.numKvHeads > kMAX_TILE_ROWS)
    {
        return fail(msg, msgLen, "num_heads/num_kv_heads=%d is not supported; allowed: 1..%d",
            p.numHeads / p.numKvHeads, kMAX_TILE_ROWS);
    }
    if (!isOneOf(p.kBits, kSUPPORTED_BITS, 3))
    {
        return fail(msg, msgLen, "k_bits=%d is not supported; allowed: 2, 4, 8", p.kBits);
    }
    if (!isOneOf(p.vBits, kSUPPORTED_BITS, 3))
    {
        return fail(msg, msgLen, "v_bits=%d is not supported; allowed: 2, 4, 8", p.vBits);
    }
    if (!isOneOf(p.groupSize, kSUPPORTED_GROUP_SIZES, 3))
    {
        return fail(msg, msgLen, "group_size=%d is not supported; allowed: 32, 64, 128", p.groupSize);
    }
    if (p.residualLength < 0)
    {
        return fail(msg, msgLen, "residual_length=%d must be >= 0", p.residualLength);
    }
    if (p.blockSize <= 0 || p.blockSize % p.groupSize != 0)
    {
        return fail(msg, msgLen, "block_size=%d must be a positive multiple of group_size=%d", p.blockSize,
            p.groupSize);
    }
    if (p.scaleDtype < kKIVI_FLOAT16 || p.scaleDtype > kKIVI_FLOAT32)
    {
        return fail(msg, msgLen, "scale_dtype=%d is not supported; allowed: 0 (float16), 1 (bfloat16), 2 (float32)",
            p.scaleDtype);
    }
    if (p.keyGrouping != kKEY_GROUPING_PER_CHANNEL)
    {
        return fail(msg, msgLen,
            "key_grouping=%d is not supported by the KIVI kernels; allowed: 0 (per_channel); per_token keys (1) "
            "run in the torch reference only",
            p.keyGrouping);
    }
    if (p.actDtype != kKIVI_FLOAT16 && p.actDtype != kKIVI_BFLOAT16)
    {
        return fail(msg, msgLen, "act_dtype=%d is not supported; allowed: 0 (float16), 1 (bfloat16)", p.actDtype);
    }
    if (p.batch < 0 || p.numTokens < 0)
    {
        return fail(msg, msgLen, "batch=%d and num_tokens=%d must be >= 0", p.batch, p.numTokens);
    }
    if (p.numBlocks <= 0 || p.numSlots <= 0 || p.maxBlocksPerSeq <= 0)
    {
        return fail(msg, msgLen, "num_blocks=%d, num_slots=%d and max_blocks_per_seq=%d must be positive",
            p.numBlocks, p.numSlots, p.maxBlocksPerSeq);
    }
    if (p.maxChunkLen < 0 || p.maxChunkLen > p.numTokens)
    {
        return fail(msg, msgLen, "max_chunk_len=%d is out of range; allowed: 0 (= num_tokens) .. num_tokens=%d",
            p.maxChunkLen, p.numTokens);
    }
    if (p.sinkTokens < 0 || p.sinkTokens > kMAX_SINK_TOKENS)
    {
        return fail(msg, msgLen, "sink_tokens=%d is out of range; allowed: 0 .. %d", p.sinkTokens, kMAX_SINK_TOKENS);
    }
    int64_t const capacity
        = int64_t(p.maxBlocksPerSeq) * p.blockSize + p.sinkTokens + windowCapacity(p.residualLength, p.groupSize);
    if (capacity > INT32_MAX / 2)
    {
        return fail(msg, msgLen, "max_blocks_per_seq=%d x block_size=%d is past the supported capacity of %d tokens",
            p.maxBlocksPerSeq, p.blockSize, INT32_MAX / 2);
    }
    if (p.maxSeqLen < 0 || p.maxSeqLen > capacity)
    {
        return fail(msg, msgLen,
            "max_seq_len=%d is past the capacity of %lld tokens (max_blocks_per_seq=%d blocks of %d + %d sinks + "
            "window %d); allowed: 0 (= capacity) .. %lld",
            p.maxSeqLen, static_cast<long long>(capacity), p.maxBlocksPerSeq, p.blockSize, p.sinkTokens,
            windowCapacity(p.residualLength, p.groupSize), static_cast<long long>(capacity));
    }
    if (p.attentionImpl == kKIVI_ATTN_SIMT || p.attentionImpl == kKIVI_ATTN_TENSOR_CORE)
    {
        return fail(msg, msgLen,
            "attention_impl=%d (legacy SIMT/WMMA kernel) reads the FORMAT_VERSION 1 code layout and is kept compiled "
            "only as a performance-model subject; allowed: 0 (auto), 3 (mma)",
            p.attentionImpl);
    }
    if (p.attentionImpl != kKIVI_ATTN_AUTO && p.attentionImpl != kKIVI_ATTN_MMA)
    {
        return fail(msg, msgLen, "attention_impl=%d is not supported; allowed: 0 (auto), 3 (mma)", p.attentionImpl);
    }
    if (p.ctasPerSm < 0 || p.ctasPerSm > 64)
    {
        return fail(msg, msgLen, "ctas_per_sm=%d is out of range; allowed: 0 (= %d for these bits) .. 64", p.ctasPerSm,
            defaultCtasPerSm(p.kBits, p.vBits));
    }
    if (p.numSms < 0)
    {
        return fail(msg, msgLen, "num_sms=%d must be >= 0 (0: %d)", p.numSms, kDEFAULT_NUM_SMS);
    }
    if (p.decodeVariant < 0 || p.decodeVariant >= kKIVI_DECODE_VARIANT_COUNT)
    {
        return fail(msg, msgLen, "decode_variant=%d is out of range; allowed: 0 (auto) .. %d (%s)", p.decodeVariant,
            kKIVI_DECODE_VARIANT_COUNT - 1, kKIVI_DECODE_VARIANTS[kKIVI_DECODE_VARIANT_COUNT - 1].name);
    }
    if (p.decodeVariant != kKIVI_VARIANT_AUTO && !kiviVariantCompiled(p.decodeVariant, p.headDim, p.kBits, p.vBits))
    {
        return fail(msg, msgLen,
            "decode_variant=%d (%s) is compiled for head_dim 128 with 2-bit keys and values only; this step has "
            "head_dim=%d, k_bits=%d, v_bits=%d; use 0 (auto) or %d (%s)",
            p.decodeVariant, kKIVI_DECODE_VARIANTS[p.decodeVariant].name, p.headDim, p.kBits, p.vBits,
            kKIVI_VARIANT_DEFAULT, kKIVI_DECODE_VARIANTS[kKIVI_VARIANT_DEFAULT].name);
    }
    if (p.batch == 0 || p.numTokens == 0)
    {
        return 0; // nothing to launch; pointers may be null
    }
    struct Req
    {
        char const* name;
        void const* ptr;
        size_t alignment;
        bool attention;
        bool append;
    };
    Req const reqs[] = {
        {"q", p.q, 16, true, false},
        {"k", p.k, 16, true, true},
        {"v", p.v, 16, true, true},
        {"out", p.out, 16, true, false},
        {"slot_ids", p.slotIds, 4, true, true},
        {"past_len", p.pastLen, 4, true, true},
        {"chunk_len", p.chunkLen, 4, true, true},
        {"block_table", p.blockTable, 4, true, true},
        // codes and scales are staged with 16-byte cp.async copies by the attention kernel
        {"k_codes", p.kCodes, 16, true, true},
        {"k_scale", p.kScale, 16, true, true},
        {"k_zero", p.kZero, 16, true, true},
        {"v_codes", p.vCodes, 16, true, true},
        {"v_scale", p.vScale, 16, true, true},
        {"v_zero", p.vZero, 16, true, true},
        {"k_window", p.kWindow, 16, true, true},
        {"v_window", p.vWindow, 16, true, true},
    };
    for (Req const& r : reqs)
    {
        bool const needed = ((phase & kPHASE_ATTENTION) && r.attention) || ((phase & kPHASE_APPEND) && r.append);
        if (needed && checkPointer(r.name, r.ptr, r.alignment, msg, msgLen) != 0)
        {
            return -1;
        }
    }
    if (p.errorFlag != nullptr && !aligned(p.errorFlag, 4))
    {
        return fail(msg, msgLen, "error_flag=%p is not 4-byte aligned", static_cast<void const*>(p.errorFlag));
    }
    size_t const need = kiviWorkspaceSize(p);
    if (p.workspaceSize < need)
    {
        return fail(msg, msgLen, "workspace_size=%zu is too small; this step needs %zu bytes (kiviWorkspaceSize)",
            p.workspaceSize, need);
    }
    if (need > 0 && checkPointer("workspace", p.workspace, 256, msg, msgLen) != 0)
    {
        return -1;
    }
    return 0;
}

namespace
{
//! The shape class of a step for the plan table (kiviDecodeVariants.h).
int32_t shapeClass(KiviStepParams const& p, int32_t numSms)
{
    int32_t const mcl = p.maxChunkLen > 0 ? p.maxChunkLen : p.numTokens;
    if (mcl > 1)
    {
        return kKIVI_SHAPE_MIXED;
    }
    int64_t const grp = p.numKvHeads > 0 && p.numHeads >= p.numKvHeads ? p.numHeads / p.numKvHeads : 1;
    int64_t const ctas = int64_t(p.batch) * ceilDiv(grp, kTILE_ROWS) * (p.numKvHeads > 0 ? p.numKvHeads : 1);
    return ctas < (numSms > 0 ? numSms : kDEFAULT_NUM_SMS) ? kKIVI_SHAPE_FEW_CTAS : kKIVI_SHAPE_MANY_CTAS;
}
} // namespace

int32_t kiviDecodeVariantFor(KiviStepParams const& p, int32_t smVersion, int32_t numSms)
{
    if (p.decodeVariant != kKIVI_VARIANT_AUTO)
    {
        return p.decodeVariant;
    }
    int32_t const sms = numSms > 0 ? numSms : kDEFAULT_NUM_SMS;
    int32_t const cls = shapeClass(p, sms);
    for (KiviDecodePlanEntry const& e : kKIVI_DECODE_PLAN)
    {
        bool const match = (e.arch == 0 || e.arch == smVersion) && (e.minSms == 0 || sms >= e.minSms)
            && (e.maxSms == 0 || sms <= e.maxSms) && (e.shapeClass == kKIVI_SHAPE_ANY || e.shapeClass == cls);
        if (match && kiviVariantCompiled(e.variant, p.headDim, p.kBits, p.vBits))
        {
            return e.variant;
        }
    }
    return kKIVI_VARIANT_DEFAULT;
}

int32_t kiviSplitStaticSmemBytes(int32_t headDim)
{
    return 2 * (headDim / 32) * 32 * 16; // the B fragments of q (qa and rnd(qsc)), uint4 per lane and 32 channels
}

int32_t kiviSplitSmemBytes(int32_t headDim, int32_t kBits, int32_t vBits, int32_t stages, int32_t scaleBytes,
    int32_t groupSize)
{
    int32_t const gv = groupSize < headDim ? groupSize : headDim;
    // one 32-key stage (mmaStageBytes): K and V words, K scale + zero [D], V scale + zero [32 keys][D / Gv]
    int32_t const stage = 32 * headDim * (kBits + vBits) / 8 + 2 * headDim * scaleBytes
        + 2 * 32 * (headDim / gv) * scaleBytes;
    int32_t const rings = 4 * stages * stage;
    int32_t const fpTiles = 2 * 2 * 16 * headDim * 2; // two warps' 16-key K and V tiles of 16-bit rows
    int32_t const merge = 4 * kTILE_ROWS * (headDim + 2) * 4;
    return rings + fpTiles > merge ? rings + fpTiles : merge;
}

int32_t kiviVariantCtasPerSm(KiviStepParams const& p, int32_t variant)
{
    int32_t const bounds = defaultCtasPerSm(p.kBits, p.vBits); // __launch_bounds__ of both decode kernels
    if (variant <= kKIVI_VARIANT_AUTO || variant >= kKIVI_DECODE_VARIANT_COUNT
        || kKIVI_DECODE_VARIANTS[variant].kernel != kKIVI_KERNEL_SPLIT)
    {
        return bounds;
    }
    int32_t const stages = kiviVariantStages(variant, p.headDim, p.kBits, p.vBits);
    int32_t const smem = kiviSplitSmemBytes(p.headDim, p.kBits, p.vBits, stages, p.scaleDtype == kKIVI_FLOAT32 ? 4 : 2,
                             p.groupSize > 0 ? p.groupSize : 32)
        + kiviSplitStaticSmemBytes(p.headDim);
    int32_t const bySmem = 233472 / (smem + 1024); // sm_90: 228 KB per SM, 1 KB reserved per CTA
    int32_t const ctas = bySmem < bounds ? bySmem : bounds;
    return ctas > 0 ? ctas : 1;
}

KiviLaunchPlan kiviLaunchPlan(KiviStepParams const& p, int32_t smVersion)
{
    KiviLaunchPlan plan{};
    plan.decodeVariant = kiviDecodeVariantFor(p, smVersion, p.numSms);
    if (plan.decodeVariant <= 0 || plan.decodeVariant >= kKIVI_DECODE_VARIANT_COUNT)
    {
        plan.decodeVariant = kKIVI_VARIANT_DEFAULT; // invalid params: a useless but indexable plan
    }
    KiviDecodeVariant const& variant = kKIVI_DECODE_VARIANTS[plan.decodeVariant];
    plan.windowCapacity = windowCapacity(p.residualLength, p.groupSize);
    int64_t const capacity = int64_t(p.maxBlocksPerSeq) * p.blockSize + p.sinkTokens + plan.windowCapacity;
    plan.maxSeqLen = static_cast<int32_t>(p.maxSeqLen > 0 ? p.maxSeqLen : capacity);
    plan.maxChunkLen = p.maxChunkLen > 0 ? p.maxChunkLen : p.numTokens;
    // Divisors are clamped to >= 1 so that a plan of invalid params (kiviValidate rejects them) is merely useless.
    plan.groupHeads = p.numKvHeads > 0 && p.numHeads >= p.numKvHeads ? p.numHeads / p.numKvHeads : 1;
    plan.tileTokens = plan.groupHeads <= kMAX_TILE_ROWS ? kMAX_TILE_ROWS / plan.groupHeads : 1;
    int64_t const t = p.numTokens;
    int64_t const grp = plan.groupHeads;
    plan.tileRows = kTILE_ROWS;
    // Sequence b has ceil(c_b * grp / 8) tiles of 8 query rows: the sum is <= ceil(T * grp / 8) + B and
    // <= T * ceil(grp / 8).
    int64_t const byRows = ceilDiv(t * grp, kTILE_ROWS) + p.batch;
    int64_t const byTokens = t * ceilDiv(grp, kTILE_ROWS);
    int64_t tiles = byRows < byTokens ? byRows : byTokens;
    // Sequences with c_b * grp >= kPREFILL_TILE_ROWS run in the prefill kernel (possible only when the host bound
    // maxChunkLen allows it). Each has ceil(c_b * grp / 64) <= c_b * grp / 64 + 1 tiles and there are at most
    // min(B, floor(T * grp / 64)) of them; every other sequence has < 64 rows: at most 8 decode tiles.
    int64_t const prefillRows = int64_t(plan.maxChunkLen) * grp >= kPREFILL_TILE_ROWS ? t * grp : 0;
    int64_t const x = prefillRows / kPREFILL_TILE_ROWS;
    plan.numPrefillTiles = static_cast<int32_t>(x + (p.batch < x ? p.batch : x));
    if (plan.numPrefillTiles > 0)
    {
        int64_t const decodeCap = int64_t(p.batch) * ceilDiv(kPREFILL_TILE_ROWS - 1, kTILE_ROWS);
        tiles = tiles < decodeCap ? tiles : decodeCap;
    }
    // Decode mode (a fused variant, every chunk at most one token): tile x = sequence x tilesPerSeq + tile of the
    // sequence, so the attention kernel needs no prefix sums from the prepare kernel to find its sequence.
    plan.tilesPerSeq = static_cast<int32_t>(ceilDiv(grp, kTILE_ROWS));
    plan.decodeMode = variant.fused != 0 && plan.maxChunkLen <= 1 ? 1 : 0;
    if (plan.decodeMode)
    {
        tiles = int64_t(p.batch) * plan.tilesPerSeq;
    }
    plan.numTiles = static_cast<int32_t>(tiles);
    // Split the keys so that tiles x KV heads x splits fills the variant's waves of SMs x ctasPerSm resident CTAs
    // (never more CTAs than that unless tiles x KV heads alone exceed them); splits of >= kMIN_SPLIT_LEN keys.
    // Lengths are device values, so the split is sized for maxSeqLen (a hint when known).
    plan.ctasPerSm = p.ctasPerSm > 0 ? p.ctasPerSm : kiviVariantCtasPerSm(p, plan.decodeVariant);
    int64_t const splits = targetSplits(p, plan);
    int64_t const msl = plan.maxSeqLen > 0 ? plan.maxSeqLen : 1;
    int64_t const splitLen = ceilDiv(ceilDiv(msl, splits), kKEY_TILE) * kKEY_TILE;
    plan.splitLen = static_cast<int32_t>(splitLen);
    plan.numSplits = static_cast<int32_t>(ceilDiv(msl, splitLen));
    plan.flushGroupsPerSeq = static_cast<int32_t>(ceilDiv(plan.maxChunkLen, p.groupSize > 0 ? p.groupSize : 1));
    plan.seqInfoBytes = roundUp256(size_t(p.batch) * kSEQ_INFO_INTS * sizeof(int32_t));
    // Split partials of this step: [numTokens, numHeads, numSplits, D] fp32, then [.., 2] (m, l) (kiviLaunch.cu).
    // TensorRT's workspace is sized by kiviWorkspaceSizeForProfile, which covers every step of the profile.
    if (plan.numSplits > 1)
    {
        plan.partialBytes = partialBytesOf(p, plan.numSplits);
    }
    // Fused variants: with no prefill tile in the step the last CTA of each (tile, KV head) merges the splits (one
    // arrival counter each), and the attention kernel writes the window row of every one-token, non-flush chunk
    // (a row this step's attention never reads: the append kernel skips those sequences).
    plan.windowByAttention = variant.fused;
    plan.fusedCombine = variant.fused != 0 && plan.numPrefillTiles == 0 && plan.numSplits > 1 ? 1 : 0;
    if (plan.fusedCombine)
    {
        plan.counterBytes = roundUp256(size_t(plan.numTiles) * size_t(p.numKvHeads > 0 ? p.numKvHeads : 0) * 4);
    }
    return plan;
}

namespace
{
thread_local char tLastError[512] = "";
} // namespace

char const* kiviGetLastErrorMessage()
{
    return tLastError;
}

void kiviSetLastErrorMessage(char const* msg)
{
    std::snprintf(tLastError, sizeof(tLastError), "%s", msg != nullptr ? msg : "");
}

namespace
{
//! The variants a step with these host fields may run: p.decodeVariant, or for auto every variant the plan table
//! can pick on any arch (the workspace is sized before the device is known, e.g. by TensorRT at build time).
int32_t candidateVariants(KiviStepParams const& p, int32_t* out)
{
    if (p.decodeVariant != kKIVI_VARIANT_AUTO)
    {
        out[0] = p.decodeVariant;
        return 1;
    }
    int32_t n = 0;
    out[n++] = kKIVI_VARIANT_DEFAULT;
    for (KiviDecodePlanEntry const& e : kKIVI_DECODE_PLAN)
    {
        bool seen = false;
        for (int32_t i = 0; i < n; ++i)
        {
            seen = seen || out[i] == e.variant;
        }
        if (!seen && kiviVariantCompiled(e.variant, p.headDim, p.kBits, p.vBits))
        {
            out[n++] = e.variant;
        }
    }
    return n;
}

size_t planWorkspace(KiviLaunchPlan const& plan)
{
    return plan.seqInfoBytes + plan.partialBytes + plan.counterBytes;
}
} // namespace

size_t kiviWorkspaceSize(KiviStepParams const& p)
{
    if (p.batch <= 0 || p.numTokens <= 0)
    {
        return 0;
    }
    int32_t variants[kKIVI_DECODE_VARIANT_COUNT + kKIVI_DECODE_PLAN_SIZE];
    int32_t const n = candidateVariants(p, variants);
    size_t need = 0;
    for (int32_t i = 0; i < n; ++i)
    {
        KiviStepParams q = p;
        q.decodeVariant = variants[i];
        size_t const bytes = planWorkspace(kiviLaunchPlan(q));
        need = bytes > need ? bytes : need;
    }
    return need;
}

size_t kiviWorkspaceSizeForProfile(
    KiviStepParams const& maxStep, int32_t minTokens, int32_t minBatch, int32_t minBlocksPerSeq)
{
    if (maxStep.batch <= 0 || maxStep.numTokens <= 0)
    {
        return 0;
    }
    // Per-sequence info grows with batch: the largest batch. Partials: numSplits depends on the tile count, which
    // grows with tokens and batch, so for each token count the smallest batch has the most splits. With a fixed
    // block-table width (the exporter's) the plan's numSplits is exact; with a range of widths, the target split
    // count at the widest bounds numSplits at every width (a narrower table only lowers maxSplits). The split count
    // never increases with tokens: stop at the first token count without a split.
    // Decode mode (fused variants, chunks of at most one token) plans tiles per sequence: its split count does not
    // follow the token count, so those token counts never stop the loop. Arrival counters (fused combine) number at
    // most half the variant's CTA slots (a split count >= 2 means tiles x KV heads <= slots / 2).
    int32_t variants[kKIVI_DECODE_VARIANT_COUNT + kKIVI_DECODE_PLAN_SIZE];
    int32_t const n = candidateVariants(maxStep, variants);
    bool const fixedWidth = minBlocksPerSeq >= maxStep.maxBlocksPerSeq;
    size_t partial = 0;
    size_t counters = 0;
    for (int32_t v = 0; v < n; ++v)
    {
        KiviStepParams s = maxStep;
        s.decodeVariant = variants[v];
        s.maxSeqLen = 0;
        s.batch = minBatch < 1 ? 1 : (minBatch > maxStep.batch ? maxStep.batch : minBatch);
        for (int32_t t = minTokens < 1 ? 1 : minTokens; t <= maxStep.numTokens; ++t)
        {
            s.numTokens = t;
            KiviLaunchPlan const plan = kiviLaunchPlan(s);
            int64_t const target = targetSplits(s, plan);
            if (target <= 1 && !plan.decodeMode)
            {
                break;
            }
            int64_t const splits = fixedWidth ? plan.numSplits : target;
            size_t const bytes = splits > 1 ? partialBytesOf(s, splits) : 0;
            partial = bytes > partial ? bytes : partial;
            if (kKIVI_DECODE_VARIANTS[plan.decodeVariant].fused && splits > 1)
            {
                int64_t const sms = s.numSms > 0 ? s.numSms : kDEFAULT_NUM_SMS;
                size_t const slots
                    = size_t(sms * plan.ctasPerSm * kKIVI_DECODE_VARIANTS[plan.decodeVariant].waves);
                size_t const c = roundUp256(slots / 2 * sizeof(int32_t));
                counters = c > counters ? c : counters;
            }
        }
    }
    return roundUp256(size_t(maxStep.batch) * kSEQ_INFO_INTS * sizeof(int32_t)) + partial + counters;
}

int32_t kiviCheckArch(KiviStepParams const& p, int32_t smVersion, char* msg, size_t msgLen)
{
    if (msg != nullptr && msgLen > 0)
    {
        msg[0] = '\0';
    }
    // Every attention implementation kiviValidate admits (0 auto, 3 mma) is the mma.sync kernel: bf16/f16
    // m16n8k16, movmatrix and cp.async need sm_80.
    if (smVersion < kMIN_SM_TENSOR_CORE)
    {
        return fail(msg, msgLen,
            "attention_impl=%d (the mma.sync attention kernel) needs compute capability >= %d.%d; this device is "
            "sm_%d (%d.%d)",
            p.attentionImpl, kMIN_SM_TENSOR_CORE / 10, kMIN_SM_TENSOR_CORE % 10, smVersion, smVersion / 10,
            smVersion % 10);
    }
    return 0;
}

} // namespace kernels
} // namespace trtllm_kivi
