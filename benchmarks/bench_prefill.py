"""KIVI CUDA prefill benchmark: the prefill attention kernel and the append of a chunk, against torch SDPA (causal,
FP16) and a plain FP16 cache write, in one run.

    PYTHONPATH=. python3 benchmarks/bench_prefill.py [--out FILE] [--time-budget S] [--l2 cold|warm]
    python3 benchmarks/bench_prefill.py --dry-run [--gpu h100|h200]        (no GPU, no torch)

Llama-3-8B shapes (H=32, Hkv=8, D=128), one sequence, chunks of 512 / 2K / 8K tokens over 0 / 8K / 32K tokens of
history (a random KIVI state), L2-cold (rotating buffer sets) unless --l2 warm:
  - kivi_prefill_attention: invokeKiviAttention of the chunk (>= 64 query rows: the prefill kernel), attending to
    the dequantized history, the window and the chunk (causal);
  - kivi_append: invokeKiviAppend of the chunk (quantize the groups it completes, write the window rows);
  - kivi_prefill_step: both (invokeKiviStep);
  - sdpa_causal_fp16: torch scaled_dot_product_attention of the chunk's queries over history + chunk, causal with
    the diagonal at the end (torch.nn.attention.bias.causal_lower_right; is_causal when there is no history);
  - fp16_cache_write: the chunk's K and V copied into an FP16 cache [Hkv, S, D] at [history, history + chunk).
Flops (causal) = 4 * chunk * (history + (chunk + 1) / 2) * H * D. Writes benchmarks/results/bench_prefill_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import gpu_plan  # noqa: E402  (standard library only: the dry run needs no torch)

from trtllm_kivi.format import KiviConfig, quantized_bytes_per_token  # noqa: E402

PHASE_ATTENTION, PHASE_APPEND, PHASE_STEP = 1, 2, 3  # _abi's phases


def causal_flops(chunk: int, hist: int, h: int, d: int) -> float:
    return 4.0 * chunk * (hist + (chunk + 1) / 2) * h * d


def kivi_bytes(cfg: KiviConfig, h: int, hkv: int, d: int, chunk: int, hist: int) -> dict[str, int]:
    """Bytes the prefill attention reads (history store + window rows + q/k/v of the chunk) and writes (out), and
    what the append reads (the chunk's k/v) and writes (the groups it completes, the window rows)."""
    n_q = cfg.num_quantized(hist)
    row = 2 * hkv * d * 2
    qkv = chunk * (h + 2 * hkv) * d * 2
    att = int(n_q * quantized_bytes_per_token(cfg, hkv, d)) + (hist - n_q) * row + qkv + chunk * h * d * 2
    new_groups = cfg.num_quantized(hist + chunk) - n_q
    app = chunk * row + int(new_groups * quantized_bytes_per_token(cfg, hkv, d)) \
        + min(chunk, cfg.window_capacity) * row
    return {"attention": att, "append": app}


def sdpa_causal(q, k, v, hist: int):
    """(callable, method): SDPA of q [1, H, C, D] over k/v [1, Hkv, hist + C, D], causal with the diagonal at the
    end; the first form this torch runs (causal_lower_right with GQA, then with K/V expanded to H heads)."""
    import torch
    import torch.nn.functional as F

    if hist == 0:
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), "is_causal"
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[2], k.shape[2])
    try:
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        torch.cuda.synchronize()
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)), \
            "causal_lower_right+enable_gqa"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        first = f"{type(e).__name__}: {e}"[:160]
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return (lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=bias)), \
        f"causal_lower_right over K/V expanded to H heads (with GQA: {first})"


def measure(lib, cfg: KiviConfig, chunk: int, hist: int, facts: dict, l2: str) -> dict:
    import gpu_common as gc
    import kernel_timing as kt
    import torch

    h, hkv, d = gpu_plan.MODELS["llama-3-8b"]
    flops = causal_flops(chunk, hist, h, d)
    nb = kivi_bytes(cfg, h, hkv, d, chunk, hist)
    copies = gpu_plan.rotation_copies(nb["attention"], facts["l2_bytes"], l2)
    row: dict = {"model": "llama-3-8b", "heads": h, "kv_heads": hkv, "head_dim": d, "chunk": chunk, "history": hist,
                 "l2": l2, "flops": flops, "copies": {"kivi": copies}}

    def rate(t: dict, nbytes: int) -> dict:
        return gc.with_bandwidth(t, nbytes) | {"tflops": flops / (t["median_ms"] * 1e-3) / 1e12}

    state = kt.KiviState(lib, cfg, h, hkv, d, 1, hist + chunk, copies, chunk=chunk)
    for name, phase, nbytes in (("kivi_prefill_attention", PHASE_ATTENTION, nb["attention"]),
                                ("kivi_append", PHASE_APPEND, nb["append"]),
                                ("kivi_prefill_step", PHASE_STEP, nb["attention"] + nb["append"])):
        fns, refused, plan = state.launchers(hist, 0, phase)
        row[name] = {"refused": refused} if refused else rate(gc.time_launches(fns), nbytes) | {"plan": plan}
    row["kivi_error_flag"] = state.error_flag()
    del state
    torch.cuda.empty_cache()
    fbytes = (hist + chunk) * 2 * hkv * d * 2 + 2 * chunk * h * d * 2
    fcopies = gpu_plan.rotation_copies(fbytes, facts["l2_bytes"], l2)
    sets = [(torch.randn(1, h, chunk, d, dtype=torch.float16, device="cuda"),
             torch.randn(1, hkv, hist + chunk, d, dtype=torch.float16, device="cuda"),
             torch.randn(1, hkv, hist + chunk, d, dtype=torch.float16, device="cuda")) for _ in range(fcopies)]
    fns, methods = [], set()
    for q, k, v in sets:
        fn, method = sdpa_causal(q, k, v, hist)
        fns.append(fn)
        methods.add(method)
    row["sdpa_causal_fp16"] = rate(gc.time_launches(fns), fbytes) | {"method": "; ".join(sorted(methods))}
    row["copies"]["fp16"] = fcopies
    del sets, fns
    torch.cuda.empty_cache()
    wbytes = 2 * 2 * chunk * hkv * d * 2  # K and V: read the chunk, write the cache rows
    wcopies = gpu_plan.rotation_copies(wbytes, facts["l2_bytes"], l2)
    caches = [(torch.randn(chunk, hkv, d, dtype=torch.float16, device="cuda"),
               torch.randn(chunk, hkv, d, dtype=torch.float16, device="cuda"),
               torch.empty(hkv, hist + chunk, d, dtype=torch.float16, device="cuda"),
               torch.empty(hkv, hist + chunk, d, dtype=torch.float16, device="cuda")) for _ in range(wcopies)]

    def write(k, v, kc, vc) -> None:
        kc[:, hist:].copy_(k.transpose(0, 1))
        vc[:, hist:].copy_(v.transpose(0, 1))
    row["fp16_cache_write"] = gc.with_bandwidth(gc.time_launches([lambda c=c: write(*c) for c in caches]), wbytes)
    row["copies"]["write"] = wcopies
    del caches
    torch.cuda.empty_cache()
    ms = {k: row[k].get("median_ms") for k in ("kivi_prefill_attention", "kivi_append", "kivi_prefill_step",
                                                 "sdpa_causal_fp16", "fp16_cache_write")}
    if ms["kivi_prefill_attention"] and ms["sdpa_causal_fp16"]:
        row["attention_speedup_vs_sdpa"] = ms["sdpa_causal_fp16"] / ms["kivi_prefill_attention"]
    if ms["kivi_append"] and ms["fp16_cache_write"]:
        row["append_time_vs_fp16_write"] = ms["kivi_append"] / ms["fp16_cache_write"]
    if ms["kivi_prefill_step"] and ms["sdpa_causal_fp16"] and ms["fp16_cache_write"]:
        row["step_speedup_vs_sdpa_plus_write"] = (ms["sdpa_causal_fp16"] + ms["fp16_cache_write"]) \
            / ms["kivi_prefill_step"]
    return row


def summary_table(rows: list[dict]) -> str:
    lines = [f"{'chunk':>6s} {'hist':>6s} {'kivi att ms':>11s} {'TFLOP/s':>8s} {'sdpa ms':>8s} {'x sdpa':>7s} "
             f"{'append ms':>9s} {'fp16 write ms':>13s} {'step x':>7s}"]
    for r in rows:
        a, s = r.get("kivi_prefill_attention", {}), r.get("sdpa_causal_fp16", {})
        lines.append(f"{r['chunk']:6d} {r['history']:6d} {a.get('median_ms', 0):11.3f} {a.get('tflops', 0):8.1f} "
                     f"{s.get('median_ms', 0):8.3f} {r.get('attention_speedup_vs_sdpa', 0):7.2f} "
                     f"{r.get('kivi_append', {}).get('median_ms', 0):9.3f} "
                     f"{r.get('fp16_cache_write', {}).get('median_ms', 0):13.3f} "
                     f"{r.get('step_speedup_vs_sdpa_plus_write', 0):7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-budget", type=float, default=60.0)
    ap.add_argument("--l2", choices=("cold", "warm"), default="cold")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (no GPU, no torch) and exit")
    ap.add_argument("--gpu", choices=sorted(gpu_plan.ASSUMED_GPUS), default="h100", help="dry run: assumed GPU")
    args = ap.parse_args(argv)
    if args.time_budget <= 0:
        ap.error(f"--time-budget={args.time_budget} must be > 0 seconds")
    cfg = KiviConfig()
    if args.dry_run:
        runs = gpu_plan.prefill_plan(gpu_plan.ASSUMED_GPUS[args.gpu], cfg, args.l2)
        print(gpu_plan.describe(runs, args.time_budget, "bench_prefill"))
        return 0
    import gpu_common as gc
    import torch

    from trtllm_kivi.cuda import _abi

    if not torch.cuda.is_available():
        print("bench_prefill: torch.cuda.is_available() is False; nothing to measure", file=sys.stderr)
        return 2
    budget = gpu_plan.Budget(args.time_budget)
    lib = _abi.load_library()
    facts = gc.gpu_facts()
    report: dict = {"benchmark": "bench_prefill", "config": cfg.to_dict(), "machine": gc.machine_info(lib),
                    "l2": args.l2, "notes": ["CUDA events around CUDA-graph replays, medians; L2-cold unless l2 "
                                             "says warm", "flops counted causal (each query sees history + its "
                                             "prefix)"]}
    rows, skipped = [], []
    per = {tuple(r.shape.values()): 0.0 for r in gpu_plan.prefill_plan(gpu_plan.ASSUMED_GPUS["h100"], cfg)}
    for r in gpu_plan.prefill_plan(gpu_plan.ASSUMED_GPUS["h100"], cfg):
        per[tuple(r.shape.values())] += r.est_s
    for hist in gpu_plan.PREFILL_HISTORY:
        for chunk in gpu_plan.PREFILL_CHUNKS:
            if not budget.allows(min(per[("llama-3-8b", chunk, hist)], 5.0)):
                skipped.append({"chunk": chunk, "history": hist, "reason": "time budget spent"})
                continue
            rows.append(measure(lib, cfg, chunk, hist, facts, args.l2))
            print(f"chunk {chunk} over {hist}: done", flush=True)
    report["prefill"], report["skipped"], report["elapsed_s"] = rows, skipped, budget.spent()
    gc.write_json(gc.result_path("bench_prefill", args.out), report)
    print(summary_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
