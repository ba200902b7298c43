// Entry points of one instruction-set path (kiviCpuIsa<Name>.cpp); the dispatcher picks a table at run time.
#pragma once
#include "kiviCpuCommon.h"

namespace trtllm_kivi
{
namespace cpu
{

struct IsaKernels
{
    void (*attendItem)(const Ctx& c, const WorkItem& it, float* scratch);
    void (*mergeItem)(const Ctx& c, const WorkItem& it, float* scratch);
};

extern const IsaKernels kPortableKernels;
#ifdef KIVI_CPU_HAVE_X86
extern const IsaKernels kAvx2Kernels;
extern const IsaKernels kAvx2DenormalKernels;
extern const IsaKernels kAvx512Kernels;
extern const IsaKernels kAvx512VnniKernels;
#endif

} // namespace cpu
} // namespace trtllm_kivi
