"""The CPU check of an exported graph (builder/check.py): onnxruntime with the reference KiviAttention op against
the torch runtime (TorchRunner over a KiviCache), over a ragged prefill plus 64 decode steps.

Oracle: the torch runtime; the check must pass on a correct graph and fail on a corrupted one."""

import numpy as np
import pytest
import torch
from onnx import numpy_helper

from trtllm_kivi.builder.check import LOGIT_ATOL, check_graph
from trtllm_kivi.builder.onnx_export import export_llama, graph_info
from trtllm_kivi.op import ExportSpec
from trtllm_kivi.models.tiny import tiny_model
from trtllm_kivi.format import KiviConfig

CFG = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=2)[0]


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (77, 30)]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_graph_matches_the_torch_runtime_over_prefill_and_64_decode_steps(tiny, dtype):
    spec = ExportSpec(dtype, max_batch_size=2, max_seq_len=256, max_num_tokens=256)
    res = check_graph(tiny, export_llama(tiny, CFG, spec), graph_info(tiny, CFG, spec), _prompts(), decode_steps=64)
    assert res.decode_steps == 64 and res.prefill_tokens == [77, 30]
    assert res.passed, res.to_dict()
    # Both sequences crossed flush points (prefill 77 > R + G = 64; the short one flushes while decoding).
    assert res.quantized_tokens == [CFG.num_quantized(77 + 64), CFG.num_quantized(30 + 64)] == [96, 32]
    assert res.max_logit_diff < 1e-4  # fp32 in both runtimes: only summation order differs
    assert res.code_words_differing == 0 and res.scale_zero_rel_diff == 0.0
    assert res.greedy_agreement == 1.0


def test_check_fails_on_a_corrupted_graph(tiny):
    """A graph whose attention output projection is off by 1% in one layer must not pass."""
    spec = ExportSpec("float32", 2, 256, 256)
    graph = export_llama(tiny, CFG, spec)
    init = next(i for i in graph.graph.initializer if i.name == "layers.1.attn.wo.weight")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.01), init.name))
    res = check_graph(tiny, graph, graph_info(tiny, CFG, spec), _prompts(1), decode_steps=4)
    assert not res.passed and res.max_logit_diff > LOGIT_ATOL / 10


def test_a_rounding_boundary_flip_is_counted_once_and_does_not_propagate(tiny, monkeypatch):
    """A code word that differs after one step (as where a value sits on a rounding boundary and the runtimes' fp32
    roundings differ) is counted, then replaced by the torch runtime's: the later steps' logits stay as close as
    without it (fp32 in both runtimes)."""
    from trtllm_kivi.runtime.ort_runner import OrtRunner

    step, calls = OrtRunner.step, []

    def flipping_step(self, slots, tokens, all_logits=False):
        out = step(self, slots, tokens, all_logits)
        calls.append(1)
        if len(calls) == 2:  # after the first decode step: flip the lowest code of slot 0's first block, layer 0
            blk = self.cache._blocks[slots[0]][0]
            self.cache.layers[0].k_codes[blk].view(-1)[0] ^= 1
        return out

    monkeypatch.setattr(OrtRunner, "step", flipping_step)
    spec = ExportSpec("float32", max_batch_size=2, max_seq_len=256, max_num_tokens=256)
    res = check_graph(tiny, export_llama(tiny, CFG, spec), graph_info(tiny, CFG, spec), _prompts(), decode_steps=8)
    assert res.code_words_differing == 1
    assert res.passed and res.max_logit_diff < 1e-4, res.to_dict()


def test_check_refuses_prompts_past_the_graphs_maxima(tiny):
    spec = ExportSpec("float32", 1, 100, 100)
    graph, info = export_llama(tiny, CFG, spec), graph_info(tiny, CFG, spec)
    with pytest.raises(ValueError, match=r"2 check prompts but the graph has max_batch_size=1"):
        check_graph(tiny, graph, info, _prompts(), decode_steps=4)
    with pytest.raises(ValueError, match=r"check needs 141 tokens per sequence; the graph has max_seq_len=100"):
        check_graph(tiny, graph, info, _prompts()[:1], decode_steps=64)


@pytest.mark.slow
def test_real_model_graph_matches_the_torch_runtime():
    """SmolLM2-135M-Instruct (the built-in GGUF, Q4_1 weights dequantized) exported in fp16: a ragged prefill of
    real text and 16 decode steps; R = 32 so both sequences flush groups within the check."""
    from trtllm_kivi.builder.build import CHECK_TEXT
    from trtllm_kivi.models import load_model

    model, tok, _ = load_model("smollm2-135m", "float32")
    cfg = KiviConfig(residual_length=32)
    spec = ExportSpec("float16", max_batch_size=2, max_seq_len=256, max_num_tokens=256)
    ids = tok.encode(CHECK_TEXT, add_special_tokens=False)
    res = check_graph(model, export_llama(model, cfg, spec), graph_info(model, cfg, spec), [ids[:74], ids[10:70]],
                      decode_steps=16)
    assert res.passed, res.to_dict()
    # 74 tokens flush a group during the prefill, 60 + 16 cross R + G = 64 while decoding.
    assert res.quantized_tokens == [cfg.num_quantized(90), cfg.num_quantized(76)] == [32, 32]
    assert res.greedy_agreement == 1.0
