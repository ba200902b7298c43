"""A tiny random Llama checkpoint (a real Hugging Face folder: config.json, model.safetensors, tokenizer.json) for
fast builds in tests and smoke runs of the build pipeline. Its text is meaningless; its shapes are real."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_position_embeddings": 1024, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def tiny_state_dict(conf: dict = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named fp32 weights: matrices ~ N(0, 0.1^2) (logits of order 1), norms ~ 1 + N(0, 0.3^2)."""
    from ..models import LlamaModel, config_from_hf

    g = torch.Generator().manual_seed(seed)
    shapes = LlamaModel.hf_weight_shapes(config_from_hf(conf))
    return {n: torch.randn(s, generator=g) * (0.3 if len(s) == 1 else 0.1) + (1.0 if len(s) == 1 else 0.0)
            for n, s in shapes.items()}


def tiny_model(seed: int = 0, **overrides):
    """(LlamaModel fp32, ModelConfig) of the tiny config (keys of TINY_CONFIG may be overridden)."""
    from ..models import LlamaModel, config_from_hf

    conf = {**TINY_CONFIG, **overrides}
    cfg = config_from_hf(conf)
    return LlamaModel.from_hf_state_dict(cfg, tiny_state_dict(conf, seed)), cfg


def write_tiny_checkpoint(folder: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the tiny checkpoint as a Hugging Face folder; a byte-level tokenizer whose 256 ids are the bytes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    conf = {**TINY_CONFIG, **overrides}
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(tiny_state_dict(conf, seed), str(folder / "model.safetensors"))
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(byte_chars))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": tok.id_to_token(1),
                                                             "eos_token": tok.id_to_token(2)}))
    return folder
