"""`trtllm-kivi memory` (trtllm_kivi/memory.py, commands/memory.py) through the real CLI entry point.

Oracles: the source material's figures (Llama-2-70B: 327,680 B/token, 10.7 GB at 32K, 43 GB at 128K; 64 layers x
4 KV heads x 128 at 64K: 8.59 GB FP16, 1.07 GB at pure 2 bits) and hand arithmetic in the comments.
"""

from __future__ import annotations

import json
import re

import pytest

from trtllm_kivi import cli
from trtllm_kivi.format import Geometry, KiviConfig, kivi_total_bytes


def run_json(capsys, *args) -> dict:
    assert cli.main(["memory", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama2_70b_readable(capsys):
    assert cli.main(["memory", "--preset", "llama-2-70b", "--seq-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "327,680" in out  # FP16 bytes per token: 2 * 80 * 8 * 128 * 2
    assert "10.74 GB" in out  # 32,768 * 327,680 = 10,737,418,240 B (the source's "10.7 GB")
    assert "80 layers, 64 heads, 8 KV heads, head_dim 128" in out
    for label in ("FP16", "FP8", "KIVI-2 pure bits", "KIVI-2 codes + scales/zeros", "KIVI-2 total"):
        assert label in out


def test_llama2_70b_json(capsys):
    r = run_json(capsys, "--preset", "llama-2-70b", "--seq-len", "32768")
    rows = r["rows"]
    assert rows["fp16"]["bytes_per_token"] == 327_680
    assert rows["fp16"]["total_bytes"] == 10_737_418_240
    assert round(rows["fp16"]["total_bytes"] / 1e9, 1) == 10.7
    assert rows["fp8"]["total_bytes"] == 10_737_418_240 // 2
    assert rows["kivi_pure_bits"]["bytes_per_token"] == 327_680 / 8  # 2 bits instead of 16
    assert rows["kivi_store"]["bytes_per_token"] == 80 * 768  # codes 512 + scales/zeros 256 per layer (3 bits)
    # The honest total is format.kivi_total_bytes (hand-checked in test_format: 2,057,502,720).
    assert rows["kivi_total"]["total_bytes"] == 2_057_502_720
    assert rows["kivi_total"]["ratio_vs_fp16"] == pytest.approx(10_737_418_240 / 2_057_502_720)
    assert r["kivi"] == KiviConfig().to_dict() and r["geometry"]["num_layers"] == 80


def test_llama2_70b_128k(capsys):
    r = run_json(capsys, "--preset", "llama-2-70b", "--seq-len", "131072")
    assert r["rows"]["fp16"]["total_bytes"] == 42_949_672_960
    assert round(r["rows"]["fp16"]["total_bytes"] / 1e9) == 43
    assert cli.main(["memory", "--preset", "llama-2-70b", "--seq-len", "131072"]) == 0
    assert "42.95 GB" in capsys.readouterr().out


def test_exercise_64_layers_4_kv_heads(capsys):
    args = ["--layers", "64", "--kv-heads", "4", "--head-dim", "128", "--seq-len", "65536"]
    r = run_json(capsys, *args)
    assert r["rows"]["fp16"]["total_bytes"] == 8_589_934_592  # 2 * 64 * 4 * 128 * 2 * 65,536: 8.59 GB
    # Pure 2 bits is 1/8 of FP16: 1.07 GB. (The source's exercise answer, 2.15 GB, is the 4-bit figure.)
    assert r["rows"]["kivi_pure_bits"]["total_bytes"] == 1_073_741_824
    r4 = run_json(capsys, *args, "--k-bits", "4", "--v-bits", "4")
    assert r4["rows"]["kivi_pure_bits"]["total_bytes"] == 2_147_483_648
    assert cli.main(["memory", *args]) == 0
    out = capsys.readouterr().out
    assert "8.59 GB" in out and "1.07 GB" in out and "2.15 GB" not in out


def test_default_is_smollm2(capsys):
    assert cli.main(["memory"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "30 layers, 9 heads, 3 KV heads, head_dim 64" in out
    assert "8,192 tokens" in out
    r = run_json(capsys)
    assert r["seq_len"] == 8192 and r["rows"]["fp16"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2


@pytest.mark.parametrize("preset, geom", [
    ("llama-2-7b", (32, 32, 32, 128)), ("llama-3-8b", (32, 32, 8, 128)), ("llama-3-70b", (80, 64, 8, 128)),
    ("smollm2-135m", (30, 9, 3, 64))])
def test_presets(capsys, preset, geom):
    r = run_json(capsys, "--preset", preset, "--seq-len", "1000", "--batch", "3")
    g = r["geometry"]
    assert (g["num_layers"], g["num_heads"], g["num_kv_heads"], g["head_dim"]) == geom
    L, _, hkv, d = geom
    assert r["rows"]["fp16"]["total_bytes"] == 2 * L * hkv * d * 2 * 1000 * 3
    assert r["rows"]["kivi_total"]["total_bytes"] == kivi_total_bytes(KiviConfig(), Geometry(*geom), 1000, 3)


def test_hf_config(tmp_path, capsys):
    # Llama-3-8B's config.json keys; head_dim derived as hidden_size / heads = 4096 / 32 = 128.
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = run_json(capsys, "--config", str(p), "--seq-len", "8192")
    assert r["rows"]["fp16"]["bytes_per_token"] == 131_072  # 2 * 32 * 8 * 128 * 2
    p.write_text(json.dumps({"num_hidden_layers": 2}))
    assert cli.main(["memory", "--config", str(p)]) == 2
    assert "num_attention_heads" in capsys.readouterr().err


def test_kivi_knobs(capsys):
    r = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "4096", "--k-bits", "4", "--v-bits", "2",
                 "--group-size", "64", "--residual-length", "32", "--block-size", "256", "--scale-dtype", "float32")
    assert r["kivi"] == KiviConfig(4, 2, 64, 32, 256, "float32").to_dict()
    # per layer: codes 8*128*6/8 = 768, K meta 8*128/64*2*4 = 128, V meta 8*(128/64)*2*4 = 128 -> 1024; 32 layers.
    assert r["rows"]["kivi_store"]["bytes_per_token"] == 32 * 1024


@pytest.mark.parametrize("args, match", [
    (["--k-bits", "3"], r"k_bits=3 is not supported; allowed: 2, 4, 8"),
    (["--group-size", "48"], r"group_size=48 is not supported; allowed: 32, 64, 128"),
    (["--block-size", "48"], r"block_size=48 must be a positive multiple of group_size=32"),
    (["--scale-dtype", "int8"], r"scale_dtype='int8' is not supported"),
    (["--kv", "fp16"], r"--kv 'fp16': the calculator \(it compares FP16 and FP8 with a KIVI cache\) needs a KIVI"),
    (["--preset", "llama-2-7b", "--layers", "2"], r"give one of --preset, --config or --layers"),
    (["--layers", "2", "--kv-heads", "2"], r"explicit geometry needs --layers, --kv-heads and --head-dim"),
    (["--layers", "2", "--kv-heads", "2", "--head-dim", "80"], r"head_dim=80 must be a positive multiple of 32"),
    (["--seq-len", "0"], r"seq_len=0 and batch=1 must be >= 1"),
    (["--config", "/nonexistent/config.json"], r"No such file"),
])
def test_bad_input_is_one_clear_line(capsys, args, match):
    assert cli.main(["memory", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trtllm-kivi memory: error: ") and re.search(match, err), err
