"""`trtllm-kivi serve`: the OpenAI-compatible HTTP server (serving/openai_server.py) over the built-in model, a
checkpoint or a build folder, with the same runner, scheduler, admission and prefix cache as `trtllm-kivi triton`.

    trtllm-kivi serve                                  # the built-in model, KIVI-2, http://127.0.0.1:8000/v1
    curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import flags

NAME = "serve"
HELP = "serve a model over the OpenAI API (/v1/completions, /v1/chat/completions) with KIVI KV and prefix sharing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    flags.add_engine(src)
    src.add_argument("--model", help="built-in name (default smollm2-135m), .gguf file or Hugging Face folder, "
                     "served by the torch runner over --kv")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one, printed)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model name, or the "
                   "build folder's name)")
    flags.add_capacity(p, 8, 2048, 512, 128)
    p.add_argument("--num-blocks", type=int, help="KIVI block pool size for --model (default: enough for every slot "
                   "at --max-seq-len); fewer blocks make requests wait for blocks (admission reserves each "
                   "request's worst case)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a chat request that gives none "
                   "(capped by what the sequence still holds; /v1/completions defaults to 16 as OpenAI's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt prefixes")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB; "
                   "larger ones get 413)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="at SIGTERM, seconds running requests may still "
                   "take (default 30); then they are cancelled and the server exits 0")
    flags.add_dtype(p, "float32", "model dtype for --model")
    flags.add_device(p)
    flags.add_threads(p)
    flags.add_backend(p)
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    flags.add_kv(p)


def run(args: argparse.Namespace) -> int:
    from ..models import DEFAULT_MODEL
    from ..serving.config import load_runner
    from ..serving.openai_server import OpenAIServer, ServeOptions, serve
    from .triton import serving_config

    if not args.engine and not args.model:
        args.model = DEFAULT_MODEL
    for name in ("default_max_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535]")
    cfg = serving_config(args)  # the same checks and runner as `trtllm-kivi triton`
    name = args.served_model_name or (Path(args.engine).resolve().name if args.engine else
                                      Path(args.model).name if Path(args.model).exists() else args.model)
    runner, tokenizer = load_runner(cfg)
    opts = ServeOptions(name, cfg.max_batch_tokens, cfg.prefill_chunk, cfg.prefix_caching,
                        args.default_max_tokens, args.max_body_bytes, args.drain_timeout)
    server = OpenAIServer(runner, tokenizer, opts)

    def ready(port: int) -> None:
        print(f"trtllm-kivi serve: model {name!r} ({runner.name} runner, {runner.max_slots} slots x "
              f"{runner.max_seq_len} tokens, KV {cfg.kv}, prefix caching "
              f"{'on' if cfg.prefix_caching else 'off'}) on http://{args.host}:{port}/v1 ; SIGTERM or Ctrl-C stops it",
              flush=True)

    code = serve(server, args.host, args.port, args.log_level, ready)
    print(f"trtllm-kivi serve: stopped ({server.scheduler.finished_requests.get('cancelled', 0)} requests "
          f"cancelled)", flush=True)
    return code
