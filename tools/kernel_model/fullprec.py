"""The measured kernel's full-precision chunk: 32 window keys whose K and V rows each lane loads from global memory
(kiviDecodeMma.cuh loadFullPrecisionScores / accumulateFullPrecisionValues), the other class of work its warps do.
From the same SASS as the quantized chunk, walked with the path rules of a full-precision chunk: its executed
warp-instructions, the L1 lines its per-lane loads touch (a lane -> address mapping per load, as the bank model's) and
the global-load round trips it waits for in series (a use of an outstanding load's register)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .analysis import KernelAnalysis, KernelResult
from .kernels import MMA
from .sass import Instr, op_class
from .spec import Ctx, KernelSpec, PathRule

LINE_BYTES = 128


@dataclass(frozen=True)
class GlobalAccess:
    """Lane -> byte offset of the global loads from the line holding `text` (None = inactive lane)."""
    file: str
    text: str
    lanes: Callable[[Ctx], list[int | None]]
    note: str


def lines_touched(addresses: Sequence[int | None], width: int) -> int:
    """Distinct 128-byte lines a warp-wide load touches: the L1 tag work of one request."""
    return len({x // LINE_BYTES for a in addresses if a is not None for x in (a, a + width - 1)})


def _row(ctx: Ctx) -> int:
    return ctx.shape.head_dim * 2  # a window row: head_dim fp16 values


def _score_lanes(high: bool, second: bool) -> Callable[[Ctx], list[int | None]]:
    """a[0..3] of a score MMA: lane (g, t) reads key g (+8) at channel 2t (+8): 4 lanes x 4 B of 8 rows."""
    return lambda c: [((lane // 4) + 8 * high) * _row(c) + 4 * (lane % 4) + 16 * second for lane in range(32)]


def _value_lanes(odd: bool) -> Callable[[Ctx], list[int | None]]:
    """A V element of an A register: lane (g, t) reads key 2t (+1) at channel g: 8 lanes x 2 B of 4 rows."""
    return lambda c: [(2 * (lane % 4) + odd) * _row(c) + 2 * (lane // 4) for lane in range(32)]


MMA_GLOBAL = (
    GlobalAccess(MMA, "a[0] = row0 ? *reinterpret_cast<uint32_t const*>(row0 + ch) : 0U;", _score_lanes(False, False),
                 "K row g, channels 2t, 2t + 1: 8 rows x 16 B"),
    GlobalAccess(MMA, "a[1] = row1 ? *reinterpret_cast<uint32_t const*>(row1 + ch) : 0U;", _score_lanes(True, False),
                 "K row g + 8"),
    GlobalAccess(MMA, "a[2] = row0 ? *reinterpret_cast<uint32_t const*>(row0 + ch + 8) : 0U;",
                 _score_lanes(False, True), "K row g, channels + 8"),
    GlobalAccess(MMA, "a[3] = row1 ? *reinterpret_cast<uint32_t const*>(row1 + ch + 8) : 0U;",
                 _score_lanes(True, True), "K row g + 8, channels + 8"),
    GlobalAccess(MMA, "uint16_t const xl = lo ? *reinterpret_cast<uint16_t const*>(lo + ch) : uint16_t(0);",
                 _value_lanes(False), "V key 2t, channel g: 4 rows x 16 B"),
    GlobalAccess(MMA, "uint16_t const xh = hi ? *reinterpret_cast<uint16_t const*>(hi + ch) : uint16_t(0);",
                 _value_lanes(True), "V key 2t + 1"),
)

# A full-precision chunk's path: the window's rows (key < s) from the full-precision branches of the key loop; the
# quantized chunk's work (stage wait, fold, conversions, its MMAs, the refill) is off it.
FULL_ON = ("loadFullPrecisionScores<T, kD, kKB>(p, wk, qaS, ci, g, t, sc);",
           "accumulateFullPrecisionValues<T, kD>(p, wk, ci, tau, g, t, b0, b1, st.o);",
           "av[0] = g == vGroups ? kONE2 : 0U; // l only: full-precision keys have no V bias")
QUANT_ONLY = (
    "cpAsyncWait<kMMA_STAGES - 2>();",
    "foldKeyGroup<T, kD, kKB, S>(qaS, kScale, kZero, g, t, qK, biasS);",
    "uint32_t const* src = reinterpret_cast<uint32_t const*>(kWords) + (tau * 32 + lane) * Geo::kNWK;",
    "w[tau][j] = src[j];",
    "sc[tau][r] = biasS[r & 1];",
    "convertBlock<T, kKB, Geo::kNWK>(w[tau], kb, one2, a);",
    "mma16816<T>(sc[tau], a, qK[kb][0], qK[kb][1]);",
    "vt.load(vScale, vZero, key0, vGroups, vSliceShift, t);",
    "vt.biasOperand(g, av);",
    "uint32_t const* src = reinterpret_cast<uint32_t const*>(vWords) + (tau * 32 + lane) * Geo::kNWV;",
    "w[j] = src[j];\n                }\n                uint32_t const wb0",
    "uint32_t const wb0 = MmaTraits<T>::mul2(b0, AffV::kINV_BETA2);",
    "uint32_t const wb1 = MmaTraits<T>::mul2(b1, AffV::kINV_BETA2);",
    "pb0 = MmaTraits<T>::mul2(wb0, vt.scalePair(mt / 2, false));",
    "pb1 = MmaTraits<T>::mul2(wb1, vt.scalePair(mt / 2, true));",
    "convertBlock<T, kVB, Geo::kNWV>(w, mt, one2, a);",
    "mma16816<T>(st.o[mt], a, pb0, pb1);",
    "__syncwarp(); // every lane has read this stage before it is refilled",
    "rowC += kMMA_CHUNK;",
    "issueChunk<kD, kKB, kVB, S>(p, stages + issueStage * stageBytes, table[issueAt.entry], wk.h,",
    "issueAt.advance(p.blockSize);",
    # the chunk's own row (key == s, one key in the window's 160) and keys past k1 (the split's end)
    "return chunk + ((wk.info.tokenOffset + (key - wk.s)) * int64_t(p.numKvHeads) + wk.h) * kD;",
)


def full_chunk_spec(spec: KernelSpec) -> KernelSpec:
    """The measured kernel's table with the path of a full-precision chunk instead of a quantized one."""
    drop = set(FULL_ON) | set(QUANT_ONLY)
    rules = tuple(r for r in spec.rules if r.text not in drop)
    rules += tuple(PathRule(MMA, t, 1.0, "a full-precision chunk") for t in FULL_ON)
    rules += tuple(PathRule(MMA, t, 0.0, "quantized chunks only") for t in QUANT_ONLY)
    return dataclasses.replace(spec, name=spec.name + "_full", rules=rules)


_REG = re.compile(r"\bR(\d+)\b")


def _regs(text: str, width: int = 1) -> set[int]:
    return {int(r) + k for r in _REG.findall(text) for k in range(width)}


def _width(opcode: str) -> int:
    return 4 if ".128" in opcode else 2 if ".64" in opcode else 1


def round_trips(path: Sequence[tuple[Instr, float]]) -> float:
    """Global-load round trips a warp waits for in series along `path`: an instruction that reads the register of an
    outstanding load waits for it, and the loads issued before it are taken to have arrived with it (they were in
    flight together). Weighted by the path's executions (a fractional block counts fractionally)."""
    pending: set[int] = set()
    trips = 0.0
    for ins, n in path:
        ops = [o.strip() for o in ins.operands.split(",")]
        store = op_class(ins.opcode) in ("STG", "STS", "ST", "STL", "RED", "ATOM", "ATOMG")
        dst = set() if store or not ops else _regs(ops[0], _width(ins.opcode))
        srcs = _regs(",".join(ops if store else ops[1:]))
        if ins.base == "HMMA":  # d, a, b, c: the accumulator c is read too
            srcs |= _regs(ops[-1], 4)
        if srcs & pending:
            trips += n
            pending.clear()
        pending -= dst
        if op_class(ins.opcode) in ("LDG", "LD") and n > 0:
            pending |= dst
    return trips


def count_under(an: KernelAnalysis, ctx: Ctx, file: str, text: str) -> float:
    """Executed warp-instructions per warp whose inline stack holds the line(s) of `text`: what a call site costs
    per entry of the loops around it."""
    lines = an.lines_of(file, text)
    return sum(n * sum(1 for ins in b.instrs if lines & set(ins.stack)) for b, n, _ in an.executed(ctx))


@dataclass(frozen=True)
class FullChunk:
    instructions: float
    lines: float
    round_trips: float
    loads: float


def full_chunk(result: KernelResult, ctx: Ctx, accesses: Sequence[GlobalAccess] = MMA_GLOBAL) -> FullChunk:
    """The full-precision chunk of the measured kernel from its SASS (the same cubin as its quantized chunk)."""
    an = KernelAnalysis(full_chunk_spec(result.spec), result.analysis.instrs, result.resources, result.arch)
    path = [(ins, n) for b, n, in_tile in an.executed(ctx) if in_tile for ins in b.instrs]
    maps = [(an.lines_of(a.file, a.text), a.lanes(ctx)) for a in accesses]
    lines = loads = 0.0
    for ins, n in path:
        if op_class(ins.opcode) != "LDG":
            continue
        loads += n
        hit = next((lanes for where, lanes in maps if where & set(ins.stack)), None)
        if hit is None:
            raise ValueError(f"{result.spec.name} ({result.arch}): global load {ins.opcode} at "
                             f"{ins.stack[:1]} of the full-precision chunk has no lane mapping")
        width = {"U16": 2, "S16": 2, "64": 8, "128": 16}.get(ins.opcode.split(".")[-1], 4)
        lines += n * lines_touched(hit, width)
    return FullChunk(sum(n for _, n in path), lines, round_trips(path), loads)
