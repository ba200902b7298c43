"""GPU measurements behind bench_kernels.py and bench_prefill.py: KIVI states in rotating buffer sets, the KIVI
launches per (past, decode variant, phase), the same kernel over an FP16 cache, torch SDPA, the copy bandwidth and
the prefill-chunk append. Imports torch: loaded only on a GPU run (the dry runs plan with gpu_plan.py alone).
"""

from __future__ import annotations

import ctypes
import math
import statistics
from collections.abc import Callable

import gpu_common as gc
import gpu_plan
import torch

from trtllm_kivi.cuda import _abi
from trtllm_kivi.cuda.ops import make_params
from trtllm_kivi.format import KiviConfig, quantized_bytes_per_token
from trtllm_kivi.reference import KiviBuffers

STORE = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


def random_kivi_buffers(cfg: KiviConfig, hkv: int, d: int, num_blocks: int, num_slots: int,
                        dtype: torch.dtype = torch.float16) -> KiviBuffers:
    """Buffers of the format's shapes: random codes and window rows, small constant scales and zeros (timing does
    not depend on the values beyond avoiding NaN; never zeros)."""
    meta = KiviBuffers.allocate(cfg, hkv, d, 1, 1, dtype, "meta")
    bufs = []
    for name, t in zip(KiviBuffers._fields, meta, strict=True):
        shape = ((num_blocks if name in STORE else num_slots), *t.shape[1:])
        if t.dtype == torch.int32:
            bufs.append(torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device="cuda"))
        elif name.endswith("scale"):
            bufs.append(torch.full(shape, 0.01, dtype=t.dtype, device="cuda"))
        elif name.endswith("zero"):
            bufs.append(torch.full(shape, -0.02, dtype=t.dtype, device="cuda"))
        else:
            bufs.append(torch.randn(shape, dtype=t.dtype, device="cuda"))
    return KiviBuffers(*bufs)


def variant_for(lib, params, sm_version: int, sms: int) -> int | None:
    """The variant id "auto" picks for these params (kiviCDecodeVariantFor), None without the variant API."""
    fn = getattr(lib.lib, "kiviCDecodeVariantFor", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
    fn.restype = ctypes.c_int32
    return int(fn(ctypes.byref(params), sm_version, sms))


class KiviState:
    """`copies` independent KIVI states of `batch` sequences (rotated through when timed: L2-cold), sharing q/k/v,
    the output, the block table and the lengths; launches per (past, variant, phase), built on demand.

    chunk: query tokens per sequence (1 = decode; a prefill chunk runs the prefill kernel); max_len: the longest
    past + chunk the state must hold (sizes the block table)."""

    def __init__(self, lib, cfg: KiviConfig, h: int, hkv: int, d: int, batch: int, max_len: int, copies: int,
                 chunk: int = 1) -> None:
        self.lib, self.cfg, self.batch, self.chunk = lib, cfg, batch, chunk
        self.mbs = cfg.max_blocks_per_seq(max_len)
        self.sets = [random_kivi_buffers(cfg, hkv, d, batch * self.mbs, batch) for _ in range(copies)]
        tokens = batch * chunk
        self.q = torch.randn(tokens, h, d, dtype=torch.float16, device="cuda")
        self.k = torch.randn(tokens, hkv, d, dtype=torch.float16, device="cuda")
        self.v = torch.randn(tokens, hkv, d, dtype=torch.float16, device="cuda")
        self.out = torch.empty_like(self.q)
        self.slot_ids = torch.arange(batch, dtype=torch.int32, device="cuda")
        self.chunk_len = torch.full((batch,), chunk, dtype=torch.int32, device="cuda")
        self.table = torch.arange(batch * self.mbs, dtype=torch.int32, device="cuda").reshape(batch, self.mbs)
        self.flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self._past: dict[int, torch.Tensor] = {}
        self._ws = torch.empty(1, dtype=torch.uint8, device="cuda")
        self._keep: list = []  # params of captured launches stay alive with the state

    def past_tensor(self, past: int) -> torch.Tensor:
        if past not in self._past:
            self._past[past] = torch.full((self.batch,), past, dtype=torch.int32, device="cuda")
        return self._past[past]

    def params(self, buffers: KiviBuffers, past: int, variant: int):
        p = make_params(self.q, self.k, self.v, self.out, self.slot_ids, self.past_tensor(past), self.chunk_len,
                        self.table, buffers, self.cfg, max_chunk_len=self.chunk, max_seq_len=past + self.chunk,
                        num_sms=self.sms, error_flag=self.flag)
        if variant:
            if not hasattr(p, "decodeVariant"):
                raise RuntimeError(f"decode variant {variant} asked for, but KiviStepParams has no decodeVariant")
            p.decodeVariant = variant
        p.ctasPerSm = max(self.lib.attention_ctas_per_sm(p), 0)  # the kernel's real occupancy
        size = self.lib.workspace_size(p)
        if size > self._ws.numel():  # shared by every launch (stream order); older ones stay alive with their params
            self._keep.append(self._ws)
            self._ws = torch.empty(size, dtype=torch.uint8, device="cuda")
        p.workspace, p.workspaceSize = self._ws.data_ptr(), size
        return p

    def launchers(self, past: int, variant: int, phase: int) -> tuple[list[Callable[[], None]], str, dict]:
        """(one launch per buffer set, the library's refusal ("" when valid), the launch plan)."""
        fns, plan = [], {}
        for buffers in self.sets:
            p = self.params(buffers, past, variant)
            msg = self.lib.validate(p, phase)
            if msg:
                return [], msg, {}
            plan = plan or self.lib.launch_plan(p)
            self._keep.append(p)
            fns.append(lambda p=p: self._launch(p, phase))
        return fns, "", plan

    def _launch(self, p, phase: int) -> None:
        rc = self.lib.launch(p, torch.cuda.current_stream().cuda_stream, phase)
        if rc != 0:
            raise RuntimeError(f"KIVI launch failed: cudaError_t {rc} {self.lib.last_error()}")

    def auto_variant(self, past: int, sm_version: int) -> int | None:
        return variant_for(self.lib, self.params(self.sets[0], past, 0), sm_version, self.sms)

    def error_flag(self) -> int:
        torch.cuda.synchronize()
        return int(self.flag.item())


def fp16_mma(lib, h: int, hkv: int, d: int, batch: int, ctx: int, copies: int) -> dict:
    """The default kernel over an FP16 cache: residual_length = ctx puts every key in the full-precision window."""
    cfg = KiviConfig(residual_length=ctx)
    state = KiviState(lib, cfg, h, hkv, d, batch, ctx, copies)
    fns, refused, plan = state.launchers(ctx - 1, 0, _abi.PHASE_ATTENTION)
    if refused:
        return {"refused": refused}
    t = gc.time_launches(fns)
    return gc.with_bandwidth(t, gpu_plan.fp16_decode_bytes(hkv, d, batch, ctx - 1)) | {"plan": plan}


def sdpa_fp16(h: int, hkv: int, d: int, batch: int, ctx: int, copies: int) -> dict:
    """torch SDPA (enable_gqa) of one query per sequence over `copies` random FP16 caches of ctx tokens."""
    caches = [(torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device="cuda"),
               torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device="cuda")) for _ in range(copies)]
    q = torch.randn(batch, h, 1, d, dtype=torch.float16, device="cuda")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = gc.time_launches([lambda kc=kc, vc=vc: sdpa(q, kc, vc, enable_gqa=True) for kc, vc in caches])
    return gc.with_bandwidth(t, gpu_plan.fp16_decode_bytes(hkv, d, batch, ctx))


def _copy_time(n: int, graphed: bool) -> dict:
    """A device-to-device copy of n random bytes: CUDA-graph replays, or eager events around 10 copies."""
    src = gc.random_bytes(n)
    dst = torch.empty_like(src)
    if graphed:
        return gc.time_launches([lambda: dst.copy_(src)])
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": 5, "inner": 10, "method": "eager"}


def copy_bandwidth() -> dict:
    """Device-to-device copy, read + write bytes / time, the best of a 2 GiB copy in CUDA-graph replays and a 4 GiB
    one timed eagerly; both reported. Kept for continuity: the read-only streaming kernel is the ceiling kernels are
    judged against (a copy writes as much as it reads, and SDPA read faster than the copy moved on an H200)."""
    res = {}
    for name, n, graphed in (("graph_2gib", 2 << 30, True), ("eager_4gib", 4 << 30, False)):
        t = _copy_time(n, graphed)
        torch.cuda.empty_cache()
        res[name] = {**t, "bytes": 2 * n, "gbps": 2 * n / (t["median_ms"] * 1e-3) / 1e9}
    best = max(res.values(), key=lambda r: r["gbps"])
    return {**best, "variants": res}


def bench_quantize(lib, cfg: KiviConfig) -> dict:
    """Append phase of one 32K-token prefill chunk, Llama-3-8B shapes (idempotent: past_len stays 0)."""
    h, hkv, d, n = 32, 8, 128, 32768
    n_q = cfg.num_quantized(n)
    mbs = math.ceil(n_q / cfg.block_size)
    buffers = KiviBuffers.allocate(cfg, hkv, d, mbs, 1, torch.float16, "cuda")
    k = torch.randn(n, hkv, d, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    q = torch.empty(n, h, d, dtype=torch.float16, device="cuda")  # not read by the append phase
    i = torch.zeros(1, dtype=torch.int32, device="cuda")
    chunk = torch.full((1,), n, dtype=torch.int32, device="cuda")
    table = torch.arange(mbs, dtype=torch.int32, device="cuda").reshape(1, mbs)
    params = make_params(q, k, v, None, i, i, chunk, table, buffers, cfg, max_chunk_len=n, max_seq_len=n)
    size = lib.workspace_size(params)
    ws = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
    params.workspace, params.workspaceSize = ws.data_ptr(), size

    def fn() -> None:
        rc = lib.launch(params, torch.cuda.current_stream().cuda_stream, _abi.PHASE_APPEND)
        if rc != 0:
            raise RuntimeError(f"append failed: {rc} {lib.last_error()}")
    t = gc.time_launches([fn])
    read = 2 * k.numel() * 2
    written = int(n_q * quantized_bytes_per_token(cfg, hkv, d)) + 2 * cfg.window_capacity * hkv * d * 2
    return {**t, "tokens": n, "heads": h, "kv_heads": hkv, "head_dim": d, "bytes": read + written,
            "gbps": (read + written) / (t["median_ms"] * 1e-3) / 1e9}
