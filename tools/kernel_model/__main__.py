"""Static performance model of the CUDA decode-attention kernels (a MODEL, not a measurement).

    python -m tools.kernel_model [--out benchmarks/results/kernel_model.json] [--fail-if-default-regresses]
                                 [--fail-if-default-not-memory-bound] [--fail-if-append-below-copy-bw]

CPU only. For each kernel of KERNELS (a declared per-kernel table) and each arch (sm_90, sm_80) it
1. compiles a translation unit that explicitly instantiates just that decode kernel (nvcc -cubin -lineinfo,
   -Xptxas -v: registers, spills, shared memory) -- separate from CI's one-arch library build;
2. disassembles it with nvdisasm -gi (the pinned PyPI wheel nvidia-cuda-nvdisasm): SASS with inline line info;
3. splits it into basic blocks, finds the loops (back edges) and names them through the source tags
   `// KIVI_MODEL_LOOP(name)` (the loop's `for` line) / `// KIVI_MODEL_ANCHOR(name)` (a line executed once per source
   iteration, whose static copies in a SASS loop body give its unroll factor); trip counts come from the table
   (per source loop, as a function of the shapes), never from hard-coded instruction counts;
4. weights each block by the executed path of a decode step (declared path rules keyed by source text, copy rules
   for unrolled copies that a runtime guard skips, warp fractions; unreachable, divergence-fallback and slow-path
   blocks are not executed) and counts executed warp-instructions per key tile by class, plus the per-CTA rest;
5. counts shared-memory wavefronts of every LDS/STS/LDSM with a bank model over a declared lane -> byte-address
   mapping per access (SmemAccess; a lane-level emulation can supply the mapping as a list of 32 addresses);
6. derives occupancy from regs / smem / threads, mirrors the launch plan of plugins/kernels/src/kiviParams.cpp
   (split rule, per-sequence split length of the prepare kernel) and predicts the time per layer of a decode step as
   the sum over waves of max(issue, shared-memory, memory) time, plus launch overheads counted alike for the FP16
   baseline (FP16 K/V bytes at copy bandwidth).

The calibration against a hand count of the SIMT and WMMA kernels' SASS (predict.CALIBRATION) is part of the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from . import calibrate
from .analysis import analyze, from_root, present
from .append import APPEND_KERNELS, APPEND_MIN_FRACTION, append_records
from .constants import FITTED, FITTED_ON
from .kernels import KERNELS
from .predict import build_records, calibration
from .report import (HEADLINE, gate_append, gate_default_memory_bound, gate_default_no_regression, markdown_table,
                     read_verdict)
from .shapes import GPUS, ROOT
from .split import SPLIT_KERNELS
from .toolchain import ToolMissing

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernel_model.json"
APPEND_OUT = ROOT / "benchmarks" / "results" / "kernel_model_append.json"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON list of records (default %(default)s)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown here")
    ap.add_argument("--fail-if-default-not-memory-bound", action="store_true",
                    help="exit 1 when the default decode variant reads at < 80%% of the read ceiling at Llama-3-8B, "
                         "batch 8, 32K on H200 (measured where a committed measurement exists, else the calibrated "
                         "model)")
    ap.add_argument("--fail-if-default-regresses", action="store_true",
                    help="exit 1 when the default decode variant at Llama-3-8B, batch 8, 32K on H200 is slower than "
                         "the measured baseline kernel (its own committed measurement where one exists, else the "
                         "calibrated model): the CI gate; memory-boundness is a target reported by the verdict lines")
    ap.add_argument("--calibrate", action="store_true",
                    help="refit the timing model's constants to the measurements, hold shapes and models out, and "
                         f"write {calibrate.CALIBRATION_OUT.relative_to(ROOT)} (about a minute)")
    ap.add_argument("--append-out", type=Path, default=APPEND_OUT,
                    help="JSON records of the append (quantize-and-store) kernel for prefill chunks (default %(default)s)")
    ap.add_argument("--fail-if-append-below-copy-bw", action="store_true",
                    help=f"exit 1 when the append kernel is predicted below {APPEND_MIN_FRACTION:.0%} of copy bandwidth "
                         "for a prefill chunk of >= 4K tokens on H200")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kernel-root", type=Path, default=None,
                    help="compile the kernels whose headers this tree lacks (e.g. kiviDecodeMma.cuh) from this other "
                         "checkout (read-only), to preview a kernel before it is merged")
    args = ap.parse_args(argv)
    specs = [s if present(s) or args.kernel_root is None else from_root(s, args.kernel_root.resolve())
             for s in KERNELS]
    for s in specs:
        if not present(s):
            print(f"kernel_model: kernel {s.name!r} not in this tree ({', '.join(s.headers)} absent): skipped")
    try:
        results, versions = analyze(list(specs) + list(SPLIT_KERNELS) + list(APPEND_KERNELS), jobs=args.jobs)
    except ToolMissing as exc:
        print(f"kernel_model: {exc}", file=sys.stderr)
        return 2
    records = build_records({k: v for k, v in results.items() if k[0] != "append"}, versions)
    app = append_records(results, versions)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.append_out.write_text(json.dumps(app, indent=1, sort_keys=True) + "\n")
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    tmp.replace(args.out)
    if args.markdown:
        args.markdown.write_text(markdown_table(records))
    for cal in calibration(records):
        for row in cal["rows"]:
            print(f"calibration {cal['kernel']:5s} {row['quantity']:28s} hand {row['hand_count']:>8g}  model "
                  f"{row['model']:>8g}  ratio {row['ratio']:.3f}{'' if row['within_tolerance'] else '  OUT OF TOLERANCE'}")
    for (name, arch), r in sorted(results.items()):
        print(f"resources {name:5s} {arch}: {r.resources.registers} regs, {r.resources.smem_bytes} B smem, spills "
              f"{r.resources.spill_stores}/{r.resources.spill_loads} B")
    print(f"kernel_model: wrote {len(records)} records to {args.out}")
    for rec in app:
        if rec["gpu"] == "H200":
            print(f"append {rec['model']:10s} batch {rec['batch']} chunk {rec['chunk']:>5d}: {rec['predicted_us']:g} us, "
                  f"{rec['fraction_of_copy_bw']:.0%} of copy bandwidth ({rec['bound']}-bound; model)")
    measurements = calibrate.load_measurements()
    setup = calibrate.setup_for(results[("mma", GPUS[FITTED_ON].arch)], GPUS[FITTED_ON])
    errs = calibrate.errors(measurements, FITTED, setup)
    print(f"calibration: {len(errs)} {FITTED_ON} timings, |predicted / measured - 1| rms "
          f"{calibrate.summary(errs)['rms']:.1%}, max {calibrate.summary(errs)['max_abs']:.1%} (tolerance "
          f"{calibrate.TOLERANCE:.0%})")
    if args.calibrate:
        refit = calibrate.fit(measurements, setup)
        print(f"calibration: refit {refit} (committed: {FITTED})")
        doc = calibrate.calibration_document(measurements, setup)
        calibrate.CALIBRATION_OUT.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"calibration: wrote {calibrate.CALIBRATION_OUT} (held out: each shape {doc['held_out']['each_shape']}, "
              f"other model {doc['held_out']['other_model']})")
    measured = calibrate.measured_attention(measurements)
    for dec in records:
        if (dec["gpu"], dec["model"], dec["batch"], dec["context"]) == HEADLINE and "read_fraction" in dec:
            ok, verdict = read_verdict(dec, measured.get((*HEADLINE, dec.get("variant"))))
            print(f"verdict{' (default)' if dec['default'] else ''}: {verdict}: "
                  f"{'memory-bound' if ok else 'NOT memory-bound'}")
    if args.fail_if_append_below_copy_bw:
        why = gate_append(app)
        if why:
            print(f"kernel_model: FAIL: {why}", file=sys.stderr)
            return 1
    if args.fail_if_default_regresses:
        why = gate_default_no_regression(records, measured)
        if why:
            print(f"kernel_model: FAIL: {why}", file=sys.stderr)
            return 1
    if args.fail_if_default_not_memory_bound:
        why = gate_default_memory_bound(records, measured)
        if why:
            print(f"kernel_model: FAIL: {why}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
