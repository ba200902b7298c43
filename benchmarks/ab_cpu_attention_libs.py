"""In-process A/B of builds of the native CPU library on the KiviAttention decode op.

Separate processes on a shared machine differ by +-10% (clock, neighbours); here every build is loaded into one
process (ctypes, RTLD_LOCAL: each copy binds its own symbols) and the builds are called alternately, round after
round, so drift hits them alike. The comparison is the median over rounds of each build's time / the first build's.

    PYTHONPATH=. .venv/bin/python benchmarks/ab_cpu_attention_libs.py --geometry smollm2-135m --batch 8 \\
        --context 2176 --layers 1 --calls 4 --rounds 30 base=ab/a.so new=ab/b.so base2=ab/a.so

Name a build twice (base, base2) to see the noise floor of the run. Writes JSON (--out) with the machine, the shape,
and per build: min / median ms per call of all layers, cycles per 16-token tile at --ghz, the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu_attention as B  # noqa: E402

from trtllm_kivi.bench import machine_info, portable_path  # noqa: E402
from trtllm_kivi.cpu import _abi  # noqa: E402
from trtllm_kivi.cpu.ops import KiviCpuAttention  # noqa: E402
from trtllm_kivi.format import KiviConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="name=path/to/libtrtllm_kivi_cpu.so; the first is the baseline")
    ap.add_argument("--geometry", default="smollm2-135m", choices=list(B.GEOMETRIES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2176)
    ap.add_argument("--layers", type=int, default=1, help="layers per call set (more: a working set above the L3)")
    ap.add_argument("--calls", type=int, default=4, help="calls of all layers per timing")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="auto", choices=list(_abi.ISA_CODES))
    ap.add_argument("--ghz", type=float, default=3.55, help="core clock for the cycles-per-tile column")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    builds = []
    for spec in args.builds:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"build {spec!r}: expected name=path to an existing library")
        builds.append((name, _abi.load_library(path)))
    _, h, hkv, d, _ = B.GEOMETRIES[args.geometry]
    cfg, b, ctx = KiviConfig(), args.batch, args.context
    gen = torch.Generator().manual_seed(0)
    kivi, table, dense = B.make_layers(cfg, args.layers, hkv, d, b, ctx, gen)
    del dense
    q, k, v = (torch.randn(b, n, d, generator=gen) for n in (h, hkv, hkv))
    i32 = dict(dtype=torch.int32)
    slots, past, chunk = torch.arange(b, **i32), torch.full((b,), ctx, **i32), torch.ones(b, **i32)
    times: dict[str, list[float]] = {name: [] for name, _ in builds}
    ops = {name: KiviCpuAttention(kivi, cfg, h, isa=args.isa, lib=lib) for name, lib in builds}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, _ in builds:
            op = ops[name]
            t0 = time.perf_counter()
            for _ in range(args.calls):
                for i in range(len(kivi)):
                    op(i, q, k, v, slots, past, chunk, table, threads=args.threads, phase=_abi.PHASE_ATTENTION)
            if r:
                times[name].append((time.perf_counter() - t0) / args.calls)
    tiles = args.layers * b * hkv * ctx / 16
    base = builds[0][0]
    res = {}
    for name, ts in times.items():
        ratio = statistics.median(t / t0 for t, t0 in zip(ts, times[base], strict=True))
        res[name] = {"min_ms": round(min(ts) * 1e3, 4), "median_ms": round(statistics.median(ts) * 1e3, 4),
                     "cycles_per_tile_at_min": round(min(ts) * args.ghz * 1e9 / tiles),
                     f"median_ratio_to_{base}": round(ratio, 4)}
        print(f"{name:12s} min {min(ts) * 1e3:9.3f} ms  median {statistics.median(ts) * 1e3:9.3f} ms  "
              f"cycles/tile {res[name]['cycles_per_tile_at_min']:6d}  ratio to {base} {ratio:.3f}")
    if args.out:
        out = {"benchmark": "ab_cpu_attention_libs", "machine": machine_info(load_average_1m=os.getloadavg()[0]),
            "shape": {"geometry": args.geometry, "batch": b, "context": ctx, "layers": args.layers,
                      "threads": args.threads, "isa": args.isa, "calls": args.calls, "rounds": args.rounds},
            "builds": {name: portable_path(lib.path) for name, lib in builds}, "results": res}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
