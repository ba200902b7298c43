"""Text generation over any Runner (runtime/base.py): greedy or sampled (seeded temperature / top-k / top-p), stop
tokens and stop strings, a batch of prompts of different lengths, a per-token streaming callback.

Every prompt is its own sequence in its own cache slot, so nothing is padded and padding never enters a cache. A
step feeds each live sequence its next piece: a prompt chunk (<= prefill_chunk tokens) while it is prefilling, else
its last sampled token; sequences that finish free their slot at once and waiting prompts take it. Sampling uses one
generator per prompt (seed + prompt index), so a prompt's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .base import Runner


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


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (without a final stop token)
    text: str | None = None  # decoded tokens (cut before a stop string); None without a tokenizer
    finish_reason: str = ""  # "stop" (stop token or string) or "length" (max_new_tokens)


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


class TextStream:
    """Incremental detokenization for streaming: push token ids, get the new text (held back while a multi-byte
    character is incomplete)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.tokens, self.emitted = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta


def generate(runner: Runner, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
             tokenizer=None, on_token: Callable[[int, int], None] | None = None,
             prefill_chunk: int = 512) -> list[Generation]:
    """Generate for each prompt (token ids); on_token(prompt_index, token_id) is called for every kept token."""
    if not prompts:
        raise ValueError("no prompts given")
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; it needs at least one token")
        need = len(p) + params.max_new_tokens - 1  # the last new token is never fed back
        if need > runner.max_seq_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens={params.max_new_tokens} needs {need} "
                             f"cache positions; the runner holds max_seq_len={runner.max_seq_len}")
    results = [Generation(list(p)) for p in prompts]
    gens = []
    for i in range(len(prompts)):
        g = torch.Generator()
        g.manual_seed(params.seed + i) if params.seed is not None else g.seed()
        gens.append(g)
    stop_ids = set(params.stop_token_ids)
    waiting = list(range(len(prompts)))
    live: dict[int, int] = {}  # prompt index -> slot
    fed: dict[int, int] = {}  # prompt index -> prompt tokens fed so far
    try:
        while waiting or live:
            while waiting and runner.free_slots > 0:
                i = waiting.pop(0)
                live[i], fed[i] = runner.add_sequence(), 0
            if not live:
                raise ValueError("the runner has no free slot for a new sequence")
            order = list(live)
            chunks = []
            for i in order:
                p = results[i].prompt
                if fed[i] < len(p):  # prefilling
                    chunks.append(p[fed[i]:fed[i] + prefill_chunk])
                    fed[i] += len(chunks[-1])
                else:
                    chunks.append(results[i].tokens[-1:])
            logits = runner.step([live[i] for i in order], chunks)  # [B, vocab]: each chunk's last token
            for b, i in enumerate(order):
                if fed[i] < len(results[i].prompt):
                    continue  # a middle prompt chunk: its logits predict prompt tokens
                r = results[i]
                tok = sample(logits[b], params, gens[i])
                done = tok in stop_ids
                if not done:
                    r.tokens.append(tok)
                    if on_token is not None:
                        on_token(i, tok)
                if params.stop_strings:
                    text = tokenizer.decode(r.tokens)
                    hits = [text.find(s) for s in params.stop_strings if s in text]
                    if hits:
                        r.text, done = text[:min(hits)], True
                if done or len(r.tokens) >= params.max_new_tokens:
                    r.finish_reason = "stop" if done else "length"
                    if tokenizer is not None and r.text is None:
                        r.text = tokenizer.decode(r.tokens)
                    runner.free_sequence(live.pop(i))
    finally:
        for slot in live.values():  # an error mid-way must not leak slots
            runner.free_sequence(slot)
    return results
