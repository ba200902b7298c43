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
from ..runtime.kvspec import KV_HELP, KV_OPTIONS, KVSpec, parse_kv, read_kv_config

DEFAULT_KV = "kivi2"


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
    g.set_defaults(_kv_default=default)
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


def kv_config(args: argparse.Namespace) -> KVSpec | None:
    """The --kv-config file's spec (None without one); a --kv or KIVI knob that disagrees with it is refused,
    naming both values."""
    path = getattr(args, "kv_config", None)
    if not path:
        return None
    spec = read_kv_config(path)
    assert spec.kivi is not None
    if args.kv is not None and args.kv.strip().lower() != spec.name:
        raise ValueError(f"--kv {args.kv} conflicts with --kv-config {path} (kv {spec.name}); give one of them")
    for name, value in kv_options(args).items():
        if getattr(spec.kivi, name) != value:
            raise ValueError(f"--{name.replace('_', '-')} {value} conflicts with --kv-config {path} "
                             f"({name}={getattr(spec.kivi, name)}); give one of them")
    return spec


def kv_names(args: argparse.Namespace) -> list[str]:
    """The --kv value(s) as a list (the command's default when not given; the --kv-config recipe with one)."""
    from_file = kv_config(args)
    if from_file is not None:
        return [from_file.name]
    text = args.kv if args.kv is not None else args._kv_default
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--kv {text!r} names no KV cache; allowed: {KV_HELP}")
    return names


def kv_options(args: argparse.Namespace) -> dict:
    """The KIVI knobs the user gave (KiviConfig field -> value)."""
    return {k: getattr(args, k) for k in KV_OPTIONS if getattr(args, k, None) is not None}


def kv_from_args(args: argparse.Namespace, name: str | None = None) -> KVSpec:
    """The KVSpec of the parsed add_kv() options (name overrides args.kv, e.g. one of a list); a --kv-config
    file's recipe comes back with its exact config."""
    from_file = kv_config(args)
    if from_file is not None and (name is None or name.strip().lower() == from_file.name):
        return from_file
    return parse_kv(name if name is not None else kv_names(args)[0], **kv_options(args))


def kv_for_build(args: argparse.Namespace, cfg: KiviConfig) -> KVSpec:
    """A build folder's KV config; KV flags the user gave must agree with it (refused naming both values)."""
    if args.kv is not None:
        given = parse_kv(args.kv, **kv_options(args))
        if given.kivi != cfg:
            raise ValueError(f"--kv {args.kv} ({given.describe()}) contradicts the build folder's KV config "
                             f"({KVSpec.of(cfg).describe()}); a build folder runs the cache it was built for")
    for name, value in kv_options(args).items():
        if getattr(cfg, name) != value:
            raise ValueError(f"--{name.replace('_', '-')} {value} contradicts the build folder's {name}="
                             f"{getattr(cfg, name)}; a build folder runs the cache it was built for")
    return KVSpec.of(cfg)


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
