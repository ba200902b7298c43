"""Continuous-batching scheduler (trtllm_kivi/runtime/scheduler.py) on a small random-weight Llama
(LlamaModel + TorchRunner) with the real default-model tokenizer.

Oracle for every batching test: the same request run alone on a fresh runner (one slot, nothing else in the cache),
with the same prefill chunking. Interleaving, slot reuse and KIVI flushes (G=32, R=16: flush points 48, 80, ...)
must not change a single greedy token (cache isolation)."""

from __future__ import annotations

import threading

import pytest
import torch

from trtllm_kivi.models import LlamaModel, ModelConfig
from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model
from trtllm_kivi.runtime.generate import SamplingParams
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.scheduler import RequestRejected, Scheduler
from trtllm_kivi.runtime.torch_runner import TorchRunner

KV_SPECS = {
    "kivi2": dict(group_size=32, residual_length=16, block_size=32),  # small R/G: flushes inside every request
    "fp16": {},
}
MAX_SEQ_LEN = 112
PREFILL_CHUNK = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                      ffn_dim=128, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(shape, generator=g) * (1.0 if len(shape) == 1 else 0.3)
          for n, shape in LlamaModel.hf_weight_shapes(cfg).items()}
    return LlamaModel.from_hf_state_dict(cfg, sd)


def make_runner(model, kv: str, max_slots: int) -> TorchRunner:
    return TorchRunner.create(model, parse_kv(kv, **KV_SPECS[kv]), max_slots, MAX_SEQ_LEN)


def workload(n: int, seed: int = 1) -> list[tuple[list[int], int]]:
    """n (prompt, max_new_tokens) pairs of different lengths; prompts up to 70 tokens so chunks and flushes mix."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        plen = int(torch.randint(1, 71, (1,), generator=g))
        out.append((torch.randint(0, 49152, (plen,), generator=g).tolist(), int(torch.randint(1, 35, (1,),
                                                                                               generator=g))))
    return out


def alone(model, kv: str, prompt: list[int], params: SamplingParams, tokenizer=None):
    sched = Scheduler(make_runner(model, kv, 1), tokenizer, prefill_chunk=PREFILL_CHUNK)
    return sched.generate([prompt], params)[0]


@pytest.mark.parametrize("kv", list(KV_SPECS))
def test_interleaved_requests_equal_each_alone(model, kv):
    """12 requests, 3 slots (each slot reused ~4 times), requests arriving while others decode or prefill."""
    work = workload(12)
    runner = make_runner(model, kv, 3)
    sched = Scheduler(runner, prefill_chunk=PREFILL_CHUNK, max_batch_tokens=40)
    reqs = []
    mixed_steps = 0
    for i, (prompt, n) in enumerate(work):
        reqs.append(sched.submit(prompt, SamplingParams(max_new_tokens=n)))
        for _ in range(i % 4):  # staggered arrivals: 0..3 steps between submissions
            decoding = sum(r.fed >= len(r.prompt) for r in sched._running)
            prefilling = sched.num_running - decoding
            mixed_steps += decoding > 0 and prefilling > 0
            sched.step()
    sched.run_until_idle()
    assert mixed_steps > 0, "no step mixed a prefill chunk with decode tokens"
    assert runner.free_slots == 3
    for (prompt, n), r in zip(work, reqs, strict=True):
        ref = alone(model, kv, prompt, SamplingParams(max_new_tokens=n))
        assert r.finish_reason == "length" and len(r.tokens) == n
        assert r.tokens == ref.tokens, f"request {r.id} (prompt {len(prompt)}, {n} new) differs from its solo run"


def test_kivi_flushes_happen_in_the_workload(model):
    """The isolation test is only meaningful if quantized history is read: sequences pass R + G = 48 tokens."""
    lengths = [len(p) + n - 1 for p, n in workload(12)]
    assert sum(t >= 48 for t in lengths) >= 4 and sum(t >= 80 for t in lengths) >= 1


def test_sampled_requests_are_batch_independent(model):
    """Seeded temperature/top-p sampling: one generator per request, so batching does not change the tokens."""
    work = workload(5, seed=2)
    params = [SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.9, seed=100 + i)
              for i, (_, n) in enumerate(work)]
    sched = Scheduler(make_runner(model, "kivi2", 2), prefill_chunk=PREFILL_CHUNK)
    reqs = [sched.submit(p, sp) for (p, _), sp in zip(work, params, strict=True)]
    sched.run_until_idle()
    for (prompt, _), sp, r in zip(work, params, reqs, strict=True):
        assert r.tokens == alone(model, "kivi2", prompt, sp).tokens


def test_oversized_request_is_refused_and_harms_no_other(model):
    work = workload(4, seed=3)
    runner = make_runner(model, "kivi2", 2)
    sched = Scheduler(runner, prefill_chunk=PREFILL_CHUNK)
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=n)) for p, n in work[:2]]
    sched.step()
    sched.step()
    with pytest.raises(RequestRejected, match=r"100 tokens \+ max_new_tokens=20 needs 119 .*max_seq_len=112"):
        sched.submit(list(range(100)), SamplingParams(max_new_tokens=20))
    with pytest.raises(RequestRejected, match="prompt is empty"):
        sched.submit([], SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestRejected, match=r"outside the vocabulary \[0, 49152\)"):
        sched.submit([1, 49152], SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestRejected, match="must be integers"):
        sched.submit([1, 2.5], SamplingParams(max_new_tokens=4))
    assert sched.num_waiting + sched.num_running == 2
    reqs += [sched.submit(p, SamplingParams(max_new_tokens=n)) for p, n in work[2:]]
    sched.run_until_idle()
    for (prompt, n), r in zip(work, reqs, strict=True):
        assert r.tokens == alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=n)).tokens
    # the largest request that fits is accepted: 100 + 13 - 1 = 112 positions
    r = sched.submit(list(range(100)), SamplingParams(max_new_tokens=13))
    sched.run_until_idle()
    assert len(r.tokens) == 13 and runner.free_slots == 2


def test_stop_token_ids_and_stop_strings(model, tokenizer):
    prompt, _ = workload(1, seed=4)[0]
    ref = alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=30), tokenizer)
    # stop token: the 6th generated token; the output is everything before its first occurrence
    stop_tok = ref.tokens[5]
    cut = ref.tokens.index(stop_tok)
    r = alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=30, stop_token_ids=(stop_tok,)), tokenizer)
    assert r.finish_reason == "stop" and r.tokens == ref.tokens[:cut]
    # stop string: two characters of the text of the 4th-5th tokens; the text is cut before it, and generation
    # ends at the first token whose text contains it
    text = ref.text
    start = len(tokenizer.decode(ref.tokens[:3]))
    stop = text[start:start + 2]
    assert stop
    expect_text = text[:text.find(stop)]
    n = next(k for k in range(1, 31) if stop in tokenizer.decode(ref.tokens[:k]))
    r = alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=30, stop_strings=(stop,)), tokenizer)
    assert r.finish_reason == "stop" and r.text == expect_text and r.tokens == ref.tokens[:n]


def test_streaming_callbacks_and_iterator(model, tokenizer):
    """Per-token callbacks and the iterator yield exactly the final tokens; streamed text deltas add up to the final
    text, also when a stop string cuts it (text that could start a stop string is held back)."""
    work = workload(4, seed=5)
    ref = alone(model, "fp16", work[0][0], SamplingParams(max_new_tokens=20), tokenizer)
    stop = ref.text[len(tokenizer.decode(ref.tokens[:6])):][:3]
    sched = Scheduler(make_runner(model, "fp16", 2), tokenizer, prefill_chunk=PREFILL_CHUNK)
    got: dict[str, list] = {}

    def on_update(req, new, delta):
        got.setdefault(req.id, [[], ""])
        got[req.id][0] += new
        got[req.id][1] += delta

    params = [SamplingParams(max_new_tokens=20, stop_strings=(stop,))] + \
        [SamplingParams(max_new_tokens=n) for _, n in work[1:]]
    reqs = [sched.submit(p, sp, on_update=on_update) for (p, _), sp in zip(work, params, strict=True)]
    streamed = list(reqs[2].stream())  # drives the scheduler itself (no background thread)
    sched.run_until_idle()
    assert streamed == reqs[2].tokens
    assert reqs[0].finish_reason == "stop" and reqs[0].text == ref.text[:ref.text.find(stop)]
    for r in reqs:
        assert got[r.id][0] == r.tokens
        assert got[r.id][1] == r.text


def test_background_thread_serves_concurrent_submitters(model):
    work = workload(6, seed=6)
    sched = Scheduler(make_runner(model, "kivi2", 3), prefill_chunk=PREFILL_CHUNK).start()
    results: dict[int, list[int]] = {}
    try:
        def client(i):
            prompt, n = work[i]
            results[i] = list(sched.submit(prompt, SamplingParams(max_new_tokens=n)).stream(timeout=60))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sched.stop()
    with pytest.raises(RequestRejected, match="the scheduler is stopped"):
        sched.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    for i, (prompt, n) in enumerate(work):
        assert results[i] == alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=n)).tokens


def test_cancel_frees_the_slot(model):
    runner = make_runner(model, "kivi2", 1)
    sched = Scheduler(runner, prefill_chunk=PREFILL_CHUNK)
    a = sched.submit(list(range(1, 40)), SamplingParams(max_new_tokens=30))
    b = sched.submit(list(range(1, 10)), SamplingParams(max_new_tokens=3))
    sched.step()
    a.cancel()
    sched.run_until_idle()
    assert a.finish_reason == "cancelled" and b.finish_reason == "length" and runner.free_slots == 1
    assert b.tokens == alone(model, "kivi2", list(range(1, 10)), SamplingParams(max_new_tokens=3)).tokens


class LimitedRunner(TorchRunner):
    """The torch runner with a graph runner's hard per-step token limit (as the onnxruntime/TensorRT runners have:
    their graphs are built for max_num_tokens); it refuses bigger steps, like they do."""

    max_num_tokens = 20

    def step(self, slots, tokens, all_logits=False):
        n = sum(len(t) for t in tokens)
        assert n <= self.max_num_tokens, f"step of {n} tokens > max_num_tokens={self.max_num_tokens}"
        return super().step(slots, tokens, all_logits)


def test_hard_step_token_limit_is_respected(model):
    work = workload(6, seed=7)
    runner = make_runner(model, "kivi2", 3)
    limited = LimitedRunner(runner.model, runner.cache)
    sched = Scheduler(limited, prefill_chunk=PREFILL_CHUNK, max_batch_tokens=512)  # budget clamped to 20
    assert sched.max_batch_tokens == 20
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=n)) for p, n in work]
    sched.run_until_idle()
    for (prompt, n), r in zip(work, reqs, strict=True):
        assert r.finish_reason == "length", r.error
        assert r.tokens == alone(model, "kivi2", prompt, SamplingParams(max_new_tokens=n)).tokens
