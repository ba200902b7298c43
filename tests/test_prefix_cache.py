"""Prefix sharing (runtime/prefix_cache.py, the scheduler's use of it, KiviCache's block refcounts).

Oracle (docs/design.md, prefix sharing contract): a request that reuses a cached prefix ends up with exactly the stored
state, logits and greedy tokens of the same prompt prefilled alone, on a fresh runner, in chunks split at the shared
boundary (attend, then append) — computed here with runner.step directly, chunk by chunk, no prefix cache involved.
Bit-exact (torch.equal) for kivi2, kivi4, a recipe with sinks and rotation, and fp16. And the pool: a block a live
sequence holds is never evicted, whatever the pressure."""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cache import KiviCache
from trtllm_kivi.models import LlamaModel, ModelConfig
from trtllm_kivi.runtime.generate import SamplingParams
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.prefix_cache import PrefixCache, chain_hashes
from trtllm_kivi.runtime.scheduler import Scheduler
from trtllm_kivi.runtime.torch_runner import TorchRunner

G, R, BS = 32, 16, 32  # boundaries b_k = S + 16 + 32 k
CHUNK, MAX_SEQ_LEN, VOCAB = 24, 224, 384
KVS = ["kivi2", "kivi4", "kivi2+sink4+had", "fp16"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    # head_dim 64: the native CPU kernels serve the KIVI cache where they are built (else the memo backend)
    cfg = ModelConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                      max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(shape, generator=g) * (1.0 if len(shape) == 1 else 0.25)
          for n, shape in LlamaModel.hf_weight_shapes(cfg).items()}
    return LlamaModel.from_hf_state_dict(cfg, sd)


def spec(kv: str):
    return parse_kv(kv) if kv == "fp16" else parse_kv(kv, group_size=G, residual_length=R, block_size=BS)


def make_runner(model, kv: str, slots: int = 2, num_blocks: int | None = None) -> TorchRunner:
    extra = {} if num_blocks is None else {"num_blocks": num_blocks}
    return TorchRunner.create(model, spec(kv), slots, MAX_SEQ_LEN, **extra)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk_ends(n: int, boundaries: list[int]) -> list[int]:
    """The scheduler's chunk ends with prefix caching: multiples of CHUNK from each chunk start, and the boundaries."""
    ends, pos = [], 0
    while pos < n:
        nxt = min([pos + CHUNK, n] + [b for b in boundaries if b > pos])
        ends.append(nxt)
        pos = nxt
    return ends


def split_prefill_and_decode(runner: TorchRunner, tokens: list[int], ends: list[int], n: int, slot: int | None = None,
                             start: int = 0):
    """Prefill tokens[start:] in chunks ending at `ends`, then greedy-decode n tokens: (slot, logits, generated)."""
    slot = runner.add_sequence() if slot is None else slot
    pos, logits = start, []
    for e in [e for e in ends if e > start]:
        logits.append(runner.step([slot], [tokens[pos:e]])[0])
        pos = e
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits.append(runner.step([slot], [[out[-1]]])[0])
    return slot, torch.stack(logits), out


def state(runner: TorchRunner, slot: int) -> list[dict[str, torch.Tensor]]:
    c = runner.cache
    if isinstance(c, KiviCache):
        return [c.sequence_state(slot, layer) for layer in range(len(c.layers))]
    t = c.seq_len(slot)
    return [{"k": c.k[layer][slot, :, :t].clone(), "v": c.v[layer][slot, :, :t].clone()} for layer in range(len(c.k))]


def assert_same_state(a, b) -> None:
    for la, lb in zip(a, b, strict=True):
        assert la.keys() == lb.keys()
        for name in la:
            assert torch.equal(la[name], lb[name]), name


@pytest.mark.parametrize("kv", KVS)
def test_reused_prefix_is_the_prompt_split_at_the_boundary(model, kv):
    shared = prompt(1, 150)
    donor, reuser = shared + prompt(2, 20), shared + prompt(3, 30)
    runner = make_runner(model, kv)
    pc = PrefixCache(runner.cache)
    bounds = pc.bounds(len(reuser))
    # the donor prefills in the scheduler's chunks and registers every boundary it reaches
    slot = runner.add_sequence()
    hashes = chain_hashes(donor, pc.bounds(len(donor)))
    pos = 0
    for e in chunk_ends(len(donor), pc.bounds(len(donor))):
        runner.step([slot], [donor[pos:e]])
        pos = e
        pc.register(slot, hashes, e)
    runner.free_sequence(slot)  # its blocks stay cached (unreferenced), its slot is reused below
    m = pc.match(reuser)
    deepest = max(b for b in bounds if b <= len(shared))  # the last boundary inside the shared part
    assert m.tokens == deepest and m.depth == bounds.index(deepest) + 1
    slot = runner.add_sequence()
    pc.attach(slot, m)
    assert runner.seq_len(slot) == deepest

    ref = make_runner(model, kv)
    ends = chunk_ends(len(reuser), bounds)
    assert deepest in ends
    ref_slot = ref.add_sequence()
    pos = 0
    for e in [e for e in ends if e <= deepest]:
        ref.step([ref_slot], [reuser[pos:e]])
        pos = e
    assert_same_state(state(runner, slot), state(ref, ref_slot))  # the state at the boundary, bit for bit

    _, logits, out = split_prefill_and_decode(runner, reuser, ends, 12, slot, start=deepest)
    _, ref_logits, ref_out = split_prefill_and_decode(ref, reuser, ends, 12, ref_slot, start=deepest)
    assert out == ref_out
    assert torch.equal(logits, ref_logits)
    assert_same_state(state(runner, slot), state(ref, ref_slot))


@pytest.mark.parametrize("kv", KVS)
def test_scheduler_hit_gives_the_tokens_of_the_split_prompt_alone(model, kv):
    shared = prompt(4, 140)
    prompts = [shared + prompt(10 + i, 10 + 7 * i) for i in range(3)]
    sched = Scheduler(make_runner(model, kv), max_batch_tokens=64, prefill_chunk=CHUNK, prefix_caching=True)
    params = SamplingParams(max_new_tokens=10)
    got = [sched.generate([p], params)[0] for p in prompts]  # one after another: the first one fills the cache
    assert got[0].cached_tokens == 0
    assert sched.prefix is not None
    for p, r in zip(prompts, got, strict=True):
        bounds = sched.prefix.bounds(len(p))
        _, _, ref = split_prefill_and_decode(make_runner(model, kv, slots=1), p, chunk_ends(len(p), bounds), 10)
        assert r.tokens == ref
    deepest = max(sched.prefix.bounds(len(shared)))
    assert [r.cached_tokens for r in got[1:]] == [deepest, deepest]
    assert sched.prefix.hits == 2 and sched.prefix.queries == 3


def test_a_whole_cached_prompt_still_prefills_its_last_token(model):
    p = prompt(5, 16 + 2 * 32)  # ends exactly at b_2
    sched = Scheduler(make_runner(model, "kivi2"), prefill_chunk=CHUNK, prefix_caching=True)
    a = sched.generate([p], SamplingParams(max_new_tokens=4))[0]
    b = sched.generate([p], SamplingParams(max_new_tokens=4))[0]
    assert b.cached_tokens == 16 + 32 and a.tokens == b.tokens  # b_1: b_2 = P would leave nothing to prefill


def test_hash_chain_is_position_exact():
    toks = list(range(100))
    a = chain_hashes(toks, [48, 80])
    assert chain_hashes(toks[:80], [48, 80]) == a
    assert chain_hashes([1] + toks[:79], [48, 80])[1] != a[1]  # the same tokens one position later
    b = list(toks)
    b[10] = 999  # a change in the first segment changes every later hash
    assert all(x != y for x, y in zip(chain_hashes(b, [48, 80]), a, strict=True))


def test_eviction_never_frees_a_block_in_use(model):
    """A small pool filled with shared and private prefixes: while sequences hold blocks, the allocator evicts only
    unreferenced cached ones (LRU), and a live sequence's blocks are never handed out again."""
    pool = 12
    runner = make_runner(model, "kivi2", slots=3, num_blocks=pool)
    cache = runner.cache
    assert isinstance(cache, KiviCache)
    sched = Scheduler(runner, max_batch_tokens=96, prefill_chunk=CHUNK, prefix_caching=True)
    pc = sched.prefix
    assert pc is not None
    shared = prompt(6, 120)
    held: dict[int, list[int]] = {}

    def check() -> None:
        live = {s: cache.blocks_of(s) for s in range(cache.max_slots) if cache.active[s]}
        owners: dict[int, set[int]] = {}
        for s, blocks in live.items():
            for b in blocks:
                owners.setdefault(b, set()).add(s)
        for b, slots in owners.items():
            assert cache.block_refs(b) == len(slots), b
            assert b not in cache._free_blocks, f"block {b} held by slots {slots} is on the free list"
        for s, blocks in held.items():  # blocks a live sequence had are still its own
            if s in live:
                assert live[s][:len(blocks)] == blocks
        held.clear()
        held.update(live)

    prompts = [shared + prompt(20 + i, 40) for i in range(4)] + [prompt(30 + i, 150) for i in range(6)]
    reqs = [sched.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    while sched.has_work():
        sched.step()
        check()
    assert all(r.finish_reason == "length" for r in reqs)
    assert pc.evictions > 0  # the pool was too small to keep everything
    assert any(r.cached_tokens for r in reqs[1:4])  # the shared prefix was reused while it was live
    assert cache.blocks_in_use == 0
    assert cache.free_blocks + pc.cached_blocks == pool
    # every request's tokens are those of its prompt alone (the eviction took nothing a request needed)
    for p, r in zip(prompts, reqs, strict=True):
        alone = Scheduler(make_runner(model, "kivi2", slots=1), prefill_chunk=CHUNK, prefix_caching=True)
        assert alone.generate([p], SamplingParams(max_new_tokens=6))[0].tokens == r.tokens


def test_admission_counts_shared_blocks_once(model):
    """With a pool that holds one private sequence and a shared prefix, two requests sharing the prefix run at once."""
    runner = make_runner(model, "kivi2", slots=2, num_blocks=7)
    sched = Scheduler(runner, max_batch_tokens=96, prefill_chunk=CHUNK, prefix_caching=True)
    shared = prompt(7, 176)  # 5 blocks at b_5 = 176
    sched.generate([shared + [1, 2]], SamplingParams(max_new_tokens=2))
    a = sched.submit(shared + [3, 4], SamplingParams(max_new_tokens=2))
    b = sched.submit(shared + [5, 6], SamplingParams(max_new_tokens=2))
    sched.step()
    assert sched.num_running == 2 and a.cached_tokens == b.cached_tokens == 176
    sched.run_until_idle()


def test_a_burst_sharing_a_prefix_computes_it_once(model):
    """Requests submitted together with a common prefix: the first prefills it, the others wait for it to be kept
    (not computing it again) and reuse it; every request still gets the tokens of its prompt alone."""
    shared = prompt(8, 150)
    prompts = [shared + prompt(40 + i, 9 + i) for i in range(4)]
    sched = Scheduler(make_runner(model, "kivi2", slots=4), max_batch_tokens=96, prefill_chunk=CHUNK,
                      prefix_caching=True)
    reqs = sched.generate(prompts, SamplingParams(max_new_tokens=5))
    assert sched.prefix is not None
    deepest = max(sched.prefix.bounds(len(shared)))
    assert [r.cached_tokens for r in reqs] == [0, deepest, deepest, deepest]
    assert sched.prompt_tokens == sum(len(p) for p in prompts) - 3 * deepest
    for p, r in zip(prompts, reqs, strict=True):
        alone = Scheduler(make_runner(model, "kivi2", slots=1), prefill_chunk=CHUNK, prefix_caching=True)
        assert alone.generate([p], SamplingParams(max_new_tokens=5))[0].tokens == r.tokens
