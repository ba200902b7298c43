"""Native CPU path of the KIVI op (plugins/cpu, C++ with AVX2/AVX-512/portable paths) through ctypes.

- `_abi`: the C ABI (library finder/loader, parameter structs); standard library only.
- `ops`: `kivi_attention_cpu_` (signature and semantics of reference.kivi_attention_) and `full_attention_cpu_`
  (the unquantized cache's step, FullCache.attention); `KiviCpuAttention` / `FullCpuAttention`: the same ops bound
  to a cache's layers (buffers checked and params built once; what KiviCache / FullCache's cpu backends and the
  onnxruntime in-place op call once per layer per step).
"""

from ._abi import KiviCpuLibrary, find_library, load_library


def unavailable_reason(quantized: bool = True) -> str | None:
    """Why the native library cannot serve this package's format (None: it can). quantized=False: the unquantized
    cache's dense kernel, which reads no quantized store and so does not depend on the FORMAT_VERSION."""
    from ..format import FORMAT_VERSION

    if find_library() is None:
        return "the native CPU library is not built (build_scripts/build_cpu_kernels.sh)"
    try:
        lib = load_library()
    except (OSError, RuntimeError) as e:
        return f"the native CPU library does not load: {e}"
    if quantized and lib.format_version() != FORMAT_VERSION:
        return (f"the native CPU library implements FORMAT_VERSION {lib.format_version()}, this package stores "
                f"FORMAT_VERSION {FORMAT_VERSION}")
    return None


def available() -> bool:
    """True when the native library is found, loads and implements this package's FORMAT_VERSION."""
    return unavailable_reason() is None


__all__ = ["KiviCpuLibrary", "find_library", "load_library", "available", "unavailable_reason"]
