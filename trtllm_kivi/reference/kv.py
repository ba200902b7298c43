"""K and V quantization in the store's layouts (see trtllm_kivi/format.py).

Keys (KIVI, per channel): one scale/zero per channel over G consecutive tokens; codes packed along tokens.
Keys (naive control, per token) and values: one scale/zero per Gv = min(G, D) channels of one token; codes packed
along channels.
"""

from __future__ import annotations

import torch

from ..format import KiviConfig
from .quant import dequantize_along, pack, quantize_along, torch_dtype, unpack


def quantize_keys(k: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [Hkv, n, D] with n a multiple of G -> codes, scale, zero in the k_* layouts (without the block axis):
    per_channel: codes [Hkv, n // (32 // k_bits), D], scale/zero [Hkv, n // G, D];
    per_token:   codes [Hkv, n, D // (32 // k_bits)],  scale/zero [Hkv, n, D // Gv]."""
    sdt = torch_dtype(cfg.scale_dtype)
    if cfg.key_grouping == "per_channel":
        codes, scale, zero = quantize_along(k, dim=1, group=cfg.group_size, bits=cfg.k_bits, scale_dtype=sdt)
        return pack(codes, cfg.k_bits, dim=1), scale, zero
    gv = cfg.value_group_size(k.shape[-1])
    codes, scale, zero = quantize_along(k, dim=2, group=gv, bits=cfg.k_bits, scale_dtype=sdt)
    return pack(codes, cfg.k_bits, dim=2), scale, zero


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cfg: KiviConfig, n: int,
                    head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_keys -> k [Hkv, n, D] in out_dtype."""
    if cfg.key_grouping == "per_channel":
        c = unpack(codes, cfg.k_bits, n, dim=1)
        return dequantize_along(c, scale[:, : n // cfg.group_size], zero[:, : n // cfg.group_size], dim=1,
                                group=cfg.group_size, out_dtype=out_dtype)
    c = unpack(codes[:, :n], cfg.k_bits, head_dim, dim=2)
    gv = cfg.value_group_size(head_dim)
    return dequantize_along(c, scale[:, :n], zero[:, :n], dim=2, group=gv, out_dtype=out_dtype)


def quantize_values(v: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [Hkv, n, D] -> codes [Hkv, n, D // (32 // v_bits)], scale/zero [Hkv, n, D // Gv]."""
    gv = cfg.value_group_size(v.shape[-1])
    codes, scale, zero = quantize_along(v, dim=2, group=gv, bits=cfg.v_bits,
                                        scale_dtype=torch_dtype(cfg.scale_dtype))
    return pack(codes, cfg.v_bits, dim=2), scale, zero


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cfg: KiviConfig,
                      head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_values -> v [Hkv, n, D] in out_dtype."""
    c = unpack(codes, cfg.v_bits, head_dim, dim=2)
    return dequantize_along(c, scale, zero, dim=2, group=cfg.value_group_size(head_dim), out_dtype=out_dtype)
