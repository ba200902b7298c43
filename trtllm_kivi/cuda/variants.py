"""The decode attention variants and the plan table (plugins/kernels/include/kiviDecodeVariants.h, field for field;
tests/test_kernels_host.py compares them with the library's kiviCDecodeVariantDescribe / kiviCDecodeVariantFor).

A variant is one compiled design point of the decode attention path: id 0 = auto (the plan table's choice per arch,
SM count and shape class), 1 = baseline (kiviDecodeMma.cuh as measured), 2.. = the split kernel (kiviDecodeSplit.cuh)
with its tunables. Variant 2 is compiled for every combination; the others for head_dim 128 with 2-bit K and V only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format import KiviConfig
from ._abi import DEFAULT_NUM_SMS, MMA_CTAS_PER_SM, TILE_ROWS


def default_ctas_per_sm(k_bits: int, v_bits: int) -> int:
    """defaultCtasPerSm: the decode kernels' __launch_bounds__ occupancy (2 with an 8-bit operand, else 3)."""
    return 2 if 8 in (k_bits, v_bits) else MMA_CTAS_PER_SM


@dataclass(frozen=True)
class Variant:
    """KiviDecodeVariant (plugins/kernels/include/kiviDecodeVariants.h), field for field."""

    id: int
    name: str
    kernel: str  # "baseline" (kiviDecodeMma.cuh) or "split" (kiviDecodeSplit.cuh)
    stages: int  # cp.async stages per warp; 0: by bits (split_default_stages)
    keys_per_stage: int
    waves: int  # split policy: the split fills this many waves of SMs x ctas_per_sm CTAs
    fused: bool  # pure-decode steps: in-kernel prepare, last-CTA merge, window row by the attention kernel
    all_combos: bool  # compiled for every combination (else the headline one only)


VARIANTS = (
    Variant(0, "auto", "split", 0, 32, 2, True, True),
    Variant(1, "baseline", "baseline", 3, 32, 1, False, False),
    Variant(2, "split", "split", 0, 32, 2, True, True),
    Variant(3, "split-s3", "split", 3, 32, 2, True, False),
    Variant(4, "split-s6", "split", 6, 32, 2, True, False),
    Variant(5, "split-1wave", "split", 0, 32, 1, True, True),
    Variant(6, "split-unfused", "split", 0, 32, 2, False, True),
)
VARIANT_AUTO, VARIANT_BASELINE, VARIANT_DEFAULT = 0, 1, 2
SHAPE_ANY, SHAPE_FEW_CTAS, SHAPE_MANY_CTAS, SHAPE_MIXED = -1, 0, 1, 2
# kKIVI_DECODE_PLAN: (arch, min SMs, max SMs, shape class, variant), first match wins. Not measured: the designed
# default everywhere until a GPU sweep replaces it.
PLAN_TABLE = ((90, 0, 0, SHAPE_FEW_CTAS, 2), (90, 0, 0, SHAPE_MANY_CTAS, 2), (90, 0, 0, SHAPE_MIXED, 2),
              (0, 0, 0, SHAPE_ANY, 2))
SM90_SMEM_PER_SM = 233472  # 228 KB; 1 KB reserved per CTA


def is_headline(head_dim: int, k_bits: int, v_bits: int) -> bool:
    return head_dim == 128 and k_bits == 2 and v_bits == 2


def variant_compiled(vid: int, head_dim: int, k_bits: int, v_bits: int) -> bool:
    """kiviVariantCompiled: variant vid (1..) is built for (head_dim, k_bits, v_bits)."""
    return 0 < vid < len(VARIANTS) and (VARIANTS[vid].all_combos or is_headline(head_dim, k_bits, v_bits))


def split_default_stages(head_dim: int, k_bits: int, v_bits: int) -> int:
    """kiviSplitDefaultStages: the most stages (2..4) keeping 3 CTAs per SM (2 with an 8-bit operand) on sm_90."""
    stage = 32 * head_dim * (k_bits + v_bits) // 8 + 4 * head_dim + 4 * 32 * (head_dim // 32)
    fixed = 2 * 16 * head_dim * 2 * 2 + head_dim // 32 * 32 * 16 * 2
    per_cta = SM90_SMEM_PER_SM // (2 if 8 in (k_bits, v_bits) else 3) - 1024
    stages = 4
    while stages > 2 and 4 * stages * stage + fixed > per_cta:
        stages -= 1
    return stages


def variant_stages(vid: int, head_dim: int, k_bits: int, v_bits: int) -> int:
    return VARIANTS[vid].stages or split_default_stages(head_dim, k_bits, v_bits)


def split_smem_bytes(head_dim: int, k_bits: int, v_bits: int, stages: int, scale_bytes: int, group_size: int
                     ) -> int:
    """kiviSplitSmemBytes: the warps' stage rings + two warps' 16-key K and V tiles (the merge reuses them)."""
    gv = min(group_size, head_dim)
    stage = (32 * head_dim * (k_bits + v_bits) // 8 + 2 * head_dim * scale_bytes
             + 2 * 32 * (head_dim // gv) * scale_bytes)
    return max(4 * stages * stage + 2 * 2 * 16 * head_dim * 2, 4 * TILE_ROWS * (head_dim + 2) * 4)


def variant_ctas_per_sm(cfg: KiviConfig, head_dim: int, vid: int) -> int:
    """kiviVariantCtasPerSm: the launch-bounds occupancy, lowered where the split kernel's shared memory allows fewer
    on sm_90."""
    bounds = default_ctas_per_sm(cfg.k_bits, cfg.v_bits)  # both decode kernels' __launch_bounds__
    if not 0 < vid < len(VARIANTS) or VARIANTS[vid].kernel != "split":
        return bounds
    smem = split_smem_bytes(head_dim, cfg.k_bits, cfg.v_bits, variant_stages(vid, head_dim, cfg.k_bits, cfg.v_bits),
                            4 if cfg.scale_dtype == "float32" else 2, cfg.group_size)
    smem += 2 * (head_dim // 32) * 32 * 16  # the q fragments (static)
    return max(1, min(bounds, SM90_SMEM_PER_SM // (smem + 1024)))


def shape_class(num_heads: int, num_kv_heads: int, batch: int, num_tokens: int, max_chunk_len: int,
                num_sms: int) -> int:
    if (max_chunk_len if max_chunk_len > 0 else num_tokens) > 1:
        return SHAPE_MIXED
    ctas = batch * -(-(num_heads // num_kv_heads) // TILE_ROWS) * num_kv_heads
    return SHAPE_FEW_CTAS if ctas < (num_sms or DEFAULT_NUM_SMS) else SHAPE_MANY_CTAS


def variant_for(decode_variant: int, head_dim: int, k_bits: int, v_bits: int, cls: int, sm_version: int,
                num_sms: int) -> int:
    """kiviDecodeVariantFor: an explicit variant as is; auto -> the first plan-table row matching (arch, SMs, shape
    class) whose variant is compiled for the combination, else the default."""
    if decode_variant != VARIANT_AUTO:
        return decode_variant
    sms = num_sms or DEFAULT_NUM_SMS
    for arch, lo, hi, c, vid in PLAN_TABLE:
        if ((arch in (0, sm_version)) and (lo == 0 or sms >= lo) and (hi == 0 or sms <= hi)
                and c in (SHAPE_ANY, cls) and variant_compiled(vid, head_dim, k_bits, v_bits)):
            return vid
    return VARIANT_DEFAULT
