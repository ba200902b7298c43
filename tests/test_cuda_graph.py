"""runtime/cuda_graph.py: decode steps whose device tensors are static (CUDA-graph capturable) compute what
TorchRunner.step computes. Oracles: the same model and cache driven by TorchRunner.step, token by token, on the same
sequences (ragged lengths, a flush point crossed while decoding).

On the CPU the step body runs eagerly (capture=False): it checks the decode forward (RoPE rows gathered on the device,
the model's layers), the static tensors' loading, the FP16 attention with device lengths and the greedy feedback.
On a GPU (marked gpu) the captured graphs replay against the eager runner: KIVI through the cuda backend, FP16 through
both graph-safe attention methods.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_kivi.models import LlamaModel, ModelConfig
from trtllm_kivi.runtime.cuda_graph import FP16_METHODS, GraphDecoder
from trtllm_kivi.runtime.torch_runner import TorchRunner


def make_model(head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaModel:
    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=head_dim, ffn_dim=192)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (0 if len(s) == 2 else 1)
          for n, s in LlamaModel.hf_weight_shapes(cfg).items()}
    return LlamaModel.from_hf_state_dict(cfg, sd, dtype, device)


def decode_both(model: LlamaModel, kv: str, steps: int, capture: bool, fp16_method: str = "sdpa_masked",
                backend: str | None = None, feedback: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two runners over the same prompts (lengths 150 and 40: the first flushes at 160 while decoding); one decodes
    with TorchRunner.step, the other with a GraphDecoder (an FP16 cache's unwritten rows full of garbage); each
    step's logits of both. feedback: the decoder feeds itself its greedy tokens (else it gets the runner's, so that
    a near tie decided differently on another plan cannot fork the sequences)."""
    kwargs = {"backend": backend} if backend and kv.startswith("kivi") else {}
    prompts = [[(7 * i) % 64 for i in range(150)], [(3 * i + 1) % 64 for i in range(40)]]
    a, b = (TorchRunner.create(model, kv, 2, 256, **kwargs) for _ in range(2))
    if kv.startswith("fp"):  # rows no token has reached hold garbage: attending to one more row must show
        g = torch.Generator(device=model.device).manual_seed(1)
        for t in b.cache.k + b.cache.v:
            t.copy_(10 * torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32))
    slots = [a.add_sequence() for _ in prompts]
    assert [b.add_sequence() for _ in prompts] == slots == [0, 1]
    first = a.step(slots, prompts)
    b.step(slots, prompts)
    dec = GraphDecoder(b, fp16_method=fp16_method, capture=capture)
    tokens = first.argmax(-1).tolist()
    got, want = [], []
    for i in range(steps):
        want.append(a.step(slots, [[t] for t in tokens]).clone())
        got.append(dec.step(slots, tokens if i == 0 or not feedback else None).clone())
        tokens = want[-1].argmax(-1).tolist()
    assert [a.seq_len(s) for s in slots] == [b.seq_len(s) for s in slots] == [150 + steps, 40 + steps]
    return got, want


@pytest.mark.parametrize("kv,backend", [("kivi2", "memo"), ("kivi4", "reference"), ("fp32", None)])
def test_eager_decode_body_matches_the_runner(kv, backend, one_torch_thread):
    model = make_model(32)
    got, want = decode_both(model, kv, 14, capture=False, backend=backend)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"decode step {i}: {m}")


def test_decoder_refusals_name_the_problem():
    model = make_model(32)
    with pytest.raises(ValueError, match="CUDA-graph decode needs the cuda attention backend; the cache uses 'memo'"):
        GraphDecoder(TorchRunner.create(model, "kivi2", 2, 64, backend="memo"))
    with pytest.raises(ValueError, match="CUDA-graph capture needs a CUDA device; the cache is on cpu"):
        GraphDecoder(TorchRunner.create(model, "fp32", 2, 64))
    with pytest.raises(ValueError, match=r"method 'flash' is not supported; allowed: flash_varlen, sdpa_masked"):
        GraphDecoder(TorchRunner.create(model, "fp32", 2, 64), fp16_method="flash", capture=False)
    r = TorchRunner.create(model, "fp32", 3, 64)
    slots = [r.add_sequence() for _ in range(3)]
    dec = GraphDecoder(r, fp16_method="sdpa_masked", capture=False)
    with pytest.raises(ValueError, match="the first step of a batch size needs explicit tokens"):
        dec.step(slots[:2])
    with pytest.raises(ValueError, match=r"slots \[1, 2\] must be exactly those"):
        dec.step(slots[1:], [1, 2])
    with pytest.raises(ValueError, match="3 tokens for 2 slots"):
        dec.step(slots[:2], [1, 2, 3])
    assert [r.seq_len(s) for s in slots] == [0, 0, 0]  # refused steps change nothing


def _gpu_ready(kv: str) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    if kv.startswith("kivi"):
        from trtllm_kivi.cuda import find_library

        if find_library() is None:
            return "the KIVI kernel library is not built (build_scripts/build_plugin.sh)"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("kv,method", [("kivi2", "sdpa_masked"), *(("fp16", m) for m in FP16_METHODS)])
def test_captured_decode_matches_the_eager_runner(kv, method):
    """Graph replays (one capture per batch size, 40 steps across a flush) against TorchRunner.step on the same
    GPU: fp16 logits within 2e-2 (the kernels' split differs: the graph's plan is sized for the capacity)."""
    why = _gpu_ready(kv)
    if why:
        pytest.skip(why)
    model = make_model(64, torch.float16, "cuda")
    got, want = decode_both(model, "kivi2" if kv == "kivi2" else "fp16", 40, capture=True, fp16_method=method,
                            backend="cuda", feedback=False)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2, msg=lambda m, i=i: f"decode step {i}: {m}")
