"""The CPU emulation of the prefill attention kernel (trtllm_kivi/cuda/prefill_model.py, kiviPrefillMma.cuh).

Oracles: trtllm_kivi.reference (pack_fragments, kivi_attention_, append) and the PTX ISA's A fragment layout
(fragments.a_coord).
  - the scatter: the kernel's index arithmetic from a FRAGMENT-order word (tile, lane, word, bit position) to a
    (key, channel) element puts every reference code of a 32-key chunk exactly once where it belongs, K and V, every
    bit width and head_dim;
  - attention: ragged steps whose long chunks (>= 64 query rows) run in the prefill kernel, next to decode
    sequences in the decode kernel, over quantized histories, sinks and the window, one split and many: within
    mma_model.attention_tolerance of the reference (the prefill kernel rounds less than the decode kernel's folds:
    its K/V tiles are the reference's history values exactly), stores bit-exact;
  - a wrong scatter (keys 8 apart swapped) leaves that tolerance, so the test can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels_mma_model import run_steps

from trtllm_kivi.cuda import launch, prefill_model
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import pack_fragments


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_scatter_places_every_reference_code_once(bits, d, kind):
    gen = torch.Generator().manual_seed(bits * d)
    codes = torch.randint(0, 2 ** bits, (32, d), generator=gen).int()  # [key, channel] of a 32-key chunk
    codes[3, :] = 2 ** bits - 1  # all-ones words (negative int32)
    words = pack_fragments(codes, bits, kind).numpy().view(np.uint32)
    got, hits = prefill_model.scatter_fragment_words(words, bits, d, kind)
    assert (hits == 1).all()
    assert np.array_equal(got, codes.numpy())


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    real = prefill_model.cta

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(prefill_model, "cta", counted)
    return calls


@pytest.mark.parametrize("kb, vb, g, d, h, hkv, dtype, sdt, sinks", [
    (2, 2, 32, 128, 8, 2, torch.float16, "float16", 0),
    (4, 2, 32, 64, 3, 1, torch.bfloat16, "float16", 4),
    (8, 4, 64, 64, 2, 2, torch.float16, "float32", 0),
    (2, 8, 32, 64, 16, 1, torch.bfloat16, "bfloat16", 33),
])
def test_prefill_steps_match_reference(monkeypatch, kb, vb, g, d, h, hkv, dtype, sdt, sinks):
    """Chunks of 70 / 150 tokens (>= 64 rows at every GQA here) run in the prefill kernel, the others in the decode
    kernel, over histories with quantized groups, sinks and the ring; few splits and many."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=32, block_size=128, scale_dtype=sdt,
                     sink_tokens=sinks)
    calls = _counting(monkeypatch)
    steps = [[70, 3, 0], [1, 150, 7], [1, 1, 70]]
    few, _ = run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1, history=[200, 40, 0], num_blocks=40, mbs=4)
    assert calls[0] > 0 and all(p.num_prefill_tiles > 0 for p in few)
    many, _ = run_steps(cfg, h, hkv, d, dtype, steps, num_sms=1000, history=[200, 40, 0], num_blocks=40, mbs=4)
    assert any(p.num_splits > 2 for p in many)


def test_decode_steps_never_plan_the_prefill_kernel():
    """max_chunk_len = 1 (what a decode step's caller knows): no prefill grid, the decode plan is unchanged."""
    cfg = KiviConfig()
    plan = launch.launch_plan(cfg, 32, 8, 128, 64, 64, 256, max_chunk_len=1)
    assert plan.num_prefill_tiles == 0 and not plan.is_prefill(1)
    unhinted = launch.launch_plan(cfg, 32, 8, 128, 64, 64, 256)  # the plugin's case: any chunk up to T
    assert unhinted.num_prefill_tiles > 0 and unhinted.is_prefill(16) and not unhinted.is_prefill(15)


def test_tolerance_catches_a_wrong_scatter(monkeypatch):
    """Swap keys g and g + 8 in the scatter of K: the emulation leaves the derived tolerance."""
    real = prefill_model.scatter_fragment_words

    def swapped(words, bits, d, kind):
        codes, hits = real(words, bits, d, kind)
        if kind == "keys":
            codes = codes.reshape(2, 2, 8, d)[:, ::-1].reshape(32, d)
        return codes, hits

    monkeypatch.setattr(prefill_model, "scatter_fragment_words", swapped)
    cfg = KiviConfig(k_bits=4, v_bits=4, group_size=32, residual_length=32, block_size=128)
    with pytest.raises(AssertionError, match="max err/tol"):
        run_steps(cfg, 4, 1, 64, torch.float16, [[64]], history=[200], num_blocks=4, mbs=2)
