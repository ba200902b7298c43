"""`trtllm-kivi bench` end to end on a tiny random-weight Llama checkpoint folder (config.json + safetensors + the
default model's real tokenizer.json), and the workload driver / memory figures underneath.

Oracles: each request's greedy tokens from runtime.generate.generate run alone; the FP16 and
FP8 byte counts written out by hand (2 x layers x kv_heads x head_dim x tokens x bytes); format.kivi_total_bytes
for KIVI (the format's own formula)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from trtllm_kivi import format as fmt
from trtllm_kivi.bench.dataset import read_dataset
from trtllm_kivi.bench.workload import memory_figures, run_workload
from trtllm_kivi.cli import main
from trtllm_kivi.models import load_model
from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model
from trtllm_kivi.models.tiny import WIDE_INIT, write_tiny_checkpoint
from trtllm_kivi.runtime.generate import SamplingParams, generate
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.torch_runner import TorchRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama checkpoint folder with the default model's tokenizer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), seed=0, init=WIDE_INIT,
                                 tokenizer=gguf_tokenizer(resolve_model("smollm2-135m")).tok, vocab_size=49152,
                                 max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                                 eos_token_id=None)


def test_prepare_and_throughput_cli_with_several_kv_specs(tiny, tmp_path, capsys):
    data, report = tmp_path / "d.jsonl", tmp_path / "r.json"
    assert main(["bench", "prepare-dataset", "-o", str(data), "--model", str(tiny), "--seed", "2",
                 "token-norm-dist", "--num-requests", "6", "--input-mean", "40", "--input-stdev", "20",
                 "--output-mean", "20", "--output-stdev", "8"]) == 0
    assert main(["bench", "throughput", "--dataset", str(data), "--model", str(tiny), "--kv", "fp16,kivi2",
                 "--residual-length", "16", "--max-batch-size", "3", "--warmup", "1", "--streaming",
                 "--kv-memory-gb", "1", "--report-json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "Request Throughput (req/sec):" in out and "| kivi2 |" in out
    rep = json.loads(report.read_text())
    reqs = read_dataset(data)
    assert rep["dataset"]["num_requests"] == 6 and [r["kv"] for r in rep["runs"]] == ["fp16", "kivi2"]
    n_out = sum(r.output_tokens for r in reqs)
    for run in rep["runs"]:
        perf = run["performance"]
        assert run["request_info"]["num_requests"] == 6
        assert run["request_info"]["avg_output_length"] == pytest.approx(n_out / 6)
        assert perf["system_output_throughput_tok_s"] == pytest.approx(n_out / perf["total_latency_ms"] * 1e3)
        assert run["streaming_metrics"]["avg_ttft_ms"] > 0 and run["streaming_metrics"]["avg_tpot_ms"] > 0
        assert run["memory"]["kv_cache_bytes_allocated"] > 0
    assert rep["runs"][1]["outputs_identical_to_baseline"]["of"] == 6
    assert rep["machine"]["torch"] == torch.__version__ and rep["machine"]["cores"] == os.cpu_count()
    assert rep["machine"]["cpu"] and rep["machine"]["git_commit"]  # the machine as what it is, and the commit
    assert (rep["model"], rep["dataset"]["path"]) == (tiny.name, data.name)  # no path of this machine


def test_prepare_from_text_and_latency_cli(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    data, report = tmp_path / "d.jsonl", tmp_path / "r.json"
    assert main(["bench", "prepare-dataset", "-o", str(data), "--model", str(tiny), "text", "--file", str(text),
                 "--num-requests", "3", "--input-len", "24", "--output-mean", "6"]) == 0
    reqs = read_dataset(data)
    assert [len(r.input_ids) for r in reqs] == [24] * 3 and [r.output_tokens for r in reqs] == [6] * 3
    assert main(["bench", "latency", "--dataset", str(data), "--model", str(tiny), "--kv", "kivi4",
                 "--warmup", "0", "--report-json", str(report)]) == 0
    run = json.loads(report.read_text())["runs"][0]
    assert run["request_info"]["avg_num_concurrent_requests"] <= 1.0 + 1e-6  # one at a time
    assert "streaming_metrics" in run


def test_bench_refuses_a_dataset_past_the_model_context(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"task_id": 0, "input_ids": [1, 2, 3], "output_tokens": 600}\n')
    assert main(["bench", "throughput", "--dataset", str(data), "--model", str(tiny)]) == 2
    assert "needs 603 tokens per sequence; the model's context is 512" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_workload_outputs_equal_solo_generation(tiny, mode):
    model, _, _ = load_model(str(tiny))
    from trtllm_kivi.bench.dataset import token_norm_dist

    reqs = token_norm_dist(5, 30, 15, 12, 5, 49152, seed=4)
    spec = parse_kv("kivi2", residual_length=16)
    runner = TorchRunner.create(model, spec, 2, 128)
    res = run_workload(runner, reqs, mode, max_num_tokens=32, prefill_chunk=16, warmup=1)
    assert runner.free_slots == 2 and res.statistics["request_info"]["num_requests"] == 5
    for r in reqs:
        solo = TorchRunner.create(model, spec, 1, 128)
        ref = generate(solo, [r.input_ids], SamplingParams(max_new_tokens=r.output_tokens), prefill_chunk=16)[0]
        assert res.outputs[r.task_id] == ref.tokens
    if mode == "latency":
        t = sorted(res.timings, key=lambda x: x.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(t, t[1:], strict=False)), "latency mode overlapped requests"


def test_memory_figures(tiny):
    model, _, cfg = load_model(str(tiny))
    geom = cfg.geometry  # 2 layers, 2 KV heads, head_dim 32
    for kv in ("fp16", "kivi2"):
        spec = parse_kv(kv, residual_length=16)
        runner = TorchRunner.create(model, spec, 3, 100)
        m = memory_figures(runner, 100, kv_memory_gb=0.001)
        assert m["kv_cache_bytes_allocated"] == runner.kv_nbytes
        assert m["fp16_kv_cache_bytes_same_shapes"] == 2 * 2 * 2 * 32 * 2 * 100 * 3
        per = m["budget"]["bytes_per_sequence"]
        assert per["fp16"] == 2 * 2 * 2 * 32 * 2 * 100 and per["fp8"] == per["fp16"] // 2
        kcfg = spec.kivi or fmt.KiviConfig()
        assert per["kivi"] == fmt.kivi_total_bytes(kcfg, geom, 100, 1, 2)
        budget = 0.001 * 2**30
        assert m["budget"]["max_concurrent_sequences"] == {k: math.floor(budget / v) for k, v in per.items()}
    # the FP16 cache of a fp32 model stores fp16: allocated == the FP16 figure
    runner = TorchRunner.create(model, parse_kv("fp16"), 3, 100)
    m = memory_figures(runner, 100, 1)
    assert m["kv_cache_bytes_allocated"] == m["fp16_kv_cache_bytes_same_shapes"]
    with pytest.raises(ValueError, match="kv_memory_gb=0 must be > 0"):
        memory_figures(runner, 100, 0)
