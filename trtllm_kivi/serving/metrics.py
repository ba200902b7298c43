"""The served model's own Prometheus metrics: KV cache usage (slots, blocks, bytes), queue, tokens and tokens/s, the
prefix cache's hits.

`snapshot(scheduler)` computes the values (plain Python, tested without a server); inside Triton, `TritonMetrics`
publishes them through the python backend's custom metrics API (pb_utils.MetricFamily), so they appear on Triton's
metrics endpoint (`curl 127.0.0.1:8002/metrics`) next to Triton's own, labelled with the model name. A background
thread refreshes them every `interval` seconds (the scheduler thread never waits on metrics)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from ..runtime.kv_usage import kv_usage
from ..runtime.scheduler import Scheduler

PREFIX = "trtllm_kivi_"
# name (without PREFIX) -> (kind, help). Gauges are set to the snapshot; counters are incremented by its deltas.
METRICS = {
    "kv_slots_total": ("gauge", "sequence slots of the KV cache"),
    "kv_slots_in_use": ("gauge", "sequence slots holding a request"),
    "kv_blocks_total": ("gauge", "quantized KV blocks in the pool (0: unquantized cache)"),
    "kv_blocks_in_use": ("gauge", "KV blocks holding tokens"),
    "kv_blocks_reserved": ("gauge", "KV blocks reserved by running requests (their worst case)"),
    "kv_cache_bytes": ("gauge", "bytes of KV cache buffers allocated"),
    "kv_cache_used_bytes": ("gauge", "bytes of the KV blocks and windows in use"),
    "requests_waiting": ("gauge", "requests queued for a slot or KV blocks"),
    "requests_running": ("gauge", "requests holding a slot"),
    "generation_tokens_per_second": ("gauge", "tokens generated per second over the last few seconds"),
    "scheduler_steps_total": ("counter", "model steps run"),
    "prompt_tokens_total": ("counter", "prompt tokens processed"),
    "generation_tokens_total": ("counter", "tokens generated"),
    "requests_finished_total": ("counter", "requests finished, by reason (length, stop, cancelled, error)"),
    "kv_blocks_cached": ("gauge", "KV blocks the prefix cache keeps (shared or evictable)"),
    "prefix_cache_queries_total": ("counter", "requests looked up in the prefix cache"),
    "prefix_cache_hits_total": ("counter", "requests that reused a cached prefix"),
    "prefix_cache_hit_tokens_total": ("counter", "prompt tokens whose state came from the prefix cache"),
    "prefix_cache_evictions_total": ("counter", "prefix cache entries evicted"),
}
FINISH_REASONS = ("length", "stop", "cancelled", "error")


def snapshot(scheduler: Scheduler) -> dict[str, float | dict[str, float]]:
    """Current values of METRICS but tokens/s (requests_finished_total is a dict reason -> count)."""
    u = kv_usage(scheduler.runner)
    return {"kv_slots_total": u.slots_total, "kv_slots_in_use": u.slots_in_use, "kv_blocks_total": u.blocks_total,
            "kv_blocks_in_use": u.blocks_in_use, "kv_blocks_reserved": scheduler.blocks_reserved,
            "kv_cache_bytes": u.bytes_total, "kv_cache_used_bytes": u.bytes_in_use,
            "requests_waiting": scheduler.num_waiting, "requests_running": scheduler.num_running,
            "scheduler_steps_total": scheduler.steps, "prompt_tokens_total": scheduler.prompt_tokens,
            "generation_tokens_total": scheduler.generated_tokens,
            "requests_finished_total": {r: scheduler.finished_requests.get(r, 0) for r in FINISH_REASONS},
            **_prefix(scheduler)}


def _prefix(scheduler: Scheduler) -> dict[str, float]:
    pc = scheduler.prefix
    if pc is None:
        return {"kv_blocks_cached": 0, "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0,
                "prefix_cache_hit_tokens_total": 0, "prefix_cache_evictions_total": 0}
    return {"kv_blocks_cached": pc.cached_blocks if pc.kivi else 0, "prefix_cache_queries_total": pc.queries,
            "prefix_cache_hits_total": pc.hits, "prefix_cache_hit_tokens_total": pc.hit_tokens,
            "prefix_cache_evictions_total": pc.evictions}


class TokenRate:
    """Tokens per second over a sliding window of (time, count) samples."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, count: int) -> float:
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, c0 = self.samples[0]
        return (count - c0) / (now - t0) if now > t0 else 0.0


class TritonMetrics:
    """Publishes snapshot(scheduler) through pb_utils' custom metrics; `close()` before the model unloads."""

    def __init__(self, pb_utils, scheduler: Scheduler, model: str, interval: float = 0.1) -> None:
        self.scheduler, self.interval = scheduler, interval
        labels = {"model": model}
        self._families: list = []
        self._metrics: dict[str, Any] = {}  # name -> pb_utils Metric, or reason -> Metric
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}
        for name, (kind, help_) in METRICS.items():
            fam = pb_utils.MetricFamily(name=PREFIX + name, description=help_, kind=kinds[kind])
            self._families.append(fam)
            if name == "requests_finished_total":
                self._metrics[name] = {r: fam.Metric(labels=labels | {"reason": r}) for r in FINISH_REASONS}
            else:
                self._metrics[name] = fam.Metric(labels=labels)
        self._last: dict = {}
        self._rate = TokenRate()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.publish()
        self._thread = threading.Thread(target=self._loop, name="trtllm-kivi-metrics", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        with self._lock:
            if not self._metrics:
                return
            snap: dict[str, Any] = snapshot(self.scheduler)
            snap["generation_tokens_per_second"] = self._rate.update(time.monotonic(),
                                                                     int(snap["generation_tokens_total"]))
            for name, value in snap.items():  # only what changed: each update is a message to the server
                last, m = self._last.get(name), self._metrics[name]
                if isinstance(value, dict):
                    for r, v in value.items():
                        if v != (last or {}).get(r, 0):
                            m[r].increment(v - (last or {}).get(r, 0))
                elif METRICS[name][0] == "counter":
                    if value != (last or 0):
                        m.increment(value - (last or 0))
                elif value != last:
                    m.set(value)
            self._last = snap

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:  # the model is unloading: metrics are gone
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._metrics.clear()  # Metric objects before their MetricFamily (the python backend requires it)
            self._families.clear()


__all__ = ["FINISH_REASONS", "METRICS", "PREFIX", "TokenRate", "TritonMetrics", "snapshot"]
