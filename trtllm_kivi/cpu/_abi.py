"""ctypes view of the native CPU KIVI library's C ABI (plugins/cpu/include/kiviCpuApi.h).

Imports only the standard library. Finder order: $TRTLLM_KIVI_CPU_LIB, then build/cpu/ of the source tree
(build_scripts/build_cpu_kernels.sh).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LIB_NAME = "libtrtllm_kivi_cpu.so"
LIB_ENV = "TRTLLM_KIVI_CPU_LIB"
DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "cpu"

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}
ISA_CODES = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512vnni": 4, "avx2denormal": 5}
ISA_NAMES = {v: k for k, v in ISA_CODES.items()}
PHASE_ATTENTION, PHASE_APPEND, PHASE_STEP = 1, 2, 3
STATUS_INVALID_VALUE, STATUS_UNSUPPORTED_ISA = 1, 2

_P = ctypes.c_void_p
_I = ctypes.c_int32


class KiviCpuParams(ctypes.Structure):
    """Mirror of KiviCpuParams (same field order; kiviCpuParamsSize checks the size)."""

    _fields_ = ([(n, _I) for n in ("numHeads", "numKvHeads", "headDim", "kBits", "vBits", "groupSize",
                                   "residualLength", "blockSize", "scaleDtype", "keyGrouping", "sinkTokens", "actDtype", "batch",
                                   "numTokens", "numBlocks", "numSlots", "maxBlocksPerSeq", "numThreads", "isa",
                                   "phase")]
                + [(n, _P) for n in ("q", "k", "v", "out", "slotIds", "pastLen", "chunkLen", "blockTable",
                                     "kCodes", "kScale", "kZero", "vCodes", "vScale", "vZero", "kWindow",
                                     "vWindow")])


class KiviCpuDenseParams(ctypes.Structure):
    """Mirror of KiviCpuDenseParams."""

    _fields_ = ([(n, _I) for n in ("numHeads", "numKvHeads", "headDim", "actDtype", "cacheDtype", "batch",
                                   "numTokens", "numSlots", "maxSeqLen", "numThreads", "isa")]
                + [(n, _P) for n in ("q", "k", "v", "out", "slotIds", "pastLen", "chunkLen", "kCache", "vCache")])


class KiviCpuLibrary:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        lib = self.lib = ctypes.CDLL(str(self.path))
        for name, res, args in (("kiviCpuFormatVersion", _I, []), ("kiviCpuParamsSize", ctypes.c_size_t, []),
                                ("kiviCpuDenseParamsSize", ctypes.c_size_t, []), ("kiviCpuIsaSupported", _I, [_I]),
                                ("kiviCpuResolveIsa", _I, [_I]), ("kiviCpuSplitLen", _I, []),
                                ("kiviCpuSetNumThreads", None, [_I]), ("kiviCpuGetNumThreads", _I, []),
                                ("kiviCpuStep", _I, [_P]), ("kiviCpuDense", _I, [_P]),
                                ("kiviCpuLastError", ctypes.c_char_p, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        for fn, cls in ((lib.kiviCpuParamsSize, KiviCpuParams), (lib.kiviCpuDenseParamsSize, KiviCpuDenseParams)):
            if fn() != ctypes.sizeof(cls):
                raise RuntimeError(f"{self.path}: {cls.__name__} is {fn()} bytes in the library but "
                                   f"{ctypes.sizeof(cls)} in trtllm_kivi/cpu/_abi.py; rebuild the library")

    def format_version(self) -> int:
        return int(self.lib.kiviCpuFormatVersion())

    def last_error(self) -> str:
        return (self.lib.kiviCpuLastError() or b"").decode()

    def isa_supported(self, isa: str) -> bool:
        return bool(self.lib.kiviCpuIsaSupported(ISA_CODES[isa]))

    def resolve_isa(self, isa: str = "auto") -> str:
        return ISA_NAMES.get(int(self.lib.kiviCpuResolveIsa(ISA_CODES[isa])), "invalid")

    def split_len(self) -> int:
        return int(self.lib.kiviCpuSplitLen())

    def _check(self, rc: int) -> None:
        if rc == 0:
            return
        msg = self.last_error()
        if rc in (STATUS_INVALID_VALUE, STATUS_UNSUPPORTED_ISA):
            raise ValueError(msg)
        raise RuntimeError(f"{self.path}: {msg} (status {rc})")

    def step(self, params: KiviCpuParams) -> None:
        self._check(self.lib.kiviCpuStep(ctypes.byref(params)))

    def dense(self, params: KiviCpuDenseParams) -> None:
        self._check(self.lib.kiviCpuDense(ctypes.byref(params)))


def library_candidates() -> list[Path]:
    env = os.environ.get(LIB_ENV)
    return ([Path(env)] if env else []) + [DEFAULT_BUILD_DIR / LIB_NAME]


def find_library() -> Path | None:
    for path in library_candidates():
        if path.is_file():
            return path
    return None


_LOADED: dict[Path, KiviCpuLibrary] = {}
# The default library per value of $TRTLLM_KIVI_CPU_LIB: every op call asks for it, and finding it anew costs
# stat + realpath system calls per layer per step.
_DEFAULT: dict[str | None, KiviCpuLibrary] = {}


def load_library(path: str | os.PathLike | None = None) -> KiviCpuLibrary:
    """Load (once) the CPU library; the error names every path tried and how to build it."""
    if path is None:
        env = os.environ.get(LIB_ENV)
        if env in _DEFAULT:
            return _DEFAULT[env]
        path = find_library()
        if path is None:
            tried = ", ".join(str(p) for p in library_candidates())
            raise FileNotFoundError(f"native CPU KIVI library not found (tried {tried}); build it with "
                                    f"build_scripts/build_cpu_kernels.sh or set {LIB_ENV}")
        lib = load_library(path)
        _DEFAULT[env] = lib
        return lib
    path = Path(path).resolve()
    if path not in _LOADED:
        _LOADED[path] = KiviCpuLibrary(path)
    return _LOADED[path]
