"""`trtllm-kivi serve` against a live server on 127.0.0.1 (started once for the module, the built-in model), with the
official `openai` client and with raw HTTP.

Oracle: the offline path in this process — the same model, KV cache spec and scheduler settings
(runtime/scheduler.py with the same prefill chunk and prefix caching), each prompt alone — token for token (compared
as decoded text). Plus OpenAI's API shapes (field names, SSE framing), the Prometheus text parser, and for every
malformed request the status and a message naming the bad field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trtllm_kivi.serving.openai_client import get, post

openai = pytest.importorskip("openai", reason="the openai client is in the test extra (pip install -e .[test])")
prom = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is in the test extra")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
KV_ARGS = ["--kv", "kivi2", "--residual-length", "32", "--block-size", "32"]  # prefix boundaries every 32 tokens
SLOTS, MAX_SEQ_LEN, CHUNK = 8, 384, 128
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def server():
    cmd = [sys.executable, "-m", "trtllm_kivi.cli", "serve", "--port", "0", "--max-batch-size", str(SLOTS),
           "--max-seq-len", str(MAX_SEQ_LEN), "--prefill-chunk", str(CHUNK), "--drain-timeout", "3",
           "--max-body-bytes", str(1 << 20), "--threads", "1", *KV_ARGS]  # one thread: steady on a busy machine
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    port = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and port is None:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "http://127.0.0.1:" in line:
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
    if port is None:
        proc.kill()
        pytest.fail(f"serve did not start:\n{''.join(lines)}")
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stdout or []), daemon=True)
    drain.start()
    yield proc, port
    if proc.poll() is None:  # a test below stops it with SIGTERM; never leave it running
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def offline(one_thread):
    """generate(prompt_ids, **params) -> text, with the server's model, KV spec and scheduler settings."""
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.sampling import SamplingParams
    from trtllm_kivi.runtime.scheduler import Scheduler
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    model, tok, _ = load_model(MODEL, "float32")
    runner = TorchRunner.create(model, parse_kv("kivi2", residual_length=32, block_size=32), 1, MAX_SEQ_LEN)

    def generate(ids: list[int], **params) -> str:
        sched = Scheduler(runner, tok, prefill_chunk=CHUNK, prefix_caching=True)
        p = SamplingParams(stop_token_ids=tuple(tok.eos_ids), **params)
        return sched.generate([ids], p)[0].text
    generate.tok = tok  # type: ignore[attr-defined]
    return generate


@pytest.fixture(scope="module")
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{HOST}:{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def metrics(server) -> dict[str, float]:
    status, text = get(HOST, server[1], "/metrics")
    assert status == 200
    out = {}
    for fam in prom.text_string_to_metric_families(text):  # parses as Prometheus text, or raises
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["trtllm_kivi_requests_running"] == 0 and m["trtllm_kivi_kv_slots_in_use"] == 0:
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.1)


def test_models_and_small_endpoints(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert get(HOST, server[1], "/health") == (200, '{"status":"ok"}')
    status, text = get(HOST, server[1], "/version")
    v = json.loads(text)
    assert status == 200 and v["model"] == MODEL and v["prefix_caching"] is True and v["kv_cache"]["k_bits"] == 2


def test_completions_match_the_offline_runner(server, offline):
    c = client(server)
    prompt = "The capital of France is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = offline.tok.encode(prompt)
    assert r.choices[0].text == offline(ids, max_new_tokens=12)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    # a token-id prompt is the same request
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    # streamed: the same text, in chunks, with the usage chunk at the end
    s = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                             stream_options={"include_usage": True})
    parts = list(s)
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_streamed_and_not(server, offline):
    c = client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0)
    want = offline(chat_ids(offline.tok, msgs), max_new_tokens=16)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(chat_ids(offline.tok, msgs))
    s = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in s) == want
    assert s[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(p.object == "chat.completion.chunk" and p.id == s[0].id for p in s)


def test_stop_strings_and_seeded_sampling(server, offline):
    c = client(server)
    full = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0].text
    assert "6" in full
    cut = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=["6", "zz"])
    assert cut.choices[0].text == full[:full.index("6")] and cut.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.95)
    a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    other = c.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != other
    assert a == offline(offline.tok.encode("Once upon a time"), max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)


def test_prefix_cache_hits_show_in_usage_and_metrics(server):
    c = client(server)
    system = "You are a helpful assistant for a bakery. " * 12
    before = metrics(server)
    uses = []
    for q in ("What is bread?", "What is a croissant?"):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                             {"role": "user", "content": q}], max_tokens=4,
                                      temperature=0)
        uses.append(r.usage)
    assert uses[0].prompt_tokens_details.cached_tokens == 0
    cached = uses[1].prompt_tokens_details.cached_tokens
    assert 64 <= cached < uses[1].prompt_tokens and (cached - 32) % 32 == 0  # a boundary b_k = R + k * block_size
    after = metrics(server)
    assert after["trtllm_kivi_prefix_cache_hits_total"] >= before["trtllm_kivi_prefix_cache_hits_total"] + 1
    assert after["trtllm_kivi_prefix_cache_hit_tokens_total"] >= before["trtllm_kivi_prefix_cache_hit_tokens_total"] \
        + cached
    assert after["trtllm_kivi_kv_blocks_cached"] > 0 and after["trtllm_kivi_kv_bytes_per_token"] > 0
    assert after["trtllm_kivi_time_to_first_token_seconds_count"] > before["trtllm_kivi_time_to_first_token_seconds_count"]


def test_concurrent_streaming_clients_get_the_offline_tokens(server, offline):
    """32 streaming clients on 8 slots (raw HTTP, SSE): every reply equals its prompt run alone offline."""
    words = ["apple", "river", "mountain", "violin", "garden", "rocket", "winter", "castle"]
    prompts = [f"Write one sentence about a {w} and the number {i}." for i, w in enumerate(words * 4)]
    replies: list = [None] * len(prompts)

    def one(i: int) -> None:
        replies[i] = post(HOST, server[1], "/v1/completions", {"model": MODEL, "prompt": prompts[i], "max_tokens": 6,
                                                               "temperature": 0, "stream": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for p, r in zip(prompts, replies, strict=True):
        assert r is not None and r.ok, r
        assert r.text == offline(offline.tok.encode(p), max_new_tokens=6), p
    wait_idle(server)


def test_a_client_that_disconnects_frees_its_slot(server):
    import http.client

    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 300, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    for streamed in (True, False):
        conn = http.client.HTTPConnection(HOST, server[1], timeout=60)
        conn.request("POST", "/v1/completions", body if streamed else body.replace(b'"stream": true',
                                                                                   b'"stream": false'),
                     {"Content-Type": "application/json"})
        if streamed:
            resp = conn.getresponse()
            assert resp.status == 200
            resp.fp.readline()  # the first chunk: the request is running
        else:
            deadline = time.monotonic() + 30
            while metrics(server)["trtllm_kivi_requests_running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        conn.sock.close()  # the client goes away mid-generation
        conn.close()
        m = wait_idle(server, timeout=20)
        assert m['trtllm_kivi_requests_finished_total{reason=cancelled}'] >= 1


MALFORMED = [  # (path, body, status, words the message must contain)
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": "5"}', 400, ["max_tokens", "integer"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 5.5}', 400, ["max_tokens"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": -1}', 400, ["max_tokens", "[1, 384]"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 0}', 400, ["max_tokens"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 100000000000}', 400,
     ["max_tokens", "384"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "temperature": "hot"}', 400, ["temperature"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "temperature": 5}', 400, ["temperature", "[0, 2]"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "top_p": 1.5}', 400, ["top_p", "[0, 1]"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "stream": "yes"}', 400, ["stream", "boolean"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": 42}', 400, ["prompt"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ""}', 400, ["prompt", "empty"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": [1, 99999999]}', 400, ["prompt", "vocabulary"]),
    ("/v1/completions", b'{"model": "smollm2-135m"}', 400, ["prompt", "required"]),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "hi"}', 404, ["gpt-4", "does not exist"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "n": 3}', 400, ["'n'=3", "allowed: 1"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "frobnicate": 1}', 400, ["frobnicate"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "stop": [1, 2]}', 400, ["stop"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "seed": -3}', 400, ["seed"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "stream_options": {"include_usage": true}}', 400,
     ["stream_options", "stream"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "presence_penalty": 1}', 400,
     ["presence_penalty", "not supported"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 10', 400, ["not valid JSON"]),
    ("/v1/completions", b'["model", "prompt"]', 400, ["JSON object"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, ["UTF-8"]),
    ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, 400, ["nests", "32"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "' + b"x" * (1 << 20) + b'"}', 413, ["bytes"]),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "' + b"word " * 500 + b'"}', 400,
     ["prompt", "max_seq_len=384"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": []}', 400, ["messages"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}', 400,
     ["messages[0].role", "wizard"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": 7}]}', 400,
     ["messages[0].content"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": "hi"}', 400, ["messages"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], '
     b'"max_completion_tokens": true}', 400, ["max_completion_tokens"]),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], '
     b'"tools": [{"type": "function"}]}', 400, ["tools", "not supported"]),
]


@pytest.mark.parametrize("path,body,status,words", MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_requests_get_the_right_status_and_message(server, path, body, status, words):
    r = post(HOST, server[1], path, body, stream=False)
    assert r.status == status, (r.status, r.body)
    err = (r.body or {})["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err)


def test_good_requests_after_malformed_ones_are_unaffected(server, offline):
    want = offline(offline.tok.encode("The capital of France is"), max_new_tokens=4)
    for path, body, _, _ in MALFORMED[::4]:
        post(HOST, server[1], path, body, stream=False)
        r = post(HOST, server[1], "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                      "max_tokens": 4, "temperature": 0})
        assert r.ok and r.text == want
    status, _ = get(HOST, server[1], "/v1/nothing")
    assert status == 404
    assert get(HOST, server[1], "/v1/completions")[0] == 405
    m = metrics(server)
    assert m['trtllm_kivi_http_requests_total{endpoint=completions,status=400}'] >= 20


def test_sigterm_drains_refuses_new_requests_and_exits_0(server):
    proc, port = server
    result: list = []
    t = threading.Thread(target=lambda: result.append(post(HOST, port, "/v1/completions", {
        "model": MODEL, "prompt": "Count slowly:", "max_tokens": 24, "temperature": 0, "ignore_eos": True})))
    t.start()
    deadline = time.monotonic() + 30
    while metrics(server)["trtllm_kivi_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    late = post(HOST, port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert late.status == 503 and "shutting down" in (late.error or "")
    t.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert result and result[0].status in (200, 503)  # finished within the drain time, or cancelled after it
