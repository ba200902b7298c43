/*
 * KIVI kernels: the launch parameters and their host-side validation. Plain C++ (no CUDA, no TensorRT includes), so
 * the validation and index math compile with g++ and are unit-tested on a machine without a GPU.
 *
 * KiviStepParams is a flat, standard-layout struct (ints, pointers, size_t only): the C ABI (kiviCApi.h) takes it by
 * pointer and Python mirrors it with ctypes (trtllm_kivi/cuda/_abi.py); kiviParamsSizeBytes() lets a test check the
 * mirror. Field order is part of the ABI: append new fields at the end only.
 */
#pragma once

#include <cstddef>
#include <cstdint>

namespace trtllm_kivi
{
namespace kernels
{

//! Activation / scale dtype codes; equal to kSCALE_DTYPE_* of kiviFormat.h (FLOAT32 is a scale dtype only).
enum KiviDataType : int32_t
{
    kKIVI_FLOAT16 = 0,
    kKIVI_BFLOAT16 = 1,
    kKIVI_FLOAT32 = 2,
};

//! Bits of the device error flag (KiviStepParams::errorFlag). Kernels never sync the host: a sequence failing a check
//! is skipped (its output rows are zero, its cache untouched) and the bit is OR-ed into *errorFlag.
enum KiviErrorBits : int32_t
{
    kKIVI_ERR_LENGTH = 1,   //!< past_len < 0, chunk_len < 0, chunk_len > maxChunkLen or tokens past numTokens
    kKIVI_ERR_CAPACITY = 2, //!< n_q(past_len + chunk_len) beyond maxBlocksPerSeq * blockSize, or beyond maxSeqLen
    kKIVI_ERR_SLOT = 4,     //!< slot id outside [0, numSlots)
    kKIVI_ERR_BLOCK_ID = 8, //!< a used block-table entry outside [0, numBlocks)
};

//! One KiviAttention step (attend, then append) over a ragged batch. Shapes follow trtllm_kivi/format.py:
//!   q [numTokens, numHeads, headDim], k/v [numTokens, numKvHeads, headDim] (activation dtype, post-RoPE);
//!   out [numTokens, numHeads, headDim]; slotIds/pastLen/chunkLen [batch] int32 (device); blockTable
//!   [batch, maxBlocksPerSeq] int32 (device); kCodes [numBlocks, Hkv, BS/(32/kBits), D] int32; kScale/kZero
//!   [numBlocks, Hkv, BS/G, D]; vCodes [numBlocks, Hkv, BS, D/(32/vBits)] int32; vScale/vZero [numBlocks, Hkv, BS,
//!   D/Gv]; kWindow/vWindow [numSlots, Hkv, R+G-1, D] (activation dtype).
struct KiviStepParams
{
    // geometry
    int32_t numHeads;
    int32_t numKvHeads;
    int32_t headDim;
    // KiviConfig (format.py)
    int32_t kBits;
    int32_t vBits;
    int32_t groupSize;
    int32_t residualLength;
    int32_t blockSize;
    int32_t scaleDtype;  //!< KiviDataType: fp16, bf16 or fp32
    int32_t keyGrouping; //!< kKEY_GROUPING_*: the kernels support per_channel (0) only
    int32_t actDtype;    //!< KiviDataType: fp16 or bf16 (q, k, v, out, windows)
    // batch and capacities (host values)
    int32_t batch;           //!< sequences in this step (B)
    int32_t numTokens;       //!< rows of q/k/v/out = sum(chunk_len) (checked on the device)
    int32_t maxChunkLen;     //!< host upper bound of chunk_len (0: numTokens); 1 for a pure decode step
    int32_t maxSeqLen;       //!< host upper bound of past_len + chunk_len (0: block-table capacity + window)
    int32_t numBlocks;       //!< blocks in the pool
    int32_t numSlots;        //!< window slots
    int32_t maxBlocksPerSeq; //!< columns of blockTable
    int32_t numSms;          //!< multiprocessors used to size the split over tokens (0: 132)
    // device pointers
    void const* q;
    void const* k;
    void const* v;
    void* out;
    int32_t const* slotIds;
    int32_t const* pastLen;
    int32_t const* chunkLen;
    int32_t const* blockTable;
    void* kCodes;
    void* kScale;
    void* kZero;
    void* vCodes;
    void* vScale;
    void* vZero;
    void* kWindow;
    void* vWindow;
    int32_t* errorFlag; //!< optional (may be null): KiviErrorBits OR-ed in by the kernels; the caller clears it
    void* workspace;    //!< kiviWorkspaceSize(params) bytes, 256-byte aligned (may be null when that size is 0)
    size_t workspaceSize;
    // appended after the first version of this struct (zero-initialized callers get the defaults)
    int32_t attentionImpl; //!< KiviAttentionImpl: 0 = auto (= 3, mma.sync), 1 / 2 legacy (refused), 3 = mma.sync
    int32_t ctasPerSm;     //!< resident attention CTAs per SM the split is sized for (0: defaultCtasPerSm); the
                           //!< launcher's kiviAttentionCtasPerSm() gives the real occupancy on the current device
    // FORMAT_VERSION 2 (format.py); rotation is applied outside the op, so only the sinks reach the kernels
    int32_t sinkTokens; //!< S (0 .. kMAX_SINK_TOKENS): tokens [0, S) kept in full precision, window rows [0, S)
    // decode attention design point (kiviDecodeVariants.h): 0 = auto (the plan table), 1 = baseline, 2.. = variants
    int32_t decodeVariant;
};

//! Attention kernel choice (KiviStepParams::attentionImpl). Same decomposition, same workspace.
enum KiviAttentionImpl : int32_t
{
    kKIVI_ATTN_AUTO = 0,        //!< the default: kKIVI_ATTN_MMA
    kKIVI_ATTN_SIMT = 1,        //!< legacy: reads the FORMAT_VERSION 1 layout; refused by kiviValidate (the static
                                //!< model compiles it as a calibration subject; the library does not)
    kKIVI_ATTN_TENSOR_CORE = 2, //!< legacy WMMA kernel: same
    kKIVI_ATTN_MMA = 3,         //!< mma.sync m16n8k16 over FRAGMENT-order codes (kiviDecodeMma.cuh), sm_80+
};

//! Derived launch geometry: a pure function of the host fields, shared by the launchers, the workspace query and
//! the CPU model of the decomposition (trtllm_kivi/cuda/model.py).
struct KiviLaunchPlan
{
    int32_t windowCapacity; //!< W = R + G - 1
    int32_t maxSeqLen;      //!< resolved maxSeqLen
    int32_t maxChunkLen;    //!< resolved maxChunkLen
    int32_t groupHeads;     //!< numHeads / numKvHeads
    int32_t tileTokens;     //!< legacy kernels only: kMAX_TILE_ROWS / groupHeads (>= 1)
    int32_t numTiles;       //!< attention grid.x: an upper bound of sum_b ceil(chunk_len[b] * groupHeads / tileRows)
    int32_t splitLen;       //!< keys per split at maxSeqLen (multiple of kKEY_TILE); numSplits = ceil(maxSeqLen / it)
    int32_t numSplits;      //!< attention grid.z. Each sequence splits its own length e over all of them:
                            //!< splitLen(e) = max(kMIN_SPLIT_LEN, roundUp(ceil(e / numSplits), kKEY_TILE))
    int32_t flushGroupsPerSeq; //!< flush grid.y: an upper bound of the groups one sequence quantizes in a step
    size_t seqInfoBytes;    //!< workspace part 1: per-sequence info
    size_t partialBytes;    //!< workspace part 2: split partials (m, l, acc[D]) of this step when numSplits > 1
                            //!< (numTokens x numHeads x numSplits rows); 0 when numSplits == 1
    int32_t tileRows;       //!< query rows per attention CTA (row r of a chunk = token r / groupHeads, head r %
                            //!< groupHeads): kTILE_ROWS, the MMA's N
    int32_t ctasPerSm;      //!< resolved KiviStepParams::ctasPerSm
    int32_t numPrefillTiles; //!< prefill kernel grid.x (0: no sequence of this step can be a prefill sequence): an
                             //!< upper bound of sum_b ceil(c_b x groupHeads / kPREFILL_TILE_ROWS) over the sequences
                             //!< with c_b x groupHeads >= kPREFILL_TILE_ROWS (kiviPrepareKernel's assignment)
    // appended with the decode variants (kiviDecodeVariants.h)
    int32_t decodeVariant; //!< the resolved variant (never 0 = auto)
    int32_t decodeMode;    //!< 1: a pure-decode step (maxChunkLen <= 1) of a fused variant: grid x = sequence x
                           //!< tilesPerSeq + tile, and the attention kernel derives each sequence's offsets itself
                           //!< (no wait for the prepare kernel before its key loop)
    int32_t tilesPerSeq;   //!< ceil(groupHeads / kTILE_ROWS): decode-mode tiles per sequence
    int32_t fusedCombine;  //!< 1: the last CTA of each (tile, KV head) merges the splits (no combine kernel): a
                           //!< fused variant, numSplits > 1 and no prefill tile in the step
    int32_t windowByAttention; //!< 1 (fused variants): the attention kernel writes the window row of each valid
                               //!< one-token non-flush chunk and the append kernel skips those sequences
    size_t counterBytes;   //!< workspace part 3 (fusedCombine): one int32 arrival counter per (tile, KV head),
                           //!< zeroed by kiviPrepareKernel each step
};

constexpr int32_t kKEY_TILE = 32;      //!< keys per attention tile (a G-group never straddles one: G % 32 == 0)
constexpr int32_t kMAX_TILE_ROWS = 16; //!< query rows (tokens x heads of one KV head) per attention CTA
constexpr int32_t kTILE_ROWS = 8;      //!< query rows per CTA of the mma.sync decode kernel (its N)
//! Query rows per CTA of the prefill kernel (kiviPrefillMma.cuh: 4 warps x the MMA's M = 16). A sequence whose chunk
//! has at least this many rows (chunk_len x groupHeads) runs there, every other one in the decode kernel.
constexpr int32_t kPREFILL_TILE_ROWS = 64;
constexpr int32_t kMIN_SPLIT_LEN = 256;
constexpr int32_t kDEFAULT_NUM_SMS = 132;
constexpr int32_t kMAX_SINK_TOKENS = 128; //!< format.py MAX_SINK_TOKENS
constexpr int32_t kMMA_CTAS_PER_SM = 3; //!< default occupancy of the 2/4-bit decode kernels (__launch_bounds__(128, 3))
//! The occupancy the split is sized for when the caller passes none: what __launch_bounds__ of kiviDecodeMmaKernel
//! guarantees (mmaMinCtas: 2 with an 8-bit operand, else 3), a pure function of the host fields, so TensorRT's
//! build-time workspace and every run-time plan agree on every device. tiles x KV heads x splits <= SMs x this.
constexpr int32_t defaultCtasPerSm(int32_t kBits, int32_t vBits)
{
    return kBits == 8 || vBits == 8 ? 2 : kMMA_CTAS_PER_SM;
}
constexpr int32_t kSEQ_INFO_INTS = 8; //!< per sequence: token/tile offsets, tile count, valid, split length, prefill tile
                                      //!< offset and count, 1 spare

//! Validate the host fields and pointers of `p` for `phase` (kPHASE_*). Returns 0 when valid, else writes a message
//! naming the bad value and the allowed range into msg (always NUL-terminated) and returns -1.
constexpr int32_t kPHASE_ATTENTION = 1;
constexpr int32_t kPHASE_APPEND = 2;
constexpr int32_t kPHASE_STEP = 3;
int32_t kiviValidate(KiviStepParams const& p, int32_t phase, char* msg, size_t msgLen);

//! The launch plan of `p` (call only with params that kiviValidate accepts, pointers aside).
//! `smVersion` (major * 10 + minor) resolves decodeVariant 0 (auto) through the plan table; host-only callers that do
//! not know the device get the sm_90 plan.
constexpr int32_t kKIVI_PLAN_ARCH = 90;
KiviLaunchPlan kiviLaunchPlan(KiviStepParams const& p, int32_t smVersion = kKIVI_PLAN_ARCH);

//! The variant `auto` resolves to for these host fields on a device of compute capability smVersion with numSms SMs
//! (0: kDEFAULT_NUM_SMS): the first matching entry of kKIVI_DECODE_PLAN whose variant is compiled for the
//! combination, else kKIVI_VARIANT_DEFAULT. An explicit p.decodeVariant is returned as is.
int32_t kiviDecodeVariantFor(KiviStepParams const& p, int32_t smVersion, int32_t numSms);

//! Shared memory (dynamic) of the split decode kernel for (headDim, bits, stages, scale bytes, G): per-warp stage
//! rings, the full-precision tiles of two warps; the warp merge reuses it. Static shared memory (q fragments) is
//! kiviSplitStaticSmemBytes(headDim).
int32_t kiviSplitSmemBytes(int32_t headDim, int32_t kBits, int32_t vBits, int32_t stages, int32_t scaleBytes,
    int32_t groupSize);
int32_t kiviSplitStaticSmemBytes(int32_t headDim);

//! Resident CTAs per SM the plan assumes for a variant when the caller passes none: the kernel's launch-bounds
//! occupancy, lowered where its shared memory allows fewer on sm_90 (228 KB per SM). A pure function of host fields.
int32_t kiviVariantCtasPerSm(KiviStepParams const& p, int32_t variant);

//! The message of the last validation failure of a launcher on this thread ("" when none), and its setter.
char const* kiviGetLastErrorMessage();
void kiviSetLastErrorMessage(char const* msg);

//! Workspace bytes a step with these host fields needs (pointers are ignored). Not monotonic in numTokens: a
//! decode step splits its keys (partials) where a long prefill step does not.
size_t kiviWorkspaceSize(KiviStepParams const& p);

//! Workspace bytes that serve every step of a TensorRT optimization profile: at least kiviWorkspaceSize of each step
//! whose numTokens is in [minTokens, maxStep.numTokens], batch in [minBatch, maxStep.batch] and maxBlocksPerSeq in
//! [minBlocksPerSeq, maxStep.maxBlocksPerSeq], the other host fields as in maxStep. Computed from the split plan of
//! each token count (the partials of the step with the most rows x splits, not of the largest step), so a
//! long-prefill profile is not charged for partials no step uses. Exact for a fixed block-table width.
size_t kiviWorkspaceSizeForProfile(
    KiviStepParams const& maxStep, int32_t minTokens, int32_t minBatch, int32_t minBlocksPerSeq);

//! Lowest compute capability (major * 10 + minor) of the attention kernels: the default mma.sync kernel (and the
//! legacy WMMA one) need sm_80.
constexpr int32_t kMIN_SM_TENSOR_CORE = 80;

//! 0 when the attention implementation p.attentionImpl runs on a device of compute capability smVersion
//! (major * 10 + minor), else -1 with a message naming both (msg always NUL-terminated).
int32_t kiviCheckArch(KiviStepParams const& p, int32_t smVersion, char* msg, size_t msgLen);

} // namespace kernels
} // namespace trtllm_kivi
