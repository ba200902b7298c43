"""Hardware counters of the decode attention at the headline shape (Llama-3-8B, batch 8, 32K), for the default and the
sweep's best decode variant: DRAM read bandwidth, instructions per cycle, pipe utilisation, the top stall reasons,
and stall samples per SASS region (basic blocks of the attention kernel's SASS).

    python3 benchmarks/ncu_profile.py run [--sweep bench_kernels.json] [--out ncu.json] [--raw-dir DIR]
                                          [--time-budget S]
    python3 benchmarks/ncu_profile.py target --variant ID      (what ncu runs: one launch in an NVTX range)
    python3 benchmarks/ncu_profile.py --dry-run

Nsight Compute (`ncu`, --clock-control none: the clocks as found) profiles every kernel of one attention launch
(NVTX range "kivi_profile"; warm-up launches outside it) with its built-in sections (no metric names that a version
could lack); ncu flushes the caches between passes, so the counters are L2-cold. Where ncu cannot read counters
(no permission, no profiler library) the JSON says why and nothing fails. Parsing is best effort on ncu's CSV pages
(raw, source); the raw CSVs are kept next to the JSON.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import gpu_plan  # noqa: E402

RANGE = "kivi_profile"
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "WarpStateStats", "SourceCounters",
            "LaunchStats", "Occupancy", "SchedulerStats", "InstructionStats")
BRANCHES = ("BRA", "EXIT", "RET", "BSYNC", "BREAK", "CALL", "JMP", "WARPSYNC", "BAR", "SYNCS")


def find_ncu() -> str | None:
    installed = sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))
    for cand in (shutil.which("ncu"), "/usr/local/cuda/bin/ncu", *installed):
        if cand and Path(cand).exists():
            return str(cand)
    return None


# ---------------------------------------------------------------------------------------------- parsing


def _num(x: str) -> float | None:
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def parse_raw(text: str) -> list[dict]:
    """ncu --page raw --csv --print-units base: one dict per kernel (name, duration in ns, DRAM read GB/s, IPC, pipe
    utilisation, stall reasons)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        return []
    head = rows[start]
    out = []
    for r in rows[start + 2:]:  # the row after the header holds the units
        if len(r) != len(head):
            continue
        m = dict(zip(head, r, strict=True))
        k: dict = {"kernel": m.get("Kernel Name", "?")}
        dur = next((_num(v) for h, v in m.items() if h.startswith("gpu__time_duration.sum")), None)
        k["duration_ns"] = dur
        rd = _num(m.get("dram__bytes_read.sum", ""))
        k["dram_read_bytes"] = rd
        bw = _num(m.get("dram__bytes_read.sum.per_second", ""))  # base units (--print-units base): byte/second
        k["dram_read_gbps"] = bw / 1e9 if bw is not None else (rd / dur if rd and dur else None)  # byte/ns = GB/s
        k["ipc_active"] = _num(m.get("sm__inst_executed.avg.per_cycle_active", ""))
        k["dram_throughput_pct"] = _num(m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", ""))
        pipes, stalls = {}, {}
        for h, v in m.items():
            if (p := re.fullmatch(r"sm__(?:inst_executed_pipe_|pipe_)(\w+?)(?:_cycles_active)?\.avg\."
                                  r"pct_of_peak_sustained_active", h)) and _num(v) is not None:
                pipes[p.group(1)] = _num(v)
            if (s := re.fullmatch(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(?:_per_issue_active)?"
                                  r"(?:\.ratio)?", h)) and _num(v) is not None:
                stalls[s.group(1)] = _num(v)
        k["pipes_pct"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:8])
        k["top_stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        out.append(k)
    return out


def parse_source(text: str, top: int = 8) -> list[dict]:
    """ncu --page source --csv (SASS): stall samples per region, a region being a run of instructions ended by a
    branch or barrier; the top regions by samples with their opcodes and stall reasons (when ncu gives them)."""
    rows = list(csv.reader(io.StringIO(text)))
    hi = next((i for i, r in enumerate(rows) if any("Address" in c for c in r) and "Source" in r), None)
    if hi is None:
        return []
    head = rows[hi]
    addr_c = next(i for i, c in enumerate(head) if "Address" in c)
    src_c = head.index("Source")
    samp_c = next((i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All")), None)
    stall_cs = [i for i, c in enumerate(head) if "stall" in c.lower() and i != samp_c
                and "Sampling" not in c]
    regions, cur = [], None
    for r in rows[hi + 1:]:
        if len(r) != len(head) or not r[src_c].strip():
            continue
        if "Address" in r[addr_c]:  # the next kernel's header
            break
        m = re.match(r"(?:@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_.]*)", r[src_c].strip())  # the opcode, guard skipped
        op = m.group(1) if m else r[src_c].strip().split(" ")[0]
        if cur is None:
            cur = {"start": r[addr_c], "instructions": 0, "samples": 0.0, "opcodes": {}, "stalls": {}}
            regions.append(cur)
        cur["end"] = r[addr_c]
        cur["instructions"] += 1
        s = _num(r[samp_c]) if samp_c is not None else None
        cur["samples"] += s or 0.0
        base = op.split(".")[0]
        cur["opcodes"][base] = cur["opcodes"].get(base, 0) + 1
        for i in stall_cs:
            v = _num(r[i])
            if v:
                cur["stalls"][head[i]] = cur["stalls"].get(head[i], 0.0) + v
        if base in BRANCHES:
            cur = None
    total = sum(g["samples"] for g in regions) or 1.0
    for g in regions:
        g["share"] = g["samples"] / total
        g["opcodes"] = dict(sorted(g["opcodes"].items(), key=lambda kv: -kv[1])[:4])
        g["stalls"] = dict(sorted(g["stalls"].items(), key=lambda kv: -kv[1])[:4])
    return sorted(regions, key=lambda g: -g["samples"])[:top]


# ---------------------------------------------------------------------------------------------- running


def target(variant: int, model: str, batch: int, ctx: int) -> int:
    """One attention launch of `variant` inside the NVTX range ncu profiles (after warm-up launches)."""
    import gpu_common as gc  # noqa: F401  (sets the import path; torch loaded)
    import kernel_timing as kt
    import torch

    from trtllm_kivi.cuda import _abi
    from trtllm_kivi.format import KiviConfig

    cfg = KiviConfig()
    h, hkv, d = gpu_plan.MODELS[model]
    lib = _abi.load_library()
    state = kt.KiviState(lib, cfg, h, hkv, d, batch, ctx, 1)
    fns, refused, _ = state.launchers(gpu_plan.flush_past(cfg, ctx), variant, _abi.PHASE_ATTENTION)
    if refused:
        print(f"ncu_profile target: variant {variant} refused: {refused}", file=sys.stderr)
        return 3
    for _ in range(3):
        fns[0]()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    fns[0]()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


def profile(ncu: str, variant: int, raw_dir: Path, timeout: float) -> dict:
    """ncu over `target --variant`, then its raw and source pages parsed."""
    rep = raw_dir / f"ncu_variant{variant}"
    model, batch, ctx = gpu_plan.HEADLINE[0]
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include", f"{RANGE}/",
           *(x for s in SECTIONS for x in ("--section", s)), "--import-source", "yes", "-f", "-o", str(rep),
           sys.executable, str(Path(__file__).resolve()), "target", "--variant", str(variant)]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"ncu did not finish in {timeout:.0f} s"}
    out: dict = {"variant": variant, "shape": {"model": model, "batch": batch, "context": ctx},
                 "seconds": round(time.monotonic() - t0, 1), "rc": res.returncode}
    (raw_dir / f"ncu_variant{variant}.log").write_text(res.stdout[-20000:] + res.stderr[-20000:])
    report = rep.with_suffix(".ncu-rep")
    if res.returncode != 0 or not report.exists():
        out["error"] = (res.stderr.strip() or res.stdout.strip())[-600:]
        return out
    raw = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True, timeout=120)
    (raw_dir / f"ncu_variant{variant}_raw.csv").write_text(raw.stdout)
    out["kernels"] = parse_raw(raw.stdout)
    for extra in (["--print-source", "sass"], []):
        src = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "source", *extra],
                             capture_output=True, text=True, timeout=120)
        if src.returncode == 0 and src.stdout.strip():
            (raw_dir / f"ncu_variant{variant}_source.csv").write_text(src.stdout)
            out["sass_regions"] = parse_source(src.stdout)
            out["source_page"] = " ".join(["--page source", *extra])
            break
        out["source_page_error"] = (src.stderr.strip() or "empty")[-300:]
    return out


def best_variant(sweep: Path | None) -> tuple[int | None, str]:
    """The headline shape's fastest variant in a bench_kernels JSON (None without a sweep or variants)."""
    if sweep is None or not sweep.exists():
        return None, "no sweep JSON"
    model, batch, ctx = gpu_plan.HEADLINE[0]
    for r in json.loads(sweep.read_text()).get("decode", []):
        if (r["model"], r["batch"], r["context"]) == (model, batch, ctx) and r.get("best_variant"):
            return int(r["best_variant"]["id"]), f"{sweep.name}: {r['best_variant']['name']}"
    return None, f"{sweep.name} has no best variant at the headline shape"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=("run", "target"), default="run")
    ap.add_argument("--variant", type=int, default=0)
    ap.add_argument("--sweep", type=Path, default=None, help="bench_kernels JSON naming the best variant")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--raw-dir", type=Path, default=None, help="where the reports and CSVs go (default: --out's)")
    ap.add_argument("--time-budget", type=float, default=80.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(gpu_plan.describe(gpu_plan.ncu_plan(), args.time_budget, "ncu_profile"))
        print(f"ncu: {find_ncu() or 'not found here'}; sections: {', '.join(SECTIONS)}")
        return 0
    if args.mode == "target":
        return target(args.variant, *gpu_plan.HEADLINE[0])
    out = args.out or ROOT / "build" / "ncu" / "ncu.json"
    raw_dir = args.raw_dir or out.parent
    raw_dir.mkdir(parents=True, exist_ok=True)
    budget = gpu_plan.Budget(args.time_budget)
    ncu = find_ncu()
    result: dict = {"benchmark": "ncu_profile", "ncu": ncu, "sections": list(SECTIONS), "profiles": []}
    if ncu is None:
        result["skipped"] = "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)"
    else:
        result["ncu_version"] = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip()
        best, why = best_variant(args.sweep)
        result["best_variant_source"] = why
        for v in dict.fromkeys([0] + ([best] if best is not None else [])):
            if budget.left() < 25:
                result.setdefault("skipped_variants", []).append(v)
                continue
            p = profile(ncu, v, raw_dir, budget.left() - 5)
            result["profiles"].append(p)
            if "error" in p and ("ERR_NVGPUCTRPERM" in p["error"] or "LibraryNotLoaded" in p["error"]):
                result["skipped"] = "ncu cannot read the counters here: " + p["error"][-200:]
                break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for p in result["profiles"]:
        main_k = max(p.get("kernels", []), key=lambda k: k.get("duration_ns") or 0, default={})
        print(f"variant {p['variant']}: {main_k.get('kernel', p.get('error', '?'))[:60]} "
              f"{main_k.get('duration_ns') or 0:.0f} ns, DRAM read {main_k.get('dram_read_gbps') or 0:.0f} GB/s, "
              f"IPC {main_k.get('ipc_active')}, stalls {list(main_k.get('top_stalls', {}))[:3]}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
