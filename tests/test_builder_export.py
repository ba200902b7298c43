"""Structure of the exported ONNX graph (trtllm_kivi.builder.onnx_export) on a tiny random Llama.

Oracles: format.buffer_shapes / buffer_dtypes (cache I/O), op.plugin_fields (node attributes), the torch model's
own tensors (initializers), onnx.checker + strict shape inference (graph validity)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from trtllm_kivi.builder.onnx_export import ONNX_DTYPES, export_llama, graph_info, save_model
from trtllm_kivi.runtime.ort_session import ort_model
from trtllm_kivi.models.tiny import tiny_model
from trtllm_kivi.builder.trt_build import profile_shapes, trtexec_command
from trtllm_kivi.format import BUFFER_NAMES, FORMAT_VERSION, KiviConfig, buffer_dtypes, buffer_shapes
from trtllm_kivi.op import (DOMAIN, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, STEP_INPUTS, ExportSpec,
                            plugin_fields)

CFG = KiviConfig(k_bits=2, v_bits=4, group_size=32, residual_length=32, block_size=64)
SPEC = ExportSpec("float16", max_batch_size=3, max_seq_len=300, max_num_tokens=256)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=1)


@pytest.fixture(scope="module")
def graph(tiny):
    return export_llama(tiny[0], CFG, SPEC)


def _attr(node, name):
    return onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == name))


def test_one_kivi_attention_node_per_layer_with_plugin_fields(graph, tiny):
    _, mc = tiny
    nodes = [n for n in graph.graph.node if n.op_type == PLUGIN_NAME]
    assert len(nodes) == mc.n_layers
    expected = plugin_fields(CFG, mc.n_heads, mc.n_kv_heads, mc.head_dim)
    for layer, n in enumerate(nodes):
        assert n.domain == DOMAIN == PLUGIN_NAMESPACE
        ints = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
        assert ints == expected
        assert _attr(n, "plugin_version") == PLUGIN_VERSION.encode()
        assert _attr(n, "plugin_namespace") == PLUGIN_NAMESPACE.encode()
        assert list(n.input[3:7]) == ["slot_ids", "past_len", "chunk_len", "block_table"]
        assert list(n.input[7:]) == [f"past.{layer}.{b}" for b in BUFFER_NAMES]
        assert list(n.output[1:]) == [f"present.{layer}.{b}" for b in BUFFER_NAMES] + [f"status.{layer}"]
    assert {(o.domain, o.version) for o in graph.opset_import} >= {(DOMAIN, 1)}


def test_cache_inputs_outputs_match_the_format(graph, tiny):
    _, mc = tiny
    shapes = buffer_shapes(CFG, mc.n_kv_heads, mc.head_dim, SPEC.num_blocks(CFG), SPEC.max_batch_size)
    dtypes = buffer_dtypes(CFG, "float16")
    ins = {v.name: v.type.tensor_type for v in graph.graph.input}
    outs = {v.name: v.type.tensor_type for v in graph.graph.output}
    for layer in range(mc.n_layers):
        for b in BUFFER_NAMES:
            for t in (ins[f"past.{layer}.{b}"], outs[f"present.{layer}.{b}"]):
                assert t.elem_type == ONNX_DTYPES[dtypes[b]]
                assert tuple(d.dim_value for d in t.shape.dim) == shapes[b]
    assert len(ins) == len(STEP_INPUTS) + 8 * mc.n_layers and len(outs) == 1 + 9 * mc.n_layers
    for layer in range(mc.n_layers):  # the plugin's status output (kernel error bits) of every layer
        t = outs[f"status.{layer}"]
        assert t.elem_type == TensorProto.INT32 and tuple(d.dim_value for d in t.shape.dim) == (1,)


def test_step_inputs_are_int32_with_dynamic_dims_and_logits_fp32(graph, tiny):
    ins = {v.name: v.type.tensor_type for v in graph.graph.input}
    for name in STEP_INPUTS:
        assert ins[name].elem_type == TensorProto.INT32
    dims = lambda t: [d.dim_param or d.dim_value for d in t.shape.dim]  # noqa: E731
    assert dims(ins["input_ids"]) == dims(ins["positions"]) == ["num_tokens"]
    assert dims(ins["slot_ids"]) == ["batch"]
    assert dims(ins["block_table"]) == ["batch", SPEC.max_blocks_per_seq(CFG)]
    logits = graph.graph.output[0]
    assert logits.name == "logits" and logits.type.tensor_type.elem_type == TensorProto.FLOAT
    assert dims(logits.type.tensor_type) == ["num_logits", tiny[1].vocab_size]


def test_checker_and_strict_shape_inference_pass(graph, tiny):
    onnx.checker.check_model(graph, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(graph, strict_mode=True, data_prop=True)
    vi = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    _, mc = tiny
    out = vi["attention_0.out"]  # the declared custom-node output carries shape inference past the node
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["num_tokens", mc.n_heads, mc.head_dim]


def test_every_float_is_explicit_in_the_activation_dtype(graph):
    """Strongly typed networks: weights are fp16, the only fp32 initializers are the RoPE tables and eps, and
    every Cast has an explicit target."""
    fp32 = {i.name for i in graph.graph.initializer if i.data_type == TensorProto.FLOAT}
    assert fp32 == {"rope_cos", "rope_sin"} | {n for n in fp32 if n.startswith("eps_")}
    weights = [i for i in graph.graph.initializer if i.name.endswith("weight")]
    assert weights and all(i.data_type == TensorProto.FLOAT16 for i in weights)
    assert all(_attr(n, "to") in (TensorProto.FLOAT, TensorProto.FLOAT16) for n in graph.graph.node
               if n.op_type == "Cast")


def test_weights_are_the_models_and_graph_info_records_the_maxima(graph, tiny):
    model, mc = tiny
    inits = {i.name: i for i in graph.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(inits["layers.1.attn.wqkv.weight"]),
                                  model.layers[1].attn.wqkv.detach().half().numpy())
    assert "lm_head.weight" not in inits  # tied: the embedding serves both
    assert not graph.metadata_props  # one record of the config: build_config.json (op.GraphInfo), not the graph
    info = graph_info(model, CFG, ExportSpec("float16", 3, 300, 256))
    d = info.to_dict()
    assert d["maxima"] == {"max_batch_size": 3, "max_seq_len": 300, "max_num_tokens": 256,
                           "max_blocks_per_seq": info.max_blocks_per_seq, "num_blocks": 3 * info.max_blocks_per_seq}
    assert d["kivi_config"] == CFG.to_dict() and d["geometry"]["num_layers"] == mc.n_layers
    assert type(info).from_dict(d) == info
    for n in graph.graph.node:  # every node carries exactly the fields the info derives
        if n.op_type == PLUGIN_NAME:
            info.check_node_fields({a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT},
                                   n.name)
    assert info.fields()["format_version"] == FORMAT_VERSION


def test_dtypes_change_nothing_but_element_types(tiny):
    """The fp32 graph (what the check runs) has the same nodes, names and attributes as the fp16 and bf16 ones."""
    strip = lambda m: [(n.op_type, n.name, list(n.input), list(n.output),  # noqa: E731
                        [a for a in n.attribute if a.name != "to"]) for n in m.graph.node]
    graphs = [export_llama(tiny[0], CFG, ExportSpec(d, 3, 300, 256)) for d in ("float16", "bfloat16", "float32")]
    assert strip(graphs[0]) == strip(graphs[1]) == strip(graphs[2])


def test_ort_copy_moves_the_domain_and_keeps_scale_buffers(graph):
    m = ort_model(graph)
    nodes = [n for n in m.graph.node if n.op_type == PLUGIN_NAME]
    assert all(n.domain == "ai.onnx.contrib" for n in nodes)
    ins = {v.name: v.type.tensor_type.elem_type for v in m.graph.input}
    assert ins["past.0.k_scale"] == TensorProto.FLOAT16  # format dtype kept at the graph boundary
    assert ins["past.0.k_window"] == TensorProto.FLOAT  # activations widened
    assert all(i.data_type != TensorProto.FLOAT16 for i in m.graph.initializer)
    assert all(n.domain == DOMAIN for n in graph.graph.node if n.op_type == PLUGIN_NAME)  # original untouched


def test_bf16_weights_widen_exactly(tiny):
    g = export_llama(tiny[0], CFG, ExportSpec("bfloat16", 1, 300, 256))
    m = ort_model(g)
    w = numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "layers.0.mlp.w2.weight"))
    np.testing.assert_array_equal(w, tiny[0].layers[0].mlp.w2.detach().bfloat16().float().numpy())


def test_save_model_puts_weights_in_external_data(graph, tmp_path):
    path = tmp_path / "model.onnx"
    save_model(graph, str(path))
    data = tmp_path / "model.onnx.data"
    weights = sum(len(i.raw_data) for i in graph.graph.initializer if i.name.endswith("weight"))
    assert data.stat().st_size >= weights and path.stat().st_size < weights / 10
    back = onnx.load(str(path))
    assert [i.name for i in back.graph.initializer] == [i.name for i in graph.graph.initializer]
    onnx.checker.check_model(str(path), full_check=True)


def test_profiles_and_trtexec_command_cover_the_maxima():
    shapes = profile_shapes(SPEC, CFG)
    assert shapes["input_ids"] == ((1,), (3,), (256,))
    assert shapes["block_table"] == ((1, SPEC.max_blocks_per_seq(CFG)), (3, SPEC.max_blocks_per_seq(CFG)),
                                     (3, SPEC.max_blocks_per_seq(CFG)))
    cmd = trtexec_command("d/model.onnx", "d/model.engine", "/lib/libk.so", SPEC, CFG)
    for part in ("--onnx=d/model.onnx", "--dynamicPlugins=/lib/libk.so", "--stronglyTyped",
                 "--setPluginsToSerialize=/lib/libk.so", "--maxShapes=input_ids:256,positions:256",
                 "--minShapes=input_ids:1", "block_table:3x", "--preview=+aliasedPluginIO1003"):
        assert part in cmd


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="int8"), r"dtype='int8' is not supported; allowed: float16, bfloat16, float32"),
    (dict(max_batch_size=0), r"max_batch_size=0 must be an integer >= 1"),
    (dict(max_seq_len=-5), r"max_seq_len=-5 must be an integer >= 1"),
    (dict(max_num_tokens=2), r"max_num_tokens=2 must be an integer >= 4"),
])
def test_export_spec_rejects_bad_values(kwargs, match):
    args = dict(dtype="float16", max_batch_size=4, max_seq_len=64, max_num_tokens=64) | kwargs
    with pytest.raises(ValueError, match=match):
        ExportSpec(**args)
