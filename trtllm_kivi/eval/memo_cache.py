"""Moved: the memoized history is KiviCache's `memo` attention backend (trtllm_kivi.cache.MemoBackend).
MemoKiviCache is kept for one release as a KiviCache that always uses it; tests/test_cache_backends.py is its test."""

from __future__ import annotations

from ..cache import KiviCache


class MemoKiviCache(KiviCache):
    """KiviCache(..., backend="memo")."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["backend"] = "memo"
        super().__init__(*args, **kwargs)

    @classmethod
    def like(cls, cache: KiviCache) -> MemoKiviCache:
        """A fresh MemoKiviCache with the same configuration, geometry and capacity as `cache`."""
        return cls(cache.cfg, cache.geom, cache.max_slots, cache.max_seq_len, cache.dtype, cache.device,
                   cache.num_blocks)


__all__ = ["MemoKiviCache"]
