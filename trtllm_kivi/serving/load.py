"""A bounded load run against a served model on 127.0.0.1: `clients` concurrent streaming clients (gRPC streams, and
every `sse_every`-th one over HTTP SSE) send requests back to back for `duration_s` seconds; every output is
compared with the expected one (the offline runner's, computed by the caller); the server's RSS (server + stubs) is
sampled; TTFT and inter-token latency percentiles are reported. Used by tests/test_triton_load.py: short in CI, long
with TRTLLM_KIVI_SERVING_LOAD=long, which writes benchmarks/results/serving_load_<machine>.json when
TRTLLM_KIVI_SERVING_LOAD_REPORT names it."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from .client import GrpcStreamClient, Result, http_generate_stream
from .server import TritonServer


@dataclass
class LoadReport:
    clients: int
    duration_s: float  # wall time from the first request to the last response
    requests: int = 0
    failed: int = 0
    mismatches: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    warmup_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failures / mismatches, for the message

    @property
    def rss_growth_pct(self) -> float:
        """Growth of the RSS after warm-up: the largest sample after it over the first sample after it."""
        after = [b for t, b in self.rss if t >= self.warmup_s]
        return 100.0 * (max(after) - after[0]) / after[0] if len(after) >= 2 else 0.0

    def figures(self) -> dict:
        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")

        return {"requests": self.requests, "concurrency": self.clients, "duration_s": round(self.duration_s, 1),
                "failed": self.failed, "mismatches": self.mismatches, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.duration_s, 1) if self.duration_s else 0.0,
                "rss_growth_pct": round(self.rss_growth_pct, 2), "warmup_s": self.warmup_s,
                "rss_mb_after_warmup": round(next((b for t, b in self.rss if t >= self.warmup_s), 0) / 2**20, 1),
                "rss_mb_max": round(max((b for _, b in self.rss), default=0) / 2**20, 1),
                "ttft_ms_p50": pct(self.ttft_s, 0.5), "ttft_ms_p99": pct(self.ttft_s, 0.99),
                "itl_ms_p50": pct(self.itl_s, 0.5), "itl_ms_p99": pct(self.itl_s, 0.99),
                "ttft_ms_mean": round(1000 * statistics.fmean(self.ttft_s), 2) if self.ttft_s else float("nan")}


def run_load(server: TritonServer, model: str, cases: list[tuple[dict, list[int]]], clients: int, duration_s: float,
             sse_every: int = 4, warmup_s: float | None = None, request_timeout: float = 120.0,
             max_requests: int = 100_000) -> LoadReport:
    """cases: (request body, expected output ids) pairs; client i sends case (i + k) % len(cases) as its k-th
    request, with stream=true. Stops sending after duration_s (in-flight requests finish), or at max_requests."""
    report = LoadReport(clients=clients, duration_s=0.0, warmup_s=warmup_s if warmup_s is not None
                        else max(3.0, 0.2 * duration_s))
    lock = threading.Lock()
    start = time.perf_counter()
    stop_at = start + duration_s
    stop_rss = threading.Event()
    sent = [0]

    def record(r: Result, expected: list[int]) -> None:
        with lock:
            report.requests += 1
            if not r.ok:
                report.failed += 1
                if len(report.errors) < 5:
                    report.errors.append(f"failed: {r.error or r.finish}")
                return
            if r.ids != expected:
                report.mismatches += 1
                if len(report.errors) < 5:
                    report.errors.append(f"mismatch: got {r.ids} expected {expected}")
            report.tokens += len(r.ids)
            if r.ttft is not None:
                report.ttft_s.append(r.ttft)
            report.itl_s += r.itls

    def take() -> bool:
        with lock:
            if time.perf_counter() >= stop_at or sent[0] >= max_requests:
                return False
            sent[0] += 1
            return True

    def client(i: int) -> None:
        sse = sse_every > 0 and i % sse_every == sse_every - 1
        grpc = None if sse else GrpcStreamClient(server.grpc_url, model)
        try:
            k = 0
            while take():
                body, expected = cases[(i + k) % len(cases)]
                body = dict(body, stream=True)
                if grpc is None:
                    r = http_generate_stream(server.http_url, model, body, timeout=request_timeout)
                else:
                    r = grpc.generate({n: v if isinstance(v, list) else [v] for n, v in body.items()},
                                      timeout=request_timeout)
                record(r, expected)
                k += 1
        finally:
            if grpc is not None:
                grpc.close()

    def sample_rss() -> None:
        while not stop_rss.is_set():
            report.rss.append((time.perf_counter() - start, server.rss_bytes()))
            stop_rss.wait(0.5)

    rss_thread = threading.Thread(target=sample_rss, daemon=True)
    rss_thread.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration_s + request_timeout + 30)
    report.duration_s = time.perf_counter() - start
    stop_rss.set()
    rss_thread.join()
    hung = sum(t.is_alive() for t in threads)
    if hung:
        report.failed += hung
        report.errors.append(f"{hung} clients still waiting after the run")
    return report


__all__ = ["LoadReport", "run_load"]
