"""generate() over a TorchRunner with a small random Llama and a byte-level tokenizer: a batch of prompts of
different lengths gives each prompt the tokens it gets alone (oracle: the same prompt run by itself), greedy and
seeded sampling, stop tokens/strings, max_new_tokens, slot reuse, streaming; sample() against its definition."""

from __future__ import annotations

import pytest
import torch
from tokenizers import pre_tokenizers

from trtllm_kivi.cache import KiviCache
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models import LlamaModel, ModelConfig, Tokenizer
from trtllm_kivi.runtime.detokenize import Detokenizer
from trtllm_kivi.runtime.generate import Generation, SamplingParams, generate
from trtllm_kivi.runtime.sampling import sample
from trtllm_kivi.runtime.torch_runner import TorchRunner

BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
VOCAB = ["<s>", "</s>"] + BYTES  # 258 tokens: every byte is one token


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": VOCAB,
                                       "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [3, 3] + [1] * 256,
                                       "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1})


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = ModelConfig(vocab_size=len(VOCAB), dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256,
                      max_seq_len=512)
    g = torch.Generator().manual_seed(0)
    sd = {n: (torch.randn(shape, generator=g) * (0.5 if len(shape) == 1 else shape[-1] ** -0.5) +
              (1.0 if len(shape) == 1 else 0.0)) for n, shape in LlamaModel.hf_weight_shapes(cfg).items()}
    sd["model.embed_tokens.weight"] *= 4  # sharper logits: varied but decisive greedy choices
    return LlamaModel.from_hf_state_dict(cfg, sd)


def kivi_runner(model, slots, seq_len=256):
    """KIVI-2 with a short window (R = G = 32) so generations cross several flushes."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=32)
    return TorchRunner(model, KiviCache(cfg, model.cfg.geometry, slots, seq_len, torch.float32))


PROMPTS = [[5, 9, 100], list(range(20, 57)), [7] * 70, [200, 3, 4, 5, 6, 8, 11, 13]]


@pytest.mark.parametrize("kv", ["fp32", "kivi2-short-window"])
def test_batched_greedy_equals_alone(model, kv):
    make = (lambda slots: kivi_runner(model, slots)) if kv != "fp32" else \
        (lambda slots: TorchRunner.create(model, "fp32", slots, 256))
    params = SamplingParams(max_new_tokens=40)
    alone = [generate(make(1), [p], params, prefill_chunk=16)[0].tokens for p in PROMPTS]
    assert len({tuple(a) for a in alone}) == len(PROMPTS)  # the prompts really lead to different continuations
    batched = generate(make(len(PROMPTS)), PROMPTS, params, prefill_chunk=16)
    assert [r.tokens for r in batched] == alone
    waves = generate(make(2), PROMPTS, params, prefill_chunk=16)  # fewer slots than prompts: slots are reused
    assert [r.tokens for r in waves] == alone
    assert all(r.finish_reason == "length" and len(r.tokens) == 40 for r in batched)


def test_streaming_callback_and_slots_released(model):
    runner = TorchRunner.create(model, "kivi2", 3, 256)
    seen: dict[int, list[int]] = {}
    res = generate(runner, PROMPTS[:3], SamplingParams(max_new_tokens=7),
                   on_token=lambda i, t: seen.setdefault(i, []).append(t))
    assert seen == {i: r.tokens for i, r in enumerate(res)}
    assert runner.free_slots == 3

    def boom(i, t):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        generate(runner, PROMPTS[:3], SamplingParams(max_new_tokens=7), on_token=boom)
    assert runner.free_slots == 3  # an error mid-way frees every slot it took


def test_seeded_sampling(model):
    runner = TorchRunner.create(model, "fp32", 2, 256)
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    a = generate(runner, PROMPTS[:2], p)
    b = generate(TorchRunner.create(model, "fp32", 1, 256), PROMPTS[:2], p)  # one slot: prompts run one by one
    assert [r.tokens for r in a] == [r.tokens for r in b]
    c = generate(runner, PROMPTS[:2], SamplingParams(**{**p.__dict__, "seed": 124}))
    assert [r.tokens for r in a] != [r.tokens for r in c]
    greedy = generate(runner, PROMPTS[:2], SamplingParams(max_new_tokens=12))
    top1 = generate(runner, PROMPTS[:2], SamplingParams(max_new_tokens=12, temperature=0.7, top_k=1, seed=1))
    assert [r.tokens for r in greedy] == [r.tokens for r in top1]


def test_stop_token_and_string(model, tok):
    runner = TorchRunner.create(model, "fp32", 1, 256)
    free = generate(runner, [PROMPTS[1]], SamplingParams(max_new_tokens=30), tok)[0]
    assert free.text == tok.decode(free.tokens) and free.finish_reason == "length"
    stop = free.tokens[5]
    first = free.tokens.index(stop)
    r = generate(runner, [PROMPTS[1]], SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)), tok)[0]
    assert r.tokens == free.tokens[:first] and r.finish_reason == "stop"
    piece = free.text[10:13]
    cut = free.text.index(piece)
    r = generate(runner, [PROMPTS[1]], SamplingParams(max_new_tokens=30, stop_strings=(piece,)), tok)[0]
    assert r.text == free.text[:cut] and r.finish_reason == "stop"
    assert tok.decode(r.tokens).startswith(r.text + piece)  # generation stopped on the token completing it


def test_errors(model):
    runner = TorchRunner.create(model, "fp32", 1, 32)
    with pytest.raises(ValueError, match="prompt 0: the prompt is empty"):
        generate(runner, [[]])
    with pytest.raises(ValueError, match=r"prompt 1: prompt of 30 tokens \+ max_new_tokens=5 needs 34 cache "
                                         r"positions; a sequence holds at most max_seq_len=32"):
        generate(runner, [[1], [2] * 30], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        generate(runner, [[1]], SamplingParams(stop_strings=("x",)))
    for kw, match in [({"temperature": -1.0}, "temperature=-1.0 must be >= 0"), ({"top_p": 0.0}, "top_p=0.0"),
                      ({"max_new_tokens": 0}, "max_new_tokens=0"), ({"top_k": -2}, "top_k=-2")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    assert runner.free_slots == 1


def test_sample_definition():
    """Oracle: softmax(logits / T) restricted to the top-k / nucleus set."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    draw = lambda **kw: [sample(logits, SamplingParams(temperature=1.0, **kw), g) for _ in range(2000)]  # noqa
    assert set(draw(top_k=2)) == {0, 1}
    assert set(draw(top_p=0.6)) == {0, 1}  # 0.5 < 0.6 needs the second token; 0.8 covers it
    assert set(draw(top_p=0.4)) == {0}
    counts = torch.bincount(torch.tensor(draw()), minlength=4).float() / 2000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04, rtol=0)
    assert sample(logits, SamplingParams()) == 0  # temperature 0: argmax


def _pieces(detok: Detokenizer, ids: list[int]) -> list[str]:
    out = []
    for i in ids:
        detok.push(i)
        out.append(detok.delta())
    return out + [detok.delta(final=True)]


def test_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("aé😀b")  # é is 2 bytes, 😀 is 4: one token per byte here
    assert len(ids) == 8
    pieces = _pieces(Detokenizer(tok), ids)
    assert "".join(pieces) == "aé😀b"
    assert pieces == ["a", "", "é", "", "", "", "😀", "b", ""]


def test_detokenizer_holds_back_a_possible_stop_string_and_cuts_before_it(tok):
    """Streamed text never shows a prefix of a stop string that then completes; the text is cut before it."""
    d = Detokenizer(tok, ("END",))
    pieces = _pieces(d, tok.encode("abEN") + tok.encode("Dxyz"))
    assert d.stopped and d.text == "ab" and "".join(pieces) == "ab"
    assert "E" not in "".join(pieces)
    d = Detokenizer(tok, ("END",))
    pieces = _pieces(d, tok.encode("abENx"))  # "EN" was held back, then released when it could not grow
    assert not d.stopped and "".join(pieces) == "abENx" and pieces[-1] == ""


def test_generation_record():
    g = Generation([1, 2])
    assert g.tokens == [] and g.text is None
