"""A real Triton Inference Server (the `tritonserver` of the PyPI wheel nvidia-pytriton, python backend) serving the
default model from a repository written by `trtllm-kivi triton`, on 127.0.0.1, queried with tritonclient.

Oracle: the offline path in this process — the same model and KV cache spec through runtime.generate.generate
(greedy, or seeded sampling), token for token.

Runs with the serving env's Python (numpy<2, tritonclient), which build_scripts/setup_triton_env.sh makes:
    ENV=$(bash build_scripts/setup_triton_env.sh | tail -1)
    $ENV/bin/python -m pytest --noconftest -m triton tests/test_triton_server.py
From the dev venv, tests/test_triton_relay.py runs exactly that.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from trtllm_kivi.serving.client import grpc_inputs, http_generate
from trtllm_kivi.serving.server import SETUP, TritonEnv, TritonServer

pytestmark = pytest.mark.triton

try:
    import tritonclient.grpc as grpcclient
except ImportError as e:  # the main dev venv has no tritonclient (its numpy 2 / protobuf 7 do not suit Triton)
    pytest.skip(f"tritonclient is not importable here ({e}); tests/test_triton_relay.py runs this file with the "
                f"serving env's python (ENV=$({SETUP} | tail -1); $ENV/bin/python -m pytest --noconftest -m triton "
                f"tests/test_triton_server.py)", allow_module_level=True)

try:
    TRITON_ENV = TritonEnv.find()
except FileNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

MODEL = "trtllm_kivi"
KV, KV_OPTIONS = "kivi2", {"residual_length": 32}  # R=32: sequences past 64 tokens read quantized history
MAX_SLOTS, MAX_SEQ_LEN = 4, 160
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fibonacci(n):", "The quick brown fox", "Once upon a time there was a"]


ENGINE_MODEL = "tiny_engine"
# The engine's checkpoint: models.tiny's TINY_CONFIG with the default model's 49152-token vocabulary (and its
# tokenizer), 512 positions, eps 1e-6, an untied lm_head, no BOS/EOS ids; wide init (peaked logits, far from ties).
TINY_OVERRIDES = dict(vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None)


def build_tiny_engine(folder) -> str:
    """`trtllm-kivi build` of a random tiny Llama (with the default model's tokenizer), KIVI-2 with R=16."""
    from trtllm_kivi.cli import main
    from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model
    from trtllm_kivi.models.tiny import WIDE_INIT, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(folder / "tiny", seed=0, init=WIDE_INIT,
                                 tokenizer=gguf_tokenizer(resolve_model("smollm2-135m")).tok, **TINY_OVERRIDES)
    out = folder / "build"
    assert main(["build", "--model", str(ckpt), "-o", str(out), "--dtype", "float32", "--max-batch-size", "3",
                 "--max-seq-len", "128", "--max-num-tokens", "64", "--check-steps", "0", "--quiet",
                 "--kv", "kivi2", "--residual-length", "16"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("tiny_build"))


QWEN2_MODEL, QWEN2_ENGINE = "tiny_qwen2", "tiny_qwen2_engine"
QWEN2_KV = ["--kv", "kivi2", "--residual-length", "16"]  # R + G = 48: the requests below read quantized history
QWEN2_MAXIMA = ["--max-batch-size", "3", "--max-seq-len", "128", "--max-num-tokens", "64"]


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory):
    """(checkpoint, build folder) of a random tiny Qwen2 (models.tiny's TINY_QWEN2_CONFIG: q/k/v biases, rope theta
    1e6, GQA 7:1; byte tokenizer; wide init; no EOS id so every request runs to max_tokens) and its `trtllm-kivi
    build` (KIVI-2, R=16; the ONNX graph carries the biases)."""
    from trtllm_kivi.cli import main
    from trtllm_kivi.models.tiny import WIDE_INIT, write_tiny_qwen2_checkpoint

    folder = tmp_path_factory.mktemp("qwen2")
    ckpt = write_tiny_qwen2_checkpoint(folder / "tiny-qwen2", seed=5, init=WIDE_INIT, max_position_embeddings=512,
                                       bos_token_id=None, eos_token_id=None)
    out = folder / "build"
    assert main(["build", "--model", str(ckpt), "-o", str(out), "--dtype", "float32", "--check-steps", "0",
                 "--quiet", *QWEN2_MAXIMA, *QWEN2_KV]) == 0
    return ckpt, out


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_dir, qwen2_dirs):
    """One server, four models: the default model through the torch runner (repository written by the Python API),
    a build folder through the builder's runner factory (written by `trtllm-kivi triton --engine`), and a tiny Qwen2
    both ways (`trtllm-kivi triton --model` of its Hugging Face folder, `--engine` of its build)."""
    from trtllm_kivi.cli import main
    from trtllm_kivi.models import resolve_model
    from trtllm_kivi.serving.config import ServingConfig
    from trtllm_kivi.serving.repository import write_repository

    repo = tmp_path_factory.mktemp("triton_repo")
    cfg = ServingConfig(model=str(resolve_model("smollm2-135m")), kv=KV, kv_options=KV_OPTIONS,
                        max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, prefill_chunk=128, default_max_tokens=16,
                        num_threads=1)
    write_repository(repo, cfg, MODEL)
    assert main(["triton", "--engine", engine_dir, "-o", str(repo), "--name", ENGINE_MODEL, "--num-threads", "1",
                 "--prefill-chunk", "32"]) == 0
    qwen2_ckpt, qwen2_build = qwen2_dirs
    assert main(["triton", "--model", str(qwen2_ckpt), "-o", str(repo), "--name", QWEN2_MODEL, "--num-threads", "1",
                 "--prefill-chunk", "32", "--dtype", "float32", *QWEN2_MAXIMA, *QWEN2_KV]) == 0
    assert main(["triton", "--engine", str(qwen2_build), "-o", str(repo), "--name", QWEN2_ENGINE, "--num-threads",
                 "1", "--prefill-chunk", "32"]) == 0
    srv = TritonServer(repo, TRITON_ENV, log_file=tmp_path_factory.mktemp("triton_log") / "tritonserver.log")
    try:
        srv.start(timeout=240)
        yield srv
    finally:
        srv.stop()
        assert srv.proc.poll() is not None, "tritonserver still running after stop()"


@pytest.fixture(scope="module")
def offline():
    """The reference: same model, same KV spec, generated offline in this process."""
    import torch

    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    torch.set_num_threads(1)  # as the server (num_threads=1): same matmul partitioning, and 2 cores for 2 processes
    model, tok, _ = load_model("smollm2-135m")

    def run(prompt_ids: list[int], **params):
        runner = TorchRunner.create(model, parse_kv(KV, **KV_OPTIONS), 1, MAX_SEQ_LEN)
        sp = SamplingParams(stop_token_ids=tuple(tok.eos_ids), **params)
        return generate(runner, [prompt_ids], sp, tok, prefill_chunk=128)[0]

    return tok, run


def _input(name: str, value) -> grpcclient.InferInput:
    """A Triton input of the type config.pbtxt declares (serving/client.py; a numpy array keeps its dtype)."""
    return grpc_inputs({name: value})[0]


def stream_requests(server, requests: list[dict], timeout: float = 120.0, model: str = MODEL) -> dict[str, dict]:
    """Send every request on one gRPC stream (all in flight at once); collect per request the streamed ids and text,
    the finish reason, the number of responses, or the error."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    out = {str(i): {"ids": [], "text": "", "finish": None, "error": None, "responses": 0}
           for i in range(len(requests))}
    try:
        for i, req in enumerate(requests):
            inputs = [_input(k, v) for k, v in req.items()]
            client.async_stream_infer(model, inputs, request_id=str(i))
        pending = set(out)
        while pending:
            result, error = q.get(timeout=timeout)
            if error is not None:
                rid = _error_request_id(error, pending)
                out[rid]["error"] = str(error)
                pending.discard(rid)
                continue
            rid = result.get_response().id
            o = out[rid]
            o["responses"] += 1
            o["ids"] += result.as_numpy("output_ids").tolist()
            o["text"] += result.as_numpy("text_output")[0].decode()
            fin = result.as_numpy("finish_reason")[0].decode()
            if fin:
                o["finish"] = fin
                pending.discard(rid)
    finally:
        client.stop_stream()
        client.close()
    return out


def _error_request_id(error, pending: set[str]) -> str:
    """gRPC stream errors carry the request id in their message ('[request id: N] ...') or, from the model, only
    the message: then match the single pending request of this test."""
    msg = str(error)
    for rid in pending:
        if f"[request id: {rid}]" in msg:
            return rid
    assert len(pending) == 1, f"cannot tell which request failed: {msg}"
    return next(iter(pending))


def test_concurrent_streaming_requests_match_offline(server, offline):
    tok, run = offline
    n = [16, 24, 12, 20, 8, 16]
    got = stream_requests(server, [{"text_input": [p], "max_tokens": [k], "stream": [True]}
                                   for p, k in zip(PROMPTS, n, strict=True)])
    for i, (p, k) in enumerate(zip(PROMPTS, n, strict=True)):
        ref = run(tok.encode(p), max_new_tokens=k)
        o = got[str(i)]
        assert o["error"] is None, o["error"]
        assert o["ids"] == ref.tokens, f"prompt {p!r}: server {o['ids']} != offline {ref.tokens}"
        assert o["text"] == ref.text and o["finish"] == ref.finish_reason
        assert o["responses"] >= len(ref.tokens), "streaming sent fewer responses than tokens"


def test_input_ids_seeded_sampling_and_stop_words(server, offline):
    tok, run = offline
    ids = tok.encode(PROMPTS[1])
    greedy = run(ids, max_new_tokens=24)
    stop = greedy.text[len(tok.decode(greedy.tokens[:4])):][:3]
    sampled = run(ids, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=1234)
    reqs = [
        {"input_ids": ids, "max_tokens": [24], "stop_words": [stop], "stream": [True]},
        {"input_ids": ids, "max_tokens": [12], "temperature": [0.8], "top_p": [0.9], "seed": [1234],
         "stream": [True]},
        {"input_ids": ids, "max_tokens": [12], "temperature": [0.8], "top_p": [0.9], "seed": [1234]},
    ]
    got = stream_requests(server, reqs)
    assert got["0"]["finish"] == "stop" and got["0"]["text"] == greedy.text[:greedy.text.find(stop)]
    assert got["1"]["ids"] == sampled.tokens and got["1"]["text"] == sampled.text
    assert got["1"]["responses"] >= len(sampled.tokens)  # stream=true: one response per token
    assert got["2"]["ids"] == sampled.tokens and got["2"]["responses"] == 1  # default stream=false: one response


MALFORMED = [
    ({"text_input": [""]}, "'text_input' is empty"),
    ({"max_tokens": [4]}, "exactly one of 'text_input'"),
    ({"text_input": ["hi"], "input_ids": [1, 2]}, "exactly one of 'text_input'"),
    ({"text_input": ["hi"], "max_tokens": [0]}, r"max_tokens=0 must be in \[1, 160\]"),
    ({"text_input": ["hi"], "max_tokens": [1_000_000_000]}, r"max_tokens=1000000000 must be in \[1, 160\]"),
    ({"text_input": ["hi"], "max_tokens": [4, 5]}, "'max_tokens' must hold exactly one value"),
    ({"text_input": ["hi", "there"]}, "exactly one string"),
    ({"text_input": ["hi"], "temperature": [-1.0]}, "temperature=-1.0 must be in"),
    ({"text_input": ["hi"], "top_p": [0.0]}, r"top_p=0.0 must be in \(0, 1\]"),
    ({"input_ids": [1, 49152]}, r"outside the vocabulary \[0, 49152\)"),
    ({"input_ids": []}, "'input_ids' is empty"),
    ({"text_input": [b"\xff\xfe"]}, "not valid UTF-8"),
    ({"input_ids": list(range(1, 101)), "max_tokens": [100]}, "needs 199 cache positions"),
    ({"text_input": ["hi"], "max_tokens": np.array([2.5], np.float32)},
     "data-type is 'FP32', but model 'trtllm_kivi' expects 'INT64'"),
    ({"text_input": ["hi"], "bogus": [1]}, "unexpected inference input 'bogus'"),
    # the shape config.pbtxt declares is the one the model parses; large integers are not truncated
    ({"input_ids": [[1, 2, 3]]}, r"unexpected shape for input 'input_ids' for model 'trtllm_kivi'. Expected \[-1\], "
                                 r"got \[1,3\]"),
    ({"text_input": ["hi"], "max_tokens": [2**40]}, r"max_tokens=1099511627776 must be in \[1, 160\]"),
    ({"input_ids": [2**32 + 5]}, r"ids \[4294967301\] outside the vocabulary \[0, 49152\)"),
    ({"input_ids": list(range(1, 301))}, r"the prompt has 300 tokens; a sequence holds at most max_seq_len=160 tokens "
                                         r"\(prompt \+ max_new_tokens - 1\), so the prompt must be 1\.\.160 tokens"),
]


def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, offline):
    tok, run = offline
    for req, match in MALFORMED:
        got = stream_requests(server, [req])["0"]
        assert got["error"] is not None, f"{req} was accepted"
        assert re.search(match, got["error"]), f"{req}: {got['error']!r} does not match {match!r}"
    assert server.live() and server.ready()
    ref = run(tok.encode(PROMPTS[0]), max_new_tokens=8)
    got = stream_requests(server, [{"text_input": [PROMPTS[0]], "max_tokens": [8]}])
    assert got["0"]["ids"] == ref.tokens


def test_http_generate_endpoint(server, offline):
    """Triton's HTTP generate extension (plain JSON) on the decoupled model with stream=false: one response."""
    tok, run = offline
    ref = run(tok.encode(PROMPTS[4]), max_new_tokens=10)
    body = json.dumps({"text_input": PROMPTS[4], "max_tokens": 10, "stream": False}).encode()
    r = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", body,
                               {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=120) as resp:
        out = json.loads(resp.read())
    assert out["text_output"] == ref.text and out["output_ids"] == ref.tokens and out["finish_reason"] == "length"
    bad = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate",
                                 json.dumps({"text_input": "", "stream": False}).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=60)
    assert "'text_input' is empty" in e.value.read().decode()


def test_http_generate_plain_request(server, offline):
    """The obvious request -- no "stream" key -- gets one JSON response with the whole output."""
    tok, run = offline
    ref = run(tok.encode(PROMPTS[2]), max_new_tokens=12)
    r = http_generate(server.http_url, MODEL, {"text_input": PROMPTS[2], "max_tokens": 12})
    assert (r.status, r.error) == (200, None)
    assert r.ids == ref.tokens and r.text == ref.text and r.finish == "length"


HTTP_MALFORMED = [  # unknown inputs, out-of-range values, prompts past capacity over HTTP generate: status, message
    ({"text_input": "hi", "bogus": 1}, 400, r"invalid request: unknown inputs \['bogus'\]; accepted: \['input_ids', "),
    ({"text_input": "hi", "temprature": 0.5, "max_tokens": 4}, 400, r"unknown inputs \['temprature'\]"),
    ({"text_input": "hi", "max_tokens": 2**40}, 400, r"max_tokens=1099511627776 must be in \[1, 160\]"),
    ({"text_input": "hi", "top_k": -2**40}, 400, r"top_k=-1099511627776 must be >= 0"),
    ({"input_ids": [5, 2**32 + 5]}, 400, r"ids \[4294967301\] outside the vocabulary \[0, 49152\)"),
    ({"text_input": "hi " * 400}, 400, r"the prompt has 401 tokens; a sequence holds at most max_seq_len=160 tokens "
                                      r"\(prompt \+ max_new_tokens - 1\), so the prompt must be 1\.\.160 tokens"),
    ({"text_input": "hi " * 100, "max_tokens": 100}, 400,
     r"prompt of 101 tokens \+ max_new_tokens=100 needs 200 cache positions; a sequence holds at most "
     r"max_seq_len=160 \(max_new_tokens allowed for this prompt: 1\.\.60\)"),
    ({"text_input": ""}, 400, "'text_input' is empty"),
]


@pytest.mark.parametrize("body, status, match", HTTP_MALFORMED)
def test_http_generate_refuses_bad_requests(server, body, status, match):
    r = http_generate(server.http_url, MODEL, body, timeout=60)
    assert r.status == status and r.error is not None, (r.status, r.error)
    assert re.search(match, r.error), f"{body}: {r.error!r} does not match {match!r}"


def test_http_input_ids_shape_agrees_with_config(server, offline):
    """config.pbtxt declares input_ids dims [-1] and the model parses exactly that: [n] works over
    HTTP and gRPC, [1, n] is refused before the model (by Triton's shape check, naming the input)."""
    tok, run = offline
    ids = tok.encode(PROMPTS[3])
    ref = run(ids, max_new_tokens=6)
    assert http_generate(server.http_url, MODEL, {"input_ids": ids, "max_tokens": 6}).ids == ref.tokens
    assert stream_requests(server, [{"input_ids": ids, "max_tokens": [6]}])["0"]["ids"] == ref.tokens
    r = http_generate(server.http_url, MODEL, {"input_ids": [ids], "max_tokens": 6})
    assert r.status >= 400 and ("input_ids" in r.error or "Shape does not match" in r.error), (r.status, r.error)
    assert server.live() and server.ready()


def test_grpc_unknown_parameters_are_refused(server):
    """Over gRPC, a request parameter the model does not take is refused like an unknown input."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(MODEL, grpc_inputs({"text_input": ["hi"], "max_tokens": [3]}),
                                  parameters={"bogus": 1})
        result, error = q.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None and re.search(r"unknown inputs \['bogus'\]", str(error)), (result, error)


def test_concurrent_clients_in_threads(server, offline):
    """Several clients at once (own connections, own threads), more requests than slots: all served, all exact."""
    tok, run = offline
    results: dict[int, dict] = {}

    def client(i: int) -> None:
        results[i] = stream_requests(server, [{"text_input": [PROMPTS[i]], "max_tokens": [10]}])["0"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i, p in enumerate(PROMPTS):
        assert results[i]["ids"] == run(tok.encode(p), max_new_tokens=10).tokens


def test_build_folder_model_matches_offline_factory(server, engine_dir):
    """The build folder served by Triton equals the builder's runner (runtime.select.load_runner) run offline;
    prompt + output pass R + G = 48 tokens, so quantized history is read."""
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.select import BuildFolder, load_runner

    tok = BuildFolder.open(engine_dir).tokenizer()
    prompts = [list(range(100, 140)), list(range(7, 19)), tok.encode("Hello from the engine")]
    n = [20, 45, 10]
    got = stream_requests(server, [{"input_ids": p, "max_tokens": [k]} for p, k in zip(prompts, n, strict=True)],
                          model=ENGINE_MODEL)
    for i, (p, k) in enumerate(zip(prompts, n, strict=True)):
        runner, _ = load_runner(engine_dir, threads=1)
        ref = generate(runner, [p], SamplingParams(max_new_tokens=k, stop_token_ids=tuple(tok.eos_ids)), tok,
                       prefill_chunk=32)[0]
        assert got[str(i)]["error"] is None and got[str(i)]["ids"] == ref.tokens
    bad = stream_requests(server, [{"input_ids": list(range(100)), "max_tokens": [40]}], model=ENGINE_MODEL)["0"]
    assert "needs 139 cache positions; a sequence holds at most max_seq_len=128" in bad["error"]


def test_qwen2_checkpoint_and_build_match_offline(server, qwen2_dirs):
    """A Qwen2 checkpoint (q/k/v biases) served by Triton equals the offline runners token for token: its Hugging
    Face folder through the torch runner (TorchRunner over the same KIVI-2 cache, R=16) and its build folder through
    the builder's runner factory (runtime.select.load_runner). Prompt + output pass R + G = 48 tokens."""
    import torch

    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.select import load_runner
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    torch.set_num_threads(1)  # as the served models (--num-threads 1)
    ckpt, build = qwen2_dirs
    model, tok, mc = load_model(str(ckpt))
    assert mc.qkv_bias and mc.n_heads == 7 * mc.n_kv_heads  # a Qwen2 config: q/k/v biases, GQA 7:1
    text = "Qwen2 meets KIVI through Triton"
    prompts = [tok.encode(text), list(range(40, 90)), list(range(3, 12))]
    n = [30, 24, 45]
    got = stream_requests(server, [{"text_input": [text], "max_tokens": [n[0]], "stream": [True]}]
                          + [{"input_ids": p, "max_tokens": [k]} for p, k in zip(prompts[1:], n[1:], strict=True)],
                          model=QWEN2_MODEL)
    engine = stream_requests(server, [{"input_ids": p, "max_tokens": [k]} for p, k in zip(prompts, n, strict=True)],
                             model=QWEN2_ENGINE)
    for i, (p, k) in enumerate(zip(prompts, n, strict=True)):
        params = SamplingParams(max_new_tokens=k)
        runner = TorchRunner.create(model, parse_kv("kivi2", residual_length=16), 1, 128)
        ref = generate(runner, [p], params, tok, prefill_chunk=32)[0]
        assert len(ref.tokens) == k and len(set(ref.tokens)) > 3  # no early stop, not one repeated token
        assert got[str(i)]["error"] is None and got[str(i)]["ids"] == ref.tokens, (i, got[str(i)], ref.tokens)
        engine_runner, _ = load_runner(str(build), threads=1)
        ref_engine = generate(engine_runner, [p], params, tok, prefill_chunk=32)[0]
        assert engine[str(i)]["error"] is None and engine[str(i)]["ids"] == ref_engine.tokens, (i, engine[str(i)])
    assert got["0"]["text"] == tok.decode(got["0"]["ids"]) and got["0"]["responses"] >= n[0]


TYPE_ERRORS = [b'{"text_input": 5, "max_tokens": 2}', b'{"text_input": "Hi", "max_tokens": 2.5}',
               b'{"text_input": "Hi", "max_tokens": "2"}', b'{"text_input": "Hi", "max_tokens": 2, "temperature": "x"}',
               b'[1, 2]', b'{"text_input": "Hi", "max_tok']
DEEP = b'{"text_input": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"  # ~100 KB


def _post_raw(url: str, raw: bytes) -> tuple[int | None, str]:
    req = urllib.request.Request(f"http://{url}/v2/models/{MODEL}/generate", data=raw,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # the server went away
        return None, repr(e)


def test_launcher_exit_status_follows_the_server_after_hostile_bodies(tmp_path):
    """Triton's own HTTP front end answers wrong JSON types with HTTP 500 naming no field, and tritonserver 2.51 dies
    with SIGSEGV on a body nested 50,000 levels deep (upstream; docs/serving.md has the reproductions). What is ours:
    `trtllm-kivi triton --launch` exits with the server's failure (128 + signal) and says why; had the server
    survived, it keeps serving and the launcher exits 0 at SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "trtllm_kivi.cli", "triton", "--model", "smollm2-135m", "-o", str(tmp_path / "repo"),
           "--launch", "--max-batch-size", "2", "--max-seq-len", "192", "--threads", "1", "--kv", KV,
           "--residual-length", "32", "--block-size", "32", "--triton-env", str(TRITON_ENV.root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        url, metrics_url, lines = None, None, []
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"HTTP (127\.0\.0\.1:\d+).*metrics (127\.0\.0\.1:\d+)", line)
            url, metrics_url = (m.group(1), m.group(2)) if m else (None, None)
        assert url, "".join(lines)
        good = b'{"text_input": "Hi", "max_tokens": 2}'
        # prefix sharing works through this door too: the second prompt reuses the first one's kept blocks
        system = "You are a helpful assistant for a bakery. " * 10
        for q in ("What is bread?", "What is a croissant?"):
            assert _post_raw(url, json.dumps({"text_input": system + q, "max_tokens": 2}).encode())[0] == 200
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=30) as r:
            text = r.read().decode()
        hits = re.search(r"^trtllm_kivi_prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
        assert hits and float(hits.group(1)) >= 1, text[-3000:]
        for raw in TYPE_ERRORS:
            status, body = _post_raw(url, raw)
            assert status is not None and 400 <= status < 600 and status != 200, (raw, status, body)
            assert _post_raw(url, good)[0] == 200, raw
        status, body = _post_raw(url, DEEP)
        time.sleep(2)
        if status is None:  # the server died (Triton 2.51): the launcher must fail, naming the signal
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 128 + signal.SIGSEGV, (proc.returncode, out[-2000:])
            assert "SIGSEGV" in out and "died" in out, out[-2000:]
        else:  # a fixed Triton: it refuses the body and keeps serving; a clean stop exits 0
            assert 400 <= status < 500 and _post_raw(url, good)[0] == 200, (status, body)
            os.kill(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=120)
            assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
