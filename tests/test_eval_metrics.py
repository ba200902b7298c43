"""Metric correctness on distributions whose values are worked out by hand (the oracle is the closed form)."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_kivi.eval.metrics import (kl_divergence, nll, perplexity, relative_error, token_rank,
                                      top1_agreement)


def logits_of(p: list[float]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log()[None]  # log-probabilities are valid logits


def test_kl_known_values():
    # KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(logits_of([0.5, 0.5]), logits_of([0.9, 0.1])).item() == pytest.approx(expected, rel=1e-12)
    # asymmetric: the reverse direction is a different number
    rev = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(logits_of([0.9, 0.1]), logits_of([0.5, 0.5])).item() == pytest.approx(rev, rel=1e-12)
    assert expected != pytest.approx(rev)


def test_kl_invariances_and_zero_mass():
    a = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.all(kl_divergence(a, a) == 0)
    # a constant shift of the logits is the same distribution (fp32 inputs: computed in fp32, ~1e-7 rounding)
    assert torch.allclose(kl_divergence(a, a + 3.0), torch.zeros(5, dtype=torch.float64), atol=1e-6)
    # p_ref puts zero mass on token 2: that term is 0, not nan; KL([.5,.5,0] || [.25,.25,.5]) = ln 2
    p = torch.tensor([[0.0, 0.0, float("-inf")]], dtype=torch.float64)
    q = logits_of([0.25, 0.25, 0.5])
    assert kl_divergence(p, q).item() == pytest.approx(math.log(2), rel=1e-12)


def test_top1_and_rank():
    ref = torch.tensor([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]])
    test = torch.tensor([[0.0, 9.0, 1.0], [0.0, 2.0, 1.0]])
    assert top1_agreement(ref, test).tolist() == [True, False]
    assert token_rank(ref, torch.tensor([1, 2])).tolist() == [0, 1]
    assert token_rank(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0])).tolist() == [1]  # a tie counts against


def test_nll_and_perplexity_uniform():
    v = 10
    logits = torch.zeros(4, v)
    n = nll(logits, torch.tensor([0, 3, 5, 9]))
    assert torch.allclose(n, torch.full((4,), math.log(v), dtype=torch.float64))
    assert perplexity(n) == pytest.approx(v)
    # a two-token case by hand: p(target) = e^2 / (e^2 + 1)
    assert nll(torch.tensor([[2.0, 0.0]]), torch.tensor([0])).item() == pytest.approx(-math.log(math.e ** 2 /
                                                                                                (math.e ** 2 + 1)))


def test_relative_error():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    test = torch.tensor([[3.0, 5.0], [0.0, 0.0]])
    assert relative_error(ref, test).tolist() == [pytest.approx(0.2), 0.0]


def test_shape_errors():
    with pytest.raises(ValueError, match=r"must both be \[positions, vocab\]"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="must be"):
        nll(torch.zeros(2, 3), torch.tensor([1]))
