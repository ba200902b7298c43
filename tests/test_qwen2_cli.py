"""A tiny random Qwen2 checkpoint (models/tiny.py: q/k/v biases, rope theta 1e6, GQA 7:1) through the CLI end to
end, in both formats: `trtllm-kivi run` (HF folder and GGUF), `eval --json`, and `build` (ONNX export with the biases,
onnxruntime check) followed by `run --engine`.

Oracles: transformers' Qwen2ForCausalLM greedy generate() (DynamicCache) for the fp32 run; the torch runtime
(TorchRunner over the same KiviCache config) for KIVI runs and for the engine's tokens; the build's own check."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_kivi import cli
from trtllm_kivi.models.tiny import WIDE_INIT, write_tiny_gguf, write_tiny_qwen2_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = "Qwen2 meets KIVI"
SMALL = ["--residual-length", "32", "--max-batch-size", "2", "--max-seq-len", "256", "--check-steps", "16",
         "--quiet"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    return (write_tiny_qwen2_checkpoint(d / "tiny-qwen2", seed=7, init=WIDE_INIT),
            write_tiny_gguf(d / "tiny-qwen2.gguf", seed=7, init=WIDE_INIT, quant="F32"))


def _run(capsys, *argv, prompt: str = PROMPT) -> str:
    assert cli.main(["run", "--prompt", prompt, "--quiet", *argv]) == 0
    return capsys.readouterr().out.rstrip("\n")


def _torch_tokens(model_path, kv: str, n: int, prompt: str = PROMPT) -> tuple[list[int], str]:
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.kvspec import parse_kv
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    model, tok, _ = load_model(str(model_path))
    spec = parse_kv(kv, residual_length=None if kv.startswith("fp") else 32)
    runner = TorchRunner.create(model, spec, 1, 256)
    g = generate(runner, [tok.encode(prompt)], SamplingParams(max_new_tokens=n), tok)[0]
    return g.tokens, g.text


def test_run_fp32_matches_transformers_generate(ckpts, capsys):
    folder, gguf = ckpts
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    from trtllm_kivi.models import Tokenizer

    ids = Tokenizer.from_hf_folder(folder).encode(PROMPT)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    want = out[0, len(ids):].tolist()
    tokens, text = _torch_tokens(folder, "fp32", 16)
    assert tokens == want and len(set(want)) > 3  # not one repeated token
    for model in (folder, gguf):  # the F32 GGUF holds the same weights
        assert _run(capsys, "--model", str(model), "--kv", "fp32", "--max-new-tokens", "16") == text


@pytest.mark.parametrize("kv", ["kivi2", "k4v2"])
def test_run_kivi_matches_the_torch_runtime(ckpts, capsys, kv):
    """A 40-token prompt + 48 new tokens with R=32 crosses flush points (R + G = 64) during the decode."""
    folder, gguf = ckpts
    prompt = PROMPT * 2 + " and more text to pass R"
    assert len(prompt) >= 40
    tokens, text = _torch_tokens(folder, kv, 48, prompt)
    assert len(tokens) == 48
    for model in (folder, gguf):  # the F32 GGUF holds the same weights: the same tokens
        got = _run(capsys, "--model", str(model), "--kv", kv, "--residual-length", "32", "--max-new-tokens", "48",
                   prompt=prompt)
        assert got == text


def _eval(model, tmp_path, capsys) -> dict:
    """`eval --json` of fp16 and kivi2 (R=32) on one 200-token segment: the quality configs."""
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question. " * 20)
    rc = cli.main(["eval", "--model", str(model), "--text", str(tmp_path / "t.txt"), "--kv", "fp16,kivi2",
                   "--segments", "1", "--segment-len", "200", "--prefix", "100", "--tasks", "ppl", "--json",
                   "--no-progress", "--residual-length", "32"])
    assert rc == 0
    q = json.loads(capsys.readouterr().out)["quality"]["configs"]
    assert q["fp16"]["scored_tokens"] == q["kivi2"]["scored_tokens"] == 200 - 1 - 100
    assert q["kivi2"]["kl_mean"] > 0 and q["fp16"]["ppl"] > 1
    return q


def test_eval_json_runs_on_qwen2_in_both_formats(ckpts, tmp_path, capsys):
    """eval runs from the HF folder and from the GGUF file; the F32 GGUF holds the folder's weights and tokenizer,
    so both report the same PPL and KL."""
    a, b = (_eval(model, tmp_path, capsys) for model in ckpts)
    for kv in ("fp16", "kivi2"):
        assert a[kv]["ppl"] == pytest.approx(b[kv]["ppl"], rel=1e-4), kv
    assert a["kivi2"]["kl_mean"] == pytest.approx(b["kivi2"]["kl_mean"], rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("fmt", [0, 1], ids=["hf-folder", "gguf"])
def test_build_and_run_engine(ckpts, tmp_path, capsys, fmt):
    """The exported graph carries the biases (Gemm with C); the build's onnxruntime check passes against the torch
    runtime; `run --engine` generates what the torch runtime generates on the build's fp16 reference model. From
    the HF folder and from the GGUF file alike."""
    import onnx

    from trtllm_kivi.builder import check as check_mod
    from trtllm_kivi.cache import KiviCache
    from trtllm_kivi.format import KiviConfig
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.select import load_runner
    from trtllm_kivi.runtime.torch_runner import TorchRunner

    folder = ckpts[fmt]
    out = tmp_path / "qwen2-kivi"
    assert cli.main(["build", "--model", str(folder), "-o", str(out), *SMALL]) == 0
    conf = json.loads((out / "build_config.json").read_text())
    assert conf["check"]["passed"] and conf["model"]["config"]["qkv_bias"] is True
    g = onnx.load(str(out / "model.onnx"), load_external_data=False)
    gemms = [n for n in g.graph.node if n.op_type == "Gemm" and len(n.input) == 3]
    assert [n.input[2] for n in gemms] == [f"layers.{i}.attn.bqkv.bias" for i in range(2)]

    capsys.readouterr()
    assert cli.main(["run", "--engine", str(out), "--prompt", PROMPT, "--max-new-tokens", "12", "--quiet"]) == 0
    engine_text = capsys.readouterr().out.rstrip("\n")
    runner, _ = load_runner(out)
    model, tok, mc = load_model(str(folder))
    params = SamplingParams(max_new_tokens=12)
    ours = generate(runner, [tok.encode(PROMPT)], params, tok)[0]
    ref_model = check_mod.reference_model(model, "float16")
    ref = TorchRunner(ref_model, KiviCache(KiviConfig(residual_length=32), mc.geometry, 1, 256,
                                           dtype=ref_model.dtype))
    theirs = generate(ref, [tok.encode(PROMPT)], params, tok)[0]
    assert ours.tokens == theirs.tokens and len(ours.tokens) == 12
    assert engine_text == ours.text
