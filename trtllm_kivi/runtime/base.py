"""The interface every runner implements (torch, onnxruntime, tensorrt): a model plus its KV cache that runs one
step of a ragged batch. Generation, evaluation, the scheduler, bench and Triton are written against this alone."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


class Runner(ABC):
    """Sequences live in cache slots; a step feeds each listed slot a chunk of new tokens (prompt or generated)
    and returns logits. Attend-then-append per DESIGN.md's streaming contract."""

    name: str  # "torch", "onnxruntime" or "tensorrt"
    vocab_size: int
    max_slots: int  # sequences that can be live at once
    max_seq_len: int  # tokens per sequence (prompt + generated)

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
