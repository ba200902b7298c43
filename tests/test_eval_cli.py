"""`trtllm-kivi eval --json` end to end on a tiny random checkpoint and a short text (real loader, tokenizer,
runners, caches, plot): the JSON has every configuration with consistent numbers, the files are written, and bad
arguments fail with a one-line error naming the value."""

from __future__ import annotations

import json
import os

import pytest

from trtllm_kivi.cli import main
from trtllm_kivi.models.tiny import FAN_IN_INIT, write_tiny_checkpoint

# This file's checkpoint: 2 query heads / 1 KV head, 4096 positions, no BOS/EOS ids (so no BOS is added), unit
# norms and N(0, 1/fan_in) matrices (embedding x3).
TINY = dict(init=FAN_IN_INIT, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            bos_token_id=None, eos_token_id=None)

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
        "lour'd upon our house in the deep bosom of the ocean buried. ") * 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalcli")
    (d / "text.txt").write_text(TEXT)
    return write_tiny_checkpoint(d / "tiny", **TINY), d / "text.txt"


def test_eval_json(ckpt, tmp_path, capsys):
    model, text = ckpt
    rc = main(["eval", "--model", str(model), "--text", str(text), "--kv", "fp16,kivi2,naive2", "--segments", "2",
               "--segment-len", "200", "--prefix", "128", "--passkey-lengths", "400", "--passkey-depths", "0.5",
               "--json", "--no-progress", "--out-dir", str(tmp_path), "--name", "q"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    q = res["quality"]
    assert list(q["configs"]) == ["fp16", "kivi2", "naive2"]
    assert all(c["scored_tokens"] == 2 * (200 - 1 - 128) for c in q["configs"].values())
    assert q["configs"]["fp16"]["ppl_delta_vs_ref"] == 0 and "kl_mean" not in q["configs"]["fp16"]
    for name in ("kivi2", "naive2"):
        c = q["configs"][name]
        assert c["kl_mean"] >= 0 and 0 <= c["top1_agreement"] <= 1 and c["kivi"]["k_bits"] == 2
    assert q["configs"]["naive2"]["kivi"]["key_grouping"] == "per_token"
    pk = res["passkey"]
    assert {c["length"] for c in pk["results"]["fp16"]} == {400} and set(pk["results"]) == {"fp16", "kivi2", "naive2"}
    assert (tmp_path / "q.json").is_file() and (tmp_path / "q.md").read_text().count("| kivi2 |") >= 1
    assert (tmp_path / "q_error_growth.png").read_bytes()[:4] == b"\x89PNG"
    # provenance without the paths of this machine: files outside the repository by name, the machine as it is
    assert res["model"]["source"] == model.name and res["corpus"]["file"] == text.name
    assert res["machine"]["cores"] == os.cpu_count() and res["machine"]["git_commit"]


@pytest.mark.parametrize("argv, match", [
    (["--kv", "fp16,kivi3"], "k_bits=3 is not supported"),
    (["--kv", "kivi2"], "--reference 'fp16' must be one of"),
    (["--tasks", "ppl,mmlu"], "unknown \\['mmlu'\\]"),
    (["--prefix", "500", "--segment-len", "200", "--tasks", "ppl"], "prefix=500 must be in"),
])
def test_eval_bad_arguments(ckpt, capsys, argv, match):
    model, text = ckpt
    assert main(["eval", "--model", str(model), "--text", str(text), "--no-progress", *argv]) == 2
    import re
    assert re.search(match, capsys.readouterr().err)
