"""`trtllm-kivi memory`: KV-cache memory of FP16, FP8 and KIVI for a model preset, a config.json or a geometry."""

from __future__ import annotations

import argparse
import json

from ..format import Geometry
from ..memory import (DEFAULT_PRESET, DEFAULT_SEQ_LEN, PRESETS, format_report, geometry_from_hf_config,
                      memory_report)
from . import flags

NAME = "memory"
HELP = "KV-cache memory calculator: FP16 vs FP8 vs KIVI (pure bits and honest total)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model (one of; default: --preset smollm2-135m)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a known model geometry")
    src.add_argument("--config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    src.add_argument("--layers", type=int, help="explicit geometry: number of layers (with --kv-heads, --head-dim)")
    src.add_argument("--kv-heads", type=int, help="explicit geometry: number of KV heads")
    src.add_argument("--head-dim", type=int, help="explicit geometry: head dimension")
    src.add_argument("--heads", type=int, help="explicit geometry: number of query heads (default: --kv-heads)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per sequence "
                   f"(default {DEFAULT_SEQ_LEN})")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    flags.add_kv(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON (exact byte counts)")


def _geometry(args: argparse.Namespace) -> tuple[Geometry, str]:
    explicit = [args.layers, args.kv_heads, args.head_dim, args.heads]
    given = sum(x is not None for x in (args.preset, args.config)) + any(x is not None for x in explicit)
    if given > 1:
        raise ValueError("give one of --preset, --config or --layers/--kv-heads/--head-dim, not several")
    if args.config:
        return geometry_from_hf_config(args.config), args.config
    if any(x is not None for x in explicit):
        if None in explicit[:3]:
            raise ValueError(f"explicit geometry needs --layers, --kv-heads and --head-dim; got layers="
                             f"{args.layers}, kv_heads={args.kv_heads}, head_dim={args.head_dim}")
        heads = args.heads if args.heads is not None else args.kv_heads
        return Geometry(args.layers, heads, args.kv_heads, args.head_dim), "custom geometry"
    preset = PRESETS[args.preset or DEFAULT_PRESET]
    return preset.geometry, f"{preset.description} [preset {preset.name}]"


def run(args: argparse.Namespace) -> int:
    geom, model = _geometry(args)
    cfg = flags.kv_spec(args, needs_kivi="the calculator (it compares FP16 and FP8 with a KIVI cache)").kivi
    assert cfg is not None  # needs_kivi
    report = memory_report(geom, cfg, args.seq_len, args.batch, model)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
