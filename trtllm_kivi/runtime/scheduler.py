"""Continuous-batching scheduler over any Runner (runtime/base.py): many requests share one runner, each in its own
cache slot; new requests join the running batch between steps, and each finishes on its own stop condition.

One `step()`:
  1. admit waiting requests into free slots (runner.add_sequence: a fresh, empty sequence),
  2. build a ragged batch: every decoding request feeds its last sampled token, then prefilling requests feed their
     next prompt chunk while the step's token budget (max_batch_tokens) lasts, so one request's prefill chunk and
     others' decode tokens share a step,
  3. run runner.step once, sample each request whose prompt is complete, check its stop conditions (max tokens,
     stop token ids, stop strings), stream the new token/text, and free the slot of every finished request.

Isolation: a request only ever feeds and reads its own slot, and its slot is empty when it gets it (the cache resets a
slot on add_sequence; blocks are reassigned through the block table). Prompt chunk boundaries are a function of the
request alone (multiples of prefill_chunk from the prompt start), and sampling uses one generator per request, so a
request's tokens do not depend on what else is in the batch (up to the rounding of batched CPU matmuls).

Admission control: a request whose prompt + max_new_tokens - 1 positions exceed runner.max_seq_len or the whole
KV block pool, an empty prompt, or token ids outside the vocabulary are refused at submit() with RequestRejected;
nothing else changes. KV blocks: a request is admitted only when the pool's unreserved blocks cover its worst case
(prompt + max_new_tokens - 1 tokens stored); it keeps that reservation until it finishes. So when blocks run short,
requests wait in arrival order, and a running request never finds the pool empty mid-generation.

Prefix sharing (prefix_caching=True; runtime/prefix_cache.py): a prompt chunk also ends at every boundary b_k of
the cache (where a prefix's state is whole blocks + a window), the state there is kept, and a request whose prompt
starts with a kept prefix gets that state at admission and prefills only the rest (`cached_tokens`); a request whose
next prefix block a running prefill is computing waits for it rather than computing it again. Chunk ends are
then a function of the position alone, so a request's tokens are the same whether its prefix came from the cache
or not. Admission counts a shared block once: the blocks live sequences hold, plus what each may still allocate,
plus the new request's revived (cached, unheld) prefix blocks and its own worst case beyond them, must fit the pool.

Cancellation: Request.cancel(), or a `cancelled` predicate given to submit() (e.g. Triton's request.is_cancelled),
polled before every step; a cancelled request ends with finish_reason "cancelled" and its slot and blocks are freed
in that step, waiting or running.

Use it synchronously (`submit` + `run_until_idle` / `generate`, or iterate `request.stream()`, which drives the steps
itself) or in a background thread (`start()` / `stop()`: `submit` is then thread-safe and callbacks run on the
scheduler thread).
"""

from __future__ import annotations

import itertools
import operator
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator, Sequence

import torch

from ..cache import KiviCache
from . import kv_usage
from .base import Runner
from .detokenize import Detokenizer
from .prefix_cache import Match, PrefixCache, chain_hashes
from .sampling import SamplingParams, sample

# on_update(request, new_token_ids, new_text): called after every step that changed the request (new token, or
# finished); new_text is "" without a tokenizer. Raising from it cancels that request only.
UpdateCallback = Callable[["Request", list[int], str], None]


class RequestRejected(ValueError):
    """A request that cannot be served as given (empty prompt, past the runner's capacity, bad token ids)."""


@dataclass(eq=False)
class Request:
    """One generation request and its live state. Times are time.perf_counter() seconds."""

    id: str
    prompt: list[int]
    params: SamplingParams
    on_update: UpdateCallback | None = None
    tokens: list[int] = field(default_factory=list)  # generated ids (without a final stop token)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    slot: int | None = None
    fed: int = 0  # prompt tokens fed so far
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    _detok: Detokenizer = field(default_factory=lambda: Detokenizer(None))
    _cancel: bool = False
    _generator: torch.Generator | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)  # token ids, then None when finished
    _done: threading.Event = field(default_factory=threading.Event)
    _scheduler: Scheduler | None = None
    _cancelled: Callable[[], bool] | None = None  # polled before every step (e.g. the client went away)
    _blocks: int = 0  # pool blocks reserved for this request's worst case while it runs
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache
    _hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix chain (with prefix caching)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def text(self) -> str:
        """The decoded tokens, cut before a stop string ("" without a tokenizer)."""
        return self._detok.text

    def cancel(self) -> None:
        """Stop this request at the next step (finish_reason "cancelled"); its slot is freed there."""
        self._cancel = True
        if self._scheduler is not None:
            self._scheduler._wake()

    def wait(self, timeout: float | None = None) -> Request:
        """Block until finished (with a background scheduler); drives the steps itself otherwise."""
        if self._scheduler is not None and not self._scheduler.running:
            while not self.finished:
                self._scheduler.step()
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Yield generated token ids as they are produced (each one once), until the request finishes."""
        while True:
            try:
                tok = self._events.get_nowait()
            except queue.Empty:
                if self._scheduler is not None and not self._scheduler.running:
                    if self.finished and self._events.empty():
                        return
                    self._scheduler.step()
                    continue
                try:
                    tok = self._events.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"request {self.id}: no token within {timeout} s") from None
            if tok is None:
                return
            yield tok


class Scheduler:
    """Continuous batching of requests over one runner (see the module doc)."""

    def __init__(self, runner: Runner, tokenizer=None, max_batch_tokens: int = 512, prefill_chunk: int = 128,
                 max_batch_size: int | None = None, prefix_caching: bool = False,
                 prefix_capacity: int | None = None) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be >= 1")
        self.runner, self.tokenizer = runner, tokenizer
        # a graph runner is built for at most max_num_tokens tokens per step: a hard limit on the budget
        limit = runner.max_num_tokens
        self.hard_limit = limit is not None
        self.max_batch_tokens = min(max_batch_tokens, limit) if limit else max_batch_tokens
        self.prefill_chunk = min(prefill_chunk, self.max_batch_tokens)
        self.max_batch_size = runner.max_slots if max_batch_size is None else max_batch_size
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._lock = threading.Lock()  # guards _waiting (submit may come from other threads)
        self._step_lock = threading.Lock()  # one step at a time
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopping_submit = False  # drain(): no new requests, running ones finish
        self._ids = itertools.count()
        self.steps = 0  # runner steps run so far (for stats)
        # counters for metrics (read from other threads; ints only)
        self.prompt_tokens = 0  # prompt tokens fed
        self.generated_tokens = 0  # tokens sampled (including final stop tokens)
        self.finished_requests: dict[str, int] = {}  # finish reason -> count
        self.blocks_reserved = 0  # pool blocks reserved by running requests
        self.prefix: PrefixCache | None = None
        if prefix_caching:
            cache = getattr(runner, "cache", None)
            if cache is None:
                raise ValueError(f"prefix caching needs a runner with a trtllm_kivi cache; {runner.name} has none")
            self.prefix = PrefixCache(cache, prefix_capacity)

    # ------------------------------------------------------------------------------------------- submission

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected when the request cannot be served; changes nothing."""
        if len(prompt) == 0:
            raise RequestRejected("the prompt is empty; it needs at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestRejected(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"stop token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop_strings and self.tokenizer is None:
            raise RequestRejected("stop strings need a tokenizer; this scheduler has none")
        cap = self.runner.max_seq_len
        if len(prompt) > cap:
            raise RequestRejected(f"the prompt has {len(prompt)} tokens; a sequence holds at most max_seq_len={cap} "
                                  f"tokens (prompt + max_new_tokens - 1), so the prompt must be 1..{cap} tokens")
        need = len(prompt) + params.max_new_tokens - 1  # the last new token is never fed back
        if need > cap:
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} needs {need} cache "
                f"positions; a sequence holds at most max_seq_len={cap} (max_new_tokens allowed for this prompt: "
                f"1..{cap - len(prompt) + 1})")
        blocks, pool = kv_usage.blocks_for(self.runner, need), kv_usage.blocks_total(self.runner)
        if blocks > pool:
            fit = kv_usage.max_tokens_in_blocks(self.runner, pool)
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} needs {blocks} KV cache "
                f"blocks; the whole pool has {pool}, which holds at most {fit} tokens per request (prompt + "
                f"max_new_tokens - 1)")

    def submit(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
               on_update: UpdateCallback | None = None, request_id: str | None = None,
               cancelled: Callable[[], bool] | None = None) -> Request:
        """Queue a request (token ids); raises RequestRejected (nothing queued) when it cannot be served.
        `cancelled() -> True` (polled before every step) cancels it, as Request.cancel() does."""
        try:
            prompt = [operator.index(t) for t in prompt]  # ints (numpy ints too); never silently truncate floats
        except TypeError as e:
            raise RequestRejected(f"prompt token ids must be integers: {e}") from None
        self.check(prompt, params)
        gen = torch.Generator()
        gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
        req = Request(id=request_id if request_id is not None else str(next(self._ids)), prompt=prompt,
                      params=params, on_update=on_update, arrival_time=time.perf_counter(), _generator=gen,
                      _detok=Detokenizer(self.tokenizer, params.stop_strings), _scheduler=self,
                      _cancelled=cancelled)
        with self._cv:
            if self._stopping or self._stopping_submit:
                raise RequestRejected("the scheduler is stopped; no new requests")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()) -> list[Request]:
        """Submit every prompt, run until all finish (synchronously), return the requests in order."""
        reqs = [self.submit(p, params) for p in prompts]
        if self.running:
            for r in reqs:
                r.wait()
        else:
            self.run_until_idle()
        return reqs

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def run_until_idle(self) -> None:
        while self.has_work():
            if not self._running and self.runner.free_slots == 0:  # nothing can ever be admitted: never spin
                raise RuntimeError(f"{self.num_waiting} requests wait but the runner has no free slot and none is "
                                   f"running (slots held outside this scheduler)")
            self.step()

    # ------------------------------------------------------------------------------------------- one step

    def step(self) -> list[Request]:
        """Admit, run one runner step over the batch, sample and stream; returns the requests finished here."""
        with self._step_lock:
            finished = self._drop_cancelled()
            self._admit()
            batch = self._build_batch()
            if not batch:
                return finished
            reqs, chunks = zip(*batch, strict=False)
            try:
                logits = self.runner.step([r.slot for r in reqs], list(chunks))  # [B, vocab]
            except Exception as e:  # the runner validates before changing state: fail this batch, keep serving
                for r in reqs:
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
                return finished + list(reqs)
            self.steps += 1
            now = time.perf_counter()
            for b, (r, chunk) in enumerate(batch):
                if r.fed < len(r.prompt):
                    r.fed += len(chunk)
                    self.prompt_tokens += len(chunk)
                    if self.prefix is not None and r.slot is not None:
                        self.prefix.register(r.slot, r._hashes, r.fed)
                    if r.fed < len(r.prompt):
                        continue  # a middle prompt chunk: its logits predict prompt tokens
                if self._sample(r, logits[b], now):
                    finished.append(r)
            return finished

    def _drop_cancelled(self) -> list[Request]:
        with self._lock:
            live = list(self._waiting) + self._running
        for r in live:
            if r._cancelled is not None and not r._cancel:
                try:
                    r._cancel = bool(r._cancelled())
                except Exception as e:  # the predicate's client is gone: cancel
                    r._cancel, r.error = True, f"cancel check failed: {type(e).__name__}: {e}"
        with self._lock:
            gone = [r for r in self._waiting if r._cancel]
            for r in gone:
                self._waiting.remove(r)
        gone += [r for r in self._running if r._cancel]
        for r in gone:
            self._finish(r, "cancelled")
        return gone

    def _admit(self) -> None:
        with self._lock:
            pool = kv_usage.blocks_total(self.runner)
            inflight = self._inflight_prefixes()
            i = 0
            while i < len(self._waiting) and self.runner.free_slots > 0 and len(self._running) < self.max_batch_size:
                r = self._waiting[i]
                blocks = kv_usage.blocks_for(self.runner, len(r.prompt) + r.params.max_new_tokens - 1)
                match, usable = self._match(r)
                if match.depth < usable and r._hashes[match.depth] in inflight:
                    i += 1  # a running request is prefilling this prompt's next prefix block: reuse it when kept
                    continue
                if self._committed() + match.revived + blocks - len(match.blocks) > pool:
                    break  # wait (in arrival order) until running requests return their blocks
                del self._waiting[i]
                r.slot = self.runner.add_sequence()
                r._blocks, self.blocks_reserved = blocks, self.blocks_reserved + blocks
                if self.prefix is not None:
                    self.prefix.attach(r.slot, match)
                    r.fed = r.cached_tokens = match.tokens
                    inflight.update(self._pending_hashes(r))
                self._running.append(r)

    def _match(self, r: Request) -> tuple[Match, int]:
        """The request's longest cached prefix, and how many of its prefix entries it could use at all."""
        if self.prefix is None:
            return Match(), 0
        if not r._hashes:
            r._hashes = chain_hashes(r.prompt, self.prefix.bounds(len(r.prompt)))
        usable = len(self.prefix.bounds(len(r.prompt) - 1))  # at least one prompt token is left to prefill
        return self.prefix.match(r.prompt, r._hashes[:usable]), usable

    def _pending_hashes(self, r: Request) -> list[bytes]:
        """The prefix entries a running request will still register (its boundaries beyond what it has fed)."""
        assert self.prefix is not None
        done = len(self.prefix.bounds(r.fed))
        return r._hashes[done:]

    def _inflight_prefixes(self) -> set[bytes]:
        """Prefix entries that running prefills are computing now. A waiting request whose next entry is among them
        waits for it (later arrivals may go first) instead of computing the same prefix again: a burst of requests
        with a common system prompt computes it once."""
        if self.prefix is None:
            return set()
        return {h for r in self._running if r.fed < len(r.prompt) for h in self._pending_hashes(r)}

    def _committed(self) -> int:
        """Pool blocks that running requests hold or may still allocate (a shared block counts once)."""
        if self.prefix is None or not self.prefix.kivi:
            return self.blocks_reserved
        cache = self.prefix.cache
        assert isinstance(cache, KiviCache)
        return cache.blocks_in_use + sum(r._blocks - len(cache.blocks_of(r.slot)) for r in self._running
                                         if r.slot is not None)

    def _build_batch(self) -> list[tuple[Request, list[int]]]:
        """Decode tokens first (one per decoding request), then whole prompt chunks in arrival order while the
        token budget lasts; the oldest prefilling request always gets its chunk (unless the runner has a hard
        per-step token limit), so prefill never starves. Chunk boundaries never depend on the budget."""
        batch = [(r, r.tokens[-1:]) for r in self._running if r.fed >= len(r.prompt)]
        budget = self.max_batch_tokens - len(batch)
        prefills = 0
        for r in self._running:
            if r.fed < len(r.prompt):
                end = r.fed + self.prefill_chunk
                if self.prefix is not None:  # a chunk ends at every boundary, where the prefix state is kept
                    end = min(end, self.prefix.next_boundary(r.fed))
                chunk = r.prompt[r.fed:end]
                if len(chunk) <= budget or (prefills == 0 and not self.hard_limit):
                    batch.append((r, chunk))
                    budget -= len(chunk)
                    prefills += 1
        return batch

    def _sample(self, r: Request, logits: torch.Tensor, now: float) -> bool:
        """Sample r's next token, apply its stop conditions, stream; True when r finished."""
        p = r.params
        tok = sample(logits, p, r._generator)
        self.generated_tokens += 1
        new: list[int] = []
        reason = None
        if tok in p.stop_token_ids:
            reason = "stop"
        else:
            r.tokens.append(tok)
            r.token_times.append(now)
            if r.first_token_time is None:
                r.first_token_time = now
            new = [tok]
            r._events.put(tok)
            r._detok.push(tok)
            if r._detok.stopped:
                reason = "stop"
        if reason is None and len(r.tokens) >= p.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason, new=new)
            return True
        self._notify(r, new)
        return False

    def _notify(self, r: Request, new: list[int]) -> None:
        if r.on_update is None:
            return
        delta = r._detok.delta(final=r.finished)
        if not new and not delta and not r.finished:
            return
        try:
            r.on_update(r, new, delta)
        except Exception as e:  # e.g. the client went away: stop this request only
            if not r.finished:
                r._cancel = True
                r.error = f"on_update failed: {type(e).__name__}: {e}"

    def _finish(self, r: Request, reason: str, error: str | None = None, new: list[int] | None = None) -> None:
        self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1  # (before the slot is free)
        if r.slot is not None:
            self.runner.free_sequence(r.slot)
            r.slot = None
        self.blocks_reserved -= r._blocks
        r._blocks = 0
        if r in self._running:
            self._running.remove(r)
        r.finish_reason = reason
        r.error = error if error is not None else r.error
        r.finish_time = time.perf_counter()
        r._done.set()
        r._events.put(None)
        self._notify(r, new or [])

    # ------------------------------------------------------------------------------------------- background

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Scheduler:
        """Run steps in a background thread whenever there is work."""
        if self.running:
            return self
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="trtllm-kivi-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, cancel: bool = True) -> None:
        """Stop the background thread; with cancel, unfinished requests end as "cancelled" (slots freed)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if cancel:
            for r in list(self._waiting) + list(self._running):
                r._cancel, r.error = True, r.error or "the scheduler stopped (server shutdown)"
            self._drop_cancelled()

    def drain(self, timeout: float, reason: str = "server shutdown") -> int:
        """Shut down gracefully: refuse new requests, cancel the waiting ones, let the running ones finish for up to
        `timeout` seconds (background thread), then stop and cancel the rest. Returns how many were cancelled."""
        with self._cv:
            self._stopping_submit = True
            waiting = list(self._waiting)
        before = self.finished_requests.get("cancelled", 0)
        for r in waiting:
            r.error = r.error or reason
            r.cancel()
        deadline = time.monotonic() + timeout
        while self.running and self.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            for r in list(self._waiting) + list(self._running):
                r.error = r.error or f"{reason}: not finished within {timeout:g} s"
        self.stop(cancel=True)
        return self.finished_requests.get("cancelled", 0) - before

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.has_work():
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a bug must not leave clients waiting forever: fail what is running
                for r in list(self._running):
                    self._finish(r, "error", f"scheduler error: {type(e).__name__}: {e}")


__all__ = ["Request", "RequestRejected", "Scheduler", "SamplingParams", "UpdateCallback"]
