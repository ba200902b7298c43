"""A build folder (`trtllm-kivi build -o DIR`) as the runtime reads it. Its build_config.json is the one source of
truth for the KIVI config, geometry and maxima (op.GraphInfo) of the graph and engine next to it: every runner and
serving read it here; the graph's KiviAttention node attributes are checked against it.

    DIR/model.onnx (+ .data)  the graph          DIR/model.engine      the TensorRT engine (when built)
    DIR/tokenizer.json, tokenizer_config.json, chat_template.jinja      DIR/build_config.json
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..op import GraphInfo, check_format_version

BUILD_CONFIG = "build_config.json"
ONNX_FILE = "model.onnx"
ENGINE_FILE = "model.engine"
BUILD_SCHEMA = 2  # version of build_config.json's layout (2: GraphInfo fields at the top level, no plugin copy)


@dataclass
class BuildFolder:
    path: Path
    config: dict
    info: GraphInfo

    @classmethod
    def open(cls, path: str | Path) -> BuildFolder:
        path = Path(path)
        conf_path = path / BUILD_CONFIG
        if not conf_path.is_file():
            raise ValueError(f"{path} is not a trtllm-kivi build folder (no {BUILD_CONFIG}); make one with "
                             f"`trtllm-kivi build -o {path}`")
        conf = json.loads(conf_path.read_text())
        check_format_version(conf.get("format_version"), f"build folder {path}")
        if conf.get("schema") != BUILD_SCHEMA:
            raise ValueError(f"{path}: build_config.json schema {conf.get('schema')!r} is not {BUILD_SCHEMA}; "
                             f"rebuild it with this version")
        return cls(path, conf, GraphInfo.from_dict(conf))

    @property
    def onnx_path(self) -> Path:
        return self.path / self.config["files"]["onnx"]

    @property
    def engine_path(self) -> Path | None:
        name = self.config["files"].get("engine")
        return self.path / name if name else None

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
        """Why the tensorrt runner cannot run here (None: it can): no engine, not the TensorRT flavour that built it
        (trtllm_kivi.trt), no GPU, or a GPU that is not one of a TensorRT-RTX engine's compute capabilities."""
        from ..trt import TensorRTUnavailable, find_tensorrt

        engine = self.config["engine"]
        if self.engine_path is None:
            return f"the folder has no engine ({engine.get('reason', 'not built')})"
        flavour = engine.get("flavour", "tensorrt")
        try:
            find_tensorrt(flavour)
        except TensorRTUnavailable:
            return f"the engine was built by {flavour}, whose Python package is not installed here"
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU (torch.cuda.is_available() is False)"
        cc = "{}.{}".format(*torch.cuda.get_device_capability())
        targets = engine.get("targets")
        if targets and cc not in targets:
            return (f"the GPU here has compute capability {cc}; the engine was built for {', '.join(targets)} "
                    f"(docs/tensorrt.md: what runs where)")
        return None


__all__ = ["BuildFolder", "BUILD_CONFIG", "ONNX_FILE", "ENGINE_FILE", "BUILD_SCHEMA"]
