"""Sampling: the parameters of a request and one token from logits (greedy or seeded temperature / top-k / top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with probability >= top_p
    top_k: int = 0  # keep the k most likely tokens (0: all)
    seed: int | None = None  # None: nondeterministic sampling
    stop_token_ids: tuple[int, ...] = ()  # ends a sequence (the stop token itself is not returned)
    stop_strings: tuple[str, ...] = ()  # ends a sequence once its text contains one (text cut before it)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from fp32 logits [vocab]."""
    if params.temperature == 0:
        return int(logits.argmax())
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, params.top_k).values[-1], float("-inf"))
    if params.top_p < 1:
        xs, order = torch.sort(x, descending=True)
        p = torch.softmax(xs, dim=-1)
        drop = p.cumsum(-1) - p > params.top_p  # tokens after the nucleus is complete (the first is always kept)
        x = x.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))


__all__ = ["SamplingParams", "sample"]
