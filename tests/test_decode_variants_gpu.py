"""Every decode variant the kernel library declares (kiviDecodeVariants.h through the C ABI; the default alone when the
library has no variant API) computes the KiviAttention op at the headline combination (head_dim 128, 2-bit K and V,
fp16 and bf16): a ragged batch prefilled, then decode steps across window and group flushes, the variant chosen
through KiviStepParams.decodeVariant. Marked gpu (skipped without CUDA or the built library).

Oracles, as tests/test_kernels_gpu.py: reference.kivi_attention_ on the CPU from identical starting buffers; every
buffer bit-exact after every step; the output (NaN-filled first) within mma_model.step_tolerance; the error flag 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trtllm_kivi.cuda import _abi, find_library, mma_model
from trtllm_kivi.cuda.ops import make_params, run_step
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.reference import KiviBuffers, kivi_attention_

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_plan  # noqa: E402  (standard library: the variant list through the C ABI)

pytestmark = pytest.mark.gpu


def _variants() -> list:
    """The library's variants at collection (the default alone without the API; a library that does not load fails
    in the test, by load_library's message, not at collection)."""
    path = find_library()
    try:
        found = gpu_plan.variants_from_library(path) if path is not None else None
    except OSError:
        found = None
    return [pytest.param(v["id"], id=f"{v['id']}-{v['name']}") for v in (found or [{"id": 0, "name": "default"}])]


def _random_buffers(cfg: KiviConfig, hkv: int, d: int, blocks: int, slots: int, dtype: torch.dtype,
                    gen: torch.Generator) -> KiviBuffers:
    """Buffers filled with random bits: a stray write anywhere fails the bit-exact comparison."""
    out = []
    for t in KiviBuffers.allocate(cfg, hkv, d, blocks, slots, dtype):
        bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
        info = torch.iinfo(bits.dtype)
        out.append(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, generator=gen).view(t.dtype))
    return KiviBuffers(*out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant", _variants())
def test_variant_matches_the_reference_across_flushes(variant, dtype):
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: no CUDA device")
    path = find_library()
    if path is None:
        pytest.skip("KIVI kernel library not built (build_scripts/build_plugin.sh)")
    lib = _abi.load_library(path)
    cfg = KiviConfig(residual_length=32)  # a flush every 32 decode steps after 64 tokens
    h, hkv, d, batch, mbs = 32, 8, 128, 3, 4
    gen = torch.Generator().manual_seed(variant)
    ref = _random_buffers(cfg, hkv, d, batch * mbs + 2, batch + 1, dtype, gen)
    gpu = KiviBuffers(*(t.cuda() for t in ref))
    table = torch.randperm(batch * mbs + 2, generator=gen)[: batch * mbs].reshape(batch, mbs).int()
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    lens = [0, 0, 0]
    steps = [[45, 1, 130]] + [[1, 1, 1]] * 40
    for chunks in steps:
        t = sum(chunks)
        q, k, v = (torch.randn(t, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv))
        past, chunk = torch.tensor(lens, dtype=torch.int32), torch.tensor(chunks, dtype=torch.int32)
        tol = mma_model.step_tolerance(ref, cfg, q, k, v, slots, past, chunk, table)
        want = kivi_attention_(q, k, v, slots, past, chunk, table, ref, cfg)
        out = torch.full((t, h, d), float("nan"), dtype=dtype, device="cuda")
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        ends = [a + b for a, b in zip(lens, chunks, strict=True)]
        p = make_params(q.cuda(), k.cuda(), v.cuda(), out, slots.cuda(), past.cuda(), chunk.cuda(), table.cuda(),
                        gpu, cfg, max_chunk_len=max(chunks), max_seq_len=max(ends),
                        num_sms=torch.cuda.get_device_properties(0).multi_processor_count, error_flag=flag)
        if variant:
            p.decodeVariant = variant
        p.ctasPerSm = max(lib.attention_ctas_per_sm(p), 0)
        refused = lib.validate(p, _abi.PHASE_STEP)
        assert not refused, f"variant {variant} refused at the headline combination: {refused}"
        run_step(lib, p, torch.device("cuda"))
        torch.cuda.synchronize()
        what = f"variant {variant}, chunks {chunks} after {lens}"
        assert int(flag.item()) == 0, f"error flag {int(flag.item())}: {what}"
        err = (out.cpu().float() - want.float()).abs()
        bad = ~(err <= tol)  # NaN (an unwritten element) is bad
        assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements off, max error {float(err.max())}"
        for name, a, b in zip(KiviBuffers._fields, gpu, ref, strict=True):
            assert torch.equal(a.cpu().view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32)), f"{name}: {what}"
        lens = ends
