"""ctypes view of the KIVI kernel library's C ABI (plugins/kernels/include/kiviCApi.h).

Imports only the standard library and trtllm_kivi.format / trtllm_kivi.op (themselves standard-library only), so the
CPU tests can load the host-only build (validation and launch plan, g++) and the GPU machine can load the full one
without our venv.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

from ..format import DTYPE_NAMES
from ..op import find_library as _find
from ..op import library_candidates as _candidates

LIB_NAME = "libtrtllm_kivi_kernels.so"
LIB_ENV = "TRTLLM_KIVI_KERNELS_LIB"

# KiviDataType / KiviErrorBits / phases, as in plugins/kernels/include/kiviParams.h.
DTYPE_CODES = {n: i for i, n in enumerate(DTYPE_NAMES)}  # format.dtype_code
ERR_LENGTH, ERR_CAPACITY, ERR_SLOT, ERR_BLOCK_ID = 1, 2, 4, 8
PHASE_ATTENTION, PHASE_APPEND, PHASE_STEP = 1, 2, 3
ATTN_AUTO, ATTN_SIMT, ATTN_TENSOR_CORE, ATTN_MMA = 0, 1, 2, 3  # KiviAttentionImpl (1, 2: legacy, refused)
KEY_TILE = 32
MAX_TILE_ROWS = 16
MIN_SPLIT_LEN = 256
DEFAULT_NUM_SMS = 132
MMA_CTAS_PER_SM = 3  # kMMA_CTAS_PER_SM: the occupancy the split is sized for when the caller passes none
TILE_ROWS = 8  # kTILE_ROWS: query rows per decode attention CTA (the MMA's N)
PREFILL_TILE_ROWS = 64  # kPREFILL_TILE_ROWS: query rows per prefill attention CTA (4 warps x the MMA's M)
SEQ_INFO_INTS = 8
CUDA_ERROR_INVALID_VALUE = 1

_INT_FIELDS = ("numHeads", "numKvHeads", "headDim", "kBits", "vBits", "groupSize", "residualLength", "blockSize",
               "scaleDtype", "keyGrouping", "actDtype", "batch", "numTokens", "maxChunkLen", "maxSeqLen",
               "numBlocks", "numSlots", "maxBlocksPerSeq", "numSms")
_PTR_FIELDS = ("q", "k", "v", "out", "slotIds", "pastLen", "chunkLen", "blockTable", "kCodes", "kScale", "kZero",
               "vCodes", "vScale", "vZero", "kWindow", "vWindow", "errorFlag", "workspace")

PLAN_FIELDS = ("window_capacity", "max_seq_len", "max_chunk_len", "group_heads", "tile_tokens", "num_tiles",
               "split_len", "num_splits", "flush_groups_per_seq", "seq_info_bytes", "partial_bytes",
               "workspace_size", "tile_rows", "ctas_per_sm", "num_prefill_tiles", "decode_variant", "decode_mode",
               "tiles_per_seq", "fused_combine", "window_by_attention", "counter_bytes")
DECODE_VARIANT_AUTO, DECODE_VARIANT_BASELINE = 0, 1  # kiviDecodeVariants.h; trtllm_kivi/cuda/variants.py


class KiviStepParams(ctypes.Structure):
    """Mirror of trtllm_kivi::kernels::KiviStepParams (same field order; kiviCParamsSize checks the size)."""

    _fields_ = ([(n, ctypes.c_int32) for n in _INT_FIELDS] + [(n, ctypes.c_void_p) for n in _PTR_FIELDS]
                + [("workspaceSize", ctypes.c_size_t), ("attentionImpl", ctypes.c_int32),
                   ("ctasPerSm", ctypes.c_int32), ("sinkTokens", ctypes.c_int32), ("decodeVariant", ctypes.c_int32)])


class KiviLibrary:
    """A loaded kernel library (full CUDA build) or host-only build (validation/plan functions only)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(self.path))
        lib = self.lib
        lib.kiviCParamsSize.restype = ctypes.c_size_t
        lib.kiviCFormatVersion.restype = ctypes.c_int32
        lib.kiviCValidate.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.kiviCValidate.restype = ctypes.c_int32
        lib.kiviCLaunchPlan.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
        lib.kiviCLaunchPlan.restype = ctypes.c_int32
        lib.kiviCWorkspaceSize.argtypes = [ctypes.c_void_p]
        lib.kiviCWorkspaceSize.restype = ctypes.c_size_t
        lib.kiviCLastErrorMessage.restype = ctypes.c_char_p
        lib.kiviCWorkspaceSizeForProfile.argtypes = [ctypes.c_void_p] + [ctypes.c_int32] * 3
        lib.kiviCWorkspaceSizeForProfile.restype = ctypes.c_size_t
        lib.kiviCCheckArch.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.kiviCCheckArch.restype = ctypes.c_int32
        lib.kiviCDecodeVariantCount.restype = ctypes.c_int32
        lib.kiviCDecodeVariantName.argtypes = [ctypes.c_int32]
        lib.kiviCDecodeVariantName.restype = ctypes.c_char_p
        lib.kiviCDecodeVariantDescribe.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
        lib.kiviCDecodeVariantDescribe.restype = ctypes.c_int32
        lib.kiviCDecodeVariantFor.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
        lib.kiviCDecodeVariantFor.restype = ctypes.c_int32
        lib.kiviCLaunchPlanFor.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)]
        lib.kiviCLaunchPlanFor.restype = ctypes.c_int32
        self.has_launchers = hasattr(lib, "kiviCStep")
        if self.has_launchers:
            for name in ("kiviCStep", "kiviCAttention", "kiviCAppend"):
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                fn.restype = ctypes.c_int32
            lib.kiviCAttentionCtasPerSm.argtypes = [ctypes.c_void_p]
            lib.kiviCAttentionCtasPerSm.restype = ctypes.c_int32
        size = lib.kiviCParamsSize()
        if size != ctypes.sizeof(KiviStepParams):
            raise RuntimeError(f"{self.path}: KiviStepParams is {size} bytes in the library but "
                               f"{ctypes.sizeof(KiviStepParams)} in trtllm_kivi/cuda/_abi.py; rebuild the library")

    def format_version(self) -> int:
        return int(self.lib.kiviCFormatVersion())

    def last_error(self) -> str:
        return (self.lib.kiviCLastErrorMessage() or b"").decode()

    def validate(self, params: KiviStepParams, phase: int = PHASE_STEP) -> str:
        """'' when valid, else the library's message naming the bad value."""
        rc = self.lib.kiviCValidate(ctypes.byref(params), phase)
        return "" if rc == 0 else self.last_error()

    def launch_plan(self, params: KiviStepParams, sm_version: int | None = None) -> dict[str, int]:
        """kiviLaunchPlan; decodeVariant 0 (auto) resolved for compute capability sm_version (None: sm_90)."""
        out = (ctypes.c_int64 * len(PLAN_FIELDS))()
        if sm_version is None:
            self.lib.kiviCLaunchPlan(ctypes.byref(params), out)
        else:
            self.lib.kiviCLaunchPlanFor(ctypes.byref(params), sm_version, out)
        return dict(zip(PLAN_FIELDS, (int(x) for x in out), strict=True))

    def decode_variants(self) -> list[dict]:
        """Every decode attention variant as {id, name, kernel, stages, keys_per_stage, waves, split_policy, combine,
        window, prepare, window_row_write, copy, compiled} (kiviCDecodeVariantDescribe); id 0 is auto."""
        out = []
        buf = ctypes.create_string_buffer(1024)
        for i in range(int(self.lib.kiviCDecodeVariantCount())):
            if self.lib.kiviCDecodeVariantDescribe(i, buf, len(buf)) != 0:
                raise RuntimeError(f"{self.path}: kiviCDecodeVariantDescribe({i}) failed")
            out.append(json.loads(buf.value.decode()))
        return out

    def decode_variant_for(self, params: KiviStepParams, sm_version: int, num_sms: int) -> int:
        """The variant decodeVariant 0 (auto) runs for these params on compute capability sm_version (e.g. 90)
        with num_sms SMs (0: 132); an explicit params.decodeVariant is returned as is."""
        return int(self.lib.kiviCDecodeVariantFor(ctypes.byref(params), sm_version, num_sms))

    def workspace_size(self, params: KiviStepParams) -> int:
        return int(self.lib.kiviCWorkspaceSize(ctypes.byref(params)))

    def attention_ctas_per_sm(self, params: KiviStepParams) -> int:
        """Resident CTAs per SM of the default attention kernel for these params on the current device (-1: error)."""
        if not self.has_launchers:
            raise RuntimeError(f"{self.path} is a host-only build without the CUDA launchers")
        return int(self.lib.kiviCAttentionCtasPerSm(ctypes.byref(params)))

    def workspace_size_for_profile(self, max_params: KiviStepParams, min_tokens: int, min_batch: int,
                                   min_blocks_per_seq: int) -> int:
        """Bytes serving every step of a TensorRT profile whose max is max_params (kiviWorkspaceSizeForProfile)."""
        return int(self.lib.kiviCWorkspaceSizeForProfile(ctypes.byref(max_params), min_tokens, min_batch,
                                                         min_blocks_per_seq))

    def check_arch(self, params: KiviStepParams, sm_version: int) -> str:
        """'' when params.attentionImpl runs on compute capability sm_version (e.g. 75, 80, 90), else the message."""
        rc = self.lib.kiviCCheckArch(ctypes.byref(params), sm_version)
        return "" if rc == 0 else self.last_error()

    def launch(self, params: KiviStepParams, stream: int, phase: int = PHASE_STEP) -> int:
        if not self.has_launchers:
            raise RuntimeError(f"{self.path} is a host-only build without the CUDA launchers")
        fn = {PHASE_STEP: self.lib.kiviCStep, PHASE_ATTENTION: self.lib.kiviCAttention,
              PHASE_APPEND: self.lib.kiviCAppend}[phase]
        return int(fn(ctypes.byref(params), ctypes.c_void_p(stream)))


def decode_variants(lib: KiviLibrary | None = None) -> list[dict]:
    """The decode attention variants of the kernel library (ids for KiviStepParams.decodeVariant /
    ops.make_params(decode_variant=...)): id, name and tunables (KiviLibrary.decode_variants)."""
    return (lib or load_library()).decode_variants()


def library_candidates() -> list[Path]:
    """Where load_library looks (op.library_candidates): $TRTLLM_KIVI_KERNELS_LIB, then build/plugins/."""
    return _candidates(LIB_NAME, LIB_ENV)


def find_library() -> Path | None:
    try:
        return _find(LIB_NAME, LIB_ENV)
    except FileNotFoundError:
        return None


_LOADED: dict[Path, KiviLibrary] = {}


def load_library(path: str | os.PathLike | None = None) -> KiviLibrary:
    """Load (once) the kernel library; the error names every path tried and how to build it."""
    if path is None:
        path = find_library()
        if path is None:
            tried = ", ".join(str(p) for p in library_candidates())
            raise FileNotFoundError(f"KIVI kernel library not found (tried {tried}); build it with "
                                    f"build_scripts/build_plugin.sh or set {LIB_ENV}")
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"KIVI kernel library {path} does not exist; build it with "
                                f"build_scripts/build_plugin.sh")
    if path not in _LOADED:
        _LOADED[path] = KiviLibrary(path)
    return _LOADED[path]
