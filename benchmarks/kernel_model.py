"""Static performance model of the CUDA decode-attention kernels (a MODEL, not a measurement).

    python benchmarks/kernel_model.py [--out benchmarks/results/kernel_model.json] [--fail-if-default-not-memory-bound]

CPU only. For each kernel of KERNELS (a declared per-kernel table) and each arch (sm_90, sm_80) it
1. compiles a translation unit that explicitly instantiates just that decode kernel (nvcc -cubin -lineinfo,
   -Xptxas -v: registers, spills, shared memory) -- separate from CI's one-arch library build;
2. disassembles it with nvdisasm -gi (the pinned PyPI wheel nvidia-cuda-nvdisasm): SASS with inline line info;
3. splits it into basic blocks, finds the loops (back edges) and names them through the source tags
   `// KIVI_MODEL_LOOP(name)` (the loop's `for` line) / `// KIVI_MODEL_ANCHOR(name)` (a line executed once per source
   iteration, whose static copies in a SASS loop body give its unroll factor); trip counts come from the table
   (per source loop, as a function of the shapes), never from hard-coded instruction counts;
4. weights each block by the executed path of a decode step (declared path rules keyed by source text, copy rules
   for unrolled copies that a runtime guard skips, warp fractions; unreachable, divergence-fallback and slow-path
   blocks are not executed) and counts executed warp-instructions per key tile by class, plus the per-CTA rest;
5. counts shared-memory wavefronts of every LDS/STS/LDSM with a bank model over a declared lane -> byte-address
   mapping per access (SmemAccess; a lane-level emulation can supply the mapping as a list of 32 addresses);
6. derives occupancy from regs / smem / threads, mirrors the launch plan of plugins/kernels/src/kiviParams.cpp
   (split rule, per-sequence split length of the prepare kernel) and predicts the time per layer of a decode step as
   the sum over waves of max(issue, shared-memory, memory) time, plus launch overheads counted alike for the FP16
   baseline (FP16 K/V bytes at copy bandwidth).

The calibration against issue 12's hand count of today's kernels is part of the output (CALIBRATION below).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL_INCLUDE = ROOT / "plugins" / "kernels" / "include"
FORMAT_INCLUDE = ROOT / "plugins" / "include"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernel_model.json"
ARCHS = ("sm_90", "sm_80")
WARP = 32
KEY_TILE = 32  # kKEY_TILE (kiviParams.h)

# ---------------------------------------------------------------------------------------------------- GPU table
# One row per GPU. Sources: /work/.library/device/H200.md + KINDS.md (H200: 132 SMs and 60 MB L2 read by PyTorch,
# SM clock 1980 MHz seen under load, device-to-device copy 4.3 TB/s counting bytes read and written, datasheet HBM
# 4.8 TB/s), NVIDIA datasheets / CUDA programming guide (SM counts, boost clocks, HBM bandwidth, 64K registers,
# 2048 threads, 32 CTAs, 228 / 164 KB shared memory per SM of which 1 KB per CTA is reserved, 4 schedulers issuing one
# warp-instruction per clock each, 32 banks x 4 B = one 128-byte shared-memory wavefront per clock per SM).
# ASSUMPTIONS (not measured here): H100 and A100 copy bandwidth = datasheet HBM bandwidth x 0.896, the copy efficiency
# measured on the H200 (4.3 / 4.8); boost clocks are sustained; launch_us: the gap one extra kernel launch adds to a
# decode step inside a CUDA graph (taken as 2 us on every GPU), charged identically to the KIVI and FP16 sides.


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # the cubin the model reads for this GPU
    sms: int
    clock_ghz: float
    issue_per_clk_per_sm: int  # warp-instructions (4 schedulers x 1)
    smem_wavefronts_per_clk_per_sm: int  # 128-byte wavefronts
    copy_gbps: float  # achievable device-memory bandwidth (GB/s, 1e9), what FP16 bytes and KIVI bytes are charged at
    hbm_gbps: float  # datasheet
    smem_per_sm: int
    smem_reserved_per_cta: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    launch_us: float
    source: str


COPY_EFFICIENCY = 4300.0 / 4800.0
GPUS: dict[str, Gpu] = {
    "H200": Gpu("H200", "sm_90", 132, 1.98, 4, 1, 4300.0, 4800.0, 228 * 1024, 1024, 65536, 2048, 32, 2.0,
                "KINDS.md/H200.md: 132 SMs, 1980 MHz under load, copy 4.3 TB/s measured here; HBM3e 4.8 TB/s"),
    "H100": Gpu("H100", "sm_90", 132, 1.98, 4, 1, round(3350.0 * COPY_EFFICIENCY, 1), 3350.0, 228 * 1024, 1024,
                65536, 2048, 32, 2.0, "H100 SXM5 datasheet: 132 SMs, 1980 MHz boost, HBM3 3.35 TB/s; copy = HBM x "
                "0.896 (H200's measured ratio; assumption)"),
    "A100": Gpu("A100", "sm_80", 108, 1.41, 4, 1, round(2039.0 * COPY_EFFICIENCY, 1), 2039.0, 164 * 1024, 1024,
                65536, 2048, 32, 2.0, "A100 SXM4 80GB datasheet: 108 SMs, 1410 MHz boost, HBM2e 2.039 TB/s; copy = "
                "HBM x 0.896 (assumption)"),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: int

    @property
    def group_heads(self) -> int:
        return self.num_heads // self.num_kv_heads


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 8, 128, 32),
    "llama-2-7b": ModelShape("llama-2-7b", 32, 32, 128, 32),
}
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)

# KIVI-2 defaults (DESIGN.md): k_bits = v_bits = 2, G = 32, R = 128, block 128, fp16 scales and activations.
BITS, GROUP, RESIDUAL = 2, 32, 128

# ------------------------------------------------------------------------------------------------ launch plan
# Mirror of kiviLaunchPlan (plugins/kernels/src/kiviParams.cpp) for a decode step (chunk_len 1 per sequence) and of
# the prepare kernel's per-sequence split length (kiviLaunch.cu). tests/test_kernel_model.py checks it against
# trtllm_kivi/cuda/launch.py launch_plan, which tests/test_kernels_host.py checks against the C++.
MAX_TILE_ROWS, MIN_SPLIT_LEN, CTAS_PER_SM = 16, 256, 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Plan:
    group_heads: int
    tile_tokens: int
    num_tiles: int
    split_len: int
    num_splits: int
    seq_split_len: int  # SeqInfo::splitLen of a sequence of length e


def launch_plan(shape: ModelShape, batch: int, max_seq_len: int, num_sms: int, seq_len: int) -> Plan:
    """kiviLaunchPlan for num_tokens = batch (decode), max_chunk_len 1; seq_len = e = past_len + 1."""
    grp = shape.group_heads
    tq = MAX_TILE_ROWS // grp if grp <= MAX_TILE_ROWS else 1
    t = batch
    num_tiles = min(ceil_div(t, tq) + batch, t)
    ctas = max(num_tiles, 1) * shape.num_kv_heads
    splits = ceil_div(CTAS_PER_SM * num_sms, ctas)
    max_splits = ceil_div(max(max_seq_len, 1), MIN_SPLIT_LEN)
    splits = max(1, min(splits, max_splits))
    split_len = ceil_div(ceil_div(max(max_seq_len, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = ceil_div(max(max_seq_len, 1), split_len)
    per = ceil_div(max(seq_len, 0), num_splits)
    seq_split = max(MIN_SPLIT_LEN, ceil_div(per, KEY_TILE) * KEY_TILE)
    return Plan(grp, tq, num_tiles, split_len, num_splits, seq_split)


def num_quantized(seq_len: int) -> int:
    return 0 if seq_len < RESIDUAL else (seq_len - RESIDUAL) // GROUP * GROUP


# ------------------------------------------------------------------------------------------------ occupancy


@dataclass(frozen=True)
class Resources:
    registers: int
    smem_bytes: int  # static shared memory per CTA (ptxas)
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def occupancy(res: Resources, threads: int, gpu: Gpu) -> dict:
    """Resident CTAs per SM: min over registers (allocated per warp in units of 256), shared memory (+1 KB reserved per
    CTA), threads and the CTA limit (CUDA occupancy calculator rules for sm_80 / sm_90)."""
    warps = ceil_div(threads, WARP)
    regs_per_warp = ceil_div(max(res.registers, 1) * WARP, 256) * 256
    by_regs = gpu.regs_per_sm // (regs_per_warp * warps)
    by_smem = gpu.smem_per_sm // (res.smem_bytes + gpu.smem_reserved_per_cta) if res.smem_bytes > 0 else 10 ** 9
    by_threads = gpu.max_threads_per_sm // (warps * WARP)
    ctas = min(by_regs, by_smem, by_threads, gpu.max_ctas_per_sm)
    limiter = min((("registers", by_regs), ("shared_memory", by_smem), ("threads", by_threads),
                   ("cta_limit", gpu.max_ctas_per_sm)), key=lambda kv: kv[1])[0]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "by_registers": by_regs, "by_shared_memory": by_smem,
            "by_threads": by_threads, "limiter": limiter}


# ------------------------------------------------------------------------------------------------ bank model


def wavefronts(addresses: Sequence[int | None], width: int) -> int:
    """Shared-memory wavefronts of one warp-wide access: 32 banks of 4 bytes; lanes reading the same 4-byte word share
    it (broadcast); the request takes as many wavefronts as its most loaded bank has distinct words (an 8- or 16-byte
    access covers 2 or 4 consecutive words, so 32 x 16 B contiguous = 4 wavefronts). None = inactive lane."""
    banks: dict[int, set[int]] = defaultdict(set)
    for a in addresses:
        if a is None:
            continue
        for w in range(a // 4, (a + width - 1) // 4 + 1):
            banks[w % 32].add(w)
    return max((len(s) for s in banks.values()), default=0)


# ------------------------------------------------------------------------------------------------ kernel table


@dataclass(frozen=True)
class Ctx:
    """What the executed path depends on: the model's shapes and whether the keys are split."""
    shape: ModelShape
    split: bool


Weight = float | Callable[[Ctx], float]


def _w(x: Weight, ctx: Ctx) -> float:
    return float(x(ctx)) if callable(x) else float(x)


@dataclass(frozen=True)
class LoopSpec:
    """A source loop named by `// KIVI_MODEL_LOOP(tag)` on its `for` line, or declared here by source text (file,
    loop_text, anchor_text) for a kernel whose source carries no tags; trips = source iterations per entry as the warp
    executes them (the most any of its lanes runs); anchor_op: the opcode class of the anchor line's one instruction
    per iteration (`// KIVI_MODEL_ANCHOR(tag)` or anchor_text; its static count in a SASS loop body is that loop's
    unroll factor). sites: (file, call-site text, trips) for a loop whose trip count depends on where it is inlined."""
    tag: str
    trips: Callable[[Ctx], int]
    anchor_op: str
    file: str | None = None
    loop_text: str | None = None
    anchor_text: tuple[str, ...] = ()
    sites: tuple[tuple[str, str, Callable[[Ctx], int]], ...] = ()


@dataclass(frozen=True)
class PathRule:
    """Instructions with `text` (a source substring, unique in `file`) anywhere in their inline stack execute with
    this weight (0: not on the path; a fraction: that share of the CTA's warps)."""
    file: str
    text: str
    weight: Weight
    why: str
    optional: bool = False  # the text may be absent (e.g. a specialization a kernel version does not have)


@dataclass(frozen=True)
class CopyRule:
    """A fully unrolled source loop whose k-th copy runs with weights[k] (a guard such as `if (row >= rows) continue;`
    skips the others): the region is the lines [start, end] of `file`; the copies are separated by the branches (or
    EXITs) whose stack holds the `guard` line; blocks ending in a guard always run. Versions of the loop that nvcc
    unswitched on a runtime value (e.g. numSplits == 1) each hold all copies, so copy k of the n-th guard is n % len."""
    file: str
    start: str
    end: str
    guard: str
    weights: Callable[[Ctx], list[float]]
    why: str


@dataclass(frozen=True)
class SmemAccess:
    """Lane -> byte address (of the first byte the lane touches) of the shared-memory instructions from the line holding
    `text`; `lanes` takes (ctx) and returns 32 addresses (None = inactive), e.g. from a lane-level emulation."""
    file: str
    text: str
    op: str  # LDS | STS | LDSM | LDGSTS; LDS / STS also match a generic LD / ST from that line (staged data)
    lanes: Callable[[Ctx], list[int | None]]
    note: str


@dataclass(frozen=True)
class KernelSpec:
    name: str
    symbol: str  # substring of the mangled name
    headers: tuple[str, ...]  # included by the generated TU
    instantiation: str  # explicit instantiation statement(s), inside namespace trtllm_kivi::kernels
    threads: int
    loops: tuple[LoopSpec, ...]
    rules: tuple[PathRule, ...]
    copies: tuple[CopyRule, ...]
    smem: tuple[SmemAccess, ...]
    tile_bytes: Callable[[ModelShape], int]  # device bytes per quantized key tile of one (sequence, KV head)
    code_words: Callable[[ModelShape], int]  # 32-bit code words per tile
    stages: int  # key tiles in flight per CTA (cp.async stages x warps that each stream their own; 1 = none)
    include_dirs: tuple[Path, ...] = (KERNEL_INCLUDE, FORMAT_INCLUDE)
    min_arch: int = 80
    note: str = ""
    tile_warps: int | None = None  # warps that process one key tile (None: all warps of the CTA together)
    dynamic_smem: Callable[[ModelShape], int] = lambda shape: 0  # bytes the launcher passes (beyond ptxas' static)
    plan: Callable[..., Plan] | None = None  # launch plan (None: today's kiviLaunchPlan, launch_plan below)
    default_rank: int | None = None  # the present kernel with the lowest rank is the default (None: never)


def kivi_tile_bytes(shape: ModelShape) -> int:
    d = shape.head_dim
    codes = 2 * KEY_TILE * d * BITS // 8  # K + V codes
    k_sz = 2 * d * 2 * (KEY_TILE // GROUP)  # per-channel scale + zero (fp16) per G-group of tokens
    v_sz = 2 * KEY_TILE * (d // min(GROUP, d)) * 2  # per-token scale + zero per Gv-group of channels
    return codes + k_sz + v_sz


def kivi_code_words(shape: ModelShape) -> int:
    return 2 * KEY_TILE * shape.head_dim * BITS // 32


ATT = "kiviAttention.cuh"
TC = "kiviAttentionTc.cuh"
COMMON = "kiviCommon.cuh"
THREADS = 128
LOADSCALE_BF16 = "if (dtype == kKIVI_BFLOAT16)\n    {\n        return __bfloat162float"


def _rows_per_warp(ctx: Ctx, j: int) -> float:
    """SIMT kernel: share of the 4 warps that own row warp + 4 j (decode: rows = group heads)."""
    rows = ctx.shape.group_heads
    return sum(1 for w in range(4) if w + 4 * j < rows) / 4.0


def _lanes(f: Callable[[int], int | None]) -> Callable[[Ctx], list[int | None]]:
    return lambda ctx: [f(lane) for lane in range(WARP)]


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
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i][d]", "STS", _lanes(_simt_kstore), "K dequant store, d = lane"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i + kPW / 2][d]", "STS", _lanes(_simt_kstore), "K dequant store"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i]", "STS", _lanes(_simt_vstore),
               "V dequant store: tok = lane / 8, word = lane % 8, 16 floats apart -> banks {i, 16 + i}"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i + kPW / 2]", "STS", _lanes(_simt_vstore), "V dequant store"),
    SmemAccess(ATT, "float const kv = kS[lane][d];", "LDS", _lanes(lambda lane: lane * 129 * 4),
               "row stride D + 1 = 129 words: conflict-free"),
    SmemAccess(ATT, "score[j] += qS[warp + kATTN_WARPS * j][d] * kv;", "LDS", _lanes(lambda lane: 0),
               "q row of the warp: one address, broadcast"),
    SmemAccess(ATT, "acc[j][i] += pj * vS[jj][lane + 32 * i];", "LDS", _lanes(lambda lane: lane * 4),
               "consecutive words"),
    SmemAccess(ATT, "qS[row][u % kD] = x;", "STS", _lanes(lambda lane: lane * 4), "consecutive words"),
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
    SmemAccess(TC, "wmma::load_matrix_sync(aFrag, &qS[0][kk * 16], kLDH);", "LDSM", _lanes(_ldsm_x4(272)),
               "q A fragment, rows 272 B apart: 8 rows hit 8 distinct 16-byte bank groups"),
    SmemAccess(TC, "wmma::load_matrix_sync(bFrag, &kS[warp * 16][kk * 16], kLDH);", "LDSM", _lanes(_ldsm_x4(272)),
               "K B fragment (col-major = K rows), rows 272 B apart"),
    SmemAccess(TC, "wmma::load_matrix_sync(aFrag, &pS[0][kk * 16], kLDP);", "LDSM", _lanes(_ldsm_x4(80)),
               "P A fragment, rows 80 B apart (5 x 16 B: distinct mod 8)"),
    SmemAccess(TC, "wmma::load_matrix_sync(bFrag, &vS[kk * 16][nt * 16], kLDH);", "LDSM", _lanes(_ldsm_x4(272)),
               "V B fragment (.trans), rows 272 B apart"),
    SmemAccess(TC, "wmma::store_matrix_sync(&sS[0][warp * 16], sFrag, kLDS, wmma::mem_row_major);", "STS",
               _lanes(_acc_frag(36)), "S accumulator to sS (row 36 words)"),
    SmemAccess(TC, "wmma::load_matrix_sync(oFrag, &oS[0][nt * 16], kLDO, wmma::mem_row_major);", "LDS",
               _lanes(_acc_frag(132)), "O accumulator from oS (row 132 words)"),
    SmemAccess(TC, "wmma::store_matrix_sync(&oS[0][nt * 16], oFrag, kLDO, wmma::mem_row_major);", "STS",
               _lanes(_acc_frag(132)), "O accumulator to oS"),
    SmemAccess(TC, "alphaS[sRow] = alpha;", "STS", _lanes(lambda lane: (lane // 8) * 4 if lane % 8 == 0 else None),
               "one lane of 8 per row"),
    SmemAccess(TC, "qS[row][u % kD] = x;", "STS", _lanes(lambda lane: lane * 2), "16-bit, consecutive"),
    SmemAccess(TC, "oS[row][u % kD] = 0.F;", "STS", _lanes(lambda lane: lane * 4), "consecutive words"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i][d]", "STS", _lanes(lambda lane: (lane % 128) * 2),
               "K dequant store (16-bit), d = lane: 64 contiguous bytes"),
    SmemAccess(ATT, "storeSmem<T>(kS[wi * kPW + i + kPW / 2][d]", "STS", _lanes(lambda lane: (lane % 128) * 2),
               "K dequant store"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i]", "STS", _lanes(_tc_vstore),
               "V dequant store: tok = lane / 8, word = lane % 8, rows 272 B apart -> 8 banks x 4 words"),
    SmemAccess(ATT, "storeSmem<T>(vS[tok][wi * kPW + i + kPW / 2]", "STS", _lanes(_tc_vstore), "V dequant store"),
    SmemAccess(TC, "oS[u / kD][u % kD] *= alphaS[u / kD];", "LDS", _lanes(_tc_rescale), "oS row: consecutive words"),
    SmemAccess(TC, "oS[u / kD][u % kD] *= alphaS[u / kD];", "STS", _lanes(_tc_rescale), "oS row: consecutive words"),
    SmemAccess(TC, "sc[j] = visible ? sS[sRow][sCol + j] * softmaxScale : -INFINITY;", "LDS",
               _lanes(lambda lane: (lane // 8) * 36 * 4 + (lane % 8) * 16),
               "row = lane / 8 (rows 144 B apart), 4 consecutive floats per thread (LDS.128)"),
    SmemAccess(TC, "pS[sRow][sCol + j] = pr;", "STS", _lanes(lambda lane: (lane // 8) * 40 * 2 + (lane % 8) * 8),
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


# The mma.sync decode kernel (issue 12 item 2, plugins/kernels/include/kiviDecodeMma.cuh): 4 warps, each streams its own
# contiguous range of 32-key chunks through 3 cp.async stages, so one chunk (= one 3,072-byte KIVI tile) is the work of
# ONE warp (tile_warps = 1). Its source carries no KIVI_MODEL tags, so the loops are declared here by source text.
MMA = "kiviDecodeMma.cuh"
MMA_TILE_ROWS, MMA_STAGES, MMA_WARPS = 8, 3, 4


def mma_launch_plan(shape: ModelShape, batch: int, max_seq_len: int, num_sms: int, seq_len: int,
                    ctas_per_sm: int) -> Plan:
    """The new kernel's kiviLaunchPlan (decode): tiles of 8 query rows; splits = slots / (tiles x Hkv) with slots =
    SMs x the kernel's real occupancy (the launcher passes kiviAttentionCtasPerSm()), so the grid is one wave."""
    grp = shape.group_heads
    t = batch
    num_tiles = min(ceil_div(t * grp, MMA_TILE_ROWS) + batch, t * ceil_div(grp, MMA_TILE_ROWS))
    base = max(num_tiles, 1) * shape.num_kv_heads
    max_splits = ceil_div(max(max_seq_len, 1), MIN_SPLIT_LEN)
    splits = max(1, min((num_sms * ctas_per_sm) // base, max_splits))
    split_len = ceil_div(ceil_div(max(max_seq_len, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = ceil_div(max(max_seq_len, 1), split_len)
    seq_split = max(MIN_SPLIT_LEN, ceil_div(ceil_div(max(seq_len, 0), num_splits), KEY_TILE) * KEY_TILE)
    return Plan(grp, MMA_TILE_ROWS, num_tiles, split_len, num_splits, seq_split)


def mma_stage_bytes(shape: ModelShape) -> int:
    return kivi_tile_bytes(shape)  # K + V words of a 32-key chunk + K scale/zero [D] + V scale/zero [32][D / Gv]


def _mma_q_lanes(lane: int) -> int:  # float2 qS[g][16 kb + 8 reg + 2 t], rows of D + 8 floats (544 B)
    g, t = lane // 4, lane % 4
    return g * 136 * 4 + 2 * t * 4


def _mma_vrow_lanes(lane: int) -> int:  # V scale / zero row of key 2t (D = 128, Gv = 32: 4 fp16 = 8 bytes per key)
    return 2 * (lane % 4) * 8


MMA_SMEM = (
    SmemAccess(MMA, "w[tau][j] = src[j];", "LDS",
               _lanes(lambda lane: lane * 16), "K words of the lane's A registers: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "w[j] = src[j];\n                }\n                uint32_t const wb0", "LDS",
               _lanes(lambda lane: lane * 16), "V words: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "float2 const qq = *reinterpret_cast<float2 const*>(&qS[g][16 * kb + 8 * (k % 2) + 2 * t]);", "LDS",
               _lanes(_mma_q_lanes), "q row g = lane / 4 (rows of D + 8 = 136 floats), channels 2 t, 2 t + 1: "
               "conflict-free (once per CTA)"),
    SmemAccess(MMA, "return *reinterpret_cast<uint32_t const*>(base + i * 2);", "LDS",
               _lanes(lambda lane: (lane % 4) * 4), "staged K scale/zero pair of channels 2 t, 2 t + 1 (generic "
               "pointer), broadcast over g: one wavefront"),
    SmemAccess(MMA, "s[k][j] = reinterpret_cast<uint32_t const*>(sBase + key * kVG * 2)[j];", "LDS",
               _lanes(_mma_vrow_lanes), "staged V scale row (D / 32 fp16) of key 2 t (+1, +8, +9): 8 B per lane, "
               "broadcast over g: one wavefront"),
    SmemAccess(MMA, "z[k][j] = reinterpret_cast<uint32_t const*>(zBase + key * kVG * 2)[j];", "LDS",
               _lanes(_mma_vrow_lanes), "staged V zero row: as the scale row"),
    SmemAccess(MMA, "uint4 const x = qaS[i * 32 + lane];", "LDS", _lanes(lambda lane: lane * 16),
               "qa fragments [kb / 2][lane] uint4: 16 contiguous bytes per lane"),
    SmemAccess(MMA, "qaS[i * 32 + lane] = make_uint4(x[0], x[1], x[2], x[3]);", "STS", _lanes(lambda lane: lane * 16),
               "qa fragments, written once by warp 0"),
    SmemAccess(MMA, "qS[n][u % kD] = x;", "STS", _lanes(lambda lane: lane * 4), "consecutive words"),
    SmemAccess(MMA, 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(s), "l"(gmem));', "LDGSTS",
               _lanes(lambda lane: lane * 16), "cp.async 16 B per lane, contiguous"),
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
               note="mma.sync m16n8k16 over FRAGMENT-order codes (issue 12 item 2); the default where present"),
)

# ------------------------------------------------------------------------------------------------ append kernel
# kiviAppendKernel (plugins/kernels/include/kiviAppend.cuh): the quantize-and-store path of a prefill chunk. Its "tile"
# is one G-token group of one (sequence, KV head) in a chunk CTA (y >= 1): stage K [G][D + 8] (16-byte loads), K
# scales, K codes (one thread per FRAGMENT word), then V^T [D][G + 8], V scales, V codes. Shapes: G = 32, 2-bit K
# and V, fp16 activations and scales (the default); the group size, bits and scale dtype are uniform branches whose
# other copies are off the path.
APPEND = "kiviAppend.cuh"
APPEND_CHUNKS = (4096, 8192, 32768)
APPEND_BATCHES = (1, 8)
APPEND_MIN_FRACTION = 0.80  # issue 12: the store path at >= 80% of copy bandwidth for prefill chunks of >= 4K tokens
APPEND_OUT = ROOT / "benchmarks" / "results" / "kernel_model_append.json"


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
               _lanes(_append_pair_lanes(APPEND_KROW, 2)), "K staging (chunk CTAs): 16 vectors per row, two rows per warp"),
    SmemAccess(APPEND, "    *scale = s;", "STS", _lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)),
               "scale / zero / 1/s stores of storePairScales (K: 8-byte stride; charged at V's pattern, token pairs x "
               "groups: 32-byte stride, the worse of the two call sites)"),
    SmemAccess(APPEND, "    *zero = storeScale(", "STS", _lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)),
               "as *scale"),
    SmemAccess(APPEND, "    *inv = codeReciprocal(s);", "STS",
               _lanes(lambda lane: 4 * (2 * (lane % 16) * (128 // GROUP) + lane // 16)), "as *scale"),
    SmemAccess(APPEND, "*reinterpret_cast<uint4*>(sm.tile + i * Sm::kKROW + 8 * c8) = *reinterpret_cast<uint4 const*>(row + 8 * c8);",
               "STS", _lanes(_append_pair_lanes(APPEND_KROW, 2)), "K staging: 16 vectors per row, two rows per warp"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + i * Sm::kKROW + 2 * c2);", "LDS",
               _lanes(lambda lane: lane * 4), "K scales: channel pairs of one token row, consecutive words"),
    SmemAccess(APPEND, "uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + 2 * c2);", "LDS",
               _lanes(lambda lane: lane * 4), "K scales: row 0"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(row + 8 * (reg & 1) * Sm::kKROW + off);",
               "LDS", _lanes(_append_pair_lanes(APPEND_KROW, 0)), "K code pairs: token g (+8), word t: banks 4g + t"),
    SmemAccess(APPEND, "uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[off + hf], inv[off + hf], ok);",
               "LDS", _lanes(lambda lane: (2 * (lane % 4)) * 4), "K zero / 1/s of channel 2t (+1): broadcast over g"),
    SmemAccess(APPEND, "*reinterpret_cast<uint32_t*>(dst) = __byte_perm(a[i], c[i], 0x5410);", "STS",
               _lanes(lambda lane: (lane // 16) * 8 * APPEND_VROW + (lane % 16) * 4),
               "V^T staging: 16 token pairs x 2 channel octets per warp (rows 8 apart: 2-way conflict)"),
    SmemAccess(APPEND, "*reinterpret_cast<uint32_t*>(dst + Sm::kVROW) = __byte_perm(a[i], c[i], 0x7632);", "STS",
               _lanes(lambda lane: (lane // 16) * 8 * APPEND_VROW + APPEND_VROW + (lane % 16) * 4),
               "V^T staging, odd channel"),
    SmemAccess(APPEND, "uint32_t mn = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV) * Sm::kVROW + 2 * tp);",
               "LDS", _lanes(lambda lane: (lane // 16) * GROUP * APPEND_VROW + (lane % 16) * 4),
               "V scales: token pairs of two channel groups (rows 32 apart)"),
    SmemAccess(APPEND, "uint32_t const x = *reinterpret_cast<uint32_t const*>(sm.tile + (cg * Sm::kGV + c) * Sm::kVROW + 2 * tp);",
               "LDS", _lanes(lambda lane: (lane // 16) * GROUP * APPEND_VROW + (lane % 16) * 4), "V scales"),
    SmemAccess(APPEND, "= *reinterpret_cast<uint32_t const*>(col + (16 * blk + 8 * (reg & 1)) * Sm::kVROW + 8 * (reg >> 1));",
               "LDS", _lanes(_append_pair_lanes(APPEND_VROW, 0)), "V code pairs: channel g (+8), tokens 2t, 2t + 1: "
               "banks 20g + t"),
    SmemAccess(APPEND, "uint32_t const c = quantizeCodeFast<kBITS>(pairElement<T>(x, hf), zero[sk], inv[sk], ok);",
               "LDS", _lanes(lambda lane: (2 * (lane % 4)) * (128 // GROUP) * 4),
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
        "predicted_us": _round(kernel_us + gpu.launch_us, 4), "copy_bw_us": _round(copy_us + gpu.launch_us, 4),
        "fraction_of_copy_bw": _round(copy_us / kernel_us, 3), "bound": longest["bound"],
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


def gate_append(records: list[dict]) -> str | None:
    """None when the append kernel is predicted at >= 80% of copy bandwidth for every chunk >= 4K on H200."""
    hits = [r for r in records if r["gpu"] == "H200" and r["chunk"] >= 4096]
    if not hits:
        return "no append-kernel record at H200 with a chunk of >= 4K tokens"
    bad = [r for r in hits if r["fraction_of_copy_bw"] < APPEND_MIN_FRACTION]
    if bad:
        r = min(bad, key=lambda r: r["fraction_of_copy_bw"])
        return (f"append kernel at {r['fraction_of_copy_bw']:.0%} of copy bandwidth ({r['model']}, batch {r['batch']}, "
                f"chunk {r['chunk']}: {r['bound']}-bound); it must reach {APPEND_MIN_FRACTION:.0%}")
    return None


# Issue 12's hand count of today's kernels (sm_90, Llama-3-8B shapes, per 3,072-byte tile) and its prediction at batch
# 8, 32K on an H200; the model must reproduce them within ~20%.
CALIBRATION = {
    "simt": {"warp_instructions_per_tile": 6488, "wavefronts_per_tile": 3500, "instructions_per_code_word": 405,
             "predicted_us": 1100.0},
    "wmma": {"warp_instructions_per_tile": 5412, "wavefronts_per_tile": 1430, "instructions_per_code_word": 338,
             "predicted_us": 450.0},
    "fp16": {"predicted_us": 250.0},
}
CALIBRATION_TOLERANCE = 0.20

# ------------------------------------------------------------------------------------------------ tools


class ToolMissing(RuntimeError):
    """nvcc or a disassembler wheel is absent; the message says which and how to get it."""


def find_nvcc() -> str:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise ToolMissing("nvcc is not on PATH nor in /usr/local/cuda/bin (install the CUDA 13.0 toolkit)")


def find_wheel_tool(name: str) -> str:
    """nvdisasm / cuobjdump from the PyPI wheels nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump (bin/ of nvidia/cu13)."""
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_nvdisasm", "cuda_cuobjdump"):
            p = Path(loc) / sub / "bin" / name
            if p.exists():
                return str(p)
    raise ToolMissing(f"{name} not found: pip install the test extra (pyproject.toml pins nvidia-cuda-{name})")


# ------------------------------------------------------------------------------------------------ compile


def compile_kernel(spec: KernelSpec, arch: str, work: Path, nvcc: str) -> tuple[Path, Resources]:
    tu = work / f"{spec.name}_{arch}.cu"
    includes = "".join(f'#include "{h}"\n' for h in spec.headers)
    tu.write_text(f"// generated by benchmarks/kernel_model.py: {spec.name} only\n{includes}"
                  f"namespace trtllm_kivi\n{{\nnamespace kernels\n{{\n{spec.instantiation}\n}}\n}}\n")
    cubin = work / f"{spec.name}_{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-lineinfo", "-O3", "-std=c++17", "-Xptxas=-v",
           *(f"-I{d}" for d in spec.include_dirs), str(tu), "-o", str(cubin)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for kernel {spec.name} ({arch}):\n{res.stderr[-4000:]}")
    return cubin, parse_ptxas(res.stdout + res.stderr, spec.symbol)


def parse_ptxas(text: str, symbol: str) -> Resources:
    """-Xptxas -v lines of the entry function whose mangled name contains `symbol`."""
    block = None
    for part in re.split(r"ptxas info\s*: Compiling entry function ", text)[1:]:
        if symbol in part.split("\n", 1)[0]:
            block = part
    if block is None:
        raise RuntimeError(f"ptxas -v has no entry function matching {symbol!r}")

    def num(pat: str) -> int:
        m = re.search(pat, block)
        return int(m.group(1)) if m else 0

    return Resources(num(r"Used (\d+) registers"), num(r"(\d+) bytes smem"), num(r"(\d+) bytes stack frame"),
                     num(r"(\d+) bytes spill stores"), num(r"(\d+) bytes spill loads"))


def cuobjdump_resources(cubin: Path, cuobjdump: str, symbol: str) -> dict:
    """cuobjdump --dump-resource-usage of the function matching `symbol`: {REG, STACK, SHARED, LOCAL} (SHARED counts
    the 1 KB the sm_90 runtime reserves per CTA, which ptxas leaves out)."""
    res = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin}: {res.stderr[-2000:]}")
    for part in res.stdout.split(" Function ")[1:]:
        name, _, body = part.partition(":")
        if symbol in name:
            return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", body)}
    raise RuntimeError(f"cuobjdump lists no function matching {symbol!r} in {cubin}")


# ------------------------------------------------------------------------------------------------ SASS


@dataclass
class Instr:
    addr: int
    pred: str
    opcode: str
    operands: str
    stack: tuple[tuple[str, int], ...]  # (file, line), innermost first
    label: str | None = None

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|\$[\w$.]+):")


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """nvdisasm -c -gi output -> {function: instructions}. A run of `//## File` lines is one inline stack (innermost
    first) that applies to the instructions after it until the next run."""
    funcs: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    stack: list[tuple[str, int]] = []
    fresh = True
    label = None
    for ln in text.splitlines():
        if ln.startswith(".text."):
            cur = funcs.setdefault(ln[len(".text."):].rstrip(":"), [])
            stack, fresh, label = [], True, None
            continue
        if cur is None:
            continue
        m = _LINE.match(ln)
        if m:
            if not fresh:
                stack, fresh = [], True
            stack.append((str(Path(m.group(1)).resolve()), int(m.group(2))))
            continue
        m = _LABEL.match(ln.strip())
        if m:
            label = m.group(1)
            continue
        m = _INSTR.match(ln)
        if m:
            fresh = False
            cur.append(Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4), tuple(stack),
                             label))
            label = None
    return funcs


def disassemble(cubin: Path, nvdisasm: str) -> dict[str, list[Instr]]:
    res = subprocess.run([nvdisasm, "-c", "-gi", str(cubin)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}: {res.stderr[-2000:]}")
    return parse_sass(res.stdout)


def op_class(opcode: str) -> str:
    """Instruction class used in the per-tile counts."""
    b = opcode.split(".")[0]
    if b in ("HMMA", "IMMA", "HGMMA", "DMMA", "BMMA", "QGMMA", "IGMMA"):
        return "MMA"
    if b in ("FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2", "FMNMX", "HMNMX2", "FSEL", "FSETP", "HSETP2", "DFMA",
             "DADD", "DMUL", "FCHK", "FSWZADD"):
        return "FMA"
    if b == "MUFU":
        return "MUFU"
    if b in ("F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "FRND"):
        return "CVT"
    if b in ("LDS", "STS", "LDSM", "STSM", "LDGSTS", "LDG", "STG", "LDL", "STL", "LDC", "BAR", "SHFL", "ATOMS", "ATOMG",
             "RED", "ATOM", "LD", "ST", "LDGDEPBAR", "DEPBAR", "UBLKCP", "UTMALDG", "SYNCS"):
        return b
    if b in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "BSSY", "BSYNC", "WARPSYNC", "BREAK", "NOP", "YIELD",
             "ENDCOLLECTIVE", "ELECT", "VOTE", "VOTEU", "MATCH", "BMOV", "PLOP3", "KILL", "ACQBULK"):
        return "CTRL"
    if b.startswith("U") or b in ("S2UR", "R2UR"):
        return "UNIFORM"
    return "ALU"


def smem_width(opcode: str) -> int:
    parts = opcode.split(".")
    for p, w in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if p in parts:
            return w
    return 4


@dataclass
class Block:
    index: int
    instrs: list[Instr]
    succs: list[int] = field(default_factory=list)
    div_succs: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.instrs[0].addr

    @property
    def end(self) -> int:
        return self.instrs[-1].addr


def _local_call(ins: Instr) -> bool:
    """`CALL.REL.NOINC` to a label of the same function: sm_80 code uses it as a (conditional) jump out of a loop."""
    return ins.base == "CALL" and "`(.L_x_" in ins.operands


def basic_blocks(instrs: list[Instr]) -> list[Block]:
    """Split at labels and after control transfers (a CALL to a local label is a jump); edges: branch targets (BRA.DIV targets apart: the divergent
    fallback, not taken by converged warps) and fall-through unless the branch/EXIT is unconditional."""
    blocks: list[Block] = []
    curr: list[Instr] = []
    for ins in instrs:
        if ins.label and curr:
            blocks.append(Block(len(blocks), curr))
            curr = []
        curr.append(ins)
        if ins.base in ("BRA", "BRX", "JMX", "JMP", "EXIT", "RET") or _local_call(ins):
            blocks.append(Block(len(blocks), curr))
            curr = []
    if curr:
        blocks.append(Block(len(blocks), curr))
    by_label = {b.instrs[0].label: b.index for b in blocks if b.instrs[0].label}
    for b in blocks:
        last = b.instrs[-1]
        m = re.search(r"`\(([^)]+)\)", last.operands)
        if (last.base == "BRA" or _local_call(last)) and m and m.group(1) in by_label:
            (b.div_succs if ".DIV" in last.opcode else b.succs).append(by_label[m.group(1)])
        uncond = not last.pred and last.base in ("BRA", "EXIT", "RET", "BRX", "JMX", "JMP") and ".DIV" not in last.opcode
        if not uncond and b.index + 1 < len(blocks):
            b.succs.append(b.index + 1)
    return blocks


def reachable(blocks: list[Block]) -> set[int]:
    seen, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        todo.extend(blocks[i].succs)
    return seen


@dataclass
class Loop:
    head: int  # first block index
    tail: int  # block with the back edge
    tag: str | None = None
    unroll: int = 1
    trips: float = 1.0
    parent: int | None = None

    def contains(self, i: int) -> bool:
        return self.head <= i <= self.tail


def find_loops(blocks: list[Block], live: set[int]) -> list[Loop]:
    """Natural loops of the reachable blocks: a back edge b -> t with t <= b spans blocks t..b (nvcc lays loops out
    contiguously). Edges out of unreachable blocks (e.g. the divergent-shuffle fallbacks jumping back) are no loops."""
    loops = [Loop(t, b.index) for b in blocks if b.index in live for t in b.succs if t <= b.index]
    loops.sort(key=lambda lp: (lp.head, -lp.tail))
    for i, lp in enumerate(loops):  # innermost enclosing loop
        enclosing = [j for j, o in enumerate(loops) if j != i and o.head <= lp.head and lp.tail <= o.tail
                     and (o.head, o.tail) != (lp.head, lp.tail)]
        lp.parent = min(enclosing, key=lambda j: loops[j].tail - loops[j].head) if enclosing else None
    return loops


# ------------------------------------------------------------------------------------------------ source tags


def source_lines(files: dict[str, Path], file: str, text: str) -> set[int]:
    """Line numbers of `text` (may span lines) in `file`; it must occur exactly once."""
    src = files[file].read_text()
    hits = [m.start() for m in re.finditer(re.escape(text), src)]
    if len(hits) != 1:
        raise ValueError(f"source text {text!r} occurs {len(hits)} times in {file}; a rule needs exactly one")
    first = src.count("\n", 0, hits[0]) + 1
    return set(range(first, first + text.count("\n") + 1))


def find_tags(paths: Sequence[Path]) -> dict[tuple[str, str], set[tuple[str, int]]]:
    """{("LOOP" | "ANCHOR", name): {(resolved file, line)}} of the KIVI_MODEL_* comments. A loop name is unique per file
    (two kernels in two files may both have a loop `tile`); a loop may have several anchor lines when its versions
    (e.g. unswitched on numSplits) execute different ones, each once per iteration."""
    tags: dict[tuple[str, str], set[tuple[str, int]]] = defaultdict(set)
    for path in paths:
        seen: set[tuple[str, str]] = set()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for kind, name in re.findall(r"KIVI_MODEL_(LOOP|ANCHOR)\((\w+)\)", line):
                if kind == "LOOP" and (kind, name) in seen:
                    raise ValueError(f"tag KIVI_MODEL_{kind}({name}) appears twice in {path}")
                seen.add((kind, name))
                tags[(kind, name)].add((str(path.resolve()), n))
    return dict(tags)


# ------------------------------------------------------------------------------------------------ counting


@dataclass
class Count:
    """Executed warp-instructions (per CTA, summed over its warps) and shared-memory wavefronts."""
    by_class: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    wavefronts: float = 0.0
    unmapped_smem: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # "file:line op"
    by_line: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # innermost own "file:line"

    @property
    def instructions(self) -> float:
        return float(sum(self.by_class.values()))

    def as_dict(self) -> dict:
        return {"warp_instructions": round(self.instructions, 1),
                "by_class": {k: round(v, 1) for k, v in sorted(self.by_class.items()) if v},
                "wavefronts": round(self.wavefronts, 1),
                "unmapped_smem": {k: round(v, 1) for k, v in sorted(self.unmapped_smem.items())},
                "hot_lines": [[k, round(v, 1)] for k, v in sorted(self.by_line.items(), key=lambda kv: (-kv[1], kv[0]))[:12]]}


class KernelAnalysis:
    """The SASS of one kernel on one arch, with its blocks, loops and tags; count(ctx) walks the executed path."""

    def __init__(self, spec: KernelSpec, instrs: list[Instr], resources: Resources, arch: str) -> None:
        self.spec, self.instrs, self.resources, self.arch = spec, instrs, resources, arch
        files = {p.name: p for d in spec.include_dirs for p in sorted(d.glob("*.cuh")) + sorted(d.glob("*.h"))}
        self.files = files
        self.tags = find_tags(list(files.values()))
        self._lines: dict[tuple[str, str], set[tuple[str, int]]] = {}
        for ls in spec.loops:  # tags declared in the table (source text) instead of comments
            if (ls.loop_text or ls.anchor_text) and not ls.file:
                raise ValueError(f"loop {ls.tag} of {spec.name}: loop_text / anchor_text need the file")
            if ls.loop_text and ls.file:
                first = min(n for _, n in self.lines_of(ls.file, ls.loop_text))
                self.tags.setdefault(("LOOP", ls.tag), set()).add((str(self.files[ls.file].resolve()), first))
            for text in ls.anchor_text:
                self.tags.setdefault(("ANCHOR", ls.tag), set()).update(self.lines_of(ls.file or "", text))
        self.blocks = basic_blocks(instrs)
        self.live = reachable(self.blocks)
        self.loops = find_loops(self.blocks, self.live)
        self._name_loops()
        self._counts: dict[Ctx, tuple[Count, Count]] = {}

    # -- loops
    def _frames(self, ins: Instr) -> set[tuple[str, int]]:
        return set(ins.stack)

    def _own_blocks(self, li: int) -> list[int]:
        lp = self.loops[li]
        inner = [o for j, o in enumerate(self.loops) if o.parent == li]
        return [i for i in range(lp.head, lp.tail + 1) if not any(o.contains(i) for o in inner)]

    def _name_loops(self) -> None:
        loop_tags = {loc: k[1] for k, locs in self.tags.items() if k[0] == "LOOP" for loc in locs}
        specs = {s.tag: s for s in self.spec.loops}
        for li, lp in enumerate(self.loops):
            back = self.blocks[lp.tail].instrs[-1]
            names = [loop_tags[f] for f in back.stack if f in loop_tags]
            lp.tag = names[0] if names else None
            if lp.tag is None or lp.tag not in specs:
                continue
            anchor = self.tags.get(("ANCHOR", lp.tag), set())
            if lp.tag == "tile":
                lp.unroll = 1
                continue
            if not anchor:
                raise ValueError(f"loop {lp.tag} has no KIVI_MODEL_ANCHOR({lp.tag}) line")
            n = sum(1 for i in self._own_blocks(li) for ins in self.blocks[i].instrs
                    if anchor & set(ins.stack) and op_class(ins.opcode) == specs[lp.tag].anchor_op)
            lp.unroll = n

    def tile_loop(self, weights: dict[int, float] | None = None) -> int:
        cands = [i for i, lp in enumerate(self.loops) if lp.tag == "tile"]
        if len(cands) > 1 and weights is not None:  # copies of the loop (e.g. one per scale dtype): the one on the
            # path, i.e. the most weighted instructions (a dead copy may keep a few unattributed weight-1 instructions)
            def live(i: int) -> float:
                return sum(weights[b] * len(self.blocks[b].instrs) for b in self._own_blocks(i))
            best = max(cands, key=live)
            if any(live(i) > 0.1 * live(best) for i in cands if i != best):
                raise ValueError(f"{self.spec.name} ({self.arch}): {len(cands)} live copies of the tile loop")
            cands = [best]
        if len(cands) != 1:
            raise ValueError(f"{self.spec.name} ({self.arch}): expected one SASS loop tagged tile, found {len(cands)}")
        return cands[0]

    def _trips(self, ctx: Ctx, weights: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
        """SASS trips per entry of each loop. Per tag and call-site stack (frames outside the tagged lines), the live
        anchor instructions outside that tag's SASS loops run once per entry (a fully unrolled loop, or the
        prologue / epilogue of a software-pipelined one); the remaining source trips are spread over the live SASS
        loops of the group (nvcc's unrolled loop + remainder loop), largest unroll first; fewer straight-line anchors
        than the largest unroll that do not fit are nvcc's straight-line remainder (run N mod U times, scaled so; exact
        when N mod U is 0, as in today's kernels). Returns (trips per loop, block multipliers). Loops whose copies run for
        other call sites or versions (e.g. unswitched on a runtime value) are separate groups or dead. A group whose
        anchors do not add up to a whole multiple of the source trips is refused by name (e.g. a straight-line
        remainder that runs only when N mod U != 0), never miscounted silently."""
        specs = {s.tag: s for s in self.spec.loops}
        out: dict[int, float] = {li: 1.0 for li in range(len(self.loops))}  # tile loop: per tile; untagged: reported
        scale: dict[int, float] = {}  # block -> multiplier of remainder blocks
        in_loop: dict[int, list[int]] = defaultdict(list)
        for li, lp in enumerate(self.loops):
            for i in range(lp.head, lp.tail + 1):
                in_loop[i].append(li)
        for tag, sp in specs.items():
            if tag == "tile":
                continue
            anchors = self.tags.get(("ANCHOR", tag), set())
            heads = self.tags.get(("LOOP", tag), set())

            def outer(stack: tuple[tuple[str, int], ...], marks: set[tuple[str, int]]) -> tuple:
                k = next((i for i, fr in enumerate(stack) if fr in marks), None)
                return stack[k + 1:] if k is not None else ("?",)

            loops: dict[tuple, list[int]] = defaultdict(list)
            for li, lp in enumerate(self.loops):
                if lp.tag != tag:
                    continue
                if not any(weights[i] > 0 for i in self._own_blocks(li)):
                    out[li] = 0.0
                    continue
                loops[outer(self.blocks[lp.tail].instrs[-1].stack, heads)].append(li)
            straight: Counter = Counter()
            straight_blocks: dict[tuple, set[int]] = defaultdict(set)
            for bl in self.blocks:
                if weights[bl.index] <= 0 or any(self.loops[li].tag == tag for li in in_loop[bl.index]):
                    continue
                for ins in bl.instrs:
                    if anchors & set(ins.stack) and op_class(ins.opcode) == sp.anchor_op:
                        straight[outer(ins.stack, anchors)] += 1
                        straight_blocks[outer(ins.stack, anchors)].add(bl.index)
            sites = [(self.lines_of(f, text), fn) for f, text, fn in sp.sites]
            for key in set(loops) | set(straight):
                total = next((fn(ctx) for lines, fn in sites if lines & set(key)), sp.trips(ctx))
                lis, left = loops.get(key, []), total - straight[key]
                umax = max((self.loops[j].unroll for j in lis), default=0)
                if lis and 0 < straight[key] < umax and left % umax:
                    # nvcc's straight-line remainder of a loop unrolled by umax (< umax copies, run for N mod umax
                    # iterations): its anchor blocks run (N mod umax) / copies times (exact for 0 and for all copies)
                    r = total % umax
                    if r > straight[key]:
                        raise ValueError(f"loop {tag} ({self.arch}): {total} source trips, {straight[key]} straight-line "
                                         f"anchors and SASS loops unrolled {[self.loops[j].unroll for j in lis]}: the "
                                         "remainder structure is not modelled (use #pragma unroll 1, or a trip count "
                                         "nvcc sees)")
                    for i in straight_blocks[key]:
                        scale[i] = scale.get(i, 1.0) * r / straight[key]
                    left = total - r
                if not lis:
                    if straight[key] % total:
                        raise ValueError(f"loop {tag} ({self.arch}): {straight[key]} unrolled anchor instructions on the "
                                         f"path, not a multiple of its {total} source trips")
                    continue
                for li in sorted(lis, key=lambda j: -self.loops[j].unroll):
                    u = self.loops[li].unroll
                    if u <= 0:
                        raise ValueError(f"loop {tag} ({self.arch}) has no anchor instruction ({sp.anchor_op}) in its "
                                         "body: cannot tell its unroll factor")
                    out[li] = float(max(left, 0) // u)
                    left -= int(out[li]) * u
                if left:
                    raise ValueError(
                        f"loop {tag} ({self.arch}): {total} source trips do not fit {straight[key]} straight-line "
                        f"anchors + SASS loops unrolled {[self.loops[j].unroll for j in lis]} (a remainder that runs "
                        "only for some trip counts is not modelled: use #pragma unroll 1, or a trip count nvcc sees)")
        return out, scale

    # -- path weights
    def lines_of(self, file: str, text: str) -> set[tuple[str, int]]:
        """{(resolved file, line)} of a source text (cached)."""
        if (file, text) not in self._lines:
            f = str(self.files[file].resolve())
            self._lines[(file, text)] = {(f, n) for n in source_lines(self.files, file, text)}
        return self._lines[(file, text)]

    def _rule_lines(self) -> list[tuple[set[tuple[str, int]], PathRule]]:
        src = {r.file: self.files[r.file].read_text() for r in self.spec.rules}
        return [(self.lines_of(r.file, r.text), r) for r in self.spec.rules
                if not (r.optional and r.text not in src[r.file])]

    def _weights(self, ctx: Ctx) -> dict[int, float]:
        rules = self._rule_lines()
        w: dict[int, float] = {}
        for b in self.blocks:
            if b.index not in self.live or any(i.base == "CALL" and re.search(r"slowpath|_s64", i.operands)
                                               for i in b.instrs):
                w[b.index] = 0.0  # not reached by converged warps, or the 64-bit-division / division slow path
                continue
            per = []
            for ins in b.instrs:
                x = 1.0
                for lines, r in rules:
                    if lines & set(ins.stack):
                        x *= _w(r.weight, ctx)
                per.append(x)
            c = Counter(per)
            top = max(c.values())
            w[b.index] = max(v for v, n in c.items() if n == top)
        for cr in self.spec.copies:
            f = str(self.files[cr.file].resolve())
            lo = min(source_lines(self.files, cr.file, cr.start))
            hi = max(source_lines(self.files, cr.file, cr.end))
            guard = {(f, n) for n in source_lines(self.files, cr.file, cr.guard)}
            weights = cr.weights(ctx)
            k = -1
            for b in self.blocks:
                last = b.instrs[-1]
                if b.index in self.live and last.base in ("BRA", "EXIT") and guard & set(last.stack):
                    k += 1
                    continue
                inside = sum(1 for ins in b.instrs if any(fr[0] == f and lo <= fr[1] <= hi for fr in ins.stack))
                if not inside or 2 * inside < len(b.instrs):
                    continue
                if k >= 0:
                    w[b.index] *= weights[k % len(weights)]
            if (k + 1) % len(weights):
                raise ValueError(f"copy rule {cr.why!r}: {k + 1} guard branches in the SASS, not a multiple of the "
                                 f"{len(weights)} unrolled copies")
        return w

    # -- counting
    def count(self, ctx: Ctx) -> tuple[Count, Count]:
        """(per tile, per CTA outside the tile loop), summed over the CTA's warps (cached per path context)."""
        if ctx not in self._counts:
            self._counts[ctx] = self._count(ctx)
        return self._counts[ctx]

    def _count(self, ctx: Ctx) -> tuple[Count, Count]:
        weights = self._weights(ctx)
        trips, scale = self._trips(ctx, weights)
        tl = self.tile_loop(weights)
        tile, rest = Count(), Count()
        smem = self._smem_patterns(ctx)
        warps = ceil_div(self.spec.threads, WARP)
        tile_warps = self.spec.tile_warps or warps
        for b in self.blocks:
            wgt = weights[b.index] * scale.get(b.index, 1.0)
            if wgt == 0.0:
                continue
            n = wgt * (tile_warps if self.loops[tl].contains(b.index) else warps)
            for li, lp in enumerate(self.loops):
                if lp.contains(b.index) and li != tl:
                    n *= trips[li]
            target = tile if self.loops[tl].contains(b.index) else rest
            for ins in b.instrs:
                cls = "CTRL" if ins.pred == "@!PT" else op_class(ins.opcode)  # never-true predicate: a padding slot
                target.by_class[cls] += n  # a predicated-off instruction still takes its issue slot
                target.by_line[self._where(ins)] += n
                generic = cls in ("LD", "ST")  # generic: shared memory only where a SmemAccess declares it
                if cls in ("LDS", "STS", "LDSM", "STSM", "LDGSTS") or generic:
                    wf = self._wavefronts(ins, cls, smem)
                    if wf is None and generic:
                        continue
                    if wf is None:
                        key = f"{Path(ins.stack[0][0]).name}:{ins.stack[0][1]} {ins.opcode}" if ins.stack else ins.opcode
                        target.unmapped_smem[key] += n
                        wf = self._default_wavefronts(ins, cls)
                    target.wavefronts += n * wf
        return tile, rest

    def _where(self, ins: Instr) -> str:
        """The innermost frame in the kernel's own headers (not CUDA's), as file:line."""
        own = {str(f.resolve()) for f in self.files.values()}
        fr = next((f for f in ins.stack if f[0] in own), ins.stack[0] if ins.stack else ("?", 0))
        return f"{Path(fr[0]).name}:{fr[1]}"

    def _smem_patterns(self, ctx: Ctx) -> list[tuple[set[tuple[str, int]], str, list[int | None]]]:
        return [(self.lines_of(a.file, a.text), a.op, a.lanes(ctx)) for a in self.spec.smem]

    def _wavefronts(self, ins: Instr, cls: str, smem) -> int | None:
        frames = set(ins.stack)
        for lines, op, lanes in smem:  # a generic LD / ST matches a declared LDS / STS
            if (op == cls or (cls, op) in (("LD", "LDS"), ("ST", "STS"))) and lines & frames:
                return wavefronts(lanes, smem_width(ins.opcode))
        return None

    @staticmethod
    def _default_wavefronts(ins: Instr, cls: str) -> int:
        """Unmapped access: assumed conflict-free (consecutive lanes; ldmatrix/stmatrix: one wavefront per 8x8
        matrix)."""
        if cls in ("LDSM", "STSM"):  # LDSM.16.M88.4 = four 8x8 16-bit matrices of 128 B
            last = ins.opcode.split(".")[-1]
            return int(last) if last in ("2", "4") else 1
        return max(1, WARP * smem_width(ins.opcode) // 128)

    def check_loops(self, ctx: Ctx) -> list[str]:
        """Loops on the executed path that no tag names (counted as one trip per entry): listed in the output."""
        weights = self._weights(ctx)
        out = []
        for lp in self.loops:
            untagged = lp.tag is None or lp.tag not in {s.tag for s in self.spec.loops}
            if untagged and any(weights[i] > 0 for i in range(lp.head, lp.tail + 1)):
                back = self.blocks[lp.tail].instrs[-1]
                where = f"{Path(back.stack[-1][0]).name}:{back.stack[-1][1]}" if back.stack else "?"
                out.append(f"blocks {lp.head}-{lp.tail} (back edge at {where})")
        return out


# ------------------------------------------------------------------------------------------------ analysis driver


@dataclass
class KernelResult:
    """One kernel on one arch: resources and the executed counts for each path context."""
    spec: KernelSpec
    arch: str
    resources: Resources
    analysis: KernelAnalysis
    cuobjdump: dict = field(default_factory=dict)  # --dump-resource-usage, the cross-check of ptxas -v

    def counts(self, ctx: Ctx) -> tuple[Count, Count]:
        return self.analysis.count(ctx)


def tool_versions(nvcc: str, nvdisasm: str, cuobjdump: str) -> dict:
    def first(cmd: list[str]) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()
        return out[-1] if out else "?"
    return {"nvcc": first([nvcc, "--version"]), "nvdisasm": first([nvdisasm, "--version"]),
            "cuobjdump": first([cuobjdump, "--version"])}


def present(spec: KernelSpec) -> bool:
    """Whether the kernel's headers exist in its include dirs (a kernel not yet merged is skipped, and listed)."""
    return all(any((d / h).exists() for d in spec.include_dirs) for h in spec.headers)


def from_root(spec: KernelSpec, root: Path) -> KernelSpec:
    """The same kernel compiled from another checkout's plugins/ (read-only): for a kernel not yet in this tree."""
    return dataclasses.replace(spec, include_dirs=(root / "plugins" / "kernels" / "include",
                                                   root / "plugins" / "include"))


def analyze(specs: Sequence[KernelSpec] = KERNELS, archs: Sequence[str] = ARCHS, jobs: int = 2,
            work: Path | None = None) -> tuple[dict[tuple[str, str], KernelResult], dict]:
    """Compile, disassemble and analyze every (kernel, arch). Raises ToolMissing when nvcc / nvdisasm is absent."""
    nvcc = find_nvcc()
    nvdisasm = find_wheel_tool("nvdisasm")
    cuobjdump = find_wheel_tool("cuobjdump")
    tmp = tempfile.TemporaryDirectory(prefix="kernel_model_") if work is None else None
    wdir = Path(tmp.name) if tmp else Path(work or ".")
    jobs_list = [(s, a) for s in specs for a in archs if int(a.split("_")[1]) >= s.min_arch and present(s)]

    def one(sa: tuple[KernelSpec, str]) -> KernelResult:
        spec, arch = sa
        cubin, res = compile_kernel(spec, arch, wdir, nvcc)
        funcs = disassemble(cubin, nvdisasm)
        names = [f for f in funcs if spec.symbol in f]
        if len(names) != 1:
            raise RuntimeError(f"{spec.name} ({arch}): {len(names)} SASS functions match {spec.symbol!r}")
        usage = cuobjdump_resources(cubin, cuobjdump, spec.symbol)
        if usage.get("REG") != res.registers:
            raise RuntimeError(f"{spec.name} ({arch}): ptxas says {res}, cuobjdump says {usage}")
        return KernelResult(spec, arch, res, KernelAnalysis(spec, funcs[names[0]], res, arch), usage)

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            results = list(ex.map(one, jobs_list))
    finally:
        if tmp:
            tmp.cleanup()
    return {(r.spec.name, r.arch): r for r in results}, tool_versions(nvcc, nvdisasm, cuobjdump)


# ------------------------------------------------------------------------------------------------ timing

DRAM_LATENCY_NS = 800.0  # loaded device-memory latency assumed for the bytes-in-flight check (detail only)
# Tensor-pipe cycles of one mma.sync (HMMA, m16n8k16 or k8) per SM sub-partition, a detail reported next to the three
# bounds: A100's dense fp16 peak (312 TFLOPS, 108 SMs, 1.41 GHz) is 256 FMA per clock per sub-partition = 8 cycles
# per m16n8k16; Hopper's legacy mma.sync path reaches about 2/3 of its wgmma peak (2048 FMA/clk/SM): ~6 cycles
# (an assumption, not measured here). k8 MMAs are charged as k16.
MMA_CYCLES = {"sm_80": 8.0, "sm_90": 6.0}


def _round(x: float, n: int = 3) -> float:
    return float(f"{x:.{n}g}") if abs(x) >= 1e-12 else 0.0


def wave_times(ctas: Sequence[tuple[float, ...]], slots: int, gpu: Gpu, mma_arch: str | None = None
               ) -> list[dict[str, Any]]:
    """CTAs (warp-instructions, wavefronts, device bytes[, MMAs]) in launch order, in waves of `slots`: each wave takes
    max(issue, shared, memory) -- the busiest SM runs ceil(CTAs / SMs) x the largest CTA; memory is the wave's bytes
    at copy bandwidth. mma_arch: also report the tensor pipe (4 sub-partitions per SM at MMA_CYCLES per mma.sync)."""
    issue_rate = gpu.issue_per_clk_per_sm * gpu.clock_ghz * 1e3  # warp-instructions per us per SM
    smem_rate = gpu.smem_wavefronts_per_clk_per_sm * gpu.clock_ghz * 1e3
    bw = gpu.copy_gbps * 1e3  # bytes per us
    waves: list[dict[str, Any]] = []
    for w0 in range(0, len(ctas), slots):
        wave = ctas[w0:w0 + slots]
        per_sm = ceil_div(len(wave), gpu.sms)
        t = {"issue": per_sm * max(c[0] for c in wave) / issue_rate,
             "shared": per_sm * max(c[1] for c in wave) / smem_rate,
             "memory": sum(c[2] for c in wave) / bw}
        bound = max(t, key=lambda k: t[k])
        w: dict[str, Any] = {"ctas": len(wave), "ctas_per_sm": per_sm, "bound": bound,
                             **{f"{k}_us": _round(v, 4) for k, v in t.items()}, "us": _round(t[bound], 4)}
        if mma_arch is not None:
            w["tensor_pipe_us"] = _round(per_sm * max(c[3] for c in wave) * MMA_CYCLES[mma_arch]
                                         / (4 * gpu.clock_ghz * 1e3), 4)
        waves.append(w)
    return waves


def predict(result: KernelResult, gpu: Gpu, shape: ModelShape, batch: int, context: int, default: bool) -> dict:
    """One decode step of one layer: prepare + attention (+ combine) kernels. Time = sum over waves of max(issue,
    shared-memory, memory) + combine bytes at copy bandwidth + launches x launch_us. FP16: the K/V bytes at copy
    bandwidth + the same launches."""
    spec = result.spec
    e = context  # sequence length after the step (past = context - 1, chunk 1), as benchmarks/bench_kernels.py
    past = e - 1
    nq = num_quantized(past)
    res = dataclasses.replace(result.resources, smem_bytes=result.resources.smem_bytes + spec.dynamic_smem(shape))
    occ = occupancy(res, spec.threads, gpu)
    plan = spec.plan(shape, batch, context, gpu.sms, e, occ["ctas_per_sm"]) if spec.plan else \
        launch_plan(shape, batch, context, gpu.sms, e)
    ctx = Ctx(shape, plan.num_splits > 1)
    tile, rest = result.counts(ctx)
    slots = occ["ctas_per_sm"] * gpu.sms
    tile_bytes = spec.tile_bytes(shape)
    d = shape.head_dim
    # CTAs in launch order (blockIdx.x = sequence fastest, then KV head, then split): cost by split
    ctas: list[tuple[float, float, float, float]] = []  # (warp-instructions, wavefronts, device bytes, MMAs)
    L = plan.seq_split_len
    for z in range(plan.num_splits):
        k0 = z * L
        if k0 >= e:
            continue  # the CTA returns at once (no row reads this split)
        keys = min(L, e - k0)
        tiles = ceil_div(keys, KEY_TILE)
        q_keys = max(0, min(keys, nq - k0))
        q_tiles = q_keys // KEY_TILE
        w_keys = keys - q_keys
        nbytes = q_tiles * tile_bytes + w_keys * d * 2 * 2 + shape.group_heads * d * (2 + 4)
        cost = (rest.instructions + tiles * tile.instructions, rest.wavefronts + tiles * tile.wavefronts, nbytes,
                rest.by_class.get("MMA", 0.0) + tiles * tile.by_class.get("MMA", 0.0))
        ctas.extend([cost] * (batch * shape.num_kv_heads))
    bw = gpu.copy_gbps * 1e3  # bytes per us
    waves = wave_times(ctas, slots, gpu, result.arch)
    attn_us = sum(w["us"] for w in waves)
    launches = 2 + (1 if plan.num_splits > 1 else 0)
    combine_bytes = batch * shape.num_heads * plan.num_splits * (d + 2) * 4 + batch * shape.num_heads * d * 2 \
        if plan.num_splits > 1 else 0
    predicted = attn_us + combine_bytes / bw + launches * gpu.launch_us
    fp16_bytes = batch * e * shape.num_kv_heads * d * 2 * 2
    fp16_us = fp16_bytes / bw + launches * gpu.launch_us
    kivi_bytes = sum(c[2] for c in ctas)
    longest = max(waves, key=lambda w: w["us"]) if waves else {"bound": "memory"}
    in_flight = occ["ctas_per_sm"] * spec.stages * tile_bytes
    need = gpu.copy_gbps * DRAM_LATENCY_NS / gpu.sms  # bytes per SM in flight to sustain copy bandwidth
    return {
        "gpu": gpu.name, "model": shape.name, "batch": batch, "context": context, "kernel": spec.name,
        "default": default, "predicted_us": _round(predicted, 4), "fp16_us": _round(fp16_us, 4),
        "speedup_vs_fp16": _round(fp16_us / predicted, 3), "bound": longest["bound"],
        "label": "static model, not a measurement",
        "arch": result.arch,
        "kivi_bytes_at_copy_bw_us": _round(kivi_bytes / bw + launches * gpu.launch_us, 4),
        "launches": launches, "launch_us_each": gpu.launch_us,
        "plan": {"num_splits": plan.num_splits, "seq_split_len": L, "grid_ctas": batch * shape.num_kv_heads
                 * plan.num_splits, "active_ctas": len(ctas), "resident_slots": slots,
                 "waves": _round(len(ctas) / slots, 3) if slots else None, "num_sms_in_plan": gpu.sms},
        "waves": waves,
        "occupancy": occ,
        "resources": {**dataclasses.asdict(result.resources), "dynamic_smem_bytes": spec.dynamic_smem(shape),
                      "cuobjdump": result.cuobjdump},
        "zero_spills": result.resources.spill_stores == 0 and result.resources.spill_loads == 0,
        "per_tile": {**tile.as_dict(), "bytes": tile_bytes,
                     "instructions_per_code_word": _round(tile.instructions * WARP / spec.code_words(shape), 4)},
        "per_cta_outside_tile_loop": {"warp_instructions": round(rest.instructions, 1),
                                      "wavefronts": round(rest.wavefronts, 1),
                                      "untagged_loops_counted_once": result.analysis.check_loops(ctx)},
        # what a tile may cost for the kernel to run at 85% of copy bandwidth on this GPU (issue 12's budget)
        "budget_per_tile_at_85pct_copy_bw": {
            "warp_instructions": round(gpu.issue_per_clk_per_sm * gpu.clock_ghz * 1e3 * gpu.sms * tile_bytes
                                       / (0.85 * bw), 1),
            "wavefronts": round(gpu.smem_wavefronts_per_clk_per_sm * gpu.clock_ghz * 1e3 * gpu.sms * tile_bytes
                                / (0.85 * bw), 1)},
        "bytes_in_flight_per_sm": {"provided": in_flight, "needed_at_copy_bw": round(need),
                                   "assumed_latency_ns": DRAM_LATENCY_NS},
    }


def calibration(records: list[dict]) -> list[dict]:
    """Model vs issue 12's table at Llama-3-8B, batch 8, 32K, H200 (sm_90)."""
    out = []
    for rec in records:
        if (rec["gpu"], rec["model"], rec["batch"], rec["context"]) != ("H200", "llama-3-8b", 8, 32768):
            continue
        want = CALIBRATION.get(rec["kernel"])
        if want is None:
            continue
        got = {"warp_instructions_per_tile": rec["per_tile"]["warp_instructions"],
               "wavefronts_per_tile": rec["per_tile"]["wavefronts"],
               "instructions_per_code_word": rec["per_tile"]["instructions_per_code_word"],
               "predicted_us": rec["predicted_us"]}
        rows = []
        for k, v in want.items():
            ratio = got[k] / v
            rows.append({"quantity": k, "issue_12": v, "model": got[k], "ratio": _round(ratio, 3),
                         "within_tolerance": abs(ratio - 1) <= CALIBRATION_TOLERANCE})
        fp = CALIBRATION["fp16"]["predicted_us"]
        rows.append({"quantity": "fp16_us", "issue_12": fp, "model": rec["fp16_us"], "ratio": _round(rec["fp16_us"] / fp, 3),
                     "within_tolerance": abs(rec["fp16_us"] / fp - 1) <= CALIBRATION_TOLERANCE})
        rec["calibration"] = rows
        out.append({"kernel": rec["kernel"], "rows": rows})
    return out


def build_records(results: dict[tuple[str, str], KernelResult], versions: dict,
                  gpus: Sequence[str] = tuple(GPUS), models: Sequence[str] = tuple(MODELS),
                  batches: Sequence[int] = BATCHES, contexts: Sequence[int] = CONTEXTS) -> list[dict]:
    ranked = sorted((r.spec.default_rank, r.spec.name) for r in results.values() if r.spec.default_rank is not None)
    default_name = ranked[0][1] if ranked else None
    records = []
    for g in gpus:
        gpu = GPUS[g]
        for m in models:
            for b in batches:
                for c in contexts:
                    for spec in KERNELS:
                        r = results.get((spec.name, gpu.arch))
                        if r is None:
                            continue
                        rec = predict(r, gpu, MODELS[m], b, c, spec.name == default_name)
                        rec["tools"] = versions
                        rec["gpu_spec"] = dataclasses.asdict(gpu)
                        records.append(rec)
    calibration(records)
    return records


def gate_default_memory_bound(records: list[dict]) -> str | None:
    """The CI gate: None when the default kernel is memory-bound at Llama-3-8B, batch 8, 32K on H200, else why not."""
    hits = [r for r in records if r["default"] and (r["gpu"], r["model"], r["batch"], r["context"])
            == ("H200", "llama-3-8b", 8, 32768)]
    if len(hits) != 1:
        return f"expected one default-kernel record at H200 / llama-3-8b / batch 8 / 32K, found {len(hits)}"
    r = hits[0]
    if r["bound"] != "memory":
        return (f"default kernel {r['kernel']!r} is predicted {r['bound']}-bound at H200 / llama-3-8b / batch 8 / 32K "
                f"({r['predicted_us']} us vs FP16 {r['fp16_us']} us); it must be memory-bound")
    return None


def markdown_table(records: list[dict]) -> str:
    """One row per (GPU, model, batch, context), the kernels side by side (the default marked *)."""
    kernels = list(dict.fromkeys(r["kernel"] for r in records))
    default = {r["kernel"] for r in records if r["default"]}
    head = " | ".join(f"{k}{'*' if k in default else ''} us | vs FP16 | bound" for k in kernels)
    lines = ["Static model, not a measurement: benchmarks/kernel_model.py, one decode step of one layer (attention "
             "kernels + launches), FP16 = its K/V bytes at copy bandwidth + the same launches. * = default kernel.", "",
             f"| GPU | model | batch | context | FP16 us | {head} |",
             "|---|---|---:|---:|---:|" + "---:|---:|---|" * len(kernels)]
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["gpu"], r["model"], r["batch"], r["context"]), {})[r["kernel"]] = r
    for (g, m, b, c), by in rows.items():
        fp16 = next(iter(by.values()))["fp16_us"]
        cells = " | ".join(f"{by[k]['predicted_us']:g} | {by[k]['speedup_vs_fp16']:g}x | {by[k]['bound']}"
                           if k in by else "- | - | -" for k in kernels)
        lines.append(f"| {g} | {m} | {b} | {c // 1024}K | {fp16:g} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON list of records (default %(default)s)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown here")
    ap.add_argument("--fail-if-default-not-memory-bound", action="store_true",
                    help="exit 1 when the default kernel is predicted issue- or shared-bound at Llama-3-8B, batch 8, "
                         "32K on H200")
    ap.add_argument("--append-out", type=Path, default=APPEND_OUT,
                    help="JSON records of the append (quantize-and-store) kernel for prefill chunks (default %(default)s)")
    ap.add_argument("--fail-if-append-below-copy-bw", action="store_true",
                    help=f"exit 1 when the append kernel is predicted below {APPEND_MIN_FRACTION:.0%} of copy bandwidth "
                         "for a prefill chunk of >= 4K tokens on H200")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kernel-root", type=Path, default=None,
                    help="compile the kernels whose headers this tree lacks (e.g. kiviDecodeMma.cuh) from this other "
                         "checkout (read-only), to preview a kernel before it is merged")
    args = ap.parse_args(argv)
    specs = [s if present(s) or args.kernel_root is None else from_root(s, args.kernel_root.resolve())
             for s in KERNELS]
    for s in specs:
        if not present(s):
            print(f"kernel_model: kernel {s.name!r} not in this tree ({', '.join(s.headers)} absent): skipped")
    try:
        results, versions = analyze(list(specs) + list(APPEND_KERNELS), jobs=args.jobs)
    except ToolMissing as exc:
        print(f"kernel_model: {exc}", file=sys.stderr)
        return 2
    records = build_records({k: v for k, v in results.items() if k[0] != "append"}, versions)
    app = append_records(results, versions)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.append_out.write_text(json.dumps(app, indent=1, sort_keys=True) + "\n")
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    tmp.replace(args.out)
    if args.markdown:
        args.markdown.write_text(markdown_table(records))
    for cal in calibration(records):
        for row in cal["rows"]:
            print(f"calibration {cal['kernel']:5s} {row['quantity']:28s} issue {row['issue_12']:>8g}  model "
                  f"{row['model']:>8g}  ratio {row['ratio']:.3f}{'' if row['within_tolerance'] else '  OUT OF TOLERANCE'}")
    for (name, arch), r in sorted(results.items()):
        print(f"resources {name:5s} {arch}: {r.resources.registers} regs, {r.resources.smem_bytes} B smem, spills "
              f"{r.resources.spill_stores}/{r.resources.spill_loads} B")
    print(f"kernel_model: wrote {len(records)} records to {args.out}")
    for rec in app:
        if rec["gpu"] == "H200":
            print(f"append {rec['model']:10s} batch {rec['batch']} chunk {rec['chunk']:>5d}: {rec['predicted_us']:g} us, "
                  f"{rec['fraction_of_copy_bw']:.0%} of copy bandwidth ({rec['bound']}-bound; model)")
    if args.fail_if_append_below_copy_bw:
        why = gate_append(app)
        if why:
            print(f"kernel_model: FAIL: {why}", file=sys.stderr)
            return 1
    if args.fail_if_default_not_memory_bound:
        why = gate_default_memory_bound(records)
        if why:
            print(f"kernel_model: FAIL: {why}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
