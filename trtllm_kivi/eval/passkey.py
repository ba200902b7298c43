"""Passkey retrieval (Mohtashami & Jaggi 2023, as used by KIVI): a 5-digit key hidden at a given depth of
repetitive filler text; the model must complete "The pass key is" with it.

Scoring is teacher-forced: after the haystack (prefilled in chunks, so later chunks read the cache) and the
question (one chunk), the answer tokens are fed one by one as decode steps. `passed` means every answer token was
the argmax, i.e. greedy decoding would print exactly the key; the soft measures are each answer token's rank
(0 = argmax) and log-probability, which stay informative when a small model passes nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch

from ..runtime.base import Runner
from .metrics import token_rank

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass
class PasskeyPrompt:
    key: str
    context: list[int]  # intro + filler + needle + filler (prefilled)
    question: list[int]  # fed as one chunk after the context
    answer: list[int]  # teacher-forced, one decode step each
    needle_start: int  # token index of the needle in context
    depth: float  # requested depth in [0, 1]

    @property
    def num_tokens(self) -> int:
        return len(self.context) + len(self.question) + len(self.answer)


def make_key(rng: random.Random) -> str:
    return str(rng.randrange(10000, 100000))


def build_prompt(encode: Callable[[str], list[int]], n_tokens: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of about n_tokens tokens (within half a filler sentence) with the needle after a fraction `depth`
    of the filler. Pieces end in a newline and are tokenized separately, so token positions are exact."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    if not (len(key) == 5 and key.isdigit()):
        raise ValueError(f"key={key!r} must be 5 digits")
    intro, unit, needle = encode(INTRO), encode(FILLER), encode(NEEDLE.format(key=key))
    question, answer = encode(QUESTION), encode(ANSWER.format(key=key))
    fixed = len(intro) + len(needle) + len(question) + len(answer)
    if n_tokens < fixed + len(unit):
        raise ValueError(f"n_tokens={n_tokens} is too short; the passkey prompt needs >= {fixed + len(unit)}")
    n_fill = round((n_tokens - fixed) / len(unit))
    before = round(depth * n_fill)
    context = intro + unit * before + needle + unit * (n_fill - before)
    return PasskeyPrompt(key, context, question, answer, len(intro) + len(unit) * before, depth)


@dataclass
class PasskeyResult:
    passed: bool
    ranks: list[int]  # rank of each answer token (0 = argmax)
    logprobs: list[float]  # log p of each answer token (nats)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "ranks": self.ranks, "logprobs": [round(x, 4) for x in self.logprobs],
                "answer_logprob": round(sum(self.logprobs), 4)}


def run_passkey(runner: Runner, prompt: PasskeyPrompt, prefill_chunk: int = 512) -> PasskeyResult:
    """Prefill the context in chunks of prefill_chunk, feed the question, then teacher-force the answer."""
    if prompt.num_tokens > runner.max_seq_len:
        raise ValueError(f"passkey prompt of {prompt.num_tokens} tokens exceeds max_seq_len={runner.max_seq_len}")
    slot = runner.add_sequence()
    try:
        ctx = prompt.context
        for s in range(0, len(ctx), prefill_chunk):
            runner.step([slot], [ctx[s:s + prefill_chunk]])
        logits = runner.step([slot], [prompt.question])  # [1, V]: predicts answer[0]
        ranks, logprobs = [], []
        for j, tok in enumerate(prompt.answer):
            target = torch.tensor([tok])
            ranks.append(int(token_rank(logits, target)[0]))
            logprobs.append(float(torch.log_softmax(logits.double(), -1)[0, tok]))
            if j + 1 < len(prompt.answer):
                logits = runner.step([slot], [[tok]])
        return PasskeyResult(all(r == 0 for r in ranks), ranks, logprobs)
    finally:
        runner.free_sequence(slot)


def summarize(results: Sequence[PasskeyResult]) -> dict:
    """Pass rate, mean answer-token rank and mean answer log-prob over trials."""
    n = len(results)
    ranks = [r for res in results for r in res.ranks]
    return {"trials": n, "pass_rate": sum(r.passed for r in results) / n if n else None,
            "mean_rank": sum(ranks) / len(ranks) if ranks else None,
            "token_top1": sum(r == 0 for r in ranks) / len(ranks) if ranks else None,
            "mean_answer_logprob": sum(sum(r.logprobs) for r in results) / n if n else None}
