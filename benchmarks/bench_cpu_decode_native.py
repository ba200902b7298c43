"""Whole-model CPU decode tokens/s at several contexts: ours with the native CPU kernels (FP16 cache: FullCache
backend cpu; KIVI recipes: KiviCache backend cpu), ours with the torch FP16 cache and the memo KIVI backend (the
previous CPU paths), and HF transformers' LlamaForCausalLM (default DynamicCache), same weights (GGUF Q4_1
dequantized to fp32), prompt text, dtype, threads, machine and run.

    PYTHONPATH=. python benchmarks/bench_cpu_decode_native.py [--contexts 512 2048] [--decode 8] [--rounds 2]
                                                              [--threads 2] [--kv kivi2 kivi4] [--out FILE]

Per context: every implementation prefills the same prompt (not timed), then greedy decode steps are timed taking one
step of each implementation in turn (a load change on the shared machine hits all alike). Reported: median ms/token,
tokens/s, and ratios as medians of per-step ratios (same moment) against HF and against our native FP16 cache.
Implementations whose prefill would materialize a [context x context] score matrix per layer (the torch paths) are
skipped above --torch-max-context. Writes JSON to benchmarks/results/cpu_decode_native_smollm2_<machine>.json.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cpu_decode import HF, hf_llama  # noqa: E402

from trtllm_kivi import cpu as native  # noqa: E402
from trtllm_kivi.bench import machine_info, machine_tag, portable_path  # noqa: E402
from trtllm_kivi.cache import FullCache  # noqa: E402
from trtllm_kivi.eval.corpus import load_play  # noqa: E402
from trtllm_kivi.models import load_model, resolve_model  # noqa: E402
from trtllm_kivi.runtime.kvspec import parse_kv  # noqa: E402
from trtllm_kivi.runtime.torch_runner import TorchRunner  # noqa: E402


class Ours:
    def __init__(self, model, kv: str, n: int, backend: str) -> None:
        spec = parse_kv(kv)
        if spec.kivi is None:
            cache = FullCache(model.cfg.geometry, 1, n, spec.full_dtype, backend=backend)
            self.runner = TorchRunner(model, cache)
        else:
            self.runner = TorchRunner.create(model, spec, 1, n, backend=backend)
        self.backend = self.runner.cache.backend_name

    def prefill(self, ids: list[int]) -> int:
        self.slot = self.runner.add_sequence()
        logits = None
        for i in range(0, len(ids), 1024):  # chunked prefill: bounded score matrices in the torch paths
            logits = self.runner.step([self.slot], [ids[i:i + 1024]])
        return int(logits.argmax(-1))

    def decode(self, tok: int) -> int:
        return int(self.runner.step([self.slot], [[tok]]).argmax(-1))

    def done(self) -> None:
        self.runner.free_sequence(self.slot)


def run_context(model, hf, ids_all: list[int], ctx: int, args) -> dict:
    ids = ids_all[:ctx]
    n = ctx + args.decode + 1
    impls: dict = {"ours_fp16_cpu": Ours(model, "fp16", n, "cpu")}
    for kv in args.kv:
        impls[f"ours_{kv}_cpu"] = Ours(model, kv, n, "cpu")
    if ctx <= args.torch_max_context:
        impls["ours_fp16_torch"] = Ours(model, "fp16", n, "torch")
        impls["ours_kivi2_memo"] = Ours(model, "kivi2", n, "memo")
    impls["hf_dynamic_cache"] = HF(hf)
    times: dict[str, list[float]] = {k: [] for k in impls}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        last = {name: impl.prefill(ids) for name, impl in impls.items()}
        seqs = {name: [t] for name, t in last.items()}
        for _ in range(args.decode):
            for name, impl in impls.items():
                t0 = time.perf_counter()
                last[name] = impl.decode(last[name])
                times[name].append(time.perf_counter() - t0)
                seqs[name].append(last[name])
        for name, impl in impls.items():
            impl.done()
            tokens.setdefault(name, seqs[name])
        print(f"ctx {ctx} round {r}: " + ", ".join(f"{k} {statistics.median(v[-args.decode:]) * 1e3:.1f}"
                                                   for k, v in times.items()) + " ms/token", file=sys.stderr)

    def per_step(base: str) -> dict[str, float]:
        return {k: round(statistics.median(b / a for a, b in zip(times[k], times[base], strict=True)), 3)
                for k in impls}

    med = {k: statistics.median(v) for k, v in times.items()}
    return {"context": ctx, "decode_steps": args.decode, "rounds": args.rounds,
            "backends": {k: getattr(v, "backend", "transformers") for k, v in impls.items()},
            "median_ms_per_token": {k: round(v * 1e3, 2) for k, v in med.items()},
            "tokens_per_s": {k: round(1 / v, 2) for k, v in med.items()},
            "ratio_vs_hf_median_of_per_step_ratios": per_step("hf_dynamic_cache"),
            "ratio_vs_ours_fp16_cpu_median_of_per_step_ratios": per_step("ours_fp16_cpu"),
            "greedy_tokens_equal_to_hf": {k: tokens[k] == tokens["hf_dynamic_cache"] for k in impls}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--kv", nargs="+", default=["kivi2", "kivi4"])
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-max-context", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/cpu_decode_native_smollm2_{machine_tag()}.json"))
    args = ap.parse_args()
    if not native.available():
        print("native CPU library not built: run build_scripts/build_cpu_kernels.sh", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    model, tok, cfg = load_model(args.model, "float32")
    ids = tok.encode(load_play("tragedies/hamlet"), add_special_tokens=False)
    if len(ids) < max(args.contexts):
        ids = (ids * (max(args.contexts) // len(ids) + 1))
    hf, hf_version = hf_llama(args.model)
    import transformers  # noqa: F401  (version recorded below)

    result = {
        "benchmark": "cpu_decode_native", "model": cfg.name, "model_source": portable_path(resolve_model(args.model)),
        "weights_note": "GGUF Q4_1 weights dequantized to fp32 for every implementation",
        "machine": machine_info(threads=args.threads, cpu_isa=native.load_library().resolve_isa("auto"),
                                transformers=hf_version, load_average_1m_at_start=round(os.getloadavg()[0], 2),
                                note="a shared machine: absolute numbers are noisy; per-step ratios (same moment) "
                                     "are the comparison"),
        "batch": 1, "dtype": "float32",
        "contexts": [run_context(model, hf, ids, c, args) for c in args.contexts],
    }
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
