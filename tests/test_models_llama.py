"""The compact Llama against Hugging Face transformers' LlamaForCausalLM (the oracle) on random small checkpoints
written with save_pretrained: MHA and GQA, head_dim 64 and 128, tied and untied embeddings, Llama-3 rope scaling,
single-file and sharded safetensors. Logits of a prefill, chunked prefill and token-by-token decoding over a
full-precision cache must match HF's logits of the whole sequence."""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models import LlamaModel, ModelConfig, config_from_hf, read_hf_folder, rope_inv_freq
from trtllm_kivi.runtime.torch_runner import TorchRunner

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # small original context so all three bands occur

CONFIGS = {
    "mha-d64-tied": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, hidden_size=128,
                         tie_word_embeddings=True),
    "gqa-d128-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, hidden_size=256,
                            tie_word_embeddings=False),
    "gqa-d64-llama3": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64, hidden_size=192,
                           tie_word_embeddings=False, rope_scaling=LLAMA3),
}


def hf_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, intermediate_size=160, num_hidden_layers=2, rope_theta=5000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=256, **CONFIGS[name])
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initializes norms to 1; random ones check that every norm weight is used
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, vocab]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(HF model, our fp32 model) from the same save_pretrained folder."""
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    # the llama3 config is written in shards to exercise model.safetensors.index.json
    hf.save_pretrained(folder, max_shard_size="100KB" if "llama3" in request.param else "1GB")
    assert (folder / "model.safetensors.index.json").exists() == ("llama3" in request.param)
    cfg, sd = read_hf_folder(folder)
    return hf, LlamaModel.from_hf_state_dict(cfg, sd, torch.float32)


def test_prefill_matches_transformers(checkpoint):
    hf, model = checkpoint
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = TorchRunner.create(model, "fp32", max_slots=1, max_seq_len=64)
    ours = runner.step([runner.add_sequence()], [tokens], all_logits=True)
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_chunked_and_decode_match_transformers(checkpoint):
    """Prefill 17 tokens, a chunk of 9, then 1 token per step, two sequences interleaved in one ragged batch."""
    hf, model = checkpoint
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (33, 30)]
    runner = TorchRunner.create(model, "fp32", max_slots=2, max_seq_len=64)
    slots = [runner.add_sequence(), runner.add_sequence()]
    got = [[], []]
    pieces = [(0, 17), (17, 26)] + [(t, t + 1) for t in range(26, 30)]
    for s, e in pieces:
        out = runner.step(slots, [seq[s:e] for seq in seqs], all_logits=True)
        got[0].append(out[: e - s])
        got[1].append(out[e - s:])
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), hf_logits(hf, seqs[b][:30]), atol=2e-5, rtol=1e-4)
    # last-token logits (the default) are the rows of all_logits at each chunk's end
    last = runner.step(slots, [[seqs[0][30]], seqs[1][29:30]])
    assert last.shape == (2, 97)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.15), (torch.float16, 0.02)])
def test_half_precision_close_to_fp32(checkpoint, dtype, tol):
    """bf16/fp16 weights and activations (KIVI window in the same dtype) stay near the fp32 logits."""
    hf, model32 = checkpoint
    sd = {k: v for k, v in hf.state_dict().items()}
    model = LlamaModel.from_hf_state_dict(model32.cfg, sd, dtype)
    assert model.dtype == dtype and model.embed.dtype == dtype
    tokens = list(range(3, 35))
    ref = TorchRunner.create(model32, "fp32", 1, 40)
    ref_logits = ref.step([ref.add_sequence()], [tokens], all_logits=True)
    for kv in ("fp32", "kivi8"):
        r = TorchRunner.create(model, kv, 1, 40)
        out = r.step([r.add_sequence()], [tokens], all_logits=True)
        assert out.dtype == torch.float32
        err = (out - ref_logits).abs().max() / ref_logits.abs().max()
        assert err < tol, f"{dtype} {kv}: relative error {err:.3g}"


def test_kivi_cache_without_flush_equals_full_cache(checkpoint):
    """Below R tokens the KIVI cache holds everything in the full-precision window: same logits as FullCache."""
    _, model = checkpoint
    tokens = list(range(40))
    outs = []
    for kv in ("fp32", "kivi2"):
        r = TorchRunner.create(model, kv, 1, 64)
        s = r.add_sequence()
        outs.append(torch.cat([r.step([s], [tokens[:20]], all_logits=True)] +
                              [r.step([s], [[t]]) for t in tokens[20:]]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_kivi_history_is_read_after_flush(checkpoint):
    """Past R + G tokens KIVI-8 attends to dequantized history: close to, but not identical with, fp32."""
    _, model = checkpoint
    tokens = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    spec_full = TorchRunner.create(model, "fp32", 1, 128)
    ref = spec_full.step([spec_full.add_sequence()], [tokens], all_logits=True)
    from trtllm_kivi.cache import KiviCache

    cache = KiviCache(KiviConfig(k_bits=8, v_bits=8, group_size=32, residual_length=32, block_size=32),
                      model.cfg.geometry, 1, 128, torch.float32)
    r = TorchRunner(model, cache)
    s = r.add_sequence()
    out = torch.cat([r.step([s], [tokens[:40]], all_logits=True)] + [r.step([s], [[t]]) for t in tokens[40:]])
    assert cache.cfg.num_quantized(r.seq_len(s)) == 64  # two groups flushed to 8-bit codes
    diff = (out - ref).abs().max()
    assert 0 < diff < 0.05 * ref.abs().max()


def test_rope_llama3_matches_transformers():
    """Oracle: transformers' rope init for rope_type llama3 (ROPE_INIT_FUNCTIONS)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_theta=5000.0,
                                      rope_scaling=LLAMA3)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(config_from_hf(hf_cfg.to_dict() | {"vocab_size": 10, "intermediate_size": 8,
                                                             "num_hidden_layers": 1}))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(ModelConfig(10, 128, 1, 2, 2, 64, 8, rope_theta=5000.0)))


def test_config_from_legacy_keys():
    """transformers 4.x config.json style: top-level rope_theta and rope_scaling."""
    conf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 128, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 6]}
    cfg = config_from_hf(conf)
    assert (cfg.rope_theta, cfg.head_dim, cfg.n_kv_heads, cfg.eos_token_ids) == (500000.0, 64, 2, (5, 6))
    base = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    torch.testing.assert_close(rope_inv_freq(cfg), base / 2.0)
