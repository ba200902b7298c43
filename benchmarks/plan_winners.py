"""The winning decode variant per shape class of a sweep (bench_kernels JSON), for the plan table that `auto` reads
(plugins/kernels/include/kiviDecodeVariants.h, kKIVI_DECODE_PLAN: keyed by arch and SM count).

    python3 benchmarks/plan_winners.py SWEEP.json [--metric step_amortized|attention_flush] [--out winners.json]

Shape classes (KiviShapeClass in kiviDecodeVariants.h): a pure-decode shape whose batch x query tiles x KV heads
are fewer CTAs than the GPU has SMs is few_ctas (latency-bound, e.g. batch 1), otherwise many_ctas
(bandwidth-bound); steps with chunks longer than one token are mixed (the decode sweep has none: "not measured").
Per class, each variant's time at a shape is divided by the best variant's there; the winner has the smallest
geometric mean of that ratio over the class's shapes (only variants measured at every shape compete; "auto" is
the plan itself and never competes). The metric is the amortized decode step ((flush + (G - 1) non-flush) / G:
attention, append and every launch) unless --metric attention_flush. Prints a table and the plan rows to paste;
--out writes them as JSON. A measurement, so the rows name the GPU and the file they come from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

CLASSES = ("few_ctas", "many_ctas", "mixed")
CLASS_ENUM = {"few_ctas": "kKIVI_SHAPE_FEW_CTAS", "many_ctas": "kKIVI_SHAPE_MANY_CTAS", "mixed": "kKIVI_SHAPE_MIXED"}
TILE_ROWS = 8  # kTILE_ROWS: query rows per decode CTA (the MMA's N)


def shape_class(row: dict, sms: int) -> str:
    """few_ctas / many_ctas of a pure-decode row: batch x ceil(group heads / TILE_ROWS) x KV heads CTAs against the
    SM count, as shapeClass in plugins/kernels/src/kiviParams.cpp (and cuda/variants.shape_class) decide."""
    ctas = row["batch"] * math.ceil(row["heads"] // row["kv_heads"] / TILE_ROWS) * row["kv_heads"]
    return "few_ctas" if ctas < sms else "many_ctas"


def metric_ms(entry: dict, metric: str) -> float | None:
    if metric == "step_amortized":
        return entry.get("step_amortized_ms")
    return entry.get("attention_flush", {}).get("median_ms")


def winners(report: dict, metric: str = "step_amortized", source: str = "") -> dict:
    """{class: winner record} for one sweep."""
    mach = report.get("machine", {})
    sms = int(mach.get("sms", 0))
    arch = int(str(mach.get("compute_capability", "0.0")).replace(".", ""))
    per_class: dict[str, list[tuple[dict, dict[int, float]]]] = {}
    names: dict[int, str] = {}
    for row in report.get("decode", []):
        times = {}
        for e in row.get("variants", []):
            t = metric_ms(e, metric)
            if e["id"] != 0 and t:
                times[e["id"]] = t
                names[e["id"]] = e["name"]
        if times:
            per_class.setdefault(shape_class(row, sms), []).append((row, times))
    out: dict = {}
    for cls in CLASSES:
        items = per_class.get(cls)
        if not items:
            out[cls] = {"measured": False}
            continue
        common = set.intersection(*(set(t) for _, t in items))
        if not common:
            out[cls] = {"measured": False, "why": "no variant was measured at every shape of the class"}
            continue
        score = {i: math.exp(sum(math.log(t[i] / min(t.values())) for _, t in items) / len(items)) for i in common}
        ranked = sorted(score, key=lambda i: score[i])
        win = ranked[0]
        shapes = [{"model": r["model"], "batch": r["batch"], "context": r["context"],
                   "winner_ms": t[win], "best_ms": min(t.values()), "best_id": min(t, key=lambda i: t[i])}
                  for r, t in items]
        out[cls] = {"measured": True, "arch": arch, "sms": sms, "gpu": mach.get("gpu"), "variant": win,
                    "name": names[win], "geomean_vs_best": score[win],
                    "runner_up": ({"variant": ranked[1], "name": names[ranked[1]], "geomean_vs_best": score[ranked[1]]}
                                  if len(ranked) > 1 else None),
                    "shapes": shapes, "metric": metric, "source": source,
                    "plan_row": f"{{{arch}, {sms}, {sms}, {CLASS_ENUM[cls]}, {win}}}, // measured: {mach.get('gpu')} "
                                f"{source} ({metric}, geomean {score[win]:.3f} of the best)"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="a bench_kernels JSON (benchmarks/results/bench_kernels_<gpu>.json)")
    ap.add_argument("--metric", choices=("step_amortized", "attention_flush"), default="step_amortized")
    ap.add_argument("--out", type=Path, default=None, help="write the winners as JSON")
    args = ap.parse_args(argv)
    if not args.sweep.is_file():
        ap.error(f"{args.sweep} does not exist")
    report = json.loads(args.sweep.read_text())
    if report.get("benchmark") != "bench_kernels" or "decode" not in report:
        print(f"plan_winners: {args.sweep} is not a bench_kernels sweep (benchmark={report.get('benchmark')!r})",
              file=sys.stderr)
        return 2
    res = winners(report, args.metric, args.sweep.name)
    for cls, w in res.items():
        if not w.get("measured"):
            print(f"{cls:10s} not measured{': ' + w['why'] if 'why' in w else ''}")
            continue
        ru = w["runner_up"]
        print(f"{cls:10s} sm_{w['arch']} {w['sms']} SMs: {w['name']} (id {w['variant']}), geomean "
              f"{w['geomean_vs_best']:.3f} of the per-shape best over {len(w['shapes'])} shapes"
              + (f"; runner-up {ru['name']} {ru['geomean_vs_best']:.3f}" if ru else ""))
        print(f"           {w['plan_row']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
