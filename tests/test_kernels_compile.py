"""The KIVI kernels compile with nvcc (no GPU needed): the launcher TU and one (head_dim, dtype) instantiation, for
sm_90, with warnings as errors and without --use_fast_math or --expt-relaxed-constexpr (the flags CMake uses).
build_scripts/build_plugin.sh builds the whole library in CI; this catches a broken header early and fast.
Oracle: nvcc's exit status and an empty diagnostics stream; ptxas -v reports 0 spill bytes for every kernel of the
translation unit (the default attention kernel included)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDES = [ROOT / "plugins" / "kernels" / "include", ROOT / "plugins" / "include"]


@pytest.mark.parametrize("source", ["kiviLaunch.cu", "instantiations/kiviKernels_d64_bf16.cu"])
def test_nvcc_compiles_cleanly(tmp_path, source):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc is not on PATH nor in /usr/local/cuda/bin")
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-c", str(ROOT / "plugins/kernels/src" / source),
           *(f"-I{p}" for p in INCLUDES), "--Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror",
           "-Xptxas=-v", "-o", str(tmp_path / "out.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in (res.stdout + res.stderr).lower(), res.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stdout + res.stderr)
    assert spills and all(a == "0" and b == "0" for a, b in spills), [x for x in spills if x != ("0", "0")]
