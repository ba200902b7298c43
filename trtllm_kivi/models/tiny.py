"""A tiny random-weight Llama checkpoint (a real Hugging Face folder: config.json, model.safetensors,
tokenizer.json) for tests and smoke runs: every loader, builder and runner path is the real one, only the weights
are random. One config dict (TINY_CONFIG + overrides), one weight generator, one tokenizer writer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .llama import LlamaModel, ModelConfig
from .loaders import config_from_hf

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_position_embeddings": 1024, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class TinyInit:
    """How the random weights are drawn. Matrices: N(0, matrix_std^2), or N(0, 1/fan_in) when matrix_std is None,
    times embed_gain for the embedding. Norm weights: norm_mean + N(0, norm_std^2); norm_std=0 gives constant
    norm_mean without drawing (so the matrices' draws do not move)."""
    matrix_std: float | None = 0.1
    embed_gain: float = 1.0
    norm_mean: float = 1.0
    norm_std: float = 0.3


SMALL_INIT = TinyInit()  # logits of order 1; the default
FAN_IN_INIT = TinyInit(matrix_std=None, embed_gain=3.0, norm_mean=1.0, norm_std=0.0)  # unit norms, N(0, 1/fan_in)
WIDE_INIT = TinyInit(matrix_std=0.3, norm_mean=0.0, norm_std=1.0)  # peaked logits: greedy far from ties


def tiny_config(**overrides) -> dict:
    """TINY_CONFIG with keys overridden; an override of None drops the key (the loader's default applies)."""
    return {k: v for k, v in {**TINY_CONFIG, **overrides}.items() if v is not None}


def tiny_state_dict(conf: dict = TINY_CONFIG, seed: int = 0, init: TinyInit = SMALL_INIT) -> dict[str, torch.Tensor]:
    """Random HF-named fp32 weights of `conf`, drawn in hf_weight_shapes order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, s in LlamaModel.hf_weight_shapes(config_from_hf(conf)).items():
        if len(s) == 1:  # RMSNorm weight [dim]
            sd[n] = torch.randn(s, generator=g) * init.norm_std + init.norm_mean if init.norm_std else \
                torch.full(s, init.norm_mean)
        else:  # matrix [out, in]
            w = torch.randn(s, generator=g)
            w = w / s[-1] ** 0.5 if init.matrix_std is None else w * init.matrix_std
            sd[n] = (w * init.embed_gain if "embed" in n else w).contiguous()
    return sd


def tiny_model(seed: int = 0, init: TinyInit = SMALL_INIT, **overrides) -> tuple[LlamaModel, ModelConfig]:
    """(LlamaModel fp32, ModelConfig) of tiny_config(**overrides)."""
    conf = tiny_config(**overrides)
    cfg = config_from_hf(conf)
    return LlamaModel.from_hf_state_dict(cfg, tiny_state_dict(conf, seed, init)), cfg


def write_byte_tokenizer(folder: str | Path, conf: dict = TINY_CONFIG) -> None:
    """tokenizer.json whose 256 ids are the bytes (byte-level BPE, no merges); tokenizer_config.json naming the
    bos/eos tokens when conf has bos_token_id / eos_token_id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins of the bytes
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    if "bos_token_id" in conf or "eos_token_id" in conf:
        names = {f"{k}_token": tok.id_to_token(conf[f"{k}_token_id"]) for k in ("bos", "eos")
                 if f"{k}_token_id" in conf}
        (folder / "tokenizer_config.json").write_text(json.dumps(names))


def write_tiny_checkpoint(folder: str | Path, seed: int = 0, init: TinyInit = SMALL_INIT, tokenizer=None,
                          **overrides) -> Path:
    """Write tiny_config(**overrides) as a Hugging Face folder and return it. tokenizer: None for the byte-level
    one (write_byte_tokenizer), or a tokenizers.Tokenizer to save as tokenizer.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    conf = tiny_config(**overrides)
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(tiny_state_dict(conf, seed, init), str(folder / "model.safetensors"))
    if tokenizer is None:
        write_byte_tokenizer(folder, conf)
    else:
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder
