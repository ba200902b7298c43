"""`trtllm-kivi triton`: write a Triton Inference Server model repository (python backend, decoupled/streaming)
that serves generation from a build folder (--engine DIR) or a model spec (--model, torch runner over --kv), and
optionally start tritonserver on it (--launch, bound to 127.0.0.1)."""

from __future__ import annotations

import argparse
import signal
import sys

from ..serving.config import ServingConfig
from . import flags
from ..serving.repository import DEFAULT_MODEL_NAME, write_repository

NAME = "triton"
HELP = "write a Triton model repository serving a build folder or model through the KIVI runner + scheduler"



def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    flags.add_engine(src)
    src.add_argument("--model", help="built-in name (smollm2-135m), .gguf file or Hugging Face folder, served by "
                     "the torch runner over --kv")
    p.add_argument("-o", "--output", required=True, metavar="REPO", help="model repository folder to write")
    p.add_argument("--name", default=DEFAULT_MODEL_NAME, help=f"model name in the repository (default "
                   f"{DEFAULT_MODEL_NAME})")
    flags.add_capacity(p, 8, 1024, 512, 128, aliases=True)  # --max-slots / --max-batch-tokens: old names
    p.add_argument("--num-blocks", type=int, help="KIVI block pool size for --model (default: enough for every slot "
                   "at --max-seq-len); fewer blocks make requests wait for blocks (admission reserves each "
                   "request's worst case)")
    p.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a request gives none")
    flags.add_dtype(p, "float32", "model dtype for --model")
    flags.add_device(p)
    flags.add_threads(p, "--num-threads")  # --num-threads: the old name
    flags.add_backend(p)
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt prefixes")
    p.add_argument("--force", action="store_true", help="replace an existing model folder of that name")
    p.add_argument("--launch", action="store_true", help="then start tritonserver on the repository (127.0.0.1, "
                   "free ports) from the serving env and serve until Ctrl-C")
    p.add_argument("--triton-env", help="serving venv made by build_scripts/setup_triton_env.sh (default "
                   "$TRTLLM_KIVI_TRITON_ENV or ~/.cache/trtllm-kivi/triton-venv)")
    p.add_argument("--http-port", type=int, help="with --launch (default: a free port)")
    p.add_argument("--grpc-port", type=int, help="with --launch (default: a free port)")
    p.add_argument("--metrics-port", type=int, help="with --launch: Prometheus metrics, incl. the KV cache usage "
                   "(default: a free port)")
    flags.add_kv(p)


def serving_config(args: argparse.Namespace) -> ServingConfig:
    from pathlib import Path

    from ..models import resolve_model
    from ..runtime.build_folder import BuildFolder

    model = engine = None
    if args.engine:
        kv = flags.kv_spec(args, build=BuildFolder.open(args.engine).info.kivi)  # the folder's config; no override
        engine = str(Path(args.engine).resolve())
    else:  # an absolute file path: the server's python env need not have the built-in model's package
        kv = flags.kv_spec(args)  # validate the KV options now, not at server start
        model = str(resolve_model(args.model).resolve())
    return ServingConfig(model=model, engine=engine, kv=kv.name, kv_options=kv.options() if model else {},
                         dtype=args.dtype, device=args.device, max_slots=args.max_batch_size,
                         max_seq_len=args.max_seq_len, num_blocks=args.num_blocks, prefill_chunk=args.prefill_chunk,
                         max_batch_tokens=args.max_num_tokens, default_max_tokens=args.default_max_tokens,
                         num_threads=args.threads, attention_backend=args.attention_backend,
                         prefix_caching=not args.no_prefix_caching)


def run(args: argparse.Namespace) -> int:
    cfg = serving_config(args)
    folder = write_repository(args.output, cfg, args.name, force=args.force)
    print(f"wrote {folder}/config.pbtxt, serving.json, 1/model.py ({cfg.engine or cfg.model}, KV {cfg.kv}, "
          f"{cfg.max_slots} slots x {cfg.max_seq_len} tokens)")
    if not args.launch:
        print(f"start it with: trtllm-kivi triton ... --launch, or PATH=<serving venv>/bin:$PATH tritonserver "
              f"--model-repository={folder.parent} --http-address=127.0.0.1 --grpc-address=127.0.0.1 (see README)")
        return 0
    from ..serving.server import TritonEnv, TritonServer

    server = TritonServer(folder.parent, TritonEnv.find(args.triton_env), http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    print(f"starting tritonserver (log: {server.log_file}) ...", flush=True)
    server.start()
    print(f"ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}/metrics; model "
          f"{args.name!r}. Ctrl-C stops it.",
          flush=True)
    asked: list[bool] = []  # set when we were asked to stop (SIGTERM / Ctrl-C): only then is the server's end expected

    def stop(*_) -> None:
        asked.append(True)
        raise KeyboardInterrupt
    try:
        signal.signal(signal.SIGTERM, stop)
        if server.proc is not None:
            server.proc.wait()
    except KeyboardInterrupt:
        asked.append(True)
    finally:
        code = server.stop()
    return launcher_status(code, bool(asked), server.log_tail(20))


def launcher_status(code: int | None, asked: bool, log_tail: str = "") -> int:
    """The launcher's exit status: 0 when the server stopped cleanly because we asked it to; otherwise the server's
    failure (128 + signal when a signal killed it, as a shell reports it; its exit code; 1 if it ended with 0 on its
    own), with the reason on stderr, so a supervisor sees a dead server."""
    if code is None:
        return 1
    if asked and code == 0:
        print("tritonserver stopped (exit code 0)")
        return 0
    if code < 0:
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"killed by signal {-code}"
        status = 128 - code
    else:
        why, status = f"exit code {code}", code or 1
    cause = "after the stop request" if asked else "on its own"
    print(f"trtllm-kivi triton: tritonserver died {cause} ({why}); the launcher exits {status}. Last log lines:\n"
          f"{log_tail}", file=sys.stderr, flush=True)
    return status
