"""The KiviAttention op's contract: what every implementation and every graph agrees on.

- identity: PLUGIN_NAME / PLUGIN_VERSION / PLUGIN_NAMESPACE (the TensorRT plugin, the ONNX node's op type + domain);
- fields: FIELDS, the one list of int32 plugin fields = ONNX node attributes (the C++ creator parses the same list,
  plugins/kiviAttentionPlugin/fields.json is its machine-readable copy); plugin_fields / config_from_fields;
- the graph's I/O: STEP_INPUTS (the per-step inputs besides the cache), cache_io_names (past.* / present.*) and
  status_name (status.*: the plugin's error bits of each layer, STATUS_OUTPUT / STATUS_BITS / describe_status);
- ExportSpec (what a graph is built for) and GraphInfo (everything a runner needs to drive a graph: KIVI config,
  geometry, maxima, vocabulary), which a build folder's build_config.json records once;
- check_format_version: the one FORMAT_VERSION check, for graphs, build folders and libraries;
- find_library: the one finder of the native libraries (TensorRT plugin, CUDA kernels, CPU kernels).

Standard library only (the CUDA bindings import it on a GPU machine without our venv); builder and runtime import
it, never each other.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .format import (FORMAT_VERSION, MAX_SINK_TOKENS, SUPPORTED_KEY_GROUPINGS, SUPPORTED_ROTATIONS,
                     SUPPORTED_SCALE_DTYPES, BUFFER_NAMES, Geometry, KiviConfig, canonical_dtype)

PLUGIN_NAME = "KiviAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "trtllm_kivi"
DOMAIN = PLUGIN_NAMESPACE  # ONNX custom-op domain of the KiviAttention nodes
OPSET = 18  # the default-domain opset of exported graphs

# The sink and rotation format options (FORMAT_VERSION 2) as plugin fields. The op is rotation-agnostic (rotation is
# applied in the graph): the codes only record the format of this layer's cache, so a rotated cache is never read
# unrotated.
ROTATIONS = SUPPORTED_ROTATIONS  # k_rotation / v_rotation codes 0, 1 (format.py; MAX_SINK_TOKENS too)


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
    PluginField("sink_tokens", f"S: tokens [0, S) of each sequence kept in full precision (0..{MAX_SINK_TOKENS})"),
    PluginField("k_rotation", "rotation of this layer's cached keys: " + ", ".join(
        f"{i}={n}" for i, n in enumerate(ROTATIONS))),
    PluginField("v_rotation", "rotation of this layer's cached values: " + ", ".join(
        f"{i}={n}" for i, n in enumerate(ROTATIONS))),
    PluginField("format_version", "storage format version the engine was built for"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)


def plugin_fields(cfg: KiviConfig, num_heads: int, num_kv_heads: int, head_dim: int, layer: int = 0
                  ) -> dict[str, int]:
    """KiviConfig + geometry -> plugin fields / ONNX node attributes (all int32), in FIELDS order, for the node of
    `layer`: its k_rotation / v_rotation codes (rotation is per layer, for K and V separately; format.py)."""
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
        "k_rotation": ROTATIONS.index(cfg.k_rotation_of(layer)),
        "v_rotation": ROTATIONS.index(cfg.v_rotation_of(layer)),
        "format_version": FORMAT_VERSION,
    }


def config_from_fields(fields: dict[str, int]) -> tuple[KiviConfig, int, int, int]:
    """Inverse of plugin_fields -> (cfg, num_heads, num_kv_heads, head_dim), cfg with that node's layer's rotations
    as plain values; refuses missing/unknown fields and a format version other than this package's."""
    missing = [n for n in FIELD_NAMES if n not in fields]
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if missing or unknown:
        raise ValueError(f"KiviAttention fields: missing {missing}, unknown {unknown}; expected {list(FIELD_NAMES)}")
    check_format_version(fields["format_version"], "KiviAttention field format_version")
    for name, allowed in (("scale_dtype", SUPPORTED_SCALE_DTYPES), ("key_grouping", SUPPORTED_KEY_GROUPINGS),
                          ("k_rotation", ROTATIONS), ("v_rotation", ROTATIONS)):
        if not 0 <= fields[name] < len(allowed):
            raise ValueError(f"{name}={fields[name]} is not supported; allowed: 0..{len(allowed) - 1} "
                             f"({', '.join(allowed)})")
    cfg = KiviConfig(k_bits=fields["k_bits"], v_bits=fields["v_bits"], group_size=fields["group_size"],
                     residual_length=fields["residual_length"], block_size=fields["block_size"],
                     scale_dtype=SUPPORTED_SCALE_DTYPES[fields["scale_dtype"]],
                     key_grouping=SUPPORTED_KEY_GROUPINGS[fields["key_grouping"]],
                     sink_tokens=fields["sink_tokens"], k_rotation=ROTATIONS[fields["k_rotation"]],
                     v_rotation=ROTATIONS[fields["v_rotation"]])  # validates sink_tokens, naming it
    Geometry(1, fields["num_heads"], fields["num_kv_heads"], fields["head_dim"])
    cfg.check_head_dim(fields["head_dim"])
    return cfg, fields["num_heads"], fields["num_kv_heads"], fields["head_dim"]


def rotations_from_fields(fields: dict[str, int]) -> tuple[str, str]:
    """(k_rotation, v_rotation) names of one node's fields; refuses codes outside ROTATIONS by name."""
    for name in ("k_rotation", "v_rotation"):
        if not 0 <= fields[name] < len(ROTATIONS):
            raise ValueError(f"{name}={fields[name]} is not supported; allowed: "
                             + ", ".join(f"{i} ({n})" for i, n in enumerate(ROTATIONS)))
    return ROTATIONS[fields["k_rotation"]], ROTATIONS[fields["v_rotation"]]


def check_format_version(found: object, what: str) -> None:
    """The one FORMAT_VERSION check: raise ValueError naming `what` and both versions on a mismatch."""
    if found != FORMAT_VERSION:
        raise ValueError(f"{what} has format_version={found!r} but this trtllm_kivi uses FORMAT_VERSION="
                         f"{FORMAT_VERSION}; rebuild it with this version")


# ---------------------------------------------------------------------------------------------- graph I/O

# Per-step graph inputs besides the cache, in graph order (shapes in builder/onnx_export.py's docstring).
STEP_INPUTS = ("input_ids", "positions", "slot_ids", "past_len", "chunk_len", "block_table", "logit_rows")
LOGITS = "logits"


def cache_io_names(layer: int) -> tuple[list[str], list[str]]:
    """(past.*, present.*) tensor names of one layer, in BUFFER_NAMES order."""
    return [f"past.{layer}.{n}" for n in BUFFER_NAMES], [f"present.{layer}.{n}" for n in BUFFER_NAMES]


# The plugin's output after `out` and the cache buffers: status, int32 [1], the OR of the kernels' KiviErrorBits
# over the step's sequences (plugins/kernels/include/kiviParams.h). Nonzero: the flagged sequences were skipped.
STATUS_OUTPUT = "status"
STATUS_BITS = {1: "length (past_len/chunk_len negative or past the step's rows)",
               2: "capacity (past_len + chunk_len beyond the block table or max_seq_len)",
               4: "slot id outside [0, num_slots)", 8: "block id outside [0, num_blocks)"}


def status_name(layer: int) -> str:
    """The graph output carrying one layer's KiviAttention status (STATUS_OUTPUT)."""
    return f"{STATUS_OUTPUT}.{layer}"


def describe_status(bits: int) -> str:
    """KiviErrorBits -> 'length (...), slot id ...' (unknown bits named by value)."""
    names = [name for bit, name in STATUS_BITS.items() if bits & bit]
    rest = bits & ~sum(STATUS_BITS)
    return ", ".join(names + ([f"unknown bits {rest:#x}"] if rest else [])) or "none"


GRAPH_DTYPES = ("float16", "bfloat16", "float32")  # activation dtypes a graph can be built for


@dataclass(frozen=True)
class ExportSpec:
    """What a graph is built for: its activation dtype and the maxima of its dynamic dimensions."""

    dtype: str  # activation dtype of the graph
    max_batch_size: int  # sequences per step = cache slots
    max_seq_len: int  # tokens per sequence
    max_num_tokens: int  # tokens per step (all sequences)

    def __post_init__(self) -> None:
        if self.dtype not in GRAPH_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: {', '.join(GRAPH_DTYPES)}")
        for name, lo in (("max_batch_size", 1), ("max_seq_len", 1), ("max_num_tokens", self.max_batch_size)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}={v!r} must be an integer >= {lo}")

    def max_blocks_per_seq(self, cfg: KiviConfig) -> int:
        """Block-table width (KiviConfig.max_blocks_per_seq, as KiviCache allocates)."""
        return cfg.max_blocks_per_seq(self.max_seq_len)

    def num_blocks(self, cfg: KiviConfig) -> int:
        """Blocks in each layer's pool: every slot can reach max_seq_len."""
        return self.max_batch_size * self.max_blocks_per_seq(cfg)


@dataclass(frozen=True)
class GraphInfo:
    """Everything a runner needs to drive an exported graph or engine; recorded once in build_config.json."""

    kivi: KiviConfig
    geometry: Geometry
    spec: ExportSpec
    vocab_size: int

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks(self.kivi)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.spec.max_blocks_per_seq(self.kivi)

    def fields(self, layer: int = 0) -> dict[str, int]:
        """The KiviAttention node attributes / plugin fields of a layer (they differ only in the rotation codes)."""
        g = self.geometry
        self.kivi.check_num_layers(g.num_layers)
        return plugin_fields(self.kivi, g.num_heads, g.num_kv_heads, g.head_dim, layer)

    def to_dict(self) -> dict:
        return {"kivi_config": self.kivi.to_dict(), "geometry": dataclasses.asdict(self.geometry),
                "maxima": {**{k: v for k, v in dataclasses.asdict(self.spec).items() if k != "dtype"},
                           "max_blocks_per_seq": self.max_blocks_per_seq, "num_blocks": self.num_blocks},
                "dtype": self.spec.dtype, "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, d: dict) -> GraphInfo:
        m = d["maxima"]
        info = cls(KiviConfig.from_dict(d["kivi_config"]), Geometry(**d["geometry"]),
                   ExportSpec(canonical_dtype(d["dtype"]), m["max_batch_size"], m["max_seq_len"],
                              m["max_num_tokens"]), int(d["vocab_size"]))
        for key in ("max_blocks_per_seq", "num_blocks"):  # derived values: a disagreement means another format
            if key in m and m[key] != getattr(info, key):
                raise ValueError(f"build config {key}={m[key]} disagrees with {getattr(info, key)} derived from "
                                 f"its KIVI config and maxima")
        return info

    def check_node_fields(self, fields: dict[str, int], where: str, layer: int = 0) -> None:
        """A graph's node attributes must be exactly what this info derives (one source of truth)."""
        want = self.fields(layer)  # a cache written rotated is never read unrotated
        bad = {k: (fields.get(k), v) for k, v in want.items() if fields.get(k) != v}
        if bad:
            detail = ", ".join(f"{k}: graph {a!r} vs build config {b!r}" for k, (a, b) in bad.items())
            raise ValueError(f"{where}: KiviAttention node attributes disagree with the build config ({detail})")


# ---------------------------------------------------------------------------------------------- native libraries

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO_ROOT / "build" / "plugins"  # where build_scripts/build_plugin.sh puts the libraries


def library_candidates(name: str, env_var: str) -> list[Path]:
    """Where find_library looks for `name`, in order: $env_var, build/plugins/ of the source tree, trtllm_kivi/lib/
    (a packaged copy)."""
    env = os.environ.get(env_var)
    return ([Path(env)] if env else []) + [BUILD_DIR / name, Path(__file__).resolve().parent / "lib" / name]


def find_library(name: str, env_var: str, path: str | os.PathLike | None = None, build_hint: str = "") -> Path:
    """The native library `name`: `path` if given, else the first of library_candidates() that exists. Raises
    FileNotFoundError naming every searched path and how to build it."""
    searched = [Path(path)] if path is not None else library_candidates(name, env_var)
    for p in searched:
        if p.is_file():
            return p
    raise FileNotFoundError(f"{name} not found; searched: {', '.join(map(str, searched))}. "
                            f"{build_hint or 'Build it with build_scripts/build_plugin.sh'} or set {env_var}")


__all__ = ["PLUGIN_NAME", "PLUGIN_VERSION", "PLUGIN_NAMESPACE", "DOMAIN", "OPSET", "PluginField", "FIELDS",
           "FIELD_NAMES", "ROTATIONS", "MAX_SINK_TOKENS", "plugin_fields", "config_from_fields",
           "rotations_from_fields", "check_format_version", "STEP_INPUTS", "LOGITS", "cache_io_names",
           "STATUS_OUTPUT", "STATUS_BITS", "status_name", "describe_status", "GRAPH_DTYPES", "ExportSpec",
           "GraphInfo", "library_candidates", "find_library"]
