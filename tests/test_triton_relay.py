"""Runs tests/test_triton_server.py and tests/test_triton_load.py (a real tritonserver) from the main test suite: they
need the serving env's Python (numpy<2, tritonclient), which the dev venv is not, so this test runs them there as a
subprocess and fails with their output when they fail. Skipped when this Python can run it directly (then it runs itself) or when no
serving env exists (build_scripts/setup_triton_env.sh makes one; build_scripts/test.sh does in CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi.serving.server import SETUP, TritonEnv

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parent.parent
SERVER_TESTS = ("test_triton_server.py", "test_triton_load.py")


def _client_here() -> bool:
    return importlib.util.find_spec("tritonclient") is not None


def test_triton_server_suite_in_the_serving_env():
    if _client_here():
        pytest.skip("this Python has tritonclient: tests/test_triton_server.py and test_triton_load.py run directly")
    try:
        env = TritonEnv.find()
    except FileNotFoundError as e:
        pytest.skip(f"no Triton serving env ({e}); create it with `{SETUP}`")
    cmd = [str(env.python), "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "-m", "triton",
           *(str(ROOT / "tests" / f) for f in SERVER_TESTS)]
    run_env = dict(os.environ, TRTLLM_KIVI_TRITON_ENV=str(env.root))
    run_env.pop("VIRTUAL_ENV", None)
    p = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-6000:]}"
    last = out.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "skipped" not in last, last
