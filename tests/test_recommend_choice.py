"""The recipe search's final choice and scale dtype (eval/recommend.py: choose, scale_dtype_for): among candidates
within the budget it must not trade half the KL for 0.01 bit (a small GQA model once got k4v2 at 4.25 bits/element
and KL 0.023 over k4v2+sink4+had at 4.26 and KL 0.011), it says why, and it never measures with fp16 scales that
the calibration's K/V would overflow."""

from __future__ import annotations

import pytest

from trtllm_kivi.eval.recommend import LayerErrors, choose, scale_dtype_for


def _e(kl: float, dppl: float) -> dict:
    return {"kl_mean": kl, "ppl_delta_pct": dppl}


def test_quality_wins_within_the_bit_tolerance_and_says_why():
    bits = {"k4v2": 4.25, "k4v2+sink4": 4.255, "k4v2+sink4+had": 4.26}
    entries = {"k4v2": _e(0.023, 3.0), "k4v2+sink4": _e(0.015, 2.0), "k4v2+sink4+had": _e(0.011, 1.0)}
    name, why = choose(list(bits), bits, entries, bit_tolerance=0.05)
    assert name == "k4v2+sink4+had"
    assert "chosen over the cheapest admitted k4v2" in why and "0.01 more bits/element" in why
    assert "KL 0.0110" in why and "KL 0.0230" in why


def test_bits_still_win_beyond_the_tolerance():
    bits = {"kivi2+sink4": 3.27, "k4v2+sink4+had": 4.26}
    entries = {"kivi2+sink4": _e(0.045, 4.0), "k4v2+sink4+had": _e(0.011, 1.0)}
    name, why = choose(list(bits), bits, entries, bit_tolerance=0.05)
    assert name == "kivi2+sink4" and "no other within 0.05" in why
    assert choose(list(bits), bits, entries, bit_tolerance=1.0)[0] == "k4v2+sink4+had"  # a wider tolerance


def test_equal_kl_falls_back_to_dppl_then_bits():
    bits = {"a": 3.0, "b": 3.01, "c": 3.02}
    entries = {"a": _e(0.02, 2.0), "b": _e(0.02, 1.0), "c": _e(0.02, 1.0)}
    assert choose(list(bits), bits, entries, 0.05)[0] == "b"


def _errors(k: list[float], v: list[float]) -> LayerErrors:
    return LayerErrors(k_absmax=k, v_absmax=v)


def test_scale_dtype_follows_the_calibration_range():
    dtype, why = scale_dtype_for(_errors([120.0, 900.0], [3.0, 8.0]), None)
    assert dtype is None and "900" in why and "fits fp16" in why
    dtype, why = scale_dtype_for(_errors([120.0, 9.0e4], [3.0, 8.0]), None)
    assert dtype == "bfloat16" and "layer 1" in why and "9e+04" in why
    assert scale_dtype_for(_errors([120.0], [7.0e4]), "float32")[0] == "float32"
    with pytest.raises(ValueError, match=r"layer 0: calibration \|V\| reaches 7e\+04.*--scale-dtype bfloat16"):
        scale_dtype_for(_errors([120.0], [7.0e4]), "float16")
