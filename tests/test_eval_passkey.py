"""Passkey prompt construction, checked against the real SmolLM2-style byte-level tokenizer of the tiny test
checkpoint (the oracle: decoding the built token lists gives back the intended text, needle at the intended place)."""

from __future__ import annotations

import random

import pytest

from trtllm_kivi.eval.passkey import FILLER, INTRO, NEEDLE, QUESTION, build_prompt, make_key
from trtllm_kivi.models.tiny import FAN_IN_INIT, write_tiny_checkpoint
from trtllm_kivi.models import Tokenizer

# This file's checkpoint: 2 query heads / 1 KV head, 4096 positions, no BOS/EOS ids (so no BOS is added), unit
# norms and N(0, 1/fan_in) matrices (embedding x3).
TINY = dict(init=FAN_IN_INIT, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), **TINY)
    return Tokenizer.from_hf_folder(folder)


def enc(tok):
    return lambda s: tok.encode(s, add_special_tokens=False)


@pytest.mark.parametrize("n_tokens", [400, 1000, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_structure(tok, n_tokens, depth):
    p = build_prompt(enc(tok), n_tokens, depth, "71432")
    unit = len(enc(tok)(FILLER))
    assert abs(p.num_tokens - n_tokens) <= unit // 2 + 1
    text = tok.decode(p.context)
    needle = NEEDLE.format(key="71432")
    assert text.startswith(INTRO) and text.count(needle) == 1
    assert tok.decode(p.context[p.needle_start:p.needle_start + len(enc(tok)(needle))]) == needle
    before, after = text.split(needle)
    n_before, n_after = before[len(INTRO):].count(FILLER), after.count(FILLER)
    assert before == INTRO + FILLER * n_before and after == FILLER * n_after  # nothing else in the haystack
    assert n_before == round(depth * (n_before + n_after))
    assert tok.decode(p.question) == QUESTION and tok.decode(p.answer) == " 71432"


def test_keys_are_five_digits_and_seeded():
    a = [make_key(random.Random(3)) for _ in range(3)]
    assert all(len(k) == 5 and k.isdigit() for k in a) and a == [make_key(random.Random(3)) for _ in range(3)]


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="depth=1.5 must be in"):
        build_prompt(enc(tok), 1000, 1.5, "71432")
    with pytest.raises(ValueError, match="must be 5 digits"):
        build_prompt(enc(tok), 1000, 0.5, "7143")
    with pytest.raises(ValueError, match="too short"):
        build_prompt(enc(tok), 50, 0.5, "71432")


def test_run_passkey_matches_one_shot_scoring(tmp_path):
    """run_passkey (chunked prefill, question chunk, teacher-forced answer) on an unquantized fp32 cache must give
    the ranks and log-probs of one full-sequence forward over context + question + answer (the oracle: chunking
    cannot matter without quantization; atol for matmul-shape rounding)."""
    import torch

    from trtllm_kivi.cache import FullCache
    from trtllm_kivi.eval.metrics import token_rank
    from trtllm_kivi.eval.passkey import run_passkey
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    model, tk, _ = load_model(write_tiny_checkpoint(tmp_path / "m", **TINY))
    p = build_prompt(enc(tk), 600, 0.3, "52817")
    runner = lambda: TorchRunner(model, FullCache(model.cfg.geometry, 1, 1024, torch.float32))  # noqa: E731
    res = run_passkey(runner(), p, prefill_chunk=128)
    r = runner()
    seq = p.context + p.question + p.answer
    logits = r.step([r.add_sequence()], [seq], all_logits=True)
    start = len(p.context) + len(p.question) - 1  # logits row predicting answer[0]
    rows = logits[start:start + len(p.answer)]
    assert res.ranks == token_rank(rows, torch.tensor(p.answer)).tolist()
    want = torch.log_softmax(rows.double(), -1)[torch.arange(len(p.answer)), p.answer]
    assert torch.allclose(torch.tensor(res.logprobs, dtype=torch.float64), want, atol=1e-4)
    assert res.passed == all(x == 0 for x in res.ranks)
