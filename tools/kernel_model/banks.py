"""The shared-memory bank model: wavefronts of one warp-wide access from its 32 lane addresses and the access width
of a SASS opcode."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

def wavefronts(addresses: Sequence[int | None], width: int) -> int:
    """Shared-memory wavefronts of one warp-wide access: 32 banks of 4 bytes; lanes reading the same 4-byte word share
    it (broadcast); the request takes as many wavefronts as its most loaded bank has distinct words (an 8- or 16-byte
    access covers 2 or 4 consecutive words, so 32 x 16 B contiguous = 4 wavefronts). None = inactive lane."""
    banks: dict[int, set[int]] = defaultdict(set)
    for a in addresses:
        if a is None:
            continue
        for w in range(a // 4, (a + width - 1) // 4 + 1):
            banks[w % 32].add(w)
    return max((len(s) for s in banks.values()), default=0)

def smem_width(opcode: str) -> int:
    parts = opcode.split(".")
    for p, w in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if p in parts:
            return w
    return 4
