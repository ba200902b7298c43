"""The OpenAI-compatible protocol of `trtllm-kivi serve`: request bodies of /v1/completions and /v1/chat/completions
checked field by field, and the response / stream-chunk bodies, with OpenAI's shapes and field names.

Everything here is plain Python over bytes and dicts (tested without a server); serving/openai_server.py moves them.

What a client's mistake gets (never a 500, never a crash): 400 with OpenAI's error body naming the field, the bad
value and the allowed range; 404 for an unknown model; 413 for a body over the size limit. A body is read only up to
the limit, must be UTF-8 JSON whose nesting is at most MAX_DEPTH levels (checked on the bytes before parsing, so a
body nested 50,000 levels deep costs one linear scan), and an object.

Fields: the OpenAI fields of each endpoint are known; an unknown field is refused (400 naming it), as OpenAI's API
does. Fields that change nothing here are accepted and ignored (user, store, metadata, service_tier,
parallel_tool_calls, prompt_cache_key, safety_identifier). Known fields this server does not implement are accepted
only at their neutral value (presence_penalty / frequency_penalty 0, logit_bias empty, best_of 1, suffix null,
tools / functions empty, response_format text) and refused otherwise, naming the field. Extensions (as vLLM and
llama.cpp's server take them): top_k, ignore_eos.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..runtime.sampling import SamplingParams

MAX_DEPTH = 32  # nesting levels of a request body (OpenAI request bodies need < 8)
MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**63 - 1

COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "functions", "function_call", "parallel_tool_calls", "store", "metadata",
                        "service_tier", "modalities", "prompt_cache_key", "safety_identifier"}
ROLES = ("system", "user", "assistant", "developer")


class APIError(Exception):
    """A request the server refuses: HTTP status + OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


# ------------------------------------------------------------------------------------------------ body


_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # a JSON string (skipped whole), or a bracket


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """The deepest [ / { nesting of a JSON text (outside strings), scanning the bytes once; stops at limit + 1."""
    depth = best = 0
    for m in _TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            best = max(best, depth)
            if best > limit:
                return best
        elif c in (b"]", b"}"):
            depth -= 1
    return best


def parse_body(raw: bytes) -> dict:
    """A request body: UTF-8 JSON, nested at most MAX_DEPTH levels, an object; else APIError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_json") from None
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise APIError(400, f"the request body nests more than {MAX_DEPTH} levels deep; at most {MAX_DEPTH} are "
                       "accepted",
                       code="invalid_json")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


# ------------------------------------------------------------------------------------------------ fields


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer in [{lo}, {hi}], got {_type_name(v)} {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise bad(name, f"'{name}'={v} is out of range; allowed: [{lo}, {hi}]")
    return v


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"'{name}' must be a number in [{lo:g}, {hi:g}], got {_type_name(v)} {json.dumps(v)[:40]}")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise bad(name, f"'{name}'={v} is out of range; allowed: [{lo:g}, {hi:g}]")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {_type_name(v)} {json.dumps(v)[:40]}")
    return v


def _neutral(body: dict, name: str, ok) -> None:
    """A known OpenAI field this server does not implement: accepted only at its neutral value."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise bad(name, f"'{name}'={json.dumps(body[name])[:60]} is not supported by this server; leave it out "
                  f"(or give its neutral value)")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", f"'stop' must be a string or an array of strings, got {_type_name(v)}")
    if len(items) > MAX_STOP or any(not s for s in items):
        raise bad("stop", f"'stop' takes 1 to {MAX_STOP} non-empty strings, got {len(items)} "
                  f"({sum(not s for s in items)} empty)")
    return tuple(items)


# ------------------------------------------------------------------------------------------------ requests


@dataclass
class Context:
    """What request checking needs from the served model."""

    model: str
    tokenizer: Any
    vocab_size: int
    max_seq_len: int
    default_max_tokens: int = 256
    eos_ids: tuple[int, ...] = ()


@dataclass
class GenerationRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: str = ""  # completions with echo: the prompt text put before the completion
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex


def _common(body: dict, ctx: Context, allowed: set[str], prompt: list[int], kind: str,
            max_tokens: int | None) -> GenerationRequest:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                       "unknown_parameter")
    n = _int(body, "n", 1, 128, 1)
    if n != 1:
        raise bad("n", f"'n'={n} is not supported; allowed: 1 (send n requests instead)")
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2.0, 2.0, 0.0)
        _neutral(body, name, lambda v: v == 0)
    _neutral(body, "logit_bias", lambda v: v == {})
    _neutral(body, "logprobs", lambda v: v is False)
    _neutral(body, "top_logprobs", lambda v: v == 0)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"'user' must be a string, got {_type_name(body['user'])}")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options", "'stream_options' must be an object with 'include_usage' (boolean)")
        include_usage = _bool(opts, "include_usage", False)
    cap = ctx.max_seq_len - len(prompt) + 1  # what a sequence still holds after this prompt
    if max_tokens is None:
        max_tokens = max(1, min(ctx.default_max_tokens, cap))
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0  # the smallest nucleus: the most likely token
    top_k = _int(body, "top_k", -1, 1 << 30, 0)
    seed = _int(body, "seed", 0, MAX_SEED, None)
    ignore_eos = _bool(body, "ignore_eos", False)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=max(0, top_k or 0), seed=seed,
                            stop_token_ids=() if ignore_eos else tuple(ctx.eos_ids), stop_strings=_stop(body))
    return GenerationRequest(kind, ctx.model, prompt, params, stream, include_usage)


def check_model(body: dict, ctx: Context) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(400, "you must provide a model parameter ('model'); GET /v1/models lists it", "model",
                       "missing_required_parameter")
    if not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {_type_name(model)}")
    if model != ctx.model:
        raise APIError(404, f"The model '{model[:100]}' does not exist; this server serves '{ctx.model}'", "model",
                       "model_not_found")


def _token_ids(v: list, ctx: Context, name: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad(name, f"'{name}' as a token list must hold integers only")
    bad_ids = [t for t in v if not 0 <= t < ctx.vocab_size]
    if bad_ids:
        raise bad(name, f"'{name}' has token ids {bad_ids[:5]} outside the vocabulary [0, {ctx.vocab_size})")
    return list(v)


def _max_tokens(body: dict, ctx: Context, *names: str) -> int | None:
    got = None
    for name in names:
        v = _int(body, name, 1, ctx.max_seq_len, None)
        got = v if v is not None else got
    return got


def parse_completion(body: dict, ctx: Context) -> GenerationRequest:
    """POST /v1/completions: prompt = a string, a token list, or a list of one of them."""
    check_model(body, ctx)
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "'prompt' is required (a string or a list of token ids)", "prompt",
                       "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "'prompt' is empty; it needs at least one character")
        ids = ctx.tokenizer.encode(p)
        echo = p
    elif isinstance(p, list):
        if p and isinstance(p[0], (str, list)):
            raise bad("prompt", f"'prompt' holds {len(p)} prompts; this server takes one prompt per request")
        if not p:
            raise bad("prompt", "'prompt' is empty; it needs at least one token")
        ids = _token_ids(p, ctx, "prompt")
        echo = ctx.tokenizer.decode(ids)
    else:
        raise bad("prompt", f"'prompt' must be a string or an array of token ids, got {_type_name(p)}")
    if not ids:
        raise bad("prompt", "'prompt' encodes to no tokens")
    _neutral(body, "suffix", lambda v: v == "")
    _neutral(body, "best_of", lambda v: v == 1)
    req = _common(body, ctx, COMPLETION_FIELDS, ids, "completion", _max_tokens(body, ctx, "max_tokens"))
    if "max_tokens" not in body or body["max_tokens"] is None:  # OpenAI's completions default
        req.params = replace(req.params, max_new_tokens=min(16, req.params.max_new_tokens))
    if _bool(body, "echo", False):
        req.echo = echo
    return req


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content[{j}]", f"'messages[{i}].content[{j}]' must be a text part "
                          "{\"type\": \"text\", \"text\": ...}; this model takes text only")
            parts.append(part["text"])
        return "".join(parts)
    if c is None and msg.get("role") == "assistant":
        return ""
    raise bad(f"messages[{i}].content", f"'messages[{i}].content' must be a string or an array of text parts, got "
              f"{_type_name(c)}")


def parse_chat(body: dict, ctx: Context) -> GenerationRequest:
    """POST /v1/chat/completions: messages rendered with the model's chat template."""
    check_model(body, ctx)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", f"'messages' must be a non-empty array of messages, got {_type_name(msgs)}"
                  + (" (empty)" if msgs == [] else ""))
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"'messages[{i}].role'={json.dumps(role)[:40]} is not supported; "
                      f"allowed: {', '.join(ROLES)}")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}]", f"'messages[{i}]' has fields {extra} this server does not support "
                      "(tool calls are not supported)")
        clean.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    _neutral(body, "tools", lambda v: v == [])
    _neutral(body, "functions", lambda v: v == [])
    _neutral(body, "tool_choice", lambda v: v == "none")
    _neutral(body, "function_call", lambda v: v == "none")
    _neutral(body, "response_format", lambda v: v == {"type": "text"})
    _neutral(body, "modalities", lambda v: v == ["text"])
    try:
        text = ctx.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
    except ValueError as e:
        raise bad("messages", f"the chat template refused the messages: {e}") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad("messages", "the messages render to an empty prompt")
    return _common(body, ctx, CHAT_FIELDS, ids, "chat", _max_tokens(body, ctx, "max_tokens",
                                                                      "max_completion_tokens"))


# ------------------------------------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response(req: GenerationRequest, text: str, finish_reason: str, use: dict) -> dict:
    """The non-streamed body."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": req.echo + text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": use}


def chunk(req: GenerationRequest, text: str | None, finish_reason: str | None = None, use: dict | None = None,
          first: bool = False) -> dict:
    """One streamed chunk; text None with use: the final usage chunk (no choices)."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict = {} if text is None else ({"role": "assistant", "content": text} if first else
                                               {"content": text})
        choices = [] if text is None and use is not None else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        obj = "text_completion"
        choices = [] if text is None and use is not None else [
            {"index": 0, "text": (req.echo if first else "") + (text or ""), "logprobs": None,
             "finish_reason": finish_reason}]
    out = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
    if req.include_usage:
        out["usage"] = use
    return out


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"


__all__ = ["APIError", "CHAT_FIELDS", "COMPLETION_FIELDS", "Context", "GenerationRequest", "MAX_DEPTH", "chunk",
           "nesting_depth", "parse_body", "parse_chat", "parse_completion", "response", "sse", "usage"]
