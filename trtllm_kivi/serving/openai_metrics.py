"""The /metrics endpoint of `trtllm-kivi serve` in Prometheus text format (version 0.0.4): the scheduler's and the KV
cache's figures (serving/metrics.py's snapshot, the same ones Triton publishes), the prefix cache's, and latency
histograms (TTFT, inter-token latency, end-to-end) recorded as requests finish."""

from __future__ import annotations

import bisect
import threading

from ..format import dense_bytes_per_token, quantized_bytes_per_token
from ..runtime.scheduler import Request, Scheduler
from .metrics import METRICS, PREFIX, snapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += c
            out.append(f'{name}_bucket{{le="{"+Inf" if le == float("inf") else repr(le)}"}} {acc}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {acc}"]


def kv_bytes_per_token(scheduler: Scheduler) -> float:
    """Bytes one token takes in the cache as stored, all layers: the quantized store's (codes + scales + zeros) for
    a KIVI cache, the dense rows' for an unquantized one."""
    r = scheduler.runner
    g, cfg = r.geometry, r.kivi_config
    if cfg is None:
        return dense_bytes_per_token(g, r.activation_dtype.itemsize)
    return g.num_layers * quantized_bytes_per_token(cfg, g.num_kv_heads, g.head_dim)


class ServerMetrics:
    """Latency histograms and request counters of the HTTP door; `render()` is the whole /metrics text."""

    HISTOGRAMS = {"time_to_first_token_seconds": ("time from arrival to the first generated token", TTFT_BUCKETS),
                  "inter_token_latency_seconds": ("time between consecutive generated tokens", ITL_BUCKETS),
                  "request_latency_seconds": ("time from arrival to the last token", E2E_BUCKETS)}

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self.hist = {name: Histogram(b) for name, (_, b) in self.HISTOGRAMS.items()}
        self.http_requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count

    def finished(self, r: Request) -> None:
        """Record a finished request's latencies (called on the scheduler thread)."""
        with self._lock:
            if r.first_token_time is not None:
                self.hist["time_to_first_token_seconds"].observe(r.first_token_time - r.arrival_time)
            for a, b in zip(r.token_times, r.token_times[1:], strict=False):
                self.hist["inter_token_latency_seconds"].observe(b - a)
            if r.finish_time is not None and r.finish_reason in ("stop", "length"):
                self.hist["request_latency_seconds"].observe(r.finish_time - r.arrival_time)

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http_requests[(endpoint, status)] = self.http_requests.get((endpoint, status), 0) + 1

    def render(self) -> str:
        s = self.scheduler
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"])
            lines.extend(PREFIX + x for x in samples)

        for name, value in snapshot(s).items():
            kind, help_ = METRICS[name]
            if isinstance(value, dict):
                family(name, kind, help_, [f'{name}{{reason="{k}"}} {v}' for k, v in value.items()])
            else:
                family(name, kind, help_, [f"{name} {value}"])
        family("kv_bytes_per_token", "gauge", "KV cache bytes per token as stored, all layers",
               [f"kv_bytes_per_token {kv_bytes_per_token(s)!r}"])
        with self._lock:
            for name, (help_, _) in self.HISTOGRAMS.items():
                family(name, "histogram", help_, self.hist[name].lines(name))
            family("http_requests_total", "counter", "HTTP requests by endpoint and status",
                   [f'http_requests_total{{endpoint="{e}",status="{c}"}} {n}'
                    for (e, c), n in sorted(self.http_requests.items())])
        return "\n".join(lines) + "\n"


__all__ = ["Histogram", "ServerMetrics", "kv_bytes_per_token"]
