"""KIVI CUDA kernels on a GPU against the torch reference (marked gpu; skipped without CUDA or the built library).

Runs on a bare GPU machine: imports only torch, numpy, pytest and this source tree (PYTHONPATH=.).
Oracles: trtllm_kivi.reference.kivi_attention_ / append on the CPU, from identical starting buffers.
  - cache buffers: bit-exact after every step (codes, scales, zeros, windows). Buffers start filled with random
    bits on both sides, so a stray write anywhere (another sequence's blocks or slot, padding) fails the comparison.
  - attention output (the default mma.sync kernel, kiviDecodeMma.cuh): within mma_model.step_tolerance, the bound
    derived from the kernel's folded rounding (q' = rnd(q s 2^b), P'' = rnd(p s 2^b), the reference's rounding of
    dequantized K/V to the activation dtype, fp32 tensor-core accumulation; trtllm_kivi/cuda/mma_model.py), the
    same bound the lane-level CPU emulation is tested against. The output starts filled with NaN (sentinel):
    every element must be written, rows no sequence covers included (zeros).
  - loose check: 8-bit KIVI vs full-precision attention on the original K/V.
Sequences of >= 64 query rows (chunk_len x GQA) run in the prefill kernel (kiviPrefillMma.cuh), the others in the
decode kernel, in the same step; every step's append is kiviAppendKernel (one launch: window groups, then the window
rows, in CTA y = 0; chunk groups in the others).
"""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_kivi.cuda import _abi, mma_model
from trtllm_kivi.cuda.variants import VARIANTS
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import KiviBuffers, kivi_attention_
from trtllm_kivi.reference.attention import append as ref_append

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib() -> _abi.KiviLibrary:
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: no CUDA device")
    path = _abi.find_library()
    if path is None:
        tried = ", ".join(str(p) for p in _abi.library_candidates())
        pytest.skip(f"KIVI kernel library not built (tried {tried}); run build_scripts/build_plugin.sh")
    return _abi.load_library(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def random_buffers(cfg: KiviConfig, hkv: int, d: int, num_blocks: int, num_slots: int, dtype: torch.dtype,
                   gen: torch.Generator) -> KiviBuffers:
    """Buffers of the right shapes/dtypes filled with random bits (sentinels for stray writes)."""
    z = KiviBuffers.allocate(cfg, hkv, d, num_blocks, num_slots, dtype)
    out = []
    for t in z:
        b = _bits(t)
        info = torch.iinfo(b.dtype)
        out.append(torch.randint(info.min, info.max, b.shape, dtype=b.dtype, generator=gen).view(t.dtype))
    return KiviBuffers(*out)


def assert_buffers_equal(gpu: KiviBuffers, ref: KiviBuffers, what: str) -> None:
    for name, a, b in zip(ref._fields, gpu, ref, strict=True):
        a = _bits(a.cpu())
        if not torch.equal(a, _bits(b)):
            bad = (a != _bits(b)).nonzero()[:5].tolist()
            pytest.fail(f"{name} differs from the reference {what}; first indices {bad}")


def assert_attention_close(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    got = got.cpu().float()
    err = (got - ref.float()).abs()
    ok = err <= tol  # NaN (an unwritten sentinel) fails
    if not bool(ok.all()):
        i = (~ok).nonzero()[0].tolist()
        pytest.fail(f"attention {what}: at {i} got {got[tuple(i)].item()} want {ref[tuple(i)].item()} "
                    f"(tol {tol[tuple(i)].item()}); {int((~ok).sum())} elements off")


class Pair:
    """The same cache state on the CPU (reference) and on the GPU (kernels)."""

    def __init__(self, cfg: KiviConfig, h: int, hkv: int, d: int, dtype: torch.dtype, batch: int, mbs: int,
                 seed: int = 0, spare_blocks: int = 3) -> None:
        self.cfg, self.h, self.hkv, self.d, self.dtype = cfg, h, hkv, d, dtype
        self.gen = torch.Generator().manual_seed(seed)
        num_blocks = batch * mbs + spare_blocks
        self.ref = random_buffers(cfg, hkv, d, num_blocks, batch + 2, dtype, self.gen)
        self.gpu = KiviBuffers(*(t.cuda() for t in self.ref))
        self.table = torch.randperm(num_blocks, generator=self.gen)[: batch * mbs].reshape(batch, mbs).int()
        self.slots = torch.randperm(batch + 2, generator=self.gen)[:batch].int()
        self.lens = [0] * batch
        self.v_max = 1.0

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.dtype)

    def fill_history(self, lens: list[int]) -> None:
        """Give sequence b a history of lens[b] tokens with the reference's append (no attention), on both sides."""
        for b, n in enumerate(lens):
            if n == 0:
                continue
            k, v = self.randn(self.hkv, n, self.d), self.randn(self.hkv, n, self.d)
            self.v_max = max(self.v_max, v.abs().max().item())
            ref_append(self.ref, self.cfg, int(self.slots[b]), self.table[b], self.lens[b], k, v)
            self.lens[b] += n
        self.gpu = KiviBuffers(*(t.cuda() for t in self.ref))

    def step(self, lib: _abi.KiviLibrary, chunks: list[int], *, max_seq_len: int = 0,
             impl: int = _abi.ATTN_AUTO, max_chunk_len: int | None = None, variant: int = 0) -> None:
        """One step on both sides; compare out (sentinel-filled) and every buffer. impl: the attention kernel;
        variant: the decode variant (0 = auto); max_chunk_len None = max(chunks) (1 for decode steps: the fused
        variants' decode mode)."""
        from trtllm_kivi.cuda.ops import kivi_attention_cuda_
        t = sum(chunks)
        q, k, v = self.randn(t, self.h, self.d), self.randn(t, self.hkv, self.d), self.randn(t, self.hkv, self.d)
        self.v_max = max(self.v_max, v.abs().max().item() if t else 0.0)
        past, chunk = torch.tensor(self.lens).int(), torch.tensor(chunks).int()
        tol = mma_model.step_tolerance(self.ref, self.cfg, q, k, v, self.slots, past, chunk, self.table)
        want = kivi_attention_(q, k, v, self.slots, past, chunk, self.table, self.ref, self.cfg)
        out = torch.full((t, self.h, self.d), float("nan"), dtype=self.dtype, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        kivi_attention_cuda_(q.cuda(), k.cuda(), v.cuda(), self.slots.cuda(), past.cuda(), chunk.cuda(),
                             self.table.cuda(), self.gpu, self.cfg,
                             max_chunk_len=max(chunks) if max_chunk_len is None else max_chunk_len,
                             max_seq_len=max_seq_len,
                             error_flag=flag, out=out, attention_impl=impl, lib=lib, decode_variant=variant)
        torch.cuda.synchronize()
        what = f"chunks {chunks} after {self.lens} (attention_impl {impl}, decode variant {variant})"
        assert int(flag.item()) == 0, f"error flag {int(flag.item())} for {what}"
        assert_attention_close(out, want, tol, what)
        assert_buffers_equal(self.gpu, self.ref, what)
        self.lens = [a + b for a, b in zip(self.lens, chunks, strict=True)]


# The default (auto = mma.sync) kernel; the explicit selector must give the same kernel.
IMPLS = [pytest.param(_abi.ATTN_AUTO, id="auto")]
# Every decode variant (kiviDecodeVariants.h; trtllm_kivi/cuda/variants.py): 0 = auto, 1 = baseline, 2.. = the split
# kernel's design points. Variants not compiled for every combination run at the headline one (D 128, 2/2 bits).
VARIANT_IDS = [pytest.param(v.id, id=v.name) for v in VARIANTS]
ALL_COMBO_VARIANTS = [pytest.param(v.id, id=v.name) for v in VARIANTS if v.all_combos]

CONFIGS = [  # (k_bits, v_bits, G, R, D, H, Hkv, act dtype, scale dtype)
    (2, 2, 32, 32, 128, 32, 8, torch.float16, "float16"),
    (2, 4, 32, 32, 64, 12, 4, torch.bfloat16, "float16"),
    (4, 8, 64, 64, 128, 8, 8, torch.float16, "bfloat16"),
    (8, 2, 32, 0, 64, 3, 1, torch.bfloat16, "float32"),
    (4, 4, 128, 128, 128, 16, 2, torch.float16, "float16"),
    (2, 8, 32, 128, 128, 24, 3, torch.bfloat16, "bfloat16"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kb, vb, g, r, d, h, hkv, dtype, sdt", CONFIGS)
def test_decode_loop_matches_reference(lib, kb, vb, g, r, d, h, hkv, dtype, sdt, impl):
    """Ragged prefill, chunked prefill and 70 decode steps (crossing window and group flushes), batch 3; out and the
    whole cache compared after every step."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=r, block_size=128, scale_dtype=sdt)
    pair = Pair(cfg, h, hkv, d, dtype, batch=3, mbs=4)
    pair.step(lib, [45, 1, 130], impl=impl)
    pair.step(lib, [20, 0, 3], impl=impl)
    for _ in range(70):
        pair.step(lib, [1, 1, 1], impl=impl)


@pytest.mark.parametrize("variant", VARIANT_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_variant_decode_loop(lib, variant, dtype):
    """Every decode variant at the headline combination (head_dim 128, 2-bit K and V, GQA 4, G 32, R 32): a ragged
    prefill, then 40 pure decode steps (max_chunk_len 1: the fused variants' decode mode, the attention kernel
    writing the window rows, the fused merge) crossing window wraps and flushes of three sequences with different
    histories (one long enough for several splits), a zero-length chunk in between; out and the whole cache against
    the reference after every step."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    pair = Pair(cfg, 32, 8, 128, dtype, batch=3, mbs=12, seed=variant)
    pair.fill_history([1300, 0, 150])
    pair.step(lib, [33, 70, 2], variant=variant)
    for i in range(40):
        pair.step(lib, [1, 1, 0 if i == 7 else 1], variant=variant)


@pytest.mark.parametrize("variant", ALL_COMBO_VARIANTS)
@pytest.mark.parametrize("kb, vb, g, d, h, hkv, dtype, sdt, sinks", [
    (4, 8, 64, 64, 12, 4, torch.bfloat16, "bfloat16", 0),
    (8, 2, 32, 128, 32, 2, torch.float16, "float32", 4),  # GQA 16: two tiles per sequence
    (2, 4, 128, 64, 3, 1, torch.float16, "float16", 0),
])
def test_all_combination_variants_decode_loop(lib, variant, kb, vb, g, d, h, hkv, dtype, sdt, sinks):
    """The variants compiled for every combination, away from the headline one: a prefill chunk next to a decode
    token, then 10 decode steps (decode mode for the fused ones) in which both sequences cross a flush (histories
    placed 6 and 4 tokens before one); several splits for the ~900-token history."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=g, residual_length=32, block_size=128, scale_dtype=sdt,
                     sink_tokens=sinks)
    pair = Pair(cfg, h, hkv, d, dtype, batch=2, mbs=10, seed=kb + vb)
    first_flush = sinks + 32 + g  # S + R + G: past lengths S + R + kG - 1 flush on the next token
    pair.fill_history([first_flush + (896 // g - 1) * g - 6, 0])
    pair.step(lib, [1, first_flush - 4], variant=variant)
    for _ in range(10):
        pair.step(lib, [1, 1], variant=variant)


@pytest.mark.parametrize("sinks, kb, vb, dtype", [(4, 2, 2, torch.float16), (5, 4, 2, torch.bfloat16),
                                                   (128, 2, 4, torch.float16)])
def test_sink_tokens_match_reference(lib, sinks, kb, vb, dtype):
    """FORMAT_VERSION 2 sinks: prefill across the sinks and the first flush points, then decode; the sink rows stay
    in the window, the store starts at token S (reference: kivi_attention_ with the same config)."""
    cfg = KiviConfig(k_bits=kb, v_bits=vb, group_size=32, residual_length=32, block_size=128, sink_tokens=sinks)
    pair = Pair(cfg, 8, 2, 64, dtype, batch=3, mbs=4)
    pair.step(lib, [3, 70, 150])
    pair.step(lib, [40, 1, 1])
    for _ in range(40):
        pair.step(lib, [1, 1, 1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("d, gqa, dtype", [(128, 4, torch.float16), (64, 1, torch.bfloat16),
                                           (128, 8, torch.bfloat16), (64, 3, torch.float16)])
def test_batch_sweep_around_boundaries(lib, batch, d, gqa, dtype, impl):
    """Histories just below/at/above the window (R), group (R + kG) and block boundaries; a decode step and a short
    chunk step."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=64, block_size=128)
    edges = [0, 1, 63, 64, 65, 95, 96, 97, 127, 128, 190, 191, 192, 255, 256, 257, 600]
    hkv = 2
    pair = Pair(cfg, gqa * hkv, hkv, d, dtype, batch=batch, mbs=6, seed=batch)
    pair.fill_history([edges[(i * 7) % len(edges)] for i in range(batch)])
    pair.step(lib, [1] * batch, impl=impl)
    pair.step(lib, [(i % 5) for i in range(batch)], impl=impl)


LONG = [[1], [4096, 33], [16_000, 1, 9000], [40_000, 40_001]]


@pytest.mark.parametrize("variant, lens", [(0, lens) for lens in LONG]
                         + [(v.id, LONG[1]) for v in VARIANTS[1:]],
                         ids=lambda x: VARIANTS[x].name if isinstance(x, int) else "+".join(map(str, x)))
def test_long_contexts(lib, lens, variant):
    """Long histories (up to 40K tokens): many splits and their merge, decode steps (decode mode for the fused
    variants, then the unhinted chunk bound), GQA 4, head_dim 128; every variant at 4096 + 33 tokens."""
    cfg = KiviConfig()
    batch = len(lens)
    mbs = math.ceil(max(lens) / cfg.block_size) + 2
    pair = Pair(cfg, 32, 8, 128, torch.float16, batch=batch, mbs=mbs)
    pair.fill_history(lens)
    pair.step(lib, [1] * batch, variant=variant)
    pair.step(lib, [1] * batch, max_seq_len=max(lens) + 2, variant=variant)
    pair.step(lib, [1] * batch, max_chunk_len=0, variant=variant)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_chunks_match_reference(lib, impl):
    """Prefill chunks of 3000 tokens next to decode tokens in one ragged step, then chunked prefill on top."""
    cfg = KiviConfig(k_bits=4, v_bits=2)
    pair = Pair(cfg, 8, 2, 128, torch.bfloat16, batch=3, mbs=60)
    pair.step(lib, [3000, 1, 700], impl=impl)
    pair.step(lib, [1, 2500, 333], impl=impl)


def test_long_prefill_append_is_bit_exact(lib):
    """A 40K-token prefill chunk through the append phase only (its attention output is O(n^2) to check on the
    CPU) against the reference append."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig()
    n, hkv, d = 40_000, 8, 128
    pair = Pair(cfg, hkv, hkv, d, torch.float16, batch=1, mbs=math.ceil(n / 128) + 1)
    k, v = pair.randn(n, hkv, d), pair.randn(n, hkv, d)
    ref_append(pair.ref, cfg, int(pair.slots[0]), pair.table[0], 0, k.transpose(0, 1), v.transpose(0, 1))
    q = torch.empty(n, hkv, d, dtype=torch.float16, device="cuda")
    kivi_attention_cuda_(q, k.cuda(), v.cuda(), pair.slots.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda"),
                         torch.tensor([n], dtype=torch.int32, device="cuda"), pair.table.cuda(), pair.gpu, cfg,
                         phase=_abi.PHASE_APPEND, lib=lib)
    torch.cuda.synchronize()
    assert_buffers_equal(pair.gpu, pair.ref, "after a 40K-token append")


def test_close_to_full_precision_at_8_bits(lib):
    """Loose check against unquantized attention (SDPA on the original K/V): 8-bit codes keep the output within
    0.02 (|v| <~ 4: 8-bit steps ~ 8/255, averaged by the softmax; 0.006 seen in a CPU run of this arithmetic)."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig(k_bits=8, v_bits=8, residual_length=32)
    h, hkv, d, n = 8, 2, 128, 1000
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(n, hkv, d, generator=gen).half(), torch.randn(n, hkv, d, generator=gen).half()
    q = torch.randn(n, h, d, generator=gen).half()
    buf = KiviBuffers(*(t.cuda() for t in KiviBuffers.allocate(cfg, hkv, d, 10, 1, torch.float16)))
    table = torch.arange(10).int().reshape(1, 10).cuda()
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    outs = []
    for t in range(n):  # decode token by token: each step attends to the quantized history
        o = kivi_attention_cuda_(q[t:t + 1].cuda(), k[t:t + 1].cuda(), v[t:t + 1].cuda(), one * 0, one * t, one,
                                 table, buf, cfg, check=False, lib=lib)
        outs.append(o)
    got = torch.cat(outs).float().cpu()
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(h // hkv, 0), vf.repeat_interleave(h // hkv, 0), is_causal=True).transpose(0, 1)
    assert (got - want).abs().max().item() < 0.02


@pytest.mark.parametrize("variant, max_chunk_len", [(0, 1), (0, 0), (1, 0), (6, 1)],
                         ids=["auto-decode-mode", "auto", "baseline", "split-unfused"])
@pytest.mark.parametrize("bad", ["capacity", "block_id"])
def test_device_side_overflow_sets_the_flag(lib, bad, variant, max_chunk_len):
    """A sequence past the block table's capacity, or with a used block id past the pool (device values, no host
    sync in the launcher; in decode mode the decode kernel checks the lengths itself and takes the block-id verdict
    from the prepare kernel before writing): the sequence is skipped (zero output, cache untouched), the flag names
    the check, the other sequence is exact."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig(residual_length=32)
    pair = Pair(cfg, 8, 2, 64 if variant != 1 else 128, torch.float16, batch=2, mbs=2)
    pair.fill_history([100, 300 if bad == "block_id" else 40])
    d = pair.d
    before = KiviBuffers(*(t.clone() for t in pair.gpu))
    q, k, v = pair.randn(2, 8, d), pair.randn(2, 2, d), pair.randn(2, 2, d)
    table = pair.table.clone()
    if bad == "capacity":  # sequence 1 claims 5000 tokens: capacity 2 x 128 + 63
        past = torch.tensor([100, 5000], dtype=torch.int32)
    else:  # sequence 1's second block (used: n_q(301) = 256 > 128) points past the pool
        past = torch.tensor([100, 300], dtype=torch.int32)
        table[1, 1] = before.k_codes.shape[0] + 7
    chunk = torch.tensor([1, 1], dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = kivi_attention_cuda_(q.cuda(), k.cuda(), v.cuda(), pair.slots.cuda(), past.cuda(), chunk.cuda(),
                               table.cuda(), pair.gpu, cfg, error_flag=flag, check=False, lib=lib,
                               max_chunk_len=max_chunk_len, decode_variant=variant)
    torch.cuda.synchronize()
    assert int(flag.item()) == (_abi.ERR_CAPACITY if bad == "capacity" else _abi.ERR_BLOCK_ID)
    assert torch.all(out[1].cpu() == 0)
    slot1 = int(pair.slots[1])
    for a, b in ((pair.gpu.k_window, before.k_window), (pair.gpu.v_window, before.v_window)):
        assert torch.equal(_bits(a[slot1]), _bits(b[slot1]))
    args = (q[:1], k[:1], v[:1], pair.slots[:1], past[:1], chunk[:1], pair.table[:1])
    tol = mma_model.step_tolerance(pair.ref, cfg, *args)
    want = kivi_attention_(*args, pair.ref, cfg)
    assert_attention_close(out[:1], want, tol, "sequence 0 next to an overflowing one")


def test_launcher_rejects_unsupported_values(lib):
    """Host validation reaches Python as ValueError naming the value."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig()
    buf = KiviBuffers(*(t.cuda() for t in KiviBuffers.allocate(cfg, 1, 96, 2, 1, torch.float16)))
    x = torch.zeros(1, 1, 96, dtype=torch.float16, device="cuda")
    i = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="head_dim=96 is not supported by the KIVI kernels"):
        kivi_attention_cuda_(x, x, x, i, i, i + 1, torch.zeros(1, 2, dtype=torch.int32, device="cuda"), buf, cfg,
                             lib=lib)
    cfg_pt = KiviConfig(key_grouping="per_token")
    buf = KiviBuffers(*(t.cuda() for t in KiviBuffers.allocate(cfg_pt, 1, 64, 2, 1, torch.float16)))
    x = torch.zeros(1, 1, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="key_grouping=1 is not supported"):
        kivi_attention_cuda_(x, x, x, i, i, i + 1, torch.zeros(1, 2, dtype=torch.int32, device="cuda"), buf, cfg_pt,
                             lib=lib)


@pytest.mark.parametrize("variant", [0, 1, 6], ids=["auto", "baseline", "split-unfused"])
@pytest.mark.parametrize("chunks", [[1, 3], [1, 1]], ids=["mixed", "decode"])
@pytest.mark.parametrize("max_seq_len", [200, 0], ids=["one_split", "many_splits"])
def test_rows_no_sequence_covers_are_zero(lib, max_seq_len, chunks, variant):
    """q has more rows than sum(chunk_len) (e.g. a padded step): the rows past the last chunk belong to no sequence
    and must come back zero, with one split (kiviZeroUncoveredRowsKernel; fused variants: the decode kernel) and with
    many (kiviCombineKernel; fused variants: the decode kernel again, decode mode for one-token chunks). The output
    starts NaN-filled; the covered rows match the reference. max_seq_len 200 leaves a single split; 0 sizes the
    splits for the block table's capacity (many for this short step)."""
    from trtllm_kivi.cuda.ops import make_params, run_step
    cfg = KiviConfig(residual_length=32)
    pair = Pair(cfg, 8, 2, 64 if variant != 1 else 128, torch.float16, batch=2, mbs=8)
    pair.fill_history([100, 40])
    extra = 5
    t = sum(chunks)
    d = pair.d
    q, k, v = pair.randn(t + extra, 8, d), pair.randn(t + extra, 2, d), pair.randn(t + extra, 2, d)
    past, chunk = torch.tensor(pair.lens).int(), torch.tensor(chunks).int()
    tol = mma_model.step_tolerance(pair.ref, cfg, q[:t], k[:t], v[:t], pair.slots, past, chunk, pair.table)
    want = kivi_attention_(q[:t], k[:t], v[:t], pair.slots, past, chunk, pair.table, pair.ref, cfg)
    out = torch.full((t + extra, 8, d), float("nan"), dtype=torch.float16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    dev = [x.cuda() for x in (q, k, v, pair.slots, past, chunk, pair.table)]
    params = make_params(*dev[:3], out, *dev[3:], pair.gpu, cfg, max_seq_len=max_seq_len, error_flag=flag,
                         max_chunk_len=max(chunks), decode_variant=variant)
    plan = lib.launch_plan(params)
    assert (plan["num_splits"] == 1) == (max_seq_len == 200), plan
    run_step(lib, params, torch.device("cuda"))
    torch.cuda.synchronize()
    assert int(flag.item()) == 0
    assert torch.all(out[t:].cpu() == 0), "rows past sum(chunk_len) are not zero"
    assert_attention_close(out[:t], want, tol, f"covered rows ({plan['num_splits']} splits)")
    assert_buffers_equal(pair.gpu, pair.ref, "after a padded step")


def test_legacy_kernels_are_refused(lib):
    """The legacy SIMT/WMMA kernels read the FORMAT_VERSION 1 layout: attention_impl 1 and 2 are refused by name."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig(residual_length=32)
    pair = Pair(cfg, 8, 2, 128, torch.float16, batch=1, mbs=2)
    x = torch.zeros(1, 8, 128, dtype=torch.float16, device="cuda")
    i = torch.zeros(1, dtype=torch.int32, device="cuda")
    for impl in (_abi.ATTN_SIMT, _abi.ATTN_TENSOR_CORE):
        with pytest.raises(ValueError, match="legacy SIMT/WMMA kernel"):
            kivi_attention_cuda_(x, x[:, :2], x[:, :2], pair.slots.cuda(), i, i + 1, pair.table.cuda(), pair.gpu,
                                 cfg, attention_impl=impl, lib=lib)


def test_occupancy_query_and_whole_waves(lib):
    """kiviCAttentionCtasPerSm reports >= 1 resident CTA per SM for every bit combination (the variant auto runs); the
    decode plan at Llama-3-8B shapes then fills the variant's waves (tiles x KV heads x splits <= waves x SMs x
    CTAs/SM); and the designed occupancy of the default split kernel at the headline combination is the real one."""
    from trtllm_kivi.cuda import launch
    from trtllm_kivi.cuda.ops import make_params
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for kb in (2, 4, 8):
        for vb in (2, 4, 8):
            cfg = KiviConfig(k_bits=kb, v_bits=vb)
            buf = KiviBuffers.allocate(cfg, 8, 128, 1, 1, torch.float16)
            x = torch.zeros(8, 32, 128, dtype=torch.float16)
            i = torch.zeros(8, dtype=torch.int32)
            p = make_params(x, x[:, :8], x[:, :8], x, i, i, i, torch.zeros(8, 300, dtype=torch.int32), buf, cfg)
            cps = lib.attention_ctas_per_sm(p)
            assert cps >= 1, (kb, vb, cps)
            plan = launch.launch_plan(cfg, 32, 8, 128, 8, 8, 300, 1, 32768, sms, cps)
            assert plan.num_tiles * 8 * plan.num_splits <= sms * cps * VARIANTS[plan.decode_variant].waves
            if kb == vb == 2:
                assert cps == launch.launch_plan(cfg, 32, 8, 128, 8, 8, 300, 1, 32768, sms).ctas_per_sm == 3


def _launch_with_workspace(lib: _abi.KiviLibrary, params: _abi.KiviStepParams, ws: torch.Tensor, phase: int) -> None:
    """Launch on the current stream with the caller's workspace (its contents left as they are)."""
    params.workspace, params.workspaceSize = ws.data_ptr(), ws.numel()
    rc = lib.launch(params, torch.cuda.current_stream().cuda_stream, phase)
    assert rc == 0, f"launch failed: cudaError_t {rc} {lib.last_error()}"


@pytest.mark.parametrize("variant", [2, 5], ids=["split", "split-1wave"])
def test_fused_merge_with_a_dirty_workspace_and_graph_replays(lib, variant):
    """The fused merge's arrival counters live in the workspace (TensorRT's scratch, shared with other layers): the
    prepare kernel zeroes them every step, and the decode kernel (a programmatic dependent on sm_90) touches them,
    seqInfo and the partials only after griddepcontrol.wait. The workspace is filled with nonzero bytes before every
    launch (counters 0x01010101 or -1: a missed or late zeroing leaves no CTA the last, and out keeps its NaN
    sentinel): decode steps crossing a flush (out vs the reference, the cache bit-exact), then one step's attention
    captured in a CUDA graph (the programmatic launches become graph edges) and replayed with the workspace refilled
    between replays: out bit-identical to the eager launch each time."""
    from trtllm_kivi.cuda.ops import make_params
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    pair = Pair(cfg, 32, 8, 128, torch.float16, batch=3, mbs=12, seed=variant)
    pair.fill_history([1300, 40, 150])  # flushes after 11, 23 and 9 decode steps
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i in range(12):
        q, k, v = pair.randn(3, 32, 128), pair.randn(3, 8, 128), pair.randn(3, 8, 128)
        past, chunk = torch.tensor(pair.lens).int(), torch.ones(3, dtype=torch.int32)
        tol = mma_model.step_tolerance(pair.ref, cfg, q, k, v, pair.slots, past, chunk, pair.table)
        want = kivi_attention_(q, k, v, pair.slots, past, chunk, pair.table, pair.ref, cfg)
        out = torch.full((3, 32, 128), float("nan"), dtype=torch.float16, device="cuda")
        dev = [x.cuda() for x in (q, k, v, pair.slots, past, chunk, pair.table)]
        params = make_params(*dev[:3], out, *dev[3:], pair.gpu, cfg, max_chunk_len=1, num_sms=sms,
                             decode_variant=variant)
        plan = lib.launch_plan(params)
        assert plan["decode_mode"] == 1 and plan["fused_combine"] == 1, plan
        ws = torch.full((lib.workspace_size(params),), 0xFF if i % 2 else 0x01, dtype=torch.uint8, device="cuda")
        _launch_with_workspace(lib, params, ws, _abi.PHASE_STEP)
        torch.cuda.synchronize()
        assert_attention_close(out, want, tol, f"decode step {i} after {pair.lens} with a dirty workspace")
        assert_buffers_equal(pair.gpu, pair.ref, f"decode step {i} with a dirty workspace")
        pair.lens = [n + 1 for n in pair.lens]
    # one step's attention (no cache writes) in a CUDA graph
    q, k, v = pair.randn(3, 32, 128), pair.randn(3, 8, 128), pair.randn(3, 8, 128)
    past, chunk = torch.tensor(pair.lens).int(), torch.ones(3, dtype=torch.int32)
    dev = [x.cuda() for x in (q, k, v, pair.slots, past, chunk, pair.table)]
    out = torch.full((3, 32, 128), float("nan"), dtype=torch.float16, device="cuda")
    params = make_params(*dev[:3], out, *dev[3:], pair.gpu, cfg, max_chunk_len=1, num_sms=sms,
                         decode_variant=variant)
    ws = torch.full((lib.workspace_size(params),), 0x01, dtype=torch.uint8, device="cuda")
    _launch_with_workspace(lib, params, ws, _abi.PHASE_ATTENTION)
    torch.cuda.synchronize()
    eager = out.clone()
    assert not bool(eager.isnan().any())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch_with_workspace(lib, params, ws, _abi.PHASE_ATTENTION)
    for fill in (0x01, 0xFF, 0x7F):
        ws.fill_(fill)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"graph replay with workspace bytes {fill:#x} differs from the eager launch"
    assert_buffers_equal(pair.gpu, pair.ref, "after attention-only launches")


@pytest.mark.parametrize("variant", [2, 5, 6], ids=["split", "split-1wave", "split-unfused"])
@pytest.mark.parametrize("max_seq_len", [200, 0], ids=["one_split", "many_splits"])
def test_non_finite_window_key_gives_nan(lib, variant, max_seq_len):
    """A NaN in a window key that a sequence attends to gives NaN in the outputs of that KV head's query heads, as the
    reference's (docs/design.md: never silently finite), whichever kernel divides by l: the CTA (one split), the
    fused merge or the combine kernel; every other output finite and as the reference. CPU twin:
    tests/test_kernels_mma_model.py::test_non_finite_window_key_gives_nan_not_zero."""
    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    pair = Pair(cfg, 32, 8, 128, torch.float16, batch=2, mbs=4, seed=variant)
    pair.fill_history([300, 40])
    pair.ref.k_window[int(pair.slots[0]), 1, cfg.window_row(pair.lens[0] - 1), 5] = float("nan")
    pair.gpu = KiviBuffers(*(t.cuda() for t in pair.ref))
    q, k, v = pair.randn(2, 32, 128), pair.randn(2, 8, 128), pair.randn(2, 8, 128)
    past, chunk = torch.tensor(pair.lens).int(), torch.ones(2, dtype=torch.int32)
    want = kivi_attention_(q, k, v, pair.slots, past, chunk, pair.table, pair.ref, cfg)
    out = torch.full((2, 32, 128), 7.0, dtype=torch.float16, device="cuda")
    kivi_attention_cuda_(q.cuda(), k.cuda(), v.cuda(), pair.slots.cuda(), past.cuda(), chunk.cuda(),
                         pair.table.cuda(), pair.gpu, cfg, max_chunk_len=1, max_seq_len=max_seq_len, out=out,
                         decode_variant=variant)
    torch.cuda.synchronize()
    got = out.cpu()
    assert torch.isnan(want[0, 4:8]).all() and torch.isnan(got[0, 4:8]).all()  # query heads 4..7 read KV head 1
    nan_rows = torch.zeros(2, 32, dtype=torch.bool)
    nan_rows[0, 4:8] = True
    assert torch.isfinite(got[~nan_rows]).all()


@pytest.mark.parametrize("gqa, dtype", [(4, torch.float16), (3, torch.bfloat16), (1, torch.float16)])
def test_unhinted_chunk_bound_runs_both_kernels(lib, gqa, dtype):
    """The TensorRT plugin passes max_chunk_len = 0 (any chunk up to num_tokens): a decode batch of 40 then has a
    prefill grid whose CTAs find no sequence, a mixed step splits its sequences between the two kernels, and a long
    chunk's append runs in the chunk CTAs. Oracle: the reference, every buffer bit-exact, outputs within tolerance."""
    cfg = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=128)
    hkv = 2
    pair = Pair(cfg, gqa * hkv, hkv, 128, dtype, batch=40, mbs=6, seed=gqa)
    pair.fill_history([(37 * i) % 500 for i in range(40)])
    pair.step(lib, [1] * 40, max_chunk_len=0)
    pair.step(lib, [(i % 3) * 40 if i % 7 == 0 else 1 for i in range(40)], max_chunk_len=0)
    pair.step(lib, [1] * 40, max_chunk_len=0)


@pytest.mark.parametrize("kv", ["kivi2", "k4v2"])
def test_runner_cuda_backend_matches_reference_backend(lib, kv):
    """The Python layer's caller: TorchRunner on the GPU (random fp16 Llama, head_dim 64, GQA 2) with the cache's
    cuda backend (these kernels) against the same model and runner with the reference backend (the spec's torch ops
    on the same device). Ragged prefill past the window, then decode steps across the flush at R + G = 160.
    Oracle: the reference backend's logits, within 1% of their range (fp16 activations: the native CPU kernels against
    the same reference measured 0.004 of a 6.4 range; quantizing at all moves these logits by 0.51)."""
    from trtllm_kivi.models import LlamaModel, ModelConfig
    from trtllm_kivi.runtime.torch_runner import TorchRunner
    mcfg = ModelConfig(vocab_size=96, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=384)
    g = torch.Generator().manual_seed(5)
    sd = {n: torch.randn(s, generator=g) * (0.05 if len(s) == 2 else 0.1) + (0 if len(s) == 2 else 1)
          for n, s in LlamaModel.hf_weight_shapes(mcfg).items()}
    model = LlamaModel.from_hf_state_dict(mcfg, sd, torch.float16, "cuda")
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (150, 7, 140)]
    logits = []
    for backend in ("cuda", "reference"):
        r = TorchRunner.create(model, kv, 3, 256, backend=backend)
        assert r.cache.backend_name == backend
        slots = [r.add_sequence() for _ in prompts]
        outs = [r.step(slots, prompts, all_logits=True)]
        for i in range(30):
            outs.append(r.step(slots, [[(i * 7 + b) % 96] for b in range(3)]))
        logits.append(torch.cat(outs).float().cpu())
    got, want = logits
    span = (want.max() - want.min()).item()
    err = (got - want).abs().max().item()
    assert torch.isfinite(got).all() and err <= 0.01 * span, f"max |cuda - reference| {err} (logit range {span})"
