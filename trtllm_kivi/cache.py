"""Streaming KV caches a runner uses: the KIVI cache (block pool + block tables + per-slot windows) and an
unquantized cache with the same interface as the baseline.

A runner drives one model step as:

    step = cache.begin_step(slots, chunk_lens)   # validates capacity, assigns blocks; changes nothing on error
    for layer in range(L):
        out = cache.attention(layer, q, k, v, step)   # attend, then append (the KiviAttention op, in place)
    cache.end_step(step)                         # advances the sequence lengths

All buffers are preallocated for the capacity given at construction; nothing grows by concatenation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .format import Geometry, KiviConfig
from .reference.attention import KiviBuffers, attend, full_precision_rows, history, kivi_attention_


class CacheCapacityError(ValueError):
    """A step would need more tokens, blocks or slots than the cache was allocated for."""


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


class _SlotCache:
    """Slot bookkeeping shared by both caches."""

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
        for slot, c in zip(slots, chunk_lens):
            self._check_slot(slot)
            if c < 0:
                raise ValueError(f"chunk length {c} for slot {slot} must be >= 0")
            if self.seq_lens[slot] + c > self.max_seq_len:
                raise CacheCapacityError(f"slot {slot}: {self.seq_lens[slot]} + {c} tokens exceeds the cache "
                                         f"capacity max_seq_len={self.max_seq_len}")

    def _make_step(self, slots: Sequence[int], chunk_lens: Sequence[int], block_table: torch.Tensor) -> Step:
        past = [self.seq_lens[s] for s in slots]
        i32 = dict(dtype=torch.int32, device=self.device)
        return Step(list(slots), past, list(chunk_lens), torch.tensor(list(slots), **i32),
                    torch.tensor(past, **i32), torch.tensor(list(chunk_lens), **i32), block_table)

    def end_step(self, step: Step) -> None:
        """Advance the lengths of the step's sequences (after every layer ran)."""
        for slot, c in zip(step.slots, step.chunk):
            self.seq_lens[slot] += c


class KiviCache(_SlotCache):
    """KIVI cache for L layers: a pool of quantized blocks per layer, a block table per slot, a full-precision
    window per slot (format.py has the layouts)."""

    def __init__(self, cfg: KiviConfig, geom: Geometry, max_slots: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu",
                 num_blocks: int | None = None) -> None:
        super().__init__(geom, max_slots, max_seq_len, dtype, device)
        cfg.check_head_dim(geom.head_dim)
        cfg.check_num_layers(geom.num_layers)
        self.cfg = cfg
        self.max_blocks_per_seq = max(1, math.ceil(cfg.num_quantized(max_seq_len) / cfg.block_size))
        self.num_blocks = max_slots * self.max_blocks_per_seq if num_blocks is None else num_blocks
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")
        self.layers = [KiviBuffers.allocate(cfg, geom.num_kv_heads, geom.head_dim, self.num_blocks, max_slots,
                                            dtype, device) for _ in range(geom.num_layers)]
        # -1 marks an unassigned entry: a stray read fails loudly instead of reading another sequence's block.
        self.block_tables = torch.full((max_slots, self.max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._blocks: list[list[int]] = [[] for _ in range(max_slots)]

    def free_sequence(self, slot: int) -> None:
        super().free_sequence(slot)
        self._free_blocks.extend(reversed(self._blocks[slot]))
        self._blocks[slot] = []
        self.block_tables[slot] = -1

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        """Validate the step and assign the blocks its flushes need. On error nothing changes."""
        self._check_step(slots, chunk_lens)
        bs = self.cfg.block_size
        need = [math.ceil(self.cfg.num_quantized(self.seq_lens[s] + c) / bs) - len(self._blocks[s])
                for s, c in zip(slots, chunk_lens)]
        if sum(max(0, n) for n in need) > len(self._free_blocks):
            raise CacheCapacityError(f"the step needs {sum(max(0, n) for n in need)} new blocks but only "
                                     f"{len(self._free_blocks)} of {self.num_blocks} are free")
        for slot, n in zip(slots, need):
            for _ in range(max(0, n)):
                blk = self._free_blocks.pop()
                self.block_tables[slot, len(self._blocks[slot])] = blk
                self._blocks[slot].append(blk)
        return self._make_step(slots, chunk_lens, self.block_tables[list(slots)])

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """q [tokens, H, D], k/v [tokens, Hkv, D] -> out [tokens, H, D]; appends k/v to the layer's state."""
        return kivi_attention_(q, k, v, step.slot_ids, step.past_len, step.chunk_len, step.block_table,
                               self.layers[layer], self.cfg)

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
        """(k_rotation, v_rotation) of a layer: what the model applies around the op (format.py)."""
        return self.cfg.k_rotation_of(layer), self.cfg.v_rotation_of(layer)

    def dequantized(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-precision view of a sequence's stored K/V [Hkv, T, D] (history as attention sees it; rotated
        when the layer's rotation is on)."""
        return history(self.layers[layer], self.cfg, slot, self.block_tables[slot], self.seq_len(slot))


class FullCache(_SlotCache):
    """Unquantized (fp16/bf16/fp32) cache with KiviCache's interface: the baseline."""

    def __init__(self, geom: Geometry, max_slots: int, max_seq_len: int, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(geom, max_slots, max_seq_len, dtype, device)
        shape = (max_slots, geom.num_kv_heads, max_seq_len, geom.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geom.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geom.num_layers)]

    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        self._check_step(slots, chunk_lens)
        return self._make_step(slots, chunk_lens, torch.zeros((len(slots), 0), dtype=torch.int32))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        out = torch.empty_like(q)
        offset = 0
        for slot, s, c in zip(step.slots, step.past, step.chunk):
            rows = slice(offset, offset + c)
            self.k[layer][slot, :, s:s + c] = k[rows].transpose(0, 1)
            self.v[layer][slot, :, s:s + c] = v[rows].transpose(0, 1)
            out[rows] = attend(q[rows], self.k[layer][slot, :, :s + c], self.v[layer][slot, :, :s + c], s)
            offset += c
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rotations(self, layer: int) -> tuple[str, str]:
        return "none", "none"

    def dequantized(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len(slot)
        return self.k[layer][slot, :, :t], self.v[layer][slot, :, :t]

