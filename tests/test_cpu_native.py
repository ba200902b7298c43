"""The native CPU KIVI library (plugins/cpu, trtllm_kivi/cpu) against the torch reference (the spec).

Reference: trtllm_kivi.reference.attention.kivi_attention_ for the KIVI op, cache.FullCache.attention for the dense
baseline. Stores (codes, scales, zeros, windows) must be bit-exact over the whole buffers (both start from the same
random sentinel fill, so a stray write by either side shows); attention within the tolerance derived in `_tol`.
Every ISA path the CPU supports is forced in turn; results must not depend on the thread count or the batch.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import pytest
import torch

from trtllm_kivi import cpu as native
from trtllm_kivi.cache import FullCache
from trtllm_kivi.format import Geometry, KiviConfig
from trtllm_kivi.reference.attention import KiviBuffers, kivi_attention_

if native.unavailable_reason(quantized=False) is not None:  # the dense kernel needs only a built library
    pytest.skip(f"{native.unavailable_reason(quantized=False)} (build: build_scripts/build_cpu_kernels.sh, or set "
                f"TRTLLM_KIVI_CPU_LIB)", allow_module_level=True)

from trtllm_kivi.cpu.ops import (FullCpuAttention, KiviCpuAttention, full_attention_cpu_,  # noqa: E402
                                 kivi_attention_cpu_, kivi_layout_mismatch)

# The KIVI op of plugins/cpu implements the code layout of CODE_LAYOUT_VERSION (FORMAT_VERSION 3: FRAGMENT order, sinks);
# should format.py's FORMAT_VERSION move on without a port, the op refuses to run and its tests skip with that reason.
needs_layout = pytest.mark.skipif(kivi_layout_mismatch() is not None, reason=str(kivi_layout_mismatch()))

LIB = native.load_library()
ISAS = ["portable", "avx2", "avx2denormal", "avx512", "avx512vnni"]


def _isa(name: str) -> str:
    if not LIB.isa_supported(name):
        pytest.skip(f"this CPU has no {name} (the path is compiled in; run the tests on a CPU with it)")
    return name


@pytest.fixture(params=ISAS)
def isa(request) -> str:
    return _isa(request.param)


def _sentinel(bufs: KiviBuffers, gen: torch.Generator) -> KiviBuffers:
    """Random finite garbage in every buffer: stray writes (by either side) make the buffers differ."""
    out = []
    for t in bufs:
        if t.dtype == torch.int32:
            out.append(torch.randint(-2 ** 31, 2 ** 31 - 1, t.shape, dtype=torch.int32, generator=gen))
        else:
            out.append((torch.rand(t.shape, generator=gen) * 2 - 1).to(t.dtype))
    return KiviBuffers(*out)


class Run:
    """Drive the reference and the native op through the same ragged schedule."""

    def __init__(self, cfg: KiviConfig, h: int, hkv: int, d: int, dtype: torch.dtype, slots: int = 4,
                 max_blocks: int = 16, seed: int = 0) -> None:
        self.cfg, self.h, self.hkv, self.d, self.dtype = cfg, h, hkv, d, dtype
        self.gen = torch.Generator().manual_seed(seed)
        num_blocks = slots * max_blocks
        base = _sentinel(KiviBuffers.allocate(cfg, hkv, d, num_blocks, slots, dtype), self.gen)
        self.ref, self.nat = base.clone(), base.clone()
        perm = torch.randperm(num_blocks, generator=self.gen).to(torch.int32)  # non-identity block tables
        self.tables = perm.reshape(slots, max_blocks)
        self.past = [0] * slots

    def inputs(self, chunks: list[int]):
        n = sum(chunks)
        q = torch.randn(n, self.h, self.d, generator=self.gen).to(self.dtype)
        k = torch.randn(n, self.hkv, self.d, generator=self.gen).to(self.dtype)
        v = torch.randn(n, self.hkv, self.d, generator=self.gen).to(self.dtype)
        return q, k, v

    def step(self, slots: list[int], chunks: list[int], isa: str = "auto", threads: int = 2, qkv=None):
        q, k, v = qkv if qkv is not None else self.inputs(chunks)
        i32 = dict(dtype=torch.int32)
        args = (torch.tensor(slots, **i32), torch.tensor([self.past[s] for s in slots], **i32),
                torch.tensor(chunks, **i32), self.tables[slots].contiguous())
        out_ref = kivi_attention_(q, k, v, *args, self.ref, self.cfg)
        out_nat = kivi_attention_cpu_(q, k, v, *args, self.nat, self.cfg, isa=isa, threads=threads)
        for s, c in zip(slots, chunks, strict=True):
            self.past[s] += c
        return out_ref, out_nat, v

    def assert_stores_equal(self) -> None:
        for name, a, b in zip(KiviBuffers._fields, self.ref, self.nat, strict=True):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b), \
                f"{name}: {(a != b).sum().item()} elements differ"


def _tol(dtype: torch.dtype, v: torch.Tensor) -> float:
    """Attention error bound: the reference rounds dequantized history to the activation dtype (half an ulp of
    |v|, |k|) and rounds the output (half an ulp); the native kernel keeps fp32 and reassociates sums (a few fp32
    ulps of max|v| per split merge). With unit-variance inputs (|scores| = O(1)) that is <= 4 ulps(act) * max|v|
    plus 1e-5 * max|v| for the fp32 reassociation."""
    eps = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    vmax = float(v.float().abs().max())
    return (4 * eps + 1e-5) * max(vmax, 1.0)


CONFIGS = [  # (cfg, H, Hkv, D, dtype)
    (KiviConfig(), 6, 2, 64, torch.float32),
    # bf16 scales on avx512vnni's integer dot products (scale maxima read from the bf16 bit patterns)
    (KiviConfig(scale_dtype="bfloat16"), 6, 2, 64, torch.float32),
    (KiviConfig(k_bits=4, v_bits=2, group_size=64, residual_length=96, block_size=128), 8, 2, 128, torch.float32),
    (KiviConfig(k_bits=8, v_bits=4, group_size=128, residual_length=32, block_size=256, scale_dtype="bfloat16"),
     4, 4, 64, torch.float32),
    (KiviConfig(k_bits=2, v_bits=8, key_grouping="per_token", group_size=32, residual_length=64,
                scale_dtype="float32"), 9, 3, 64, torch.float32),
    (KiviConfig(k_bits=2, v_bits=2, residual_length=40), 8, 1, 128, torch.float16),
    (KiviConfig(k_bits=4, v_bits=4, key_grouping="per_token", group_size=64), 4, 2, 64, torch.bfloat16),
    # sinks: split 0 is [0, S + split_len), so an S that is not a tile multiple shifts every store index
    (KiviConfig(sink_tokens=4), 6, 2, 64, torch.float32),
    (KiviConfig(k_bits=4, v_bits=2, group_size=64, residual_length=64, sink_tokens=128), 8, 2, 128, torch.float16),
    (KiviConfig(k_bits=8, v_bits=2, key_grouping="per_token", residual_length=32, sink_tokens=7), 4, 2, 64,
     torch.bfloat16),
    # 8 KV heads at D 128: a decode item computes its split 4 heads at a time (headsPerPass), in two passes
    (KiviConfig(v_bits=4), 8, 8, 128, torch.float32),
    # a block size that is not a power of two: the per-block lookups divide by it, groups and tiles shift
    (KiviConfig(block_size=96, residual_length=64), 6, 2, 64, torch.float32),
]

# ragged steps: prefills, chunked prefill crossing flush points, decodes, long enough for several key splits
SCHEDULE = [([0, 1, 2], [300, 45, 7]), ([0, 1, 2], [1, 1, 1]), ([1, 3], [200, 130]), ([0, 1, 2, 3], [1, 1, 33, 1]),
            ([2, 0], [260, 1]), ([3, 2, 1, 0], [1, 1, 1, 1]), ([0], [700]), ([0, 3], [1, 1])]


@needs_layout
@pytest.mark.parametrize("cfg,h,hkv,d,dtype", CONFIGS,
                         ids=[f"{c.k_bits}k{c.v_bits}v-G{c.group_size}-{c.key_grouping}-{c.scale_dtype}-S"
                              f"{c.sink_tokens}-D{d}-{str(dt).split('.')[-1]}" for c, _, _, d, dt in CONFIGS])
def test_matches_reference(cfg, h, hkv, d, dtype, isa) -> None:
    run = Run(cfg, h, hkv, d, dtype)
    for slots, chunks in SCHEDULE:
        out_ref, out_nat, v = run.step(slots, chunks, isa=isa)
        run.assert_stores_equal()
        err = float((out_ref.float() - out_nat.float()).abs().max())
        assert err <= _tol(dtype, v), f"step {slots} {chunks}: max |native - reference| = {err}"
    assert max(run.past) > LIB.split_len()  # the schedule exercised more than one key split


@needs_layout
def test_special_groups_bit_exact(isa) -> None:
    """Constant groups (scale 0), tiny ranges (subnormal fp16 scales), huge ranges and exact rounding ties."""
    cfg = KiviConfig(residual_length=0)
    run = Run(cfg, 2, 2, 64, torch.float32, slots=1)
    n = 96
    k = torch.randn(n, 2, 64, generator=run.gen)
    k[:32, 0] = 0.75  # constant per channel over the first group
    k[32:64, 1] = k[32:64, 1] * 1e-6  # range ~1e-6: fp16 subnormal scale
    k[64:, 0, :8] = torch.tensor([0.0, 3.0, 1.5, 0.5, 2.5, 1.0, 2.0, 3.0]).repeat(4)[:, None]  # exact .5 ties
    v = k.clone() * 1e4  # |v| up to ~4e4: scales near the top of fp16's range
    v[:, :, 32:] = 1e-5 * torch.randn(n, 2, 32, generator=run.gen)
    q = torch.randn(n, 2, 64, generator=run.gen)
    out_ref, out_nat, _ = run.step([0], [n], isa=isa, qkv=(q, k, v))
    run.assert_stores_equal()
    assert torch.allclose(out_ref, out_nat, rtol=1e-4, atol=1e-4 * float(v.abs().max()))


@needs_layout
@pytest.mark.parametrize("case", ["nan_query", "negative_value_scales", "tiny_key_scales", "tiny_value_scales",
                                  "large_key_scales", "large_value_scales", "huge_key_scales", "huge_value_scales"])
def test_dot_product_fallbacks(case, isa) -> None:
    """Inputs avx512vnni's integer dot products cannot take go to its fp32 path (keys: per block; values: per split
    and head):
    a NaN query head (keys; its values' digits are garbage in that row only, whose softmax sum is NaN), negative value
    scales, scales so small (< 1e-30) that the fixed-point step would underflow.
    avx2denormal's subnormal decode carries 2^100 in its operands: large_* (scales x 1e6) stay finite and take it,
    huge_* (x 1e12 keys, x 1e20 values) overflow, so that key group / split is scored again by the fp32 path.
    On every path the result must still match the reference, with the NaN in exactly the head it came from."""
    cfg = KiviConfig(scale_dtype="float32")  # fp16 scales cannot be that small
    run = Run(cfg, 6, 2, 64, torch.float32, slots=2, seed=13)
    run.step([0, 1], [700, 300], isa=isa)  # quantized history over two key splits
    for bufs in (run.ref, run.nat):  # the same change on both sides (the stores stay equal)
        if case == "negative_value_scales":
            bufs.v_scale.view(-1)[::3].neg_()
        elif case == "tiny_key_scales":
            bufs.k_scale.mul_(1e-33)
        elif case == "tiny_value_scales":
            bufs.v_scale.mul_(1e-32)
        elif case.endswith("_key_scales"):
            bufs.k_scale.view(-1)[::5].mul_(1e12 if case.startswith("huge") else 1e6)
        elif case.endswith("_value_scales"):
            bufs.v_scale.view(-1)[::5].mul_(1e20 if case.startswith("huge") else 1e6)
    # the history's |v|: the tolerance is relative to it
    scale = {"large_value_scales": 1e6, "huge_value_scales": 1e20}.get(case, 1.0)
    for chunks in ([1, 1], [1, 1]):
        q, k, v = run.inputs(chunks)
        if case == "nan_query":
            q[0, 3, 5] = float("nan")  # sequence 0, head 3 (KV head 1)
        out_ref, out_nat, v = run.step([0, 1], chunks, isa=isa, qkv=(q, k, v))
        run.assert_stores_equal()
        nan = out_ref.isnan()
        assert torch.equal(nan, out_nat.isnan())
        assert bool(nan.any()) == (case == "nan_query") and bool(nan[0, 3].all()) == (case == "nan_query")
        err = float((out_ref - out_nat)[~nan].abs().max())
        assert err <= scale * _tol(torch.float32, v), f"{case}: max |native - reference| = {err}"


@needs_layout
@pytest.mark.parametrize("mult,scale_dtype", [(10.0, "float16"), (1000.0, "float16"), (1000.0, "bfloat16"),
                                              (1000.0, "float32")])
def test_key_outlier_groups(mult, scale_dtype, isa) -> None:
    """Keys far larger in a few groups (an attention-sink-like first group, a few tokens of the next one), as real
    models have: avx512vnni's key digits share one fixed-point scale per block and row (S::keyBlockScale), which must
    bound the outlier groups and keep the others within the tolerance; x1000 for every scale dtype (S::keyScaleMax
    reads the scales' bit patterns: a misread maximum lets the outliers' digits overflow). x10 only with fp16 scales:
    its scores are O(10), outside _tol's O(1) assumption, and every path's error is 0.4-0.9 of the tolerance there
    (avx512vnni with bf16 scales 1.03)."""
    run = Run(KiviConfig(residual_length=32, scale_dtype=scale_dtype), 6, 2, 64, torch.float32, slots=1, seed=3)
    q, k, v = run.inputs([700])
    k[:32] *= mult
    k[40:45] *= mult
    run.step([0], [700], isa=isa, qkv=(q, k, v))
    for _ in range(3):
        out_ref, out_nat, v = run.step([0], [1], isa=isa)
        run.assert_stores_equal()
        err = float((out_ref - out_nat).abs().max())
        assert err <= _tol(torch.float32, v), f"x{mult}: max |native - reference| = {err}"


@needs_layout
@pytest.mark.parametrize("group_size,d", [(64, 64), (32, 64), (32, 128)], ids=["ng1", "ng2", "ng4"])
def test_value_outlier_tokens(group_size, d, isa) -> None:
    """A few tokens with values x1000 at odd positions, with 1, 2 or 4 value groups per token: avx512vnni's value
    digits share one fixed-point scale per split and group (the largest value scale: S::maxBits over the
    token-major entries, then S::groupMaxBits per group), which must take every lane of its group into account; with
    an outlier missed its digits overflow."""
    run = Run(KiviConfig(group_size=group_size, residual_length=32), 6, 2, d, torch.float32, slots=1, seed=7)
    q, k, v = run.inputs([700])
    v[[41, 43, 301]] *= 1000.0
    run.step([0], [700], isa=isa, qkv=(q, k, v))
    vmax = float(v.abs().max())
    for _ in range(2):
        out_ref, out_nat, _ = run.step([0], [1], isa=isa)
        run.assert_stores_equal()
        err = float((out_ref - out_nat).abs().max())
        assert err <= (4 * 2 ** -23 + 1e-5) * vmax, f"max |native - reference| = {err} (max |v| {vmax})"


@needs_layout
def test_flush_denormal_mode_changes_nothing(isa) -> None:
    """torch.set_flush_denormal(True) sets DAZ/FTZ on the calling thread; avx2denormal's codes are subnormal floats,
    so the kernel clears DAZ for its work and restores MXCSR: the same bits with and without, on the caller (1 thread)
    and on the pool (2 threads), and the caller's mode is left as it was."""
    cfg = KiviConfig()
    runs = {(mode, t): Run(cfg, 6, 2, 64, torch.float32, slots=2, seed=5) for mode in ("plain", "flush") for t in (1, 2)}
    for chunks in ([700, 300], [1, 1], [1, 1]):
        qkv = runs["plain", 1].inputs(chunks)
        for threads in (1, 2):
            out_plain = runs["plain", threads].step([0, 1], chunks, isa=isa, threads=threads, qkv=qkv)[1]
            if not torch.set_flush_denormal(True):
                pytest.skip("this CPU has no flush-denormal mode (DAZ)")
            try:
                out_flush = runs["flush", threads].step([0, 1], chunks, isa=isa, threads=threads, qkv=qkv)[1]
                assert torch.tensor([1e-40]).mul(1.0).item() == 0.0  # the caller still flushes after the op
            finally:
                torch.set_flush_denormal(False)
            assert torch.equal(out_plain, out_flush), f"threads={threads}: {(out_plain - out_flush).abs().max()}"


@needs_layout
def test_thread_count_invariance(isa) -> None:
    """Split points are fixed: any thread count gives the same bits (outputs and stores)."""
    cfg = KiviConfig()
    runs = {t: Run(cfg, 6, 2, 64, torch.float32, seed=3) for t in (1, 2, 3, 8)}
    for slots, chunks in SCHEDULE:
        qkv = runs[1].inputs(chunks)
        outs = {t: r.step(slots, chunks, isa=isa, threads=t, qkv=qkv)[1] for t, r in runs.items()}
        for t in (2, 3, 8):
            assert torch.equal(outs[1], outs[t]), f"threads={t} differs from threads=1 at step {slots} {chunks}"
            for a, b in zip(runs[1].nat, runs[t].nat, strict=True):
                assert torch.equal(a, b)


@needs_layout
def test_batch_invariance(isa) -> None:
    """A sequence's output bits do not depend on what else is in the step (decode and prefill rows)."""
    cfg = KiviConfig()
    alone = Run(cfg, 6, 2, 64, torch.float32, seed=5)
    mixed = Run(cfg, 6, 2, 64, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(9)
    for chunk in (900, 1, 1, 40, 1):
        qkv = tuple(torch.randn(chunk, hh, 64, generator=gen) for hh in (6, 2, 2))
        out_alone = alone.step([0], [chunk], isa=isa, qkv=qkv)[1]
        other = tuple(torch.randn(17, hh, 64, generator=gen) for hh in (6, 2, 2))
        both = tuple(torch.cat([o, x]) for o, x in zip(other, qkv, strict=True))  # sequence 0 second in the batch
        out_mixed = mixed.step([2, 0], [17, chunk], isa=isa, qkv=both)[1]
        assert torch.equal(out_alone, out_mixed[17:]), f"chunk {chunk}: batch composition changed the bits"


@needs_layout
def test_paths_agree() -> None:
    """Every supported path computes the same attention (up to fp32 reassociation) and the same stores."""
    supported = [i for i in ISAS if LIB.isa_supported(i)]
    runs = {i: Run(KiviConfig(), 6, 2, 64, torch.float32, seed=11) for i in supported}
    for slots, chunks in SCHEDULE[:4]:
        qkv = runs[supported[0]].inputs(chunks)
        outs = {i: r.step(slots, chunks, isa=i, qkv=qkv)[1] for i, r in runs.items()}
        for i in supported[1:]:
            assert torch.allclose(outs[supported[0]], outs[i], rtol=0, atol=2e-5)
            for a, b in zip(runs[supported[0]].nat, runs[i].nat, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dense_matches_full_cache(cache_dtype, isa) -> None:
    """full_attention_cpu_ is FullCache.attention: same cache contents (bit-exact casts), attention in tolerance."""
    geom = Geometry(1, 8, 2, 64)
    ref = FullCache(geom, 3, 1200, cache_dtype, backend="torch")  # the torch path is the reference
    k_cache, v_cache = ref.k[0].clone(), ref.v[0].clone()
    bound_k, bound_v = ref.k[0].clone(), ref.v[0].clone()
    bound = FullCpuAttention([bound_k], [bound_v], 8, isa=isa)  # the cpu FullCache's path: same bits
    for _ in range(3):
        ref.add_sequence()
    gen = torch.Generator().manual_seed(2)
    for slots, chunks in ([0, 1, 2], [600, 5, 33]), ([0, 1, 2], [1, 1, 1]), ([2, 1], [540, 1]):
        step = ref.begin_step(slots, chunks)
        n = sum(chunks)
        q, k, v = (torch.randn(n, hh, 64, generator=gen) for hh in (8, 2, 2))
        out_ref = ref.attention(0, q, k, v, step)
        out_nat = full_attention_cpu_(q, k, v, step.slot_ids, step.past_len, step.chunk_len, k_cache, v_cache,
                                      isa=isa)
        out_bound = bound(0, q, k, v, step.slot_ids, step.past_len, step.chunk_len)
        ref.end_step(step)
        assert torch.equal(ref.k[0], k_cache) and torch.equal(ref.v[0], v_cache)
        assert torch.equal(ref.k[0], bound_k) and torch.equal(ref.v[0], bound_v) and torch.equal(out_nat, out_bound)
        err = float((out_ref - out_nat).abs().max())
        assert err <= 2e-5 * max(1.0, float(v.abs().max())), err
    with pytest.raises(ValueError, match="chunk_len has dtype torch.int64"):
        bound(0, q, k, v, step.slot_ids, step.past_len, step.chunk_len.long())
    with pytest.raises(ValueError, match="must be \\[tokens, 8, 64\\]"):
        bound(0, q[:, :4].contiguous(), k, v, step.slot_ids, step.past_len, step.chunk_len)
    for bad_out in (torch.empty(q.shape, dtype=torch.float64), torch.empty(q.shape[0], 64, 8).transpose(1, 2)):
        with pytest.raises(ValueError, match="must be a contiguous CPU tensor like q"):
            full_attention_cpu_(q, k, v, step.slot_ids, step.past_len, step.chunk_len, k_cache, v_cache, out=bad_out)
        with pytest.raises(ValueError, match="must be a contiguous CPU tensor like q"):
            bound(0, q, k, v, step.slot_ids, step.past_len, step.chunk_len, out=bad_out)


def _one_step_args(run: Run, slots, chunks):
    q, k, v = run.inputs(chunks)
    i32 = dict(dtype=torch.int32)
    return [q, k, v, torch.tensor(slots, **i32), torch.tensor([run.past[s] for s in slots], **i32),
            torch.tensor(chunks, **i32), run.tables[slots].contiguous()]


@needs_layout
@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.__setitem__(3, torch.tensor([0, 0], dtype=torch.int32)), "appears twice"),
    (lambda a: a.__setitem__(3, torch.tensor([0, 9], dtype=torch.int32)), "slot id 9 out of range"),
    (lambda a: a.__setitem__(5, torch.tensor([3, 4], dtype=torch.int32)), "sum\\(chunk_len\\)=7"),
    (lambda a: a.__setitem__(4, torch.tensor([-1, 0], dtype=torch.int32)), "must be >= 0"),
    (lambda a: a.__setitem__(6, torch.full((2, 16), -1, dtype=torch.int32)), "block id -1"),
    (lambda a: a.__setitem__(4, torch.tensor([5000, 0], dtype=torch.int32)), "past the block table's capacity"),
    (lambda a: a.__setitem__(0, a[0].double()), "activation dtype"),
    (lambda a: a.__setitem__(0, a[0].transpose(0, 1).contiguous().transpose(0, 1)), "must be contiguous"),
])
@pytest.mark.parametrize("api", ["function", "bound"])
def test_bad_inputs_raise_and_corrupt_nothing(mutate, match, api) -> None:
    """kivi_attention_cpu_ and KiviCpuAttention (after a good call, so its step memo holds other tensors) refuse the
    bad value and write nothing."""
    run = Run(KiviConfig(), 4, 2, 64, torch.float32)
    run.step([0, 1], [300, 2])
    args = _one_step_args(run, [0, 1], [1, 2])
    op = KiviCpuAttention([run.nat], run.cfg, run.h)
    if api == "bound":
        good = _one_step_args(run, [0, 1], [1, 2])
        op(0, *good, phase=1)  # attention only: the cache is unchanged
    mutate(args)
    before = run.nat.clone()
    with pytest.raises(ValueError, match=match):
        if api == "bound":
            op(0, *args)
        else:
            kivi_attention_cpu_(*args, run.nat, run.cfg)
    for a, b in zip(before, run.nat, strict=True):
        assert torch.equal(a, b)


@needs_layout
def test_bound_op_matches_function() -> None:
    """KiviCpuAttention (checks once, params built once, step tensors checked once per step) gives the bits of
    kivi_attention_cpu_ (the reference for it here), outputs and stores, over two layers and ragged steps; it refuses
    int tensors of another dtype or shape when they replace checked ones, and q/k/v/out that do not fit."""
    cfg, h, hkv, d = KiviConfig(), 6, 2, 64
    gen = torch.Generator().manual_seed(5)
    base = [_sentinel(KiviBuffers.allocate(cfg, hkv, d, 32, 4, torch.float32), gen) for _ in range(2)]
    fn_layers, op_layers = [b.clone() for b in base], [b.clone() for b in base]
    op = KiviCpuAttention(op_layers, cfg, h)
    tables = torch.randperm(32, generator=gen).to(torch.int32).reshape(4, 8)
    past = [0] * 4
    i32 = dict(dtype=torch.int32)
    for slots, chunks in ([0, 1, 2], [300, 45, 7]), ([0, 1, 2], [1, 1, 1]), ([3, 0], [200, 1]), ([2, 3], [1, 1]):
        ints = (torch.tensor(slots, **i32), torch.tensor([past[s] for s in slots], **i32), torch.tensor(chunks, **i32),
                tables[slots].contiguous())
        for layer in range(2):
            q, k, v = (torch.randn(sum(chunks), n, d, generator=gen) for n in (h, hkv, hkv))
            out = torch.full_like(q, float("nan"))  # sentinel: every element must be written
            a = kivi_attention_cpu_(q, k, v, *ints, fn_layers[layer], cfg, threads=2)
            b = op(layer, q, k, v, *ints, threads=2, out=out)
            assert b is out and torch.equal(a, b)
        for s, c in zip(slots, chunks, strict=True):
            past[s] += c
    for x, y in zip(fn_layers, op_layers, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
    q, k, v = (torch.randn(1, n, d, generator=gen) for n in (h, hkv, hkv))
    ints = [torch.tensor([1], **i32), torch.tensor([past[1]], **i32), torch.tensor([1], **i32),
            tables[[1]].contiguous()]
    with pytest.raises(ValueError, match="past_len has dtype torch.int64"):
        op(0, q, k, v, ints[0], ints[1].long(), *ints[2:], phase=1)
    with pytest.raises(ValueError, match=r"must be \[B\]"):
        op(0, q, k, v, ints[0], torch.tensor([0, 0], **i32), *ints[2:], phase=1)
    with pytest.raises(ValueError, match="must equal the window dtype"):
        op(0, q.half(), k.half(), v.half(), *ints, phase=1)
    with pytest.raises(ValueError, match="must be contiguous"):
        op(0, q, k.expand(1, hkv, d).transpose(1, 2).contiguous().transpose(1, 2), v, *ints, phase=1)
    with pytest.raises(ValueError, match="do not match the bound cache"):
        op(0, torch.randn(1, 4, d), k, v, *ints, phase=1)  # 4 heads, bound with 6
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor like q"):
        op(0, q, k, v, *ints, phase=1, out=torch.empty(1, h, d, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_heads=5 must be a positive multiple"):
        KiviCpuAttention(op_layers, cfg, 5)
    with pytest.raises(ValueError, match="buffer k_scale has shape"):
        KiviCpuAttention([op_layers[0]._replace(k_scale=op_layers[0].k_scale[:1])], cfg, h)


@needs_layout
def test_unchecked_call_matches_checked_and_still_checks_qkv() -> None:
    """check=False (the cache's own calls: it allocated the buffers) gives the same bits and still refuses bad q/k/v
    and bad lengths (the library validates those)."""
    run = Run(KiviConfig(), 4, 2, 64, torch.float32)
    run.step([0, 1], [300, 2])
    args = _one_step_args(run, [0, 1], [1, 1])
    other = run.nat.clone()
    a = kivi_attention_cpu_(*args, run.nat, run.cfg)
    b = kivi_attention_cpu_(*args, other, run.cfg, check=False)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(run.nat, other, strict=True))
    bad = list(args)
    bad[0] = bad[0].double()
    with pytest.raises(ValueError, match="activation dtype"):
        kivi_attention_cpu_(*bad, run.nat, run.cfg, check=False)
    bad = list(args)
    bad[3] = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="slot id 9 out of range"):
        kivi_attention_cpu_(*bad, run.nat, run.cfg, check=False)


@needs_layout
def test_unsupported_geometry_and_isa() -> None:
    cfg = KiviConfig()
    bufs = KiviBuffers.allocate(cfg, 2, 96, 4, 2, torch.float32)
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim=96"):
        kivi_attention_cpu_(torch.zeros(1, 2, 96), torch.zeros(1, 2, 96), torch.zeros(1, 2, 96),
                            torch.tensor([0], **i32), torch.tensor([0], **i32), torch.tensor([1], **i32),
                            torch.zeros(1, 2, **i32), bufs, cfg)
    with pytest.raises(ValueError, match="isa='sse9'"):
        kivi_attention_cpu_(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64),
                            torch.tensor([0], **i32), torch.tensor([0], **i32), torch.tensor([1], **i32),
                            torch.zeros(1, 2, **i32), KiviBuffers.allocate(cfg, 2, 64, 4, 2, torch.float32), cfg,
                            isa="sse9")
    missing = [i for i in ISAS if not LIB.isa_supported(i)]
    if missing:
        with pytest.raises(ValueError, match=f"isa path {missing[0]} is not supported"):
            kivi_attention_cpu_(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64),
                                torch.tensor([0], **i32), torch.tensor([0], **i32), torch.tensor([1], **i32),
                                torch.zeros(1, 2, **i32), KiviBuffers.allocate(cfg, 2, 64, 4, 2, torch.float32),
                                cfg, isa=missing[0])


def test_library_metadata() -> None:
    from trtllm_kivi.cpu.ops import CODE_LAYOUT_VERSION
    assert LIB.format_version() == CODE_LAYOUT_VERSION  # the code layout it implements (kivi_layout_mismatch)
    assert LIB.resolve_isa("auto") in ISAS
    assert LIB.isa_supported("portable")
    assert LIB.split_len() % 128 == 0 and math.gcd(LIB.split_len(), 512) == 512


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None,
                    reason="binutils (objdump, nm) not installed")
def test_dot_product_accumulators_stay_in_registers() -> None:
    """The avx512vnni path's integer dot-product loops (keyTileDot8 inside scoresPerChannel<2>, valueSpanDot8) keep
    their accumulators in registers: no vpdpbusd result is stored to the stack right after it. g++ 12 keeps an
    inlined valueSpanDot8's accumulator array in memory (a store after every vpdpbusd, 1.2x the op's time), and a
    by-reference accumulator does the same in keyTileDot8; the kernel sidesteps both (valueSpanDot8 not inlined, the
    accumulator passed by value), and this catches a return."""
    so = str(LIB.path)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True, check=True)
    spill = re.compile(r"vmovdq[au](?:32|64)\s+%(zmm\d+),-?(?:0x[0-9a-f]+)?\(%r[sb]p")
    dst = re.compile(r"vpdpbusd\s+.*,%(zmm\d+)\s*$")
    checked, name, lines = 0, "", asm.stdout.splitlines()
    for i, ln in enumerate(lines):
        if ln.endswith(">:"):
            name = ln
            checked += "10avx512vnni" in name and ("16scoresPerChannelILi2E" in name or "13valueSpanDot8" in name)
            continue
        m = dst.search(ln)
        if not m or "10avx512vnni" not in name:
            continue
        for nxt in lines[i + 1:i + 3]:
            s2 = spill.search(nxt)
            assert not (s2 and s2.group(1) == m.group(1)), \
                f"{name}: accumulator spilled: {ln} / {nxt}"
    assert checked >= 4, f"avx512vnni scoresPerChannel<2> / valueSpanDot8 symbols not found in {so} ({checked})"


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None,
                    reason="binutils (objdump, nm) not installed")
def test_key_prefetch_is_compiled_in() -> None:
    """Every ISA's per-channel key scoring (scoresPerChannel) issues its software prefetches. Reference: the source's
    prefetchKeyGroup calls; GCC 12 deletes them unless the helpers are always_inline (a function whose only effects
    are prefetches is taken as side-effect free), which leaves the keys waiting on DRAM. The function also holds
    prefetchValues (3 prefetch instructions, one per loop: codes, scales, zeros), so the key group's own (scales,
    zeros, codes: at least 3 more) are counted: a build with prefetchKeyGroup deleted again has exactly 3."""
    so = str(LIB.path)
    syms = subprocess.run(["nm", "-S", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    found = 0
    for line in syms.splitlines():
        parts = line.split()
        if len(parts) != 4 or "16scoresPerChannelILi2E" not in parts[3]:
            continue
        start, size = int(parts[0], 16), int(parts[1], 16)
        asm = subprocess.run(["objdump", "-d", f"--start-address={start}", f"--stop-address={start + size}", so],
                             capture_output=True, text=True, check=True).stdout
        n = sum(1 for ln in asm.splitlines() if "prefetch" in ln)
        assert n >= 6, f"{n} prefetch instructions in {parts[3]}: the key group's are missing"
        found += 1
    assert found >= 2, f"scoresPerChannel<2> symbols not found in {so} (found {found})"
