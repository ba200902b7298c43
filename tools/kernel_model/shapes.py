"""The GPUs and model shapes the kernel model predicts for, and the paths and constants it shares.

GPU rows state where each number comes from and which are assumptions; the KIVI settings are the defaults
(DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL_INCLUDE = ROOT / "plugins" / "kernels" / "include"
FORMAT_INCLUDE = ROOT / "plugins" / "include"
ARCHS = ("sm_90", "sm_80")
WARP = 32
KEY_TILE = 32  # kKEY_TILE (kiviParams.h)

# ---------------------------------------------------------------------------------------------------- GPU table
# One row per GPU. Sources: an H200 run of this project (132 SMs and 60 MB L2 as PyTorch reports them, SM clock
# 1980 MHz observed under load, device-to-device copy of 8.6 GB at 4.3 TB/s counting bytes read and written), NVIDIA
# datasheets / CUDA programming guide (SM counts, boost clocks, HBM bandwidth, 64K registers,
# 2048 threads, 32 CTAs, 228 / 164 KB shared memory per SM of which 1 KB per CTA is reserved, 4 schedulers issuing one
# warp-instruction per clock each, 32 banks x 4 B = one 128-byte shared-memory wavefront per clock per SM).
# ASSUMPTIONS (not measured here): H100 and A100 copy bandwidth = datasheet HBM bandwidth x 0.896, the copy efficiency
# measured on the H200 (4.3 / 4.8); boost clocks are sustained; launch_us: the gap one extra kernel launch adds to a
# decode step inside a CUDA graph (taken as 2 us on every GPU), charged identically to the KIVI and FP16 sides.


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # the cubin the model reads for this GPU
    sms: int
    clock_ghz: float
    issue_per_clk_per_sm: int  # warp-instructions (4 schedulers x 1)
    smem_wavefronts_per_clk_per_sm: int  # 128-byte wavefronts
    copy_gbps: float  # achievable device-memory bandwidth (GB/s, 1e9), what FP16 bytes and KIVI bytes are charged at
    hbm_gbps: float  # datasheet
    smem_per_sm: int
    smem_reserved_per_cta: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    launch_us: float
    source: str


COPY_EFFICIENCY = 4300.0 / 4800.0
GPUS: dict[str, Gpu] = {
    "H200": Gpu("H200", "sm_90", 132, 1.98, 4, 1, 4300.0, 4800.0, 228 * 1024, 1024, 65536, 2048, 32, 2.0,
                "H200 run: 132 SMs, 1980 MHz under load, copy 4.3 TB/s measured on it; HBM3e 4.8 TB/s datasheet"),
    "H100": Gpu("H100", "sm_90", 132, 1.98, 4, 1, round(3350.0 * COPY_EFFICIENCY, 1), 3350.0, 228 * 1024, 1024,
                65536, 2048, 32, 2.0, "H100 SXM5 datasheet: 132 SMs, 1980 MHz boost, HBM3 3.35 TB/s; copy = HBM x "
                "0.896 (H200's measured ratio; assumption)"),
    "A100": Gpu("A100", "sm_80", 108, 1.41, 4, 1, round(2039.0 * COPY_EFFICIENCY, 1), 2039.0, 164 * 1024, 1024,
                65536, 2048, 32, 2.0, "A100 SXM4 80GB datasheet: 108 SMs, 1410 MHz boost, HBM2e 2.039 TB/s; copy = "
                "HBM x 0.896 (assumption)"),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: int

    @property
    def group_heads(self) -> int:
        return self.num_heads // self.num_kv_heads


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 8, 128, 32),
    "llama-2-7b": ModelShape("llama-2-7b", 32, 32, 128, 32),
}
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)

# KIVI-2 defaults (DESIGN.md): k_bits = v_bits = 2, G = 32, R = 128, block 128, fp16 scales and activations.
BITS, GROUP, RESIDUAL = 2, 32, 128
