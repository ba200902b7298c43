"""Verdicts and tables from the records: the CI gates (the default decode kernel memory-bound; the append kernel at
its share of copy bandwidth) and the markdown table."""

from __future__ import annotations

from .append import APPEND_MIN_FRACTION

def gate_append(records: list[dict]) -> str | None:
    """None when the append kernel is predicted at >= 80% of copy bandwidth for every chunk >= 4K on H200."""
    hits = [r for r in records if r["gpu"] == "H200" and r["chunk"] >= 4096]
    if not hits:
        return "no append-kernel record at H200 with a chunk of >= 4K tokens"
    bad = [r for r in hits if r["fraction_of_copy_bw"] < APPEND_MIN_FRACTION]
    if bad:
        r = min(bad, key=lambda r: r["fraction_of_copy_bw"])
        return (f"append kernel at {r['fraction_of_copy_bw']:.0%} of copy bandwidth ({r['model']}, batch {r['batch']}, "
                f"chunk {r['chunk']}: {r['bound']}-bound); it must reach {APPEND_MIN_FRACTION:.0%}")
    return None

MEMORY_BOUND_FRACTION = 0.80  # the design target: decode attention at >= 80% of the measured read ceiling
HEADLINE = ("H200", "llama-3-8b", 8, 32768)


def read_verdict(rec: dict, measured_us: float | None = None) -> tuple[bool, str]:
    """(memory-bound?, why) of a decode record: its read bytes over its time against the read ceiling -- the
    measured time where one is given (a measurement wins), else the model's."""
    ceiling = rec["read_ceiling_gbps"] * 1e3  # bytes per us
    us = measured_us if measured_us is not None else rec["predicted_us"]
    frac = rec["read_bytes"] / us / ceiling
    where = f"{rec['gpu']} / {rec['model']} / batch {rec['batch']} / {rec['context'] // 1024}K"
    times = (f"measured: {us:.1f} us; " if measured_us is not None else "") + \
        f"model: {rec['predicted_us']:.1f} us, {rec['bound']}-bound"
    why = (f"{rec['kernel']!r} (variant {rec.get('variant')}; {rec['timing']}) at {where} reads at "
           f"{rec['read_bytes'] / us / 1e6:.2f} TB/s = {frac:.0%} of the read ceiling {ceiling / 1e6:.2f} TB/s "
           f"({times})")
    return frac >= MEMORY_BOUND_FRACTION, why


def gate_default_memory_bound(records: list[dict], measured: dict[tuple, float] | None = None) -> str | None:
    """The CI gate: None when the default decode variant reads at >= 80% of the read ceiling at Llama-3-8B, batch 8,
    32K on H200 -- measured where a committed measurement of it exists, else by the calibrated model -- else why
    not. measured: {(gpu, model, batch, context, variant): us}."""
    hits = [r for r in records if r["default"] and (r["gpu"], r["model"], r["batch"], r["context"]) == HEADLINE]
    if len(hits) != 1:
        return f"expected one default-kernel record at H200 / llama-3-8b / batch 8 / 32K, found {len(hits)}"
    r = hits[0]
    if "read_fraction" not in r:
        return f"default kernel {r['kernel']!r} has no calibrated timing ({r['timing']}): the gate cannot judge it"
    ok, why = read_verdict(r, (measured or {}).get((*HEADLINE, r.get("variant"))))
    return None if ok else f"default {why}; memory-bound needs >= {MEMORY_BOUND_FRACTION:.0%}"


def gate_default_no_regression(records: list[dict], measured: dict[tuple, float] | None = None) -> str | None:
    """The CI gate: None when the default decode variant at Llama-3-8B, batch 8, 32K on H200 is not slower than the
    measured kernel ("baseline", the kernel the committed H200 timings are of) -- the default's committed measurement
    where one exists, else its calibrated prediction, against the baseline's measurement -- else why not.
    Memory-boundness (>= 80% of the read ceiling) is a target, judged by a GPU measurement and reported by the CLI's
    verdict lines; a model alone never claims it, so it does not gate CI (--fail-if-default-not-memory-bound does)."""
    hits = [r for r in records if r["default"] and (r["gpu"], r["model"], r["batch"], r["context"]) == HEADLINE]
    if len(hits) != 1:
        return f"expected one default-kernel record at H200 / llama-3-8b / batch 8 / 32K, found {len(hits)}"
    r = hits[0]
    base = (measured or {}).get((*HEADLINE, "baseline"))
    if base is None:
        return "no committed measurement of the baseline kernel at the headline shape to compare the default with"
    own = (measured or {}).get((*HEADLINE, r.get("variant")))
    us = own if own is not None else r["predicted_us"]
    how = "measured" if own is not None else f"model ({r['timing']})"
    if us > base:
        return (f"default {r['kernel']!r} (variant {r.get('variant')}) at {us:.1f} us ({how}) is slower than the "
                f"measured baseline kernel's {base:.1f} us at H200 / llama-3-8b / batch 8 / 32K")
    return None


def _us(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.4g}"


def markdown_table(records: list[dict]) -> str:
    """One row per (GPU, model, batch, context); a column per kernel or decode variant: its time and limit (the
    default marked *)."""
    key = [r.get("variant") or r["kernel"] for r in records]
    kernels = list(dict.fromkeys(key))
    rows: dict[tuple, dict[str, dict]] = {}
    default: dict[tuple, str] = {}
    for k, r in zip(key, records, strict=True):
        shape = (r["gpu"], r["model"], r["batch"], r["context"])
        rows.setdefault(shape, {})[k] = r
        if r["default"]:
            default[shape] = k
    lines = ["Static model, not a measurement: tools/kernel_model, one decode step of one layer (attention kernels + "
             "launches), µs (limit). baseline = the measured kernel, timed by the model calibrated on the H200 "
             "measurements (H100, A100: those constants, uncalibrated); split* = the split kernel's variants, "
             "uncalibrated (no GPU has timed them); simt / wmma = ideal bounds; FP16 = torch SDPA's calibrated model. "
             "* = the variant the plan picks.", "",
             f"| GPU | model | batch | context | FP16 | {' | '.join(kernels)} |",
             "|---|---|---:|---:|---:|" + "---:|" * len(kernels)]
    for (g, m, b, c), by in rows.items():
        fp16 = next(iter(by.values()))["fp16_us"]
        cells = " | ".join(f"{_us(by[k]['predicted_us'])}{'*' if default.get((g, m, b, c)) == k else ''} "
                           f"({by[k]['bound']})" if k in by else "-" for k in kernels)
        lines.append(f"| {g} | {m} | {b} | {c // 1024}K | {_us(fp16)} | {cells} |")
    return "\n".join(lines) + "\n"
