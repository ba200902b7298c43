"""The declared per-kernel table's types: what a kernel's executed path depends on (Ctx), its source loops, path and
copy rules, shared-memory lane mappings, and the KernelSpec that holds them; the KIVI tile's bytes and words."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .plan import Plan
from .shapes import BITS, FORMAT_INCLUDE, GROUP, KERNEL_INCLUDE, KEY_TILE, WARP, ModelShape

# ------------------------------------------------------------------------------------------------ kernel table


@dataclass(frozen=True)
class Ctx:
    """What the executed path depends on: the model's shapes and whether the keys are split."""
    shape: ModelShape
    split: bool


Weight = float | Callable[[Ctx], float]


def weight_of(x: Weight, ctx: Ctx) -> float:
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
    plan: Callable[..., Plan] | None = None  # launch plan (None: today's kiviLaunchPlan, plan.launch_plan)
    default_rank: int | None = None  # the present kernel with the lowest rank is the default (None: never)


def kivi_tile_bytes(shape: ModelShape) -> int:
    d = shape.head_dim
    codes = 2 * KEY_TILE * d * BITS // 8  # K + V codes
    k_sz = 2 * d * 2 * (KEY_TILE // GROUP)  # per-channel scale + zero (fp16) per G-group of tokens
    v_sz = 2 * KEY_TILE * (d // min(GROUP, d)) * 2  # per-token scale + zero per Gv-group of channels
    return codes + k_sz + v_sz


def kivi_code_words(shape: ModelShape) -> int:
    return 2 * KEY_TILE * shape.head_dim * BITS // 32

def lanes(f: Callable[[int], int | None]) -> Callable[[Ctx], list[int | None]]:
    return lambda ctx: [f(lane) for lane in range(WARP)]
