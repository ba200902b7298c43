"""The CPU model of the KIVI CUDA kernels (trtllm_kivi/cuda/model.py) against the torch reference.

Oracle: trtllm_kivi.reference (append, kivi_attention_). The model runs the kernels' decomposition: launch plan,
prepare checks (error bits), the flush index math into FRAGMENT-order words (bit-exact stores); its attention is the
lane-level emulation of a decode variant's kernel (split_model.py / mma_model.py, tested in test_kernels_mma_model.py),
compared here within mma_model.step_tolerance (derived there from the folded rounding).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cuda import launch, mma_model, model
from trtllm_kivi.cuda.variants import VARIANTS
from trtllm_kivi.cuda._abi import ERR_BLOCK_ID, ERR_CAPACITY, ERR_LENGTH, ERR_SLOT
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import KiviBuffers, kivi_attention_
from trtllm_kivi.reference.attention import append as ref_append


@pytest.mark.parametrize("kb, vb, g, d, hkv, dtype, sdt", [
    (2, 2, 32, 128, 2, torch.float16, "float16"),
    (4, 8, 32, 64, 1, torch.bfloat16, "float16"),
    (8, 2, 64, 128, 1, torch.float16, "bfloat16"),
    (2, 4, 32, 64, 4, torch.bfloat16, "float32"),
    (4, 4, 128, 64, 1, torch.float16, "float16"),
])
def test_model_append_matches_reference(kb, vb, g, d, hkv, dtype, sdt):
    """Ragged prefill/decode chunks crossing window, group and block boundaries (and R=0 flushing every G tokens):
    every buffer bit-identical to the reference append after every step."""
    for r in (32, 0):
        cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=r, block_size=128, scale_dtype=sdt)
        torch.manual_seed(kb * vb + r)
        ref = KiviBuffers.allocate(cfg, hkv, d, 48, 4, dtype)
        mod = ref.clone()
        table = torch.randperm(48)[:24].reshape(3, 8).int()
        slots = torch.tensor([2, 0, 3]).int()
        lens = [0, 0, 0]
        for chunks in ([40, 3, 0], [1, 97, 7], [130, 1, 1], [1, 1, 33], [64, 2, 90]) + ([1, 1, 1],) * 5:
            k, v = (torch.randn(sum(chunks), hkv, d).to(dtype) for _ in range(2))
            off = 0
            for b, c in enumerate(chunks):
                ref_append(ref, cfg, int(slots[b]), table[b], lens[b], k[off:off + c].transpose(0, 1),
                           v[off:off + c].transpose(0, 1))
                off += c
            flag = model.append(k, v, slots, torch.tensor(lens).int(), torch.tensor(chunks).int(), table, mod, cfg)
            assert flag == 0
            for name, a, bb in zip(ref._fields, ref, mod, strict=True):
                assert torch.equal(a, bb), f"{name} differs after chunks {chunks} (past {lens}, R={r})"
            lens = [a + c for a, c in zip(lens, chunks, strict=True)]


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
            args = (q[sl], k[sl], v[sl], slots[b:b + 1].int(), past[b:b + 1].int(), chunk[b:b + 1], table[b:b + 1])
            tol = mma_model.step_tolerance(ref, cfg, *args)
            want = kivi_attention_(*args, ref, cfg)
            err = (out[sl].float() - want.float()).abs()
            assert torch.all(err <= tol), (err / tol).max().item()
            slot = int(slots[b])
            assert torch.equal(mod.k_window[slot], ref.k_window[slot])
        if bad != 2 and 0 <= int(slots[bad]) < 4:  # untouched window (slot 7 does not exist)
            assert torch.equal(mod.k_window[int(slots[bad])], buf.k_window[int(slots[bad])])


@pytest.mark.parametrize("variant", [v.id for v in VARIANTS[1:]])
def test_model_plan_fills_the_variants_waves(variant):
    """Decode at Llama-3-8B shapes: tiles x KV heads x splits <= waves x SMs x CTAs/SM and more than 90% of it (one
    wave: 9 splits -> 576 CTAs for 528 slots would be 1.09 waves, a second nearly empty one); decode mode (fused
    variants, chunks of one token) has one tile per sequence here (GQA 4)."""
    cfg = KiviConfig()
    waves = VARIANTS[variant].waves
    for batch in (1, 8, 32):
        plan = launch.launch_plan(cfg, 32, 8, 128, batch, batch, 300, max_chunk_len=1, max_seq_len=32768,
                                  num_sms=132, ctas_per_sm=4, decode_variant=variant)
        ctas = plan.num_tiles * 8 * plan.num_splits
        assert plan.num_tiles == batch and plan.decode_variant == variant
        assert plan.decode_mode == int(VARIANTS[variant].fused)
        assert ctas <= waves * 132 * 4 and (ctas >= 0.9 * waves * 132 * 4 or plan.num_splits == 1), (batch, ctas)


@pytest.mark.parametrize("sdt", [torch.float16, torch.bfloat16, torch.float32])
def test_fast_code_path_equals_the_ieee_division(sdt):
    """kiviAppend.cuh quantizes with rint((x - z) fl(1 / s)) where its error bound (< 2^-13 below 512) cannot flip
    the rounding, else by the IEEE division (quantizeCode). Oracle: rint(fl((x - z) / s)), clamped -- the
    reference's codes -- on adversarial inputs: quotients within a few ulps of every half-integer (the ties the fast
    path must hand over), random values, values past both ends, NaN / inf, zero and tiny scales."""
    import numpy as np
    rng = np.random.default_rng(0)
    f32 = np.float32
    n = 200_000
    scale = torch.from_numpy(rng.uniform(1e-4, 3.0, n).astype(f32)).to(sdt).float().numpy()
    zero = torch.from_numpy(rng.normal(0, 2, n).astype(f32)).to(sdt).float().numpy()
    k = rng.integers(-2, 260, n).astype(f32)
    ulps = rng.integers(-8, 9, n).astype(f32)
    near = (zero + (k + f32(0.5)) * scale).astype(f32)
    near = (near + ulps * np.spacing(np.abs(near)).astype(f32)).astype(f32)  # within 8 ulps of a tie
    rand = (zero + rng.uniform(-3, 300, n).astype(f32) * scale).astype(f32)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, 1e30, -1e30], f32)
    x = np.concatenate([near, rand, np.resize(special, n)])
    s = np.concatenate([scale, scale, np.resize(np.array([0.0, 1e-40, 1.0], f32), n)]).astype(f32)
    z = np.concatenate([zero, zero, np.zeros(n, f32)])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        inv = (f32(1) / s).astype(f32)
    ulp_off = rng.integers(-1, 2, inv.shape)  # the kernel's rcp.approx is within 1 ulp: any such value must do
    inv_approx = np.where(ulp_off < 0, np.nextafter(inv, f32(-np.inf)),
                          np.where(ulp_off > 0, np.nextafter(inv, f32(np.inf)), inv)).astype(f32)
    for bits in (2, 4, 8):
        levels = f32(2 ** bits - 1)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            want = np.rint(((x - z).astype(f32) / s).astype(f32))
        want = np.where(s == 0, 0, np.nan_to_num(np.clip(want, 0, levels), nan=0.0)).astype(np.uint32)
        for iv in (None, inv_approx):
            got = model.quantize_codes(x, s, z, levels, inv=iv)
            assert np.array_equal(got, want), (bits, np.nonzero(got != want)[0][:10])
    # both paths ran: the near-tie inputs send some 2-bit codes to the division
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q = ((near - zero).astype(f32) * (f32(1) / scale).astype(f32)).astype(f32)
    assert 0 < (np.abs(q - np.rint(q)) >= f32(0.5) - f32(2.0 ** -18)).sum() < n
