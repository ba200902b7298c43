"""The KiviAttention TensorRT plugin library: finding and loading it (ctypes), and its FORMAT_VERSION check.

The op's identity and field list (PLUGIN_NAME, FIELDS, plugin_fields, ...) are trtllm_kivi.op's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from .op import check_format_version, find_library, library_candidates

PLUGIN_LIBRARY_NAME = "libtrtllm_kivi_plugin.so"
PLUGIN_LIBRARY_ENV = "TRTLLM_KIVI_PLUGIN_LIB"
_BUILD_HINT = "Build it with `build_scripts/build_plugin.sh --tensorrt-root DIR` (needs TensorRT headers)"


def plugin_library_candidates() -> list[Path]:
    """Where find_plugin_library looks, in order: $TRTLLM_KIVI_PLUGIN_LIB, build_scripts/build_plugin.sh's default
    build directory, a library packaged next to this module."""
    return library_candidates(PLUGIN_LIBRARY_NAME, PLUGIN_LIBRARY_ENV)


def find_plugin_library(path: str | os.PathLike | None = None) -> Path:
    """The KiviAttention plugin library: `path` if given, else the first candidate that exists. Raises
    FileNotFoundError naming every searched path."""
    return find_library(PLUGIN_LIBRARY_NAME, PLUGIN_LIBRARY_ENV, path, _BUILD_HINT)


def load_plugin_library(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load the plugin library (ctypes, RTLD_GLOBAL) and check its FORMAT_VERSION.

    If TensorRT is in the process (the tensorrt module, or libnvinfer), the library registers its creator on load;
    `import tensorrt` is attempted first for that. Engines loaded through IPluginRegistry::loadLibrary (trtexec
    --dynamicPlugins) use the library's getCreators instead and do not need this function."""
    lib_path = find_plugin_library(path)
    # tensorrt loads libnvinfer first, so the library's load-time registration finds it; without TensorRT the
    # library still loads (nothing to register with)
    with contextlib.suppress(ImportError):
        import tensorrt  # noqa: F401
    lib = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
    lib.kiviGetFormatVersion.restype = ctypes.c_int32
    lib.kiviGetFormatVersion.argtypes = []
    check_format_version(lib.kiviGetFormatVersion(), f"the plugin library {lib_path}")
    return lib


__all__ = ["PLUGIN_LIBRARY_NAME", "PLUGIN_LIBRARY_ENV", "plugin_library_candidates", "find_plugin_library",
           "load_plugin_library"]
