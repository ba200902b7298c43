"""Lane-level CPU emulation of the baseline decode attention kernel (decode variant 1:
plugins/kernels/include/kiviDecodeMma.cuh); split_model.py reuses its fragments, chunk arithmetic and tolerance.

What it reproduces, in numpy, with the kernel's arithmetic (the fragment layouts, the bit conversion and the MMA
model shared with the prefill emulation live in fragments.py):
  - fragments: which lane and register hold which (token, channel) codes after the unpack of a FRAGMENT-order tile
    (trtllm_kivi/format.py), assembled into matrices with the PTX ISA's mma.m16n8k16 A/B/C layouts (g = lane >> 2,
    t = lane & 3; A: row g + 8 (r & 1), col 2t + 8 (r >> 1) + {0,1}; B: k 2t + 8 r + {0,1}, n g; C: row g + 8 (r >> 1),
    col 2t + (r & 1)), and the movmatrix.m8n8.trans that turns the C fragment of S into the B fragment of P^T;
  - the bit conversion: one shift + one lop3 per register, the code lands in the top b mantissa bits of 1.0
    (fp16 0x3C00 / bf16 0x3F80), so the register is the exact pair (1 + c_lo 2^-b, 1 + c_hi 2^-b); bf16 with 8-bit
    codes (7 mantissa bits) converts through fp32 instead (the register is the exact pair (c_lo, c_hi));
  - scores in log2 units: qsc = fl32(q fl32(log2(e) / sqrt D)), the softmax is ex2 (modelled as exact 2^x rounded to
    fp32; the hardware's ex2.approx is within 2^-22, inside attention_tolerance);
  - the folded scales (per group, as the kernel), every fold a packed 16-bit multiply or an MMA (T = act dtype,
    register = alpha + beta c): qa = rnd_T(qsc) / beta, q'' = rnd_T(qa rnd_T(s_k)) per K group, and the score bias
    beta (sum_ch qa rnd_T(z_k) - alpha/beta q'') as the kernel's m16n8k8 chains (low and high channel halves summed
    in fp32), which seeds the score MMA; for O^T: w = rnd_T(p), P' = rnd_T((w / beta) rnd_T(s_v)) per V group, and
    one MMA per 16 keys of [u ; 1] w^T with u = rnd_T(rnd_T(z_v) - alpha/beta rnd_T(s_v)): the V bias of each
    group and l = sum of w;
  - the decomposition: CTA = (8 query rows, KV head, split); 4 warps split the split's 32-key chunks into contiguous
    ranges, each with its own online softmax (m, l per head; a rescale by alpha = 1 when no maximum grows is what
    the kernel skips), merged once through shared memory; splits merged by the combine kernel (LSE weights, m
    written in natural-log units).
The tensor-core products are modelled as exact products summed in float64 and rounded once to fp32 per MMA (the
hardware's fp32 accumulation order differs: attention_tolerance bounds that too).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..format import KiviConfig, fragment_words_per_lane
from ..reference.attention import KiviBuffers
from ..reference.kv import dequantize_keys, dequantize_values
from . import prefill_model
from .fragments import (LOG2E, MANTISSA, CtaInputs, assemble_a, code_affine, exp2, f32, mma, p_to_b_fragment,
                        round_to, unpack_tile)
from .launch import LaunchPlan, launch_plan, prepare
from .variants import VARIANT_BASELINE

WARPS = 4
CHUNK = 32  # keys per warp iteration: two 16-key MMA tiles
TILE = 16
N = 8  # query rows per CTA (the MMA's N)
LN2 = np.float32(0.6931471805599453)
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


# ---------------------------------------------------------------------------------------------- one warp


class Warp:
    """One warp's online-softmax state over its key range (heads = the CTA's N = 8 rows)."""

    def __init__(self, d: int, n_vgroups: int) -> None:
        self.m = np.full(N, -np.inf, np.float32)  # log2 units
        self.o = np.zeros((d, N), np.float32)  # O^T: C fragments of the D / 16 channel m-tiles
        self.vb = np.zeros((16, N), np.float32)  # C fragment of [V bias per group ; l] (rows >= groups + 1 unused)
        self.n_vgroups = n_vgroups

    def finish(self, gv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """End of the key loop: l is row `groups` of vb, the V bias of group (16 mt + g) / Gv is added to O."""
        lsum = self.vb[self.n_vgroups].copy()
        o = f32(self.o + np.repeat(self.vb[:self.n_vgroups], gv, axis=0))
        return self.m, lsum, o


def quantized_tiles(ctx: CtaInputs, kind: str, blk: int, h: int, r: int) -> np.ndarray:
    """The two 16-token tiles of the chunk at block row r (a multiple of 32) -> A matrices [2, D/16, 16, 16] of the
    converted registers (keys: [key, channel]; values: V^T [channel, key])."""
    bits = ctx.cfg.k_bits if kind == "keys" else ctx.cfg.v_bits
    words = ctx.k_words if kind == "keys" else ctx.v_words
    nw = fragment_words_per_lane(ctx.d, bits)
    out = []
    for tau in (r // TILE, r // TILE + 1):
        w = words[blk, h, tau * 32 * nw:(tau + 1) * 32 * nw].reshape(32, nw)
        out.append(assemble_a(unpack_tile(w, bits, ctx.d, ctx.act)))
    return np.stack(out)


def _key_fold(qa: np.ndarray, sk: np.ndarray, zk: np.ndarray, act: torch.dtype, bits: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """foldKeyGroup: qa [N, D] (rnd(qsc) / beta) and the group's K scale / zero [D] as T -> (q'' [N, D], bias [N]).
    bias = beta (Cl + Ch), C = Z - A: two m16n8k8 chains over the low / high 8 channels of every 16-channel block,
    each MMA one fp32 rounding: Z accumulates qa . z, A (if alpha) q'' . (alpha / beta); then Z - A per half."""
    alpha, beta = code_affine(act, bits)
    qk = round_to(f32(qa * sk[None]), act)
    d = qa.shape[1]
    parts = []
    for half in (0, 1):
        cz = np.zeros(N, np.float32)
        ca = np.zeros(N, np.float32)
        for kb in range(d // 16):
            ch = 16 * kb + 8 * half + np.arange(8)
            cz = f32(cz + qa[:, ch].astype(np.float64) @ zk[ch].astype(np.float64))
            if alpha:
                ca = f32(ca + qk[:, ch].astype(np.float64).sum(axis=1) * (alpha / beta))
        parts.append(f32(cz - ca))
    return qk, f32(f32(parts[0] + parts[1]) * np.float32(beta))


def fma(a, b, c) -> np.ndarray:
    """fl32(a b + c) with one rounding (fmaf)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _warp_chunk(ctx: CtaInputs, warp: Warp, qa: np.ndarray, q_fp: np.ndarray, kt: int, k1: int, pos: np.ndarray,
                quant: bool, blk: int, h: int, slot: int, s: int, nq: int, k_chunk: np.ndarray,
                v_chunk: np.ndarray) -> None:
    """One 32-key chunk [kt, kt + 32) of one warp: S MMA (seeded with the bias), mask, online softmax, P V MMA and
    the [V bias ; l] MMA. Keys are in the kernel's order: store index j (token S + j) for j < n_q, then the S sink
    tokens, then the ring's tokens and the chunk's (key = token from S + n_q on)."""
    d, act, cfg = ctx.d, ctx.act, ctx.cfg
    nvg = d // ctx.gv
    if quant:
        r = kt % cfg.block_size
        ak = quantized_tiles(ctx, "keys", blk, h, r)  # [2, D/16, 16 keys, 16 ch]
        av = quantized_tiles(ctx, "values", blk, h, r)  # [2, D/16, 16 ch, 16 keys]
        grp = r // cfg.group_size
        sk, zk = round_to(ctx.ks[blk, h, grp], act), round_to(ctx.kz[blk, h, grp], act)  # [D] as T
        bq, bias = _key_fold(qa, sk, zk, act, cfg.k_bits)
        bq = bq.T  # B of S: [D (k), N]
        rows_v = r + np.arange(CHUNK)
        sv, zv = round_to(ctx.vs[blk, h, rows_v], act), round_to(ctx.vz[blk, h, rows_v], act)  # [32, groups]
        alpha_v, beta_v = code_affine(act, cfg.v_bits)
        u = round_to(f32(zv.astype(np.float64) - (alpha_v / beta_v) * sv.astype(np.float64)), act)  # [32, groups]
    else:
        keys = kt + np.arange(CHUNK)
        kr = np.zeros((CHUNK, d), np.float32)
        vr = np.zeros((CHUNK, d), np.float32)
        for i, t in enumerate(keys):  # window rows (t < s), chunk rows (t < k1), zeros past k1
            if t < s:  # key order: the store (tokens S..S + n_q), then the sinks, then the ring
                row = cfg.window_row(int(t) - nq if t < nq + cfg.sink_tokens else int(t))
                kr[i], vr[i] = ctx.kwin[slot, h, row], ctx.vwin[slot, h, row]
            elif t < k1:
                kr[i], vr[i] = k_chunk[t - s, h], v_chunk[t - s, h]
        ak = kr.reshape(2, 16, d // 16, 16).transpose(0, 2, 1, 3)  # [2, D/16, 16 keys, 16 ch]
        av = vr.reshape(2, 16, d // 16, 16).transpose(0, 2, 3, 1)  # [2, D/16, 16 ch, 16 keys]
        bias = np.zeros(N, np.float32)
        bq = q_fp.T
    sc = np.zeros((CHUNK, N), np.float32)
    for tau in range(2):
        c = np.broadcast_to(bias[None], (16, N)).astype(np.float32)
        for kb in range(d // 16):
            c = mma(c, ak[tau, kb], bq[16 * kb:16 * kb + 16])
        sc[16 * tau:16 * tau + 16] = c
    key = kt + np.arange(CHUNK)
    visible = (key[:, None] < k1) & (key[:, None] <= pos[None, :])
    sc = np.where(visible, sc, -np.inf).astype(np.float32)
    m_new = np.maximum(warp.m, sc.max(axis=0))
    with np.errstate(invalid="ignore"):  # -inf - -inf where no key is visible yet: alpha = 1 there
        alpha = np.where(m_new == warp.m, 1.0, exp2(warp.m - m_new)).astype(np.float32)
    warp.m = m_new
    warp.o = f32(warp.o * alpha[None])
    warp.vb = f32(warp.vb * alpha[None])
    m_use = np.where(m_new == -np.inf, 0.0, m_new).astype(np.float32)
    p = exp2(f32(sc - m_use[None]))  # [32 keys, N]
    w = round_to(p, act)  # the B fragment of P^T (pack + movmatrix)
    for tau in range(2):
        wt = p_to_b_fragment(w[16 * tau:16 * tau + 16])  # [16 keys, N], through the lanes: equals w
        a_bias = np.zeros((16, 16), np.float32)  # rows: V groups, then the ones row (l)
        if quant:
            alpha_v, beta_v = code_affine(act, cfg.v_bits)
            wb = f32(wt * np.float32(1.0 / beta_v))  # exact: a power of two
            a_bias[:nvg] = u[16 * tau:16 * tau + 16].T
            for vg in range(nvg):
                pp = round_to(f32(wb * sv[16 * tau:16 * tau + 16, vg][:, None]), act)  # P' [16, N]
                for cb in range(vg * ctx.gv // 16, (vg + 1) * ctx.gv // 16):
                    warp.o[16 * cb:16 * cb + 16] = mma(warp.o[16 * cb:16 * cb + 16], av[tau, cb], pp)
        else:
            for cb in range(d // 16):
                warp.o[16 * cb:16 * cb + 16] = mma(warp.o[16 * cb:16 * cb + 16], av[tau, cb], wt)
        a_bias[nvg] = 1.0
        warp.vb = mma(warp.vb, a_bias, wt)


def warp_ranges(k0: int, k1: int) -> list[tuple[int, int]]:
    """Contiguous 32-key chunk ranges [a, b) of the 4 warps over the split's keys [k0, k1)."""
    n = -(-(k1 - k0) // CHUNK)
    per = -(-n // WARPS)
    return [(k0 + CHUNK * min(w * per, n), k0 + CHUNK * min((w + 1) * per, n)) for w in range(WARPS)]


def cta(ctx: CtaInputs, qrows: np.ndarray, live: np.ndarray, pos: np.ndarray, k0: int, k1: int, nq: int,
        table_row: torch.Tensor, h: int, slot: int, s: int, k_chunk: np.ndarray, v_chunk: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One CTA: qrows [8, D] (zeros for dead rows) over keys [k0, k1) -> merged (m [8] in log2 units, l [8],
    O [8, D])."""
    d = ctx.d
    smscale = np.float32(LOG2E / math.sqrt(d))
    qsc = f32(qrows * smscale)  # log2 units
    q_fp = round_to(qsc, ctx.act)  # B of S for full-precision keys
    _, beta_k = code_affine(ctx.act, ctx.cfg.k_bits)
    qa = f32(q_fp * np.float32(1.0 / beta_k))  # exact: a power of two
    results = []
    for a, b in warp_ranges(k0, k1):
        warp = Warp(d, d // ctx.gv)
        for kt in range(a, b, CHUNK):
            quant = kt < nq
            blk = int(table_row[kt // ctx.cfg.block_size]) if quant else -1
            _warp_chunk(ctx, warp, qa, q_fp, kt, k1, pos, quant, blk, h, slot, s, nq, k_chunk, v_chunk)
        results.append(warp.finish(ctx.gv))
    # merge the warps once (shared memory in the kernel)
    ms = np.stack([r[0] for r in results])  # [4, N]
    mx = ms.max(axis=0)
    f = np.where(ms == -np.inf, 0.0, exp2(ms - mx[None])).astype(np.float32)
    lsum = np.zeros(N, np.float32)
    o = np.zeros((d, N), np.float32)
    for w, (_, lw, ow) in enumerate(results):
        lsum = fma(lw, f[w], lsum)
        o = fma(ow, f[w][None], o)
    return mx, lsum, o.T


# ---------------------------------------------------------------------------------------------- the step


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor, past_len: torch.Tensor,
              chunk_len: torch.Tensor, block_table: torch.Tensor, buffers: KiviBuffers, cfg: KiviConfig,
              max_chunk_len: int = 0, max_seq_len: int = 0, num_sms: int = 0, ctas_per_sm: int = 0
              ) -> tuple[torch.Tensor, LaunchPlan, int]:
    """The attend half of a step as kiviDecodeMmaKernel (sequences of < 64 query rows), kiviPrefillMmaKernel
    (trtllm_kivi/cuda/prefill_model.py: the others) and kiviCombineKernel compute it -> (out, plan, error bits).
    Buffers are not modified; rows of invalid sequences and rows no sequence covers are zero."""
    tokens, nh, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    batch = slot_ids.shape[0]
    plan = launch_plan(cfg, nh, hkv, d, batch, tokens, block_table.shape[1], max_chunk_len, max_seq_len, num_sms,
                       ctas_per_sm, decode_variant=VARIANT_BASELINE)
    slots, pasts, chunks = slot_ids.tolist(), past_len.tolist(), chunk_len.tolist()
    infos, flag = prepare(plan, cfg, slots, pasts, chunks, block_table, tokens, num_blocks,
                          buffers.k_window.shape[0])
    grp, act = plan.group_heads, q.dtype
    ctx = CtaInputs(buffers, cfg, act, d)
    out = np.zeros((tokens, nh, d), np.float32)
    ml = np.zeros((tokens, nh, plan.num_splits, 2), np.float32)
    part = np.zeros((tokens, nh, plan.num_splits, d), np.float32)
    qf, kf, vf = q.float().numpy(), k.float().numpy(), v.float().numpy()
    # the decode kernel's tiles (8 rows), then the prefill kernel's (64 rows): kiviPrepareKernel gives every
    # sequence to exactly one of them
    kernels = [(plan.num_tiles, N, "tile_offset", "tile_count", cta),
               (plan.num_prefill_tiles, prefill_model.ROWS, "prefill_tile_offset", "prefill_tile_count",
                prefill_model.cta)]
    work = [(tile, rows, off, cnt, fn) for n_tiles, rows, off, cnt, fn in kernels for tile in range(n_tiles)]
    for tile, rows, off_field, cnt_field, cta_fn in work:
        b = max(i for i in range(batch) if getattr(infos[i], off_field) <= tile)  # findSequence
        info = infos[b]
        off = getattr(info, off_field)
        if tile >= off + getattr(info, cnt_field) or not info.valid:
            continue
        s, c, slot = pasts[b], chunks[b], slots[b]
        rho = (tile - off) * rows + np.arange(rows)  # flattened rows of the chunk
        live = rho < c * grp
        r_tok, r_head = np.where(live, rho // grp, 0), np.where(live, rho % grp, 0)
        key_end = s + int(r_tok[live].max()) + 1
        nq = cfg.num_quantized(s)
        tok = info.token_offset
        k_chunk, v_chunk = kf[tok:tok + c], vf[tok:tok + c]
        pos = s + r_tok
        for h in range(hkv):
            qrows = np.where(live[:, None], qf[tok + r_tok, h * grp + r_head], 0.0).astype(np.float32)
            for split in range(plan.num_splits):
                k0 = split * info.split_len
                if k0 >= key_end:
                    continue
                k1 = min(k0 + info.split_len, key_end)
                m, lsum, o = cta_fn(ctx, qrows, live, pos, k0, k1, nq, block_table[b], h, slot, s, k_chunk,
                                    v_chunk)
                for n in np.nonzero(live)[0]:
                    t_, hd = tok + r_tok[n], h * grp + r_head[n]
                    if plan.num_splits == 1:
                        out[t_, hd] = o[n] / (lsum[n] if lsum[n] > 0 else 1.0)
                    else:
                        ml[t_, hd, split] = (np.float32(m[n] * LN2), lsum[n])  # natural-log units
                        part[t_, hd, split] = o[n]
    if plan.num_splits > 1:  # kiviCombineKernel
        for b, info in enumerate(infos):
            if not info.valid:
                continue
            for i in range(chunks[b]):
                used = (pasts[b] + i) // info.split_len + 1
                mm, ll = ml[info.token_offset + i, :, :used, 0], ml[info.token_offset + i, :, :used, 1]
                m_max = mm.max(axis=1, keepdims=True)
                with np.errstate(invalid="ignore"):
                    wgt = np.where(mm == -np.inf, 0.0, np.exp(mm - m_max)).astype(np.float32)  # [H, used]
                l_tot = (ll * wgt).sum(axis=1)
                a = (part[info.token_offset + i, :, :used] * wgt[..., None]).sum(axis=1)
                out[info.token_offset + i] = a / np.where(l_tot > 0, l_tot, 1)[:, None]
    return torch.from_numpy(out).to(act), plan, flag


# ---------------------------------------------------------------------------------------------- tolerance


def history_stats(buffers: KiviBuffers, cfg: KiviConfig, slot: int, table_row: torch.Tensor, past: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored state after `past` tokens as the kernel sees it: K, V [Hkv, past, D] dequantized in fp32 WITHOUT
    the reference's rounding to the activation dtype (window rows as stored), and the per-key, per-channel K and V
    scales [Hkv, past, D] (0 for full-precision keys)."""
    _, hkv, _, d = buffers.k_window.shape
    n_q = cfg.num_quantized(past)
    ks, vs, kss, vss = [], [], [], []
    if n_q:
        nb = -(-n_q // cfg.block_size)
        blocks = table_row[:nb].long()
        cat = lambda t: t[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, t.shape[-1])  # noqa: E731
        kc, ksc, kz = (cat(t) for t in buffers[0:3])
        vc, vsc, vz = (cat(t) for t in buffers[3:6])
        ks.append(dequantize_keys(kc, ksc, kz, cfg, n_q, d, torch.float32))
        vs.append(dequantize_values(vc[:, :n_q], vsc[:, :n_q], vz[:, :n_q], cfg, d, torch.float32))
        kss.append(ksc[:, : n_q // cfg.group_size].float().repeat_interleave(cfg.group_size, 1))
        vss.append(vsc[:, :n_q].float().repeat_interleave(cfg.value_group_size(d), 2))
    rows = [cfg.window_row(t) for t in list(range(min(cfg.sink_tokens, past)))
            + list(range(cfg.sink_tokens + n_q, past))]  # sinks, then the ring (any key order: all are < past)
    ks.append(buffers.k_window[slot][:, rows].float())
    vs.append(buffers.v_window[slot][:, rows].float())
    kss.append(torch.zeros(hkv, len(rows), d))
    vss.append(torch.zeros(hkv, len(rows), d))
    return tuple(torch.cat(x, dim=1) for x in (ks, vs, kss, vss))  # type: ignore[return-value]


def attention_tolerance(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, ks_all: torch.Tensor,
                        vs_all: torch.Tensor, past: int, cfg: KiviConfig, act: torch.dtype) -> torch.Tensor:
    """A bound on |kernel - reference| for one sequence's chunk, from the folded rounding (first order in u, the
    unit roundoff of act: 2^-11 fp16, 2^-8 bf16; e = 2^-23, fp32 accumulation with truncation).

    q [c, H, D] at positions past..past+c-1; k_all/v_all [Hkv, past + c, D] the fp32 K/V the kernel folds (history
    unrounded, then window and chunk rows); ks_all/vs_all [Hkv, past + c, D] the per-key K/V scales (0 where full
    precision). Per (query row n, key i), with qsc = q / sqrt(D), b = bits, and |z_i| <= |k_i| + (2^b - 1) s_i:
      score error  d_i <= 2u sum|qsc k_i|          (the reference rounds dequantized K to act; the full-precision
                                                   path rounds qsc to act)
                        + 3u sum|qsc| 2^b s_i    (q'' = rnd(rnd(qsc) rnd(s) / beta): up to three roundings of
                                                   the code part; the '1' of each converted code cancels with the
                                                   same q'' in the bias MMA)
                        + u sum|qsc| (|k_i| + 2^b s_i)   (rnd(qsc) and rnd(z) in the zero term)
                        + (D/8 + 8) e 2^(b+1) sum|qsc| (|k_i| + 2^b s_i)   (fp32 sums of the uncancelled terms)
      softmax:     |d out| <= exp(max d) sum_i p_i (exp(d_i) - 1) (|v_i| + |out|)   (|v_i - out| bounded by the sum)
      values:      + u sum_i p_i (6 |v_i| + 6 2^b vs_i) + 2u |out|   (w = rnd(p) in numerator and denominator,
                                                   P' = rnd(w rnd(s) / beta), u = rnd(z - alpha s / beta) not
                                                   cancelling P' exactly, the reference's rounding of V to act)
                   + (keys/16 + 8) e sum_i p_i (vs_i 2^(b+1) + |v_i|) + (keys/16) e |out|   (fp32 accumulation of O
                                                   and l, one rounding per MMA)
      output:      + one ulp of act at |out| (each side rounds once) + 2^-20 max|v| (ex2.approx, rescaling, merges).
    Returns tol [c, H, D] (float32)."""
    c, nh, d = q.shape
    hkv = k_all.shape[0]
    grp = nh // hkv
    u = UNIT_ROUNDOFF[act]
    e = 2.0 ** -23
    qsc = q.double().permute(1, 0, 2).reshape(hkv, grp * c, d) / math.sqrt(d)  # [Hkv, grp*c, D] rows (head, token)
    k, v, ks, vs = (x.double() for x in (k_all, v_all, ks_all, vs_all))
    aq = qsc.abs()
    lk = 2 ** cfg.k_bits
    lv = 2 ** cfg.v_bits
    kz = k.abs() + lk * ks  # a bound on |z| + 2^b s, per key and channel
    delta = (2 * u * (aq @ k.abs().transpose(1, 2)) + 3 * u * lk * (aq @ ks.transpose(1, 2))
             + (u + (d / 8 + 8) * e * 2 * lk) * (aq @ kz.transpose(1, 2)))  # [Hkv, rows, keys]
    scores = qsc @ k.transpose(1, 2)
    n = k.shape[1]
    pos = past + torch.arange(c).repeat(grp)  # rows are (head-in-group, token)
    mask = torch.arange(n)[None, :] > pos[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [Hkv, rows, keys]
    out = p @ v  # [Hkv, rows, D]
    dmax = delta.masked_fill(mask[None], 0).amax(dim=-1, keepdim=True)
    w = (p * torch.expm1(delta)).masked_fill(mask[None], 0)
    # sum_i w_i |v_i - out| <= w @ |v| + |out| sum_i w_i (no [rows, keys, D] temporary for long contexts)
    tol = torch.exp(dmax) * (w @ v.abs() + out.abs() * w.sum(dim=-1, keepdim=True))
    tol = (tol + u * (p @ (6 * v.abs() + 6 * lv * vs)) + 2 * u * out.abs()
           + (n / 16 + 8) * e * (p @ (vs * 2 * lv + v.abs())) + (n / 16) * e * out.abs())
    out_act = out.to(act).float()
    mant = MANTISSA[act]
    ulp = torch.exp2(torch.floor(torch.log2(out_act.abs().clamp_min(2.0 ** -14))) - mant)
    tol = tol + ulp.double() + 2.0 ** -20 * v.abs().max()
    return tol.reshape(hkv, grp, c, d).permute(2, 0, 1, 3).reshape(c, nh, d).float()


def step_tolerance(buffers_before: KiviBuffers, cfg: KiviConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_ids: torch.Tensor, past_len: torch.Tensor, chunk_len: torch.Tensor,
                   block_table: torch.Tensor) -> torch.Tensor:
    """attention_tolerance for every sequence of a ragged step (CPU tensors), from the buffers before the step."""
    tol = torch.zeros(q.shape)
    off = 0
    for b in range(len(chunk_len)):
        c, s = int(chunk_len[b]), int(past_len[b])
        if c == 0:
            continue
        kh, vh, ksh, vsh = history_stats(buffers_before, cfg, int(slot_ids[b]), block_table[b], s)
        kc, vc = k[off:off + c].transpose(0, 1).float(), v[off:off + c].transpose(0, 1).float()
        z = torch.zeros_like(kc)
        tol[off:off + c] = attention_tolerance(q[off:off + c], torch.cat([kh, kc], 1), torch.cat([vh, vc], 1),
                                               torch.cat([ksh, z], 1), torch.cat([vsh, z], 1), s, cfg, q.dtype)
        off += c
    return tol
