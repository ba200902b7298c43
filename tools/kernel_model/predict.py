"""The prediction: one decode step of one layer per (GPU, model, batch, context) and kernel. Every kernel gets its
ideal bounds from its counts, occupancy and launch plan (waves of max(issue, shared-memory, memory) time at the
GPU table's rates: `ideal_us`); the measured decode kernel ("mma", decode variant "baseline") gets the calibrated
timing model as `predicted_us` (decode.baseline_prediction; calibrate.FITTED), the legacy SIMT and WMMA kernels keep
their ideal bounds there, checked against a hand count of their SASS (CALIBRATION). FP16 = torch SDPA's calibrated
model (its bytes at the read ceiling + its fixed time)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .analysis import KernelResult
from .constants import constants_for
from .decode import baseline_prediction
from .kernels import KERNELS
from .plan import ceil_div, launch_plan, num_quantized, occupancy
from .shapes import BATCHES, CONTEXTS, GPUS, KEY_TILE, MODELS, WARP, Gpu, ModelShape
from .spec import Ctx
from .split import variant_records

DRAM_LATENCY_NS = 800.0  # loaded device-memory latency assumed for the bytes-in-flight check (detail only)
# Tensor-pipe cycles of one mma.sync (HMMA, m16n8k16 or k8) per SM sub-partition, a detail reported next to the three
# bounds: A100's dense fp16 peak (312 TFLOPS, 108 SMs, 1.41 GHz) is 256 FMA per clock per sub-partition = 8 cycles
# per m16n8k16; Hopper's legacy mma.sync path reaches about 2/3 of its wgmma peak (2048 FMA/clk/SM): ~6 cycles
# (an assumption, not measured here). k8 MMAs are charged as k16.
MMA_CYCLES = {"sm_80": 8.0, "sm_90": 6.0}


def round_sig(x: float, n: int = 3) -> float:
    return float(f"{x:.{n}g}") if abs(x) >= 1e-12 else 0.0


def wave_times(ctas: Sequence[tuple[float, ...]], slots: int, gpu: Gpu, mma_arch: str | None = None
               ) -> list[dict[str, Any]]:
    """CTAs (warp-instructions, wavefronts, device bytes[, MMAs]) in launch order, in waves of `slots`: each wave takes
    max(issue, shared, memory) -- the busiest SM runs ceil(CTAs / SMs) x the largest CTA; memory is the wave's bytes
    at copy bandwidth. mma_arch: also report the tensor pipe (4 sub-partitions per SM at MMA_CYCLES per mma.sync)."""
    issue_rate = gpu.issue_per_clk_per_sm * gpu.clock_ghz * 1e3  # warp-instructions per us per SM
    smem_rate = gpu.smem_wavefronts_per_clk_per_sm * gpu.clock_ghz * 1e3
    bw = gpu.copy_gbps * 1e3  # bytes per us
    waves: list[dict[str, Any]] = []
    for w0 in range(0, len(ctas), slots):
        wave = ctas[w0:w0 + slots]
        per_sm = ceil_div(len(wave), gpu.sms)
        t = {"issue": per_sm * max(c[0] for c in wave) / issue_rate,
             "shared": per_sm * max(c[1] for c in wave) / smem_rate,
             "memory": sum(c[2] for c in wave) / bw}
        bound = max(t, key=lambda k: t[k])
        w: dict[str, Any] = {"ctas": len(wave), "ctas_per_sm": per_sm, "bound": bound,
                             **{f"{k}_us": round_sig(v, 4) for k, v in t.items()}, "us": round_sig(t[bound], 4)}
        if mma_arch is not None:
            w["tensor_pipe_us"] = round_sig(per_sm * max(c[3] for c in wave) * MMA_CYCLES[mma_arch]
                                         / (4 * gpu.clock_ghz * 1e3), 4)
        waves.append(w)
    return waves


def predict(result: KernelResult, gpu: Gpu, shape: ModelShape, batch: int, context: int, default: bool) -> dict:
    """One decode step of one layer: prepare + attention (+ combine) kernels. Time = sum over waves of max(issue,
    shared-memory, memory) + combine bytes at copy bandwidth + launches x launch_us. FP16: the K/V bytes at copy
    bandwidth + the same launches."""
    spec = result.spec
    e = context  # sequence length after the step (past = context - 1, chunk 1), as benchmarks/bench_kernels.py
    past = e - 1
    nq = num_quantized(past)
    res = dataclasses.replace(result.resources, smem_bytes=result.resources.smem_bytes + spec.dynamic_smem(shape))
    occ = occupancy(res, spec.threads, gpu)
    plan = spec.plan(shape, batch, context, gpu.sms, e, occ["ctas_per_sm"]) if spec.plan else \
        launch_plan(shape, batch, context, gpu.sms, e)
    ctx = Ctx(shape, plan.num_splits > 1)
    tile, rest = result.counts(ctx)
    slots = occ["ctas_per_sm"] * gpu.sms
    tile_bytes = spec.tile_bytes(shape)
    d = shape.head_dim
    # CTAs in launch order (blockIdx.x = sequence fastest, then KV head, then split): cost by split
    ctas: list[tuple[float, float, float, float]] = []  # (warp-instructions, wavefronts, device bytes, MMAs)
    L = plan.seq_split_len
    for z in range(plan.num_splits):
        k0 = z * L
        if k0 >= e:
            continue  # the CTA returns at once (no row reads this split)
        keys = min(L, e - k0)
        tiles = ceil_div(keys, KEY_TILE)
        q_keys = max(0, min(keys, nq - k0))
        q_tiles = q_keys // KEY_TILE
        w_keys = keys - q_keys
        nbytes = q_tiles * tile_bytes + w_keys * d * 2 * 2 + shape.group_heads * d * (2 + 4)
        cost = (rest.instructions + tiles * tile.instructions, rest.wavefronts + tiles * tile.wavefronts, nbytes,
                rest.by_class.get("MMA", 0.0) + tiles * tile.by_class.get("MMA", 0.0))
        ctas.extend([cost] * (batch * shape.num_kv_heads))
    bw = gpu.copy_gbps * 1e3  # bytes per us
    waves = wave_times(ctas, slots, gpu, result.arch)
    attn_us = sum(w["us"] for w in waves)
    launches = 2 + (1 if plan.num_splits > 1 else 0)
    combine_bytes = batch * shape.num_heads * plan.num_splits * (d + 2) * 4 + batch * shape.num_heads * d * 2 \
        if plan.num_splits > 1 else 0
    predicted = attn_us + combine_bytes / bw + launches * gpu.launch_us
    fp16_bytes = batch * e * shape.num_kv_heads * d * 2 * 2
    k, _ = constants_for(gpu)
    fp16_us = k.sdpa_us + fp16_bytes / (k.read_gbps * 1e3)
    kivi_bytes = sum(c[2] for c in ctas)
    longest = max(waves, key=lambda w: w["us"]) if waves else {"bound": "memory"}
    in_flight = occ["ctas_per_sm"] * spec.stages * tile_bytes
    need = gpu.copy_gbps * DRAM_LATENCY_NS / gpu.sms  # bytes per SM in flight to sustain copy bandwidth
    timed = baseline_prediction(result, gpu, shape, batch, context, occ["ctas_per_sm"]) if spec.name == "mma" \
        else {"predicted_us": predicted, "bound": longest["bound"], "timing": "ideal bounds (uncalibrated)"}
    return {
        "gpu": gpu.name, "model": shape.name, "batch": batch, "context": context, "kernel": spec.name,
        "default": default, **timed, "predicted_us": round_sig(timed["predicted_us"], 4),
        "ideal_us": round_sig(predicted, 4), "ideal_bound": longest["bound"], "fp16_us": round_sig(fp16_us, 4),
        "fp16": "torch SDPA over an FP16 cache, calibrated model",
        "speedup_vs_fp16": round_sig(fp16_us / timed["predicted_us"], 3),
        "label": "static model, not a measurement",
        "arch": result.arch,
        "kivi_bytes_at_copy_bw_us": round_sig(kivi_bytes / bw + launches * gpu.launch_us, 4),
        "launches": launches, "launch_us_each": gpu.launch_us,
        "plan": {"num_splits": plan.num_splits, "seq_split_len": L, "grid_ctas": batch * shape.num_kv_heads
                 * plan.num_splits, "active_ctas": len(ctas), "resident_slots": slots,
                 "waves": round_sig(len(ctas) / slots, 3) if slots else None, "num_sms_in_plan": gpu.sms},
        "waves": waves,
        "occupancy": occ,
        "resources": {**dataclasses.asdict(result.resources), "dynamic_smem_bytes": spec.dynamic_smem(shape),
                      "cuobjdump": result.cuobjdump},
        "zero_spills": result.resources.spill_stores == 0 and result.resources.spill_loads == 0,
        "per_tile": {**tile.as_dict(), "bytes": tile_bytes,
                     "instructions_per_code_word": round_sig(tile.instructions * WARP / spec.code_words(shape), 4)},
        "per_cta_outside_tile_loop": {"warp_instructions": round(rest.instructions, 1),
                                      "wavefronts": round(rest.wavefronts, 1),
                                      "untagged_loops_counted_once": result.analysis.check_loops(ctx)},
        # what a tile may cost for the kernel to run at 85% of copy bandwidth on this GPU (the budget)
        "budget_per_tile_at_85pct_copy_bw": {
            "warp_instructions": round(gpu.issue_per_clk_per_sm * gpu.clock_ghz * 1e3 * gpu.sms * tile_bytes
                                       / (0.85 * bw), 1),
            "wavefronts": round(gpu.smem_wavefronts_per_clk_per_sm * gpu.clock_ghz * 1e3 * gpu.sms * tile_bytes
                                / (0.85 * bw), 1)},
        "bytes_in_flight_per_sm": {"provided": in_flight, "needed_at_copy_bw": round(need),
                                   "assumed_latency_ns": DRAM_LATENCY_NS},
    }

# A hand count of the SIMT and WMMA kernels' SASS (sm_90, Llama-3-8B shapes, per 3,072-byte tile) and the times
# predicted from it at batch 8, 32K on an H200, made when the mma.sync kernel was designed; the model must reproduce
# them within ~20%.
CALIBRATION = {
    "simt": {"warp_instructions_per_tile": 6488, "wavefronts_per_tile": 3500, "instructions_per_code_word": 405,
             "predicted_us": 1100.0},
    "wmma": {"warp_instructions_per_tile": 5412, "wavefronts_per_tile": 1430, "instructions_per_code_word": 338,
             "predicted_us": 450.0},
    "fp16": {"predicted_us": 250.0},
}
CALIBRATION_TOLERANCE = 0.20

def calibration(records: list[dict]) -> list[dict]:
    """Model vs the hand count (CALIBRATION) at Llama-3-8B, batch 8, 32K, H200 (sm_90)."""
    out = []
    for rec in records:
        if (rec["gpu"], rec["model"], rec["batch"], rec["context"]) != ("H200", "llama-3-8b", 8, 32768):
            continue
        want = CALIBRATION.get(rec["kernel"])
        if want is None:
            continue
        got = {"warp_instructions_per_tile": rec["per_tile"]["warp_instructions"],
               "wavefronts_per_tile": rec["per_tile"]["wavefronts"],
               "instructions_per_code_word": rec["per_tile"]["instructions_per_code_word"],
               "predicted_us": rec["ideal_us"]}
        rows = []
        for k, v in want.items():
            ratio = got[k] / v
            rows.append({"quantity": k, "hand_count": v, "model": got[k], "ratio": round_sig(ratio, 3),
                         "within_tolerance": abs(ratio - 1) <= CALIBRATION_TOLERANCE})
        fp = CALIBRATION["fp16"]["predicted_us"]
        rows.append({"quantity": "fp16_us", "hand_count": fp, "model": rec["fp16_us"], "ratio": round_sig(rec["fp16_us"] / fp, 3),
                     "within_tolerance": abs(rec["fp16_us"] / fp - 1) <= CALIBRATION_TOLERANCE})
        rec["calibration"] = rows
        out.append({"kernel": rec["kernel"], "rows": rows})
    return out


def build_records(results: dict[tuple[str, str], KernelResult], versions: dict,
                  gpus: Sequence[str] = tuple(GPUS), models: Sequence[str] = tuple(MODELS),
                  batches: Sequence[int] = BATCHES, contexts: Sequence[int] = CONTEXTS) -> list[dict]:
    """Every kernel of KERNELS and every split variant analysed for each GPU's arch, per shape. The default is the
    variant the plan table picks where its kernel was analysed, else the present kernel of lowest default_rank."""
    ranked = sorted((r.spec.default_rank, r.spec.name) for r in results.values() if r.spec.default_rank is not None)
    default_name = ranked[0][1] if ranked else None
    records = []
    for g in gpus:
        gpu = GPUS[g]
        for m in models:
            for b in batches:
                for c in contexts:
                    variants = variant_records(results, gpu, MODELS[m], b, c)
                    picked = any(v["default"] for v in variants)
                    for spec in KERNELS:
                        r = results.get((spec.name, gpu.arch))
                        if r is None:
                            continue
                        records.append(predict(r, gpu, MODELS[m], b, c, spec.name == default_name and not picked))
                    records += variants
    for rec in records:
        rec["tools"] = versions
        rec["gpu_spec"] = dataclasses.asdict(GPUS[rec["gpu"]])
    calibration(records)
    return records
