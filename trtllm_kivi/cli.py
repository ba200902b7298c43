"""`trtllm-kivi` command line: one subcommand per module in trtllm_kivi/commands/.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommands in the order `--help` lists them (module names under trtllm_kivi.commands).
COMMANDS = [
    "memory",
    "run",
    "build",
    "eval",
    "bench",
    "triton",
    "serve",
    "models",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-kivi", description="2-bit KIVI KV-cache quantization for "
                                     "TensorRT and PyTorch")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"trtllm_kivi.commands.{name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        print(f"trtllm-kivi {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
