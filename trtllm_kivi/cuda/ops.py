"""Torch-facing wrappers over the KIVI CUDA kernels (ctypes; torch CUDA tensors' data_ptr + the current stream).

`kivi_attention_cuda_` has the signature and semantics of trtllm_kivi.reference.kivi_attention_ (attend, then append,
buffers updated in place) for per_channel keys, fp16/bf16 activations and head_dim 64/128.
"""

from __future__ import annotations

import torch

from ..format import SUPPORTED_KEY_GROUPINGS, KiviConfig, dtype_code
from ..reference.attention import KiviBuffers
from . import _abi
from ._abi import KiviLibrary, KiviStepParams

_ACT_CODES = {torch.float16: dtype_code("float16"), torch.bfloat16: dtype_code("bfloat16")}


def make_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                slot_ids: torch.Tensor, past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor,
                buffers: KiviBuffers, cfg: KiviConfig, *, max_chunk_len: int = 0, max_seq_len: int = 0,
                num_sms: int = 0, error_flag: torch.Tensor | None = None,
                attention_impl: int = _abi.ATTN_AUTO, ctas_per_sm: int = 0, decode_variant: int = 0
                ) -> KiviStepParams:
    """Fill KiviStepParams from tensors (shapes and data pointers only; nothing is read, so CPU tensors work for
    validation tests). workspace is left empty: see `run_step`. decode_variant: 0 = auto (the plan table), 1 =
    baseline, 2.. = the variants of _abi.decode_variants()."""
    tokens, h, d = q.shape
    num_blocks, hkv = buffers.k_codes.shape[:2]
    p = KiviStepParams()
    p.numHeads, p.numKvHeads, p.headDim = h, hkv, d
    p.kBits, p.vBits, p.groupSize = cfg.k_bits, cfg.v_bits, cfg.group_size
    p.residualLength, p.blockSize = cfg.residual_length, cfg.block_size
    p.scaleDtype = dtype_code(cfg.scale_dtype)
    p.keyGrouping = SUPPORTED_KEY_GROUPINGS.index(cfg.key_grouping)
    p.actDtype = _ACT_CODES.get(q.dtype, dtype_code("float32") if q.dtype == torch.float32 else -1)
    p.batch, p.numTokens = slot_ids.shape[0], tokens
    p.maxChunkLen, p.maxSeqLen = max_chunk_len, max_seq_len
    p.numBlocks, p.numSlots, p.maxBlocksPerSeq = num_blocks, buffers.k_window.shape[0], block_table.shape[1]
    p.numSms = num_sms
    ptr = lambda t: t.data_ptr() if t is not None and t.numel() > 0 else None  # noqa: E731
    p.q, p.k, p.v, p.out = ptr(q), ptr(k), ptr(v), ptr(out)
    p.slotIds, p.pastLen, p.chunkLen, p.blockTable = ptr(slot_ids), ptr(past_len), ptr(chunk_len), ptr(block_table)
    (p.kCodes, p.kScale, p.kZero, p.vCodes, p.vScale, p.vZero, p.kWindow, p.vWindow) = (ptr(t) for t in buffers)
    p.errorFlag = ptr(error_flag)
    p.attentionImpl = attention_impl
    p.ctasPerSm = ctas_per_sm
    p.sinkTokens = cfg.sink_tokens
    p.decodeVariant = decode_variant
    return p


def _check_tensors(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg) -> None:
    """What the C++ validation cannot see: devices, dtypes, contiguity, shapes against the format."""
    from ..reference.attention import check_step
    tensors = {"q": q, "k": k, "v": v, "slot_ids": slot_ids, "past_len": past_len, "chunk_len": chunk_len,
               "block_table": block_table, **dict(zip(buffers._fields, buffers, strict=False))}
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}; the KIVI CUDA kernels need CUDA tensors")
        if not t.is_contiguous():
            raise ValueError(f"{name} with strides {t.stride()} must be contiguous")
    for name in ("slot_ids", "past_len", "chunk_len", "block_table"):
        if tensors[name].dtype != torch.int32:
            raise ValueError(f"{name} has dtype {tensors[name].dtype}; expected torch.int32")
    if q.dtype not in _ACT_CODES:
        raise ValueError(f"activation dtype {q.dtype} is not supported by the kernels; allowed: float16, bfloat16")
    # Shapes/dtypes only: check_step's length checks sync the host, so they run on the CPU copies of the lengths.
    check_step(q, k, v, slot_ids.cpu(), past_len.cpu(), chunk_len.cpu(), block_table.cpu(), buffers, cfg)


def run_step(lib: KiviLibrary, params: KiviStepParams, device: torch.device, phase: int = _abi.PHASE_STEP) -> None:
    """Allocate the workspace on `device`, launch on the current stream, raise on a launch/validation error."""
    size = lib.workspace_size(params)
    ws = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    params.workspace, params.workspaceSize = ws.data_ptr(), size
    stream = torch.cuda.current_stream(device).cuda_stream
    rc = lib.launch(params, stream, phase)
    if rc == _abi.CUDA_ERROR_INVALID_VALUE and lib.last_error():
        raise ValueError(lib.last_error())
    if rc != 0:
        raise RuntimeError(f"KIVI kernel launch failed with cudaError_t {rc} ({lib.path})")
    ws.record_stream(torch.cuda.current_stream(device))


def kivi_attention_cuda_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_ids: torch.Tensor,
                         past_len: torch.Tensor, chunk_len: torch.Tensor, block_table: torch.Tensor,
                         buffers: KiviBuffers, cfg: KiviConfig, *, max_chunk_len: int = 0, max_seq_len: int = 0,
                         error_flag: torch.Tensor | None = None, check: bool = True,
                         out: torch.Tensor | None = None, phase: int = _abi.PHASE_STEP,
                         attention_impl: int = _abi.ATTN_AUTO, lib: KiviLibrary | None = None,
                         decode_variant: int = 0) -> torch.Tensor:
    """CUDA form of reference.kivi_attention_: updates `buffers` in place and returns out [tokens, H, D].

    max_chunk_len / max_seq_len: host upper bounds of chunk_len and past_len + chunk_len when the caller knows them
    (they size the grid and the split; 0 = derive from num_tokens and the block-table capacity). check=True also
    runs the reference's shape checks (host sync on the lengths); a runner that validated the step passes False.
    error_flag: optional int32 [1] CUDA tensor the kernels OR KiviErrorBits into. out: optional preallocated
    [tokens, H, D] output. phase: _abi.PHASE_STEP (attend, then append), PHASE_ATTENTION or PHASE_APPEND only.
    attention_impl: _abi.ATTN_AUTO or ATTN_MMA (the mma.sync kernel, sm_80+; the legacy SIMT/WMMA kernels are
    refused). decode_variant: the decode attention design point (0 = auto, 1 = baseline, _abi.decode_variants()).
    The split is sized from the variant's real occupancy on this device (kiviCAttentionCtasPerSm)."""
    lib = lib or _abi.load_library()
    if check:
        _check_tensors(q, k, v, slot_ids, past_len, chunk_len, block_table, buffers, cfg)
    else:  # host-side and free: the kernels index q/k/v as dense [tokens, heads, D]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_contiguous():
                raise ValueError(f"{name} with strides {t.stride()} must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must be a contiguous tensor like q "
                         f"{tuple(q.shape)} {q.dtype} on {q.device}")
    props = torch.cuda.get_device_properties(q.device)
    params = make_params(q, k, v, out, slot_ids, past_len, chunk_len, block_table, buffers, cfg,
                         max_chunk_len=max_chunk_len, max_seq_len=max_seq_len,
                         num_sms=props.multi_processor_count, error_flag=error_flag,
                         attention_impl=attention_impl, decode_variant=decode_variant)
    params.ctasPerSm = _ctas_per_sm(lib, params, q.device)
    run_step(lib, params, q.device, phase)
    return out


_OCCUPANCY: dict[tuple, int] = {}


def _ctas_per_sm(lib: KiviLibrary, params: KiviStepParams, device: torch.device) -> int:
    """Occupancy of the decode attention kernel that runs these params (the variant auto resolves to on this device,
    head_dim, dtypes, bits, G), cached; 0 (the default) on error."""
    major, minor = torch.cuda.get_device_capability(device)
    variant = lib.decode_variant_for(params, 10 * major + minor, params.numSms)
    key = (str(device), variant, params.headDim, params.actDtype, params.scaleDtype, params.kBits, params.vBits,
           params.groupSize)
    if key not in _OCCUPANCY:
        with torch.cuda.device(device):
            _OCCUPANCY[key] = max(lib.attention_ctas_per_sm(params), 0)
    return _OCCUPANCY[key]
