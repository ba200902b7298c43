"""Compile an exported graph into a TensorRT engine — with NVIDIA's TensorRT or TensorRT-RTX, whichever trtllm_kivi.trt
finds — or, without either, the trtexec command that does it on a TensorRT machine.

The engine: a strongly typed network (the graph's explicit dtypes and Casts decide every precision) parsed by the ONNX
parser, which maps each `trtllm_kivi::KiviAttention` node to the registered plugin of that name (attributes = plugin
fields, plugin_version/plugin_namespace select it; attributes the creator does not list are not passed on, so
check_graph_nodes refuses them first); the plugin's cache outputs alias its inputs (IPluginV3OneBuildV2::
getAliasedInput, enabled by PreviewFeature.ALIASED_PLUGIN_IO_10_03); version-compatible, with the plugin library
serialized into it (plugins_to_serialize). TensorRT-RTX builds without a GPU for named compute capabilities; the
builder never looks at the plugin's own GPU code, so plan_engine checks the library's compiled architectures
against the targets and refuses a mismatch. What the plugin cannot run (engine_unsupported) is refused before
TensorRT, naming the option; a refusal inside TensorRT surfaces as the plugin's own message.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..format import SUPPORTED_HEAD_DIMS, KiviConfig
from ..op import FIELD_NAMES, PLUGIN_NAME, ExportSpec, GraphInfo
from ..trt import (RTX_INSTALL_HINT, CompiledArchs, TensorRT, TensorRTUnavailable, compiled_archs, find_plugins,
                   find_tensorrt, parse_compute_capability, uncovered_targets)

ACTIVATION_DTYPES = ("float16", "bfloat16")  # the plugin's activation types (fields.json activation_dtypes)
MAX_GQA_RATIO = 16  # num_heads / num_kv_heads the kernels run (kMAX_TILE_ROWS)
MIN_KERNEL_CC = "8.0"  # the attention kernel is mma.sync bf16 + cp.async: the launcher refuses older GPUs
# Targets of a TensorRT-RTX build on a machine without a GPU: every TensorRT-RTX target the kernels run on.
DEFAULT_RTX_TARGETS = ("8.0", "8.6", "8.9", "12.0", "12.1")
NODE_ATTRIBUTES = (*FIELD_NAMES, "plugin_version", "plugin_namespace")
TENSORRT_MODES = ("auto", "on", "off")


class EngineUnavailable(RuntimeError):
    """No engine can be built here for this graph; the message says why (and, where it can, how to fix it)."""


def engine_unsupported(info: GraphInfo) -> str | None:
    """Why the KiviAttention plugin cannot run this graph's configuration, naming the option (None: it can)."""
    g, kivi = info.geometry, info.kivi
    if info.spec.dtype not in ACTIVATION_DTYPES:
        return (f"dtype {info.spec.dtype}: the KiviAttention plugin's activations are "
                f"{' or '.join(ACTIVATION_DTYPES)} (--dtype)")
    if g.head_dim not in SUPPORTED_HEAD_DIMS:
        return (f"head_dim={g.head_dim}: the KiviAttention plugin's kernels are built for head_dim "
                f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if g.num_heads // g.num_kv_heads > MAX_GQA_RATIO:
        return (f"num_heads/num_kv_heads={g.num_heads // g.num_kv_heads}: the KiviAttention kernels run 1.."
                f"{MAX_GQA_RATIO} query heads per KV head")
    if kivi.key_grouping != "per_channel":
        return (f"key_grouping={kivi.key_grouping}: the KiviAttention kernels quantize keys per_channel only "
                f"(per_token keys run in the torch reference)")
    return None


def check_graph_nodes(onnx_path: str | Path) -> int:
    """Every KiviAttention node carries exactly the plugin's fields (+ plugin_version/plugin_namespace): the parser
    passes on only the fields the creator lists, so an unknown attribute would vanish and a missing one would be the
    plugin's concern. Returns the number of nodes; raises ValueError naming the node and the attribute."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == PLUGIN_NAME]
    for n in nodes:
        names = [a.name for a in n.attribute]
        unknown = [a for a in names if a not in NODE_ATTRIBUTES]
        missing = [a for a in FIELD_NAMES if a not in names]
        if unknown or missing:
            raise ValueError(f"{onnx_path}: {PLUGIN_NAME} node {n.name!r}: "
                             + "; ".join(([f"unknown attribute(s) {', '.join(unknown)}"] if unknown else [])
                                         + ([f"missing field(s) {', '.join(missing)}"] if missing else []))
                             + f"; the plugin's fields: {', '.join(FIELD_NAMES)}")
    return len(nodes)


def gpu_compute_capability() -> str | None:
    """The compute capability of the GPU here ('9.0'), None without one (torch's view)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def resolve_targets(t: TensorRT, requested: list[str] | None, gpu: str | None) -> tuple[list[str], str]:
    """(targets, how they were chosen). TensorRT-RTX: the requested ones, else the GPU here, else
    DEFAULT_RTX_TARGETS. NVIDIA's TensorRT: the GPU here (it builds for the GPU it runs on)."""
    if not t.is_rtx:
        if gpu is None:
            raise EngineUnavailable(f"{t.describe()} builds engines on a GPU and there is none here (TensorRT-RTX "
                                    f"builds without one: {RTX_INSTALL_HINT})")
        if requested and requested != [gpu]:
            raise EngineUnavailable(f"--compute-capability {','.join(requested)}: {t.describe()} builds for the GPU "
                                    f"it runs on (compute capability {gpu}); naming targets is a TensorRT-RTX option")
        return [gpu], "the GPU here"
    if requested:
        targets, how = requested, "--compute-capability"
    elif gpu is not None:
        targets, how = [gpu], "the GPU here"
    else:
        targets, how = list(DEFAULT_RTX_TARGETS), "no GPU here: every TensorRT-RTX target the KiviAttention kernels run on"
    allowed = t.targets()
    bad = [c for c in targets if c not in allowed]
    if bad:
        hopper = " (SM 9.0 engines need NVIDIA's TensorRT: docs/tensorrt.md)" if "9.0" in bad else ""
        raise EngineUnavailable(f"compute capability {', '.join(bad)} ({how}) is not a {t.describe()} target; "
                                f"allowed: {', '.join(allowed)}{hopper}")
    old = [c for c in targets if tuple(map(int, c.split("."))) < tuple(map(int, MIN_KERNEL_CC.split(".")))]
    if old:
        raise EngineUnavailable(f"compute capability {', '.join(old)} ({how}): the KiviAttention kernels need "
                                f"SM {MIN_KERNEL_CC} or newer (mma.sync bf16, cp.async)")
    return targets, how


@dataclass
class EnginePlan:
    """What an engine build will use, decided before any work: TensorRT, the plugin library, the targets."""

    tensorrt: TensorRT
    plugin_lib: Path
    archs: CompiledArchs
    targets: list[str]
    targets_chosen: str

    def facts(self) -> dict:
        lib = self.plugin_lib
        return {"flavour": self.tensorrt.flavour, "tensorrt": self.tensorrt.version, "targets": self.targets,
                "targets_chosen": self.targets_chosen,
                "plugin_library": {"file": lib.name, "bytes": lib.stat().st_size, "sha256": file_sha256(lib),
                                   "sass": [f"sm_{a}" for a in self.archs.sass],
                                   "ptx": [f"compute_{a}" for a in self.archs.ptx]}}


def engine_plan(plugin_lib: str | os.PathLike | None = None, compute_capability: list[str] | None = None,
                gpu: str | None | bool = True) -> EnginePlan:
    """Decide TensorRT, the plugin library and the targets of an engine build, or raise EngineUnavailable saying
    why not: no TensorRT, no plugin library, targets the builder cannot name, or a plugin library without GPU code
    for a target (both named). gpu: True = ask torch; None = no GPU; '8.6' = that one."""
    t = find_tensorrt_or_unavailable()
    try:
        libs = find_plugins(plugin_lib)
    except FileNotFoundError as e:
        raise EngineUnavailable(str(e)) from None
    requested = [parse_compute_capability(c) for c in compute_capability] if compute_capability else None
    targets, how = resolve_targets(t, requested, gpu_compute_capability() if gpu is True else gpu or None)
    # the first library found with GPU code for every target (e.g. build/plugins-rtx/ when build/plugins/ is sm_90)
    found = [(lib, compiled_archs(lib)) for lib in libs]
    lib, archs = next(((lib, a) for lib, a in found if not uncovered_targets(a, targets)), found[0])
    missing = uncovered_targets(archs, targets)
    if missing:
        sms = ";".join(sorted({c.replace(".", "") for c in targets}, key=int))
        raise EngineUnavailable(
            f"the plugin library {lib} holds GPU code for {archs.describe()}, which does not run on compute "
            f"capability {', '.join(missing)} of the engine's targets {', '.join(targets)} ({how}); rebuild it "
            f"with build_scripts/build_plugin.sh --arch \"{sms}\" or choose --compute-capability")
    return EnginePlan(t, lib, archs, targets, how)


def plan_engine(info: GraphInfo, plugin_lib: str | os.PathLike | None = None,
                compute_capability: list[str] | None = None, gpu: str | None | bool = True) -> EnginePlan:
    """engine_plan for a graph, refusing first (EngineUnavailable naming the option) a configuration the
    KiviAttention plugin cannot run."""
    find_tensorrt_or_unavailable()
    why = engine_unsupported(info)
    if why:
        raise EngineUnavailable(why)
    return engine_plan(plugin_lib, compute_capability, gpu)


def find_tensorrt_or_unavailable() -> TensorRT:
    try:
        return find_tensorrt()
    except TensorRTUnavailable as e:
        raise EngineUnavailable(str(e)) from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def profile_shapes(spec: ExportSpec, cfg: KiviConfig) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes of every dynamic input: tokens up to max_num_tokens, batch up to max_batch_size.
    opt = a full decode step (one token per sequence), the shape a serving loop runs most."""
    b, t, mb = spec.max_batch_size, spec.max_num_tokens, spec.max_blocks_per_seq(cfg)
    tokens, batch = (1, b, t), (1, b, b)
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        name: tuple((n,) for n in tokens) for name in ("input_ids", "positions", "logit_rows")}
    shapes |= {name: tuple((n,) for n in batch) for name in ("slot_ids", "past_len", "chunk_len")}
    shapes["block_table"] = tuple((n, mb) for n in batch)
    return shapes


def trtexec_command(onnx_path: str | Path, engine_path: str | Path, plugin_lib: str | Path, spec: ExportSpec,
                    cfg: KiviConfig) -> str:
    """The trtexec line (NVIDIA's TensorRT) that builds the same engine as build_engine (strongly typed, one
    profile, plugin library loaded and embedded)."""
    shapes = profile_shapes(spec, cfg)
    fmt = lambda i: ",".join(f"{n}:{'x'.join(map(str, s[i]))}" for n, s in shapes.items())  # noqa: E731
    args = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}", "--stronglyTyped",
            f"--dynamicPlugins={plugin_lib}", f"--setPluginsToSerialize={plugin_lib}", "--versionCompatible",
            "--excludeLeanRuntime", "--preview=+aliasedPluginIO1003",
            f"--minShapes={fmt(0)}", f"--optShapes={fmt(1)}", f"--maxShapes={fmt(2)}", "--skipInference"]
    return " ".join(shlex.quote(a) for a in args)


@dataclass
class Compiled:
    """A serialized engine and what the builder said about it."""

    plan: bytes
    seconds: float
    network_layers: int
    network: object  # the parsed network (its layers and tensors as TensorRT typed them)
    logger: object


def compile_onnx(onnx_path: str | Path, plan: EnginePlan, profile: Mapping[str, tuple[tuple[int, ...], ...]],
                 workspace_bytes: int | None = None, echo: bool = True) -> Compiled:
    """Parse an ONNX file with the plugin library loaded and build a serialized, version-compatible engine with the
    library embedded, for plan.targets. A parse or build failure raises ValueError / RuntimeError carrying the
    plugin's own messages (which name the field), never an abort."""
    t = plan.tensorrt
    trt = t.trt
    logger = t.logger(echo=echo)
    builder = t.builder(logger)
    # The library's getCreators registers KiviAttention with the builder's registry (the parser looks it up there).
    t.load_plugin_library(builder, plan.plugin_lib, logger)
    network = t.network(builder)
    parser = t.onnx_parser(network, logger)
    start = time.perf_counter()
    if not parser.parse_from_file(str(onnx_path)):  # reads the external weights next to the file
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ValueError(f"{t.describe()} could not parse {onnx_path}: "
                         + "; ".join(logger.plugin_errors() + errors))
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # cache outputs alias inputs
    config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)  # required for plugins_to_serialize
    config.set_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)
    config.plugins_to_serialize = [str(plan.plugin_lib)]
    t.set_targets(config, plan.targets)
    profile_obj = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        profile_obj.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile_obj)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"{t.describe()} failed to build an engine from {onnx_path}: "
                           + ("; ".join(logger.plugin_errors()) or logger.errors_text() or "no message"))
    return Compiled(bytes(serialized), time.perf_counter() - start, network.num_layers, network, logger)


def build_engine(onnx_path: str | Path, engine_path: str | Path, plan: EnginePlan, spec: ExportSpec,
                 cfg: KiviConfig, workspace_bytes: int | None = None,
                 log: Callable[[str], None] | None = None) -> dict:
    """Check the graph's nodes, compile it (compile_onnx) and write the engine atomically. Returns the build facts
    for build_config.json."""
    nodes = check_graph_nodes(onnx_path)
    if log:
        log(f"[engine] {plan.tensorrt.describe()}: building for compute capability {', '.join(plan.targets)} "
            f"({plan.targets_chosen}) with {plan.plugin_lib} ({plan.archs.describe()})")
    compiled = compile_onnx(onnx_path, plan, profile_shapes(spec, cfg), workspace_bytes)
    engine_path = Path(engine_path)
    tmp = engine_path.with_name(engine_path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(compiled.plan)
    os.replace(tmp, engine_path)
    return {"engine": engine_path.name, "bytes": engine_path.stat().st_size,
            "seconds": round(compiled.seconds, 2), **plan.facts(), "kivi_nodes": nodes,
            "network_layers": compiled.network_layers, "plugins_serialized": [plan.plugin_lib.name],
            "version_compatible": True, "strongly_typed": True}
