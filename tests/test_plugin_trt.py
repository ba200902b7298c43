"""The KiviAttention plugin inside a real TensorRT builder (NVIDIA's TensorRT or TensorRT-RTX, whichever
trtllm_kivi.trt finds; TensorRT-RTX builds without a GPU): one-node engines through the ONNX parser with a dynamic
profile, over a covering set of the combinations (every pair of values of dtype, K bits, V bits, head_dim, GQA,
group size, scale dtype, sinks and rotation is built at least once), checking what the builder reports back for
the plugin's outputs (shapes and types from getOutputShapes / getOutputDataTypes, the engine's layer information,
aliasing); invalid fields refused with the plugin's own message naming the field; the plugin library embedded in
the plan; registration through the builder's registry.

With a CUDA GPU (`gpu` too): the engine is deserialized and run for two steps over a ragged batch against the
reference op (trtllm_kivi/reference/attention.py, kivi_attention).

Skips, naming the missing piece, only without a TensorRT Python package or without the built plugin library
(build_scripts/build_plugin.sh --tensorrt-root DIR needs TensorRT's headers); the GPU tests also without a GPU.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from trtllm_kivi.builder.trt_build import (EngineUnavailable, check_graph_nodes, compile_onnx, engine_plan,
                                           find_tensorrt_or_unavailable)
from trtllm_kivi.format import BUFFER_NAMES, FORMAT_VERSION, KiviConfig, buffer_dtypes, buffer_shapes
from trtllm_kivi.op import DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, STATUS_OUTPUT, plugin_fields
from trtllm_kivi.reference.attention import KiviBuffers, kivi_attention
from trtllm_kivi.trt import find_plugin

pytestmark = pytest.mark.trt

ONNX_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT,
              "int32": TensorProto.INT32}
TRT_TYPES = {"float16": "HALF", "bfloat16": "BF16", "float32": "FLOAT", "int32": "INT32"}
LAYER_INFO_TYPES = {"float16": "Half", "bfloat16": "BFloat16", "float32": "Float", "int32": "Int32"}
NUM_BLOCKS, NUM_SLOTS, MAX_BLOCKS = 8, 3, 4
MAX_TOKENS, MAX_BATCH = 256, 4


@pytest.fixture(scope="module")
def plan():
    """TensorRT, the plugin library and targets (the GPU here, else one TensorRT-RTX target); skips naming what is
    missing."""
    try:
        find_tensorrt_or_unavailable()
    except EngineUnavailable as e:
        pytest.skip(f"no TensorRT: {e}")
    try:
        find_plugin()
    except FileNotFoundError as e:
        pytest.skip(f"no plugin library: {e}")
    return engine_plan(compute_capability=None if torch.cuda.is_available() else ["8.6"])


def one_node_graph(cfg: KiviConfig, h: int, hkv: int, d: int, act: str = "float16", attrs: dict | None = None,
                   drop: tuple[str, ...] = ()) -> onnx.ModelProto:
    """A graph holding one KiviAttention node (the exporter's node: same inputs, outputs and attributes) whose
    inputs are graph inputs: q/k/v [tokens, heads, D], the step tensors [batch] / [batch, MAX_BLOCKS] and the cache
    buffers of NUM_BLOCKS blocks and NUM_SLOTS slots; `attrs` overrides fields, `drop` leaves some out."""
    shapes = buffer_shapes(cfg, hkv, d, NUM_BLOCKS, NUM_SLOTS)
    dtypes = buffer_dtypes(cfg, act)
    vi = helper.make_tensor_value_info
    inputs = [vi("q", ONNX_TYPES[act], ["tokens", h, d]), vi("k", ONNX_TYPES[act], ["tokens", hkv, d]),
              vi("v", ONNX_TYPES[act], ["tokens", hkv, d])]
    inputs += [vi(n, TensorProto.INT32, ["batch"]) for n in ("slot_ids", "past_len", "chunk_len")]
    inputs += [vi("block_table", TensorProto.INT32, ["batch", MAX_BLOCKS])]
    inputs += [vi(n, ONNX_TYPES[dtypes[n]], list(shapes[n])) for n in BUFFER_NAMES]
    outputs = [vi("out", ONNX_TYPES[act], ["tokens", h, d])]
    outputs += [vi(f"{n}_out", ONNX_TYPES[dtypes[n]], list(shapes[n])) for n in BUFFER_NAMES]
    outputs += [vi(STATUS_OUTPUT, TensorProto.INT32, [1])]
    fields = {k: v for k, v in plugin_fields(cfg, h, hkv, d).items() if k not in drop} | (attrs or {})
    node = helper.make_node(PLUGIN_NAME, [i.name for i in inputs], [o.name for o in outputs], name="kivi",
                            domain=DOMAIN, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE,
                            **fields)
    return helper.make_model(helper.make_graph([node], "kivi_one_node", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def profile(h: int, hkv: int, d: int) -> dict:
    """Dynamic profile: 1..MAX_TOKENS tokens, 1..MAX_BATCH sequences."""
    tok = lambda heads: ((1, heads, d), (MAX_TOKENS // 2, heads, d), (MAX_TOKENS, heads, d))  # noqa: E731
    out = {"q": tok(h), "k": tok(hkv), "v": tok(hkv), "block_table": ((1, MAX_BLOCKS), (2, MAX_BLOCKS),
                                                                    (MAX_BATCH, MAX_BLOCKS))}
    return out | {n: ((1,), (2,), (MAX_BATCH,)) for n in ("slot_ids", "past_len", "chunk_len")}


def compile_graph(plan, tmp_path: Path, graph: onnx.ModelProto, h: int, hkv: int, d: int):
    path = tmp_path / "one.onnx"
    onnx.save(graph, str(path))
    return compile_onnx(path, plan, profile(h, hkv, d), echo=False)


# ---------------------------------------------------------------------------------------------- the combinations

FACTORS = {
    "act": ("float16", "bfloat16"),
    "k_bits": (2, 4, 8),
    "v_bits": (2, 4, 8),
    "head_dim": (64, 128),
    "gqa": (1, 4, 8),
    "group_size": (32, 64, 128),
    "scale_dtype": ("float16", "bfloat16", "float32"),
    "sink_tokens": (0, 4),
    "rotation": ("none", "hadamard"),
}


def covering_set(factors: dict[str, tuple]) -> list[dict]:
    """A small set of combinations in which every pair of values of two factors occurs: greedy over the full
    product (deterministic), each step taking the combination that covers the most pairs not yet covered."""
    names = list(factors)
    pairs = list(itertools.combinations(range(len(names)), 2))
    product = np.array(list(itertools.product(*(range(len(v)) for v in factors.values()))))  # [N, factors]
    sizes = [len(v) for v in factors.values()]
    offsets = np.cumsum([0] + [sizes[a] * sizes[b] for a, b in pairs])
    # ids[n, p]: the id of the pair of values combination n has for the factor pair p
    ids = np.stack([offsets[p] + product[:, a] * sizes[b] + product[:, b] for p, (a, b) in enumerate(pairs)], 1)
    uncovered = np.ones(offsets[-1], dtype=bool)
    chosen = []
    while uncovered.any():
        best = int(uncovered[ids].sum(1).argmax())
        uncovered[ids[best]] = False
        chosen.append({n: factors[n][i] for n, i in zip(names, product[best], strict=True)})
    return chosen


COMBINATIONS = covering_set(FACTORS)


def _combo_id(c: dict) -> str:
    return (f"{c['act']}-k{c['k_bits']}v{c['v_bits']}-d{c['head_dim']}-gqa{c['gqa']}-g{c['group_size']}-"
            f"s{c['scale_dtype']}-sink{c['sink_tokens']}-{c['rotation']}")


def test_the_covering_set_covers_every_pair():
    assert 9 <= len(COMBINATIONS) <= 20  # 3 x 3 pairs at least; far below the 3,888 of the full product
    for a, b in itertools.combinations(FACTORS, 2):
        assert {(c[a], c[b]) for c in COMBINATIONS} == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)


def _layer_info(messages: list[tuple[str, str]], layer: str) -> tuple[dict, dict]:
    """({input: (type, dims)}, {output: (type, dims)}) of `layer` in the builder's "Engine Layer Information"."""
    text = next(m for _, m in messages if "Engine Layer Information" in m)
    line = next(ln for ln in text.splitlines() if f": {layer}," in ln)
    ins, outs = line.split(" -> ")
    parse = lambda s: {n: (t, tuple(int(x) for x in d.split(",") if x))  # noqa: E731
                       for n, t, d in re.findall(r"(\w+) \((\w+)\[([-\d,]*)\]\)", s)}
    return parse(ins), parse(outs)


@pytest.mark.parametrize("combo", COMBINATIONS, ids=_combo_id)
def test_one_node_engine_builds_and_reports_the_outputs(plan, tmp_path, combo):
    hkv, d, act = 2, combo["head_dim"], combo["act"]
    h = hkv * combo["gqa"]
    cfg = KiviConfig(k_bits=combo["k_bits"], v_bits=combo["v_bits"], group_size=combo["group_size"],
                     scale_dtype=combo["scale_dtype"], sink_tokens=combo["sink_tokens"],
                     k_rotation=combo["rotation"], v_rotation=combo["rotation"])
    compiled = compile_graph(plan, tmp_path, one_node_graph(cfg, h, hkv, d, act), h, hkv, d)
    assert len(compiled.plan) > plan.plugin_lib.stat().st_size  # version-compatible: the library is in the plan

    shapes, dtypes = buffer_shapes(cfg, hkv, d, NUM_BLOCKS, NUM_SLOTS), buffer_dtypes(cfg, act)
    want = {"out": (act, (-1, h, d))} | {f"{n}_out": (dtypes[n], shapes[n]) for n in BUFFER_NAMES}
    want[STATUS_OUTPUT] = ("int32", (1,))
    # The network's outputs as the plugin typed and shaped them (getOutputDataTypes / getOutputShapes).
    net = compiled.network
    got = {net.get_output(i).name: (net.get_output(i).dtype.name, tuple(net.get_output(i).shape))
           for i in range(net.num_outputs)}
    assert got == {n: (TRT_TYPES[t], s) for n, (t, s) in want.items()}
    # What the builder reports for the engine's layer: every input and output with its type and dims.
    ins, outs = _layer_info(compiled.logger.messages, "kivi")
    assert outs == {n: (LAYER_INFO_TYPES[t], s) for n, (t, s) in want.items()}
    for n in BUFFER_NAMES:  # each cache output is its input's twin (aliased: same type and dims)
        assert ins[n] == outs[f"{n}_out"]
    assert ins["q"] == (LAYER_INFO_TYPES[act], (-1, h, d)) and ins["block_table"] == ("Int32", (-1, MAX_BLOCKS))


def test_the_builder_sees_the_aliased_cache_outputs(plan, tmp_path):
    # Without the preview feature that enables aliased plugin I/O the builder refuses the plugin, naming the
    # aliasing: it reads getAliasedInput (compile_onnx turns the feature on; the one-node builds above pass).
    cfg = KiviConfig()
    path = tmp_path / "one.onnx"
    onnx.save(one_node_graph(cfg, 8, 2, 64), str(path))
    t = plan.tensorrt
    logger = t.logger(echo=False)
    builder = t.builder(logger)
    t.load_plugin_library(builder, plan.plugin_lib, logger)
    network = t.network(builder)
    assert t.onnx_parser(network, logger).parse_from_file(str(path))
    config = builder.create_builder_config()
    p = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile(8, 2, 64).items():
        p.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(p)
    t.set_targets(config, plan.targets)
    assert builder.build_serialized_network(network, config) is None
    assert "Aliased I/O used by plugin kivi" in logger.errors_text()


# ---------------------------------------------------------------------------------------------- refusals

# (attribute overrides, dropped fields, GQA, the plugin's own words) refused when the parser creates the plugin.
CREATE_REFUSALS = [
    ({"head_dim": 96}, (), 4, "KiviAttention field head_dim=96 is not supported; allowed: 64, 128"),
    ({"k_bits": 3}, (), 4, "KiviAttention field k_bits=3 is not supported; allowed: 2, 4, 8"),
    ({"v_bits": 5}, (), 4, "KiviAttention field v_bits=5 is not supported; allowed: 2, 4, 8"),
    ({"group_size": 48}, (), 4, "KiviAttention field group_size=48 is not supported; allowed: 32, 64, 128"),
    ({"format_version": 99}, (), 4, f"format_version=99 does not match this plugin library's FORMAT_VERSION="
                                    f"{FORMAT_VERSION}"),
    ({"num_kv_heads": 5}, (), 4, "KiviAttention field num_heads=8 must be a multiple of num_kv_heads=5"),
    ({"sink_tokens": 200}, (), 4, "KiviAttention field sink_tokens=200 must be in [0, 128]"),
    ({"k_rotation": 2}, (), 4, "KiviAttention field k_rotation=2 is not supported"),
    ({"k_bits": 2.0}, (), 4, "KiviAttention field k_bits must be one int32"),
    ({}, ("residual_length",), 4, "KiviAttention: missing field(s) residual_length"),
    ({}, ("num_heads", "format_version"), 4, "KiviAttention: missing field(s) num_heads, format_version"),
]


@pytest.mark.parametrize("attrs,drop,gqa,message", CREATE_REFUSALS,
                         ids=[m.split(" is")[0].split(" must")[0].split(" does")[0][-32:] for *_, m in
                              CREATE_REFUSALS])
def test_an_invalid_field_is_refused_with_the_plugins_message(plan, tmp_path, attrs, drop, gqa, message):
    graph = one_node_graph(KiviConfig(), 2 * gqa, 2, 64, attrs=attrs, drop=drop)
    with pytest.raises(ValueError, match="could not parse") as e:
        compile_graph(plan, tmp_path, graph, 2 * gqa, 2, 64)
    assert message in str(e.value)


def test_what_the_kernels_cannot_run_is_refused_at_build_with_the_plugins_message(plan, tmp_path):
    # Valid fields, but a GQA ratio past the attention kernel's tile (configurePlugin asks the kernels).
    with pytest.raises(RuntimeError, match="num_heads/num_kv_heads=32 is not supported; allowed: 1..16"):
        compile_graph(plan, tmp_path, one_node_graph(KiviConfig(), 32, 1, 64), 32, 1, 64)
    # key_grouping per_token with per-channel buffers: the inputs' dims disagree with the fields.
    graph = one_node_graph(KiviConfig(), 8, 2, 64, attrs={"key_grouping": 1})
    with pytest.raises(RuntimeError, match="KiviAttention input k_codes has dims"):
        compile_graph(plan, tmp_path, graph, 8, 2, 64)


def test_an_unknown_attribute_never_reaches_the_plugin_so_the_builder_refuses_it(plan, tmp_path):
    # TensorRT's ONNX parser passes on only the fields the creator lists: the plugin cannot see (or refuse) an
    # unknown attribute, and the engine builds. check_graph_nodes, which build_engine runs first, refuses it.
    graph = one_node_graph(KiviConfig(), 8, 2, 64, attrs={"num_layer": 30})
    compile_graph(plan, tmp_path, graph, 8, 2, 64)
    with pytest.raises(ValueError, match=r"node 'kivi': unknown attribute\(s\) num_layer; the plugin's fields"):
        check_graph_nodes(tmp_path / "one.onnx")
    onnx.save(one_node_graph(KiviConfig(), 8, 2, 64, drop=("sink_tokens",)), str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match=r"missing field\(s\) sink_tokens"):
        check_graph_nodes(tmp_path / "m.onnx")


def test_the_creator_reads_fields_from_a_collection_that_keeps_them_alive(plan):
    t = plan.tensorrt
    logger = t.logger(echo=False)
    builder = t.builder(logger)
    t.load_plugin_library(builder, plan.plugin_lib, logger)
    creator = builder.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    assert creator is not None
    fields = plugin_fields(KiviConfig(), 8, 2, 64)
    good = t.field_collection(fields)
    import gc

    gc.collect()  # nothing the collection points into may be freed
    assert creator.create_plugin("kivi", good.collection, t.trt.TensorRTPhase.BUILD) is not None
    for name, bad in (("k_bits", 3), ("group_size", 48), ("format_version", FORMAT_VERSION + 1)):
        logger.clear()
        fc = t.field_collection(dict(fields, **{name: bad}))
        assert creator.create_plugin("kivi", fc.collection, t.trt.TensorRTPhase.BUILD) is None
        assert any(f"field {name}={bad}" in m for m in logger.plugin_errors()), logger.messages


def test_load_library_registers_once_in_a_fresh_process(plan):
    code = (
        "from trtllm_kivi.trt import find_tensorrt\n"
        "t = find_tensorrt()\n"
        "lg = t.logger(echo=False)\n"
        "b = t.builder(lg)\n"
        f"t.load_plugin_library(b, {str(plan.plugin_lib)!r}, lg)\n"
        "reg = b.get_plugin_registry()\n"
        f"assert reg.get_creator({PLUGIN_NAME!r}, {PLUGIN_VERSION!r}, {PLUGIN_NAMESPACE!r}) is not None\n"
        "n = sum(1 for c in reg.all_creators if c.name == 'KiviAttention')\n"
        "assert n == 1, n\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- on a GPU

H, HKV, D = 8, 2, 64
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)")


def _engine(plan, tmp_path, cfg: KiviConfig, act: torch.dtype):
    name = "float16" if act == torch.float16 else "bfloat16"
    compiled = compile_graph(plan, tmp_path, one_node_graph(cfg, H, HKV, D, name), H, HKV, D)
    t = plan.tensorrt
    logger = t.logger()
    # A fresh runtime: the plugin comes back from the library embedded in the plan (createPlugin(kRUNTIME, ...)).
    return t.deserialize(t.runtime(logger), compiled.plan, logger)


def _run(engine, context, q, k, v, slot_ids, past_len, chunk_len, block_table, bufs: KiviBuffers, status=None):
    """One step on the GPU; bufs (CUDA tensors) are updated in place through the aliased outputs. The status output
    (the kernels' error bits) is written to `status` when given, else checked to be 0."""
    named = dict(q=q, k=k, v=v, slot_ids=slot_ids, past_len=past_len, chunk_len=chunk_len, block_table=block_table)
    for name, t in named.items():
        context.set_input_shape(name, tuple(t.shape))
        context.set_tensor_address(name, t.data_ptr())
    for name, t in zip(BUFFER_NAMES, bufs, strict=True):
        context.set_tensor_address(name, t.data_ptr())
        assert engine.get_aliased_input_tensor(f"{name}_out") == name
        context.set_tensor_address(f"{name}_out", t.data_ptr())
    out = torch.empty_like(q)
    context.set_tensor_address("out", out.data_ptr())
    st = torch.full((1,), -1, dtype=torch.int32, device="cuda") if status is None else status
    context.set_tensor_address(STATUS_OUTPUT, st.data_ptr())
    assert context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    if status is None:
        assert st.item() == 0, f"status {st.item()}"
    return out


@gpu
@needs_gpu
@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
def test_engine_matches_reference_over_two_steps(plan, tmp_path, act):
    cfg = KiviConfig()  # KIVI-2: k_bits = v_bits = 2, G = 32, R = 128, block 128
    engine = _engine(plan, tmp_path, cfg, act)
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


@gpu
@needs_gpu
def test_status_output_reports_a_skipped_sequence(plan, tmp_path):
    # Device lengths past the block table (no host check can see them): the sequence is skipped and the status
    # output carries kKIVI_ERR_CAPACITY (2) instead of a silent zero row.
    cfg = KiviConfig()
    engine = _engine(plan, tmp_path, cfg, torch.float16)
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
