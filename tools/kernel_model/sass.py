"""Reading SASS: nvdisasm -gi output into instructions with their inline stacks, opcode classes, basic blocks, the
reachable ones and the loops (back edges), and the KIVI_MODEL_* source tags that name loops."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
