"""The KV cache spec shared by every CLI (run, eval, bench): `--kv NAME` plus KiviConfig knobs -> a cache factory.

Names: fp16 | bf16 | fp32            unquantized cache (FullCache) storing K/V in that dtype
       kivi2 | kivi4 | kivi8          KIVI, keys per channel, values per token, k_bits = v_bits
       k4v2, k2v4, k8v4, ...          KIVI with separate key/value bits
       naive2 | naive4 | naive8       control: keys quantized per token (key_grouping=per_token), same bits
Knobs (KV_OPTIONS: k_bits, v_bits, group_size, residual_length, block_size, scale_dtype) override the name's KIVI
settings; they do not apply to unquantized caches and are ignored there. The CLI flags are in commands/flags.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import FullCache, KiviCache, KVCache
from ..format import SUPPORTED_BITS, Geometry, KiviConfig

FULL_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# KiviConfig fields a --kv spec's knobs may override (the CLI flags --k-bits ... --scale-dtype)
KV_OPTIONS = ("k_bits", "v_bits", "group_size", "residual_length", "block_size", "scale_dtype")
KV_HELP = ("KV cache: fp16|bf16|fp32 (unquantized), kivi2|kivi4|kivi8, k<bits>v<bits> (e.g. k4v2), "
           "naive2|naive4|naive8 (keys per token)")


@dataclass(frozen=True)
class KVSpec:
    """A KV cache choice: `kivi` is None for an unquantized cache of `full_dtype`."""

    name: str
    kivi: KiviConfig | None = None
    full_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, cfg: KiviConfig) -> KVSpec:
        """The spec of a KiviConfig (e.g. a build folder's), named as --kv would name its bits and grouping."""
        if cfg.key_grouping == "per_token":
            name = f"naive{cfg.k_bits}" if cfg.k_bits == cfg.v_bits else f"naive-k{cfg.k_bits}v{cfg.v_bits}"
        else:
            name = f"kivi{cfg.k_bits}" if cfg.k_bits == cfg.v_bits else f"k{cfg.k_bits}v{cfg.v_bits}"
        return cls(name, kivi=cfg)

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
        return (f"{self.name} (K {c.k_bits}-bit {c.key_grouping.replace('_', '-')}, V {c.v_bits}-bit per-token, "
                f"G={c.group_size}, R={c.residual_length}, block={c.block_size}, scales {c.scale_dtype})")


def parse_kv(spec: str, k_bits: int | None = None, v_bits: int | None = None, group_size: int | None = None,
             residual_length: int | None = None, block_size: int | None = None,
             scale_dtype: str | None = None) -> KVSpec:
    """Parse a --kv name (see the module doc) with optional KiviConfig overrides."""
    s = spec.strip().lower()
    if s in FULL_DTYPES:
        return KVSpec(s, full_dtype=FULL_DTYPES[s])
    if m := re.fullmatch(r"(kivi|naive)(\d+)", s):
        kb = vb = int(m.group(2))
        grouping = "per_token" if m.group(1) == "naive" else "per_channel"
    elif m := re.fullmatch(r"k(\d+)v(\d+)", s):
        kb, vb, grouping = int(m.group(1)), int(m.group(2)), "per_channel"
    else:
        raise ValueError(f"--kv {spec!r} is not a KV cache spec; allowed: fp16, bf16, fp32, kivi<b>, naive<b>, "
                         f"k<b>v<b> with b in {SUPPORTED_BITS}")
    over = dict(k_bits=k_bits, v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                block_size=block_size, scale_dtype=scale_dtype)
    base: dict[str, Any] = dict(k_bits=kb, v_bits=vb, key_grouping=grouping)
    base |= {k: v for k, v in over.items() if v is not None}
    cfg = KiviConfig(**base)
    return KVSpec(s, kivi=cfg)


__all__ = ["KVSpec", "parse_kv", "FULL_DTYPES", "KV_HELP", "KV_OPTIONS"]
