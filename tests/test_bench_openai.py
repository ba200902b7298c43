"""`trtllm-kivi bench latency|throughput --openai-url` against a live `trtllm-kivi serve` on 127.0.0.1 (started once
for the module: the built-in model, KIVI-2, one thread), through the CLI's main().

Oracles: the dataset file (request count, output_tokens per request: the server accepts ignore_eos, so every request
must run to its max_tokens) and the server's own usage (one request sent here with the same body). Errors: a port
nobody listens on, a path the server does not have and a model it does not serve each fail the command with a
message naming the URL and the status."""

from __future__ import annotations

import json

import pytest

from trtllm_kivi.bench.dataset import read_dataset
from trtllm_kivi.bench.endpoint import Endpoint, completion_body
from trtllm_kivi.cli import main
from trtllm_kivi.serving.openai_client import ServeProcess, post

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    with ServeProcess(["--model", MODEL, "--kv", "kivi2", "--max-batch-size", "8", "--max-seq-len", "64",
                       "--threads", "1"], timeout=300) as s:  # one thread: steady on a busy machine
        yield s


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_openai") / "d.jsonl"
    assert main(["bench", "prepare-dataset", "-o", str(path), "--seed", "3", "token-norm-dist", "--num-requests", "6",
                 "--input-mean", "32", "--input-stdev", "4", "--output-mean", "8", "--output-stdev", "2",
                 "--vocab-size", "49152"]) == 0
    return path


def bench(mode: str, url: str, dataset, report, *extra: str) -> dict:
    assert main(["bench", mode, "--openai-url", url, "--dataset", str(dataset), "--warmup", "0",
                 "--report-json", str(report), *extra]) == 0
    return json.loads(report.read_text())


def test_throughput_against_serve(server, dataset, tmp_path, capsys):
    url = f"http://127.0.0.1:{server.port}"
    rep = bench("throughput", url, dataset, tmp_path / "r.json")
    reqs = read_dataset(dataset)
    want = sum(r.output_tokens for r in reqs)
    assert (rep["endpoint"], rep["model"], rep["mode"]) == (url, MODEL, "throughput")
    assert rep["settings"]["ignore_eos"] is True  # `serve` accepts it
    run = rep["runs"][0]
    assert run["request_info"]["num_requests"] == len(reqs) == 6
    assert run["output_tokens"] == {"total": want, "source": "usage", "requests_at_max_tokens": 6, "of": 6}
    assert run["request_info"]["avg_output_length"] == pytest.approx(want / 6)
    perf, stream = run["performance"], run["streaming_metrics"]
    assert perf["system_output_throughput_tok_s"] == pytest.approx(want / perf["total_latency_ms"] * 1e3)
    assert stream["avg_ttft_ms"] > 0 and stream["avg_tpot_ms"] > 0
    assert run["request_info"]["avg_num_concurrent_requests"] > 1  # sent at once
    out = capsys.readouterr().out
    assert "Request Throughput (req/sec):" in out and "Average time-to-first-token [TTFT] (ms):" in out
    # the usage the server reports for the same body is what the report counted
    r0 = reqs[0]
    ep = Endpoint.parse(url)
    reply = post(ep.host, ep.port, "/v1/completions", completion_body(MODEL, r0, True))
    assert reply.ok and reply.usage["completion_tokens"] == r0.output_tokens
    assert reply.usage["prompt_tokens"] == len(r0.input_ids)


def test_latency_against_serve(server, dataset, tmp_path):
    url = f"http://127.0.0.1:{server.port}/v1"
    rep = bench("latency", url, dataset, tmp_path / "r.json", "--num-requests", "3", "--openai-model", MODEL,
                "--warmup", "1")
    run = rep["runs"][0]
    assert run["request_info"]["num_requests"] == 3 and rep["settings"]["concurrency"] == 1
    assert run["request_info"]["avg_num_concurrent_requests"] <= 1.0 + 1e-6  # one at a time
    assert run["output_tokens"]["total"] == sum(r.output_tokens for r in read_dataset(dataset, num_requests=3))
    assert run["streaming_metrics"]["avg_ttft_ms"] > 0 and run["streaming_metrics"]["avg_tpot_ms"] > 0


def test_errors_name_the_url_and_the_status(server, dataset, capsys):
    cases = [
        (["--openai-url", "http://127.0.0.1:1"], ["http://127.0.0.1:1/v1/models", "no answer", "Connection"]),
        (["--openai-url", f"http://127.0.0.1:{server.port}/nope"],
         [f"http://127.0.0.1:{server.port}/nope/v1/models", "HTTP 404"]),
        (["--openai-url", f"http://127.0.0.1:{server.port}", "--openai-model", "gpt-4"],
         [f"http://127.0.0.1:{server.port}/v1/completions", "HTTP 404", "gpt-4", "does not exist"]),
        (["--openai-url", "https://127.0.0.1:1"], ["http://HOST:PORT"]),
        (["--openai-url", f"http://127.0.0.1:{server.port}", "--kv", "kivi4"], ["--kv", "server's own KV cache"]),
    ]
    for args, words in cases:
        assert main(["bench", "throughput", "--dataset", str(dataset), "--warmup", "0", *args]) == 2, args
        err = capsys.readouterr().err
        for w in words:
            assert w in err, (w, err)
    with pytest.raises(SystemExit):  # argparse: --openai-url and --model are exclusive
        main(["bench", "latency", "--dataset", str(dataset), "--model", MODEL, "--openai-url", "http://x:1"])
    assert "not allowed with argument" in capsys.readouterr().err
