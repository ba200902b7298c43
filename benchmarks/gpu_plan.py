"""What the GPU benchmarks run, planned without a GPU and without torch: shapes, byte counts, L2 rotation, decode
variants, each run's estimated seconds and the budget it must fit.

The benchmarks (bench_kernels.py, bench_prefill.py, bench_e2e_gpu.py, ncu_profile.py) and the scripts
(build_scripts/gpu_check.sh, gpu_tune.sh) take their run lists from here, so a dry run (`--dry-run`) prints exactly
what a GPU run would measure and tests/test_gpu_scripts.py keeps that plan working on the CPU.

    python3 benchmarks/gpu_plan.py check|tune [--gpu h100|h200] [--library PATH] [--variants-json FILE]
                                              [--sweep-budget S] [--prefill-budget S] [--e2e-budget S]

Estimated seconds are a planning model (bytes at an assumed bandwidth, fixed overheads), never a measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trtllm_kivi.format import KiviConfig, quantized_bytes_per_token  # noqa: E402  (standard library only)

MODELS = {"llama-3-8b": (32, 8, 128), "llama-2-7b": (32, 32, 128)}  # heads, kv heads, head_dim
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)
# The shapes the targets name (B8 32K: the headline; B1 4K: the small-batch target; B1 32K: "from B1 32K up").
HEADLINE = (("llama-3-8b", 8, 32768), ("llama-3-8b", 1, 4096), ("llama-3-8b", 1, 32768))
PREFILL_CHUNKS = (512, 2048, 8192)
PREFILL_HISTORY = (0, 8192, 32768)
E2E_BATCHES = (1, 8, 32)
E2E_CONTEXTS = (4096, 32768)
E2E_STEPS = 32  # timed decode steps per configuration: one whole group, so exactly one flush per sequence
# Assumed GPUs for a dry run (no device to ask): L2 bytes, usable memory, read bandwidth for time estimates.
ASSUMED_GPUS = {"h100": {"l2_bytes": 50 << 20, "memory_bytes": 79 << 30, "read_gbps": 3000.0, "sms": 132},
                "h200": {"l2_bytes": 60 << 20, "memory_bytes": 139 << 30, "read_gbps": 4300.0, "sms": 132}}
L2_FACTOR = 2.0  # rotating buffers hold more than L2_FACTOR x the L2 (L2-cold timing)
MAX_COPIES = 64
MIN_GRAPH_MS = 2.0  # a timed graph replays >= this much work (launch overhead amortized)
WARMUP, REPS = 3, 10
MEMORY_FRACTION = 0.8  # a shape whose buffers exceed this fraction of free memory is skipped


# ---------------------------------------------------------------------------------------------- steps and bytes


def is_flush_step(cfg: KiviConfig, past: int) -> bool:
    """Whether appending token `past` (the step from past to past + 1) quantizes a group: past + 1 is a flush point
    S + R + kG, k >= 1."""
    free = past + 1 - cfg.sink_tokens - cfg.residual_length
    return free >= cfg.group_size and free % cfg.group_size == 0


def flush_past(cfg: KiviConfig, context: int) -> int:
    """The largest past <= context - 1 whose decode step flushes (context - 1 for the benchmark contexts, which
    are multiples of G: past = context - 1 = R - 1 mod G)."""
    for past in range(context - 1, -1, -1):
        if is_flush_step(cfg, past):
            return past
    raise ValueError(f"context={context} has no flush step (needs > {cfg.sink_tokens + cfg.residual_length} tokens)")


def nonflush_past(cfg: KiviConfig, context: int) -> int:
    """One token before flush_past: a decode step that only writes its window row (31 of every 32 steps)."""
    return flush_past(cfg, context) - 1


def kivi_decode_bytes(cfg: KiviConfig, h: int, hkv: int, d: int, batch: int, past: int) -> tuple[int, int]:
    """(read, written) bytes of one decode step's attention at `past`: codes + scales/zeros of the n_q quantized
    tokens, the window rows, the new token's k/v, q; the output."""
    n_q = cfg.num_quantized(past)
    row = 2 * 2 * hkv * d  # K + V fp16 per full-precision token
    read = batch * (n_q * quantized_bytes_per_token(cfg, hkv, d) + (past - n_q) * row + row + 2 * h * d)
    return int(read), batch * 2 * h * d


def fp16_decode_bytes(hkv: int, d: int, batch: int, context: int) -> int:
    """K + V of an FP16 cache of `context` tokens: what SDPA (or the same kernel over FP16) reads."""
    return 2 * 2 * batch * hkv * context * d


def rotation_copies(nbytes: int, l2_bytes: int, l2: str = "cold") -> int:
    """Buffer sets to rotate through so that one replay cycle reads more than L2_FACTOR x the L2 (1 when warm)."""
    if l2 == "warm" or nbytes <= 0:
        return 1
    return max(1, min(MAX_COPIES, math.ceil(L2_FACTOR * l2_bytes / nbytes)))


def timing_seconds(kernel_s: float, copies: int) -> float:
    """Seconds one timed measurement takes (gpu_common.time_launches): eager probe, capture, warmup and reps of a
    graph of >= MIN_GRAPH_MS and >= `copies` launches."""
    inner = max(copies, math.ceil(MIN_GRAPH_MS * 1e-3 / max(kernel_s, 1e-6)))
    inner = math.ceil(inner / copies) * copies
    return 0.03 + 2 * kernel_s + (WARMUP + REPS) * inner * kernel_s


# ---------------------------------------------------------------------------------------------- variants


def variants_from_library(path: str | Path) -> list[dict] | None:
    """The decode variants the library declares through its host-only C ABI (kiviCDecodeVariantCount / Name /
    Describe; plugins/kernels/include/kiviCApi.h), or None when the library has no variant API."""
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "kiviCDecodeVariantCount"):
        return None
    lib.kiviCDecodeVariantCount.restype = ctypes.c_int32
    lib.kiviCDecodeVariantName.argtypes = [ctypes.c_int32]
    lib.kiviCDecodeVariantName.restype = ctypes.c_char_p
    lib.kiviCDecodeVariantDescribe.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    lib.kiviCDecodeVariantDescribe.restype = ctypes.c_int32
    out = []
    for i in range(int(lib.kiviCDecodeVariantCount())):
        buf = ctypes.create_string_buffer(4096)
        tunables: dict = {}
        if lib.kiviCDecodeVariantDescribe(i, buf, len(buf)) >= 0 and buf.value:
            try:
                tunables = json.loads(buf.value.decode())
            except ValueError:
                tunables = {"unparsed": buf.value.decode()}
        out.append({"id": i, "name": (lib.kiviCDecodeVariantName(i) or b"?").decode(), "tunables": tunables})
    return out


def load_variants(library: str | Path | None = None, fake_json: str | Path | None = None) -> tuple[list[dict], str]:
    """(variants, source). A fake list (a JSON file) only plans a dry run; a library without the variant API times
    the default alone (id 0, what the library does without a choice)."""
    if fake_json is not None:
        return json.loads(Path(fake_json).read_text()), f"fake list {Path(fake_json).name} (planning only)"
    if library is not None and Path(library).is_file():
        try:
            found = variants_from_library(library)
        except OSError as e:  # a dry run plans anyway; a GPU run fails on loading it, with this message
            return [{"id": 0, "name": "default", "tunables": {}}], f"the library did not load ({e}): the default only"
        if found:
            return found, "library"
    return [{"id": 0, "name": "default", "tunables": {}}], "no variant API in the library: the default only"


def param_checks(library: str | Path, variants: list[dict], cfg: KiviConfig | None = None, headline_only: bool = True,
                 sms: int = 132) -> list[dict]:
    """The library's host checks of every variant's decode step at the planned shapes, without a GPU or torch:
    KiviStepParams filled as the benchmark fills them (fake, aligned device pointers: validation reads none),
    then kiviCValidate (a refusal names the variant and the value) and the launch plan. One row per (variant, shape,
    flush / non-flush past)."""
    from trtllm_kivi.cuda import _abi
    from trtllm_kivi.format import dtype_code

    cfg = cfg or KiviConfig()
    lib = _abi.KiviLibrary(library)  # checks sizeof(KiviStepParams) against the mirror
    shapes = list(HEADLINE) + ([] if headline_only else [(m, b, c) for m in MODELS for b in BATCHES for c in CONTEXTS
                                                          if (m, b, c) not in HEADLINE])
    rows = []
    for model, batch, ctx in shapes:
        h, hkv, d = MODELS[model]
        mbs = cfg.max_blocks_per_seq(ctx)
        for past in (flush_past(cfg, ctx), nonflush_past(cfg, ctx)):
            for v in variants:
                p = _abi.KiviStepParams()
                p.numHeads, p.numKvHeads, p.headDim, p.kBits, p.vBits = h, hkv, d, cfg.k_bits, cfg.v_bits
                p.groupSize, p.residualLength, p.blockSize = cfg.group_size, cfg.residual_length, cfg.block_size
                p.scaleDtype, p.keyGrouping, p.actDtype = dtype_code(cfg.scale_dtype), 0, dtype_code("float16")
                p.batch, p.numTokens, p.maxChunkLen, p.maxSeqLen = batch, batch, 1, past + 1
                p.numBlocks, p.numSlots, p.maxBlocksPerSeq, p.numSms = batch * mbs, batch, mbs, sms
                for i, name in enumerate(_abi._PTR_FIELDS):
                    setattr(p, name, (i + 1) << 20)  # distinct, 1 MiB-aligned, never dereferenced on the host
                if hasattr(p, "decodeVariant"):
                    p.decodeVariant = v["id"]
                p.workspaceSize = lib.workspace_size(p)
                refused = lib.validate(p, _abi.PHASE_STEP)
                row = {"variant": v["name"], "model": model, "batch": batch, "context": ctx, "past": past}
                if refused:
                    row["refused"] = refused
                else:
                    plan = lib.launch_plan(p)
                    row |= {k: plan[k] for k in ("num_splits", "split_len", "decode_variant", "decode_mode")
                            if k in plan}
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- run lists


@dataclass
class Planned:
    """One measurement of a benchmark: what it times, the bytes it moves, the rotation, its estimated seconds."""

    bench: str
    name: str
    shape: dict
    nbytes: int
    copies: int
    est_s: float
    skip: str = ""  # why a GPU run would skip it (memory), "" when it runs
    extra: dict = field(default_factory=dict)


def decode_plan(variants: list[dict], gpu: dict, cfg: KiviConfig | None = None, headline_only: bool = False,
                l2: str = "cold") -> list[Planned]:
    """bench_kernels: per shape (headline shapes first), the read-only roofline over the shape's KIVI and FP16
    bytes, every variant's attention and whole step at a flush and a non-flush past, the same kernel over FP16
    and torch SDPA."""
    cfg = cfg or KiviConfig()
    bw = gpu["read_gbps"] * 1e9
    shapes = [s for s in HEADLINE]
    if not headline_only:
        shapes += [(m, b, c) for m in MODELS for b in BATCHES for c in CONTEXTS if (m, b, c) not in HEADLINE]
    runs = [Planned("bench_kernels", "read_ceiling", {}, 2 << 30, 1, 3 * timing_seconds((2 << 30) / bw, 1)),
            Planned("bench_kernels", "copy", {}, 12 << 30, 1, 1.0)]
    for model, batch, ctx in shapes:
        h, hkv, d = MODELS[model]
        shape = {"model": model, "batch": batch, "context": ctx}
        kb, _ = kivi_decode_bytes(cfg, h, hkv, d, batch, flush_past(cfg, ctx))
        fb = fp16_decode_bytes(hkv, d, batch, ctx)
        skip = f"needs {fb / 2**30:.1f} GiB" if fb > MEMORY_FRACTION * gpu["memory_bytes"] else ""
        kc, fc = rotation_copies(kb, gpu["l2_bytes"], l2), rotation_copies(fb, gpu["l2_bytes"], l2)
        setup = 0.05 + kb * kc / 1e12  # the KIVI state (random codes) for every variant, allocated once per shape
        runs.append(Planned("bench_kernels", "kivi_state", shape, kb, kc, setup))
        runs.append(Planned("bench_kernels", "stream_read@kivi_bytes", shape, kb, kc, timing_seconds(kb / bw, kc)))
        runs.append(Planned("bench_kernels", "stream_read@fp16_bytes", shape, fb, fc, timing_seconds(fb / bw, fc)))
        for v in variants:
            for what in ("attention@flush", "step@flush", "attention@nonflush", "step@nonflush"):
                t = kb / (0.5 * bw)  # a variant reads at >= half the ceiling, for planning
                runs.append(Planned("bench_kernels", f"{v['name']}:{what}", shape, kb, kc,
                                    timing_seconds(t, kc) + 0.02, extra={"variant": v["id"]}))
        fill = 0.05 + fb * fc / 1e12  # random FP16 caches
        runs.append(Planned("bench_kernels", "fp16_mma", shape, fb, fc, timing_seconds(fb / (0.5 * bw), fc) + fill,
                            skip))
        runs.append(Planned("bench_kernels", "sdpa_fp16", shape, fb, fc, timing_seconds(fb / bw, fc) + fill, skip))
    runs.append(Planned("bench_kernels", "quantize", {"tokens": 32768}, 0, 1, 0.5))
    return runs


def prefill_plan(gpu: dict, cfg: KiviConfig | None = None, l2: str = "cold") -> list[Planned]:
    """bench_prefill: Llama-3-8B, one sequence; per (chunk, history): the prefill attention kernel, the append
    (PHASE_APPEND) and the whole step, torch SDPA causal FP16 and a plain FP16 cache write of the chunk."""
    cfg = cfg or KiviConfig()
    h, hkv, d = MODELS["llama-3-8b"]
    bw = gpu["read_gbps"] * 1e9
    runs = []
    for hist in PREFILL_HISTORY:
        for chunk in PREFILL_CHUNKS:
            shape = {"model": "llama-3-8b", "chunk": chunk, "history": hist}
            flops = 4 * chunk * (hist + chunk / 2) * h * d  # causal: QK^T and PV over the visible keys
            t_att = flops / 300e12 + 10e-6  # planning: ~300 TFLOP/s
            kb = int(hist * quantized_bytes_per_token(cfg, hkv, d)) + chunk * (h + 2 * hkv) * d * 2
            fb = (hist + chunk) * 2 * hkv * d * 2 + chunk * h * d * 2
            wb = 2 * chunk * hkv * d * 2
            kc, fc = rotation_copies(kb, gpu["l2_bytes"], l2), rotation_copies(fb, gpu["l2_bytes"], l2)
            wc = rotation_copies(2 * wb, gpu["l2_bytes"], l2)
            for name, nbytes, copies, t in (("kivi_prefill_attention", kb, kc, 2 * t_att),
                                            ("kivi_append", kb, kc, wb / (0.3 * bw) + 5e-6),
                                            ("kivi_prefill_step", kb, kc, 2 * t_att + wb / (0.3 * bw)),
                                            ("sdpa_causal_fp16", fb, fc, t_att),
                                            ("fp16_cache_write", 2 * wb, wc, 2 * wb / bw + 3e-6)):
                runs.append(Planned("bench_prefill", name, shape, nbytes, copies, timing_seconds(t, copies) + 0.02,
                                    extra={"flops": flops}))
    return runs


def e2e_plan(gpu: dict, cfg: KiviConfig | None = None) -> list[Planned]:
    """bench_e2e_gpu: a Llama-3-8B-shaped model (random fp16 weights, 32 layers) through the torch runtime with
    CUDA-graph decode steps: KIVI-2 (cuda backend) and an FP16 cache with SDPA, per (batch, context) where the cache
    fits; then the largest batch at 32K each fits, by allocating (bisection)."""
    cfg = cfg or KiviConfig()
    h, hkv, d = MODELS["llama-3-8b"]
    layers, weights = 32, 16_060_000_000
    bw = gpu["read_gbps"] * 1e9
    runs = [Planned("bench_e2e_gpu", "model_init", {}, weights, 1, 2.0)]
    for kind in ("kivi2", "fp16"):
        for batch in E2E_BATCHES:
            for ctx in E2E_CONTEXTS:
                if kind == "kivi2":
                    kv = int(layers * batch * ctx * quantized_bytes_per_token(cfg, hkv, d))
                else:
                    kv = layers * fp16_decode_bytes(hkv, d, batch, ctx)
                free = gpu["memory_bytes"] - weights
                skip = f"cache needs {kv / 2**30:.1f} GiB" if kv > 0.9 * free else ""
                step_s = (weights + kv) / bw
                est = 1.5 + kv / 1e12 + (E2E_STEPS + 4) * step_s  # fill, capture, steps
                runs.append(Planned("bench_e2e_gpu", f"{kind}_decode", {"batch": batch, "context": ctx}, kv, 1,
                                    est, skip))
        runs.append(Planned("bench_e2e_gpu", f"{kind}_max_batch@32k", {"context": 32768}, 0, 1, 12.0))
    return runs


def ncu_plan(headline: tuple = HEADLINE[0]) -> list[Planned]:
    """ncu_profile: hardware counters (DRAM read bandwidth, IPC, pipe utilisation, stall reasons, per-SASS-region
    stall samples) of one attention launch at the headline shape, for the default and the sweep's best variant."""
    model, batch, ctx = headline
    shape = {"model": model, "batch": batch, "context": ctx}
    return [Planned("ncu_profile", f"ncu:{which}", shape, 0, 1, 25.0) for which in ("default", "best")]


# ---------------------------------------------------------------------------------------------- budgets


class Budget:
    """Seconds left of a benchmark's budget; runs that would not fit are skipped and listed, never cut midway."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = float(seconds), time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.spent()

    def allows(self, est_s: float) -> bool:
        return self.left() >= est_s


def fit_budget(runs: list[Planned], budget_s: float) -> tuple[list[Planned], list[Planned]]:
    """(runs that fit the budget in order, runs a GPU run would leave out), by estimated seconds."""
    kept, cut, total = [], [], 0.0
    for r in runs:
        if r.skip:
            cut.append(r)
        elif total + r.est_s <= budget_s:
            kept.append(r)
            total += r.est_s
        else:
            cut.append(r)
    return kept, cut


def describe(runs: list[Planned], budget_s: float, title: str) -> str:
    """The dry-run text of one benchmark: each run, its bytes and rotation, estimated seconds; what the budget
    leaves out."""
    kept, cut = fit_budget(runs, budget_s)
    est = sum(r.est_s for r in kept)
    lines = [f"== {title}: {len(runs)} runs planned, {len(kept)} fit the {budget_s:.0f} s budget "
             f"(estimated {est:.0f} s); {len(cut)} left out"]
    for r in runs:
        shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
        mark = "SKIP " + r.skip if r.skip else ("" if r in kept else "OVER BUDGET")
        lines.append(f"   {r.name:34s} {shape:40s} {r.nbytes / 1e6:10.1f} MB x{r.copies:<3d} ~{r.est_s:6.2f} s {mark}")
    return "\n".join(lines)


def plan_text(script: str, gpu_name: str = "h100", library: str | Path | None = None,
              variants_json: str | Path | None = None, sweep_budget: float = 110.0, prefill_budget: float = 35.0,
              e2e_budget: float = 75.0, ncu_budget: float = 50.0) -> str:
    """Everything a gpu_check (script="check") or gpu_tune (script="tune") run measures after its tests."""
    gpu = ASSUMED_GPUS[gpu_name]
    variants, source = load_variants(library, variants_json)
    out = [f"assumed GPU {gpu_name}: L2 {gpu['l2_bytes'] >> 20} MiB, memory {gpu['memory_bytes'] >> 30} GiB, "
           f"read ~{gpu['read_gbps']:.0f} GB/s (planning model only)",
           f"decode variants ({source}): " + ", ".join(f"{v['id']}={v['name']}" for v in variants)]
    if source == "library" and library is not None:
        checks = param_checks(library, variants, headline_only=script == "check", sms=gpu["sms"])
        refused = [c for c in checks if "refused" in c]
        out.append(f"== host checks of the library: {len(checks)} (variant, shape, past) decode steps, "
                   f"{len(refused)} refused")
        out += [f"   REFUSED {c['variant']} {c['model']} b{c['batch']} {c['context']} past {c['past']}: "
                f"{c['refused']}" for c in refused]
    if script == "check":
        out.append(describe(decode_plan(variants, gpu, headline_only=True), sweep_budget,
                            "bench_kernels --headline (every variant at the headline shapes)"))
    else:
        out.append(describe(decode_plan(variants, gpu), sweep_budget, "bench_kernels (every variant, every shape)"))
        out.append(describe(prefill_plan(gpu), prefill_budget, "bench_prefill (prefill attention, append)"))
        out.append(describe(e2e_plan(gpu), e2e_budget, "bench_e2e_gpu (32-layer model, CUDA graphs)"))
        out.append(describe(ncu_plan(), ncu_budget, "ncu_profile (hardware counters at the headline shape)"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script", choices=("check", "tune"))
    ap.add_argument("--gpu", choices=sorted(ASSUMED_GPUS), default="h100")
    ap.add_argument("--library", type=Path, default=None, help="kernel library whose variant list to plan with")
    ap.add_argument("--variants-json", type=Path, default=None, help="a fake variant list (planning only)")
    ap.add_argument("--sweep-budget", type=float, default=110.0)
    ap.add_argument("--prefill-budget", type=float, default=35.0)
    ap.add_argument("--e2e-budget", type=float, default=75.0)
    ap.add_argument("--ncu-budget", type=float, default=50.0)
    args = ap.parse_args(argv)
    for name in ("sweep_budget", "prefill_budget", "e2e_budget", "ncu_budget"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0 seconds")
    print(plan_text(args.script, args.gpu, args.library, args.variants_json, args.sweep_budget, args.prefill_budget,
                    args.e2e_budget, args.ncu_budget))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
