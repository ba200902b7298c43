"""The recipe table: decode-mode quality of many KV recipes, resumable per (configuration, segment), with paired
bootstrap confidence intervals across segments, bits/element from the memory formula and passkey retrieval.

Each segment is scored by quality.evaluate_quality on its own (the reference and the configurations still missing
for it, in lockstep), with a chunk plan cut at the flush points of *every* configuration of the table, so a
configuration's numbers do not depend on which others ran with it. Every finished (configuration, segment) and
passkey cell is appended to a JSON-lines cache; a rerun skips what the cache holds for the same setup.

Statistics (per configuration, against the reference on the same segments):
  ppl            exp(mean NLL over all scored tokens) (segments have equal lengths: mean of segment means)
  ppl_delta_pct  100 * (ppl / ppl_ref - 1)
  *_ci95         paired bootstrap over segments: resample segment indices with replacement (the same indices for
                 the configuration and the reference), recompute the statistic, take the 2.5 / 97.5 percentiles
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from collections.abc import Callable, Sequence

from ..format import Geometry, KiviConfig, kivi_total_bytes
from ..models.llama import LlamaModel
from ..runtime.kvspec import KVSpec
from .passkey import PasskeyPrompt, PasskeyResult, run_passkey, summarize
from .quality import QualitySetup, evaluate_quality
from .suite import make_runner

CONTEXTS = (2048, 8192, 32768)


def bits_per_element(cfg: KiviConfig | None, geom: Geometry, seq_len: int, full_bits: int = 16) -> float:
    """KV bits per cached element (K and V, all layers) of one sequence of seq_len tokens, from the memory formula
    (format.kivi_total_bytes): codes + scales/zeros of whole blocks + the sink rows and the window (fp16)."""
    elements = 2 * geom.num_layers * geom.num_kv_heads * geom.head_dim * seq_len
    if cfg is None:
        return float(full_bits)
    return kivi_total_bytes(cfg, geom, seq_len) * 8 / elements


def _mean_at(values: Sequence[float], idx: list[int]) -> float:
    return sum(values[i] for i in idx) / len(idx)


def bootstrap_ci(stat: Callable[[list[int]], float], n: int, resamples: int = 2000, seed: int = 0
                 ) -> list[float]:
    """[2.5, 97.5] percentiles of stat(indices) over bootstrap resamples of range(n) (with replacement)."""
    rng = random.Random(seed)
    vals = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    lo, hi = vals[int(0.025 * (resamples - 1))], vals[int(math.ceil(0.975 * (resamples - 1)))]
    return [lo, hi]


class ResultCache:
    """JSON-lines cache of finished units: each line {"key": ..., "fingerprint": ..., ...}. Lines of another
    fingerprint (another setup) are ignored; a torn last line (a killed run) is skipped."""

    def __init__(self, path: str | Path, fingerprint: dict) -> None:
        self.path, self.fp = Path(path), json.dumps(fingerprint, sort_keys=True)
        self.rows: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("fingerprint") == self.fp:
                    self.rows[row["key"]] = row

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def put(self, key: str, row: dict) -> None:
        row = dict(row, key=key, fingerprint=self.fp)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows[key] = row


def _unit(kind: str, name: str, *parts) -> str:
    return "|".join([kind, name, *map(str, parts)])


def score_segments(model: LlamaModel, specs: dict[str, KVSpec], token_ids: Sequence[int], setup: QualitySetup,
                   cache: ResultCache, reference: str = "fp16", memo: bool = True,
                   log: Callable[[str], None] = print, compute: bool = True) -> dict[str, list[dict | None]]:
    """Per-segment results {name: [row or None per segment]} (row: segment, nll, kl, top1, tokens), computing only
    what `cache` lacks (nothing with compute=False: missing units stay None). The reference reruns with any segment
    that has missing configurations (KL needs its logits)."""
    kivi = {n: s.kivi for n, s in specs.items()}
    runners: dict = {}
    for i in range(setup.segments):
        missing = [n for n in specs if cache.get(_unit("seg", n, i)) is None]
        if not missing or not compute:
            continue
        names = [reference] + [n for n in missing if n != reference]
        for n in names:
            if n not in runners:
                runners[n] = make_runner(model, specs[n], 1, setup.segment_len, "memo" if memo else "reference")
        one = QualitySetup(1, setup.segment_len, setup.prefix, setup.max_chunk, setup.offset + i * setup.segment_len, 1)
        start = time.time()
        res = evaluate_quality(model, {n: runners[n] for n in names}, kivi, token_ids, one, reference,
                               record_layers=False)
        for n in names:
            if n == reference and reference not in missing:
                continue
            row = res["configs"][n]
            cache.put(_unit("seg", n, i), {"kind": "seg", "kv": n, "segment": i, "nll": row["nll"],
                                           "tokens": row["scored_tokens"], "kl": row.get("kl_mean", 0.0),
                                           "top1": row.get("top1_agreement", 1.0)})
        log(f"segment {i}: {len(names)} configurations in {time.time() - start:.0f} s ({', '.join(names)})")
    return {n: [cache.get(_unit("seg", n, i)) for i in range(setup.segments)] for n in specs}


def passkey_cells(model: LlamaModel, specs: dict[str, KVSpec], prompts: dict[tuple[int, float], PasskeyPrompt],
                  cache: ResultCache, reference: str = "fp16", max_config_lengths: int = 0, memo: bool = True,
                  log: Callable[[str], None] = print, compute: bool = True) -> dict:
    """Passkey: the reference at every (length, depth); the other configurations at the lengths where it passes at
    every depth (the longest max_config_lengths of them when > 0). Cached per (configuration, length, depth); with
    compute=False only cached cells are used (a configuration without any gets no summary)."""
    lengths = sorted({n for n, _ in prompts})
    depths = sorted({d for _, d in prompts})
    longest = max(p.num_tokens for p in prompts.values())

    def cells(name: str, ns: Sequence[int]) -> list[dict]:
        out, runner = [], None  # one runner per configuration, dropped after it (the caches are large)
        for n in ns:
            for d in depths:
                key = _unit("pk", name, n, d)
                if cache.get(key) is None and not compute:
                    continue
                if cache.get(key) is None:
                    runner = runner or make_runner(model, specs[name], 1, longest, "memo" if memo else "reference")
                    r = run_passkey(runner, prompts[(n, d)])
                    cache.put(key, {"kind": "pk", "kv": name, "length": n, "depth": d} | r.to_dict())
                    log(f"passkey {name} length {n} depth {d}: {'pass' if r.passed else 'fail'}")
                row = cache.get(key)
                if row is not None:
                    out.append(row)
        return out

    results = {reference: cells(reference, lengths)}
    all_pass = [n for n in lengths if all(c["passed"] for c in results[reference] if c["length"] == n)]
    eval_lengths = all_pass or lengths
    if max_config_lengths > 0:
        eval_lengths = eval_lengths[-max_config_lengths:]
    for name in specs:
        if name != reference:
            results[name] = cells(name, eval_lengths)
    summary = {}
    for name, cs in results.items():
        cs = [c for c in cs if c["length"] in eval_lengths]
        if not cs:
            continue
        summary[name] = summarize([PasskeyResult(c["passed"], c["ranks"], c["logprobs"]) for c in cs])
    return {"lengths": lengths, "depths": depths, "reference_pass_lengths": all_pass, "eval_lengths": eval_lengths,
            "results": results, "summary": summary}


def recipe_table(specs: dict[str, KVSpec], segs: dict[str, list[dict | None]], geom: Geometry, reference: str,
                 setup: QualitySetup, passkey: dict | None = None, resamples: int = 2000) -> dict:
    """quality_recipes.json: one entry per configuration keyed by its --kv string (see the module doc)."""
    def ppl(rows: list[float], idx: list[int]) -> float:
        return math.exp(sum(rows[i] for i in idx) / len(idx))

    def _ppl_delta(a: list[float], b: list[float], idx: list[int]) -> float:
        return 100 * (ppl(a, idx) / ppl(b, idx) - 1)

    entries = {}
    for name, spec in specs.items():
        both = [i for i, (r, f) in enumerate(zip(segs[name], segs[reference], strict=True))
                if r is not None and f is not None]
        if not both:
            continue
        rows: list[dict] = [segs[name][i] or {} for i in both]  # paired with the reference on the same segments
        ref_nll = [(segs[reference][i] or {})["nll"] for i in both]
        n = len(both)
        nll = [r["nll"] for r in rows]
        kl = [r["kl"] for r in rows]
        every = list(range(n))
        c = spec.kivi
        e = {"k_bits": c.k_bits if c else 16, "v_bits": c.v_bits if c else 16,
             "key_grouping": c.key_grouping if c else None,
             "rotation": {"k": _rot(c.k_rotation) if c else "none", "v": _rot(c.v_rotation) if c else "none"},
             "sink_tokens": c.sink_tokens if c else 0, "group_size": c.group_size if c else None,
             "residual_length": c.residual_length if c else None,
             "ppl": ppl(nll, every),
             "ppl_delta_pct": 100 * (ppl(nll, every) / ppl(ref_nll, every) - 1),
             "ppl_delta_ci95": bootstrap_ci(partial(_ppl_delta, nll, ref_nll), n, resamples) if n > 1 else None,
             "kl_mean": sum(kl) / n,
             "kl_ci95": bootstrap_ci(partial(_mean_at, kl), n, resamples) if n > 1 else None,
             "top1": sum(r["top1"] for r in rows) / n,
             "bits_per_element": {str(t): round(bits_per_element(c, geom, t), 4) for t in CONTEXTS},
             "passkey_pass_rate": (passkey or {}).get("summary", {}).get(name, {}).get("pass_rate"),
             "segments": n, "segment_ids": both, "segment_nll": nll, "segment_kl": kl}
        entries[name] = e
    return {"reference": reference, "segments": max(e["segments"] for e in entries.values()),
            "segment_len": setup.segment_len, "prefix": setup.prefix,
            "offset": setup.offset, "bootstrap_resamples": resamples, "configs": entries,
            "passkey": {k: v for k, v in (passkey or {}).items() if k != "results"} if passkey else None,
            "setup": asdict(setup)}


def _rot(r) -> str | list[str]:
    return r if isinstance(r, str) else list(r)


def recipe_markdown(table: dict, title: str = "") -> str:
    """Markdown table of recipe_table's result."""
    ref = table["reference"]
    lines = [title, ""] if title else []
    lines += [f"| KV recipe | segments | K/V bits | rotation K/V | sinks | bits/elem @2K | @8K | @32K | PPL | "
              f"ΔPPL vs {ref} [95% CI] | KL({ref} ‖ cfg) [95% CI] | top-1 | passkey |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for name, e in table["configs"].items():
        rot = "/".join(x if isinstance(x, str) else f"per-layer ({sum(y == 'hadamard' for y in x)}/{len(x)})"
                       for x in (e["rotation"]["k"], e["rotation"]["v"]))
        b = e["bits_per_element"]
        pk = "—" if e["passkey_pass_rate"] is None else f"{e['passkey_pass_rate']:.2f}"
        ci, kci = e["ppl_delta_ci95"], e["kl_ci95"]
        cis = f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "(1 segment: no CI)"
        kcis = f"[{kci[0]:.4f}, {kci[1]:.4f}]" if kci else ""
        lines.append(f"| {name} | {e['segments']} | {e['k_bits']}/{e['v_bits']} | {rot} | {e['sink_tokens']} | "
                     f"{b['2048']:.2f} | {b['8192']:.2f} | {b['32768']:.2f} | {e['ppl']:.3f} | "
                     f"{e['ppl_delta_pct']:+.2f}% {cis} | {e['kl_mean']:.4f} {kcis} | {e['top1']:.3f} | {pk} |")
    return "\n".join(lines) + "\n"
