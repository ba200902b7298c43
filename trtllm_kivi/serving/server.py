"""Start and stop a real `tritonserver` (the one in the PyPI wheel nvidia-pytriton, made by
build_scripts/setup_triton_env.sh) on a model repository, bound to 127.0.0.1 only, on free ports.

The python backend stub embeds the system libpython3.11; it finds our dependencies because the serving venv's bin/
comes first on PATH (the embedded interpreter takes its prefix from the `python3` it finds there, so the venv's
site-packages are on sys.path — pytriton launches its server the same way) and the bundled shared libraries are on
LD_LIBRARY_PATH."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .config import PACKAGE_ROOT

DEFAULT_ENV = Path.home() / ".cache" / "trtllm-kivi" / "triton-venv"
ENV_VAR = "TRTLLM_KIVI_TRITON_ENV"
SETUP = "bash build_scripts/setup_triton_env.sh"


@dataclass(frozen=True)
class TritonEnv:
    """The paths of a serving venv made by setup_triton_env.sh."""

    root: Path
    python: Path
    tritonserver: Path
    backends: Path
    libs: Path

    @classmethod
    def find(cls, root: str | Path | None = None) -> "TritonEnv":
        """The serving env at root, $TRTLLM_KIVI_TRITON_ENV or ~/.cache/trtllm-kivi/triton-venv; raises
        FileNotFoundError naming what is missing and how to make it."""
        root = Path(root or os.environ.get(ENV_VAR) or DEFAULT_ENV)
        sites = sorted(root.glob("lib/python3.*/site-packages"))  # python3.11 normally: the stub's libpython
        site = sites[0] if sites else root / "lib" / "python3.11" / "site-packages"
        env = cls(root, root / "bin" / "python", site / "pytriton" / "tritonserver" / "bin" / "tritonserver",
                  site / "pytriton" / "tritonserver" / "backends", site / "nvidia_pytriton.libs")
        stub = env.backends / "python" / "triton_python_backend_stub"
        for what, p in (("python", env.python), ("tritonserver", env.tritonserver), ("python backend stub", stub),
                        ("bundled libraries", env.libs)):
            if not p.exists():
                raise FileNotFoundError(f"Triton serving env at {root}: no {what} ({p}); create it with `{SETUP}` "
                                        f"(or point ${ENV_VAR} at one)")
            if p.is_file() and not os.access(p, os.X_OK) and what != "bundled libraries":
                raise FileNotFoundError(f"{p} is not executable; rerun `{SETUP}`")
        return env

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.root / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(self.libs), env.get("LD_LIBRARY_PATH")]))
        env["PYTHONPATH"] = ":".join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        env.pop("VIRTUAL_ENV", None)
        return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started the server dies (Linux prctl), so a
    killed test or CLI never leaves a server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A tritonserver process on 127.0.0.1 (HTTP, gRPC and metrics on free ports), stopped by its PID.

        with TritonServer(repo) as server:   # waits until ready
            server.grpc_url, server.http_url
    """

    def __init__(self, repo: str | Path, env: TritonEnv | None = None, log_file: str | Path | None = None,
                 http_port: int | None = None, grpc_port: int | None = None, metrics_port: int | None = None,
                 log_verbose: int = 0, exit_timeout: int = 25) -> None:
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise FileNotFoundError(f"model repository {self.repo} does not exist")
        self.env = env or TritonEnv.find()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_file = Path(log_file) if log_file else self.repo.parent / f"tritonserver.{self.http_port}.log"
        self.log_verbose = log_verbose
        self.exit_timeout = exit_timeout  # seconds Triton waits for in-flight requests after SIGTERM
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def command(self) -> list[str]:
        return [str(self.env.tritonserver), f"--model-repository={self.repo}",
                f"--backend-directory={self.env.backends}",
                "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
                "--allow-gpu-metrics=false", "--exit-on-error=true", "--disable-auto-complete-config",
                f"--exit-timeout-secs={self.exit_timeout}", f"--log-verbose={self.log_verbose}"]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        """Start the server and wait until it reports ready; raises RuntimeError with the log's tail otherwise."""
        self._log = open(self.log_file, "wb")
        # own session: stop() signals the server's process group (the server and its backend stubs) only
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env.environ(), start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def live(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/live", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self, timeout: float = 5.0) -> str:
        """The Prometheus text of the metrics endpoint (Triton's and the model's own trtllm_kivi_* metrics)."""
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=timeout) as r:
            return r.read().decode()

    def group_pids(self) -> list[int]:
        """PIDs in the server's process group: the server and its python backend stubs (Linux /proc)."""
        if self.proc is None:
            return []
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgrp; zombies hold no memory
                    out.append(int(d.name))
        return sorted(out)

    def rss_bytes(self) -> int:
        """Resident memory of the server and its stubs together (VmRSS of every process in its group)."""
        total = 0
        for pid in self.group_pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server (by its PID: Triton then finishes in-flight requests, unloads the models and their
        stubs exit), SIGKILL its process group after timeout; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.kill_orphans()
        self._log.close()
        return self.proc.returncode

    def kill_orphans(self) -> list[int]:
        """SIGKILL what is left of the server's process group (stubs that outlived it); returns their PIDs."""
        left = self.group_pids()
        if left:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return left

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
