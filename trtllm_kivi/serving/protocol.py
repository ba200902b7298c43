"""The Triton request/response protocol of the served model (names follow TensorRT-LLM's Triton ensemble where they
exist: text_input, max_tokens, stop_words, stream, text_output, output_ids), and its validation.

Everything here works on plain numpy arrays, so it is tested without a server; the Triton model
(serving/triton_model.py) only moves tensors in and out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime.generate import SamplingParams


class InvalidRequest(ValueError):
    """A malformed request: the message names the input, the bad value and what is accepted."""


# name -> (Triton dtype, dims, optional, description); config.pbtxt is written from this table, so the shapes the
# model accepts are the ones Triton lets through. Every input is one-dimensional ([-1]: max_batch_size 0, no batch
# dim) and the model checks the element counts itself, so a wrong count gets a message that names the input.
# Integers are INT64: Triton converts a JSON number of the HTTP generate endpoint to the declared type, and INT32
# would silently wrap a large max_tokens / top_k / token id (2^40 -> 0) before the model could refuse it.
INPUTS = {
    "text_input": ("TYPE_STRING", [-1], True, "prompt text (one UTF-8 string); or give input_ids"),
    "input_ids": ("TYPE_INT64", [-1], True, "prompt token ids; or give text_input"),
    "max_tokens": ("TYPE_INT64", [-1], True, "tokens to generate (one value)"),
    "temperature": ("TYPE_FP32", [-1], True, "0 = greedy (default)"),
    "top_p": ("TYPE_FP32", [-1], True, "nucleus sampling, (0, 1]"),
    "top_k": ("TYPE_INT64", [-1], True, "sample among the k most likely tokens, 0 = off"),
    "seed": ("TYPE_INT64", [-1], True, "sampling seed, >= 0"),
    "stop_words": ("TYPE_STRING", [-1], True, "stop strings (the output is cut before the first one)"),
    "stream": ("TYPE_BOOL", [-1], True, "false (default): one final response; true: one response per token"),
}
OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1], "text: the new piece when streaming, else the whole output"),
    "output_ids": ("TYPE_INT32", [-1], "token ids: the new ones when streaming, else all generated"),
    "finish_reason": ("TYPE_STRING", [-1], "stop | length | cancelled on the final response, else empty"),
}
MAX_STOP_WORDS = 16
# request parameters Triton itself sets (the gRPC client's option for an empty final response); not inputs
RESERVED_PARAMETERS = frozenset({"triton_enable_empty_final_response"})


@dataclass
class ParsedRequest:
    prompt: list[int]
    params: SamplingParams
    stream: bool


def _one(tensors: dict, name: str, kind: str, default):
    """The single value of an optional scalar input, checked for kind ("int", "float", "bool")."""
    a = tensors.get(name)
    if a is None:
        return default
    if a.size != 1:
        raise InvalidRequest(f"input '{name}' must hold exactly one value, got shape {list(a.shape)}")
    ok = {"int": np.issubdtype(a.dtype, np.integer), "float": np.issubdtype(a.dtype, np.floating),
          "bool": a.dtype == np.bool_}[kind]
    if not ok:
        raise InvalidRequest(f"input '{name}' must be {kind}, got dtype {a.dtype}")
    v = a.reshape(-1)[0].item()
    return v


def _strings(a: np.ndarray, name: str) -> list[str]:
    out = []
    for x in a.reshape(-1):
        if not isinstance(x, (bytes, str)):
            raise InvalidRequest(f"input '{name}' must be strings (BYTES), got {type(x).__name__}")
        try:
            out.append(x.decode("utf-8") if isinstance(x, bytes) else x)
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return out


def parse_request(tensors: dict[str, np.ndarray], tokenizer, vocab_size: int, max_seq_len: int,
                  default_max_tokens: int = 64, stop_token_ids: tuple[int, ...] = (),
                  parameters: dict | None = None) -> ParsedRequest:
    """Validate a request's input tensors and turn them into prompt ids + sampling params (raises InvalidRequest).
    `parameters` are the request's Triton parameters: the model takes none, and Triton's HTTP generate endpoint
    turns every JSON key that is not an input into one, so any (but Triton's own, see RESERVED_PARAMETERS) is an
    unknown input. Whether prompt + max_tokens fits a sequence is the scheduler's check (RequestRejected)."""
    unknown = sorted(set(tensors) - set(INPUTS))
    unknown += sorted(k for k in (parameters or {}) if k not in RESERVED_PARAMETERS)
    if unknown:
        raise InvalidRequest(f"unknown inputs {unknown}; accepted: {sorted(INPUTS)}")
    for name, a in tensors.items():
        dims = INPUTS[name][1]
        if a.ndim != len(dims):  # Triton checks this already; parse_request also serves offline callers
            raise InvalidRequest(f"input '{name}' must have {len(dims)} dimension(s) (dims {dims}), got shape "
                                 f"{list(a.shape)}")
    has_text, has_ids = "text_input" in tensors, "input_ids" in tensors
    if has_text == has_ids:
        raise InvalidRequest("give exactly one of 'text_input' (prompt text) or 'input_ids' (token ids)")
    if has_text:
        texts = _strings(tensors["text_input"], "text_input")
        if len(texts) != 1:
            raise InvalidRequest(f"input 'text_input' must hold exactly one string, got {len(texts)}")
        if not texts[0]:
            raise InvalidRequest("input 'text_input' is empty; the prompt needs at least one character")
        prompt = tokenizer.encode(texts[0])
        if not prompt:
            raise InvalidRequest("input 'text_input' encodes to no tokens")
    else:
        a = tensors["input_ids"]
        if not np.issubdtype(a.dtype, np.integer):
            raise InvalidRequest(f"input 'input_ids' must be integers, got dtype {a.dtype}")
        prompt = [int(x) for x in a.reshape(-1)]
        if not prompt:
            raise InvalidRequest("input 'input_ids' is empty; the prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"input 'input_ids' has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")

    max_tokens = _one(tensors, "max_tokens", "int", default_max_tokens)
    if not 1 <= max_tokens <= max_seq_len:
        raise InvalidRequest(f"max_tokens={max_tokens} must be in [1, {max_seq_len}] (the sequence capacity)")
    temperature = _one(tensors, "temperature", "float", 0.0)
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise InvalidRequest(f"temperature={temperature} must be in [0, 100] (0 = greedy)")
    top_p = _one(tensors, "top_p", "float", 1.0)
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"top_p={top_p} must be in (0, 1]")
    top_k = _one(tensors, "top_k", "int", 0)
    if top_k < 0:
        raise InvalidRequest(f"top_k={top_k} must be >= 0 (0 = off)")
    seed = _one(tensors, "seed", "int", None)
    if seed is not None and seed < 0:
        raise InvalidRequest(f"seed={seed} must be >= 0")
    stop = _strings(tensors["stop_words"], "stop_words") if "stop_words" in tensors else []
    if len(stop) > MAX_STOP_WORDS or any(not s for s in stop):
        raise InvalidRequest(f"stop_words must be at most {MAX_STOP_WORDS} non-empty strings, got {stop!r:.200}")
    stream = bool(_one(tensors, "stream", "bool", False))
    params = SamplingParams(max_new_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                            top_k=int(top_k), seed=seed, stop_token_ids=tuple(stop_token_ids),
                            stop_strings=tuple(stop))
    return ParsedRequest(prompt, params, stream)


def response_arrays(text: str, ids: list[int], finish_reason: str) -> dict[str, np.ndarray]:
    """The output tensors of one response."""
    return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "output_ids": np.array(ids, dtype=np.int32),
            "finish_reason": np.array([finish_reason.encode("utf-8")], dtype=np.object_)}
