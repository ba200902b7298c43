"""Lane-level CPU emulation of the split decode kernel (plugins/kernels/include/kiviDecodeSplit.cuh: decode variants
>= 2 of kiviDecodeVariants.h), sharing mma_model's fragments, conversions and MMA model.

What differs from the baseline kernel (mma_model) and is reproduced here:
  - the key assignment: quantized 32-key chunks [y Lc, (y + 1) Lc) to split y, Lc = max(8, ceil(n_q / 32 /
    num_splits)), contiguous quarters to the 4 warps; full-precision keys [n_q, keyEnd) in 16-key tiles, tile j to
    split j % num_splits and to warp 3 or 2 alternately (j // num_splits even: warp 3), processed after the warp's
    quantized chunks, in j order;
  - the fold: each bias term accumulated by two chains (even / odd 16-channel blocks, one fp32 rounding per MMA),
    summed, then Z - A per channel half; the score MMA chain starts from zero and the bias is added after it;
  - full-precision tiles: S = K rnd(qsc)^T over 16 keys (zero rows past keyEnd), masked, O^T += V^T w^T, l += w;
  - the merge: one split writes out = O / l; with plan.fused_combine the last CTA merges the splits in split order
    (m in log2 units: w_y = 2^(m_y - max), fmaf chains of l and O); otherwise kiviCombineKernel merges every split
    of a decode row (natural-log units);
  - decode mode (plan.decode_mode): tile x = sequence x tiles_per_seq + i (the sequence found without the prepare
    kernel's prefix sums; validity as the prepare kernel decides it).
Sequences of >= 64 query rows run in the prefill kernel (prefill_model) as with the baseline.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..format import KiviConfig
from ..reference.attention import KiviBuffers
from . import prefill_model
from .fragments import LOG2E, CtaInputs, code_affine, exp2, f32, mma, p_to_b_fragment, round_to
from .launch import LaunchPlan, launch_plan, prepare
from .mma_model import CHUNK, LN2, N, WARPS, Warp, fma, quantized_tiles

FP_TILE = 16  # keys per full-precision tile
FP_WARPS = 2  # warps 3 and 2 take the full-precision tiles
MIN_SPLIT_CHUNKS = 8  # kMIN_SPLIT_LEN / 32


def key_fold(qa: np.ndarray, sk: np.ndarray, zk: np.ndarray, act: torch.dtype, bits: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """foldKeyGroupSplit: (q'' = rnd(qa s_k) [N, D], bias [N]). Per channel half, Z = qa . z and A = q'' . alpha /
    beta each as two m16n8k8 chains (even / odd 16-channel blocks, one fp32 rounding per MMA), Z = Z_even + Z_odd,
    A = A_even + A_odd, part = Z - A; bias = (part_low + part_high) beta."""
    alpha, beta = code_affine(act, bits)
    qk = round_to(f32(qa * sk[None]), act)
    d = qa.shape[1]
    parts = []
    for half in (0, 1):
        cz = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
        ca = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
        for kb in range(d // 16):
            ch = 16 * kb + 8 * half + np.arange(8)
            cz[kb & 1] = f32(cz[kb & 1] + qa[:, ch].astype(np.float64) @ zk[ch].astype(np.float64))
            if alpha:
                ca[kb & 1] = f32(ca[kb & 1] + qk[:, ch].astype(np.float64).sum(axis=1) * (alpha / beta))
        parts.append(f32(f32(cz[0] + cz[1]) - f32(ca[0] + ca[1])))
    return qk, f32(f32(parts[0] + parts[1]) * np.float32(beta))


def _softmax(warp: Warp, sc: np.ndarray) -> np.ndarray:
    """The online softmax of kiviDecodeSplit.cuh (softmaxUpdate + probabilities): m' = max(m, max sc), rescale by
    2^(m - m') (exactly 1 where the maximum holds: the kernel skips it), w = rnd_T(2^(sc - m')) -> p [keys, N]."""
    m_new = np.maximum(warp.m, sc.max(axis=0))
    with np.errstate(invalid="ignore"):  # -inf - -inf where no key is visible yet: alpha = 1 there
        alpha = np.where(m_new == warp.m, 1.0, exp2(warp.m - m_new)).astype(np.float32)
    warp.m = m_new
    warp.o = f32(warp.o * alpha[None])
    warp.vb = f32(warp.vb * alpha[None])
    m_use = np.where(m_new == -np.inf, 0.0, m_new).astype(np.float32)
    return exp2(f32(sc - m_use[None]))


def quantized_chunk(ctx: CtaInputs, warp: Warp, qk: np.ndarray, bias: np.ndarray, blk: int, h: int, r: int) -> None:
    """splitQuantizedChunk: one 32-key chunk at block row r (its group's q'' and bias given)."""
    d, act, cfg = ctx.d, ctx.act, ctx.cfg
    nvg = d // ctx.gv
    ak = quantized_tiles(ctx, "keys", blk, h, r)  # [2, D/16, 16 keys, 16 ch]
    av = quantized_tiles(ctx, "values", blk, h, r)  # [2, D/16, 16 ch, 16 keys]
    bq = qk.T
    sc = np.zeros((CHUNK, N), np.float32)
    for tau in range(2):
        c = np.zeros((16, N), np.float32)
        for kb in range(d // 16):
            c = mma(c, ak[tau, kb], bq[16 * kb:16 * kb + 16])
        sc[16 * tau:16 * tau + 16] = f32(c + bias[None])
    p = _softmax(warp, sc)
    w = round_to(p, act)
    rows_v = r + np.arange(CHUNK)
    sv, zv = round_to(ctx.vs[blk, h, rows_v], act), round_to(ctx.vz[blk, h, rows_v], act)  # [32, groups]
    alpha_v, beta_v = code_affine(act, cfg.v_bits)
    u = round_to(f32(zv.astype(np.float64) - (alpha_v / beta_v) * sv.astype(np.float64)), act)
    for tau in range(2):
        wt = p_to_b_fragment(w[16 * tau:16 * tau + 16])
        wb = f32(wt * np.float32(1.0 / beta_v))  # exact: a power of two
        a_bias = np.zeros((16, 16), np.float32)
        a_bias[:nvg] = u[16 * tau:16 * tau + 16].T
        a_bias[nvg] = 1.0
        for vg in range(nvg):
            pp = round_to(f32(wb * sv[16 * tau:16 * tau + 16, vg][:, None]), act)  # P' [16, N]
            for cb in range(vg * ctx.gv // 16, (vg + 1) * ctx.gv // 16):
                warp.o[16 * cb:16 * cb + 16] = mma(warp.o[16 * cb:16 * cb + 16], av[tau, cb], pp)
        warp.vb = mma(warp.vb, a_bias, wt)


def full_precision_tile(ctx: CtaInputs, warp: Warp, qf: np.ndarray, key0: int, key_end: int, pos: np.ndarray,
                        h: int, slot: int, s: int, nq: int, k_chunk: np.ndarray, v_chunk: np.ndarray) -> None:
    """splitFullPrecisionTile: keys [key0, key0 + 16) in kernel order (sink rows, ring, chunk rows), zeros past
    keyEnd (cp.async zero fill)."""
    d, cfg = ctx.d, ctx.cfg
    nvg = d // ctx.gv
    kr = np.zeros((FP_TILE, d), np.float32)
    vr = np.zeros((FP_TILE, d), np.float32)
    for i in range(FP_TILE):
        t = key0 + i
        if t < s:  # window: the sinks [n_q, n_q + S) are rows t - n_q, the ring's keys are tokens
            row = t - nq if t < nq + cfg.sink_tokens else cfg.window_row(t)
            kr[i], vr[i] = ctx.kwin[slot, h, row], ctx.vwin[slot, h, row]
        elif t < key_end:
            kr[i], vr[i] = k_chunk[t - s, h], v_chunk[t - s, h]
    c = np.zeros((FP_TILE, N), np.float32)
    for kb in range(d // 16):
        c = mma(c, kr[:, 16 * kb:16 * kb + 16], qf.T[16 * kb:16 * kb + 16])
    key = key0 + np.arange(FP_TILE)
    visible = (key[:, None] < key_end) & (key[:, None] <= pos[None, :])
    sc = np.where(visible, c, -np.inf).astype(np.float32)
    p = _softmax(warp, sc)
    wt = p_to_b_fragment(round_to(p, ctx.act))
    for cb in range(d // 16):
        warp.o[16 * cb:16 * cb + 16] = mma(warp.o[16 * cb:16 * cb + 16], vr[:, 16 * cb:16 * cb + 16].T, wt)
    a_bias = np.zeros((16, 16), np.float32)
    a_bias[nvg] = 1.0  # l only: full-precision keys have no V bias
    warp.vb = mma(warp.vb, a_bias, wt)


def warp_work(nq: int, key_end: int, split: int, num_splits: int) -> list[tuple[range, list[int]]]:
    """(quantized chunk indices, full-precision tile indices) of each of the 4 warps of a CTA."""
    nqc = nq // CHUNK
    lc = max(MIN_SPLIT_CHUNKS, -(-nqc // num_splits))
    qc0 = min(split * lc, nqc)
    n = min(qc0 + lc, nqc) - qc0
    per = -(-n // WARPS)
    nft = -(-(key_end - nq) // FP_TILE)
    out = []
    for w in range(WARPS):
        f = WARPS - 1 - w
        tiles = list(range(split + num_splits * f, nft, FP_WARPS * num_splits)) if f < FP_WARPS else []
        out.append((range(qc0 + min(w * per, n), qc0 + min((w + 1) * per, n)), tiles))
    return out


def cta(ctx: CtaInputs, qrows: np.ndarray, pos: np.ndarray, nq: int, key_end: int, split: int, num_splits: int,
        table_row: torch.Tensor, h: int, slot: int, s: int, k_chunk: np.ndarray, v_chunk: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One CTA: qrows [8, D] (zeros for dead rows) -> merged (m [8] in log2 units, l [8], O [8, D])."""
    d, act, cfg = ctx.d, ctx.act, ctx.cfg
    qf = round_to(f32(qrows * np.float32(LOG2E / math.sqrt(d))), act)  # rnd(qsc): B of full-precision keys
    _, beta_k = code_affine(act, cfg.k_bits)
    qa = f32(qf * np.float32(1.0 / beta_k))  # exact: a power of two
    results = []
    for chunks, tiles in warp_work(nq, key_end, split, num_splits):
        warp = Warp(d, d // ctx.gv)
        qk, bias = qa, np.zeros(N, np.float32)  # replaced by the first chunk's fold
        for ci in chunks:
            key = ci * CHUNK
            r = key % cfg.block_size
            blk = int(table_row[key // cfg.block_size])
            if ci == chunks.start or key % cfg.group_size == 0:  # a new key group
                g = r // cfg.group_size
                qk, bias = key_fold(qa, round_to(ctx.ks[blk, h, g], act), round_to(ctx.kz[blk, h, g], act), act,
                                    cfg.k_bits)
            quantized_chunk(ctx, warp, qk, bias, blk, h, r)
        for j in tiles:
            full_precision_tile(ctx, warp, qf, nq + FP_TILE * j, key_end, pos, h, slot, s, nq, k_chunk, v_chunk)
        results.append(warp.finish(ctx.gv))
    ms = np.stack([x[0] for x in results])  # [4, N]
    mx = ms.max(axis=0)
    with np.errstate(invalid="ignore"):  # warps without keys: -inf - -inf, weight 0
        fw = np.where(ms == -np.inf, 0.0, exp2(ms - mx[None])).astype(np.float32)
    lsum = np.zeros(N, np.float32)
    o = np.zeros((d, N), np.float32)
    for w, (_, lw, ow) in enumerate(results):
        lsum = fma(lw, fw[w], lsum)
        o = fma(ow, fw[w][None], o)
    return mx, lsum, o.T


def fused_merge(ml: np.ndarray, part: np.ndarray) -> np.ndarray:
    """The last CTA's merge of one row's splits (split order): ml [splits, 2] (m in log2 units, l), part [splits, D]
    -> out [D] fp32."""
    mx = ml[:, 0].max()
    lsum = np.zeros((), np.float32)
    o = np.zeros(part.shape[1], np.float32)
    for y in range(ml.shape[0]):
        wy = np.zeros((), np.float32) if ml[y, 0] == -np.inf else exp2(np.asarray(ml[y, 0] - mx, np.float32))
        lsum = fma(ml[y, 1], wy, lsum)
        o = fma(part[y], wy, o)
    # l == 0: no key attended (a zero row); a NaN l (non-finite K/V or q) stays NaN, as the reference's
    return f32(o / lsum) if lsum != 0 else np.zeros_like(o)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
              chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
              max_chunk_len: int = 0, max_seq_len: int = 0, num_sms: int = 0, ctas_per_sm: int = 0,
              decode_variant: int = 0, sm_version: int = 90) -> tuple[torch.Tensor, LaunchPlan, int]:
    """The attend half of a step as a split variant computes it (kiviDecodeSplitKernel for sequences of < 64 query
    rows, kiviPrefillMmaKernel for the others, then the fused merge or kiviCombineKernel) -> (out, plan, error bits).
    Buffers are not modified; rows of invalid sequences and rows no sequence covers are zero."""
    tokens, nh, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    batch = slot_ids.shape[0]
    plan = launch_plan(cfg, nh, hkv, d, batch, tokens, block_table.shape[1], max_chunk_len, max_seq_len, num_sms,
                       ctas_per_sm, decode_variant=decode_variant, sm_version=sm_version)
    slots, pasts, chunks = slot_ids.tolist(), past_len.tolist(), chunk_len.tolist()
    infos, flag = prepare(plan, cfg, slots, pasts, chunks, block_table, tokens, num_blocks,
                          buffers.k_window.shape[0])
    grp, act, ns = plan.group_heads, q.dtype, plan.num_splits
    ctx = CtaInputs(buffers, cfg, act, d)
    out = np.zeros((tokens, nh, d), np.float32)
    ml = np.zeros((tokens, nh, ns, 2), np.float32)
    part = np.zeros((tokens, nh, ns, d), np.float32)
    qf, kf, vf = q.float().numpy(), k.float().numpy(), v.float().numpy()
    decode_rows = []  # (token, head) rows the split kernel computed
    for tile in range(plan.num_tiles):
        if plan.decode_mode:  # tile = b x tiles_per_seq + i
            b, i = divmod(tile, plan.tiles_per_seq)
        else:  # findSequence over the prepare kernel's tile offsets
            b = max(x for x in range(batch) if infos[x].tile_offset <= tile)
            i = tile - infos[b].tile_offset
            if i >= infos[b].tile_count:
                continue
        info = infos[b]
        s, c, slot, tok = pasts[b], chunks[b], slots[b], info.token_offset
        rows_all = max(0, min(c, tokens - tok)) * grp
        rho = i * N + np.arange(N)
        live = rho < rows_all
        if not info.valid or not live.any():
            continue
        r_tok, r_head = np.where(live, rho // grp, 0), np.where(live, rho % grp, 0)
        key_end = s + int(r_tok[live].max()) + 1
        nq = cfg.num_quantized(s)
        pos = s + r_tok
        for h in range(hkv):
            qrows = np.where(live[:, None], qf[tok + r_tok, h * grp + r_head], 0.0).astype(np.float32)
            for split in range(ns):
                m, lsum, o = cta(ctx, qrows, pos, nq, key_end, split, ns, block_table[b], h, slot, s,
                                 kf[tok:tok + c], vf[tok:tok + c])
                for n in np.nonzero(live)[0]:
                    t_, hd = tok + r_tok[n], h * grp + r_head[n]
                    if ns == 1:
                        out[t_, hd] = f32(o[n] / lsum[n]) if lsum[n] != 0 else 0.0
                    else:
                        ml[t_, hd, split] = (m[n] if plan.fused_combine else np.float32(m[n] * LN2), lsum[n])
                        part[t_, hd, split] = o[n]
                        if split == 0:
                            decode_rows.append((t_, hd))
    for tile in range(plan.num_prefill_tiles):  # the prefill kernel: contiguous splits of info.split_len keys
        b = max(x for x in range(batch) if infos[x].prefill_tile_offset <= tile)
        info = infos[b]
        if tile >= info.prefill_tile_offset + info.prefill_tile_count or not info.valid:
            continue
        s, c, slot, tok = pasts[b], chunks[b], slots[b], info.token_offset
        rho = (tile - info.prefill_tile_offset) * prefill_model.ROWS + np.arange(prefill_model.ROWS)
        live = rho < c * grp
        r_tok, r_head = np.where(live, rho // grp, 0), np.where(live, rho % grp, 0)
        key_end = s + int(r_tok[live].max()) + 1
        pos = s + r_tok
        for h in range(hkv):
            qrows = np.where(live[:, None], qf[tok + r_tok, h * grp + r_head], 0.0).astype(np.float32)
            for split in range(ns):
                k0 = split * info.split_len
                if k0 >= key_end:
                    continue
                m, lsum, o = prefill_model.cta(ctx, qrows, live, pos, k0, min(k0 + info.split_len, key_end),
                                               cfg.num_quantized(s), block_table[b], h, slot, s, kf[tok:tok + c],
                                               vf[tok:tok + c])
                for n in np.nonzero(live)[0]:
                    t_, hd = tok + r_tok[n], h * grp + r_head[n]
                    if ns == 1:
                        out[t_, hd] = o[n] / (lsum[n] if lsum[n] > 0 else 1.0)
                    else:
                        ml[t_, hd, split] = (np.float32(m[n] * LN2), lsum[n])
                        part[t_, hd, split] = o[n]
    if ns > 1 and plan.fused_combine:
        for t_, hd in decode_rows:
            out[t_, hd] = fused_merge(ml[t_, hd], part[t_, hd])
    elif ns > 1:  # kiviCombineKernel: every split of a decode row, splits 0..pos / split_len of a prefill row
        for b, info in enumerate(infos):
            if not info.valid:
                continue
            for i in range(chunks[b]):
                used = ns if info.tile_count > 0 else (pasts[b] + i) // info.split_len + 1
                t_ = info.token_offset + i
                mm, ll = ml[t_, :, :used, 0], ml[t_, :, :used, 1]
                m_max = mm.max(axis=1, keepdims=True)
                with np.errstate(invalid="ignore"):
                    wgt = np.where(mm == -np.inf, 0.0, np.exp(mm - m_max)).astype(np.float32)  # [H, used]
                l_tot = (ll * wgt).sum(axis=1)
                a = (part[t_, :, :used] * wgt[..., None]).sum(axis=1)
                out[t_] = a / np.where(l_tot > 0, l_tot, 1)[:, None]
    return torch.from_numpy(out).to(act), plan, flag
