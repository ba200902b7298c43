/*
 * KIVI kernels: the launcher API (what the TensorRT plugin's enqueue and the C ABI call). No TensorRT, no torch.
 *
 * A step (the KiviAttention op) = attend, then append, on the caller's stream, never the default stream:
 *   invokeKiviStep      = invokeKiviAttention + invokeKiviAppend (in that order).
 *   invokeKiviAttention : out = attention of each chunk over state(past_len) + the chunk (causal, fp32 softmax).
 *   invokeKiviAppend    : quantize tokens [n_q(s), n_q(e)) into the store, then write the window rows of tokens
 *                         [max(s, e - W), e) at row t % W.
 * Launchers validate the host fields first (cudaErrorInvalidValue, message in kiviGetLastErrorMessage()), never
 * synchronize, and return the launch status. Device-side length problems are reported through params.errorFlag.
 */
#pragma once

#include "kiviParams.h"

#include <cuda_runtime_api.h>

namespace trtllm_kivi
{
namespace kernels
{

cudaError_t invokeKiviStep(KiviStepParams const& params, cudaStream_t stream);
cudaError_t invokeKiviAttention(KiviStepParams const& params, cudaStream_t stream);
cudaError_t invokeKiviAppend(KiviStepParams const& params, cudaStream_t stream);

//! Resident CTAs per SM of the default attention kernel chosen by (headDim, actDtype, kBits, vBits, scaleDtype,
//! groupSize) on the current device: pass it as params.ctasPerSm (and to kiviWorkspaceSize) so the split fills whole
//! waves. -1 for unsupported values or a failed query.
int32_t kiviAttentionCtasPerSm(KiviStepParams const& params);

} // namespace kernels
} // namespace trtllm_kivi
