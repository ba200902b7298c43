"""The CPU model of the KIVI CUDA kernels (trtllm_kivi/cuda/model.py) against the torch reference.

Oracle: trtllm_kivi.reference (unpack, kivi_attention_). The model runs the kernels' decomposition CTA by CTA (tiles,
splits, partial softmax states and combine, the magic-number code conversion, the flush index math), so these tests
check the algorithm without a GPU; the GPU tests only confirm the CUDA-specific parts.

Attention tolerance (same dequantized values on both sides, fp32 accumulation on both): the two results differ by
fp32 rounding (different summation order / online rescaling, exp implementation), a few hundred eps32 relative to
max|v| at most, plus the final rounding to the activation dtype, which can flip by one ulp of the output. So
|model - ref| <= ulp_act(|ref|) + 2^-14 * max|v|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_kivi.cuda import model
from trtllm_kivi.cuda._abi import ERR_BLOCK_ID, ERR_CAPACITY, ERR_LENGTH, ERR_SLOT
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import KiviBuffers, kivi_attention_, pack, unpack


def assert_attention_close(got: torch.Tensor, ref: torch.Tensor, v_max: float) -> None:
    tol = model.attention_tolerance(ref, v_max)
    err = (got.float() - ref.float()).abs()
    assert torch.all(err <= tol), f"max err {err.max().item()} (tol there {tol.flatten()[err.argmax()].item()})"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_magic_number_conversion_is_exact(bits):
    """Every code value in every position of a word: unpack_magic == reference.unpack."""
    rng = np.random.default_rng(bits)
    per = 32 // bits
    codes = torch.from_numpy(rng.integers(0, 2 ** bits, size=(257, per))).int()
    codes[0] = 2 ** bits - 1  # all-ones word (negative int32)
    codes[1, :] = torch.arange(per) % (2 ** bits)
    words = pack(codes, bits, dim=1)  # [257, 1]
    got = model.unpack_magic(words.numpy().view(np.uint32), bits).reshape(257, per)
    assert np.array_equal(got, unpack(words, bits, per, dim=1).numpy().astype(np.float32))


def _run_steps(cfg, h, hkv, d, dtype, steps, *, num_sms=0, max_seq_len=0, seed=0, num_blocks=48, mbs=8):
    """Drive reference and model through the same ragged steps; compare out (tolerance) and buffers (bit-exact)
    after every step. Returns the plans seen."""
    torch.manual_seed(seed)
    batch = len(steps[0])
    ref = KiviBuffers.allocate(cfg, hkv, d, num_blocks, batch + 1, dtype)
    mod = ref.clone()
    table = torch.randperm(num_blocks)[: batch * mbs].reshape(batch, mbs).int()
    slots = torch.randperm(batch + 1)[:batch].int()
    lens = [0] * batch
    plans = []
    for chunks in steps:
        t = sum(chunks)
        q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, hkv, hkv))
        past, chunk = torch.tensor(lens).int(), torch.tensor(chunks).int()
        out_ref = kivi_attention_(q, k, v, slots, past, chunk, table, ref, cfg)
        out, plan, flag = model.attention(q, k, v, slots, past, chunk, table, mod, cfg, num_sms=num_sms,
                                          max_seq_len=max_seq_len)
        flag |= model.append(k, v, slots, past, chunk, table, mod, cfg, max_seq_len=max_seq_len)
        assert flag == 0
        assert_attention_close(out, out_ref, v.abs().max().item() + 1.0)
        for name, a, b in zip(ref._fields, ref, mod):
            assert torch.equal(a, b), f"{name} differs after chunks {chunks} (past {lens})"
        plans.append(plan)
        lens = [a + b for a, b in zip(lens, chunks)]
    return plans


@pytest.mark.parametrize("kb, vb, g, d, h, hkv, dtype, sdt", [
    (2, 2, 32, 128, 8, 2, torch.float16, "float16"),
    (4, 8, 32, 64, 3, 1, torch.bfloat16, "float16"),
    (8, 2, 64, 128, 8, 1, torch.float16, "bfloat16"),
    (2, 4, 32, 64, 4, 4, torch.bfloat16, "float32"),
    (4, 4, 128, 64, 16, 1, torch.float16, "float16"),
])
def test_model_step_matches_reference(kb, vb, g, d, h, hkv, dtype, sdt):
    """Ragged prefill/decode mix crossing window and group boundaries; one split and many splits."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=32, block_size=128, scale_dtype=sdt)
    steps = [[40, 3, 0], [1, 97, 7], [130, 1, 1], [1, 1, 33], [1, 1, 1], [64, 2, 90]]
    few = _run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1)
    assert any(p.num_splits == 1 for p in few)  # the direct-output path (no combine)
    many = _run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1000)
    assert any(p.num_splits > 2 for p in many)


@pytest.mark.parametrize("sinks", [4, 32, 45])
def test_model_with_sinks_matches_reference(sinks):
    """Format v2 sinks: tiles straddling sinks and the store (S = 4, 45) and aligned ones (S = 32), flushes at
    S + R + kG, chunked prefill and decode; one split and many."""
    cfg = KiviConfig(k_bits=2, v_bits=4, group_size=32, residual_length=32, block_size=64, sink_tokens=sinks)
    steps = [[3, 50, 0], [40, 1, 80], [1, 90, 1], [64, 1, 1], [1, 1, 33]]
    _run_steps(cfg, 8, 2, 64, torch.float16, steps, num_sms=1)
    many = _run_steps(cfg, 8, 2, 64, torch.float16, steps, num_sms=1000)
    assert any(p.num_splits > 2 for p in many)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_with_rounded_p_is_within_its_derived_tolerance(dtype):
    """The tensor-core kernel's arithmetic (p rounded to the activation dtype for the P V product): within
    attention_tolerance(round_p=True) of the reference; for bf16 (u = 2^-8) measurably outside the strict SIMT
    tolerance somewhere, so the extra 2u * max|v| term is needed there (for fp16 the rounding errors of p mostly
    average out below one output ulp)."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    torch.manual_seed(5)
    h, hkv, d = 8, 2, 64
    ref = KiviBuffers.allocate(cfg, hkv, d, 12, 2, dtype)
    table = torch.arange(12).reshape(2, 6).int()
    slots, lens = torch.tensor([1, 0]).int(), [0, 0]
    worst_strict = 0.0
    for chunks in ([300, 37], [1, 1], [2, 40]):
        t = sum(chunks)
        q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, hkv, hkv))
        past, chunk = torch.tensor(lens).int(), torch.tensor(chunks).int()
        mod = ref.clone()
        out, _, flag = model.attention(q, k, v, slots, past, chunk, table, mod, cfg, num_sms=64, round_p=True)
        want = kivi_attention_(q, k, v, slots, past, chunk, table, ref, cfg)
        v_max = v.abs().max().item() + 1.0
        err = (out.float() - want.float()).abs()
        assert flag == 0 and torch.all(err <= model.attention_tolerance(want, v_max, round_p=True))
        worst_strict = max(worst_strict, (err / model.attention_tolerance(want, v_max)).max().item())
        lens = [a + b for a, b in zip(lens, chunks)]
    if dtype == torch.bfloat16:
        assert worst_strict > 1.0


def test_model_long_history_uses_many_splits():
    """Histories of 1100 and 700 tokens (filled with the reference append), then decode and chunk steps: each
    sequence spreads its own length over the splits (SeqInfo.split_len), several splits per query are merged."""
    from trtllm_kivi.reference.attention import append as ref_append
    cfg = KiviConfig(k_bits=4, v_bits=2, group_size=32, residual_length=32, block_size=128)
    torch.manual_seed(7)
    h, hkv, d, dtype = 8, 2, 64, torch.float16
    ref = KiviBuffers.allocate(cfg, hkv, d, 30, 3, dtype)
    table = torch.arange(30).reshape(3, 10).int()
    slots = torch.tensor([2, 0, 1]).int()
    lens = [1100, 700, 5]
    for b, n in enumerate(lens):
        ref_append(ref, cfg, int(slots[b]), table[b], 0, torch.randn(hkv, n, d).to(dtype),
                   torch.randn(hkv, n, d).to(dtype))
    mod = ref.clone()
    for chunks in ([1, 1, 1], [3, 40, 1], [1, 1, 1]):
        t = sum(chunks)
        q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, hkv, hkv))
        past, chunk = torch.tensor(lens).int(), torch.tensor(chunks).int()
        want = kivi_attention_(q, k, v, slots, past, chunk, table, ref, cfg)
        out, plan, flag = model.attention(q, k, v, slots, past, chunk, table, mod, cfg, num_sms=132)
        flag |= model.append(k, v, slots, past, chunk, table, mod, cfg)
        infos, _ = model.prepare(plan, cfg, slots.tolist(), lens, chunks, table, t, 30, 3)
        assert flag == 0 and -(-(lens[0] + chunks[0]) // infos[0].split_len) > 2  # > 2 splits of sequence 0 used
        assert_attention_close(out, want, 5.0)
        for name, a, bb in zip(ref._fields, ref, mod):
            assert torch.equal(a, bb), name
        lens = [a + c for a, c in zip(lens, chunks)]


def test_model_decode_loop_matches_reference():
    """Token-by-token decode after a prefill, across several flushes (R=0 flushes every G tokens), GQA 4."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=0, block_size=64)
    steps = [[45, 33]] + [[1, 1]] * 40
    _run_steps(cfg, 8, 2, 64, torch.float16, steps, num_sms=64, max_seq_len=200)


def test_model_error_flags_skip_the_sequence():
    """Device-side checks: a failing sequence sets its bit, gets zero output and leaves the cache untouched, while the
    other sequences still match the reference."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64)
    h, hkv, d = 4, 2, 64
    torch.manual_seed(1)
    buf = KiviBuffers.allocate(cfg, hkv, d, 8, 4, torch.float16)
    table = torch.tensor([[0, 1], [2, 3], [4, 99], [5, 6]]).int()  # row 2 points past the pool
    chunk = torch.tensor([10, 5, 150, 3]).int()
    t = int(chunk.sum())
    q, k, v = (torch.randn(t, n, d).half() for n in (h, hkv, hkv))
    cases = [  # (slot_ids, past_len, expected bits, bad sequence)
        (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 0, 0]), ERR_BLOCK_ID, 2),
        (torch.tensor([0, 1, 2, 7]), torch.tensor([0, 0, 0, 0]), ERR_SLOT | ERR_BLOCK_ID, 3),
        (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 200, 0, 0]), ERR_CAPACITY | ERR_BLOCK_ID, 1),
        (torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 0]), ERR_LENGTH | ERR_BLOCK_ID, 0),
    ]
    for slots, past, bits, bad in cases:
        mod = buf.clone()
        out, _, flag = model.attention(q, k, v, slots.int(), past.int(), chunk, table, mod, cfg)
        flag |= model.append(k, v, slots.int(), past.int(), chunk, table, mod, cfg)
        assert flag == bits
        offs = [0, 10, 15, 165, 168]
        assert torch.all(out[offs[bad]:offs[bad + 1]] == 0)
        for b in (0, 1, 2, 3):
            if b in (bad, 2):
                continue
            ref = buf.clone()
            sl = slice(offs[b], offs[b + 1])
            want = kivi_attention_(q[sl], k[sl], v[sl], slots[b:b + 1].int(), past[b:b + 1].int(),
                                   chunk[b:b + 1], table[b:b + 1], ref, cfg)
            assert_attention_close(out[sl], want, 5.0)
            slot = int(slots[b])
            assert torch.equal(mod.k_window[slot], ref.k_window[slot])
        if bad != 2 and 0 <= int(slots[bad]) < 4:  # untouched window (slot 7 does not exist)
            assert torch.equal(mod.k_window[int(slots[bad])], buf.k_window[int(slots[bad])])
