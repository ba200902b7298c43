// C ABI, host part: validation, launch plan and workspace size (plain C++; the CPU tests build it with g++ alone).
#include "kiviCApi.h"

#include "kiviDecodeVariants.h"
#include "kiviFormat.h"
#include "kiviParams.h"

#include <cstdio>

using trtllm_kivi::kernels::KiviLaunchPlan;
using trtllm_kivi::kernels::KiviStepParams;

extern "C"
{

size_t kiviCParamsSize(void)
{
    return sizeof(KiviStepParams);
}

int32_t kiviCFormatVersion(void)
{
    return trtllm_kivi::kFORMAT_VERSION;
}

int32_t kiviCValidate(void const* params, int32_t phase)
{
    char msg[512];
    int32_t const rc
        = trtllm_kivi::kernels::kiviValidate(*static_cast<KiviStepParams const*>(params), phase, msg, sizeof(msg));
    trtllm_kivi::kernels::kiviSetLastErrorMessage(rc == 0 ? "" : msg);
    return rc;
}

int32_t kiviCLaunchPlan(void const* params, int64_t* out)
{
    KiviStepParams const& p = *static_cast<KiviStepParams const*>(params);
    KiviLaunchPlan const plan = trtllm_kivi::kernels::kiviLaunchPlan(p);
    int64_t const fields[] = {plan.windowCapacity, plan.maxSeqLen, plan.maxChunkLen, plan.groupHeads, plan.tileTokens,
        plan.numTiles, plan.splitLen, plan.numSplits, plan.flushGroupsPerSeq, int64_t(plan.seqInfoBytes),
        int64_t(plan.partialBytes), int64_t(trtllm_kivi::kernels::kiviWorkspaceSize(p)), plan.tileRows,
        plan.ctasPerSm, plan.numPrefillTiles, plan.decodeVariant, plan.decodeMode, plan.tilesPerSeq,
        plan.fusedCombine, plan.windowByAttention, int64_t(plan.counterBytes)};
    for (int32_t i = 0; i < 21; ++i)
    {
        out[i] = fields[i];
    }
    return 0;
}

size_t kiviCWorkspaceSize(void const* params)
{
    return trtllm_kivi::kernels::kiviWorkspaceSize(*static_cast<KiviStepParams const*>(params));
}

size_t kiviCWorkspaceSizeForProfile(
    void const* maxParams, int32_t minTokens, int32_t minBatch, int32_t minBlocksPerSeq)
{
    return trtllm_kivi::kernels::kiviWorkspaceSizeForProfile(
        *static_cast<KiviStepParams const*>(maxParams), minTokens, minBatch, minBlocksPerSeq);
}

int32_t kiviCCheckArch(void const* params, int32_t smVersion)
{
    char msg[512];
    int32_t const rc = trtllm_kivi::kernels::kiviCheckArch(
        *static_cast<KiviStepParams const*>(params), smVersion, msg, sizeof(msg));
    trtllm_kivi::kernels::kiviSetLastErrorMessage(rc == 0 ? "" : msg);
    return rc;
}

char const* kiviCLastErrorMessage(void)
{
    return trtllm_kivi::kernels::kiviGetLastErrorMessage();
}

int32_t kiviCDecodeVariantCount(void)
{
    return trtllm_kivi::kernels::kKIVI_DECODE_VARIANT_COUNT;
}

char const* kiviCDecodeVariantName(int32_t id)
{
    using trtllm_kivi::kernels::kKIVI_DECODE_VARIANTS;
    return id >= 0 && id < trtllm_kivi::kernels::kKIVI_DECODE_VARIANT_COUNT ? kKIVI_DECODE_VARIANTS[id].name : nullptr;
}

int32_t kiviCDecodeVariantDescribe(int32_t id, char* buf, size_t len)
{
    namespace kk = trtllm_kivi::kernels;
    if (id < 0 || id >= kk::kKIVI_DECODE_VARIANT_COUNT || buf == nullptr)
    {
        return -1;
    }
    kk::KiviDecodeVariant const& v = kk::kKIVI_DECODE_VARIANTS[id];
    bool const split = v.kernel == kk::kKIVI_KERNEL_SPLIT;
    int const n = std::snprintf(buf, len,
        "{\"id\": %d, \"name\": \"%s\", \"kernel\": \"%s\", \"stages\": %d, \"keys_per_stage\": %d, "
        "\"waves\": %d, \"split_policy\": \"%s\", \"combine\": \"%s\", \"window\": \"%s\", "
        "\"prepare\": \"%s\", \"window_row_write\": \"%s\", \"copy\": \"cp.async\", "
        "\"compiled\": \"%s\"}",
        v.id, v.name, split ? "kiviDecodeSplitKernel" : "kiviDecodeMmaKernel", v.stages, v.keysPerStage, v.waves,
        v.waves == 1 ? "one wave" : "two waves", v.fused ? "fused (last CTA)" : "separate kernel",
        split ? "staged (cp.async, spread over splits and warps)" : "direct (per-lane global loads)",
        v.fused ? "in-kernel for pure-decode steps, overlapped (programmatic dependent launch on sm_90)"
                : "separate kernel",
        v.fused ? "attention kernel (one-token non-flush chunks)" : "append kernel",
        v.allCombos ? "every head_dim, dtype and bit width" : "head_dim 128, 2-bit K and V, fp16 and bf16");
    return n >= 0 && size_t(n) < len ? 0 : -1;
}

int32_t kiviCDecodeVariantFor(void const* params, int32_t smVersion, int32_t numSms)
{
    return trtllm_kivi::kernels::kiviDecodeVariantFor(*static_cast<KiviStepParams const*>(params), smVersion, numSms);
}

int32_t kiviCLaunchPlanFor(void const* params, int32_t smVersion, int64_t* out)
{
    KiviStepParams p = *static_cast<KiviStepParams const*>(params);
    p.decodeVariant = trtllm_kivi::kernels::kiviDecodeVariantFor(p, smVersion, p.numSms);
    return kiviCLaunchPlan(&p, out);
}

} // extern "C"
