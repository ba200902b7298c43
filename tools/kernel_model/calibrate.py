"""The timing model against the committed GPU measurements: the fitted constants (FITTED), the fit that reproduces
them, its held-out checks, and the calibration records (benchmarks/results/kernel_model_calibration.json).

Measurements: benchmarks/results/bench_kernels_h200.json -- one decode step of one layer at 18 shapes (Llama-3-8B and
Llama-2-7B, batch 1 / 8 / 32, context 4K / 32K / 128K, every step a flush step: past = context - 1), three kernels:
the measured decode kernel over KIVI-2 ("kivi_attention"), the same kernel over an FP16 cache ("fp16_mma") and torch
SDPA over an FP16 cache ("sdpa_fp16"). SDPA is a streaming read: sdpa_us + bytes / read ceiling (a linear fit, which
also gives the read ceiling the kernels' memory centre uses); the kernel's five constants are a least-squares fit of
the relative error (Levenberg-Marquardt on their logarithms, numpy only, deterministic)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .analysis import KernelResult
from .constants import FITTED, KERNEL_CONSTANTS, MEANING
from .decode import FP16, KIVI2, Cache, baseline_classes, baseline_step
from .plan import occupancy
from .shapes import MODELS, ROOT, Gpu
from .timing import ChunkClass, Constants, Machine, step_time

MEASUREMENTS = ROOT / "benchmarks" / "results" / "bench_kernels_h200.json"
CALIBRATION_OUT = ROOT / "benchmarks" / "results" / "kernel_model_calibration.json"
TOLERANCE = 0.25  # |predicted / measured - 1| allowed for every calibrated record (tests/test_kernel_model.py)
LABEL = "static model, not a measurement (calibrated against the measurements listed; a measurement always wins)"

@dataclass(frozen=True)
class Measurement:
    gpu: str
    model: str
    batch: int
    context: int
    past: int
    kernel: str  # kivi_attention | fp16_mma | sdpa_fp16
    variant: str  # the decode variant timed ("baseline" for the kernel measured before variants existed)
    measured_us: float
    source: str


def load_measurements(path: Path = MEASUREMENTS) -> list[Measurement]:
    """The decode timings of a bench_kernels JSON whose rows predate decode variants (the kernel then = baseline)."""
    data = json.loads(path.read_text())
    gpu = data["machine"]["gpu"].replace("NVIDIA ", "")
    out = []
    for row in data["decode"]:
        if "variants" in row:
            raise ValueError(f"{path.name}: rows with decode variants are not read yet (calibrate.load_measurements)")
        for kernel in ("kivi_attention", "fp16_mma", "sdpa_fp16"):
            if "median_ms" in row.get(kernel, {}):
                out.append(Measurement(gpu, row["model"], row["batch"], row["context"], row["context"] - 1, kernel,
                                       "baseline", row[kernel]["median_ms"] * 1e3, path.name))
    return out


def sdpa_bytes(m: Measurement) -> int:
    shape = MODELS[m.model]
    return m.batch * (m.past + 1) * shape.num_kv_heads * shape.head_dim * 2 * 2


ClassesFor = Callable[[str], dict[str, ChunkClass]]  # model name -> the measured kernel's chunk classes


@dataclass(frozen=True)
class Setup:
    """What predicting a measurement needs besides the constants: the kernel's classes per model (SASS), its
    resident CTAs per SM (occupancy) and the GPU."""
    classes: ClassesFor
    ctas_per_sm: int
    machine: Machine


def predict_us(m: Measurement, k: Constants, s: Setup) -> float:
    if m.kernel == "sdpa_fp16":
        return k.sdpa_us + sdpa_bytes(m) / (k.read_gbps * 1e3)
    cache: Cache = KIVI2 if m.kernel == "kivi_attention" else FP16
    st = baseline_step(MODELS[m.model], m.batch, m.context, m.past, cache, s.ctas_per_sm, s.machine.sms)
    return step_time(st, s.classes(m.model), k, s.machine)["us"]


def _fit_sdpa(ms: Sequence[Measurement]) -> tuple[float, float]:
    """(sdpa_us, read_gbps): least squares of the relative error of sdpa_us + bytes / read."""
    rows = [m for m in ms if m.kernel == "sdpa_fp16"]
    y = np.array([m.measured_us for m in rows])
    a = np.array([[1.0, sdpa_bytes(m) / 1e3] for m in rows]) / y[:, None]
    x = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)[0]
    return float(x[0]), float(1.0 / x[1])


def fit(ms: Sequence[Measurement], s: Setup, start: Constants = FITTED, iters: int = 30) -> Constants:
    """The constants that minimise sum (predicted / measured - 1)^2: SDPA's two linearly, then the kernel's five by
    Levenberg-Marquardt on their logarithms (forward-difference Jacobian)."""
    sdpa_us, read = _fit_sdpa(ms)
    base = replace(start, sdpa_us=sdpa_us, read_gbps=read)
    rows = [m for m in ms if m.kernel != "sdpa_fp16"]

    def consts(y: np.ndarray) -> Constants:
        return replace(base, **dict(zip(KERNEL_CONSTANTS, np.exp(y).tolist(), strict=True)))

    def res(y: np.ndarray) -> np.ndarray:
        k = consts(y)
        return np.array([predict_us(m, k, s) / m.measured_us - 1.0 for m in rows])

    y = np.log([getattr(base, n) for n in KERNEL_CONSTANTS])
    r = res(y)
    lam, h = 1e-2, 1e-4
    for _ in range(iters):
        jac = np.stack([(res(y + h * np.eye(len(y))[j]) - r) / h for j in range(len(y))], axis=1)
        a, g = jac.T @ jac, jac.T @ r
        while lam < 1e8:
            dy = -np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-6), g)  # + 1e-6: a constant no timing moves
            r2 = res(y + dy)
            if r2 @ r2 < r @ r:
                y, r, lam = y + dy, r2, lam / 3
                break
            lam *= 4
        if lam >= 1e8 or np.max(np.abs(dy)) < 1e-5:
            break
    return consts(y)


def errors(ms: Sequence[Measurement], k: Constants, s: Setup) -> list[float]:
    return [predict_us(m, k, s) / m.measured_us - 1.0 for m in ms]


def summary(errs: Sequence[float]) -> dict:
    e = np.array(errs)
    return {"rms": round(float(np.sqrt(np.mean(e ** 2))), 4), "max_abs": round(float(np.max(np.abs(e))), 4),
            "n": len(e)}


def shape_of(m: Measurement) -> tuple[str, int, int]:
    return (m.model, m.batch, m.context)


def held_out(ms: Sequence[Measurement], s: Setup, key: Callable[[Measurement], object]) -> dict:
    """Each group of `key` predicted by constants fitted without it: {index of the measurement: held-out us} and
    the constants of each fit."""
    preds: dict[int, float] = {}
    fits = {}
    for group in sorted({key(m) for m in ms}, key=str):
        train = [m for m in ms if key(m) != group]
        k = fit(train, s)
        label = " ".join(str(x) for x in group) if isinstance(group, tuple) else str(group)
        fits[f"without {label}"] = {n: round(getattr(k, n), 4) for n in asdict(k)}
        for i, m in enumerate(ms):
            if key(m) == group:
                preds[i] = predict_us(m, k, s)
    return {"predicted_us": preds, "constants": fits}


def calibration_document(ms: Sequence[Measurement], s: Setup, k: Constants = FITTED, with_held_out: bool = True,
                         extra: dict | None = None) -> dict:
    """The committed calibration: constants, in-sample and held-out errors, one record per measurement."""
    pred = [predict_us(m, k, s) for m in ms]
    loso = held_out(ms, s, shape_of) if with_held_out else None
    by_model = held_out(ms, s, lambda m: m.model) if with_held_out else None
    records = []
    errs: dict[str, list[float]] = {"in_sample": [], "held_out_shape": [], "held_out_model": []}
    for i, (m, p) in enumerate(zip(ms, pred, strict=True)):
        rec = {"gpu": m.gpu, "model": m.model, "batch": m.batch, "context": m.context, "past": m.past,
               "kernel": m.kernel, "variant": m.variant if m.kernel != "sdpa_fp16" else None,
               "predicted_us": round(p, 2), "measured_us": round(m.measured_us, 2),
               "error": round(p / m.measured_us - 1.0, 4), "source": m.source}
        errs["in_sample"].append(p / m.measured_us - 1.0)
        for name, ho in (("held_out_shape", loso), ("held_out_model", by_model)):
            if ho is not None:
                rec[f"{name}_us"] = round(ho["predicted_us"][i], 2)
                rec[f"{name}_error"] = round(ho["predicted_us"][i] / m.measured_us - 1.0, 4)
                errs[name].append(ho["predicted_us"][i] / m.measured_us - 1.0)
        records.append(rec)
    doc: dict = {
        "label": LABEL, "tolerance": TOLERANCE,
        "constants": [{"name": n, "value": getattr(k, n), "meaning": MEANING[n]} for n in asdict(k)],
        "fitted": f"{len(KERNEL_CONSTANTS)} constants to {sum(m.kernel != 'sdpa_fp16' for m in ms)} kernel "
                  f"timings, 2 to {sum(m.kernel == 'sdpa_fp16' for m in ms)} SDPA timings",
        "in_sample": summary(errs["in_sample"]),
        "records": records, **(extra or {}),
    }
    if loso is not None and by_model is not None:
        doc["held_out"] = {
            "each_shape": {**summary(errs["held_out_shape"]),
                           "how": "each of the 18 shapes (its 3 timings) predicted by a fit to the other 17"},
            "other_model": {**summary(errs["held_out_model"]),
                            "how": "each model's 9 shapes predicted by a fit to the other model's"},
            "constants_each_shape": loso["constants"], "constants_other_model": by_model["constants"]}
    return doc


def setup_for(result: KernelResult, gpu: Gpu) -> Setup:
    """The measured kernel ("mma") analysed for `gpu`'s arch: its classes per model and its occupancy."""
    res = replace(result.resources, smem_bytes=result.resources.smem_bytes + result.spec.dynamic_smem(MODELS[
        "llama-3-8b"]))
    cps = occupancy(res, result.spec.threads, gpu)["ctas_per_sm"]
    cache: dict[str, dict[str, ChunkClass]] = {}

    def classes(model: str) -> dict[str, ChunkClass]:
        if model not in cache:
            cache[model] = baseline_classes(result, MODELS[model])
        return cache[model]
    return Setup(classes, cps, Machine(gpu.sms, gpu.clock_ghz))


def measured_attention(ms: Sequence[Measurement]) -> dict[tuple, float]:
    """{(gpu, model, batch, context, variant): us} of the KIVI attention timings (what the gate may use)."""
    return {(m.gpu, m.model, m.batch, m.context, m.variant): m.measured_us for m in ms if m.kernel == "kivi_attention"}
