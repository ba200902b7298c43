"""The KiviAttention op: the single definition the cache, ONNX exporter, CUDA kernels and TensorRT plugin follow.

One step handles a ragged batch of B chunks. Sequence b owns window slot slot_ids[b] and block-table row b; its
chunk covers positions [s, e) with s = past_len[b], e = s + chunk_len[b]; its tokens are rows
[sum(chunk_len[:b]), sum(chunk_len[:b+1])) of q/k/v. For each sequence:
  1. attend: the query at position t in [s, e) attends (fp32 softmax, scale 1/sqrt(D), causal) to the stored state
     after s tokens (history dequantized from the store + full-precision window) and to chunk tokens s..t in full
     precision. GQA: query head h reads KV head h // (H / Hkv) without materializing a repeat.
  2. append: the chunk joins the stored state, giving state(e): tokens [S + n_q(s), S + n_q(e)) are quantized in
     whole G-token groups (taken from the window or the chunk), sinks t < S are written at window row t and the
     other tokens of [max(s, e - W), e) at row S + (t - S) % W (format.py: S = sink_tokens, W = R + G - 1).
Inputs:  q [tokens, H, D], k/v [tokens, Hkv, D] (post-RoPE), slot_ids/past_len/chunk_len [B] int32,
         block_table [B, max_blocks] int32, buffers: the 8 cache buffers of format.BUFFER_NAMES.
Outputs: out [tokens, H, D] (q's dtype) and the updated buffers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..format import BUFFER_NAMES, KiviConfig, buffer_shapes, codes_per_word
from .kv import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from .quant import torch_dtype


class KiviBuffers(NamedTuple):
    """One layer's cache buffers, in format.BUFFER_NAMES order (shapes in format.py)."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor

    @staticmethod
    def allocate(cfg: KiviConfig, num_kv_heads: int, head_dim: int, num_blocks: int, num_slots: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu") -> KiviBuffers:
        shapes = buffer_shapes(cfg, num_kv_heads, head_dim, num_blocks, num_slots)
        sdt = torch_dtype(cfg.scale_dtype)
        dts = {"k_codes": torch.int32, "v_codes": torch.int32, "k_window": dtype, "v_window": dtype}
        return KiviBuffers(*(torch.zeros(shapes[n], dtype=dts.get(n, sdt), device=device) for n in BUFFER_NAMES))

    def clone(self) -> KiviBuffers:
        return KiviBuffers(*(t.clone() for t in self))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of one chunk in fp32.

    q [c, H, D] at positions past..past+c-1; k/v [Hkv, past + c, D] -> out [c, H, D] in q's dtype."""
    c, h, d = q.shape
    hkv, n, _ = k.shape
    qg = q.float().permute(1, 0, 2).reshape(hkv, h // hkv, c, d)  # [Hkv, grp, c, D]: head h -> kv head h // grp
    scores = qg @ k.float().unsqueeze(1).transpose(-1, -2) / math.sqrt(d)  # [Hkv, grp, c, n]
    key_pos = torch.arange(n, device=q.device)
    query_pos = past + torch.arange(c, device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = p @ v.float().unsqueeze(1)  # [Hkv, grp, c, D]
    return out.reshape(h, c, d).permute(1, 0, 2).to(q.dtype)


def _blocks_of(buf: torch.Tensor, table_row: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Gather a sequence's blocks: buf [num_blocks, Hkv, rows, X] -> [Hkv, n_blocks * rows, X]."""
    b = buf[table_row[:n_blocks].long()]  # [n_blocks, Hkv, rows, X]
    return b.permute(1, 0, 2, 3).reshape(b.shape[1], -1, b.shape[3])


def window_rows(cfg: KiviConfig, t: torch.Tensor) -> torch.Tensor:
    """Window rows of tokens t (format.KiviConfig.window_row): a sink at row t, the others in the ring after them."""
    s = cfg.sink_tokens
    return torch.where(t < s, t, s + (t - s) % cfg.window_capacity)


def _rows(cfg: KiviConfig, t0: int, t1: int) -> torch.Tensor:
    """Window rows of tokens [t0, t1)."""
    return window_rows(cfg, torch.arange(t0, max(t0, t1)))


def full_precision_rows(cfg: KiviConfig, past: int) -> torch.Tensor:
    """Window rows of the full-precision tokens after `past` tokens, in token order: the sinks [0, min(S, past)),
    then the ring's tokens [S + n_q(past), past)."""
    s0 = min(cfg.sink_tokens, past)
    return torch.cat([torch.arange(s0), _rows(cfg, s0 + cfg.num_quantized(past), past)])


def history(buffers: KiviBuffers, cfg: KiviConfig, slot: int, table_row: torch.Tensor, past: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored state after `past` tokens as full-precision K/V [Hkv, past, D] (window dtype), in token order:
    the sinks [0, min(S, past)), the quantized tokens [S, S + n_q), the ring's tokens [S + n_q, past)."""
    _, hkv, w, d = buffers.k_window.shape
    dtype = buffers.k_window.dtype
    n_q, s0 = cfg.num_quantized(past), min(cfg.sink_tokens, past)
    ks, vs = [buffers.k_window[slot][:, :s0]], [buffers.v_window[slot][:, :s0]]
    if n_q:
        nb = math.ceil(n_q / cfg.block_size)
        kc, kscale, kzero = (_blocks_of(t, table_row, nb) for t in buffers[0:3])
        vc, vscale, vzero = (_blocks_of(t, table_row, nb) for t in buffers[3:6])
        ks.append(dequantize_keys(kc, kscale, kzero, cfg, n_q, d, dtype))
        vs.append(dequantize_values(vc[:, :n_q], vscale[:, :n_q], vzero[:, :n_q], cfg, d, dtype))
    rows = _rows(cfg, s0 + n_q, past)
    ks.append(buffers.k_window[slot][:, rows])
    vs.append(buffers.v_window[slot][:, rows])
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def append(buffers: KiviBuffers, cfg: KiviConfig, slot: int, table_row: torch.Tensor, past: int,
           k: torch.Tensor, v: torch.Tensor) -> None:
    """Append a chunk k/v [Hkv, c, D] to the stored state after `past` tokens, in place. Store index j holds
    token S + j (sinks never enter a group)."""
    c = k.shape[1]
    end = past + c
    s0, w = cfg.sink_tokens, cfg.window_capacity
    q0, q1 = cfg.num_quantized(past), cfg.num_quantized(end)
    if q1 > q0:  # flush whole groups of tokens [S + q0, S + q1): older ones from the window, newer from the chunk
        old = _rows(cfg, s0 + q0, min(past, s0 + q1))
        new = slice(max(0, s0 + q0 - past), max(0, s0 + q1 - past))  # chunk rows of the rest (never a sink)
        kf = torch.cat([buffers.k_window[slot][:, old], k[:, new]], dim=1)
        vf = torch.cat([buffers.v_window[slot][:, old], v[:, new]], dim=1)
        kq, vq = quantize_keys(kf, cfg), quantize_values(vf, cfg)
        bs, g = cfg.block_size, cfg.group_size
        kpw = codes_per_word(cfg.k_bits)
        for j0 in range(q0, q1, g):  # groups never straddle blocks (block_size is a multiple of G)
            blk, r, i = int(table_row[j0 // bs]), j0 % bs, j0 - q0
            if cfg.key_grouping == "per_channel":
                buffers.k_codes[blk, :, r // kpw:(r + g) // kpw] = kq[0][:, i // kpw:(i + g) // kpw]
                buffers.k_scale[blk, :, r // g] = kq[1][:, i // g]
                buffers.k_zero[blk, :, r // g] = kq[2][:, i // g]
            else:
                for dst, src in zip(buffers[0:3], kq, strict=False):
                    dst[blk, :, r:r + g] = src[:, i:i + g]
            for dst, src in zip(buffers[3:6], vq, strict=False):
                dst[blk, :, r:r + g] = src[:, i:i + g]
    # Every live token's row: sinks always; of the others only the last W (older ones would be overwritten).
    first = max(past, min(s0, end), end - w)
    t = torch.cat([torch.arange(past, max(past, min(s0, end))), torch.arange(first, end)])
    rows = window_rows(cfg, t)
    buffers.k_window[slot][:, rows] = k[:, t - past]
    buffers.v_window[slot][:, rows] = v[:, t - past]


def check_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
               chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig) -> None:
    """Validate one step's inputs against each other and the buffers; raise ValueError naming the bad value."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tokens, h, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    num_slots = buffers.k_window.shape[0]
    cfg.check_head_dim(d)
    if tuple(k.shape) != (tokens, hkv, d) or tuple(v.shape) != (tokens, hkv, d):
        raise ValueError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} must be {(tokens, hkv, d)}")
    if not (q.dtype == k.dtype == v.dtype == buffers.k_window.dtype == buffers.v_window.dtype):
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must equal the window dtype "
                         f"{buffers.k_window.dtype}")
    if h % hkv != 0:
        raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={hkv}")
    expected = buffer_shapes(cfg, hkv, d, num_blocks, num_slots)
    for name, t in zip(BUFFER_NAMES, buffers, strict=False):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"buffer {name} has shape {tuple(t.shape)}, expected {expected[name]}")
    b = slot_ids.shape[0]
    if past_len.shape != (b,) or chunk_len.shape != (b,) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"slot_ids/past_len/chunk_len must be [B] and block_table [B, max_blocks]; got "
                         f"{tuple(slot_ids.shape)}, {tuple(past_len.shape)}, {tuple(chunk_len.shape)}, "
                         f"{tuple(block_table.shape)}")
    if int(chunk_len.sum()) != tokens:
        raise ValueError(f"sum(chunk_len)={int(chunk_len.sum())} must equal the number of tokens {tokens}")
    if (chunk_len < 0).any() or (past_len < 0).any():
        raise ValueError(f"past_len {past_len.tolist()} and chunk_len {chunk_len.tolist()} must be >= 0")
    if ((slot_ids < 0) | (slot_ids >= num_slots)).any():
        raise ValueError(f"slot_ids {slot_ids.tolist()} out of range [0, {num_slots})")
    if len(set(slot_ids.tolist())) != b:
        raise ValueError(f"slot_ids {slot_ids.tolist()} must be distinct within a step")
    max_tokens = block_table.shape[1] * cfg.block_size
    for i in range(b):
        end = int(past_len[i] + chunk_len[i])
        n_q = cfg.num_quantized(end)
        if n_q > max_tokens:
            raise ValueError(f"sequence {i}: length {end} needs {n_q} quantized tokens, past the block table's "
                             f"capacity of {max_tokens} ({block_table.shape[1]} blocks of {cfg.block_size})")
        used = block_table[i, : math.ceil(n_q / cfg.block_size)]
        if ((used < 0) | (used >= num_blocks)).any():
            raise ValueError(f"sequence {i}: block ids {used.tolist()} out of range [0, {num_blocks})")


def kivi_attention_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                    past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor,
                    buffers: KiviBuffers, cfg: KiviConfig) -> torch.Tensor:
    """In-place form (runners): updates `buffers` and returns out [tokens, H, D]."""
    check_step(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg)
    out = torch.empty_like(q)
    offset = 0
    for b in range(slot_ids.shape[0]):
        slot, s, c = int(slot_ids[b]), int(past_len[b]), int(chunk_len[b])
        if c == 0:
            continue
        rows = slice(offset, offset + c)
        kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, c, D]
        kh, vh = history(buffers, cfg, slot, block_table[b], s)  # [Hkv, s, D]
        out[rows] = attend(q[rows], torch.cat([kh, kc], dim=1), torch.cat([vh, vc], dim=1), s)
        append(buffers, cfg, slot, block_table[b], s, kc, vc)
        offset += c
    return out


def kivi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                   past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor,
                   buffers: KiviBuffers, cfg: KiviConfig) -> tuple[torch.Tensor, KiviBuffers]:
    """Functional form: returns (out [tokens, H, D], updated copies of the buffers); inputs are not modified."""
    new = KiviBuffers(*buffers).clone()
    out = kivi_attention_(q, k, v, slot_ids, past_len, chunk_len, block_table, new, cfg)
    return out, new
