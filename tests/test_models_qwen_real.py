"""The real Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, fetched with `trtllm-kivi models fetch qwen2.5-coder-1.5b`)
against transformers' Qwen2ForCausalLM loaded from the same file by transformers' own GGUF loader: the logits of one
prompt, and greedy tokens through this project's transformers Cache (hf.KiviCache) against our runner. Skipped
with the fetch command as the reason where the model is not fetched (CI never downloads it). Each model is loaded
alone and freed before the next (fp32: ~7 GB each)."""

from __future__ import annotations

import gc

import pytest
import torch

from trtllm_kivi.models.registry import FETCHED_MODELS, ModelNotFetchedError, resolve_fetched

NAME = "qwen2.5-coder-1.5b"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _path():
    try:
        return resolve_fetched(NAME)
    except ModelNotFetchedError:
        pytest.skip(f"{NAME} is not fetched: run {FETCHED_MODELS[NAME].fetch_command()}")


@pytest.fixture(scope="module")
def ours():
    """Our fp32 model's logits over PROMPT and its greedy continuations (FP16 and KIVI-2 caches), then freed."""
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    path = _path()
    model, tok, cfg = load_model(NAME, "float32")
    ids = tok.encode(PROMPT, add_special_tokens=False)
    runner = TorchRunner.create(model, "fp32", 1, 256)
    logits = runner.step([runner.add_sequence()], [ids], all_logits=True)
    greedy = {kv: generate(TorchRunner.create(model, kv, 1, 256), [ids], SamplingParams(max_new_tokens=16))[0].tokens
              for kv in ("fp16", "kivi2")}
    out = {"path": path, "ids": ids, "logits": logits, "greedy": greedy, "cfg": cfg,
           "text": tok.decode(greedy["fp16"])}
    del model, runner
    gc.collect()
    return out


@pytest.mark.slow
def test_geometry_and_a_sensible_continuation(ours):
    cfg = ours["cfg"]
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta) == (28, 12, 2, 128, 1e6)
    assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.max_seq_len == 32768
    assert "return" in ours["text"] or "if" in ours["text"], ours["text"]


@pytest.mark.slow
def test_logits_and_kivi_cache_match_transformers_on_the_same_gguf(ours):
    transformers = pytest.importorskip("transformers")
    from trtllm_kivi.hf import KiviCache

    path = ours["path"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([ours["ids"]])
    with torch.inference_mode():
        want = hf(ids).logits[0].float()
    got = ours["logits"]
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= 2e-3 * scale, (err, scale)  # same dequantized weights, fp32: only summation order differs
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for kv in ("fp16", "kivi2"):
        cache = KiviCache(hf, kv, max_seq_len=256)
        with torch.inference_mode():
            out = hf.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == ours["greedy"][kv], kv
