"""The KiviAttention op (trtllm_kivi/reference/attention.py) on ragged batches.

Oracle, written here: the stored state after s tokens is rebuilt from the sequence's raw K/V by the contract alone
(one-shot quantize_keys/quantize_values of the first n_q(s) tokens, dequantized with the reference dequantizers, then
the remaining tokens in full precision), concatenated with the chunk, and fed to plain float64 softmax attention over
explicitly repeated KV heads with a causal mask. It never reads the op's buffers or block tables.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import (KiviBuffers, check_step, dequantize_keys, dequantize_values, kivi_attention,
                                   kivi_attention_, quantize_keys, quantize_values)

D = 64


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """q [c, H, D] at positions past..past+c-1, k/v [Hkv, past + c, D] -> [c, H, D] float64."""
    c, h, d = q.shape
    rep = h // k.shape[0]
    k = k.double().repeat_interleave(rep, dim=0)  # [H, n, D]: query head h reads KV head h // rep
    v = v.double().repeat_interleave(rep, dim=0)
    scores = torch.einsum("chd,hnd->hcn", q.double(), k) / math.sqrt(d)
    causal = torch.arange(k.shape[1])[None, :] > (past + torch.arange(c))[:, None]  # [c, n]
    p = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    return torch.einsum("hcn,hnd->chd", p, v)


def contract_state(k_all: torch.Tensor, v_all: torch.Tensor, cfg: KiviConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [Hkv, s, D] as the stored state after s tokens must present them: the first n_q(s) tokens quantized in
    one shot and dequantized (fp32 arithmetic, cast to the activation dtype), the rest exact."""
    s, d, dt = k_all.shape[1], k_all.shape[2], k_all.dtype
    n_q = cfg.num_quantized(s)
    if n_q == 0:
        return k_all, v_all
    kh = dequantize_keys(*quantize_keys(k_all[:, :n_q], cfg), cfg, n_q, d, dt)
    vh = dequantize_values(*quantize_values(v_all[:, :n_q], cfg), cfg, d, dt)
    return torch.cat([kh, k_all[:, n_q:]], dim=1), torch.cat([vh, v_all[:, n_q:]], dim=1)


def clone_all(*ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2), (8, 1)])  # GQA group 1, 3, 8
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_op_matches_dense_oracle(dtype, heads, kv_heads, data):
    cfg = KiviConfig(k_bits=data.draw(st.sampled_from([2, 4])), v_bits=data.draw(st.sampled_from([2, 8])),
                     group_size=32, residual_length=data.draw(st.sampled_from([0, 32])),
                     block_size=data.draw(st.sampled_from([32, 64])),
                     key_grouping=data.draw(st.sampled_from(["per_channel", "per_token"])))
    b = data.draw(st.integers(1, 4))
    chunk = st.one_of(st.just(0), st.just(1), st.integers(2, 90))  # empty, decode, prefill/chunked prefill
    plan = data.draw(st.lists(st.lists(chunk, min_size=b, max_size=b), min_size=1, max_size=3))
    plan = [row for row in plan if sum(row) > 0] or [[1] * b]
    seed = data.draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)

    num_slots = b + 2
    slots = torch.randperm(num_slots, generator=g)[:b].to(torch.int32)  # non-trivial slot ids
    max_len = sum(sum(row) for row in plan)
    max_blocks = max(1, math.ceil(cfg.num_quantized(max_len) / cfg.block_size))
    num_blocks = b * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    buffers = KiviBuffers.allocate(cfg, kv_heads, D, num_blocks, num_slots, dtype)

    k_all = [torch.zeros(kv_heads, 0, D, dtype=dtype) for _ in range(b)]
    v_all = [torch.zeros(kv_heads, 0, D, dtype=dtype) for _ in range(b)]
    past = [0] * b
    for row in plan:
        n = sum(row)
        q = torch.randn(n, heads, D, generator=g).to(dtype)
        k = torch.randn(n, kv_heads, D, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, D, generator=g).to(dtype)
        past_len, chunk_len = torch.tensor(past, dtype=torch.int32), torch.tensor(row, dtype=torch.int32)
        args = (q, k, v, slots, past_len, chunk_len, block_table)
        before = clone_all(*args, *buffers)

        out_f, new = kivi_attention(*args, buffers, cfg)  # functional form
        for a, b_ in zip(before, [*args, *buffers], strict=True):
            assert torch.equal(a, b_), "the functional form modified an input"
        out_i = kivi_attention_(*args, buffers, cfg)  # in-place form
        assert torch.equal(out_f, out_i)
        for a, b_ in zip(new, buffers, strict=True):
            assert torch.equal(a, b_)

        off = 0
        for i, c in enumerate(row):
            kc, vc = k[off:off + c].transpose(0, 1), v[off:off + c].transpose(0, 1)  # [Hkv, c, D]
            kh, vh = contract_state(k_all[i], v_all[i], cfg)
            ref = dense_attention(q[off:off + c], torch.cat([kh, kc], 1), torch.cat([vh, vc], 1), past[i])
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(out_i[off:off + c].double(), ref, atol=tol, rtol=tol)
            k_all[i], v_all[i] = torch.cat([k_all[i], kc], 1), torch.cat([v_all[i], vc], 1)
            past[i] += c
            off += c


def test_history_is_actually_quantized():
    """Guard against a vacuous oracle: after 2 bits of history the op's output differs from full-precision
    attention by far more than the tolerance used above, and equals the contract-state oracle."""
    cfg = KiviConfig(residual_length=32, block_size=64)
    g = torch.Generator().manual_seed(1)
    t = 200
    q, k, v = torch.randn(t, 4, D, generator=g), torch.randn(t, 2, D, generator=g), torch.randn(t, 2, D, generator=g)
    buffers = KiviBuffers.allocate(cfg, 2, D, 4, 1, torch.float32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = kivi_attention_(q, k, v, i32([0]), i32([0]), i32([t]), i32([[0, 1, 2]]), buffers, cfg)
    # Prefill attends to the chunk in full precision; a decode step then sees the quantized history.
    q1, k1, v1 = torch.randn(1, 4, D, generator=g), torch.randn(1, 2, D, generator=g), torch.randn(1, 2, D, generator=g)
    out1 = kivi_attention_(q1, k1, v1, i32([0]), i32([t]), i32([1]), i32([[0, 1, 2]]), buffers, cfg)
    kt, vt = torch.cat([k, k1]).transpose(0, 1), torch.cat([v, v1]).transpose(0, 1)
    exact = dense_attention(q1, kt, vt, t)
    assert (out1.double() - exact).abs().max() > 1e-2
    kh, vh = contract_state(k.transpose(0, 1), v.transpose(0, 1), cfg)
    torch.testing.assert_close(out1.double(), dense_attention(q1, torch.cat([kh, k1.transpose(0, 1)], 1),
                                                             torch.cat([vh, v1.transpose(0, 1)], 1), t),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(q, kt[:, :t], vt[:, :t], 0), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- check_step


def _valid_step():
    cfg = KiviConfig(residual_length=32, block_size=64)
    buffers = KiviBuffers.allocate(cfg, 2, D, num_blocks=4, num_slots=3, dtype=torch.float32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q, k, v = torch.zeros(5, 4, D), torch.zeros(5, 2, D), torch.zeros(5, 2, D)
    step = dict(q=q, k=k, v=v, slot_ids=i32([0, 2]), past_len=i32([0, 10]), chunk_len=i32([4, 1]),
                block_table=i32([[0, 1], [2, 3]]), buffers=buffers, cfg=cfg)
    return step, i32


def test_check_step_accepts_valid_step():
    step, _ = _valid_step()
    check_step(**step)


@pytest.mark.parametrize("change, match", [
    (lambda s, i: dict(q=s["q"][0]), r"q/k/v must be \[tokens, heads, head_dim\]"),
    (lambda s, i: dict(k=torch.zeros(5, 3, D)), r"k/v shapes \(5, 3, 64\)/\(5, 2, 64\) must be \(5, 2, 64\)"),
    (lambda s, i: dict(q=torch.zeros(5, 4, 48), k=torch.zeros(5, 2, 48), v=torch.zeros(5, 2, 48)),
     r"head_dim=48 must be a positive multiple of 32"),
    (lambda s, i: dict(q=torch.zeros(5, 3, D)), r"num_heads=3 must be a multiple of num_kv_heads=2"),
    (lambda s, i: dict(q=s["q"].half()), r"q/k/v dtypes torch.float16/torch.float32/torch.float32 must equal the "
                                         r"window dtype torch.float32"),
    (lambda s, i: dict(slot_ids=i([0, 3])), r"slot_ids \[0, 3\] out of range \[0, 3\)"),
    (lambda s, i: dict(slot_ids=i([-1, 2])), r"slot_ids \[-1, 2\] out of range \[0, 3\)"),
    (lambda s, i: dict(slot_ids=i([2, 2])), r"slot_ids \[2, 2\] must be distinct within a step"),
    (lambda s, i: dict(chunk_len=i([4, 2])), r"sum\(chunk_len\)=6 must equal the number of tokens 5"),
    (lambda s, i: dict(chunk_len=i([6, -1])), r"chunk_len \[6, -1\] must be >= 0"),
    (lambda s, i: dict(past_len=i([0])), r"slot_ids/past_len/chunk_len must be \[B\]"),
    # 2 blocks of 64 hold 128 quantized tokens; length 200 needs n_q = (200 - 32) // 32 * 32 = 160.
    (lambda s, i: dict(past_len=i([0, 199])), r"sequence 1: length 200 needs 160 quantized tokens, past the block "
                                             r"table's capacity of 128 \(2 blocks of 64\)"),
    # length 101: n_q = 64 tokens, one block used -> only block_table[1, 0] = 4 is read (and out of range).
    (lambda s, i: dict(past_len=i([0, 100]), block_table=i([[0, 1], [4, 3]])),
     r"sequence 1: block ids \[4\] out of range \[0, 4\)"),
    (lambda s, i: dict(buffers=s["buffers"]._replace(v_zero=torch.zeros(4, 2, 64, 1))),
     r"buffer v_zero has shape \(4, 2, 64, 1\), expected \(4, 2, 64, 2\)"),
])
def test_check_step_errors(change, match):
    step, i32 = _valid_step()
    step.update(change(step, i32))
    before = [t.clone() for t in step["buffers"]]
    with pytest.raises(ValueError, match=match):
        check_step(**step)
    with pytest.raises(ValueError, match=match):  # the op validates before touching anything
        kivi_attention_(**step)
    assert all(torch.equal(a, b) for a, b in zip(before, step["buffers"], strict=True))
