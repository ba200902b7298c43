"""The TensorRT path end to end on a GPU: `build` of a tiny checkpoint compiles the engine (plugin library embedded)
for the GPU here, and the tensorrt runner (runtime/trt_runner.py) drives it over a ragged prefill and decode steps.

Oracle: the torch runtime on the GPU in the same dtype (TorchRunner over a KiviCache with the same config).
Needs a TensorRT Python package (trtllm_kivi.trt: NVIDIA's TensorRT, or TensorRT-RTX on a GPU it targets), a CUDA
GPU and the built plugin library; skips naming the missing piece. Not run so far: the only GPU this project has run on,
an H200, is SM 9.0, which TensorRT-RTX does not target, and NVIDIA's TensorRT cannot be installed from our registries."""

import json

import pytest
import torch

from trtllm_kivi.builder.build import BuildOptions, build
from trtllm_kivi.builder.trt_build import EngineUnavailable, engine_plan, find_tensorrt_or_unavailable
from trtllm_kivi.cache import KiviCache
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models.tiny import write_tiny_checkpoint
from trtllm_kivi.trt import find_plugin

pytestmark = [
    pytest.mark.trt,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"),
]

CFG = KiviConfig(residual_length=32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    try:
        find_tensorrt_or_unavailable()
    except EngineUnavailable as e:
        pytest.skip(f"no TensorRT: {e}")
    try:
        lib = find_plugin()
    except FileNotFoundError as e:
        pytest.skip(f"no plugin library: {e}")
    try:
        engine_plan(lib)
    except EngineUnavailable as e:  # e.g. TensorRT-RTX on an SM 9.0 GPU: it cannot target it
        pytest.skip(f"no engine for the GPU here: {e}")
    root = tmp_path_factory.mktemp("trt")
    ckpt = write_tiny_checkpoint(root / "ckpt", head_dim=64, hidden_size=128)  # head_dim the kernels instantiate
    out = root / "build"
    build(BuildOptions(output=out, model=str(ckpt), kivi=CFG, max_batch_size=2, max_seq_len=256, check_steps=8,
                       plugin_lib=str(lib), tensorrt="on"), progress=False)
    return ckpt, out


def test_build_embeds_the_engine(built):
    _, out = built
    conf = json.loads((out / "build_config.json").read_text())
    assert conf["engine"]["built"] and (out / "model.engine").stat().st_size == conf["engine"]["bytes"]
    assert conf["files"]["engine"] == "model.engine"
    assert conf["engine"]["targets"] == ["{}.{}".format(*torch.cuda.get_device_capability())]


def test_trt_runner_matches_the_torch_runtime(built):
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.select import load_runner
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    ckpt, out = built
    runner, why = load_runner(out)
    assert runner.name == "tensorrt" and "tensorrt runner" in why
    model, _, mc = load_model(str(ckpt), "float16", "cuda")
    ref = TorchRunner(model, KiviCache(CFG, mc.geometry, 2, 256, dtype=torch.float16, device="cuda",
                                       num_blocks=runner.cache.num_blocks))
    g = torch.Generator().manual_seed(0)
    slots = [runner.add_sequence(), runner.add_sequence()]
    assert slots == [ref.add_sequence(), ref.add_sequence()]
    tokens = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (80, 20)]
    for _ in range(40):
        a, b = runner.step(slots, tokens), ref.step(slots, tokens)
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)
        tokens = [[int(t)] for t in b.argmax(-1)]
    for layer in range(mc.n_layers):
        for s in slots:
            x, y = runner.cache.sequence_state(s, layer), ref.cache.sequence_state(s, layer)
            same = (x["k_codes"] == y["k_codes"]).float().mean()
            assert same > 0.99
