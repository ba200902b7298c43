"""The attention op alone on the CPU: native KIVI (trtllm_kivi.cpu's KiviCpuAttention, the KiviCache cpu backend's
op) vs native attention over an unquantized FP16 cache (FullCpuAttention, FullCache's), decode (one token per
sequence), batch 8, 8K context, over every layer of a model's geometry (distinct buffers per layer, so the working set
is far above the L3), same run, same threads. Both ops are called as the caches call them: bound to the layers (buffers
checked once; per call only q/k/v and the step tensors).

    PYTHONPATH=. python benchmarks/bench_cpu_attention.py [--geometry smollm2-135m llama3-8b] [--context 8192]
                                                          [--batch 8] [--threads 1 2] [--rounds 5] [--out FILE]

Each round times one decode step over all layers of each implementation in turn (KIVI, FP16), so load changes on a
shared machine hit both alike; reported: median seconds per step over all layers, achieved GB/s (bytes the op must
read: quantized store + fp32 window for KIVI, the K/V rows for FP16, each over all layers), the median of per-round
ratios, and the read bandwidth of the machine measured in the same run (torch.sum over a 1 GiB fp32 tensor with the
same threads). Only the attention phase is timed (phase=attention: the append costs one group flush every G steps).
Writes JSON to benchmarks/results/cpu_attention_op_<machine>.json (trtllm_kivi.bench.machine_tag).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi import cpu as native  # noqa: E402
from trtllm_kivi.bench import machine_info, machine_tag  # noqa: E402
from trtllm_kivi.cpu import _abi  # noqa: E402
from trtllm_kivi.cpu.ops import FullCpuAttention, KiviCpuAttention  # noqa: E402
from trtllm_kivi.format import KiviConfig  # noqa: E402
from trtllm_kivi.reference.attention import KiviBuffers  # noqa: E402

# (layers, heads, kv heads, head_dim, layers used): Llama-3-8B's 32 layers of FP16 cache at batch 8 x 8K would be
# 8 GiB (too much for a shared 23 GiB machine); 8 of its layers (2.0 GiB FP16, 0.45 GiB KIVI-2) are already
# > 14x the 32 MiB L3.
GEOMETRIES = {"smollm2-135m": (30, 9, 3, 64, 30), "llama3-8b": (32, 32, 8, 128, 8)}


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    x = torch.ones(int(gib * 2 ** 30 / 4), dtype=torch.float32)
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def make_layers(cfg: KiviConfig, n_layers: int, hkv: int, d: int, batch: int, ctx: int, gen: torch.Generator):
    nb_per = -(-cfg.num_quantized(ctx + 1) // cfg.block_size)
    kivi = []
    for _ in range(n_layers):
        b = KiviBuffers.allocate(cfg, hkv, d, batch * nb_per, batch, torch.float32)
        for t in b:  # contents do not change the work; finite values keep the softmax honest
            if t.dtype == torch.int32:
                t.random_(-2 ** 31, 2 ** 31 - 1, generator=gen)
            elif t is b.k_scale or t is b.v_scale:
                t.uniform_(0.001, 0.01, generator=gen)
            else:
                t.uniform_(-1, 1, generator=gen)
        kivi.append(b)
    table = torch.arange(batch * nb_per, dtype=torch.int32).reshape(batch, nb_per)
    dense = [tuple(torch.empty(batch, hkv, ctx + 1, d, dtype=torch.float16).uniform_(-1, 1, generator=gen)
                   for _ in range(2)) for _ in range(n_layers)]
    return kivi, table, dense


def resident_per_token(cfg: KiviConfig, h: int, hkv: int, d: int, tokens: int, gen: torch.Generator,
                       rounds: int) -> dict:
    """Per-token time of the same op over a cache-resident store: one layer, batch 1, the most keys (whole 512-key
    splits, at least one) whose store fits 448 KiB (a 512 KiB L2 here), called as many times as the DRAM case reads
    tokens; the Python call overhead (as many calls over one key) is subtracted. Per (token x sequence x layer), ns.
    A DRAM per-token time well above it means the op waits on memory, whatever fraction of the bandwidth it uses."""
    res: dict = {}
    i32 = dict(dtype=torch.int32)
    q, k, v = (torch.randn(1, n, d, generator=gen) for n in (h, hkv, hkv))
    slots, chunk = torch.zeros(1, **i32), torch.ones(1, **i32)
    for key in ("kivi2", "fp16"):
        ctx = 2048
        while True:
            kivi, table, dense = make_layers(cfg, 1, hkv, d, 1, ctx, gen)
            store = (sum(t.numel() * t.element_size() for t in kivi[0]) if key == "kivi2"
                     else sum(t.numel() * 2 for t in dense[0]))
            if store <= 448 * 1024 or ctx <= 512:
                break
            ctx -= 512
        kop, fop = KiviCpuAttention(kivi, cfg, h), FullCpuAttention([dense[0][0]], [dense[0][1]], h)
        calls = max(1, tokens // ctx)
        times: dict[int, list[float]] = {ctx: [], 1: []}
        for r in range(rounds + 1):  # round 0 warms up
            for past_len in (ctx, 1):
                past = torch.full((1,), past_len, **i32)
                t0 = time.perf_counter()
                for _ in range(calls):
                    if key == "kivi2":
                        kop(0, q, k, v, slots, past, chunk, table, threads=1, phase=_abi.PHASE_ATTENTION)
                    else:
                        fop(0, q, k, v, slots, past, chunk, threads=1)
                if r:
                    times[past_len].append(time.perf_counter() - t0)
        ovh = statistics.median(times[1]) / calls
        res[key] = {"keys": ctx, "store_kib": round(store / 1024, 1), "calls": calls,
                    "call_overhead_us": round(ovh * 1e6, 1),
                    "ns_per_token": round((statistics.median(times[ctx]) / calls - ovh) / ctx * 1e9, 2)}
    return res


def bench_geometry(name: str, args, gen: torch.Generator) -> dict:
    n_model_layers, h, hkv, d, n_layers = GEOMETRIES[name]
    cfg = KiviConfig()
    b, ctx = args.batch, args.context
    kivi, table, dense = make_layers(cfg, n_layers, hkv, d, b, ctx, gen)
    q = torch.randn(b, h, d, generator=gen)
    k = torch.randn(b, hkv, d, generator=gen)
    v = torch.randn(b, hkv, d, generator=gen)
    i32 = dict(dtype=torch.int32)
    slots, past, chunk = torch.arange(b, **i32), torch.full((b,), ctx, **i32), torch.ones(b, **i32)
    n_q = cfg.num_quantized(ctx)
    q_bytes = n_q * (hkv * d * (cfg.k_bits + cfg.v_bits) / 8 + 2 * 2 * 2 * hkv * d / cfg.group_size)
    kivi_bytes = n_layers * b * (q_bytes + (ctx - n_q) * hkv * d * 4 * 2)  # + the fp32 window rows
    fp16_bytes = n_layers * b * (ctx + 1) * hkv * d * 2 * 2
    out: dict = {"layers_timed": n_layers, "model_layers": n_model_layers, "heads": h, "kv_heads": hkv,
                 "head_dim": d, "batch": b, "context": ctx,
                 "bytes_per_step": {"kivi2": int(kivi_bytes), "fp16": int(fp16_bytes)},
                 "working_set_mib": {"kivi2": round(sum(t.numel() * t.element_size() for L in kivi for t in L)
                                                    / 2 ** 20, 1),
                                     "fp16": round(sum(t.numel() * 2 for L in dense for t in L) / 2 ** 20, 1)},
                 "threads": {}}

    # both ops as the caches call them (KiviCache / FullCache's cpu backends): bound to the layers, checked once
    kop = KiviCpuAttention(kivi, cfg, h)
    fop = FullCpuAttention([kc for kc, _ in dense], [vc for _, vc in dense], h)

    def kivi_step(threads: int) -> None:
        for i in range(n_layers):
            kop(i, q, k, v, slots, past, chunk, table, threads=threads, phase=_abi.PHASE_ATTENTION)

    def fp16_step(threads: int) -> None:
        for i in range(n_layers):  # writes the token at row ctx (the same row each round), then attends over ctx + 1
            fop(i, q, k, v, slots, past, chunk, threads=threads)

    resident = resident_per_token(cfg, h, hkv, d, n_layers * b * ctx, gen, args.rounds)
    out["cache_resident_1_thread"] = resident
    for threads in args.threads:
        bw = read_bandwidth(threads)
        times: dict[str, list[float]] = {"kivi2": [], "fp16": []}
        cpu_times: dict[str, list[float]] = {"kivi2": [], "fp16": []}
        kivi_step(threads), fp16_step(threads)  # warm-up (thread pool, pages)
        for _ in range(args.rounds):
            for key, fn in (("kivi2", kivi_step), ("fp16", fp16_step)):
                t0, c0 = time.perf_counter(), time.process_time()
                fn(threads)
                times[key].append(time.perf_counter() - t0)
                cpu_times[key].append(time.process_time() - c0)
        med = {key: statistics.median(t) for key, t in times.items()}
        ratio = statistics.median(f / q_ for f, q_ in zip(times["fp16"], times["kivi2"], strict=True))
        cpu_ratio = statistics.median(f / q_ for f, q_ in zip(cpu_times["fp16"], cpu_times["kivi2"], strict=True))
        gbs = {"kivi2": kivi_bytes / med["kivi2"] / 1e9, "fp16": fp16_bytes / med["fp16"] / 1e9}
        # per-token time against the cache-resident one (1 thread; call overhead removed from both)
        stall = {key: (med[key] / (n_layers * b) - resident[key]["call_overhead_us"] * 1e-6) / ctx * 1e9
                 / resident[key]["ns_per_token"] for key in med} if threads == 1 else {}
        bound = {key: ("bandwidth-bound" if gbs[key] > 0.6 * bw else
                       "not classified (the cache-resident check runs with 1 thread)" if not stall else
                       f"memory-latency-bound (per-token time {stall[key]:.2f}x the cache-resident one)"
                       if stall[key] > 1.15 else "compute-bound") for key in gbs}
        out["threads"][str(threads)] = {
            "median_s_per_step_all_layers": {key: round(v_, 5) for key, v_ in med.items()},
            "median_cpu_s_per_step": {key: round(statistics.median(t), 5) for key, t in cpu_times.items()},
            "achieved_gb_s": {key: round(v_, 2) for key, v_ in gbs.items()},
            "read_bandwidth_gb_s_same_run": round(bw, 2),
            "fraction_of_bandwidth": {key: round(v_ / bw, 3) for key, v_ in gbs.items()},
            "bound": bound,
            **({"dram_over_cache_resident_per_token": {key: round(x, 3) for key, x in stall.items()}}
               if stall else {}),
            "speedup_kivi2_vs_fp16_median_of_round_ratios": round(ratio, 3),
            "speedup_kivi2_vs_fp16_cpu_time": round(cpu_ratio, 3),
        }
        print(f"{name} threads={threads}: kivi2 {med['kivi2'] * 1e3:.1f} ms ({gbs['kivi2']:.2f} GB/s), fp16 "
              f"{med['fp16'] * 1e3:.1f} ms ({gbs['fp16']:.2f} GB/s), read bw {bw:.1f} GB/s, speedup {ratio:.2f}x "
              f"(cpu time {cpu_ratio:.2f}x)", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/cpu_attention_op_{machine_tag()}.json"))
    args = ap.parse_args()
    if not native.available():
        print("native CPU library not built: run build_scripts/build_cpu_kernels.sh", file=sys.stderr)
        return 1
    lib = native.load_library()
    gen = torch.Generator().manual_seed(0)
    result = {
        "benchmark": "cpu_attention_op", "op": "decode attention (phase=attention), KIVI-2 (k2v2 G32 R128 block 128, "
        "fp16 scales, fp32 window) vs FP16 dense cache, both native (plugins/cpu)",
        "machine": machine_info(cpu_isa=lib.resolve_isa("auto"),
                                load_average_1m_at_start=round(os.getloadavg()[0], 2),
                                note="a shared machine: wall times are noisy; per-round ratios and cpu-time ratios "
                                     "are the robust comparison"),
        "geometries": {g: bench_geometry(g, args, gen) for g in args.geometry},
    }
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
