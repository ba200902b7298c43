"""The recipe table's pieces (eval/recipes.py) and the --kv recipe grammar (runtime/kvspec.py).

Oracles: format.kivi_total_bytes worked by hand for bits/element, the bootstrap's definition on data whose answer is
known, the JSON-lines file itself for the resumable cache, KiviConfig for the grammar."""

from __future__ import annotations

import json
import math

import pytest

from trtllm_kivi.eval.quality import QualitySetup
from trtllm_kivi.eval.recipes import ResultCache, bits_per_element, bootstrap_ci, recipe_markdown, recipe_table
from trtllm_kivi.format import Geometry, KiviConfig
from trtllm_kivi.runtime.kvspec import parse_kv, recipe_name

SMOL = Geometry(30, 9, 3, 64)


def test_bits_per_element_by_hand():
    # kivi2 at T = 8192: n_q = 8064 -> 63 blocks x 128 tokens x 144 bytes (3 heads x 64: 96 code bytes + 24 + 24
    # scale/zero bytes) + window 2 x 159 rows x 3 x 64 x 2 bytes = 122112 bytes, per layer; elements 2 x 3 x 64 x T.
    want = (63 * 128 * 144 + 122112) * 8 / (2 * 3 * 64 * 8192)
    assert math.isclose(bits_per_element(KiviConfig(), SMOL, 8192), want)
    assert round(want, 2) == 3.26  # plain KIVI-2 at 8K, the figure the docs quote
    assert bits_per_element(KiviConfig(sink_tokens=4), SMOL, 8192) > want  # sink rows are counted
    assert bits_per_element(None, SMOL, 8192) == 16.0


def test_bootstrap_ci():
    assert bootstrap_ci(lambda idx: 3.0, 5) == [3.0, 3.0]
    data = [1.0, 2.0, 3.0, 4.0, 10.0]
    lo, hi = bootstrap_ci(lambda idx: sum(data[i] for i in idx) / len(idx), len(data), 4000)
    assert min(data) <= lo < sum(data) / 5 < hi <= max(data)


def test_result_cache_resumes_and_ignores_other_setups(tmp_path):
    path = tmp_path / "c.jsonl"
    a = ResultCache(path, {"segment_len": 2048})
    a.put("seg|kivi2|0", {"nll": 1.5})
    with path.open("a") as f:
        f.write('{"key": "seg|kivi2|1", "nll"')  # a torn last line (a killed run)
    b = ResultCache(path, {"segment_len": 2048})
    assert b.get("seg|kivi2|0")["nll"] == 1.5 and b.get("seg|kivi2|1") is None
    assert ResultCache(path, {"segment_len": 1024}).get("seg|kivi2|0") is None
    assert all(json.loads(x)["fingerprint"] for x in path.read_text().splitlines()[:1])


def test_recipe_table_pairs_segments_with_the_reference():
    specs = {"fp16": parse_kv("fp16"), "kivi2": parse_kv("kivi2"), "kivi4": parse_kv("kivi4")}
    row = lambda nll, kl=0.0: {"nll": nll, "kl": kl, "top1": 0.9, "tokens": 100}  # noqa: E731
    segs = {"fp16": [row(3.0), row(3.2), row(3.1)], "kivi2": [row(3.1, 0.2), row(3.3, 0.1), row(3.3, 0.3)],
            "kivi4": [row(3.01, 0.01), None, None]}  # kivi4 has one segment only
    t = recipe_table(specs, segs, SMOL, "fp16", QualitySetup(3, 2048, 128), None, 500)
    k2, k4 = t["configs"]["kivi2"], t["configs"]["kivi4"]
    assert math.isclose(k2["ppl_delta_pct"], 100 * (math.exp(3.2333333333) / math.exp(3.1) - 1), rel_tol=1e-6)
    assert math.isclose(k2["kl_mean"], 0.2) and k2["segments"] == 3
    assert k2["ppl_delta_ci95"][0] <= k2["ppl_delta_pct"] <= k2["ppl_delta_ci95"][1]
    assert k4["segments"] == 1 and k4["ppl_delta_ci95"] is None  # no CI from one segment
    assert math.isclose(k4["ppl_delta_pct"], 100 * (math.exp(0.01) - 1), rel_tol=1e-6)  # paired with segment 0
    assert "(1 segment: no CI)" in recipe_markdown(t)


def test_kv_grammar():
    assert parse_kv("kivi2").kivi == KiviConfig()  # the paper's names are unchanged: no sinks, no rotation
    assert parse_kv("naive2").kivi == KiviConfig(key_grouping="per_token")
    c = parse_kv("k4v2+sink4+had:k@0-2.5/8+g64").kivi
    assert (c.k_bits, c.v_bits, c.sink_tokens, c.group_size, c.v_rotation) == (4, 2, 4, 64, "none")
    assert c.k_rotation == ("hadamard",) * 3 + ("none", "none", "hadamard", "none", "none")
    for name in ("kivi2+sink4+had", "k4v2+had:k", "kivi2+had:v@0-3/30", "naive2+had+r64", "kivi4+g128"):
        cfg = parse_kv(name).kivi
        assert parse_kv(recipe_name(cfg)).kivi == cfg, name
    for bad, match in (("kivi2+sink4+sink8", r"sink<n> is given twice"), ("kivi2+quarot", r"option 'quarot'"),
                       ("kivi2+sink200", r"sink_tokens=200 must be an integer in \[0, 128\]"),
                       ("kivi2+had:k@5-2", r"layer range '5-2' is empty"),
                       ("kivi3+had", r"k_bits=3 is not supported")):
        with pytest.raises(ValueError, match=match):
            parse_kv(bad)
    with pytest.raises(ValueError, match=r"names 30 layers but the model has 8"):
        parse_kv("kivi2+had:k@1/30", num_layers=8)
