"""Clients of the served model (loopback only): one generation request over Triton's gRPC stream (decoupled) or its
HTTP generate / generate_stream (SSE) endpoints, timed per token, and a parser for the metrics endpoint.

The gRPC client needs tritonclient (the serving env has it: build_scripts/setup_triton_env.sh); HTTP needs nothing.
Inputs are typed from serving/protocol.py's INPUTS, so a client always sends what config.pbtxt declares."""

from __future__ import annotations

import http.client
import json
import queue
import re
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from .protocol import INPUTS

_NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32,
          "TYPE_BOOL": np.bool_}
_WIRE = {"TYPE_STRING": "BYTES", "TYPE_INT64": "INT64", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32",
         "TYPE_BOOL": "BOOL"}


@dataclass
class Result:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None  # finish_reason of the final response
    error: str | None = None  # the error response's message (or the transport's)
    status: int | None = None  # HTTP status (HTTP clients)
    responses: int = 0
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each response that carried tokens
    done: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish in ("length", "stop")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def wire_array(name: str, value) -> tuple[np.ndarray, str]:
    """(numpy array, Triton wire dtype) of a value for input `name`: the declared type of a known input; for
    another name (to test refusal) inferred from the value; a numpy array of numbers or bools keeps its dtype."""
    if isinstance(value, np.ndarray) and value.dtype != np.object_ and value.dtype.kind not in "SU":
        arr = value  # an explicit dtype is sent as it is (e.g. to test Triton's dtype check)
        return arr, {"i": {4: "INT32", 8: "INT64"}, "f": {4: "FP32", 8: "FP64"}, "b": {1: "BOOL"}}[
            arr.dtype.kind][arr.dtype.itemsize]
    arr = np.asarray(value)
    if name in INPUTS:
        t = INPUTS[name][0]
        if t == "TYPE_STRING":
            arr = np.array([v.encode() if isinstance(v, str) else bytes(v) for v in arr.reshape(-1)],
                           dtype=np.object_).reshape(arr.shape)
        else:
            arr = arr.astype(_NUMPY[t])
        return arr, _WIRE[t]
    kind = {"i": "INT64", "u": "INT64", "f": "FP32", "b": "BOOL"}.get(arr.dtype.kind, "BYTES")
    if kind == "BYTES":
        arr = np.array([str(v).encode() for v in arr.reshape(-1)], dtype=np.object_)
    return arr.astype({"INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}.get(kind, np.object_)), kind


def grpc_inputs(request: dict):
    import tritonclient.grpc as grpcclient

    out = []
    for name, value in request.items():
        arr, dt = wire_array(name, value)
        i = grpcclient.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


class GrpcStreamClient:
    """A gRPC client with one open stream; `generate` sends one request and collects its responses."""

    def __init__(self, url: str, model: str) -> None:
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((time.perf_counter(), result, error)))
        self._n = 0

    def generate(self, request: dict, timeout: float = 120.0, on_response=None) -> Result:
        """Send `request` (input name -> value) and wait for its final response. on_response(result) after each
        response; returning True from it stops reading (the caller then cancels with close(cancel=True))."""
        self._n += 1
        rid = str(self._n)
        r = Result(sent=time.perf_counter())
        self.client.async_stream_infer(self.model, grpc_inputs(request), request_id=rid)
        deadline = r.sent + timeout
        while True:
            try:
                t, result, error = self.q.get(timeout=max(0.01, deadline - time.perf_counter()))
            except queue.Empty:
                r.error = f"no response within {timeout} s"
                break
            if error is not None:
                r.error, r.done = str(error), t
                break
            r.responses += 1
            new = result.as_numpy("output_ids").tolist()
            if new:
                r.token_times.append(t)
            r.ids += new
            r.text += result.as_numpy("text_output")[0].decode()
            fin = result.as_numpy("finish_reason")[0].decode()
            if fin:
                r.finish, r.done = fin, t
                break
            if on_response is not None and on_response(r):
                break
        return r

    def close(self, cancel: bool = False) -> None:
        """Close the stream; with cancel, in-flight requests are cancelled (Triton's decoupled cancellation)."""
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


def _http(url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = url.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def http_generate(url: str, model: str, body: dict, timeout: float = 120.0) -> Result:
    """POST /v2/models/<model>/generate (one JSON response)."""
    conn = _http(url, timeout)
    r = Result(sent=time.perf_counter())
    try:
        conn.request("POST", f"/v2/models/{model}/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r.status, data = resp.status, json.loads(resp.read() or b"{}")
    except (OSError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    finally:
        conn.close()
    r.done = time.perf_counter()
    if "error" in data or r.status != 200:
        r.error = data.get("error", f"HTTP {r.status}: {data}")
        return r
    ids = data["output_ids"]
    r.responses, r.text, r.finish = 1, data["text_output"], data["finish_reason"]
    r.ids = ids if isinstance(ids, list) else [ids]  # Triton writes a one-element tensor as a scalar
    r.token_times = [r.done]
    return r


def http_generate_stream(url: str, model: str, body: dict, timeout: float = 120.0, on_response=None) -> Result:
    """POST /v2/models/<model>/generate_stream (server-sent events, one per response). on_response(result) after
    each event; returning True drops the connection there (what a client that goes away does)."""
    conn = _http(url, timeout)
    r = Result(sent=time.perf_counter())
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            r.error = json.loads(resp.read() or b"{}").get("error", f"HTTP {resp.status}")
            return r
        while True:
            line = resp.readline()
            if not line:
                r.error = r.error or "the stream ended without a final response"
                break
            if not line.startswith(b"data:"):
                continue
            t = time.perf_counter()
            ev = json.loads(line[5:])
            if "error" in ev:
                r.error, r.done = ev["error"], t
                break
            r.responses += 1
            new = ev.get("output_ids", [])
            new = new if isinstance(new, list) else [new]  # Triton writes a one-element tensor as a scalar
            if new:
                r.token_times.append(t)
            r.ids += new
            r.text += ev.get("text_output", "")
            if ev.get("finish_reason"):
                r.finish, r.done = ev["finish_reason"], t
                break
            if on_response is not None and on_response(r):
                conn.sock.shutdown(socket.SHUT_RDWR)
                break
    except (OSError, ValueError) as e:
        r.error = r.error or f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return r


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')


def parse_metrics(text: str, prefix: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(name, sorted label pairs): value} for the samples whose name starts with prefix."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def model_metrics(text: str, model: str) -> dict[str, float]:
    """The trtllm_kivi_* samples of one model: name -> value, with a `reason` label folded into the name
    (requests_finished_total:cancelled)."""
    out = {}
    for (name, labels), v in parse_metrics(text, "trtllm_kivi_").items():
        d = dict(labels)
        if d.get("model") != model:
            continue
        key = name[len("trtllm_kivi_"):]
        out[f"{key}:{d['reason']}" if "reason" in d else key] = v
    return out


__all__ = ["GrpcStreamClient", "Result", "grpc_inputs", "http_generate", "http_generate_stream", "model_metrics",
           "parse_metrics", "wire_array"]
