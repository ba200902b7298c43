"""Prefix sharing: a prompt prefix's stored state, computed once, reused by every request whose prompt starts with it.

What a prefix's state is. After T tokens a KIVI sequence holds (docs/design.md, streaming semantics) the sinks [0,
S) and the ring's tokens [S + n_q(T), T) in full precision (its slot's window) and the n_q(T) tokens between them
quantized in pool blocks of block_size (bs) tokens. The state is a pure function of the tokens' K/V, and the K/V of
token t are a function of tokens [0, t] and of where the chunks that computed them were split (a chunk attends to
its own tokens in full precision, to earlier ones as stored). So the state after T tokens is fixed by the tokens [0,
T) and the chunk boundaries below T.

Which part is immutable blocks. A block is complete once its bs tokens are quantized; the sequence never writes it
again (later flushes go to later blocks). The window is not: its ring is rewritten as the sequence grows, so it is
no shareable block. The boundaries where a state is *exactly* whole blocks plus a window are
    b_k = S + R + k * bs   (k >= 1):   n_q(b_k) = k * bs (bs is a multiple of G),
a state of k complete blocks (tokens [S, S + k bs)), the S sinks and a ring of exactly R tokens [S + k bs, b_k).

How a request gets exactly the state of its prompt split at b_k. With prefix caching on, the scheduler ends a
prompt chunk at every boundary b_k (runtime/scheduler.py: chunk ends are a function of the position alone, so a
request that starts at b_k continues with the same chunks as one that prefilled [0, b_k) itself). When a request's
prefill ends at b_k, this index keeps (1) its block k-1, by reference (refcount, never copied), keyed by a hash of
the tokens [0, b_k) chained block by block (h_k = H(h_{k-1}, tokens [b_{k-1}, b_k)), b_0 = 0: position-exact, a
prefix at another offset never matches), and (2) a copy of its S + R full-precision rows at b_k (a "window
snapshot", a fixed-size store with its own LRU). A later request whose prompt hashes to h_1 .. h_k (and has at least
one token after b_k, whose logits it needs) gets blocks 0..k-1 into its block table (one more reference each), the
snapshot written to its window rows, and length b_k: bit for bit the state of its own prompt prefilled in chunks
ending at b_k; it prefills only [b_k, P). Its tokens are therefore those of the same prompt prefilled alone with a
chunk boundary at b_k (tests/test_prefix_cache.py, greedy, bit-exact: kivi2, kivi4, kivi2+sink4+had, fp16). They are
not those of one unsplit prefill: a chunk boundary changes which tokens a later query reads quantized; that cost is
measured (benchmarks/bench_serving_prefix.py: greedy agreement over 50+ prompts), not hidden.

The unquantized cache (fp16/bf16/fp32) stores a sequence's rows contiguously per slot (what its attention kernels
read), so its "blocks" are copies: b_k = k * bs, entry k holds rows [b_{k-1}, b_k) of every layer, and a hit copies
entries 1..k into the new sequence's rows (exact for the same reason).

Eviction. A cached block no live sequence holds is evictable; the pool's allocator (KiviCache.begin_step) takes free
blocks first and then asks `evict` for more, least recently used first, never a block a live sequence holds (it is
not evictable while its refcount is > 0). Within a chain the deeper entries are used less recently (a hit touches
the chain deepest-first), so eviction trims a prefix from its end. Snapshots and unquantized entries are copies
nobody references after the copy: their store evicts least recently used when full.

Decode-time tokens are never cached: a token decoded one at a time is not the state of a prefill split at b_k.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Sequence

import torch

from ..cache import FullCache, KiviCache, KVCache
from ..format import DEFAULT_BLOCK_SIZE


@dataclass
class _Entry:
    block: int | None  # KIVI: the pool block k-1 (complete); None for the unquantized cache
    row: int | None = None  # index into the full-precision store: KIVI window snapshot at b_k, or the rows of entry k


@dataclass
class Match:
    """The longest usable cached prefix of a prompt: `depth` entries, `tokens` = b_depth tokens."""

    depth: int = 0
    tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # h_1 .. h_depth
    blocks: list[int] = field(default_factory=list)  # KIVI pool blocks 0..depth-1
    revived: int = 0  # of those, blocks no live sequence holds now (admission counts them as newly used)


def chain_hashes(tokens: Sequence[int], bounds: Sequence[int]) -> list[bytes]:
    """h_k for each boundary b_k in `bounds` (increasing): h_k = H(h_{k-1}, tokens [b_{k-1}, b_k)), b_0 = 0."""
    out: list[bytes] = []
    prev, start = b"trtllm-kivi prefix", 0
    for b in bounds:
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", tokens[start:b]).tobytes())
        prev, start = h.digest(), b
        out.append(prev)
    return out


class PrefixCache:
    """The index of cached prefixes of one runner's cache (a KiviCache or a FullCache); `capacity` = entries of the
    full-precision store (KIVI window snapshots of S + R rows, or unquantized blocks of bs rows)."""

    def __init__(self, cache: KVCache, capacity: int | None = None) -> None:
        self.cache = cache
        if isinstance(cache, KiviCache):
            cfg = cache.cfg
            self.kivi = True
            self.bs, self.base = cfg.block_size, cfg.sink_tokens + cfg.residual_length
            rows = self.base  # S sinks + a ring of exactly R tokens at every boundary
            default = 2 * cache.max_slots
            cache.reclaim = self.evict
        elif isinstance(cache, FullCache):
            self.kivi = False
            self.bs, self.base, rows = DEFAULT_BLOCK_SIZE, 0, DEFAULT_BLOCK_SIZE
            default = 2 * cache.max_slots * cache.max_seq_len // DEFAULT_BLOCK_SIZE // 4
        else:
            raise TypeError(f"prefix sharing needs a KiviCache or FullCache, not {type(cache).__name__}")
        self.capacity = max(1, default if capacity is None else capacity)
        g = cache.geom
        shape = (self.capacity, g.num_kv_heads, rows, g.head_dim)
        self._k = [torch.zeros(shape, dtype=cache.dtype, device=cache.device) for _ in range(g.num_layers)]
        self._v = [torch.zeros(shape, dtype=cache.dtype, device=cache.device) for _ in range(g.num_layers)]
        self._free_rows = list(range(self.capacity - 1, -1, -1))
        self._row_owner: OrderedDict[int, bytes] = OrderedDict()  # store row -> entry hash, least recent first
        self.index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.queries = self.hits = self.hit_tokens = self.evictions = 0  # counters (metrics)

    # ------------------------------------------------------------------------------------------ boundaries

    def boundary(self, k: int) -> int:
        """b_k: the k-th position (k >= 1) where a prefix's state is whole blocks + a full-precision window."""
        return self.base + k * self.bs

    def next_boundary(self, pos: int) -> int:
        """The first boundary b_k > pos."""
        k = max(1, (pos - self.base) // self.bs + 1)
        return self.boundary(k)

    def bounds(self, n: int) -> list[int]:
        """Boundaries b_k <= n."""
        return [self.boundary(k) for k in range(1, (n - self.base) // self.bs + 1)] if n >= self.boundary(1) else []

    # ------------------------------------------------------------------------------------------ lookup / reuse

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    @property
    def cached_blocks(self) -> int:
        """KIVI pool blocks kept by the index (entries for the unquantized cache)."""
        return len(self.index)

    def match(self, prompt: Sequence[int], hashes: list[bytes] | None = None) -> Match:
        """The longest cached prefix of `prompt` that leaves at least one token to prefill."""
        hashes = chain_hashes(prompt, self.bounds(len(prompt) - 1)) if hashes is None else hashes
        best = Match()
        for k, h in enumerate(hashes, start=1):
            e = self.index.get(h)
            if e is None:
                break
            if not self.kivi or e.row is not None:  # a KIVI state needs the window snapshot at b_k too
                best = Match(k, self.boundary(k), hashes[:k])
        if best.depth and self.kivi:
            c = self.cache
            assert isinstance(c, KiviCache)
            best.blocks = [self.index[h].block for h in best.hashes]  # type: ignore[misc]
            best.revived = sum(c.block_refs(b) == 0 for b in best.blocks)
        return best

    def attach(self, slot: int, m: Match) -> None:
        """Give the empty sequence in `slot` the matched prefix's exact state (see the module doc)."""
        self.queries += 1
        if not m.depth:
            return
        c = self.cache
        if isinstance(c, KiviCache):
            c.adopt_prefix(slot, m.blocks, m.tokens)
            row = self.index[m.hashes[-1]].row
            rows = c.window_rows(slot)
            for layer, buf in enumerate(c.layers):
                buf.k_window[slot][:, rows] = self._k[layer][row]
                buf.v_window[slot][:, rows] = self._v[layer][row]
        else:
            assert isinstance(c, FullCache)
            for k, h in enumerate(m.hashes):
                row, a = self.index[h].row, k * self.bs
                for layer in range(len(c.k)):
                    c.k[layer][slot, :, a:a + self.bs] = self._k[layer][row]
                    c.v[layer][slot, :, a:a + self.bs] = self._v[layer][row]
            c.adopt_prefix(slot, m.tokens)
        self._touch(m.hashes)
        self.hits += 1
        self.hit_tokens += m.tokens

    def register(self, slot: int, hashes: list[bytes], length: int) -> None:
        """A prefill chunk of the sequence in `slot` ended at `length`; when that is a boundary b_k, keep its state
        there under hashes[k-1] (hashes: the prompt's chain, h_1 ..)."""
        k = (length - self.base) // self.bs
        if k < 1 or self.boundary(k) != length or k > len(hashes):
            return
        h = hashes[k - 1]
        e = self.index.get(h)
        c = self.cache
        if isinstance(c, KiviCache):
            if e is None:
                blk = c.blocks_of(slot)[k - 1]
                e = self.index[h] = _Entry(blk)
                c.set_cached(blk, True)
            if e.row is None:  # (a duplicate prefill keeps its own block private: it is freed with it)
                e.row = self._take_row(h)
                if e.row is not None:
                    rows = c.window_rows(slot)
                    for layer, buf in enumerate(c.layers):
                        self._k[layer][e.row] = buf.k_window[slot][:, rows]
                        self._v[layer][e.row] = buf.v_window[slot][:, rows]
        elif e is None:
            assert isinstance(c, FullCache)
            row = self._take_row(h)
            if row is None:
                return
            a = length - self.bs
            for layer in range(len(c.k)):
                self._k[layer][row] = c.k[layer][slot, :, a:length]
                self._v[layer][row] = c.v[layer][slot, :, a:length]
            self.index[h] = _Entry(None, row)
        self._touch(hashes[:k])

    # ------------------------------------------------------------------------------------------ LRU

    def _touch(self, hashes: list[bytes]) -> None:
        """Most recently used: the chain's shallowest entry last (eviction trims chains from their deep end)."""
        for h in reversed(hashes):
            if h in self.index:
                self.index.move_to_end(h)
                row = self.index[h].row
                if row is not None:
                    self._row_owner.move_to_end(row)

    def _take_row(self, owner: bytes) -> int | None:
        """A store row for a new copy: a free one, else the least recently used one (its entry loses it)."""
        if not self._free_rows:
            if not self._row_owner:
                return None
            row, old = self._row_owner.popitem(last=False)
            e = self.index.get(old)
            if e is not None:
                e.row = None
                if not self.kivi:  # an unquantized entry is its rows
                    del self.index[old]
                    self.evictions += 1
            self._free_rows.append(row)
        row = self._free_rows.pop()
        self._row_owner[row] = owner
        return row

    def evict(self, n: int) -> int:
        """Free up to n KIVI pool blocks: drop least recently used entries whose block no live sequence holds.
        Returns how many were freed."""
        c = self.cache
        if not isinstance(c, KiviCache):
            return 0
        freed = 0
        for h in list(self.index):
            if freed >= n:
                break
            e = self.index[h]
            if e.block is None or c.block_refs(e.block) > 0:  # in use: never evicted
                continue
            del self.index[h]
            if e.row is not None:
                del self._row_owner[e.row]
                self._free_rows.append(e.row)
            c.set_cached(e.block, False)
            freed += 1
            self.evictions += 1
        return freed

    def clear(self) -> None:
        """Forget every entry (blocks nobody holds go back to the pool)."""
        for h in list(self.index):
            e = self.index.pop(h)
            if e.block is not None:
                assert isinstance(self.cache, KiviCache)
                self.cache.set_cached(e.block, False)
        self._row_owner.clear()
        self._free_rows = list(range(self.capacity - 1, -1, -1))


__all__ = ["Match", "PrefixCache", "chain_hashes"]
