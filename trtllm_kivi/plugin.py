"""The KiviAttention TensorRT plugin as Python sees it: identity, the one field list (ONNX node attributes =
TensorRT plugin fields) and the library loader.

The same fields, in the same order, are what the C++ creator parses at build time and what the plugin serializes
(getFieldsToSerialize); plugins/kiviAttentionPlugin/fields.json is the machine-readable copy a CPU test checks.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from .format import (FORMAT_VERSION, MAX_SINK_TOKENS, SUPPORTED_KEY_GROUPINGS, SUPPORTED_ROTATIONS,
                     SUPPORTED_SCALE_DTYPES, Geometry, KiviConfig)

PLUGIN_NAME = "KiviAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "trtllm_kivi"


@dataclass(frozen=True)
class PluginField:
    name: str
    doc: str


# Every field is an int32 scalar (kINT32, length 1). Order is the serialization order.
FIELDS = (
    PluginField("num_heads", "query heads H"),
    PluginField("num_kv_heads", "KV heads Hkv (H % Hkv == 0)"),
    PluginField("head_dim", "channels per head D"),
    PluginField("k_bits", "bits per key code"),
    PluginField("v_bits", "bits per value code"),
    PluginField("group_size", "G: tokens per key group, channels per value group (min(G, D))"),
    PluginField("residual_length", "R: minimum full-precision window"),
    PluginField("block_size", "tokens per block of the quantized store"),
    PluginField("scale_dtype", "scale/zero dtype code: " + ", ".join(
        f"{i}={n}" for i, n in enumerate(SUPPORTED_SCALE_DTYPES))),
    PluginField("key_grouping", "key grouping code: " + ", ".join(
        f"{i}={n}" for i, n in enumerate(SUPPORTED_KEY_GROUPINGS))),
    PluginField("sink_tokens", f"S: the first S tokens stay in full precision (0..{MAX_SINK_TOKENS})"),
    PluginField("k_rotation", "rotation of this node's layer's K (applied outside the op): " + ", ".join(
        f"{i}={n}" for i, n in enumerate(SUPPORTED_ROTATIONS))),
    PluginField("v_rotation", "rotation of this node's layer's V (applied outside the op): " + ", ".join(
        f"{i}={n}" for i, n in enumerate(SUPPORTED_ROTATIONS))),
    PluginField("format_version", "storage format version the engine was built for"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)


def plugin_fields(cfg: KiviConfig, num_heads: int, num_kv_heads: int, head_dim: int, layer: int = 0
                  ) -> dict[str, int]:
    """KiviConfig + geometry -> plugin fields / ONNX node attributes (all int32), in FIELDS order, for the node of
    `layer` (its k_rotation / v_rotation codes)."""
    Geometry(1, num_heads, num_kv_heads, head_dim)  # validates the geometry
    cfg.check_head_dim(head_dim)
    return {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "k_bits": cfg.k_bits,
        "v_bits": cfg.v_bits,
        "group_size": cfg.group_size,
        "residual_length": cfg.residual_length,
        "block_size": cfg.block_size,
        "scale_dtype": SUPPORTED_SCALE_DTYPES.index(cfg.scale_dtype),
        "key_grouping": SUPPORTED_KEY_GROUPINGS.index(cfg.key_grouping),
        "sink_tokens": cfg.sink_tokens,
        "k_rotation": SUPPORTED_ROTATIONS.index(cfg.k_rotation_of(layer)),
        "v_rotation": SUPPORTED_ROTATIONS.index(cfg.v_rotation_of(layer)),
        "format_version": FORMAT_VERSION,
    }


def config_from_fields(fields: dict[str, int]) -> tuple[KiviConfig, int, int, int]:
    """Inverse of plugin_fields -> (cfg, num_heads, num_kv_heads, head_dim), cfg with that node's layer's rotations
    as plain values; refuses missing/unknown fields and a format version other than this package's."""
    missing = [n for n in FIELD_NAMES if n not in fields]
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if missing or unknown:
        raise ValueError(f"KiviAttention fields: missing {missing}, unknown {unknown}; expected {list(FIELD_NAMES)}")
    if fields["format_version"] != FORMAT_VERSION:
        raise ValueError(f"KiviAttention format_version={fields['format_version']} does not match this build's "
                         f"FORMAT_VERSION={FORMAT_VERSION}")
    for name, allowed in (("scale_dtype", SUPPORTED_SCALE_DTYPES), ("key_grouping", SUPPORTED_KEY_GROUPINGS),
                          ("k_rotation", SUPPORTED_ROTATIONS), ("v_rotation", SUPPORTED_ROTATIONS)):
        if not 0 <= fields[name] < len(allowed):
            raise ValueError(f"{name}={fields[name]} is not supported; allowed: 0..{len(allowed) - 1} "
                             f"({', '.join(allowed)})")
    cfg = KiviConfig(k_bits=fields["k_bits"], v_bits=fields["v_bits"], group_size=fields["group_size"],
                     residual_length=fields["residual_length"], block_size=fields["block_size"],
                     scale_dtype=SUPPORTED_SCALE_DTYPES[fields["scale_dtype"]],
                     key_grouping=SUPPORTED_KEY_GROUPINGS[fields["key_grouping"]],
                     sink_tokens=fields["sink_tokens"], k_rotation=SUPPORTED_ROTATIONS[fields["k_rotation"]],
                     v_rotation=SUPPORTED_ROTATIONS[fields["v_rotation"]])
    Geometry(1, fields["num_heads"], fields["num_kv_heads"], fields["head_dim"])
    cfg.check_head_dim(fields["head_dim"])
    return cfg, fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]


# ---------------------------------------------------------------------------------------------- plugin library

PLUGIN_LIBRARY_NAME = "libtrtllm_kivi_plugin.so"
PLUGIN_LIBRARY_ENV = "TRTLLM_KIVI_PLUGIN_LIB"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def plugin_library_candidates() -> list[Path]:
    """Where find_plugin_library looks, in order: $TRTLLM_KIVI_PLUGIN_LIB, build_scripts/build_plugin.sh's default
    build directory, a library packaged next to this module."""
    paths = []
    if os.environ.get(PLUGIN_LIBRARY_ENV):
        paths.append(Path(os.environ[PLUGIN_LIBRARY_ENV]))
    paths.append(_REPO_ROOT / "build" / "plugins" / PLUGIN_LIBRARY_NAME)
    paths.append(Path(__file__).resolve().parent / "lib" / PLUGIN_LIBRARY_NAME)
    return paths


def find_plugin_library(path: str | os.PathLike | None = None) -> Path:
    """The KiviAttention plugin library: `path` if given, else the first of plugin_library_candidates() that
    exists. Raises FileNotFoundError naming every searched path."""
    searched = [Path(path)] if path is not None else plugin_library_candidates()
    for p in searched:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{PLUGIN_LIBRARY_NAME} not found; searched: {', '.join(map(str, searched))}. Build it with "
        f"`build_scripts/build_plugin.sh --tensorrt-root DIR` (needs TensorRT headers) or set {PLUGIN_LIBRARY_ENV}")


def load_plugin_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load the plugin library (ctypes, RTLD_GLOBAL) and check its FORMAT_VERSION.

    If TensorRT is in the process (the tensorrt module, or libnvinfer), the library registers its creator on load;
    `import tensorrt` is attempted first for that. Engines loaded through IPluginRegistry::loadLibrary (trtexec
    --dynamicPlugins) use the library's getCreators instead and do not need this function."""
    lib_path = find_plugin_library(path)
    try:
        import tensorrt  # noqa: F401  (loads libnvinfer first, so the library's load-time registration finds it)
    except ImportError:
        pass  # without TensorRT the library still loads (nothing to register with)
    lib = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
    lib.kiviGetFormatVersion.restype = ctypes.c_int32
    lib.kiviGetFormatVersion.argtypes = []
    version = lib.kiviGetFormatVersion()
    if version != FORMAT_VERSION:
        raise ValueError(f"{lib_path} was built for FORMAT_VERSION={version} but this trtllm_kivi uses "
                         f"FORMAT_VERSION={FORMAT_VERSION}; rebuild it with build_scripts/build_plugin.sh")
    return lib
