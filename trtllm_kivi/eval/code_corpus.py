"""A code corpus for coder models: the Python source of a pinned PyPI sdist, more-itertools 10.5.0 (MIT license,
Copyright (c) 2012 Erik Rose; more_itertools/more.py then recipes.py, ~180 KB, ~45K Qwen2.5 tokens), read from the
sdist tarball itself. The tarball is fetched once with pip into the cache folder next to the fetched models
($TRTLLM_KIVI_HOME/corpora or ~/.cache/trtllm-kivi/corpora) and checked against its sha256 (`fetch_sdist`);
`load_code_corpus` never downloads. It is a popular package, so a model trained on public code has likely seen it:
its perplexity is low, and the comparisons between KV caches on the same text are what it is for."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path

from ..models.registry import models_home

PIN = "more-itertools==10.5.0"
SDIST = "more-itertools-10.5.0.tar.gz"
SHA256 = "5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6"
FILES = ("more-itertools-10.5.0/more_itertools/more.py", "more-itertools-10.5.0/more_itertools/recipes.py")
LICENSE = "MIT (Copyright (c) 2012 Erik Rose)"


def sdist_path() -> Path:
    return models_home().parent / "corpora" / SDIST


def _fetch_hint() -> str:
    return f"python -m trtllm_kivi.eval.code_corpus (pip download --no-deps --no-binary :all: {PIN})"


def fetch_sdist() -> Path:
    """Download the pinned sdist with pip (once) and check its sha256; returns its path."""
    path = sdist_path()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "-d", str(path.parent), PIN]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise FileNotFoundError(f"pip download {PIN} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    _check(path)
    return path


def _check(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {SHA256}; delete it and run {_fetch_hint()}")


def load_code_corpus(path: str | Path | None = None) -> str:
    """The corpus text: each file of FILES preceded by a `# file: <name>` line, in order."""
    path = Path(path) if path is not None else sdist_path()
    if not path.is_file():
        raise FileNotFoundError(f"the code corpus needs the sdist {SDIST}; fetch it with: {_fetch_hint()}")
    _check(path)
    parts = []
    with tarfile.open(path, "r:gz") as tar:
        for name in FILES:
            f = tar.extractfile(name)
            if f is None:
                raise ValueError(f"{path} has no file {name}")
            parts.append(f"# file: {name.split('/', 1)[1]}\n" + f.read().decode("utf-8"))
    return "\n".join(parts)


def describe() -> dict:
    """Provenance for result files."""
    return {"package": PIN, "sdist_sha256": SHA256, "license": LICENSE, "files": [f.split("/", 1)[1] for f in FILES],
            "text": "Python source of a pinned PyPI sdist"}


if __name__ == "__main__":
    print(fetch_sdist())
