"""Build the runners of an evaluation and run the passkey sweep (the quality run is quality.evaluate_quality)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ..models.llama import LlamaModel
from ..runtime.base import Runner
from ..runtime.kvspec import KVSpec
from ..runtime.torch_runner import TorchRunner
from .passkey import PasskeyPrompt, PasskeyResult, build_prompt, make_key, run_passkey, summarize


def make_runner(model: LlamaModel, spec: KVSpec, max_slots: int, max_seq_len: int,
                backend: str | None = None) -> Runner:
    """TorchRunner over a fresh cache of `spec` with the given KIVI attention backend (None: the fastest; every
    backend's results equal the reference's within its stated tolerance, memo's bit for bit)."""
    return TorchRunner.create(model, spec, max_slots, max_seq_len, backend=backend)


def passkey_prompts(encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float],
                    seed: int = 0) -> dict[tuple[int, float], PasskeyPrompt]:
    """One prompt per (length, depth), keys drawn from a seeded RNG: every configuration sees the same prompts."""
    rng = random.Random(seed)
    return {(n, d): build_prompt(encode, n, d, make_key(rng)) for n in lengths for d in depths}


def passkey_sweep(runners: dict[str, Runner], prompts: dict[tuple[int, float], PasskeyPrompt], reference: str,
                  fallback_lengths: Sequence[int] = (), prefill_chunk: int = 512, max_config_lengths: int = 0,
                  progress: Callable[[str, int, float], None] | None = None) -> dict:
    """Run the reference at every (length, depth); the other configurations at the lengths where the reference
    passes at every depth (else where it passes at some depth; else at those of fallback_lengths in the sweep,
    or at all lengths: soft measures only). max_config_lengths > 0 keeps only that many of those lengths, the
    longest (where the most tokens are quantized), to bound the run time."""
    lengths = sorted({n for n, _ in prompts})
    depths = sorted({d for _, d in prompts})

    def run(name: str, ns: Sequence[int]) -> list[dict]:
        cells = []
        for n in ns:
            for d in depths:
                if progress:
                    progress(name, n, d)
                p = prompts[(n, d)]
                r = run_passkey(runners[name], p, prefill_chunk)
                cells.append({"length": n, "depth": d, "tokens": p.num_tokens, "key": p.key} | r.to_dict())
        return cells

    results = {reference: run(reference, lengths)}
    passed = {n: [c["passed"] for c in results[reference] if c["length"] == n] for n in lengths}
    all_pass = [n for n in lengths if all(passed[n])]
    some_pass = [n for n in lengths if any(passed[n])]
    eval_lengths = all_pass or some_pass or sorted(n for n in fallback_lengths if n in passed) or lengths
    basis = ("lengths where the reference passes at every depth" if all_pass else
             "lengths where the reference passes at some depth" if some_pass else
             "reference passes nowhere: fallback lengths, soft measures only")
    if max_config_lengths > 0:
        eval_lengths = eval_lengths[-max_config_lengths:]
    for name in runners:
        if name != reference:
            results[name] = run(name, eval_lengths)

    def summary(name: str) -> dict:
        cells = [c for c in results[name] if c["length"] in eval_lengths]
        return summarize([PasskeyResult(c["passed"], c["ranks"], c["logprobs"]) for c in cells])

    return {"lengths": lengths, "depths": depths, "reference_pass_lengths": all_pass,
            "reference_some_pass_lengths": some_pass, "eval_lengths": eval_lengths, "eval_basis": basis,
            "results": results, "summary": {n: summary(n) for n in runners}}
