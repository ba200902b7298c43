"""Passkey study of the 2-bit recipes: does a 2-bit-value recipe with G = 32, R = 128 and <= 3.3 bits/element at 8K
pass passkey at >= 0.93 of the cells (the project's target for such a recipe)?

Every recipe runs the same cells: lengths x depths x seeds (a seed draws the keys of one (length, depth) grid, as
`trtllm-kivi eval --passkey-seed`), scored exactly as `trtllm-kivi eval --tasks passkey` (eval/passkey.py: prefill
in chunks of 512, question as one chunk, answer teacher-forced; passed = every answer token is the argmax). Recipes
over the bit budget at 8K (format.kivi_total_bytes, eval/recipes.bits_per_element) are refused before any work.
Cells are cached per (recipe, length, depth, seed) in <out>.cache.jsonl, so a rerun resumes (a local file: the
cache is not a result and is not committed).

    PYTHONPATH=$PWD nice -n 19 python benchmarks/passkey_2bit_study.py --kv fp16,kivi2,kivi2+sink4+had \\
        --lengths 2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 --seeds 0 --out benchmarks/results/passkey_2bit_study
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trtllm_kivi.bench import machine_info, portable_path
from trtllm_kivi.eval.passkey import run_passkey
from trtllm_kivi.eval.recipes import CONTEXTS, ResultCache, bits_per_element
from trtllm_kivi.eval.suite import make_runner, passkey_prompts
from trtllm_kivi.models import load_model, resolve_model
from trtllm_kivi.runtime.kvspec import parse_kv

MAX_BITS_8K = 3.3  # the bit budget of a 2-bit recipe at 8K (plain KIVI-2 is 3.26)


def _list(s: str, typ=str) -> list:
    return [typ(x) for x in s.split(",") if x.strip()]


def summarize_cells(cells: list[dict]) -> dict:
    """Cells passed, mean answer log-prob and the ranks of the answer tokens that were not the argmax."""
    fails = [c for c in cells if not c["passed"]]
    return {"cells": len(cells), "passed": len(cells) - len(fails),
            "pass_rate": (len(cells) - len(fails)) / len(cells) if cells else None,
            "mean_answer_logprob": sum(c["answer_logprob"] for c in cells) / len(cells) if cells else None,
            "failing_token_ranks": sorted(r for c in fails for r in c["ranks"] if r > 0),
            # (answer position, rank) of every token that was not the argmax; position 0 is the lone space before
            # the digits (the tokenizer splits " 60494" into " ", "6", "0", ...)
            "failing_tokens": [[j, r] for c in fails for j, r in enumerate(c["ranks"]) if r > 0],
            "digits_pass_rate": sum(all(r == 0 for r in c["ranks"][1:]) for c in cells) / len(cells) if cells else None,
            "failed_cells": [[c["length"], c["depth"], c["seed"]] for c in fails]}


def markdown(res: dict) -> str:
    ref = res["summary"][res["reference"]]
    lines = [f"Passkey cells: lengths {res['lengths']} x depths {res['depths']} x seeds {res['seeds']} = "
             f"{ref['cells']} cells (the same prompts for every recipe); the reference ({res['reference']}) passes "
             f"{ref['passed']}/{ref['cells']}. Pass = every answer token is the argmax (teacher-forced; greedy "
             "decoding would print exactly the key). Target: >= 0.93 of the cells at <= 3.3 bits/element at 8K. "
             "A recipe with fewer cells than the reference was screened only on the cells another recipe failed "
             "(listed). Failing tokens: (answer position: rank), position 0 is the lone space before the digits.",
             "", "| KV recipe | bits/elem @8K | cells passed | pass rate | digits-only pass rate | "
             "mean answer log-prob (nats) | failing tokens (position: rank) | failed cells (length/depth/seed) |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, s in res["summary"].items():
        b = res["bits_per_element"][name]["8192"]
        toks = ", ".join(f"{j}: {r}" for j, r in s["failing_tokens"]) or "—"
        failed = ", ".join(f"{n}/{d}/{sd}" for n, d, sd in s["failed_cells"]) or "—"
        lines.append(f"| {name} | {b:.2f} | {s['passed']}/{s['cells']} | {s['pass_rate']:.2f} | "
                     f"{s['digits_pass_rate']:.2f} | {s['mean_answer_logprob']:.3f} | {toks} | {failed} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv", required=True, help="comma-separated --kv recipes; the first is the reference")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int)
    p.add_argument("--out", required=True, help="path stem: <out>.json, <out>.md, <out>.cache.jsonl")
    p.add_argument("--cells", help="run only these cells, LENGTH:DEPTH:SEED joined by commas (e.g. the cells "
                   "another recipe failed: a screening); prompts are still drawn from the full grid")
    p.add_argument("--cached-only", action="store_true", help="write the report from the cache only")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = _list(args.kv)
    lengths, depths, seeds = _list(args.lengths, int), _list(args.depths, float), _list(args.seeds, int)
    specs = {n: parse_kv(n) for n in names}
    model, tok, cfg = load_model(args.model, "float32")
    bits = {n: {str(t): round(bits_per_element(s.kivi, cfg.geometry, t), 4) for t in CONTEXTS}
            for n, s in specs.items()}
    for n, s in specs.items():
        if s.kivi is not None and bits[n]["8192"] > MAX_BITS_8K:
            raise ValueError(f"--kv {n}: {bits[n]['8192']:.3f} bits/element at 8K exceeds the budget {MAX_BITS_8K}")
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = {seed: passkey_prompts(encode, lengths, depths, seed) for seed in seeds}
    out = Path(args.out)
    cache = ResultCache(out.with_name(out.name + ".cache.jsonl"),
                        {"model": portable_path(resolve_model(args.model)), "dtype": "float32", "prefill_chunk": 512,
                         "backend": "memo"})
    only = None if not args.cells else {(int(a), float(b), int(c)) for a, b, c in
                                        (x.split(":") for x in _list(args.cells))}
    longest = max(q.num_tokens for ps in prompts.values() for q in ps.values())
    results: dict[str, list[dict]] = {}
    for n in names:
        runner, cells = None, []
        for seed in seeds:
            for length in lengths:
                for depth in depths:
                    key = f"pk|{n}|{length}|{depth}|{seed}"
                    if only is not None and (length, depth, seed) not in only:
                        continue
                    if cache.get(key) is None and not args.cached_only:
                        runner = runner or make_runner(model, specs[n], 1, longest, "memo")
                        t0 = time.time()
                        q = prompts[seed][(length, depth)]
                        r = run_passkey(runner, q)
                        cache.put(key, {"kv": n, "length": length, "depth": depth, "seed": seed, "key_digits": q.key,
                                        "tokens": q.num_tokens, "seconds": round(time.time() - t0, 1)} | r.to_dict())
                        print(f"[{time.strftime('%H:%M:%S')}] {n} length {length} depth {depth} seed {seed}: "
                              f"{'pass' if r.passed else 'fail'} ranks {r.ranks} ({time.time() - t0:.0f} s)",
                              file=sys.stderr, flush=True)
                    if cache.get(key) is not None:
                        cells.append(cache.get(key))
        results[n] = cells
        del runner
    res = {"reference": names[0], "lengths": lengths, "depths": depths, "seeds": seeds,
           "max_bits_per_element_8192": MAX_BITS_8K, "bits_per_element": bits,
           "summary": {n: summarize_cells(c) for n, c in results.items() if c},
           "cells": {n: [{k: v for k, v in c.items() if k not in ("fingerprint", "key")} for c in cs]
                     for n, cs in results.items()},
           "model": {"name": cfg.name, "source": portable_path(resolve_model(args.model)), "dtype": "float32"},
           "machine": machine_info(threads=torch.get_num_threads())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_name(out.name + ".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
