"""Open a build folder's best runner on this machine: tensorrt when the folder has an engine, TensorRT imports and a
GPU is present; else onnxruntime on the CPU."""

from __future__ import annotations

from pathlib import Path

from .base import Runner
from .build_folder import BuildFolder

RUNNER_CHOICES = ("auto", "tensorrt", "onnxruntime")


def load_runner(engine_dir: str | Path, prefer: str = "auto", threads: int | None = None) -> tuple[Runner, str]:
    """(runner, a sentence saying which runner and why) for a build folder. prefer: auto | tensorrt | onnxruntime."""
    if prefer not in RUNNER_CHOICES:
        raise ValueError(f"runner {prefer!r} is not supported; allowed: {', '.join(RUNNER_CHOICES)}")
    folder = BuildFolder.open(engine_dir)
    why_not = folder.tensorrt_unavailable()
    if prefer == "tensorrt" and why_not:
        raise ValueError(f"cannot use the tensorrt runner for {folder.path}: {why_not}")
    if prefer in ("auto", "tensorrt") and why_not is None:
        from .trt_runner import TrtRunner

        return TrtRunner(folder), f"tensorrt runner: {folder.engine_path} on the GPU"
    from .ort_runner import OrtRunner

    runner = OrtRunner(folder.onnx_path, folder.info, threads)
    reason = "requested" if prefer == "onnxruntime" else f"tensorrt unavailable: {why_not}"
    return runner, (f"onnxruntime runner: {folder.onnx_path} on the CPU (fp32 copy of the {folder.info.spec.dtype} "
                    f"graph; {reason})")


__all__ = ["BuildFolder", "RUNNER_CHOICES", "load_runner"]
