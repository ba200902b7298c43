"""Tokenizer of a checkpoint: a `tokenizers` tokenizer (tokenizer.json of a Hugging Face folder, or a byte-level
BPE built from a GGUF file's own vocabulary and merges) plus BOS/EOS ids and the chat template (jinja2)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (gguf.TokenType): 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer names -> the split done before the GPT-2 byte-level regex (None: the regex alone).
# smollm/starcoder/refact split every digit; llama-bpe (Llama 3) uses its own regex instead of GPT-2's.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
# qwen2 (Qwen2/Qwen2.5's tokenizer.json) is the Llama-3 regex with single digits, merges applied to whole words too.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_GGUF_PRE = {"default": None, "gpt2": None, "gpt-2": None, "smollm": "digits", "starcoder": "digits",
             "refact": "digits", "llama-bpe": "llama3", "llama3": "llama3", "qwen2": "qwen2"}


class Tokenizer:
    """encode/decode text, render the chat template; `eos_ids` are the ids generation stops at by default."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None = None, eos_ids: tuple[int, ...] = (),
                 chat_template: str | None = None, add_bos: bool = False) -> None:
        self.tok, self.bos_id, self.eos_ids = tok, bos_id, tuple(eos_ids)
        self.chat_template, self.add_bos = chat_template, add_bos

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with add_special_tokens the checkpoint's BOS is prepended when it asks for one."""
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages [{"role", "content"}] with the checkpoint's template (as HF does: sandboxed jinja2,
        trim_blocks/lstrip_blocks). Encode the result with add_special_tokens=False: the template has the BOS."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; use a plain prompt instead of --chat")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg: str):
            raise ValueError(f"chat template: {msg}")

        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        special = lambda i: self.tok.id_to_token(i) if i is not None else ""  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=special(self.bos_id),
            eos_token=special(self.eos_ids[0] if self.eos_ids else None))

    # ------------------------------------------------------------------------------------------- sources

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json / chat_template.jinja) of a Hugging Face checkpoint folder. BOS
        comes from tokenizer.json's post-processor, or is added when tokenizer_config.json sets add_bos_token."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (needed to tokenize prompts)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type for a malformed file
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
        conf = {}
        if (folder / "tokenizer_config.json").is_file():
            conf = json.loads((folder / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            t = conf.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if isinstance(t, str) else None

        bos, eos = token_id("bos_token"), token_id("eos_token")
        eos_all = tuple(dict.fromkeys([*eos_ids, *([eos] if eos is not None else [])]))
        return cls(tok, bos, eos_all, template, add_bos=bool(conf.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Build from GGUF metadata (tokenizer.ggml.*): a byte-level BPE over tokens/merges, with control tokens
        as special tokens and the pre-tokenizer named by tokenizer.ggml.pre."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; allowed: 'gpt2' (byte-level "
                             f"BPE)")
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens (needed to build the tokenizer)")
        # No merges: a pure byte vocabulary (the gguf writer drops an empty merges array).
        tokens, merges = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.merges", [])
        types = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE:
            raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; allowed: {', '.join(_GGUF_PRE)}")
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ", 1)) for m in merges],
                                     ignore_merges=_GGUF_PRE[pre] == "llama3"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=_GGUF_PRE[pre] not in
                                              ("llama3", "qwen2"))
        if _GGUF_PRE[pre] == "digits":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif _GGUF_PRE[pre] in ("llama3", "qwen2"):
            regex = _LLAMA3_REGEX if _GGUF_PRE[pre] == "llama3" else _QWEN2_REGEX
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
        return cls(tok, fields.get("tokenizer.ggml.bos_token_id"), tuple(dict.fromkeys(eos)),
                   fields.get("tokenizer.chat_template"), add_bos=bool(fields.get("tokenizer.ggml.add_bos_token")))
