"""Decode-mode scoring: prefill a prefix, then feed the rest through the cache and keep every position's logits.

Per docs/design.md's streaming contract a chunk [s, e) reproduces token-by-token decoding exactly when no flush point
S + R + kG (k >= 1) lies strictly inside (s, e). `chunk_plan` cuts a range at every flush point of every KIVI
configuration being compared (and at `max_chunk`), so all configurations see the same chunk shapes and every
chunk is exact for each of them: scoring in chunks costs one forward per chunk instead of one per token.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..format import KiviConfig
from ..runtime.base import Runner


def flush_points(cfg: KiviConfig, start: int, end: int) -> list[int]:
    """Flush points S + R + kG (k >= 1; S = sink_tokens) strictly inside (start, end)."""
    r, g = cfg.sink_tokens + cfg.residual_length, cfg.group_size
    k0 = max(1, (start - r) // g + 1)  # first k with R + kG > start
    return [p for p in range(r + k0 * g, end, g) if start < p < end]


def chunk_plan(start: int, end: int, configs: Iterable[KiviConfig], max_chunk: int) -> list[tuple[int, int]]:
    """Split [start, end) into chunks that contain no flush point of any config strictly inside and are at most
    max_chunk long."""
    if not 0 <= start <= end:
        raise ValueError(f"chunk range [{start}, {end}) must satisfy 0 <= start <= end")
    if max_chunk < 1:
        raise ValueError(f"max_chunk={max_chunk} must be >= 1")
    cuts = sorted({p for cfg in configs for p in flush_points(cfg, start, end)} | {start, end})
    plan = []
    for s, e in zip(cuts, cuts[1:], strict=False):
        plan += [(a, min(a + max_chunk, e)) for a in range(s, e, max_chunk)]
    return plan


def is_exact(cfg: KiviConfig, s: int, e: int) -> bool:
    """Whether chunk [s, e) reproduces token-by-token decoding under cfg (no flush point strictly inside)."""
    return not flush_points(cfg, s, e)


def score_sequence(runner: Runner, tokens: Sequence[int], prefix: int, plan: Sequence[tuple[int, int]],
                   on_chunk: Callable[[int, int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Prefill tokens[:prefix] as one chunk, then feed the chunks of `plan` (which must tile [prefix, N - 1));
    return the logits of positions prefix..N-2 [N - 1 - prefix, vocab] fp32 (row i predicts tokens[prefix + i + 1]).
    `on_chunk(s, e, logits)` is called after every scored chunk (progress, streaming metrics)."""
    n = len(tokens)
    if not 1 <= prefix < n - 1:
        raise ValueError(f"prefix={prefix} must be in [1, {n - 2}] for a sequence of {n} tokens")
    if not plan or plan[0][0] != prefix or plan[-1][1] != n - 1 or any(a[1] != b[0] for a, b in zip(plan, plan[1:], strict=False)):
        raise ValueError(f"the chunk plan must tile [{prefix}, {n - 1}) contiguously")
    if n - 1 > runner.max_seq_len:
        raise ValueError(f"sequence of {n} tokens exceeds the runner's max_seq_len={runner.max_seq_len}")
    slot = runner.add_sequence()
    try:
        runner.step([slot], [list(tokens[:prefix])])
        out = []
        for s, e in plan:
            logits = runner.step([slot], [list(tokens[s:e])], all_logits=True)  # [e - s, V]
            if on_chunk is not None:
                on_chunk(s, e, logits)
            out.append(logits)
        return torch.cat(out)
    finally:
        runner.free_sequence(slot)


@contextmanager
def record_attention_outputs(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record each decoder layer's attention output (after the output projection, [T, dim]) on every forward.

    Yields a list with one list per layer; each forward appends its [T, dim] tensor (a detached fp32 copy). The
    model must expose `layers[i].attn` (trtllm_kivi.models.llama.LlamaModel does)."""
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(b, "attn") for b in layers):
        raise ValueError(f"{type(model).__name__} has no layers[i].attn modules to record")
    rec: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [b.attn.register_forward_hook(lambda _m, _i, out, i=i: rec[i].append(out.detach().float().clone()))
             for i, b in enumerate(layers)]
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()
