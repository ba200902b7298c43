// C ABI, host part: validation, launch plan and workspace size (plain C++; the CPU tests build it with g++ alone).
#include "kiviCApi.h"

#include "kiviFormat.h"
#include "kiviParams.h"

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
        plan.ctasPerSm, plan.numPrefillTiles};
    for (int32_t i = 0; i < 15; ++i)
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

} // extern "C"
