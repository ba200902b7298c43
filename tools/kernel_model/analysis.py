"""The executed path of one kernel on one arch: its SASS walked with the declared table (loop trips, path and copy
weights) into warp-instructions by class and shared-memory wavefronts per key tile and per CTA; the driver that
compiles, disassembles and analyzes every (kernel, arch)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import toolchain
from .banks import smem_width, wavefronts
from .kernels import KERNELS
from .plan import Resources, ceil_div
from .sass import Block, Instr, basic_blocks, disassemble, find_loops, find_tags, op_class, reachable, source_lines
from .shapes import ARCHS, WARP
from .spec import Ctx, KernelSpec, PathRule, weight_of

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
        self._executed: dict[Ctx, list[tuple[Block, float, bool]]] = {}

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
                        x *= weight_of(r.weight, ctx)
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

    def executed(self, ctx: Ctx) -> list[tuple[Block, float, bool]]:
        """The blocks on the executed path: (block, executions per warp -- per key tile inside the tile loop, per
        CTA outside it --, inside the tile loop). Block weight x trips of the enclosing loops other than the tile's."""
        if ctx in self._executed:
            return self._executed[ctx]
        weights = self._weights(ctx)
        trips, scale = self._trips(ctx, weights)
        tl = self.tile_loop(weights)
        out = []
        for b in self.blocks:
            n = weights[b.index] * scale.get(b.index, 1.0)
            if n == 0.0:
                continue
            for li, lp in enumerate(self.loops):
                if lp.contains(b.index) and li != tl:
                    n *= trips[li]
            out.append((b, n, self.loops[tl].contains(b.index)))
        self._executed[ctx] = out
        return out

    def _count(self, ctx: Ctx) -> tuple[Count, Count]:
        tile, rest = Count(), Count()
        smem = self._smem_patterns(ctx)
        warps = ceil_div(self.spec.threads, WARP)
        tile_warps = self.spec.tile_warps or warps
        for b, per_warp, in_tile in self.executed(ctx):
            n = per_warp * (tile_warps if in_tile else warps)
            target = tile if in_tile else rest
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
    nvcc = toolchain.find_nvcc()  # looked up on the module, so that a test can stand in for a missing tool
    nvdisasm = toolchain.find_wheel_tool("nvdisasm")
    cuobjdump = toolchain.find_wheel_tool("cuobjdump")
    tmp = tempfile.TemporaryDirectory(prefix="kernel_model_") if work is None else None
    wdir = Path(tmp.name) if tmp else Path(work or ".")
    jobs_list = [(s, a) for s in specs for a in archs if int(a.split("_")[1]) >= s.min_arch and present(s)]

    def one(sa: tuple[KernelSpec, str]) -> KernelResult:
        spec, arch = sa
        cubin, res = toolchain.compile_kernel(spec, arch, wdir, nvcc)
        funcs = disassemble(cubin, nvdisasm)
        names = [f for f in funcs if spec.symbol in f]
        if len(names) != 1:
            raise RuntimeError(f"{spec.name} ({arch}): {len(names)} SASS functions match {spec.symbol!r}")
        usage = toolchain.cuobjdump_resources(cubin, cuobjdump, spec.symbol)
        if usage.get("REG") != res.registers:
            raise RuntimeError(f"{spec.name} ({arch}): ptxas says {res}, cuobjdump says {usage}")
        return KernelResult(spec, arch, res, KernelAnalysis(spec, funcs[names[0]], res, arch), usage)

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            results = list(ex.map(one, jobs_list))
    finally:
        if tmp:
            tmp.cleanup()
    return {(r.spec.name, r.arch): r for r in results}, toolchain.tool_versions(nvcc, nvdisasm, cuobjdump)
