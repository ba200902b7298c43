// C ABI of the native CPU KIVI library (libtrtllm_kivi_cpu.so), loaded by trtllm_kivi/cpu/_abi.py with ctypes.
// The op follows trtllm_kivi.reference.attention.kivi_attention_ (attend, then append; buffers updated in place);
// kiviCpuDense is the unquantized baseline (cache.FullCache: write the chunk, then attend over the dense cache).
// Every function returns 0 on success, else a nonzero KiviCpuStatus with kiviCpuLastError() naming the bad value.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifndef KIVI_CPU_API
#define KIVI_CPU_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Activation / scale / cache dtype codes (same order as format.SUPPORTED_SCALE_DTYPES).
enum KiviCpuDtype { kiviCpuFloat16 = 0, kiviCpuBfloat16 = 1, kiviCpuFloat32 = 2 };
// Instruction-set path: auto picks the best the CPU supports; a forced path the CPU lacks is an error. avx512vnni is
// avx512 plus VNNI and VBMI (integer dot products for 2-bit codes). avx2denormal is avx2 with 2-bit codes decoded as
// subnormal floats (one AND per 8 codes): auto picks it on AMD CPUs without AVX-512; it runs on any AVX2 CPU, slowly
// on Intel (subnormal operands take a microcode assist there).
enum KiviCpuIsa
{
    kiviCpuIsaAuto = 0,
    kiviCpuIsaPortable = 1,
    kiviCpuIsaAvx2 = 2,
    kiviCpuIsaAvx512 = 3,
    kiviCpuIsaAvx512Vnni = 4,
    kiviCpuIsaAvx2Denormal = 5
};
// What a step runs: attend then append (the op), attention only, or append only.
enum KiviCpuPhase { kiviCpuPhaseStep = 3, kiviCpuPhaseAttention = 1, kiviCpuPhaseAppend = 2 };
enum KiviCpuStatus { kiviCpuOk = 0, kiviCpuInvalidValue = 1, kiviCpuUnsupportedIsa = 2, kiviCpuInternal = 3 };

// One step of the KiviAttention op over a ragged batch. Layouts: trtllm_kivi/format.py FORMAT_VERSION 3 (per-channel K
// and all V codes in FRAGMENT order; per-token K codes LINEAR; windows of S + R + G - 1 rows; all tensors contiguous).
typedef struct KiviCpuParams
{
    int32_t numHeads, numKvHeads, headDim;
    int32_t kBits, vBits, groupSize, residualLength, blockSize;
    int32_t scaleDtype;  // KiviCpuDtype of k/v scale and zero
    int32_t keyGrouping; // 0 per_channel, 1 per_token
    int32_t sinkTokens;  // S in [0, 128]: tokens [0, S) stay in full precision at window rows [0, S)
    int32_t actDtype;    // KiviCpuDtype of q, k, v, out and the windows
    int32_t batch, numTokens, numBlocks, numSlots, maxBlocksPerSeq;
    int32_t numThreads; // <= 0: the library default (kiviCpuSetNumThreads / $TRTLLM_KIVI_CPU_THREADS / cores)
    int32_t isa;        // KiviCpuIsa
    int32_t phase;      // KiviCpuPhase
    const void* q;      // [numTokens, numHeads, headDim]
    const void* k;      // [numTokens, numKvHeads, headDim]
    const void* v;
    void* out; // [numTokens, numHeads, headDim]
    const int32_t* slotIds;    // [batch]
    const int32_t* pastLen;    // [batch]
    const int32_t* chunkLen;   // [batch]
    const int32_t* blockTable; // [batch, maxBlocksPerSeq]
    void* kCodes;
    void* kScale;
    void* kZero;
    void* vCodes;
    void* vScale;
    void* vZero;
    void* kWindow;
    void* vWindow;
} KiviCpuParams;

// One step of the unquantized cache (FullCache): k/v of the chunk are written at [past, past + chunk) of the slot's
// dense rows (converted to cacheDtype), then each query attends causally over rows [0, past + chunk).
typedef struct KiviCpuDenseParams
{
    int32_t numHeads, numKvHeads, headDim;
    int32_t actDtype;   // q, k, v, out
    int32_t cacheDtype; // kCache, vCache
    int32_t batch, numTokens, numSlots, maxSeqLen;
    int32_t numThreads, isa;
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int32_t* slotIds;
    const int32_t* pastLen;
    const int32_t* chunkLen;
    void* kCache; // [numSlots, numKvHeads, maxSeqLen, headDim]
    void* vCache;
} KiviCpuDenseParams;

KIVI_CPU_API int32_t kiviCpuFormatVersion(void);
KIVI_CPU_API size_t kiviCpuParamsSize(void);
KIVI_CPU_API size_t kiviCpuDenseParamsSize(void);
// 1 when the path is compiled in and the CPU supports it (kiviCpuIsaAuto: always 1).
KIVI_CPU_API int32_t kiviCpuIsaSupported(int32_t isa);
// The path kiviCpuIsaAuto resolves to (honours $TRTLLM_KIVI_CPU_ISA = portable|avx2|avx2denormal|avx512|avx512vnni).
KIVI_CPU_API int32_t kiviCpuResolveIsa(int32_t isa);
// Keys per split of the log-sum-exp merge (fixed: results do not depend on threads or batch).
KIVI_CPU_API int32_t kiviCpuSplitLen(void);
KIVI_CPU_API void kiviCpuSetNumThreads(int32_t n);
KIVI_CPU_API int32_t kiviCpuGetNumThreads(void);
KIVI_CPU_API int32_t kiviCpuStep(const KiviCpuParams* params);
KIVI_CPU_API int32_t kiviCpuDense(const KiviCpuDenseParams* params);
KIVI_CPU_API const char* kiviCpuLastError(void);

#ifdef __cplusplus
}
#endif
