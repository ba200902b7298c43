"""Torch-facing wrappers over the native CPU KIVI library (ctypes over CPU tensors' data pointers).

`kivi_attention_cpu_` has the signature and semantics of trtllm_kivi.reference.kivi_attention_ (attend, then append;
buffers updated in place; returns out [tokens, H, D]) for head_dim 64/128, fp32/fp16/bf16 activations, every
KiviConfig (2/4/8 bits, G 32/64/128, per_channel/per_token keys, fp16/bf16/fp32 scales, sink_tokens 0..128; a
rotation is applied outside the op, so the op never sees it).
`full_attention_cpu_` is the unquantized cache's step (cache.FullCache.attention): write the chunk into the dense
K/V cache [slots, Hkv, max_seq_len, D] (converted to its dtype), then attend over rows [0, past + chunk).

The C++ side validates the lengths, slots and block ids (ValueError naming the bad value; nothing is written on
error); this module checks devices, dtypes, contiguity and shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..format import FORMAT_VERSION, SUPPORTED_KEY_GROUPINGS, KiviConfig, buffer_shapes
from ..reference.attention import KiviBuffers
from . import _abi
from ._abi import KiviCpuDenseParams, KiviCpuLibrary, KiviCpuParams

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_INT_NAMES = ("slot_ids", "past_len", "chunk_len", "block_table")


def _ptr(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.numel() > 0 else None


def _check_common(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    # is_cpu / is_contiguous only: this runs once per layer per step (t.device builds an object per call)
    for name, t in zip(names, tensors, strict=True):
        if not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}; the native CPU kernels need CPU tensors")
        if not t.is_contiguous():
            raise ValueError(f"{name} with shape {tuple(t.shape)} and strides {t.stride()} must be contiguous")


def _check_ints(slot_ids, past_len, chunk_len, block_table=None) -> None:
    """The step's int32 tensors (block_table None: the unquantized cache's step has none)."""
    ints = (slot_ids, past_len, chunk_len) + (() if block_table is None else (block_table,))
    _check_common(_INT_NAMES[:len(ints)], ints)
    for name, t in zip(_INT_NAMES[:len(ints)], ints, strict=True):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32")
    b = slot_ids.shape[0] if slot_ids.dim() == 1 else -1
    table_ok = block_table is None or (block_table.dim() == 2 and block_table.shape[0] == b)
    if slot_ids.dim() != 1 or past_len.shape != (b,) or chunk_len.shape != (b,) or not table_ok:
        if block_table is None:
            raise ValueError(f"slot_ids/past_len/chunk_len must be [B]; got {tuple(slot_ids.shape)}, "
                             f"{tuple(past_len.shape)}, {tuple(chunk_len.shape)}")
        raise ValueError(f"slot_ids/past_len/chunk_len must be [B] and block_table [B, max_blocks]; got "
                         f"{tuple(slot_ids.shape)}, {tuple(past_len.shape)}, {tuple(chunk_len.shape)}, "
                         f"{tuple(block_table.shape)}")


def _check_buffers(buffers: KiviBuffers, cfg: KiviConfig) -> None:
    _check_common(KiviBuffers._fields, tuple(buffers))
    for name, t in (("k_codes", buffers.k_codes), ("v_codes", buffers.v_codes)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32")
    if buffers.k_window.dtype not in _DTYPE_CODES or buffers.v_window.dtype != buffers.k_window.dtype:
        raise ValueError(f"window dtypes {buffers.k_window.dtype}/{buffers.v_window.dtype} must be equal: float16, "
                         f"bfloat16 or float32")
    sdt = _SCALE_DTYPES[cfg.scale_dtype]
    for name, t in zip(("k_scale", "k_zero", "v_scale", "v_zero"),
                       (buffers.k_scale, buffers.k_zero, buffers.v_scale, buffers.v_zero), strict=True):
        if t.dtype != sdt:
            raise ValueError(f"{name} has dtype {t.dtype}; cfg.scale_dtype is {cfg.scale_dtype}")
    if buffers.k_codes.dim() < 2 or buffers.k_window.dim() != 4:
        raise ValueError(f"k_codes {tuple(buffers.k_codes.shape)} / k_window {tuple(buffers.k_window.shape)} are not "
                         f"cache buffers (format.buffer_shapes)")
    num_blocks, hkv = buffers.k_codes.shape[:2]
    expected = _buffer_shapes(cfg, hkv, buffers.k_window.shape[-1], num_blocks, buffers.k_window.shape[0])
    for name, t in zip(buffers._fields, buffers, strict=True):
        if t.shape != expected[name]:  # torch.Size is a tuple
            raise ValueError(f"buffer {name} has shape {tuple(t.shape)}, expected {expected[name]}")


def _check_qkv(q, k, v, hkv: int, window_dtype: torch.dtype) -> None:
    _check_common(("q", "k", "v"), (q, k, v))
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tokens, h, d = q.shape
    if tuple(k.shape) != (tokens, hkv, d) or tuple(v.shape) != (tokens, hkv, d):
        raise ValueError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} must be {(tokens, hkv, d)}")
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"activation dtype {q.dtype} is not supported; allowed: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype == window_dtype):
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must equal the window dtype {window_dtype}")


def _check_step(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers: KiviBuffers, cfg: KiviConfig) -> None:
    _check_ints(slot_ids, past_len, chunk_len, block_table)
    _check_buffers(buffers, cfg)
    _check_qkv(q, k, v, buffers.k_codes.shape[1], buffers.k_window.dtype)


@functools.lru_cache(maxsize=64)
def _buffer_shapes(cfg: KiviConfig, hkv: int, d: int, num_blocks: int, num_slots: int) -> dict[str, tuple[int, ...]]:
    """format.buffer_shapes, memoized: the op is called once per layer per step with the same geometry."""
    return buffer_shapes(cfg, hkv, d, num_blocks, num_slots)


def _out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """out, or a new tensor like q; a given out must be a contiguous CPU tensor of q's shape and dtype."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous CPU tensor like q "
                         f"{tuple(q.shape)} {q.dtype}")
    return out


def make_params(q, k, v, out, slot_ids, past_len, chunk_len, block_table, buffers: KiviBuffers, cfg: KiviConfig,
                *, isa: str = "auto", threads: int = 0, phase: int = _abi.PHASE_STEP) -> KiviCpuParams:
    tokens, h, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    if isa not in _abi.ISA_CODES:
        raise ValueError(f"isa={isa!r} is not a path; allowed: {', '.join(_abi.ISA_CODES)}")
    # one constructor call with every field in order (KiviCpuParams._fields_): 36 attribute stores took ~7 us, once
    # per layer per step
    return KiviCpuParams(h, hkv, d, cfg.k_bits, cfg.v_bits, cfg.group_size, cfg.residual_length, cfg.block_size,
                         _abi.DTYPE_CODES[cfg.scale_dtype], SUPPORTED_KEY_GROUPINGS.index(cfg.key_grouping),
                         cfg.sink_tokens, _DTYPE_CODES[q.dtype], slot_ids.shape[0], tokens, num_blocks,
                         buffers.k_window.shape[0], block_table.shape[1], threads, _abi.ISA_CODES[isa], phase,
                         _ptr(q), _ptr(k), _ptr(v), None if out is None else _ptr(out), _ptr(slot_ids),
                         _ptr(past_len), _ptr(chunk_len), _ptr(block_table), *(_ptr(t) for t in buffers))


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else int(threads)


# The code layout plugins/cpu reads and writes (the library reports it: kiviCpuFormatVersion): FORMAT_VERSION 3's
# FRAGMENT order for per-channel K and all V codes, with sinks. When format.py's FORMAT_VERSION moves on, the KIVI op
# refuses to run until the native kernels are ported (the dense path, full_attention_cpu_, is unaffected).
CODE_LAYOUT_VERSION = 3


def kivi_layout_mismatch() -> str | None:
    """Why the native CPU KIVI op cannot read this package's stores (None: it can)."""
    if CODE_LAYOUT_VERSION == FORMAT_VERSION:
        return None
    return (f"the native CPU KIVI kernels (plugins/cpu) read the FORMAT_VERSION {CODE_LAYOUT_VERSION} code layout; "
            f"this package stores FORMAT_VERSION {FORMAT_VERSION}: not ported yet")


def kivi_attention_cpu_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                        past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor,
                        buffers: KiviBuffers, cfg: KiviConfig, *, isa: str = "auto", threads: int | None = None,
                        phase: int = _abi.PHASE_STEP, out: torch.Tensor | None = None,
                        lib: KiviCpuLibrary | None = None, check: bool = True) -> torch.Tensor:
    """Native CPU form of reference.kivi_attention_: updates `buffers` in place, returns out [tokens, H, D].
    Refused (ValueError) while the native code layout differs from FORMAT_VERSION (kivi_layout_mismatch).

    isa: "auto" (best the CPU has; $TRTLLM_KIVI_CPU_ISA overrides), "portable", "avx2", "avx2denormal" (AVX2 with 2-bit
    codes decoded as subnormal floats: auto's pick on AMD without AVX-512), "avx512" or "avx512vnni" (forced; an
    unsupported one raises ValueError). threads: worker threads (default torch.get_num_threads(); results are
    bit-identical for any value). phase: _abi.PHASE_STEP (attend, then append), PHASE_ATTENTION or PHASE_APPEND.
    check=False skips the Python checks of the cache buffers (devices, dtypes, shapes: a caller that allocated them
    itself, like cache.KiviCache, once per layer per step) but not those of q/k/v; the library still validates the
    lengths, slots and block ids."""
    why = kivi_layout_mismatch()
    if why:
        raise ValueError(why)
    lib = lib or _abi.load_library()
    if check:
        _check_step(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg)
    elif (q.dim() != 3 or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
          or not (q.dtype == k.dtype == v.dtype == buffers.k_window.dtype) or q.device.type != "cpu"
          or tuple(k.shape) != (q.shape[0], buffers.k_window.shape[1], q.shape[2]) or k.shape != v.shape):
        _check_step(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg)  # names the bad value
    out = _out_like(q, out)
    lib.step(make_params(q, k, v, out, slot_ids, past_len, chunk_len, block_table, buffers, cfg, isa=isa,
                         threads=_threads(threads), phase=phase))
    return out


class KiviCpuAttention:
    """kivi_attention_cpu_ bound to a cache's layers (what cache.KiviCache and the onnxruntime in-place op call once per
    layer per step): the buffers, cfg and num_heads are checked once here and each layer's params struct is built
    once; a call checks q/k/v/out, checks the step's int32 tensors only when they are not the ones the previous
    call checked (a step passes the same tensors to every layer), sets the per-call fields and calls the library.

        op = KiviCpuAttention(layers, cfg, num_heads)
        out = op(layer, q, k, v, slot_ids, past_len, chunk_len, block_table)   # = kivi_attention_cpu_(..., layers[layer], cfg)

    Why: kivi_attention_cpu_'s per-call Python (checks of 17 tensors and a 36-field params struct) took ~100 us per
    layer in a decode step at 8K context, the interpreter's data evicted by the op's own reads (~4% of SmolLM2's
    1-thread attention op, ~10% with 2 threads; benchmarks/bench_cpu_attention.py). The buffers must keep their
    storage while bound (no resize_ / set_: their pointers are read once, as a TensorRT plugin's workspace is)."""

    def __init__(self, layers: Sequence[KiviBuffers], cfg: KiviConfig, num_heads: int, *, isa: str = "auto",
                 lib: KiviCpuLibrary | None = None) -> None:
        why = kivi_layout_mismatch()
        if why:
            raise ValueError(why)
        if isa not in _abi.ISA_CODES:
            raise ValueError(f"isa={isa!r} is not a path; allowed: {', '.join(_abi.ISA_CODES)}")
        if not layers:
            raise ValueError("layers is empty; bind at least one layer's KiviBuffers")
        self.lib = lib or _abi.load_library()
        self.layers, self.cfg = tuple(layers), cfg
        for i, bufs in enumerate(self.layers):
            _check_buffers(bufs, cfg)
            geo = (bufs.k_codes.shape[1], bufs.k_window.shape[-1], bufs.k_window.dtype)  # kv heads, head_dim, dtype
            if i == 0:
                hkv, d, self._dtype = geo
            elif geo != (hkv, d, self._dtype):
                raise ValueError(f"layer {i}: kv heads, head_dim, dtype {geo} differ from layer 0's "
                                 f"{(hkv, d, self._dtype)}")
        if num_heads <= 0 or num_heads % hkv:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of the kv heads {hkv}")
        self._h, self._hkv, self._d = num_heads, hkv, d
        none = torch.empty(0)
        self._params = [make_params(torch.empty(0, num_heads, d, dtype=self._dtype), none, none, None,
                                    *(torch.empty(0, dtype=torch.int32),) * 3,
                                    torch.empty(0, 0, dtype=torch.int32), bufs, cfg, isa=isa)
                        for bufs in self.layers]
        self._step: tuple = ()  # the int32 step tensors the last call checked
        self._ptrs: tuple = ()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                 past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor, *,
                 threads: int | None = None, phase: int = _abi.PHASE_STEP,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        qs = q.shape
        tokens = qs[0] if len(qs) == 3 else -1
        dt = self._dtype
        if (qs != (tokens, self._h, self._d) or k.shape != (tokens, self._hkv, self._d) or k.shape != v.shape
                or q.dtype != dt or k.dtype != dt or v.dtype != dt or not q.is_cpu
                or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())):
            _check_qkv(q, k, v, self._hkv, dt)  # names the bad value
            raise ValueError(f"q/k/v {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} {q.dtype} do not match the "
                             f"bound cache: [tokens, {self._h}, {self._d}] / [tokens, {self._hkv}, {self._d}] {dt}")
        step = self._step
        if (not step or slot_ids is not step[0] or past_len is not step[1] or chunk_len is not step[2]
                or block_table is not step[3]):
            _check_ints(slot_ids, past_len, chunk_len, block_table)
            self._step = (slot_ids, past_len, chunk_len, block_table)
            self._ptrs = (slot_ids.shape[0], block_table.shape[1], _ptr(slot_ids), _ptr(past_len), _ptr(chunk_len),
                          _ptr(block_table))
        out = _out_like(q, out)
        p = self._params[layer]
        p.numTokens, p.numThreads, p.phase = tokens, _threads(threads), phase
        p.batch, p.maxBlocksPerSeq, p.slotIds, p.pastLen, p.chunkLen, p.blockTable = self._ptrs
        p.q, p.k, p.v, p.out = _ptr(q), _ptr(k), _ptr(v), _ptr(out)
        self.lib.step(p)
        return out


class FullCpuAttention:
    """full_attention_cpu_ bound to an unquantized cache's layers (cache.FullCache's cpu backend), as
    KiviCpuAttention: the caches are checked and each layer's params struct is built once; a call checks q/k/v/out
    and (when they changed) the step's int32 tensors. k_caches / v_caches: [slots, Hkv, max_seq_len, D] per layer."""

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], num_heads: int, *,
                 isa: str = "auto", lib: KiviCpuLibrary | None = None) -> None:
        if isa not in _abi.ISA_CODES:
            raise ValueError(f"isa={isa!r} is not a path; allowed: {', '.join(_abi.ISA_CODES)}")
        if not k_caches or len(k_caches) != len(v_caches):
            raise ValueError(f"{len(k_caches)} k caches and {len(v_caches)} v caches: need as many, at least one")
        self.lib = lib or _abi.load_library()
        shape, dt = tuple(k_caches[0].shape), k_caches[0].dtype
        for i, (kc, vc) in enumerate(zip(k_caches, v_caches, strict=True)):
            _check_common(("k_cache", "v_cache"), (kc, vc))
            if kc.dim() != 4 or tuple(kc.shape) != shape or tuple(vc.shape) != shape or kc.dtype != dt or vc.dtype != dt:
                raise ValueError(f"layer {i}: k_cache/v_cache {tuple(kc.shape)} {kc.dtype} / {tuple(vc.shape)} "
                                 f"{vc.dtype} must be [slots, Hkv, max_seq_len, D] like layer 0's {shape} {dt}")
        if dt not in _DTYPE_CODES:
            raise ValueError(f"cache dtype {dt} is not supported; allowed: float16, bfloat16, float32")
        slots, hkv, max_len, d = shape
        if num_heads <= 0 or num_heads % hkv:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of the kv heads {hkv}")
        self._h, self._hkv, self._d = num_heads, hkv, d
        self._params = []
        for kc, vc in zip(k_caches, v_caches, strict=True):
            p = KiviCpuDenseParams()
            p.numHeads, p.numKvHeads, p.headDim = num_heads, hkv, d
            p.cacheDtype, p.numSlots, p.maxSeqLen, p.isa = _DTYPE_CODES[dt], slots, max_len, _abi.ISA_CODES[isa]
            p.kCache, p.vCache = _ptr(kc), _ptr(vc)
            self._params.append(p)
        self._caches = (tuple(k_caches), tuple(v_caches))  # keeps the storage alive while bound
        self._step: tuple = ()
        self._ptrs: tuple = ()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                 past_len: torch.Tensor, chunk_len: torch.Tensor, *, threads: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        qs = q.shape
        tokens = qs[0] if len(qs) == 3 else -1
        dt = q.dtype
        if (qs != (tokens, self._h, self._d) or k.shape != (tokens, self._hkv, self._d) or k.shape != v.shape
                or k.dtype != dt or v.dtype != dt or dt not in _DTYPE_CODES or not q.is_cpu
                or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())):
            _check_common(("q", "k", "v"), (q, k, v))
            raise ValueError(f"q/k/v {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} {q.dtype}/{k.dtype}/"
                             f"{v.dtype} must be [tokens, {self._h}, {self._d}] / [tokens, {self._hkv}, {self._d}], "
                             f"one of float16, bfloat16, float32")
        step = self._step
        if not step or slot_ids is not step[0] or past_len is not step[1] or chunk_len is not step[2]:
            _check_ints(slot_ids, past_len, chunk_len)
            self._step = (slot_ids, past_len, chunk_len)
            self._ptrs = (slot_ids.shape[0], _ptr(slot_ids), _ptr(past_len), _ptr(chunk_len))
        out = _out_like(q, out)
        p = self._params[layer]
        p.numTokens, p.numThreads, p.actDtype = tokens, _threads(threads), _DTYPE_CODES[dt]
        p.batch, p.slotIds, p.pastLen, p.chunkLen = self._ptrs
        p.q, p.k, p.v, p.out = _ptr(q), _ptr(k), _ptr(v), _ptr(out)
        self.lib.dense(p)
        return out


_DENSE_NAMES = ("q", "k", "v", "slot_ids", "past_len", "chunk_len", "k_cache", "v_cache")


def full_attention_cpu_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                        past_len: torch.Tensor, chunk_len: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, *, isa: str = "auto", threads: int | None = None,
                        out: torch.Tensor | None = None, lib: KiviCpuLibrary | None = None) -> torch.Tensor:
    """Unquantized cache step: k/v [tokens, Hkv, D] written into k_cache/v_cache [slots, Hkv, max_seq_len, D] at
    [past, past + chunk) of each slot, then causal GQA attention over [0, past + chunk) -> out [tokens, H, D]."""
    lib = lib or _abi.load_library()
    _check_common(_DENSE_NAMES, (q, k, v, slot_ids, past_len, chunk_len, k_cache, v_cache))
    for name, t in zip(_INT_NAMES[:3], (slot_ids, past_len, chunk_len), strict=True):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [tokens, H, D] and the caches [slots, Hkv, max_seq_len, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}")
    tokens, h, d = q.shape
    slots, hkv, max_len, dc = k_cache.shape
    if tuple(k.shape) != (tokens, hkv, d) or tuple(v.shape) != (tokens, hkv, d) or dc != d:
        raise ValueError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} must be {(tokens, hkv, d)} (cache "
                         f"{tuple(k_cache.shape)})")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or k_cache.dtype not in _DTYPE_CODES:
        raise ValueError(f"k_cache/v_cache {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} "
                         f"{v_cache.dtype} must match and be float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPE_CODES:
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must be equal: float16, bfloat16 or float32")
    if isa not in _abi.ISA_CODES:
        raise ValueError(f"isa={isa!r} is not a path; allowed: {', '.join(_abi.ISA_CODES)}")
    out = _out_like(q, out)  # the library writes tokens x H x D floats of q's dtype there
    p = KiviCpuDenseParams()
    p.numHeads, p.numKvHeads, p.headDim = h, hkv, d
    p.actDtype, p.cacheDtype = _DTYPE_CODES[q.dtype], _DTYPE_CODES[k_cache.dtype]
    p.batch, p.numTokens, p.numSlots, p.maxSeqLen = slot_ids.shape[0], tokens, slots, max_len
    p.numThreads, p.isa = _threads(threads), _abi.ISA_CODES[isa]
    p.q, p.k, p.v, p.out = _ptr(q), _ptr(k), _ptr(v), _ptr(out)
    p.slotIds, p.pastLen, p.chunkLen = _ptr(slot_ids), _ptr(past_len), _ptr(chunk_len)
    p.kCache, p.vCache = _ptr(k_cache), _ptr(v_cache)
    lib.dense(p)
    return out


__all__ = ["kivi_attention_cpu_", "full_attention_cpu_", "make_params", "KiviCpuAttention", "FullCpuAttention"]
