"""Per-position metrics on next-token logits.

Computed in float32 from log_softmax (float64 over [positions, 49152] costs ~10x more on the CPU): KL is summed from
p_ref * (log p_ref - log p_test), whose fp32 rounding (~1e-6 absolute on log-probs of magnitude <~30, weighted by
p_ref) is far below the KL values measured here (>~1e-5); identical inputs give exactly 0. Results are returned as
float64 tensors so that averages over many positions do not lose digits.
"""

from __future__ import annotations

import math

import torch


def _check_pair(ref: torch.Tensor, test: torch.Tensor) -> None:
    if ref.shape != test.shape or ref.dim() != 2:
        raise ValueError(f"logits must both be [positions, vocab]; got {tuple(ref.shape)} and {tuple(test.shape)}")


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in fp32 (or float64 if given float64): [N, V] -> [N, V]."""
    return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)


def nll_from_log_probs(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, V] log-probs, targets [N] -> [N] float64."""
    if logp.dim() != 2 or targets.shape != (logp.shape[0],):
        raise ValueError(f"logits {tuple(logp.shape)} must be [N, V] and targets {tuple(targets.shape)} [N]")
    return -logp.gather(1, targets.long()[:, None])[:, 0].double()


def kl_from_log_probs(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position from log-probs [N, V] x2 -> [N] float64."""
    _check_pair(lp, lq)
    # where p = 0 the term is 0 (even if q = 0 too); exp(lp) * (lp - lq) would give nan there
    terms = torch.where(lp == float("-inf"), torch.zeros_like(lp), lp.exp() * (lp - lq))
    return terms.sum(dim=-1).double().clamp_min(0.0)  # rounding can leave tiny negatives for p ~= q


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: logits [N, V], targets [N] -> [N] float64 (nats)."""
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] and targets {tuple(targets.shape)} [N]")
    return nll_from_log_probs(log_probs(logits), targets)


def perplexity(nlls: torch.Tensor) -> float:
    """exp(mean NLL)."""
    return math.exp(float(nlls.double().mean()))


def kl_divergence(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p_test) per position: sum_v p_ref(v) (log p_ref(v) - log p_test(v)); [N, V] x2 -> [N] float64."""
    _check_pair(ref_logits, test_logits)
    return kl_from_log_probs(log_probs(ref_logits), log_probs(test_logits))


def top1_agreement(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """Whether the argmax tokens agree, per position: [N, V] x2 -> [N] bool."""
    _check_pair(ref_logits, test_logits)
    return ref_logits.argmax(dim=-1) == test_logits.argmax(dim=-1)


def relative_error(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """||test - ref||_2 / ||ref||_2 over the last dim: [..., X] x2 -> [...] float64 (0 where both are 0)."""
    if ref.shape != test.shape:
        raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(test.shape)}")
    num = (test.float() - ref.float()).norm(dim=-1).double()
    den = ref.float().norm(dim=-1).double()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))


def token_rank(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rank of each target among the vocabulary (0 = the argmax; ties count against the target):
    logits [N, V], targets [N] -> [N] int64."""
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] and targets {tuple(targets.shape)} [N]")
    t = logits.gather(1, targets.long()[:, None])
    above = (logits > t).sum(dim=-1)
    ties = (logits == t).sum(dim=-1) - 1  # other tokens with exactly the same logit
    return above + ties
