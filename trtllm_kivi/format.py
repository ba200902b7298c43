"""The KIVI storage format: the single source of truth.

Every constant and buffer layout the reference, the cache, the CUDA kernels, the TensorRT plugin and the ONNX
exporter use comes from here. The C++ side reads `plugins/include/kiviFormat.h`, generated from this module
(`python -m trtllm_kivi.format --header > plugins/include/kiviFormat.h`); a CPU test fails when they differ.

Layouts (per layer; Hkv = num_kv_heads, D = head_dim, BS = block_size, G = group_size, W = window capacity):

    k_codes   [num_blocks, Hkv, BS // (32 // k_bits), D]  int32   per-channel keys, FRAGMENT order (below); the
                                                                  container shape holds BS * D * k_bits / 32 words
              [num_blocks, Hkv, BS, D // (32 // k_bits)]  int32   per-token keys (naive control): LINEAR order, a word
                                                                  packs 32/k_bits consecutive channels of one token
    k_scale   [num_blocks, Hkv, BS // G, D]               sz      per channel over G tokens
              [num_blocks, Hkv, BS, D // Gv]              sz      per-token keys (naive control)
    k_zero    same as k_scale
    v_codes   [num_blocks, Hkv, BS, D // (32 // v_bits)]  int32   per-token values, FRAGMENT order (below)
    v_scale   [num_blocks, Hkv, BS, D // Gv]              sz      per token over Gv = min(G, D) channels
    v_zero    same as v_scale
    k_window  [num_slots, Hkv, S + W, D]                  act     full-precision rows: S sink rows, then a ring of
    v_window  [num_slots, Hkv, S + W, D]                  act     W = R + G - 1 rows; token t < S lives at row t,
                                                                  token t >= S at row S + (t - S) % W (no shifting)
    block_table [batch, max_blocks_per_seq]               int32   the j-th quantized token (token S + j) lives in
                                                                  block block_table[b, j // BS], row j % BS

Sinks (FORMAT_VERSION 2): the first S = sink_tokens tokens of a sequence stay in full precision for its lifetime
(window rows [0, S)); they never enter a quantization group. Groups start at token S:

    n_q(T) = max(0, floor((T - S - R) / G)) * G      quantized tokens after T tokens: tokens [S, S + n_q(T))

and the window holds tokens [S + n_q(T), T) in its ring (between R and R + G - 1 of them once T >= S + R). Flush
points (where a group is quantized) are S + R + kG, k >= 1. S = 0 is exactly FORMAT_VERSION 1's layout.

Rotation (FORMAT_VERSION 2): per layer, for K and V separately, `none` or `hadamard`. With `hadamard` the cache
holds K (or V) multiplied along head_dim by H = the Sylvester Walsh-Hadamard matrix of size D scaled by 1/sqrt(D)
(H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]; orthonormal and symmetric). It is applied outside the op: post-RoPE q
and k times H before the op (scores are unchanged: (qH).(kH) = q.k), v times H, the op's output times H^T before
o_proj. The op and the kernels never see the rotation; the config field (plugin field, build config) records it so a
rotated cache is never read unrotated.

Words are int32 (TensorRT has no uint32). LINEAR order: code i of a word occupies bits [i * bits, (i + 1) * bits)
(LSB-first). sz = scale/zero dtype (fp16 default), act = activation dtype (fp16 or bf16; fp32 in the CPU reference).

FRAGMENT order (FORMAT_VERSION 3; per_channel k_codes and all v_codes). The words of one (block, KV head) are a
flat array (the container shapes above only fix their count) cut into tiles of MMA_TILE_TOKENS = 16 tokens (tile
tau = tokens [16 tau, 16 tau + 16) of the block, words [tau * 32 * nw, (tau + 1) * 32 * nw)); inside a tile, lane L
(0..31) of a warp owns nw = D * bits / 64 consecutive words: word index (tau * 32 + L) * nw + j. With
g = L // 4 (PTX groupID) and t = L % 4 (threadID_in_group), word j of lane L holds, at bit position p (0 <= p <
16 / bits) of half h (0: bits [0, 16), 1: bits [16, 32)), i.e. at word bits [16 h + p * bits, 16 h + (p + 1) * bits),
the code of pair  pi = j * (16 / bits) + p,  register r = pi % 4,  block i = pi // 4:
    keys:   token 16 tau + g + 8 (r & 1),            channel 16 i + 8 (r >> 1) + 2 t + h
    values: token 16 tau + 8 (r >> 1) + 2 t + h,     channel 16 i + g + 8 (r & 1)
That is the register order of the A operand of mma.sync.m16n8k16 (row-major A, 16 x 16; register r holds the
element pair (row g + 8 (r & 1), cols 2 t + 8 (r >> 1) + {0, 1})), with A = the 16-key x 16-channel K tile for
S = K q^T (pairs along channels) and A = the 16-channel x 16-key V^T tile for O^T = V^T P^T (pairs along tokens).
The kernel turns word j into register r with one shift and one lop3: shifting the codes of position p to the top
`bits` mantissa bits of each half and OR-ing 1.0 (ONE_FP16 0x3C00 / ONE_BF16 0x3F80) gives exactly the pair
(1 + c_lo 2^-bits, 1 + c_hi 2^-bits); the 1 and the 2^-bits are folded into the scales (bf16 has 7 mantissa bits,
so 8-bit codes are converted through fp32 there). This is the fp16 magic-number trick with the code at the top of
the mantissa instead of at its bottom (0x6400: 1024 + c), which keeps the folded-away constant within 2^bits of the
signal instead of 1024 / (2^bits - 1) times it (trtllm_kivi/cuda/mma_model.py).
Tokens of one G-group stay whole tiles (G % 16 == 0), so flushing a group writes a contiguous word range.

Scales and zeros keep their FORMAT_VERSION 1 layout (separate k_scale/k_zero and v_scale/v_zero buffers, not
interleaved pairs): the op contract has 8 cache buffers (BUFFER_NAMES, plugin I/O, ONNX graph) and the kernel loads
both through shared memory with the same bytes either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import sys
from dataclasses import dataclass

FORMAT_VERSION = 3  # 2: sink_tokens + per-layer K/V rotation; 3: fragment-order codes (the CUDA kernels' layout)

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_SCALE_DTYPES = ("float16", "bfloat16", "float32")
SUPPORTED_KEY_GROUPINGS = ("per_channel", "per_token")
SUPPORTED_HEAD_DIMS = (64, 128)  # what the kernels instantiate; the torch reference accepts any multiple of 32
SUPPORTED_ROTATIONS = ("none", "hadamard")  # plugin field codes 0, 1
MAX_SINK_TOKENS = 128

WORD_BITS = 32
WORD_DTYPE = "int32"
BIT_ORDER = "lsb_first"
ROUNDING = "half_to_even"

DEFAULT_K_BITS = 2
DEFAULT_V_BITS = 2
DEFAULT_GROUP_SIZE = 32
DEFAULT_RESIDUAL_LENGTH = 128
DEFAULT_BLOCK_SIZE = 128
DEFAULT_SCALE_DTYPE = "float16"
DEFAULT_KEY_GROUPING = "per_channel"
DEFAULT_SINK_TOKENS = 0  # the paper's KIVI; recipes add sinks explicitly (runtime/kvspec.py)
DEFAULT_ROTATION = "none"  # never on by default: it helps some models and hurts others (docs/design.md)

# Fragment order (see the module docstring): tiles of 16 tokens, 32 lanes, nw = D * bits / 64 words per lane.
MMA_TILE_TOKENS = 16
FRAGMENT_LANES = 32
FRAGMENT_KINDS = ("keys", "values")
ONE_FP16 = 0x3C00  # fp16 1.0: a b-bit code OR-ed into mantissa bits [10 - b, 10) gives exactly 1 + c 2^-b
ONE_BF16 = 0x3F80  # bf16 1.0: mantissa bits [7 - b, 7): exact for 2- and 4-bit codes

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# The one table of dtype names: canonical names (also the C ABI's dtype codes, by index) and their short aliases.
DTYPE_NAMES = ("float16", "bfloat16", "float32")
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """A dtype name or alias (float16 / fp16, bfloat16 / bf16, float32 / fp32) -> its canonical name."""
    n = DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if n not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not supported; allowed: {', '.join(DTYPE_NAMES)} "
                         f"(or {', '.join(DTYPE_ALIASES)})")
    return n


def dtype_code(name: str) -> int:
    """The C ABI / plugin code of a dtype (index in DTYPE_NAMES)."""
    return DTYPE_NAMES.index(canonical_dtype(name))

# Order of the per-layer quantized-store and window buffers everywhere (op inputs/outputs, plugin, ONNX graph).
BUFFER_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window")


def codes_per_word(bits: int) -> int:
    """Number of `bits`-wide codes in one int32 word."""
    _check_choice("bits", bits, SUPPORTED_BITS)
    return WORD_BITS // bits


def fragment_words_per_lane(head_dim: int, bits: int) -> int:
    """nw = D * bits / 64: words lane L owns in one 16-token tile (D a multiple of 32, bits 2/4/8)."""
    _check_choice("bits", bits, SUPPORTED_BITS)
    if head_dim <= 0 or head_dim % 32 != 0:
        raise ValueError(f"head_dim={head_dim} must be a positive multiple of 32")
    return head_dim * bits // 64


def fragment_coord(kind: str, lane: int, j: int, half: int, pos: int, bits: int) -> tuple[int, int]:
    """(token within the 16-token tile, channel) of the code at bit position `pos` of half `half` of word `j` of
    lane `lane` in FRAGMENT order (module docstring)."""
    _check_choice("kind", kind, FRAGMENT_KINDS)
    g, t = lane // 4, lane % 4
    pi = j * (16 // bits) + pos
    r, i = pi % 4, pi // 4
    if kind == "keys":
        return g + 8 * (r & 1), 16 * i + 8 * (r >> 1) + 2 * t + half
    return 8 * (r >> 1) + 2 * t + half, 16 * i + g + 8 * (r & 1)


def _check_choice(name: str, value, allowed) -> None:
    # 2.0 == 2 and True == 1 would pass `in` and break the integer layout arithmetic later
    bad_type = isinstance(value, bool) or (isinstance(allowed[0], int) and not isinstance(value, numbers.Integral))
    if bad_type or value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not a length


@dataclass(frozen=True)
class KiviConfig:
    """Quantization settings of a KIVI cache; validated on construction."""

    k_bits: int = DEFAULT_K_BITS
    v_bits: int = DEFAULT_V_BITS
    group_size: int = DEFAULT_GROUP_SIZE
    residual_length: int = DEFAULT_RESIDUAL_LENGTH
    block_size: int = DEFAULT_BLOCK_SIZE
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    key_grouping: str = DEFAULT_KEY_GROUPING
    sink_tokens: int = DEFAULT_SINK_TOKENS
    # "none" | "hadamard" for every layer, or a per-layer tuple of them (length = the model's num_layers)
    k_rotation: str | tuple[str, ...] = DEFAULT_ROTATION
    v_rotation: str | tuple[str, ...] = DEFAULT_ROTATION

    def __post_init__(self) -> None:
        for name in ("k_rotation", "v_rotation"):
            r = getattr(self, name)
            if isinstance(r, list):  # from JSON
                object.__setattr__(self, name, r := tuple(r))
            if isinstance(r, tuple):
                if not r:
                    raise ValueError(f"{name}=() must name a rotation per layer or be one of "
                                     f"{', '.join(SUPPORTED_ROTATIONS)}")
                for i, x in enumerate(r):
                    if x not in SUPPORTED_ROTATIONS:
                        raise ValueError(f"{name}[{i}]={x!r} is not supported; allowed: "
                                         f"{', '.join(SUPPORTED_ROTATIONS)}")
                if len(set(r)) == 1:  # a uniform tuple is the plain value: one spelling per configuration
                    object.__setattr__(self, name, r[0])
            elif r not in SUPPORTED_ROTATIONS:
                raise ValueError(f"{name}={r!r} is not supported; allowed: {', '.join(SUPPORTED_ROTATIONS)} "
                                 f"or a per-layer tuple of them")
        if (isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int)
                or not 0 <= self.sink_tokens <= MAX_SINK_TOKENS):
            raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an integer in [0, {MAX_SINK_TOKENS}]")
        _check_choice("k_bits", self.k_bits, SUPPORTED_BITS)
        _check_choice("v_bits", self.v_bits, SUPPORTED_BITS)
        _check_choice("group_size", self.group_size, SUPPORTED_GROUP_SIZES)
        _check_choice("scale_dtype", self.scale_dtype, SUPPORTED_SCALE_DTYPES)
        _check_choice("key_grouping", self.key_grouping, SUPPORTED_KEY_GROUPINGS)
        if not _is_int(self.residual_length) or self.residual_length < 0:
            raise ValueError(f"residual_length={self.residual_length!r} must be an integer >= 0")
        if (not _is_int(self.block_size) or self.block_size <= 0
                or self.block_size % self.group_size != 0):
            raise ValueError(f"block_size={self.block_size!r} must be a positive multiple of "
                             f"group_size={self.group_size}")

    @property
    def window_capacity(self) -> int:
        """W = R + G - 1: rows of the window's ring (the most non-sink tokens held in full precision)."""
        return self.residual_length + self.group_size - 1

    @property
    def window_rows(self) -> int:
        """S + W: rows of a slot's full-precision window buffer (S sink rows, then the ring)."""
        return self.sink_tokens + self.window_capacity

    def window_row(self, t: int) -> int:
        """Window row of token t (a sink or a token in the ring)."""
        s = self.sink_tokens
        return t if t < s else s + (t - s) % self.window_capacity

    def window_rows_of(self, t0: int, t1: int) -> list[int]:
        """Window rows of tokens [t0, t1)."""
        return [self.window_row(t) for t in range(t0, t1)]

    def flush_point(self, k: int) -> int:
        """The k-th flush point S + R + kG (k >= 1): the length at which the k-th group is quantized."""
        return self.sink_tokens + self.residual_length + k * self.group_size

    def k_rotation_of(self, layer: int) -> str:
        return _rotation_of(self.k_rotation, layer, "k_rotation")

    def v_rotation_of(self, layer: int) -> str:
        return _rotation_of(self.v_rotation, layer, "v_rotation")

    @property
    def rotated(self) -> bool:
        """Whether any layer rotates K or V."""
        return any(x != "none" for r in (self.k_rotation, self.v_rotation) for x in
                   ((r,) if isinstance(r, str) else r))

    def for_layer(self, layer: int) -> KiviConfig:
        """This config with the rotations of one layer (what that layer's op node / plugin records)."""
        return dataclasses.replace(self, k_rotation=self.k_rotation_of(layer), v_rotation=self.v_rotation_of(layer))

    def check_num_layers(self, num_layers: int) -> None:
        """Per-layer rotation tuples must have one entry per layer of the model."""
        for name in ("k_rotation", "v_rotation"):
            r = getattr(self, name)
            if isinstance(r, tuple) and len(r) != num_layers:
                raise ValueError(f"{name} names {len(r)} layers but the model has num_layers={num_layers}")

    def value_group_size(self, head_dim: int) -> int:
        """Gv = min(G, head_dim): channels per value group."""
        return min(self.group_size, head_dim)

    def num_quantized(self, seq_len: int) -> int:
        """n_q(T) = max(0, floor((T - S - R) / G)) * G: tokens in the quantized store after T tokens (tokens
        [S, S + n_q))."""
        free = seq_len - self.sink_tokens - self.residual_length
        if free < 0:
            return 0
        return free // self.group_size * self.group_size

    def max_blocks_per_seq(self, max_seq_len: int) -> int:
        """Block-table width for sequences of up to max_seq_len tokens (at least 1)."""
        return max(1, math.ceil(self.num_quantized(max_seq_len) / self.block_size))

    def check_head_dim(self, head_dim: int) -> None:
        """The torch reference needs whole words and whole value groups per head."""
        if head_dim <= 0 or head_dim % 32 != 0:
            raise ValueError(f"head_dim={head_dim} must be a positive multiple of 32")
        if head_dim % self.value_group_size(head_dim) != 0:  # e.g. D=96 with G=64: no whole value groups
            raise ValueError(f"head_dim={head_dim} must be a multiple of group_size={self.group_size} when larger "
                             f"than it (value groups are min(G, head_dim) channels)")
        if self.rotated and head_dim & (head_dim - 1):
            raise ValueError(f"head_dim={head_dim} has no Sylvester Hadamard matrix (a power of 2 is needed); use "
                             f"k_rotation/v_rotation='none'")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("k_rotation", "v_rotation"):
            if isinstance(d[name], tuple):
                d[name] = list(d[name])  # JSON
        return d

    @classmethod
    def from_dict(cls, d: dict) -> KiviConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KiviConfig fields {unknown}; allowed: {sorted(known)}")
        return cls(**d)


def _rotation_of(r: str | tuple[str, ...], layer: int, name: str) -> str:
    if isinstance(r, str):
        return r
    if not 0 <= layer < len(r):
        raise ValueError(f"layer {layer} has no {name} entry (the config names {len(r)} layers)")
    return r[layer]


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of a model: what the cache and the op are shaped by."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")


# ---------------------------------------------------------------------------------------------- buffer layouts


def buffer_shapes(cfg: KiviConfig, num_kv_heads: int, head_dim: int, num_blocks: int,
                  num_slots: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's cache buffers, in BUFFER_NAMES order."""
    cfg.check_head_dim(head_dim)
    bs, g = cfg.block_size, cfg.group_size
    gv = cfg.value_group_size(head_dim)
    kpw, vpw = codes_per_word(cfg.k_bits), codes_per_word(cfg.v_bits)
    if cfg.key_grouping == "per_channel":
        k_codes = (num_blocks, num_kv_heads, bs // kpw, head_dim)
        k_scale = (num_blocks, num_kv_heads, bs // g, head_dim)
    else:  # per-token keys (naive control) are stored like values
        k_codes = (num_blocks, num_kv_heads, bs, head_dim // kpw)
        k_scale = (num_blocks, num_kv_heads, bs, head_dim // gv)
    w = cfg.window_rows
    return {
        "k_codes": k_codes,
        "k_scale": k_scale,
        "k_zero": k_scale,
        "v_codes": (num_blocks, num_kv_heads, bs, head_dim // vpw),
        "v_scale": (num_blocks, num_kv_heads, bs, head_dim // gv),
        "v_zero": (num_blocks, num_kv_heads, bs, head_dim // gv),
        "k_window": (num_slots, num_kv_heads, w, head_dim),
        "v_window": (num_slots, num_kv_heads, w, head_dim),
    }


def buffer_dtypes(cfg: KiviConfig, act_dtype: str) -> dict[str, str]:
    """Dtype names of one layer's cache buffers (act_dtype: float16, bfloat16 or float32)."""
    _check_choice("act_dtype", act_dtype, DTYPE_NAMES)
    sz = cfg.scale_dtype
    return {"k_codes": WORD_DTYPE, "k_scale": sz, "k_zero": sz, "v_codes": WORD_DTYPE, "v_scale": sz,
            "v_zero": sz, "k_window": act_dtype, "v_window": act_dtype}


# ---------------------------------------------------------------------------------------------- byte counts


def quantized_bytes_per_token(cfg: KiviConfig, num_kv_heads: int, head_dim: int) -> float:
    """Bytes one token adds to the quantized store of one layer: codes + scales/zeros (K and V)."""
    sz = DTYPE_BYTES[cfg.scale_dtype]
    gv = cfg.value_group_size(head_dim)
    codes = num_kv_heads * head_dim * (cfg.k_bits + cfg.v_bits) / 8
    if cfg.key_grouping == "per_channel":
        k_meta = num_kv_heads * head_dim / cfg.group_size * 2 * sz
    else:
        k_meta = num_kv_heads * head_dim / gv * 2 * sz
    v_meta = num_kv_heads * head_dim / gv * 2 * sz
    return codes + k_meta + v_meta


def pure_bits_bytes_per_token(cfg: KiviConfig, num_kv_heads: int, head_dim: int) -> float:
    """Bytes per token per layer counting only the codes (the 'pure bits' figure, no scales, no window)."""
    return num_kv_heads * head_dim * (cfg.k_bits + cfg.v_bits) / 8


def window_bytes(cfg: KiviConfig, num_kv_heads: int, head_dim: int, act_bytes: int = 2) -> int:
    """Bytes of one sequence's full-precision rows (K and V) in one layer: S sink rows + the ring of R + G - 1."""
    return 2 * cfg.window_rows * num_kv_heads * head_dim * act_bytes


def kivi_total_bytes(cfg: KiviConfig, geom: Geometry, seq_len: int, batch: int = 1, act_bytes: int = 2) -> int:
    """Honest KV bytes for `batch` sequences of `seq_len` tokens: whole blocks of the quantized store for the
    n_q(seq_len) quantized tokens, plus each sequence's window (S sink rows + ring) at full capacity, over all
    layers."""
    n_q = cfg.num_quantized(seq_len)
    blocks = math.ceil(n_q / cfg.block_size)
    per_block = quantized_bytes_per_token(cfg, geom.num_kv_heads, geom.head_dim) * cfg.block_size
    per_layer_seq = blocks * per_block + window_bytes(cfg, geom.num_kv_heads, geom.head_dim, act_bytes)
    return int(round(geom.num_layers * batch * per_layer_seq))


def dense_bytes_per_token(geom: Geometry, bytes_per_element: float) -> float:
    """2 x layers x kv_heads x head_dim x bytes: an unquantized cache (FP16: 2 bytes, FP8: 1 byte)."""
    return 2 * geom.num_layers * geom.num_kv_heads * geom.head_dim * bytes_per_element


# ---------------------------------------------------------------------------------------------- C header


def c_header() -> str:
    """The C/C++ view of this module (plugins/include/kiviFormat.h)."""
    bits = ", ".join(map(str, SUPPORTED_BITS))
    groups = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
    dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
    lines = [
        "// Generated by `python -m trtllm_kivi.format --header` from trtllm_kivi/format.py. Do not edit:",
        "// tests/test_format.py fails when this file and format.py disagree.",
        "#pragma once",
        "#include <cstdint>",
        "",
        "namespace trtllm_kivi",
        "{",
        f"constexpr int32_t kFORMAT_VERSION = {FORMAT_VERSION};",
        f"constexpr int32_t kWORD_BITS = {WORD_BITS}; // int32 words, LSB-first: code i at bits [i*b, (i+1)*b)",
        f"constexpr int32_t kSUPPORTED_BITS[] = {{{bits}}};",
        f"constexpr int32_t kSUPPORTED_GROUP_SIZES[] = {{{groups}}};",
        f"constexpr int32_t kSUPPORTED_HEAD_DIMS[] = {{{dims}}};",
        f"constexpr int32_t kMMA_TILE_TOKENS = {MMA_TILE_TOKENS}; // fragment order: 16-token tiles (format.py)",
        f"constexpr int32_t kFRAGMENT_LANES = {FRAGMENT_LANES};",
        f"constexpr uint32_t kONE_FP16 = 0x{ONE_FP16:04X}U; // fragment conversion: 1.0 | code << (10 - b)",
        f"constexpr uint32_t kONE_BF16 = 0x{ONE_BF16:04X}U; // 1.0 | code << (7 - b), b <= 4",
        f"constexpr int32_t kDEFAULT_K_BITS = {DEFAULT_K_BITS};",
        f"constexpr int32_t kDEFAULT_V_BITS = {DEFAULT_V_BITS};",
        f"constexpr int32_t kDEFAULT_GROUP_SIZE = {DEFAULT_GROUP_SIZE};",
        f"constexpr int32_t kDEFAULT_RESIDUAL_LENGTH = {DEFAULT_RESIDUAL_LENGTH};",
        f"constexpr int32_t kDEFAULT_BLOCK_SIZE = {DEFAULT_BLOCK_SIZE};",
        # kMAX_SINK_TOKENS and kROTATION_* live in kiviAttentionPlugin/kiviAttentionParams.h (checked against
        # MAX_SINK_TOKENS / SUPPORTED_ROTATIONS by tests/test_plugin_fields.py)
        f"constexpr int32_t kDEFAULT_SINK_TOKENS = {DEFAULT_SINK_TOKENS};",
        "",
        "// Scale/zero dtype codes (plugin field `scale_dtype`).",
    ]
    for i, name in enumerate(SUPPORTED_SCALE_DTYPES):
        lines.append(f"constexpr int32_t kSCALE_DTYPE_{name.upper()} = {i};")
    lines.append("// Key grouping codes (plugin field `key_grouping`).")
    for i, name in enumerate(SUPPORTED_KEY_GROUPINGS):
        lines.append(f"constexpr int32_t kKEY_GROUPING_{name.upper()} = {i};")
    lines.append("// Buffer order of the op's cache inputs/outputs.")
    for i, name in enumerate(BUFFER_NAMES):
        lines.append(f"constexpr int32_t kBUFFER_{name.upper()} = {i};")
    lines += [
        f"constexpr int32_t kNUM_BUFFERS = {len(BUFFER_NAMES)};",
        "",
        "constexpr int32_t codesPerWord(int32_t bits) { return kWORD_BITS / bits; }",
        "// Fragment order: words one lane owns in a 16-token tile (nw = D * bits / 64).",
        "constexpr int32_t fragmentWordsPerLane(int32_t headDim, int32_t bits) { return headDim * bits / 64; }",
        "// W = R + G - 1: rows of the window ring (token t >= S at row S + (t - S) % W).",
        "constexpr int32_t windowCapacity(int32_t residualLength, int32_t groupSize)",
        "{",
        "    return residualLength + groupSize - 1;",
        "}",
        "// n_q(T) = max(0, floor((T - R) / G)) * G (no sinks)",
        "constexpr int32_t numQuantized(int32_t seqLen, int32_t residualLength, int32_t groupSize)",
        "{",
        "    return seqLen < residualLength ? 0 : (seqLen - residualLength) / groupSize * groupSize;",
        "}",
        "// n_q(T) = max(0, floor((T - S - R) / G)) * G: tokens [S, S + n_q) are quantized",
        "constexpr int32_t numQuantized(int32_t seqLen, int32_t sinkTokens, int32_t residualLength, int32_t groupSize)",
        "{",
        "    return numQuantized(seqLen - sinkTokens, residualLength, groupSize);",
        "}",
        "// S + W rows per slot window: S sink rows, then the ring of W = R + G - 1",
        "constexpr int32_t windowRows(int32_t sinkTokens, int32_t residualLength, int32_t groupSize)",
        "{",
        "    return sinkTokens + windowCapacity(residualLength, groupSize);",
        "}",
        "// Window row of token t: t for a sink (t < S), else S + (t - S) % W",
        "constexpr int64_t windowRow(int64_t t, int32_t sinkTokens, int32_t residualLength, int32_t groupSize)",
        "{",
        "    return t < sinkTokens ? t : sinkTokens + (t - sinkTokens) % windowCapacity(residualLength, groupSize);",
        "}",
        "constexpr int32_t valueGroupSize(int32_t groupSize, int32_t headDim)",
        "{",
        "    return groupSize < headDim ? groupSize : headDim;",
        "}",
        "} // namespace trtllm_kivi",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--header", action="store_true", help="print the generated C header")
    args = p.parse_args(argv)
    if args.header:
        sys.stdout.write(c_header())
        return 0
    print(f"FORMAT_VERSION={FORMAT_VERSION}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
