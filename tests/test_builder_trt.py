"""`trtllm-kivi build --tensorrt on` of the built-in model (SmolLM2-135M-Instruct, 30 layers) into a TensorRT engine
with a real builder (NVIDIA's TensorRT or TensorRT-RTX, whichever trtllm_kivi.trt finds): KIVI-2 for the default
targets, and a recipe with sinks and Hadamard rotation (k4v2+sink4+had) for one named compute capability. The
engine file lies next to the ONNX and build_config.json records what was built (flavour, version, targets, bytes,
seconds, the plugin library's hash and compiled architectures). A plugin library without GPU code for a target is
refused before TensorRT, naming both.

Skips, naming the missing piece, only without a TensorRT Python package or without the built plugin library.
Slow (~40 s per engine on two cores: export, weights written, engine built); the onnxruntime check is
tests/test_builder_cli.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import onnx
import pytest

from trtllm_kivi import cli
from trtllm_kivi import trt as trt_mod
from trtllm_kivi.builder.trt_build import DEFAULT_RTX_TARGETS, EngineUnavailable, engine_plan, file_sha256
from trtllm_kivi.trt import (RTX_TARGETS, TensorRTUnavailable, compiled_archs, find_plugin, find_tensorrt,
                             uncovered_targets)

pytestmark = [pytest.mark.trt, pytest.mark.slow]


@pytest.fixture(scope="module")
def trt_and_plugin():
    try:
        t = find_tensorrt()
    except TensorRTUnavailable as e:
        pytest.skip(f"no TensorRT: {e}")
    try:
        return t, find_plugin()
    except FileNotFoundError as e:
        pytest.skip(f"no plugin library: {e}")


def _build(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    out = tmp_path / "engine-build"
    assert cli.main(["build", "-o", str(out), "--tensorrt", "on", "--check-steps", "0", "--quiet", *args]) == 0
    text = capsys.readouterr().out
    conf = json.loads((out / "build_config.json").read_text())
    assert (out / "model.engine").stat().st_size == conf["engine"]["bytes"]
    assert conf["files"]["engine"] == "model.engine" and (out / conf["files"]["onnx"]).is_file()
    return conf, text


def _check_facts(conf: dict, t, lib, targets: list[str], record, out) -> None:
    eng = conf["engine"]
    assert eng["built"] and eng["flavour"] == t.flavour and eng["tensorrt"] == t.version
    assert eng["targets"] == targets and eng["version_compatible"] and eng["plugins_serialized"] == [lib.name]
    archs = compiled_archs(lib)
    assert eng["plugin_library"] == {"file": lib.name, "bytes": lib.stat().st_size, "sha256": file_sha256(lib),
                                     "sass": [f"sm_{a}" for a in archs.sass],
                                     "ptx": [f"compute_{a}" for a in archs.ptx]}
    assert not uncovered_targets(archs, targets)
    layers = conf["geometry"]["num_layers"]
    assert eng["kivi_nodes"] == layers and eng["network_layers"] > 50 * layers
    # the weights (fp16, as in the ONNX's external data) and the plugin library are inside the engine
    assert eng["bytes"] > lib.stat().st_size + 0.9 * (out / conf["files"]["onnx_data"]).stat().st_size
    assert 0 < eng["seconds"] < 600
    for key in ("bytes", "seconds", "targets", "network_layers"):
        record(f"engine_{key}", eng[key])
    print(f"\n[engine] {conf['kivi_config']} -> {eng['bytes']:,d} bytes in {eng['seconds']} s for "
          f"{', '.join(eng['targets'])} ({eng['network_layers']} network layers)")


def test_builtin_model_kivi2_engine(trt_and_plugin, tmp_path, capsys, record_property):
    t, lib = trt_and_plugin
    gpu = engine_plan(lib)  # the targets a plain build picks here (the GPU's, else the stated list)
    conf, text = _build(tmp_path, capsys)
    _check_facts(conf, t, lib, gpu.targets, record_property, tmp_path / "engine-build")
    if t.is_rtx and gpu.targets_chosen.startswith("no GPU"):
        assert gpu.targets == list(DEFAULT_RTX_TARGETS)
    assert f"[engine] {tmp_path / 'engine-build' / 'model.engine'} ({conf['engine']['bytes']:,d} bytes" in text
    shutil.rmtree(tmp_path / "engine-build")


def test_builtin_model_recipe_with_sinks_and_rotation_engine(trt_and_plugin, tmp_path, capsys, record_property):
    t, lib = trt_and_plugin
    if not t.is_rtx:
        pytest.skip("naming a compute capability is a TensorRT-RTX option (NVIDIA's TensorRT builds for its GPU)")
    conf, _ = _build(tmp_path, capsys, "--kv", "k4v2+sink4+had", "--compute-capability", "8.6")
    _check_facts(conf, t, lib, ["8.6"], record_property, tmp_path / "engine-build")
    assert conf["kivi_config"]["sink_tokens"] == 4 and conf["kivi_config"]["k_bits"] == 4
    graph = onnx.load(str(tmp_path / "engine-build" / "model.onnx"), load_external_data=False).graph
    fields = [{a.name: a.i for a in n.attribute if a.name != "plugin_version" and a.name != "plugin_namespace"}
              for n in graph.node if n.op_type == "KiviAttention"]
    assert {(f["sink_tokens"], f["k_rotation"], f["v_rotation"]) for f in fields} == {(4, 1, 1)}
    shutil.rmtree(tmp_path / "engine-build")


def test_rtx_targets_are_the_pinned_wheels(trt_and_plugin):
    t, _ = trt_and_plugin
    if not t.is_rtx:
        pytest.skip("compute-capability targets are TensorRT-RTX's")
    assert t.targets() == RTX_TARGETS  # a new wheel with other targets must update trt.RTX_TARGETS and the docs


def test_a_plugin_without_code_for_a_target_is_refused_naming_both(trt_and_plugin, tmp_path, monkeypatch):
    # The builder never checks the plugin's GPU code (an sm_86-only plugin was accepted into 7.5, 8.0 and 12.x
    # engines), so engine_plan does: a library compiled for sm_86 alone (real nvcc) against 8.0, 8.6 and 12.0.
    t, plugin = trt_and_plugin
    if not t.is_rtx:
        pytest.skip("compute-capability targets are TensorRT-RTX's")
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("no nvcc to compile a library for sm_86 alone")
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(int* p) { p[threadIdx.x] = 1; }\n")
    lib = tmp_path / "libsm86.so"
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_86,code=sm_86", str(src), "-o",
                    str(lib)], check=True, capture_output=True, timeout=300)
    with pytest.raises(EngineUnavailable) as e:
        engine_plan(lib, ["8.0", "8.6", "12.0"])
    msg = str(e.value)
    assert "holds GPU code for sm_86, which does not run on compute capability 8.0, 12.0" in msg
    assert "targets 8.0, 8.6, 12.0" in msg and '--arch "80;86;120"' in msg
    assert engine_plan(lib, ["8.6", "8.9"]).targets == ["8.6", "8.9"]
    # Without --plugin-lib, the first library found with code for every target is used: with the sm_86 one found
    # first (say in build/plugins/) and the built plugin next, the sm_86 one for 8.6, the built plugin for 8.0.
    monkeypatch.setattr(trt_mod, "plugin_candidates", lambda: [lib, plugin])
    assert engine_plan(None, ["8.6"]).plugin_lib == lib
    assert engine_plan(None, ["8.0"]).plugin_lib == plugin
    with pytest.raises(EngineUnavailable, match=r"compute capability 7.5 \(--compute-capability\): the "
                                                r"KiviAttention kernels need SM 8.0 or newer"):
        engine_plan(lib, ["7.5"])
    with pytest.raises(EngineUnavailable, match=r"compute capability 9.0 .* is not a TensorRT-RTX .* target; "
                                                r"allowed: 7.5, 8.0, 8.6, 8.9, 12.0, 12.1 \(SM 9.0 engines need "
                                                r"NVIDIA's TensorRT"):
        engine_plan(lib, ["9.0"])
