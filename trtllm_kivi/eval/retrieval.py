"""Long-context retrieval: passkey (eval/passkey.py's prompts, to 32K) and multi-key retrieval (LongBench's
KV-retrieval style: a JSON object of 100+ random UUID pairs, asked for the value of one key), scored in two modes.

serving   how KIVI serves a prompt: the whole prompt but its last token is prefilled once with full-precision
          attention in the model dtype, its K/V are stored into each cache configuration (the stored state is a pure
          function of the K/V, so the state after one append equals the streamed one), and the last prompt token and
          the answer are decoded from that cache (teacher-forced): every answer token is predicted by a query that
          reads the quantized cache. One prefill serves every configuration of a cell, and the configurations decode
          together as one batch (one sequence per cache, `ConfigBatch`).
decode    stricter: the prompt is prefilled through each configuration's own cache in chunks (a later chunk reads
          the quantized state of the earlier ones), then the answer is teacher-forced as in eval/passkey.py.

A cell passes when every answer token is the argmax. Cells are cached one per (mode, cell, configuration) in a
JSON-lines ResultCache, so a rerun resumes. Prompts are built so that cells share prefixes (causal attention: a
prefix's K/V do not depend on what follows): every passkey prompt starts with the same intro + filler stream up to
its needle, and the KV-retrieval prompts of one seed start with the same intro + pairs stream (a shorter prompt's
haystack is a prefix of a longer one's; the depth only changes the question). `PrefixPrefill` keeps the stream's
K/V and prefills only what a cell adds to it.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import FullCache, KiviCache, KVCache, Step, check_kv_range
from ..models.llama import LlamaModel
from ..reference.attention import append
from ..reference.quant import torch_dtype
from ..reference.rotation import rotate, unrotate
from ..runtime.kvspec import KVSpec
from ..runtime.torch_runner import TorchRunner
from .metrics import token_rank
from .suite import passkey_prompts

KV_INTRO = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{\n"
KV_PAIR = '"{key}": "{value}",\n'
# The scored answer is the value itself: the prompt ends with its opening quote and the closing one is not scored.
# Otherwise an FP16 model that retrieves every value token still loses cells on the quotes' spelling (' "' vs '"'
# before it; after it the JSON has '",\n', one token, which the model rightly prefers to '"').
KV_QUESTION = '}}\n\nKey: "{key}"\nThe value associated with the specified key is: "'
KV_ANSWER = '{value}'


@dataclass
class Cell:
    """One retrieval prompt: prompt[:shared] equals the first `shared` tokens of the stream `stream`."""

    task: str  # passkey | kv
    length: int  # requested prompt length in tokens
    depth: float  # where the needle (passkey) or the asked pair (kv) sits, in [0, 1]
    seed: int
    stream: str
    shared: int
    prompt: list[int]  # context + question (all but the last token are prefilled)
    answer: list[int]  # teacher-forced
    target: str  # the passkey or the value asked for

    @property
    def key(self) -> str:
        return f"{self.task}|{self.length}|{self.depth}|{self.seed}"


def passkey_cells(encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float],
                  seeds: Sequence[int]) -> tuple[list[Cell], dict[str, list[int]]]:
    """eval/passkey.py's prompts (keys from suite.passkey_prompts per seed) as cells over one shared stream."""
    cells = []
    for seed in seeds:
        for (n, d), p in passkey_prompts(encode, lengths, depths, seed).items():
            cells.append(Cell("passkey", n, d, seed, "passkey", p.needle_start, p.context + p.question, p.answer,
                              p.key))
    longest = max(cells, key=lambda c: c.shared)
    stream = longest.prompt[:longest.shared]  # intro + filler units, the same tokens for every cell
    assert all(c.prompt[:c.shared] == stream[:c.shared] for c in cells)
    return cells, {"passkey": stream}


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_cells(encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float],
             seeds: Sequence[int]) -> tuple[list[Cell], dict[str, list[int]]]:
    """Multi-key retrieval: per seed one stream of random UUID pairs (one JSON member per line, each line tokenized
    on its own so positions are exact); a prompt of length n holds as many pairs as fit, and at depth d asks for
    the pair at index round(d * (pairs - 1))."""
    intro = encode(KV_INTRO)
    cells, streams = [], {}
    for seed in seeds:
        rng = random.Random(seed)
        pairs: list[tuple[str, str, list[int]]] = []
        ends = [len(intro)]  # ends[i]: stream length with i pairs
        need = max(lengths)
        while ends[-1] < need:
            k, v = _uuid(rng), _uuid(rng)
            pairs.append((k, v, encode(KV_PAIR.format(key=k, value=v))))
            ends.append(ends[-1] + len(pairs[-1][2]))
        stream = intro + [t for _, _, toks in pairs for t in toks]
        streams[f"kv{seed}"] = stream
        for n in lengths:
            q_len = len(encode(KV_QUESTION.format(key=pairs[0][0]))) + len(encode(KV_ANSWER.format(value=pairs[0][1])))
            count = max(i for i, e in enumerate(ends) if e + q_len + 8 <= n)  # 8: slack for key/value token counts
            if count < 2:
                raise ValueError(f"kv retrieval length {n} is too short for two pairs")
            for d in depths:
                i = round(d * (count - 1))
                key, value, _ = pairs[i]
                prompt = stream[:ends[count]] + encode(KV_QUESTION.format(key=key))
                cells.append(Cell("kv", n, d, seed, f"kv{seed}", ends[count], prompt,
                                  encode(KV_ANSWER.format(value=value)), value))
    return cells, streams


# ------------------------------------------------------------------------------------------------ serving mode


class PrefixPrefill:
    """Full-precision prefill (the model dtype, unquantized cache) that keeps a stream's K/V in slot 0 and prefills
    a cell in slot 1 from a copy of the stream's first `shared` rows. `kv(cell)` returns per layer the K/V
    [Hkv, P - 1, D] of the cell's prompt but its last token (views into the cache: valid until the next call)."""

    def __init__(self, model: LlamaModel, capacity: int, chunk: int = 512) -> None:
        self.cache = FullCache(model.cfg.geometry, 2, capacity, model.dtype, model.device)
        self.runner = TorchRunner(model, self.cache)
        self.chunk = chunk
        self.stream_id: str | None = None
        self.prefilled = 0  # stream tokens in slot 0
        self.tokens_computed = 0  # prefill work done (for the report)

    def _prefill(self, slot: int, tokens: Sequence[int]) -> None:
        for s in range(0, len(tokens), self.chunk):
            self.runner.step([slot], [list(tokens[s:s + self.chunk])])
        self.tokens_computed += len(tokens)

    def extend_stream(self, stream_id: str, stream: Sequence[int], n: int) -> None:
        if stream_id != self.stream_id:
            for s in (0, 1):
                if self.cache.active[s]:
                    self.cache.free_sequence(s)
            self.cache.add_sequence()  # slot 0
            self.stream_id, self.prefilled = stream_id, 0
        if n > self.prefilled:
            self._prefill(0, stream[self.prefilled:n])
            self.prefilled = n

    def save_stream(self, path: Path) -> None:
        """Keep the stream's K/V on disk ([layers, 2, Hkv, n, D] + its id and length; atomic), so that a rerun or a
        switch between streams does not prefill it again."""
        n = self.prefilled
        kv = torch.stack([torch.stack([k[0, :, :n], v[0, :, :n]]) for k, v in zip(self.cache.k, self.cache.v,
                                                                                   strict=True)])
        tmp = path.with_name(path.name + ".partial")
        torch.save({"stream": self.stream_id, "n": n, "kv": kv}, tmp)
        tmp.replace(path)

    def load_stream(self, path: Path, stream_id: str) -> bool:
        """Restore a saved stream into slot 0 (False when the file is absent or of another stream)."""
        if not path.is_file():
            return False
        doc = torch.load(path)
        if doc.get("stream") != stream_id:
            return False
        self.extend_stream(stream_id, [], 0)
        n = int(doc["n"])
        for layer, kv in enumerate(doc["kv"]):
            self.cache.k[layer][0, :, :n] = kv[0]
            self.cache.v[layer][0, :, :n] = kv[1]
        self.cache.seq_lens[0] = self.prefilled = n
        return True

    def kv(self, cell: Cell, stream: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.extend_stream(cell.stream, stream, cell.shared)
        if self.cache.active[1]:
            self.cache.free_sequence(1)
        slot = self.cache.add_sequence()
        assert slot == 1
        n, p = cell.shared, len(cell.prompt) - 1
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][1, :, :n] = self.cache.k[layer][0, :, :n]
            self.cache.v[layer][1, :, :n] = self.cache.v[layer][0, :, :n]
        self.cache.seq_lens[1] = n
        self._prefill(1, cell.prompt[n:p])
        return [(self.cache.k[i][1, :, :p], self.cache.v[i][1, :, :p]) for i in range(len(self.cache.k))]


def load_state(cache: KVCache, slot: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Store the K/V [Hkv, T, D] of every layer (unrotated, as the model computes them) as the state of an empty
    slot: the same stored state as streaming them (the state is a pure function of the K/V), rotated per the
    cache's format and range-checked like any K/V entering a cache."""
    t = kv[0][0].shape[1]
    step = cache.begin_step([slot], [t])
    for layer, (k, v) in enumerate(kv):
        if isinstance(cache, KiviCache):
            kr, vr = cache.rotations(layer)
            k, v = rotate(k, kr).to(cache.dtype).contiguous(), rotate(v, vr).to(cache.dtype).contiguous()
            check_kv_range(layer, k, v, torch_dtype(cache.cfg.scale_dtype), "KIVI scale/zero dtype")
            append(cache.layers[layer], cache.cfg, slot, step.block_table[0], 0, k, v)
        elif isinstance(cache, FullCache):
            check_kv_range(layer, k, v, cache.dtype, "cache dtype")
            cache.k[layer][slot, :, :t] = k
            cache.v[layer][slot, :, :t] = v
        else:
            raise TypeError(f"cannot load a state into {type(cache).__name__}")
    cache.end_step(step)


class ConfigBatch:
    """Several caches (one sequence each, slot 0) driven as one batch: sequence b of a step is caches[b]'s. Each
    cache's rotation is applied here (the model sees none), so configurations with different rotations decode in
    one forward; the result equals running each alone."""

    kivi_config = None

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = list(caches)
        self.geom = self.caches[0].geom
        self._steps: list[Step] = []

    def begin_step(self, slots: Sequence[int], chunk_lens: Sequence[int]) -> Step:
        self._steps = [self.caches[b].begin_step([0], [c]) for b, c in zip(slots, chunk_lens, strict=True)]
        past = [s.past[0] for s in self._steps]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        return Step(list(slots), past, list(chunk_lens), i32(list(slots)), i32(past), i32(list(chunk_lens)),
                    torch.zeros((len(slots), 0), dtype=torch.int32))

    def rotations(self, layer: int) -> tuple[str, str]:
        return "none", "none"

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        out = torch.empty_like(q)
        off = 0
        for b, c in zip(step.slots, step.chunk, strict=True):
            rows = slice(off, off + c)
            cache = self.caches[b]
            kr, vr = cache.rotations(layer)
            o = cache.attention(layer, rotate(q[rows], kr).contiguous(), rotate(k[rows], kr).contiguous(),
                                rotate(v[rows], vr).contiguous(), self._steps[b])
            out[rows] = unrotate(o, vr)
            off += c
        return out

    def end_step(self, step: Step) -> None:
        for s, cache in zip(self._steps, (self.caches[b] for b in step.slots), strict=True):
            cache.end_step(s)


def _score(model: LlamaModel, batch: ConfigBatch, first: int, answer: Sequence[int]) -> list[dict]:
    """Feed `first` (the prompt's last token) then the answer teacher-forced to every cache of the batch; per cache
    the rank and log-probability of each answer token."""
    n = len(batch.caches)
    ranks: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    feed = first
    for j, tok in enumerate(answer):
        step = batch.begin_step(list(range(n)), [1] * n)
        positions = torch.tensor(step.past, dtype=torch.long)
        with torch.inference_mode():
            logits = model(torch.full((n,), feed, dtype=torch.long), positions, batch, step)  # [n, V]
        batch.end_step(step)
        r = token_rank(logits, torch.full((n,), tok, dtype=torch.long))
        lp = torch.log_softmax(logits.double(), -1)[:, tok]
        for b in range(n):
            ranks[b].append(int(r[b]))
            logps[b].append(round(float(lp[b]), 4))
        feed = answer[j]
    return [{"passed": all(x == 0 for x in ranks[b]), "ranks": ranks[b], "logprobs": logps[b],
             "answer_logprob": round(sum(logps[b]), 4)} for b in range(n)]


def serving_scores(model: LlamaModel, specs: dict[str, KVSpec], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   cell: Cell, backend: str | None = None) -> dict[str, dict]:
    """Serving mode for one cell: every configuration's cache gets the prefilled K/V, then all decode together."""
    t = kv[0][0].shape[1] + 1 + len(cell.answer)
    caches = [spec.make_cache(model.cfg.geometry, 1, t, model.dtype, model.device, backend=backend)
              for spec in specs.values()]
    for c in caches:
        load_state(c, c.add_sequence(), kv)
    rows = _score(model, ConfigBatch(caches), cell.prompt[-1], cell.answer)
    return dict(zip(specs, rows, strict=True))


def decode_scores(model: LlamaModel, spec: KVSpec, cell: Cell, chunk: int = 512, backend: str | None = None
                  ) -> dict:
    """Decode mode for one cell and configuration: the prompt but its last token prefilled through the cache in
    chunks, then scored as in serving mode."""
    t = len(cell.prompt) + len(cell.answer)
    cache = spec.make_cache(model.cfg.geometry, 1, t, model.dtype, model.device, backend=backend)
    runner = TorchRunner(model, cache)
    slot = runner.add_sequence()
    body = cell.prompt[:-1]
    for s in range(0, len(body), chunk):
        runner.step([slot], [body[s:s + chunk]])
    return _score(model, ConfigBatch([cache]), cell.prompt[-1], cell.answer)[0]


def summarize_cells(rows: Sequence[dict]) -> dict:
    """passes / cells, the pass rate, and the failing cells (length/depth/seed: first failing answer position: its
    rank)."""
    n = len(rows)
    passed = sum(r["passed"] for r in rows)
    fails = []
    for r in rows:
        if not r["passed"]:
            j = next(i for i, x in enumerate(r["ranks"]) if x)
            fails.append(f"{r['length']}/{r['depth']}/{r['seed']}: {j}: {r['ranks'][j]}")
    return {"passed": passed, "cells": n, "pass_rate": passed / n if n else None, "failed": fails,
            "mean_answer_logprob": sum(r["answer_logprob"] for r in rows) / n if n else None}
