"""The append (quantize-and-store) kernel of a prefill chunk: its declared table and its prediction per (GPU, model,
batch, chunk)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .analysis import KernelResult
from .kernels import COMMON, THREADS
from .plan import ceil_div, num_quantized, occupancy
from .predict import round_sig, wave_times
from .shapes import BITS, GPUS, GROUP, MODELS, RESIDUAL, Gpu, ModelShape
from .spec import Ctx, KernelSpec, LoopSpec, PathRule, SmemAccess, lanes

# ------------------------------------------------------------------------------------------------ append kernel
# kiviAppendKernel (plugins/kernels/include/kiviAppend.cuh): the quantize-and-store path of a prefill chunk. Its "tile"
# is one G-token group of one (sequence, KV head) in a chunk CTA (y >= 1): stage K [G][D + 8] (16-byte loads), K
# scales, K codes (one thread per FRAGMENT word), then V^T [D][G + 8], V scales, V codes. Shapes: G = 32, 2-bit K
# and V, fp16 activations and scales (the default); the group size, bits and scale dtype are uniform branches whose
# other copies are off the path.
APPEND = "kiviAppend.cuh"
APPEND_CHUNKS = (4096, 8192, 32768)
APPEND_BATCHES = (1, 8)
APPEND_MIN_FRACTION = 0.80  # the target: the store path at >= 80% of copy bandwidth for prefill chunks of >= 4K tokens
def append_group_bytes(shape: ModelShape) -> int:
    """Device bytes of one group: K and V read (fp16), codes + per-channel K / per-token V scale and zero written."""
    d = shape.head_dim
    return 2 * GROUP * d * 2 + 2 * GROUP * d * BITS // 8 + 2 * d * 2 + 2 * GROUP * (d // min(GROUP, d)) * 2


def _append_pair_lanes(row_bytes: int, rows_per_warp: int) -> Callable[[int], int]:
    """Lane -> byte address of a pair load / staging store: lane (g, t) = row g, word t (code loops), or the 16-byte
    staging vectors of `rows_per_warp` rows per warp."""
    def f(lane: int) -> int:
        if rows_per_warp:
            per_row = 32 // rows_per_warp
            return (lane // per_row) * row_bytes + (lane % per_row) * 16
        return (lane // 4) * row_bytes + (lane % 4) * 4
    return f


APPEND_KROW = (128 + 8) * 2  # K tile row bytes at D = 128
APPEND_VROW = (GROUP + 8) * 2  # V^T tile row bytes at G = 32

APPEND_SMEM = (
    SmemAccess(APPEND, "*reinterpret_cast<uint4*>(dst + k * kPASS_ROWS * Sm::kKROW)\n                = *reinterpret_cast<uint4 const*>(src + k * kPASS_ROWS * int32_t(rowStride)); // K staging (chunk)", "STS",
               lanes(_append_pair_lanes(APPEND_KROW, 2)), "K staging (chunk CTAs): 16 vectors per row, two rows per warp"),
    SmemAccess(APPEND, "    *scale = s;", "STS", lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)),
               "scale / zero / 1/s stores of storePairScales (K: 8-byte stride; charged at V's pattern, token pairs x "
               "groups: 32-byte stride, the worse of the two call sites)"),
    SmemAccess(APPEND, "    *zero = storeScale(", "STS", lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)),
               "as *scale"),
    SmemAccess(APPEND, "    *inv = codeReciprocal(s);", "STS",
               lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)), "as *scale"),
    SmemAccess(APPEND, "*reinterpret_cast<uint4*>(sm.tile + i * Sm::kKROW + 8 * c8) = *reinterpret_cast<uint4 const*>(row + 8 * c8);",
               "STS", lanes(_append_pair_lanes(APPEND_KROW, 2)), "K staging: 16 vectors per row, two rows per warp"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + i * Sm::kKROW + 2 * c2);", "LDS",
               lanes(lambda lane: lane * 4), "K scales: channel pairs of one token row, consecutive words"),
    SmemAccess(APPEND, "uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + 2 * c2);", "LDS",
               lanes(lambda lane: lane * 4), "K scales: row 0"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(row + 8 * (reg & 1) * Sm::kKROW + off);",
               "LDS", lanes(_append_pair_lanes(APPEND_KROW, 0)), "K code pairs: token g (+8), word t: banks 4g + t"),
    SmemAccess(APPEND, "uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[off + hf], inv[off + hf], ok);",
               "LDS", lanes(lambda lane: (2 * (lane % 4)) * 4), "K zero / 1/s of channel 2t (+1): broadcast over g"),
    SmemAccess(APPEND, "*reinterpret_cast<uint32_t*>(dst) = __byte_perm(a[i], c[i], 0x5410);", "STS",
               lanes(lambda lane: (lane // 16) * 8 * APPEND_VROW + (lane % 16) * 4),
               "V^T staging: 16 token pairs x 2 channel octets per warp (rows 8 apart: 2-way conflict)"),
    SmemAccess(APPEND, "*reinterpret_cast<uint32_t*>(dst + Sm::kVROW) = __byte_perm(a[i], c[i], 0x7632);", "STS",
               lanes(lambda lane: (lane // 16) * 8 * APPEND_VROW + APPEND_VROW + (lane % 16) * 4),
               "V^T staging, odd channel"),
    SmemAccess(APPEND, "uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV) * Sm::kVROW + 2 * tp);",
               "LDS", lanes(lambda lane: (lane // 16) * GROUP * APPEND_VROW + (lane % 16) * 4),
               "V scales: token pairs of two channel groups (rows 32 apart)"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV + c) * Sm::kVROW + 2 * tp);",
               "LDS", lanes(lambda lane: (lane // 16) * GROUP * APPEND_VROW + (lane % 16) * 4), "V scales"),
    SmemAccess(APPEND, "= *reinterpret_cast<uint32_t const*>(col + (16 * blk + 8 * (reg & 1)) * Sm::kVROW + 8 * (reg >> 1));",
               "LDS", lanes(_append_pair_lanes(APPEND_VROW, 0)), "V code pairs: channel g (+8), tokens 2t, 2t + 1: "
               "banks 20g + t"),
    SmemAccess(APPEND, "uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[sk], inv[sk], ok);",
               "LDS", lanes(lambda lane: (2 * (lane % 4)) * (128 // GROUP) * 4),
               "V zero / 1/s of token 2t (+1), one group: broadcast over g"),
)

APPEND_RULES = (
    PathRule(APPEND, "appendSequence<T, kD, 64>(p, info, b, h, appendSmem);", 0, "G = 32"),
    PathRule(APPEND, "appendSequence<T, kD, 128>(p, info, b, h, appendSmem);", 0, "G = 32"),
    PathRule(APPEND, "flushGroup<T, kD, kG, false>(p, info, b, h, s, q0 + int64_t(kG) * k, sm); // a window group", 0,
             "chunk CTAs (y >= 1); the window CTA's groups and rows are charged at their bytes only"),
    PathRule(APPEND, "writeWindowRows<T, kD>(p, info, b, h);", 0, "chunk CTAs"),
    PathRule(APPEND, "for (int32_t k = 0; k < kWin; ++k)", 0, "chunk CTAs (the window CTA's group loop)"),
    PathRule(APPEND, "writeKeyCodes<T, kD, kG, 4>(sm, codes, base);", 0, "2-bit keys"),
    PathRule(APPEND, "writeKeyCodes<T, kD, kG, 8>(sm, codes, base);", 0, "2-bit keys"),
    PathRule(APPEND, "writeValueCodes<T, kD, kG, 4>(sm, codes, base);", 0, "2-bit values"),
    PathRule(APPEND, "writeValueCodes<T, kD, kG, 8>(sm, codes, base);", 0, "2-bit values"),
    PathRule(APPEND, "word = exactWord<T, kD, kG, kBITS>(sm, false, lane, j, tile); // the IEEE division (K)", 0,
             "a word with a code within 2^(b - 20) of a tie: ~2^-15 of the 2-bit words (tests/test_kernels_model.py)"),
    PathRule(APPEND, "word = exactWord<T, kD, kG, kBITS>(sm, true, lane, j, tile); // the IEEE division (V)", 0,
             "as for K"),
    PathRule(APPEND, "keyScales<T, kD, kG>(p, sm, (headBase * (bs / kG) + r / kG) * kD);", 0.5,
             "D / 2 = 64 channel pairs: warps 0-1 of 4"),
    PathRule(APPEND, "valueScales<T, kD, kG>(p, sm, (headBase * bs + r) * Sm::kVGROUPS);", 0.5,
             "(G / 2) x (D / Gv) = 64 (token pair, group) threads: warps 0-1"),
    PathRule(COMMON, "__nv_bfloat16 const h = __float2bfloat16_rn(x);", 0, "fp16 scales"),
    PathRule(COMMON, "static_cast<float*>(ptr)[idx] = x;", 0, "fp16 scales"),
)


def _append_loops() -> tuple[LoopSpec, ...]:
    words = lambda c: (GROUP // 16) * 32 * (c.shape.head_dim * BITS // 64)  # noqa: E731  FRAGMENT words per group
    return (
        LoopSpec("tile", lambda c: 1, "BRA"),
        LoopSpec("kcodes", lambda c: ceil_div(words(c), THREADS), "STG"),
        LoopSpec("vcodes", lambda c: ceil_div(words(c), THREADS), "STG"),
    )


APPEND_KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec("append", "kiviAppendKernelI6__halfLi128", (APPEND,),
               "template __global__ void kiviAppendKernel<half, 128>(KiviStepParams, SeqInfo const*);", THREADS,
               _append_loops(), APPEND_RULES, (), APPEND_SMEM, append_group_bytes,
               lambda sh: 2 * (GROUP // 16) * 32 * (sh.head_dim * BITS // 64), 1,
               dynamic_smem=lambda sh: 2 * max(GROUP * (sh.head_dim + 8), sh.head_dim * (GROUP + 8))
               + 3 * sh.head_dim * 4 + 3 * GROUP * (sh.head_dim // min(GROUP, sh.head_dim)) * 4,
               note="quantize-and-store of a prefill chunk (one G-group per tile)"),
)


def predict_append(result: KernelResult, gpu: Gpu, shape: ModelShape, batch: int, chunk: int) -> dict:
    """A prefill chunk of `chunk` tokens from past 0 (every flushed group lies in the chunk): the chunk CTAs' groups
    at max(issue, shared-memory, memory) per wave, the window CTAs (the last W rows) at their bytes, one launch.
    fraction_of_copy_bw = bytes at copy bandwidth / predicted (launch excluded on both)."""
    d = shape.head_dim
    res = dataclasses.replace(result.resources, smem_bytes=result.resources.smem_bytes + result.spec.dynamic_smem(shape))
    occ = occupancy(res, result.spec.threads, gpu)
    ctx = Ctx(shape, False)
    tile, rest = result.counts(ctx)
    groups = num_quantized(chunk) // GROUP
    gb = append_group_bytes(shape)
    chunk_ctas = min(chunk // GROUP, 1023)
    per_cta = ceil_div(groups, chunk_ctas)  # groups a chunk CTA flushes (grid stride)
    ctas = []
    for y in range(chunk_ctas):
        n = len(range(y, groups, chunk_ctas))
        if n:
            ctas.append((rest.instructions + n * tile.instructions, rest.wavefronts + n * tile.wavefronts, n * gb))
    ctas = ctas * (batch * shape.num_kv_heads)
    w_rows = min(chunk, RESIDUAL + GROUP - 1)
    window_bytes = batch * shape.num_kv_heads * 2 * w_rows * d * 2 * 2  # K and V rows read from the chunk, written
    slots = occ["ctas_per_sm"] * gpu.sms
    issue_rate = gpu.issue_per_clk_per_sm * gpu.clock_ghz * 1e3
    smem_rate = gpu.smem_wavefronts_per_clk_per_sm * gpu.clock_ghz * 1e3
    bw = gpu.copy_gbps * 1e3
    waves = wave_times(ctas, slots, gpu)
    kernel_us = sum(w["us"] for w in waves) + window_bytes / bw
    total_bytes = sum(c[2] for c in ctas) + window_bytes
    copy_us = total_bytes / bw
    longest = max(waves, key=lambda w: w["us"])
    return {
        "gpu": gpu.name, "model": shape.name, "batch": batch, "chunk": chunk, "kernel": result.spec.name,
        "label": "static model, not a measurement", "arch": result.arch,
        "predicted_us": round_sig(kernel_us + gpu.launch_us, 4), "copy_bw_us": round_sig(copy_us + gpu.launch_us, 4),
        "fraction_of_copy_bw": round_sig(copy_us / kernel_us, 3), "bound": longest["bound"],
        "bytes": total_bytes, "groups_per_sequence_and_head": groups, "groups_per_chunk_cta": per_cta,
        "waves": waves, "occupancy": occ,
        "resources": {**dataclasses.asdict(result.resources), "dynamic_smem_bytes": result.spec.dynamic_smem(shape)},
        "zero_spills": result.resources.spill_stores == 0 and result.resources.spill_loads == 0,
        "per_group": {**tile.as_dict(), "bytes": gb},
        "per_cta_outside_group_loop": {"warp_instructions": round(rest.instructions, 1),
                                       "wavefronts": round(rest.wavefronts, 1),
                                       "untagged_loops_counted_once": result.analysis.check_loops(ctx)},
        "budget_per_group_at_80pct_copy_bw": {
            "warp_instructions": round(issue_rate * gpu.sms * gb / (APPEND_MIN_FRACTION * bw), 1),
            "wavefronts": round(smem_rate * gpu.sms * gb / (APPEND_MIN_FRACTION * bw), 1)},
    }


def append_records(results: dict[tuple[str, str], KernelResult], versions: dict) -> list[dict]:
    out = []
    for gpu in GPUS.values():
        r = results.get(("append", gpu.arch))
        if r is None:
            continue
        for m in MODELS.values():
            for b in APPEND_BATCHES:
                for c in APPEND_CHUNKS:
                    rec = predict_append(r, gpu, m, b, c)
                    rec["tools"] = versions
                    out.append(rec)
    return out
