"""The CPU check of an exported graph: onnxruntime (runtime.ort_runner, the KiviAttention node running the reference
op) against the torch runtime (runtime.torch_runner over a KiviCache) on the same token stream: a ragged prefill of
two sequences in one step, then decode steps of both, each fed the torch runtime's greedy token (teacher forcing, so
one near-tie cannot make the streams diverge). After every step the graph's cache is compared with the torch
runtime's (codes word for word; scales, zeros and windows by max |diff|) and then overwritten with it, so every step
starts both runtimes from the same state: a code that flips where a value sits on a rounding boundary (the two
runtimes' fp32 roundings differ in the last bits) is counted once and cannot change the inputs of the later steps,
where it would otherwise move every later layer's K/V and logits by a quantization step. Reported: max |logit diff|
over prefill and decode steps, and the summed / maximal cache differences the steps left.

The graph's weights are in the build dtype; the torch reference uses the same weights rounded to that dtype and run
in fp32 (what the onnxruntime copy computes in), so the difference measured is that of the two runtimes."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from ..cache import KiviCache
from ..op import GraphInfo
from ..runtime.ort_runner import OrtRunner
from ..runtime.torch_runner import TorchRunner

# Stated tolerances (fp32 in both runtimes; CPU matmul kernels differ in summation order only). Cache tensors are
# compared relative to their largest magnitude (keys have outlier channels of tens), and a stored scale/zero may
# differ by one ulp of its dtype where fp32 min/max differ in the last bits. A code word may differ where a value
# sits on a rounding boundary: allowed for at most 0.1% of words.
LOGIT_ATOL = 1e-2
STATE_RTOL = 1e-3
CODE_MISMATCH_MAX = 1e-3


@dataclass
class CheckResult:
    prefill_tokens: list[int]
    decode_steps: int
    max_logit_diff_prefill: float
    max_logit_diff_decode: float
    max_logit_abs: float  # scale of the logits, to read the differences against
    greedy_agreement: float  # fraction of steps where both runtimes pick the same argmax
    code_words: int
    code_words_differing: int  # summed over the steps (each step starts from the torch runtime's cache)
    scale_zero_rel_diff: float  # max |diff| / max |value| over every layer's scales and zeros, over the steps
    window_rel_diff: float  # the same over the full-precision windows
    quantized_tokens: list[int]  # per sequence, at the end: the check covers flushes only when > 0
    seconds: float

    @property
    def max_logit_diff(self) -> float:
        return max(self.max_logit_diff_prefill, self.max_logit_diff_decode)

    @property
    def passed(self) -> bool:
        return (self.max_logit_diff <= LOGIT_ATOL and self.scale_zero_rel_diff <= STATE_RTOL
                and self.window_rel_diff <= STATE_RTOL
                and self.code_words_differing <= CODE_MISMATCH_MAX * self.code_words)

    def to_dict(self) -> dict:
        return {**asdict(self), "max_logit_diff": self.max_logit_diff, "passed": self.passed,
                "tolerances": {"logit_atol": LOGIT_ATOL, "state_rtol": STATE_RTOL,
                               "code_words_differing_max_fraction": CODE_MISMATCH_MAX}}


def _diff_and_scale(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(max |x - y|, max |y|) of two tensors (0, 0 when empty)."""
    if not x.numel():
        return 0.0, 0.0
    return float((x.float() - y.float()).abs().max()), float(y.float().abs().max())


def reference_model(model, dtype: str, inplace: bool = False):
    """The torch model with its weights rounded to the graph's dtype, in fp32 (`model` itself with inplace: a
    1.5B model's fp32 copy is 7 GB)."""
    ref = (model if inplace else copy.deepcopy(model)).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    return ref


def check_graph(model, graph: onnx.ModelProto | str | Path, info: GraphInfo, prompts: list[list[int]],
                decode_steps: int = 64, progress: Callable[[int], None] | None = None, threads: int | None = None,
                reference_inplace: bool = False) -> CheckResult:
    """Run both runtimes over a prefill of `prompts` (one ragged step) plus `decode_steps` decode steps. Torch runs
    single-threaded meanwhile: onnxruntime's threads and the Python op's torch calls would contend. With
    reference_inplace the torch reference rounds `model`'s own weights (the caller's model is changed)."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check(model, graph, info, prompts, decode_steps, progress, threads, reference_inplace)
    finally:
        torch.set_num_threads(torch_threads)


def _check(model, graph, info, prompts, decode_steps, progress, threads, reference_inplace) -> CheckResult:
    import time

    t0 = time.perf_counter()
    ort = OrtRunner(graph, info, threads)
    if len(prompts) > ort.max_slots:
        raise ValueError(f"{len(prompts)} check prompts but the graph has max_batch_size={ort.max_slots}")
    longest = max(map(len, prompts)) + decode_steps
    if longest > ort.max_seq_len:
        raise ValueError(f"check needs {longest} tokens per sequence; the graph has max_seq_len={ort.max_seq_len}")
    ref = reference_model(model, info.spec.dtype, inplace=reference_inplace)
    cache = KiviCache(info.kivi, info.geometry, ort.max_slots, ort.max_seq_len, dtype=torch.float32,
                      num_blocks=info.num_blocks)
    torch_runner = TorchRunner(ref, cache)

    slots = [ort.add_sequence() for _ in prompts]
    assert [torch_runner.add_sequence() for _ in prompts] == slots  # same bookkeeping -> same slots
    differing = 0
    d_sz = m_sz = d_win = m_win = 0.0

    def compare_and_sync() -> None:
        """Add what the last step left different in the graph's cache, then copy the torch runtime's into it (in
        place: onnxruntime's op holds these tensors). Unused blocks and rows are zero in both."""
        nonlocal differing, d_sz, m_sz, d_win, m_win
        assert torch.equal(ort.cache.block_tables, cache.block_tables)
        for x, y in zip(ort.cache.layers, cache.layers, strict=True):
            for name, tx, ty in zip(x._fields, x, y, strict=True):
                if name.endswith("codes"):
                    differing += int((tx != ty).sum())
                elif name.endswith("window"):
                    d, m = _diff_and_scale(tx, ty)
                    d_win, m_win = max(d_win, d), max(m_win, m)
                else:
                    d, m = _diff_and_scale(tx, ty)
                    d_sz, m_sz = max(d_sz, d), max(m_sz, m)
                tx.copy_(ty)

    a, b = ort.step(slots, prompts), torch_runner.step(slots, prompts)
    compare_and_sync()
    d_prefill = float((a - b).abs().max())
    scale = float(b.abs().max())
    d_decode, same = 0.0, int((a.argmax(-1) == b.argmax(-1)).all())
    for _i in range(decode_steps):
        nxt = [[int(t)] for t in b.argmax(-1)]
        a, b = ort.step(slots, nxt), torch_runner.step(slots, nxt)
        compare_and_sync()
        d_decode = max(d_decode, float((a - b).abs().max()))
        scale = max(scale, float(b.abs().max()))
        same += int((a.argmax(-1) == b.argmax(-1)).all())
        if progress:
            progress(1)

    # the denominator of the code-word fraction: the words the sequences' states hold at the end
    words = sum(cache.sequence_state(s, layer)[name].numel() for layer in range(info.geometry.num_layers)
                for s in slots for name in ("k_codes", "v_codes"))
    return CheckResult([len(p) for p in prompts], decode_steps, d_prefill, d_decode, scale,
                       same / (decode_steps + 1), words, differing, d_sz / max(m_sz, 1e-30),
                       d_win / max(m_win, 1e-30),
                       [info.kivi.num_quantized(ort.seq_len(s)) for s in slots], time.perf_counter() - t0)
