"""Scheduler admission under KV block pressure, cancellation by predicate, capacity messages and the counters that
serving exports as metrics (trtllm_kivi/runtime/scheduler.py, runtime/kv_usage.py, serving/metrics.py).

Oracle: each request run alone on a fresh runner with a full pool (tests/test_scheduler_batching.py's `alone`), and
the block arithmetic of docs/design.md's streaming contract (n_q(T) = max(0, floor((T - R) / G)) * G tokens quantized,
block_size tokens per block)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from trtllm_kivi.models import LlamaModel, ModelConfig
from trtllm_kivi.runtime import kv_usage
from trtllm_kivi.runtime.generate import SamplingParams
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.scheduler import RequestRejected, Scheduler
from trtllm_kivi.runtime.torch_runner import TorchRunner
from trtllm_kivi.serving.metrics import TokenRate, snapshot

G, R, BS = 32, 16, 32  # flush points 48, 80, ...; one block per 32 quantized tokens
KV = parse_kv("kivi2", group_size=G, residual_length=R, block_size=BS)
MAX_SEQ_LEN, CHUNK, VOCAB = 112, 16, 512

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                      max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(shape, generator=g) * (1.0 if len(shape) == 1 else 0.3)
          for n, shape in LlamaModel.hf_weight_shapes(cfg).items()}
    return LlamaModel.from_hf_state_dict(cfg, sd)


def runner(model, slots: int, num_blocks: int | None = None) -> TorchRunner:
    extra = {} if num_blocks is None else {"num_blocks": num_blocks}
    return TorchRunner.create(model, KV, slots, MAX_SEQ_LEN, **extra)


def alone(model, prompt, n):
    return Scheduler(runner(model, 1), prefill_chunk=CHUNK).generate([prompt], SamplingParams(max_new_tokens=n))[0]


def blocks_by_contract(tokens: int) -> int:
    return math.ceil(max(0, (tokens - R) // G * G) / BS)


def test_blocks_for_follows_the_streaming_contract(model):
    r = runner(model, 2)
    for t in range(MAX_SEQ_LEN + 1):
        assert kv_usage.blocks_for(r, t) == blocks_by_contract(t), t
    assert kv_usage.blocks_total(r) == 2 * blocks_by_contract(MAX_SEQ_LEN)
    assert kv_usage.max_tokens_in_blocks(r, 1) == 79  # n_q(79) = 32, n_q(80) = 64
    full = TorchRunner.create(model, parse_kv("fp16"), 2, MAX_SEQ_LEN)
    assert kv_usage.blocks_for(full, 100) == 0 and kv_usage.blocks_total(full) == 0


def test_requests_wait_for_blocks_and_stay_exact(model):
    """4 slots but 3 blocks: a request needing 2 blocks (prompt 60 + 30 new -> 89 tokens) and three needing 1
    (<= 79 tokens). Admission reserves each one's worst case, so the pool never runs dry mid-generation: requests
    wait while slots are free, blocks in use never exceed the pool, and every output equals its solo run."""
    g = torch.Generator().manual_seed(1)
    work = [(torch.randint(0, VOCAB, (60,), generator=g).tolist(), 30)] + \
        [(torch.randint(0, VOCAB, (20 + 5 * i,), generator=g).tolist(), 40) for i in range(3)]
    assert [blocks_by_contract(len(p) + n - 1) for p, n in work] == [2, 1, 1, 1]
    run = runner(model, 4, num_blocks=3)
    sched = Scheduler(run, prefill_chunk=CHUNK)
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=n)) for p, n in work]
    waited_with_free_slots = 0
    while sched.has_work():
        sched.step()
        u = kv_usage.kv_usage(run)
        assert u.blocks_in_use <= sched.blocks_reserved <= 3
        waited_with_free_slots += sched.num_waiting > 0 and run.free_slots > 0
    assert waited_with_free_slots > 0, "no request ever waited for blocks"
    for (p, n), r in zip(work, reqs, strict=True):
        assert r.finish_reason == "length" and r.tokens == alone(model, p, n).tokens
    u = kv_usage.kv_usage(run)
    assert (u.slots_in_use, u.blocks_in_use, sched.blocks_reserved) == (0, 0, 0)


def test_capacity_messages_name_what_fits(model):
    sched = Scheduler(runner(model, 2, num_blocks=1), prefill_chunk=CHUNK)
    with pytest.raises(RequestRejected, match=r"the prompt has 500 tokens; a sequence holds at most max_seq_len=112 "
                                              r"tokens .*prompt must be 1\.\.112 tokens"):
        sched.submit(list(range(500)), SamplingParams(max_new_tokens=1))
    with pytest.raises(RequestRejected, match=r"needs 119 cache positions.*allowed for this prompt: 1\.\.13\)"):
        sched.submit(list(range(100)), SamplingParams(max_new_tokens=20))
    # 60 + 30 - 1 = 89 tokens: 2 blocks; the pool has 1, which holds up to 79 tokens
    with pytest.raises(RequestRejected, match=r"needs 2 KV cache blocks; the whole pool has 1, which holds at most "
                                              r"79 tokens per request"):
        sched.submit(list(range(60)), SamplingParams(max_new_tokens=30))
    assert not sched.has_work()
    r = sched.submit(list(range(60)), SamplingParams(max_new_tokens=20))  # 79 tokens: fits
    sched.run_until_idle()
    assert r.finish_reason == "length"


def test_cancel_predicate_frees_waiting_and_running_requests(model):
    run = runner(model, 1)
    sched = Scheduler(run, prefill_chunk=CHUNK)
    flags = {"a": False, "b": False}
    a = sched.submit(list(range(1, 30)), SamplingParams(max_new_tokens=50), cancelled=lambda: flags["a"])
    b = sched.submit(list(range(1, 9)), SamplingParams(max_new_tokens=50), cancelled=lambda: flags["b"])
    c = sched.submit(list(range(3, 9)), SamplingParams(max_new_tokens=5), cancelled=lambda: 1 / 0)
    d = sched.submit(list(range(5, 12)), SamplingParams(max_new_tokens=4))
    for _ in range(4):
        sched.step()
    assert a.slot is not None and b.slot is None  # a runs, b waits (one slot)
    flags["a"] = flags["b"] = True
    sched.step()  # both dropped before this step: a's slot is free at once
    assert a.finish_reason == b.finish_reason == "cancelled" and c.finish_reason == "cancelled"
    assert "cancel check failed: ZeroDivisionError" in c.error
    assert 0 < len(a.tokens) < 50 and b.tokens == []
    sched.run_until_idle()
    assert d.tokens == alone(model, list(range(5, 12)), 4).tokens and run.free_slots == 1
    assert sched.finished_requests == {"cancelled": 3, "length": 1}


def test_counters_and_metrics_snapshot(model):
    run = runner(model, 2)
    sched = Scheduler(run, prefill_chunk=CHUNK)
    reqs = [sched.submit(list(range(1, 41)), SamplingParams(max_new_tokens=10)),
            sched.submit(list(range(1, 6)), SamplingParams(max_new_tokens=7))]
    for _ in range(4):
        sched.step()
    snap = snapshot(sched)
    assert snap["kv_slots_in_use"] == 2 and snap["requests_running"] == 2
    assert snap["kv_blocks_in_use"] == blocks_by_contract(len(reqs[0].prompt) + len(reqs[0].tokens) - 1)
    assert snap["kv_blocks_reserved"] == blocks_by_contract(49) + blocks_by_contract(11)
    assert 0 < snap["kv_cache_used_bytes"] < snap["kv_cache_bytes"] == run.kv_nbytes
    sched.run_until_idle()
    snap = snapshot(sched)
    assert snap["prompt_tokens_total"] == 45 and snap["generation_tokens_total"] == 17
    assert snap["requests_finished_total"]["length"] == 2
    assert (snap["kv_slots_in_use"], snap["kv_blocks_in_use"], snap["kv_blocks_reserved"],
            snap["kv_cache_used_bytes"]) == (0, 0, 0, 0)
    rate = TokenRate(window_s=2.0)
    assert rate.update(0.0, 0) == 0.0 and rate.update(1.0, 50) == 50.0 and rate.update(4.0, 50) == pytest.approx(0)


def test_drain_finishes_running_cancels_waiting_and_refuses_new(model):
    run = runner(model, 1)
    sched = Scheduler(run, prefill_chunk=CHUNK).start()
    try:
        a = sched.submit(list(range(1, 9)), SamplingParams(max_new_tokens=6))
        b = sched.submit(list(range(2, 9)), SamplingParams(max_new_tokens=6))
        while a.slot is None and not a.finished:
            time.sleep(0.001)
        assert sched.drain(timeout=30) == 1
    finally:
        sched.stop()
    assert a.finish_reason == "length" and a.tokens == alone(model, list(range(1, 9)), 6).tokens
    assert b.finish_reason == "cancelled" and b.error == "server shutdown" and run.free_slots == 1
    with pytest.raises(RequestRejected, match="stopped"):
        sched.submit([1, 2], SamplingParams(max_new_tokens=2))
    # a running request past the timeout is cancelled with the reason
    sched = Scheduler(runner(model, 1), prefill_chunk=CHUNK).start()
    c = sched.submit(list(range(1, 9)), SamplingParams(max_new_tokens=100))
    while not c.tokens:
        time.sleep(0.001)
    assert sched.drain(timeout=0.05) == 1
    assert c.finish_reason == "cancelled" and "not finished within 0.05 s" in c.error and 0 < len(c.tokens) < 100
