"""Long-context retrieval table of a model (eval/retrieval.py): passkey at 4K-32K and multi-key KV retrieval at 8K /
16K, depths 0.1-0.9, per seed, in the serving setting (one full-precision prefill per cell serves every cache
configuration, which then decode the answer together) and, at the lengths of --decode-lengths, in the stricter
decode mode (the prompt prefilled through each quantized cache).

Cells run seed by seed (the first seed is the one looked at while choosing recipes, the next ones are held out),
shortest first; every (mode, cell, configuration) is cached in a JSON-lines resume cache and every shared stream's
K/V is kept next to it (`<cache>.<stream>.pt`), so a killed run resumes where it stopped. The table is written from
whatever the cache holds (--report-only: no computation), with the counts, so a partial run reports exactly what ran.

    TRTLLM_KIVI_HOME=... PYTHONPATH=. nice -n 19 python benchmarks/retrieval_model.py --model qwen2.5-coder-1.5b \\
        --kv fp16,kivi4,k4v2,kivi2,kivi2+sink4 --seeds 1,2 --cache CACHE.jsonl \\
        --out benchmarks/results/retrieval_qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtllm_kivi.bench import machine_info, portable_path  # noqa: E402
from trtllm_kivi.eval import retrieval as rt  # noqa: E402
from trtllm_kivi.eval.recipes import ResultCache, bits_per_element  # noqa: E402
from trtllm_kivi.models import load_model, resolve_model  # noqa: E402
from trtllm_kivi.models.loaders import load_metadata  # noqa: E402
from trtllm_kivi.runtime.kvspec import parse_kv  # noqa: E402

# KIVI's published GQA figure (arXiv 2402.02750, LongBench PassageRetrieval, Mistral-7B, 8 KV heads): FP16 89.3,
# KIVI-2 80.8; the authors recommend 4 bits for GQA models.
PUBLISHED = {"model": "Mistral-7B (GQA 4:1)", "task": "LongBench PassageRetrieval", "fp16": 89.3, "kivi2": 80.8}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv", default="fp16,kivi4,k4v2,kivi2", help="cache configurations (the first is the "
                    "reference)")
    ap.add_argument("--passkey-lengths", default="4096,8192,16384,32768")
    ap.add_argument("--kv-lengths", default="8192,16384", help="multi-key retrieval lengths")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--decode-lengths", default="4096", help="passkey lengths also scored in decode mode")
    ap.add_argument("--decode-kv", default="", help="configurations scored in decode mode (default: --kv but "
                    "the reference, which decode mode does not change)")
    ap.add_argument("--max-length", type=int, default=0, help="skip cells longer than this (0: none)")
    ap.add_argument("--backend", default=None, help="KIVI attention backend (default: the fastest, cpu)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", required=True, help="resume cache (JSON lines; the streams' K/V go next to it)")
    ap.add_argument("--out", required=True, help="output stem: STEM.json and STEM.md")
    ap.add_argument("--report-only", action="store_true", help="write the table from the cache, compute nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    if args.report_only:  # metadata only: the report needs the tokenizer (prompts) and the geometry
        model = None
        tok, cfg = load_metadata(args.model)
    else:
        model, tok, cfg = load_model(args.model, args.dtype)
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    depths = [float(x) for x in args.depths.split(",")]
    seeds = _ints(args.seeds)
    geom = cfg.geometry
    specs = {n: parse_kv(n, num_layers=geom.num_layers) for n in args.kv.split(",") if n}
    reference = next(iter(specs))
    dec_names = [n for n in (args.decode_kv.split(",") if args.decode_kv else list(specs)[1:]) if n]
    dec_specs = {n: parse_kv(n, num_layers=geom.num_layers) for n in dec_names}
    pk, pk_streams = rt.passkey_cells(encode, _ints(args.passkey_lengths), depths, seeds)
    kvc, kv_streams = rt.kv_cells(encode, _ints(args.kv_lengths), depths, seeds) if args.kv_lengths else ([], {})
    streams = pk_streams | kv_streams
    cells = [c for c in pk + kvc if not args.max_length or c.length <= args.max_length]
    order = sorted(cells, key=lambda c: (seeds.index(c.seed), c.length, c.task, c.shared))
    fingerprint = {"model": portable_path(resolve_model(args.model)), "dtype": args.dtype, "prompts": "v3",
                   "backend": args.backend}
    cache = ResultCache(args.cache, fingerprint)
    stream_file = lambda sid: Path(f"{args.cache}.{sid}.pt")  # noqa: E731
    capacity = max(len(c.prompt) for c in cells) + 1
    pre = None if args.report_only else rt.PrefixPrefill(model, capacity)
    log(f"{len(cells)} cells x {len(specs)} configurations (serving) + decode mode at {args.decode_lengths} "
        f"for {', '.join(dec_specs)}; {len(cache.rows)} cached")

    def key(mode: str, c: rt.Cell, name: str) -> str:
        return f"{mode}|{c.key}|{name}"

    def run_serving(c: rt.Cell) -> None:
        assert pre is not None
        missing = {n: s for n, s in specs.items() if cache.get(key("serving", c, n)) is None}
        if not missing:
            return
        t0 = time.time()
        if pre.stream_id != c.stream:
            if pre.stream_id is not None:
                pre.save_stream(stream_file(pre.stream_id))
            if pre.load_stream(stream_file(c.stream), c.stream):
                log(f"stream {c.stream}: {pre.prefilled} tokens loaded")
        before = pre.prefilled
        kv = pre.kv(c, streams[c.stream])
        if pre.prefilled >= before + 4096:
            pre.save_stream(stream_file(c.stream))
        t1 = time.time()
        rows = rt.serving_scores(model, missing, kv, c, args.backend)
        for n, r in rows.items():
            cache.put(key("serving", c, n), {"mode": "serving", "task": c.task, "length": c.length, "depth": c.depth,
                                             "seed": c.seed, "kv": n, "tokens": len(c.prompt), "target": c.target}
                      | r)
        log(f"serving {c.key}: {sum(r['passed'] for r in rows.values())}/{len(rows)} pass; prefill "
            f"{t1 - t0:.0f} s (stream at {pre.prefilled}), decode {time.time() - t1:.0f} s")

    def run_decode(c: rt.Cell) -> None:
        for n, s in dec_specs.items():
            if cache.get(key("decode", c, n)) is None:
                t0 = time.time()
                r = rt.decode_scores(model, s, c, backend=args.backend)
                cache.put(key("decode", c, n), {"mode": "decode", "task": c.task, "length": c.length,
                                                "depth": c.depth, "seed": c.seed, "kv": n, "tokens": len(c.prompt),
                                                "target": c.target} | r)
                log(f"decode {c.key} {n}: {'pass' if r['passed'] else 'fail'} ({time.time() - t0:.0f} s)")

    if not args.report_only:
        dec_lengths = set(_ints(args.decode_lengths))
        for seed in seeds:
            for c in (c for c in order if c.seed == seed):
                run_serving(c)
            for c in (c for c in order if c.seed == seed and c.task == "passkey" and c.length in dec_lengths):
                run_decode(c)
        if pre is not None and pre.stream_id is not None:
            pre.save_stream(stream_file(pre.stream_id))
    report = build_report(cache, cells, specs, dec_specs, reference, seeds, geom)
    report |= {"model": {"name": cfg.name, "source": portable_path(resolve_model(args.model)), "dtype": args.dtype,
                         "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
                         "head_dim": cfg.head_dim},
               "kv": {n: s.describe() for n, s in (specs | dec_specs).items()}, "published": PUBLISHED,
               "machine": machine_info(threads=torch.get_num_threads()),
               "command": "python benchmarks/retrieval_model.py " + " ".join(
                   Path(a).name if a.startswith("/") else a for a in sys.argv[1:]
                   if not a.startswith(("--cache", "--report-only")) and a != args.cache)}  # no machine paths
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


def build_report(cache: ResultCache, cells: list[rt.Cell], specs: dict, dec_specs: dict, reference: str,
                 seeds: list[int], geom) -> dict:
    """Per (mode, task, length, seed, configuration): passes / cells from whatever the cache holds."""
    groups: dict[str, dict] = {}
    for mode, names in (("serving", list(specs)), ("decode", list(dec_specs))):
        for c in cells:
            for n in names:
                row = cache.get(f"{mode}|{c.key}|{n}")
                if row is None:
                    continue
                g = groups.setdefault(f"{mode}|{c.task}|{c.length}|{c.seed}|{n}", {
                    "mode": mode, "task": c.task, "length": c.length, "seed": c.seed, "kv": n, "rows": []})
                g["rows"].append(row)
    table = []
    for g in groups.values():
        s = rt.summarize_cells(g.pop("rows"))
        table.append(g | s)
    bits = {n: round(bits_per_element(s.kivi, geom, 8192), 3) for n, s in (specs | dec_specs).items()}
    return {"reference": reference, "seeds": seeds, "held_out_seeds": seeds[1:], "bits_per_element_8k": bits,
            "table": table, "cells_planned": len(cells)}


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(rep: dict) -> str:
    names = list(rep["bits_per_element_8k"])
    lines = [f"Retrieval on {rep['model']['name']} ({rep['model']['dtype']}): pass = every answer token is the "
             f"argmax; passes/cells per (task, length) and seed (seed {rep['seeds'][0]} looked at while choosing "
             f"recipes; {', '.join(map(str, rep['held_out_seeds'])) or 'none'} held out). Published KIVI GQA figure: "
             f"{rep['published']['model']}, {rep['published']['task']}: FP16 {rep['published']['fp16']}, KIVI-2 "
             f"{rep['published']['kivi2']}.", ""]
    for mode in ("serving", "decode"):
        rows = [r for r in rep["table"] if r["mode"] == mode]
        if not rows:
            continue
        cols = sorted({(r["task"], r["length"], r["seed"]) for r in rows})
        lines += [f"**{mode} mode**", "",
                  "| KV | bits/elem @8K | " + " | ".join(f"{t} {_k(n)} s{s}" for t, n, s in cols) + " |",
                  "|---|---:|" + "---:|" * len(cols)]
        for n in names:
            cells = {(r["task"], r["length"], r["seed"]): r for r in rows if r["kv"] == n}
            if not cells:
                continue
            vals = [f"{cells[k]['passed']}/{cells[k]['cells']}" if k in cells else "—" for k in cols]
            lines.append(f"| {n} | {rep['bits_per_element_8k'][n]:.2f} | " + " | ".join(vals) + " |")
        lines.append("")
        fails = [f"{r['kv']} {r['task']}: {', '.join(r['failed'])}" for r in rows if r["failed"]]
        if fails:
            lines += ["Failed cells (length/depth/seed: first failing answer position: its rank):", ""]
            lines += [f"- {f}" for f in fails] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
