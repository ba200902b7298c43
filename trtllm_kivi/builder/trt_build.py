"""Compile an exported graph into a TensorRT engine (TensorRT's Python API) — or, without TensorRT, the trtexec
command that does it on a TensorRT machine.

Written against TensorRT 11 (include/NvInfer.h of the public NVIDIA/TensorRT repository): networks are always
strongly typed (the graph's explicit dtypes and Casts decide every precision; no FP16/BF16 builder flags), the ONNX
parser maps each `trtllm_kivi::KiviAttention` node to the registered plugin of that name (attributes = plugin fields,
plugin_version/plugin_namespace select it), the plugin's cache outputs alias its inputs
(IPluginV3OneBuildV2::getAliasedInput, enabled by PreviewFeature.ALIASED_PLUGIN_IO_10_03), and the plugin library is
embedded in the engine (plugins_to_serialize, which TensorRT honours for version-compatible engines only).
Not run on any machine of this project: no reachable registry ships TensorRT's builder library.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..format import KiviConfig
from ..op import ExportSpec


def has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


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
    """The trtexec line that builds the same engine as build_engine (strongly typed, one profile, plugin
    library loaded and embedded)."""
    shapes = profile_shapes(spec, cfg)
    fmt = lambda i: ",".join(f"{n}:{'x'.join(map(str, s[i]))}" for n, s in shapes.items())  # noqa: E731
    args = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}", "--stronglyTyped",
            f"--dynamicPlugins={plugin_lib}", f"--setPluginsToSerialize={plugin_lib}", "--versionCompatible",
            "--excludeLeanRuntime", "--preview=+aliasedPluginIO1003",
            f"--minShapes={fmt(0)}", f"--optShapes={fmt(1)}", f"--maxShapes={fmt(2)}", "--skipInference"]
    return " ".join(shlex.quote(a) for a in args)


def build_engine(onnx_path: str | Path, engine_path: str | Path, plugin_lib: str | Path, spec: ExportSpec,
                 cfg: KiviConfig, workspace_bytes: int | None = None) -> dict:
    """Parse the ONNX (plugin loaded), build a serialized engine and write it atomically. Returns build facts."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # The library's getCreators registers KiviAttention with the builder's registry (the parser looks it up there).
    builder.get_plugin_registry().load_library(str(plugin_lib))
    network = builder.create_network(0)  # TensorRT 11: always strongly typed
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads the external weights next to the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT could not parse {onnx_path}: {errors}")

    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # cache outputs alias inputs
    config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)  # required for plugins_to_serialize
    config.set_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)
    config.plugins_to_serialize = [str(plugin_lib)]
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(spec, cfg).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    engine_path = Path(engine_path)
    tmp = engine_path.with_name(engine_path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(plan)
    os.replace(tmp, engine_path)
    return {"engine": engine_path.name, "bytes": engine_path.stat().st_size, "tensorrt": trt.__version__,
            "plugins_serialized": [Path(plugin_lib).name], "version_compatible": True}
