"""The timing model's fitted constants (calibrate.fit on benchmarks/results/bench_kernels_h200.json; README.md says
how and how well) and what each means; the constants for a GPU other than the one they were fitted on."""

from __future__ import annotations

from dataclasses import replace

from .shapes import GPUS, Gpu
from .timing import Constants

FITTED_ON = "H200"
# Rounded results of calibrate.fit on the H200 measurements (tests/test_kernel_model.py refits and compares).
FITTED = Constants(launch_us=3.39, latency_us=0.501, issue_ipc=2.02, line_cycles=1.29, split_us=0.286,
                   read_gbps=4490.0, sdpa_us=6.58)
KERNEL_CONSTANTS = ("launch_us", "latency_us", "issue_ipc", "line_cycles", "split_us")
MEANING = {
    "launch_us": "us per kernel of the step inside a CUDA graph (the measured kernel's step has 3: prepare, "
                 "attention, combine or zero rows)",
    "latency_us": "us per device-memory round trip under load: the full-precision chunk's serial round trips, each "
                  "warp's pipeline fill, Little's law for items in flight",
    "issue_ipc": "warp-instructions per clock per SM sustained while every resident warp streams (at most 4 can "
                 "issue): the measured kernel's SM-side ceiling (whether SM- or memory-side: hardware counters)",
    "line_cycles": "L1 cycles per 128-byte line that a warp-wide per-lane global load touches",
    "split_us": "us per split in the combine's serial loop over one (token, head)'s partials",
    "read_gbps": "GB/s a streaming read sustains (torch SDPA's fitted rate in the same run): the read ceiling",
    "sdpa_us": "us torch SDPA takes besides reading its bytes",
}


def constants_for(gpu: Gpu) -> tuple[Constants, str]:
    """(constants, how they apply): the fit on its own GPU; elsewhere the same constants with the read ceiling
    scaled by the datasheet HBM bandwidth -- an assumption, labelled uncalibrated."""
    if gpu.name == FITTED_ON:
        return FITTED, f"calibrated ({FITTED_ON} measurements)"
    read = FITTED.read_gbps * gpu.hbm_gbps / GPUS[FITTED_ON].hbm_gbps
    return (replace(FITTED, read_gbps=round(read, 1)),
            f"uncalibrated on {gpu.name}: {FITTED_ON}'s constants, read ceiling x HBM bandwidth ratio")
