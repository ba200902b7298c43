/*
 * KIVI decode attention: the compiled design points ("variants") and the plan table that picks one per step.
 * Plain C++ (no CUDA): the host validation, the C ABI (kiviCApi.h) and the CPU tests read the same table.
 *
 * A variant is one design point of the decode attention path: which kernel, its compile-time tunables (cp.async
 * stages per warp, keys per stage) and its launch-time ones (split policy, fused combine + in-kernel prepare for
 * pure-decode steps). Ids are stable: results JSON and the plan table refer to them.
 *   0 = auto: the plan table's choice for (arch, SM count, shape class);
 *   1 = baseline: kiviDecodeMma.cuh exactly as measured in benchmarks/results/bench_kernels_h200.json (prepare,
 *       attention, combine or zero rows, append; one-wave split), kept for same-run A/B and model calibration;
 *   2.. = kiviDecodeSplit.cuh designs. Variant 2 is compiled for every supported combination (the default);
 *       the others only for the headline combinations (kiviVariantCompiled) to bound compile time.
 * trtllm_kivi/cuda/launch.py mirrors this table (tests/test_kernels_host.py compares them).
 */
#pragma once

#include <cstddef>
#include <cstdint>

namespace trtllm_kivi
{
namespace kernels
{

//! Which attention kernel a variant runs.
enum KiviDecodeKernel : int32_t
{
    kKIVI_KERNEL_BASELINE = 0, //!< kiviDecodeMmaKernel (window rows read per lane from global memory)
    kKIVI_KERNEL_SPLIT = 1,    //!< kiviDecodeSplitKernel (window rows staged by cp.async, spread over splits/warps)
};

struct KiviDecodeVariant
{
    int32_t id;
    char const* name;
    int32_t kernel;       //!< KiviDecodeKernel
    int32_t stages;       //!< cp.async stages per warp; 0: by bits (kiviSplitDefaultStages), the most that keep
                          //!< the designed occupancy
    int32_t keysPerStage; //!< keys per stage (one 32-key chunk)
    int32_t waves;        //!< split policy: the split fills this many waves of SMs x ctasPerSm resident CTAs
    int32_t fused;        //!< pure-decode steps: in-kernel prepare, last-CTA combine, window row written by the
                          //!< attention kernel, programmatic dependent launch on sm_90 (0: separate kernels)
    int32_t allCombos;    //!< 1: compiled for every (head_dim, act dtype, bits); 0: headline combinations only
};

constexpr int32_t kKIVI_VARIANT_AUTO = 0;
constexpr int32_t kKIVI_VARIANT_BASELINE = 1;
constexpr int32_t kKIVI_VARIANT_DEFAULT = 2; //!< compiled for every combination; auto falls back to it

//! The variants, indexed by id (entry 0 = auto describes nothing; its fields are unused).
constexpr KiviDecodeVariant kKIVI_DECODE_VARIANTS[] = {
    {0, "auto", kKIVI_KERNEL_SPLIT, 0, 32, 2, 1, 1},
    {1, "baseline", kKIVI_KERNEL_BASELINE, 3, 32, 1, 0, 0},
    {2, "split", kKIVI_KERNEL_SPLIT, 0, 32, 2, 1, 1},
    {3, "split-s3", kKIVI_KERNEL_SPLIT, 3, 32, 2, 1, 0},
    {4, "split-s6", kKIVI_KERNEL_SPLIT, 6, 32, 2, 1, 0},
    {5, "split-1wave", kKIVI_KERNEL_SPLIT, 0, 32, 1, 1, 1},
    {6, "split-unfused", kKIVI_KERNEL_SPLIT, 0, 32, 2, 0, 1},
};
constexpr int32_t kKIVI_DECODE_VARIANT_COUNT = static_cast<int32_t>(sizeof(kKIVI_DECODE_VARIANTS) / sizeof(kKIVI_DECODE_VARIANTS[0]));

//! The headline combination the non-default variants are compiled for: head_dim 128, 2-bit K and V (fp16 and
//! bf16 activations), the measured shapes.
constexpr bool kiviIsHeadlineCombo(int32_t headDim, int32_t kBits, int32_t vBits)
{
    return headDim == 128 && kBits == 2 && vBits == 2;
}

//! True when variant `id` (1..count-1) is compiled for (headDim, kBits, vBits) (any act dtype, scale dtype, G).
constexpr bool kiviVariantCompiled(int32_t id, int32_t headDim, int32_t kBits, int32_t vBits)
{
    return id > 0 && id < kKIVI_DECODE_VARIANT_COUNT
        && (kKIVI_DECODE_VARIANTS[id].allCombos != 0 || kiviIsHeadlineCombo(headDim, kBits, vBits));
}

//! cp.async stages per warp of the split kernel when a variant says 0: the most (2..4) whose shared memory keeps 3
//! resident CTAs per SM on sm_90 with 2/4-bit operands (2 with an 8-bit one) at fp16/bf16 scales and G = 32:
//! 2/2-bit D 128: 4; 4/4-bit: 2; 8/8-bit: 2. A pure function of the compile-time shape (see kiviDecodeSplit.cuh).
constexpr int32_t kiviSplitDefaultStages(int32_t headDim, int32_t kBits, int32_t vBits)
{
    // bytes of one 32-key stage at 16-bit scales, G = 32 (mmaStageBytes): codes + K scale/zero + V scale/zero
    int32_t const stage = 32 * headDim * (kBits + vBits) / 8 + 4 * headDim + 4 * 32 * (headDim / 32);
    int32_t const fixed = 2 * 16 * headDim * 2 * 2 + headDim / 32 * 32 * 16 * 2; // fp tiles of 2 warps + q fragments
    int32_t const ctas = kBits == 8 || vBits == 8 ? 2 : 3;
    int32_t const perCta = 233472 / ctas - 1024; // sm_90: 228 KB per SM, 1 KB reserved per CTA
    int32_t stages = 4;
    while (stages > 2 && 4 * stages * stage + fixed > perCta)
    {
        --stages;
    }
    return stages;
}

//! Stages a variant compiles to for (headDim, kBits, vBits).
constexpr int32_t kiviVariantStages(int32_t id, int32_t headDim, int32_t kBits, int32_t vBits)
{
    return kKIVI_DECODE_VARIANTS[id].stages > 0 ? kKIVI_DECODE_VARIANTS[id].stages
                                               : kiviSplitDefaultStages(headDim, kBits, vBits);
}

//! Shape classes of the plan table.
enum KiviShapeClass : int32_t
{
    kKIVI_SHAPE_ANY = -1,
    kKIVI_SHAPE_FEW_CTAS = 0,  //!< pure decode, tiles x KV heads < SMs: latency-bound (e.g. batch 1)
    kKIVI_SHAPE_MANY_CTAS = 1, //!< pure decode, tiles x KV heads >= SMs: bandwidth-bound (batch >= 8 x 8 KV heads)
    kKIVI_SHAPE_MIXED = 2,     //!< a step with chunks longer than one token (prefill or mixed)
};

//! One row of the plan table: the variant `auto` picks on an arch (sm major * 10 + minor, 0 = any) with an SM count
//! in [minSms, maxSms] (0 = no bound) for a shape class.
struct KiviDecodePlanEntry
{
    int32_t arch;
    int32_t minSms;
    int32_t maxSms;
    int32_t shapeClass;
    int32_t variant;
};

//! The plan table, first match wins. NOT MEASURED: every entry is the designed default (variant 2) until a GPU
//! sweep (build_scripts/gpu_tune.sh, benchmarks/results/) replaces it; the sweep's JSON is committed beside it.
constexpr KiviDecodePlanEntry kKIVI_DECODE_PLAN[] = {
    {90, 0, 0, kKIVI_SHAPE_FEW_CTAS, 2},  // H100 / H200: designed default, not measured
    {90, 0, 0, kKIVI_SHAPE_MANY_CTAS, 2}, // designed default, not measured
    {90, 0, 0, kKIVI_SHAPE_MIXED, 2},     // designed default, not measured
    {0, 0, 0, kKIVI_SHAPE_ANY, 2},        // every other arch (sm_80 kept correct, not tuned): the default
};
constexpr int32_t kKIVI_DECODE_PLAN_SIZE = static_cast<int32_t>(sizeof(kKIVI_DECODE_PLAN) / sizeof(kKIVI_DECODE_PLAN[0]));

} // namespace kernels
} // namespace trtllm_kivi
