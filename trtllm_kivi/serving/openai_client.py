"""A small OpenAI-API client over raw HTTP (stdlib http.client, no dependencies) for loopback tests and load runs:
one request, streamed (server-sent events) or not, timed per chunk; and a load run of N concurrent streaming
clients. It speaks only the OpenAI API, so the same code measures `trtllm-kivi serve` and llama.cpp's llama-server
(benchmarks/bench_serving.py)."""

from __future__ import annotations

import http.client
import json
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Reply:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    status: int = 0
    body: dict | None = None  # the JSON body of a non-streamed reply (or an error body)
    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    error: str | None = None
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    first_choice: float = 0.0  # arrival of the first chunk that carried a choice (a token, even one of no text)
    chunks: int = 0
    done: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish in ("stop", "length")

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None


def post(host: str, port: int, path: str, body: dict | bytes, stream: bool | None = None, timeout: float = 300.0,
         headers: dict | None = None) -> Reply:
    """POST a JSON body (dict, or raw bytes sent as they are); a streamed reply (SSE) is read chunk by chunk."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = stream if stream is not None else isinstance(body, dict) and bool(body.get("stream"))
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    r = Reply(sent=time.perf_counter())
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        r.status = resp.status
        if not stream or resp.status != 200 or "text/event-stream" not in (resp.getheader("content-type") or ""):
            data = resp.read()
            r.done = time.perf_counter()
            try:
                r.body = json.loads(data)
            except ValueError:
                r.error = f"not JSON: {data[:200]!r}"
                return r
            if resp.status != 200:
                r.error = (r.body or {}).get("error", {}).get("message", "?")
                return r
            choice = r.body["choices"][0]
            r.text = choice.get("text") if "text" in choice else choice["message"]["content"]
            r.finish, r.usage = choice["finish_reason"], r.body.get("usage")
            return r
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                r.error = obj["error"].get("message")
                break
            r.chunks += 1
            if obj.get("choices") and not r.first_choice:
                r.first_choice = time.perf_counter()
            if obj.get("usage"):
                r.usage = obj["usage"]
            for c in obj.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    r.text += piece
                    r.chunk_times.append(time.perf_counter())
                if c.get("finish_reason"):
                    r.finish = c["finish_reason"]
        r.done = time.perf_counter()
    except (OSError, http.client.HTTPException) as e:
        r.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return r


def get(host: str, port: int, path: str, timeout: float = 30.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_clients(host: str, port: int, path: str, bodies: list[dict], clients: int, timeout: float = 600.0) -> dict:
    """`clients` threads send the bodies (streamed) back to back, each body once, in order of a shared queue; returns
    the replies (in the bodies' order) and the aggregate figures: output chunks/s over the wall time, TTFT
    median/P90, request latency, failures."""
    replies: list[Reply | None] = [None] * len(bodies)
    nxt = [0]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(bodies):
                return
            replies[i] = post(host, port, path, dict(bodies[i], stream=True), timeout=timeout)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [r for r in replies if r is not None]
    ok = [r for r in done if r.ok]
    tokens = sum((r.usage or {}).get("completion_tokens", len(r.chunk_times)) for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {"replies": replies, "requests": len(bodies), "clients": clients, "failed": len(bodies) - len(ok),
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_s_median": statistics.median(ttft) if ttft else float("nan"),
            "ttft_s_p90": percentile(ttft, 0.9),
            "latency_s_median": statistics.median([r.done - r.sent for r in ok]) if ok else float("nan"),
            "errors": [r.error for r in done if not r.ok][:5]}




class ServeProcess:
    """`trtllm-kivi serve ARGS` as a child process on 127.0.0.1 (a free port), stopped by its PID (SIGTERM: it drains
    and exits 0). `with ServeProcess([...]) as s: s.port`."""

    def __init__(self, args: list[str], python: str | None = None, timeout: float = 600.0,
                 env: dict | None = None) -> None:
        import sys

        self.cmd = [python or sys.executable, "-m", "trtllm_kivi.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                    *args]
        self.timeout, self.env = timeout, env
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.output: list[str] = []

    def start(self) -> ServeProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)
        deadline = time.monotonic() + self.timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.output.append(line)
            if "http://127.0.0.1:" in line:
                self.port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                threading.Thread(target=lambda: self.output.extend(self.proc.stdout or []),  # type: ignore[union-attr]
                                 daemon=True).start()
                return self
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"trtllm-kivi serve did not start:\n{''.join(self.output[-30:])}")

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (drain, exit 0); SIGKILL after timeout. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Reply", "ServeProcess", "get", "percentile", "post", "run_clients"]
