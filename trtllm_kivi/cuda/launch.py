"""The kernels' launch plan and prepare kernel on the CPU (plugins/kernels/src/kiviParams.cpp kiviLaunchPlan,
kiviPrepareKernel): tiles of query rows, split length, grid sizes, workspace bytes; per sequence its token/tile offsets,
split length, device-side checks and error bits. Shared by the append model (model.py) and the attention emulations
(mma_model.py, prefill_model.py); checked against the C++ by tests/test_kernels_host.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..format import KiviConfig
from ._abi import (DEFAULT_NUM_SMS, ERR_BLOCK_ID, ERR_CAPACITY, ERR_LENGTH, ERR_SLOT, KEY_TILE, MAX_TILE_ROWS,
                   MIN_SPLIT_LEN, PREFILL_TILE_ROWS, SEQ_INFO_INTS, TILE_ROWS)
from .variants import (PLAN_TABLE, VARIANT_AUTO, VARIANT_DEFAULT, VARIANTS, shape_class, variant_compiled,
                       variant_ctas_per_sm, variant_for)

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round256(n: int) -> int:
    return _ceil_div(n, 256) * 256


@dataclass(frozen=True)
class LaunchPlan:
    """kiviLaunchPlan (plugins/kernels/src/kiviParams.cpp), field for field."""

    window_capacity: int
    max_seq_len: int
    max_chunk_len: int
    group_heads: int
    tile_tokens: int  # legacy SIMT/WMMA kernels only (refused since FORMAT_VERSION 3)
    num_tiles: int
    split_len: int
    num_splits: int
    flush_groups_per_seq: int
    seq_info_bytes: int
    partial_bytes: int
    workspace_size: int
    tile_rows: int  # query rows (flattened token x group head) per decode attention CTA: the MMA's N = 8
    ctas_per_sm: int  # resident attention CTAs per SM the split is sized for
    num_prefill_tiles: int  # prefill kernel grid.x (0: no sequence of this step can have >= 64 query rows)
    decode_variant: int = VARIANT_DEFAULT  # the resolved variant
    decode_mode: int = 0  # 1: grid x = sequence x tiles_per_seq + tile (a fused variant, chunks of <= 1 token)
    tiles_per_seq: int = 1
    fused_combine: int = 0  # 1: the last CTA of a (tile, KV head) merges the splits
    window_by_attention: int = 0  # 1: the attention kernel writes one-token non-flush window rows
    counter_bytes: int = 0

    def is_prefill(self, chunk_len: int) -> bool:
        """kiviPrepareKernel's assignment: a sequence with >= PREFILL_TILE_ROWS query rows runs in the prefill
        kernel (decided from max(chunk_len, 0), the same rule for the prefix sums and the sequence itself)."""
        return self.num_prefill_tiles > 0 and max(chunk_len, 0) * self.group_heads >= PREFILL_TILE_ROWS


def launch_plan(cfg: KiviConfig, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, num_tokens: int,
                max_blocks_per_seq: int, max_chunk_len: int = 0, max_seq_len: int = 0,
                num_sms: int = 0, ctas_per_sm: int = 0, decode_variant: int = VARIANT_AUTO,
                sm_version: int = 90) -> LaunchPlan:
    """Tiles of TILE_ROWS query rows (row rho of a sequence's chunk = token rho // grp, head rho % grp of the KV
    head), x KV heads, x splits of the keys; splits fill the variant's waves of num_sms x ctas_per_sm resident CTAs.
    workspace_size is kiviWorkspaceSize: the largest plan of the variants the step may run (auto: every variant of
    the plan table)."""
    plan = _plan(cfg, num_heads, num_kv_heads, head_dim, batch, num_tokens, max_blocks_per_seq, max_chunk_len,
                 max_seq_len, num_sms, ctas_per_sm, decode_variant, sm_version)
    ws = 0
    for vid in candidate_variants(decode_variant, head_dim, cfg.k_bits, cfg.v_bits):
        other = _plan(cfg, num_heads, num_kv_heads, head_dim, batch, num_tokens, max_blocks_per_seq, max_chunk_len,
                      max_seq_len, num_sms, ctas_per_sm, vid, sm_version)
        ws = max(ws, other.workspace_size)
    return replace(plan, workspace_size=ws)


def candidate_variants(decode_variant: int, head_dim: int, k_bits: int, v_bits: int) -> list[int]:
    """The variants a step may run: the one named, or for auto every variant of the plan table (any arch)."""
    if decode_variant != VARIANT_AUTO:
        return [decode_variant]
    out = [VARIANT_DEFAULT]
    for *_, vid in PLAN_TABLE:
        if vid not in out and variant_compiled(vid, head_dim, k_bits, v_bits):
            out.append(vid)
    return out


def _plan(cfg: KiviConfig, num_heads: int, num_kv_heads: int, head_dim: int, batch: int, num_tokens: int,
          max_blocks_per_seq: int, max_chunk_len: int, max_seq_len: int, num_sms: int, ctas_per_sm: int,
          decode_variant: int, sm_version: int) -> LaunchPlan:
    """kiviLaunchPlan for one variant (workspace_size: this plan's own bytes)."""
    w = cfg.window_capacity
    capacity = max_blocks_per_seq * cfg.block_size + cfg.sink_tokens + w  # store + sink rows + ring
    msl = max_seq_len if max_seq_len > 0 else capacity
    mcl = max_chunk_len if max_chunk_len > 0 else num_tokens
    grp = num_heads // num_kv_heads
    vid = variant_for(decode_variant, head_dim, cfg.k_bits, cfg.v_bits,
                      shape_class(num_heads, num_kv_heads, batch, num_tokens, max_chunk_len, num_sms), sm_version,
                      num_sms)
    variant = VARIANTS[vid]
    tq = max(1, MAX_TILE_ROWS // grp)
    # per sequence ceil(c * grp / 8) tiles: sum <= ceil(T * grp / 8) + B and <= T * ceil(grp / 8)
    num_tiles = min(_ceil_div(num_tokens * grp, TILE_ROWS) + batch, num_tokens * _ceil_div(grp, TILE_ROWS))
    # prefill sequences (c grp >= 64, possible only if max_chunk_len allows): <= c grp / 64 + 1 tiles each, at most
    # min(B, floor(T grp / 64)) of them; every other sequence has < 64 rows, so at most 8 decode tiles
    x = num_tokens * grp // PREFILL_TILE_ROWS if mcl * grp >= PREFILL_TILE_ROWS else 0
    num_prefill_tiles = x + min(batch, x)
    if num_prefill_tiles > 0:
        num_tiles = min(num_tiles, batch * _ceil_div(PREFILL_TILE_ROWS - 1, TILE_ROWS))
    tps = _ceil_div(grp, TILE_ROWS)
    decode_mode = int(variant.fused and mcl <= 1)
    if decode_mode:  # tile x = sequence x tiles_per_seq + i
        num_tiles = batch * tps
    sms = num_sms if num_sms > 0 else DEFAULT_NUM_SMS
    cps = ctas_per_sm if ctas_per_sm > 0 else variant_ctas_per_sm(cfg, head_dim, vid)
    slots = sms * cps * variant.waves
    base = max(num_tiles + num_prefill_tiles, 1) * num_kv_heads  # CTAs per split of both kernels
    max_splits = _ceil_div(max(msl, 1), MIN_SPLIT_LEN)
    splits = min(max(slots // base, 1), max_splits)  # whole waves: base * splits <= slots when base < slots
    split_len = _ceil_div(_ceil_div(max(msl, 1), splits), KEY_TILE) * KEY_TILE
    num_splits = _ceil_div(max(msl, 1), split_len)
    seq_info = _round256(batch * SEQ_INFO_INTS * 4)
    partial = 0
    if num_splits > 1:  # this step's partials: [T, H, num_splits, D] then [T, H, num_splits, 2] fp32
        rows = num_tokens * num_heads * num_splits
        partial = _round256(rows * head_dim * 4) + _round256(rows * 2 * 4)
    fused_combine = int(variant.fused and num_prefill_tiles == 0 and num_splits > 1)
    counters = _round256(num_tiles * num_kv_heads * 4) if fused_combine else 0
    ws = 0 if batch <= 0 or num_tokens <= 0 else seq_info + partial + counters
    return LaunchPlan(w, msl, mcl, grp, tq, num_tiles, split_len, num_splits, _ceil_div(mcl, cfg.group_size),
                      seq_info, partial, ws, TILE_ROWS, cps, num_prefill_tiles, vid, decode_mode, tps, fused_combine,
                      int(variant.fused), counters)


# ---------------------------------------------------------------------------------------------- prepare


@dataclass
class SeqInfo:
    token_offset: int
    tile_offset: int
    tile_count: int
    valid: bool
    split_len: int  # this sequence's length spread over all plan.num_splits splits
    prefill_tile_offset: int = 0
    prefill_tile_count: int = 0  # > 0: the sequence runs in the prefill kernel (its decode tile_count is 0)


def prepare(plan: LaunchPlan, cfg: KiviConfig, slot_ids: list[int], past_len: list[int], chunk_len: list[int],
            block_table: torch.Tensor, num_tokens: int, num_blocks: int, num_slots: int) -> tuple[list[SeqInfo], int]:
    """kiviPrepareKernel for every sequence -> (infos, OR of the error bits)."""
    infos, flag = [], 0
    tokens = tiles = prefill_tiles = 0
    for b, (slot, s, c) in enumerate(zip(slot_ids, past_len, chunk_len, strict=False)):
        e, err = s + c, 0
        if s < 0 or c < 0 or c > plan.max_chunk_len or tokens + c > num_tokens:
            err |= ERR_LENGTH
        nq = cfg.num_quantized(e) if e >= 0 else 0
        if err == 0 and (e > plan.max_seq_len or nq > block_table.shape[1] * cfg.block_size):
            err |= ERR_CAPACITY
        if not 0 <= slot < num_slots:
            err |= ERR_SLOT
        if err == 0:
            used = block_table[b, :_ceil_div(nq, cfg.block_size)]
            if ((used < 0) | (used >= num_blocks)).any():
                err |= ERR_BLOCK_ID
        rows = max(0, min(c, num_tokens - tokens))
        split_len = max(MIN_SPLIT_LEN, _ceil_div(_ceil_div(max(e, 0), plan.num_splits), KEY_TILE) * KEY_TILE)
        pf = plan.is_prefill(c)
        infos.append(SeqInfo(min(tokens, num_tokens), tiles,
                             0 if pf else _ceil_div(rows * plan.group_heads, plan.tile_rows), err == 0, split_len,
                             prefill_tiles, _ceil_div(rows * plan.group_heads, PREFILL_TILE_ROWS) if pf else 0))
        flag |= err
        tokens += max(c, 0)
        if pf:
            prefill_tiles += _ceil_div(max(c, 0) * plan.group_heads, PREFILL_TILE_ROWS)
        else:
            tiles += _ceil_div(max(c, 0) * plan.group_heads, plan.tile_rows)
    return infos, flag
