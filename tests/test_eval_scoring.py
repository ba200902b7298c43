"""Decode-mode scoring on a tiny random-weight Llama (real loader, runner and caches).

Oracle: token-by-token decoding (one step per token) through the same runner. Chunks that contain no flush point
R + kG strictly inside must reproduce it; CPU matmuls round differently for a [32, dim] and a [1, dim] input
(different BLAS blocking / accumulation order), so logits are compared with atol=1e-4 on logits of magnitude ~10,
about 100x the observed fp32 shape noise and far below the quantization effects (> 1e-2) that the misaligned case
must show.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cache import FullCache, KiviCache
from trtllm_kivi.eval.quality import QualitySetup, evaluate_quality
from trtllm_kivi.eval.scoring import chunk_plan, flush_points, is_exact, score_sequence
from trtllm_kivi.models.tiny import FAN_IN_INIT, write_tiny_checkpoint
from trtllm_kivi.eval.metrics import nll, perplexity
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models import load_model
from trtllm_kivi.runtime.torch_runner import TorchRunner

# This file's checkpoint: 2 query heads / 1 KV head, 4096 positions, no BOS/EOS ids (so no BOS is added), unit
# norms and N(0, 1/fan_in) matrices (embedding x3).
TINY = dict(init=FAN_IN_INIT, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            bos_token_id=None, eos_token_id=None)

ATOL = 1e-4
KIVI2 = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32)  # flush points 64, 96, 128, ...


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok, cfg = load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), **TINY))
    text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer " * 3
    return model, tok.encode(text, add_special_tokens=False)[:200]


def kivi_runner(model, cfg=KIVI2, slots=1, n=256, cls=KiviCache):
    return TorchRunner(model, cls(cfg, model.cfg.geometry, slots, n, model.dtype))


def token_by_token(runner, tokens, prefix):
    slot = runner.add_sequence()
    runner.step([slot], [tokens[:prefix]])
    out = torch.cat([runner.step([slot], [[t]]) for t in tokens[prefix:-1]])
    runner.free_sequence(slot)
    return out


def test_flush_points_and_plan():
    assert flush_points(KIVI2, 0, 130) == [64, 96, 128]
    assert flush_points(KIVI2, 64, 96) == [] and flush_points(KIVI2, 63, 96) == [64]
    plan = chunk_plan(40, 199, [KIVI2], 32)
    assert plan[0] == (40, 64) and plan[-1] == (192, 199)
    assert all(is_exact(KIVI2, s, e) for s, e in plan)
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))
    both = chunk_plan(0, 200, [KIVI2, KiviConfig(residual_length=40)], 1000)
    assert {72, 104, 64, 96}.issubset({s for s, _ in both})
    with pytest.raises(ValueError, match="max_chunk=0 must be >= 1"):
        chunk_plan(0, 10, [KIVI2], 0)


def test_aligned_chunks_equal_token_by_token(tiny):
    model, tokens = tiny
    prefix = 40
    ref = token_by_token(kivi_runner(model), tokens, prefix)
    plan = chunk_plan(prefix, len(tokens) - 1, [KIVI2], 32)
    got = score_sequence(kivi_runner(model), tokens, prefix, plan)
    assert got.shape == ref.shape == (len(tokens) - 1 - prefix, model.cfg.vocab_size)
    assert (got - ref).abs().max().item() < ATOL


def test_misaligned_chunk_differs(tiny):
    """Chunks of 32 from position 40 straddle the flush points 64, 96, ...: queries after a flush point inside the
    chunk attend to full-precision tokens that token-by-token decoding reads quantized, so the logits differ."""
    model, tokens = tiny
    prefix = 40
    ref = token_by_token(kivi_runner(model), tokens, prefix)
    plan = [(s, min(s + 32, len(tokens) - 1)) for s in range(prefix, len(tokens) - 1, 32)]
    assert not all(is_exact(KIVI2, s, e) for s, e in plan)
    got = score_sequence(kivi_runner(model), tokens, prefix, plan)
    diff = (got - ref).abs().amax(dim=-1)  # [positions]
    assert diff[: 64 - prefix].max().item() < ATOL  # positions 40..63 read no flushed state: still exact
    assert diff.max().item() > 100 * ATOL  # past a straddled flush point: a real difference
    # the same misaligned plan on an unquantized cache stays exact: the difference comes from the flush schedule
    full = lambda: TorchRunner(model, FullCache(model.cfg.geometry, 1, 256, torch.float32))  # noqa: E731
    assert (score_sequence(full(), tokens, prefix, plan) - token_by_token(full(), tokens, prefix)).abs().max() < ATOL


def test_quality_lockstep_matches_single_sequence_scoring(tiny):
    """evaluate_quality batches segments and runs configurations in lockstep; its PPL must equal scoring each
    segment alone with score_sequence (rtol for batch-shape rounding), and a configuration identical to the
    reference must show KL 0 and full top-1 agreement."""
    model, tokens = tiny
    setup = QualitySetup(segments=2, segment_len=100, prefix=40, batch=2)
    make = lambda: TorchRunner(model, FullCache(model.cfg.geometry, 2, 100, torch.float32))  # noqa: E731
    runners = {"fp32": make(), "fp32_copy": make(), "kivi2": kivi_runner(model, KIVI2, 2, 100)}
    res = evaluate_quality(model, runners, {"fp32": None, "fp32_copy": None, "kivi2": KIVI2}, tokens, setup, "fp32")
    plan = chunk_plan(40, 99, [KIVI2], 32)
    for name, runner in [("fp32", make()), ("kivi2", kivi_runner(model, KIVI2, 1, 100))]:
        nlls = torch.cat([nll(score_sequence(runner, tokens[a:a + 100], 40, plan), torch.tensor(tokens[a + 41:a + 100]))
                          for a in (0, 100)])
        assert res["configs"][name]["ppl"] == pytest.approx(perplexity(nlls), rel=1e-4)
        assert res["configs"][name]["scored_tokens"] == 2 * 59
    copy = res["configs"]["fp32_copy"]
    assert copy["kl_mean"] < 1e-9 and copy["top1_agreement"] == 1.0 and copy["attn_rel_err_mean"] < 1e-5
    k = res["configs"]["kivi2"]
    assert k["kl_mean"] > 1e-4 and k["attn_rel_err_mean"] > 1e-3  # the tiny model does feel 2-bit KV
    assert len(res["error_growth"]["kivi2"]["attn_rel_err_by_layer"]) == model.cfg.n_layers
