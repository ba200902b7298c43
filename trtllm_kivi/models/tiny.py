"""A tiny random-weight Llama or Qwen2 checkpoint (a real Hugging Face folder: config.json, model.safetensors,
tokenizer.json; or a real GGUF file written with the `gguf` package) for tests and smoke runs: every loader, builder
and runner path is the real one, only the weights are random. One config dict (TINY_CONFIG or TINY_QWEN2_CONFIG +
overrides), one weight generator, one tokenizer writer per format."""

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
# Qwen2: q/k/v biases, a large rope theta, no sliding window (as Qwen2.5 ships it); GQA 7:1 like Qwen2.5-0.5B/7B.
TINY_QWEN2_CONFIG = {**TINY_CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                     "num_attention_heads": 7, "num_key_value_heads": 1, "head_dim": 32, "hidden_size": 224,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False,
                     "sliding_window": None, "max_window_layers": 2}


@dataclass(frozen=True)
class TinyInit:
    """How the random weights are drawn. Matrices: N(0, matrix_std^2), or N(0, 1/fan_in) when matrix_std is None,
    times embed_gain for the embedding. Norm weights: norm_mean + N(0, norm_std^2); norm_std=0 gives constant
    norm_mean without drawing (so the matrices' draws do not move)."""
    matrix_std: float | None = 0.1
    embed_gain: float = 1.0
    norm_mean: float = 1.0
    norm_std: float = 0.3
    bias_std: float = 0.5  # q/k/v biases (Qwen2): N(0, bias_std^2); large enough that dropping one shows


SMALL_INIT = TinyInit()  # logits of order 1; the default
FAN_IN_INIT = TinyInit(matrix_std=None, embed_gain=3.0, norm_mean=1.0, norm_std=0.0)  # unit norms, N(0, 1/fan_in)
WIDE_INIT = TinyInit(matrix_std=0.3, norm_mean=0.0, norm_std=1.0)  # peaked logits: greedy far from ties


def tiny_config(base: dict = TINY_CONFIG, **overrides) -> dict:
    """`base` (TINY_CONFIG or TINY_QWEN2_CONFIG) with keys overridden; an override of None drops the key (the
    loader's default applies)."""
    return {k: v for k, v in {**base, **overrides}.items() if v is not None}


def tiny_state_dict(conf: dict = TINY_CONFIG, seed: int = 0, init: TinyInit = SMALL_INIT) -> dict[str, torch.Tensor]:
    """Random HF-named fp32 weights of `conf`, drawn in hf_weight_shapes order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, s in LlamaModel.hf_weight_shapes(config_from_hf(conf)).items():
        if n.endswith(".bias"):  # q/k/v bias [out] (Qwen2)
            sd[n] = torch.randn(s, generator=g) * init.bias_std
        elif len(s) == 1:  # RMSNorm weight [dim]
            sd[n] = torch.randn(s, generator=g) * init.norm_std + init.norm_mean if init.norm_std else \
                torch.full(s, init.norm_mean)
        else:  # matrix [out, in]
            w = torch.randn(s, generator=g)
            w = w / s[-1] ** 0.5 if init.matrix_std is None else w * init.matrix_std
            sd[n] = (w * init.embed_gain if "embed" in n else w).contiguous()
    return sd


def tiny_model(seed: int = 0, init: TinyInit = SMALL_INIT, base: dict = TINY_CONFIG,
               **overrides) -> tuple[LlamaModel, ModelConfig]:
    """(LlamaModel fp32, ModelConfig) of tiny_config(base, **overrides)."""
    conf = tiny_config(base, **overrides)
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
                          base: dict = TINY_CONFIG, **overrides) -> Path:
    """Write tiny_config(base, **overrides) as a Hugging Face folder and return it. tokenizer: None for the
    byte-level one (write_byte_tokenizer), or a tokenizers.Tokenizer to save as tokenizer.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    conf = tiny_config(base, **overrides)
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(tiny_state_dict(conf, seed, init), str(folder / "model.safetensors"))
    if tokenizer is None:
        write_byte_tokenizer(folder, conf)
    else:
        tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_tiny_qwen2_checkpoint(folder: str | Path, seed: int = 0, init: TinyInit = SMALL_INIT,
                                **overrides) -> Path:
    """A tiny random Qwen2 Hugging Face folder: write_tiny_checkpoint(base=TINY_QWEN2_CONFIG, **overrides)."""
    return write_tiny_checkpoint(folder, seed, init, base=TINY_QWEN2_CONFIG, **overrides)


# ------------------------------------------------------------------------------------------------ GGUF

# Hugging Face per-layer names -> llama.cpp's (blk.N.<name>); the loader (models/loaders.py) maps them back.
GGUF_BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to a Llama's q/k rows (LlamaModel.permute); Qwen2 is not
    permuted (llama.cpp runs it with half-split NEOX RoPE, as Hugging Face does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(conf: dict, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights of `conf` -> llama.cpp-named fp32 tensors as its converter writes them (tied checkpoints
    have no output.weight; a Llama's q/k rows permuted)."""
    arch = "qwen2" if conf.get("model_type") == "qwen2" else "llama"
    heads, kv_heads = conf["num_attention_heads"], conf.get("num_key_value_heads") or conf["num_attention_heads"]
    out = {}
    for name, t in sd.items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif name == "model.norm.weight":
            out["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not conf.get("tie_word_embeddings", False):
                out["output.weight"] = t
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.<i>.<module>.<weight|bias>
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and kind == "weight" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = llama_cpp_permute(t, heads if module.endswith("q_proj") else kv_heads)
            out[f"blk.{i}.{GGUF_BLOCK_NAMES[module]}.{kind}"] = t
    return out


def write_gguf(path: str | Path, conf: dict, sd: dict[str, torch.Tensor], quant: str = "Q8_0",
               drop: tuple[str, ...] = (), skip_keys: tuple[str, ...] = (), extra_keys: dict | None = None,
               tokenizer: bool = True, raw: dict | None = None) -> Path:
    """Write HF-named weights `sd` of the HF config dict `conf` as a GGUF file with the real `gguf` writer:
    metadata as llama.cpp writes it for general.architecture llama or qwen2, 2-D tensors in `quant` ("Q8_0" or
    "F32"), 1-D ones (norms, biases) in F32, and the byte-level vocabulary of write_byte_tokenizer (tokenizer.ggml
    model gpt2, pre-tokenizer "qwen2" / "smollm"). drop: GGUF tensor names left out; skip_keys: metadata keys
    (add_<key> names) left out; extra_keys: {GGUF key: value} added (e.g. "qwen2.attention.sliding_window": 64);
    raw: {GGUF tensor name: (uint8 blocks [rows, bytes], quant name)} written as given instead of that tensor (the
    k-quants Q4_K / Q6_K, which the gguf package reads but cannot write)."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    arch = "qwen2" if conf.get("model_type") == "qwen2" else "llama"
    heads = conf["num_attention_heads"]
    head_dim = conf.get("head_dim") or conf["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": conf["num_hidden_layers"], "context_length": conf.get("max_position_embeddings", 2048),
            "embedding_length": conf["hidden_size"], "feed_forward_length": conf["intermediate_size"],
            "head_count": heads, "head_count_kv": conf.get("num_key_value_heads") or heads,
            "layer_norm_rms_eps": conf.get("rms_norm_eps", 1e-6),
            "rope_freq_base": (conf.get("rope_parameters") or {}).get("rope_theta", conf.get("rope_theta", 1e4)),
            "rope_dimension_count": head_dim, "key_length": head_dim, "value_length": head_dim}
    for k, v in meta.items():
        if k not in skip_keys:
            getattr(w, f"add_{k}")(v)
    for k, v in (extra_keys or {}).items():
        w.add_uint32(k, v) if isinstance(v, int) else w.add_string(k, v)
    if tokenizer:
        tokens = sorted(pre_tokenizers.ByteLevel.alphabet())  # the ids of write_byte_tokenizer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_list(tokens)
        w.add_token_merges([])
        w.add_token_types([1] * len(tokens))
        for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
            if isinstance(conf.get(key), int):
                add(conf[key])
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, t in gguf_tensors(conf, sd).items():
        if name in drop:
            continue
        if name in (raw or {}):
            blocks, kind = (raw or {})[name]
            w.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        elif t.dim() == 2 and quant != "F32":
            w.add_tensor(name, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def gguf_roundtrip(w: torch.Tensor, quant: str = "Q8_0") -> torch.Tensor:
    """What a 2-D tensor holds after write_gguf in `quant` and dequantization (the oracle's weights)."""
    import gguf

    if quant == "F32":
        return w.float()
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), qtype), qtype).copy())


def write_tiny_gguf(path: str | Path, seed: int = 0, init: TinyInit = SMALL_INIT, base: dict = TINY_QWEN2_CONFIG,
                    quant: str = "Q8_0", **overrides) -> Path:
    """tiny_config(base, **overrides) with tiny_state_dict weights as a GGUF file (see write_gguf)."""
    conf = tiny_config(base, **overrides)
    return write_gguf(path, conf, tiny_state_dict(conf, seed, init), quant)
