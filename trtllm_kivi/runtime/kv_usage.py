"""How full a runner's KV cache is, and how many pool blocks a sequence of n tokens takes: what the scheduler's
admission control reserves and what serving exports as metrics. Uses the Runner interface (kivi_config,
free_blocks, free_slots, kv_nbytes) and, for a runner with a block pool, its cache's num_blocks and buffers (a
KiviCache); an unquantized cache has slots but no blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Runner


@dataclass(frozen=True)
class KVUsage:
    slots_total: int
    slots_in_use: int
    blocks_total: int  # quantized-store blocks in the pool (0: an unquantized cache, no pool)
    blocks_in_use: int
    bytes_total: int  # KV buffers allocated (runner.kv_nbytes)
    bytes_in_use: int  # the blocks in use + the full-precision windows (or rows) of the slots in use


def _pool(runner: Runner):
    """The block-pool cache of a runner (a KiviCache: runner.free_blocks is not None), else None."""
    if runner.free_blocks is None:
        return None
    return runner.cache  # type: ignore[attr-defined]  # every runner with a pool is a CacheRunner


def blocks_total(runner: Runner) -> int:
    c = _pool(runner)
    return 0 if c is None else c.num_blocks


def blocks_for(runner: Runner, num_tokens: int) -> int:
    """Pool blocks a sequence holds once num_tokens tokens are stored (0 without a pool)."""
    cfg = runner.kivi_config
    if cfg is None or runner.free_blocks is None:
        return 0
    return math.ceil(cfg.num_quantized(num_tokens) / cfg.block_size)


def max_tokens_in_blocks(runner: Runner, blocks: int) -> int:
    """The longest sequence (<= runner.max_seq_len) whose blocks fit in `blocks` pool blocks."""
    lo, hi = 0, runner.max_seq_len  # blocks_for is monotone in the token count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for(runner, mid) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def kv_usage(runner: Runner) -> KVUsage:
    total_bytes = runner.kv_nbytes
    slots_used = runner.max_slots - runner.free_slots
    pool = _pool(runner)
    if pool is None:  # FullCache: every slot owns max_seq_len rows
        return KVUsage(runner.max_slots, slots_used, 0, 0, total_bytes,
                       total_bytes * slots_used // max(1, runner.max_slots))
    used = pool.num_blocks - pool.free_blocks
    # per-block and per-slot bytes from the buffers' leading dims (blocks for the store, slots for the windows)
    block_bytes = slot_bytes = 0
    for layer in pool.layers:
        for name, t in zip(layer._fields, layer):
            per = t.numel() * t.element_size() // t.shape[0]
            if name.endswith("_window"):
                slot_bytes += per
            else:
                block_bytes += per
    return KVUsage(runner.max_slots, slots_used, pool.num_blocks, used, total_bytes,
                   used * block_bytes + slots_used * slot_bytes)


__all__ = ["KVUsage", "blocks_for", "blocks_total", "kv_usage", "max_tokens_in_blocks"]
