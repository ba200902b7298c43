"""KIVI as a Hugging Face transformers Cache: `KiviCache(model, kv="kivi2")` for `model.generate(...,
past_key_values=cache)` or a plain forward loop with any transformers Llama / Qwen2 / Mistral-style decoder (full
attention in every layer).

    from trtllm_kivi.hf import KiviCache
    cache = KiviCache(model, kv="kivi2")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

What it stores is this project's cache, not a copy of it: every batch row is a sequence in a trtllm_kivi.cache
KiviCache (or FullCache for fp16/bf16/fp32), fed through its begin_step / attention / end_step, so the codes,
scales, zeros, window and streaming schedule are exactly the format's (docs/design.md "Streaming semantics"), and
`cache.store.sequence_state(row, layer)` shows them.

How transformers' attention sees KIVI semantics exactly. transformers calls `update(key_states, value_states,
layer_idx)` with the chunk's post-RoPE K/V [B, Hkv, c, D] and then runs its own attention over what update returns.
update returns, per row, the stored state *before* the chunk (dequantized history + full-precision window, i.e.
`store.dequantized(row, layer)`) followed by the chunk's own K/V in full precision; transformers' causal mask then
makes the query at position t attend to the stored state and to chunk tokens s..t — the attend-then-append rule.
Then the chunk is appended to our cache (its attention output is discarded: the store is written by the op itself).
For an unquantized FullCache of another dtype (fp16 for an fp32 model) the chunk is returned as that cache stores it.
Recipes (`kivi2+sink4+had`, per-layer `had:k@...`; docs/recipes.md): sinks live in the store; a layer's Hadamard
rotation is applied here as this project's model applies it around the op (format.py): the chunk's K (V) is stored
as kH (vH), and the history handed back is rotated back (x H^T), so transformers' unrotated q sees q.(k^ H^T) = (qH).k^,
the score the rotated op computes, and its attention output is the op's output rotated back.

Padding. The 2-D attention_mask the model receives (generate passes it; a forward loop passes its own) is read by a
forward pre-hook on the model's decoder: only columns with mask 1 enter the cache, so a left-padded batch stores
each row exactly as that prompt alone. The returned K/V keep transformers' column layout ([B, Hkv, columns, D]:
history at the columns its tokens came from, zeros at padding columns, which the same mask hides).

Tested with transformers 5.24 (pyproject's test extra pins the tested range); beam search, crop (assisted
decoding) and batch reordering are refused with a clear error, as are sliding-window layers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import FullCache, Step
from .cache import KiviCache as StreamingKiviCache
from .format import Geometry
from .reference.rotation import rotate, unrotate
from .runtime.kvspec import KVSpec, resolve_kv

_HOOK_ATTR = "_trtllm_kivi_mask_hook"


class _Layer(CacheLayerMixin):
    """One model layer's view of the shared store: transformers' per-layer calls go to the owning KiviCache."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: KiviCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.is_initialized = True
        return self.owner._update(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.columns

    def get_max_length(self) -> int:
        return -1  # like a dynamic cache; the store's own capacity check names max_seq_len when exceeded

    def reset(self) -> None:
        pass  # KiviCache.reset resets the shared store

    def offload(self) -> None:
        raise NotImplementedError("trtllm_kivi.hf.KiviCache does not support offloading")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("trtllm_kivi.hf.KiviCache does not support beam search (reorder_cache); use "
                                  "greedy or sampled decoding")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("trtllm_kivi.hf.KiviCache cannot crop (a quantized group is never un-flushed); "
                                  "assisted / speculative decoding is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("trtllm_kivi.hf.KiviCache does not support num_beams > 1 or "
                                  "num_return_sequences > 1; repeat the prompts in the batch instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("trtllm_kivi.hf.KiviCache does not support batch_select_indices")


def _text_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_geometry(model) -> Geometry:
    """Geometry of a transformers decoder (Llama/Qwen2/Mistral-style config); refuses sliding-window layers."""
    c = _text_config(model)
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(c, key, None), int):
            raise ValueError(f"model config has no integer {key}; expected a Llama/Qwen2/Mistral-style decoder")
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    types = list(getattr(c, "layer_types", None) or [])
    bad = [(i, t) for i, t in enumerate(types) if t != "full_attention"]
    if bad:
        raise ValueError(f"model config layer_types[{bad[0][0]}]={bad[0][1]!r} is not supported; allowed: "
                         f"'full_attention' in every layer")
    if not types and getattr(c, "sliding_window", None) is not None and getattr(c, "use_sliding_window", True):
        raise ValueError(f"model config sliding_window={c.sliding_window} is not supported (sliding-window "
                         f"attention); allowed: None")
    return Geometry(c.num_hidden_layers, heads, kv_heads, head_dim)


def _decoder(model):
    """The module that receives attention_mask and the cache: the base model of a *ForCausalLM, else the model."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) else model


def _mask_hook(module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on the decoder: hand the call's 2-D attention_mask to the trtllm KiviCache it uses."""
    found = dict(kwargs)
    if args[1:]:  # positional arguments after input_ids, e.g. model.model(ids, mask): name them by the signature
        try:
            found = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            found = {**found, **found.get("kwargs", {})}
        except TypeError:
            pass
    cache = found.get("cache", found.get("past_key_values"))
    if isinstance(cache, KiviCache):
        cache._arm(found.get("attention_mask"))


class KiviCache(Cache):
    """A transformers Cache storing K/V in this project's KIVI format (see the module docstring).

    model: the transformers model it will be used with (a forward pre-hook on its decoder reads the attention mask).
    kv: a --kv name or recipe (kivi2, kivi4, k4v2, naive2, kivi2+sink4+had, ..., fp16, bf16, fp32) or a
        runtime.kvspec.KVSpec; knobs (k_bits, v_bits, group_size, residual_length, block_size, scale_dtype) override
        a KIVI spec as the CLI flags do. A per-layer rotation (`had:k@1-29`) is sized to the model's layers.
    max_seq_len: columns per row the store is allocated for (default: the model's max_position_embeddings).
    backend: the KIVI store's attention backend (trtllm_kivi.cache BACKENDS; None: its default for the device).
    """

    def __init__(self, model, kv: str | KVSpec = "kivi2", max_seq_len: int | None = None,
                 backend: str | None = None, **knobs: Any) -> None:
        self.geometry = model_geometry(model)
        super().__init__(layers=[_Layer(self, i) for i in range(self.geometry.num_layers)])
        self.spec = resolve_kv(kv, knobs, num_layers=self.geometry.num_layers)[0]
        self.max_seq_len = max_seq_len or getattr(_text_config(model), "max_position_embeddings", None) or 4096
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise ValueError(f"KiviCache: max_seq_len={self.max_seq_len!r} must be an integer >= 1")
        decoder = _decoder(model)
        if not hasattr(decoder, _HOOK_ATTR):  # one hook per decoder serves every KiviCache used with it
            setattr(decoder, _HOOK_ATTR, decoder.register_forward_pre_hook(_mask_hook, with_kwargs=True))
        self.backend = backend
        self.store: StreamingKiviCache | FullCache | None = None  # made at the first update (batch, dtype, device)
        self.columns = 0  # sequence columns seen, padding included (what transformers calls the cache length)
        self._cols: list[torch.Tensor] = []  # per row: the columns its stored tokens came from, in order
        self._armed = False
        self._mask: torch.Tensor | None = None
        self._step: Step | None = None  # the open store step between layer 0 and the last layer
        self._real: torch.Tensor | None = None  # [B, c] bool: the chunk's columns that enter the cache
        self._next_layer = 0

    # ------------------------------------------------------------------------------------------- transformers API

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    def reset(self) -> None:
        """Forget every sequence (the store stays allocated for the same batch size)."""
        if self.store is not None:
            for row in range(self.store.max_slots):
                if self.store.active[row]:
                    self.store.free_sequence(row)
                self.store.add_sequence()
        self.columns, self._cols = 0, [c[:0] for c in self._cols]
        self._step, self._real, self._next_layer, self._armed = None, None, 0, False

    @property
    def batch_size(self) -> int:
        return -1 if self.store is None else self.store.max_slots

    # ------------------------------------------------------------------------------------------- the adapter

    def _arm(self, mask: torch.Tensor | None) -> None:
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(f"trtllm_kivi.hf.KiviCache needs a 2-D attention_mask [batch, columns] (or None); got "
                             f"{type(mask).__name__}{'' if not isinstance(mask, torch.Tensor) else list(mask.shape)}")
        self._armed, self._mask = True, mask

    def _begin(self, k: torch.Tensor) -> None:
        """Layer 0 of a forward: decide which chunk columns are real and open a store step."""
        if self._step is not None:
            raise RuntimeError(f"trtllm_kivi.hf.KiviCache: the previous forward stopped before layer "
                               f"{self._next_layer}; the cache is inconsistent: call cache.reset()")
        if not self._armed:
            raise RuntimeError("trtllm_kivi.hf.KiviCache saw no forward of the model it was made for (its decoder's "
                               "pre-hook reads the attention mask); create it with KiviCache(model, ...) for this "
                               "model")
        b, hkv, c, d = k.shape
        g = self.geometry
        if (hkv, d) != (g.num_kv_heads, g.head_dim):
            raise ValueError(f"key_states [B, Hkv, c, D]={list(k.shape)} do not match the model's Hkv="
                             f"{g.num_kv_heads}, head_dim={g.head_dim}")
        if self.store is None:
            self._make_store(b, k.dtype, k.device)
        elif b != self.store.max_slots:
            raise ValueError(f"batch size {b} differs from this cache's {self.store.max_slots}; use a new KiviCache "
                             f"(or cache.reset() keeps the batch size)")
        mask = self._mask
        if mask is None:
            real = torch.ones(b, c, dtype=torch.bool, device=k.device)
        else:
            if tuple(mask.shape) != (b, self.columns + c):
                raise ValueError(f"attention_mask shape {list(mask.shape)} must be [batch={b}, cached columns "
                                 f"{self.columns} + new {c}]")
            real = mask[:, self.columns:].to(device=k.device) != 0
        self._real = real
        assert self.store is not None
        self._step = self.store.begin_step(list(range(b)), real.sum(dim=1).tolist())  # capacity checked here

    def _make_store(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        store: StreamingKiviCache | FullCache
        if self.spec.kivi is not None:
            store = StreamingKiviCache(self.spec.kivi, self.geometry, batch, self.max_seq_len, dtype, device,
                                       backend=self.backend)
        else:
            assert self.spec.full_dtype is not None
            store = FullCache(self.geometry, batch, self.max_seq_len, self.spec.full_dtype, device)
        for _ in range(batch):
            store.add_sequence()  # row b lives in slot b
        self.store = store
        self._cols = [torch.zeros(0, dtype=torch.long, device=device) for _ in range(batch)]

    def _update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [B, Hkv, c, D] (post-RoPE) -> K/V [B, Hkv, columns + c, D] for transformers' attention."""
        if layer == 0:
            self._begin(k)
        if layer != self._next_layer or self._step is None:
            raise RuntimeError(f"trtllm_kivi.hf.KiviCache: update for layer {layer}, expected layer "
                               f"{self._next_layer}")
        b, hkv, c, d = k.shape
        store, real = self.store, self._real
        assert store is not None and real is not None
        out_k = k.new_zeros(b, hkv, self.columns + c, d)
        out_v = v.new_zeros(b, hkv, self.columns + c, d)
        k_rot, v_rot = store.rotations(layer)  # what the model applies around the op ("none" for FullCache)
        for row in range(b):  # the stored state before this chunk, at the columns its tokens came from
            if len(self._cols[row]):
                kh, vh = store.dequantized(row, layer)  # [Hkv, s, D], rotated where the layer rotates
                out_k[row][:, self._cols[row]] = unrotate(kh, k_rot).to(k.dtype)
                out_v[row][:, self._cols[row]] = unrotate(vh, v_rot).to(v.dtype)
        if isinstance(store, FullCache):  # the chunk as an unquantized cache of its dtype holds it
            out_k[:, :, self.columns:] = k.to(store.dtype).to(k.dtype)
            out_v[:, :, self.columns:] = v.to(store.dtype).to(v.dtype)
        else:  # KIVI attends to the chunk in full precision
            out_k[:, :, self.columns:] = k
            out_v[:, :, self.columns:] = v
        # Append the real tokens through the op (attend, then append); its output is not needed.
        kf = rotate(k.transpose(1, 2)[real], k_rot)  # [tokens, Hkv, D], rows concatenated as the step lists them
        vf = rotate(v.transpose(1, 2)[real], v_rot)
        q = kf.new_zeros(kf.shape[0], self.geometry.num_heads, d)
        store.attention(layer, q.contiguous(), kf.contiguous(), vf.contiguous(), self._step)
        self._next_layer = layer + 1
        if self._next_layer == self.geometry.num_layers:
            self._end(c)
        return out_k, out_v

    def _end(self, c: int) -> None:
        assert self.store is not None and self._step is not None and self._real is not None
        self.store.end_step(self._step)
        real = self._real
        new = torch.arange(self.columns, self.columns + c, device=real.device)
        self._cols = [torch.cat([cols, new[real[row]].to(cols.device)]) for row, cols in enumerate(self._cols)]
        self.columns += c
        self._step, self._real, self._next_layer, self._armed = None, None, 0, False

    def __repr__(self) -> str:
        return f"trtllm_kivi.hf.KiviCache({self.spec.describe()}, columns={self.columns})"


__all__ = ["KiviCache", "model_geometry"]
