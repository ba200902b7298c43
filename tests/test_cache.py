"""Streaming caches (trtllm_kivi/cache.py): the streaming contract, capacity errors, slot reuse, FullCache.

Oracles: one-shot quantize_keys/quantize_values of the first n_q(T) tokens (docs/design.md "Streaming semantics"), the raw
K/V for the window, a fresh cache for slot reuse, and plain float64 softmax attention for FullCache.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_kivi.cache import CacheCapacityError, FullCache, KiviCache
from trtllm_kivi.format import Geometry, KiviConfig
from trtllm_kivi.reference import quantize_keys, quantize_values


def run_chunks(cache, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Feed tokens [T, heads, D] of one sequence in chunks ending at `cuts` through every layer; returns the last
    layer's outputs [T, H, D]. Layer l gets k + l, v - l, so the layers hold different data."""
    outs, start = [], cache.seq_len(slot)
    for end in cuts:
        step = cache.begin_step([slot], [end - start])
        for layer in range(cache.geom.num_layers):
            out = cache.attention(layer, q[start:end], k[start:end] + layer, v[start:end] - layer, step)
        cache.end_step(step)
        outs.append(out)
        start = end
    return torch.cat(outs)


def state_from_blocks(state: dict, n_q: int) -> dict:
    """sequence_state's block-major store [nb, Hkv, rows, X] -> token-major [Hkv, rows of n_q tokens, X]."""
    out = {}
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        t = state[name]
        out[name] = t.permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[3])
    return out


def cache_snapshot(cache: KiviCache):
    return ([t.clone() for layer in cache.layers for t in layer], cache.block_tables.clone(), list(cache.seq_lens),
            list(cache.active), cache.free_blocks, [list(b) for b in cache._blocks])


def assert_same_snapshot(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert torch.equal(a[1], b[1]) and a[2:] == b[2:]


# ---------------------------------------------------------------------------------------------- streaming contract


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_one_shot_state(data):
    g_size = data.draw(st.sampled_from([32, 64]), label="G")
    cfg = KiviConfig(k_bits=data.draw(st.sampled_from([2, 4, 8])), v_bits=data.draw(st.sampled_from([2, 4])),
                     group_size=g_size, residual_length=data.draw(st.sampled_from([0, 32, 128]), label="R"),
                     block_size=g_size * data.draw(st.sampled_from([1, 2, 4])),
                     key_grouping=data.draw(st.sampled_from(["per_channel", "per_token"])),
                     sink_tokens=data.draw(st.sampled_from([0, 0, 1, 4, 33, 128]), label="S"))
    heads, kv_heads = data.draw(st.sampled_from([(2, 2), (4, 2), (6, 2), (8, 1)]), label="GQA")
    d = data.draw(st.sampled_from([64, 128]), label="head_dim")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    t = data.draw(st.integers(1, cfg.sink_tokens + cfg.residual_length + 5 * g_size), label="T")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, t), max_size=6))))
    cuts = [c for c in cuts if c < t] + [t]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    q = torch.randn(t, heads, d, generator=gen).to(dtype)
    k = (torch.randn(t, kv_heads, d, generator=gen) * 2).to(dtype)
    v = torch.randn(t, kv_heads, d, generator=gen).to(dtype)
    geom = Geometry(2, heads, kv_heads, d)

    split = KiviCache(cfg, geom, max_slots=2, max_seq_len=t, dtype=dtype)
    split.add_sequence()  # occupy slot 0 so the sequence under test lives in slot 1
    slot = split.add_sequence()
    run_chunks(split, slot, q, k, v, cuts)
    whole = KiviCache(cfg, geom, max_slots=1, max_seq_len=t, dtype=dtype)
    run_chunks(whole, whole.add_sequence(), q, k, v, [t])

    n_q, s0 = cfg.num_quantized(t), min(cfg.sink_tokens, t)
    for layer in range(2):
        a, b = split.sequence_state(slot, layer), whole.sequence_state(0, layer)
        assert a.keys() == b.keys()
        for name in a:  # bit-identical stored state, whatever the split
            assert torch.equal(a[name], b[name]), name
        # ... equal to the sinks [0, S) in full precision, one-shot quantization of tokens [S, S + n_q) (groups
        # start at S, format.py) and the rest in the window.
        kl, vl = (k + layer).transpose(0, 1), (v - layer).transpose(0, 1)  # [Hkv, T, D]
        full = torch.cat([torch.arange(s0), torch.arange(s0 + n_q, t)])
        assert torch.equal(a["k_window"], kl[:, full]) and torch.equal(a["v_window"], vl[:, full])
        if n_q:
            store = state_from_blocks(a, n_q)
            kc, ks, kz = quantize_keys(kl[:, s0:s0 + n_q], cfg)
            vc, vs, vz = quantize_values(vl[:, s0:s0 + n_q], cfg)
            for name, ref in zip(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"),
                                 (kc, ks, kz, vc, vs, vz), strict=True):
                assert torch.equal(store[name][:, : ref.shape[1]], ref), name
                assert not store[name][:, ref.shape[1]:].any()  # rows past n_q in the last block are not state
        else:
            assert all(a[n].shape[0] == 0 for n in ("k_codes", "v_codes"))


def test_token_by_token_equals_prefill_state():
    """Decode one token at a time across several flush points (R + kG) and block boundaries."""
    cfg = KiviConfig(residual_length=32, group_size=32, block_size=64)
    geom = Geometry(1, 4, 2, 64)
    t = 32 + 5 * 32 + 7
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(t, 4, 64, generator=g), torch.randn(t, 2, 64, generator=g), torch.randn(t, 2, 64, generator=g)
    a, b = KiviCache(cfg, geom, 1, t, torch.float32), KiviCache(cfg, geom, 1, t, torch.float32)
    run_chunks(a, a.add_sequence(), q, k, v, list(range(1, t + 1)))
    run_chunks(b, b.add_sequence(), q, k, v, [t])
    sa, sb = a.sequence_state(0, 0), b.sequence_state(0, 0)
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    ka, va = a.dequantized(0, 0)
    kb, vb = b.dequantized(0, 0)
    assert torch.equal(ka, kb) and torch.equal(va, vb) and ka.shape == (2, t, 64)


# ---------------------------------------------------------------------------------------------- capacity


def _small_cache(num_blocks=None, max_seq_len=160):
    cfg = KiviConfig(residual_length=32, group_size=32, block_size=32)
    return KiviCache(cfg, Geometry(2, 2, 1, 64), max_slots=2, max_seq_len=max_seq_len, dtype=torch.float32,
                     num_blocks=num_blocks)


def _fill(cache, slot, n, seed=0):
    """Append n random tokens to a sequence in one step (run_chunks indexes by absolute position)."""
    g = torch.Generator().manual_seed(seed)
    t = cache.seq_len(slot) + n
    q, k, v = torch.randn(t, 2, 64, generator=g), torch.randn(t, 1, 64, generator=g), torch.randn(t, 1, 64, generator=g)
    run_chunks(cache, slot, q, k, v, [t])


def test_past_max_seq_len_raises_and_changes_nothing():
    cache = _small_cache()
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    _fill(cache, s0, 150)
    _fill(cache, s1, 40, seed=1)
    before = cache_snapshot(cache)
    with pytest.raises(CacheCapacityError, match=r"slot 0: 150 \+ 11 tokens exceeds the cache capacity "
                                                 r"max_seq_len=160"):
        cache.begin_step([s1, s0], [1, 11])  # the valid s1 part must not be applied either
    assert_same_snapshot(before, cache_snapshot(cache))
    _fill(cache, s0, 10)  # exactly up to capacity is fine
    assert cache.seq_len(s0) == 160


def test_past_block_pool_raises_and_changes_nothing():
    # max_seq_len 160 -> n_q(160) = 128 -> 4 blocks per sequence; a pool of 5 cannot hold two full sequences.
    cache = _small_cache(num_blocks=5)
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    _fill(cache, s0, 160)  # 4 blocks
    _fill(cache, s1, 90, seed=1)  # n_q = 32: the 5th block
    assert cache.free_blocks == 0
    before = cache_snapshot(cache)
    with pytest.raises(CacheCapacityError, match=r"the step needs 1 new blocks but only 0 of 5 are free"):
        cache.begin_step([s1], [10])  # length 100 -> n_q = 64 -> a second block
    assert_same_snapshot(before, cache_snapshot(cache))
    cache.free_sequence(s0)
    assert cache.free_blocks == 4
    _fill(cache, s1, 10)
    assert cache.seq_len(s1) == 100


def test_slots_exhausted():
    cache = _small_cache()
    cache.add_sequence(), cache.add_sequence()
    with pytest.raises(CacheCapacityError, match=r"all 2 sequence slots are in use"):
        cache.add_sequence()
    with pytest.raises(ValueError, match=r"slot 5 is not an active sequence slot \(slots 0..1\)"):
        cache.begin_step([5], [1])


def test_reused_slot_reads_nothing_of_the_old_sequence():
    cfg = KiviConfig(residual_length=32, group_size=32, block_size=32)
    geom = Geometry(2, 4, 2, 64)
    g = torch.Generator().manual_seed(7)
    old = [torch.randn(300, h, 64, generator=g) * 5 for h in (4, 2, 2)]  # long, so its blocks and window are full
    new = [torch.randn(150, h, 64, generator=g) for h in (4, 2, 2)]
    cuts = [40, 41, 100, 137, 150]

    reused = KiviCache(cfg, geom, max_slots=2, max_seq_len=300, dtype=torch.float32)
    other = reused.add_sequence()
    slot = reused.add_sequence()
    run_chunks(reused, slot, *old, [300])
    run_chunks(reused, other, *new, [20])  # a neighbour keeps its blocks throughout
    reused.free_sequence(slot)
    assert reused.add_sequence() == slot and reused.seq_len(slot) == 0
    out_reused = run_chunks(reused, slot, *new, cuts)

    fresh = KiviCache(cfg, geom, max_slots=1, max_seq_len=300, dtype=torch.float32)
    out_fresh = run_chunks(fresh, fresh.add_sequence(), *new, cuts)
    assert torch.equal(out_reused, out_fresh)
    for layer in range(2):
        a, b = reused.sequence_state(slot, layer), fresh.sequence_state(0, layer)
        assert all(torch.equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------------------------------------- FullCache


def dense_attention(q, k, v, past):
    """q [c, H, D], k/v [Hkv, past + c, D] -> [c, H, D] float64, heads repeated explicitly, causal."""
    c, h, d = q.shape
    k = k.double().repeat_interleave(h // k.shape[0], 0)
    v = v.double().repeat_interleave(h // v.shape[0], 0)
    scores = torch.einsum("chd,hnd->hcn", q.double(), k) / math.sqrt(d)
    causal = torch.arange(k.shape[1])[None, :] > (past + torch.arange(c))[:, None]
    return torch.einsum("hcn,hnd->chd", torch.softmax(scores.masked_fill(causal, float("-inf")), -1), v)


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (6, 2), (8, 1)])
def test_full_cache_is_dense_attention(heads, kv_heads):
    geom = Geometry(1, heads, kv_heads, 64)
    cache = FullCache(geom, max_slots=3, max_seq_len=120, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    seqs = {cache.add_sequence(): [torch.randn(120, h, 64, generator=g) for h in (heads, kv_heads, kv_heads)]
            for _ in range(2)}
    plan = [[50, 1], [0, 70], [1, 1], [69, 0]]  # ragged batches: prefill + decode, chunk_len 0
    slots = list(seqs)
    for row in plan:
        step = cache.begin_step(slots, row)
        q = torch.cat([seqs[s][0][p:p + c] for s, p, c in zip(slots, step.past, row, strict=True)])
        k = torch.cat([seqs[s][1][p:p + c] for s, p, c in zip(slots, step.past, row, strict=True)])
        v = torch.cat([seqs[s][2][p:p + c] for s, p, c in zip(slots, step.past, row, strict=True)])
        out = cache.attention(0, q, k, v, step)
        cache.end_step(step)
        off = 0
        for s, p, c in zip(slots, step.past, row, strict=True):
            ks, vs = seqs[s][1][: p + c].transpose(0, 1), seqs[s][2][: p + c].transpose(0, 1)
            torch.testing.assert_close(out[off:off + c].double(), dense_attention(seqs[s][0][p:p + c], ks, vs, p),
                                       atol=1e-5, rtol=1e-5)
            off += c
    for s in slots:
        k_seen, v_seen = cache.dequantized(s, 0)
        n = cache.seq_len(s)
        assert torch.equal(k_seen, seqs[s][1][:n].transpose(0, 1))
        assert torch.equal(v_seen, seqs[s][2][:n].transpose(0, 1))
    with pytest.raises(CacheCapacityError, match=r"exceeds the cache capacity max_seq_len=120"):
        cache.begin_step([slots[0]], [1])


def test_full_and_kivi_caches_agree_before_any_flush():
    """Same interface; with fewer than R + G tokens nothing is quantized, so KIVI attention equals the dense one."""
    geom = Geometry(2, 4, 2, 64)
    cfg = KiviConfig(residual_length=128, group_size=32, block_size=128)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(150, h, 64, generator=g) for h in (4, 2, 2))
    outs = []
    for cache in (FullCache(geom, 1, 150, torch.float32), KiviCache(cfg, geom, 1, 150, torch.float32)):
        outs.append(run_chunks(cache, cache.add_sequence(), q, k, v, [60, 61, 150]))
        assert cache.free_slots == 0 and cache.nbytes > 0
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
