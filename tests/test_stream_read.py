"""The read-only streaming kernel (plugins/kernels/src/kiviStreamRead.cu), the benchmarks' measured roofline.

Without a GPU: it compiles for sm_90 with the library's flags, uses no local memory, and its SASS reads memory with
16-byte loads only (LDG.E.128; the < 16-byte tail bytewise) and stores once per CTA: the roofline is a read-only,
vectorized stream (oracle: nvcc's status and the SASS text, cuobjdump from the pinned wheels).
On a GPU (marked gpu): the XOR of the per-CTA partials equals the XOR of the buffer's 32-bit words computed on the
host, for odd sizes and CTA counts, and bad arguments are refused by name.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "plugins" / "kernels" / "src" / "kiviStreamRead.cu"
INCLUDES = [ROOT / "plugins" / "kernels" / "include", ROOT / "plugins" / "include"]


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc is not on PATH nor in /usr/local/cuda/bin")
    return nvcc


def _cuobjdump() -> str:
    """cuobjdump from the PyPI wheel nvidia-cuda-cuobjdump (pinned in pyproject.toml's test extra), else PATH."""
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_cuobjdump"):
            if (p := Path(loc) / sub / "bin" / "cuobjdump").exists():
                return str(p)
    found = shutil.which("cuobjdump")
    if found is None:
        pytest.skip("cuobjdump not found: pip install the test extra (nvidia-cuda-cuobjdump)")
    return found


def test_compiles_without_spills_and_reads_with_16_byte_loads(tmp_path):
    cubin = tmp_path / "sr.cubin"
    res = subprocess.run([_nvcc(), "-std=c++17", "-O3", "-arch=sm_90", "-cubin", str(SRC),
                          *(f"-I{p}" for p in INCLUDES), "--Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror",
                          "-Xptxas=-v", "-o", str(cubin)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in res.stdout + res.stderr
    cuobjdump = _cuobjdump()
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    loads = re.findall(r"\bLDG\.E(\.[\w.]+)?", sass)
    wide = [x for x in loads if x.startswith(".128")]
    narrow = [x for x in loads if not x.startswith(".128")]
    assert len(wide) >= 8, sass  # the unrolled block's 8 loads and the remainder loop's one
    assert narrow == [".U8"], f"loads other than 16-byte vectors and the tail byte: {narrow}"
    assert len(re.findall(r"\bSTG\.E\b", sass)) == 1, "one store per CTA"


def _xor_words(data: bytes) -> int:
    import numpy as np

    padded = data + b"\0" * (-len(data) % 4)
    return int(np.bitwise_xor.reduce(np.frombuffer(padded, dtype="<u4"), initial=0))


@pytest.mark.gpu
def test_partials_xor_to_the_buffer_and_bad_arguments_are_named():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: no CUDA device")
    from trtllm_kivi.cuda import _abi

    path = _abi.find_library()
    if path is None:
        pytest.skip("KIVI kernel library not built (build_scripts/build_plugin.sh)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_common

    lib = _abi.load_library(path)
    reader = gpu_common.StreamReader(lib)
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, ctas in ((1, 1), (13, 3), (4096 + 7, 5), ((1 << 20) + 13, 7), ((3 << 20) + 5, reader.sms * 8)):
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        assert reader.xor(buf, ctas) == _xor_words(bytes(buf.cpu().numpy())), (n, ctas)
    buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    part = reader.partial.data_ptr()
    assert reader.fn(buf.data_ptr() + 4, 32, part, 1, stream) == _abi.CUDA_ERROR_INVALID_VALUE
    assert "is not 16-byte aligned" in lib.last_error()
    assert reader.fn(buf.data_ptr(), 32, part, 0, stream) == _abi.CUDA_ERROR_INVALID_VALUE
    assert "numCtas=0 is out of range" in lib.last_error()
    assert reader.fn(buf.data_ptr(), 32, None, 4, stream) == _abi.CUDA_ERROR_INVALID_VALUE
    assert "partial is null" in lib.last_error()
