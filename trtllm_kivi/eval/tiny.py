"""A tiny random-weight Llama checkpoint folder (config.json + model.safetensors + a byte-level tokenizer.json)
for tests and smoke runs of the evaluation: every loader and runner path is the real one, only the weights are
random."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.llama import LlamaModel
from ..models.loaders import config_from_hf


def write_tiny_checkpoint(folder: str | Path, layers: int = 2, dim: int = 64, heads: int = 2, kv_heads: int = 1,
                          head_dim: int = 32, ffn: int = 128, max_len: int = 4096, seed: int = 0) -> Path:
    """Write the checkpoint and return its folder. Vocabulary: the 256 byte-level tokens (no merges)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 characters, one per byte
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(alphabet),
            "hidden_size": dim, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": max_len,
            "tie_word_embeddings": True, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(conf))
    gen = torch.Generator().manual_seed(seed)
    shapes = LlamaModel.hf_weight_shapes(config_from_hf(conf))
    sd = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) / s[-1] ** 0.5 * (3 if "embed" in n
          else 1)).contiguous() for n, s in shapes.items()}
    save_file(sd, str(folder / "model.safetensors"))
    return folder
