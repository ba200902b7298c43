"""CPU decode throughput: our TorchRunner with an FP16 cache and with a KIVI-2 cache vs Hugging Face transformers'
LlamaForCausalLM with its default cache (DynamicCache), same weights, prompt, dtype (fp32), threads, machine, run.

    PYTHONPATH=. python benchmarks/bench_cpu_decode.py [--model smollm2-135m] [--prompt-len 512] [--decode 32]
                                                       [--rounds 3] [--threads 2] [--out FILE]

Each round prefills the same prompt in every implementation (not timed), then times greedy decode steps (one
token) taking one step of each implementation in turn, so a load change on a shared machine hits all of them alike;
tokens/s = 1 / median step time over all rounds, and the ratio vs HF is also given as the median of per-step
ratios (steps taken at the same moment). KIVI-2 is timed twice: the runtime path (KiviCache: the reference op, which dequantizes the
whole quantized store every step and layer) and the `memo` backend (the evaluation's cache that keeps the dequantized
history: bit-identical output). Before timing, the three implementations' greedy tokens are compared (FP16 and HF
must agree; KIVI-2 may diverge, reported). Writes JSON to
benchmarks/results/cpu_decode_smollm2_threads<N>_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.bench import machine_info, machine_tag, portable_path  # noqa: E402
from trtllm_kivi.eval.corpus import load_play  # noqa: E402
from trtllm_kivi.eval.suite import make_runner  # noqa: E402
from trtllm_kivi.models import load_model, read_gguf, read_hf_folder, resolve_model  # noqa: E402
from trtllm_kivi.runtime.kvspec import parse_kv  # noqa: E402


def hf_llama(model_name: str):
    """transformers' LlamaForCausalLM holding the same (dequantized GGUF) weights as our model."""
    import transformers

    path = resolve_model(model_name)
    cfg, sd = read_gguf(path) if path.is_file() else read_hf_folder(path)
    conf = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                                    num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                    num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                    rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                                    max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings)
    hf = transformers.LlamaForCausalLM(conf).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"HF weight mapping failed: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf.float(), transformers.__version__


class Ours:
    def __init__(self, model, kv: str, n: int, backend: str | None) -> None:
        self.runner = make_runner(model, parse_kv(kv), 1, n, backend)

    def prefill(self, ids: list[int]) -> int:
        self.slot = self.runner.add_sequence()
        return int(self.runner.step([self.slot], [ids]).argmax(-1))

    def decode(self, tok: int) -> int:
        return int(self.runner.step([self.slot], [[tok]]).argmax(-1))

    def done(self) -> None:
        self.runner.free_sequence(self.slot)


class HF:
    def __init__(self, hf) -> None:
        self.hf = hf

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> int:
        out = self.hf(input_ids=torch.tensor([ids]), use_cache=True)  # default cache (DynamicCache)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def decode(self, tok: int) -> int:
        out = self.hf(input_ids=torch.tensor([[tok]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def done(self) -> None:
        self.past = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32, help="timed decode steps per round and implementation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/cpu_decode_smollm2_threads<N>_<machine>.json)")
    args = ap.parse_args()
    name = f"cpu_decode_smollm2_threads{args.threads}_{machine_tag()}.json"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / name)
    torch.set_num_threads(args.threads)

    model, tok, cfg = load_model(args.model, "float32")
    ids = tok.encode(load_play("tragedies/hamlet"), add_special_tokens=False)[:args.prompt_len]
    hf, hf_version = hf_llama(args.model)
    n = args.prompt_len + args.decode + 1
    impls = {"ours_fp16": Ours(model, "fp16", n, None), "ours_kivi2": Ours(model, "kivi2", n, "reference"),
             "ours_kivi2_memo": Ours(model, "kivi2", n, "memo"), "hf_dynamic_cache": HF(hf)}
    times: dict[str, list[float]] = {k: [] for k in impls}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        last = {name: impl.prefill(ids) for name, impl in impls.items()}
        seqs = {name: [t] for name, t in last.items()}
        for _ in range(args.decode):  # one step of each implementation in turn: load changes hit all alike
            for name, impl in impls.items():
                t0 = time.perf_counter()
                last[name] = impl.decode(last[name])
                times[name].append(time.perf_counter() - t0)
                seqs[name].append(last[name])
        for name, impl in impls.items():
            impl.done()
            tokens.setdefault(name, seqs[name])
        print(f"round {r}: " + ", ".join(f"{k} {statistics.median(v[-args.decode:]) * 1e3:.1f}" for k, v in
                                         times.items()) + " ms/token (median)", file=sys.stderr)
    # per-step ratios (same moment, same load) are the robust comparison on a shared machine
    step_ratio = {k: statistics.median(b / a for a, b in zip(times[k], times["hf_dynamic_cache"], strict=True))
                  for k in impls}
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: 1.0 / v for k, v in med.items()}
    base = "hf_dynamic_cache"
    result = {
        "benchmark": "cpu_decode", "model": cfg.name, "model_source": portable_path(resolve_model(args.model)),
        "weights_note": "GGUF Q4_1 weights dequantized to fp32 for both implementations",
        "machine": machine_info(threads=args.threads, transformers=hf_version,
                                note="on a shared machine absolute numbers are noisy, ratios less so"),
        "shapes": {"prompt_len": args.prompt_len, "decode_steps": args.decode, "rounds": args.rounds, "batch": 1,
                   "dtype": "float32"},
        "median_ms_per_token": {k: round(v * 1e3, 3) for k, v in med.items()},
        "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
        "ratio_vs_hf": {k: round(v / tps[base], 3) for k, v in tps.items()},
        "ratio_vs_hf_median_of_per_step_ratios": {k: round(v, 3) for k, v in step_ratio.items()},
        "ratio_kivi2_vs_ours_fp16": round(tps["ours_kivi2"] / tps["ours_fp16"], 3),
        "greedy_tokens_equal_to_hf": {k: tokens[k] == tokens[base] for k in impls},
        "baseline": base,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
