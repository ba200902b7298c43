"""The onnxruntime session of an exported graph (runtime.ort_runner drives it; the builder's check uses that runner):
the KiviAttention node executes the op (the native CPU kernels of trtllm_kivi.cpu when built and the head_dim is
theirs, else the reference op of trtllm_kivi.reference) through onnxruntime-extensions' Python custom ops.

onnxruntime-extensions accepts Python ops in the domain ai.onnx.contrib only, with input/output types fixed at
registration and no 16-bit floats, so `ort_model` makes a copy of the graph for onnxruntime: the KiviAttention nodes
move to that domain, the activation dtype becomes float32 (onnxruntime's CPU kernels lack most 16-bit float ops and
so does the Python op API) and exact Casts around each node carry the scale/zero buffers, which keep their format
dtype as graph inputs/outputs (so the cache contents are the format the engine stores). Nothing else changes.

In-place form (`ort_model(m, cache_id=...)`, what OrtRunner uses): onnxruntime-extensions hands a Python op's
outputs back as Python lists (`tolist()` of every element), so returning every cache buffer of every layer each step
costs seconds per token. Instead the nodes become KiviAttentionInPlace(q, k, v, slot_ids, past_len, chunk_len,
block_table) -> (out, status) with `cache_id`/`layer` attributes: the op updates that layer's buffers of a cache
registered with `register_cache` in place (what TensorRT does with aliased plugin I/O), and the past.*/present.*
graph I/O is dropped. onnxruntime's I/O binding cannot avoid that copy: it happens inside the Python-op bridge.

Large graphs: a protobuf message cannot exceed 2 GB, and the float32 copy of a 1.5B-parameter model is 7 GB. A graph
given as a path (a build folder's model.onnx) is read without its weights, and when its float32 weights exceed
INLINE_LIMIT they are converted one tensor at a time into an external-data file in a temporary folder that
onnxruntime loads by path, so no step holds more than one tensor beyond what onnxruntime keeps
(tests/test_runners_ort.py::test_external_weights_route_matches_inline guards that both routes give the same logits).
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from ..format import BUFFER_NAMES
from ..op import DOMAIN, FIELD_NAMES, OPSET, PLUGIN_NAME, cache_io_names, config_from_fields
from ..reference.attention import KiviBuffers, kivi_attention_

if TYPE_CHECKING:
    from ..cpu.ops import KiviCpuAttention

ORT_DOMAIN = "ai.onnx.contrib"
_FLOAT16S = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
ORT_SCALE_DTYPES = ("float16", "float32")  # what numpy (hence a runner's feeds) can hold
_SCALE_BUFFERS = ("k_scale", "k_zero", "v_scale", "v_zero")
# float32 weight bytes up to which the onnxruntime copy is serialized in memory (protobuf's limit is 2 GB)
INLINE_LIMIT = 1 << 30
_ONNX_SCALE_DTYPES = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
INPLACE_OP = PLUGIN_NAME + "InPlace"
_CACHES: dict[int, list[KiviBuffers]] = {}  # cache_id -> every layer's buffers (register_cache)
_NEXT_ID = [1]
# cache_id -> trtllm_kivi.cpu's KiviCpuAttention over its layers (bound at the first call: buffers and config checked
# once, not per layer per step)
_BOUND: dict[int, KiviCpuAttention] = {}


def register_cache(layers: list[KiviBuffers]) -> int:
    """Make a runner's per-layer buffers reachable by the in-place op; returns the id for ort_model(cache_id=)."""
    cache_id = _NEXT_ID[0]
    _NEXT_ID[0] += 1
    _CACHES[cache_id] = layers
    return cache_id


def unregister_cache(cache_id: int) -> None:
    _CACHES.pop(cache_id, None)
    _BOUND.pop(cache_id, None)


@functools.cache
def native_op(head_dim: int):
    """trtllm_kivi.cpu's kivi_attention_cpu_ when the native library is built and supports head_dim, else None (the
    reference op)."""
    from .. import cpu
    from ..format import SUPPORTED_HEAD_DIMS

    if head_dim not in SUPPORTED_HEAD_DIMS or not cpu.available():
        return None
    from ..cpu.ops import kivi_attention_cpu_
    return kivi_attention_cpu_


@functools.cache
def register_ops() -> None:
    """Register the Python KiviAttention op with onnxruntime-extensions, once per process. Its Python API has no
    16-bit floats, so the op takes float32 everywhere; ort_model casts the scale/zero buffers around it (exact:
    the op stores scale-dtype values)."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    attrs = {n: PyCustomOpDef.dt_int64 for n in FIELD_NAMES}
    attrs |= {"plugin_version": PyCustomOpDef.dt_string, "plugin_namespace": PyCustomOpDef.dt_string}
    i32, f32 = PyCustomOpDef.dt_int32, PyCustomOpDef.dt_float
    bufs = [i32, f32, f32, i32, f32, f32, f32, f32]  # BUFFER_NAMES order
    onnx_op(op_type=PLUGIN_NAME, inputs=[f32, f32, f32, i32, i32, i32, i32] + bufs, outputs=[f32] + bufs + [i32],
            attrs=attrs)(_kivi_attention_op)
    onnx_op(op_type=INPLACE_OP, inputs=[f32, f32, f32, i32, i32, i32, i32], outputs=[f32, i32],
            attrs=attrs | {"cache_id": PyCustomOpDef.dt_int64, "layer": PyCustomOpDef.dt_int64})(_kivi_inplace_op)


def _kivi_inplace_op(q, k, v, slot_ids, past_len, chunk_len, block_table, **attrs):
    """The op on the registered cache's buffers of `layer`, in place; returns (out, status [1] int32 = 0)."""
    cache_id, layer = int(attrs["cache_id"]), int(attrs["layer"])
    t = [torch.from_numpy(np.asarray(a)) for a in (q, k, v, slot_ids, past_len, chunk_len, block_table)]
    threads = torch.get_num_threads()
    bound = _BOUND.get(cache_id)
    if bound is None and native_op(t[0].shape[-1]) is not None:
        from ..cpu.ops import KiviCpuAttention

        cfg, *_ = config_from_fields({n: int(attrs[n]) for n in FIELD_NAMES})
        bound = _BOUND[cache_id] = KiviCpuAttention(_CACHES[cache_id], cfg, t[0].shape[1])
    if bound is not None:  # onnxruntime's own threads are idle while the Python op runs
        return bound(layer, *t, threads=threads).numpy(), np.zeros(1, np.int32)
    cfg, *_ = config_from_fields({n: int(attrs[n]) for n in FIELD_NAMES})
    bufs = _CACHES[cache_id][layer]
    torch.set_num_threads(1)
    try:
        return kivi_attention_(*t, bufs, cfg).numpy(), np.zeros(1, np.int32)
    finally:
        torch.set_num_threads(threads)


def _kivi_attention_op(q, k, v, slot_ids, past_len, chunk_len, block_table, *buffers, **attrs):
    """The reference op on numpy arrays: returns (out, *updated buffers, status [1] int32). The buffers onnxruntime
    passes are copied once (they are its inputs) and updated with the in-place form. Dtype conversions in numpy and
    one torch thread: the op's tensors are small, and torch's thread pool contends with onnxruntime's."""
    cfg, *_ = config_from_fields({n: int(attrs[n]) for n in FIELD_NAMES})
    sdt = np.float16 if cfg.scale_dtype == "float16" else np.float32
    t = [torch.from_numpy(np.asarray(a)) for a in (q, k, v, slot_ids, past_len, chunk_len, block_table)]
    bufs = KiviBuffers(*(torch.from_numpy(np.array(b, dtype=sdt if n in _SCALE_BUFFERS else None))  # copies
                         for n, b in zip(BUFFER_NAMES, buffers, strict=True)))
    threads = torch.get_num_threads()
    op = native_op(t[0].shape[-1])
    torch.set_num_threads(1)
    try:
        out = op(*t, bufs, cfg, threads=threads) if op is not None else kivi_attention_(*t, bufs, cfg)
    finally:
        torch.set_num_threads(threads)
    # status [1] int32 = 0: the reference raises on a bad step (check_step) instead of skipping a sequence.
    return (out.numpy(), *(b.numpy().astype(np.float32) if n in _SCALE_BUFFERS else b.numpy()
                           for n, b in zip(BUFFER_NAMES, bufs, strict=True)), np.zeros(1, np.int32))


def ort_model(m: onnx.ModelProto, cache_id: int | None = None, base_dir: str | None = None,
              sink: BinaryIO | None = None, sink_name: str = "") -> onnx.ModelProto:
    """The onnxruntime copy of an exported graph (see the module docstring); `m` is not modified. With cache_id
    (register_cache): the in-place form. Weights stored as external data are read from `base_dir`; with `sink` (a
    file `sink_name` next to where the copy will be saved) every weight is written there in float32 instead of
    into the copy."""
    m = copy.deepcopy(m)
    g = m.graph
    nodes = [n for n in g.node if n.op_type == PLUGIN_NAME and n.domain == DOMAIN]
    if not nodes:
        raise ValueError(f"the graph has no {DOMAIN}::{PLUGIN_NAME} node; is it a trtllm-kivi export?")
    fields = {a.name: a.i for a in nodes[0].attribute if a.name in FIELD_NAMES}
    cfg, *_ = config_from_fields(fields)
    if cfg.scale_dtype not in ORT_SCALE_DTYPES:
        raise ValueError(f"scale_dtype={cfg.scale_dtype!r} cannot run in onnxruntime's Python op; allowed: "
                         f"{', '.join(ORT_SCALE_DTYPES)}")
    for n in nodes:
        n.domain = ORT_DOMAIN
    # Scale/zero buffers keep their dtype; every other 16-bit float tensor is an activation -> float32.
    keep = {vi.name for vi in list(g.input) + list(g.output) if vi.name.rsplit(".", 1)[-1] in
            ("k_scale", "k_zero", "v_scale", "v_zero")}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.name not in keep and vi.type.tensor_type.elem_type in _FLOAT16S:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for i, init in enumerate(g.initializer):
        if uses_external_data(init):  # one tensor's data at a time
            if base_dir is None:
                raise ValueError(f"initializer {init.name} is external data: the graph's folder is needed")
            load_external_data_for_tensor(init, base_dir)
            init.data_location = TensorProto.DEFAULT
            del init.external_data[:]
        arr = _to_float32(init) if init.data_type in _FLOAT16S else None
        if sink is not None and (arr is not None or init.data_type == TensorProto.FLOAT):
            g.initializer[i].CopyFrom(_write_external(sink, sink_name, init.name,
                                                      numpy_helper.to_array(init) if arr is None else arr))
        elif arr is not None:
            g.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i in _FLOAT16S:
                a.i = TensorProto.FLOAT
    if cache_id is None:
        _cast_scale_buffers(g, _ONNX_SCALE_DTYPES[cfg.scale_dtype])
    else:
        _make_inplace(g, nodes, cache_id)
    del m.opset_import[:]
    m.opset_import.extend([onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(ORT_DOMAIN, 1)])
    return m


def _make_inplace(g: onnx.GraphProto, nodes: list, cache_id: int) -> None:
    """KiviAttention nodes -> KiviAttentionInPlace (7 inputs; outputs out and status; cache_id/layer attributes);
    the cache graph inputs/outputs are dropped."""
    layer_of = {cache_io_names(i)[0][0]: i for i in range(len(nodes))}
    n_bufs = len(BUFFER_NAMES)
    dropped: set[str] = set()
    for n in nodes:
        if n.input[7] not in layer_of:
            raise ValueError(f"{n.name}: cache input {n.input[7]} is not a past.<layer>.k_codes graph input")
        dropped |= set(n.input[7:]) | set(n.output[1:1 + n_bufs])
        n.op_type = INPLACE_OP
        n.attribute.extend([onnx.helper.make_attribute("cache_id", cache_id),
                            onnx.helper.make_attribute("layer", layer_of[n.input[7]])])
        status = n.output[1 + n_bufs]
        del n.input[7:]
        del n.output[1:]
        n.output.append(status)
    for coll in (g.input, g.output, g.value_info):
        keep = [vi for vi in coll if vi.name not in dropped]
        del coll[:]
        coll.extend(keep)


def _cast_scale_buffers(g: onnx.GraphProto, sz: int) -> None:
    """Around every KiviAttention node: Cast its scale/zero inputs to float32 and its outputs back to `sz`."""
    new = []
    for n in g.node:
        if n.op_type != PLUGIN_NAME:
            new.append(n)
            continue
        after = []
        for j, name in enumerate(BUFFER_NAMES):
            if name in _SCALE_BUFFERS:
                i, o = n.input[7 + j], n.output[1 + j]
                new.append(onnx.helper.make_node("Cast", [i], [i + ".f32"], to=TensorProto.FLOAT))
                after.append(onnx.helper.make_node("Cast", [o + ".f32"], [o], to=sz))
                n.input[7 + j], n.output[1 + j] = i + ".f32", o + ".f32"
        new += [n] + after
    del g.node[:]
    g.node.extend(new)


def _to_float32(init: TensorProto) -> np.ndarray:
    if init.data_type == TensorProto.BFLOAT16:  # numpy has no bfloat16: widen the raw bits through torch
        raw = np.frombuffer(init.raw_data, np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).float().numpy().reshape(tuple(init.dims))
    return numpy_helper.to_array(init).astype(np.float32)


def _write_external(f: BinaryIO, location: str, name: str, arr: np.ndarray) -> TensorProto:
    """Append `arr` to the external-data file at a page-aligned offset (onnxruntime may map it); its reference."""
    offset = -(-f.tell() // 4096) * 4096
    f.seek(offset)
    data = np.ascontiguousarray(arr)
    f.write(data.data)  # no copy
    out = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(arr.shape))
    out.data_location = TensorProto.EXTERNAL  # onnx's set_external_data wants the bytes in raw_data: not here
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(data.nbytes))):
        out.external_data.add(key=k, value=v)
    return out


def float32_weight_bytes(m: onnx.ModelProto) -> int:
    """The bytes of the graph's floating-point weights once widened to float32 (from the dims: external data is
    not read)."""
    total = 0
    for init in m.graph.initializer:
        if init.data_type in _FLOAT16S + (TensorProto.FLOAT,):
            total += 4 * int(np.prod(init.dims, dtype=np.int64))
    return total


def session(m: onnx.ModelProto, threads: int | None = None, cache_id: int | None = None,
            base_dir: str | None = None):
    """An onnxruntime CPU session for an exported graph (converted with ort_model; in place with cache_id). Weights
    stored as external data are read from `base_dir`; when they exceed INLINE_LIMIT in float32 the copy goes
    through a file (see the module docstring)."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_ops()
    so = ort.SessionOptions()
    so.register_custom_ops_library(get_library_path())
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep: fair on shared CPUs
    if float32_weight_bytes(m) <= INLINE_LIMIT:
        return ort.InferenceSession(ort_model(m, cache_id, base_dir).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="trtllm-kivi-ort-") as tmp:
        path = Path(tmp) / "model.onnx"
        with open(path.with_name("model.onnx.data"), "wb") as sink:
            om = ort_model(m, cache_id, base_dir, sink, "model.onnx.data")
        onnx.save_model(om, str(path))
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

