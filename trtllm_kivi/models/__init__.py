"""Llama models and their loaders.

Public API (stable names other modules build on):
    load_model(name_or_path="smollm2-135m", dtype=torch.float32, device="cpu") -> (LlamaModel, Tokenizer, ModelConfig)
        a built-in name, a .gguf file or a Hugging Face checkpoint folder (config.json + safetensors, sharded too).
    resolve_model(name_or_path) -> Path        the file/folder a name refers to (DEFAULT_MODEL = "smollm2-135m").
    read_gguf(path) / read_hf_folder(path) -> (ModelConfig, {HF tensor name: tensor})   weights only, unchecked.
    config_from_hf(config_json_dict) -> ModelConfig
    ModelConfig                                hyper-parameters; .geometry -> format.Geometry for the caches.
    LlamaModel.from_hf_state_dict(cfg, sd, dtype, device)   checks names/shapes, fuses q|k|v and gate|up.
    LlamaModel.forward(tokens [T], positions [T], cache, step, logit_rows=None) -> fp32 logits [T or rows, vocab]
        one ragged step; attention is cache.attention(layer, q, k, v, step) (trtllm_kivi.cache).
    LlamaModel.hf_weight_shapes(cfg)           every HF tensor name -> shape (for writing checkpoints in tests).
    Tokenizer                                  encode(text, add_special_tokens) / decode / apply_chat_template;
                                               bos_id, eos_ids, vocab_size, token(id).
    parse_dtype("float32" | "bf16" | ...) -> torch.dtype.
    tiny.write_tiny_checkpoint(folder, seed, init, tokenizer, **config_overrides) / tiny.tiny_model(seed, init,
        **config_overrides)   random-weight tiny Llama for tests and smoke runs (import trtllm_kivi.models.tiny).
Drive a model through trtllm_kivi.runtime.torch_runner.TorchRunner(model, cache) (or TorchRunner.create(model,
"kivi2", max_slots, max_seq_len)) and trtllm_kivi.runtime.generate.generate(runner, prompts, params, tokenizer).
"""

from .llama import LlamaModel, ModelConfig, rope_inv_freq
from .loaders import (BUILTIN_MODELS, DEFAULT_MODEL, config_from_hf, load_model, parse_dtype, read_gguf,
                      read_hf_folder, resolve_model)
from .tokenizer import Tokenizer

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "LlamaModel", "ModelConfig", "Tokenizer", "config_from_hf",
           "load_model", "parse_dtype", "read_gguf", "read_hf_folder", "resolve_model", "rope_inv_freq"]
