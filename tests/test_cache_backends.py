"""KiviCache's attention backends (cache.BACKENDS). Reference: the `reference` backend (reference.kivi_attention_,
the executable spec). `memo` must equal it bit for bit (torch.equal) on a real loader + runner over chunked
prefill and decode of two sequences with flushes, including a freed and reused slot; the `cuda` backend is covered by
the gpu tests (tests/test_kernels_gpu.py) and must be refused clearly on the CPU."""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cache import BACKENDS, KiviCache, default_backend, resolve_backend
from trtllm_kivi.format import Geometry, KiviConfig
from trtllm_kivi.models import load_model
from trtllm_kivi.models.tiny import FAN_IN_INIT, write_tiny_checkpoint
from trtllm_kivi.runtime.torch_runner import TorchRunner

KIVI2 = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32)  # flush points 64, 96, 128, ...
GEOM = Geometry(2, 4, 2, 64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok, _ = load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), init=FAN_IN_INIT,
                                                     num_attention_heads=2, num_key_value_heads=1,
                                                     bos_token_id=None, eos_token_id=None))
    text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer " * 3
    return model, tok.encode(text, add_special_tokens=False)[:200]


def runner(model, cfg, backend, slots=2, n=256):
    return TorchRunner(model, KiviCache(cfg, model.cfg.geometry, slots, n, model.dtype, backend=backend))


@pytest.mark.parametrize("cfg", [KIVI2, KiviConfig(k_bits=4, v_bits=2, residual_length=32),
                                 KiviConfig(key_grouping="per_token", residual_length=32, block_size=64),
                                 # FORMAT_VERSION 2 options: sinks (flushes at S + R + kG), rotation per layer
                                 KiviConfig(residual_length=32, sink_tokens=4, k_rotation="hadamard",
                                            v_rotation="hadamard"),
                                 KiviConfig(residual_length=32, sink_tokens=45, k_rotation=("hadamard", "none"),
                                            v_rotation=("none", "hadamard"))])
def test_memo_is_bit_identical_to_reference(tiny, cfg):
    model, tokens = tiny
    a, b = runner(model, cfg, "reference"), runner(model, cfg, "memo")
    assert a.attention_backend == "reference" and b.attention_backend == "memo"
    sa, sb = [a.add_sequence(), a.add_sequence()], [b.add_sequence(), b.add_sequence()]
    for s, e in [(0, 40), (40, 64), (64, 100), (100, 101), (101, 160)]:  # chunked prefill and decode, 2 sequences
        chunk = [tokens[s:e], tokens[::-1][s:e]]
        assert torch.equal(a.step(sa, chunk, all_logits=True), b.step(sb, chunk, all_logits=True))
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):  # same stored state, buffer for buffer
        assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    a.free_sequence(sa[0]), b.free_sequence(sb[0])  # a freed slot's memo is dropped: the reused slot starts fresh
    sa[0], sb[0] = a.add_sequence(), b.add_sequence()
    assert torch.equal(a.step(sa, [tokens[:90], tokens[:5]]), b.step(sb, [tokens[:90], tokens[:5]]))


@pytest.mark.parametrize("cfg", [KIVI2, KiviConfig(key_grouping="per_token", residual_length=32, block_size=64),
                                 KiviConfig(residual_length=32, sink_tokens=4, k_rotation="hadamard",
                                            v_rotation="hadamard"),
                                 KiviConfig(k_bits=4, v_bits=2, residual_length=32, sink_tokens=45,
                                            k_rotation="hadamard", v_rotation="none")])
def test_cpu_backend_matches_reference(tmp_path_factory, cfg):
    """The native `cpu` backend (FORMAT_VERSION 3 fragment order, sinks; rotation is applied by the model, outside the
    op) in a real runner over chunked prefill and decode with flushes: stores bit-identical to the reference
    backend's, logits within the fp32 reassociation tolerance. One layer: in a deeper model a later layer's inputs
    differ by that reassociation, which can flip a code at a rounding boundary (a quantization step, not a bug)."""
    from trtllm_kivi import cpu as native

    if BACKENDS["cpu"].unavailable(cfg, torch.device("cpu"), torch.float32):
        pytest.skip(str(BACKENDS["cpu"].unavailable(cfg, torch.device("cpu"), torch.float32)))
    assert native.available()
    model, tok, _ = load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny64"), init=FAN_IN_INIT,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                     hidden_size=128, num_hidden_layers=1, bos_token_id=None,
                                                     eos_token_id=None))
    tokens = tok.encode("Whether 'tis nobler in the mind to suffer the slings and arrows " * 4,
                        add_special_tokens=False)[:200]
    a, b = runner(model, cfg, "reference"), runner(model, cfg, "cpu")
    assert b.attention_backend == "cpu"
    sa, sb = [a.add_sequence(), a.add_sequence()], [b.add_sequence(), b.add_sequence()]
    for s, e in [(0, 40), (40, 64), (64, 100), (100, 101), (101, 160), (160, 161)]:
        chunk = [tokens[s:e], tokens[::-1][s:e]]
        la, lb = a.step(sa, chunk, all_logits=True), b.step(sb, chunk, all_logits=True)
        assert float((la - lb).abs().max()) <= 1e-4 * max(1.0, float(la.abs().max())), (s, e)
        for x, y in zip(a.cache.layers[0], b.cache.layers[0], strict=True):
            assert torch.equal(x, y), (s, e)


def test_a_stale_memo_would_be_caught(tiny):
    """The bit-identity test can fail: a memo that is not dropped on free gives another sequence's history."""
    model, tokens = tiny
    a, b = runner(model, KIVI2, "reference", 1), runner(model, KIVI2, "memo", 1)
    outs = []
    for r in (a, b):
        s = r.add_sequence()
        r.step([s], [tokens[:120]])
        r.step([s], [tokens[120:121]])  # a decode step over a quantized history fills the memo
    b.cache.backend.free = lambda slot: None  # break it: keep the freed sequence's memo
    for r in (a, b):
        r.free_sequence(0)
        s = r.add_sequence()
        r.step([s], [tokens[::-1][:120]])
        outs.append(r.step([s], [tokens[:1]]))
    assert not torch.equal(outs[0], outs[1])


def test_backend_choice_and_errors():
    assert set(BACKENDS) >= {"reference", "memo", "cuda"}
    assert default_backend(KIVI2, "cpu", torch.float32) in ("memo", "cpu")  # the fastest available on the CPU
    assert KiviCache(KIVI2, GEOM, 1, 64, torch.float32).backend_name == default_backend(KIVI2, "cpu", torch.float32)
    assert resolve_backend("auto", KIVI2, "cpu", torch.float32) == default_backend(KIVI2, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"attention backend 'cuda' cannot serve this cache: the cuda backend "
                       r"needs a CUDA device; the cache is on cpu"):
        KiviCache(KIVI2, GEOM, 1, 64, torch.float32, backend="cuda")
    with pytest.raises(ValueError, match=r"attention backend 'fast' is not available; allowed: auto, reference, memo"):
        KiviCache(KIVI2, GEOM, 1, 64, torch.float32, backend="fast")
    assert KiviCache(KIVI2, GEOM, 1, 64, torch.float32, backend="memo").backend_name == "memo"
