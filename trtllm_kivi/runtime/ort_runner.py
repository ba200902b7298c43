"""The onnxruntime runner: an exported graph (trtllm_kivi.builder) on the CPU, its KiviAttention nodes running the
reference op. The runner owns the cache as a KiviCache (same slot/block bookkeeping as the torch runner), feeds every
buffer to the graph as past.* each step and copies the present.* outputs back into it."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import torch

from ..builder.onnx_export import ExportSpec, cache_io_names, model_metadata
from ..builder.ort_check import session
from ..cache import KiviCache
from ..format import FORMAT_VERSION, Geometry, KiviConfig
from ..plugin import FIELD_NAMES, PLUGIN_NAME, config_from_fields
from .base import CacheRunner


def graph_geometry(m: onnx.ModelProto) -> tuple[KiviConfig, Geometry, ExportSpec, dict]:
    """(KiviConfig, Geometry, ExportSpec, metadata) of an exported graph; refuses another FORMAT_VERSION."""
    meta = model_metadata(m)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"graph format_version={meta.get('format_version')} does not match this package's "
                         f"FORMAT_VERSION={FORMAT_VERSION}; rebuild it")
    nodes = [n for n in m.graph.node if n.op_type == PLUGIN_NAME]
    if not nodes:
        raise ValueError(f"the graph has no {PLUGIN_NAME} node; is it a trtllm-kivi export?")
    cfg = KiviConfig.from_dict(meta["kivi_config"])  # the whole config, per-layer rotations included
    for i, node in enumerate(nodes):  # each node records its layer's format; it must be the metadata's
        node_cfg, h, hkv, d = config_from_fields({a.name: a.i for a in node.attribute if a.name in FIELD_NAMES})
        if node_cfg != cfg.for_layer(i):
            raise ValueError(f"graph node {node.name}: fields {node_cfg} disagree with the graph's kivi_config for "
                             f"layer {i} ({cfg.for_layer(i)})")
    return cfg, Geometry(meta["num_layers"], h, hkv, d), ExportSpec(**meta["export"]), meta


def step_feeds(st, tokens: Sequence[Sequence[int]], all_logits: bool) -> dict[str, np.ndarray]:
    """The step inputs of the graph (everything but the cache) for a cache Step and its tokens."""
    ids = np.array([t for seq in tokens for t in seq], np.int32)
    pos = np.concatenate([np.arange(p, p + c, dtype=np.int32) for p, c in zip(st.past, st.chunk)])
    ends = np.cumsum(st.chunk).astype(np.int32)
    rows = np.arange(len(ids), dtype=np.int32) if all_logits else ends - 1
    return {"input_ids": ids, "positions": pos, "slot_ids": st.slot_ids.cpu().numpy(),
            "past_len": st.past_len.cpu().numpy(), "chunk_len": st.chunk_len.cpu().numpy(),
            "block_table": st.block_table.cpu().numpy(), "logit_rows": rows}


class OrtRunner(CacheRunner):
    """Runner over an exported graph (path or ModelProto) with onnxruntime on the CPU (fp32 activations)."""

    name = "onnxruntime"

    def __init__(self, graph: str | Path | onnx.ModelProto, threads: int | None = None) -> None:
        m = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph))
        self.cfg, self.geom, self.spec, meta = graph_geometry(m)
        self.vocab_size = meta["vocab_size"]
        self.max_slots, self.max_seq_len = self.spec.max_batch_size, self.spec.max_seq_len
        # The graph's cache shapes fix the pool: the same KiviCache the torch runner uses, with fp32 windows.
        self.cache = KiviCache(self.cfg, self.geom, self.max_slots, self.max_seq_len, dtype=torch.float32,
                               num_blocks=meta["num_blocks"])
        if self.cache.max_blocks_per_seq != meta["max_blocks_per_seq"]:
            raise ValueError(f"graph block table width {meta['max_blocks_per_seq']} != KiviCache's "
                             f"{self.cache.max_blocks_per_seq}")
        self.session = session(m, threads)
        self._outputs = [o.name for o in self.session.get_outputs()]


    def step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        self.check_tokens(slots, tokens, self.spec.max_num_tokens)
        st = self.cache.begin_step(list(slots), [len(t) for t in tokens])
        feeds = step_feeds(st, tokens, all_logits)
        for layer, bufs in enumerate(self.cache.layers):
            past, _ = cache_io_names(layer)
            feeds |= {n: t.numpy() for n, t in zip(past, bufs)}
        outs = dict(zip(self._outputs, self.session.run(None, feeds)))
        for layer, bufs in enumerate(self.cache.layers):  # present.* -> the runner's buffers
            _, present = cache_io_names(layer)
            for n, t in zip(present, bufs):
                np.copyto(t.numpy(), outs[n])  # numpy: single-threaded, no torch thread-pool start-up per copy
        self.cache.end_step(st)
        return torch.from_numpy(outs["logits"])


__all__ = ["OrtRunner", "graph_geometry", "step_feeds"]
