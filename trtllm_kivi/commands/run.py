"""`trtllm-kivi run`: generate text with a Llama model over a KIVI (or unquantized) KV cache, streaming to stdout,
then report tokens/s and the KV cache bytes allocated next to the FP16 figure for the same shapes."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from .. import format as fmt
from ..format import KiviConfig
from ..models import DEFAULT_MODEL, load_model
from ..runtime.base import Runner
from ..runtime.generate import SamplingParams, TextStream, generate
from ..runtime.kvspec import add_kv_arguments, kv_from_args

NAME = "run"
HELP = "generate text with the built-in model (or a .gguf / Hugging Face folder) over a KIVI KV cache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in name, .gguf file or Hugging Face checkpoint "
                   f"folder (default: {DEFAULT_MODEL})")
    p.add_argument("--engine", metavar="DIR", help="run a folder made by `trtllm-kivi build` (TensorRT engine on a "
                   "GPU when possible, else its ONNX graph with onnxruntime on the CPU)")
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
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: float32 on the CPU, float16 on CUDA)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per step (default 512)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is faster on a busy "
                   "machine)")
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no prompt, no stats)")
    add_kv_arguments(p)


def make_runner(args: argparse.Namespace, model, max_slots: int, max_seq_len: int) -> Runner:
    """The runner for the command: the torch runner over the chosen KV cache. Runner selection from a build folder
    (--engine DIR) belongs here."""
    if args.engine:  # a build folder: the runner it and this machine allow (runtime/select.py)
        from ..runtime.select import load_runner

        runner, why = load_runner(args.engine, prefer=args.runner)
        if max_slots > runner.max_slots or max_seq_len > runner.max_seq_len:
            raise ValueError(f"{max_slots} prompts of up to {max_seq_len} tokens exceed the build's maxima "
                             f"(max batch {runner.max_slots}, max seq len {runner.max_seq_len}); rebuild with larger")
        print(f"[runner] {why}", file=sys.stderr)
        return runner
    from ..runtime.torch_runner import TorchRunner

    cache = kv_from_args(args).make_cache(model.cfg.geometry, max_slots, max_seq_len, model.dtype, args.device)
    return TorchRunner(model, cache)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(args: argparse.Namespace) -> int:
    kv = kv_from_args(args)  # validate the options before the model load
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_strings=tuple(args.stop))
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available to this torch build")
    if args.dtype is None:
        args.dtype = "float32" if device.type == "cpu" else "float16"
    t0 = time.perf_counter()
    if args.engine:  # the build folder brings its tokenizer and config; make_runner opens its graph/engine
        from ..runtime.select import BuildFolder

        folder = BuildFolder.open(args.engine)
        model, tok, cfg = None, folder.tokenizer(), folder.model_config()
        kivi = KiviConfig.from_dict(folder.config["kivi_config"])
        name = f"kivi{kivi.k_bits}" if kivi.k_bits == kivi.v_bits else f"k{kivi.k_bits}v{kivi.v_bits}"
        kv = dataclasses.replace(kv, name=name, kivi=kivi)
        # onnxruntime runs the graph's fp32 copy; the engine runs the build dtype
        trt_ok = args.runner != "onnxruntime" and folder.tensorrt_unavailable() is None
        args.dtype = folder.config["dtype"] if trt_ok else "float32"
    else:
        model, tok, cfg = load_model(args.model, args.dtype, args.device)
    load_s = time.perf_counter() - t0
    params = dataclasses.replace(params, stop_token_ids=tuple(tok.eos_ids or cfg.eos_token_ids))
    if args.chat:
        prompts = []
        for text in args.prompt:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": text}]
            prompts.append(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    else:
        prompts = [tok.encode(text) for text in args.prompt]
    max_seq_len = max(map(len, prompts)) + args.max_new_tokens
    if max_seq_len > cfg.max_seq_len:
        raise ValueError(f"prompt + --max-new-tokens = {max_seq_len} tokens exceeds the model's context of "
                         f"{cfg.max_seq_len}")
    runner = make_runner(args, model, len(prompts), max_seq_len)

    single = len(prompts) == 1
    stream = TextStream(tok)
    text, shown = "", 0  # streamed text so far, and how much of it is on screen
    hold = max(map(len, args.stop), default=1) - 1  # chars that could be the start of a stop string
    first: list[float] = []
    if single and not args.quiet and not args.chat:
        sys.stdout.write(args.prompt[0])

    def on_token(i: int, token: int) -> None:
        nonlocal text, shown
        if not first:
            first.append(time.perf_counter())
        if single:
            text += stream.push(token)
            safe = min([len(text) - hold] + [text.find(s) for s in args.stop if s in text])
            if safe > shown:
                sys.stdout.write(text[shown:safe])
                sys.stdout.flush()
                shown = safe

    t1 = time.perf_counter()
    results = generate(runner, prompts, params, tok, on_token, args.prefill_chunk)
    t2 = time.perf_counter()
    if single:
        print(results[0].text[shown:])  # the held-back tail, cut before a stop string
    else:
        for i, r in enumerate(results):
            print(f"--- [{i}] {'' if args.quiet else args.prompt[i]}{r.text}")
    if args.quiet:
        return 0
    new = sum(len(r.tokens) for r in results)
    ttft = (first[0] if first else t2) - t1
    decode = new - len(results)  # tokens after each sequence's first one
    print(f"\n[model] {cfg.name}: {cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads x "
          f"{cfg.head_dim}, {args.dtype} on {args.device}, loaded in {load_s:.1f} s")
    print(f"[kv] {kv.describe()}")
    print(f"[speed] {sum(map(len, prompts))} prompt tokens, {new} new tokens in {t2 - t1:.2f} s: "
          f"{new / (t2 - t1):.1f} tokens/s overall, first token after {ttft:.2f} s"
          + (f", decode {decode / (t2 - first[0]):.1f} tokens/s" if first and decode > 0 and t2 > first[0] else ""))
    fp16 = fmt.dense_bytes_per_token(cfg.geometry, 2) * runner.max_seq_len * runner.max_slots
    window = f", {model.dtype if model is not None else args.dtype} window" if kv.quantized else ""
    print(f"[memory] KV cache allocated: {runner.kv_nbytes} bytes ({_mib(runner.kv_nbytes)}) for "
          f"{runner.max_slots} x {runner.max_seq_len} tokens{window}; FP16 cache of the same shapes: {int(fp16)} "
          f"bytes ({_mib(fp16)}); allocated / FP16 = {runner.kv_nbytes / fp16:.2f}")
    if kv.quantized:  # short runs are dominated by the fixed full-precision window; show the long-context figure
        n = cfg.max_seq_len
        kivi = fmt.kivi_total_bytes(kv.kivi, cfg.geometry, n, act_bytes=2)
        print(f"[memory] one {n}-token sequence (the model's context), fp16 window: {kv.name} {_mib(kivi)} vs FP16 "
              f"{_mib(fmt.dense_bytes_per_token(cfg.geometry, 2) * n)} "
              f"({fmt.dense_bytes_per_token(cfg.geometry, 2) * n / kivi:.2f}x smaller)")
    return 0
