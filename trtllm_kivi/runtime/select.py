"""Open a build folder (`trtllm-kivi build -o DIR`): its tokenizer, and the best runner this machine allows —
tensorrt when the folder has an engine, TensorRT imports and a GPU is present; else onnxruntime on the CPU."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..format import FORMAT_VERSION
from .base import Runner

RUNNER_CHOICES = ("auto", "tensorrt", "onnxruntime")


@dataclass
class BuildFolder:
    path: Path
    config: dict

    @classmethod
    def open(cls, path: str | Path) -> "BuildFolder":
        path = Path(path)
        conf_path = path / "build_config.json"
        if not conf_path.is_file():
            raise ValueError(f"{path} is not a trtllm-kivi build folder (no build_config.json); make one with "
                             f"`trtllm-kivi build -o {path}`")
        conf = json.loads(conf_path.read_text())
        if conf.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} was built for format_version={conf.get('format_version')}; this package "
                             f"uses FORMAT_VERSION={FORMAT_VERSION}: rebuild it")
        return cls(path, conf)

    def tokenizer(self):
        """The tokenizer saved in the folder (tokenizer.json + tokenizer_config.json)."""
        from ..models import Tokenizer

        t = self.config["tokenizer"]
        tok = Tokenizer.from_hf_folder(self.path, tuple(t["eos_ids"]))
        tok.bos_id, tok.add_bos = t["bos_id"], t["add_bos"]
        return tok

    def model_config(self):
        """The checkpoint's models.ModelConfig as recorded at build time."""
        from ..models import ModelConfig

        d = dict(self.config["model"]["config"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return ModelConfig(**d)

    def tensorrt_unavailable(self) -> str | None:
        """Why the tensorrt runner cannot run here (None: it can)."""
        if not self.config["files"].get("engine"):
            return f"the folder has no engine ({self.config['engine'].get('reason', 'not built')})"
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            return "the tensorrt Python package is not installed"
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU (torch.cuda.is_available() is False)"
        return None


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

        return TrtRunner(folder.path), f"tensorrt runner: {folder.path / folder.config['files']['engine']} on the GPU"
    from .ort_runner import OrtRunner

    runner = OrtRunner(folder.path / folder.config["files"]["onnx"], threads)
    reason = "requested" if prefer == "onnxruntime" else f"tensorrt unavailable: {why_not}"
    return runner, (f"onnxruntime runner: {folder.path / folder.config['files']['onnx']} on the CPU (fp32 copy of "
                    f"the {folder.config['dtype']} graph; {reason})")
