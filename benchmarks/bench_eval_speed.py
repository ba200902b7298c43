"""Wall time of the same `trtllm-kivi eval` command in two source trees (an older commit's checkout and this one),
same machine, same run, alternating old/new per round; the ratio is the median of per-round ratios.

    git worktree add --detach ../old-tree ac7eb69       # the older commit to compare with
    PYTHONPATH=. python benchmarks/bench_eval_speed.py --old-tree ../old-tree [--rounds 1]
        [--eval-args "--segments 1 --passkey-lengths 256,1024 --passkey-depths 0.5 --passkey-fallback-lengths 1024"]
    git worktree remove ../old-tree

Each run is `python -m trtllm_kivi.cli eval <eval-args> --json --no-progress` with PYTHONPATH set to its tree (so
each imports its own trtllm_kivi; the new tree's native CPU library is found in its build/cpu/), default
everything else (KV list, threads, attention backend). The eval's PPL per configuration is recorded on both sides
(the new default backend must reproduce the old numbers within its tolerance). Writes JSON to
benchmarks/results/eval_speed_<machine>.json: each tree by its commit, never by its path.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.bench import machine_info, machine_tag  # noqa: E402

DEFAULT_ARGS = "--segments 1 --passkey-lengths 256,1024 --passkey-depths 0.5 --passkey-fallback-lengths 1024"


def git_head(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_eval(tree: Path, eval_args: list[str]) -> dict:
    """One eval run in `tree`: wall seconds, the eval's own seconds, PPL per configuration, passkey pass rates."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "trtllm_kivi.cli", "eval", *eval_args, "--json", "--no-progress"]
    print(f"+ (cd {tree}) PYTHONPATH={tree} {shlex.join(cmd)}", file=sys.stderr)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"eval in {tree} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout[r.stdout.index("{"):])
    configs = out.get("quality", {}).get("configs", {})
    row = {"wall_s": round(wall, 1), "eval_seconds": out.get("seconds"),
           "attention_backend": out.get("attention_backend"),
           "ppl": {n: round(c["ppl"], 4) for n, c in configs.items()}}
    if "passkey" in out:
        row["passkey_summary"] = out["passkey"].get("summary")
    print(f"  {row['wall_s']} s, ppl {row['ppl']}", file=sys.stderr)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", required=True, help="checkout of the older commit (git worktree add --detach)")
    ap.add_argument("--new-tree", default=str(ROOT))
    ap.add_argument("--eval-args", default=DEFAULT_ARGS, help=f"arguments of both evals (default {DEFAULT_ARGS!r})")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/eval_speed_{machine_tag()}.json"))
    args = ap.parse_args()
    old, new = Path(args.old_tree).resolve(), Path(args.new_tree).resolve()
    eval_args = shlex.split(args.eval_args)
    rows: dict[str, list[dict]] = {"old": [], "new": []}
    load = {"start": os.getloadavg()}
    for _ in range(args.rounds):
        rows["old"].append(run_eval(old, eval_args))
        rows["new"].append(run_eval(new, eval_args))
    load["end"] = os.getloadavg()
    ratios = [o["wall_s"] / n["wall_s"] for o, n in zip(rows["old"], rows["new"], strict=True)]
    res = {"benchmark": "eval_speed", "command": "trtllm-kivi eval " + args.eval_args,
           "trees": {"old": {"commit": git_head(old)}, "new": {"commit": git_head(new)}},
           "machine": machine_info(),
           "rounds": args.rounds, "runs": rows,
           "median_wall_s": {k: statistics.median(r["wall_s"] for r in v) for k, v in rows.items()},
           "speedup_median_of_per_round_ratios": round(statistics.median(ratios), 3),
           "load_average_1_5_15": load}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
