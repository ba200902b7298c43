"""What a result file records about where it was made: the machine as what it is (CPU model and cores, GPU name and
driver), the source commit, and paths that mean the same on any machine (relative to the repository, or a
package's file name), never the absolute paths of the machine that made it. `machine_tag` names the machine in
result file names (benchmarks/results/<benchmark>_<machine>.json)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            fields: dict[str, str] = {}
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
            return fields
    except OSError:
        return {}


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; platform.processor() is empty there)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def machine_tag(gpu: str | None = None) -> str:
    """Short machine name for result files: the GPU's model ("NVIDIA H200" -> h200) when `gpu` is given, else the
    CPU's kind: xeon, zen4 / zen5 (AMD with AVX-512), epyc-avx2 (AMD EPYC without it), or the CPU model as a slug."""
    if gpu:
        words = [w for w in gpu.split() if w.lower() not in ("nvidia", "geforce", "tesla")]
        for i, w in enumerate(words):
            if any(c.isdigit() for c in w):
                head = w.split("-")[0].lower()
                return words[i - 1].lower() + head if i and head.isdigit() else head
        return _slug(gpu)
    info = _cpuinfo()
    name = cpu_model().lower()
    avx512 = "avx512f" in info.get("flags", "").split()
    if "xeon" in name:
        return "xeon" if avx512 else "xeon-avx2"
    if info.get("vendor_id") == "AuthenticAMD" or "amd" in name:
        if avx512:
            return "zen5" if int(info.get("cpu family", "0") or 0) >= 26 else "zen4"
        return "epyc-avx2" if "epyc" in name else "amd-avx2"
    return _slug(cpu_model()) or "unknown"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def git_commit(root: Path = REPO) -> str:
    """The commit of the source tree the code runs from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def portable_path(path: str | os.PathLike) -> str:
    """`path` as a result file may record it: a file of an installed package as <package>/<file>, a file of the
    repository relative to it, anything else by its name only. A relative path is returned as given."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    parts = p.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(marker):])
    try:
        return p.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return p.name


def gpu_driver() -> str:
    """The NVIDIA driver version (nvidia-smi), or why it is unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def machine_info(**extra) -> dict:
    """The machine record of a result file: CPU model and cores, OS, Python and torch versions, the GPU's name,
    compute capability, SM count, memory and driver when torch sees one, the source commit; then `extra`."""
    import torch

    info: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "os": f"{platform.system()} {platform.release()}",
                  "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
                 "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
                 "cuda_runtime": torch.version.cuda, "driver": gpu_driver()}
    info["git_commit"] = git_commit()
    return info | extra
