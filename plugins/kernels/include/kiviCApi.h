/*
 * KIVI kernels: a small C ABI over the launchers, loaded with ctypes (trtllm_kivi/cuda/). Plain ints and pointers.
 * Every call returns 0 on success, else a nonzero code (a cudaError_t value) with a message in
 * kiviCLastErrorMessage(). `stream` is a cudaStream_t (torch.cuda.current_stream().cuda_stream).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C"
{
#endif

//! sizeof(KiviStepParams): the ctypes mirror checks it.
size_t kiviCParamsSize(void);
//! FORMAT_VERSION the library was built for.
int32_t kiviCFormatVersion(void);
//! 0 when params (a KiviStepParams*) are valid for `phase` (1 attention, 2 append, 3 step); else -1 + message.
int32_t kiviCValidate(void const* params, int32_t phase);
//! Launch plan fields as int64 [windowCapacity, maxSeqLen, maxChunkLen, groupHeads, tileTokens, numTiles, splitLen,
//! numSplits, flushGroupsPerSeq, seqInfoBytes, partialBytes, workspaceSize, tileRows, ctasPerSm, numPrefillTiles,
//! decodeVariant, decodeMode, tilesPerSeq, fusedCombine, windowByAttention, counterBytes] into out[21] (auto
//! resolved for sm_90; kiviCLaunchPlanFor names the arch).
int32_t kiviCLaunchPlan(void const* params, int64_t* out);
size_t kiviCWorkspaceSize(void const* params);
//! Workspace bytes serving every step of a profile (kiviWorkspaceSizeForProfile): maxParams at the profile max.
size_t kiviCWorkspaceSizeForProfile(
    void const* maxParams, int32_t minTokens, int32_t minBatch, int32_t minBlocksPerSeq);
//! 0 when params->attentionImpl runs on compute capability smVersion (major * 10 + minor); else -1 + message.
int32_t kiviCCheckArch(void const* params, int32_t smVersion);
char const* kiviCLastErrorMessage(void);

//! Decode attention variants (kiviDecodeVariants.h), host-only: count, names, a JSON object of each one's tunables,
//! and what `auto` (decodeVariant 0) picks for these params on compute capability smVersion with numSms SMs.
int32_t kiviCDecodeVariantCount(void);
//! NULL when id is out of range.
char const* kiviCDecodeVariantName(int32_t id);
//! 0 and a JSON object with the tunables in buf (NUL-terminated), -1 for a bad id or a too small buffer.
int32_t kiviCDecodeVariantDescribe(int32_t id, char* buf, size_t len);
int32_t kiviCDecodeVariantFor(void const* params, int32_t smVersion, int32_t numSms);
//! kiviCLaunchPlan with `auto` resolved for compute capability smVersion (kiviCLaunchPlan assumes sm_90).
int32_t kiviCLaunchPlanFor(void const* params, int32_t smVersion, int64_t* out);

//! Launchers (need the CUDA library, not the host-only one).
//! Resident CTAs per SM of the default attention kernel for these params on the current device (an occupancy query,
//! no launch): pass it as KiviStepParams::ctasPerSm so the split fills whole waves. -1 on error.
int32_t kiviCAttentionCtasPerSm(void const* params);
int32_t kiviCStep(void const* params, void* stream);
int32_t kiviCAttention(void const* params, void* stream);
int32_t kiviCAppend(void const* params, void* stream);

//! The read-only streaming kernel (kiviStreamRead.h), the benchmarks' measured memory roofline: reads `bytes` at src
//! (16-byte aligned) with 16-byte loads on numCtas CTAs, partial[c] = CTA c's XOR of the 32-bit words it read (bits
//! in a float slot). 0 on success, else a cudaError_t value (message in kiviCLastErrorMessage() for bad arguments).
int32_t kiviCStreamRead(void const* src, size_t bytes, float* partial, int32_t numCtas, void* stream);

#ifdef __cplusplus
}
#endif
