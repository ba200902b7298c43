"""The split decode kernel (kiviDecodeSplit.cuh; decode variants >= 2 of kiviDecodeVariants.h) for the timing model:
its declared table for the SASS walker, its chunk classes and its decode steps. UNCALIBRATED: no GPU has timed it;
its predictions use the measured kernel's constants (a design's own SASS counts, plan, warp assignment, stages and
launches; the sustained IPC, latency and launch cost carried over) and say so in every record.

Its work, from the plan and the warp assignment the emulation shares (trtllm_kivi/cuda/launch.py launch_plan,
split_model.warp_work): quantized chunks in contiguous per-split ranges of at least 8, quarters to the 4 warps,
stages - 1 chunks in flight (the refill right after the wait); full-precision keys in 16-key tiles spread over the
splits and, within one, over warps 3 and 2 -- the first tile staged by cp.async before the warp's quantized chunks
(its latency hidden), each later one a round trip. Fused variants: one launch (the prepare kernel runs beside the
attention as a programmatic dependent -- an assumption) and the splits merged by the last CTA; unfused: three
launches as the measured kernel."""

from __future__ import annotations

import dataclasses

from trtllm_kivi.cuda.launch import launch_plan
from trtllm_kivi.cuda.split_model import warp_work
from trtllm_kivi.cuda.variants import VARIANT_AUTO, VARIANTS, shape_class, split_smem_bytes, variant_for, variant_stages
from trtllm_kivi.format import KiviConfig

from .analysis import KernelResult
from .constants import constants_for
from .decode import BASELINE_LAUNCHES, KIVI2, quantized_keys, step_bytes, timed_record
from .fullprec import count_under
from .plan import MMA_WARPS, occupancy
from .shapes import KEY_TILE, Gpu, ModelShape
from .spec import Ctx, KernelSpec, LoopSpec, PathRule, SmemAccess, kivi_code_words, kivi_tile_bytes, lanes
from .timing import ChunkClass, Machine, Step, Work, step_time

SPLIT = "kiviDecodeSplit.cuh"
HELPERS = "kiviSplitHelpers.cuh"
MMA = "kiviDecodeMma.cuh"
FP_TILE = 16
RESCALE_SHARE = 0.25  # as the measured kernel's table: the share of chunks whose running maximum grows
HEADLINE_BITS = (128, 2, 2)  # head_dim, k_bits, v_bits: the combination every split variant is compiled for

SPLIT_RULES = (
    PathRule(SPLIT, "splitKeyLoop<T, kD, kKB, kVB, kSTAGES, half, 0>(", 0, "fp16 scales with fp16 activations and "
             "G = 32 take the row-load copy of the key loop"),
    PathRule(SPLIT, "splitKeyLoop<T, kD, kKB, kVB, kSTAGES, __nv_bfloat16, 0>(", 0, "fp16 scales"),
    PathRule(SPLIT, "splitKeyLoop<T, kD, kKB, kVB, kSTAGES, float, 0>(", 0, "fp16 scales"),
    PathRule(HELPERS, "alpha[j] = mx[j] == st.m[j] ? 1.F : fastExp2(st.m[j] - mx[j]);", RESCALE_SHARE,
             "rescale only when a row maximum grows"),
    PathRule(HELPERS, "st.o[mt][r] *= alpha[r & 1];", RESCALE_SHARE, "rescale only when a row maximum grows"),
    PathRule(HELPERS, "st.vb[r] *= alpha[r & 1];", RESCALE_SHARE, "rescale only when a row maximum grows"),
    PathRule(HELPERS, "mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffU, mx[j], o));", RESCALE_SHARE,
             "the cross-lane maximum only after a vote says a score grew"),
    PathRule(SPLIT, "cur = nxt;", 1 / 128, "a new batch of 32 block-table entries every 128 chunks"),
    PathRule(SPLIT, "nxt = tableAt(tblBase + 32 + lane);", 1 / 128, "with cur = nxt"),
)

SPLIT_SMEM = (
    SmemAccess(SPLIT, "w[tau][j] = src[j];", "LDS", lanes(lambda lane: lane * 16), "K words: 16 B per lane"),
    SmemAccess(SPLIT, "wv[j] = src[j];", "LDS", lanes(lambda lane: lane * 16), "V words: 16 B per lane"),
    SmemAccess(HELPERS, "uint2 const sv = *reinterpret_cast<uint2 const*>(sBase + key * 8);", "LDS",
               lanes(lambda lane: 2 * (lane % 4) * 8), "V scale row of key 2t: broadcast over g"),
    SmemAccess(HELPERS, "uint2 const zv = *reinterpret_cast<uint2 const*>(zBase + key * 8);", "LDS",
               lanes(lambda lane: 2 * (lane % 4) * 8), "V zero row"),
    SmemAccess(MMA, "return *reinterpret_cast<uint32_t const*>(base + i * 2);", "LDS",
               lanes(lambda lane: (lane % 4) * 4), "staged K scale/zero pair, broadcast over g"),
    SmemAccess(MMA, "uint4 const x = qaS[i * 32 + lane];", "LDS", lanes(lambda lane: lane * 16),
               "q fragments, 16 B per lane"),
    SmemAccess(MMA, 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(s), "l"(gmem));', "LDGSTS",
               lanes(lambda lane: lane * 16), "cp.async 16 B per lane, contiguous"),
)
FP_COMPUTE = "splitFullPrecisionTile<T, kD>(fpBuf, qfS, wk.nq + kFP_TILE * j, wk.keyEnd, pos, vGroups, lane, st);"
FP_ISSUE_FIRST = "issueFullPrecisionTile<T, kD>(p, wk, fpBuf, fpFirst, lane);"
FP_ISSUE_LATER = "issueFullPrecisionTile<T, kD>(p, wk, fpBuf, j, lane);"
_ARGS = "KiviStepParams, KiviLaunchPlan, SeqInfo const*, float*, float*, int32_t*"


def split_spec(stages: int, min_arch: int = 80) -> KernelSpec:
    """The split kernel's table (half, D = 128, 2/2 bits) at `stages` cp.async stages per warp."""
    loops = (LoopSpec("tile", lambda c: 1, "BRA", SPLIT, "for (int32_t ci = wc0; ci < wc1; ++ci)"),
             LoopSpec("prologue", lambda c: stages - 1, "LDGDEPBAR", SPLIT,
                      "for (int32_t i = 0; i < kSTAGES - 1; ++i)", ("issue(wc0 + i);",)))
    smem = split_smem_bytes(*HEADLINE_BITS, stages, 2, 32)
    return KernelSpec(
        f"split_s{stages}", f"kiviDecodeSplitKernelI6__halfLi128ELi2ELi2ELi{stages}E", (SPLIT,),
        f"template __global__ void kiviDecodeSplitKernel<half, 128, 2, 2, {stages}>({_ARGS});", 128, loops,
        SPLIT_RULES, (), SPLIT_SMEM, kivi_tile_bytes, kivi_code_words, stages * MMA_WARPS, min_arch=min_arch,
        tile_warps=1, dynamic_smem=lambda shape: smem, note="the split design (decode variants >= 2): uncalibrated")


def _stages_of(vid: int) -> int:
    return variant_stages(vid, *HEADLINE_BITS)


def kernel_of(vid: int) -> str:
    """The table entry (kernel name) that split variant `vid` runs."""
    return f"split_s{_stages_of(vid)}"


# One kernel per stage count the split variants use; the default's for both archs, the others for sm_90 only
# (the tuning target), which bounds the model's compile time in CI.
_DEFAULT_STAGES = _stages_of(2)
SPLIT_KERNELS: tuple[KernelSpec, ...] = tuple(
    split_spec(s, 80 if s == _DEFAULT_STAGES else 90)
    for s in sorted({_stages_of(v.id) for v in VARIANTS if v.kernel == "split" and v.id != VARIANT_AUTO}))


_CLASSES: dict[tuple[str, str, int], dict[str, ChunkClass]] = {}


def split_classes(result: KernelResult, shape: ModelShape) -> dict[str, ChunkClass]:
    """The split kernel's work classes on this arch, from its SASS (cached per kernel, arch and head_dim)."""
    key = (result.spec.name, result.arch, shape.head_dim)
    if key not in _CLASSES:
        _CLASSES[key] = _classes(result, shape)
    return _CLASSES[key]


def _classes(result: KernelResult, shape: ModelShape) -> dict[str, ChunkClass]:
    ctx = Ctx(shape, True)
    tile, _ = result.counts(ctx)
    an = result.analysis
    compute = count_under(an, ctx, SPLIT, FP_COMPUTE)
    fp_bytes = FP_TILE * shape.head_dim * 2 * 2  # K and V rows of 16 keys
    stages = result.spec.stages // MMA_WARPS
    return {
        "quantized": ChunkClass("quantized", tile.instructions, kivi_tile_bytes(shape), in_flight=stages - 1),
        "tile_first": ChunkClass("tile_first", compute + count_under(an, ctx, SPLIT, FP_ISSUE_FIRST), fp_bytes),
        "tile": ChunkClass("tile", compute + count_under(an, ctx, SPLIT, FP_ISSUE_LATER), fp_bytes, round_trips=1),
    }


def split_step(shape: ModelShape, batch: int, context: int, past: int, vid: int, ctas_per_sm: int, sms: int
               ) -> Step:
    """One pure-decode step of variant `vid` (every sequence at `past`, chunk 1), plan as the benchmark builds it."""
    cfg = KiviConfig()
    lp = launch_plan(cfg, shape.num_heads, shape.num_kv_heads, shape.head_dim, batch, batch,
                     -(-context // cfg.block_size), 1, context, sms, ctas_per_sm, vid)
    nq = quantized_keys(past, cfg.residual_length)
    ctas: list[tuple[Work, ...]] = []
    for split in range(lp.num_splits):
        warps = tuple((("quantized", float(len(chunks))), ("tile_first", float(len(tiles) > 0)),
                       ("tile", float(max(len(tiles) - 1, 0)))) for chunks, tiles in warp_work(nq, past + 1, split,
                                                                                                  lp.num_splits))
        ctas += [warps] * (lp.num_tiles * shape.num_kv_heads)
    launches = 1 if VARIANTS[vid].fused else BASELINE_LAUNCHES
    return Step(ctas, ctas_per_sm, launches, lp.num_splits if lp.num_splits > 1 else 0)


def default_variant(gpu: Gpu, shape: ModelShape, batch: int) -> str:
    """The variant `auto` picks for a pure-decode step of this shape (the plan table)."""
    cls = shape_class(shape.num_heads, shape.num_kv_heads, batch, batch, 1, gpu.sms)
    return VARIANTS[variant_for(VARIANT_AUTO, *HEADLINE_BITS, cls, int(gpu.arch.split("_")[1]), gpu.sms)].name


def variant_records(results: dict[tuple[str, str], KernelResult], gpu: Gpu, shape: ModelShape, batch: int,
                    context: int) -> list[dict]:
    """One record per split variant whose kernel was analysed for this GPU's arch (uncalibrated)."""
    k, how = constants_for(gpu)
    default = default_variant(gpu, shape, batch)
    out = []
    for v in VARIANTS:
        r = results.get((kernel_of(v.id), gpu.arch)) if v.kernel == "split" and v.id else None
        if r is None:
            continue
        res = dataclasses.replace(r.resources, smem_bytes=r.resources.smem_bytes + r.spec.dynamic_smem(shape))
        occ = occupancy(res, r.spec.threads, gpu)
        st = split_step(shape, batch, context, context - 1, v.id, occ["ctas_per_sm"], gpu.sms)
        classes = split_classes(r, shape)
        t = step_time(st, classes, k, Machine(gpu.sms, gpu.clock_ghz))
        fp16_us = k.sdpa_us + batch * context * shape.num_kv_heads * shape.head_dim * 4 / (k.read_gbps * 1e3)
        label = "uncalibrated: a design no GPU has timed, charged with the measured kernel's constants" + \
            ("" if how.startswith("calibrated") else f" ({how})")
        rec = timed_record(t, classes, k, label,
                           step_bytes(shape, batch, context - 1, KIVI2, context), v.name)
        out.append({"gpu": gpu.name, "model": shape.name, "batch": batch, "context": context, "kernel": r.spec.name,
                    "default": v.name == default, **rec, "predicted_us": round(t["us"], 2),
                    "fp16_us": round(fp16_us, 2), "speedup_vs_fp16": round(fp16_us / t["us"], 3),
                    "fp16": "torch SDPA over an FP16 cache, calibrated model", "arch": r.arch,
                    "label": "static model, not a measurement", "occupancy": occ,
                    "resources": dataclasses.asdict(r.resources), "zero_spills": r.resources.spill_stores == 0
                    and r.resources.spill_loads == 0, "plan": {"num_splits": max(st.combined_splits, 1),
                                                               "grid_ctas": len(st.ctas)},
                    "per_tile": {**r.counts(Ctx(shape, True))[0].as_dict(), "bytes": kivi_tile_bytes(shape),
                                 "keys": KEY_TILE}})
    return out
