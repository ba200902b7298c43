"""`trtllm-kivi run`: generate text with a Llama model over a KIVI (or unquantized) KV cache, streaming to stdout,
then report tokens/s and the KV cache bytes allocated next to the FP16 figure for the same shapes (or, with --json,
one JSON object with the text and the timings)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from .. import format as fmt
from ..models import LlamaModel, ModelConfig, Tokenizer, load_model
from ..runtime.base import Runner
from ..runtime.generate import Generation, SamplingParams, generate
from ..runtime.kvspec import KVSpec
from . import flags

NAME = "run"
HELP = "generate text with the built-in model (or a .gguf / Hugging Face folder) over a KIVI KV cache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_engine(p, "run a folder made by `trtllm-kivi build` (TensorRT engine on a GPU when possible, else its "
                     "ONNX graph with onnxruntime on the CPU)")
    p.add_argument("--runner", default="auto", choices=["auto", "tensorrt", "onnxruntime"],
                   help="runner for --engine (default auto: tensorrt when the folder, library and GPU allow)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat for a batch (each prompt is its own sequence)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the model's "
                   "chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the model's EOS tokens "
                   "always stop")
    flags.add_dtype(p, None)
    flags.add_device(p)
    flags.add_capacity(p, None, None, None, 512)  # the cache is sized to the prompts
    flags.add_threads(p)
    flags.add_backend(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no prompt, no stats)")
    p.add_argument("--json", action="store_true", help="print one JSON object: texts, token counts, timings")
    flags.add_kv(p)


@dataclass
class Loaded:
    """What a run needs: the tokenizer, the model config, the KV spec and a runner factory."""

    tok: Tokenizer
    cfg: ModelConfig
    kv: KVSpec
    dtype: str
    model: LlamaModel | None  # the torch model (None for a build folder)
    load_s: float


def _load(args: argparse.Namespace) -> Loaded:
    t0 = time.perf_counter()
    if args.engine:  # the build folder brings its tokenizer, config and KV cache
        from ..runtime.build_folder import BuildFolder

        folder = BuildFolder.open(args.engine)
        kv = flags.kv_spec(args, build=folder.info.kivi)
        # onnxruntime runs the graph's fp32 copy; the engine runs the build dtype
        trt_ok = args.runner != "onnxruntime" and folder.tensorrt_unavailable() is None
        dtype = folder.info.spec.dtype if trt_ok else "float32"
        return Loaded(folder.tokenizer(), folder.model_config(), kv, dtype, None, time.perf_counter() - t0)
    kv = flags.kv_spec(args)  # validate the options before the model load
    device = flags.device_of(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "float16")
    model, tok, cfg = load_model(args.model, dtype, args.device)
    return Loaded(tok, cfg, kv, dtype, model, time.perf_counter() - t0)


def make_runner(args: argparse.Namespace, loaded: Loaded, max_slots: int, max_seq_len: int) -> Runner:
    """The build folder's runner (--engine DIR), else the torch runner over the chosen KV cache."""
    if args.engine:
        from ..runtime.select import load_runner

        runner, why = load_runner(args.engine, prefer=args.runner, threads=args.threads)
        if max_slots > runner.max_slots or max_seq_len > runner.max_seq_len:
            raise ValueError(f"{max_slots} prompts of up to {max_seq_len} tokens exceed the build's maxima "
                             f"(max batch {runner.max_slots}, max seq len {runner.max_seq_len}); rebuild with larger")
        print(f"[runner] {why}", file=sys.stderr)
        return runner
    from ..runtime.torch_runner import TorchRunner

    model = loaded.model
    assert model is not None  # loaded without --engine
    cache = loaded.kv.make_cache(model.cfg.geometry, max_slots, max_seq_len, model.dtype, args.device,
                                 backend=args.attention_backend)
    return TorchRunner(model, cache)


def _prompts(args: argparse.Namespace, tok) -> list[list[int]]:
    if not args.chat:
        return [tok.encode(text) for text in args.prompt]
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [tok.encode(tok.apply_chat_template(system + [{"role": "user", "content": t}]), add_special_tokens=False)
            for t in args.prompt]


def run(args: argparse.Namespace) -> int:
    flags.set_threads(args.threads)
    loaded = _load(args)
    tok, cfg = loaded.tok, loaded.cfg
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_strings=tuple(args.stop),
                            stop_token_ids=tuple(tok.eos_ids or cfg.eos_token_ids))
    prompts = _prompts(args, tok)
    max_seq_len = max(map(len, prompts)) + args.max_new_tokens
    if max_seq_len > cfg.max_seq_len:
        raise ValueError(f"prompt + --max-new-tokens = {max_seq_len} tokens exceeds the model's context of "
                         f"{cfg.max_seq_len}")
    runner = make_runner(args, loaded, len(prompts), max_seq_len)

    stream = len(prompts) == 1 and not args.json
    if stream and not args.quiet and not args.chat:
        sys.stdout.write(args.prompt[0])
    first: list[float] = []

    def on_token(i: int, token: int) -> None:
        if not first:
            first.append(time.perf_counter())

    def on_text(i: int, text: str) -> None:
        if stream:
            sys.stdout.write(text)
            sys.stdout.flush()

    t1 = time.perf_counter()
    results = generate(runner, prompts, params, tok, on_token, args.prefill_chunk, on_text)
    t2 = time.perf_counter()
    timings = _timings(prompts, results, t1, first[0] if first else t2, t2, loaded.load_s)
    if args.json:
        print(json.dumps({"texts": [r.text for r in results], "finish_reasons": [r.finish_reason for r in results],
                          "kv": loaded.kv.name, "runner": runner.name, **timings}))
        return 0
    if stream:
        print()
    else:
        for i, r in enumerate(results):
            print(f"--- [{i}] {'' if args.quiet else args.prompt[i]}{r.text}")
    if not args.quiet:
        _report(args, loaded, runner, timings)
    return 0


def _timings(prompts, results: list[Generation], t1: float, first: float, t2: float, load_s: float) -> dict:
    new = sum(len(r.tokens) for r in results)
    decode = new - len(results)  # tokens after each sequence's first one
    return {"prompt_tokens": sum(map(len, prompts)), "new_tokens": new, "load_s": round(load_s, 3),
            "seconds": round(t2 - t1, 4), "ttft_s": round(first - t1, 4),
            "prefill_tokens_per_s": round(sum(map(len, prompts)) / (first - t1), 2) if first > t1 else None,
            "decode_tokens_per_s": round(decode / (t2 - first), 2) if decode > 0 and t2 > first else None}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _report(args: argparse.Namespace, loaded: Loaded, runner: Runner, t: dict) -> None:
    cfg, kv = loaded.cfg, loaded.kv
    print(f"\n[model] {cfg.name}: {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads x "
          f"{cfg.head_dim}, {loaded.dtype} on {args.device}, loaded in {loaded.load_s:.1f} s")
    print(f"[kv] {kv.describe()}, attention: {runner.attention_backend}")
    print(f"[speed] {t['prompt_tokens']} prompt tokens, {t['new_tokens']} new tokens in {t['seconds']:.2f} s: "
          f"{t['new_tokens'] / t['seconds']:.1f} tokens/s overall, first token after {t['ttft_s']:.2f} s"
          + (f", decode {t['decode_tokens_per_s']:.1f} tokens/s" if t["decode_tokens_per_s"] else ""))
    fp16 = fmt.dense_bytes_per_token(cfg.geometry, 2) * runner.max_seq_len * runner.max_slots
    window = f", {runner.activation_dtype} window" if kv.quantized else ""
    print(f"[memory] KV cache allocated: {runner.kv_nbytes} bytes ({_mib(runner.kv_nbytes)}) for "
          f"{runner.max_slots} x {runner.max_seq_len} tokens{window}; FP16 cache of the same shapes: {int(fp16)} "
          f"bytes ({_mib(fp16)}); allocated / FP16 = {runner.kv_nbytes / fp16:.2f}")
    if kv.kivi is not None:  # short runs are dominated by the fixed full-precision window; show the long-context one
        n = cfg.max_seq_len
        kivi = fmt.kivi_total_bytes(kv.kivi, cfg.geometry, n, act_bytes=2)
        dense = fmt.dense_bytes_per_token(cfg.geometry, 2) * n
        print(f"[memory] one {n}-token sequence (the model's context), fp16 window: {kv.name} {_mib(kivi)} vs FP16 "
              f"{_mib(dense)} ({dense / kivi:.2f}x smaller)")


__all__ = ["add_arguments", "run", "make_runner"]
