"""KIVI CUDA decode benchmark: every decode variant against the measured read roofline and FP16 baselines, in one run.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--out FILE] [--time-budget S] [--headline] [--quick]
                                                     [--variants all|default|ID,ID] [--l2 cold|warm]
    python3 benchmarks/bench_kernels.py --dry-run [--gpu h100|h200] [--variants-json FILE]   (no GPU, no torch)

Measured on the same GPU in the same process (CUDA events around CUDA-graph replays, warmup, medians; L2-cold:
each replay cycles through enough buffer sets to read more than twice the L2, as a model's 32 layers do; --l2 warm
replays one set and labels every entry so):
  - read_ceiling: the read-only streaming kernel (kiviStreamRead.cu: 16-byte loads, a reduction, one store per CTA)
    over a 2 GiB buffer, best of 4 and 8 CTAs per SM: the roofline every kernel is reported against
    (fraction_of_read_ceiling); stream_read: the same kernel over each shape's exact KIVI and FP16 bytes
    (fraction_of_same_bytes_read: what a read-only kernel gets for that many bytes);
  - copy: device-to-device copy bandwidth (read + write), kept for continuity (not a ceiling);
  - per shape (Llama-3-8B H32/Hkv8/D128 and Llama-2-7B H32/Hkv32/D128, batch 1/8/32, context 4K/32K/128K; the
    headline shapes first) and per decode variant (kiviDecodeVariants.h; without the variant API the default only):
    attention (invokeKiviAttention: every launch of the attention phase) and the whole step (+ the append) at a
    flush step (past = context - 1 = R - 1 mod G: the append quantizes a group) and a non-flush step (past one less:
    the append writes one window row; 31 of 32 steps); the amortized step = (flush + (G - 1) non-flush) / G;
    bytes = what the attention must read (codes + scales/zeros of the n_q quantized tokens, the window rows, the new
    token's k/v, q) + out;
  - fp16_mma: the default kernel over an FP16 cache (residual_length = context: every key a window row);
  - sdpa_fp16: torch scaled_dot_product_attention (enable_gqa) of one query over an FP16 cache;
  - quantize: the append of a 32K-token prefill chunk.
The issue's targets are reported met/unmet ("targets", for the default and the best variant), never asserted.
Writes benchmarks/results/bench_kernels_<gpu>.json (or --out) and prints a summary table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import gpu_plan  # noqa: E402  (standard library only: the dry run needs no torch)

from trtllm_kivi.format import KiviConfig  # noqa: E402

PHASES = (("attention", 1), ("step", 3))  # _abi.PHASE_ATTENTION, PHASE_STEP


def select_variants(variants: list[dict], spec: str) -> list[dict]:
    """--variants: all, default (id 0 alone) or a comma list of ids."""
    if spec == "all":
        return variants
    if spec == "default":
        return [v for v in variants if v["id"] == 0]
    ids = {int(x) for x in spec.split(",") if x.strip()}
    unknown = ids - {v["id"] for v in variants}
    if unknown:
        raise ValueError(f"--variants {spec}: ids {sorted(unknown)} are not in the library's list "
                         f"{[v['id'] for v in variants]}")
    return [v for v in variants if v["id"] in ids]


def shapes_for(args) -> list[tuple[str, int, int]]:
    shapes = list(gpu_plan.HEADLINE)
    if not args.headline:
        batches = gpu_plan.BATCHES[:2] if args.quick else gpu_plan.BATCHES
        contexts = gpu_plan.CONTEXTS[:2] if args.quick else gpu_plan.CONTEXTS
        shapes += [(m, b, c) for m in gpu_plan.MODELS for b in batches for c in contexts if (m, b, c) not in shapes]
    return shapes


def measure_shape(lib, reader, cfg: KiviConfig, model: str, batch: int, ctx: int, variants: list[dict],
                  facts: dict, ceiling: float, l2: str, budget) -> dict:
    """One shape: stream reads of its bytes, every variant (attention and step, flush and non-flush), fp16_mma,
    SDPA; ratios."""
    import gpu_common as gc
    import kernel_timing as kt
    import torch

    h, hkv, d = gpu_plan.MODELS[model]
    fp, nfp = gpu_plan.flush_past(cfg, ctx), gpu_plan.nonflush_past(cfg, ctx)
    rb = {p: gpu_plan.kivi_decode_bytes(cfg, h, hkv, d, batch, p) for p in (fp, nfp)}
    kbytes = {p: r + w for p, (r, w) in rb.items()}
    copies = gpu_plan.rotation_copies(kbytes[fp], facts["l2_bytes"], l2)
    row: dict = {"model": model, "heads": h, "kv_heads": hkv, "head_dim": d, "batch": batch, "context": ctx,
                 "l2": l2, "flush_past": fp, "nonflush_past": nfp, "copies": {"kivi": copies}}
    same = reader.same_bytes(rb[fp][0], copies)
    row["stream_read"] = {"kivi_bytes": same}
    state = kt.KiviState(lib, cfg, h, hkv, d, batch, ctx, copies)
    entries, skipped = [], []
    for v in variants:
        if not budget.allows(1.0):
            skipped.append(v["name"])
            continue
        e: dict = {"id": v["id"], "name": v["name"]}
        for plabel, past in (("flush", fp), ("nonflush", nfp)):
            for name, phase in PHASES:
                fns, refused, plan = state.launchers(past, v["id"], phase)
                if refused:
                    e[f"{name}_{plabel}"] = {"refused": refused}
                    continue
                t = gc.time_launches(fns)
                e[f"{name}_{plabel}"] = gc.with_bandwidth(t, kbytes[past], ceiling, same["gbps"])
                if plabel == "flush" and name == "attention":
                    e["plan"] = plan
        e["error_flag"] = state.error_flag()
        step_f, step_n = e.get("step_flush", {}), e.get("step_nonflush", {})
        if "median_ms" in step_f and "median_ms" in step_n:
            g = cfg.group_size
            e["step_amortized_ms"] = (step_f["median_ms"] + (g - 1) * step_n["median_ms"]) / g
        entries.append(e)
    row["variants"], row["variants_skipped_for_time"] = entries, skipped
    row["auto_variant"] = state.auto_variant(fp, facts["sm_version"])
    del state
    torch.cuda.empty_cache()
    default = next((e for e in entries if e["id"] == 0), None)
    if default is not None:  # the fields earlier results and docs cite: the default at a flush step
        row["kivi_error_flag"] = default["error_flag"]
        row["plan"] = default.get("plan")
        for key, src in (("kivi_attention", "attention_flush"), ("kivi_step", "step_flush"),
                         ("kivi_attention_nonflush", "attention_nonflush"), ("kivi_step_nonflush", "step_nonflush")):
            row[key] = default.get(src, {})
        row["kivi_step_amortized_ms"] = default.get("step_amortized_ms")
    timed = [e for e in entries if "median_ms" in e.get("attention_flush", {})]
    if timed:
        best = min(timed, key=lambda e: e["attention_flush"]["median_ms"])
        row["best_variant"] = {"id": best["id"], "name": best["name"],
                               "attention_ms": best["attention_flush"]["median_ms"],
                               "step_amortized_ms": best.get("step_amortized_ms")}
    fb = gpu_plan.fp16_decode_bytes(hkv, d, batch, ctx)
    fcopies = gpu_plan.rotation_copies(fb, facts["l2_bytes"], l2)
    row["copies"]["fp16"] = fcopies
    if fb * fcopies > gpu_plan.MEMORY_FRACTION * torch.cuda.mem_get_info()[0]:
        row["fp16_skipped"] = f"an FP16 cache of {fb * fcopies / 2**30:.1f} GiB does not fit"
        return row
    row["stream_read"]["fp16_bytes"] = reader.same_bytes(fb, fcopies)
    row["fp16_mma"] = kt.fp16_mma(lib, h, hkv, d, batch, ctx, fcopies)
    torch.cuda.empty_cache()
    row["sdpa_fp16"] = gc.with_bandwidth(kt.sdpa_fp16(h, hkv, d, batch, ctx, fcopies), fb, ceiling,
                                         row["stream_read"]["fp16_bytes"]["gbps"])
    torch.cuda.empty_cache()
    ratios(row, ceiling)
    return row


def ratios(row: dict, ceiling: float) -> None:
    """Speedups against both FP16 baselines and fractions of the read ceiling (the keys earlier results use)."""
    att, sdpa, mma16 = row.get("kivi_attention", {}), row.get("sdpa_fp16", {}), row.get("fp16_mma", {})
    if "median_ms" not in att:
        return
    if "median_ms" in mma16:
        row["speedup_vs_fp16_mma"] = mma16["median_ms"] / att["median_ms"]
        row["fp16_mma_fraction_of_read_ceiling"] = mma16["gbps"] / ceiling
    if "median_ms" in sdpa:
        row["speedup_vs_sdpa_fp16"] = sdpa["median_ms"] / att["median_ms"]
        row["sdpa_fraction_of_read_ceiling"] = sdpa["gbps"] / ceiling
        if "median_ms" in row.get("kivi_step", {}):
            row["step_speedup_vs_sdpa_fp16"] = sdpa["median_ms"] / row["kivi_step"]["median_ms"]
        if row.get("kivi_step_amortized_ms"):
            row["amortized_step_speedup_vs_sdpa_fp16"] = sdpa["median_ms"] / row["kivi_step_amortized_ms"]
    row["kivi_fraction_of_read_ceiling"] = att["gbps"] / ceiling


def targets(rows: list[dict], ceiling: float) -> dict:
    """The issue's kernel targets, met/unmet (None: not measured), for the default and the best variant."""
    def pick(model: str, batch: int, ctx: int) -> dict | None:
        return next((r for r in rows if (r["model"], r["batch"], r["context"]) == (model, batch, ctx)), None)

    def entry(row: dict | None, which: str) -> dict:
        if row is None:
            return {}
        vid = 0 if which == "default" else (row.get("best_variant") or {}).get("id")
        return next((e for e in row.get("variants", []) if e["id"] == vid), {})

    out = {}
    for which in ("default", "best"):
        b8, b1 = pick("llama-3-8b", 8, 32768), pick("llama-3-8b", 1, 4096)
        e8, e1 = entry(b8, which), entry(b1, which)
        att8 = e8.get("attention_flush", {})
        sdpa8 = (b8 or {}).get("sdpa_fp16", {})
        frac = att8["gbps"] / ceiling if "gbps" in att8 else None
        x8 = sdpa8["median_ms"] / att8["median_ms"] if "median_ms" in att8 and "median_ms" in sdpa8 else None
        sdpa1 = (b1 or {}).get("sdpa_fp16", {}).get("median_ms")
        step1 = e1.get("step_flush", {}).get("median_ms")
        slower = []
        measured = False
        for r in rows:
            if r["batch"] * r["context"] < 32768 or "median_ms" not in r.get("sdpa_fp16", {}):
                continue
            e = entry(r, which)
            if "median_ms" not in e.get("step_flush", {}):
                continue
            measured = True
            if e["step_flush"]["median_ms"] > r["sdpa_fp16"]["median_ms"]:
                slower.append(f"{r['model']} b{r['batch']} {r['context']}")
        out[which] = {
            "variant": e8.get("name"),
            "b8_32k_attention_ge_80pct_read_ceiling": {"value": frac, "met": None if frac is None else frac >= 0.8},
            "b8_32k_attention_ge_4x_sdpa": {"value": x8, "met": None if x8 is None else x8 >= 4.0},
            "b1_4k_flush_step_le_sdpa_attention": {
                "value": (step1 / sdpa1) if step1 and sdpa1 else None,
                "met": None if not (step1 and sdpa1) else step1 <= sdpa1},
            "no_step_slower_than_sdpa_from_b1_32k": {"slower": slower, "met": (not slower) if measured else None},
        }
    return out


def legacy_goals(rows: list[dict]) -> dict:
    """The earlier report's goal keys (docs and gpu_check.json cite them), against the read ceiling now."""
    b8 = next((r for r in rows if (r["model"], r["batch"], r["context"]) == ("llama-3-8b", 8, 32768)), None)
    big = [r for r in rows if r["batch"] == 32 and r["context"] >= 32768 and "kivi_fraction_of_read_ceiling" in r]
    x = (b8 or {}).get("speedup_vs_sdpa_fp16")
    return {"large_shapes_fraction_of_read_ceiling": {f"{r['model']} b{r['batch']} {r['context']}":
                                                      r["kivi_fraction_of_read_ceiling"] for r in big},
            "speedup_vs_sdpa_at_llama3_b8_32k": x}


def summary_table(rows: list[dict]) -> str:
    head = (f"{'shape':24s} {'att us':>8s} {'best (variant) us':>24s} {'step f/nf us':>15s} {'sdpa us':>8s} "
            f"{'x sdpa':>7s} {'GB/s':>6s} {'%ceil':>6s}")
    lines = [head]
    for r in rows:
        att = r.get("kivi_attention", {}).get("median_ms")
        best = r.get("best_variant") or {}
        sf, sn = r.get("kivi_step", {}).get("median_ms"), r.get("kivi_step_nonflush", {}).get("median_ms")
        sdpa = r.get("sdpa_fp16", {}).get("median_ms")

        def us(x):
            return f"{1e3 * x:.1f}" if x else "-"
        lines.append(f"{r['model'][:10]} b{r['batch']} {r['context']:>6d}".ljust(24)
                     + f" {us(att):>8s} {us(best.get('attention_ms')) + ' (' + str(best.get('name', '-')) + ')':>24s}"
                     f" {us(sf) + '/' + us(sn):>15s} {us(sdpa):>8s} {r.get('speedup_vs_sdpa_fp16', 0):7.2f}"
                     f" {r.get('kivi_attention', {}).get('gbps', 0):6.0f}"
                     f" {100 * r.get('kivi_fraction_of_read_ceiling', 0):5.0f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds; what does not fit is listed")
    ap.add_argument("--headline", action="store_true", help="the headline shapes only (gpu_check.sh)")
    ap.add_argument("--quick", action="store_true", help="batch 1/8 and contexts 4K/32K only")
    ap.add_argument("--variants", default="all", help="all | default | comma-separated variant ids")
    ap.add_argument("--l2", choices=("cold", "warm"), default="cold")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (no GPU, no torch) and exit")
    ap.add_argument("--gpu", choices=sorted(gpu_plan.ASSUMED_GPUS), default="h100", help="dry run: assumed GPU")
    ap.add_argument("--variants-json", type=Path, default=None, help="dry run only: a fake variant list to plan")
    ap.add_argument("--library", type=Path, default=None, help="kernel library (default: the usual search)")
    args = ap.parse_args(argv)
    if args.time_budget <= 0:
        ap.error(f"--time-budget={args.time_budget} must be > 0 seconds")
    if args.variants_json is not None and not args.dry_run:
        ap.error("--variants-json plans a dry run only; a GPU run times the library's own variants")
    cfg = KiviConfig()
    if args.dry_run:
        from trtllm_kivi.cuda._abi import find_library

        variants, source = gpu_plan.load_variants(args.library or find_library(), args.variants_json)
        variants = select_variants(variants, args.variants)
        gpu = gpu_plan.ASSUMED_GPUS[args.gpu]
        runs = gpu_plan.decode_plan(variants, gpu, cfg, headline_only=args.headline, l2=args.l2)
        print(f"decode variants ({source}): {[v['name'] for v in variants]}")
        print(gpu_plan.describe(runs, args.time_budget, "bench_kernels"))
        library = args.library or find_library()
        if library is not None and source == "library":
            checks = gpu_plan.param_checks(library, variants, cfg, headline_only=args.headline)
            refused = [c for c in checks if "refused" in c]
            print(f"== host checks of the library ({len(checks)} variant x shape x past): {len(refused)} refused")
            for c in checks:
                what = c.get("refused") or ", ".join(f"{k}={v}" for k, v in c.items()
                                                     if k not in ("variant", "model", "batch", "context", "past"))
                print(f"   {c['variant']:14s} {c['model']} b{c['batch']} {c['context']} past {c['past']}: {what}")
            return 1 if refused else 0
        return 0
    return run(args, cfg)


def run(args, cfg: KiviConfig) -> int:
    import gpu_common as gc
    import kernel_timing as kt
    import torch

    from trtllm_kivi.cuda import _abi

    if not torch.cuda.is_available():
        print("bench_kernels: torch.cuda.is_available() is False; nothing to measure", file=sys.stderr)
        return 2
    budget = gpu_plan.Budget(args.time_budget)
    lib = _abi.load_library(args.library)
    variants, source = gpu_plan.load_variants(lib.path)
    variants = select_variants(variants, args.variants)
    facts = gc.gpu_facts()
    report: dict = {"benchmark": "bench_kernels", "config": cfg.to_dict(), "machine": gc.machine_info(lib),
                    "l2": args.l2, "variants": variants, "variants_source": source,
                    "notes": ["timings: CUDA events around CUDA-graph replays (method per entry), medians; L2-cold "
                              "unless l2 says warm (rotating buffer sets, copies per entry)",
                              "fraction_of_read_ceiling: achieved GB/s over the read-only streaming kernel's best "
                              "on a 2 GiB buffer in this run; fraction_of_same_bytes_read: over the same kernel "
                              "reading exactly the entry's bytes"]}
    reader = gc.StreamReader(lib)
    report["read_ceiling"] = reader.ceiling()
    ceiling = report["read_ceiling"]["gbps"]
    print(f"read ceiling: {ceiling:.0f} GB/s ({report['read_ceiling']['ctas_per_sm']} CTAs/SM)", flush=True)
    report["copy"] = kt.copy_bandwidth()
    rows, skipped = [], []
    planned: dict[tuple, float] = {}
    for r in gpu_plan.decode_plan(variants, gpu_plan.ASSUMED_GPUS["h100"], cfg, args.headline, args.l2):
        key = tuple(r.shape.values())
        planned[key] = planned.get(key, 0.0) + r.est_s
    for model, batch, ctx in shapes_for(args):
        shape = {"model": model, "batch": batch, "context": ctx}
        h, hkv, d = gpu_plan.MODELS[model]
        kb = gpu_plan.kivi_decode_bytes(cfg, h, hkv, d, batch, ctx - 1)[0]
        if kb > gpu_plan.MEMORY_FRACTION * torch.cuda.mem_get_info()[0]:
            skipped.append({**shape, "reason": f"the KIVI state needs {kb / 2**30:.1f} GiB"})
            continue
        if not budget.allows(min(planned.get((model, batch, ctx), 2.0), 10.0)):
            skipped.append({**shape, "reason": f"time budget {args.time_budget:.0f} s spent"})
            continue
        row = measure_shape(lib, reader, cfg, model, batch, ctx, variants, facts, ceiling, args.l2, budget)
        rows.append(row)
        best = row.get("best_variant") or {}
        print(f"{model} b={batch} ctx={ctx}: default {1e3 * row.get('kivi_attention', {}).get('median_ms', 0):.1f} us"
              f", best {best.get('name')} {1e3 * (best.get('attention_ms') or 0):.1f} us, sdpa "
              f"{1e3 * row.get('sdpa_fp16', {}).get('median_ms', 0):.1f} us", flush=True)
    report["decode"], report["skipped"] = rows, skipped
    if budget.allows(3.0):
        report["quantize"] = kt.bench_quantize(lib, cfg)
    report["targets"] = targets(rows, ceiling)
    report["goals"] = legacy_goals(rows)
    report["elapsed_s"] = budget.spent()
    gc.write_json(gc.result_path("bench_kernels", args.out), report)
    print(summary_table(rows))
    print(f"read ceiling {ceiling:.0f} GB/s; targets: " + "; ".join(
        f"{w}: " + ", ".join(f"{k}={v.get('met')}" for k, v in t.items() if isinstance(v, dict))
        for w, t in report["targets"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
