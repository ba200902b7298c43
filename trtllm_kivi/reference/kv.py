"""K and V quantization in the store's layouts (see trtllm_kivi/format.py).

Keys (KIVI, per channel): one scale/zero per channel over G consecutive tokens; codes in FRAGMENT order.
Values: one scale/zero per Gv = min(G, D) channels of one token; codes in FRAGMENT order.
Keys (naive control, per token): grouped like values, codes in LINEAR order packed along channels.
FRAGMENT order (format.py) stores each 16-token tile in the register order of the mma.sync A operand; the
container shapes are the FORMAT_VERSION 1 ones (same word counts).
"""

from __future__ import annotations

import torch

from ..format import KiviConfig, codes_per_word
from .quant import dequantize_along, pack, pack_fragments, quantize_along, torch_dtype, unpack, unpack_fragments


def quantize_keys(k: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [Hkv, n, D] with n a multiple of G -> codes, scale, zero in the k_* layouts (without the block axis):
    per_channel: codes [Hkv, n // (32 // k_bits), D] (FRAGMENT order), scale/zero [Hkv, n // G, D];
    per_token:   codes [Hkv, n, D // (32 // k_bits)],  scale/zero [Hkv, n, D // Gv]."""
    sdt = torch_dtype(cfg.scale_dtype)
    if cfg.key_grouping == "per_channel":
        codes, scale, zero = quantize_along(k, dim=1, group=cfg.group_size, bits=cfg.k_bits, scale_dtype=sdt)
        hkv, n, d = k.shape
        words = pack_fragments(codes, cfg.k_bits, "keys")  # [Hkv, n * D * k_bits / 32]
        return words.reshape(hkv, n // codes_per_word(cfg.k_bits), d), scale, zero
    gv = cfg.value_group_size(k.shape[-1])
    codes, scale, zero = quantize_along(k, dim=2, group=gv, bits=cfg.k_bits, scale_dtype=sdt)
    return pack(codes, cfg.k_bits, dim=2), scale, zero


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cfg: KiviConfig, n: int,
                    head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_keys -> k [Hkv, n, D] in out_dtype."""
    if cfg.key_grouping == "per_channel":
        c = unpack_fragments(codes.reshape(codes.shape[0], -1), cfg.k_bits, "keys", n, head_dim)
        return dequantize_along(c, scale[:, : n // cfg.group_size], zero[:, : n // cfg.group_size], dim=1,
                                group=cfg.group_size, out_dtype=out_dtype)
    c = unpack(codes[:, :n], cfg.k_bits, head_dim, dim=2)
    gv = cfg.value_group_size(head_dim)
    return dequantize_along(c, scale[:, :n], zero[:, :n], dim=2, group=gv, out_dtype=out_dtype)


def quantize_values(v: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [Hkv, n, D] (n a multiple of 16) -> codes [Hkv, n, D // (32 // v_bits)] (FRAGMENT order: the container
    row of token t holds words of t's 16-token tile, not only t's codes), scale/zero [Hkv, n, D // Gv]."""
    gv = cfg.value_group_size(v.shape[-1])
    codes, scale, zero = quantize_along(v, dim=2, group=gv, bits=cfg.v_bits,
                                        scale_dtype=torch_dtype(cfg.scale_dtype))
    hkv, n, d = v.shape
    words = pack_fragments(codes, cfg.v_bits, "values")  # [Hkv, n * D * v_bits / 32]
    return words.reshape(hkv, n, d // codes_per_word(cfg.v_bits)), scale, zero


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cfg: KiviConfig,
                      head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_values -> v [Hkv, n, D] in out_dtype."""
    n = codes.shape[1]
    c = unpack_fragments(codes.reshape(codes.shape[0], -1), cfg.v_bits, "values", n, head_dim)
    return dequantize_along(c, scale, zero, dim=2, group=cfg.value_group_size(head_dim), out_dtype=out_dtype)
