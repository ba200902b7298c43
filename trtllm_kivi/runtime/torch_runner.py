"""TorchRunner: the PyTorch Llama (trtllm_kivi.models) over a KiviCache or FullCache behind runtime/base.py's Runner.

A step concatenates the chunks of all listed sequences into one token batch (no padding), so every matmul runs once
per step for the whole batch and only attention goes per sequence (inside the cache)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache import KiviCache, KVCache
from ..models.llama import LlamaModel
from .base import CacheRunner


class TorchRunner(CacheRunner):
    name = "torch"

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        if cache.geom != model.cfg.geometry:
            raise ValueError(f"cache geometry {cache.geom} does not match the model's {model.cfg.geometry}")
        if isinstance(cache, KiviCache) and cache.dtype != model.dtype:  # the op needs q/k/v in the window dtype
            raise ValueError(f"KIVI cache window dtype {cache.dtype} must equal the model dtype {model.dtype}")
        if cache.device.type != model.device.type:
            raise ValueError(f"cache device {cache.device} differs from the model device {model.device}")
        self.model, self.cache = model, cache
        self.vocab_size = model.cfg.vocab_size
        self.max_slots, self.max_seq_len = cache.max_slots, cache.max_seq_len

    @classmethod
    def create(cls, model: LlamaModel, kv, max_slots: int, max_seq_len: int, **cache_kwargs) -> TorchRunner:
        """Runner with a fresh cache from a KV spec (runtime.kvspec.KVSpec or a string such as "kivi2");
        cache_kwargs go to KVSpec.make_cache (num_blocks, backend)."""
        from .kvspec import resolve_kv

        spec = resolve_kv(kv, num_layers=model.cfg.geometry.num_layers)[0]
        cache = spec.make_cache(model.cfg.geometry, max_slots, max_seq_len, model.dtype, model.device,
                                **cache_kwargs)
        return cls(model, cache)

    def step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        self.check_tokens(slots, tokens)
        chunk = [len(t) for t in tokens]
        flat = [int(t) for seq in tokens for t in seq]
        step = self.cache.begin_step(slots, chunk)  # validates capacity; nothing changes on error
        dev = self.model.device
        ids = torch.tensor(flat, dtype=torch.long, device=dev)  # [T]
        positions = torch.cat([torch.arange(s, s + c) for s, c in zip(step.past, chunk, strict=False)]).to(dev)  # [T]
        rows = None if all_logits else torch.tensor(chunk, device=dev).cumsum(0) - 1  # each chunk's last token
        with torch.inference_mode():
            logits = self.model(ids, positions, self.cache, step, rows)  # fp32 [T or B, vocab]
        self.cache.end_step(step)
        return logits
