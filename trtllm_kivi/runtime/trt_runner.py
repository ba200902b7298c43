"""The TensorRT runner: a build folder's engine on a GPU. The runner owns the cache: a KiviCache allocated on the GPU
with torch (the same slot/block bookkeeping as the other runners), whose buffers are bound to the engine's past.*
inputs and, aliased, to its present.* outputs, so the KiviAttention plugin updates them in place. An engine whose
cache outputs are not aliased to their inputs is refused (the plugin never copies a cache pool). Each layer's
status.* output (the kernels' error bits) is checked after every step.

Written against the one TensorRT API of trtllm_kivi.trt (NVIDIA's TensorRT 11 or TensorRT-RTX: ICudaEngine /
IExecutionContext with named I/O tensors and execute_async_v3), with the TensorRT flavour that built the engine; a
TensorRT-RTX engine runs only on a GPU whose compute capability is one of its targets (BuildFolder.
tensorrt_unavailable says why not). Engines are built on the CPU by TensorRT-RTX; running one needs such a GPU, and
none of this project's machines has run one: tests/test_runners_trt.py is marked `trt` and skips without a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch

from ..cache import KiviCache
from ..op import LOGITS, cache_io_names, describe_status, status_name
from ..reference.quant import torch_dtype
from ..trt import find_tensorrt
from .base import CacheRunner
from .build_folder import BuildFolder


class TrtRunner(CacheRunner):
    """Runner over DIR/model.engine (built by `trtllm-kivi build` with TensorRT present)."""

    name = "tensorrt"
    cache: KiviCache

    def __init__(self, build: str | Path | BuildFolder, device: str = "cuda", plugin_lib: str | None = None) -> None:
        folder = build if isinstance(build, BuildFolder) else BuildFolder.open(build)
        why_not = folder.tensorrt_unavailable()
        if why_not:
            raise ValueError(f"cannot run {folder.path} with TensorRT: {why_not}")
        t = find_tensorrt(folder.config["engine"].get("flavour", "tensorrt"))
        self.info = info = folder.info
        self.vocab_size = info.vocab_size
        self.max_slots, self.max_seq_len = info.spec.max_batch_size, info.spec.max_seq_len
        self.max_num_tokens = info.spec.max_num_tokens
        self.device = torch.device(device)

        self._logger = t.logger()
        self._runtime = t.runtime(self._logger)  # host code allowed: the plugin library is embedded in the engine
        if plugin_lib:  # a library given explicitly (e.g. an engine built without embedding) is registered too
            t.load_plugin_library(self._runtime, plugin_lib, self._logger)
        assert folder.engine_path is not None  # tensorrt_unavailable checked it
        self.engine = t.deserialize(self._runtime, folder.engine_path.read_bytes(), self._logger)
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)

        self.cache = KiviCache(info.kivi, info.geometry, self.max_slots, self.max_seq_len,
                               dtype=torch_dtype(info.spec.dtype), device=self.device, num_blocks=info.num_blocks)
        # The plugin updates the cache in place: every present.* must be aliased to its past.* (the plugin refuses
        # separate buffers rather than copying every pool each step).
        get_alias = getattr(self.engine, "get_aliased_input_tensor", lambda name: None)
        unaliased = [pr for layer in range(info.geometry.num_layers) for pa, pr in zip(*cache_io_names(layer), strict=False)
                     if get_alias(pr) != pa]
        if unaliased:
            raise ValueError(f"{folder.path}: the engine's cache outputs are not aliased to their inputs "
                             f"({unaliased[0]} and {len(unaliased) - 1} more); rebuild it with the builder's "
                             f"PreviewFeature.ALIASED_PLUGIN_IO_10_03 (trtllm-kivi build sets it)")
        self._status = torch.zeros((info.geometry.num_layers, 1), dtype=torch.int32, device=self.device)


    @property
    def kv_nbytes(self) -> int:
        return self.cache.nbytes

    def _bind(self, name: str, t: torch.Tensor, input_shape: bool = False) -> None:
        if input_shape and not self.context.set_input_shape(name, tuple(t.shape)):
            raise ValueError(f"input {name} shape {tuple(t.shape)} is outside the engine's optimization profile")
        self.context.set_tensor_address(name, t.data_ptr())

    @property
    def attention_backend(self) -> str:
        return "TensorRT engine (KiviAttention plugin)"

    def step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        self.check_tokens(slots, tokens)
        chunk = [len(t) for t in tokens]
        st = self.cache.begin_step(list(slots), chunk)
        i32: dict[str, Any] = dict(dtype=torch.int32, device=self.device)
        ids = torch.tensor([t for seq in tokens for t in seq], **i32)  # [T]
        positions = torch.cat([torch.arange(p, p + c, **i32) for p, c in zip(st.past, chunk, strict=True)])  # [T]
        rows = (torch.arange(len(ids), **i32) if all_logits
                else torch.tensor(chunk, **i32).cumsum(0, dtype=torch.int32) - 1)  # [B] or [T]
        inputs = {"input_ids": ids, "positions": positions, "slot_ids": st.slot_ids, "past_len": st.past_len,
                  "chunk_len": st.chunk_len, "block_table": st.block_table.contiguous(), "logit_rows": rows}
        for name, t in inputs.items():
            self._bind(name, t, input_shape=True)
        for layer, bufs in enumerate(self.cache.layers):
            past, present = cache_io_names(layer)
            for pa, pr, t in zip(past, present, bufs, strict=False):
                self._bind(pa, t, input_shape=True)
                self._bind(pr, t)  # aliased: updated in place
            self._bind(status_name(layer), self._status[layer])
        logits = torch.empty((len(rows), self.vocab_size), dtype=torch.float32, device=self.device)
        self._bind(LOGITS, logits)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were made on the current stream
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the log above)")
        self.stream.synchronize()
        self._check_status(st)
        self.cache.end_step(st)
        return logits

    def _check_status(self, st) -> None:
        """Raise if any layer's KiviAttention skipped a sequence (its status bits are nonzero). The runner checked
        capacity before the step, so this is a bug: the step's sequences must be freed (the skipped ones were not
        appended, the others were)."""
        status = self._status[:, 0].tolist()  # [layers]; the stream is synchronized
        bad = [(layer, bits) for layer, bits in enumerate(status) if bits]
        if bad:
            layer, bits = bad[0]
            raise RuntimeError(f"KiviAttention skipped sequences of slots {st.slots} in {len(bad)} layer(s) (first: "
                               f"layer {layer}, status {bits:#x}: {describe_status(bits)}); free these sequences")
