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

def gate_default_memory_bound(records: list[dict]) -> str | None:
    """The CI gate: None when the default kernel is memory-bound at Llama-3-8B, batch 8, 32K on H200, else why not."""
    hits = [r for r in records if r["default"] and (r["gpu"], r["model"], r["batch"], r["context"])
            == ("H200", "llama-3-8b", 8, 32768)]
    if len(hits) != 1:
        return f"expected one default-kernel record at H200 / llama-3-8b / batch 8 / 32K, found {len(hits)}"
    r = hits[0]
    if r["bound"] != "memory":
        return (f"default kernel {r['kernel']!r} is predicted {r['bound']}-bound at H200 / llama-3-8b / batch 8 / 32K "
                f"({r['predicted_us']} us vs FP16 {r['fp16_us']} us); it must be memory-bound")
    return None


def markdown_table(records: list[dict]) -> str:
    """One row per (GPU, model, batch, context), the kernels side by side (the default marked *)."""
    kernels = list(dict.fromkeys(r["kernel"] for r in records))
    default = {r["kernel"] for r in records if r["default"]}
    head = " | ".join(f"{k}{'*' if k in default else ''} us | vs FP16 | bound" for k in kernels)
    lines = ["Static model, not a measurement: tools/kernel_model, one decode step of one layer (attention "
             "kernels + launches), FP16 = its K/V bytes at copy bandwidth + the same launches. * = default kernel.", "",
             f"| GPU | model | batch | context | FP16 us | {head} |",
             "|---|---|---:|---:|---:|" + "---:|---:|---|" * len(kernels)]
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["gpu"], r["model"], r["batch"], r["context"]), {})[r["kernel"]] = r
    for (g, m, b, c), by in rows.items():
        fp16 = next(iter(by.values()))["fp16_us"]
        cells = " | ".join(f"{by[k]['predicted_us']:g} | {by[k]['speedup_vs_fp16']:g}x | {by[k]['bound']}"
                           if k in by else "- | - | -" for k in kernels)
        lines.append(f"| {g} | {m} | {b} | {c // 1024}K | {fp16:g} | {cells} |")
    return "\n".join(lines) + "\n"
