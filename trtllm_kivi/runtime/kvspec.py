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
settings; they do not apply to unquantized caches and are ignored there.

resolve_kv is the one way in for every source of a KV choice: the CLI (--kv, the knobs, --kv-config; commands/flags.py
only collects them), a build folder's config, a Triton serving.json (kv, kv_options), TorchRunner.create and the
transformers adapter (hf.KiviCache). It parses with parse_kv, reads --kv-config files, checks that what was given
agrees with an authoritative config (a --kv-config file, a build folder), and words every error one way: the flag
and the value given first (`--kv 'int4'`, `--group-size 64`), then what is wrong, then what is allowed or what it
contradicts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache import FullCache, KiviCache, KVCache
from ..format import DEFAULT_GROUP_SIZE, DEFAULT_RESIDUAL_LENGTH, SUPPORTED_BITS, Geometry, KiviConfig

DEFAULT_KV = "kivi2"
FULL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# KiviConfig fields a --kv spec's knobs may override (the CLI flags --k-bits ... --scale-dtype)
KV_OPTIONS = ("k_bits", "v_bits", "group_size", "residual_length", "block_size", "scale_dtype")
NAMELESS_OPTIONS = ("block_size", "scale_dtype")  # knobs a recipe name does not spell (recipe_name)
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

    def options(self) -> dict[str, Any]:
        """The knobs (KV_OPTIONS) that, with this spec's name, give back its exact config: parse_kv(name,
        **options()) == this spec (what a serving.json stores). Raises ValueError if the name cannot say it."""
        if self.kivi is None:
            return {}
        named = parse_kv(self.name, num_layers=_rotation_layers(self.kivi)).kivi
        assert named is not None
        opts = {k: getattr(self.kivi, k) for k in KV_OPTIONS if getattr(self.kivi, k) != getattr(named, k)}
        if parse_kv(self.name, num_layers=_rotation_layers(self.kivi), **opts).kivi != self.kivi:
            raise ValueError(f"--kv {self.name!r} with knobs {opts} does not give back its config "
                             f"({self.describe()}); allowed: a name parse_kv reads ({KV_HELP})")
        return opts

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
    given = {k: v for k, v in over.items() if v is not None}
    try:
        cfg = KiviConfig(**(base_cfg | given))
    except ValueError as e:  # KiviConfig names the field, the value and the allowed range
        raise ValueError(f"{_given(spec, given)}: {e}") from None
    return KVSpec(s, kivi=cfg)


def _flag(option: str) -> str:
    """k_bits -> --k-bits."""
    return "--" + option.replace("_", "-")


def _given(spec: str, options: Mapping[str, Any]) -> str:
    """`--kv 'kivi2' --group-size 48`: a KV choice as it was given."""
    return " ".join([f"--kv {spec!r}"] + [f"{_flag(k)} {v!r}" for k, v in options.items()])


def _rotation_layers(cfg: KiviConfig) -> int | None:
    """The layer count a per-layer rotation is sized to (None when both rotations are global)."""
    sized = [r for r in (cfg.k_rotation, cfg.v_rotation) if not isinstance(r, str)]
    return len(sized[0]) if sized else None


def _contradiction(given: str, origin: str, theirs: str, remedy: str) -> ValueError:
    return ValueError(f"{given} contradicts {origin} ({theirs}); {remedy}")


def _check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The knobs that were given (None = not given), refusing names that are not knobs."""
    given = {k: v for k, v in (options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(KV_OPTIONS))
    if unknown:
        raise ValueError(f"KV options {unknown} are not knobs of a KV cache spec; allowed: {', '.join(KV_OPTIONS)}")
    return given


def resolve_kv(kv: str | KVSpec | None = None, options: Mapping[str, Any] | None = None, *,
               config_file: str | Path | None = None, build: KiviConfig | None = None,
               build_origin: str = "the build folder", default: str = DEFAULT_KV, many: bool = False,
               num_layers: int | None = None, needs_kivi: str | None = None) -> list[KVSpec]:
    """Every KV choice, parsed and validated once (see the module doc) -> its KVSpecs.

    kv: a name or recipe (a comma-separated list with many=True; None: `default`), or an already parsed KVSpec
    (then no options). options: the knobs given (KV_OPTIONS; None values = not given). config_file (--kv-config)
    and build (a build folder's config, named `build_origin` in errors) are authoritative: the spec is theirs, and a
    --kv or knob that was given must agree with them (a --kv name agrees when it is the config's name or parses,
    with the knobs given and the block size / scale dtype of the config, to that config). num_layers sizes per-layer rotations. needs_kivi: what
    needs a KIVI cache (e.g. "a build"); an unquantized spec is then refused."""
    given = _check_options(options)
    if isinstance(kv, KVSpec):
        if given:
            raise ValueError(f"--kv {kv.name!r} is an already parsed KVSpec: give the knobs {sorted(given)} to "
                             f"parse_kv, not next to it")
        specs = [kv]
    else:
        fixed: list[tuple[str, KVSpec, str]] = []  # (origin, spec, remedy)
        if config_file:
            fixed.append((f"--kv-config {config_file}", read_kv_config(config_file), "give one of them"))
        if build is not None:
            fixed.append((build_origin, KVSpec.of(build), "a build folder runs the cache it was built for"))
        if len(fixed) == 2 and fixed[0][1].kivi != fixed[1][1].kivi:
            raise _contradiction(f"--kv-config {config_file} (kv {fixed[0][1].name!r})", build_origin,
                                 f"kv {fixed[1][1].name!r}: {fixed[1][1].describe()}", fixed[1][2])
        if fixed:
            specs = [_agree(kv, given, *fixed[-1])]
        else:
            text = kv if kv is not None else default
            names = [n.strip() for n in text.split(",") if n.strip()] if many else [text]
            if not names:
                raise ValueError(f"--kv {text!r} names no KV cache; allowed: {KV_HELP}")
            specs = [parse_kv(n, num_layers=num_layers, **given) for n in names]
    for spec in specs:
        if needs_kivi and spec.kivi is None:
            raise ValueError(f"--kv {spec.name!r}: {needs_kivi} needs a KIVI cache (kivi2, kivi4, k4v2, naive2, ...); "
                             f"{spec.name} is unquantized")
    return specs


def _agree(kv: str | None, given: dict[str, Any], origin: str, spec: KVSpec, remedy: str) -> KVSpec:
    """`spec` (from an authoritative origin) if the --kv name and the knobs given agree with it."""
    cfg = spec.kivi
    assert cfg is not None  # a KV config file and a build folder hold KIVI configs
    for name, value in given.items():
        if getattr(cfg, name) != value:
            raise _contradiction(f"{_flag(name)} {value!r}", origin, f"{name}={getattr(cfg, name)!r}", remedy)
    if kv is not None and kv.strip().lower() != spec.name:
        rest = {k: getattr(cfg, k) for k in NAMELESS_OPTIONS if k not in given}
        mine = parse_kv(kv, num_layers=_rotation_layers(cfg), **given, **rest)
        if mine.kivi != cfg:
            raise _contradiction(f"--kv {kv!r} ({mine.describe()})", origin, f"kv {spec.name!r}: "
                                 f"{spec.describe()}", remedy)
    return spec


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

__all__ = ["KVSpec", "parse_kv", "resolve_kv", "recipe_name", "read_kv_config", "write_kv_config", "DEFAULT_KV",
           "FULL_DTYPES", "KV_HELP", "KV_OPTIONS", "KV_CONFIG_KIND"]
