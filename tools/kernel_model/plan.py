"""Where the CTAs of a decode step go: the launch plans (mirrors of kiviLaunchPlan and the prepare kernel's split
length) and the occupancy of a kernel from its resources."""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import GROUP, KEY_TILE, RESIDUAL, WARP, Gpu, ModelShape

# ------------------------------------------------------------------------------------------------ launch plan
# Mirror of kiviLaunchPlan (plugins/kernels/src/kiviParams.cpp) for a decode step (chunk_len 1 per sequence) and of
# the prepare kernel's per-sequence split length (kiviLaunch.cu). tests/test_kernel_model.py checks it against
# trtllm_kivi/cuda/launch.py launch_plan, which tests/test_kernels_host.py checks against the C++.
MAX_TILE_ROWS, MIN_SPLIT_LEN, CTAS_PER_SM = 16, 256, 4
MMA_TILE_ROWS, MMA_STAGES, MMA_WARPS = 8, 3, 4  # the mma.sync decode kernel (kiviDecodeMma.cuh)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Plan:
    group_heads: int
    tile_tokens: int
    num_tiles: int
    split_len: int
    num_splits: int
    seq_split_len: int  # SeqInfo::splitLen of a sequence of length e


def launch_plan(shape: ModelShape, batch: int, max_seq_len: int, num_sms: int, seq_len: int) -> Plan:
    """kiviLaunchPlan for num_tokens = batch (decode), max_chunk_len 1; seq_len = e = past_len + 1."""
    grp = shape.group_heads
    tq = MAX_TILE_ROWS // grp if grp <= MAX_TILE_ROWS else 1
    t = batch
    num_tiles = min(ceil_div(t, tq) + batch, t)
    ctas = max(num_tiles, 1) * shape.num_kv_heads
    splits = ceil_div(CTAS_PER_SM * num_sms, ctas)
    max_splits = ceil_div(max(max_seq_len, 1), MIN_SPLIT_LEN)
    splits = max(1, min(splits, max_splits))
    split_len = ceil_div(ceil_div(max(max_seq_len, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = ceil_div(max(max_seq_len, 1), split_len)
    per = ceil_div(max(seq_len, 0), num_splits)
    seq_split = max(MIN_SPLIT_LEN, ceil_div(per, KEY_TILE) * KEY_TILE)
    return Plan(grp, tq, num_tiles, split_len, num_splits, seq_split)


def num_quantized(seq_len: int) -> int:
    return 0 if seq_len < RESIDUAL else (seq_len - RESIDUAL) // GROUP * GROUP

def mma_launch_plan(shape: ModelShape, batch: int, max_seq_len: int, num_sms: int, seq_len: int,
                    ctas_per_sm: int) -> Plan:
    """The new kernel's kiviLaunchPlan (decode): tiles of 8 query rows; splits = slots / (tiles x Hkv) with slots =
    SMs x the kernel's real occupancy (the launcher passes kiviAttentionCtasPerSm()), so the grid is one wave."""
    grp = shape.group_heads
    t = batch
    num_tiles = min(ceil_div(t * grp, MMA_TILE_ROWS) + batch, t * ceil_div(grp, MMA_TILE_ROWS))
    base = max(num_tiles, 1) * shape.num_kv_heads
    max_splits = ceil_div(max(max_seq_len, 1), MIN_SPLIT_LEN)
    splits = max(1, min((num_sms * ctas_per_sm) // base, max_splits))
    split_len = ceil_div(ceil_div(max(max_seq_len, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = ceil_div(max(max_seq_len, 1), split_len)
    seq_split = max(MIN_SPLIT_LEN, ceil_div(ceil_div(max(seq_len, 0), num_splits), KEY_TILE) * KEY_TILE)
    return Plan(grp, MMA_TILE_ROWS, num_tiles, split_len, num_splits, seq_split)

# ------------------------------------------------------------------------------------------------ occupancy


@dataclass(frozen=True)
class Resources:
    registers: int
    smem_bytes: int  # static shared memory per CTA (ptxas)
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def occupancy(res: Resources, threads: int, gpu: Gpu) -> dict:
    """Resident CTAs per SM: min over registers (allocated per warp in units of 256), shared memory (+1 KB reserved per
    CTA), threads and the CTA limit (CUDA occupancy calculator rules for sm_80 / sm_90)."""
    warps = ceil_div(threads, WARP)
    regs_per_warp = ceil_div(max(res.registers, 1) * WARP, 256) * 256
    by_regs = gpu.regs_per_sm // (regs_per_warp * warps)
    by_smem = gpu.smem_per_sm // (res.smem_bytes + gpu.smem_reserved_per_cta) if res.smem_bytes > 0 else 10 ** 9
    by_threads = gpu.max_threads_per_sm // (warps * WARP)
    ctas = min(by_regs, by_smem, by_threads, gpu.max_ctas_per_sm)
    limiter = min((("registers", by_regs), ("shared_memory", by_smem), ("threads", by_threads),
                   ("cta_limit", gpu.max_ctas_per_sm)), key=lambda kv: kv[1])[0]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "by_registers": by_regs, "by_shared_memory": by_smem,
            "by_threads": by_threads, "limiter": limiter}
