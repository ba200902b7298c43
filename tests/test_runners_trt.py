"""The TensorRT path end to end: `build` of a tiny checkpoint compiles the engine (plugin library embedded), and the
tensorrt runner (runtime/trt_runner.py) drives it over a ragged prefill and decode steps.

Oracle: the torch runtime on the GPU in the same dtype (TorchRunner over a KiviCache with the same config).
Needs TensorRT (`import tensorrt`), a CUDA GPU and the built plugin library; skips naming the missing piece.
Not run on any machine of this project so far (none has TensorRT)."""

import json

import pytest
import torch

from trtllm_kivi.builder.build import BuildOptions, build
from trtllm_kivi.models.tiny import write_tiny_checkpoint
from trtllm_kivi.cache import KiviCache
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.plugin import PLUGIN_LIBRARY_NAME, find_plugin_library

trt = pytest.importorskip("tensorrt", reason="TensorRT's Python package (import tensorrt) is not installed")

pytestmark = [
    pytest.mark.trt,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"),
]

CFG = KiviConfig(residual_length=32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    try:
        lib = find_plugin_library()
    except FileNotFoundError as e:
        pytest.skip(f"{PLUGIN_LIBRARY_NAME} not built: {e}")
    root = tmp_path_factory.mktemp("trt")
    ckpt = write_tiny_checkpoint(root / "ckpt", head_dim=64, hidden_size=128)  # head_dim the kernels instantiate
    out = root / "build"
    build(BuildOptions(output=out, model=str(ckpt), kivi=CFG, max_batch_size=2, max_seq_len=256, check_steps=8,
                       plugin_lib=str(lib)), progress=False)
    return ckpt, out


def test_build_embeds_the_engine(built):
    _, out = built
    conf = json.loads((out / "build_config.json").read_text())
    assert conf["engine"]["built"] and (out / "model.engine").stat().st_size == conf["engine"]["bytes"]
    assert conf["files"]["engine"] == "model.engine"


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
