"""The one place that finds TensorRT: NVIDIA's TensorRT (`import tensorrt`) or, else, TensorRT-RTX (`import
tensorrt_rtx`, the pinned wheel RTX_WHEEL), and the one API the builder, the TensorRT runner and the tests use.

Both flavours share the builder API family and the plugin interfaces; what differs is handled here:
- the network: strongly typed (TensorRT 10 needs the flag; TensorRT 11 and TensorRT-RTX always are);
- the plugin registry: IPluginRegistry::loadLibrary on the builder's / runtime's own registry, the one its parser
  looks in (the ctypes load of plugin.load_plugin_library registers nothing with TensorRT-RTX, whose library is
  not in the global symbol scope);
- the ONNX parser of TensorRT-RTX opens the unversioned `libtensorrt_rtx.so` while its wheel ships only
  `libtensorrt_rtx.so.1`; without that name the process aborts (no Python error), so the parser is refused here,
  with the fix, when the name cannot be opened (`build_scripts/install.sh --tensorrt-rtx` links it next to the
  library, where the parser's RPATH finds it);
- targets: TensorRT-RTX builds for named compute capabilities (RTX_TARGETS, no SM 9.0) without a GPU; NVIDIA's
  TensorRT builds for the GPU it runs on;
- the plugin library's own GPU code is never checked by the builder: `compiled_archs` reads it from the library's
  fatbinary and `uncovered_targets` says which targets it cannot run on.

Messages: `CapturingLogger` keeps every message (a plugin's refusal reaches only the log: the parser says just "Could
not create the plugin") and echoes warnings and errors to stderr (trt.Logger prints to stdout).
`field_collection` keeps the fields' arrays alive (a PluginFieldCollection made of temporary PluginFields points at
freed memory: the creator then reads garbage).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from .op import find_library
from .plugin import PLUGIN_LIBRARY_ENV, PLUGIN_LIBRARY_NAME, plugin_library_candidates

FLAVOURS = ("tensorrt", "tensorrt_rtx")  # searched in this order
RTX_WHEEL = "tensorrt-rtx-cu13==1.7.1.116"  # the pinned TensorRT-RTX: the tests, not its documents, say what works
RTX_INSTALL_HINT = "bash build_scripts/install.sh --tensorrt-rtx"
# TensorRT-RTX 1.7's ComputeCapability targets (SM 9.0 is not one: Hopper engines need NVIDIA's TensorRT).
RTX_TARGETS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")
RTX_PARSER_LIBRARY = "libtensorrt_rtx.so"  # the unversioned name TensorRT-RTX's ONNX parser opens
# Where build_scripts/build_plugin.sh --build-dir build/plugins-rtx puts the plugin for TensorRT-RTX targets.
RTX_PLUGIN_DIR = Path(__file__).resolve().parent.parent / "build" / "plugins-rtx"


class TensorRTUnavailable(RuntimeError):
    """No usable TensorRT here; the message says why and how to get one."""


@dataclass(frozen=True)
class TensorRT:
    """The TensorRT found: its module (`trt`), flavour (tensorrt | tensorrt_rtx) and version."""

    trt: Any
    flavour: str
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.flavour == "tensorrt_rtx"

    def describe(self) -> str:
        return f"{'TensorRT-RTX' if self.is_rtx else 'TensorRT'} {self.version} ({self.flavour})"

    # ------------------------------------------------------------------------------------------- building

    def logger(self, echo: bool = True) -> CapturingLogger:
        """The process's one logger for this TensorRT, cleared: TensorRT keeps the first logger it is given (a
        later builder's is ignored, and the plugin's messages go to the first), so every builder and runtime here
        gets this one. echo: print warnings and errors to stderr."""
        logger = _process_logger(self.trt)
        logger.clear()
        logger.echo = echo
        return logger

    def builder(self, logger: CapturingLogger) -> Any:
        return self.trt.Builder(logger)

    def network_flags(self) -> int:
        """Strongly typed: the graph's dtypes and Casts decide every precision. TensorRT 10 needs the flag; in
        TensorRT 11 and TensorRT-RTX networks always are (the flag is deprecated there)."""
        flag = getattr(self.trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        return 0 if flag is None or self.is_rtx or int(self.version.split(".")[0]) >= 11 else 1 << int(flag)

    def network(self, builder: Any) -> Any:
        return builder.create_network(self.network_flags())

    def onnx_parser(self, network: Any, logger: CapturingLogger) -> Any:
        if self.is_rtx:
            why = rtx_parser_library_missing()
            if why:
                raise TensorRTUnavailable(why)
        return self.trt.OnnxParser(network, logger)

    def load_plugin_library(self, owner: Any, path: str | os.PathLike, logger: CapturingLogger) -> Any:
        """Register a plugin library's creators with `owner`'s registry (a Builder or Runtime; the same
        IPluginRegistry::loadLibrary trtexec --dynamicPlugins uses)."""
        handle = owner.get_plugin_registry().load_library(str(path))
        if handle is None:
            raise RuntimeError(f"{self.describe()} could not load the plugin library {path}: "
                               f"{logger.errors_text() or 'no message'}")
        return handle

    def field_collection(self, fields: Mapping[str, int]) -> FieldCollection:
        """int32 plugin fields as a PluginFieldCollection whose arrays stay alive as long as the result."""
        import numpy as np

        arrays = [np.array([value], dtype=np.int32) for value in fields.values()]
        pfs = [self.trt.PluginField(name, a, self.trt.PluginFieldType.INT32) for name, a in zip(fields, arrays,
                                                                                                   strict=True)]
        return FieldCollection(self.trt.PluginFieldCollection(pfs), arrays, pfs)

    def set_targets(self, config: Any, targets: Iterable[str]) -> None:
        """TensorRT-RTX: build for these compute capabilities ("8.6", ...). NVIDIA's TensorRT builds for the GPU
        it runs on: there `targets` must be that GPU's (checked by the caller, resolve_targets)."""
        targets = list(targets)
        if not self.is_rtx:
            return
        config.num_compute_capabilities = len(targets)
        for i, t in enumerate(targets):
            cc = getattr(self.trt.ComputeCapability, "SM" + t.replace(".", ""), None)
            if cc is None or not config.set_compute_capability(cc, i):
                raise ValueError(f"compute capability {t} is not a {self.describe()} target; allowed: "
                                 f"{', '.join(self.targets())}")

    def targets(self) -> tuple[str, ...]:
        """The compute capabilities this builder can name (TensorRT-RTX; () for NVIDIA's TensorRT)."""
        if not self.is_rtx:
            return ()
        names = [n[2:] for n in dir(self.trt.ComputeCapability) if n.startswith("SM") and n[2:].isdigit()]
        return tuple(sorted((f"{n[:-1]}.{n[-1]}" for n in names), key=_cc_key))

    # ------------------------------------------------------------------------------------------- running

    def runtime(self, logger: CapturingLogger) -> Any:
        runtime = self.trt.Runtime(logger)
        runtime.engine_host_code_allowed = True  # the plugin library is embedded in version-compatible engines
        return runtime

    def deserialize(self, runtime: Any, plan: bytes, logger: CapturingLogger) -> Any:
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            why = logger.errors_text() or "no message"
            raise RuntimeError(f"{self.describe()} could not deserialize the engine: {why}")
        return engine


@dataclass
class FieldCollection:
    """A PluginFieldCollection with the objects its fields point into."""

    collection: Any
    arrays: list
    fields: list


class CapturingLogger:
    """Base of the ILogger subclass made per TensorRT module (_process_logger): every message since the last
    clear() is kept as (severity name, text)."""

    messages: list[tuple[str, str]]
    echo: bool

    def errors_text(self) -> str:
        """The error messages (and internal errors), "; "-joined: what to put in an exception."""
        return "; ".join(m for sev, m in self.messages if sev in ("ERROR", "INTERNAL_ERROR"))

    def plugin_errors(self) -> list[str]:
        """The KiviAttention plugin's own messages (its refusals name the field and the allowed values)."""
        return [m for sev, m in self.messages if "KiviAttention" in m and sev in ("ERROR", "INTERNAL_ERROR")]

    def clear(self) -> None:
        self.messages.clear()


@functools.cache
def _process_logger(trt: ModuleType) -> CapturingLogger:
    severity = trt.ILogger.Severity
    echo_at = {severity.INTERNAL_ERROR, severity.ERROR, severity.WARNING}

    class _Logger(trt.ILogger, CapturingLogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages = []
            self.echo = True

        def log(self, sev: Any, msg: str) -> None:
            self.messages.append((sev.name, msg))
            if self.echo and sev in echo_at:
                print(f"[{'TensorRT-RTX' if 'rtx' in trt.__name__ else 'TensorRT'}] {sev.name}: {msg}",
                      file=sys.stderr)

    return _Logger()


# ----------------------------------------------------------------------------------------------- finding it


def _import(flavour: str) -> ModuleType | None:
    try:
        return importlib.import_module(flavour)
    except ImportError:
        return None


@functools.cache
def find_tensorrt(flavour: str | None = None) -> TensorRT:
    """The TensorRT here: `flavour` if given, else tensorrt, else tensorrt_rtx. Raises TensorRTUnavailable saying
    what was tried and how to install one."""
    if flavour is not None and flavour not in FLAVOURS:
        raise ValueError(f"TensorRT flavour {flavour!r} is not supported; allowed: {', '.join(FLAVOURS)}")
    for name in [flavour] if flavour else FLAVOURS:
        module = _import(name)
        if module is not None:
            return TensorRT(module, name, str(module.__version__))
    raise TensorRTUnavailable(
        f"the tensorrt Python package is not installed here (nor tensorrt_rtx: {RTX_INSTALL_HINT} installs "
        f"{RTX_WHEEL}, which builds engines without a GPU; on a Hopper GPU machine install NVIDIA's TensorRT)"
        if flavour is None else f"the {flavour} Python package is not installed here")


def tensorrt_unavailable() -> str | None:
    """Why no TensorRT can be used here (None: find_tensorrt() succeeds)."""
    try:
        find_tensorrt()
    except TensorRTUnavailable as e:
        return str(e)
    return None


def rtx_parser_library_missing() -> str | None:
    """Why TensorRT-RTX's ONNX parser would abort the process here (None: the name it opens is found: next to the
    parser, where its RPATH looks, or on the library path)."""
    libs = rtx_libs_dir()
    if libs is not None and (libs / RTX_PARSER_LIBRARY).is_file():
        return None
    try:
        ctypes.CDLL(RTX_PARSER_LIBRARY)
    except OSError:
        return (f"TensorRT-RTX's ONNX parser opens {RTX_PARSER_LIBRARY}, which its wheel does not ship (only "
                f"{RTX_PARSER_LIBRARY}.1): without it the process aborts. {RTX_INSTALL_HINT} links it "
                f"next to the library")
    return None


def rtx_libs_dir() -> Path | None:
    """The TensorRT-RTX wheel's library folder (tensorrt_rtx_libs), where its parser's RPATH ($ORIGIN) looks."""
    import importlib.util

    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    return Path(spec.origin).parent if spec and spec.origin else None


# ----------------------------------------------------------------------------------------------- the plugin library


def plugin_candidates() -> list[Path]:
    """Where find_plugin looks, in order: $TRTLLM_KIVI_PLUGIN_LIB, build/plugins/, build/plugins-rtx/
    (build_plugin.sh --build-dir build/plugins-rtx), a packaged copy."""
    candidates = plugin_library_candidates()
    candidates.insert(len(candidates) - 1, RTX_PLUGIN_DIR / PLUGIN_LIBRARY_NAME)
    return candidates


def find_plugins(path: str | os.PathLike | None = None) -> list[Path]:
    """The KiviAttention plugin libraries an engine may use: [`path`] if given, else every candidate that exists
    (plugin_candidates order). FileNotFoundError names every searched path."""
    if path is not None:
        return [find_library(PLUGIN_LIBRARY_NAME, PLUGIN_LIBRARY_ENV, path)]
    found = [p for p in plugin_candidates() if p.is_file()]
    if not found:
        raise FileNotFoundError(
            f"{PLUGIN_LIBRARY_NAME} not found; searched: {', '.join(map(str, plugin_candidates()))}. Build it with "
            f"`build_scripts/build_plugin.sh --tensorrt-root DIR` (DIR: a checkout of github.com/NVIDIA/TensorRT, "
            f"for its include/ headers) or set {PLUGIN_LIBRARY_ENV}")
    return found


def find_plugin(path: str | os.PathLike | None = None) -> Path:
    """The first of find_plugins(path)."""
    return find_plugins(path)[0]


@dataclass(frozen=True)
class CompiledArchs:
    """The GPU code in a library's fatbinaries: SASS (cubins) and PTX, as SM numbers (80 = sm_80)."""

    sass: tuple[int, ...]
    ptx: tuple[int, ...] = field(default=())

    def describe(self) -> str:
        return (", ".join(f"sm_{a}" for a in self.sass) or "no SASS") + (
            f" (+ PTX {', '.join(f'compute_{a}' for a in self.ptx)})" if self.ptx else "")


_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2


def compiled_archs(path: str | os.PathLike) -> CompiledArchs:
    """Read the architectures of every fatbinary entry in a shared library's .nv_fatbin section (what
    `cuobjdump --list-elf / --list-ptx` lists; tests/test_plugin_trt.py compares the two). No CUDA tools needed."""
    data = Path(path).read_bytes()
    section = _elf_section(data, b".nv_fatbin")
    if section is None:
        return CompiledArchs(())
    sass: set[int] = set()
    ptx: set[int] = set()
    pos, end = section
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; padding between them is skipped
            continue
        entry, stop = pos + header_size, pos + header_size + fat_size
        while entry + 32 <= stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            (sass if kind == _KIND_ELF else ptx if kind == _KIND_PTX else set()).add(arch)
            entry += entry_header + payload
        pos = stop
    return CompiledArchs(tuple(sorted(sass)), tuple(sorted(ptx)))


def _elf_section(data: bytes, name: bytes) -> tuple[int, int] | None:
    """(start, end) of a named section of a 64-bit little-endian ELF file, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF shared library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = sections[shstrndx][4]
    for sh_name, _type, _flags, _addr, offset, size in sections:
        end = data.index(b"\0", strtab_off + sh_name)
        if data[strtab_off + sh_name:end] == name:
            return offset, offset + size
    return None


def _cc_key(cc: str) -> tuple[int, int]:
    major, minor = cc.split(".")
    return int(major), int(minor)


def parse_compute_capability(text: str) -> str:
    """'8.6', '86', 'sm_86', 'SM86' -> '8.6'; ValueError naming the text otherwise."""
    t = text.strip().lower().removeprefix("sm_").removeprefix("sm")
    if "." in t:
        major, _, minor = t.partition(".")
    else:
        major, minor = t[:-1], t[-1:]
    if not (major.isdigit() and minor.isdigit() and len(minor) == 1):
        raise ValueError(f"compute capability {text!r} is not of the form 8.6 (or 86, sm_86)")
    return f"{int(major)}.{int(minor)}"


def uncovered_targets(archs: CompiledArchs, targets: Iterable[str]) -> list[str]:
    """Targets no SASS of the library runs on. A cubin for sm_XY runs on compute capability X.Z with Z >= Y (same
    major); PTX is not counted (the build must compile the plugin for every target it asks for)."""
    out = []
    for t in targets:
        major, minor = _cc_key(t)
        if not any(a // 10 == major and a % 10 <= minor for a in archs.sass):
            out.append(t)
    return out


__all__ = ["FLAVOURS", "RTX_WHEEL", "RTX_TARGETS", "RTX_INSTALL_HINT", "TensorRTUnavailable", "TensorRT",
           "FieldCollection", "CapturingLogger", "find_tensorrt", "tensorrt_unavailable",
           "rtx_parser_library_missing", "rtx_libs_dir", "plugin_candidates", "find_plugins", "find_plugin", "CompiledArchs", "compiled_archs",
           "parse_compute_capability", "uncovered_targets"]
