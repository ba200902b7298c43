"""`trtllm-kivi bench`: trtllm-bench-style benchmarking of our runners.

  trtllm-kivi bench prepare-dataset -o data.jsonl token-norm-dist --num-requests 32 --input-mean 128 ...
  trtllm-kivi bench prepare-dataset -o data.jsonl text --file corpus.txt --num-requests 16 --input-len 256 ...
  trtllm-kivi bench throughput --dataset data.jsonl --kv fp16,kivi2,kivi4 --report-json out.json
  trtllm-kivi bench latency --dataset data.jsonl --engine BUILD_DIR
  trtllm-kivi bench throughput --dataset data.jsonl --openai-url http://127.0.0.1:8000   # a running server

The dataset is trtllm-bench's JSON-lines format; the report uses trtllm-bench's metric names, plus the KV cache bytes
really allocated next to the FP16 figure for the same shapes and the maximum concurrent sequences that fit
--kv-memory-gb with FP16, FP8 and KIVI. Several --kv specs (comma-separated) run the same workload through the same
model in one process, the first one being the baseline. With --openai-url the same dataset goes to an
OpenAI-compatible server (bench/endpoint.py) and the report names the endpoint and the model instead of a KV cache."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from . import flags

NAME = "bench"
HELP = "benchmark a runner on a trtllm-bench dataset (prepare-dataset | latency | throughput)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="MODE")

    prep = sub.add_parser("prepare-dataset", help="write a trtllm-bench JSON-lines dataset",
                          description="write a trtllm-bench JSON-lines dataset (task_id, input_ids, output_tokens)")
    prep.add_argument("-o", "--output", help="file to write (default: stdout)")
    flags.add_model(prep, " (the tokenizer source)")
    flags.add_engine(prep, "take the tokenizer from a build folder instead")
    prep.add_argument("--seed", type=int, default=0)
    kinds = prep.add_subparsers(dest="dataset_kind", required=True, metavar="KIND")
    tnd = kinds.add_parser("token-norm-dist", help="random token ids, lengths ~ normal")
    for name, default in (("num-requests", None), ("input-mean", None), ("input-stdev", 0.0),
                          ("output-mean", None), ("output-stdev", 0.0)):
        tnd.add_argument(f"--{name}", type=int if name == "num-requests" else float, required=default is None,
                         default=default)
    tnd.add_argument("--vocab-size", type=int, help="sample ids below this (default: the tokenizer's vocabulary)")
    txt = kinds.add_parser("text", help="prompts cut from a text file")
    txt.add_argument("--file", required=True, help="UTF-8 text file")
    txt.add_argument("--num-requests", type=int, required=True)
    txt.add_argument("--input-len", type=int, required=True, help="prompt tokens per request")
    txt.add_argument("--output-mean", type=float, required=True)
    txt.add_argument("--output-stdev", type=float, default=0.0)

    for mode, help_ in (("latency", "one request at a time (TTFT, TPOT, latency)"),
                        ("throughput", "all requests at once, continuous batching (maximum throughput)")):
        m = sub.add_parser(mode, help=help_, description=help_)
        m.add_argument("--dataset", required=True, help="trtllm-bench JSON-lines dataset")
        src = m.add_mutually_exclusive_group()
        flags.add_model(src, ", run by the torch runner over each --kv")
        flags.add_engine(src, "a `trtllm-kivi build` folder (its own KV cache)")
        src.add_argument("--openai-url", metavar="URL", help="benchmark a running OpenAI-compatible server instead "
                         "(`trtllm-kivi serve`, llama-server, vLLM), e.g. http://127.0.0.1:8000: streamed POST "
                         "/v1/completions with the dataset's token ids; the server's own settings apply")
        m.add_argument("--openai-model", metavar="NAME", help="with --openai-url: the model to request (default: "
                       "the first id of GET /v1/models)")
        flags.add_dtype(m, "float32")
        flags.add_device(m)
        flags.add_capacity(m, 8, None, 512, 128)
        m.add_argument("--num-requests", type=int, default=0, help="use the first N requests (0: all)")
        m.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default 2)")
        m.add_argument("--repeats", type=int, default=1, help="measure the workload N times per KV spec (round "
                       "robin); the report keeps every repeat and the medians (default 1)")
        if mode == "throughput":
            m.add_argument("--concurrency", type=int, help="requests kept in flight (default: all at once)")
            m.add_argument("--streaming", action="store_true", help="stream tokens; report TTFT and TPOT")
        m.add_argument("--kv-memory-gb", type=float, default=16.0, help="KV memory budget for the max-concurrent-"
                       "sequences figures (default 16 GB)")
        flags.add_threads(m)
        flags.add_backend(m)
        m.add_argument("--report-json", help="write the full report here")
        flags.add_kv(m, many=True)
        m.set_defaults(_mode=mode)


# ----------------------------------------------------------------------------------------------- prepare-dataset


def _tokenizer(model: str | None, engine: str | None):
    if engine:
        from ..runtime.build_folder import BuildFolder

        return BuildFolder.open(engine).tokenizer()
    from ..models import DEFAULT_MODEL, Tokenizer, resolve_model
    from ..models.loaders import gguf_tokenizer

    path = resolve_model(model or DEFAULT_MODEL)
    return gguf_tokenizer(path) if path.is_file() else Tokenizer.from_hf_folder(path)


def _prepare(args: argparse.Namespace) -> int:
    from ..bench.dataset import from_text, token_norm_dist, write_jsonl

    if args.dataset_kind == "token-norm-dist":
        vocab = args.vocab_size or _tokenizer(args.model, args.engine).vocab_size
        reqs = token_norm_dist(args.num_requests, args.input_mean, args.input_stdev, args.output_mean,
                               args.output_stdev, vocab, args.seed)
    else:
        text = Path(args.file).read_text(encoding="utf-8")
        reqs = from_text(text, _tokenizer(args.model, args.engine), args.num_requests, args.input_len,
                         args.output_mean, args.output_stdev, args.seed)
    out = write_jsonl(reqs, args.output)
    if args.output is None:
        sys.stdout.write(out)
    else:
        print(f"wrote {len(reqs)} requests to {args.output}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------- latency / throughput


def _machine() -> dict:
    import torch

    from ..bench import machine_info

    return machine_info(torch_threads=torch.get_num_threads())


def _runners(args: argparse.Namespace, max_seq_len: int):
    """Yield (kv name, description, runner) for each KV spec, or the build folder's runner."""
    if args.engine:
        from ..runtime.build_folder import BuildFolder
        from ..runtime.select import load_runner

        kv = flags.kv_spec(args, build=BuildFolder.open(args.engine).info.kivi)
        runner, why = load_runner(args.engine, threads=args.threads)
        yield f"engine:{kv.name}", why, runner
        return
    from ..models import load_model
    from ..runtime.torch_runner import TorchRunner

    specs = flags.kv_specs(args)  # validate all before the model load
    model, _tok, cfg = load_model(args.model, args.dtype, args.device)
    if max_seq_len > cfg.max_seq_len:
        raise ValueError(f"the dataset needs {max_seq_len} tokens per sequence; the model's context is "
                         f"{cfg.max_seq_len}")
    for spec in specs:
        yield spec.name, spec.describe(), TorchRunner.create(model, spec, args.max_batch_size, max_seq_len,
                                                             backend=args.attention_backend)


def _bench(args: argparse.Namespace) -> int:
    from ..bench.dataset import read_dataset, summary
    from ..bench.metrics import format_statistics
    from ..bench.workload import memory_figures, run_workload

    if args.openai_url:
        return _bench_endpoint(args)
    if args.openai_model:
        raise ValueError("--openai-model needs --openai-url")
    flags.set_threads(args.threads)
    tok = None
    with open(args.dataset) as f:
        needs_tok = any('"prompt"' in line and '"input_ids"' not in line for line in f)
    if needs_tok:
        tok = _tokenizer(None if args.engine else args.model, args.engine)
    reqs = read_dataset(args.dataset, tok, num_requests=args.num_requests or None)
    ds = summary(reqs)
    max_seq_len = ds["max_sequence_length"]
    mode = args._mode
    runners = list(_runners(args, max_seq_len))
    results: list[list] = [[] for _ in runners]
    for rep in range(args.repeats):  # round robin over the KV specs: machine-load drift hits all of them alike
        for i, (_name, desc, runner) in enumerate(runners):
            print(f"=== {mode} [{rep + 1}/{args.repeats}]: {desc}; {runner.name} runner, {runner.max_slots} slots x "
                  f"{runner.max_seq_len} tokens", flush=True)
            t = time.perf_counter()
            res = run_workload(runner, reqs, mode, args.max_num_tokens, args.prefill_chunk,
                               getattr(args, "concurrency", None), args.warmup if rep == 0 else 0,
                               getattr(args, "streaming", True))
            results[i].append((res, time.perf_counter() - t))
            print(format_statistics(res.statistics))
    runs: list[dict] = []
    for (name, desc, runner), reps in zip(runners, results, strict=True):
        # the repeat with the median request throughput stands for the spec; every repeat's headline is kept
        order = sorted(range(len(reps)), key=lambda j: reps[j][0].statistics["performance"]
                       ["request_throughput_req_s"])
        res, wall = reps[order[(len(order) - 1) // 2]]
        mem = memory_figures(runner, max_seq_len, args.kv_memory_gb)
        run = {"kv": name, "kv_description": desc, "runner": runner.name, "wall_s": wall, "runner_steps": res.steps,
               **res.statistics, "memory": mem, "repeats": [_headline(r.statistics) for r, _ in reps]}
        run["medians"] = {k: statistics.median(h[k] for h in run["repeats"]) for k in run["repeats"][0]}
        if runs:
            base = results[0][0][0].outputs
            same = sum(reps[0][0].outputs[k] == base[k] for k in base)
            run["outputs_identical_to_baseline"] = {"baseline": runs[0]["kv"], "requests": same, "of": len(base)}
        runs.append(run)
        print(f"--- {name}: median of {len(reps)} repeat(s)")
        _print_memory(mem)
    from ..bench import portable_path

    report = {"tool": "trtllm-kivi bench", "mode": mode, "machine": _machine(),
              "model": portable_path(args.engine or args.model), "dtype": args.dtype,
              "dataset": {"path": portable_path(args.dataset), **ds},
              "settings": {"repeats": args.repeats, "max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
                           "prefill_chunk": args.prefill_chunk, "warmup": args.warmup,
                           "concurrency": getattr(args, "concurrency", None),
                           "streaming": getattr(args, "streaming", True), "kv_memory_gb": args.kv_memory_gb,
                           "sampling": "greedy, EOS ignored (exactly output_tokens per request)"},
              "runs": runs}
    print(summary_table(report))
    _write_report(report, args.report_json)
    return 0


def _bench_endpoint(args: argparse.Namespace) -> int:
    """latency / throughput against --openai-url: the same dataset, metric names and repeats as a runner's."""
    from ..bench import portable_path
    from ..bench.dataset import read_dataset, summary
    from ..bench.endpoint import Endpoint, EndpointError, accepts_ignore_eos, run_endpoint_workload, served_models
    from ..bench.metrics import format_statistics

    given = [f for f in ("kv", "kv_config") if getattr(args, f, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} configures an in-process runner; with --openai-url the "
                         "server's own KV cache applies")
    ep = Endpoint.parse(args.openai_url)
    reqs = read_dataset(args.dataset, None, num_requests=args.num_requests or None)
    mode = args._mode
    try:
        model = args.openai_model or served_models(ep)[0]
        ignore_eos = accepts_ignore_eos(ep, model, reqs[0])
        if not ignore_eos:
            print(f"{ep.url} refuses ignore_eos: requests may stop at EOS; output tokens are the server's usage",
                  flush=True)
        reps = []
        for rep in range(args.repeats):
            print(f"=== {mode} [{rep + 1}/{args.repeats}]: {ep.url}, model {model}", flush=True)
            res = run_endpoint_workload(ep, model, reqs, mode, getattr(args, "concurrency", None),
                                        args.warmup if rep == 0 else 0, ignore_eos)
            reps.append(res)
            print(format_statistics(res.statistics))
    except EndpointError as e:
        raise ValueError(str(e)) from None
    order = sorted(range(len(reps)), key=lambda j: reps[j].statistics["performance"]["request_throughput_req_s"])
    res = reps[order[(len(order) - 1) // 2]]
    run = {"endpoint": ep.url, "model": model, **res.statistics,
           "output_tokens": {"total": sum(res.completion_tokens.values()), "source": res.output_tokens_source,
                             "requests_at_max_tokens": res.requests_at_max_tokens, "of": len(reqs)},
           "repeats": [_headline(r.statistics) for r in reps]}
    run["medians"] = {k: statistics.median(h[k] for h in run["repeats"]) for k in run["repeats"][0]}
    sampling = ("temperature 0, ignore_eos (exactly output_tokens per request)" if ignore_eos else
                "temperature 0; the server refuses ignore_eos: requests may stop at EOS, output tokens from usage")
    report = {"tool": "trtllm-kivi bench", "mode": mode, "machine": _machine(), "endpoint": ep.url, "model": model,
              "dataset": {"path": portable_path(args.dataset), **summary(reqs)},
              "settings": {"repeats": args.repeats, "warmup": args.warmup,
                           "concurrency": 1 if mode == "latency" else getattr(args, "concurrency", None),
                           "streaming": True, "sampling": sampling, "ignore_eos": ignore_eos},
              "runs": [run]}
    med, out = run["medians"], run["output_tokens"]
    print(f"--- {ep.url} ({model}), median of {len(reps)} repeat(s): {med['request_throughput_req_s']:.3f} req/s, "
          f"{med['system_output_throughput_tok_s']:.2f} output tok/s, TTFT {med['avg_ttft_ms']:.0f} ms, "
          f"TPOT {med['avg_tpot_ms']:.1f} ms; {out['total']} output tokens ({out['source']}), "
          f"{out['requests_at_max_tokens']}/{out['of']} requests ran to output_tokens")
    _write_report(report, args.report_json)
    return 0


def _write_report(report: dict, path_: str | None) -> None:
    if not path_:
        return
    path = Path(path_)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


def _headline(stats: dict) -> dict:
    p, s = stats["performance"], stats.get("streaming_metrics", {})
    h = {"request_throughput_req_s": p["request_throughput_req_s"],
         "system_output_throughput_tok_s": p["system_output_throughput_tok_s"],
         "avg_request_latency_ms": p["avg_request_latency_ms"]}
    if s:
        h |= {"avg_ttft_ms": s["avg_ttft_ms"], "avg_tpot_ms": s["avg_tpot_ms"]}
    return h


def _print_memory(mem: dict) -> None:
    b = mem["budget"]
    ratio = mem["fp16_over_allocated"]
    print(f"KV cache allocated: {mem['kv_cache_bytes_allocated']} bytes; FP16 cache of the same shapes: "
          f"{mem['fp16_kv_cache_bytes_same_shapes']} bytes ({ratio:.2f}x)")
    print(f"Max concurrent sequences of {b['sequence_length']} tokens in {b['kv_memory_gb']} GB: " +
          ", ".join(f"{k.upper()} {v}" for k, v in b["max_concurrent_sequences"].items()) +
          f" (KIVI k{b['kivi_config']['k_bits']}v{b['kivi_config']['v_bits']}, "
          f"G={b['kivi_config']['group_size']}, R={b['kivi_config']['residual_length']})")


def summary_table(report: dict) -> str:
    """One row per KV spec: medians over the repeats of the headline numbers, and the memory figures (markdown)."""
    rows = ["| KV cache | req/s | output tok/s | avg latency (ms) | TTFT (ms) | TPOT (ms) | KV bytes allocated "
            "| FP16 same shapes | max seqs in budget (FP16 / FP8 / KIVI) | outputs = baseline |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in report["runs"]:
        med, m = r["medians"], r["memory"]
        c = m["budget"]["max_concurrent_sequences"]
        same = r.get("outputs_identical_to_baseline")
        same = "baseline" if same is None else f"{same['requests']}/{same['of']}"
        rows.append(f"| {r['kv']} | {med['request_throughput_req_s']:.3f} "
                    f"| {med['system_output_throughput_tok_s']:.2f} | {med['avg_request_latency_ms']:.0f} "
                    f"| {med.get('avg_ttft_ms', nan):.0f} | {med.get('avg_tpot_ms', nan):.1f} "
                    f"| {m['kv_cache_bytes_allocated']} | {m['fp16_kv_cache_bytes_same_shapes']} "
                    f"| {c['fp16']} / {c['fp8']} / {c['kivi']} | {same} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "prepare-dataset":
        return _prepare(args)
    return _bench(args)
