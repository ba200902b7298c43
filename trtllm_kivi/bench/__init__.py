"""trtllm-bench-style benchmarking over any Runner: datasets (trtllm-bench's JSON lines), the latency/throughput
workloads through the continuous-batching scheduler, and statistics with trtllm-bench's metric names.

    token_norm_dist / from_text / read_dataset / write_jsonl   datasets (bench/dataset.py)
    run_workload(runner, requests, mode, ...)                  latency | throughput (bench/workload.py)
    memory_figures(runner, seq_len, kv_memory_gb)              KV bytes allocated vs FP16; max sequences in a budget
    run_endpoint_workload(endpoint, model, requests, mode)     the same against an OpenAI server (bench/endpoint.py)
    benchmark_statistics / format_statistics / percentiles     trtllm-bench metrics (bench/metrics.py)
    machine_info / machine_tag / portable_path / git_commit    what a result file records (bench/machine.py)
"""

from .dataset import BenchRequest, from_text, read_dataset, summary, token_norm_dist, write_jsonl
from .machine import cpu_model, git_commit, machine_info, machine_tag, portable_path
from .metrics import RequestTiming, benchmark_statistics, format_statistics, percentiles
from .workload import MODES, WorkloadResult, memory_figures, run_workload

__all__ = ["BenchRequest", "MODES", "RequestTiming", "WorkloadResult", "benchmark_statistics", "cpu_model",
           "format_statistics", "from_text", "git_commit", "machine_info", "machine_tag", "memory_figures",
           "percentiles", "portable_path", "read_dataset", "run_workload", "summary", "token_norm_dist", "write_jsonl"]
