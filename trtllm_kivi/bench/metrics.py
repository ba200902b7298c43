"""Benchmark statistics with trtllm-bench's metric names and JSON layout (request_info / performance /
streaming_metrics; times in ms, rates per second).

Per request: latency = end - start, TTFT = first token - start, TPOT = (end - first token) / (output tokens - 1),
per-user output throughput = output tokens / latency, generation throughput = (output tokens - 1) / (end - first).
Totals: total latency = last end - first start; request throughput = requests / total latency; output throughput =
output tokens / total latency; total token throughput = (input + output tokens) / total latency."""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

PERCENTILE_KEYS = ("minimum", "maximum", "average", "p50", "p90", "p95", "p99")


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    """min / max / mean and nearest-rank percentiles (the smallest value with at least p% of values <= it)."""
    if not xs:
        return {k: 0.0 for k in PERCENTILE_KEYS}
    s = sorted(float(x) for x in xs)
    n = len(s)

    def rank(p: float) -> float:
        return s[max(0, math.ceil(p / 100 * n) - 1)]

    return {"minimum": s[0], "maximum": s[-1], "average": sum(s) / n, "p50": rank(50), "p90": rank(90),
            "p95": rank(95), "p99": rank(99)}


@dataclass
class RequestTiming:
    """One finished request (times in seconds on one clock)."""

    input_tokens: int
    output_tokens: int
    start: float
    first_token: float
    end: float


def _ms(d: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in d.items()}


def benchmark_statistics(timings: Sequence[RequestTiming], streaming: bool = True) -> dict:
    """trtllm-bench's request_info, performance and (streaming) streaming_metrics sections."""
    if not timings:
        raise ValueError("no finished requests to report")
    t0, t1 = min(t.start for t in timings), max(t.end for t in timings)
    total = max(t1 - t0, 1e-9)
    lat = [t.end - t.start for t in timings]
    n_in = sum(t.input_tokens for t in timings)
    n_out = sum(t.output_tokens for t in timings)
    stats = {
        "request_info": {
            "num_requests": len(timings),
            "avg_num_concurrent_requests": sum(lat) / total,
            "avg_input_length": n_in / len(timings),
            "avg_output_length": n_out / len(timings),
        },
        "performance": {
            "total_latency_ms": total * 1e3,
            "avg_request_latency_ms": sum(lat) / len(lat) * 1e3,
            "request_throughput_req_s": len(timings) / total,
            "system_output_throughput_tok_s": n_out / total,
            "system_total_throughput_tok_s": (n_in + n_out) / total,
            "output_throughput_per_user_tok_s": sum(t.output_tokens / max(lt, 1e-9) for t, lt in zip(timings, lat, strict=True))
            / len(timings),
            "request_latency_percentiles_ms": _ms(percentiles(lat)),
        },
    }
    if streaming:
        ttft = [t.first_token - t.start for t in timings]
        multi = [t for t in timings if t.output_tokens > 1]  # TPOT needs a second token
        tpot = [(t.end - t.first_token) / (t.output_tokens - 1) for t in multi]
        gen_tps = [(t.output_tokens - 1) / max(t.end - t.first_token, 1e-9) for t in multi]
        stats["streaming_metrics"] = {
            "token_output_speed_tok_s": sum(gen_tps) / len(gen_tps) if gen_tps else 0.0,
            "avg_ttft_ms": sum(ttft) / len(ttft) * 1e3,
            "avg_tpot_ms": sum(tpot) / len(tpot) * 1e3 if tpot else 0.0,
            "tpot_percentiles": _ms(percentiles(tpot)),
            "ttft_percentiles": _ms(percentiles(ttft)),
            "gen_tps_percentiles": percentiles(gen_tps),
        }
    return stats


def format_statistics(stats: dict) -> str:
    """The console report, with trtllm-bench's PERFORMANCE OVERVIEW wording."""
    r, p = stats["request_info"], stats["performance"]
    lines = [
        "= REQUEST DETAILS",
        f"Number of requests:             {r['num_requests']}",
        f"Number of concurrent requests:  {r['avg_num_concurrent_requests']:.4f}",
        f"Average Input Length (tokens):  {r['avg_input_length']:.4f}",
        f"Average Output Length (tokens): {r['avg_output_length']:.4f}",
        "= PERFORMANCE OVERVIEW",
        f"Request Throughput (req/sec):                     {p['request_throughput_req_s']:.4f}",
        f"Total Output Throughput (tokens/sec):             {p['system_output_throughput_tok_s']:.4f}",
        f"Total Token Throughput (tokens/sec):              {p['system_total_throughput_tok_s']:.4f}",
        f"Total Latency (ms):                               {p['total_latency_ms']:.4f}",
        f"Average request latency (ms):                     {p['avg_request_latency_ms']:.4f}",
        f"Per User Output Throughput [w/ ctx] (tps/user):   {p['output_throughput_per_user_tok_s']:.4f}",
    ]
    s = stats.get("streaming_metrics")
    if s:
        lines += [
            f"Average time-to-first-token [TTFT] (ms):          {s['avg_ttft_ms']:.4f}",
            f"Average time-per-output-token [TPOT] (ms):        {s['avg_tpot_ms']:.4f}",
            f"Per User Output Speed (tps/user):                 {s['token_output_speed_tok_s']:.4f}",
        ]
        for tag, key in (("TPOT", "tpot_percentiles"), ("TTFT", "ttft_percentiles")):
            lines.append(f"-- Per-Request {tag} Breakdown (ms)")
            lines += [f"[{tag}] {k.upper():<7}: {s[key][k]:.4f}" for k in PERCENTILE_KEYS]
    lines.append("-- Request Latency Breakdown (ms)")
    lines += [f"[Latency] {k.upper():<7}: {p['request_latency_percentiles_ms'][k]:.4f}" for k in PERCENTILE_KEYS]
    return "\n".join(lines)
