"""The compact Llama (models/llama.py) as an ONNX graph whose attentions are `KiviAttention` nodes.

Built with onnx.helper from the model's own tensors rather than torch.onnx.export: the graph is small and regular
(per token ops on [tokens, dim] rows + one custom node per layer), we control every dtype and Cast (TensorRT 11
networks are strongly typed), the custom node needs 15 inputs / 10 outputs with cache aliasing that a tracer would
have to be taught through a custom symbolic, and the result does not depend on the torch exporter of the day.

One graph run is one step of a ragged batch (docs/design.md): the tokens of B sequences concatenated.

    inputs   input_ids [tokens] int32, positions [tokens] int32, slot_ids / past_len / chunk_len [batch] int32,
             block_table [batch, max_blocks] int32, logit_rows [rows] int32 (rows of the step whose logits are
             wanted: each chunk's last token, or all of them), past.{layer}.{buffer} (format.BUFFER_NAMES)
    outputs  logits [rows, vocab] float32, present.{layer}.{buffer} (same shapes/dtypes as past.*; a runner binds
             each present.* to its past.* buffer: the op updates the cache in place in TensorRT),
             status.{layer} [1] int32 (op.STATUS_OUTPUT: the kernels' error bits of the step; 0 = all ran)

Every floating op runs in the activation dtype except RMSNorm's statistics (fp32, like the torch model), the RoPE
tables (fp32, cast once per step) and the logits (cast to fp32). The node's attributes are op.plugin_fields +
plugin_version / plugin_namespace, which TensorRT's ONNX parser uses to pick the registered plugin.

Format v2 rotation (format.py) lives in the graph, around the node: in a layer whose k_rotation is hadamard, post-RoPE
q and k are multiplied by the initializer `hadamard` [D, D]; with v_rotation hadamard, v is, and the node's output
is multiplied by H^T (= H) before o_proj. The node records its layer's rotation codes, so an engine and its cache
agree by construction.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from ..format import BUFFER_NAMES, KiviConfig, buffer_dtypes, buffer_shapes
from ..op import (DOMAIN, FIELD_NAMES, GRAPH_DTYPES, LOGITS, OPSET, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION,
                  STATUS_OUTPUT, ExportSpec, GraphInfo, cache_io_names, plugin_fields, status_name)
from ..reference.rotation import hadamard

SUPPORTED_DTYPES = GRAPH_DTYPES
ONNX_DTYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT,
               "int32": TensorProto.INT32}


def kivi_attention_schema() -> onnx.defs.OpSchema:
    """The node's declaration (arity, types, attributes) so onnx.checker validates KiviAttention nodes."""
    S = onnx.defs.OpSchema
    i32, fl = "tensor(int32)", ["tensor(float16)", "tensor(bfloat16)", "tensor(float)"]
    inputs = [S.FormalParameter(n, "T") for n in ("q", "k", "v")]
    inputs += [S.FormalParameter(n, "I") for n in ("slot_ids", "past_len", "chunk_len", "block_table")]
    bufs = [S.FormalParameter(n, "I" if n.endswith("codes") else ("S" if "window" not in n else "T"))
            for n in BUFFER_NAMES]
    attrs = [S.Attribute(n, S.AttrType.INT, "plugin field") for n in FIELD_NAMES]
    attrs += [S.Attribute("plugin_version", S.AttrType.STRING, "TensorRT plugin version"),
              S.Attribute("plugin_namespace", S.AttrType.STRING, "TensorRT plugin namespace")]
    return S(PLUGIN_NAME, DOMAIN, 1, doc="KIVI attention over a quantized KV cache (trtllm_kivi.reference)",
             inputs=inputs + bufs,
             outputs=[S.FormalParameter("out", "T")] + bufs + [S.FormalParameter(STATUS_OUTPUT, "I")],
             type_constraints=[("T", fl, "activations"), ("S", fl, "scale/zero"), ("I", [i32], "int32")],
             attributes=attrs)


def register_schema() -> None:
    """Register the KiviAttention schema with onnx (once per process)."""
    if not onnx.defs.has(PLUGIN_NAME, DOMAIN):
        onnx.defs.register_schema(kivi_attention_schema())


def _tensor(name: str, t: torch.Tensor, dtype: str) -> TensorProto:
    """An initializer from a torch tensor in `dtype` (raw bytes: numpy has no bfloat16)."""
    t = t.detach().to("cpu", getattr(torch, dtype)).contiguous()
    raw = (t.view(torch.int16) if dtype == "bfloat16" else t).numpy().tobytes()
    return helper.make_tensor(name, ONNX_DTYPES[dtype], list(t.shape), raw, raw=True)


class _Graph:
    """A tiny node builder: unique names, constants, the few op patterns the Llama needs."""

    def __init__(self, dtype: str) -> None:
        self.dtype, self.act = dtype, ONNX_DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._n = 0
        self._consts: set[str] = set()

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None, outputs=None,
           **attrs) -> list[str]:
        self._n += 1
        name = name or f"{op_type}_{self._n}"
        outputs = outputs or [f"{name}_out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs

    def op1(self, op_type: str, *inputs: str, **attrs) -> str:
        return self.op(op_type, list(inputs), **attrs)[0]

    def const(self, name: str, value: np.ndarray) -> str:
        if name not in self._consts:  # constants are shared by name
            self._consts.add(name)
            self.inits.append(onnx.numpy_helper.from_array(value, name))
        return name

    def weight(self, name: str, t: torch.Tensor) -> str:
        self.inits.append(_tensor(name, t, self.dtype))
        return name

    def rms_norm(self, x: str, weight: str, eps: float) -> str:
        """weight * (xf * rsqrt(mean(xf^2) + eps)).to(act): statistics in fp32 as in models.llama.RMSNorm."""
        xf = self.op1("Cast", x, to=TensorProto.FLOAT)
        ms = self.op1("ReduceMean", self.op1("Mul", xf, xf), "axes_last", keepdims=1)
        inv = self.op1("Reciprocal", self.op1("Sqrt", self.op1("Add", ms, f"eps_{eps!r}")))
        return self.op1("Mul", weight, self.op1("Cast", self.op1("Mul", xf, inv), to=self.act))

    def rope(self, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
        """x [T, heads * D] -> rotated [T, heads, D] (HF half-split layout, as models.llama.apply_rope)."""
        x = self.op1("Reshape", x, self.const(f"shape_h{heads}", np.array([-1, heads, head_dim], np.int64)))
        x1, x2 = self.op("Split", [x, "halves"], 2, axis=-1)
        rot = self.op1("Concat", self.op1("Neg", x2), x1, axis=-1)
        return self.op1("Add", self.op1("Mul", x, cos), self.op1("Mul", rot, sin))

    def rotate(self, x: str) -> str:
        """x [..., D] @ H in fp32, cast back (as reference.rotation.rotate): 1/sqrt(D) is not exact in 16 bits."""
        xf = self.op1("Cast", x, to=TensorProto.FLOAT)
        return self.op1("Cast", self.op1("MatMul", xf, "hadamard"), to=self.act)

    def linear(self, x: str, w: str, b: str | None = None) -> str:
        """x [T, in] @ w[out, in]^T (+ b [out]): Gemm(transB) keeps torch's weight layout."""
        return self.op1("Gemm", x, w, *([b] if b else []), transB=1)


def _w(p) -> torch.Tensor:
    """A weight of the torch model, held as a bare Parameter or in a module's .weight."""
    return p if isinstance(p, torch.Tensor) else p.weight


def graph_info(model, cfg: KiviConfig, spec: ExportSpec) -> GraphInfo:
    """What export_llama(model, cfg, spec) is built for: the record a runner drives it by (build_config.json)."""
    return GraphInfo(cfg, model.cfg.geometry, spec, model.cfg.vocab_size)


def export_llama(model, cfg: KiviConfig, spec: ExportSpec) -> onnx.ModelProto:
    """A models.llama.LlamaModel -> ONNX ModelProto (weights as initializers; save with save_model)."""
    register_schema()
    mc = model.cfg
    h, hkv, d = mc.n_heads, mc.n_kv_heads, mc.head_dim
    cfg.check_num_layers(mc.n_layers)
    nb, mb = spec.num_blocks(cfg), spec.max_blocks_per_seq(cfg)
    shapes = buffer_shapes(cfg, hkv, d, nb, spec.max_batch_size)
    dtypes = buffer_dtypes(cfg, spec.dtype)

    g = _Graph(spec.dtype)
    i32 = TensorProto.INT32
    inputs = [helper.make_tensor_value_info("input_ids", i32, ["num_tokens"]),
              helper.make_tensor_value_info("positions", i32, ["num_tokens"]),
              helper.make_tensor_value_info("slot_ids", i32, ["batch"]),
              helper.make_tensor_value_info("past_len", i32, ["batch"]),
              helper.make_tensor_value_info("chunk_len", i32, ["batch"]),
              helper.make_tensor_value_info("block_table", i32, ["batch", mb]),
              helper.make_tensor_value_info("logit_rows", i32, ["num_logits"])]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["num_logits", mc.vocab_size])]

    g.const("axes_last", np.array([-1], np.int64))
    g.const(f"eps_{mc.norm_eps!r}", np.array(mc.norm_eps, np.float32))
    g.const("halves", np.array([d // 2, d // 2], np.int64))
    g.const("qkv_split", np.array([h * d, hkv * d, hkv * d], np.int64))
    g.const("mlp_split", np.array([mc.ffn_dim, mc.ffn_dim], np.int64))
    g.const("shape_attn_out", np.array([-1, h * d], np.int64))
    g.const("axis1", np.array([1], np.int64))

    # RoPE tables as in LlamaModel.rope_tables: fp32 [max_seq_len, D], cast to the activation dtype per step.
    freqs = torch.outer(torch.arange(spec.max_seq_len, dtype=torch.float32), model.inv_freq.float().cpu())
    emb = torch.cat((freqs, freqs), dim=-1)
    g.inits += [_tensor("rope_cos", emb.cos(), "float32"), _tensor("rope_sin", emb.sin(), "float32")]
    cos, sin = (g.op1("Unsqueeze", g.op1("Cast", g.op1("Gather", t, "positions", axis=0), to=g.act), "axis1")
                for t in ("rope_cos", "rope_sin"))  # [T, 1, D]

    if cfg.rotated:  # format v2: H [D, D] fp32 (Sylvester, 1/sqrt(D); symmetric, so it is also H^T)
        g.inits.append(_tensor("hadamard", hadamard(d), "float32"))
    embed = g.weight("embed.weight", _w(model.embed))
    x = g.op1("Gather", embed, "input_ids", axis=0)  # [T, dim]
    for i, blk in enumerate(model.layers):
        p = f"layers.{i}."
        past, present = cache_io_names(i)
        for name, pn in zip(BUFFER_NAMES, past, strict=False):
            inputs.append(helper.make_tensor_value_info(pn, ONNX_DTYPES[dtypes[name]], list(shapes[name])))
        for name, pn in zip(BUFFER_NAMES, present, strict=False):
            outputs.append(helper.make_tensor_value_info(pn, ONNX_DTYPES[dtypes[name]], list(shapes[name])))

        hn = g.rms_norm(x, g.weight(p + "attn_norm.weight", blk.attn_norm.weight), mc.norm_eps)
        bqkv = None if blk.attn.bqkv is None else g.weight(p + "attn.bqkv.bias", blk.attn.bqkv)  # Qwen2
        qkv = g.linear(hn, g.weight(p + "attn.wqkv.weight", _w(blk.attn.wqkv)), bqkv)
        q, k, v = g.op("Split", [qkv, "qkv_split"], 3, axis=-1)
        q, k = g.rope(q, h, d, cos, sin), g.rope(k, hkv, d, cos, sin)
        v = g.op1("Reshape", v, f"shape_h{hkv}")
        k_rot, v_rot = cfg.k_rotation_of(i), cfg.v_rotation_of(i)
        if k_rot == "hadamard":  # post-RoPE q and k times H: the scores are unchanged, the cache holds kH
            q, k = g.rotate(q), g.rotate(k)
        if v_rot == "hadamard":  # the cache holds vH; the op's output is rotated back below
            v = g.rotate(v)
        fields = plugin_fields(cfg, h, hkv, d, layer=i)  # the one mapping config + geometry -> node attributes
        attn_name = f"attention_{i}"
        attn_out = f"{attn_name}.out"
        outputs.append(helper.make_tensor_value_info(status_name(i), i32, [1]))
        g.op(PLUGIN_NAME, [q, k, v, "slot_ids", "past_len", "chunk_len", "block_table", *past],
             name=attn_name, outputs=[attn_out, *present, status_name(i)], domain=DOMAIN,
             plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE, **fields)
        # The custom node's output shape, declared so shape inference continues past it.
        g.value_info.append(helper.make_tensor_value_info(attn_out, g.act, ["num_tokens", h, d]))
        o = g.rotate(attn_out) if v_rot == "hadamard" else attn_out  # out H^T (= out H)
        o = g.op1("Reshape", o, "shape_attn_out")
        x = g.op1("Add", x, g.linear(o, g.weight(p + "attn.wo.weight", _w(blk.attn.wo))))

        hn = g.rms_norm(x, g.weight(p + "mlp_norm.weight", blk.mlp_norm.weight), mc.norm_eps)
        gate, up = g.op("Split", [g.linear(hn, g.weight(p + "mlp.w13.weight", _w(blk.mlp.w13))), "mlp_split"],
                        2, axis=-1)
        act = g.op1("Mul", g.op1("Mul", gate, g.op1("Sigmoid", gate)), up)  # SwiGLU: silu(gate) * up
        x = g.op1("Add", x, g.linear(act, g.weight(p + "mlp.w2.weight", _w(blk.mlp.w2))))

    x = g.op1("Gather", x, "logit_rows", axis=0)  # [rows, dim]: only the rows whose logits are wanted
    x = g.rms_norm(x, g.weight("norm.weight", model.norm.weight), mc.norm_eps)
    head = embed if model.lm_head is None else g.weight("lm_head.weight", _w(model.lm_head))
    g.op("Cast", [g.linear(x, head)], outputs=[LOGITS], to=TensorProto.FLOAT)

    graph = helper.make_graph(g.nodes, f"{mc.name}_kivi", inputs, outputs, g.inits, value_info=g.value_info)
    m = helper.make_model(graph, producer_name="trtllm-kivi",
                          opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = 9  # what onnxruntime and TensorRT's parser read today
    return m


def save_model(m: onnx.ModelProto, path: str, data_name: str | None = None, keep_weights: bool = True) -> None:
    """Write the graph with its weights in one external-data file next to it (`<name>.data`). onnx moves the
    weights out of `m` while saving; they are read back so `m` stays usable, unless keep_weights is False."""
    data_name = data_name or os.path.basename(path) + ".data"
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name,
                    size_threshold=1024)  # small constants (axes, shapes) stay inline for shape inference
    if keep_weights:
        onnx.load_external_data_for_model(m, os.path.dirname(os.path.abspath(path)))


__all__ = ["SUPPORTED_DTYPES", "ONNX_DTYPES",
           "export_llama", "graph_info", "kivi_attention_schema", "register_schema", "save_model"]
