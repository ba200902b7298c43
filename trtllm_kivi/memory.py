"""KV-cache memory calculator: FP16, FP8 and KIVI for a model geometry, sequence length and batch.

The dense figure is the usual 2 x layers x kv_heads x head_dim x seq_len x bytes (K and V). For KIVI three figures
are given, all from format.py's formulas:
  - pure bits:   only the codes (k_bits + v_bits per element), the figure papers quote;
  - store:       codes + the scale/zero of every group, per quantized token (the asymptotic cost);
  - total:       what a cache really holds for `batch` sequences of `seq_len` tokens (format.kivi_total_bytes):
                 the quantized store in whole blocks + each sequence's full-precision rows (S sink rows + the
                 ring of R + G - 1 tokens). Rotation costs no bytes (it is applied outside the cache).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from . import format as fmt
from .format import Geometry, KiviConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    geometry: Geometry


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("smollm2-135m", "SmolLM2-135M (the built-in model)", Geometry(30, 9, 3, 64)),
    Preset("llama-2-7b", "Llama-2-7B (MHA)", Geometry(32, 32, 32, 128)),
    Preset("llama-2-70b", "Llama-2-70B (GQA 8)", Geometry(80, 64, 8, 128)),
    Preset("llama-3-8b", "Llama-3-8B / 3.1-8B (GQA 8)", Geometry(32, 32, 8, 128)),
    Preset("llama-3-70b", "Llama-3-70B / 3.1-70B (GQA 8)", Geometry(80, 64, 8, 128)),
]}
DEFAULT_PRESET = "smollm2-135m"
DEFAULT_SEQ_LEN = 8192


def geometry_from_hf_config(path: str | Path) -> Geometry:
    """Geometry of a Hugging Face config.json (Llama-style keys; head_dim defaults to hidden_size // heads)."""
    path = Path(path)
    cfg = json.loads(path.read_text())
    if "text_config" in cfg:  # multimodal wrappers keep the language model's geometry here
        cfg = cfg["text_config"]
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{path}: config has no {missing}; need num_hidden_layers, num_attention_heads and "
                         f"head_dim or hidden_size")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if "hidden_size" not in cfg:
            raise ValueError(f"{path}: config has neither head_dim nor hidden_size")
        head_dim = cfg["hidden_size"] // heads
    return Geometry(cfg["num_hidden_layers"], heads, kv_heads, head_dim)


@dataclass(frozen=True)
class Row:
    """One storage option: bytes per token (all layers, K and V) and total bytes for the whole batch."""

    name: str
    bytes_per_token: float
    total_bytes: int
    ratio_vs_fp16: float  # FP16 bytes / these bytes: how many times smaller


@dataclass(frozen=True)
class MemoryReport:
    model: str
    geometry: Geometry
    kivi: KiviConfig
    seq_len: int
    batch: int
    rows: dict[str, Row]  # keys: fp16, fp8, kivi_pure_bits, kivi_store, kivi_total

    def to_dict(self) -> dict:
        return {"model": self.model, "geometry": asdict(self.geometry), "kivi": self.kivi.to_dict(),
                "seq_len": self.seq_len, "batch": self.batch,
                "rows": {k: asdict(r) for k, r in self.rows.items()}}


def memory_report(geom: Geometry, cfg: KiviConfig, seq_len: int, batch: int = 1, model: str = "custom"
                  ) -> MemoryReport:
    """The KV bytes of `batch` sequences of `seq_len` tokens, dense and KIVI (formulas from format.py)."""
    if seq_len <= 0 or batch <= 0:
        raise ValueError(f"seq_len={seq_len} and batch={batch} must be >= 1")
    cfg.check_head_dim(geom.head_dim)
    tokens = seq_len * batch
    L, hkv, d = geom.num_layers, geom.num_kv_heads, geom.head_dim
    per_token = {
        "fp16": fmt.dense_bytes_per_token(geom, 2),
        "fp8": fmt.dense_bytes_per_token(geom, 1),
        "kivi_pure_bits": L * fmt.pure_bits_bytes_per_token(cfg, hkv, d),  # format's figure is per layer
        "kivi_store": L * fmt.quantized_bytes_per_token(cfg, hkv, d),
    }
    totals = {k: int(round(v * tokens)) for k, v in per_token.items()}
    totals["kivi_total"] = fmt.kivi_total_bytes(cfg, geom, seq_len, batch)
    per_token["kivi_total"] = totals["kivi_total"] / tokens
    rows = {k: Row(k, per_token[k], totals[k], totals["fp16"] / totals[k]) for k in totals}
    return MemoryReport(model, geom, cfg, seq_len, batch, rows)


def _size(n: float) -> str:
    """Decimal units (1 GB = 1e9 bytes), as model cards and the KV-cache formula are usually quoted."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def format_report(r: MemoryReport) -> str:
    """Human-readable table (decimal units: 1 GB = 1e9 bytes)."""
    g, c = r.geometry, r.kivi
    bits = f"{c.k_bits}" if c.k_bits == c.v_bits else f"K{c.k_bits}/V{c.v_bits}"
    labels = {
        "fp16": "FP16",
        "fp8": "FP8",
        "kivi_pure_bits": f"KIVI-{bits} pure bits (codes only)",
        "kivi_store": f"KIVI-{bits} codes + scales/zeros",
        "kivi_total": f"KIVI-{bits} total (+ window, whole blocks)",
    }
    n_q = c.num_quantized(r.seq_len)
    lines = [
        f"{r.model}: {g.num_layers} layers, {g.num_heads} heads, {g.num_kv_heads} KV heads, head_dim {g.head_dim}",
        f"KV cache for {r.batch} x {r.seq_len:,} tokens; KIVI k_bits={c.k_bits} v_bits={c.v_bits} "
        f"group_size={c.group_size} residual_length={c.residual_length} block_size={c.block_size} "
        f"scale_dtype={c.scale_dtype} sink_tokens={c.sink_tokens}",
        "",
        f"{'':42s}{'bytes/token':>14s}{'total':>14s}{'vs FP16':>10s}",
    ]
    for key, row in r.rows.items():
        lines.append(f"{labels[key]:42s}{_num(row.bytes_per_token):>14s}{_size(row.total_bytes):>14s}"
                     f"{row.ratio_vs_fp16:>9.2f}x")
    lines += [
        "",
        f"bytes/token: all {g.num_layers} layers, K and V. 'vs FP16' = FP16 bytes / these bytes.",
        f"KIVI total: {n_q:,} of {r.seq_len:,} tokens per sequence quantized (n_q = floor((T - S - R) / G) * G), "
        f"the rest in full-precision fp16 rows: S = {c.sink_tokens} sinks + a ring of R + G - 1 = "
        f"{c.window_capacity}; "
        f"blocks of {c.block_size} tokens allocated whole.",
    ]
    return "\n".join(lines)
