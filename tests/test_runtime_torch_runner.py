"""TorchRunner (runtime/base.py's Runner over the compact Llama and a KiviCache/FullCache) and the KV spec parser
(runtime/kvspec.py). Oracles: the same sequences run one at a time (ragged batching), the cache's own byte count
and format.py's layouts, KiviConfig's validation."""

from __future__ import annotations

import argparse

import pytest
import torch

from trtllm_kivi.cache import CacheCapacityError, FullCache, KiviCache
from trtllm_kivi.format import Geometry, KiviConfig, dense_bytes_per_token, kivi_total_bytes
from trtllm_kivi.models import LlamaModel, ModelConfig
from trtllm_kivi.runtime.base import Runner
from trtllm_kivi.commands.flags import add_kv, kv_spec, kv_specs
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.torch_runner import TorchRunner


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (0 if len(s) == 2 else 1)
          for n, s in LlamaModel.hf_weight_shapes(cfg).items()}
    return LlamaModel.from_hf_state_dict(cfg, sd)


@pytest.mark.parametrize("kv", ["fp32", "kivi4"])
def test_ragged_batch_equals_sequences_alone(model, kv):
    seqs = [list(range(1, 12)), [5, 6], list(range(30, 60))]
    alone = []
    for s in seqs:
        r = TorchRunner.create(model, kv, 1, 64)
        slot = r.add_sequence()
        alone.append(r.step([slot], [s], all_logits=True))
    r = TorchRunner.create(model, kv, 3, 64)
    slots = [r.add_sequence() for _ in seqs]
    out = r.step(slots, seqs, all_logits=True)
    torch.testing.assert_close(out, torch.cat(alone), atol=1e-4, rtol=1e-4)  # matmul shapes differ
    assert [r.seq_len(s) for s in slots] == [11, 2, 30]
    last = r.step(slots[::-1], [[1], [2, 3], [4]])  # any slot order; chunks of different lengths
    assert last.shape == (3, 64) and last.dtype == torch.float32


def test_runner_interface(model):
    r = TorchRunner.create(model, "kivi2", 2, 300)
    assert isinstance(r, Runner) and r.name == "torch"
    assert (r.vocab_size, r.max_slots, r.max_seq_len, r.free_slots) == (64, 2, 300, 2)
    assert r.kv_nbytes == r.cache.nbytes
    full = TorchRunner.create(model, "fp32", 2, 300)
    assert full.kv_nbytes == dense_bytes_per_token(model.cfg.geometry, 4) * 300 * 2  # 2 slots x 300 tokens
    # KIVI: format.py's honest total (whole blocks for n_q(300) = 160 tokens + the fp32 window) + block tables
    assert r.kv_nbytes == kivi_total_bytes(KiviConfig(), model.cfg.geometry, 300, batch=2, act_bytes=4) + 2 * 2 * 4
    a = r.add_sequence()
    r.step([a], [[1, 2, 3]])
    r.free_sequence(a)
    assert r.free_slots == 2


def test_step_errors_change_nothing(model):
    r = TorchRunner.create(model, "kivi2", 2, 16)
    a = r.add_sequence()
    r.step([a], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"token ids \[64\] out of range \[0, 64\)"):
        r.step([a], [[1, 64]])
    with pytest.raises(ValueError, match=r"needs >= 1 token"):
        r.step([a], [[]])
    with pytest.raises(ValueError, match=r"slots \(1\) and tokens \(2\)"):
        r.step([a], [[1], [2]])
    with pytest.raises(CacheCapacityError, match=r"3 \+ 14 tokens exceeds the cache capacity max_seq_len=16"):
        r.step([a], [list(range(14))])
    with pytest.raises(ValueError, match="slot 1 is not an active sequence slot"):
        r.step([1], [[1]])
    assert r.seq_len(a) == 3
    ref = TorchRunner.create(model, "kivi2", 1, 16)
    b = ref.add_sequence()
    ref.step([b], [[1, 2, 3]])
    torch.testing.assert_close(r.step([a], [[4]]), ref.step([b], [[4]]), atol=0, rtol=0)


def test_construction_errors(model):
    geom = model.cfg.geometry
    other = Geometry(geom.num_layers, geom.num_heads, 1, geom.head_dim)
    with pytest.raises(ValueError, match="does not match the model"):
        TorchRunner(model, FullCache(other, 1, 8, torch.float32))
    with pytest.raises(ValueError, match="KIVI cache window dtype torch.float16 must equal the model dtype"):
        TorchRunner(model, KiviCache(KiviConfig(), geom, 1, 8, torch.float16))
    # an unquantized cache may store K/V in a narrower dtype than the model computes in
    r = TorchRunner(model, FullCache(geom, 1, 8, torch.float16))
    assert r.step([r.add_sequence()], [[1, 2]]).dtype == torch.float32


# ---------------------------------------------------------------------------------------------- KV specs


@pytest.mark.parametrize("name,k,v,grouping", [("kivi2", 2, 2, "per_channel"), ("KIVI4", 4, 4, "per_channel"),
                                                ("kivi8", 8, 8, "per_channel"), ("k4v2", 4, 2, "per_channel"),
                                                ("k2v8", 2, 8, "per_channel"), ("naive2", 2, 2, "per_token"),
                                                ("naive4", 4, 4, "per_token")])
def test_parse_kivi_specs(name, k, v, grouping):
    spec = parse_kv(name)
    assert spec.quantized and (spec.kivi.k_bits, spec.kivi.v_bits, spec.kivi.key_grouping) == (k, v, grouping)
    assert spec.kivi.group_size == 32 and spec.kivi.residual_length == 128


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_parse_full_specs(name, dtype, model):
    spec = parse_kv(name, k_bits=4)  # KIVI knobs do not apply to unquantized caches
    assert not spec.quantized and spec.full_dtype == dtype
    cache = spec.make_cache(model.cfg.geometry, 2, 10, torch.float32)
    assert isinstance(cache, FullCache) and cache.k[0].dtype == dtype


def test_knobs_and_errors(model):
    spec = parse_kv("kivi2", k_bits=4, group_size=64, residual_length=64, block_size=256, scale_dtype="float32")
    assert spec.kivi == KiviConfig(k_bits=4, v_bits=2, group_size=64, residual_length=64, block_size=256,
                                   scale_dtype="float32")
    cache = spec.make_cache(model.cfg.geometry, 1, 512, torch.bfloat16)
    assert isinstance(cache, KiviCache) and cache.layers[0].k_window.dtype == torch.bfloat16
    assert "K 4-bit per-channel" in spec.describe() and "G=64" in spec.describe()
    with pytest.raises(ValueError, match=r"--kv 'int4' is not a KV cache spec"):
        parse_kv("int4")
    with pytest.raises(ValueError, match=r"k_bits=3 is not supported; allowed: 2, 4, 8"):
        parse_kv("kivi3")
    with pytest.raises(ValueError, match=r"block_size=48 must be a positive multiple of group_size=32"):
        parse_kv("kivi2", block_size=48)


def test_cli_arguments():
    p = argparse.ArgumentParser()
    add_kv(p)
    args = p.parse_args(["--kv", "k4v2", "--group-size", "64", "--residual-length", "32"])
    spec = kv_spec(args)
    assert (spec.kivi.k_bits, spec.kivi.v_bits, spec.kivi.group_size, spec.kivi.residual_length) == (4, 2, 64, 32)
    assert kv_spec(p.parse_args([])).name == "kivi2"
    assert kv_specs(args, kv="naive8")[0].kivi.key_grouping == "per_token"


def test_kv_flags_that_contradict_a_build_folder_are_refused():
    """A build folder's KV config is the one source: flags the user gave must agree, and are named when not."""
    p = argparse.ArgumentParser()
    add_kv(p)
    built = KiviConfig(k_bits=4, v_bits=2)
    assert kv_spec(p.parse_args([]), built).kivi == built  # nothing given: the folder's config
    assert kv_spec(p.parse_args(["--kv", "k4v2", "--group-size", "32"]), built).name == "k4v2"
    with pytest.raises(ValueError, match=r"--group-size 64 contradicts the build folder \(group_size=32\); a build "
                       r"folder runs the cache it was built for"):
        kv_spec(p.parse_args(["--group-size", "64"]), built)
    with pytest.raises(ValueError, match=r"--kv 'kivi2' \(kivi2 \(K 2-bit .*\)\) contradicts the build folder "
                       r"\(kv 'k4v2': k4v2 \(K 4-bit"):
        kv_spec(p.parse_args(["--kv", "kivi2"]), built)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("kv", ["fp32", "kivi2"])
def test_cuda_matches_cpu(model, kv):
    """The same model and cache on CUDA (torch ops of the reference) give the CPU logits (oracle: the CPU run)."""
    sd = {}
    for i, b in enumerate(model.layers):  # rebuild HF-named weights from the fused CPU model
        p = f"model.layers.{i}."
        d, h, hkv = model.cfg.head_dim, model.cfg.n_heads, model.cfg.n_kv_heads
        q, k, v = b.attn.wqkv.split([h * d, hkv * d, hkv * d])
        gate, up = b.mlp.w13.chunk(2)
        sd |= {p + "input_layernorm.weight": b.attn_norm.weight, p + "post_attention_layernorm.weight":
               b.mlp_norm.weight, p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
               p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": b.attn.wo,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": b.mlp.w2}
    sd |= {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head}
    gpu = LlamaModel.from_hf_state_dict(model.cfg, sd, torch.float32, "cuda")
    tokens = [list(range(1, 40)), [3, 4, 5]]
    outs = []
    for m in (model, gpu):
        r = TorchRunner.create(m, kv, 2, 64, backend="reference")
        slots = [r.add_sequence(), r.add_sequence()]
        outs.append(torch.cat([r.step(slots, tokens, all_logits=True), r.step(slots, [[7], [8]])]).cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=1e-3)
