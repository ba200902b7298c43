"""What decides an engine build before TensorRT runs, on any machine (no TensorRT needed): compute-capability
parsing, which targets a library's GPU code runs on, the library's compiled architectures read from its fatbinary
(checked against cuobjdump on a real nvcc build), the configurations the plugin cannot run named by option, and
`trtllm-kivi build --tensorrt auto|on|off` saying why no engine was built (on: failing with that reason, leaving
nothing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi import cli
from trtllm_kivi.builder.trt_build import DEFAULT_RTX_TARGETS, engine_unsupported
from trtllm_kivi.format import Geometry, KiviConfig
from trtllm_kivi.models.tiny import write_tiny_checkpoint
from trtllm_kivi.op import ExportSpec, GraphInfo
from trtllm_kivi.trt import (RTX_TARGETS, CompiledArchs, compiled_archs, parse_compute_capability,
                             tensorrt_unavailable, uncovered_targets)


def test_compute_capability_spellings():
    for text, cc in (("8.6", "8.6"), ("86", "8.6"), ("sm_86", "8.6"), ("SM120", "12.0"), ("12.1", "12.1"),
                     (" 9.0 ", "9.0")):
        assert parse_compute_capability(text) == cc
    for bad in ("", "sm_", "8.10", "x86", "8,6"):
        with pytest.raises(ValueError, match="is not of the form 8.6"):
            parse_compute_capability(bad)


def test_sass_runs_on_the_same_major_from_its_minor_up():
    # The trap: a plugin with sm_86 code alone went into 7.5, 8.0 and 12.x engines.
    assert uncovered_targets(CompiledArchs((86,)), RTX_TARGETS) == ["7.5", "8.0", "12.0", "12.1"]
    # What build_plugin.sh --arch "80;120" gives covers every default TensorRT-RTX target (PTX is not counted).
    assert uncovered_targets(CompiledArchs((80, 120)), DEFAULT_RTX_TARGETS) == []
    assert uncovered_targets(CompiledArchs((80, 120), ptx=(80,)), ["7.5", "9.0"]) == ["7.5", "9.0"]
    assert uncovered_targets(CompiledArchs((90,)), ["9.0"]) == []


def _tool(name: str) -> str | None:
    venv = Path(__file__).resolve().parent.parent / ".venv" / "lib"
    found = sorted(venv.glob(f"python3*/site-packages/nvidia/cu*/bin/{name}")) if venv.is_dir() else []
    return shutil.which(name) or (str(found[0]) if found else None) or next(
        (p for p in (f"/usr/local/cuda/bin/{name}",) if os.path.exists(p)), None)


def test_compiled_archs_are_what_cuobjdump_lists(tmp_path):
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip(f"needs nvcc and cuobjdump (found nvcc={nvcc}, cuobjdump={cuobjdump})")
    lib = tmp_path / "libk.so"
    (tmp_path / "a.cu").write_text("__global__ void a(int* p) { p[threadIdx.x] = 1; }\n")
    (tmp_path / "b.cu").write_text("__global__ void b(float* p) { p[threadIdx.x] *= 2.f; }\n")
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_75,code=sm_75",
                    "-gencode", "arch=compute_86,code=[sm_86,compute_86]", str(tmp_path / "a.cu"),
                    str(tmp_path / "b.cu"), "-o", str(lib)], check=True, capture_output=True, timeout=300)
    listed = {}
    for kind in ("elf", "ptx"):
        out = subprocess.run([cuobjdump, f"--list-{kind}", str(lib)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
        listed[kind] = tuple(sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.", out)}))
    assert compiled_archs(lib) == CompiledArchs(listed["elf"], listed["ptx"]) == CompiledArchs((75, 86), (86,))


def test_a_library_without_gpu_code_has_no_archs():
    import ctypes.util

    libm = ctypes.util.find_library("m")
    path = next((p for p in (f"/lib/x86_64-linux-gnu/{libm}", f"/usr/lib/x86_64-linux-gnu/{libm}") if libm and
                 os.path.exists(p)), None)
    if path is None:
        pytest.skip("no libm file to read")
    assert compiled_archs(path) == CompiledArchs(())


def _info(dtype="float16", heads=(9, 3, 64), kivi=KiviConfig()) -> GraphInfo:
    return GraphInfo(kivi, Geometry(30, *heads), ExportSpec(dtype, 4, 2048, 2048), 49152)


def test_what_the_plugin_cannot_run_is_named_before_tensorrt():
    assert engine_unsupported(_info()) is None  # SmolLM2-135M, KIVI-2
    assert engine_unsupported(_info(kivi=KiviConfig(k_bits=4, sink_tokens=4, k_rotation="hadamard"))) is None
    cases = [(_info(dtype="float32"), "dtype float32: the KiviAttention plugin's activations are float16 or bfloat16"),
             (_info(heads=(4, 2, 32)), "head_dim=32: the KiviAttention plugin's kernels are built for head_dim 64, "
                                       "128"),
             (_info(heads=(32, 1, 64)), "num_heads/num_kv_heads=32: the KiviAttention kernels run 1..16"),
             (_info(kivi=KiviConfig(key_grouping="per_token")), "key_grouping=per_token: the KiviAttention kernels")]
    for info, message in cases:
        assert message in (engine_unsupported(info) or "")


# ---------------------------------------------------------------------------------------------- the CLI

SMALL = ["--residual-length", "32", "--max-batch-size", "2", "--max-seq-len", "256", "--check-steps", "0", "--quiet"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=3)  # head_dim 32


def _why_not(ckpt) -> str:
    """The reason a build of the tiny checkpoint has no engine here: no TensorRT, else its head_dim."""
    return tensorrt_unavailable() or engine_unsupported(_info(heads=(4, 2, 32))) or ""


def test_tensorrt_auto_builds_the_graph_and_says_why_there_is_no_engine(ckpt, tmp_path, capsys):
    out = tmp_path / "auto"
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL]) == 0
    conf = json.loads((out / "build_config.json").read_text())
    assert conf["engine"]["built"] is False and conf["engine"]["reason"] == _why_not(ckpt)
    assert f"[engine] not built: {_why_not(ckpt)}. To build it on a TensorRT machine:" in capsys.readouterr().out


def test_tensorrt_on_fails_with_the_reason_and_leaves_nothing(ckpt, tmp_path, capsys):
    out = tmp_path / "on"
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL, "--tensorrt", "on"]) == 2
    assert f"--tensorrt on: cannot build the engine: {_why_not(ckpt)}" in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".on.")]


def test_tensorrt_off_never_builds_an_engine(ckpt, tmp_path, capsys):
    out = tmp_path / "off"
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL, "--tensorrt", "off"]) == 0
    conf = json.loads((out / "build_config.json").read_text())
    assert conf["engine"] == {"built": False, "reason": "--tensorrt off", "trtexec": conf["engine"]["trtexec"]}
    assert "[engine] not built (--tensorrt off)" in capsys.readouterr().out


def test_bad_compute_capability_is_refused(ckpt, tmp_path, capsys):
    assert cli.main(["build", "--model", str(ckpt), "-o", str(tmp_path / "x"), *SMALL, "--tensorrt", "off",
                     "--compute-capability", "sm_8x"]) == 2
    assert "compute capability 'sm_8x' is not of the form 8.6" in capsys.readouterr().err
