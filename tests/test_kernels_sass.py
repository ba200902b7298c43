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
