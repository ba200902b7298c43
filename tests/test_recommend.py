"""Recipe search (eval/recommend.py) on a synthetic model built so that the choice can fail.

The model: the tiny random Llama (2 layers, head_dim 32) whose layer 0 has two large key channels (a RoPE pair of
k_proj rows scaled x60: large and time-varying, as in the model family where global rotation made 2-bit KIVI 5x
worse; docs/recipes.md) and whose queries ignore them (so per-channel grouping isolates them harmlessly, while the rotation spreads them into
every channel the queries read), and whose layer 1 has a large value channel (a v_proj row x100: per-token value groups
suffer, and rotation spreads it). Oracles: the decode-mode eval of the same model (KL vs the unquantized cache,
paired bootstrap CIs over segments): global rotation must measurably hurt, the per-layer choice must not.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from trtllm_kivi.eval.quality import QualitySetup
from trtllm_kivi.eval.recipes import ResultCache, recipe_table, score_segments
from trtllm_kivi.eval.recommend import layer_errors
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models.tiny import tiny_model
from trtllm_kivi.runtime.kvspec import KVSpec, parse_kv

BASE = KiviConfig(residual_length=32)  # 2-bit KIVI, G = 32; R = 32 so short segments quantize most tokens


def outlier_model():
    model, mc = tiny_model(seed=3, max_position_embeddings=2048)
    h, hkv, d = mc.n_heads, mc.n_kv_heads, mc.head_dim
    w0, w1 = model.layers[0].attn.wqkv.data, model.layers[1].attn.wqkv.data  # rows: q | k | v
    for kv in range(hkv):
        for c in (3, 3 + d // 2):  # a RoPE pair: the channel rotates with the position, so it varies over time
            w0[h * d + kv * d + c] *= 60.0
        w1[(h + hkv) * d + kv * d + 5] *= 100.0
    for head in range(h):  # the queries ignore those channels: per-channel keys isolate them harmlessly
        for c in (3, 3 + d // 2):
            w0[head * d + c] = 0.0
    return model, mc


@pytest.fixture(scope="module")
def synthetic():
    torch.manual_seed(0)
    model, mc = outlier_model()
    return model, mc, torch.randint(0, 256, (600,)).tolist()


def test_criterion_keeps_rotation_off_in_the_outlier_layer(synthetic):
    model, _, calib = synthetic
    e = layer_errors(model, calib, BASE)
    assert e.k_rot[0] > 10 * e.k_plain[0]  # rotating layer 0's keys spreads the outlier channels: harm
    assert e.v_rot[1] < 0.85 * e.v_plain[1]  # rotating layer 1's values spreads its outlier channel: help
    k_rot, v_rot = e.choose(0.1)
    assert k_rot[0] == "none" and v_rot[1] == "hadamard"


def test_per_layer_choice_avoids_the_harm_that_global_rotation_does(synthetic, tmp_path):
    model, mc, calib = synthetic
    k_rot, v_rot = layer_errors(model, calib, BASE).choose(0.1)
    specs = {"fp16": parse_kv("fp16"), "plain": KVSpec("plain", BASE),
             "global": KVSpec("global", replace(BASE, k_rotation="hadamard", v_rotation="hadamard")),
             "chosen": KVSpec("chosen", replace(BASE, k_rotation=k_rot, v_rotation=v_rot))}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (4 * 400,), generator=gen).tolist()
    setup = QualitySetup(4, 400, 32, 32, 0, 1)
    segs = score_segments(model, specs, ids, setup, ResultCache(tmp_path / "c.jsonl", {}), "fp16",
                          log=lambda _m: None)
    t = recipe_table(specs, segs, mc.geometry, "fp16", setup, None, 500)["configs"]
    kl = {n: t[n]["segment_kl"] for n in ("plain", "global", "chosen")}
    # Paired by segment (the segments differ much more than the configurations do on one segment):
    # global rotation hurts in every segment
    assert all(g > 2 * p for g, p in zip(kl["global"], kl["plain"], strict=True))
    assert t["global"]["kl_ci95"][0] > t["plain"]["kl_ci95"][1]  # ... outside the noise
    assert all(c <= p for c, p in zip(kl["chosen"], kl["plain"], strict=True))  # the per-layer choice never does
    assert t["chosen"]["kl_mean"] < t["plain"]["kl_mean"]  # and its rotation (layer 1's V) helps


def test_recommend_cli_writes_a_config_that_run_accepts(synthetic, tmp_path):
    """`eval --recommend` end to end on a checkpoint of the synthetic model: the config keeps layer 0's K
    unrotated, was measured within the budget and is accepted by --kv-config (and a conflicting --kv refused)."""
    from safetensors.torch import load_file, save_file

    from trtllm_kivi.cli import main
    from trtllm_kivi.models.tiny import write_tiny_checkpoint
    from trtllm_kivi.runtime.kvspec import read_kv_config

    folder = write_tiny_checkpoint(tmp_path / "ckpt", seed=3, max_position_embeddings=2048)
    sd = load_file(str(folder / "model.safetensors"))
    model, mc = outlier_model()
    h, hkv, d = mc.n_heads, mc.n_kv_heads, mc.head_dim
    sd["model.layers.0.self_attn.k_proj.weight"] = model.layers[0].attn.wqkv.data[h * d:(h + hkv) * d].clone()
    sd["model.layers.1.self_attn.v_proj.weight"] = model.layers[1].attn.wqkv.data[(h + hkv) * d:].clone()
    save_file(sd, str(folder / "model.safetensors"))
    text = tmp_path / "text.txt"
    text.write_text("".join(chr(32 + (i * 7919) % 90) for i in range(3000)))
    cfg_path = tmp_path / "kv.json"
    rc = main(["eval", "--recommend", "--model", str(folder), "--text", str(text), "--segments", "2",
               "--segment-len", "320", "--prefix", "32", "--residual-length", "32", "--levels", "kivi2",
               "--max-ppl-increase", "1000%", "--out-dir", str(tmp_path / "out"), "--write-config", str(cfg_path),
               "--bootstrap", "100"])
    assert rc == 0
    doc = json.loads(cfg_path.read_text())
    assert doc["measured"]["ppl_delta_pct"] <= 1000
    crit = doc["criterion"]["kivi2"]
    assert crit["k_rot"][0] > crit["k_plain"][0]
    spec = read_kv_config(cfg_path)
    assert spec.kivi.k_rotation_of(0) == "none" and spec.kivi.residual_length == 32
    import argparse

    from trtllm_kivi.commands.flags import add_kv, kv_spec
    p = argparse.ArgumentParser()
    add_kv(p)
    assert kv_spec(p.parse_args(["--kv-config", str(cfg_path)])).kivi == spec.kivi
    with pytest.raises(ValueError, match=r"--kv 'kivi4' \(.*\) contradicts --kv-config .* \(kv "):
        kv_spec(p.parse_args(["--kv-config", str(cfg_path), "--kv", "kivi4"]))
    with pytest.raises(ValueError, match=r"--residual-length 64 contradicts --kv-config .* \(residual_length=32\); "
                       r"give one of them"):
        kv_spec(p.parse_args(["--kv-config", str(cfg_path), "--residual-length", "64"]))
