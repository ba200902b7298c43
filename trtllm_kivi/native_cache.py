"""The `cpu` cache backend: KiviCache / FullCache whose attention runs the native CPU kernels (trtllm_kivi.cpu).

Same buffers, bookkeeping and contract as cache.KiviCache / cache.FullCache (the reference op's semantics; stores
bit-exact, attention within tests/test_cpu_native.py's tolerance); only `attention` calls the C++ library. Use
`available()` before constructing one; `cpu_cache_like` converts a fresh cache of either kind.
"""

from __future__ import annotations

import torch

from .cache import FullCache, KiviCache, Step
from .cpu import available
from .cpu.ops import full_attention_cpu_, kivi_attention_cpu_


class NativeKiviCache(KiviCache):
    """KiviCache with the native CPU KiviAttention op (fp32/fp16/bf16 windows, head_dim 64/128)."""

    backend = "cpu"

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        return kivi_attention_cpu_(q.contiguous(), k.contiguous(), v.contiguous(), step.slot_ids, step.past_len,
                                   step.chunk_len, step.block_table, self.layers[layer], self.cfg)


class NativeFullCache(FullCache):
    """FullCache (the unquantized baseline) with the native attention: the same treatment as the KIVI cache."""

    backend = "cpu"

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        return full_attention_cpu_(q.contiguous(), k.contiguous(), v.contiguous(), step.slot_ids, step.past_len,
                                   step.chunk_len, self.k[layer], self.v[layer])


def cpu_cache_like(cache: KiviCache | FullCache) -> NativeKiviCache | NativeFullCache:
    """A fresh native cache with the configuration, geometry and capacity of `cache` (a KiviCache or FullCache)."""
    if not available():
        raise FileNotFoundError("native CPU KIVI library not built: run build_scripts/build_cpu_kernels.sh")
    if cache.device.type != "cpu":
        raise ValueError(f"the native CPU cache needs device cpu, not {cache.device}")
    if isinstance(cache, KiviCache):
        return NativeKiviCache(cache.cfg, cache.geom, cache.max_slots, cache.max_seq_len, cache.dtype, cache.device,
                               cache.num_blocks)
    return NativeFullCache(cache.geom, cache.max_slots, cache.max_seq_len, cache.dtype, cache.device)


__all__ = ["NativeKiviCache", "NativeFullCache", "cpu_cache_like", "available"]
