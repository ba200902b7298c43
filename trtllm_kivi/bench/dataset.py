"""Benchmark datasets in trtllm-bench's format: JSON lines, one request per line,

    {"task_id": 0, "input_ids": [863, 22056, ...], "output_tokens": 128}
    {"task_id": 1, "prompt": "Generate ...", "output_tokens": 128}

`input_ids` wins when both are present (as in trtllm-bench). Synthetic workloads follow trtllm-bench's
prepare-dataset `token-norm-dist` (lengths from normal distributions, random token ids); `text` cuts prompts out of
a text file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable

import torch


@dataclass
class BenchRequest:
    task_id: int | str
    input_ids: list[int]
    output_tokens: int


def _lengths(n: int, mean: float, stdev: float, g: torch.Generator, what: str) -> list[int]:
    if mean < 1 or stdev < 0:
        raise ValueError(f"{what}: mean={mean} must be >= 1 and stdev={stdev} >= 0")
    x = torch.normal(float(mean), float(stdev), (n,), generator=g) if stdev > 0 else torch.full((n,), float(mean))
    return [max(1, int(round(v))) for v in x.tolist()]


def token_norm_dist(num_requests: int, input_mean: float, input_stdev: float, output_mean: float,
                    output_stdev: float, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Synthetic requests: input/output lengths ~ N(mean, stdev) rounded, clipped to >= 1; uniform random ids."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    g = torch.Generator().manual_seed(seed)
    ins = _lengths(num_requests, input_mean, input_stdev, g, "input length")
    outs = _lengths(num_requests, output_mean, output_stdev, g, "output length")
    return [BenchRequest(i, torch.randint(0, vocab_size, (n,), generator=g).tolist(), o)
            for i, (n, o) in enumerate(zip(ins, outs))]


def from_text(text: str, tokenizer, num_requests: int, input_len: int, output_mean: float, output_stdev: float = 0,
              seed: int = 0) -> list[BenchRequest]:
    """Requests whose prompts are consecutive `input_len`-token windows of a text (tokenized once)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if input_len < 1 or num_requests < 1:
        raise ValueError(f"input_len={input_len} and num_requests={num_requests} must be >= 1")
    if len(ids) < input_len:
        raise ValueError(f"the text has {len(ids)} tokens; input_len={input_len} needs at least that many")
    g = torch.Generator().manual_seed(seed)
    outs = _lengths(num_requests, output_mean, output_stdev, g, "output length")
    windows = max(1, len(ids) // input_len)
    return [BenchRequest(i, ids[(i % windows) * input_len:(i % windows + 1) * input_len], outs[i])
            for i in range(num_requests)]


def write_jsonl(requests: Iterable[BenchRequest], path: str | Path | None) -> str:
    """Write requests as JSON lines (to `path`, atomically, or return the text when path is None)."""
    text = "".join(json.dumps({"task_id": r.task_id, "input_ids": r.input_ids, "output_tokens": r.output_tokens},
                              separators=(",", ":")) + "\n" for r in requests)
    if path is not None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return text


def read_dataset(path: str | Path, tokenizer=None, vocab_size: int | None = None,
                 num_requests: int | None = None) -> list[BenchRequest]:
    """Parse a trtllm-bench JSON-lines dataset; `prompt` entries need a tokenizer. Errors name the line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
            if not isinstance(d, dict) or "task_id" not in d or "output_tokens" not in d:
                raise ValueError(f"{where}: needs task_id, output_tokens and prompt or input_ids")
            o = d["output_tokens"]
            if not isinstance(o, int) or isinstance(o, bool) or o < 1:
                raise ValueError(f"{where}: output_tokens={o!r} must be an integer >= 1")
            if "input_ids" in d:
                ids = d["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{where}: input_ids must be a non-empty list of integers")
            elif "prompt" in d:
                if tokenizer is None:
                    raise ValueError(f"{where}: a 'prompt' entry needs a tokenizer (use input_ids for engines "
                                     f"without one)")
                if not isinstance(d["prompt"], str) or not d["prompt"]:
                    raise ValueError(f"{where}: prompt must be a non-empty string")
                ids = tokenizer.encode(d["prompt"])
            else:
                raise ValueError(f"{where}: needs 'prompt' or 'input_ids'")
            if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
                raise ValueError(f"{where}: input_ids outside the vocabulary [0, {vocab_size})")
            out.append(BenchRequest(d["task_id"], ids, o))
            if num_requests and len(out) >= num_requests:
                break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def summary(requests: list[BenchRequest]) -> dict:
    """trtllm-bench's dataset statistics (input, output and sequence length min/max/avg/percentiles)."""
    from .metrics import percentiles

    ins = [len(r.input_ids) for r in requests]
    outs = [r.output_tokens for r in requests]
    return {"num_requests": len(requests), "isl_stats": percentiles(ins), "osl_stats": percentiles(outs),
            "seq_len_stats": percentiles([i + o for i, o in zip(ins, outs)]),
            "max_isl": max(ins), "max_osl": max(outs), "max_sequence_length": max(i + o for i, o in zip(ins, outs)),
            "avg_isl": sum(ins) / len(ins), "avg_osl": sum(outs) / len(outs)}


__all__ = ["BenchRequest", "from_text", "read_dataset", "summary", "token_norm_dist", "write_jsonl"]
