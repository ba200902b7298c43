"""The declared table of the decode-attention kernels: per kernel its source loops and trip counts, the executed-path
rules, the unrolled-copy rules and the lane -> address mapping of every shared-memory access (SIMT, WMMA, mma.sync)."""

from __future__ import annotations

from collections.abc import Callable

from .plan import MAX_TILE_ROWS, MMA_STAGES, MMA_TILE_ROWS, MMA_WARPS, ceil_div, mma_launch_plan
from .shapes import BITS, GROUP, KEY_TILE, ModelShape
from .spec import Ctx, CopyRule, KernelSpec, LoopSpec, PathRule, SmemAccess, kivi_code_words, kivi_tile_bytes, lanes

ATT = "kiviAttention.cuh"
TC = "kiviAttentionTc.cuh"
COMMON = "kiviCommon.cuh"
THREADS = 128
LOADSCALE_BF16 = "if (dtype == kKIVI_BFLOAT16)\n    {\n        return __bfloat162float"


def _rows_per_warp(ctx: Ctx, j: int) -> float:
    """SIMT kernel: share of the 4 warps that own row warp + 4 j (decode: rows = group heads)."""
    rows = ctx.shape.group_heads
    return sum(1 for w in range(4) if w + 4 * j < rows) / 4.0


# Shared arrays of the SIMT kernel (fp32): kS[32][D + 1], vS[32][D], qS[16][D] (kiviAttention.cuh).
# Lane -> address assumptions: thread t = 32 w + lane of warp w = 0, loop iteration 0 (the bank pattern is the same for
# every iteration and unrolled index i, which only add a uniform offset), D = 128, 2-bit codes (16 per word).
def _simt_kstore(lane: int) -> int:  # kS[wi*16 + i][d] with (wi, d) = (u / D, u % D), u = lane
    d, wi = lane % 128, lane // 128
    return ((wi * 16) * 129 + d) * 4


def _simt_vstore(lane: int) -> int:  # vS[tok][wi*16 + i] with (tok, wi) = (u / 8, u % 8): 16-way conflict
    tok, wi = lane // 8, lane % 8
    return (tok * 128 + wi * 16) * 4


SIMT_SMEM = (
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i][d]", "STS", lanes(_simt_kstore), "K dequant store, d = lane"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i + kPW / 2][d]", "STS", lanes(_simt_kstore), "K dequant store"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i]", "STS", lanes(_simt_vstore),
               "V dequant store: tok = lane / 8, word = lane % 8, 16 floats apart -> banks {i, 16 + i}"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i + kPW / 2]", "STS", lanes(_simt_vstore), "V dequant store"),
    SmemAccess(ATT, "float const kv = kS[lane][d];", "LDS", lanes(lambda lane: lane * 129 * 4),
               "row stride D + 1 = 129 words: conflict-free"),
    SmemAccess(ATT, "score[j] += qS[warp + kATTN_WARPS * j][d] * kv;", "LDS", lanes(lambda lane: 0),
               "q row of the warp: one address, broadcast"),
    SmemAccess(ATT, "acc[j][i] += pj * vS[jj][lane + 32 * i];", "LDS", lanes(lambda lane: lane * 4),
               "consecutive words"),
    SmemAccess(ATT, "qS[row][u % kD] = x;", "STS", lanes(lambda lane: lane * 4), "consecutive words"),
)

SIMT_RULES = (
    PathRule(ATT, "case 4: loadQuantizedKeys", 0, "k_bits = 2"),
    PathRule(ATT, "default: loadQuantizedKeys", 0, "k_bits = 2"),
    PathRule(ATT, "case 4: loadQuantizedValues", 0, "v_bits = 2"),
    PathRule(ATT, "default: loadQuantizedValues", 0, "v_bits = 2"),
    PathRule(ATT, "loadFullPrecision<T, kD>(p, h, slot", 0,
             "quantized history tiles (the window's <= 5 tiles per sequence are charged at the quantized tile's "
             "instructions, at their own fp16 bytes)"),
    PathRule(COMMON, LOADSCALE_BF16, 0, "fp16 scales: loadScale returns at the first test"),
    PathRule(COMMON, "return static_cast<float const*>(ptr)[idx];", 0, "fp16 scales"),
    PathRule(ATT, "case 1: dotRows<kD, 1>", lambda c: _rows_per_warp(c, 0) - _rows_per_warp(c, 1),
             "warps with exactly one row (decode: rows = group heads)"),
    PathRule(ATT, "case 2: dotRows<kD, 2>", lambda c: _rows_per_warp(c, 1) - _rows_per_warp(c, 2), "two rows"),
    PathRule(ATT, "case 3: dotRows<kD, 3>", lambda c: _rows_per_warp(c, 2) - _rows_per_warp(c, 3), "three rows"),
    PathRule(ATT, "default: dotRows<kD, kROWS_PER_WARP>", lambda c: _rows_per_warp(c, 3), "four rows"),
    PathRule(ATT, "out[(token * p.numHeads + head) * kD + lane + 32 * i] = ActTraits<T>::fromFloat(acc[j][i] * inv);",
             lambda c: 0.0 if c.split else 1.0, "numSplits == 1 only"),
    PathRule(ATT, "float const inv = l[j] > 0.F ? 1.F / l[j] : 0.F;", lambda c: 0.0 if c.split else 1.0,
             "numSplits == 1 only"),
    PathRule(ATT, "partialAcc[idx * kD + lane + 32 * i] = acc[j][i];", lambda c: 1.0 if c.split else 0.0,
             "numSplits > 1 only"),
    PathRule(ATT, "partialMl[idx * 2] = m[j];", lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
    PathRule(ATT, "partialMl[idx * 2 + 1] = l[j];", lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
    PathRule(ATT, "int64_t const idx = (token * p.numHeads + head) * plan.numSplits + split;",
             lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
)

SIMT_COPIES = (
    CopyRule(ATT, "int32_t const row = warp + kATTN_WARPS * j;\n            if (row >= rows)",
             "acc[j][i] += pj * vS[jj][lane + 32 * i];", "if (row >= rows)\n            {\n                continue; // warp-uniform",
             lambda c: [_rows_per_warp(c, j) for j in range(4)], "softmax + PV of row warp + 4 j"),
    CopyRule(ATT, "int32_t const row = warp + kATTN_WARPS * j;\n        if (row >= rows)\n        {\n            continue;\n        }\n        int64_t const token",
             "partialMl[idx * 2 + 1] = l[j];", "if (row >= rows)\n        {\n            continue;\n        }\n        int64_t const token",
             lambda c: [_rows_per_warp(c, j) for j in range(4)], "epilogue of row warp + 4 j"),
)


def _tile_words(c: Ctx) -> int:
    """Code words of K (or V) per 32-key tile."""
    return KEY_TILE * c.shape.head_dim // (32 // BITS)


def _simt_loops() -> tuple[LoopSpec, ...]:
    words = _tile_words
    return (
        LoopSpec("tile", lambda c: 1, "BRA"),
        LoopSpec("kwords", lambda c: ceil_div(words(c), THREADS), "LDG"),
        LoopSpec("vwords", lambda c: ceil_div(words(c), THREADS), "LDG"),
        LoopSpec("dot", lambda c: c.shape.head_dim, "LDS"),
        LoopSpec("pv", lambda c: KEY_TILE, "SHFL"),
        LoopSpec("qload", lambda c: MAX_TILE_ROWS * c.shape.head_dim // THREADS, "STS"),
    )


# Tensor-core (WMMA) kernel, 16-bit smem tiles kS/vS[32][D + 8], qS[16][D + 8], sS[16][36] fp32, pS[16][40], oS[16][D+4]
def _tc_vstore(lane: int) -> int:  # vS[tok][wi*16 + i] (16-bit), tok = lane / 8, wi = lane % 8: 4-way conflict
    tok, wi = lane // 8, lane % 8
    return (tok * 136 + wi * 16) * 2


def _tc_rescale(lane: int) -> int:  # oS[u / D][u % D] fp32, row stride D + 4
    return lane * 4


def _ldsm_x4(row_bytes: int) -> Callable[[int], int]:
    """ldmatrix .x4 of a 16 x 16 16-bit tile: lane l gives the address of row (l % 8) + 8 ((l / 8) % 2), 8-element
    column block l / 16 (matrices 0-3 = rows 0-7 / 8-15 x columns 0-7 / 8-15; the same for .trans)."""
    return lambda lane: ((lane % 8) + 8 * ((lane // 8) % 2)) * row_bytes + (lane // 16) * 16


def _acc_frag(row_words: int) -> Callable[[int], int]:
    """fp32 16 x 16 accumulator as two m16n8 halves (LDS.64 / STS.64): lane l holds row l / 4 (+8), columns
    2 (l % 4) + {0, 1} (+8)."""
    return lambda lane: ((lane // 4) * row_words + 2 * (lane % 4)) * 4


TC_SMEM = (
    SmemAccess(TC, "wmma::load_matrix_sync(aFrag, &qS[0][kk * 16], kLDH);", "LDSM", lanes(_ldsm_x4(272)),
               "q A fragment, rows 272 B apart: 8 rows hit 8 distinct 16-byte bank groups"),
    SmemAccess(TC, "wmma::load_matrix_sync(bFrag, &kS[warp * 16][kk * 16], kLDH);", "LDSM", lanes(_ldsm_x4(272)),
               "K B fragment (col-major = K rows), rows 272 B apart"),
    SmemAccess(TC, "wmma::load_matrix_sync(aFrag, &pS[0][kk * 16], kLDP);", "LDSM", lanes(_ldsm_x4(80)),
               "P A fragment, rows 80 B apart (5 x 16 B: distinct mod 8)"),
    SmemAccess(TC, "wmma::load_matrix_sync(bFrag, &vS[kk * 16][nt * 16], kLDH);", "LDSM", lanes(_ldsm_x4(272)),
               "V B fragment (.trans), rows 272 B apart"),
    SmemAccess(TC, "wmma::store_matrix_sync(&sS[0][warp * 16], sFrag, kLDS, wmma::mem_row_major);", "STS",
               lanes(_acc_frag(36)), "S accumulator to sS (row 36 words)"),
    SmemAccess(TC, "wmma::load_matrix_sync(oFrag, &oS[0][nt * 16], kLDO, wmma::mem_row_major);", "LDS",
               lanes(_acc_frag(132)), "O accumulator from oS (row 132 words)"),
    SmemAccess(TC, "wmma::store_matrix_sync(&oS[0][nt * 16], oFrag, kLDO, wmma::mem_row_major);", "STS",
               lanes(_acc_frag(132)), "O accumulator to oS"),
    SmemAccess(TC, "alphaS[sRow] = alpha;", "STS", lanes(lambda lane: (lane // 8) * 4 if lane % 8 == 0 else None),
               "one lane of 8 per row"),
    SmemAccess(TC, "qS[row][u % kD] = x;", "STS", lanes(lambda lane: lane * 2), "16-bit, consecutive"),
    SmemAccess(TC, "oS[row][u % kD] = 0.F;", "STS", lanes(lambda lane: lane * 4), "consecutive words"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i][d]", "STS", lanes(lambda lane: (lane % 128) * 2),
               "K dequant store (16-bit), d = lane: 64 contiguous bytes"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i + kPW / 2][d]", "STS", lanes(lambda lane: (lane % 128) * 2),
               "K dequant store"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i]", "STS", lanes(_tc_vstore),
               "V dequant store: tok = lane / 8, word = lane % 8, rows 272 B apart -> 8 banks x 4 words"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i + kPW / 2]", "STS", lanes(_tc_vstore), "V dequant store"),
    SmemAccess(TC, "oS[u / kD][u % kD] *= alphaS[u / kD];", "LDS", lanes(_tc_rescale), "oS row: consecutive words"),
    SmemAccess(TC, "oS[u / kD][u % kD] *= alphaS[u / kD];", "STS", lanes(_tc_rescale), "oS row: consecutive words"),
    SmemAccess(TC, "sc[j] = visible ? sS[sRow][sCol + j] * softmaxScale : -INFINITY;", "LDS",
               lanes(lambda lane: (lane // 8) * 36 * 4 + (lane % 8) * 16),
               "row = lane / 8 (rows 144 B apart), 4 consecutive floats per thread (LDS.128)"),
    SmemAccess(TC, "pS[sRow][sCol + j] = pr;", "STS", lanes(lambda lane: (lane // 8) * 40 * 2 + (lane % 8) * 8),
               "row = lane / 8 (80 B apart), 4 halves per thread"),
)

TC_RULES = (
    PathRule(ATT, "case 4: loadQuantizedKeys", 0, "k_bits = 2"),
    PathRule(ATT, "default: loadQuantizedKeys", 0, "k_bits = 2"),
    PathRule(ATT, "case 4: loadQuantizedValues", 0, "v_bits = 2"),
    PathRule(ATT, "default: loadQuantizedValues", 0, "v_bits = 2"),
    PathRule(ATT, "loadFullPrecision<T, kD>(p, h, slot", 0, "quantized history tiles"),
    PathRule(COMMON, LOADSCALE_BF16, 0, "fp16 scales"),
    PathRule(COMMON, "return static_cast<float const*>(ptr)[idx];", 0, "fp16 scales"),
    PathRule(TC, "wmma::fill_fragment(sFrag, 0.F);", 0.5, "S = Q K^T: warps 0-1 of 4"),
    PathRule(TC, "wmma::load_matrix_sync(aFrag, &qS[0][kk * 16], kLDH);", 0.5, "warps 0-1"),
    PathRule(TC, "wmma::load_matrix_sync(bFrag, &kS[warp * 16][kk * 16], kLDH);", 0.5, "warps 0-1"),
    PathRule(TC, "wmma::mma_sync(sFrag, aFrag, bFrag, sFrag);", 0.5, "warps 0-1"),
    PathRule(TC, "wmma::store_matrix_sync(&sS[0][warp * 16], sFrag, kLDS, wmma::mem_row_major);", 0.5, "warps 0-1"),
    PathRule(TC, "alphaS[sRow] = alpha;", 0.25, "one thread of 8 per row: every warp branches, 1/4 of lanes"),
    PathRule(TC, "out[(token * p.numHeads + head) * kD + d] = ActTraits<T>::fromFloat(l > 0.F ? oS[row][d] / l : 0.F);",
             lambda c: 0.0 if c.split else 1.0, "numSplits == 1 only"),
    PathRule(TC, "float const l = lS[row];", lambda c: 0.0 if c.split else 1.0, "numSplits == 1 only"),
    PathRule(TC, "int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;",
             lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
    PathRule(TC, "partialAcc[idx * kD + d] = oS[row][d];", lambda c: 1.0 if c.split else 0.0, "numSplits > 1"),
    PathRule(TC, "partialMl[idx * 2] = mS[row];", lambda c: 1.0 if c.split else 0.0, "numSplits > 1"),
    PathRule(TC, "partialMl[idx * 2 + 1] = lS[row];", lambda c: 1.0 if c.split else 0.0, "numSplits > 1"),
)


def _tc_loops() -> tuple[LoopSpec, ...]:
    words = _tile_words
    return (
        LoopSpec("tile", lambda c: 1, "BRA"),
        LoopSpec("kwords", lambda c: ceil_div(words(c), THREADS), "LDG"),
        LoopSpec("vwords", lambda c: ceil_div(words(c), THREADS), "LDG"),
        LoopSpec("rescale", lambda c: MAX_TILE_ROWS * c.shape.head_dim // THREADS, "STS"),
        LoopSpec("qload", lambda c: MAX_TILE_ROWS * c.shape.head_dim // THREADS, "STS"),
        LoopSpec("out", lambda c: ceil_div(c.shape.group_heads * c.shape.head_dim, THREADS), "STG"),
    )


# The mma.sync decode kernel (plugins/kernels/include/kiviDecodeMma.cuh): 4 warps, each streams its own
# contiguous range of 32-key chunks through 3 cp.async stages, so one chunk (= one 3,072-byte KIVI tile) is the work of
# ONE warp (tile_warps = 1). Its source carries no KIVI_MODEL tags, so the loops are declared here by source text.
MMA = "kiviDecodeMma.cuh"


def mma_stage_bytes(shape: ModelShape) -> int:
    return kivi_tile_bytes(shape)  # K + V words of a 32-key chunk + K scale/zero [D] + V scale/zero [32][D / Gv]


def _mma_q_lanes(lane: int) -> int:  # float2 qS[g][16 kb + 8 reg + 2 t], rows of D + 8 floats (544 B)
    g, t = lane // 4, lane % 4
    return g * 136 * 4 + 2 * t * 4


def _mma_vrow_lanes(lane: int) -> int:  # V scale / zero row of key 2t (D = 128, Gv = 32: 4 fp16 = 8 bytes per key)
    return 2 * (lane % 4) * 8


MMA_SMEM = (
    SmemAccess(MMA, "w[tau][j] = src[j];", "LDS",
               lanes(lambda lane: lane * 16), "K words of the lane's A registers: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "w[j] = src[j];\n                }\n                uint32_t const wb0", "LDS",
               lanes(lambda lane: lane * 16), "V words: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "float2 const qq = *reinterpret_cast<float2 const*>(&qS[g][16 * kb + 8 * (k % 2) + 2 * t]);", "LDS",
               lanes(_mma_q_lanes), "q row g = lane / 4 (rows of D + 8 = 136 floats), channels 2 t, 2 t + 1: "
               "conflict-free (once per CTA)"),
    SmemAccess(MMA, "return *reinterpret_cast<uint32_t const*>(base + i * 2);", "LDS",
               lanes(lambda lane: (lane % 4) * 4), "staged K scale/zero pair of channels 2 t, 2 t + 1 (generic "
               "pointer), broadcast over g: one wavefront"),
    SmemAccess(MMA, "s[k][j] = reinterpret_cast<uint32_t const*>(sBase + key * kVG * 2)[j];", "LDS",
               lanes(_mma_vrow_lanes), "staged V scale row (D / 32 fp16) of key 2 t (+1, +8, +9): 8 B per lane, "
               "broadcast over g: one wavefront"),
    SmemAccess(MMA, "z[k][j] = reinterpret_cast<uint32_t const*>(zBase + key * kVG * 2)[j];", "LDS",
               lanes(_mma_vrow_lanes), "staged V zero row: as the scale row"),
    SmemAccess(MMA, "uint4 const x = qaS[i * 32 + lane];", "LDS", lanes(lambda lane: lane * 16),
               "qa fragments [kb / 2][lane] uint4: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "qaS[i * 32 + lane] = make_uint4(x[0], x[1], x[2], x[3]);", "STS", lanes(lambda lane: lane * 16),
               "qa fragments, written once by warp 0"),
    SmemAccess(MMA, "qS[n][u % kD] = x;", "STS", lanes(lambda lane: lane * 4), "consecutive words"),
    SmemAccess(MMA, 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(s), "l"(gmem));', "LDGSTS",
               lanes(lambda lane: lane * 16), "cp.async 16 B per lane, contiguous"),
)

# Share of chunks whose online softmax rescales (a row maximum grew; warp-uniform vote). Scores of iid keys set a new
# maximum in about ln(n) of n chunks (~10% of a warp's ~40 chunks at 32K); 0.25 is a conservative assumption.
MMA_RESCALE_SHARE = 0.25

MMA_RULES = (
    PathRule(MMA, "mmaKeyLoop<T, kD, kKB, kVB, half, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);",
             0, "fp16 scales with fp16 activations and G = 32 take the row-load copy of the key loop"),
    PathRule(MMA, "mmaKeyLoop<T, kD, kKB, kVB, __nv_bfloat16, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);",
             0, "fp16 scales (the key loop is compiled once per scale path)"),
    PathRule(MMA, "mmaKeyLoop<T, kD, kKB, kVB, float, 0>(p, wk, stages, qaS, c0, c1, cq, maskFrom, pos, lane, st);", 0,
             "fp16 scales"),
    PathRule(MMA, "loadFullPrecisionScores<T, kD, kKB>(p, wk, qaS, ci, g, t, sc);", 0,
             "quantized chunks (the window's <= 5 chunks are charged at the quantized chunk's instructions)"),
    PathRule(MMA, "accumulateFullPrecisionValues<T, kD>(p, wk, ci, tau, g, t, b0, b1, st.o);", 0, "quantized chunks"),
    PathRule(MMA, "av[0] = g == vGroups ? kONE2 : 0U; // l only: full-precision keys have no V bias", 0,
             "quantized chunks"),
    PathRule(MMA, "out[(token * p.numHeads + wk.h * grp + row % grp) * kD + u % kD] = ActTraits<T>::fromFloat(0.F);", 0,
             "valid sequences"),
    PathRule(MMA, "= ActTraits<T>::fromFloat(lsum > 0.F ? __fdiv_rn(o, lsum) : 0.F);",
             lambda c: 0.0 if c.split else 1.0, "numSplits == 1 only"),
    PathRule(MMA, "partialAcc[idx * kD + ch] = o;", lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
    PathRule(MMA, "int64_t const idx = (token * p.numHeads + head) * plan.numSplits + wk.split;",
             lambda c: 1.0 if c.split else 0.0, "numSplits > 1 only"),
    # masking runs for the chunks that reach past maskFrom: the split's last chunk (decode), once per CTA, not per tile
    PathRule(MMA, "if (!(key < wk.k1 && key <= pos[r & 1]))", 0, "chunks below maskFrom (all but a split's last)"),
    PathRule(MMA, "int32_t const key = kt + 16 * tau + g + 8 * (r >> 1);", 0, "chunks below maskFrom"),
    PathRule(MMA, "alpha[j] = mx[j] == st.m[j] ? 1.F : fastExp2(st.m[j] - mx[j]);", MMA_RESCALE_SHARE,
             "rescale only when a row maximum grows (MMA_RESCALE_SHARE of the chunks)"),
    PathRule(MMA, "st.o[mt][r] *= alpha[r & 1];", MMA_RESCALE_SHARE, "rescale only when a row maximum grows"),
    PathRule(MMA, "st.vb[r] *= alpha[r & 1];", MMA_RESCALE_SHARE, "rescale only when a row maximum grows"),
    # K groups (G = 32 = one chunk): foldKeyGroup runs for every chunk
    PathRule(MMA, "foldKeyGroup<T, kD, kKB, S>(qaS, kScale, kZero, g, t, qK, biasS);", lambda c: KEY_TILE / GROUP,
             "a new key group every G / 32 chunks"),
)


def _mma_loops() -> tuple[LoopSpec, ...]:
    return (
        LoopSpec("tile", lambda c: 1, "BRA", MMA, "for (int32_t ci = c0; ci < c1; ++ci)"),
        LoopSpec("qload", lambda c: MMA_TILE_ROWS * c.shape.head_dim // THREADS, "STS", MMA,
                 "for (int32_t u = threadIdx.x; u < kTILE_ROWS * kD; u += kMMA_THREADS)", ("qS[n][u % kD] = x;",)),
        LoopSpec("prologue", lambda c: MMA_STAGES - 1, "LDGDEPBAR", MMA,
                 "for (int32_t i = 0; i < kMMA_STAGES - 1; ++i)", ("issue(c0 + i);",)),
        LoopSpec("out", lambda c: ceil_div(min(MMA_TILE_ROWS, c.shape.group_heads) * c.shape.head_dim, THREADS), "STG",
                 MMA, "for (int32_t u = threadIdx.x; u < wk.nRows * kD; u += kMMA_THREADS)",
                 ("partialAcc[idx * kD + ch] = o;", "= ActTraits<T>::fromFloat(lsum > 0.F ? __fdiv_rn(o, lsum) : 0.F);")),
    )


_ARGS = "KiviStepParams, KiviLaunchPlan, SeqInfo const*, float*, float*"
KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec("simt", "kiviAttentionKernelI6__halfLi128", ("kiviAttention.cuh",),
               f"template __global__ void kiviAttentionKernel<half, 128>({_ARGS});", THREADS, _simt_loops(),
               SIMT_RULES, SIMT_COPIES, SIMT_SMEM, kivi_tile_bytes, kivi_code_words, 1, default_rank=1,
               note="today's default (attentionImpl 0/1): calibration subject"),
    KernelSpec("wmma", "kiviAttentionTcKernelI6__halfLi128", ("kiviAttentionTc.cuh",),
               f"template __global__ void kiviAttentionTcKernel<half, 128>({_ARGS});", THREADS, _tc_loops(),
               TC_RULES, (), TC_SMEM, kivi_tile_bytes, kivi_code_words, 1,
               note="today's tensor-core kernel (attentionImpl 2): calibration subject"),
    KernelSpec("mma", "kiviDecodeMmaKernelI6__halfLi128ELi2ELi2E", (MMA,),
               f"template __global__ void kiviDecodeMmaKernel<half, 128, 2, 2>({_ARGS});", THREADS,
               _mma_loops(), MMA_RULES, (), MMA_SMEM, kivi_tile_bytes, kivi_code_words, MMA_STAGES * MMA_WARPS,
               tile_warps=1, dynamic_smem=lambda sh: MMA_WARPS * MMA_STAGES * mma_stage_bytes(sh),
               plan=mma_launch_plan, default_rank=0,
               note="mma.sync m16n8k16 over FRAGMENT-order codes; the default where present"),
)
