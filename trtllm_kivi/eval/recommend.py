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
the first level with a candidate within budget gives the answer: its cheapest such candidate (bits/element at the
longest context), ties broken by dPPL.
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

    def choose(self, margin: float = 0.05) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(k_rotation, v_rotation) per layer: hadamard where it lowers the error by more than `margin`."""
        pick = lambda rot, plain: tuple("hadamard" if r < (1 - margin) * p else "none"  # noqa: E731
                                        for r, p in zip(rot, plain, strict=True))
        return pick(self.k_rot, self.k_plain), pick(self.v_rot, self.v_plain)


def layer_errors(model: LlamaModel, tokens: Sequence[int], cfg: KiviConfig, queries: int = 256) -> LayerErrors:
    """The per-layer criterion (module doc) for cfg's bits, group size, residual length and sinks."""
    seen = record_qkv(model, tokens)
    t = len(tokens)
    q0 = max(0, t - queries)
    base = replace(cfg, k_rotation="none", v_rotation="none")
    out = LayerErrors()
    for layer in range(len(model.layers)):
        q, k, v = seen[layer]
        q, k, v = q.float(), k.float().transpose(0, 1), v.float().transpose(0, 1)  # k/v [Hkv, T, D]
        exact = attend(q[q0:], k, v, q0)  # [queries, H, D]
        ref_norm = exact.norm()
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
              knobs: dict | None = None, log: Callable[[str], None] = print) -> dict:
    """Run the search (module doc). Returns {"chosen": name or None, "spec": KVSpec or None, "table": the
    measured entries, "criterion": per-level LayerErrors, "rejected": why each candidate was dropped}."""
    geom: Geometry = model.cfg.geometry
    calib = list(calibration if calibration is not None else token_ids[setup.offset:setup.offset + setup.segment_len])
    fp16 = parse_kv("fp16")
    measured: dict[str, dict] = {}
    criteria, rejected, specs_all = {}, {}, {"fp16": fp16}
    for level in levels:
        plain_spec = parse_kv(level, **(knobs or {}))
        if plain_spec.kivi is None:
            raise ValueError(f"recommend level {level!r} is not a KIVI spec; allowed: kivi2, k4v2, kivi4, ...")
        errors = layer_errors(model, calib, replace(plain_spec.kivi, sink_tokens=sinks))
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
            best = min(ok, key=lambda n: (bits_per_element(specs[n].kivi, geom, context),
                                          measured[n]["ppl_delta_pct"]))
            return {"chosen": best, "spec": specs_all[best], "table": measured, "criterion": criteria,
                    "rejected": rejected}
    return {"chosen": None, "spec": None, "table": measured, "criterion": criteria, "rejected": rejected}
