// C ABI, launch part: thin wrappers over invokeKivi* (ctypes passes the stream as a void pointer).
#include "kiviCApi.h"

#include "kiviKernels.h"
#include "kiviStreamRead.h"

using trtllm_kivi::kernels::KiviStepParams;

extern "C"
{

int32_t kiviCStep(void const* params, void* stream)
{
    return static_cast<int32_t>(trtllm_kivi::kernels::invokeKiviStep(
        *static_cast<KiviStepParams const*>(params), static_cast<cudaStream_t>(stream)));
}

int32_t kiviCAttention(void const* params, void* stream)
{
    return static_cast<int32_t>(trtllm_kivi::kernels::invokeKiviAttention(
        *static_cast<KiviStepParams const*>(params), static_cast<cudaStream_t>(stream)));
}

int32_t kiviCAttentionCtasPerSm(void const* params)
{
    return trtllm_kivi::kernels::kiviAttentionCtasPerSm(*static_cast<KiviStepParams const*>(params));
}

int32_t kiviCAppend(void const* params, void* stream)
{
    return static_cast<int32_t>(trtllm_kivi::kernels::invokeKiviAppend(
        *static_cast<KiviStepParams const*>(params), static_cast<cudaStream_t>(stream)));
}

int32_t kiviCStreamRead(void const* src, size_t bytes, float* partial, int32_t numCtas, void* stream)
{
    return static_cast<int32_t>(trtllm_kivi::kernels::invokeKiviStreamRead(
        src, bytes, partial, numCtas, static_cast<cudaStream_t>(stream)));
}

} // extern "C"
