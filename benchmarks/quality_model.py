"""The quality table of a model: decode-mode perplexity, KL and top-1 vs the FP16 cache over segments with paired
bootstrap CIs (eval/recipes.py's statistics), for the paper's KIVI levels, sinks, rotation, and what the recipe
search (`trtllm-kivi eval --recommend`, eval/recommend.py) chooses within a budget, on the Shakespeare corpus
(eval/corpus.py) or a code corpus (eval/code_corpus.py).

Scoring is eval/quality.py's protocol (prefix prefilled, then 32-token chunks cut at every configuration's flush
points, so each chunk is exact decode-mode for every cache; teacher forcing; the FP16 cache is the reference), with
all segments of a pass run as one ragged batch (one weight read per chunk for every segment: a 1.5B model on a CPU is
bound by that). A pass holds configurations with the same sink count, and its chunk plan is cut at their flush
points only (a plan cut at sinks 0 and 4 together has 119 chunks instead of 60: twice the weight reads), so each
chunk is exact decode mode for every configuration of the pass; the FP16 reference runs in every pass (KL and top-1
are against the same pass's logits; its per-segment NLL is kept from the first pass, and another plan's chunk shapes
change it only by fp32 summation order). Per-segment results go into a JSON-lines resume cache in the same units as
`eval --recipes` (`seg|<kv>|<segment>`), so the search then finds its candidates measured and only chooses (its
criterion too is computed once, from one calibration prefill of segment 0).

    TRTLLM_KIVI_HOME=... PYTHONPATH=. nice -n 19 python benchmarks/quality_model.py --model qwen2.5-coder-1.5b \\
        --corpus shakespeare --segments 6 --cache CACHE.jsonl \\
        --out benchmarks/results/quality_qwen2.5-coder-1.5b_shakespeare
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtllm_kivi.bench import machine_info, portable_path  # noqa: E402
from trtllm_kivi.eval.metrics import kl_from_log_probs, log_probs, nll_from_log_probs  # noqa: E402
from trtllm_kivi.eval.quality import QualitySetup  # noqa: E402
from trtllm_kivi.eval.recipes import ResultCache, recipe_markdown, recipe_table  # noqa: E402
from trtllm_kivi.eval.recommend import Budget, candidates, layer_errors, recommend, record_qkv  # noqa: E402
from trtllm_kivi.eval.scoring import chunk_plan  # noqa: E402
from trtllm_kivi.eval.suite import make_runner  # noqa: E402
from trtllm_kivi.models import load_model, resolve_model  # noqa: E402
from trtllm_kivi.runtime.kvspec import KVSpec, parse_kv  # noqa: E402

TABLE = "fp16,kivi4,k4v2,kivi2,kivi2+sink4,kivi2+sink4+had,k4v2+sink4+had"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def text_of(corpus: str) -> tuple[str, dict]:
    if corpus == "shakespeare":
        from trtllm_kivi.eval import corpus as c

        return c.load_corpus(), c.describe()
    from trtllm_kivi.eval import code_corpus as cc

    cc.fetch_sdist()
    return cc.load_code_corpus(), cc.describe()


def score_pass(model, specs: dict[str, KVSpec], ids: list[int], setup: QualitySetup, cache: ResultCache,
               names: list[str], reference: str, backend: str | None) -> None:
    """One pass: the reference and `names` on every segment as one ragged batch, in lockstep per chunk; each
    configuration's per-segment nll / kl / top-1 written to the cache as `eval --recipes` writes them."""
    n_seg, p0, end = setup.segments, setup.prefix, setup.segment_len - 1
    cfgs = [c for c in (specs[n].kivi for n in names) if c is not None]
    plan = chunk_plan(p0, end, cfgs, setup.max_chunk)
    segs = [ids[setup.offset + i * setup.segment_len:setup.offset + (i + 1) * setup.segment_len] for i in range(n_seg)]
    order = [reference, *names]
    runners = {n: make_runner(model, specs[n], n_seg, setup.segment_len, backend) for n in order}
    slots = {n: [runners[n].add_sequence() for _ in segs] for n in order}
    f64 = torch.float64
    acc = {n: {"nll": torch.zeros(n_seg, dtype=f64), "kl": torch.zeros(n_seg, dtype=f64),
               "top1": torch.zeros(n_seg, dtype=f64)} for n in order}
    for n in order:
        runners[n].step(slots[n], [s[:p0] for s in segs])
    t0 = time.time()
    for j, (s, e) in enumerate(plan):
        c = e - s
        chunk = [seg[s:e] for seg in segs]
        targets = torch.tensor([seg[s + 1:e + 1] for seg in segs]).reshape(-1)
        ref = runners[reference].step(slots[reference], chunk, all_logits=True)
        ref_lp, ref_top = log_probs(ref), ref.argmax(-1)
        acc[reference]["nll"] += nll_from_log_probs(ref_lp, targets).view(n_seg, c).sum(1)
        for n in names:
            out = runners[n].step(slots[n], chunk, all_logits=True)
            lp = log_probs(out)
            acc[n]["nll"] += nll_from_log_probs(lp, targets).view(n_seg, c).sum(1)
            acc[n]["kl"] += kl_from_log_probs(ref_lp, lp).view(n_seg, c).sum(1)
            acc[n]["top1"] += (out.argmax(-1) == ref_top).view(n_seg, c).double().sum(1)
        if j % 10 == 0:
            log(f"  chunk {j + 1}/{len(plan)} ({time.time() - t0:.0f} s)")
    scored = setup.scored_per_segment
    for n in order:
        for i in range(n_seg):
            key = f"seg|{n}|{i}"
            if cache.get(key) is None:
                a = acc[n]
                cache.put(key, {"kind": "seg", "kv": n, "segment": i, "nll": float(a["nll"][i]) / scored,
                                "tokens": scored, "kl": float(a["kl"][i]) / scored if n != reference else 0.0,
                                "top1": float(a["top1"][i]) / scored if n != reference else 1.0})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--corpus", choices=("shakespeare", "code"), default="shakespeare")
    ap.add_argument("--segments", type=int, default=6)
    ap.add_argument("--segment-len", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--kv", default=TABLE, help=f"table configurations (default {TABLE}); passes run in this "
                    "order, each search level's candidates right after the level's plain KIVI")
    ap.add_argument("--levels", default="kivi2,k4v2", help="recipe search levels (2-bit values: kivi2,k4v2)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--margin", type=float, default=0.1)
    ap.add_argument("--max-ppl-increase", type=float, default=5.0, help="search budget, percent")
    ap.add_argument("--max-kl", type=float, default=0.05)
    ap.add_argument("--bit-tolerance", type=float, default=0.05)
    ap.add_argument("--per-pass", type=int, default=3, help="configurations per pass besides the reference")
    ap.add_argument("--backend", default="memo", help="KIVI attention backend while scoring (memo: the reference's "
                    "bits)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", required=True, help="resume cache (JSON lines; not a result: keep it out of "
                    "benchmarks/results)")
    ap.add_argument("--out", required=True, help="output stem: writes STEM.json and STEM.md")
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    model, tok, cfg = load_model(args.model, args.dtype)
    log(f"loaded {cfg.name} ({args.dtype}) in {time.time() - t_start:.0f} s")
    text, text_info = text_of(args.corpus)
    ids = tok.encode(text, add_special_tokens=False)
    setup = QualitySetup(args.segments, args.segment_len, args.prefix, 32, 0, args.segments)
    if len(ids) < setup.tokens_needed:
        raise SystemExit(f"the corpus has {len(ids)} tokens; {setup.tokens_needed} needed")
    fingerprint = {"model": portable_path(resolve_model(args.model)), "dtype": args.dtype, "text": text_info,
                   "segment_len": setup.segment_len, "prefix": setup.prefix, "offset": 0,
                   "plan": "per pass: its configurations' flush points", "backend": args.backend}
    cache = ResultCache(args.cache, fingerprint)
    geom = cfg.geometry
    table_names = [n for n in args.kv.split(",") if n]
    levels = [lv for lv in args.levels.split(",") if lv]
    calib = ids[:setup.segment_len]
    seen = record_qkv(model, calib)
    criteria, found = {}, {}
    for lv in levels:
        base = parse_kv(lv).kivi
        assert base is not None
        criteria[lv] = layer_errors(model, calib, replace(base, sink_tokens=args.sinks), seen=seen)
        found[lv] = candidates(lv, criteria[lv], args.sinks, args.margin)
    specs: dict[str, KVSpec] = {}
    for n in table_names + [lv for lv in levels if lv not in table_names]:
        specs.setdefault(n, parse_kv(n, num_layers=geom.num_layers))
        for c, spec in found.get(n, {}).items():
            specs.setdefault(c, spec)
    del seen
    log(f"criterion done; configurations: {', '.join(specs)}")
    missing = [n for n in specs if n != "fp16" and any(cache.get(f"seg|{n}|{i}") is None
                                                        for i in range(setup.segments))]

    def flush(n: str) -> tuple[int, int]:
        c = specs[n].kivi
        return (0, 0) if c is None else (c.sink_tokens + c.residual_length, c.group_size)

    passes: list[list[str]] = []
    for n in missing:  # in order; a pass takes configurations of one flush schedule, at most --per-pass of them
        fit = [p for p in passes if flush(p[0]) == flush(n) and len(p) < args.per_pass]
        if fit:
            fit[0].append(n)
        else:
            passes.append([n])
    for names in passes:
        t0 = time.time()
        log(f"pass: fp16 + {', '.join(names)}")
        score_pass(model, specs, ids, setup, cache, names, "fp16", args.backend)
        log(f"pass done in {time.time() - t0:.0f} s")
    budget = Budget(args.max_ppl_increase, args.max_kl)
    res = recommend(model, ids, setup, cache, budget, levels, args.sinks, args.margin, resamples=args.bootstrap,
                    log=log, bit_tolerance=args.bit_tolerance, criteria=criteria)
    segs = {n: [cache.get(f"seg|{n}|{i}") for i in range(setup.segments)] for n in specs}
    table = recipe_table(specs, segs, geom, "fp16", setup, None, args.bootstrap)
    table |= {"model": {"name": cfg.name, "source": portable_path(resolve_model(args.model)), "dtype": args.dtype,
                        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
                        "head_dim": cfg.head_dim, "max_seq_len": cfg.max_seq_len},
              "corpus": text_info | {"tokens": len(ids)}, "kv": {n: s.describe() for n, s in specs.items()},
              "recommend": {"budget": {"max_ppl_increase_pct": args.max_ppl_increase, "max_kl": args.max_kl},
                            "levels": levels, "sinks": args.sinks, "margin": args.margin,
                            "bit_tolerance": args.bit_tolerance, "chosen": res["chosen"], "why": res["why"],
                            "rejected": res["rejected"], "scale_dtype": res["scale_dtype"],
                            "criterion": {lv: vars(e) for lv, e in criteria.items()}},
              "backend": args.backend, "machine": machine_info(threads=torch.get_num_threads()),
              "command": "python benchmarks/quality_model.py " + " ".join(
                  Path(a).name if a.startswith("/") else a for a in sys.argv[1:]
                  if not a.startswith("--cache") and a != args.cache)}  # no machine paths in results
    title = (f"{cfg.name} ({Path(str(resolve_model(args.model))).name} dequantized to {args.dtype}; {geom.num_layers} layers, "
             f"{cfg.n_heads} query / {cfg.n_kv_heads} KV heads, head_dim {cfg.head_dim}), {setup.segments} segments "
             f"x {setup.segment_len} tokens of {text_info.get('text')} ({text_info.get('package', '')}), first "
             f"{setup.prefix} prefilled, decode-mode scoring; CIs: paired bootstrap over segments ({args.bootstrap} "
             f"resamples); bits/element include scales/zeros, sinks and the fp16 window. Recipe search within "
             f"+{args.max_ppl_increase}% / KL {args.max_kl} at levels {', '.join(levels)}: "
             f"**{res['chosen']}** ({res['why']}).")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(table, indent=1) + "\n")  # (the stem has dots: no with_suffix)
    Path(f"{out}.md").write_text(recipe_markdown(table, title))
    print(recipe_markdown(table, title))
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
