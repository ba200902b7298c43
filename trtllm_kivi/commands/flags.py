"""The command-line flags shared by the subcommands: one definition per flag, one name per knob.

Knob names across subcommands: --model, --engine, --kv (+ KIVI knobs), --attention-backend, --dtype, --device,
--threads, --max-batch-size (sequence slots), --max-seq-len, --max-num-tokens (tokens per step), --prefill-chunk,
--quiet, --json, --no-progress. Old names kept as aliases where scripts may use them (triton's --max-slots,
--max-batch-tokens, --num-threads).
"""

from __future__ import annotations

import argparse

import torch

from ..cache import BACKEND_CHOICES
from ..format import DTYPE_NAMES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, SUPPORTED_SCALE_DTYPES, KiviConfig
from ..models import DEFAULT_MODEL
from ..runtime.kvspec import DEFAULT_KV, KV_HELP, KV_OPTIONS, KVSpec, resolve_kv


def add_model(p: argparse.ArgumentParser | argparse._ArgumentGroup, help_extra: str = "") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in name, .gguf file or Hugging Face checkpoint "
                   f"folder (default: {DEFAULT_MODEL}){help_extra}")


def add_engine(p: argparse.ArgumentParser | argparse._ArgumentGroup, help_: str | None = None) -> None:
    p.add_argument("--engine", metavar="DIR", help=help_ or "a folder made by `trtllm-kivi build` (its KV config "
                   "and maxima apply)")


def add_kv(p: argparse.ArgumentParser, default: str = DEFAULT_KV, many: bool = False) -> None:
    """--kv and the KiviConfig knobs, for every command that builds a cache. Defaults are None so that a flag
    the user gave can be told from one they did not (a build folder's config is refused only when contradicted)."""
    g = p.add_argument_group("KV cache")
    what = "comma-separated list of " if many else ""
    g.add_argument("--kv", default=None, help=f"{what}{KV_HELP} (default: {default})")
    g.set_defaults(_kv_default=default, _kv_many=many)
    g.add_argument("--kv-config", metavar="FILE", help="KV config file (JSON) written by `trtllm-kivi eval "
                   "--recommend`: its recipe replaces --kv (a --kv or KIVI knob that disagrees is refused)")
    # no argparse `choices`: KiviConfig validates, with the one error message naming the value and the range
    bits = ", ".join(map(str, SUPPORTED_BITS))
    g.add_argument("--k-bits", type=int, help=f"override the key bits of a KIVI spec ({bits})")
    g.add_argument("--v-bits", type=int, help=f"override the value bits of a KIVI spec ({bits})")
    g.add_argument("--group-size", type=int, help=f"KIVI group size G ({', '.join(map(str, SUPPORTED_GROUP_SIZES))}; "
                   f"default 32)")
    g.add_argument("--residual-length", type=int, help="KIVI full-precision window minimum R (default 128)")
    g.add_argument("--block-size", type=int, help="tokens per quantized cache block (default 128)")
    g.add_argument("--scale-dtype", help=f"dtype of KIVI scales/zeros ({', '.join(SUPPORTED_SCALE_DTYPES)}; "
                   f"default float16)")


def kv_specs(args: argparse.Namespace, build: KiviConfig | None = None, kv: str | None = None,
             needs_kivi: str | None = None) -> list[KVSpec]:
    """The KV specs add_kv()'s flags name, parsed and validated by runtime.kvspec.resolve_kv: the --kv list (or the
    command's default), or the --kv-config file's recipe, or a build folder's config (`build`, of --engine), which
    the flags given must agree with. kv: names to use instead of --kv and the file (e.g. eval's --reference)."""
    options = {k: getattr(args, k, None) for k in KV_OPTIONS}
    many = getattr(args, "_kv_many", False)
    if kv is not None:
        return resolve_kv(kv, options, many=many, needs_kivi=needs_kivi)
    engine = getattr(args, "engine", None)
    return resolve_kv(args.kv, options, config_file=getattr(args, "kv_config", None), build=build,
                      build_origin=f"the build folder {engine}" if engine else "the build folder",
                      default=getattr(args, "_kv_default", DEFAULT_KV), many=many, needs_kivi=needs_kivi)


def kv_spec(args: argparse.Namespace, build: KiviConfig | None = None, needs_kivi: str | None = None) -> KVSpec:
    """The KV spec of a command that runs one cache (kv_specs)."""
    return kv_specs(args, build, needs_kivi=needs_kivi)[0]


def add_backend(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--attention-backend", default="auto", choices=BACKEND_CHOICES,
                   help="KIVI attention backend of the torch runtime: reference (the spec, slow), memo (memoized "
                   "history, bit-identical), cpu (native kernels), cuda (CUDA kernels); default auto: the fastest "
                   "available")


def add_dtype(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None,
              help_: str = "model/activation dtype") -> None:
    p.add_argument("--dtype", default=default, choices=DTYPE_NAMES,
                   help=f"{help_} (default: {default or 'float32 on the CPU, float16 on CUDA'})")


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda, cuda:1)")


def add_threads(p: argparse.ArgumentParser | argparse._ArgumentGroup, *aliases: str) -> None:
    p.add_argument("--threads", *aliases, dest="threads", type=int, help="torch CPU threads (default: torch's "
                   "choice; 1 is faster on a busy machine)")


def add_capacity(p: argparse.ArgumentParser | argparse._ArgumentGroup, max_batch_size: int | None,
                 max_seq_len: int | None,
                 max_num_tokens: int | None, prefill_chunk: int | None, aliases: bool = False) -> None:
    """--max-batch-size (slots), --max-seq-len, --max-num-tokens (per step), --prefill-chunk; with aliases the old
    triton names --max-slots / --max-batch-tokens are accepted too."""
    if max_batch_size is not None:
        p.add_argument("--max-batch-size", *(["--max-slots"] if aliases else []), dest="max_batch_size", type=int,
                       default=max_batch_size, help=f"sequences at once = cache slots (default {max_batch_size})")
    if max_seq_len is not None:
        p.add_argument("--max-seq-len", type=int, default=max_seq_len,
                       help=f"prompt + generated tokens per sequence (default {max_seq_len})")
    if max_num_tokens is not None:
        p.add_argument("--max-num-tokens", *(["--max-batch-tokens"] if aliases else []), dest="max_num_tokens",
                       type=int, default=max_num_tokens, help=f"token budget of one step, all sequences (default "
                       f"{max_num_tokens})")
    if prefill_chunk is not None:
        p.add_argument("--prefill-chunk", type=int, default=prefill_chunk,
                       help=f"prompt tokens per request per step (default {prefill_chunk})")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads} must be >= 1")
        torch.set_num_threads(threads)


def device_of(name: str) -> torch.device:
    """A --device value checked: a torch device this build can use."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available to this torch build")
    return device
