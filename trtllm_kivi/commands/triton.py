"""`trtllm-kivi triton`: write a Triton Inference Server model repository (python backend, decoupled/streaming)
that serves generation from a build folder (--engine DIR) or a model spec (--model, torch runner over --kv), and
optionally start tritonserver on it (--launch, bound to 127.0.0.1)."""

from __future__ import annotations

import argparse
import signal
import sys

from ..serving.config import ServingConfig
from ..serving.repository import DEFAULT_MODEL_NAME, write_repository

NAME = "triton"
HELP = "write a Triton model repository serving a build folder or model through the KIVI runner + scheduler"

KV_OPTIONS = ("k_bits", "v_bits", "group_size", "residual_length", "block_size", "scale_dtype")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..runtime.kvspec import add_kv_arguments

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", metavar="DIR", help="a folder made by `trtllm-kivi build`")
    src.add_argument("--model", help="built-in name (smollm2-135m), .gguf file or Hugging Face folder, served by "
                     "the torch runner over --kv")
    p.add_argument("-o", "--output", required=True, metavar="REPO", help="model repository folder to write")
    p.add_argument("--name", default=DEFAULT_MODEL_NAME, help=f"model name in the repository (default "
                   f"{DEFAULT_MODEL_NAME})")
    p.add_argument("--max-slots", type=int, default=8, help="sequences served at once (default 8)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="prompt + generated tokens per sequence "
                   "(default 1024)")
    p.add_argument("--num-blocks", type=int, help="KIVI block pool size for --model (default: enough for every slot "
                   "at --max-seq-len); fewer blocks make requests wait for blocks (admission reserves each "
                   "request's worst case)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per step per request (default 128)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one step (default 512)")
    p.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a request gives none")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model dtype for --model (default float32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; cuda on a GPU machine)")
    p.add_argument("--num-threads", type=int, help="torch CPU threads in the server (default: torch's choice)")
    p.add_argument("--force", action="store_true", help="replace an existing model folder of that name")
    p.add_argument("--launch", action="store_true", help="then start tritonserver on the repository (127.0.0.1, "
                   "free ports) from the serving env and serve until Ctrl-C")
    p.add_argument("--triton-env", help="serving venv made by build_scripts/setup_triton_env.sh (default "
                   "$TRTLLM_KIVI_TRITON_ENV or ~/.cache/trtllm-kivi/triton-venv)")
    p.add_argument("--http-port", type=int, help="with --launch (default: a free port)")
    p.add_argument("--grpc-port", type=int, help="with --launch (default: a free port)")
    p.add_argument("--metrics-port", type=int, help="with --launch: Prometheus metrics, incl. the KV cache usage "
                   "(default: a free port)")
    add_kv_arguments(p)


def serving_config(args: argparse.Namespace) -> ServingConfig:
    from pathlib import Path

    from ..models import resolve_model
    from ..runtime.kvspec import kv_from_args

    kv_from_args(args)  # validate the KV options now, not at server start
    kv_options = {k: getattr(args, k) for k in KV_OPTIONS if getattr(args, k, None) is not None}
    model = engine = None
    if args.engine:
        engine = str(Path(args.engine).resolve())
    else:  # an absolute file path: the server's python env need not have the built-in model's package
        model = str(resolve_model(args.model).resolve())
    return ServingConfig(model=model, engine=engine, kv=args.kv, kv_options=kv_options, dtype=args.dtype,
                         device=args.device, max_slots=args.max_slots, max_seq_len=args.max_seq_len,
                         num_blocks=args.num_blocks,
                         prefill_chunk=args.prefill_chunk, max_batch_tokens=args.max_batch_tokens,
                         default_max_tokens=args.default_max_tokens, num_threads=args.num_threads)


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
    try:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.proc.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        code = server.stop()
    print(f"tritonserver stopped (exit code {code})")
    return 0
