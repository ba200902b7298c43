"""Recipe search: choose rotation per layer (K and V) from a cheap per-layer criterion on the user's text, confirm
with the decode-mode eval, return the cheapest recipe within a quality budget.

Per-layer criterion (`layer_errors`): one FP16 prefill of a calibration text records every layer's post-RoPE q, k
and v. For each layer and each of K and V, the stored state after the whole text is built with the reference
(reference.attention.append: the streaming state is chunk-invariant, so one append equals the decode-time state),
with and without the Hadamard rotation, and the attention output of the last `queries` positions is compared with
exact attention (relative L2 error; K quantized with V exact, and V quantized with K exact, so the two choices are
separable). A layer rotates K (or V) only when that lowers its error by more than `margin`.

Search (`recommend`): bit levels in order of cost (kivi2, k4v2, kivi4 by default); at each level the plain paper
KIVI, the same with sinks, and sinks + the per-layer rotation are scored in decode mode (eval/recipes.py, resumable,
paired bootstrap CIs). A candidate that measured worse than the plain KIVI of its level (in dPPL or KL) is dropped;
the first level with a candidate within budget gives the answer (`choose`): among its candidates within
`bit_tolerance` bits/element (at `context` tokens) of the cheapest one, the lowest KL (then dPPL) — so the search
never trades half the KL for 0.01 bit — and the reason is logged.

Scale dtype (`scale_dtype_for`): the calibration prefill also gives every layer's largest |K| and |V| as stored
(plain and rotated). Beyond fp16's range a KIVI group's scale or zero would overflow, so the search then measures
with bf16 scales (logged), or refuses when fp16 scales were asked for explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Sequence

import torch

from ..cache import FullCache
from ..format import Geometry, KiviConfig
from ..models.llama import LlamaModel
from ..reference.attention import KiviBuffers, append, attend, history
from ..reference.rotation import rotate, unrotate
from ..runtime.kvspec import KVSpec, parse_kv, recipe_name
from ..runtime.torch_runner import TorchRunner
from .quality import QualitySetup
from .recipes import ResultCache, bits_per_element, recipe_table, score_segments


class _RecordingCache(FullCache):
    """An FP16-style full cache that also keeps every layer's post-RoPE q, k, v of each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def attention(self, layer, q, k, v, step):
        self.seen[layer] = (q.detach().clone(), k.detach().clone(), v.detach().clone())
        return super().attention(layer, q, k, v, step)


def record_qkv(model: LlamaModel, tokens: Sequence[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{layer: (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])} of one prefill of `tokens` with an unquantized cache."""
    cache = _RecordingCache(model.cfg.geometry, 1, len(tokens), torch.float32)
    runner = TorchRunner(model, cache)
    slot = runner.add_sequence()
    runner.step([slot], [list(tokens)])
    return cache.seen


def _stored(x_k: torch.Tensor, x_v: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [Hkv, T, D] -> the dequantized stored state after T tokens (sinks and window in full precision)."""
    hkv, t, d = x_k.shape
    blocks = max(1, math.ceil(cfg.num_quantized(t) / cfg.block_size))
    buf = KiviBuffers.allocate(cfg, hkv, d, blocks, 1, x_k.dtype)
    table = torch.arange(blocks, dtype=torch.int32)
    append(buf, cfg, 0, table, 0, x_k, x_v)
    return history(buf, cfg, 0, table, t)


@dataclass
class LayerErrors:
    """Relative attention-output error of each layer with K (or V) quantized, plain and Hadamard-rotated."""

    k_plain: list[float] = field(default_factory=list)
    k_rot: list[float] = field(default_factory=list)
    v_plain: list[float] = field(default_factory=list)
    v_rot: list[float] = field(default_factory=list)
    k_absmax: list[float] = field(default_factory=list)  # largest |K| the cache would store (plain or rotated)
    v_absmax: list[float] = field(default_factory=list)

    def choose(self, margin: float = 0.05) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(k_rotation, v_rotation) per layer: hadamard where it lowers the error by more than `margin`."""
        pick = lambda rot, plain: tuple("hadamard" if r < (1 - margin) * p else "none"  # noqa: E731
                                        for r, p in zip(rot, plain, strict=True))
        return pick(self.k_rot, self.k_plain), pick(self.v_rot, self.v_plain)


def layer_errors(model: LlamaModel, tokens: Sequence[int], cfg: KiviConfig, queries: int = 256,
                 seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> LayerErrors:
    """The per-layer criterion (module doc) for cfg's bits, group size, residual length and sinks (`seen`: a
    record_qkv of `tokens` already made, e.g. for another bit level)."""
    seen = record_qkv(model, tokens) if seen is None else seen
    t = len(tokens)
    q0 = max(0, t - queries)
    base = replace(cfg, k_rotation="none", v_rotation="none")
    out = LayerErrors()
    for layer in range(len(model.layers)):
        q, k, v = seen[layer]
        q, k, v = q.float(), k.float().transpose(0, 1), v.float().transpose(0, 1)  # k/v [Hkv, T, D]
        exact = attend(q[q0:], k, v, q0)  # [queries, H, D]
        ref_norm = exact.norm()
        out.k_absmax.append(max(float(rotate(k, r).abs().max()) for r in ("none", "hadamard")))
        out.v_absmax.append(max(float(rotate(v, r).abs().max()) for r in ("none", "hadamard")))
        for rot in ("none", "hadamard"):
            kr, vr, qr = rotate(k, rot), rotate(v, rot), rotate(q, rot)
            kq, vq = _stored(kr, vr, base)
            err_k = (attend(qr[q0:], kq, v, q0) - exact).norm() / ref_norm  # K quantized, V exact
            err_v = (unrotate(attend(q[q0:], k, vq, q0), rot) - exact).norm() / ref_norm  # V quantized, K exact
            (out.k_plain if rot == "none" else out.k_rot).append(float(err_k))
            (out.v_plain if rot == "none" else out.v_rot).append(float(err_v))
    return out


@dataclass
class Budget:
    max_ppl_increase_pct: float = 2.0
    max_kl: float | None = None

    def admits(self, entry: dict) -> bool:
        return entry["ppl_delta_pct"] <= self.max_ppl_increase_pct and (
            self.max_kl is None or entry["kl_mean"] <= self.max_kl)


def scale_dtype_for(errors: LayerErrors, requested: str | None) -> tuple[str | None, str]:
    """(scale dtype to measure with, why): None keeps the configuration's own (fp16 by default) when every stored
    |K|, |V| of the calibration fits fp16; bfloat16 when one does not and none was asked for; ValueError when
    float16 was asked for and one does not fit."""
    limit = torch.finfo(torch.float16).max
    worst = max(((m, "K", i) for i, m in enumerate(errors.k_absmax)), default=(0.0, "K", 0))
    worst = max(worst, max(((m, "V", i) for i, m in enumerate(errors.v_absmax)), default=worst))
    m, which, layer = worst
    if m <= limit:
        return requested, f"largest stored |K|/|V| {m:.4g} (layer {layer} {which}) fits fp16 scales"
    if requested in ("float16", "fp16", "half"):
        raise ValueError(f"layer {layer}: calibration |{which}| reaches {m:.4g}, beyond fp16 scales/zeros (max "
                         f"{limit:.6g}): KIVI groups would store inf/NaN; use --scale-dtype bfloat16 or float32")
    if requested is not None:
        return requested, f"largest stored |K|/|V| {m:.4g} (layer {layer} {which}); scales in {requested} as asked"
    return "bfloat16", (f"layer {layer}: calibration |{which}| reaches {m:.4g}, beyond fp16 scales/zeros (max "
                        f"{limit:.6g}): measuring with bfloat16 scales")


def choose(names: Sequence[str], bits: dict[str, float], entries: dict[str, dict], bit_tolerance: float
           ) -> tuple[str, str]:
    """Among admitted candidates: those within bit_tolerance bits/element of the cheapest, then the lowest KL, then
    the lowest dPPL. Returns (name, why)."""
    cheapest = min(names, key=lambda n: (bits[n], entries[n]["kl_mean"]))
    pool = [n for n in names if bits[n] <= bits[cheapest] + bit_tolerance]
    best = min(pool, key=lambda n: (entries[n]["kl_mean"], entries[n]["ppl_delta_pct"], bits[n]))
    e = entries[best]
    why = f"{best}: {bits[best]:.2f} bits/element, KL {e['kl_mean']:.4f}, dPPL {e['ppl_delta_pct']:+.2f}%"
    others = [n for n in pool if n != best]
    if best != cheapest:
        c = entries[cheapest]
        why += (f"; chosen over the cheapest admitted {cheapest} ({bits[cheapest]:.2f} bits/element, KL "
                f"{c['kl_mean']:.4f}): {bits[best] - bits[cheapest]:.2f} more bits/element (within the "
                f"{bit_tolerance} tolerance) for the lowest KL")
    elif others:
        why += f"; the cheapest admitted, and the lowest KL of the {len(pool)} within {bit_tolerance} bits/element"
    else:
        why += f"; the cheapest admitted (no other within {bit_tolerance} bits/element)"
    return best, why


def candidates(level: str, errors: LayerErrors, sinks: int, margin: float, knobs: dict | None = None
               ) -> dict[str, KVSpec]:
    """plain KIVI of the level, + sinks, + sinks and the per-layer rotation (when any layer rotates). knobs:
    parse_kv overrides (e.g. residual_length) applied to all of them."""
    out = {}
    plain = parse_kv(level, **(knobs or {}))
    out[plain.name] = plain
    if sinks:
        s = parse_kv(f"{level}+sink{sinks}", **(knobs or {}))
        out[s.name] = s
    k_rot, v_rot = errors.choose(margin)
    assert plain.kivi is not None, f"{level} is not a KIVI level"
    cfg = replace(plain.kivi, sink_tokens=sinks, k_rotation=k_rot, v_rotation=v_rot)
    if cfg.rotated:
        name = recipe_name(cfg)
        out[name] = KVSpec(name, kivi=cfg)
    return out


def recommend(model: LlamaModel, token_ids: Sequence[int], setup: QualitySetup, cache: ResultCache, budget: Budget,
              levels: Sequence[str] = ("kivi2", "k4v2", "kivi4"), sinks: int = 4, margin: float = 0.05,
              calibration: Sequence[int] | None = None, context: int = 8192, resamples: int = 2000,
              knobs: dict | None = None, log: Callable[[str], None] = print, bit_tolerance: float = 0.05,
              criteria: dict[str, LayerErrors] | None = None) -> dict:
    """Run the search (module doc). Returns {"chosen": name or None, "spec": KVSpec or None, "why": the reason
    for the choice, "table": the measured entries, "criterion": per-level LayerErrors, "rejected": why each
    candidate was dropped, "scale_dtype": the scale dtype measured and why}. criteria: per-level LayerErrors
    already measured on the same calibration text (not recomputed)."""
    geom: Geometry = model.cfg.geometry
    calib = list(calibration if calibration is not None else token_ids[setup.offset:setup.offset + setup.segment_len])
    fp16 = parse_kv("fp16")
    measured: dict[str, dict] = {}
    rejected: dict[str, str] = {}
    specs_all = {"fp16": fp16}
    known, criteria = dict(criteria or {}), {}
    seen = None
    knobs = dict(knobs or {})
    scale_note = None
    for level in levels:
        plain_spec = parse_kv(level, **knobs)
        if plain_spec.kivi is None:
            raise ValueError(f"recommend level {level!r} is not a KIVI spec; allowed: kivi2, k4v2, kivi4, ...")
        if level in known:
            errors = known[level]
        else:
            seen = seen if seen is not None else record_qkv(model, calib)  # one prefill serves every level
            errors = layer_errors(model, calib, replace(plain_spec.kivi, sink_tokens=sinks), seen=seen)
        if scale_note is None:
            dtype, scale_note = scale_dtype_for(errors, knobs.get("scale_dtype"))
            log(f"scale dtype: {scale_note}")
            if dtype is not None and dtype != knobs.get("scale_dtype"):
                knobs["scale_dtype"] = dtype
                plain_spec = parse_kv(level, **knobs)
        criteria[level] = errors
        specs = candidates(level, errors, sinks, margin, knobs)
        log(f"{level}: per-layer rotation chosen for K in {sum(x == 'hadamard' for x in errors.choose(margin)[0])}"
            f"/{geom.num_layers} layers, V in {sum(x == 'hadamard' for x in errors.choose(margin)[1])}; "
            f"candidates {', '.join(specs)}")
        specs_all |= specs
        run = {"fp16": fp16} | specs
        segs = score_segments(model, run, token_ids, setup, cache, "fp16", True, log)
        table = recipe_table(run, segs, geom, "fp16", setup, None, resamples)["configs"]
        measured |= {n: table[n] for n in specs}
        plain = table[plain_spec.name]
        ok = []
        for name in specs:
            e = table[name]
            if name != plain_spec.name and (e["ppl_delta_pct"] > plain["ppl_delta_pct"]
                                                  or e["kl_mean"] > plain["kl_mean"]):
                rejected[name] = f"measured worse than plain {level}"
                continue
            if not budget.admits(e):
                rejected[name] = (f"outside the budget (dPPL {e['ppl_delta_pct']:+.2f}%, KL {e['kl_mean']:.4f})")
                continue
            ok.append(name)
        if ok:
            bits = {n: bits_per_element(specs[n].kivi, geom, context) for n in ok}
            best, why = choose(ok, bits, measured, bit_tolerance)
            log(f"chose {why}")
            return {"chosen": best, "spec": specs_all[best], "why": why, "table": measured, "criterion": criteria,
                    "rejected": rejected, "scale_dtype": scale_note}
    return {"chosen": None, "spec": None, "why": None, "table": measured, "criterion": criteria,
            "rejected": rejected, "scale_dtype": scale_note}
