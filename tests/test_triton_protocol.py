"""The Triton serving protocol and repository writer, without a server (tests/test_triton_server.py runs the real
one): request validation (serving/protocol.py), config.pbtxt, serving.json and `trtllm-kivi triton`.

Oracles: the input/output contract written out here (names, Triton dtypes, decoupled python backend) and the
tokenizer's own encoding of the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtllm_kivi.cli import main
from trtllm_kivi.models.loaders import gguf_tokenizer, resolve_model
from trtllm_kivi.serving import InvalidRequest, ServingConfig, config_pbtxt, parse_request, write_repository
from trtllm_kivi.serving.protocol import response_arrays

VOCAB, MAX_SEQ_LEN = 49152, 256


@pytest.fixture(scope="module")
def tok():
    return gguf_tokenizer(resolve_model("smollm2-135m"))


def S(*xs):
    return np.array([x.encode() if isinstance(x, str) else x for x in xs], dtype=np.object_)


def parse(tok, **tensors):
    return parse_request(tensors, tok, VOCAB, MAX_SEQ_LEN, default_max_tokens=16, stop_token_ids=(2,))


def test_valid_requests(tok):
    p = parse(tok, text_input=S("Hello world"))
    assert p.prompt == tok.encode("Hello world") and not p.stream  # stream defaults to false (one response)
    assert p.params.max_new_tokens == 16 and p.params.temperature == 0 and p.params.stop_token_ids == (2,)
    p = parse(tok, input_ids=np.array([5, 6, 7], np.int64), max_tokens=np.array([9], np.int64),
              temperature=np.array([0.5], np.float32), top_p=np.array([0.8], np.float32),
              top_k=np.array([4], np.int64), seed=np.array([7], np.int64), stop_words=S("\n\n", "END"),
              stream=np.array([True]))
    assert p.prompt == [5, 6, 7] and p.stream
    sp = p.params
    assert (sp.max_new_tokens, sp.top_k, sp.seed, sp.stop_strings) == (9, 4, 7, ("\n\n", "END"))
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.8)


@pytest.mark.parametrize("tensors, match", [
    ({"text_input": S("")}, "'text_input' is empty"),
    ({}, "exactly one of 'text_input'"),
    ({"text_input": S("a"), "input_ids": np.array([1], np.int32)}, "exactly one of 'text_input'"),
    ({"text_input": S("a", "b")}, "exactly one string, got 2"),
    ({"text_input": S(b"\xff")}, "not valid UTF-8"),
    ({"input_ids": np.array([], np.int32)}, "'input_ids' is empty"),
    ({"input_ids": np.array([1.0], np.float32)}, "'input_ids' must be integers, got dtype float32"),
    ({"input_ids": np.array([[1], [2]], np.int32)},
     r"'input_ids' must have 1 dimension\(s\) \(dims \[-1\]\), got shape \[2, 1\]"),
    ({"input_ids": np.array([[1, 2]], np.int64)}, r"'input_ids' must have 1 dimension\(s\).*got shape \[1, 2\]"),
    ({"input_ids": np.array([2**32 + 5], np.int64)}, r"ids \[4294967301\] outside the vocabulary"),
    ({"text_input": S("a"), "max_tokens": np.array([2**40], np.int64)},
     r"max_tokens=1099511627776 must be in \[1, 256\]"),
    ({"input_ids": np.array([3, VOCAB], np.int32)}, r"ids \[49152\] outside the vocabulary \[0, 49152\)"),
    ({"text_input": S("a"), "max_tokens": np.array([0], np.int32)}, r"max_tokens=0 must be in \[1, 256\]"),
    ({"text_input": S("a"), "max_tokens": np.array([2**31 - 1], np.int32)}, r"max_tokens=2147483647 must be in"),
    ({"text_input": S("a"), "max_tokens": np.array([1, 2], np.int32)}, r"exactly one value, got shape \[2\]"),
    ({"text_input": S("a"), "max_tokens": np.array([2.0], np.float32)}, "'max_tokens' must be int"),
    ({"text_input": S("a"), "temperature": np.array([np.nan], np.float32)}, "temperature=nan must be in"),
    ({"text_input": S("a"), "temperature": np.array([-0.5], np.float32)}, "temperature=-0.5 must be in"),
    ({"text_input": S("a"), "top_p": np.array([1.5], np.float32)}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"text_input": S("a"), "top_k": np.array([-1], np.int32)}, "top_k=-1 must be >= 0"),
    ({"text_input": S("a"), "seed": np.array([-3], np.int64)}, "seed=-3 must be >= 0"),
    ({"text_input": S("a"), "stop_words": S("")}, "stop_words must be at most 16 non-empty strings"),
    ({"text_input": S("a"), "stop_words": S(*["x"] * 17)}, "stop_words must be at most 16"),
    ({"text_input": S("a"), "stream": np.array([1], np.int32)}, "'stream' must be bool"),
    ({"text_input": S("a"), "bogus": np.array([1], np.int32)}, r"unknown inputs \['bogus'\]"),
])
def test_malformed_requests(tok, tensors, match):
    with pytest.raises(InvalidRequest, match=match):
        parse(tok, **tensors)


def test_unknown_parameters_are_unknown_inputs(tok):
    """Triton's HTTP generate endpoint passes JSON keys that are not inputs as request parameters."""
    args = ({"text_input": S("a")}, tok, VOCAB, MAX_SEQ_LEN)
    with pytest.raises(InvalidRequest, match=r"unknown inputs \['bogus', 'temprature'\]; accepted: \["):
        parse_request(*args, parameters={"temprature": 0.5, "bogus": 1})
    assert parse_request(*args, parameters={"triton_enable_empty_final_response": True}).prompt == tok.encode("a")


def test_config_dims_are_the_shapes_parse_request_accepts(tok):
    """config.pbtxt and parse_request agree: every input's dims in config.pbtxt is its INPUTS dims, and an array
    of that rank passes the shape check while one more dimension is refused."""
    import re

    from trtllm_kivi.serving.protocol import INPUTS

    text = config_pbtxt("m")
    for name, (dt, dims, _, _) in INPUTS.items():
        m = re.search(rf'name: "{name}" data_type: (\w+) dims: (\[[^]]*\])', text)
        assert m and m.group(1) == dt and json.loads(m.group(2)) == dims, name
    ok = parse(tok, input_ids=np.array([5, 6], np.int64), max_tokens=np.array([3], np.int64))
    assert ok.prompt == [5, 6]
    with pytest.raises(InvalidRequest, match="must have 1 dimension"):
        parse(tok, input_ids=np.array([[5, 6]], np.int64))


def test_response_arrays():
    r = response_arrays("héllo", [1, 2], "length")
    assert r["text_output"].dtype == object and r["text_output"][0].decode() == "héllo"
    assert r["output_ids"].dtype == np.int32 and r["output_ids"].tolist() == [1, 2]
    assert response_arrays("", [], "")["output_ids"].shape == (0,)


def test_config_pbtxt_is_a_decoupled_python_model():
    text = config_pbtxt("m")
    assert 'backend: "python"' in text and "decoupled: true" in text and "max_batch_size: 0" in text
    for name, dt in [("text_input", "TYPE_STRING"), ("input_ids", "TYPE_INT64"), ("max_tokens", "TYPE_INT64"),
                     ("top_k", "TYPE_INT64"),
                     ("temperature", "TYPE_FP32"), ("top_p", "TYPE_FP32"), ("seed", "TYPE_INT64"),
                     ("stop_words", "TYPE_STRING"), ("stream", "TYPE_BOOL"), ("text_output", "TYPE_STRING"),
                     ("output_ids", "TYPE_INT32")]:
        assert f'name: "{name}" data_type: {dt}' in text


def test_triton_command_writes_the_repository(tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["triton", "--model", "smollm2-135m", "-o", str(repo), "--kv", "kivi4", "--residual-length", "64",
                 "--max-slots", "3", "--max-seq-len", "512"]) == 0
    folder = repo / "trtllm_kivi"
    assert sorted(p.name for p in folder.iterdir()) == ["1", "config.pbtxt", "serving.json"]
    cfg = ServingConfig.from_json((folder / "serving.json").read_text())
    assert cfg.model == str(resolve_model("smollm2-135m").resolve()) and cfg.engine is None
    assert (cfg.kv, cfg.kv_options, cfg.max_slots, cfg.max_seq_len) == ("kivi4", {"residual_length": 64}, 3, 512)
    model_py = (folder / "1" / "model.py").read_text()
    assert "from trtllm_kivi.serving.triton_model import TritonPythonModel" in model_py
    root = json.loads((folder / "serving.json").read_text())["package_root"]  # model.py puts it on sys.path
    assert (Path(root) / "trtllm_kivi" / "serving" / "triton_model.py").is_file()
    # an existing model folder is kept unless --force; bad input is refused before anything is written
    assert main(["triton", "--model", "smollm2-135m", "-o", str(repo)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["triton", "--model", "smollm2-135m", "-o", str(repo), "--force", "--max-slots", "2"]) == 0
    assert ServingConfig.from_json((folder / "serving.json").read_text()).max_slots == 2
    assert main(["triton", "--model", "smollm2-135m", "-o", str(tmp_path / "r2"), "--kv", "kivi3"]) == 2
    assert not (tmp_path / "r2").exists()
    assert main(["triton", "--engine", str(tmp_path / "nope"), "-o", str(tmp_path / "r3")]) == 2
    assert "is not a trtllm-kivi build folder" in capsys.readouterr().err and not (tmp_path / "r3" / "trtllm_kivi").exists()


def test_serving_config_validation(tmp_path):
    with pytest.raises(ValueError, match="exactly one of model"):
        ServingConfig()
    with pytest.raises(ValueError, match="max_slots=0 must be an integer >= 1"):
        ServingConfig(model="x", max_slots=0)
    with pytest.raises(ValueError, match=r"unknown serving config fields \['oops'\]"):
        ServingConfig.from_json('{"model": "x", "oops": 1}')
    with pytest.raises(ValueError, match="must match"):
        write_repository(tmp_path / "repo", ServingConfig(model="x"), name="bad name")
    assert not (tmp_path / "repo").exists()  # refused before anything is written


def test_client_types_follow_the_protocol_and_metrics_parse():
    """serving/client.py sends every known input with its config.pbtxt type, and reads the model's metrics."""
    from trtllm_kivi.serving.client import model_metrics, wire_array
    from trtllm_kivi.serving.protocol import INPUTS

    wire = {"TYPE_STRING": "BYTES", "TYPE_INT64": "INT64", "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}
    values = {"text_input": ["hi"], "input_ids": [1, 2**40], "max_tokens": [3], "temperature": [0.5],
              "top_p": [0.9], "top_k": [2], "seed": [7], "stop_words": ["x"], "stream": [True]}
    for name, v in values.items():
        arr, dt = wire_array(name, v)
        assert dt == wire[INPUTS[name][0]], name
    assert wire_array("input_ids", [1, 2**40])[0].tolist() == [1, 2**40]
    assert wire_array("max_tokens", np.array([2.5], np.float32))[1] == "FP32"  # an explicit dtype is kept
    text = ('# HELP trtllm_kivi_kv_slots_in_use slots\n# TYPE trtllm_kivi_kv_slots_in_use gauge\n'
            'trtllm_kivi_kv_slots_in_use{model="a"} 2\ntrtllm_kivi_kv_slots_in_use{model="b"} 0\n'
            'trtllm_kivi_requests_finished_total{model="a",reason="cancelled"} 3\nnv_inference_count{model="a"} 9\n')
    assert model_metrics(text, "a") == {"kv_slots_in_use": 2.0, "requests_finished_total:cancelled": 3.0}


@pytest.mark.parametrize("code, asked, status, words", [
    (0, True, 0, []),  # stopped cleanly because we asked
    (-11, False, 139, ["died on its own", "SIGSEGV", "exits 139"]),  # a crash: 128 + signal, as a shell says
    (-9, True, 137, ["after the stop request", "SIGKILL"]),  # killed after the stop request timed out
    (1, False, 1, ["exit code 1"]),
    (0, False, 1, ["died on its own", "exit code 0"]),  # ended by itself: a supervisor must still restart it
])
def test_launcher_exit_status_follows_the_server(capsys, code, asked, status, words):
    from trtllm_kivi.commands.triton import launcher_status

    assert launcher_status(code, asked, "LOG TAIL") == status
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert ("LOG TAIL" in err) == (status != 0)
