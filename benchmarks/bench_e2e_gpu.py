"""End-to-end decode on the GPU: a Llama-3-8B-shaped model through the torch runtime with CUDA-graph decode steps,
KIVI-2 (cuda backend) against the same runtime over an FP16 cache, in one run.

    PYTHONPATH=. python3 benchmarks/bench_e2e_gpu.py [--out FILE] [--time-budget S] [--steps N]
    python3 benchmarks/bench_e2e_gpu.py --dry-run [--gpu h100|h200]        (no GPU, no torch)

The model: Llama-3-8B's shape (32 layers, dim 4096, 32 heads, 8 KV heads, head_dim 128, FFN 14336, vocab 128256,
Llama-3 RoPE), random fp16 weights made on the device (matrices N(0, 1/fan_in), unit norms): nothing is
downloaded; speed does not depend on the values. Per cache kind and (batch 1/8/32, context 4K/32K) where the cache
fits: the cache is filled with random values and advanced to the context without running a prefill, then decode steps
run through runtime/cuda_graph.GraphDecoder (one captured step per batch size; the cache's host bookkeeping before
each replay, greedy tokens fed back on the device): tokens/s over `--steps` steps (default 32: one flush per
sequence), the graph replay alone, the host's share.
  - kivi2: KiviCache (k2v2, G32, R128) with the cuda backend;
  - fp16: FullCache (fp16) whose attention inside the graph is Fp16GraphAttention: flash attention's varlen kernel
    with device lengths when this torch runs it correctly (checked against SDPA first), else SDPA with a device
    mask; its per-layer time next to torch SDPA over the exact length (a step's attention could be that much faster:
    "fp16_exact_sdpa_step_ms" subtracts the difference, and the targets use the faster FP16 figure).
Max batch at 32K: the largest batch whose cache allocates and runs one decode step (eager), found by allocating and
bisecting (torch.cuda.OutOfMemoryError = does not fit); the calculator only brackets the search.
Writes benchmarks/results/bench_e2e_gpu_<gpu>.json and prints a summary table last.
"""

from __future__ import annotations

import argparse
import gc as pygc
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import gpu_plan  # noqa: E402  (standard library only: the dry run needs no torch)

from trtllm_kivi.format import KiviConfig, quantized_bytes_per_token  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                 norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                 name="llama-3-8b-shaped (random weights)")
MAX_BATCH_CONTEXT = 32768


def random_model(seed: int = 0):
    """The Llama-3-8B-shaped LlamaModel with random fp16 weights made on the GPU (the module is built on the meta
    device, then every weight is a new device tensor)."""
    import torch

    from trtllm_kivi.models import LlamaModel, ModelConfig
    from trtllm_kivi.models.llama import rope_inv_freq

    cfg = ModelConfig(**LLAMA3_8B)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.inv_freq = rope_inv_freq(cfg)  # host fp32, as the model keeps it
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        if p.dim() == 1:
            w = torch.ones(p.shape, dtype=torch.float16, device="cuda")
        else:
            std = 1.0 if name == "embed" else 1.0 / math.sqrt(p.shape[1])
            w = torch.empty(p.shape, dtype=torch.float16, device="cuda").normal_(0.0, std, generator=g)
        setattr(model.get_submodule(owner) if owner else model, attr, torch.nn.Parameter(w, requires_grad=False))
    return model.eval()


def make_runner(model, kind: str, batch: int, capacity: int, fill: bool = True):
    """A TorchRunner over a fresh cache of `batch` slots, `capacity` tokens each (random values when fill)."""
    import torch

    from trtllm_kivi.cache import FullCache, KiviCache
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    geom = model.cfg.geometry
    if kind == "kivi2":
        cache = KiviCache(KiviConfig(), geom, batch, capacity, torch.float16, "cuda", backend="cuda")
        if fill:
            for layer in cache.layers:
                for name, t in zip(layer._fields, layer, strict=True):
                    if t.dtype == torch.int32:
                        t.random_()
                    elif name.endswith("scale"):
                        t.fill_(0.01)
                    elif name.endswith("zero"):
                        t.fill_(-0.02)
                    else:
                        t.normal_()
    else:
        cache = FullCache(geom, batch, capacity, torch.float16, "cuda", backend="torch")
        if fill:
            for t in cache.k + cache.v:
                t.normal_()
    return TorchRunner(model, cache)


def advance(runner, batch: int, context: int) -> list[int]:
    """Slots 0..batch-1 holding `context` tokens each, without a prefill (the cache's bookkeeping only: blocks and
    lengths; the values are what the buffers hold)."""
    slots = [runner.add_sequence() for _ in range(batch)]
    step = runner.cache.begin_step(slots, [context] * batch)
    runner.cache.end_step(step)
    return slots


def choose_fp16_method(model) -> tuple[str, dict]:
    """The first Fp16GraphAttention method whose output matches torch SDPA over the exact lengths (ragged: 2
    sequences of 300 and 77 tokens, garbage beyond them)."""
    import torch
    import torch.nn.functional as F

    from trtllm_kivi.cache import FullCache, Step
    from trtllm_kivi.runtime.cuda_graph import FP16_METHODS, Fp16GraphAttention

    geom = model.cfg.geometry
    h, hkv, d = geom.num_heads, geom.num_kv_heads, geom.head_dim
    cache = FullCache(geom, 2, 512, torch.float16, "cuda", backend="torch")
    for t in cache.k[:1] + cache.v[:1]:
        t.normal_()
    lens = [300, 77]
    q = torch.randn(2, h, d, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(2, hkv, d, dtype=torch.float16, device="cuda") for _ in range(2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    step = Step([0, 1], lens, [1, 1], i32([0, 1]), i32(lens), i32([1, 1]), i32([[], []]))
    checks = {}
    for method in FP16_METHODS:
        kc, vc = cache.k[0].clone(), cache.v[0].clone()
        try:
            att = Fp16GraphAttention(cache, method)
            out = att.attention(0, q, k, v, step).float()
            want = []
            for b, n in enumerate(lens):  # the new token is now row n of each sequence
                kk, vv = cache.k[0][b, :, :n + 1], cache.v[0][b, :, :n + 1]
                want.append(F.scaled_dot_product_attention(q[b:b + 1, :, None], kk[None], vv[None],
                                                           enable_gqa=True)[0, :, 0])
            err = float((out - torch.stack(want).float()).abs().max())
            checks[method] = {"max_abs_error": err, "ok": err < 2e-2}
        except (RuntimeError, TypeError, ValueError) as e:
            checks[method] = {"error": f"{type(e).__name__}: {e}"[:300], "ok": False}
        cache.k[0].copy_(kc)
        cache.v[0].copy_(vc)
        if checks[method]["ok"]:
            return method, checks
    raise RuntimeError(f"no graph-safe FP16 attention method matches SDPA: {checks}")


def attention_pair_ms(runner, batch: int, context: int, method: str) -> dict:
    """One layer's FP16 decode attention: the graph method (device lengths) and torch SDPA over the exact length."""
    import gpu_common as gc
    import torch
    import torch.nn.functional as F

    from trtllm_kivi.cache import Step
    from trtllm_kivi.runtime.cuda_graph import Fp16GraphAttention

    cache = runner.cache
    geom = cache.geom
    q = torch.randn(batch, geom.num_heads, geom.head_dim, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(batch, geom.num_kv_heads, geom.head_dim, dtype=torch.float16, device="cuda")
            for _ in range(2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    step = Step(list(range(batch)), [context] * batch, [1] * batch, i32(list(range(batch))), i32([context] * batch),
                i32([1] * batch), torch.zeros(batch, 0, dtype=torch.int32, device="cuda"))
    att = Fp16GraphAttention(cache, method)
    kc, vc = cache.k[0][:batch, :, :context + 1], cache.v[0][:batch, :, :context + 1]
    graph_t = gc.time_launches([lambda: att.attention(0, q, k, v, step)])
    exact_t = gc.time_launches([lambda: F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)])
    return {"graph_method_ms": graph_t["median_ms"], "exact_sdpa_ms": exact_t["median_ms"]}


def decode_run(model, kind: str, batch: int, context: int, steps: int, fp16_method: str) -> dict:
    """Tokens/s of `steps` graph-replayed decode steps at `context`."""
    import torch

    from trtllm_kivi.runtime.cuda_graph import GraphDecoder

    t0 = time.perf_counter()
    runner = make_runner(model, kind, batch, context + steps + 8)
    slots = advance(runner, batch, context)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    dec = GraphDecoder(runner, fp16_method=fp16_method)
    t0 = time.perf_counter()
    dec.step(slots, [1] * batch)  # warm-up = this step, then the capture
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    dec.step(slots)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(steps):
        logits = dec.step(slots)
    end.record()
    end.synchronize()
    wall = time.perf_counter() - t0
    step_ms = start.elapsed_time(end) / steps
    graph = dec._static[batch].graph  # the graph alone, same inputs each replay (no host bookkeeping between)
    assert graph is not None
    s2, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s2.record()
    for _ in range(8):
        graph.replay()
    e2.record()
    e2.synchronize()
    row = {"kind": kind, "batch": batch, "context": context, "steps": steps, "step_ms": step_ms,
           "tokens_per_s": batch * 1e3 / step_ms, "graph_replay_ms": s2.elapsed_time(e2) / 8,
           "wall_s": wall, "setup_s": setup_s, "capture_s": capture_s, "kv_bytes": runner.kv_nbytes,
           "finite_logits": bool(torch.isfinite(logits).all())}
    if kind == "fp16":
        row["fp16_attention_method"] = fp16_method
        row["attention_per_layer"] = attention_pair_ms(runner, batch, context + steps + 2, fp16_method)
        a = row["attention_per_layer"]
        extra = max(0.0, a["graph_method_ms"] - a["exact_sdpa_ms"]) * model.cfg.n_layers
        row["fp16_exact_sdpa_step_ms"] = step_ms - extra
        row["fp16_exact_sdpa_tokens_per_s"] = batch * 1e3 / row["fp16_exact_sdpa_step_ms"]
    del dec, runner
    pygc.collect()
    torch.cuda.empty_cache()
    return row


def fits(model, kind: str, batch: int, context: int, fp16_method: str) -> bool:
    """Whether a cache of `batch` sequences at `context` allocates and runs one decode step (eager)."""
    import torch

    from trtllm_kivi.runtime.cuda_graph import GraphDecoder

    ok = True
    try:
        runner = make_runner(model, kind, batch, context + 8, fill=False)
        slots = advance(runner, batch, context)
        GraphDecoder(runner, fp16_method=fp16_method, capture=False).step(slots, [1] * batch)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        ok = False
    runner = None  # the frames of the exception are gone here: free everything before the next try
    pygc.collect()
    torch.cuda.empty_cache()
    return ok


def max_batch(model, kind: str, context: int, fp16_method: str, budget) -> dict:
    """The largest batch that fits (bisection over allocations); the calculator's estimate only brackets it."""
    import torch

    geom = model.cfg.geometry
    per_seq = (geom.num_layers * context * quantized_bytes_per_token(KiviConfig(), geom.num_kv_heads, geom.head_dim)
               if kind == "kivi2" else geom.num_layers * gpu_plan.fp16_decode_bytes(geom.num_kv_heads,
                                                                                   geom.head_dim, 1, context))
    guess = max(1, int(torch.cuda.mem_get_info()[0] / per_seq))
    tries: list[tuple[int, bool]] = []
    lo, hi, b = 0, None, guess
    while budget.allows(5.0):
        ok = fits(model, kind, b, context, fp16_method)
        tries.append((b, ok))
        if ok:
            lo = b
        else:
            hi = b
        if hi is not None and (hi - lo <= 1 or hi == 1):
            break
        if hi is None:
            b = max(b + 1, int(b * 1.25))  # the estimate fits: grow until one does not
        elif lo == 0:
            b = max(1, int(b * 0.8))  # the estimate does not fit: shrink until one does
        else:
            b = (lo + hi) // 2
    return {"context": context, "max_batch": lo, "first_failing": hi, "tries": tries, "estimate": guess,
            "complete": hi is not None and hi - lo <= 1}


def targets(rows: list[dict], mb: dict) -> dict:
    def pick(kind: str, batch: int, ctx: int) -> dict | None:
        return next((r for r in rows if (r["kind"], r["batch"], r["context"]) == (kind, batch, ctx)), None)

    k8, f8 = pick("kivi2", 8, 32768), pick("fp16", 8, 32768)
    x = None
    if k8 and f8:
        fp16_best = max(f8["tokens_per_s"], f8.get("fp16_exact_sdpa_tokens_per_s", 0.0))
        x = k8["tokens_per_s"] / fp16_best
    kb, fb = (mb.get(k, {}).get("max_batch") for k in ("kivi2", "fp16"))
    ratio = kb / fb if kb and fb else None
    return {"b8_32k_tokens_per_s_ge_2x_fp16": {"value": x, "met": None if x is None else x >= 2.0},
            "max_batch_32k_ge_4x_fp16": {"value": ratio, "met": None if ratio is None else ratio >= 4.0}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--time-budget", type=float, default=90.0)
    ap.add_argument("--steps", type=int, default=gpu_plan.E2E_STEPS)
    ap.add_argument("--dry-run", action="store_true", help="print the plan (no GPU, no torch) and exit")
    ap.add_argument("--gpu", choices=sorted(gpu_plan.ASSUMED_GPUS), default="h100", help="dry run: assumed GPU")
    args = ap.parse_args(argv)
    if args.time_budget <= 0 or args.steps < 1:
        ap.error(f"--time-budget={args.time_budget} must be > 0 and --steps={args.steps} >= 1")
    if args.dry_run:
        print(gpu_plan.describe(gpu_plan.e2e_plan(gpu_plan.ASSUMED_GPUS[args.gpu]), args.time_budget,
                                "bench_e2e_gpu"))
        return 0
    import gpu_common as gc
    import torch

    if not torch.cuda.is_available():
        print("bench_e2e_gpu: torch.cuda.is_available() is False; nothing to measure", file=sys.stderr)
        return 2
    budget = gpu_plan.Budget(args.time_budget)
    from trtllm_kivi.cuda import _abi

    lib = _abi.load_library()
    model = random_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    method, checks = choose_fp16_method(model)
    report: dict = {"benchmark": "bench_e2e_gpu", "machine": gc.machine_info(lib), "model": LLAMA3_8B,
                    "weights_bytes": weights, "kivi": KiviConfig().to_dict(), "fp16_attention": method,
                    "fp16_attention_checks": checks,
                    "notes": ["decode steps through runtime/cuda_graph.GraphDecoder: step_ms = CUDA events around "
                              "`steps` steps including the host bookkeeping before each replay",
                              "max batch: allocation + one eager decode step at the context; OOM = does not fit"]}
    rows, skipped = [], []
    for kind in ("kivi2", "fp16"):
        for batch in gpu_plan.E2E_BATCHES:
            for ctx in gpu_plan.E2E_CONTEXTS:
                need = batch * (ctx + args.steps + 8) * (
                    model.cfg.n_layers * quantized_bytes_per_token(KiviConfig(), 8, 128) if kind == "kivi2"
                    else model.cfg.n_layers * gpu_plan.fp16_decode_bytes(8, 128, 1, 1))
                if need > 0.9 * torch.cuda.mem_get_info()[0]:
                    skipped.append({"kind": kind, "batch": batch, "context": ctx,
                                    "reason": f"the cache needs {need / 2**30:.1f} GiB"})
                    continue
                if not budget.allows(6.0):
                    skipped.append({"kind": kind, "batch": batch, "context": ctx, "reason": "time budget spent"})
                    continue
                try:
                    rows.append(decode_run(model, kind, batch, ctx, args.steps, method))
                    print(f"{kind} b={batch} ctx={ctx}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
                except torch.cuda.OutOfMemoryError as e:
                    skipped.append({"kind": kind, "batch": batch, "context": ctx, "reason": f"OOM: {e}"[:200]})
                    print(f"{kind} b={batch} ctx={ctx}: out of memory", flush=True)
                pygc.collect()
                torch.cuda.empty_cache()
    mb = {}
    for kind in ("kivi2", "fp16"):
        if budget.allows(10.0):
            mb[kind] = max_batch(model, kind, MAX_BATCH_CONTEXT, method, budget)
    report["decode"], report["skipped"], report["max_batch"] = rows, skipped, mb
    report["targets"] = targets(rows, mb)
    report["elapsed_s"] = budget.spent()
    gc.write_json(gc.result_path("bench_e2e_gpu", args.out), report)
    print(f"{'kind':6s} {'batch':>5s} {'ctx':>6s} {'tok/s':>9s} {'step ms':>8s} {'graph ms':>8s}")
    for r in rows:
        print(f"{r['kind']:6s} {r['batch']:5d} {r['context']:6d} {r['tokens_per_s']:9.0f} {r['step_ms']:8.2f} "
              f"{r['graph_replay_ms']:8.2f}")
    print("max batch at 32K: " + ", ".join(f"{k} {v['max_batch']}" for k, v in mb.items())
          + f"; targets: {report['targets']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
