"""KIVI CUDA kernel benchmark: decode attention over a 2-bit KIVI cache vs FP16 baselines, in one run.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--out FILE] [--time-budget S] [--quick]

Measured on the same GPU in the same process (CUDA events around CUDA-graph replays of several launches, warmup,
medians):
  - copy: device-to-device copy bandwidth of a 2 GiB buffer (read + write bytes / time): the ceiling;
  - kivi_attention: the attention phase of one decode step (invokeKiviAttention: prepare + the default mma.sync
    kernel + combine) at Llama-3-8B (H=32, Hkv=8, D=128) and Llama-2-7B (H=32, Hkv=32, D=128) shapes, batch
    1/8/32, context 4K/32K/128K where memory allows; bytes = what the kernels must read (codes + scales/zeros of
    the n_q quantized tokens, the window rows, q, k/v of the new token) + out;
  - kivi_step: the same plus the append (window write; a flush when the step crosses a group);
  - fp16_mma: the SAME kernel (same MMA tiles, warps, splits, combine) over an FP16 cache: residual_length = the
    context, so every key is a full-precision window row (bytes = K + V cache) -- the fair FP16 baseline of the
    same design; its full-precision loads are direct (no cp.async stages), see kiviDecodeMma.cuh;
  - sdpa_fp16: torch scaled_dot_product_attention (enable_gqa) of one query over an FP16 cache of the same
    context (bytes = K + V cache);
  - quantize: the append phase of a 32K-token prefill chunk (Llama-3-8B shapes): bytes read (K/V chunk) +
    written (codes, scales, zeros, window).
Writes JSON (machine, versions, shapes, medians, GB/s, ratios, goal checks) to
benchmarks/results/bench_kernels_<gpu>.json (bench_kernels_h200.json on an NVIDIA H200).
Imports only torch + this source tree, for a bare GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.cuda import _abi  # noqa: E402
from trtllm_kivi.cuda.ops import make_params  # noqa: E402
from trtllm_kivi.format import KiviConfig, quantized_bytes_per_token  # noqa: E402
from trtllm_kivi.reference import KiviBuffers  # noqa: E402

# Loaded by path: the bench package's __init__ imports more than torch, and this script runs on a bare GPU machine.
_spec = importlib.util.spec_from_file_location("kivi_machine", ROOT / "trtllm_kivi" / "bench" / "machine.py")
machine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(machine)

MODELS = {"llama-3-8b": (32, 8, 128), "llama-2-7b": (32, 32, 128)}
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)


def time_fn(fn, min_ms: float = 2.0, reps: int = 10, warmup: int = 3) -> dict:
    """Median time of fn() in ms: captured `inner` times into a CUDA graph when possible (launch overhead out),
    events around each replay."""
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) * 1e3
    inner = max(1, min(20, int(min_ms / max(eager_ms, 1e-3))))
    method = "cuda_graph"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(inner):
                    fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - fall back to eager timing, and say so in the JSON
        method = f"eager ({type(e).__name__}: {e})"[:200]

        def run() -> None:
            for _ in range(inner):
                fn()
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
            "method": method}


def _copy_time(n: int, graphed: bool) -> dict:
    """Time of a device-to-device copy of n random bytes: CUDA-graph replays (time_fn), or eager events around 10."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()  # never time zeros
    dst = torch.empty_like(src)
    if graphed:
        return time_fn(lambda: dst.copy_(src), reps=10)
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
    """The ceiling: device-to-device copy, read + write bytes / time, the best of a 2 GiB copy timed as the kernels
    are (CUDA-graph replays) and a 4 GiB one timed eagerly (events around 10 copies, ~4.3 TB/s on an H200); both
    are reported. The graph-replayed 2 GiB copy alone understates the ceiling (2.77 TB/s on an H200), which would
    overstate every kernel's fraction of copy bandwidth."""
    res = {}
    for name, n, graphed in (("graph_2gib", 2 << 30, True), ("eager_4gib", 4 << 30, False)):
        t = _copy_time(n, graphed)
        torch.cuda.empty_cache()
        res[name] = {**t, "bytes": 2 * n, "gbps": 2 * n / (t["median_ms"] * 1e-3) / 1e9}
    best = max(res.values(), key=lambda r: r["gbps"])
    return {**best, "variants": res}


class KiviDecode:
    """A decode step's tensors for `batch` sequences at position `ctx - 1` (random codes/scales; timing does not
    depend on values beyond avoiding NaN)."""

    def __init__(self, lib, cfg: KiviConfig, h: int, hkv: int, d: int, batch: int, ctx: int) -> None:
        self.lib, self.cfg = lib, cfg
        past = ctx - 1
        n_q = cfg.num_quantized(past + 1)
        mbs = max(1, math.ceil(n_q / cfg.block_size))
        shapes = KiviBuffers.allocate(cfg, hkv, d, 1, 1, torch.float16, "meta")
        bufs = []
        for name, t in zip(KiviBuffers._fields, shapes, strict=True):
            n0 = batch * mbs if name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero") else batch
            shape = (n0, *t.shape[1:])
            if t.dtype == torch.int32:
                bufs.append(torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device="cuda"))
            elif name.endswith("scale"):
                bufs.append(torch.full(shape, 0.01, dtype=t.dtype, device="cuda"))
            elif name.endswith("zero"):
                bufs.append(torch.full(shape, -0.02, dtype=t.dtype, device="cuda"))
            else:
                bufs.append(torch.randn(shape, dtype=t.dtype, device="cuda"))
        self.buffers = KiviBuffers(*bufs)
        self.q = torch.randn(batch, h, d, dtype=torch.float16, device="cuda")
        self.k = torch.randn(batch, hkv, d, dtype=torch.float16, device="cuda")
        self.v = torch.randn(batch, hkv, d, dtype=torch.float16, device="cuda")
        self.out = torch.empty_like(self.q)
        i = torch.arange(batch, dtype=torch.int32, device="cuda")
        self.slot_ids, self.past_len = i, torch.full((batch,), past, dtype=torch.int32, device="cuda")
        self.chunk_len = torch.ones(batch, dtype=torch.int32, device="cuda")
        self.table = torch.arange(batch * mbs, dtype=torch.int32, device="cuda").reshape(batch, mbs)
        self.flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.params = make_params(self.q, self.k, self.v, self.out, self.slot_ids, self.past_len, self.chunk_len,
                                  self.table, self.buffers, cfg, max_chunk_len=1, max_seq_len=ctx, num_sms=sms,
                                  error_flag=self.flag)
        self.params.ctasPerSm = max(lib.attention_ctas_per_sm(self.params), 0)  # the kernel's real occupancy
        size = lib.workspace_size(self.params)
        self.ws = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
        self.params.workspace, self.params.workspaceSize = self.ws.data_ptr(), size
        self.plan = lib.launch_plan(self.params)
        wbytes = 2 * 2 * hkv * d  # K + V fp16 per window token
        window_tokens = past - cfg.num_quantized(past)
        self.read_bytes = int(batch * (cfg.num_quantized(past) * quantized_bytes_per_token(cfg, hkv, d)
                                       + window_tokens * wbytes + wbytes + 2 * h * d))
        self.write_bytes = batch * 2 * h * d

    def launch(self, phase: int) -> None:
        rc = self.lib.launch(self.params, torch.cuda.current_stream().cuda_stream, phase)
        if rc != 0:
            raise RuntimeError(f"launch failed: {rc} {self.lib.last_error()}")


def fp16_mma(lib, h: int, hkv: int, d: int, batch: int, ctx: int) -> dict:
    """The default kernel over an FP16 cache: R = ctx puts every key in the full-precision window."""
    cfg = KiviConfig(residual_length=ctx)
    dec = KiviDecode(lib, cfg, h, hkv, d, batch, ctx)
    t = time_fn(lambda: dec.launch(_abi.PHASE_ATTENTION))
    nbytes = 2 * 2 * batch * hkv * (ctx - 1) * d
    return {**t, "bytes": nbytes, "gbps": nbytes / (t["median_ms"] * 1e-3) / 1e9, "plan": dec.plan}


def sdpa_fp16(h: int, hkv: int, d: int, batch: int, ctx: int) -> dict:
    kc = torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device="cuda")  # not zeros: they can time faster
    vc = torch.randn_like(kc)
    q = torch.randn(batch, h, 1, d, dtype=torch.float16, device="cuda")
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)  # noqa: E731
    t = time_fn(fn)
    nbytes = 2 * kc.numel() * 2  # the caches are freed when this returns
    return {**t, "bytes": nbytes, "gbps": nbytes / (t["median_ms"] * 1e-3) / 1e9}


def machine_info(lib) -> dict:
    """The GPU as what it is (name, SMs, memory, driver), versions, the commit, the library relative to the repo."""
    return machine.machine_info(library=machine.portable_path(lib.path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds; remaining shapes are skipped")
    ap.add_argument("--quick", action="store_true", help="batch 1/8 and contexts 4K/32K only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: torch.cuda.is_available() is False; nothing to measure", file=sys.stderr)
        return 2
    lib = _abi.load_library()
    t_start = time.perf_counter()
    cfg = KiviConfig()
    report = {"benchmark": "bench_kernels", "config": cfg.to_dict(), "machine": machine_info(lib),
              "notes": ["kivi_attention: the default mma.sync kernel (kiviDecodeMma.cuh: FRAGMENT-order codes, folded "
                        "scales, cp.async stages, split from the real occupancy); fp16_mma: the same kernel over an "
                        "FP16 cache (every key a full-precision window row), the same-design FP16 baseline; "
                        "sdpa_fp16: torch SDPA over an FP16 cache",
                        "timings: CUDA events around CUDA-graph replays (method per entry), medians"]}
    report["copy"] = copy_bandwidth()
    copy_gbps = report["copy"]["gbps"]
    print(f"copy: {copy_gbps:.0f} GB/s", flush=True)
    free = torch.cuda.mem_get_info()[0]
    rows, skipped = [], []
    batches = BATCHES[:2] if args.quick else BATCHES
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    for name, (h, hkv, d) in MODELS.items():
        for batch in batches:
            for ctx in contexts:
                shape = {"model": name, "heads": h, "kv_heads": hkv, "head_dim": d, "batch": batch, "context": ctx}
                fp16_bytes = 2 * 2 * batch * hkv * ctx * d
                kivi_bytes = batch * ctx * quantized_bytes_per_token(cfg, hkv, d)
                if max(fp16_bytes, kivi_bytes) > 0.8 * free:
                    skipped.append({**shape, "reason": f"needs {max(fp16_bytes, kivi_bytes) / 2**30:.1f} GiB"})
                    continue
                if time.perf_counter() - t_start > args.time_budget:
                    skipped.append({**shape, "reason": f"time budget {args.time_budget} s spent"})
                    continue
                dec = KiviDecode(lib, cfg, h, hkv, d, batch, ctx)
                att = time_fn(lambda dec=dec: dec.launch(_abi.PHASE_ATTENTION))
                stp = time_fn(lambda dec=dec: dec.launch(_abi.PHASE_STEP))
                torch.cuda.synchronize()
                flag = int(dec.flag.item())
                kbytes = dec.read_bytes + dec.write_bytes
                plan = dec.plan
                dec = None  # free its buffers before the FP16 cache is allocated
                torch.cuda.empty_cache()
                mma16 = fp16_mma(lib, h, hkv, d, batch, ctx)
                torch.cuda.empty_cache()
                base = sdpa_fp16(h, hkv, d, batch, ctx)
                torch.cuda.empty_cache()
                gbps = lambda t, kbytes=kbytes: kbytes / (t["median_ms"] * 1e-3) / 1e9  # noqa: E731
                row = {**shape, "kivi_error_flag": flag, "plan": plan,
                       "kivi_attention": {**att, "bytes": kbytes, "gbps": gbps(att)},
                       "kivi_step": stp, "fp16_mma": mma16, "sdpa_fp16": base}
                row["speedup_vs_fp16_mma"] = mma16["median_ms"] / att["median_ms"]
                row["speedup_vs_sdpa_fp16"] = base["median_ms"] / att["median_ms"]
                row["kivi_fraction_of_copy_bw"] = row["kivi_attention"]["gbps"] / copy_gbps
                row["fp16_mma_fraction_of_copy_bw"] = mma16["gbps"] / copy_gbps
                row["sdpa_fraction_of_copy_bw"] = base["gbps"] / copy_gbps
                rows.append(row)
                print(f"{name} b={batch} ctx={ctx}: kivi {att['median_ms']:.3f} ms "
                      f"({row['kivi_attention']['gbps']:.0f} GB/s, {100 * row['kivi_fraction_of_copy_bw']:.0f}% of "
                      f"copy), fp16 mma {mma16['median_ms']:.3f} ms, sdpa fp16 {base['median_ms']:.3f} ms -> "
                      f"x{row['speedup_vs_fp16_mma']:.2f} / x{row['speedup_vs_sdpa_fp16']:.2f}", flush=True)
    report["decode"] = rows
    report["skipped"] = skipped
    report["quantize"] = bench_quantize(lib, cfg)
    print(f"quantize: {report['quantize']['gbps']:.0f} GB/s", flush=True)
    report["goals"] = {"vs_fp16_mma": goals(rows, "fp16_mma"), "vs_sdpa_fp16": goals(rows, "sdpa_fp16")}
    report["elapsed_s"] = time.perf_counter() - t_start
    gpu = machine.machine_tag(report["machine"]["gpu"])
    out = args.out or ROOT / "benchmarks" / "results" / f"bench_kernels_{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


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
    t = time_fn(fn)
    read = 2 * k.numel() * 2
    written = int(n_q * quantized_bytes_per_token(cfg, hkv, d)) + 2 * cfg.window_capacity * hkv * d * 2
    return {**t, "tokens": n, "heads": h, "kv_heads": hkv, "head_dim": d, "bytes": read + written,
            "gbps": (read + written) / (t["median_ms"] * 1e-3) / 1e9}


def goals(rows: list[dict], baseline: str) -> dict:
    """The project's speed targets for the default kernel against one FP16 baseline ("fp16_mma" or "sdpa_fp16"), on the
    measured rows (None when the shape was not measured)."""
    frac, speed = "kivi_fraction_of_copy_bw", f"speedup_vs_{baseline}"
    def pick(model: str, batch: int, ctx: int):
        return next((r for r in rows if r["model"] == model and r["batch"] == batch and r["context"] == ctx), None)
    big = [r for r in rows if r["batch"] == 32 and r["context"] >= 32768]
    b8 = pick("llama-3-8b", 8, 32768)
    b8_l2 = pick("llama-2-7b", 8, 4096)
    small = [r for r in rows if r["batch"] == 1 and r["context"] == 4096]
    return {
        "large_shapes_ge_80pct_copy_bw": (all(r[frac] >= 0.8 for r in big) if big else None),
        "large_shapes_fraction_of_copy_bw": {f"{r['model']} b{r['batch']} {r['context']}": r[frac] for r in big},
        "ge_4x_faster_than_fp16_at_llama3_b8_32k": (b8[speed] >= 4.0) if b8 else None,
        "speedup_at_llama3_b8_32k": b8[speed] if b8 else None,
        "ge_3x_faster_than_fp16_at_llama2_b8_4k": (b8_l2[speed] >= 3.0) if b8_l2 else None,
        "never_slower_than_fp16_at_b1_4k": (all(r[speed] >= 1.0 for r in small) if small else None),
    }


if __name__ == "__main__":
    raise SystemExit(main())
