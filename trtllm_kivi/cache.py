"""Streaming KV caches a runner uses: the KIVI cache (block pool + block tables + per-slot windows) and an
unquantized cache with the same interface as the baseline, both behind one interface (KVCache).

A runner drives one model step as:

    step = cache.begin_step(slots, chunk_lens)   # validates capacity, assigns blocks; changes nothing on error
    for layer in range(L):
        out = cache.attention(layer, q, k, v, step)   # attend, then append (the KiviAttention op, in place)
    cache.end_step(step)                         # advances the sequence lengths

All buffers are preallocated for the capacity given at construction; nothing grows by concatenation.

`cache.attention` is the one attention entry point; an attention backend computes it (BACKENDS):
    reference  the executable spec (reference.kivi_attention_): dequantizes the whole history every step
    memo       reference append + memoized dequantized history: bit-identical to reference (CPU fallback)
    cpu        the native CPU kernels through their C ABI (cpu.ops): the default on the CPU when built
    cuda       the CUDA kernels through their C ABI (cuda.ops): the default on a CUDA device
default_backend(device) picks the fastest one available.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .format import Geometry, KiviConfig
from .reference.attention import (KiviBuffers, _blocks_of, _rows, append, attend, check_step, full_precision_rows,
                                  history, kivi_attention_)
from .reference.kv import dequantize_keys, dequantize_values
from .reference.quant import torch_dtype

if TYPE_CHECKING:
    from .cpu.ops import FullCpuAttention, KiviCpuAttention


class CacheCapacityError(ValueError):
    """A step would need more tokens, blocks or slots than the cache was allocated for."""


class KVRangeError(ValueError):
    """K/V values the cache cannot store: non-finite, or beyond the range of its scale/zero (or fp16 storage) dtype."""


def check_kv_range(layer: int, k: torch.Tensor, v: torch.Tensor, store_dtype: torch.dtype, what: str) -> None:
    """Refuse K/V that would be stored as inf/NaN (KVRangeError naming the layer, the value and the fix) instead of
    letting them poison attention silently. A KIVI group stores zero = min and scale = (max - min) / (2^b - 1):
    with every |x| <= the dtype's max both stay finite for b >= 2, so one amax per layer and step is the check
    (tests/test_kv_range.py). CPU tensors only: on a GPU the check would be a host synchronization per layer and
    step, and impossible inside a captured CUDA graph (runtime/cuda_graph.py); there the kernels keep the format's
    contract instead (an overflowing group's stored scale/zero is non-finite, so attention over it gives NaN, never
    silently finite values), and `eval --recommend` chooses the scale dtype from the calibration's K/V range."""
    if store_dtype == torch.float32 or k.numel() == 0 or k.device.type != "cpu":
        return
    limit = torch.finfo(store_dtype).max
    mk, mv = (torch.linalg.vector_norm(x.detach(), float("inf")).item() for x in (k, v))  # max |x|; NaN stays NaN
    for name, m in (("K", mk), ("V", mv)):
        if not m <= limit:  # also catches NaN
            fix = ("--scale-dtype bfloat16 or float32 (KIVI scales/zeros in a wider dtype)" if "scale" in what
                   else "a bf16 or fp32 cache (--kv bf16 / fp32)")
            raise KVRangeError(f"layer {layer}: |{name}| reaches {m:.4g}, beyond the range of the {what} "
                               f"({str(store_dtype).replace('torch.', '')}, max {limit:.6g}); stored it would "
                               f"become inf/NaN. Use {fix}")


@dataclass
class Step:
    """One model step's batch: sequence b owns slot slots[b] and covers positions [past[b], past[b] + chunk[b])."""

    slots: list[int]
    past: list[int]
    chunk: list[int]
    slot_ids: torch.Tensor  # [B] int32
    past_len: torch.Tensor  # [B] int32
    chunk_len: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32 (unused for the unquantized cache)

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk)


class KVCache(ABC):
    """The interface of both caches (slot bookkeeping here; storage and attention in the subclasses)."""

    kivi_config: KiviConfig | None = None  # None: unquantized

    def __init__(self, geom: Geometry, max_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        if max_slots <= 0:
            raise ValueError(f"max_slots={max_slots} must be >= 1")
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype={dtype} is not supported; allowed: float16, bfloat16, float32")
        self.geom, self.max_slots, self.max_seq_len = geom, max_slots, max_seq_len
        self.dtype, self.device = dtype, torch.device(device)
        self.seq_lens = [0] * max_slots
        self.active = [False] * max_slots

    def add_sequence(self) -> int:
        """Assign a free slot to a new (empty) sequence and return it."""
        for slot, used in enumerate(self.active):
            if not used:
                self.active[slot] = True
                self.seq_lens[slot] = 0
                return slot
        raise CacheCapacityError(f"all {self.max_slots} sequence slots are in use")

    def free_sequence(self, slot: int) -> None:
        self._check_slot(slot)
        self.active[slot] = False
        self.seq_lens[slot] = 0

    def seq_len(self, slot: int) -> int:
        self._check_slot(slot)
        return self.seq_lens[slot]

    @property
    def free_slots(self) -> int:
        return self.active.count(False)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or not self.active[slot]:
            raise ValueError(f"slot {slot} is not an active sequence slot (slots 0..{self.max_slots - 1})")

    def _check_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> None:
        if len(slots) != len(chunk_lens) or not slots:
            raise ValueError(f"slots ({len(slots)}) and chunk_lens ({len(chunk_lens)}) must be equal, non-empty")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {list(slots)} must be distinct within a step")
        for slot, c in zip(slots, chunk_lens, strict=True):
            self._check_slot(slot)
            if c < 0:
                raise ValueError(f"chunk length {c} for slot {slot} must be >= 0")
            if self.seq_lens[slot] + c > self.max_seq_len:
                raise CacheCapacityError(f"slot {slot}: {self.seq_lens[slot]} + {c} tokens exceeds the cache "
                                         f"capacity max_seq_len={self.max_seq_len}")

    def _make_step(self, slots: Sequence[int], chunk_lens: Sequence[int], block_table: torch.Tensor) -> Step:
        past = [self.seq_lens[s] for s in slots]
        def i32(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=self.device)

        return Step(list(slots), past, list(chunk_lens), i32(list(slots)), i32(past), i32(list(chunk_lens)),
                    block_table)

    def end_step(self, step: Step) -> None:
        """Advance the lengths of the step's sequences (after every layer ran)."""
        for slot, c in zip(step.slots, step.chunk, strict=True):
            self.seq_lens[slot] += c

    @property
    def free_blocks(self) -> int | None:
        """Quantized-store blocks still free (None: an unquantized cache has no block pool)."""
        return None

    @property
    def backend_name(self) -> str:
        """The attention backend's name ("torch" for the unquantized cache's plain torch attention)."""
        return "torch"

    @abstractmethod
    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        """Validate a step and reserve what it needs; on error nothing changes."""

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """q [tokens, H, D], k/v [tokens, Hkv, D] -> out [tokens, H, D]; appends k/v to the layer's state."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes allocated for the cache buffers."""

    @abstractmethod
    def dequantized(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-precision view of a sequence's stored K/V [Hkv, T, D] (history as attention sees it)."""

    def rotations(self, layer: int) -> tuple[str, str]:
        """(k_rotation, v_rotation) of a layer (format.py): what the model applies around attention."""
        return "none", "none"


# ---------------------------------------------------------------------------------------------- attention backends


class AttentionBackend(ABC):
    """Computes KiviCache.attention (attend, then append: the KiviAttention op, in place) for one cache."""

    name: str

    def __init__(self, cache: KiviCache) -> None:
        self.cache = cache

    @classmethod
    def unavailable(cls, cfg: KiviConfig, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot serve `cfg` with `dtype` activations on `device` (None: it can)."""
        return None

    @abstractmethod
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        ...

    def free(self, slot: int) -> None:  # noqa: B027  (optional hook: most backends keep no per-sequence state)
        """The sequence in `slot` was freed (drop any per-sequence state)."""


class ReferenceBackend(AttentionBackend):
    """The executable spec: reference.kivi_attention_ (dequantizes the whole history every step and layer)."""

    name = "reference"

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        c = self.cache
        return kivi_attention_(q, k, v, step.slot_ids, step.past_len, step.chunk_len, step.block_table,
                               c.layers[layer], c.cfg)


class MemoBackend(AttentionBackend):
    """The reference op with each sequence's dequantized history kept between steps.

    The store is append-only (a quantized group never changes until the sequence is freed) and dequantization is
    elementwise, so dequantizing only the groups added since the last step and concatenating gives bit-identical
    history, hence bit-identical attention (tests/test_cache_backends.py checks torch.equal against reference).
    Storage and flushing are the reference `append`; only the read side is memoized."""

    name = "memo"

    def __init__(self, cache: KiviCache) -> None:
        super().__init__(cache)
        self._memo: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}  # (layer, slot) -> n, K, V

    def free(self, slot: int) -> None:
        for key in [k for k in self._memo if k[1] == slot]:
            del self._memo[key]

    def _quantized_history(self, layer: int, slot: int, table_row: torch.Tensor, n_q: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V [Hkv, n_q, D] of the first n_q tokens, extending the memo by the new groups only."""
        buf, cfg = self.cache.layers[layer], self.cache.cfg
        bs, d = cfg.block_size, buf.k_window.shape[-1]
        n, k_old, v_old = self._memo.get((layer, slot), (0, None, None))
        if n > n_q:  # cannot happen for a live sequence (the store only grows); recompute to be safe
            n, k_old, v_old = 0, None, None
        if n == n_q and k_old is not None and v_old is not None:
            return k_old, v_old
        b0, b1 = n // bs, math.ceil(n_q / bs)  # blocks holding the new tokens [n, n_q)
        sub = table_row[b0:b1]
        m = n_q - b0 * bs  # tokens of those blocks in the store
        kc, ks, kz = (_blocks_of(t, sub, b1 - b0) for t in buf[0:3])
        vc, vs, vz = (_blocks_of(t, sub, b1 - b0) for t in buf[3:6])
        k_new = dequantize_keys(kc, ks, kz, cfg, m, d, buf.k_window.dtype)[:, n - b0 * bs:]
        v_new = dequantize_values(vc[:, :m], vs[:, :m], vz[:, :m], cfg, d, buf.v_window.dtype)[:, n - b0 * bs:]
        k_all = k_new if k_old is None else torch.cat([k_old, k_new], dim=1)
        v_all = v_new if v_old is None else torch.cat([v_old, v_new], dim=1)
        self._memo[(layer, slot)] = (n_q, k_all, v_all)
        return k_all, v_all

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        buf, cfg = self.cache.layers[layer], self.cache.cfg
        check_step(q, k, v, step.slot_ids, step.past_len, step.chunk_len, step.block_table, buf, cfg)
        out = torch.empty_like(q)
        off = 0
        for b, (slot, s, c) in enumerate(zip(step.slots, step.past, step.chunk, strict=True)):
            if c == 0:
                continue
            rows = slice(off, off + c)
            kc, vc = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, c, D]
            n_q, s0 = cfg.num_quantized(s), min(cfg.sink_tokens, s)
            ring = _rows(cfg, s0 + n_q, s)  # token order: sinks, store, ring, chunk (format.py)
            parts_k, parts_v = [buf.k_window[slot][:, ring], kc], [buf.v_window[slot][:, ring], vc]
            if n_q:
                kq, vq = self._quantized_history(layer, slot, step.block_table[b], n_q)
                parts_k.insert(0, kq)
                parts_v.insert(0, vq)
            if s0:
                parts_k.insert(0, buf.k_window[slot][:, :s0])
                parts_v.insert(0, buf.v_window[slot][:, :s0])
            out[rows] = attend(q[rows], torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1), s)
            append(buf, cfg, slot, step.block_table[b], s, kc, vc)
            off += c
        return out


class CudaBackend(AttentionBackend):
    """The CUDA kernels (plugins/kernels) through their C ABI: cuda.ops.kivi_attention_cuda_."""

    name = "cuda"

    @classmethod
    def unavailable(cls, cfg: KiviConfig, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"the cuda backend needs a CUDA device; the cache is on {device}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"the CUDA kernels take float16 or bfloat16 activations; the cache holds {dtype}"
        from .cuda import find_library

        if find_library() is None:
            return "the KIVI kernel library is not built (build_scripts/build_plugin.sh)"
        if cfg.key_grouping != "per_channel":
            return f"the CUDA kernels implement per_channel keys only; key_grouping={cfg.key_grouping!r}"
        return None

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        from .cuda.ops import kivi_attention_cuda_

        c = self.cache
        ends = [p + n for p, n in zip(step.past, step.chunk, strict=True)]
        # begin_step validated the lengths on the host: the kernels get exact host bounds, no host sync. The kernels
        # read q/k/v as dense [T, heads, D]; the model's v is a view of the fused qkv projection (row stride
        # H + 2 Hkv heads), so it is made contiguous here (an H200 run read the wrong rows before this)
        return kivi_attention_cuda_(q.contiguous(), k.contiguous(), v.contiguous(), step.slot_ids, step.past_len,
                                    step.chunk_len, step.block_table, c.layers[layer], c.cfg,
                                    max_chunk_len=max(step.chunk), max_seq_len=max(ends), check=False)


class CpuBackend(AttentionBackend):
    """The native CPU kernels (plugins/cpu: AVX-512 / AVX2 / portable, multithreaded) through their C ABI:
    cpu.ops.kivi_attention_cpu_ (stores bit-exact with reference; attention within tests/test_cpu_native.py's
    tolerance)."""

    name = "cpu"

    @classmethod
    def unavailable(cls, cfg: KiviConfig, device: torch.device, dtype: torch.dtype) -> str | None:
        from .cpu.ops import kivi_layout_mismatch

        return kivi_layout_mismatch() or _cpu_unavailable(device)

    _op: KiviCpuAttention | None = None  # over the cache's layers, bound at the first call (they exist by then)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        if self._op is None:
            from .cpu.ops import KiviCpuAttention

            c = self.cache
            self._op = KiviCpuAttention(c.layers, c.cfg, c.geom.num_heads)
        return self._op(layer, q.contiguous(), k.contiguous(), v.contiguous(), step.slot_ids, step.past_len,
                        step.chunk_len, step.block_table)


def _cpu_unavailable(device: torch.device, head_dim: int | None = None, quantized: bool = True) -> str | None:
    """Why the native CPU kernels cannot serve a cache on `device` (None: they can)."""
    if device.type != "cpu":
        return f"the cpu backend needs device cpu; the cache is on {device}"
    if head_dim is not None and head_dim not in (64, 128):
        return f"the native CPU kernels take head_dim 64 or 128, not {head_dim}"
    from .cpu import unavailable_reason

    return unavailable_reason(quantized)


BACKENDS: dict[str, type[AttentionBackend]] = {"reference": ReferenceBackend, "memo": MemoBackend,
                                               "cpu": CpuBackend, "cuda": CudaBackend}
BACKEND_CHOICES = ("auto", "reference", "memo", "cpu", "cuda")


def register_backend(cls: type[AttentionBackend]) -> None:
    """Add a backend to BACKENDS under cls.name (e.g. the native CPU backend)."""
    BACKENDS[cls.name] = cls


_WARNED_NO_CPU = [False]


def _why_not(name: str, cfg: KiviConfig, device: torch.device, dtype: torch.dtype,
             head_dim: int | None) -> str | None:
    why = BACKENDS[name].unavailable(cfg, device, dtype)
    if why is None and name == "cpu":  # the native CPU kernels instantiate head_dim 64 and 128
        why = _cpu_unavailable(device, head_dim)
    return why


def default_backend(cfg: KiviConfig, device: str | torch.device, dtype: torch.dtype = torch.float16,
                    head_dim: int | None = None) -> str:
    """The fastest backend available for `cfg` on `device`: cuda on a CUDA device (when built), the native cpu
    kernels on the CPU (when built; benchmarks/results/cpu_attention_op_xeon.json), else memo (with a one-line warning
    on the CPU, once per process)."""
    device = torch.device(device)
    for name in ("cuda", "cpu"):
        if name in BACKENDS and _why_not(name, cfg, device, dtype, head_dim) is None:
            return name
    why = _cpu_unavailable(device)
    if device.type == "cpu" and why and not _WARNED_NO_CPU[0]:  # library missing: say so once
        import sys

        _WARNED_NO_CPU[0] = True
        print(f"trtllm-kivi: warning: {why}; using the slower memo attention backend", file=sys.stderr)
    return "memo"


def resolve_backend(name: str | None, cfg: KiviConfig, device: str | torch.device,
                    dtype: torch.dtype = torch.float16, head_dim: int | None = None) -> str:
    """A --attention-backend choice ("auto"/None = default_backend) checked for `cfg` on `device`."""
    if name in (None, "auto"):
        return default_backend(cfg, device, dtype, head_dim)
    if name not in BACKENDS:
        allowed = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"attention backend {name!r} is not available; allowed: {allowed}")
    why = _why_not(name, cfg, torch.device(device), dtype, head_dim)
    if why:
        raise ValueError(f"attention backend {name!r} cannot serve this cache: {why}")
    return name


# ---------------------------------------------------------------------------------------------- caches


class KiviCache(KVCache):
    """KIVI cache for L layers: a pool of quantized blocks per layer, a block table per slot, a full-precision
    window per slot (format.py has the layouts); attention by the chosen backend (default_backend if None)."""

    def __init__(self, cfg: KiviConfig, geom: Geometry, max_slots: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu",
                 num_blocks: int | None = None, backend: str | None = None) -> None:
        super().__init__(geom, max_slots, max_seq_len, dtype, device)
        cfg.check_head_dim(geom.head_dim)
        cfg.check_num_layers(geom.num_layers)
        self.cfg = self.kivi_config = cfg
        self._scale_dtype = torch_dtype(cfg.scale_dtype)
        self.backend: AttentionBackend = BACKENDS[resolve_backend(backend, cfg, self.device, dtype,
                                                                  geom.head_dim)](self)
        self.max_blocks_per_seq = cfg.max_blocks_per_seq(max_seq_len)
        self.num_blocks = max_slots * self.max_blocks_per_seq if num_blocks is None else num_blocks
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")
        self.layers = [KiviBuffers.allocate(cfg, geom.num_kv_heads, geom.head_dim, self.num_blocks, max_slots,
                                            dtype, device) for _ in range(geom.num_layers)]
        # -1 marks an unassigned entry: a stray read fails loudly instead of reading another sequence's block.
        self.block_tables = torch.full((max_slots, self.max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._blocks: list[list[int]] = [[] for _ in range(max_slots)]
        # Prefix sharing (runtime/prefix_cache.py): a block is referenced by every slot whose table holds it, and
        # a block the prefix index keeps (`_cached`) outlives its sequences; it is free only when neither holds it.
        # begin_step takes free blocks first, then asks `reclaim(n)` to evict unreferenced cached ones
        # (tests/test_prefix_cache.py: eviction never frees a block in use).
        self._refs = [0] * self.num_blocks
        self._cached = [False] * self.num_blocks
        self.reclaim: Callable[[int], int] | None = None

    def free_sequence(self, slot: int) -> None:
        super().free_sequence(slot)
        self.backend.free(slot)
        for blk in reversed(self._blocks[slot]):
            self._refs[blk] -= 1
            if self._refs[blk] == 0 and not self._cached[blk]:
                self._free_blocks.append(blk)
        self._blocks[slot] = []
        self.block_tables[slot] = -1

    # ------------------------------------------------------------------ prefix sharing (runtime/prefix_cache.py)

    def blocks_of(self, slot: int) -> list[int]:
        """The pool blocks in the sequence's block table, in order."""
        return list(self._blocks[slot])

    def block_refs(self, blk: int) -> int:
        """How many live sequences hold block `blk`."""
        return self._refs[blk]

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by at least one live sequence (shared blocks count once)."""
        return self.num_blocks - len(self._free_blocks) - sum(c and r == 0 for c, r in zip(self._cached, self._refs,
                                                                                         strict=True))

    def set_cached(self, blk: int, cached: bool) -> None:
        """Mark a block as kept by the prefix index (or no longer); an unkept block nobody holds becomes free."""
        if self._cached[blk] == cached:
            return
        self._cached[blk] = cached
        if not cached and self._refs[blk] == 0:
            self._free_blocks.append(blk)

    def adopt_prefix(self, slot: int, blocks: Sequence[int], seq_len: int) -> None:
        """Give the empty sequence in `slot` a cached prefix of seq_len tokens whose quantized store is `blocks`
        (complete, shared: each gets one more reference); the caller writes its full-precision rows (window_rows)."""
        self._check_slot(slot)
        if self.seq_lens[slot] or self._blocks[slot]:
            raise ValueError(f"slot {slot} is not empty ({self.seq_lens[slot]} tokens); a prefix goes first")
        if self.cfg.num_quantized(seq_len) != len(blocks) * self.cfg.block_size or seq_len > self.max_seq_len:
            raise ValueError(f"a prefix of {seq_len} tokens quantizes {self.cfg.num_quantized(seq_len)} tokens, "
                             f"not the {len(blocks)} whole blocks given")
        for i, blk in enumerate(blocks):
            if self._refs[blk] == 0 and not self._cached[blk]:
                raise ValueError(f"block {blk} is free; only a held or cached block can be shared")
            self._refs[blk] += 1
            self.block_tables[slot, i] = blk
        self._blocks[slot] = list(blocks)
        self.seq_lens[slot] = seq_len

    def window_rows(self, slot: int, seq_len: int | None = None) -> torch.Tensor:
        """Window rows of the full-precision tokens of a sequence of seq_len (default: its length) tokens, in
        token order: the sinks, then the ring's tokens (what a prefix's state holds besides its blocks)."""
        return full_precision_rows(self.cfg, self.seq_lens[slot] if seq_len is None else seq_len).to(self.device)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        """Validate the step and assign the blocks its flushes need. On error nothing changes."""
        self._check_step(slots, chunk_lens)
        bs = self.cfg.block_size
        need = [math.ceil(self.cfg.num_quantized(self.seq_lens[s] + c) / bs) - len(self._blocks[s])
                for s, c in zip(slots, chunk_lens, strict=True)]
        total = sum(max(0, n) for n in need)
        if total > len(self._free_blocks) and self.reclaim is not None:
            self.reclaim(total - len(self._free_blocks))  # evict unreferenced cached prefix blocks
        if total > len(self._free_blocks):
            raise CacheCapacityError(f"the step needs {total} new blocks but only "
                                     f"{len(self._free_blocks)} of {self.num_blocks} are free")
        for slot, n in zip(slots, need, strict=True):
            for _ in range(max(0, n)):
                blk = self._free_blocks.pop()
                self._refs[blk] = 1
                self.block_tables[slot, len(self._blocks[slot])] = blk
                self._blocks[slot].append(blk)
        return self._make_step(slots, chunk_lens, self.block_tables[list(slots)])

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """q [tokens, H, D], k/v [tokens, Hkv, D] -> out [tokens, H, D]; appends k/v to the layer's state."""
        check_kv_range(layer, k, v, self._scale_dtype, "KIVI scale/zero dtype")
        return self.backend.attention(layer, q, k, v, step)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all layers' buffers and the block tables."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer) + \
            self.block_tables.numel() * 4

    def sequence_state(self, slot: int, layer: int) -> dict[str, torch.Tensor]:
        """The stored state of a sequence in canonical order (for comparisons): the quantized store of its first
        n_q tokens (codes/scales/zeros concatenated over its blocks) and its window rows in token order."""
        t = self.seq_len(slot)
        n_q = self.cfg.num_quantized(t)
        buf = self.layers[layer]
        nb = math.ceil(n_q / self.cfg.block_size)
        blocks = torch.tensor(self._blocks[slot][:nb], dtype=torch.long)
        state = {name: getattr(buf, name)[blocks].clone() for name in
                 ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")}
        if nb:  # drop rows past n_q in the last block: they are not part of the state
            tail = n_q - (nb - 1) * self.cfg.block_size
            per_row = {n: self.cfg.block_size // getattr(buf, n).shape[2] for n in state}
            for n in state:
                state[n][-1, :, tail // per_row[n]:] = 0
        rows = full_precision_rows(self.cfg, t)  # sinks, then the ring's live tokens, in token order
        state["k_window"] = buf.k_window[slot][:, rows].clone()
        state["v_window"] = buf.v_window[slot][:, rows].clone()
        return state

    def rotations(self, layer: int) -> tuple[str, str]:
        return self.cfg.k_rotation_of(layer), self.cfg.v_rotation_of(layer)

    def dequantized(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-precision view of a sequence's stored K/V [Hkv, T, D] (history as attention sees it; rotated
        when the layer's rotation is on)."""
        return history(self.layers[layer], self.cfg, slot, self.block_tables[slot], self.seq_len(slot))


class FullCache(KVCache):
    """Unquantized (fp16/bf16/fp32) cache with KiviCache's interface: the baseline. backend "torch" (plain torch
    attention) or "cpu" (the native CPU kernels, cpu.ops.full_attention_cpu_: the same treatment as the KIVI cache's
    cpu backend, so comparisons are fair); None / "auto": cpu when available, else torch."""

    def __init__(self, geom: Geometry, max_slots: int, max_seq_len: int, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cpu", backend: str | None = None) -> None:
        super().__init__(geom, max_slots, max_seq_len, dtype, device)
        shape = (max_slots, geom.num_kv_heads, max_seq_len, geom.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geom.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geom.num_layers)]
        why = _cpu_unavailable(self.device, geom.head_dim, quantized=False)
        if backend in (None, "auto"):
            backend = "cpu" if why is None else "torch"
        if backend not in ("torch", "cpu"):
            raise ValueError(f"FullCache backend {backend!r} is not available; allowed: auto, torch, cpu")
        if backend == "cpu" and why:
            raise ValueError(f"FullCache backend 'cpu' cannot serve this cache: {why}")
        self._backend = backend
        self._op: FullCpuAttention | None = None  # over self.k / self.v, bound at the first cpu call

    @property
    def backend_name(self) -> str:
        return self._backend

    def adopt_prefix(self, slot: int, seq_len: int) -> None:
        """The empty sequence in `slot` now holds seq_len tokens whose rows the caller has written (a cached
        prefix, runtime/prefix_cache.py)."""
        self._check_slot(slot)
        if self.seq_lens[slot] or not 0 < seq_len <= self.max_seq_len:
            raise ValueError(f"slot {slot} ({self.seq_lens[slot]} tokens) must be empty and seq_len={seq_len} in "
                             f"[1, {self.max_seq_len}]")
        self.seq_lens[slot] = seq_len

    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        self._check_step(slots, chunk_lens)
        return self._make_step(slots, chunk_lens, torch.zeros((len(slots), 0), dtype=torch.int32))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        check_kv_range(layer, k, v, self.dtype, "cache dtype")
        if self._backend == "cpu":
            if self._op is None:
                from .cpu.ops import FullCpuAttention

                self._op = FullCpuAttention(self.k, self.v, self.geom.num_heads)
            return self._op(layer, q.contiguous(), k.contiguous(), v.contiguous(), step.slot_ids, step.past_len,
                            step.chunk_len)
        out = torch.empty_like(q)
        offset = 0
        for slot, s, c in zip(step.slots, step.past, step.chunk, strict=True):
            rows = slice(offset, offset + c)
            self.k[layer][slot, :, s:s + c] = k[rows].transpose(0, 1)
            self.v[layer][slot, :, s:s + c] = v[rows].transpose(0, 1)
            out[rows] = attend(q[rows], self.k[layer][slot, :, :s + c], self.v[layer][slot, :, :s + c], s)
            offset += c
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def dequantized(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len(slot)
        return self.k[layer][slot, :, :t], self.v[layer][slot, :, :t]

