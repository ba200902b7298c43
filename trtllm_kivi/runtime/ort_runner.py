"""The onnxruntime runner: an exported graph (trtllm_kivi.builder) on the CPU, its KiviAttention nodes running the
op (runtime.ort_session: native CPU kernels when built, else the reference op). The runner owns the cache as a
KiviCache (same slot/block bookkeeping as the torch runner); the session's attention nodes update its buffers in
place (ort_session's in-place form: no per-step copy of the cache through onnxruntime).
What the graph was built for comes from an op.GraphInfo (a build folder's build_config.json), checked against the
graph's node attributes."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

import numpy as np
import onnx
import torch

from ..cache import KiviCache, Step
from ..op import FIELD_NAMES, LOGITS, PLUGIN_NAME, GraphInfo
from .base import CacheRunner
from .ort_session import native_op, register_cache, session, unregister_cache


def step_feeds(st: Step, tokens: Sequence[Sequence[int]], all_logits: bool) -> dict[str, np.ndarray]:
    """The step inputs of the graph (op.STEP_INPUTS: everything but the cache) for a cache Step and its tokens."""
    ids = np.array([t for seq in tokens for t in seq], np.int32)
    pos = np.concatenate([np.arange(p, p + c, dtype=np.int32) for p, c in zip(st.past, st.chunk, strict=True)])
    ends = np.cumsum(st.chunk).astype(np.int32)
    rows = np.arange(len(ids), dtype=np.int32) if all_logits else ends - 1
    return {"input_ids": ids, "positions": pos, "slot_ids": st.slot_ids.cpu().numpy(),
            "past_len": st.past_len.cpu().numpy(), "chunk_len": st.chunk_len.cpu().numpy(),
            "block_table": st.block_table.cpu().numpy(), "logit_rows": rows}


class OrtRunner(CacheRunner):
    """Runner over an exported graph (path or ModelProto) with onnxruntime on the CPU (fp32 activations)."""

    name = "onnxruntime"
    cache: KiviCache

    def __init__(self, graph: str | Path | onnx.ModelProto, info: GraphInfo, threads: int | None = None) -> None:
        # a path is read without its weights here; session() streams them (a 1.5B model's are 7 GB in float32)
        m = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
        nodes = [n for n in m.graph.node if n.op_type == PLUGIN_NAME]
        if not nodes:
            raise ValueError(f"the graph has no {PLUGIN_NAME} node; is it a trtllm-kivi export?")
        if len(nodes) != info.geometry.num_layers:
            raise ValueError(f"the graph has {len(nodes)} {PLUGIN_NAME} nodes; its build config says "
                             f"num_layers={info.geometry.num_layers}")
        for i, n in enumerate(nodes):  # each node records its layer's rotation codes
            info.check_node_fields({a.name: a.i for a in n.attribute if a.name in FIELD_NAMES}, f"node {n.name}", i)
        self.info = info
        self.vocab_size = info.vocab_size
        self.max_slots, self.max_seq_len = info.spec.max_batch_size, info.spec.max_seq_len
        self.max_num_tokens = info.spec.max_num_tokens
        # The graph's cache shapes fix the pool: the same KiviCache the torch runner uses, with fp32 windows.
        self.cache = KiviCache(info.kivi, info.geometry, self.max_slots, self.max_seq_len, dtype=torch.float32,
                               num_blocks=info.num_blocks)
        self._cache_id = register_cache(self.cache.layers)
        base_dir = None if isinstance(graph, onnx.ModelProto) else str(Path(graph).resolve().parent)
        self.session = session(m, threads, self._cache_id, base_dir)
        self._outputs = [o.name for o in self.session.get_outputs()]

    def __del__(self) -> None:
        unregister_cache(getattr(self, "_cache_id", 0))

    @property
    def attention_backend(self) -> str:
        native = native_op(self.cache.geom.head_dim) is not None
        return f"onnxruntime graph ({'native CPU op' if native else 'reference op'}, cache updated in place)"

    def step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        self.check_tokens(slots, tokens)
        st = self.cache.begin_step(list(slots), [len(t) for t in tokens])
        feeds = step_feeds(st, tokens, all_logits)
        outs = dict(zip(self._outputs, self.session.run(None, feeds), strict=True))  # cache updated in place
        self.cache.end_step(st)
        return torch.from_numpy(outs[LOGITS])


__all__ = ["OrtRunner", "step_feeds"]
