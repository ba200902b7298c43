"""Group quantization and int32 packing: the executable spec of docs/design.md's quantization contract.

Per group: mn = min, mx = max (fp32); scale = (mx - mn) / (2^b - 1); both are cast to the scale dtype and the
*stored* values are what the codes are computed from:
    q = clamp(round_half_even((x - zero) / scale), 0, 2^b - 1),     dequant = q * scale + zero  (fp32, then cast)
A group whose stored scale is 0 stores q = 0 (dequantizes to exactly the stored zero, never NaN).
Two word orders (format.py): LINEAR (pack/unpack along one axis) and FRAGMENT (pack_fragments/unpack_fragments,
the mma.sync A-operand register order of 16-token tiles).
"""

from __future__ import annotations

import torch

from ..format import (FRAGMENT_LANES, MMA_TILE_TOKENS, canonical_dtype, codes_per_word, fragment_coord,
                      fragment_words_per_lane)

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name or alias (format.canonical_dtype: the one parser of dtype names)."""
    return _TORCH_DTYPES[canonical_dtype(name)]


def quantize_groups(x: torch.Tensor, bits: int, scale_dtype: torch.dtype = torch.float16
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the groups on the last axis of x [..., n, group] -> (codes [..., n, group] int32 in [0, 2^b),
    scale [..., n] and zero [..., n] in scale_dtype)."""
    xf = x.float()
    mn = xf.amin(dim=-1)  # [..., n]; NaN propagates
    mx = xf.amax(dim=-1)
    scale = ((mx - mn) / (2 ** bits - 1)).to(scale_dtype)
    zero = mn.to(scale_dtype)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.round((xf - z) / s).clamp(0, 2 ** bits - 1)  # torch.round rounds half to even
    q = torch.where(s == 0, torch.zeros_like(q), q)
    q = torch.nan_to_num(q, nan=0.0)  # codes of non-finite groups are unspecified; keep them valid integers
    return q.to(torch.int32), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """codes [..., n, group], scale/zero [..., n] -> values [..., n, group] (fp32 arithmetic, then cast)."""
    return (codes.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).to(out_dtype)


def quantize_along(x: torch.Tensor, dim: int, group: int, bits: int, scale_dtype: torch.dtype = torch.float16
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x in groups of `group` consecutive elements along `dim` (its size must be a multiple).

    Returns codes shaped like x (int32) and scale/zero shaped like x with `dim` divided by `group`."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group != 0:
        raise ValueError(f"size {n} of dim {dim} is not a multiple of the group size {group}")
    xm = x.movedim(dim, -1)
    xg = xm.reshape(*xm.shape[:-1], n // group, group)
    codes, scale, zero = quantize_groups(xg, bits, scale_dtype)
    codes = codes.reshape(xm.shape).movedim(-1, dim)
    return codes, scale.movedim(-1, dim), zero.movedim(-1, dim)


def dequantize_along(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, group: int,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_along: scale/zero are repeated `group` times along `dim`."""
    s = scale.repeat_interleave(group, dim=dim).float()
    z = zero.repeat_interleave(group, dim=dim).float()
    return (codes.float() * s + z).to(out_dtype)


def pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack codes in [0, 2^b) along `dim` into int32 words, LSB-first: code i of a word at bits [i*b, (i+1)*b).
    A size that is not a multiple of 32/b is zero-padded."""
    per = codes_per_word(bits)
    c = codes.movedim(dim, -1).to(torch.int64)
    n = c.shape[-1]
    pad = (-n) % per
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64, device=c.device) * bits
    words = (c << shifts).sum(dim=-1)  # in [0, 2^32)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # reinterpret as int32
    return words.to(torch.int32).movedim(-1, dim)


def unpack(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Unpack int32 words along `dim` into n codes (int32)."""
    per = codes_per_word(bits)
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=w.device) * bits
    c = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    c = c.reshape(*c.shape[:-2], -1)[..., :n]
    return c.to(torch.int32).movedim(-1, dim)



# ---------------------------------------------------------------------------------------------- fragment order


def _fragment_index(kind: str, head_dim: int, bits: int) -> torch.Tensor:
    """[32, nw, 2, 16 // bits] -> flat (token * head_dim + channel) index within a 16-token tile (format.py)."""
    key = (kind, head_dim, bits)
    if key not in _FRAGMENT_INDEX:
        nw, per_half = fragment_words_per_lane(head_dim, bits), 16 // bits
        idx = torch.empty(FRAGMENT_LANES, nw, 2, per_half, dtype=torch.int64)
        for lane in range(FRAGMENT_LANES):
            for j in range(nw):
                for half in range(2):
                    for pos in range(per_half):
                        tok, ch = fragment_coord(kind, lane, j, half, pos, bits)
                        idx[lane, j, half, pos] = tok * head_dim + ch
        _FRAGMENT_INDEX[key] = idx
    return _FRAGMENT_INDEX[key]


_FRAGMENT_INDEX: dict[tuple[str, int, int], torch.Tensor] = {}


def pack_fragments(codes: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """codes [..., n, D] in [0, 2^b) (n a multiple of 16) -> words [..., n * D * bits / 32] int32 in FRAGMENT order
    (format.py): tile tau, lane L, word j holds at bits [16 h + p * b, ...) the code fragment_coord(kind, L, j, h, p)."""
    *lead, n, d = codes.shape
    if n % MMA_TILE_TOKENS != 0:
        raise ValueError(f"{n} tokens is not a multiple of the {MMA_TILE_TOKENS}-token fragment tile")
    idx = _fragment_index(kind, d, bits)  # [32, nw, 2, per_half]
    tiles = codes.reshape(*lead, n // MMA_TILE_TOKENS, MMA_TILE_TOKENS * d).to(torch.int64)
    c = tiles[..., idx.reshape(-1)].reshape(*tiles.shape[:-1], *idx.shape)  # [..., tiles, 32, nw, 2, per_half]
    shifts = torch.arange(idx.shape[-1], dtype=torch.int64, device=c.device) * bits
    halves = (c << shifts).sum(dim=-1)  # [..., tiles, 32, nw, 2] in [0, 2^16)
    words = halves[..., 0] | (halves[..., 1] << 16)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # reinterpret as int32
    return words.reshape(*lead, -1).to(torch.int32)


def unpack_fragments(words: torch.Tensor, bits: int, kind: str, n: int, head_dim: int) -> torch.Tensor:
    """Inverse of pack_fragments: the first n tokens (a multiple of 16) of words [..., >= n * D * bits / 32]
    -> codes [..., n, D] int32."""
    if n % MMA_TILE_TOKENS != 0:
        raise ValueError(f"{n} tokens is not a multiple of the {MMA_TILE_TOKENS}-token fragment tile")
    idx = _fragment_index(kind, head_dim, bits)
    per_tile = idx.shape[0] * idx.shape[1]  # 32 * nw words
    lead = words.shape[:-1]
    w = words[..., : n // MMA_TILE_TOKENS * per_tile].to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(*lead, n // MMA_TILE_TOKENS, *idx.shape[:2], 1, 1)  # [..., tiles, 32, nw, 1, 1]
    half_shift = torch.tensor([0, 16], dtype=torch.int64, device=w.device).reshape(2, 1)
    pos_shift = torch.arange(idx.shape[-1], dtype=torch.int64, device=w.device) * bits
    c = (w >> (half_shift + pos_shift)) & ((1 << bits) - 1)  # [..., tiles, 32, nw, 2, per_half]
    out = torch.empty(*lead, n // MMA_TILE_TOKENS, MMA_TILE_TOKENS * head_dim, dtype=torch.int64, device=w.device)
    out[..., idx.reshape(-1)] = c.reshape(*c.shape[:-4], -1)
    return out.reshape(*lead, n, head_dim).to(torch.int32)
