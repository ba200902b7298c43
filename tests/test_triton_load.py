"""Serving that holds up, on a real Triton Inference Server (the `tritonserver` of the PyPI wheel
nvidia-pytriton, python backend) on 127.0.0.1: load, cancellation, KV capacity pressure, metrics and SIGTERM.

Oracle: the offline path in this process (the same model and KV spec through runtime.generate.generate, one request
alone on a fresh cache), token for token; the block arithmetic of docs/design.md's streaming contract for the pool.

The load test is short in CI (8 streaming clients x 12 s against 4 slots, so requests queue);
TRTLLM_KIVI_SERVING_LOAD=long runs 32 clients x 60 s, and TRTLLM_KIVI_SERVING_LOAD_REPORT=FILE writes its figures
(benchmarks/results/serving_load_epyc.json was written that way). Runs with the serving env's Python, like
tests/test_triton_server.py (tests/test_triton_relay.py runs both from the dev venv).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time

import pytest

from trtllm_kivi.serving.server import SETUP, TritonEnv, TritonServer

pytestmark = pytest.mark.triton

try:
    import tritonclient.grpc  # noqa: F401
except ImportError as e:
    pytest.skip(f"tritonclient is not importable here ({e}); tests/test_triton_relay.py runs this file with the "
                f"serving env's python ({SETUP})", allow_module_level=True)
try:
    TRITON_ENV = TritonEnv.find()
except FileNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

from trtllm_kivi.serving.client import (GrpcStreamClient, Result, http_generate_stream,  # noqa: E402
                                        model_metrics)
from trtllm_kivi.serving.load import run_load  # noqa: E402

MAX_SLOTS, MAX_SEQ_LEN = 4, 160
LOAD = dict(kv="kivi2", kv_options={"residual_length": 32})  # R=32: long requests read quantized history
# 3 blocks of 32 tokens: a request of T tokens needs ceil(n_q(T) / 32) blocks, n_q(T) = floor((T - 32) / 32) * 32
TIGHT = dict(kv="kivi2", kv_options={"residual_length": 32, "block_size": 32}, num_blocks=3)
LONG = os.environ.get("TRTLLM_KIVI_SERVING_LOAD") == "long"
CLIENTS, DURATION_S = (32, 60.0) if LONG else (8, 12.0)
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fibonacci(n):",
           "The quick brown fox", "Once upon a time there was a", "Translate to French: good morning",
           "Summarize in one sentence: The KIVI method stores the keys of the attention cache per channel and the "
           "values per token in two bits, keeping the most recent tokens in full precision, which cuts the memory "
           "of the cache about five times."]  # the last one: prompt + output pass R + G = 64 (quantized history)


def _config(name: str, **kw):
    from trtllm_kivi.models import resolve_model
    from trtllm_kivi.serving.config import ServingConfig

    return ServingConfig(model=str(resolve_model("smollm2-135m")), max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN,
                         prefill_chunk=128, default_max_tokens=16, num_threads=1, **kw)


def _start(tmp_path_factory, models: dict) -> TritonServer:
    from trtllm_kivi.serving.repository import write_repository

    repo = tmp_path_factory.mktemp("triton_repo")
    for name, kw in models.items():
        write_repository(repo, _config(name, **kw), name)
    srv = TritonServer(repo, TRITON_ENV, log_file=tmp_path_factory.mktemp("triton_log") / "tritonserver.log")
    return srv.start(timeout=240)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start(tmp_path_factory, {"load": LOAD, "tight": TIGHT})
    try:
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"tritonserver exited with {code}:\n{srv.log_tail()}"


@pytest.fixture(scope="module")
def offline():
    """(tokenizer, run, model): run(model_kind, prompt ids, **sampling) -> Generation is the request alone on a
    fresh one-slot cache with a full pool, as the server would run it."""
    import torch

    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    torch.set_num_threads(1)  # as the server: same matmul partitioning
    model, tok, _ = load_model("smollm2-135m")

    def run(kind: dict, prompt_ids: list[int], **params):
        runner = TorchRunner.create(model, parse_kv(kind["kv"], **kind["kv_options"]), 1, MAX_SEQ_LEN)
        sp = SamplingParams(stop_token_ids=tuple(tok.eos_ids), **params)
        return generate(runner, [prompt_ids], sp, tok, prefill_chunk=128)[0]

    run.model = model
    return tok, run


def metrics(server, model: str) -> dict[str, float]:
    return model_metrics(server.metrics(), model)


def wait_metrics(server, model: str, cond, timeout: float = 10.0) -> dict[str, float]:
    """Poll the metrics endpoint until cond(values) holds; returns the values (fails with the last ones)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server, model)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"metrics of {model} did not reach the expected state within {timeout} s: {m}")
        time.sleep(0.02)


def all_free(m: dict[str, float]) -> bool:
    return all(m[k] == 0 for k in ("kv_slots_in_use", "kv_blocks_in_use", "kv_blocks_reserved", "requests_running",
                                   "requests_waiting"))


# ----------------------------------------------------------------------------------------------------- metrics

def test_custom_metrics_show_kv_usage(server, offline):
    """The model's own metrics on Triton's metrics endpoint (pb_utils.MetricFamily), labelled by model: capacity
    equals the offline runner's, and a request's tokens are counted."""
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    tok, run = offline
    text = server.metrics()
    assert '# TYPE trtllm_kivi_kv_slots_in_use gauge' in text and 'trtllm_kivi_generation_tokens_total{' in text
    m = metrics(server, "load")
    t = metrics(server, "tight")
    model = run.model
    full = TorchRunner.create(model, parse_kv(LOAD["kv"], **LOAD["kv_options"]), MAX_SLOTS, MAX_SEQ_LEN)
    tight = TorchRunner.create(model, parse_kv(TIGHT["kv"], **TIGHT["kv_options"]), MAX_SLOTS, MAX_SEQ_LEN,
                               num_blocks=3)
    assert m["kv_cache_bytes"] == full.kv_nbytes and t["kv_cache_bytes"] == tight.kv_nbytes
    assert (m["kv_slots_total"], m["kv_blocks_total"], t["kv_blocks_total"]) == (4, full.cache.num_blocks, 3)
    assert all_free(m) and all_free(t)
    ref = run(LOAD, tok.encode(PROMPTS[0]), max_new_tokens=12)
    c = GrpcStreamClient(server.grpc_url, "load")
    try:
        seen = []  # KV in use while the request runs
        r = c.generate({"text_input": [PROMPTS[0]], "max_tokens": [12], "stream": [True]},
                       on_response=lambda r: seen.append(metrics(server, "load")) and False)
    finally:
        c.close()
    assert r.ok and r.ids == ref.tokens
    assert any(s["kv_slots_in_use"] == 1 and s["kv_cache_used_bytes"] > 0 for s in seen), seen[-3:]
    after = wait_metrics(server, "load", lambda a: a["generation_tokens_total"] >= m["generation_tokens_total"] + 12
                         and all_free(a))
    assert after["generation_tokens_total"] - m["generation_tokens_total"] == 12  # no stop token: exactly 12
    assert after["requests_finished_total:length"] == m["requests_finished_total:length"] + 1
    assert after["prompt_tokens_total"] - m["prompt_tokens_total"] == len(tok.encode(PROMPTS[0]))
    assert after["kv_cache_used_bytes"] == 0 and after["generation_tokens_per_second"] > 0


# ----------------------------------------------------------------------------------------------------- load

def _cases(tok, run) -> list[tuple[dict, list[int]]]:
    """(request body, expected ids): greedy of several lengths and seeded sampling; the last one passes R + G = 64
    tokens (quantized history)."""
    cases = []
    for i, p in enumerate(PROMPTS):
        n = [8, 16, 24, 12, 20, 20, 10, 20][i]
        if i in (2, 5):
            body = {"text_input": p, "max_tokens": n, "temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
            ref = run(LOAD, tok.encode(p), max_new_tokens=n, temperature=0.8, top_p=0.9, seed=100 + i)
        else:
            body = {"text_input": p, "max_tokens": n}
            ref = run(LOAD, tok.encode(p), max_new_tokens=n)
        cases.append((body, ref.tokens))
    return cases


def _machine() -> dict:
    import importlib.metadata as md

    from trtllm_kivi.bench.machine import machine_info

    versions = {}
    for pkg in ("numpy", "nvidia-pytriton", "tritonclient"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    return machine_info(load_average_before=os.getloadavg()[0], tritonserver="2.51.0 (nvidia-pytriton 0.7.0)",
                        **versions)


def test_load_many_streaming_clients(server, offline):
    """CLIENTS streaming clients (gRPC, every 4th over HTTP SSE) against 4 slots for DURATION_S: no failed request,
    every output equal to the offline one, RSS flat after warm-up, everything free at the end."""
    tok, run = offline
    cases = _cases(tok, run)
    before = metrics(server, "load")
    machine = _machine()
    rep = run_load(server, "load", cases, clients=CLIENTS, duration_s=DURATION_S)
    fig = rep.figures()
    print(f"\nserving load: {json.dumps(fig)}")
    assert rep.failed == 0 and rep.mismatches == 0, rep.errors
    assert rep.requests >= CLIENTS and rep.ttft_s and rep.itl_s
    assert rep.rss_growth_pct < 5.0, f"RSS grew {rep.rss_growth_pct:.1f}% after warm-up: {rep.rss}"
    def done(m):  # every request counted once, nothing held
        return all_free(m) and m["requests_finished_total:length"] + m["requests_finished_total:stop"] - \
            before["requests_finished_total:length"] - before["requests_finished_total:stop"] == rep.requests
    wait_metrics(server, "load", done, timeout=5)
    out = os.environ.get("TRTLLM_KIVI_SERVING_LOAD_REPORT")
    if out:
        report = {**fig, "send_window_s": DURATION_S, "load_average_after": os.getloadavg()[0], "slots": MAX_SLOTS, "max_seq_len": MAX_SEQ_LEN, "model": "smollm2-135m (Q4_1 GGUF, fp32)",
                  "kv": "kivi2 R=32 G=32", "server_threads": 1, "sse_clients": CLIENTS // 4,
                  "cases": [c[0] for c in cases], "machine": machine,
                  "note": "CPU only. duration_s: first request to last response (clients send for send_window_s, "
                          "then the queued requests finish); TTFT includes queueing behind 4 slots. On a shared "
                          "machine (see load_average_*) latencies are far above an idle machine's"}
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


# ----------------------------------------------------------------------------------------------------- cancel

def _victim_and_bystander(server, offline, victim):
    """Run `victim(stop_after)` (a streaming request cut after 4 responses) while a bystander request streams;
    return the metrics before the cut and when the cancellation was counted, and check the bystander."""
    tok, run = offline
    ref = run(LOAD, tok.encode(PROMPTS[1]), max_new_tokens=40)
    base = metrics(server, "load")
    out: dict = {}

    def bystander():
        c = GrpcStreamClient(server.grpc_url, "load")
        try:
            out["b"] = c.generate({"text_input": [PROMPTS[1]], "max_tokens": [40], "stream": [True]})
        finally:
            c.close()

    t = threading.Thread(target=bystander)
    t.start()

    def stop_after(r: Result) -> bool:
        if r.responses >= 4:
            out["at_cut"] = metrics(server, "load")
            return True
        return False

    out["v"] = victim(stop_after)
    freed = wait_metrics(server, "load", lambda m: m["requests_finished_total:cancelled"]
                         >= base["requests_finished_total:cancelled"] + 1)
    t.join(timeout=120)
    assert out["b"].ok and out["b"].ids == ref.tokens, "the bystander was affected"
    wait_metrics(server, "load", all_free)
    steps = freed["scheduler_steps_total"] - out["at_cut"]["scheduler_steps_total"]
    assert steps <= 12, f"the cancelled request's slot was freed {steps} steps after the client left"
    return out


def test_grpc_stream_cancel_frees_the_slot(server, offline):
    def victim(stop_after):
        c = GrpcStreamClient(server.grpc_url, "load")
        r = c.generate({"text_input": [PROMPTS[4]], "max_tokens": [120], "stream": [True]}, on_response=stop_after)
        c.close(cancel=True)  # Triton's decoupled cancellation: the stream's requests are cancelled
        return r

    out = _victim_and_bystander(server, offline, victim)
    assert out["v"].finish is None and len(out["v"].ids) == 4


def test_http_sse_disconnect_frees_the_slot(server, offline):
    """Triton 2.51 notices a dropped SSE connection when it next writes a response: one more token, then the
    request is cancelled and its slot freed."""
    def victim(stop_after):
        return http_generate_stream(server.http_url, "load", {"text_input": PROMPTS[4], "max_tokens": 120,
                                                              "stream": True}, on_response=stop_after)

    out = _victim_and_bystander(server, offline, victim)
    assert out["v"].finish is None and len(out["v"].ids) == 4


# ----------------------------------------------------------------------------------------------------- capacity

def test_kv_block_pressure_requests_wait_and_stay_exact(server, offline):
    """Pool of 3 blocks, 4 slots. A request of 129 tokens needs 3 blocks, four of 67 tokens need 1 each: admission
    reserves each one's worst case, so the small ones wait (with slots free) until blocks return, blocks in use
    never exceed 3, every output equals its run alone, and a request needing 4 blocks is refused saying what fits."""
    tok, run = offline
    long_ids = (tok.encode(" ".join(PROMPTS)) * 4)[:120]
    small = [(tok.encode(p) * 20)[:60] for p in PROMPTS[:4]]
    work = [(long_ids, 10)] + [(ids, 8) for ids in small]
    refs = [run(TIGHT, ids, max_new_tokens=n) for ids, n in work]
    samples, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            samples.append(metrics(server, "tight"))
            time.sleep(0.02)

    w = threading.Thread(target=watch)
    w.start()
    results: dict[int, Result] = {}

    def send(i):
        c = GrpcStreamClient(server.grpc_url, "tight")
        try:
            ids, n = work[i]
            results[i] = c.generate({"input_ids": ids, "max_tokens": [n], "stream": [True]})
        finally:
            c.close()

    threads = [threading.Thread(target=send, args=(0,))]
    threads[0].start()
    wait_metrics(server, "tight", lambda m: m["kv_blocks_reserved"] == 3)  # the long one is admitted first
    threads += [threading.Thread(target=send, args=(i,)) for i in range(1, len(work))]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    w.join()
    for i, ref in enumerate(refs):
        assert results[i].ok and results[i].ids == ref.tokens, f"request {i}: {results[i].error}"
    assert max(s["kv_blocks_in_use"] for s in samples) <= 3 and max(s["kv_blocks_reserved"] for s in samples) <= 3
    assert any(s["requests_waiting"] > 0 and s["kv_slots_in_use"] < MAX_SLOTS for s in samples), \
        "no request waited for KV blocks while a slot was free"
    wait_metrics(server, "tight", all_free)
    c = GrpcStreamClient(server.grpc_url, "tight")
    try:  # 120 + 41 - 1 = 160 tokens: n_q = 128 -> 4 blocks
        r = c.generate({"input_ids": long_ids, "max_tokens": [41]})
    finally:
        c.close()
    assert r.error and re.search(r"needs 4 KV cache blocks; the whole pool has 3, which holds at most 159 tokens "
                                 r"per request", r.error), r.error


# ----------------------------------------------------------------------------------------------------- shutdown

def test_sigterm_during_load_ends_cleanly(server, offline):
    """SIGTERM to tritonserver while 4 clients stream (3 gRPC, 1 SSE): every request in flight ends finished (and
    exact) or cancelled with a reason, the server exits with code 0 within 30 s, and no stub process is left.
    It stops the module's server, so it is the last test of this file."""
    tok, run = offline
    cases = [({"text_input": p, "max_tokens": 12}, run(LOAD, tok.encode(p), max_new_tokens=12).tokens)
             for p in PROMPTS[:3]]
    srv = server
    term = threading.Event()
    results: list[tuple[dict, list[int], Result]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        k = 0
        grpc = None if i == 3 else GrpcStreamClient(srv.grpc_url, "load")
        try:
            while not term.is_set() and k < 50:
                body, ref = cases[(i + k) % len(cases)]
                body = dict(body, stream=True)
                if grpc is None:
                    r = http_generate_stream(srv.http_url, "load", body, timeout=60)
                else:
                    r = grpc.generate({n: [v] for n, v in body.items()}, timeout=60)
                with lock:
                    results.append((body, ref, r))
                k += 1
        finally:
            if grpc is not None:
                grpc.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(4)
        term.set()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=40)
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=60)
        left = srv.group_pids()
    finally:
        srv.stop()
    assert code == 0, f"exit code {code}:\n{srv.log_tail()}"
    assert took < 30, f"the server took {took:.1f} s to stop"
    assert left == [], f"processes of the server's group left after it exited: {left}"
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    assert len(results) >= 4
    for body, ref, r in results:
        if r.ok:
            assert r.ids == ref, f"{body}: {r.ids} != {ref}"
        else:
            assert r.error and re.search(r"cancelled after \d+ tokens \(server shutdown", r.error), r.error
