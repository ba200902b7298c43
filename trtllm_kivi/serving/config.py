"""What a served model is made of: a runner (from a build folder, or the torch runner over a model spec + KV cache
spec), its capacity and the scheduler's batching knobs. Written to serving.json in the Triton model folder and read
back by the Triton model; `load_runner` is shared with `trtllm-kivi bench`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import trtllm_kivi

from ..runtime.base import Runner
from ..runtime.kvspec import DEFAULT_KV, KVSpec, resolve_kv

PACKAGE_ROOT = str(Path(trtllm_kivi.__file__).resolve().parent.parent)


@dataclass
class ServingConfig:
    """A served model. Exactly one of `engine` (a `trtllm-kivi build` folder) or `model` (built-in name, .gguf file
    or Hugging Face folder, run by the torch runner over the `kv` cache) is set."""

    model: str | None = None
    engine: str | None = None
    kv: str = DEFAULT_KV  # a --kv name or recipe (informational for an engine: the folder's own config applies)
    kv_options: dict = field(default_factory=dict)  # its knobs (runtime.kvspec.KV_OPTIONS): group_size, ...
    dtype: str = "float32"
    device: str = "cpu"
    max_slots: int = 8  # sequences served at once
    max_seq_len: int = 1024  # prompt + generated tokens per sequence
    num_blocks: int | None = None  # KIVI block pool size (None: every slot can hold max_seq_len tokens)
    prefill_chunk: int = 128
    max_batch_tokens: int = 512
    default_max_tokens: int = 64
    num_threads: int | None = None  # torch CPU threads in the serving process (None: torch's default)
    attention_backend: str = "auto"  # KIVI attention backend of the torch runner (cache.BACKEND_CHOICES)
    prefix_caching: bool = True  # share cached prompt prefixes (runtime/prefix_cache.py)
    package_root: str = PACKAGE_ROOT  # where `import trtllm_kivi` comes from inside the Triton python backend

    def __post_init__(self) -> None:
        if (self.model is None) == (self.engine is None):
            raise ValueError(f"give exactly one of model ({self.model!r}) or engine ({self.engine!r})")
        if self.engine is not None and self.num_blocks is not None:
            raise ValueError(f"num_blocks={self.num_blocks}: a build folder's block pool is fixed by its graph")
        for name in ("max_slots", "max_seq_len", "prefill_chunk", "max_batch_tokens", "default_max_tokens",
                     "num_threads", "num_blocks"):
            v = getattr(self, name)
            if v is None and name in ("num_threads", "num_blocks"):
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if self.model is not None:
            self.kv_spec()  # a bad kv / kv_options is refused when the config is made or read, not at server start

    def kv_spec(self) -> KVSpec:
        """The torch runner's KV spec: kv + kv_options through runtime.kvspec.resolve_kv."""
        return resolve_kv(self.kv, self.kv_options)[0]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ServingConfig:
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown serving config fields {unknown}; allowed: {sorted(known)}")
        return cls(**d)


def load_runner(cfg: ServingConfig):
    """(runner, tokenizer) for a serving config: the build folder's runner through the builder's factory, or the
    torch runner over a fresh cache of the configured KV spec."""
    if cfg.num_threads is not None:
        import torch

        torch.set_num_threads(cfg.num_threads)
    if cfg.engine is not None:
        return _load_engine(cfg)
    from ..models import load_model
    from ..runtime.torch_runner import TorchRunner

    spec = cfg.kv_spec()  # validate before the (slow) model load
    assert cfg.model is not None  # __post_init__: exactly one of model / engine
    model, tok, mcfg = load_model(cfg.model, cfg.dtype, cfg.device)
    if cfg.max_seq_len > mcfg.max_seq_len:
        raise ValueError(f"max_seq_len={cfg.max_seq_len} exceeds the model's context of {mcfg.max_seq_len} tokens")
    if cfg.num_blocks is not None and not spec.quantized:
        raise ValueError(f"num_blocks={cfg.num_blocks} applies to a KIVI cache, not --kv {cfg.kv}")
    extra = {} if cfg.num_blocks is None else {"num_blocks": cfg.num_blocks}
    return TorchRunner.create(model, spec, cfg.max_slots, cfg.max_seq_len, backend=cfg.attention_backend,
                              **extra), tok


def _load_engine(cfg: ServingConfig):
    """The builder's factory picks the runner (tensorrt with an engine + GPU, else onnxruntime); the folder's own
    capacity (max batch size, max sequence length) applies, not cfg.max_slots / cfg.max_seq_len."""
    from ..runtime.build_folder import BuildFolder
    from ..runtime.select import load_runner as load_build

    assert cfg.engine is not None
    runner, _why = load_build(cfg.engine, threads=cfg.num_threads)
    return runner, BuildFolder.open(cfg.engine).tokenizer()


def runner_description(runner: Runner) -> str:
    return f"{runner.name} runner: {runner.max_slots} slots x {runner.max_seq_len} tokens, KV {runner.kv_nbytes} bytes"
