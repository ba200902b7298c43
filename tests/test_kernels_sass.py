"""The built CUDA kernel library's SASS has no tensor-core instruction with a negated (or absolute-value) operand.

Why: for `mma.sync.m16n8k8` with the constant B operand (-2^b, -2^b) ptxas (CUDA 13.0) emitted
`HMMA.1688.F32 R16, R20, -R44, R16` with R44 = 0x5C00DC00, which is (-2^b, -2^b) only if the negation flips bit 31
alone; an H200 negated both f16 halves, and every even channel's term of the key-group score bias came out with the
wrong sign (the GPU tests failed 25 of 41; build_scripts/gpu_diagnose.py located it). The kernels now pass only
non-negated operands (kiviDecodeMma.cuh, foldKeyGroup); this test keeps it so without a GPU.
Oracle: the SASS text of every kernel (cuobjdump -sass over the library, the PyPI wheels pinned in pyproject.toml),
parsed for HMMA/HGMMA operand modifiers. Skipped with a reason when the library is not built or the tools are absent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_kivi.cuda import find_library

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the static model's tool finder (tools/kernel_model), as test_kernel_model
    sys.path.insert(0, str(ROOT))
from tools.kernel_model import toolchain  # noqa: E402

_MMA = re.compile(r"\b(H|Q|I)?[HG]?MMA\.[\w.]+\s+([^;]*);")


def negated_mma_operands(sass: str) -> list[str]:
    """The tensor-core instructions (HMMA, HGMMA, ...) of `sass` with a '-' or '|' modifier on a register operand."""
    bad = []
    for m in _MMA.finditer(sass):
        operands = [o.strip() for o in m.group(2).split(",")]
        if any(o.startswith(("-", "|")) for o in operands):
            bad.append(m.group(0))
    return bad


def test_the_check_finds_the_instruction_seen_on_the_h200():
    seen = "        /*6c30*/                   HMMA.1688.F32 R16, R20, -R44, R16 ;      /* 0x8000002c1410723c */"
    fine = "        /*6c80*/                   HMMA.1688.F32 R16, R22, R32, R16 ;       /* 0x000000201610723c */"
    assert negated_mma_operands(seen) == ["HMMA.1688.F32 R16, R20, -R44, R16 ;"]
    assert negated_mma_operands(fine) == []
    assert negated_mma_operands("HMMA.16816.F32.BF16 R4, |R8|, R12, R4 ;") != []
    assert negated_mma_operands("FADD R1, -R2, R3 ;") == []  # not a tensor-core instruction


def test_library_mma_operands_are_not_negated():
    lib = find_library()
    if lib is None:
        pytest.skip("KIVI kernel library not built (build_scripts/build_plugin.sh)")
    try:
        cuobjdump, nvdisasm = toolchain.find_wheel_tool("cuobjdump"), toolchain.find_wheel_tool("nvdisasm")
    except toolchain.ToolMissing as e:
        pytest.skip(str(e))
    env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([str(cuobjdump), "-sass", str(lib)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    n_mma = len(_MMA.findall(res.stdout))
    assert n_mma > 1000, f"only {n_mma} tensor-core instructions in {lib}: not the library's SASS?"
    bad = negated_mma_operands(res.stdout)
    assert not bad, f"{len(bad)} tensor-core instructions with a negated operand, e.g. {bad[:3]}"


# ---------------------------------------------------------------------------------------------- the split kernel

_FUNC = re.compile(r"\n\s*Function : (\S+)")
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:[^,;]*,\s*)?0x([0-9a-f]+)")


def sass_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function of a cuobjdump -sass listing as its (address, instruction) list."""
    parts = _FUNC.split(sass)
    return {parts[i]: [(int(m.group(1), 16), m.group(2).strip()) for m in _INS.finditer(parts[i + 1])]
            for i in range(1, len(parts), 2)}


def innermost_loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    """The bodies of the innermost loops: [target, branch] of each backward branch with no other backward branch
    inside (the divergence handlers at a function's end jump back into it too; they enclose real loops)."""
    index = {a: k for k, (a, _) in enumerate(ins)}
    back = []
    for k, (a, op) in enumerate(ins):
        m = _BRA.search(op)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in index:
            back.append((index[int(m.group(1), 16)], k))
    return [[op for _, op in ins[s:e + 1]] for s, e in back if not any(s <= e2 < e for _, e2 in back)]


def global_loads(ops: list[str]) -> list[str]:
    """Per-lane global loads (LDG, not the LDGSTS of cp.async)."""
    return [o for o in ops if re.search(r"\bLDG\.", o)]


def test_the_loop_finder_on_a_listing():
    listing = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0040*/              @P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA.DIV UR4, 0x0 ;
    """
    (name, ins), = sass_functions(listing).items()
    loops = innermost_loops(ins)
    assert name == "k" and len(loops) == 1 and loops[0][0].startswith("LDG.E") and loops[0][-1] == "@P0 BRA 0x10"
    assert global_loads(loops[0]) == ["LDG.E R2, desc[UR4][R4.64]"]


@pytest.fixture(scope="module")
def library_sass() -> str:
    lib = find_library()
    if lib is None:
        pytest.skip("KIVI kernel library not built (build_scripts/build_plugin.sh)")
    try:
        cuobjdump, nvdisasm = toolchain.find_wheel_tool("cuobjdump"), toolchain.find_wheel_tool("nvdisasm")
    except toolchain.ToolMissing as e:
        pytest.skip(str(e))
    env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([str(cuobjdump), "-sass", str(lib)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_split_kernel_streams_full_precision_rows_through_shared_memory(library_sass):
    """kiviDecodeSplitKernel (kiviDecodeSplit.cuh): every innermost loop with tensor-core instructions (the
    quantized chunk loop of each scale path, the full-precision tile loop) holds at most one per-lane global load
    (the block table, 32 entries per load, one batch ahead) -- window, sink and chunk rows arrive by cp.async
    (LDGSTS) only -- and no function uses local memory. Negative control: the baseline kernel (kiviDecodeMmaKernel,
    per-lane loads of full-precision rows between its MMAs) fails the same check in the same listing."""
    funcs = sass_functions(library_sass)
    split = {n: ins for n, ins in funcs.items() if "kiviDecodeSplitKernel" in n}
    assert len(split) >= 36 + 4, f"{len(split)} split kernels: 9 bit pairs x 4 (head_dim, dtype) + 4 tuning copies"
    for name, ins in split.items():
        ops = [op for _, op in ins]
        assert not [o for o in ops if re.search(r"\b(LDL|STL)\b", o)], f"{name} uses local memory"
        loops = [body for body in innermost_loops(ins) if any("HMMA" in o for o in body)]
        assert len(loops) >= 2, f"{name}: {len(loops)} tensor-core loops (chunk loop and full-precision tile loop)"
        for body in loops:
            loads = global_loads(body)
            assert len(loads) <= 1, f"{name}: per-lane global loads in a key loop: {loads[:4]}"
        assert any(any("LDGSTS" in o for o in body) for body in loops), f"{name}: no cp.async in its key loops"
    baseline = [ins for n, ins in funcs.items() if "kiviDecodeMmaKernel" in n]
    assert baseline, "the baseline kernel (decode variant 1) is missing from the library"
    for ins in baseline:
        worst = max(len(global_loads(body)) for body in innermost_loops(ins) if any("HMMA" in o for o in body))
        assert worst > 100, f"the check would not catch the baseline's per-lane loads ({worst})"
