"""The lane-level emulations of the decode kernels against the reference: the split kernel of decode variants >= 2
(trtllm_kivi/cuda/split_model.py, the default) and the baseline kernel (mma_model.py, variant 1).

Oracles: trtllm_kivi.reference (pack_fragments / quantize, kivi_attention_, append) and the PTX ISA's mma.m16n8k16
fragment layouts (written out in fragments.a_coord / b_coord / c_coord).
  - fragments: the registers a lane builds from its words (one shift + one lop3 each), placed by the PTX A layout,
    are exactly the reference's codes of the K tile (rows = keys, pairs along channels) and of the V^T tile (rows =
    channels, pairs along tokens) -- for every bit width, both MMA types, head_dim 64 and 128;
  - movmatrix: the C fragment of S moved to the B fragment of P^T is P itself;
  - stores: bit-exact (model.append vs reference append), after every step;
  - the split kernel's key assignment: every quantized chunk and full-precision tile exactly once over its splits and
    warps; its decode mode (pure decode steps: sequences found without the prepare kernel, the last CTA's merge) over
    decode loops crossing window and flush boundaries, per variant;
  - attention: within mma_model.attention_tolerance, a bound derived from the folded rounding (q' = rnd(q s 2^b),
    P'' = rnd(p s 2^b), the reference rounding dequantized K/V to the activation dtype, fp32 sums; see its
    docstring). The bound is computed per element from the data, so it is tight where the data is small; a test
    checks that a wrong fragment (two channels swapped) is far outside it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_kivi.cuda import fragments, mma_model, model, split_model
from trtllm_kivi.cuda.variants import VARIANTS
from trtllm_kivi.format import KiviConfig, fragment_words_per_lane
from trtllm_kivi.reference import KiviBuffers, kivi_attention_, pack_fragments

BASELINE, SPLIT = 1, 2  # decode variants (kiviDecodeVariants.h): the baseline kernel, the split kernel's default
ONE_WAVE, UNFUSED = 5, 6  # the split kernel with a one-wave split; with separate prepare / combine / append kernels
assert VARIANTS[ONE_WAVE].waves == 1 and not VARIANTS[UNFUSED].fused


@pytest.mark.parametrize("act", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_fragments_hold_the_reference_codes(act, bits, d):
    gen = torch.Generator().manual_seed(bits + d)
    codes = torch.randint(0, 2 ** bits, (16, d), generator=gen).int()
    codes[0, :] = 2 ** bits - 1  # all-ones words (negative int32)
    alpha, beta = fragments.code_affine(act, bits)
    for kind in ("keys", "values"):
        words = pack_fragments(codes, bits, kind).numpy().view(np.uint32).reshape(32, fragment_words_per_lane(d, bits))
        a = fragments.assemble_a(fragments.unpack_tile(words, bits, d, act))  # [D/16, 16, 16]
        got = (a.astype(np.float64) - alpha) / beta  # exact: alpha + beta c is exact in act
        for blk in range(d // 16):
            want = codes[:, 16 * blk:16 * blk + 16] if kind == "keys" else codes[:, 16 * blk:16 * blk + 16].T
            assert np.array_equal(got[blk], want.numpy()), (kind, blk)


def test_movmatrix_moves_p_into_the_b_fragment():
    p = np.random.default_rng(0).random((16, 8)).astype(np.float32)
    assert np.array_equal(fragments.p_to_b_fragment(p), p)
    x = np.arange(64, dtype=np.float32).reshape(32, 2)  # lane L holds M[L//4][2(L%4)+i] = 8 row + col
    y = fragments.movmatrix_trans(x)
    m = x.reshape(8, 8)
    assert np.array_equal(y.reshape(8, 8), m.T)


def run_steps(cfg, h, hkv, d, dtype, steps, *, num_sms=0, max_seq_len=0, seed=0, num_blocks=48, mbs=8,
              history=None, decode_variant=0, max_chunk_len=0):
    torch.manual_seed(seed)
    batch = len(steps[0])
    ref = KiviBuffers.allocate(cfg, hkv, d, num_blocks, batch + 1, dtype)
    table = torch.randperm(num_blocks)[: batch * mbs].reshape(batch, mbs).int()
    slots = torch.randperm(batch + 1)[:batch].int()
    lens = [0] * batch
    if history:
        from trtllm_kivi.reference.attention import append as ref_append
        for b, n in enumerate(history):
            ref_append(ref, cfg, int(slots[b]), table[b], 0, torch.randn(hkv, n, d).to(dtype),
                       torch.randn(hkv, n, d).to(dtype))
        lens = list(history)
    mod = ref.clone()
    plans, worst = [], 0.0
    for chunks in steps:
        t = sum(chunks)
        q, k, v = (torch.randn(t, n, d).to(dtype) for n in (h, hkv, hkv))
        past, chunk = torch.tensor(lens).int(), torch.tensor(chunks).int()
        before = ref.clone()
        out_ref = kivi_attention_(q, k, v, slots, past, chunk, table, ref, cfg)
        out, plan, flag = model.attention(q, k, v, slots, past, chunk, table, mod, cfg, num_sms=num_sms,
                                          max_seq_len=max_seq_len, max_chunk_len=max_chunk_len,
                                          decode_variant=decode_variant)
        flag |= model.append(k, v, slots, past, chunk, table, mod, cfg, max_seq_len=max_seq_len,
                             max_chunk_len=max_chunk_len)
        assert flag == 0
        tol = mma_model.step_tolerance(before, cfg, q, k, v, slots, past, chunk, table)
        err = (out.float() - out_ref.float()).abs()
        assert torch.all(err <= tol), f"chunks {chunks} past {lens}: max err/tol {(err / tol).max().item()}"
        worst = max(worst, (err / tol).max().item())
        for name, a, b in zip(ref._fields, ref, mod, strict=True):
            assert torch.equal(a, b), f"{name} differs after chunks {chunks} (past {lens})"
        plans.append(plan)
        lens = [a + b for a, b in zip(lens, chunks, strict=True)]
    return plans, worst


@pytest.mark.parametrize("kb, vb, g, d, h, hkv, dtype, sdt, variant", [
    (2, 2, 32, 128, 8, 2, torch.float16, "float16", BASELINE),
    (2, 2, 32, 128, 8, 2, torch.float16, "float16", SPLIT),
    (4, 8, 32, 64, 3, 1, torch.bfloat16, "float16", SPLIT),
    (8, 2, 64, 128, 8, 1, torch.float16, "bfloat16", SPLIT),
    (2, 4, 32, 64, 4, 4, torch.bfloat16, "float32", SPLIT),
    (4, 4, 128, 64, 16, 1, torch.float16, "float16", SPLIT),
    (8, 8, 32, 64, 2, 2, torch.bfloat16, "float16", SPLIT),
    (8, 8, 32, 64, 2, 2, torch.bfloat16, "float16", UNFUSED),
])
def test_emulation_step_matches_reference(kb, vb, g, d, h, hkv, dtype, sdt, variant):
    """Ragged prefill/decode mix crossing window and group boundaries; GQA 4/3/8/16, MHA; one split and many (the
    split kernel's splits merged by kiviCombineKernel over every split, next to the prefill kernel's sequences)."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=32, block_size=128, scale_dtype=sdt)
    steps = [[40, 3, 0], [1, 70, 7], [1, 1, 33]]
    few, _ = run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1, decode_variant=variant)
    assert any(p.num_splits == 1 for p in few) and all(p.decode_variant == variant for p in few)
    many, _ = run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1000, decode_variant=variant)
    assert any(p.num_splits > 2 for p in many)


@pytest.mark.parametrize("sinks, kb, vb, dtype", [(4, 2, 2, torch.float16), (5, 4, 2, torch.bfloat16),
                                                   (128, 2, 4, torch.float16)])
def test_emulation_with_sink_tokens(sinks, kb, vb, dtype):
    """FORMAT_VERSION 2 sinks: the kernel reads the store first, then the sink rows, then the ring (any key order is
    the same attention); prefill across the sinks and the first flush points, then decode; one split and many."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=32, residual_length=32, block_size=128, sink_tokens=sinks)
    steps = [[3, 70, 0], [2, 1, 150], [40, 1, 1], [1, 33, 1]]
    few, _ = run_steps(cfg, 8, 2, 64, dtype, steps, num_sms=1)
    many, _ = run_steps(cfg, 8, 2, 64, dtype, steps, num_sms=1000)
    assert any(p.num_splits > 2 for p in many)


@pytest.mark.parametrize("variant", [BASELINE, SPLIT])
def test_emulation_long_history_splits_and_warps(variant):
    """700- and 1100-token histories: every warp gets several chunks, several splits per query are merged."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    plans, worst = run_steps(cfg, 8, 2, 128, torch.float16, [[1, 1], [2, 1]], num_sms=8, history=[1100, 700],
                             num_blocks=24, mbs=10, decode_variant=variant)
    assert plans[0].num_splits > 1 and worst < 1.0


@pytest.mark.parametrize("variant, h, hkv, sinks, sms", [
    (SPLIT, 8, 2, 0, 1000),  # decode mode, fused merge of many splits
    (SPLIT, 32, 2, 4, 1000),  # GQA 16: two tiles per sequence; sinks
    (SPLIT, 8, 2, 4, 1),  # one split: the CTA writes out; every full-precision tile of a warp through one buffer
    (ONE_WAVE, 4, 1, 0, 1000),
    (UNFUSED, 8, 2, 0, 1000),  # separate prepare / combine kernels, no decode mode
])
def test_emulation_decode_loop_per_variant(variant, h, hkv, sinks, sms):
    """Pure decode steps (max_chunk_len 1) of three sequences: each crosses a flush point (R = 32, G = 32: past
    lengths S + 159, S + 60, S + 285 flush at steps 1, 5 and 3) and its window ring wraps; full-precision tiles land
    in several splits; a zero-length chunk in between (the append skips nothing it should write: stores bit-exact)."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64, sink_tokens=sinks)
    steps = [[1, 1, 1]] * 3 + [[1, 0, 1]] + [[1, 1, 1]] * 2
    plans, worst = run_steps(cfg, h, hkv, 64, torch.float16, steps, num_sms=sms,
                             history=[sinks + 159, sinks + 60, sinks + 285], num_blocks=48, mbs=16,
                             decode_variant=variant, max_chunk_len=1)
    fused = VARIANTS[variant].fused
    assert all(p.decode_mode == int(fused) and p.decode_variant == variant for p in plans)
    assert all(p.fused_combine == int(fused and p.num_splits > 1) for p in plans)
    assert (min(p.num_splits for p in plans) >= 4) == (sms > 1)
    assert worst < 1.0


def test_split_kernel_assigns_every_key_once():
    """warp_work (kiviDecodeSplit.cuh's assignment): over all splits and warps of a CTA's tile, every quantized
    32-key chunk and every 16-key full-precision tile is taken exactly once, the full-precision tiles by warps 2
    and 3 only."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        nq = 32 * int(rng.integers(0, 400))
        key_end = nq + int(rng.integers(1, 300))
        ns = int(rng.integers(1, 40))
        chunks, tiles = [], []
        for split in range(ns):
            work = split_model.warp_work(nq, key_end, split, ns)
            chunks += [c for r, _ in work for c in r]
            for w, (_, t) in enumerate(work):
                assert not t or w >= 2
                tiles += t
        assert sorted(chunks) == list(range(nq // 32))
        assert sorted(tiles) == list(range(-(-(key_end - nq) // 16)))


def test_tolerance_catches_a_wrong_fragment(monkeypatch):
    """Swap two K channels in the register assignment: the emulation leaves the derived tolerance."""
    real = fragments.register_of

    def swapped(j, pos, bits):
        blk, reg = real(j, pos, bits)
        return blk, {0: 2, 2: 0}.get(reg, reg)  # channel 2t <-> 2t + 8

    cfg = KiviConfig(k_bits=4, v_bits=4, group_size=32, residual_length=32, block_size=128)
    monkeypatch.setattr(fragments, "register_of", swapped)
    with pytest.raises(AssertionError, match="max err/tol"):
        run_steps(cfg, 4, 1, 64, torch.float16, [[1]], history=[200], num_blocks=4, mbs=2)


def _attend_poisoned(step: tuple, buf: KiviBuffers, poison: dict[int, int], sms: int) -> torch.Tensor:
    """split_model.attention of a one-token step (decode mode) with window row poison[b] of slot b set to K = 0 (a
    score of 0: a weight comparable to the others'), V = 1000."""
    q, k, v, slots, past, table, cfg = step
    b2 = buf.clone()
    for b, row in poison.items():
        b2.k_window[b, :, row] = 0.0
        b2.v_window[b, :, row] = 1000.0
    ones = torch.ones(len(past), dtype=torch.int32)
    out, plan, flag = split_model.attention(q, k, v, slots, past, ones, table, b2, cfg, max_chunk_len=1,
                                            num_sms=sms, decode_variant=SPLIT)
    assert flag == 0 and plan.decode_mode == 1 and (plan.num_splits > 2) == (sms > 1)
    return out


@pytest.mark.parametrize("sinks, r, sms", [(0, 32, 1000), (4, 32, 1), (5, 0, 1000)])
def test_one_token_step_never_reads_the_row_the_decode_kernel_writes(sinks, r, sms):
    """Fused variants write the window row of a one-token chunk that flushes nothing from the decode kernel, while
    other CTAs of the same step still read the window (kiviDecodeSplit.cuh; kiviPrepareKernel's windowWritten:
    valid, chunk 1, n_q(s + 1) == n_q(s)). Oracle: the streaming contract -- that row (token s - W's, or a new sink
    row) holds nothing this step attends to -- checked on the split kernel's own key -> window-row mapping: a
    poisoned row there leaves every output bit unchanged, while the same poison in the row of token s - 1 (the
    control, where the window holds it) changes the output. Histories cover the sinks, the last non-flush length
    before a flush (W - 1 window keys) and a flush; with R = 0 the window empties at a flush."""
    from trtllm_kivi.reference.attention import append as ref_append
    g = 32
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=g, residual_length=r, block_size=64, sink_tokens=sinks)
    flush = sinks + r + g  # past length S + R + kG - 1 flushes on its next token
    hist = [max(sinks - 2, 1), flush + g - 2, flush + g - 1, sinks + r + 5]
    torch.manual_seed(0)
    batch, h, hkv, d = len(hist), 8, 2, 64
    buf = KiviBuffers.allocate(cfg, hkv, d, 64, batch, torch.float16)
    table = torch.randperm(64)[: batch * 16].reshape(batch, 16).int()
    slots = torch.arange(batch).int()
    for b, n in enumerate(hist):
        ref_append(buf, cfg, b, table[b], 0, torch.randn(hkv, n, d).half(), torch.randn(hkv, n, d).half())
    for step in range(2):
        lens = [n + step for n in hist]
        q, k, v = torch.randn(batch, h, d).half(), torch.randn(batch, hkv, d).half(), torch.randn(batch, hkv, d).half()
        inputs = (q, k, v, slots, torch.tensor(lens).int(), table, cfg)
        written = {b: cfg.window_row(s) for b, s in enumerate(lens)
                   if cfg.num_quantized(s + 1) == cfg.num_quantized(s)}
        assert len(written) >= batch - 1  # every history but the flushing one
        clean = _attend_poisoned(inputs, buf, {}, sms)
        assert torch.equal(_attend_poisoned(inputs, buf, written, sms), clean)
        held = [b for b, s in enumerate(lens) if s - 1 < sinks or s - 1 >= sinks + cfg.num_quantized(s)]
        assert len(held) >= batch - 1  # token s - 1 is in the window (with R = 0 not right after a flush)
        control = _attend_poisoned(inputs, buf, {b: cfg.window_row(lens[b] - 1) for b in held}, sms)
        assert all(not torch.equal(control[b], clean[b]) for b in held)
        for b in range(batch):
            ref_append(buf, cfg, b, table[b], lens[b], k[b:b + 1].transpose(0, 1), v[b:b + 1].transpose(0, 1))


@pytest.mark.parametrize("sms", [1, 1000])
def test_non_finite_window_key_gives_nan_not_zero(sms):
    """A NaN in a window key the step attends to makes that sequence's output NaN for the query heads of its KV head,
    as the reference's (docs/design.md: non-finite inputs never become silently finite): the split kernel's final
    division keeps a NaN l (it wrote 0 for any l that was not > 0). Other sequences and KV heads stay finite. One split
    (sms = 1: the CTA divides) and many (the fused merge divides)."""
    from trtllm_kivi.reference.attention import append as ref_append
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64)
    hist = [40, 300]
    torch.manual_seed(1)
    batch, h, hkv, d = len(hist), 8, 2, 64
    buf = KiviBuffers.allocate(cfg, hkv, d, 64, batch, torch.float16)
    table = torch.randperm(64)[: batch * 16].reshape(batch, 16).int()
    for b, n in enumerate(hist):
        ref_append(buf, cfg, b, table[b], 0, torch.randn(hkv, n, d).half(), torch.randn(hkv, n, d).half())
    q, k, v = torch.randn(batch, h, d).half(), torch.randn(batch, hkv, d).half(), torch.randn(batch, hkv, d).half()
    buf.k_window[0, 1, cfg.window_row(hist[0] - 1), 3] = float("nan")  # sequence 0, KV head 1, token s - 1: l NaN
    ones = torch.ones(batch, dtype=torch.int32)
    out, plan, flag = split_model.attention(q, k, v, torch.arange(batch).int(), torch.tensor(hist).int(), ones,
                                            table, buf, cfg, max_chunk_len=1, num_sms=sms, decode_variant=SPLIT)
    assert flag == 0 and (plan.num_splits > 1) == (sms > 1)
    out = out.float().reshape(batch, h, d)
    assert torch.isnan(out[0, 4:]).all()  # query heads 4..7 read KV head 1
    assert torch.isfinite(out[0, :4]).all() and torch.isfinite(out[1]).all()
