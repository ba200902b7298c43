"""The reference quantizer and packing (trtllm_kivi/reference/quant.py, kv.py) against docs/design.md's quantization
contract.

Oracles: pure-Python integer bit assembly for packing; a per-group numpy loop written here for K/V grouping; an error
bound derived below from the contract; hand-made half-way cases for rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import (dequantize_groups, dequantize_keys, dequantize_values, pack, pack_fragments,
                                   quantize_along,
                                   quantize_groups, quantize_keys, quantize_values, unpack,
                                   unpack_fragments)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# ---------------------------------------------------------------------------------------------- packing


def pack_oracle(codes: list[int], bits: int) -> list[int]:
    """LSB-first: code i of a word at bits [i*b, (i+1)*b); the 32-bit word read as int32 (two's complement);
    a last partial word is zero-padded."""
    per = 32 // bits
    words = []
    for w0 in range(0, len(codes), per):
        word = 0
        for i, c in enumerate(codes[w0:w0 + per]):
            word |= c << (i * bits)
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return words


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), n=st.integers(1, 70), rows=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_pack_matches_bit_oracle(bits, n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.int32)
    words = pack(codes, bits)
    assert words.dtype == torch.int32
    assert words.tolist() == [pack_oracle(r, bits) for r in codes.tolist()]
    assert torch.equal(unpack(words, bits, n), codes)  # round trip, n not necessarily a multiple of 32 / bits
    # Packing along another axis (keys pack along tokens) is the same per column.
    words_t = pack(codes.T.contiguous(), bits, dim=0)
    assert words_t.T.tolist() == [pack_oracle(r, bits) for r in codes.tolist()]
    assert torch.equal(unpack(words_t, bits, n, dim=0), codes.T)


def test_pack_extremes():
    assert pack(torch.full((16,), 3), 2).tolist() == [-1]  # all bits set -> int32 -1
    assert pack(torch.tensor([3] + [0] * 15), 2).tolist() == [3]  # code 0 in the lowest bits
    assert pack(torch.tensor([0] * 15 + [2]), 2).tolist() == [-(1 << 31)]  # code 15's high bit is the sign bit
    assert pack(torch.tensor([1, 2, 3, 4]), 8).tolist() == [0x04030201]


# ---------------------------------------------------------------------------------------------- error bound


def error_bound(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |x - dequant| for groups on the last axis, derived from the contract.

    With s, z the stored scale/zero, mn/mx the group's exact min/max, s* = (mx - mn) / (2^b - 1), u = (x - z) / s:
      - unclamped (0 <= round(u) <= 2^b-1): |x - (q s + z)| = s |u - q| <= s / 2;
      - clamped low (q = 0, x < z): x >= mn, so |x - z| <= |z - mn|;
      - clamped high (q = 2^b-1, u > 2^b-1): 0 < x - z - (2^b-1) s <= (mx - mn) - (2^b-1) s + (mn - z)
        <= (2^b-1)|s* - s| + |z - mn|;
      - s = 0: q = 0 and |x - z| <= (mx - mn) + |z - mn| = (2^b-1)|s* - s| + |z - mn|.
    So |x - deq| <= s/2 + |z - mn| + (2^b-1)|s - s*|, plus the fp32 rounding of (x - z) / s (it can move q across
    a half-way point: s * 2 eps32 |u|) and of q s + z, plus half an ulp of the cast to the output dtype (and the
    smallest subnormal, for results that land in the subnormal range)."""
    x64 = x.double()
    mn, mx = x64.amin(-1, keepdim=True), x64.amax(-1, keepdim=True)
    s, z = scale.double().unsqueeze(-1), zero.double().unsqueeze(-1)
    s_true = (mx - mn) / (2**bits - 1)
    core = s / 2 + (z - mn).abs() + (2**bits - 1) * (s - s_true).abs()
    eps32 = torch.finfo(torch.float32).eps
    deq64 = codes.double() * s + z
    fp32 = 4 * eps32 * ((x64 - z).abs() + (codes.double() * s).abs() + z.abs())
    fo = torch.finfo(out_dtype)
    cast = fo.eps / 2 * (deq64.abs() + core) + fo.smallest_normal * fo.eps
    return core + fp32 + cast


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), x_dtype=st.sampled_from(DTYPES), s_dtype=st.sampled_from(DTYPES),
       group=st.sampled_from([8, 32, 64]), log_mag=st.integers(-6, 6), offset=st.floats(-100, 100),
       seed=st.integers(0, 2**31))
def test_quantize_error_bound(bits, x_dtype, s_dtype, group, log_mag, offset, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, group, generator=g) * 10.0**log_mag + offset).to(x_dtype)  # 5 groups
    codes, scale, zero = quantize_groups(x, bits, s_dtype)
    # Finite inputs whose scale/zero fit the scale dtype; overflow has its own test below.
    assume(torch.isfinite(x).all() and torch.isfinite(scale).all() and torch.isfinite(zero).all())
    assert codes.dtype == torch.int32 and scale.dtype == zero.dtype == s_dtype
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1
    deq = dequantize_groups(codes, scale, zero, x_dtype)
    assert deq.dtype == x_dtype and torch.isfinite(deq).all()
    err = (x.double() - deq.double()).abs()
    bound = error_bound(x, codes, scale, zero, bits, x_dtype)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


def test_error_bound_is_not_vacuous():
    """A quantizer that truncates instead of rounding breaks the bound: the test above can fail."""
    x = torch.linspace(0, 3, 64)  # scale 1 at 2 bits, exact in fp16; u spans [0, 3]
    codes, scale, zero = quantize_groups(x[None], 2, torch.float32)
    floor_codes = torch.floor(x / scale.float())[None].clamp(0, 3).to(torch.int32)
    bad = dequantize_groups(floor_codes, scale, zero, torch.float32)
    assert ((x - bad).abs() > error_bound(x[None], floor_codes, scale, zero, 2, torch.float32)).any()


# ---------------------------------------------------------------------------------------------- special groups


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("s_dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_constant_groups_reconstruct_exactly(x_dtype, s_dtype, bits):
    values = torch.tensor([0.0, -0.0, 1.0, -3.5, 0.1, 1234.5, -6e-5])
    x = values[:, None].expand(-1, 32).to(x_dtype)  # one constant group per value
    codes, scale, zero = quantize_groups(x, bits, s_dtype)
    assert (scale == 0).all() and (codes == 0).all()
    deq = dequantize_groups(codes, scale, zero, x_dtype)
    assert not deq.isnan().any()
    # Exactly the stored zero (cast to the output dtype) ...
    assert torch.equal(deq, zero.to(x_dtype)[:, None].expand(-1, 32))
    # ... which is exactly x whenever x's dtype fits in the scale dtype.
    fits = s_dtype == torch.float32 or s_dtype == x_dtype
    if fits:
        assert torch.equal(deq, x)


def test_scale_underflow_stores_zero_codes():
    # fp16 input [0, 2^-24]: range 5.96e-8, scale 2e-8 underflows to 0 in fp16 (smallest subnormal 5.96e-8).
    x = torch.tensor([[0.0, 2.0**-24] * 16], dtype=torch.float16)
    codes, scale, zero = quantize_groups(x, 2, torch.float16)
    assert scale.item() == 0 and (codes == 0).all()
    deq = dequantize_groups(codes, scale, zero, torch.float16)
    assert (deq == zero.item()).all() and zero.item() == 0.0
    # fp32 input with a range of 1e-9 around 1.0: scale underflows, reconstruction is the stored zero 1.0.
    x = (1.0 + torch.rand(1, 32) * 1e-7).float()
    codes, scale, zero = quantize_groups(x, 4, torch.float16)
    assert scale.item() == 0 and (codes == 0).all()
    assert torch.equal(dequantize_groups(codes, scale, zero, torch.float32), torch.ones(1, 32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_non_finite_input_poisons_only_its_group(bad, x_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g).to(x_dtype)
    x[2, 7] = bad
    codes, scale, zero = quantize_groups(x, 2, torch.float16)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 3  # codes unspecified, but valid integers
    deq = dequantize_groups(codes, scale, zero, x_dtype)
    assert not torch.isfinite(deq[2]).any()
    ok = [0, 1, 3]  # the other groups are exactly what quantizing them alone gives
    c2, s2, z2 = quantize_groups(x[ok], 2, torch.float16)
    assert torch.equal(codes[ok], c2) and torch.equal(scale[ok], s2) and torch.equal(zero[ok], z2)
    assert torch.isfinite(deq[ok]).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_scale_zero_overflow_is_non_finite(bits):
    # The stored scale overflows fp16 (>= 65520 rounds to inf) when (mx - mn) / (2^b - 1) does: range 70000 *
    # (2^b - 1) with min 0 (finite zero) ...
    x = torch.linspace(0, 70000.0 * (2**bits - 1), 32)[None]
    codes, scale, zero = quantize_groups(x, bits, torch.float16)
    assert scale.isinf().all() and zero.item() == 0
    assert not torch.isfinite(dequantize_groups(codes, scale, zero, torch.float32)).any()
    # ... and the stored zero overflows when the min does (min -70000, small range: the scale is finite).
    x = torch.linspace(-70000.0, -69000.0, 32)[None]
    codes, scale, zero = quantize_groups(x, bits, torch.float16)
    assert torch.isfinite(scale).all() and zero.isinf().all()
    assert not torch.isfinite(dequantize_groups(codes, scale, zero, torch.float32)).any()


def test_range_above_fp16_max_with_finite_scale_is_still_correct():
    # A range > 65504 alone does not overflow anything: [-40000, 40000] at 2 bits has scale 26667 and zero -40000,
    # both finite in fp16, so the group dequantizes within the derived bound (finite, not garbage).
    x = torch.linspace(-40000.0, 40000.0, 32).half()[None]  # (linspace in fp16 overflows its own step)
    codes, scale, zero = quantize_groups(x, 2, torch.float16)
    deq = dequantize_groups(codes, scale, zero, torch.float16)
    assert torch.isfinite(deq).all()
    assert ((x.double() - deq.double()).abs() <= error_bound(x, codes, scale, zero, 2, torch.float16)).all()


def test_round_half_to_even():
    # 2 bits over [0, 3]: scale 1, zero 0 (exact); u = x exactly, so x = k + 0.5 is a true tie.
    x = torch.tensor([[0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5]])
    codes, scale, zero = quantize_groups(x, 2, torch.float16)
    assert (scale.item(), zero.item()) == (1.0, 0.0)
    assert codes.tolist() == [[0, 3, 0, 2, 2, 1, 2, 0]]
    # 8 bits over [0, 255]: scale 1.
    x = torch.tensor([[0.0, 255.0, 0.5, 1.5, 2.5, 3.5, 254.5, 127.5]])
    codes, _, _ = quantize_groups(x, 8, torch.float32)
    assert codes.tolist() == [[0, 255, 0, 2, 2, 4, 254, 128]]


# ---------------------------------------------------------------------------------------------- K and V grouping


def _cast(v: np.float32, dtype: torch.dtype) -> np.float32:
    """Round a float32 scalar to `dtype` (numpy has no bfloat16) and return its exact float32 value."""
    return np.float32(torch.tensor(float(v), dtype=torch.float32).to(dtype).item())


def group_oracle(groups: np.ndarray, bits: int, s_dtype: torch.dtype):
    """One group at a time: groups [n, size] float32 -> codes [n, size], scale [n], zero [n] (float32 values of the
    stored scale/zero)."""
    n = groups.shape[0]
    codes = np.zeros(groups.shape, dtype=np.int64)
    scale, zero = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for i in range(n):
        grp = groups[i]
        mn, mx = np.float32(grp.min()), np.float32(grp.max())
        s = _cast(np.float32(mx - mn) / np.float32(2**bits - 1), s_dtype)
        z = _cast(mn, s_dtype)
        scale[i], zero[i] = s, z
        if s != 0:
            codes[i] = np.clip(np.rint((grp - z) / s), 0, 2**bits - 1)  # np.rint: half to even
    return codes, scale, zero


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), g=st.sampled_from([32, 64]), d=st.sampled_from([32, 64, 128]),
       hkv=st.integers(1, 3), ngroups=st.integers(1, 3), s_dtype=st.sampled_from(DTYPES),
       x_dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_key_and_value_grouping_matches_per_group_oracle(bits, g, d, hkv, ngroups, s_dtype, x_dtype, seed):
    cfg_args = dict(k_bits=bits, v_bits=bits, group_size=g, block_size=128,
                    scale_dtype=str(s_dtype).removeprefix("torch."))
    cfg = KiviConfig(**cfg_args)
    n = ngroups * g
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(hkv, n, d, generator=gen) * 3 + torch.randn(hkv, 1, d, generator=gen) * 5).to(x_dtype)
    xn = x.float().numpy()
    gv = min(g, d)

    # Keys, per channel: for each head h, channel c, token group j: tokens [j*G, (j+1)*G) of channel c.
    kc, ks, kz = quantize_keys(x, cfg)
    k_codes = unpack_fragments(kc.reshape(hkv, -1), bits, "keys", n, d)  # [Hkv, n, D]
    for h in range(hkv):
        groups = xn[h].T.reshape(d, ngroups, g).reshape(d * ngroups, g)  # [(c, j), G]
        oc, os_, oz = group_oracle(groups, bits, s_dtype)
        assert np.array_equal(k_codes[h].T.reshape(d * ngroups, g).numpy(), oc)
        assert np.array_equal(ks[h].float().T.reshape(-1).numpy(), os_)
        assert np.array_equal(kz[h].float().T.reshape(-1).numpy(), oz)
    deq = dequantize_keys(kc, ks, kz, cfg, n, d, torch.float32)
    expect = k_codes.float() * ks.float().repeat_interleave(g, 1) + kz.float().repeat_interleave(g, 1)
    assert torch.equal(deq, expect)

    # Values, per token: for each head h, token t, channel group j: channels [j*Gv, (j+1)*Gv) of token t.
    vc, vs, vz = quantize_values(x, cfg)
    v_codes = unpack_fragments(vc.reshape(hkv, -1), bits, "values", n, d)  # [Hkv, n, D]
    for h in range(hkv):
        groups = xn[h].reshape(n * (d // gv), gv)
        oc, os_, oz = group_oracle(groups, bits, s_dtype)
        assert np.array_equal(v_codes[h].reshape(-1, gv).numpy(), oc)
        assert np.array_equal(vs[h].float().reshape(-1).numpy(), os_)
        assert np.array_equal(vz[h].float().reshape(-1).numpy(), oz)
    deq = dequantize_values(vc, vs, vz, cfg, d, torch.float32)
    expect = v_codes.float() * vs.float().repeat_interleave(gv, 2) + vz.float().repeat_interleave(gv, 2)
    assert torch.equal(deq, expect)

    # Per-token keys (the naive control) are grouped exactly like values (codes in LINEAR order).
    pc, ps, pz = quantize_keys(x, KiviConfig(**cfg_args, key_grouping="per_token"))
    assert torch.equal(unpack(pc, bits, d, dim=2), v_codes) and torch.equal(ps, vs) and torch.equal(pz, vz)


def test_quantize_along_rejects_partial_groups():
    with pytest.raises(ValueError, match=r"size 40 of dim 1 is not a multiple of the group size 32"):
        quantize_along(torch.zeros(2, 40), dim=1, group=32, bits=2)


# ---------------------------------------------------------------------------------------------- drift experiment


def test_drifting_values_need_per_token_scales():
    """The source material's experiment: a tensor whose later tokens drift (first half N(0, 1), second half
    N(10, 1)). Per-channel scales calibrated once on the first half cannot represent the drifted tokens (they clamp
    to the old max, an error of ~7.5 per element), while per-token scales are refitted on every token and keep the
    2-bit step (~range/3 of 32 normals) small. KIVI avoids the failure for keys, which need per-channel grouping
    because of their outlier channels, by fitting each G-token group on its own tokens (streaming): we check that
    too."""
    g = torch.Generator().manual_seed(0)
    t, c = 256, 64
    x = torch.randn(t, c, generator=g)
    x[t // 2:] += 10.0

    # Per token: one scale/zero per 32 channels of each token (how values are stored).
    codes, s, z = quantize_along(x, dim=1, group=32, bits=2, scale_dtype=torch.float32)
    per_token = dequantize_groups(codes.reshape(t, 2, 32), s, z, torch.float32).reshape(t, c)

    # Per channel, fitted on the first half only, applied to all tokens with clamping (a static calibration).
    _, s_c, z_c = quantize_along(x[: t // 2], dim=0, group=t // 2, bits=2, scale_dtype=torch.float32)  # [1, C]
    q = torch.round((x - z_c) / s_c).clamp(0, 3)
    static = q * s_c + z_c

    # Per channel over G = 32-token groups, each fitted on its own tokens (KIVI's streamed keys).
    codes_k, s_k, z_k = quantize_along(x, dim=0, group=32, bits=2, scale_dtype=torch.float32)
    streamed = codes_k.float() * s_k.repeat_interleave(32, 0) + z_k.repeat_interleave(32, 0)

    mse = lambda y: ((x - y) ** 2).mean().item()  # noqa: E731
    assert mse(static) > 10 * mse(per_token), (mse(static), mse(per_token))
    assert mse(static) > 10 * mse(streamed), (mse(static), mse(streamed))


# ---------------------------------------------------------------------------------------------- fragment order


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_fragment_pack_round_trip_and_is_a_permutation(bits, kind, d):
    """pack_fragments is a bijection of the codes of each 16-token tile (every code lands in exactly one word
    position) and unpack_fragments inverts it."""
    gen = torch.Generator().manual_seed(bits * d)
    codes = torch.randint(0, 2 ** bits, (2, 48, d), generator=gen).int()
    words = pack_fragments(codes, bits, kind)
    assert words.shape == (2, 48 * d * bits // 32)
    assert torch.equal(unpack_fragments(words, bits, kind, 48, d), codes)
    assert torch.equal(unpack_fragments(words, bits, kind, 32, d), codes[:, :32])  # a prefix of tiles
    seen = torch.zeros(16 * d, dtype=torch.int64)  # every (token, channel) of a tile exactly once
    seen.index_add_(0, torch.tensor([fmt_coord_flat(kind, lane, j, h, p, bits, d)
                                     for lane in range(32) for j in range(d * bits // 64)
                                     for h in range(2) for p in range(16 // bits)]), torch.ones(16 * d, dtype=torch.int64))
    assert torch.all(seen == 1)


def fmt_coord_flat(kind, lane, j, h, p, bits, d):
    from trtllm_kivi.format import fragment_coord
    tok, ch = fragment_coord(kind, lane, j, h, p, bits)
    return tok * d + ch


def test_fragment_order_by_hand():
    """Oracle: the PTX ISA's m16n8k16 A-fragment layout written out by hand for lane 5 (groupID 1,
    threadID_in_group 1), 2-bit codes, D = 64 (nw = 2 words per lane and tile)."""
    from trtllm_kivi.format import fragment_coord
    # keys: register r = pair % 4 holds (row g + 8 (r & 1), cols 2t + 8 (r >> 1) + half); block i = pair // 4
    assert fragment_coord("keys", 5, 0, 0, 0, 2) == (1, 2)  # a0 lo: key 1, channel 2
    assert fragment_coord("keys", 5, 0, 1, 0, 2) == (1, 3)  # a0 hi: channel 3
    assert fragment_coord("keys", 5, 0, 0, 1, 2) == (9, 2)  # a1: key g + 8
    assert fragment_coord("keys", 5, 0, 0, 2, 2) == (1, 10)  # a2: channel 2t + 8
    assert fragment_coord("keys", 5, 0, 0, 4, 2) == (1, 18)  # pair 4: k-block 1
    assert fragment_coord("keys", 5, 1, 0, 0, 2) == (1, 34)  # word 1 starts at pair 8: k-block 2
    # values (V^T tiles): rows are channels, columns (pairs) are tokens
    assert fragment_coord("values", 5, 0, 0, 0, 2) == (2, 1)  # a0 lo: token 2t, channel g
    assert fragment_coord("values", 5, 0, 1, 1, 2) == (3, 9)  # a1 hi: token 2t + 1, channel g + 8
    assert fragment_coord("values", 5, 0, 0, 3, 2) == (10, 9)  # a3: token 2t + 8, channel g + 8
    assert fragment_coord("values", 5, 0, 0, 4, 2) == (2, 17)  # pair 4: channel m-tile 1
    # bits: lane 0, tile of all-zero codes but key 0 / channel 1 = 3 -> word 0, half 1, position 0
    codes = torch.zeros(16, 64, dtype=torch.int32)
    codes[0, 1] = 3
    w = pack_fragments(codes, 2, "keys")
    assert w[0].item() == 3 << 16 and int((w != 0).sum()) == 1
