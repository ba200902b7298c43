"""`trtllm-kivi build` as a function: checkpoint -> build folder.

    DIR/model.onnx            the graph (onnx_export.py), weights in DIR/model.onnx.data (external data)
    DIR/tokenizer.json        the tokenizer, with tokenizer_config.json (BOS/EOS, chat template) and
    DIR/chat_template.jinja   the chat template when the checkpoint has one
    DIR/build_config.json     the one record of what was built (op.GraphInfo: KIVI config, geometry, dtype, maxima,
                              vocabulary) + FORMAT_VERSION, versions, check results, engine; runtime/build_folder.py
                              reads it for every runner and for serving
    DIR/model.engine          the TensorRT engine (NVIDIA's TensorRT or TensorRT-RTX, trtllm_kivi.trt), when a
                              builder and the plugin library are here (--tensorrt auto) or required (on)

Everything is written into a temporary folder next to DIR and renamed at the end, so a failed build leaves nothing
(and a --force rebuild that fails leaves the previous build as it was).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from .. import __version__
from ..format import FORMAT_VERSION, KiviConfig
from ..op import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, ExportSpec, GraphInfo
from ..trt import parse_compute_capability
from ..runtime.build_folder import BUILD_CONFIG, BUILD_SCHEMA, ENGINE_FILE, ONNX_FILE
from .onnx_export import export_llama, graph_info, save_model
from .trt_build import TENSORRT_MODES, EngineUnavailable, EnginePlan, build_engine, plan_engine, trtexec_command

# Real English text for the check's prompts (tokenized and repeated to the lengths the check needs).
CHECK_TEXT = (
    "The key-value cache of a transformer grows with every generated token, and for long contexts or large batches "
    "it, not the weights, limits how many requests a GPU can serve. KIVI observes that keys have a few outlier "
    "channels with large magnitudes while values have no such structure, so it quantizes keys per channel and "
    "values per token, both asymmetrically with a minimum and a step per group, and keeps the most recent tokens "
    "in full precision until a whole group can be quantized. With two bits per element the cache shrinks by about "
    "five times and the quality of Llama-class models stays close to that of a sixteen-bit cache. ")


@dataclass
class BuildOptions:
    output: Path
    model: str = "smollm2-135m"
    kivi: KiviConfig = field(default_factory=KiviConfig)
    dtype: str = "float16"
    max_batch_size: int = 4
    max_seq_len: int = 2048
    max_num_tokens: int | None = None  # tokens per step; default max_seq_len (a whole prompt in one step)
    force: bool = False
    check_steps: int = 64  # decode steps of the onnxruntime check (0: skip the check)
    plugin_lib: str | None = None  # KiviAttention plugin library for the engine (default: trt.find_plugin)
    tensorrt: str = "auto"  # engine: auto (when possible, else say why not) | on (or fail with the reason) | off
    compute_capability: list[str] | None = None  # TensorRT-RTX targets (default: the GPU here, else a stated list)

    def spec(self) -> ExportSpec:
        return ExportSpec(self.dtype, self.max_batch_size, self.max_seq_len,
                          self.max_num_tokens if self.max_num_tokens is not None else self.max_seq_len)


def versions() -> dict[str, str | None]:
    """Versions of what a build depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"trtllm_kivi": __version__, "python": sys.version.split()[0]}
    for pkg in ("torch", "onnx", "onnxruntime", "onnxruntime-extensions", "tensorrt", "tensorrt-rtx-cu13"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def build_key(opts: BuildOptions, model_path: Path) -> dict:
    """What makes two builds the same build: the checkpoint and every option that shapes the output."""
    files = [model_path] if model_path.is_file() else [p for p in model_path.iterdir() if p.is_file()]
    stats = [p.stat() for p in files]
    key = {"model": str(model_path.resolve()), "model_bytes": sum(s.st_size for s in stats),
           "model_mtime_ns": max((s.st_mtime_ns for s in stats), default=0),
           "kivi_config": opts.kivi.to_dict(), **dataclasses.asdict(opts.spec()), "format_version": FORMAT_VERSION}
    if opts.compute_capability:  # only when named, so the keys of earlier builds stay what they were
        key["compute_capability"] = list(opts.compute_capability)
    return key


def _existing(out: Path, key: dict, force: bool) -> str | None:
    """Decide about an existing DIR: None (build), "same" (already built) or raise."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise ValueError(f"output {out} exists and is not a folder")
    if not any(out.iterdir()):
        return None
    cfg_path = out / BUILD_CONFIG
    if not cfg_path.is_file():
        if force:
            raise ValueError(f"output {out} is a non-empty folder that is not a trtllm-kivi build; refusing to "
                             f"replace it even with --force (choose another -o)")
        raise ValueError(f"output {out} is a non-empty folder that is not a trtllm-kivi build; choose another -o")
    try:
        old = json.loads(cfg_path.read_text()).get("key")
    except json.JSONDecodeError:
        old = None
    if force:
        return None
    if old == key:
        return "same"
    diff = sorted(k for k in set(key) | set(old or {}) if (old or {}).get(k) != key.get(k))
    raise ValueError(f"output {out} holds a different build (differs in: {', '.join(diff)}); pass --force to "
                     f"replace it")


def check_prompts(tok, cfg: KiviConfig, spec: ExportSpec, decode_steps: int) -> list[list[int]]:
    """Two prompts of real text whose prefill + decode crosses flush points: one longer than R + G (a flush
    inside the prefill), one that reaches R + G during the decode. Shortened to what the graph's maxima allow."""
    ids = tok.encode(CHECK_TEXT, add_special_tokens=False)
    first = cfg.residual_length + cfg.group_size
    lengths = [first + 10, max(1, first - decode_steps // 2)][:spec.max_batch_size]
    lengths = [max(1, min(n, spec.max_seq_len - decode_steps)) for n in lengths]
    while sum(lengths) > spec.max_num_tokens:
        lengths = [max(1, n // 2) for n in lengths]
    return [(ids * (n // len(ids) + 1))[:n] for n in lengths]


def write_tokenizer(tok, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja): what models.Tokenizer.from_hf_folder reads."""
    tok.tok.save(str(folder / "tokenizer.json"))
    name = lambda i: tok.token(i) if i is not None else None  # noqa: E731
    conf = {"bos_token": name(tok.bos_id), "eos_token": name(tok.eos_ids[0]) if tok.eos_ids else None,
            "add_bos_token": bool(tok.add_bos)}
    if tok.chat_template:
        conf["chat_template"] = tok.chat_template
        (folder / "chat_template.jinja").write_text(tok.chat_template)
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))


def _model_config_dict(mc) -> dict:
    d = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc) if f.name != "extra"}
    return json.loads(json.dumps(d, default=list))


def build(opts: BuildOptions, log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Build DIR (see the module docstring); returns the build config written. Raises ValueError on bad options
    before any work, and leaves no output on any failure."""
    from tqdm import tqdm

    from ..models import load_model, resolve_model

    spec = opts.spec()  # validates dtype and maxima
    if opts.check_steps < 0:
        raise ValueError(f"check_steps={opts.check_steps} must be >= 0")
    if opts.tensorrt not in TENSORRT_MODES:
        raise ValueError(f"tensorrt={opts.tensorrt!r} is not supported; allowed: {', '.join(TENSORRT_MODES)}")
    if opts.compute_capability:  # '86', 'sm_86' -> '8.6' (refused here when malformed, whatever --tensorrt)
        opts = dataclasses.replace(opts, compute_capability=[parse_compute_capability(c)
                                                             for c in opts.compute_capability])
    model_path = resolve_model(opts.model)
    out = Path(opts.output)
    key = build_key(opts, model_path)
    if _existing(out, key, opts.force) == "same":
        old = json.loads((out / BUILD_CONFIG).read_text())
        if old["engine"].get("built") or _plan_engine(opts, GraphInfo.from_dict(old))[0] is None:
            log(f"{out} already holds this build (same model and options); nothing to do (--force rebuilds)")
            return old
        log(f"{out} holds this build without an engine; building it again with the engine")

    stages = ["load", "export", "write", "check", "engine", "finish"]
    bar = tqdm(total=len(stages) + opts.check_steps, disable=not progress, unit="step", file=sys.stderr,
               desc="build")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        bar.set_postfix_str("load model")
        model, tok, mc = load_model(opts.model, "float32")
        if spec.max_seq_len > mc.max_seq_len:
            raise ValueError(f"max_seq_len={spec.max_seq_len} exceeds the model's context of {mc.max_seq_len} "
                             f"tokens; allowed: 1..{mc.max_seq_len}")
        info = graph_info(model, opts.kivi, spec)
        info.fields()  # validates the KIVI config against the geometry before any work
        engine_plan, engine_why = _plan_engine(opts, info)  # --tensorrt on fails here, before any work
        bar.update()

        bar.set_postfix_str("export ONNX")
        graph = export_llama(model, opts.kivi, spec)
        import onnx

        bar.update()

        bar.set_postfix_str("write")
        save_model(graph, str(tmp / ONNX_FILE), keep_weights=False)
        del graph  # the check reads the file; a 1.5B model's graph is 3.5 GB in float16
        # by path: a graph over 2 GB cannot be checked in memory; also runs strict shape inference
        onnx.checker.check_model(str(tmp / ONNX_FILE), full_check=True)
        write_tokenizer(tok, tmp)
        bar.update()

        check = {"skipped": True}
        if opts.check_steps:
            bar.set_postfix_str("onnxruntime check")
            from .check import check_graph

            # check what was written, external data included; the model is not needed after the check, so the
            # reference rounds its weights in place (no second fp32 copy)
            res = check_graph(model, tmp / ONNX_FILE, info, check_prompts(tok, opts.kivi, spec, opts.check_steps),
                              opts.check_steps, progress=bar.update, reference_inplace=True)
            check = res.to_dict()
            if not res.passed:
                raise RuntimeError(f"onnxruntime check failed: max |logit diff| {res.max_logit_diff:.3g}, "
                                   f"{res.code_words_differing}/{res.code_words} code words differ, scale/zero "
                                   f"{res.scale_zero_rel_diff:.3g}, window {res.window_rel_diff:.3g} (relative) "
                                   f"(tolerances {check['tolerances']})")
        bar.update()

        bar.set_postfix_str("engine")
        engine = _engine(tmp, out, opts, spec, engine_plan, engine_why, log)
        bar.update()

        config = {
            "schema": BUILD_SCHEMA, "key": key, "format_version": FORMAT_VERSION,
            "model": {"source": opts.model, "path": str(model_path.resolve()), "config": _model_config_dict(mc)},
            **info.to_dict(),
            "plugin": {"name": PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE},
            "tokenizer": {"bos_id": tok.bos_id, "eos_ids": list(tok.eos_ids or mc.eos_token_ids),
                          "add_bos": bool(tok.add_bos)},
            "files": {"onnx": ONNX_FILE, "onnx_data": ONNX_FILE + ".data", "tokenizer": "tokenizer.json",
                      "engine": ENGINE_FILE if engine["built"] else None},
            "check": check, "engine": engine, "versions": versions(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / BUILD_CONFIG).write_text(json.dumps(config, indent=2))
        _finish(tmp, out)
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return config


def _plan_engine(opts: BuildOptions, info: GraphInfo) -> tuple[EnginePlan | None, str]:
    """(the engine build to do, or None and why not). --tensorrt on raises ValueError with the reason instead."""
    if opts.tensorrt == "off":
        return None, "--tensorrt off"
    try:
        return plan_engine(info, opts.plugin_lib, opts.compute_capability), ""
    except EngineUnavailable as e:
        if opts.tensorrt == "on":
            raise ValueError(f"--tensorrt on: cannot build the engine: {e}") from None
        return None, str(e)


def _engine(tmp: Path, out: Path, opts: BuildOptions, spec: ExportSpec, plan: EnginePlan | None, why: str,
            log: Callable[[str], None]) -> dict:
    """Build the engine as planned; else say why not and how to finish on a TensorRT machine."""
    from ..plugin import PLUGIN_LIBRARY_NAME

    lib = plan.plugin_lib if plan else None
    cmd = trtexec_command(out / ONNX_FILE, out / ENGINE_FILE, lib or f"/path/to/{PLUGIN_LIBRARY_NAME}", spec,
                          opts.kivi)
    if plan is None:
        return {"built": False, "reason": why, "trtexec": cmd}
    facts = build_engine(tmp / ONNX_FILE, tmp / ENGINE_FILE, plan, spec, opts.kivi, log=log)
    return {"built": True, "trtexec": cmd, **facts}


def _remove_stale(out: Path) -> None:
    """Remove temporary folders of builds of DIR whose process is gone (killed with SIGKILL, power loss)."""
    for p in out.parent.glob(f".{out.name}.building-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(p, ignore_errors=True)


def _finish(tmp: Path, out: Path) -> None:
    """Put the finished build in place: rename (same filesystem), replacing an old build only now."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
