"""The interface every runner implements (torch, onnxruntime, tensorrt): a model plus its KV cache that runs one
step of a ragged batch. Generation, evaluation, the scheduler, bench and Triton are written against this alone."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..cache import CacheCapacityError, KVCache
from ..format import Geometry, KiviConfig


class Runner(ABC):
    """Sequences live in cache slots; a step feeds each listed slot a chunk of new tokens (prompt or generated)
    and returns logits. Attend-then-append per docs/design.md's streaming contract."""

    name: str  # "torch", "onnxruntime" or "tensorrt"
    vocab_size: int
    max_slots: int  # sequences that can be live at once
    max_seq_len: int  # tokens per sequence (prompt + generated)
    max_num_tokens: int | None = None  # tokens per step the runner accepts (a graph's build limit); None: any

    @abstractmethod
    def add_sequence(self) -> int:
        """Take a free slot for a new, empty sequence (raises CacheCapacityError when none is free)."""

    @abstractmethod
    def free_sequence(self, slot: int) -> None:
        """Release a slot and its cache blocks."""

    @abstractmethod
    def seq_len(self, slot: int) -> int:
        """Tokens stored for the sequence in `slot`."""

    @abstractmethod
    def step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Run one step: slot slots[b] receives tokens[b]. Returns fp32 logits of each chunk's last token [B, vocab],
        or of every token [sum(len(t) for t in tokens), vocab] with all_logits. Validates capacity before changing
        any state."""

    @property
    @abstractmethod
    def kv_nbytes(self) -> int:
        """Bytes of KV cache buffers actually allocated."""

    @property
    @abstractmethod
    def free_slots(self) -> int:
        """Slots available for new sequences."""

    @property
    @abstractmethod
    def geometry(self) -> Geometry:
        """The model's attention geometry (layers, heads, KV heads, head_dim)."""

    @property
    @abstractmethod
    def kivi_config(self) -> KiviConfig | None:
        """The KIVI config of the cache; None for an unquantized cache."""

    @property
    @abstractmethod
    def activation_dtype(self) -> torch.dtype:
        """dtype of the activations the cache stores in full precision (window / unquantized cache)."""

    @property
    @abstractmethod
    def free_blocks(self) -> int | None:
        """Quantized-store blocks still free (None for an unquantized cache)."""

    @property
    @abstractmethod
    def attention_backend(self) -> str:
        """What computes attention (the cache backend's name, or the graph runtime's)."""


class CacheRunner(Runner):
    """A runner whose sequences live in a trtllm_kivi.cache cache (`self.cache`): slot bookkeeping and the step
    checks every such runner shares."""

    cache: KVCache

    def add_sequence(self) -> int:
        return self.cache.add_sequence()

    def free_sequence(self, slot: int) -> None:
        self.cache.free_sequence(slot)

    def seq_len(self, slot: int) -> int:
        return self.cache.seq_len(slot)

    @property
    def free_slots(self) -> int:
        return self.cache.free_slots

    @property
    def kv_nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def geometry(self) -> Geometry:
        return self.cache.geom

    @property
    def kivi_config(self) -> KiviConfig | None:
        return self.cache.kivi_config

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def free_blocks(self) -> int | None:
        return self.cache.free_blocks

    @property
    def attention_backend(self) -> str:
        return self.cache.backend_name

    def check_tokens(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Non-empty chunks of valid ids, one per slot, within the runner's per-step token limit."""
        if len(slots) != len(tokens) or not slots:
            raise ValueError(f"slots ({len(slots)}) and tokens ({len(tokens)}) must be equal and non-empty")
        for s, t in zip(slots, tokens, strict=True):
            if len(t) == 0:
                raise ValueError(f"slot {s}: empty chunk; every sequence in a step needs >= 1 token")
            bad = [i for i in t if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"slot {s}: token ids {bad[:3]} out of range [0, {self.vocab_size})")
        n = sum(len(t) for t in tokens)
        if self.max_num_tokens is not None and n > self.max_num_tokens:
            raise CacheCapacityError(f"the step has {n} tokens; the graph was built for max_num_tokens="
                                     f"{self.max_num_tokens} (split the prefill into chunks)")
