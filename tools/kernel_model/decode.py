"""Decode steps of the measured kernel as the timing model sees them: its chunk classes (from its SASS) and, per
shape, its CTAs with each warp's work (from its launch plan and its warp assignment).

The measured kernel (kiviDecodeMma.cuh, decode variant "baseline"): grid (tiles, KV heads, splits) of 4 warps; the
prepare kernel gives every sequence a split length; a CTA's chunks go to its warps in contiguous ranges of
ceil(chunks / 4), quantized chunks first, so the last warp of a sequence's last split holds all of its window chunks
(the per-warp critical path). Quantized chunks stream through 3 cp.async stages whose refill is issued after the
chunk's compute (2 in flight); full-precision chunks are read per lane from global memory. Three launches: prepare,
attention, and the combine (splits > 1) or the zeroing of uncovered rows (one split)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .analysis import KernelResult
from .constants import constants_for
from .fullprec import FullChunk, full_chunk
from .plan import MMA_STAGES, MMA_WARPS, ceil_div, mma_launch_plan
from .shapes import GROUP, KEY_TILE, Gpu, ModelShape
from .spec import Ctx, kivi_tile_bytes
from .timing import ChunkClass, Constants, Machine, Step, Work, step_time

BASELINE_LAUNCHES = 3  # prepare, attention, combine or zero rows (invokeKiviAttention)


@dataclass(frozen=True)
class Cache:
    """What the step reads: KIVI (residual R = the window's minimum) or FP16 through the same kernel (every key a
    window row: R = the context, so nothing is quantized)."""
    name: str
    residual: int | None  # None: the context (FP16)


KIVI2 = Cache("kivi2", 128)
FP16 = Cache("fp16", None)


def quantized_keys(past: int, residual: int) -> int:
    """n_q(s) of the streaming contract (docs/design.md) at G = 32, no sinks."""
    return 0 if past < residual else (past - residual) // GROUP * GROUP


_FULL: dict[tuple[str, str, int], FullChunk] = {}


def baseline_classes(result: KernelResult, shape: ModelShape) -> dict[str, ChunkClass]:
    """The measured kernel's two chunk classes on this arch, from its SASS."""
    ctx = Ctx(shape, True)
    tile, _ = result.counts(ctx)
    key = (result.spec.name, result.arch, shape.head_dim)
    if key not in _FULL:
        _FULL[key] = full_chunk(result, ctx)
    fc = _FULL[key]
    return {
        "quantized": ChunkClass("quantized", tile.instructions, kivi_tile_bytes(shape), in_flight=MMA_STAGES - 1,
                                refill_after_compute=True),
        "full": ChunkClass("full", fc.instructions, 2 * KEY_TILE * shape.head_dim * 2, lines=fc.lines,
                           round_trips=fc.round_trips),
    }


def baseline_step(shape: ModelShape, batch: int, context: int, past: int, cache: Cache, ctas_per_sm: int,
                  sms: int) -> Step:
    """One decode step (chunk 1 per sequence, every sequence at `past`) of the measured kernel, plan as the benchmark
    builds it (max_seq_len = context)."""
    e = past + 1
    plan = mma_launch_plan(shape, batch, context, sms, e, ctas_per_sm)
    nq = quantized_keys(past, context if cache.residual is None else cache.residual)
    length = plan.seq_split_len
    ctas: list[tuple[Work, ...]] = []
    for z in range(plan.num_splits):
        k0 = z * length
        if k0 >= e:
            continue  # the CTA returns at once
        chunks = ceil_div(min(k0 + length, e) - k0, KEY_TILE)
        per = ceil_div(chunks, MMA_WARPS)
        warps = []
        for w in range(MMA_WARPS):
            c0 = min(w * per, chunks)
            c1 = min(c0 + per, chunks)
            cq = max(c0, min(c1, ceil_div(nq - k0, KEY_TILE)))
            warps.append((("quantized", float(cq - c0)), ("full", float(c1 - cq))))
        ctas += [tuple(warps)] * (plan.num_tiles * shape.num_kv_heads)
    return Step(ctas, ctas_per_sm, BASELINE_LAUNCHES, plan.num_splits if plan.num_splits > 1 else 0)


def step_bytes(shape: ModelShape, batch: int, past: int, cache: Cache, context: int) -> int:
    """Device bytes the step must read for its keys (the model's view: quantized chunks and window rows)."""
    nq = quantized_keys(past, context if cache.residual is None else cache.residual)
    rows = past + 1 - nq
    return batch * shape.num_kv_heads * (nq // KEY_TILE * kivi_tile_bytes(shape) + rows * shape.head_dim * 2 * 2)


def baseline_prediction(result: KernelResult, gpu: Gpu, shape: ModelShape, batch: int, context: int,
                        ctas_per_sm: int, past: int | None = None) -> dict:
    """The calibrated timing of the measured kernel's decode step (KIVI-2, past = context - 1 unless given)."""
    k, how = constants_for(gpu)
    past = context - 1 if past is None else past
    st = baseline_step(shape, batch, context, past, KIVI2, ctas_per_sm, gpu.sms)
    classes = baseline_classes(result, shape)
    return timed_record(step_time(st, classes, k, Machine(gpu.sms, gpu.clock_ghz)), classes, k, how,
                        step_bytes(shape, batch, past, KIVI2, context), "baseline")


def timed_record(t: dict, classes: dict[str, ChunkClass], k: Constants, how: str, nbytes: int, variant: str) -> dict:
    """The record fields of one timed step: time, limit, share of the read ceiling, the inputs."""
    return {"variant": variant, "predicted_us": t["us"], "bound": t["bound"], "timing": how,
            "read_fraction": round(nbytes / t["us"] / (k.read_gbps * 1e3), 4), "read_bytes": nbytes,
            "read_ceiling_gbps": k.read_gbps,
            "timed": {"time_by_limit_us": {n: round(v, 3) for n, v in t["time_by_limit_us"].items()},
                      "launches_us": round(t["launch_us"], 3), "combine_us": round(t["combine_us"], 3),
                      "waves": [{"ctas": w["ctas"], "ctas_per_sm": w["ctas_per_sm"], "us": round(w["us"], 3)}
                                for w in t["waves"]],
                      "chunk_classes": {c.name: asdict(c) for c in classes.values()}}}
