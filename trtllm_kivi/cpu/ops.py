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


_STEP_NAMES = ("q", "k", "v") + _INT_NAMES + KiviBuffers._fields


def _check_step(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers: KiviBuffers, cfg: KiviConfig) -> None:
    tensors = (q, k, v, slot_ids, past_len, chunk_len, block_table, *buffers)
    _check_common(_STEP_NAMES, tensors)
    for name, t in zip(_INT_NAMES + ("k_codes", "v_codes"),
                       (slot_ids, past_len, chunk_len, block_table, buffers.k_codes, buffers.v_codes), strict=True):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tokens, h, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    if tuple(k.shape) != (tokens, hkv, d) or tuple(v.shape) != (tokens, hkv, d):
        raise ValueError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} must be {(tokens, hkv, d)}")
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"activation dtype {q.dtype} is not supported; allowed: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype == buffers.k_window.dtype == buffers.v_window.dtype):
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must equal the window dtype "
                         f"{buffers.k_window.dtype}")
    sdt = _SCALE_DTYPES[cfg.scale_dtype]
    for name, t in zip(("k_scale", "k_zero", "v_scale", "v_zero"),
                       (buffers.k_scale, buffers.k_zero, buffers.v_scale, buffers.v_zero), strict=True):
        if t.dtype != sdt:
            raise ValueError(f"{name} has dtype {t.dtype}; cfg.scale_dtype is {cfg.scale_dtype}")
    expected = _buffer_shapes(cfg, hkv, d, num_blocks, buffers.k_window.shape[0])
    for name, t in zip(buffers._fields, buffers, strict=True):
        if t.shape != expected[name]:  # torch.Size is a tuple
            raise ValueError(f"buffer {name} has shape {tuple(t.shape)}, expected {expected[name]}")
    b = slot_ids.shape[0] if slot_ids.dim() == 1 else -1
    if (slot_ids.dim() != 1 or past_len.shape != (b,) or chunk_len.shape != (b,) or block_table.dim() != 2
            or block_table.shape[0] != b):
        raise ValueError(f"slot_ids/past_len/chunk_len must be [B] and block_table [B, max_blocks]; got "
                         f"{tuple(slot_ids.shape)}, {tuple(past_len.shape)}, {tuple(chunk_len.shape)}, "
                         f"{tuple(block_table.shape)}")


@functools.lru_cache(maxsize=64)
def _buffer_shapes(cfg: KiviConfig, hkv: int, d: int, num_blocks: int, num_slots: int) -> dict[str, tuple[int, ...]]:
    """format.buffer_shapes, memoized: the op is called once per layer per step with the same geometry."""
    return buffer_shapes(cfg, hkv, d, num_blocks, num_slots)


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
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous CPU tensor like q "
                         f"{tuple(q.shape)} {q.dtype}")
    lib.step(make_params(q, k, v, out, slot_ids, past_len, chunk_len, block_table, buffers, cfg, isa=isa,
                         threads=_threads(threads), phase=phase))
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
    if out is None:
        out = torch.empty_like(q)
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


__all__ = ["kivi_attention_cpu_", "full_attention_cpu_", "make_params"]
