"""Engine-level tests of the KiviAttention plugin through TensorRT's Python API: a one-layer network holding only
the plugin is built, serialized, deserialized and run for two steps (prefill, then mixed decode + chunked prefill)
over a ragged batch; the output and every cache buffer are compared with the reference op
(trtllm_kivi/reference/attention.py, kivi_attention) run on the CPU from the same inputs.

Needs TensorRT (`import tensorrt`), a CUDA GPU with a CUDA build of torch, and the built plugin library
(build_scripts/build_plugin.sh with TensorRT headers); each test skips with the missing piece named otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from trtllm_kivi.format import BUFFER_NAMES, FORMAT_VERSION, KiviConfig
from trtllm_kivi.op import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, STATUS_OUTPUT, plugin_fields
from trtllm_kivi.plugin import PLUGIN_LIBRARY_NAME, find_plugin_library, load_plugin_library
from trtllm_kivi.reference.attention import KiviBuffers, kivi_attention

trt = pytest.importorskip("tensorrt", reason="TensorRT's Python package (import tensorrt) is not installed")

pytestmark = [
    pytest.mark.trt,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"),
]


def _library_or_skip():
    try:
        return find_plugin_library()
    except FileNotFoundError as e:
        pytest.skip(f"{PLUGIN_LIBRARY_NAME} not built: {e}")


H, HKV, D = 8, 2, 64
NUM_BLOCKS, NUM_SLOTS, MAX_BLOCKS = 8, 3, 4
MAX_TOKENS, MAX_BATCH = 256, 4
TRT_DTYPES = {torch.float16: trt.float16, torch.bfloat16: trt.bfloat16, torch.float32: trt.float32,
              torch.int32: trt.int32}


def _creator():
    load_plugin_library()
    creator = trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    assert creator is not None, "KiviAttention creator not registered after load_plugin_library()"
    return creator


def _field_collection(fields: dict[str, int]):
    return trt.PluginFieldCollection([trt.PluginField(name, np.array([value], dtype=np.int32),
                                                      trt.PluginFieldType.INT32) for name, value in fields.items()])


def _build_engine(cfg: KiviConfig, act: torch.dtype):
    logger = trt.Logger(trt.Logger.WARNING)
    plugin = _creator().create_plugin("kivi_attention", _field_collection(plugin_fields(cfg, H, HKV, D)),
                                      trt.TensorRTPhase.BUILD)
    assert plugin is not None
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    bufs = KiviBuffers.allocate(cfg, HKV, D, NUM_BLOCKS, NUM_SLOTS, dtype=act)
    specs = [("q", act, (-1, H, D)), ("k", act, (-1, HKV, D)), ("v", act, (-1, HKV, D)),
             ("slot_ids", torch.int32, (-1,)), ("past_len", torch.int32, (-1,)), ("chunk_len", torch.int32, (-1,)),
             ("block_table", torch.int32, (-1, MAX_BLOCKS))]
    specs += [(name, t.dtype, tuple(t.shape)) for name, t in zip(BUFFER_NAMES, bufs, strict=True)]
    inputs = [network.add_input(name, TRT_DTYPES[dt], shape) for name, dt, shape in specs]
    layer = network.add_plugin_v3(inputs, [], plugin)
    for i, name in enumerate(["out"] + [f"{n}_out" for n in BUFFER_NAMES] + [STATUS_OUTPUT]):
        layer.get_output(i).name = name
        network.mark_output(layer.get_output(i))
    profile = builder.create_optimization_profile()
    for name, heads in (("q", H), ("k", HKV), ("v", HKV)):
        profile.set_shape(name, (1, heads, D), (MAX_TOKENS // 2, heads, D), (MAX_TOKENS, heads, D))
    for name in ("slot_ids", "past_len", "chunk_len"):
        profile.set_shape(name, (1,), (2,), (MAX_BATCH,))
    profile.set_shape("block_table", (1, MAX_BLOCKS), (2, MAX_BLOCKS), (MAX_BATCH, MAX_BLOCKS))
    config = builder.create_builder_config()
    config.add_optimization_profile(profile)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # cache buffers in place
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "engine build failed (see the TensorRT log above)"
    # Deserialize in a fresh runtime: the plugin comes back through createPlugin(kRUNTIME, getFieldsToSerialize()).
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan))
    assert engine is not None
    return engine


def _run(engine, context, q, k, v, slot_ids, past_len, chunk_len, block_table, bufs: KiviBuffers, status=None):
    """One step on the GPU; bufs (CUDA tensors) are updated in place through the aliased outputs. The status output
    (the kernels' error bits) is written to `status` when given, else checked to be 0."""
    named = dict(q=q, k=k, v=v, slot_ids=slot_ids, past_len=past_len, chunk_len=chunk_len, block_table=block_table)
    named.update(zip(BUFFER_NAMES, bufs, strict=True))
    for name, t in named.items():
        if name in ("q", "k", "v", "slot_ids", "past_len", "chunk_len", "block_table"):
            context.set_input_shape(name, tuple(t.shape))
        context.set_tensor_address(name, t.data_ptr())
    out = torch.empty_like(q)
    context.set_tensor_address("out", out.data_ptr())
    for name, t in zip(BUFFER_NAMES, bufs, strict=True):
        assert engine.get_aliased_input_tensor(f"{name}_out") == name
        context.set_tensor_address(f"{name}_out", t.data_ptr())
    st = torch.full((1,), -1, dtype=torch.int32, device="cuda") if status is None else status
    context.set_tensor_address(STATUS_OUTPUT, st.data_ptr())
    assert context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    if status is None:
        assert st.item() == 0, f"status {st.item()}"
    return out


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_engine_matches_reference_over_two_steps(act):
    _library_or_skip()
    cfg = KiviConfig()  # KIVI-2: k_bits = v_bits = 2, G = 32, R = 128, block 128
    engine = _build_engine(cfg, act)
    context = engine.create_execution_context()
    gen = torch.Generator().manual_seed(0)
    ref_bufs = KiviBuffers.allocate(cfg, HKV, D, NUM_BLOCKS, NUM_SLOTS, dtype=act)
    gpu_bufs = KiviBuffers(*(t.cuda() for t in ref_bufs))
    block_table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32)
    # step 1: prefill 200 and 37 tokens (the first crosses flush points); step 2: one decode token + a 100-token
    # chunk (prefill and decode share the step).
    for past, chunk in (([0, 0], [200, 37]), ([200, 37], [1, 100])):
        past_len = torch.tensor(past, dtype=torch.int32)
        chunk_len = torch.tensor(chunk, dtype=torch.int32)
        t = int(chunk_len.sum())
        q = torch.randn(t, H, D, generator=gen).to(act)
        k = torch.randn(t, HKV, D, generator=gen).to(act)
        v = torch.randn(t, HKV, D, generator=gen).to(act)
        ref_out, ref_bufs = kivi_attention(q, k, v, slot_ids, past_len, chunk_len, block_table, ref_bufs, cfg)
        out = _run(engine, context, q.cuda(), k.cuda(), v.cuda(), slot_ids.cuda(), past_len.cuda(),
                   chunk_len.cuda(), block_table.cuda(), gpu_bufs)
        tol = 2e-2 if act == torch.float16 else 6e-2  # fp32 softmax, different summation order
        torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=tol, rtol=tol)
        for name, got, want in zip(BUFFER_NAMES, gpu_bufs, ref_bufs, strict=True):
            assert torch.equal(got.cpu(), want), f"{name} differs from the reference after step {past}->{chunk}"


def test_status_output_reports_a_skipped_sequence():
    # Device lengths past the block table (no host check can see them): the sequence is skipped and the status
    # output carries kKIVI_ERR_CAPACITY (2) instead of a silent zero row.
    _library_or_skip()
    cfg = KiviConfig()
    engine = _build_engine(cfg, torch.float16)
    context = engine.create_execution_context()
    bufs = KiviBuffers(*(t.cuda() for t in KiviBuffers.allocate(cfg, HKV, D, NUM_BLOCKS, NUM_SLOTS,
                                                                 dtype=torch.float16)))
    i32 = dict(dtype=torch.int32, device="cuda")
    q, kv = torch.randn(2, H, D, device="cuda").half(), torch.randn(2, HKV, D, device="cuda").half()
    status = torch.full((1,), -1, **i32)
    out = _run(engine, context, q, kv, kv, torch.tensor([0, 1], **i32), torch.tensor([0, 5000], **i32),
               torch.tensor([1, 1], **i32), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], **i32), bufs, status)
    assert status.item() == 2
    assert torch.all(out[1] == 0)


def test_creator_refuses_bad_fields():
    _library_or_skip()
    creator = _creator()
    fields = plugin_fields(KiviConfig(), H, HKV, D)
    for bad in (dict(fields, format_version=FORMAT_VERSION + 1), dict(fields, k_bits=3), dict(fields, head_dim=96),
                dict(fields, sink_tokens=4), dict(fields, k_rotation=2)):
        assert creator.create_plugin("bad", _field_collection(bad), trt.TensorRTPhase.BUILD) is None


def test_load_library_registers_once():
    # trtexec --dynamicPlugins path: IPluginRegistry::loadLibrary in a fresh process (no ctypes load before).
    lib = _library_or_skip()
    code = (
        "import tensorrt as trt, sys\n"
        "reg = trt.get_plugin_registry()\n"
        f"h = reg.load_library({str(lib)!r})\n"
        "assert h is not None, 'loadLibrary failed'\n"
        f"assert reg.get_creator({PLUGIN_NAME!r}, {PLUGIN_VERSION!r}, {PLUGIN_NAMESPACE!r}) is not None\n"
        "n = sum(1 for c in reg.all_creators if c.name == 'KiviAttention')\n"
        "assert n == 1, n\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
