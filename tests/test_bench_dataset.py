"""Benchmark datasets (trtllm-bench's JSON-lines format) and statistics (trtllm-bench's metric definitions).

Oracles: the format as trtllm-bench documents it (task_id, prompt | input_ids, output_tokens; input_ids wins),
numpy's percentile with method="inverted_cdf" (nearest rank), and the metric formulas evaluated by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtllm_kivi.bench.dataset import BenchRequest, read_dataset, summary, token_norm_dist, write_jsonl
from trtllm_kivi.bench.metrics import RequestTiming, benchmark_statistics, format_statistics, percentiles


def test_token_norm_dist_lengths_ids_and_seed():
    reqs = token_norm_dist(2000, input_mean=100, input_stdev=20, output_mean=50, output_stdev=10, vocab_size=500,
                           seed=3)
    ins = np.array([len(r.input_ids) for r in reqs])
    outs = np.array([r.output_tokens for r in reqs])
    assert abs(ins.mean() - 100) < 2 and abs(ins.std() - 20) < 2  # 2000 samples: ~0.45 standard error
    assert abs(outs.mean() - 50) < 1 and abs(outs.std() - 10) < 1
    assert all(0 <= t < 500 for r in reqs for t in r.input_ids)
    assert [r.task_id for r in reqs] == list(range(2000))
    again = token_norm_dist(2000, 100, 20, 50, 10, 500, seed=3)
    assert [r.input_ids for r in again] == [r.input_ids for r in reqs]
    fixed = token_norm_dist(5, 7, 0, 3, 0, 500)
    assert {len(r.input_ids) for r in fixed} == {7} and {r.output_tokens for r in fixed} == {3}
    tiny = token_norm_dist(200, 1, 50, 1, 50, 500)  # wide distributions are clipped to >= 1 token
    assert min(len(r.input_ids) for r in tiny) == 1 and min(r.output_tokens for r in tiny) == 1
    with pytest.raises(ValueError, match="num_requests=0 must be >= 1"):
        token_norm_dist(0, 10, 0, 10, 0, 500)
    with pytest.raises(ValueError, match="input length: mean=0 must be >= 1"):
        token_norm_dist(1, 0, 0, 10, 0, 500)


def test_jsonl_roundtrip_and_trtllm_bench_entries(tmp_path):
    reqs = token_norm_dist(4, 9, 3, 5, 2, 100, seed=1)
    path = tmp_path / "d.jsonl"
    write_jsonl(reqs, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [set(d) for d in lines] == [{"task_id", "input_ids", "output_tokens"}] * 4
    back = read_dataset(path, vocab_size=100)
    assert [(r.task_id, r.input_ids, r.output_tokens) for r in back] == \
        [(r.task_id, r.input_ids, r.output_tokens) for r in reqs]
    assert len(read_dataset(path, num_requests=2)) == 2
    # trtllm-bench's documented examples; input_ids wins over prompt
    doc = tmp_path / "doc.jsonl"
    doc.write_text('{"task_id":0,"input_ids":[863,22056,25603],"output_tokens":128}\n\n'
                   '{"task_id": 1, "prompt": "ignored", "input_ids": [5, 6], "output_tokens": 2}\n')
    r = read_dataset(doc)
    assert r[0].input_ids == [863, 22056, 25603] and r[0].output_tokens == 128 and r[1].input_ids == [5, 6]


@pytest.mark.parametrize("line, match", [
    ('{"task_id": 0, "input_ids": [1], "output_tokens": 0}', r"d.jsonl:2: output_tokens=0 must be an integer >= 1"),
    ('{"task_id": 0, "input_ids": [], "output_tokens": 3}', r"d.jsonl:2: input_ids must be a non-empty list"),
    ('{"task_id": 0, "output_tokens": 3}', r"d.jsonl:2: needs 'prompt' or 'input_ids'"),
    ('{"input_ids": [1], "output_tokens": 3}', r"d.jsonl:2: needs task_id, output_tokens"),
    ('{"task_id": 0, "prompt": "hi", "output_tokens": 3}', r"d.jsonl:2: a 'prompt' entry needs a tokenizer"),
    ('{"task_id": 0, "input_ids": [1, 700], "output_tokens": 3}', r"d.jsonl:2: input_ids outside the vocabulary"),
    ('not json', r"d.jsonl:2: not a JSON object"),
])
def test_read_dataset_names_the_bad_line(tmp_path, line, match):
    path = tmp_path / "d.jsonl"
    path.write_text('{"task_id": 9, "input_ids": [1, 2], "output_tokens": 3}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_dataset(path, vocab_size=500)


def test_percentiles_are_nearest_rank():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 1001):
        xs = rng.exponential(size=n).tolist()
        p = percentiles(xs)
        for q in (50, 90, 95, 99):
            assert p[f"p{q}"] == pytest.approx(np.percentile(xs, q, method="inverted_cdf"))
        assert p["minimum"] == min(xs) and p["maximum"] == max(xs) and p["average"] == pytest.approx(np.mean(xs))


def test_benchmark_statistics_formulas():
    # two requests: A 10 in / 5 out, starts 0, first token 1, ends 3; B 20 in / 1 out, starts 1, first/end 4
    t = [RequestTiming(10, 5, 0.0, 1.0, 3.0), RequestTiming(20, 1, 1.0, 4.0, 4.0)]
    s = benchmark_statistics(t, streaming=True)
    p, st, r = s["performance"], s["streaming_metrics"], s["request_info"]
    assert p["total_latency_ms"] == pytest.approx(4000)
    assert p["request_throughput_req_s"] == pytest.approx(2 / 4)
    assert p["system_output_throughput_tok_s"] == pytest.approx(6 / 4)
    assert p["system_total_throughput_tok_s"] == pytest.approx(36 / 4)
    assert p["avg_request_latency_ms"] == pytest.approx((3 + 3) / 2 * 1000)
    assert p["output_throughput_per_user_tok_s"] == pytest.approx((5 / 3 + 1 / 3) / 2)
    assert r["avg_num_concurrent_requests"] == pytest.approx(6 / 4)
    assert st["avg_ttft_ms"] == pytest.approx((1 + 3) / 2 * 1000)
    assert st["avg_tpot_ms"] == pytest.approx((3 - 1) / 4 * 1000)  # B has one token: no TPOT
    assert st["token_output_speed_tok_s"] == pytest.approx(4 / 2)
    assert "streaming_metrics" not in benchmark_statistics(t, streaming=False)
    text = format_statistics(s)
    for name in ("Request Throughput (req/sec):", "Total Output Throughput (tokens/sec):",
                 "Total Token Throughput (tokens/sec):", "Average request latency (ms):",
                 "Average time-to-first-token [TTFT] (ms):", "Average time-per-output-token [TPOT] (ms):",
                 "[Latency] P99"):
        assert name in text
    with pytest.raises(ValueError, match="no finished requests"):
        benchmark_statistics([])


def test_dataset_summary():
    s = summary([BenchRequest(0, [1] * 10, 5), BenchRequest(1, [1] * 30, 7)])
    assert s["max_sequence_length"] == 37 and s["avg_isl"] == 20 and s["osl_stats"]["maximum"] == 7
