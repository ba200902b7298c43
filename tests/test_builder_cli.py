"""`trtllm-kivi build` end to end on a tiny random Hugging Face checkpoint (models/tiny.py): the folder it writes,
the onnxruntime check it reports, refusal to overwrite, atomic output on failure, malformed options, and
`trtllm-kivi run --engine DIR` generating through the onnxruntime runner.

Oracles: the torch runtime (TorchRunner over a KiviCache) for generated tokens; the files' own contents."""

import json
import os

import pytest

from trtllm_kivi import cli
from trtllm_kivi.builder import check as check_mod
from trtllm_kivi.builder.build import BuildOptions, build
from trtllm_kivi.models.tiny import write_tiny_checkpoint
from trtllm_kivi.format import FORMAT_VERSION, KiviConfig

SMALL = ["--residual-length", "32", "--max-batch-size", "2", "--max-seq-len", "256", "--check-steps", "16",
         "--quiet"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=3)


@pytest.fixture(scope="module")
def built(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("builds") / "tiny-kivi"
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL]) == 0
    return out


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_build_writes_the_folder(built):
    names = {p.name for p in built.iterdir()}
    assert names >= {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json",
                     "build_config.json"}
    conf = json.loads((built / "build_config.json").read_text())
    assert conf["format_version"] == FORMAT_VERSION
    assert KiviConfig.from_dict(conf["kivi_config"]) == KiviConfig(residual_length=32)
    assert conf["geometry"] == {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
    assert conf["dtype"] == "float16"
    assert conf["maxima"]["max_batch_size"] == 2 and conf["maxima"]["max_seq_len"] == 256
    assert conf["versions"]["onnx"] and conf["versions"]["onnxruntime"]
    assert conf["engine"]["built"] is False and "--dynamicPlugins=" in conf["engine"]["trtexec"]
    assert conf["files"]["engine"] is None and not (built / "model.engine").exists()


def test_build_reports_a_passing_onnxruntime_check(built):
    chk = json.loads((built / "build_config.json").read_text())["check"]
    assert chk["passed"] and chk["decode_steps"] == 16
    assert chk["max_logit_diff"] <= chk["tolerances"]["logit_atol"]
    assert chk["code_words"] > 0 and min(chk["quantized_tokens"]) > 0  # flushes happened inside the check
    assert chk["code_words_differing"] <= chk["tolerances"]["code_words_differing_max_fraction"] * chk["code_words"]


def test_build_prints_the_check_and_the_trtexec_command(ckpt, tmp_path, capsys):
    out = tmp_path / "b"
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL[:-3], "--check-steps", "4",
                     "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "[check] onnxruntime vs torch runtime" in text and "max |logit diff|" in text and "PASSED" in text
    reason = json.loads((out / "build_config.json").read_text())["engine"]["reason"]  # no TensorRT, or head_dim 32
    assert f"[engine] not built: {reason}. To build it on a TensorRT machine:" in text
    assert f"trtexec --onnx={out / 'model.onnx'}" in text


def test_same_build_is_kept_and_a_different_one_is_refused(ckpt, built, capsys):
    before = (built / "build_config.json").read_text()
    assert cli.main(["build", "--model", str(ckpt), "-o", str(built), *SMALL]) == 0
    assert "already holds this build" in capsys.readouterr().out
    assert (built / "build_config.json").read_text() == before
    assert cli.main(["build", "--model", str(ckpt), "-o", str(built), *SMALL, "--k-bits", "4"]) == 2
    err = capsys.readouterr().err
    assert "holds a different build (differs in: kivi_config); pass --force to replace it" in err
    assert (built / "build_config.json").read_text() == before


def test_non_build_folder_is_never_replaced(ckpt, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert cli.main(["build", "--model", str(ckpt), "-o", str(out), *SMALL, "--force"]) == 2
    assert "not a trtllm-kivi build; refusing to replace it even with --force" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def _fail(*args, **kwargs):
    raise RuntimeError("simulated failure in the middle of the build")


def test_failed_build_leaves_nothing(ckpt, tmp_path, monkeypatch):
    """The check runs after the ONNX, weights and tokenizer are written: failing there must remove them all."""
    monkeypatch.setattr(check_mod, "check_graph", _fail)
    out = tmp_path / "never"
    with pytest.raises(RuntimeError, match="simulated failure"):
        build(BuildOptions(output=out, model=str(ckpt), kivi=KiviConfig(residual_length=32), max_batch_size=2,
                           max_seq_len=256, check_steps=4), progress=False)
    assert os.listdir(tmp_path) == []  # neither DIR nor its temporary folder


def test_failed_forced_rebuild_keeps_the_previous_build(ckpt, tmp_path, monkeypatch):
    out = tmp_path / "kept"
    opts = dict(output=out, model=str(ckpt), kivi=KiviConfig(residual_length=32), max_batch_size=2,
                max_seq_len=256, check_steps=2)
    build(BuildOptions(**opts), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(check_mod, "check_graph", _fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        build(BuildOptions(**{**opts, "kivi": KiviConfig(k_bits=4, residual_length=32), "force": True}),
              progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, "kept") == []


def test_stale_temporary_folder_of_a_killed_build_is_removed(ckpt, tmp_path):
    stale = tmp_path / ".x.building-999999999"  # no such process
    stale.mkdir()
    (stale / "model.onnx").write_text("half")
    build(BuildOptions(output=tmp_path / "x", model=str(ckpt), kivi=KiviConfig(residual_length=32),
                       max_batch_size=2, max_seq_len=256, check_steps=0), progress=False)
    assert not stale.exists() and (tmp_path / "x" / "build_config.json").is_file()


@pytest.mark.parametrize("args, match", [
    (["--max-batch-size", "0"], r"max_batch_size=0 must be an integer >= 1"),
    (["--max-seq-len", "4096"], r"max_seq_len=4096 exceeds the model's context of 1024 tokens; allowed: 1..1024"),
    (["--max-num-tokens", "1"], r"max_num_tokens=1 must be an integer >= 2"),
    (["--dtype", "float16", "--kv", "fp16"], r"--kv 'fp16': a build \(its attention is the KiviAttention plugin\) "
                                            r"needs a KIVI cache"),
    (["--check-steps", "-1"], r"check_steps=-1 must be >= 0"),
    (["--residual-length", "-3"], r"residual_length=-3 must be an integer >= 0"),
    (["--block-size", "48"], r"block_size=48 must be a positive multiple of group_size=32"),
])
def test_malformed_options_are_refused_with_the_value_and_range(ckpt, tmp_path, capsys, args, match):
    out = tmp_path / "bad"
    base = ["build", "--model", str(ckpt), "-o", str(out), "--max-batch-size", "2", "--max-seq-len", "256",
            "--quiet"]
    assert cli.main(base + args) == 2
    import re
    assert re.search(match, capsys.readouterr().err)
    assert not out.exists() and _leftovers(tmp_path, "bad") == []


def test_malformed_options_raise_value_error_from_the_api(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"dtype='fp8' is not supported; allowed: float16, bfloat16, float32"):
        build(BuildOptions(output=tmp_path / "o", model=str(ckpt), dtype="fp8"), progress=False)
    with pytest.raises(ValueError, match=r"model '/nonexistent' is neither a built-in name"):
        build(BuildOptions(output=tmp_path / "o", model="/nonexistent"), progress=False)
    # bits outside format.SUPPORTED_BITS: KiviConfig's one clear line, nothing written
    assert cli.main(["build", "--model", str(ckpt), "-o", str(tmp_path / "o"), "--k-bits", "3"]) == 2
    assert not (tmp_path / "o").exists()


def test_run_engine_generates_through_onnxruntime(ckpt, built, capsys):
    """Oracle: the torch runtime on the same checkpoint with the same KIVI config generates the same tokens
    (greedy; the tiny model's logits are far from ties)."""
    from trtllm_kivi.models import load_model
    from trtllm_kivi.runtime.generate import SamplingParams, generate
    from trtllm_kivi.runtime.select import load_runner
    from trtllm_kivi.runtime.torch_runner import TorchRunner
    from trtllm_kivi.cache import KiviCache

    assert cli.main(["run", "--engine", str(built), "--prompt", "Hello KIVI", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "[runner] onnxruntime runner" in captured.err and "tensorrt unavailable" in captured.err

    runner, _ = load_runner(built)
    model, tok, mc = load_model(str(ckpt))
    params = SamplingParams(max_new_tokens=12)
    ours = generate(runner, [tok.encode("Hello KIVI")], params, tok)[0]
    ref_model = check_mod.reference_model(model, "float16")
    ref = TorchRunner(ref_model, KiviCache(KiviConfig(residual_length=32), mc.geometry, 1, 256, dtype=ref_model.dtype))
    theirs = generate(ref, [tok.encode("Hello KIVI")], params, tok)[0]
    assert ours.tokens == theirs.tokens and len(ours.tokens) > 0
    assert ours.text in captured.out


def test_run_engine_refuses_kv_flags_that_contradict_the_build(built, capsys):
    """build_config.json is the one source of the folder's KV config: a contradicting flag is an error naming both
    values (it used to be ignored silently); a flag that agrees is accepted."""
    assert cli.main(["run", "--engine", str(built), "--prompt", "Hi", "--group-size", "64"]) == 2
    assert f"--group-size 64 contradicts the build folder {built} (group_size=32)" in capsys.readouterr().err
    assert cli.main(["run", "--engine", str(built), "--prompt", "Hi", "--kv", "kivi4"]) == 2
    assert "--kv 'kivi4'" in capsys.readouterr().err
    assert cli.main(["run", "--engine", str(built), "--prompt", "Hi", "--residual-length", "32",
                     "--max-new-tokens", "3", "--quiet"]) == 0


def test_run_json_reports_text_and_timings(ckpt, capsys):
    import json

    assert cli.main(["run", "--model", str(ckpt), "--prompt", "Hello KIVI", "--max-new-tokens", "5", "--json",
                     "--attention-backend", "reference"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 5 and out["prompt_tokens"] > 0 and len(out["texts"]) == 1
    assert out["decode_tokens_per_s"] > 0 and out["prefill_tokens_per_s"] > 0 and out["runner"] == "torch"
