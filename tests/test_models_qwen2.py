"""Qwen2-family checkpoints (a Llama with q/k/v biases, large rope theta, tied or untied embeddings) against
Hugging Face transformers' Qwen2ForCausalLM (the oracle) on random small checkpoints: a save_pretrained folder and a
GGUF file written with the real `gguf` writer (models/tiny.write_gguf: Q8_0 matrices, F32 biases and norms), GQA 7:1
with head_dim 64 and 128. Logits of a prefill, a chunked prefill and token-by-token decoding over a full-precision
cache must match HF's within the Llama tests' tolerance (atol 2e-5, rtol 1e-4). The tiny writers of models/tiny.py
produce checkpoints transformers itself loads. Unsupported configs (sliding window, other activations, rope types)
and malformed checkpoints fail with a ValueError naming the field or tensor."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_kivi.models import LlamaModel, Tokenizer, load_model, read_gguf, read_hf_folder
from trtllm_kivi.models.tiny import (TINY_QWEN2_CONFIG, gguf_roundtrip, tiny_config, tiny_state_dict,
                                     write_byte_tokenizer, write_gguf, write_tiny_gguf, write_tiny_qwen2_checkpoint)
from trtllm_kivi.runtime.torch_runner import TorchRunner

transformers = pytest.importorskip("transformers")

VOCAB = 256  # the byte-level vocabulary write_gguf stores
CONFIGS = {  # GQA 7:1 both: Qwen2.5-0.5B's 14 / 2 heads of 64, and 7 / 1 heads of 128 (as Qwen2.5-7B's 28 / 4)
    "gqa7-d64-tied": dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, tie_word_embeddings=True),
    "gqa7-d128-untied": dict(num_attention_heads=7, num_key_value_heads=1, hidden_size=896,
                             tie_word_embeddings=False),
}
TOL = dict(atol=2e-5, rtol=1e-4)  # as tests/test_models_llama.py


def hf_qwen2(name: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=2,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
                                   use_sliding_window=False, **CONFIGS[name])
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: random ones check that every one is used
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0, 0.5)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, vocab]


@pytest.fixture(scope="module", params=list(CONFIGS))
def qwen(request, tmp_path_factory):
    """(HF model, our fp32 model from its save_pretrained folder, the folder)."""
    hf = hf_qwen2(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    cfg, sd = read_hf_folder(folder)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6 and cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert cfg.n_heads // cfg.n_kv_heads == 7 and cfg.head_dim == 896 // cfg.n_heads
    return hf, LlamaModel.from_hf_state_dict(cfg, sd, torch.float32), folder


def test_prefill_matches_transformers(qwen):
    hf, model, _ = qwen
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = TorchRunner.create(model, "fp32", max_slots=1, max_seq_len=64)
    ours = runner.step([runner.add_sequence()], [tokens], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(hf, tokens), **TOL)


def test_chunked_and_decode_match_transformers(qwen):
    """Prefill 17 tokens, a chunk of 9, then 1 token per step, two sequences interleaved in one ragged batch."""
    hf, model, _ = qwen
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (33, 30)]
    runner = TorchRunner.create(model, "fp32", max_slots=2, max_seq_len=64)
    slots = [runner.add_sequence(), runner.add_sequence()]
    got = [[], []]
    for s, e in [(0, 17), (17, 26)] + [(t, t + 1) for t in range(26, 30)]:
        out = runner.step(slots, [seq[s:e] for seq in seqs], all_logits=True)
        got[0].append(out[: e - s])
        got[1].append(out[e - s:])
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), hf_logits(hf, seqs[b][:30]), **TOL)


def test_biases_matter(qwen):
    """The q/k/v biases are applied: zeroing them in our model moves the logits far beyond the tolerance."""
    hf, model, _ = qwen
    tokens = list(range(5, 45))
    sd = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in hf.state_dict().items()}
    unbiased = LlamaModel.from_hf_state_dict(model.cfg, sd)
    r = TorchRunner.create(unbiased, "fp32", 1, 64)
    diff = (r.step([r.add_sequence()], [tokens], all_logits=True) - hf_logits(hf, tokens)).abs().max()
    assert diff > 1e-2


def test_gguf_matches_transformers(qwen, tmp_path):
    """general.architecture qwen2, blk.N.attn_{q,k,v}.bias tensors, no Q/K row permutation (llama.cpp runs Qwen2
    with half-split RoPE). Oracle: HF with the Q8_0 round-tripped matrices the file holds."""
    hf, _, _ = qwen
    path = write_gguf(tmp_path / "q.gguf", hf.config.to_dict(), hf.state_dict())
    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        for _, p in oracle.named_parameters():
            if p.dim() == 2:
                p.copy_(gguf_roundtrip(p.detach()))
    model, tok, cfg = load_model(path)
    assert (cfg.qkv_bias, cfg.rope_theta, cfg.tie_embeddings) == (True, 1e6, hf.config.tie_word_embeddings)
    assert (cfg.n_heads, cfg.n_kv_heads) == (hf.config.num_attention_heads, hf.config.num_key_value_heads)
    tokens = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = TorchRunner.create(model, "fp32", 1, 32)
    ours = runner.step([runner.add_sequence()], [tokens], all_logits=True)
    torch.testing.assert_close(ours, hf_logits(oracle, tokens), **TOL)
    write_byte_tokenizer(tmp_path)  # the folder checkpoints' tokenizer: the same ids
    text = "Qwen2 hi 42\n  x"
    assert tok.encode(text) == Tokenizer.from_hf_folder(tmp_path).encode(text) and len(tok.encode(text)) == len(text)


# ------------------------------------------------------------------------------------------------ tiny writers


def test_tiny_qwen2_folder_loads_in_transformers(tmp_path):
    """models.tiny.write_tiny_qwen2_checkpoint writes a folder transformers' AutoModelForCausalLM loads as
    Qwen2ForCausalLM with the same logits as ours."""
    folder = write_tiny_qwen2_checkpoint(tmp_path / "tq", seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    model, tok, cfg = load_model(folder)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.qkv_bias) == (7, 1, True)
    tokens = tok.encode("Qwen2 in a tiny checkpoint")
    r = TorchRunner.create(model, "fp32", 1, 64)
    torch.testing.assert_close(r.step([r.add_sequence()], [tokens], all_logits=True), hf_logits(hf, tokens), **TOL)


def test_tiny_qwen2_gguf_loads_in_transformers(tmp_path):
    """models.tiny.write_tiny_gguf's file holds the tiny config and (Q8_0 round-tripped) weights: read_gguf gives
    them back, and transformers' own GGUF loader (from_pretrained(gguf_file=...)) reads the same model."""
    path = write_tiny_gguf(tmp_path / "tq.gguf", seed=5)
    conf = tiny_config(TINY_QWEN2_CONFIG)
    cfg, sd = read_gguf(path)
    want = tiny_state_dict(conf, seed=5)
    assert cfg.qkv_bias and set(sd) == set(want)
    for n, w in want.items():
        torch.testing.assert_close(sd[n], gguf_roundtrip(w) if w.dim() == 2 else w, rtol=0, atol=0, msg=n)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tq.gguf",
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    model, _, _ = load_model(path)
    tokens = list(range(10, 50))
    r = TorchRunner.create(model, "fp32", 1, 64)
    torch.testing.assert_close(r.step([r.add_sequence()], [tokens], all_logits=True), hf_logits(hf, tokens),
                               **TOL)


# ------------------------------------------------------------------------------------------------ refusals


def _edit_config(folder, **changes):
    conf = json.loads((folder / "config.json").read_text())
    conf.update(changes)
    (folder / "config.json").write_text(json.dumps(conf))


@pytest.mark.parametrize("changes,match", [
    (dict(use_sliding_window=True, sliding_window=64), r"use_sliding_window=True is not supported \(sliding-window"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer_types\[1\]='sliding_attention' is not supported; allowed: 'full_attention'"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported; allowed: 'silu'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), r"rope_scaling type 'yarn'"),
    (dict(num_key_value_heads=3), r"n_heads=7 must be a multiple of n_kv_heads=3"),
])
def test_unsupported_qwen2_config(tmp_path, changes, match):
    folder = write_tiny_qwen2_checkpoint(tmp_path / "tq")
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        read_hf_folder(folder)


def test_sliding_window_field_alone_is_accepted(tmp_path):
    """Qwen2.5's config.json carries sliding_window with use_sliding_window false: full attention, accepted."""
    folder = write_tiny_qwen2_checkpoint(tmp_path / "tq")
    _edit_config(folder, sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    assert read_hf_folder(folder)[0].qkv_bias


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.1.self_attn.k_proj.bias"), r"missing 1 tensor.*layers\.1\.self_attn\.k_proj\.bias"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(5)),
     r"q_proj\.bias has shape \(5,\), expected \(224,\)"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.bias", torch.zeros(112)),
     r"unsupported tensor.*o_proj\.bias"),
])
def test_malformed_qwen2_tensors(tmp_path, edit, match):
    folder = write_tiny_qwen2_checkpoint(tmp_path / "tq")
    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        LlamaModel.from_hf_state_dict(*read_hf_folder(folder))


def test_llama_with_biases_is_refused(tmp_path):
    """A Llama config.json keeps refusing attention_bias (it would also bias o_proj, which we do not model)."""
    from trtllm_kivi.models.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "tl")
    _edit_config(folder, attention_bias=True)
    with pytest.raises(ValueError, match=r"attention_bias=True is not supported"):
        read_hf_folder(folder)


def test_gguf_refusals(tmp_path):
    conf = tiny_config(TINY_QWEN2_CONFIG)
    sd = tiny_state_dict(conf)
    path = write_gguf(tmp_path / "sw.gguf", conf, sd, extra_keys={"qwen2.attention.sliding_window": 64})
    with pytest.raises(ValueError, match=r"qwen2\.attention\.sliding_window=64 < qwen2\.context_length is not "
                                         r"supported \(sliding-window attention\)"):
        read_gguf(path)
    path = write_gguf(tmp_path / "full.gguf", conf, sd, extra_keys={"qwen2.attention.sliding_window": 1024})
    assert read_gguf(path)[0].qkv_bias  # a window as long as the context is full attention
    path = write_gguf(tmp_path / "nob.gguf", conf, sd, drop=("blk.0.attn_v.bias",))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.self_attn\.v_proj\.bias"):
        load_model(path)
    path = write_gguf(tmp_path / "nokey.gguf", conf, sd, skip_keys=("head_count",))
    with pytest.raises(ValueError, match=r"missing the metadata key 'qwen2\.attention\.head_count'"):
        read_gguf(path)
