"""Finding, loading and building the KiviAttention plugin library (trtllm_kivi/plugin.py, build_plugin.sh).

Oracle: the search order documented in plugin.plugin_library_candidates; format.FORMAT_VERSION for the library's
kiviGetFormatVersion; the C++ creator/registration tests (ctest) for the built library.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi.format import FORMAT_VERSION
from trtllm_kivi.plugin import (PLUGIN_LIBRARY_ENV, PLUGIN_LIBRARY_NAME, find_plugin_library, load_plugin_library,
                                plugin_library_candidates)

ROOT = Path(__file__).resolve().parent.parent


def test_missing_library_error_names_searched_paths(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / PLUGIN_LIBRARY_NAME
    monkeypatch.setenv(PLUGIN_LIBRARY_ENV, str(missing))
    candidates = plugin_library_candidates()
    assert candidates[0] == missing and candidates[1] == ROOT / "build" / "plugins" / PLUGIN_LIBRARY_NAME
    if any(p.is_file() for p in candidates):
        pytest.skip("a built plugin library exists at a default location; the not-found path cannot be reached")
    with pytest.raises(FileNotFoundError) as e:
        find_plugin_library()
    for p in candidates:
        assert str(p) in str(e.value)
    assert "build_plugin.sh" in str(e.value)


def test_explicit_path_wins_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(PLUGIN_LIBRARY_ENV, str(tmp_path / "env.so"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "given.so")):
        find_plugin_library(tmp_path / "given.so")
    (tmp_path / "given.so").write_bytes(b"")
    assert find_plugin_library(tmp_path / "given.so") == tmp_path / "given.so"
    (tmp_path / "env.so").write_bytes(b"")
    assert find_plugin_library() == tmp_path / "env.so"  # the environment variable comes first


def _built_library() -> Path | None:
    try:
        return find_plugin_library()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_built_library() is None,
                    reason=f"{PLUGIN_LIBRARY_NAME} not built (build_scripts/build_plugin.sh needs TensorRT headers)")
def test_load_built_library_reports_format_version():
    lib = load_plugin_library()
    assert isinstance(lib, ctypes.CDLL)
    assert lib.kiviGetFormatVersion() == FORMAT_VERSION
    # The loadLibrary entry points are exported (trtexec --dynamicPlugins looks them up by name).
    assert lib.getCreators and lib.setLoggerFinder


def _tensorrt_headers() -> Path | None:
    for var in ("TensorRT_ROOT", "TRT_INCLUDE_DIR"):
        root = os.environ.get(var)
        for inc in ((Path(root), Path(root) / "include") if root else ()):
            if (inc / "NvInferRuntime.h").is_file():
                return inc.parent if inc.name == "include" else inc
    return None


@pytest.mark.slow
@pytest.mark.skipif(_tensorrt_headers() is None,
                    reason="TensorRT headers not found: set TensorRT_ROOT or TRT_INCLUDE_DIR to a directory with "
                           "NvInferRuntime.h (no registry ships them; CI skips the plugin build)")
@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="nvcc not found")
def test_build_plugin_and_run_creator_tests(tmp_path):
    build = tmp_path / "build"
    log = subprocess.run(["bash", str(ROOT / "build_scripts" / "build_plugin.sh"), "--arch", "90", "--build-dir",
                          str(build), "--tensorrt-root", str(_tensorrt_headers())],
                         capture_output=True, text=True, timeout=1800)
    assert log.returncode == 0, log.stdout[-4000:] + log.stderr[-4000:]
    assert (build / PLUGIN_LIBRARY_NAME).is_file()
    assert "warning" not in (log.stdout + log.stderr).lower()
    tests = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True,
                           text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert "kiviAttentionPluginCreator" in tests.stdout and "kiviAttentionPluginLoad_loadLibrary" in tests.stdout
