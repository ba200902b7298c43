"""Text generation over any Runner: a batch of prompts through the scheduler (runtime/scheduler.py, the one
generation loop), greedy or sampled, stop tokens and stop strings, per-token and per-text streaming callbacks.

Every prompt is its own request in its own cache slot, so nothing is padded and padding never enters a cache. Prompt
chunks are multiples of prefill_chunk from the prompt start; all prefilling prompts get their chunk in the same
step. Sampling uses one generator per prompt (seed + prompt index), so a prompt's tokens do not depend on what else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Callable, Sequence

from .base import Runner
from .sampling import SamplingParams
from .scheduler import Request, RequestRejected, Scheduler


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (without a final stop token)
    text: str | None = None  # decoded tokens (cut before a stop string); None without a tokenizer
    finish_reason: str = ""  # "stop" (stop token or string) or "length" (max_new_tokens)


def generate(runner: Runner, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
             tokenizer=None, on_token: Callable[[int, int], None] | None = None, prefill_chunk: int = 512,
             on_text: Callable[[int, str], None] | None = None) -> list[Generation]:
    """Generate for each prompt (token ids). on_token(prompt_index, token_id) is called for every kept token;
    on_text(prompt_index, text) with each piece of streamed text (held back while it could start a stop string,
    cut before one)."""
    if not prompts:
        raise ValueError("no prompts given")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
    budget = runner.max_slots * (prefill_chunk + 1)  # every live prompt's chunk fits one step
    sched = Scheduler(runner, tokenizer, max_batch_tokens=budget, prefill_chunk=prefill_chunk)
    index: dict[str, int] = {}

    def on_update(req: Request, new: list[int], text: str) -> None:
        i = index[req.id]
        if on_token is not None:
            for t in new:
                on_token(i, t)
        if on_text is not None and text:
            on_text(i, text)

    callback = on_update if on_token is not None or on_text is not None else None
    for i, p in enumerate(prompts):  # refuse the whole batch up front, naming the prompt
        try:
            sched.check(list(p), params)
        except RequestRejected as e:
            raise RequestRejected(f"prompt {i}: {e}") from None
    reqs = []
    for i, p in enumerate(prompts):
        seeded = params if params.seed is None else replace(params, seed=params.seed + i)
        reqs.append(sched.submit(p, seeded, on_update=callback, request_id=f"prompt-{i}"))
        index[reqs[-1].id] = i
    try:
        sched.run_until_idle()
    finally:
        sched.stop()  # an error mid-way must not leak slots
    out = []
    for r in reqs:
        if r.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"{r.id} ended with {r.finish_reason}: {r.error}")
        out.append(Generation(list(r.prompt), list(r.tokens), r.text if tokenizer is not None else None,
                              r.finish_reason))
    return out


__all__ = ["Generation", "SamplingParams", "generate"]
