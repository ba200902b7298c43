"""K/V beyond the range of the cache's storage: real models have outliers (vLLM met sink-scale outliers overflowing
fp16 scales), and a KIVI group stores zero = min and scale = range / (2^b - 1) in the scale dtype (fp16 by default).
Such values must be refused with a message naming the layer, the value and the fix, never stored as inf/NaN; a wider
scale dtype stores them finitely. No model needed."""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cache import FullCache, KiviCache, KVRangeError
from trtllm_kivi.format import Geometry, KiviConfig

GEOM = Geometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def _kv(t: int, peak: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 64, generator=g)
    k, v = torch.randn(t, 2, 64, generator=g), torch.randn(t, 2, 64, generator=g)
    k[t // 2, 1, 7] = peak  # one outlier channel value of one token
    return q, k, v


def _step(cache, layer: int, q, k, v):
    slot = cache.add_sequence() if not any(cache.active) else 0
    step = cache.begin_step([slot], [q.shape[0]])
    out = cache.attention(layer, q, k, v, step)
    return slot, step, out


@pytest.mark.parametrize("backend", ["memo", "reference"])
def test_fp16_scales_refuse_a_key_beyond_their_range(backend):
    cache = KiviCache(KiviConfig(), GEOM, 1, 512, torch.float32, backend=backend)
    q, k, v = _kv(300, 7.0e4)  # > 65504: the group's stored zero (its min) or scale would round to inf
    before = [t.clone() for t in cache.layers[1]]
    with pytest.raises(KVRangeError, match=r"layer 1: \|K\| reaches 7e\+04.*float16, max 65504.*--scale-dtype "
                                           r"bfloat16"):
        _step(cache, 1, q, -k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layers[1], strict=True))  # nothing was written


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
def test_a_wider_scale_dtype_stores_the_same_keys_finitely(scale_dtype):
    cache = KiviCache(KiviConfig(scale_dtype=scale_dtype), GEOM, 1, 512, torch.float32, backend="memo")
    q, k, v = _kv(300, 7.0e4)
    slot, step, out = _step(cache, 0, q, -k, v)
    cache.end_step(step)
    assert torch.isfinite(out).all()
    kd, vd = cache.dequantized(slot, 0)  # [Hkv, T, D]: 300 tokens, 160 of them quantized (R = 128, G = 32)
    assert torch.isfinite(kd).all() and torch.isfinite(vd).all()
    assert float(kd[1, 150, 7]) == pytest.approx(-7.0e4, rel=1e-2)  # the outlier survives, quantized


def test_the_largest_fp16_value_is_still_accepted():
    # |x| <= 65504 keeps zero = min and scale = (max - min) / 3 <= 43670 finite in fp16: no false refusal
    cache = KiviCache(KiviConfig(), GEOM, 1, 512, torch.float32, backend="memo")
    q, k, v = _kv(300, 65504.0)
    k[10, 1, 7] = -65504.0
    slot, step, out = _step(cache, 0, q, k, v)
    cache.end_step(step)
    kd, _ = cache.dequantized(slot, 0)
    assert torch.isfinite(out).all() and torch.isfinite(kd).all()


def test_non_finite_values_are_refused_too():
    cache = KiviCache(KiviConfig(), GEOM, 1, 512, torch.float32, backend="memo")
    q, k, v = _kv(8, 1.0)
    v[3, 0, 0] = float("nan")
    with pytest.raises(KVRangeError, match=r"layer 0: \|V\| reaches nan"):
        _step(cache, 0, q, k, v)


def test_an_fp16_cache_refuses_what_fp16_cannot_hold_and_bf16_keeps_it():
    q, k, v = _kv(16, 1.0e5)
    with pytest.raises(KVRangeError, match=r"layer 0: \|K\|.*cache dtype \(float16.*--kv bf16"):
        _step(FullCache(GEOM, 1, 64, torch.float16, backend="torch"), 0, q, k, v)
    _, _, out = _step(FullCache(GEOM, 1, 64, torch.bfloat16, backend="torch"), 0, q, k, v)
    assert torch.isfinite(out).all()
