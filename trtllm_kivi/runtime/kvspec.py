"""The KV cache spec shared by every CLI (run, eval, bench): `--kv NAME` plus KiviConfig knobs -> a cache factory.

Names: fp16 | bf16 | fp32            unquantized cache (FullCache) storing K/V in that dtype
       kivi2 | kivi4 | kivi8          KIVI, keys per channel, values per token, k_bits = v_bits
       k4v2, k2v4, k8v4, ...          KIVI with separate key/value bits
       naive2 | naive4 | naive8       control: keys quantized per token (key_grouping=per_token), same bits
These base names mean exactly the KIVI paper's cache (and its control): no sinks, no rotation.

Recipes compose a KIVI base with options joined by `+` (no commas, no spaces; order does not matter):
       sink<S>        the first S tokens stay in full precision (0 <= S <= 128)          kivi2+sink4
       had            Hadamard rotation of K and V in every layer                        kivi2+had
       had:k | had:v | had:kv   rotate only K, only V, or both                           k4v2+had:k
       had:k@<layers>[/N] per-layer choice: layers as a dot-separated list of indices or  kivi2+had:k@1-29/30
                      ranges a-b (inclusive), /N the model's num_layers (written by --recommend)
       g<G>           group size G (32, 64, 128)                                         kivi2+g64
       r<R>           residual length R (full-precision window minimum)                  kivi2+r64
e.g. `kivi2+sink4+had`. Rotation is model-dependent (it can make 2-bit KIVI 5x worse on another model family):
measure it with `trtllm-kivi eval --recommend`, which writes a --kv-config file that build/run/eval/triton accept.
Knobs (KV_OPTIONS: k_bits, v_bits, group_size, residual_length, block_size, scale_dtype) override the name's KIVI
settings; they do not apply to unquantized caches and are ignored there. The CLI flags are in commands/flags.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from ..cache import FullCache, KiviCache, KVCache
from ..format import DEFAULT_GROUP_SIZE, DEFAULT_RESIDUAL_LENGTH, SUPPORTED_BITS, Geometry, KiviConfig

FULL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# KiviConfig fields a --kv spec's knobs may override (the CLI flags --k-bits ... --scale-dtype)
KV_OPTIONS = ("k_bits", "v_bits", "group_size", "residual_length", "block_size", "scale_dtype")
KV_HELP = ("KV cache: fp16|bf16|fp32 (unquantized), kivi2|kivi4|kivi8, k<bits>v<bits> (e.g. k4v2), "
           "naive2|naive4|naive8 (keys per token: the paper's control); recipes add +options: sink<S> (first S "
           "tokens in full precision), had | had:k | had:v (Hadamard rotation of K and/or V; had:k@0-3.7 = only in "
           "those layers), g<G>, r<R>; e.g. kivi2+sink4+had. Rotation is model-dependent: see eval --recommend")


@dataclass(frozen=True)
class KVSpec:
    """A KV cache choice: `kivi` is None for an unquantized cache of `full_dtype`."""

    name: str
    kivi: KiviConfig | None = None
    full_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, cfg: KiviConfig) -> KVSpec:
        """The spec of a KiviConfig (e.g. a build folder's), named as --kv would name its bits and grouping."""
        return cls(recipe_name(cfg), kivi=cfg)

    @property
    def quantized(self) -> bool:
        return self.kivi is not None

    def make_cache(self, geom: Geometry, max_slots: int, max_seq_len: int, act_dtype: torch.dtype,
                   device: str | torch.device = "cpu", num_blocks: int | None = None,
                   backend: str | None = None) -> KVCache:
        """A fresh cache; the KIVI window holds activations, so it uses the model's dtype (act_dtype). backend: the
        KIVI attention backend (cache.BACKENDS; None = the fastest available)."""
        if self.kivi is None:
            assert self.full_dtype is not None
            return FullCache(geom, max_slots, max_seq_len, self.full_dtype, device)
        return KiviCache(self.kivi, geom, max_slots, max_seq_len, act_dtype, device, num_blocks, backend)

    def describe(self) -> str:
        if self.kivi is None:
            return f"{self.name} (unquantized)"
        c = self.kivi

        def rot(r) -> str:
            return r if isinstance(r, str) else f"hadamard in {sum(x == 'hadamard' for x in r)}/{len(r)} layers"
        return (f"{self.name} (K {c.k_bits}-bit {c.key_grouping.replace('_', '-')}, V {c.v_bits}-bit per-token, "
                f"G={c.group_size}, R={c.residual_length}, sinks={c.sink_tokens}, K rotation {rot(c.k_rotation)}, "
                f"V rotation {rot(c.v_rotation)}, block={c.block_size}, scales {c.scale_dtype})")


def _layers(text: str, spec: str) -> list[int]:
    """`0-3.7.9` -> [0, 1, 2, 3, 7, 9]."""
    out: list[int] = []
    for part in text.split("."):
        if m := re.fullmatch(r"(\d+)(?:-(\d+))?", part):
            a, b = int(m.group(1)), int(m.group(2) or m.group(1))
            if b < a:
                raise ValueError(f"--kv {spec!r}: layer range {part!r} is empty")
            out += range(a, b + 1)
        else:
            raise ValueError(f"--kv {spec!r}: {text!r} is not a layer list (indices or ranges a-b joined by '.')")
    return sorted(set(out))


def _layer_text(layers: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] -> `0-3.7` (inverse of _layers)."""
    parts, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(f"{layers[i]}" if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ".".join(parts)


def _rotation_value(layers: set[int] | None, all_layers: bool, num_layers: int | None, spec: str
                    ) -> str | tuple[str, ...]:
    if all_layers:
        return "hadamard"
    if not layers:
        return "none"
    n = max(layers) + 1 if num_layers is None else num_layers
    if max(layers) >= n:
        raise ValueError(f"--kv {spec!r}: layer {max(layers)} is past the model's num_layers={n}")
    return tuple("hadamard" if i in layers else "none" for i in range(n))


def parse_kv(spec: str, k_bits: int | None = None, v_bits: int | None = None, group_size: int | None = None,
             residual_length: int | None = None, block_size: int | None = None,
             scale_dtype: str | None = None, num_layers: int | None = None) -> KVSpec:
    """Parse a --kv name or recipe (see the module doc) with optional KiviConfig overrides. num_layers sizes a
    per-layer rotation (`had:k@...`); without it the list is as long as its highest layer + 1 and a cache of
    another depth refuses it."""
    s = spec.strip().lower()
    if s in FULL_DTYPES:
        return KVSpec(s, full_dtype=FULL_DTYPES[s])
    base, *opts = s.split("+")
    if m := re.fullmatch(r"(kivi|naive)(\d+)", base):
        kb = vb = int(m.group(2))
        grouping = "per_token" if m.group(1) == "naive" else "per_channel"
    elif m := re.fullmatch(r"k(\d+)v(\d+)", base):
        kb, vb, grouping = int(m.group(1)), int(m.group(2)), "per_channel"
    else:
        raise ValueError(f"--kv {spec!r} is not a KV cache spec; allowed: fp16, bf16, fp32, kivi<b>, naive<b>, "
                         f"k<b>v<b> with b in {SUPPORTED_BITS}, optionally followed by +sink<S>, +had[:k|:v|:kv]"
                         f"[@layers], +g<G>, +r<R>")
    base_cfg: dict[str, Any] = dict(k_bits=kb, v_bits=vb, key_grouping=grouping)
    rot: dict[str, tuple[bool, set[int]]] = {"k": (False, set()), "v": (False, set())}
    seen: set[str] = set()
    for opt in opts:
        if m := re.fullmatch(r"(sink|g|r)(\d+)", opt):
            field = {"sink": "sink_tokens", "g": "group_size", "r": "residual_length"}[m.group(1)]
            if field in seen:
                raise ValueError(f"--kv {spec!r}: {m.group(1)}<n> is given twice")
            seen.add(field)
            base_cfg[field] = int(m.group(2))
        elif m := re.fullmatch(r"had(?::(k|v|kv))?(?:@([\d.-]+)(?:/(\d+))?)?", opt):
            layers = _layers(m.group(2), spec) if m.group(2) else None
            if m.group(3):
                if num_layers is not None and int(m.group(3)) != num_layers:
                    raise ValueError(f"--kv {spec!r} names {m.group(3)} layers but the model has {num_layers}")
                num_layers = int(m.group(3))
            for which in m.group(1) or "kv":
                everywhere, chosen = rot[which]
                rot[which] = (everywhere or layers is None, chosen | set(layers or ()))
        else:
            raise ValueError(f"--kv {spec!r}: option {opt!r} is not one of sink<S>, had, had:k, had:v, had:kv, "
                             f"had:<k|v|kv>@<layers>, g<G>, r<R>")
    for which in "kv":
        everywhere, chosen = rot[which]
        base_cfg[f"{which}_rotation"] = _rotation_value(chosen, everywhere, num_layers, spec)
    over = dict(k_bits=k_bits, v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                block_size=block_size, scale_dtype=scale_dtype)
    base_cfg |= {k: v for k, v in over.items() if v is not None}
    cfg = KiviConfig(**base_cfg)
    return KVSpec(s, kivi=cfg)


def recipe_name(cfg: KiviConfig | None, full: str = "fp16") -> str:
    """The --kv string of a config (inverse of parse_kv up to option order; block size and scale dtype are knobs,
    not part of the name)."""
    if cfg is None:
        return full
    if cfg.key_grouping == "per_token":
        name = f"naive{cfg.k_bits}" if cfg.k_bits == cfg.v_bits else f"naive-k{cfg.k_bits}v{cfg.v_bits}"
    else:
        name = f"kivi{cfg.k_bits}" if cfg.k_bits == cfg.v_bits else f"k{cfg.k_bits}v{cfg.v_bits}"
    if cfg.sink_tokens:
        name += f"+sink{cfg.sink_tokens}"
    k, v = cfg.k_rotation, cfg.v_rotation
    if k == v and isinstance(k, str):
        name += "+had" if k == "hadamard" else ""
    else:
        for which, r in (("k", k), ("v", v)):
            if r == "hadamard":
                name += f"+had:{which}"
            elif isinstance(r, tuple):
                name += (f"+had:{which}@" + _layer_text([i for i, x in enumerate(r) if x == "hadamard"])
                         + f"/{len(r)}")
    if cfg.group_size != DEFAULT_GROUP_SIZE:
        name += f"+g{cfg.group_size}"
    if cfg.residual_length != DEFAULT_RESIDUAL_LENGTH:
        name += f"+r{cfg.residual_length}"
    return name


def write_kv_config(path: str | Path, spec: KVSpec, extra: dict | None = None) -> Path:
    """Write a KV config file (the recipe string and its full KiviConfig), atomically."""
    if spec.kivi is None:
        raise ValueError(f"a KV config file names a KIVI recipe; {spec.name!r} is unquantized")
    path = Path(path)
    doc = {"kind": KV_CONFIG_KIND, "kv": spec.name, "kivi": spec.kivi.to_dict()} | (extra or {})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def read_kv_config(path: str | Path) -> KVSpec:
    """The KVSpec of a KV config file (write_kv_config); the file's KiviConfig is authoritative."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--kv-config {path}: cannot read a JSON KV config ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KV_CONFIG_KIND or "kv" not in doc or "kivi" not in doc:
        raise ValueError(f"--kv-config {path}: not a KV config file (needs kind={KV_CONFIG_KIND!r}, kv, kivi)")
    return KVSpec(str(doc["kv"]), kivi=KiviConfig.from_dict(doc["kivi"]))


KV_CONFIG_KIND = "trtllm-kivi kv config"

__all__ = ["KVSpec", "parse_kv", "recipe_name", "read_kv_config", "write_kv_config", "FULL_DTYPES", "KV_HELP",
           "KV_OPTIONS", "KV_CONFIG_KIND"]
