"""Run a benchmark dataset through a runner with the continuous-batching scheduler, in trtllm-bench's two modes:

  latency     one request at a time (concurrency 1), streaming: TTFT / TPOT of an unloaded system;
  throughput  every request issued at once (or `concurrency` kept in flight), continuous batching up to the
              runner's slots: the system's maximum throughput.

Requests are greedy and ignore EOS (as trtllm-bench does), so each produces exactly `output_tokens` tokens.
Also: the KV cache memory figures — bytes the runner really allocated next to an FP16 cache of the same shapes, and
how many sequences of the dataset's longest length fit a memory budget with FP16, FP8 and KIVI (format.py's byte
formulas)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .. import format as fmt
from ..format import Geometry, KiviConfig
from ..runtime.base import Runner
from ..runtime.generate import SamplingParams
from ..runtime.scheduler import Scheduler
from .dataset import BenchRequest
from .metrics import RequestTiming, benchmark_statistics

MODES = ("latency", "throughput")


@dataclass
class WorkloadResult:
    timings: list[RequestTiming]
    outputs: dict  # task_id -> generated token ids
    steps: int  # runner steps taken (the measured requests only)
    statistics: dict


def run_workload(runner: Runner, requests: list[BenchRequest], mode: str, max_num_tokens: int = 512,
                 prefill_chunk: int = 128, concurrency: int | None = None, warmup: int = 0,
                 streaming: bool = True, on_token=None) -> WorkloadResult:
    """Run the requests (after `warmup` unmeasured ones drawn from the same list) and compute the statistics."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not supported; allowed: {', '.join(MODES)}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    sched = Scheduler(runner, max_batch_tokens=max_num_tokens, prefill_chunk=prefill_chunk)
    for r in requests:  # refuse the whole workload up front rather than half-way
        sched.check(r.input_ids, SamplingParams(max_new_tokens=r.output_tokens))
    if warmup:
        _drive(sched, requests[:warmup], 1 if mode == "latency" else concurrency, None)
    steps0 = sched.steps
    limit = 1 if mode == "latency" else concurrency
    done = _drive(sched, requests, limit, on_token if streaming else None)
    timings, outputs = [], {}
    for br, req in zip(requests, done):
        if req.finish_reason != "length" or len(req.tokens) != br.output_tokens:
            raise RuntimeError(f"task {br.task_id}: finished with {req.finish_reason!r} after {len(req.tokens)} of "
                               f"{br.output_tokens} tokens ({req.error})")
        timings.append(RequestTiming(len(br.input_ids), len(req.tokens), req.arrival_time, req.first_token_time,
                                     req.finish_time))
        outputs[br.task_id] = req.tokens
    stats = benchmark_statistics(timings, streaming=streaming or mode == "latency")
    return WorkloadResult(timings, outputs, sched.steps - steps0, stats)


def _drive(sched: Scheduler, requests: list[BenchRequest], limit: int | None, on_token):
    """Issue requests keeping at most `limit` in flight (None: all at once); returns them in order."""
    pending = deque(requests)
    issued = []
    cb = (lambda req, new, delta: on_token(req, new)) if on_token else None
    while pending or sched.has_work():
        while pending and (limit is None or sched.num_waiting + sched.num_running < limit):
            br = pending.popleft()
            issued.append(sched.submit(br.input_ids, SamplingParams(max_new_tokens=br.output_tokens),
                                       on_update=cb, request_id=str(br.task_id)))
        sched.step()
    return issued


# ----------------------------------------------------------------------------------------------- memory figures


def runner_geometry(runner: Runner) -> tuple[Geometry, KiviConfig | None, int]:
    """(geometry, KIVI config or None for an unquantized cache, activation bytes) of a runner's cache."""
    return runner.geometry, runner.kivi_config, runner.activation_dtype.itemsize


def memory_figures(runner: Runner, max_sequence_length: int, kv_memory_gb: float,
                   kivi: KiviConfig | None = None) -> dict:
    """KV bytes allocated vs FP16 for the same shapes, and max concurrent sequences of max_sequence_length tokens in
    a kv_memory_gb budget for FP16, FP8 and KIVI (the runner's KIVI config, else `kivi`, else the default)."""
    if not kv_memory_gb > 0:
        raise ValueError(f"kv_memory_gb={kv_memory_gb} must be > 0")
    geom, run_cfg, act_bytes = runner_geometry(runner)
    cfg = run_cfg or kivi or KiviConfig()
    fp16_same = fmt.dense_bytes_per_token(geom, 2) * runner.max_seq_len * runner.max_slots
    budget = kv_memory_gb * 2**30
    L = max_sequence_length
    per_seq = {
        "fp16": fmt.dense_bytes_per_token(geom, 2) * L,
        "fp8": fmt.dense_bytes_per_token(geom, 1) * L,
        "kivi": fmt.kivi_total_bytes(cfg, geom, L, batch=1, act_bytes=2),  # fp16 window, as on a GPU
    }
    return {
        "kv_cache_bytes_allocated": runner.kv_nbytes,
        "fp16_kv_cache_bytes_same_shapes": int(fp16_same),
        "fp16_over_allocated": fp16_same / runner.kv_nbytes if runner.kv_nbytes else None,
        "shapes": {"max_slots": runner.max_slots, "max_seq_len": runner.max_seq_len,
                   "num_layers": geom.num_layers, "num_kv_heads": geom.num_kv_heads, "head_dim": geom.head_dim,
                   "window_dtype_bytes": act_bytes},
        "budget": {
            "kv_memory_gb": kv_memory_gb,
            "sequence_length": L,
            "kivi_config": cfg.to_dict(),
            "bytes_per_sequence": {k: int(v) for k, v in per_seq.items()},
            "max_concurrent_sequences": {k: int(math.floor(budget / v)) for k, v in per_seq.items()},
        },
    }
