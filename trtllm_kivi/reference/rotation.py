"""The Hadamard rotation of FORMAT_VERSION 2 (format.py): H = Sylvester Walsh-Hadamard of size D, scaled 1/sqrt(D).

The op never sees it: a model rotates post-RoPE q and k by H before the op when its layer's k_rotation is
`hadamard` (scores are unchanged: (qH).(kH) = q.k because H H^T = I), v by H when v_rotation is `hadamard`, and the
op's output by H^T (= H: the Sylvester matrix is symmetric) before o_proj.
"""

from __future__ import annotations

import functools
import math

import torch

from ..format import SUPPORTED_ROTATIONS


@functools.cache
def _hadamard_f64(d: int) -> torch.Tensor:
    if d <= 0 or d & (d - 1):
        raise ValueError(f"head_dim={d} has no Sylvester Hadamard matrix; a power of 2 is needed")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # H_2n = [[H_n, H_n], [H_n, -H_n]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """H [d, d]: orthonormal, symmetric, entries +-1/sqrt(d) (computed in fp64, then cast)."""
    return _hadamard_f64(d).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """x [..., D] -> x H for `hadamard` (x itself for `none`), in x's dtype (fp32 matmul)."""
    if rotation == "none":
        return x
    if rotation not in SUPPORTED_ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not supported; allowed: {', '.join(SUPPORTED_ROTATIONS)}")
    return (x.float() @ hadamard(x.shape[-1], device=x.device)).to(x.dtype)


def unrotate(x: torch.Tensor, rotation: str) -> torch.Tensor:
    """Inverse of rotate: x H^T."""
    if rotation == "none":
        return x
    return (x.float() @ hadamard(x.shape[-1], device=x.device).T).to(x.dtype)
