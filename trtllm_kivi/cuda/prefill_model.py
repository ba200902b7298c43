"""CPU emulation of the prefill attention kernel (plugins/kernels/include/kiviPrefillMma.cuh).

A CTA owns 64 query rows (4 warps x 16: the MMA's M) of one sequence's chunk and one split of its keys; per 32-key
tile of the split (keys in the decode kernel's order: store, sinks, ring, chunk):
  - the tile is filled as loadQuantizedTilePf / loadFullPrecisionTilePf do: quantized keys from FRAGMENT-order words,
    each word's (key, channel) pairs scattered by the mma A layout (`scatter_fragment_words`: the kernel's own index
    arithmetic, so a wrong lane / register / bit mapping shows up as a wrong tile), dequantized as the reference does
    (fp32 code * scale + zero, then one rounding to the activation dtype); full-precision rows as stored;
  - per warp: S = Q K^T (Q = rnd_T(q fl32(log2(e) / sqrt(D)))), D / 16 MMAs per 8-key n-tile, each an fp32 rounding;
    mask (key < k1 and key <= the row's position); online softmax in log2 units (rescale by alpha = 1 when the
    maximum holds); P = rnd_T(2^(s - m)); l += sum of P (the rounded values, in the lanes' order: per lane, then the
    4 lanes of a row at the end); O += P V, two MMAs (16 keys each) per 8-channel n-tile.
Tensor-core products are modelled as in fragments.mma (exact products, one fp32 rounding per MMA).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..format import fragment_words_per_lane
from .fragments import LOG2E, CtaInputs, a_coord, exp2, f32, mma, round_to

ROWS = 64  # kPREFILL_TILE_ROWS
KEYS = 32  # keys per tile (one FRAGMENT chunk)
WARP_ROWS = 16


def scatter_fragment_words(words: np.ndarray, bits: int, head_dim: int, kind: str) -> tuple[np.ndarray, ...]:
    """The kernel's scatter of one 32-key FRAGMENT chunk: words uint32 [2 tiles * 32 lanes * nw] in storage order
    ([tau][lane][j]) -> (codes [32, D] int64 as K [key, channel] or V^T [channel, key] -> returned as [key, channel]
    in both cases, and a count of how often each element was written).

    Word (tau, lane, j), bit position pos holds register pi = j (16 / b) + pos of that lane: 16-block pi // 4,
    register pi % 4, whose low / high 16-bit halves are A elements (a_coord). K: A rows = keys, columns = channels;
    V: A rows = channels, columns = keys."""
    nw = fragment_words_per_lane(head_dim, bits)
    per = 16 // bits
    mask = (1 << bits) - 1
    w = words.reshape(2, 32, nw).astype(np.int64)
    lane = np.arange(32)
    codes = np.zeros((KEYS, head_dim), np.int64)
    hits = np.zeros((KEYS, head_dim), np.int64)
    for tau in range(2):
        for j in range(nw):
            for pos in range(per):
                pi = j * per + pos
                blk16, reg = pi // 4, pi % 4
                for half in range(2):
                    row, col = a_coord(lane, reg, half)
                    c = (w[tau, :, j] >> (16 * half + pos * bits)) & mask
                    if kind == "keys":
                        key, ch = 16 * tau + row, 16 * blk16 + col
                    else:
                        ch, key = 16 * blk16 + row, 16 * tau + col
                    codes[key, ch] = c
                    hits[key, ch] += 1
    return codes, hits


def _dequant(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, act: torch.dtype) -> np.ndarray:
    """reference/quant.py dequantize_groups in fp32 (no FMA contraction), then the history's cast to act."""
    return round_to(f32(f32(codes.astype(np.float32) * scale) + zero), act)


def quantized_tile(ctx: CtaInputs, blk: int, h: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """loadQuantizedTilePf: store rows [r, r + 32) of block `blk`, KV head h -> K, V [32, D] on act's grid."""
    cfg, d = ctx.cfg, ctx.d
    out = []
    for kind, bits, words in (("keys", cfg.k_bits, ctx.k_words), ("values", cfg.v_bits, ctx.v_words)):
        nw = fragment_words_per_lane(d, bits)
        chunk = words[blk, h, (r // 16) * 32 * nw:(r // 16 + 2) * 32 * nw]
        codes, hits = scatter_fragment_words(chunk, bits, d, kind)
        assert (hits == 1).all(), "the FRAGMENT scatter must write every element of the tile exactly once"
        if kind == "keys":
            g = r // cfg.group_size
            out.append(_dequant(codes, ctx.ks[blk, h, g][None], ctx.kz[blk, h, g][None], ctx.act))
        else:
            rows = r + np.arange(KEYS)
            s = np.repeat(ctx.vs[blk, h, rows], ctx.gv, axis=1)  # [32, D]
            z = np.repeat(ctx.vz[blk, h, rows], ctx.gv, axis=1)
            out.append(_dequant(codes, s, z, ctx.act))
    return out[0], out[1]


def full_precision_tile(ctx: CtaInputs, kt: int, k1: int, h: int, slot: int, s: int, nq: int, k_chunk: np.ndarray,
                        v_chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """loadFullPrecisionTilePf (fullPrecisionRow): keys [kt, kt + 32) -> K, V [32, D]; zeros past k1."""
    cfg, d = ctx.cfg, ctx.d
    kr = np.zeros((KEYS, d), np.float32)
    vr = np.zeros((KEYS, d), np.float32)
    for i in range(KEYS):
        t = kt + i
        if t >= k1:
            continue
        if t < s:  # the store (n_q keys) is behind us; then the sinks, then the ring
            row = cfg.window_row(t - nq if t < nq + cfg.sink_tokens else t)
            kr[i], vr[i] = ctx.kwin[slot, h, row], ctx.vwin[slot, h, row]
        else:
            kr[i], vr[i] = k_chunk[t - s, h], v_chunk[t - s, h]
    return kr, vr


def cta(ctx: CtaInputs, qrows: np.ndarray, live: np.ndarray, pos: np.ndarray, k0: int, k1: int, nq: int,
        table_row: torch.Tensor, h: int, slot: int, s: int, k_chunk: np.ndarray, v_chunk: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prefill CTA: qrows [64, D] (zeros for dead rows) over keys [k0, k1) -> (m [64] log2 units, l [64],
    O [64, D]) before the division (the kernel divides when there is one split)."""
    d, act = ctx.d, ctx.act
    smscale = np.float32(LOG2E / math.sqrt(d))
    q = round_to(f32(qrows * smscale), act)  # A fragments of Q
    m = np.full(ROWS, -np.inf, np.float32)
    lsum = np.zeros((ROWS, 4), np.float32)  # per lane t of the row: keys 8 nt + 2t, 8 nt + 2t + 1
    o = np.zeros((ROWS, d), np.float32)
    for kt in range(k0, k1, KEYS):
        if kt < nq:
            blk = int(table_row[kt // ctx.cfg.block_size])
            kr, vr = quantized_tile(ctx, blk, h, kt % ctx.cfg.block_size)
        else:
            kr, vr = full_precision_tile(ctx, kt, k1, h, slot, s, nq, k_chunk, v_chunk)
        sc = np.zeros((ROWS, KEYS), np.float32)
        for nt in range(KEYS // 8):
            c = np.zeros((ROWS, 8), np.float32)
            for kb in range(d // 16):
                c = mma(c, q[:, 16 * kb:16 * kb + 16], kr[8 * nt:8 * nt + 8, 16 * kb:16 * kb + 16].T)
            sc[:, 8 * nt:8 * nt + 8] = c
        key = kt + np.arange(KEYS)
        visible = (key[None, :] < k1) & (key[None, :] <= pos[:, None])
        sc = np.where(visible, sc, -np.inf).astype(np.float32)
        m_new = np.maximum(m, sc.max(axis=1))
        with np.errstate(invalid="ignore"):  # -inf - -inf where no key is visible yet: alpha = 1 there
            alpha = np.where(m_new == m, 1.0, exp2(m - m_new)).astype(np.float32)
        m = m_new
        m_use = np.where(m == -np.inf, 0.0, m).astype(np.float32)
        lsum = f32(lsum * alpha[:, None])
        o = f32(o * alpha[:, None])
        w = round_to(exp2(f32(sc - m_use[:, None])), act)  # P: A fragments of O += P V
        for kk in range(2):  # the kernel adds each pair (w.x + w.y) to its lane's l, block by block
            for half in (0, 1):  # A registers of rows g (r & 1 = 0) / g + 8: n-tiles 2kk, 2kk + 1
                cols = 16 * kk + 8 * half + np.arange(8)
                pair = f32(w[:, cols[0::2]] + w[:, cols[1::2]])  # [64, 4 lanes]
                lsum = f32(lsum + pair)
        for nt in range(d // 8):
            for kk in range(2):
                o[:, 8 * nt:8 * nt + 8] = mma(o[:, 8 * nt:8 * nt + 8], w[:, 16 * kk:16 * kk + 16],
                                               vr[16 * kk:16 * kk + 16, 8 * nt:8 * nt + 8])
    lt = f32(f32(lsum[:, 0] + lsum[:, 1]) + f32(lsum[:, 2] + lsum[:, 3]))  # xor 1, then xor 2
    return m, lt, np.where(live[:, None], o, 0.0).astype(np.float32)
