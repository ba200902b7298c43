"""What every GPU benchmark shares: CUDA-graph timing over rotating buffer sets (L2-cold), the read-only streaming
kernel as the measured roofline (plugins/kernels/src/kiviStreamRead.cu), the machine record and the JSON writer.

Imported only on a GPU run (it imports torch); the dry runs use gpu_plan.py alone. Runs on a bare GPU machine: torch
and this source tree only.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import gpu_plan  # noqa: E402

# Loaded by path: the bench package's __init__ imports more than torch, and this runs on a bare GPU machine.
_spec = importlib.util.spec_from_file_location("kivi_machine", ROOT / "trtllm_kivi" / "bench" / "machine.py")
machine = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(machine)  # type: ignore[union-attr]


def machine_info(lib=None) -> dict:
    """The GPU as what it is (name, SMs, L2, memory, driver), versions, the commit, the library relative to the
    repository."""
    props = torch.cuda.get_device_properties(0)
    extra = {"l2_bytes": int(getattr(props, "L2_cache_size", 0))}
    if lib is not None:
        extra["library"] = machine.portable_path(lib.path)
    return machine.machine_info(**extra)


def gpu_facts() -> dict:
    """What the plan needs from the device: L2 bytes, free memory, SM count, arch (major * 10 + minor)."""
    props = torch.cuda.get_device_properties(0)
    return {"l2_bytes": int(getattr(props, "L2_cache_size", 0)) or 50 << 20,
            "free_bytes": int(torch.cuda.mem_get_info()[0]), "sms": props.multi_processor_count,
            "sm_version": props.major * 10 + props.minor, "name": props.name}


def time_launches(fns: Sequence[Callable[[], None]], min_ms: float = gpu_plan.MIN_GRAPH_MS,
                  reps: int = gpu_plan.REPS, warmup: int = gpu_plan.WARMUP) -> dict:
    """Median time of one launch in ms: `inner` launches cycling through `fns` (one per rotating buffer set, so one
    cycle reads more than twice the L2: L2-cold) captured into a CUDA graph, CUDA events around each replay.
    Falls back to eager launches (and says so in `method`) when capture fails."""
    n = len(fns)
    torch.cuda.synchronize()
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) * 1e3 / n
    inner = max(n, min(512, math.ceil(min_ms / max(eager_ms, 1e-3))))
    inner = math.ceil(inner / n) * n
    method = "cuda_graph"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fns[0]()  # warm up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(inner):
                    fns[i % n]()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - fall back to eager timing, and say so in the JSON
        method = f"eager ({type(e).__name__}: {e})"[:200]

        def run() -> None:
            for i in range(inner):
                fns[i % n]()
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps, "inner": inner,
            "copies": n, "method": method}


def with_bandwidth(t: dict, nbytes: int, ceiling_gbps: float | None = None, same_bytes_gbps: float | None = None
                   ) -> dict:
    """t plus bytes, GB/s and (when given) the fraction of the read ceiling and of a stream read of the same
    bytes."""
    gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
    out = {**t, "bytes": int(nbytes), "gbps": gbps}
    if ceiling_gbps:
        out["fraction_of_read_ceiling"] = gbps / ceiling_gbps
    if same_bytes_gbps:
        out["fraction_of_same_bytes_read"] = gbps / same_bytes_gbps
    return out


def random_bytes(n: int) -> torch.Tensor:
    """n random bytes on the GPU (never time zeros)."""
    return torch.randint(-128, 128, (n,), dtype=torch.int8, device="cuda")


class StreamReader:
    """The read-only streaming kernel (kiviCStreamRead): the measured memory roofline of the same run."""

    def __init__(self, lib) -> None:
        self.fn = getattr(lib.lib, "kiviCStreamRead", None)
        if self.fn is None:
            raise RuntimeError(f"{lib.path} has no kiviCStreamRead: rebuild the library (build_scripts/"
                               f"build_plugin.sh)")
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
        self.fn.restype = ctypes.c_int32
        self.lib = lib
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.ctas_per_sm = 8
        self.partial = torch.empty(self.sms * 16, dtype=torch.float32, device="cuda")

    def launch(self, ptr: int, nbytes: int, num_ctas: int | None = None) -> None:
        n = num_ctas or self.sms * self.ctas_per_sm
        rc = self.fn(ptr, nbytes, self.partial.data_ptr(), n, torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"kiviCStreamRead failed with cudaError_t {rc}: {self.lib.last_error()}")

    def xor(self, buf: torch.Tensor, num_ctas: int) -> int:
        """XOR of the buffer's 32-bit words as the kernel computes it (the GPU test's subject)."""
        self.launch(buf.data_ptr(), buf.numel() * buf.element_size(), num_ctas)
        words = self.partial[:num_ctas].view(torch.int32).cpu().tolist()
        acc = 0
        for w in words:
            acc ^= w & 0xFFFFFFFF
        return acc

    def ceiling(self, nbytes: int = 2 << 30) -> dict:
        """The read ceiling: one buffer of nbytes (>> L2), the best over 4 and 8 CTAs per SM."""
        buf = random_bytes(nbytes)
        ptr = buf.data_ptr()
        best: dict = {}
        for k in (4, 8):
            t = time_launches([lambda k=k: self.launch(ptr, nbytes, self.sms * k)])
            t = with_bandwidth(t, nbytes) | {"ctas_per_sm": k}
            if not best or t["gbps"] > best["gbps"]:
                best = t
        self.ctas_per_sm = best["ctas_per_sm"]
        del buf
        torch.cuda.empty_cache()
        return best

    def same_bytes(self, nbytes: int, copies: int) -> dict:
        """A read of exactly nbytes, rotating over `copies` buffers (L2-cold as the kernel it is compared with)."""
        stride = (nbytes + 255) // 256 * 256
        buf = random_bytes(stride * copies)
        base = buf.data_ptr()
        t = time_launches([lambda i=i: self.launch(base + i * stride, nbytes) for i in range(copies)])
        del buf
        torch.cuda.empty_cache()  # the next allocation (a KIVI state, an FP16 cache) may need this memory
        return with_bandwidth(t, nbytes)


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}", flush=True)


def result_path(bench: str, out: Path | None) -> Path:
    """--out, else benchmarks/results/<bench>_<gpu>.json (<gpu> = machine.machine_tag, e.g. h100)."""
    if out is not None:
        return out
    gpu = machine.machine_tag(torch.cuda.get_device_properties(0).name)
    return ROOT / "benchmarks" / "results" / f"{bench}_{gpu}.json"
