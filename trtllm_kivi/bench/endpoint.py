"""trtllm-bench's latency and throughput workloads against an OpenAI-compatible server (`trtllm-kivi serve`,
llama.cpp's llama-server, vLLM, ...), so that one dataset measures every door with the same metric names.

Each dataset request is one streamed POST {url}/v1/completions: `prompt` = its input_ids, `max_tokens` = its
output_tokens, `temperature` 0, `stream_options.include_usage` (the server says how many tokens it produced), and
`ignore_eos` (an extension of vLLM, llama.cpp and `trtllm-kivi serve`) so that every request runs to max_tokens as
trtllm-bench's do. A server that refuses `ignore_eos` (OpenAI's API answers 400 naming it) gets the requests without
it; they may then stop at EOS, and the report counts the tokens each usage reports (`requests_at_max_tokens` says
how many ran to the end).

Warm-up requests send their prompts reversed, so that a server's prefix cache holds no measured prompt.
Timing per request, on this client's clock: start = the POST, first token = the first streamed chunk that carries a
choice, end = the end of the stream; the statistics are bench/metrics.py's. latency = one request at a time;
throughput = every request at once, or `concurrency` kept in flight."""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..serving.openai_client import Reply, get, post, run_clients
from .dataset import BenchRequest
from .metrics import RequestTiming, benchmark_statistics

MODES = ("latency", "throughput")


class EndpointError(RuntimeError):
    """The server could not be reached or answered an error; the message names the URL and the status."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: http://HOST:PORT, optionally with a path prefix (a trailing /v1 is implied)."""

    url: str
    host: str
    port: int
    base: str  # path prefix of the API, ending in /v1

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"--openai-url {url!r}: expected http://HOST:PORT[/v1] (plain http)")
        try:
            port = u.port or 80
        except ValueError:
            raise ValueError(f"--openai-url {url!r}: the port must be an integer in [0, 65535]") from None
        base = u.path.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return cls(url, u.hostname, port, base)

    def where(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{self.base}{path}"


def _failure(where: str, r: Reply) -> str:
    if r.status == 0:
        return f"{where}: no answer ({r.error})"
    return f"{where}: HTTP {r.status}: {r.error}"


def served_models(ep: Endpoint, timeout: float = 30.0) -> list[str]:
    """The model ids of GET /v1/models."""
    where = ep.where("/models")
    try:
        status, text = get(ep.host, ep.port, ep.base + "/models", timeout)
    except OSError as e:
        raise EndpointError(f"{where}: no answer ({type(e).__name__}: {e})") from None
    if status != 200:
        raise EndpointError(f"{where}: HTTP {status}: {text[:300]}")
    try:
        ids = [m["id"] for m in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{where}: HTTP 200 but not an OpenAI model list: {text[:300]}") from None
    if not ids:
        raise EndpointError(f"{where}: the server lists no model")
    return ids


def completion_body(model: str, req: BenchRequest, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": list(req.input_ids), "max_tokens": req.output_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def accepts_ignore_eos(ep: Endpoint, model: str, req: BenchRequest, timeout: float = 600.0) -> bool:
    """One unmeasured request with `ignore_eos` (one prompt token, one output token: no prompt a server could cache
    for the measured ones): True when served, False when refused naming the field and served without it; any other
    failure (no server, wrong model, a token id outside its vocabulary) raises EndpointError."""
    probe = BenchRequest(req.task_id, req.input_ids[:1], 1)
    path = ep.base + "/completions"
    r = post(ep.host, ep.port, path, completion_body(model, probe, True), timeout=timeout)
    if r.ok:
        return True
    if r.status == 400 and "ignore_eos" in (r.error or ""):
        r = post(ep.host, ep.port, path, completion_body(model, probe, False), timeout=timeout)
        if r.ok:
            return False
    raise EndpointError(_failure(ep.where("/completions"), r))


@dataclass
class EndpointResult:
    timings: list[RequestTiming]
    completion_tokens: dict  # task_id -> tokens the server reported (usage), else the streamed chunks
    requests_at_max_tokens: int  # requests that produced exactly their output_tokens
    output_tokens_source: str  # "usage" when every reply had usage, else "streamed chunks"
    statistics: dict


def run_endpoint_workload(ep: Endpoint, model: str, requests: list[BenchRequest], mode: str,
                          concurrency: int | None = None, warmup: int = 0, ignore_eos: bool = True,
                          timeout: float = 600.0) -> EndpointResult:
    """Send the requests (after `warmup` unmeasured ones drawn from the same list) and compute the statistics."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not supported; allowed: {', '.join(MODES)}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    path = ep.base + "/completions"

    def send(reqs: list[BenchRequest]) -> list[Reply]:
        bodies = [completion_body(model, r, ignore_eos) for r in reqs]
        clients = 1 if mode == "latency" else min(concurrency or len(bodies), len(bodies))
        replies = run_clients(ep.host, ep.port, path, bodies, clients, timeout)["replies"]
        for br, r in zip(reqs, replies, strict=True):
            if r is None or not r.ok:
                raise EndpointError(f"task {br.task_id}: " + _failure(ep.where("/completions"), r or Reply()))
        return replies

    if warmup:  # prompts reversed: same lengths, but no prefix a server's cache could keep for the measured run
        send([BenchRequest(r.task_id, r.input_ids[::-1], r.output_tokens) for r in requests[:warmup]])
    replies = send(requests)
    timings, tokens, from_usage = [], {}, True
    for br, r in zip(requests, replies, strict=True):
        n = (r.usage or {}).get("completion_tokens")
        if not isinstance(n, int):
            from_usage, n = False, len(r.chunk_times)
        first = r.first_choice or (r.chunk_times[0] if r.chunk_times else r.done)
        timings.append(RequestTiming(len(br.input_ids), n, r.sent, first, r.done))
        tokens[br.task_id] = n
    at_max = sum(tokens[br.task_id] == br.output_tokens for br in requests)
    return EndpointResult(timings, tokens, at_max, "usage" if from_usage else "streamed chunks",
                          benchmark_statistics(timings, streaming=True))


__all__ = ["Endpoint", "EndpointError", "EndpointResult", "accepts_ignore_eos", "completion_body",
           "run_endpoint_workload", "served_models"]
