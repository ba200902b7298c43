"""The storage format (trtllm_kivi/format.py): validation, defaults, n_q, layouts, byte counts, the C header.

Oracles: docs/design.md's contract text (defaults, n_q), numbers computed by hand in the comments, the checked-in header
file, and g++ evaluating the header's constexpr functions.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_kivi import format as fmt
from trtllm_kivi.format import Geometry, KiviConfig

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "plugins" / "include" / "kiviFormat.h"


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, match", [
    (dict(k_bits=3), r"k_bits=3 is not supported; allowed: 2, 4, 8"),
    (dict(v_bits=1), r"v_bits=1 is not supported; allowed: 2, 4, 8"),
    (dict(k_bits=2.0), r"k_bits=2\.0 is not supported; allowed: 2, 4, 8"),  # a float would break // layouts
    (dict(v_bits=True), r"v_bits=True is not supported; allowed: 2, 4, 8"),
    (dict(group_size=16), r"group_size=16 is not supported; allowed: 32, 64, 128"),
    (dict(group_size=48), r"group_size=48 is not supported; allowed: 32, 64, 128"),
    (dict(residual_length=-1), r"residual_length=-1 must be an integer >= 0"),
    (dict(residual_length=1.5), r"residual_length=1\.5 must be an integer >= 0"),
    (dict(block_size=48), r"block_size=48 must be a positive multiple of group_size=32"),
    (dict(block_size=0), r"block_size=0 must be a positive multiple of group_size=32"),
    (dict(group_size=64, block_size=96), r"block_size=96 must be a positive multiple of group_size=64"),
    (dict(scale_dtype="int8"), r"scale_dtype='int8' is not supported; allowed: float16, bfloat16, float32"),
    (dict(key_grouping="per_head"), r"key_grouping='per_head' is not supported; allowed: per_channel, per_token"),
    (dict(sink_tokens=-1), r"sink_tokens=-1 must be an integer in \[0, 128\]"),
    (dict(sink_tokens=129), r"sink_tokens=129 must be an integer in \[0, 128\]"),
    (dict(sink_tokens=True), r"sink_tokens=True must be an integer in \[0, 128\]"),
    (dict(k_rotation="quarot"), r"k_rotation='quarot' is not supported; allowed: none, hadamard"),
    (dict(v_rotation=("none", "givens")), r"v_rotation\[1\]='givens' is not supported; allowed: none, hadamard"),
    (dict(k_rotation=()), r"k_rotation=\(\) must name a rotation per layer"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KiviConfig(**kwargs)


def test_defaults_match_design():
    # docs/design.md "Defaults": k_bits = v_bits = 2, G = 32, R = 128, block_size = 128; fp16 scales; keys per channel.
    c = KiviConfig()
    assert (c.k_bits, c.v_bits, c.group_size, c.residual_length, c.block_size) == (2, 2, 32, 128, 128)
    assert (c.scale_dtype, c.key_grouping) == ("float16", "per_channel")
    assert c.window_capacity == 128 + 32 - 1
    assert (fmt.WORD_BITS, fmt.WORD_DTYPE, fmt.BIT_ORDER, fmt.ROUNDING) == (32, "int32", "lsb_first", "half_to_even")


def test_config_dict_round_trip_and_unknown_field():
    c = KiviConfig(k_bits=4, v_bits=8, group_size=64, residual_length=0, block_size=256, scale_dtype="bfloat16",
                   key_grouping="per_token")
    assert KiviConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"unknown KiviConfig fields \['bits'\]"):
        KiviConfig.from_dict({"bits": 2})


@pytest.mark.parametrize("head_dim, group_size, match", [
    (80, 32, r"head_dim=80 must be a positive multiple of 32"),
    (0, 32, r"head_dim=0 must be a positive multiple of 32"),
    (96, 64, r"head_dim=96 must be a multiple of group_size=64"),  # value groups of 64 cannot tile 96 channels
    (160, 128, r"head_dim=160 must be a multiple of group_size=128"),
])
def test_check_head_dim(head_dim, group_size, match):
    cfg = KiviConfig(group_size=group_size, block_size=128)
    with pytest.raises(ValueError, match=match):
        cfg.check_head_dim(head_dim)
    with pytest.raises(ValueError, match=match):
        fmt.buffer_shapes(cfg, 2, head_dim, 1, 1)


def test_head_dims_accepted():
    for g in fmt.SUPPORTED_GROUP_SIZES:
        for d in (32, 64, 96, 128, 256):
            if d % min(g, d) == 0:
                KiviConfig(group_size=g, block_size=128).check_head_dim(d)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_layers=0, num_heads=8, num_kv_heads=8, head_dim=64), r"num_layers=0 must be a positive integer"),
    (dict(num_layers=2, num_heads=9, num_kv_heads=2, head_dim=64),
     r"num_heads=9 must be a multiple of num_kv_heads=2"),
])
def test_geometry_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Geometry(**kwargs)


# ---------------------------------------------------------------------------------------------- n_q


@pytest.mark.parametrize("seq_len, expected", [
    (0, 0), (127, 0), (128, 0), (159, 0), (160, 32), (191, 32), (192, 64), (1000, 864)])
def test_num_quantized_by_hand(seq_len, expected):
    # R = 128, G = 32: n_q = max(0, floor((T - 128) / 32)) * 32; e.g. (1000 - 128) // 32 = 27 -> 864.
    assert KiviConfig().num_quantized(seq_len) == expected


@settings(max_examples=200, deadline=None)
@given(t=st.integers(0, 5000), r=st.integers(0, 300), g=st.sampled_from(fmt.SUPPORTED_GROUP_SIZES))
def test_num_quantized_formula(t, r, g):
    cfg = KiviConfig(group_size=g, residual_length=r, block_size=128)
    n_q = cfg.num_quantized(t)
    assert n_q == max(0, (t - r) // g) * g  # docs/design.md's formula (Python's // is floor division)
    assert n_q % g == 0
    if t >= r:  # the window holds between R and R + G - 1 tokens once T >= R
        assert r <= t - n_q <= cfg.window_capacity
    else:
        assert n_q == 0


@settings(max_examples=200, deadline=None)
@given(t=st.integers(0, 3000), r=st.integers(0, 300), g=st.sampled_from(fmt.SUPPORTED_GROUP_SIZES),
       s=st.integers(0, fmt.MAX_SINK_TOKENS))
def test_num_quantized_with_sinks(t, r, g, s):
    # format.py: sinks never enter a group; groups start at S: n_q(T) = max(0, floor((T - S - R) / G)) * G.
    cfg = KiviConfig(group_size=g, residual_length=r, block_size=128, sink_tokens=s)
    n_q = cfg.num_quantized(t)
    assert n_q == max(0, (t - s - r) // g) * g
    ring = t - min(s, t) - n_q  # tokens held in the ring after the sinks and the store
    assert 0 <= ring <= cfg.window_capacity and (t < s + r or ring >= r)
    rows = [cfg.window_row(x) for x in range(min(s, t))] + [cfg.window_row(x) for x in range(s + n_q, t)]
    assert len(set(rows)) == len(rows) and all(0 <= x < cfg.window_rows for x in rows)  # live rows never collide
    assert cfg.window_rows == s + r + g - 1
    if n_q:
        assert cfg.flush_point(n_q // g) <= t < cfg.flush_point(n_q // g + 1)


def test_sinks_by_hand():
    # S = 4, R = 128, G = 32: the first group [4, 36) is quantized at T = 4 + 128 + 32 = 164.
    c = KiviConfig(sink_tokens=4)
    assert [c.num_quantized(t) for t in (0, 4, 163, 164, 195, 196)] == [0, 0, 0, 32, 32, 64]
    assert (c.window_row(3), c.window_row(4), c.window_row(4 + 159), c.window_rows) == (3, 4, 4, 163)
    assert fmt.buffer_shapes(c, 3, 64, 1, 2)["k_window"] == (2, 3, 163, 64)


def test_rotation_fields():
    c = KiviConfig(k_rotation=["none", "hadamard", "none"], v_rotation="hadamard")  # a JSON list -> a tuple
    assert c.k_rotation == ("none", "hadamard", "none") and c.rotated
    assert [c.k_rotation_of(i) for i in range(3)] == ["none", "hadamard", "none"]
    assert c.for_layer(1).k_rotation == "hadamard" and c.for_layer(0).v_rotation == "hadamard"
    assert KiviConfig(k_rotation=("hadamard", "hadamard")).k_rotation == "hadamard"  # one spelling when uniform
    assert not KiviConfig().rotated  # never on by default (docs/design.md)
    assert KiviConfig.from_dict(c.to_dict()) == c
    c.check_num_layers(3)
    with pytest.raises(ValueError, match=r"k_rotation names 3 layers but the model has num_layers=30"):
        c.check_num_layers(30)
    with pytest.raises(ValueError, match=r"head_dim=96 has no Sylvester Hadamard matrix"):
        KiviConfig(k_rotation="hadamard").check_head_dim(96)
    KiviConfig().check_head_dim(96)  # unrotated: any multiple of 32


def test_sink_bytes_are_counted():
    # The window buffer of each slot holds S sink rows before the ring of R + G - 1 (fp16, K and V).
    g = Geometry(30, 9, 3, 64)
    plain, sinks = KiviConfig(), KiviConfig(sink_tokens=4)
    assert fmt.window_bytes(sinks, 3, 64) - fmt.window_bytes(plain, 3, 64) == 2 * 4 * 3 * 64 * 2
    # T = 8192: n_q = (8192 - 4 - 128) // 32 * 32 = 8032 -> 63 blocks of 128 tokens x 144 bytes (3 heads x 64:
    # 96 code bytes + 24 K + 24 V scale/zero bytes); window 2 x 163 rows x 3 x 64 x 2 bytes = 125184; x 30 layers.
    assert sinks.num_quantized(8192) == 8032 == plain.num_quantized(8192) - 32
    assert fmt.kivi_total_bytes(sinks, g, 8192) == 30 * (63 * 128 * 144 + 125184)


# ---------------------------------------------------------------------------------------------- layouts


def test_buffer_shapes_by_hand():
    # Defaults (2 bits: 16 codes per int32 word), Hkv=8, D=128, 10 blocks, 4 slots, W = 128 + 32 - 1 = 159.
    s = fmt.buffer_shapes(KiviConfig(), 8, 128, num_blocks=10, num_slots=4)
    assert list(s) == list(fmt.BUFFER_NAMES)
    assert s["k_codes"] == (10, 8, 128 // 16, 128)
    assert s["k_scale"] == s["k_zero"] == (10, 8, 128 // 32, 128)
    assert s["v_codes"] == (10, 8, 128, 128 // 16)
    assert s["v_scale"] == s["v_zero"] == (10, 8, 128, 128 // 32)
    assert s["k_window"] == s["v_window"] == (4, 8, 159, 128)
    # 4-bit keys, 8-bit values, G=64, block 256, D=64 (Gv = min(64, 64) = 64: one value group per token).
    s = fmt.buffer_shapes(KiviConfig(k_bits=4, v_bits=8, group_size=64, block_size=256, residual_length=0), 2, 64,
                          3, 1)
    assert s["k_codes"] == (3, 2, 256 // 8, 64) and s["k_scale"] == (3, 2, 256 // 64, 64)
    assert s["v_codes"] == (3, 2, 256, 64 // 4) and s["v_scale"] == (3, 2, 256, 1)
    assert s["k_window"] == (1, 2, 63, 64)
    # Per-token keys (naive control) are laid out like values.
    s = fmt.buffer_shapes(KiviConfig(key_grouping="per_token"), 2, 128, 1, 1)
    assert s["k_codes"] == (1, 2, 128, 8) and s["k_scale"] == s["k_zero"] == (1, 2, 128, 4)


def test_buffer_dtypes():
    d = fmt.buffer_dtypes(KiviConfig(scale_dtype="bfloat16"), "float16")
    assert d == {"k_codes": "int32", "k_scale": "bfloat16", "k_zero": "bfloat16", "v_codes": "int32",
                 "v_scale": "bfloat16", "v_zero": "bfloat16", "k_window": "float16", "v_window": "float16"}
    with pytest.raises(ValueError, match=r"act_dtype='int8' is not supported"):
        fmt.buffer_dtypes(KiviConfig(), "int8")


def test_codes_per_word():
    assert [fmt.codes_per_word(b) for b in (2, 4, 8)] == [16, 8, 4]
    with pytest.raises(ValueError, match=r"bits=3 is not supported; allowed: 2, 4, 8"):
        fmt.codes_per_word(3)


# ---------------------------------------------------------------------------------------------- byte counts


def test_byte_formulas_by_hand():
    cfg = KiviConfig()
    # Hkv=8, D=128, 2+2 bits: codes 8*128*4/8 = 512 B; K scale+zero fp16 per channel per 32 tokens: 8*128/32*2*2
    # = 128 B; V scale+zero per 32 channels: 8*(128/32)*2*2 = 128 B -> 768 B per token per layer (3 bits/element).
    assert fmt.pure_bits_bytes_per_token(cfg, 8, 128) == 512
    assert fmt.quantized_bytes_per_token(cfg, 8, 128) == 768
    # fp32 scales double the metadata: 512 + 2 * 256 = 1024; G=128 (Gv=128): 512 + 8*128/128*2*2*2 = 576.
    assert fmt.quantized_bytes_per_token(KiviConfig(scale_dtype="float32"), 8, 128) == 1024
    assert fmt.quantized_bytes_per_token(KiviConfig(group_size=128), 8, 128) == 576
    # Per-token keys: K metadata per Gv channels like V: same total at D=128, G=32.
    assert fmt.quantized_bytes_per_token(KiviConfig(key_grouping="per_token"), 8, 128) == 768
    # Window: 2 (K,V) * 159 tokens * 8 heads * 128 * 2 bytes = 651,264.
    assert fmt.window_bytes(cfg, 8, 128) == 651_264
    llama70 = Geometry(80, 64, 8, 128)
    assert fmt.dense_bytes_per_token(llama70, 2) == 327_680  # 2 * 80 * 8 * 128 * 2
    assert fmt.dense_bytes_per_token(llama70, 1) == 163_840
    # 32,768 tokens: n_q = (32768 - 128) // 32 * 32 = 32,640 -> 255 blocks of 128 tokens of 768 * 128 = 98,304 B,
    # plus the window: (255 * 98,304 + 651,264) * 80 layers = 2,057,502,720.
    assert fmt.kivi_total_bytes(cfg, llama70, 32768) == 2_057_502_720
    assert fmt.kivi_total_bytes(cfg, llama70, 32768, batch=3) == 3 * 2_057_502_720
    # Short sequence: nothing quantized yet, only the window (allocated whole): 80 * 651,264.
    assert fmt.kivi_total_bytes(cfg, llama70, 100) == 80 * 651_264
    # n_q = 32 tokens still occupies one whole block: (98,304 + 651,264) * 80.
    assert fmt.kivi_total_bytes(cfg, llama70, 160) == (98_304 + 651_264) * 80


# ---------------------------------------------------------------------------------------------- C header


def test_header_matches_format_py():
    """THE header test: the checked-in header must be exactly what format.py generates today."""
    generated = fmt.c_header().encode()
    on_disk = HEADER.read_bytes()
    assert on_disk == generated, ("plugins/include/kiviFormat.h is stale: regenerate it with "
                                  "`python -m trtllm_kivi.format --header > plugins/include/kiviFormat.h`")


def test_header_cli_prints_the_header(capsys):
    assert fmt.main(["--header"]) == 0
    assert capsys.readouterr().out == fmt.c_header()


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_header_compiles_and_agrees_with_python(tmp_path):
    """g++ evaluates the header's constexpr functions; static_asserts compare them with format.py."""
    checks = [f"static_assert(kFORMAT_VERSION == {fmt.FORMAT_VERSION});"]
    for g in fmt.SUPPORTED_GROUP_SIZES:
        for r in (0, 1, 32, 128, 200):
            cfg = KiviConfig(group_size=g, residual_length=r, block_size=128)
            checks.append(f"static_assert(windowCapacity({r}, {g}) == {cfg.window_capacity});")
            for t in (0, 1, r, r + g - 1, r + g, r + 5 * g + 7, 100_000):
                checks.append(f"static_assert(numQuantized({t}, {r}, {g}) == {cfg.num_quantized(t)});")
                for sk in (1, 4, 128):
                    cs = KiviConfig(group_size=g, residual_length=r, block_size=128, sink_tokens=sk)
                    checks.append(f"static_assert(numQuantized({t}, {sk}, {r}, {g}) == {cs.num_quantized(t)});")
                    checks.append(f"static_assert(windowRow({t}, {sk}, {r}, {g}) == {cs.window_row(t)});")
                    checks.append(f"static_assert(windowRows({sk}, {r}, {g}) == {cs.window_rows});")
        for d in fmt.SUPPORTED_HEAD_DIMS:
            gv = KiviConfig(group_size=g, block_size=128).value_group_size(d)
            checks.append(f"static_assert(valueGroupSize({g}, {d}) == {gv});")
    for b in fmt.SUPPORTED_BITS:
        checks.append(f"static_assert(codesPerWord({b}) == {fmt.codes_per_word(b)});")
    for i, n in enumerate(fmt.BUFFER_NAMES):
        checks.append(f"static_assert(kBUFFER_{n.upper()} == {i});")

    src = tmp_path / "check.cpp"
    src.write_text('#include "kiviFormat.h"\nusing namespace trtllm_kivi;\n' + "\n".join(checks) +
                   "\nint main() { return 0; }\n")
    res = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{HEADER.parent}", str(src)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
