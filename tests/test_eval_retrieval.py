"""Long-context retrieval (eval/retrieval.py) on a tiny random Qwen2 (GQA, q/k/v biases) and the byte-level tokenizer
of the tiny checkpoint: prompts share their prefixes exactly, one prefill reused from a shared stream equals a fresh
prefill, a loaded state equals the streamed one bit for bit, and decoding several configurations as one batch
equals decoding each alone."""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.cache import FullCache, KiviCache
from trtllm_kivi.eval import retrieval
from trtllm_kivi.eval.retrieval import Cell, PrefixPrefill, load_state
from trtllm_kivi.models import Tokenizer, load_model
from trtllm_kivi.models.tiny import TINY_QWEN2_CONFIG, WIDE_INIT, write_tiny_qwen2_checkpoint
from trtllm_kivi.runtime.kvspec import parse_kv
from trtllm_kivi.runtime.torch_runner import TorchRunner

# head_dim 64 so the native CPU kernels (64 / 128) can serve it too; 6 query heads on 2 KV heads (GQA 3:1).
OVER = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64, hidden_size=384, num_hidden_layers=2,
            max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
assert TINY_QWEN2_CONFIG["model_type"] == "qwen2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_qwen2_checkpoint(tmp_path_factory.mktemp("q"), init=WIDE_INIT, **OVER)
    model, tok, _ = load_model(folder)
    return model, (lambda s: tok.encode(s, add_special_tokens=False)), Tokenizer.from_hf_folder(folder)


def test_passkey_cells_share_one_stream(tiny):
    _, enc, _ = tiny
    cells, streams = retrieval.passkey_cells(enc, [600, 1200], [0.1, 0.5, 0.9], [1, 2])
    assert len(cells) == 12 and list(streams) == ["passkey"]
    s = streams["passkey"]
    for c in cells:
        assert c.prompt[:c.shared] == s[:c.shared]
        assert enc(f"The pass key is {c.target}.") == c.prompt[c.shared:c.shared + len(enc(f"The pass key is "
                                                                                              f"{c.target}."))]
        assert c.answer == enc(f" {c.target}")
    keys = {(c.length, c.depth): c.target for c in cells if c.seed == 1}
    assert keys != {(c.length, c.depth): c.target for c in cells if c.seed == 2}  # the held-out seed: new keys


def test_kv_cells_hold_many_pairs_and_ask_the_right_one(tiny):
    _, enc, tok = tiny
    cells, streams = retrieval.kv_cells(enc, [3000, 6000], [0.0, 0.5, 1.0], [1])
    s = streams["kv1"]
    short = [c for c in cells if c.length == 3000]
    long = [c for c in cells if c.length == 6000]
    assert short[0].shared < long[0].shared and all(c.prompt[:c.shared] == s[:c.shared] for c in cells)
    for c in cells:
        assert len(c.prompt) + len(c.answer) <= c.length
        text = tok.decode(c.prompt)
        pairs = text.count('": "')
        asked = text.rsplit('Key: "', 1)[1].split('"')[0]
        order = [line.split('"')[1] for line in text.split("{\n", 1)[1].split("}\n", 1)[0].splitlines()]
        assert order.index(asked) == round(c.depth * (pairs - 1))  # depth 0: first pair, 1: last
        assert f'"{asked}": "{c.target}"' in text and tok.decode(c.answer) == c.target
        assert text.endswith('is: "')  # the answer scored is the value, not the spelling of its opening quote
    assert text.count('": "') > 10


def _cell(enc) -> Cell:
    cells, streams = retrieval.passkey_cells(enc, [900], [0.5], [3])
    return cells[0], streams["passkey"]


def test_prefill_from_the_stream_equals_a_fresh_prefill(tiny):
    model, enc, _ = tiny
    cell, stream = _cell(enc)
    pre = PrefixPrefill(model, 1024, chunk=128)
    pre.extend_stream("passkey", stream, len(stream))  # the stream runs past the cell's needle first
    got = [(k.clone(), v.clone()) for k, v in pre.kv(cell, stream)]
    fresh = TorchRunner(model, FullCache(model.cfg.geometry, 1, 1024, torch.float32))
    fresh.step([fresh.add_sequence()], [cell.prompt[:-1]])
    for layer, (k, v) in enumerate(got):
        want_k, want_v = fresh.cache.dequantized(0, layer)
        assert k.shape == want_k.shape == (2, len(cell.prompt) - 1, 64)
        torch.testing.assert_close(k, want_k, atol=2e-4, rtol=1e-4)  # chunk shapes differ: matmul rounding
        torch.testing.assert_close(v, want_v, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", ["kivi2", "k4v2+sink4+had:k@1/2", "kivi2+sink4+had"])
def test_a_loaded_state_is_the_streamed_state(tiny, kv):
    model, _, _ = tiny
    spec = parse_kv(kv, num_layers=2)
    g = torch.Generator().manual_seed(1)
    kvs = [(torch.randn(2, 700, 64, generator=g), torch.randn(2, 700, 64, generator=g)) for _ in range(2)]
    loaded = spec.make_cache(model.cfg.geometry, 1, 800, torch.float32, backend="memo")
    load_state(loaded, loaded.add_sequence(), kvs)
    streamed = spec.make_cache(model.cfg.geometry, 1, 800, torch.float32, backend="memo")
    slot = streamed.add_sequence()
    for s, e in [(0, 5), (5, 161), (161, 700)]:  # chunks across flush points, appended through the op
        step = streamed.begin_step([slot], [e - s])
        for layer, (k, v) in enumerate(kvs):
            kr, vr = streamed.rotations(layer)
            q = torch.zeros(e - s, 6, 64)
            streamed.attention(layer, q, retrieval.rotate(k[:, s:e].transpose(0, 1), kr).contiguous(),
                               retrieval.rotate(v[:, s:e].transpose(0, 1), vr).contiguous(), step)
        streamed.end_step(step)
    assert isinstance(loaded, KiviCache)
    for layer in range(2):
        a, b = loaded.sequence_state(0, layer), streamed.sequence_state(0, layer)
        assert all(torch.equal(a[n], b[n]) for n in a), layer


@pytest.mark.parametrize("backend", ["memo", "cpu"])
def test_configurations_decoded_as_one_batch_equal_each_alone(tiny, backend):
    model, enc, _ = tiny
    if backend == "cpu":
        from trtllm_kivi.cpu import unavailable_reason

        if unavailable_reason(True):
            pytest.skip(f"native CPU kernels: {unavailable_reason(True)}")
    cell, stream = _cell(enc)
    specs = {n: parse_kv(n, num_layers=2) for n in ("fp32", "kivi2", "k4v2+sink4+had:k@1/2", "kivi2+had")}
    kv = PrefixPrefill(model, 1024).kv(cell, stream)
    together = retrieval.serving_scores(model, specs, kv, cell, backend=backend)
    for name, spec in specs.items():
        alone = retrieval.serving_scores(model, {name: spec}, kv, cell, backend=backend)[name]
        assert together[name]["ranks"] == alone["ranks"]
        assert together[name]["logprobs"] == pytest.approx(alone["logprobs"], rel=1e-4, abs=2e-4)  # batch shapes
    # the answer scores of the unquantized cache are those of one forward over prompt + answer
    r = TorchRunner(model, FullCache(model.cfg.geometry, 1, 1024, torch.float32))
    logits = r.step([r.add_sequence()], [cell.prompt + cell.answer], all_logits=True)
    rows = logits[len(cell.prompt) - 1:len(cell.prompt) - 1 + len(cell.answer)]
    assert together["fp32"]["ranks"] == retrieval.token_rank(rows, torch.tensor(cell.answer)).tolist()


def test_decode_mode_matches_serving_mode_without_quantization(tiny):
    model, enc, _ = tiny
    cell, stream = _cell(enc)
    spec = parse_kv("fp32")
    served = retrieval.serving_scores(model, {"fp32": spec}, PrefixPrefill(model, 1024).kv(cell, stream), cell)
    decoded = retrieval.decode_scores(model, spec, cell, chunk=200)
    assert decoded["ranks"] == served["fp32"]["ranks"]
    assert decoded["logprobs"] == pytest.approx(served["fp32"]["logprobs"], abs=2e-4)


def test_summary_counts_and_names_failures():
    rows = [{"passed": True, "ranks": [0, 0], "answer_logprob": -0.5, "length": 4096, "depth": 0.1, "seed": 1},
            {"passed": False, "ranks": [0, 3], "answer_logprob": -4.0, "length": 8192, "depth": 0.9, "seed": 2}]
    s = retrieval.summarize_cells(rows)
    assert (s["passed"], s["cells"], s["pass_rate"]) == (1, 2, 0.5)
    assert s["failed"] == ["8192/0.9/2: 1: 3"]


def test_a_saved_stream_resumes_bit_for_bit(tiny, tmp_path):
    model, enc, _ = tiny
    cell, stream = _cell(enc)
    a = PrefixPrefill(model, 1024, chunk=128)
    a.extend_stream("passkey", stream, cell.shared)
    a.save_stream(tmp_path / "s.pt")
    b = PrefixPrefill(model, 1024, chunk=128)
    assert not b.load_stream(tmp_path / "s.pt", "kv1")  # another stream's file is not used
    assert b.load_stream(tmp_path / "s.pt", "passkey") and b.prefilled == cell.shared
    for (ka, va), (kb, vb) in zip(a.kv(cell, stream), b.kv(cell, stream), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert b.tokens_computed == len(cell.prompt) - 1 - cell.shared  # only the cell's own tokens were computed
