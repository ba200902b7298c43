"""CPU-executable model of the KIVI CUDA kernels' decomposition (plugins/kernels/include/*.cuh).

It runs the same work split as the GPU code, CTA by CTA, in numpy/torch on the CPU:
  - launch_plan: kiviLaunchPlan (tiles of query rows, split length, grid sizes, workspace bytes);
  - prepare: kiviPrepareKernel (token/tile offsets, device-side checks, error bits);
  - attention: kiviAttentionKernel (32-key tiles, quantized / window / chunk sources, dequantization through the
    fp16 magic-number trick emulated with numpy bit views, fp32 online softmax per row with the kernel's (m, l, acc)
    update) and kiviCombineKernel (merge of the splits 0..floor(p / L), L = the sequence's split length);
  - append: kiviFlushKernel + kiviWindowKernel (which G-groups are flushed, from where, into which block/row/word,
    with the kernel's fp32 arithmetic: IEEE division, rint half-to-even).
Format v2 sinks (format.py) are modelled here ahead of the kernels (whose host validation refuses sink_tokens > 0
for now): sink rows are a full-precision key source, store index j is token S + j, a tile that straddles sinks
and the store is loaded key by key with the same arithmetic. Rotation never reaches the op.
Tested against trtllm_kivi.reference (tests/test_kernels_model.py), so a GPU run only has to confirm the
CUDA-specific parts (indexing in registers/shared memory, synchronization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..format import KiviConfig, codes_per_word
from ..reference.attention import KiviBuffers
from ..reference.quant import torch_dtype
from ._abi import (CTAS_PER_SM, DEFAULT_NUM_SMS, ERR_BLOCK_ID, ERR_CAPACITY, ERR_LENGTH, ERR_SLOT, KEY_TILE,
                   MAX_TILE_ROWS, MIN_SPLIT_LEN, SEQ_INFO_INTS)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round256(n: int) -> int:
    return _ceil_div(n, 256) * 256


@dataclass(frozen=True)
class LaunchPlan:
    """kiviLaunchPlan (plugins/kernels/src/kiviParams.cpp), field for field."""

    window_capacity: int
    max_seq_len: int
    max_chunk_len: int
    group_heads: int
    tile_tokens: int
    num_tiles: int
    split_len: int
    num_splits: int
    flush_groups_per_seq: int
    seq_info_bytes: int
    partial_bytes: int
    workspace_size: int


def launch_plan(cfg: KiviConfig, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, num_tokens: int,
                max_blocks_per_seq: int, max_chunk_len: int = 0, max_seq_len: int = 0,
                num_sms: int = 0) -> LaunchPlan:
    w = cfg.window_capacity
    capacity = max_blocks_per_seq * cfg.block_size + cfg.sink_tokens + w  # store + sink rows + ring
    msl = max_seq_len if max_seq_len > 0 else capacity
    mcl = max_chunk_len if max_chunk_len > 0 else num_tokens
    grp = num_heads // num_kv_heads
    tq = MAX_TILE_ROWS // grp
    num_tiles = min(num_tokens, _ceil_div(num_tokens, tq) + batch)
    sms = num_sms if num_sms > 0 else DEFAULT_NUM_SMS
    ctas = max(num_tiles, 1) * num_kv_heads
    max_splits = _ceil_div(max(msl, 1), MIN_SPLIT_LEN)
    splits = min(max(_ceil_div(CTAS_PER_SM * sms, ctas), 1), max_splits)
    split_len = _ceil_div(_ceil_div(max(msl, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = _ceil_div(max(msl, 1), split_len)
    seq_info = _round256(batch * SEQ_INFO_INTS * 4)
    partial = 0
    if num_splits > 1:  # this step's partials: [T, H, num_splits, D] then [T, H, num_splits, 2] fp32
        rows = num_tokens * num_heads * num_splits
        partial = _round256(rows * head_dim * 4) + _round256(rows * 2 * 4)
    ws = 0 if batch <= 0 or num_tokens <= 0 else seq_info + partial
    return LaunchPlan(w, msl, mcl, grp, tq, num_tiles, split_len, num_splits, _ceil_div(mcl, cfg.group_size),
                      seq_info, partial, ws)


# ---------------------------------------------------------------------------------------------- bit conversion


def code_pair_to_float(words: np.ndarray, bits: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """codePairToFloat: codes i and i + n/2 of each LSB-first word (n = 32 / bits) via fp16 magic numbers.

    ((w >> i*bits) & mask) | 0x64006400 holds two fp16 values 1024 + c (c in the mantissa); subtracting 1024 in
    fp16 is exact. words: uint32 array -> (low codes, high codes) as float32."""
    mask = np.uint32(((1 << bits) - 1) * 0x00010001)
    b = ((words.astype(np.uint32) >> np.uint32(i * bits)) & mask) | np.uint32(0x64006400)
    h = np.ascontiguousarray(b).view(np.float16).reshape(*b.shape, 2)  # little endian: low half first
    h = h - np.float16(1024.0)
    return h[..., 0].astype(np.float32), h[..., 1].astype(np.float32)


def unpack_magic(words: np.ndarray, bits: int) -> np.ndarray:
    """All codes of words [..., n] -> float32 [..., n, 32 / bits] in code order, through code_pair_to_float."""
    per = 32 // bits
    out = np.empty((*words.shape, per), dtype=np.float32)
    for i in range(per // 2):
        lo, hi = code_pair_to_float(words, bits, i)
        out[..., i], out[..., i + per // 2] = lo, hi
    return out


def _as_uint32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


def _round_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> dtype (round to nearest even) -> fp32, as roundToAct / storeScale."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype).float().numpy()


def act_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` (fp16 or bf16) at |x| in the normal range: 2^(floor(log2|x|) - mantissa bits)."""
    mant = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    e = torch.floor(torch.log2(x.abs().float().clamp_min(2.0 ** -14)))
    return torch.exp2(e - mant)


def attention_tolerance(ref: torch.Tensor, v_max: float, round_p: bool = False) -> torch.Tensor:
    """Allowed |got - ref| between two fp32-accumulated attentions over the same dequantized values, rounded to
    ref.dtype: fp32 rounding (summation order, online rescaling, exp) stays far below 2^-14 * max|v| for the
    lengths tested (<= 64K keys: sums of probabilities weight each error by p), and the final cast to the
    activation dtype can differ by one ulp of the output.

    round_p (the tensor-core kernel): p is rounded to the activation dtype (unit roundoff u = 2^-11 fp16, 2^-8
    bf16) and l sums the rounded p, so the output is still a convex combination of v rows whose weights moved by a
    relative 2u at most: |delta out| <= 2u * max|v| more."""
    tol = act_ulp(ref, ref.dtype) + 2.0 ** -14 * v_max
    if round_p:
        u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[ref.dtype]
        tol = tol + 2 * u * v_max
    return tol


# ---------------------------------------------------------------------------------------------- prepare


@dataclass
class SeqInfo:
    token_offset: int
    tile_offset: int
    tile_count: int
    valid: bool
    split_len: int  # this sequence's length spread over all plan.num_splits splits


def prepare(plan: LaunchPlan, cfg: KiviConfig, slot_ids: list[int], past_len: list[int], chunk_len: list[int],
            block_table: torch.Tensor, num_tokens: int, num_blocks: int, num_slots: int) -> tuple[list[SeqInfo], int]:
    """kiviPrepareKernel for every sequence -> (infos, OR of the error bits)."""
    infos, flag = [], 0
    tokens = tiles = 0
    for b, (slot, s, c) in enumerate(zip(slot_ids, past_len, chunk_len)):
        e, err = s + c, 0
        if s < 0 or c < 0 or c > plan.max_chunk_len or tokens + c > num_tokens:
            err |= ERR_LENGTH
        nq = cfg.num_quantized(e) if e >= 0 else 0
        if err == 0 and (e > plan.max_seq_len or nq > block_table.shape[1] * cfg.block_size):
            err |= ERR_CAPACITY
        if not 0 <= slot < num_slots:
            err |= ERR_SLOT
        if err == 0:
            used = block_table[b, :_ceil_div(nq, cfg.block_size)]
            if ((used < 0) | (used >= num_blocks)).any():
                err |= ERR_BLOCK_ID
        rows = max(0, min(c, num_tokens - tokens))
        split_len = max(MIN_SPLIT_LEN, _ceil_div(_ceil_div(max(e, 0), plan.num_splits), KEY_TILE) * KEY_TILE)
        infos.append(SeqInfo(min(tokens, num_tokens), tiles, _ceil_div(rows, plan.tile_tokens), err == 0, split_len))
        flag |= err
        tokens += max(c, 0)
        tiles += _ceil_div(max(c, 0), plan.tile_tokens)
    return infos, flag


# ---------------------------------------------------------------------------------------------- attention


def _dequant_token(buffers: KiviBuffers, cfg: KiviConfig, table_row: torch.Tensor, h: int, j: int, act: torch.dtype
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Store index j (token S + j) alone -> kS/vS rows [D], with the tile loader's arithmetic (magic-number codes,
    fp32 fma, rounded to act): the path of a tile that straddles the sinks and the store."""
    d = buffers.k_window.shape[-1]
    blk, r = int(table_row[j // cfg.block_size]), j % cfg.block_size
    kpw = codes_per_word(cfg.k_bits)
    kw = _as_uint32(buffers.k_codes[blk, h, r // kpw])  # [D]: the word holding token r of each channel
    kc = unpack_magic(kw, cfg.k_bits)[:, r % kpw]  # [D]
    ks = buffers.k_scale[blk, h, r // cfg.group_size].float().numpy()
    kz = buffers.k_zero[blk, h, r // cfg.group_size].float().numpy()
    vc = unpack_magic(_as_uint32(buffers.v_codes[blk, h, r]), cfg.v_bits).reshape(d)
    gv = cfg.value_group_size(d)
    vs = buffers.v_scale[blk, h, r].float().numpy().repeat(gv)
    vz = buffers.v_zero[blk, h, r].float().numpy().repeat(gv)
    return _round_to((kc * ks).astype(np.float32) + kz, act), _round_to((vc * vs).astype(np.float32) + vz, act)


def _key_tile(buffers: KiviBuffers, cfg: KiviConfig, table_row: torch.Tensor, slot: int, h: int, s: int, nq: int,
              kt: int, key_end: int, k_chunk: np.ndarray, v_chunk: np.ndarray, act: torch.dtype
              ) -> tuple[np.ndarray, np.ndarray]:
    """kS/vS of the 32-key tile starting at kt -> two float32 [32, D]. Sources by token t (format.py): sinks
    t < S at window row t, the store for S <= t < S + nq, the ring row S + (t - S) % W, then the chunk."""
    d = buffers.k_window.shape[-1]
    s0 = cfg.sink_tokens
    j0 = kt - s0  # store index of the tile's first key
    if 0 <= j0 and j0 % KEY_TILE == 0 and kt + KEY_TILE <= s0 + nq:  # a whole tile of the store
        blk, r = int(table_row[j0 // cfg.block_size]), j0 % cfg.block_size
        kpw = codes_per_word(cfg.k_bits)
        kw = _as_uint32(buffers.k_codes[blk, h, r // kpw:r // kpw + KEY_TILE // kpw])  # [32/kpw, D]
        kc = unpack_magic(kw.T, cfg.k_bits).reshape(d, KEY_TILE).T  # [32, D]: word wi, code j -> token wi*kpw+j
        ks = buffers.k_scale[blk, h, r // cfg.group_size].float().numpy()  # [D]
        kz = buffers.k_zero[blk, h, r // cfg.group_size].float().numpy()
        kS = _round_to((kc * ks[None]).astype(np.float32) + kz[None], act)
        vw = _as_uint32(buffers.v_codes[blk, h, r:r + KEY_TILE])  # [32, D/vpw]
        vc = unpack_magic(vw, cfg.v_bits).reshape(KEY_TILE, d)
        gv = cfg.value_group_size(d)
        vs = buffers.v_scale[blk, h, r:r + KEY_TILE].float().numpy().repeat(gv, axis=1)  # [32, D]
        vz = buffers.v_zero[blk, h, r:r + KEY_TILE].float().numpy().repeat(gv, axis=1)
        vS = _round_to((vc * vs).astype(np.float32) + vz, act)
        return kS, vS
    kS = np.zeros((KEY_TILE, d), np.float32)  # mixed tile, key by key; zeros past key_end
    vS = np.zeros((KEY_TILE, d), np.float32)
    for j in range(KEY_TILE):
        t = kt + j
        if t >= key_end:
            break
        if s0 <= t < s0 + nq:
            kS[j], vS[j] = _dequant_token(buffers, cfg, table_row, h, t - s0, act)
        elif t < s:
            row = cfg.window_row(t)
            kS[j] = buffers.k_window[slot, h, row].float().numpy()
            vS[j] = buffers.v_window[slot, h, row].float().numpy()
        else:
            kS[j], vS[j] = k_chunk[t - s, h], v_chunk[t - s, h]
    return kS, vS


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
              chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
              max_chunk_len: int = 0, max_seq_len: int = 0, num_sms: int = 0, round_p: bool = False
              ) -> tuple[torch.Tensor, LaunchPlan, int]:
    """The attend half of a step as the kernels compute it -> (out [tokens, H, D] in q's dtype, plan, error bits).
    round_p: as the tensor-core kernel (kiviAttentionTc.cuh): p rounded to q's dtype before P V, l sums the rounded
    p. Buffers are not modified."""
    tokens, nh, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    batch = slot_ids.shape[0]
    plan = launch_plan(cfg, nh, hkv, d, batch, tokens, block_table.shape[1], max_chunk_len, max_seq_len, num_sms)
    slots, pasts, chunks = slot_ids.tolist(), past_len.tolist(), chunk_len.tolist()
    infos, flag = prepare(plan, cfg, slots, pasts, chunks, block_table, tokens, num_blocks,
                          buffers.k_window.shape[0])
    grp, tq, act = plan.group_heads, plan.tile_tokens, q.dtype
    out = np.zeros((tokens, nh, d), np.float32)
    ml = np.zeros((tokens, nh, plan.num_splits, 2), np.float32)
    part = np.zeros((tokens, nh, plan.num_splits, d), np.float32)
    qf, kf, vf = q.float().numpy(), k.float().numpy(), v.float().numpy()
    softmax_scale = np.float32(1.0 / math.sqrt(d))
    tile_offsets = [i.tile_offset for i in infos]
    for tile in range(plan.num_tiles):
        b = max(i for i in range(batch) if tile_offsets[i] <= tile)  # findSequence
        info = infos[b]
        if tile >= info.tile_offset + info.tile_count or not info.valid:
            continue  # (invalid sequences: zeros, as `out` starts)
        s, c, slot = pasts[b], chunks[b], slots[b]
        i0 = (tile - info.tile_offset) * tq
        i1 = min(i0 + tq, c)
        rows = (i1 - i0) * grp
        key_end = s + i1
        nq = cfg.num_quantized(s)
        tok = info.token_offset
        k_chunk, v_chunk = kf[tok:tok + c], vf[tok:tok + c]
        for h in range(hkv):
            # rows r -> (token i0 + r // grp, head h * grp + r % grp)
            r_tok = i0 + np.arange(rows) // grp
            r_head = h * grp + np.arange(rows) % grp
            qS = qf[tok + r_tok, r_head]  # [rows, D]
            pos = s + r_tok  # [rows]
            for split in range(plan.num_splits):
                k0 = split * info.split_len
                if k0 >= key_end:
                    continue
                k1 = min(k0 + info.split_len, key_end)
                m = np.full(rows, -np.inf, np.float32)
                l = np.zeros(rows, np.float32)
                acc = np.zeros((rows, d), np.float32)
                for kt in range(k0, k1, KEY_TILE):
                    kS, vS = _key_tile(buffers, cfg, block_table[b], slot, h, s, nq, kt, k1, k_chunk, v_chunk, act)
                    key = kt + np.arange(KEY_TILE)
                    visible = (key[None] < k1) & (key[None] <= pos[:, None])
                    sc = np.where(visible, (qS @ kS.T).astype(np.float32) * softmax_scale, -np.inf)
                    m_new = np.maximum(m, sc.max(axis=1))
                    finite = m_new != -np.inf
                    with np.errstate(invalid="ignore"):
                        alpha = np.where(finite, np.exp(m - m_new), 1.0).astype(np.float32)
                        prob = np.where(finite[:, None], np.exp(sc - m_new[:, None]), 0.0).astype(np.float32)
                    if round_p:
                        prob = _round_to(prob, act)
                    l = l * alpha + prob.sum(axis=1)
                    m = m_new
                    acc = acc * alpha[:, None] + prob @ vS
                if plan.num_splits == 1:
                    out[tok + r_tok, r_head] = acc / np.where(l > 0, l, 1)[:, None]
                else:
                    ml[tok + r_tok, r_head, split] = np.stack([m, l], axis=1)
                    part[tok + r_tok, r_head, split] = acc
    if plan.num_splits > 1:  # kiviCombineKernel
        for b, info in enumerate(infos):
            if not info.valid:
                continue
            for i in range(chunks[b]):
                used = (pasts[b] + i) // info.split_len + 1
                mm, ll = ml[info.token_offset + i, :, :used, 0], ml[info.token_offset + i, :, :used, 1]
                m_max = mm.max(axis=1, keepdims=True)
                wgt = np.where(mm == -np.inf, 0.0, np.exp(mm - m_max)).astype(np.float32)  # [H, used]
                l_tot = (ll * wgt).sum(axis=1)
                a = (part[info.token_offset + i, :, :used] * wgt[..., None]).sum(axis=1)
                out[info.token_offset + i] = a / np.where(l_tot > 0, l_tot, 1)[:, None]
    return torch.from_numpy(out).to(act), plan, flag


# ---------------------------------------------------------------------------------------------- append


def _quantize_group_np(x: np.ndarray, bits: int, sdt: torch.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's per-group arithmetic on x [..., n] (fp32): NaN-propagating min/max, scale = (mx - mn) / levels
    (IEEE fp32), stored scale/zero rounded to sdt, codes rint((x - zero) / scale) clamped, 0 for scale 0 / NaN."""
    levels = np.float32(2 ** bits - 1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mn = x.min(axis=-1)  # numpy min/max propagate NaN like torch.amin/amax
        mx = x.max(axis=-1)
        scale = _round_to((mx - mn) / levels, sdt)
        zero = _round_to(mn, sdt)
        q = np.rint((x - zero[..., None]) / scale[..., None])
        q = np.nan_to_num(np.clip(q, 0, levels), nan=0.0)  # fmaxf(NaN, 0) = 0 in the kernel
        q = np.where(scale[..., None] == 0, 0, q)
    return q.astype(np.uint32), scale, zero


def _pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint32 [..., n] -> int32 words [..., n / (32 / bits)], LSB-first."""
    per = 32 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint64)
    words = (c << (np.arange(per, dtype=np.uint64) * bits)).sum(axis=-1).astype(np.uint32)
    return words.view(np.int32)


def append(k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
           chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
           max_chunk_len: int = 0, max_seq_len: int = 0) -> int:
    """The append half as kiviFlushKernel + kiviWindowKernel compute it; updates `buffers` in place and returns the
    error bits. The flush CTA (b, y, h) handles groups y, y + gridDim.y, ... of sequence b."""
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
    gy = min(plan.flush_groups_per_seq, 1024)
    kwin, vwin = buffers.k_window.float().numpy(), buffers.v_window.float().numpy()  # read before step 2
    for b, info in enumerate(infos):
        if not info.valid:
            continue
        s, e, slot = pasts[b], pasts[b] + chunks[b], slots[b]
        q0, q1 = cfg.num_quantized(s), cfg.num_quantized(e)

        def rows_of(t0: int, src_k: np.ndarray, src_w: np.ndarray) -> np.ndarray:  # loadHistoryOrChunk
            ts = np.arange(t0, t0 + g)
            return np.stack([src_w[slot, :, cfg.window_row(t)] if t < s else src_k[info.token_offset + t - s]
                             for t in ts], axis=1)  # [Hkv, G, D]

        for y in range(gy):
            for grp_i in range(y, (q1 - q0) // g, gy):
                j0 = q0 + grp_i * g  # store index of the group; its tokens are [S + j0, S + j0 + G)
                t0 = s0 + j0
                blk, r = int(block_table[b, j0 // bs]), j0 % bs
                xk = rows_of(t0, kf, kwin)  # [Hkv, G, D]
                codes, scale, zero = _quantize_group_np(xk.transpose(0, 2, 1), cfg.k_bits, sdt)  # over G tokens
                buffers.k_codes[blk, :, r // kpw:(r + g) // kpw] = torch.from_numpy(
                    _pack_words(codes, cfg.k_bits).transpose(0, 2, 1).copy())
                buffers.k_scale[blk, :, r // g] = torch.from_numpy(scale).to(sdt)
                buffers.k_zero[blk, :, r // g] = torch.from_numpy(zero).to(sdt)
                xv = rows_of(t0, vf, vwin).reshape(hkv, g, d // gv, gv)
                codes, scale, zero = _quantize_group_np(xv, cfg.v_bits, sdt)  # [Hkv, G, D/Gv, Gv]
                buffers.v_codes[blk, :, r:r + g] = torch.from_numpy(
                    _pack_words(codes.reshape(hkv, g, d), cfg.v_bits))
                buffers.v_scale[blk, :, r:r + g] = torch.from_numpy(scale).to(sdt)
                buffers.v_zero[blk, :, r:r + g] = torch.from_numpy(zero).to(sdt)
    for b, info in enumerate(infos):  # kiviWindowKernel, after every flush (stream order)
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
    plan_kwargs.pop("num_sms", None)
    flag |= append(k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg, **plan_kwargs)
    return out, flag
