"""Native CPU path of the KIVI op (plugins/cpu, C++ with AVX2/AVX-512/portable paths) through ctypes.

- `_abi`: the C ABI (library finder/loader, parameter structs); standard library only.
- `ops`: `kivi_attention_cpu_` (signature and semantics of reference.kivi_attention_) and `full_attention_cpu_`
  (the unquantized cache's step, FullCache.attention).
"""

from ._abi import KiviCpuLibrary, find_library, load_library


def available() -> bool:
    """True when the native library file is found and loads (any x86-64 or other CPU; no GPU involved)."""
    if find_library() is None:
        return False
    try:
        load_library()
    except (OSError, RuntimeError):
        return False
    return True


__all__ = ["KiviCpuLibrary", "find_library", "load_library", "available"]
