"""CPU-executable model of the KIVI CUDA kernels' decomposition (plugins/kernels/include/*.cuh).

It runs the same work split as the GPU code, CTA by CTA, in numpy/torch on the CPU:
  - the launch plan and the prepare kernel: launch.py (launch_plan, prepare);
  - attention, per decode variant (variants.py): the split kernel (split_model.py: staged full-precision tiles spread
    over splits and warps, the fused merge) or the baseline kernel (mma_model.py), both lane by lane (folded scales,
    warps and splits, the combine; fragments and the magic-number conversion in fragments.py), and for sequences of
    >= 64 query rows the prefill kernel (prefill_model.py: dequantized tiles, FlashAttention-2 over 64 rows);
  - append: kiviAppendKernel (which CTA flushes which G-group, from where, into which block/row/word, with the
    kernel's fp32 arithmetic: codes by the reciprocal fast path where it provably equals the IEEE division, the
    division elsewhere, rint half-to-even).
Format v2 sinks (format.py), as the kernels keep them: sink rows are a full-precision key source (window rows
[0, S)), store index j is token S + j; the attention kernel reads the store, then the sinks, then the ring and the
chunk. Rotation never reaches the op.
Tested against trtllm_kivi.reference (tests/test_kernels_model.py), so a GPU run only has to confirm the
CUDA-specific parts (indexing in registers/shared memory, synchronization).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..format import KiviConfig, codes_per_word
from ..reference.attention import KiviBuffers
from ..reference.quant import pack_fragments, torch_dtype
from . import mma_model, split_model
from .fragments import round_to
from .launch import LaunchPlan, launch_plan, prepare
from .variants import VARIANTS


# ---------------------------------------------------------------------------------------------- attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
              chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
              max_chunk_len: int = 0, max_seq_len: int = 0, num_sms: int = 0, ctas_per_sm: int = 0,
              decode_variant: int = 0, sm_version: int = 90) -> tuple[torch.Tensor, LaunchPlan, int]:
    """The attend half of a step as decode variant `decode_variant` (0 = auto, resolved for sm_version as the
    launcher does) computes it: the baseline kernel (mma_model) or the split kernel (split_model), lane by lane.
    -> (out [tokens, H, D] in q's dtype, plan, error bits)."""
    plan = launch_plan(cfg, q.shape[1], buffers.k_codes.shape[1], q.shape[2], slot_ids.shape[0], q.shape[0],
                       block_table.shape[1], max_chunk_len, max_seq_len, num_sms, ctas_per_sm,
                       decode_variant=decode_variant, sm_version=sm_version)
    if VARIANTS[plan.decode_variant].kernel == "baseline":
        return mma_model.attention(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg,
                                   max_chunk_len=max_chunk_len, max_seq_len=max_seq_len, num_sms=num_sms,
                                   ctas_per_sm=ctas_per_sm)
    return split_model.attention(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg,
                                 max_chunk_len=max_chunk_len, max_seq_len=max_seq_len, num_sms=num_sms,
                                 ctas_per_sm=ctas_per_sm, decode_variant=plan.decode_variant,
                                 sm_version=sm_version)


# ---------------------------------------------------------------------------------------------- append


def _quantize_group_np(x: np.ndarray, bits: int, sdt: torch.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-group arithmetic on x [..., n] (fp32): NaN-propagating min/max, scale = (mx - mn) / levels
    (IEEE fp32), stored scale/zero rounded to sdt, codes by quantize_codes (the kernel's fast path + fallback)."""
    levels = np.float32(2 ** bits - 1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mn = x.min(axis=-1)  # numpy min/max propagate NaN like torch.amin/amax
        mx = x.max(axis=-1)
        scale = round_to((mx - mn) / levels, sdt)
        zero = round_to(mn, sdt)
    return quantize_codes(x, scale[..., None], zero[..., None], levels), scale, zero


def quantize_codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, levels: np.float32,
                   inv: np.ndarray | None = None) -> np.ndarray:
    """kiviAppend.cuh's codes (fp32 numpy, broadcasting): quantizeCodeFast -- q = fl(fl(x - z) inv) with inv = 1 / s
    (the kernel's rcp.approx: within 2^-23; `inv` lets a test pass any such value; 0 for a zero scale, NaN where not
    finite), code = min(sat(rint(q)), levels) where |q - rint(q)| < 0.5 - 2^(b - 20) (b = log2(levels + 1)) -- and
    quantizeCode (the IEEE division) for the codes of every other word (here: every other code; the result is the
    same)."""
    f32 = np.float32
    bits = int(round(math.log2(float(levels) + 1)))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if inv is None:
            inv = (f32(1.0) / scale).astype(f32)
        inv = np.where(scale == 0, f32(0), np.where(np.isfinite(inv), inv, f32(np.nan))).astype(f32)
        q = ((x - zero).astype(f32) * inv).astype(f32)
        r = np.rint(q)
        ok = np.abs((q - r).astype(f32)) < f32(0.5) - f32(2.0 ** (bits - 20))
        fast = np.clip(np.nan_to_num(r, nan=0.0, posinf=float(levels), neginf=0.0), 0, levels)
        exact = np.rint(((x - zero).astype(f32) / scale).astype(f32))
        exact = np.nan_to_num(np.clip(exact, 0, levels), nan=0.0)  # fmaxf(NaN, 0) = 0 in the kernel
        exact = np.where(scale == 0, f32(0), exact)
    return np.where(ok, fast, exact).astype(np.uint32)


def append(k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
           chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
           max_chunk_len: int = 0, max_seq_len: int = 0) -> int:
    """The append half as kiviAppendKernel computes it; updates `buffers` in place and returns the error bits. CTA
    (b, 0, h) flushes the groups that read window rows (tokens < s), then writes the window rows; CTAs (b, y >= 1, h)
    flush the groups inside the chunk, gridDim.y - 1 apart (gridDim.y = 1 + floor(max_chunk_len / G))."""
    tokens, hkv, d = k.shape
    num_blocks = buffers.k_codes.shape[0]
    batch = slot_ids.shape[0]
    plan = launch_plan(cfg, hkv, hkv, d, batch, tokens, block_table.shape[1], max_chunk_len, max_seq_len)
    slots, pasts, chunks = slot_ids.tolist(), past_len.tolist(), chunk_len.tolist()
    infos, flag = prepare(plan, cfg, slots, pasts, chunks, block_table, tokens, num_blocks,
                          buffers.k_window.shape[0])
    sdt = torch_dtype(cfg.scale_dtype)
    g, bs, w, s0 = cfg.group_size, cfg.block_size, plan.window_capacity, cfg.sink_tokens
    gv = cfg.value_group_size(d)
    kpw = codes_per_word(cfg.k_bits)
    kf, vf = k.float().numpy(), v.float().numpy()
    gy = 1 + min(plan.max_chunk_len // g, 1023)
    kwin, vwin = buffers.k_window.float().numpy(), buffers.v_window.float().numpy()  # read before step 2
    for b, info in enumerate(infos):
        if not info.valid:
            continue
        s, e, slot = pasts[b], pasts[b] + chunks[b], slots[b]
        q0, q1 = cfg.num_quantized(s), cfg.num_quantized(e)

        def rows_of(t0: int, src_k: np.ndarray, src_w: np.ndarray, slot: int = slot, s: int = s,
                    info=info) -> np.ndarray:  # loadHistoryOrChunk (loop values bound now)
            ts = range(t0, t0 + g)
            return np.stack([src_w[slot, :, cfg.window_row(t)] if t < s else src_k[info.token_offset + t - s]
                             for t in ts], axis=1)  # [Hkv, G, D]

        groups = (q1 - q0) // g
        from_window = s - s0 - q0  # store indices [q0, q0 + from_window) are window rows
        k_win = groups if gy == 1 else min(max(0, -(-from_window // g)), groups)
        assignment = [list(range(k_win))] + [list(range(k_win + y - 1, groups, gy - 1)) for y in range(1, gy)]
        assert sorted(i for a in assignment for i in a) == list(range(groups))  # every group exactly once
        for y, mine in enumerate(assignment):
            for grp_i in mine:
                if y > 0:  # a chunk CTA never reads the window (the y = 0 CTA of (b, h) overwrites it)
                    assert s0 + q0 + grp_i * g >= s
                j0 = q0 + grp_i * g  # store index of the group; its tokens are [S + j0, S + j0 + G)
                t0 = s0 + j0
                blk, r = int(block_table[b, j0 // bs]), j0 % bs
                xk = rows_of(t0, kf, kwin)  # [Hkv, G, D]
                codes, scale, zero = _quantize_group_np(xk.transpose(0, 2, 1), cfg.k_bits, sdt)  # over G tokens
                words = pack_fragments(torch.from_numpy(codes.transpose(0, 2, 1).astype(np.int64)), cfg.k_bits,
                                       "keys")  # [Hkv, G * D * k_bits / 32]: whole 16-token tiles
                buffers.k_codes[blk, :, r // kpw:(r + g) // kpw] = words.reshape(hkv, g // kpw, d)
                buffers.k_scale[blk, :, r // g] = torch.from_numpy(scale).to(sdt)
                buffers.k_zero[blk, :, r // g] = torch.from_numpy(zero).to(sdt)
                xv = rows_of(t0, vf, vwin).reshape(hkv, g, d // gv, gv)
                codes, scale, zero = _quantize_group_np(xv, cfg.v_bits, sdt)  # [Hkv, G, D/Gv, Gv]
                words = pack_fragments(torch.from_numpy(codes.reshape(hkv, g, d).astype(np.int64)), cfg.v_bits,
                                       "values")
                buffers.v_codes[blk, :, r:r + g] = words.reshape(hkv, g, -1)
                buffers.v_scale[blk, :, r:r + g] = torch.from_numpy(scale).to(sdt)
                buffers.v_zero[blk, :, r:r + g] = torch.from_numpy(zero).to(sdt)
    for b, info in enumerate(infos):  # CTA y = 0, after its window flushes (the chunk CTAs read no window row)
        if not info.valid:
            continue
        s, e, slot = pasts[b], pasts[b] + chunks[b], slots[b]
        live = list(range(s, min(s0, e))) + list(range(max(s, s0, e - w), e))  # sinks, then the ring's last W
        for t in live:
            buffers.k_window[slot, :, cfg.window_row(t)] = k[info.token_offset + t - s]
            buffers.v_window[slot, :, cfg.window_row(t)] = v[info.token_offset + t - s]
    return flag


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
         chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
         **plan_kwargs: int) -> tuple[torch.Tensor, int]:
    """invokeKiviStep on the CPU: attention, then append (in place) -> (out, error bits)."""
    out, _, flag = attention(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg, **plan_kwargs)
    for name in ("num_sms", "ctas_per_sm", "decode_variant", "sm_version"):
        plan_kwargs.pop(name, None)
    flag |= append(k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg, **plan_kwargs)
    return out, flag
