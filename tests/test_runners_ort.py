"""The onnxruntime runner (runtime/ort_runner.py) behind the Runner interface, and runner selection from a build
folder (runtime/select.py).

Oracle: the torch runtime (TorchRunner over a KiviCache with the same config) on the same token streams."""

import json

import onnx
import pytest
import torch

from trtllm_kivi.builder.build import BuildOptions, build
from trtllm_kivi.builder.check import reference_model
from trtllm_kivi.builder.onnx_export import export_llama, graph_info
from trtllm_kivi.op import ExportSpec
from trtllm_kivi.models.tiny import tiny_model, write_tiny_checkpoint
from trtllm_kivi.cache import CacheCapacityError, KiviCache
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.runtime.ort_runner import OrtRunner
from trtllm_kivi.runtime.select import load_runner
from trtllm_kivi.runtime.torch_runner import TorchRunner

CFG = KiviConfig(k_bits=4, v_bits=2, group_size=32, residual_length=32, block_size=64)
SPEC = ExportSpec("float16", max_batch_size=3, max_seq_len=160, max_num_tokens=128)


@pytest.fixture(scope="module")
def pair():
    model, mc = tiny_model(seed=4)
    ort = OrtRunner(export_llama(model, CFG, SPEC), graph_info(model, CFG, SPEC))
    ref = reference_model(model, SPEC.dtype)
    torch_runner = TorchRunner(ref, KiviCache(CFG, mc.geometry, 3, 160, dtype=torch.float32,
                                              num_blocks=ort.cache.num_blocks))
    return ort, torch_runner


def _both(pair, slots, tokens, all_logits=False):
    a, b = (r.step(slots, tokens, all_logits) for r in pair)
    assert a.dtype == torch.float32 and a.shape == b.shape
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    return a


def test_ragged_steps_free_and_reuse_match_the_torch_runtime(pair):
    ort, ref = pair
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    s = [ort.add_sequence() for _ in range(3)]
    assert s == [ref.add_sequence() for _ in range(3)] and ort.free_slots == 0
    out = _both(pair, s, [ids(70), ids(5), ids(40)], all_logits=True)  # ragged prefill, every row's logits
    assert out.shape == (115, 256)
    for _ in range(3):  # decode of two, chunked prefill of the third, in the same steps
        _both(pair, s, [ids(1), ids(1), ids(12)])
    assert [ort.seq_len(x) for x in s] == [73, 8, 76]
    for layer in range(ort.geometry.num_layers):  # flushed groups of slot 0 and 2 are bit-identical
        for x in (s[0], s[2]):
            a, b = ort.cache.sequence_state(x, layer), ref.cache.sequence_state(x, layer)
            assert torch.equal(a["k_codes"], b["k_codes"]) and torch.equal(a["v_codes"], b["v_codes"])
    ort.free_sequence(s[1])
    ref.free_sequence(s[1])
    assert ort.free_slots == 1 and ort.add_sequence() == ref.add_sequence() == s[1]
    _both(pair, [s[1], s[0]], [ids(9), ids(1)])
    for x in s:
        ort.free_sequence(x)
        ref.free_sequence(x)


# Format v2: 4 sinks (flushes at 4 + 32 + 32k), K rotated in layer 0 only, V in both layers.
CFG_V2 = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64, sink_tokens=4,
                    k_rotation=("hadamard", "none"), v_rotation="hadamard")


def test_sinks_and_per_layer_rotation_match_the_torch_runtime():
    """The graph rotates q/k/v and the output around the node (onnx_export); the torch runtime applies the same
    rotation at run time from its cache's config. Same logits, bit-identical codes and sink rows."""
    model, mc = tiny_model(seed=4)
    m = export_llama(model, CFG_V2, SPEC)
    nodes = [n for n in m.graph.node if n.op_type == "KiviAttention"]
    codes = [{a.name: a.i for a in n.attribute if a.name in ("sink_tokens", "k_rotation", "v_rotation")}
             for n in nodes]
    assert codes == [{"sink_tokens": 4, "k_rotation": 1, "v_rotation": 1},
                     {"sink_tokens": 4, "k_rotation": 0, "v_rotation": 1}]
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"node attention_0: KiviAttention node attributes disagree with the build "
                       r"config \(k_rotation: graph 1 vs build config 0"):  # a rotated cache is never read unrotated
        OrtRunner(m, graph_info(model, replace(CFG_V2, k_rotation="none"), SPEC))
    ort = OrtRunner(m, graph_info(model, CFG_V2, SPEC))
    assert ort.info.kivi == CFG_V2
    ref = TorchRunner(reference_model(model, SPEC.dtype), KiviCache(CFG_V2, mc.geometry, 3, 160, dtype=torch.float32,
                                                                   num_blocks=ort.cache.num_blocks))
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    s = [ort.add_sequence() for _ in range(2)]
    assert s == [ref.add_sequence() for _ in range(2)]
    _both((ort, ref), s, [ids(3), ids(70)], all_logits=True)  # slot 0 still inside its sinks
    for _ in range(3):
        _both((ort, ref), s, [ids(2), ids(1)])
    _both((ort, ref), s, [ids(66), ids(30)])  # flushes of groups [4, 36), [36, 68) in slot 0; more in slot 1
    for layer in range(mc.geometry.num_layers):
        for x in s:
            a, b = ort.cache.sequence_state(x, layer), ref.cache.sequence_state(x, layer)
            assert a["k_codes"].numel() > 0 and torch.equal(a["k_codes"], b["k_codes"])
            assert torch.equal(a["v_codes"], b["v_codes"])
            torch.testing.assert_close(a["k_window"][:, :4], b["k_window"][:, :4], atol=1e-5, rtol=0)


def test_capacity_and_bad_steps_are_refused_without_changing_state(pair):
    ort, _ = pair
    s = ort.add_sequence()
    ort.step([s], [[1] * 100])
    with pytest.raises(CacheCapacityError, match=r"slot \d: 100 \+ 61 tokens exceeds the cache capacity "
                       r"max_seq_len=160"):
        ort.step([s], [[1] * 61])
    with pytest.raises(CacheCapacityError, match=r"the step has 129 tokens; the graph was built for "
                       r"max_num_tokens=128"):
        ort.step([s], [[1] * 129])
    with pytest.raises(ValueError, match=r"empty chunk"):
        ort.step([s], [[]])
    with pytest.raises(ValueError, match=r"token ids \[256\] out of range \[0, 256\)"):
        ort.step([s], [[256]])
    assert ort.seq_len(s) == 100
    ort.step([s], [[1] * 60])  # exactly to capacity still works
    assert ort.seq_len(s) == 160
    ort.free_sequence(s)
    assert ort.kv_nbytes == ort.cache.nbytes > 0


def test_graph_that_disagrees_with_its_build_config_is_refused():
    """The build config is the one source of truth: a node of another format version or KIVI config is refused."""
    model, _ = tiny_model()
    g = export_llama(model, CFG, SPEC)
    for a in g.graph.node[[n.op_type for n in g.graph.node].index("KiviAttention")].attribute:
        if a.name == "format_version":
            a.i = 999
    with pytest.raises(ValueError, match=r"attributes disagree with the build config \(format_version: graph 999 vs "
                       r"build config"):
        OrtRunner(g, graph_info(model, CFG, SPEC))
    other = KiviConfig(k_bits=2, v_bits=2, group_size=32, residual_length=32, block_size=64)
    with pytest.raises(ValueError, match=r"k_bits: graph 4 vs build config 2"):
        OrtRunner(export_llama(model, CFG, SPEC), graph_info(model, other, SPEC))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("sel")
    ckpt = write_tiny_checkpoint(root / "ckpt")
    out = root / "build"
    build(BuildOptions(output=out, model=str(ckpt), kivi=CFG, max_batch_size=2, max_seq_len=128, check_steps=0),
          progress=False)
    return out


def test_load_runner_picks_onnxruntime_here_and_says_why(folder):
    runner, why = load_runner(folder)
    assert isinstance(runner, OrtRunner) and runner.name == "onnxruntime"
    assert "tensorrt unavailable: the folder has no engine" in why
    assert runner.max_slots == 2 and runner.max_seq_len == 128 and runner.kivi_config == CFG
    runner, why = load_runner(folder, prefer="onnxruntime")
    assert "requested" in why


def test_load_runner_refuses_what_cannot_run(folder, tmp_path):
    with pytest.raises(ValueError, match=r"cannot use the tensorrt runner for .*: the folder has no engine"):
        load_runner(folder, prefer="tensorrt")
    with pytest.raises(ValueError, match=r"runner 'cuda' is not supported; allowed: auto, tensorrt, onnxruntime"):
        load_runner(folder, prefer="cuda")
    with pytest.raises(ValueError, match=r"is not a trtllm-kivi build folder \(no build_config.json\)"):
        load_runner(tmp_path)
    bad = tmp_path / "old"
    bad.mkdir()
    conf = json.loads((folder / "build_config.json").read_text()) | {"format_version": 0}
    (bad / "build_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"has format_version=0 but this trtllm_kivi uses FORMAT_VERSION"):
        load_runner(bad)


def test_build_folder_graph_is_the_runners_graph(folder):
    """The runner runs the folder's model.onnx (external weights loaded), not a re-export."""
    runner, _ = load_runner(folder)
    g = onnx.load(str(folder / "model.onnx"))
    assert runner.info.spec == ExportSpec("float16", 2, 128, 128)
    assert sum(n.op_type == "KiviAttention" for n in g.graph.node) == runner.geometry.num_layers


def test_external_weights_route_matches_inline(tmp_path, monkeypatch):
    """A saved graph whose float32 weights exceed INLINE_LIMIT (a 1.5B model: 7 GB, over protobuf's 2 GB) reaches
    onnxruntime through a float32 external-data file written one tensor at a time. Oracle: the same graph through
    the in-memory route, same token stream, logits bit-identical."""
    from trtllm_kivi.builder.onnx_export import save_model
    from trtllm_kivi.runtime import ort_session

    model, _ = tiny_model(seed=4)
    graph = export_llama(model, CFG, SPEC)
    info = graph_info(model, CFG, SPEC)
    save_model(graph, str(tmp_path / "model.onnx"), keep_weights=False)
    external = [i for i in graph.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external and not any(i.raw_data for i in external)  # keep_weights=False: not read back
    inline = OrtRunner(tmp_path / "model.onnx", info)  # tiny weights: serialized in memory
    assert ort_session.float32_weight_bytes(onnx.load(str(tmp_path / "model.onnx"))) < ort_session.INLINE_LIMIT
    written = []
    real_write = ort_session._write_external
    monkeypatch.setattr(ort_session, "INLINE_LIMIT", 0)
    monkeypatch.setattr(ort_session, "_write_external", lambda *a: written.append(a[2]) or real_write(*a))
    streamed = OrtRunner(tmp_path / "model.onnx", info)
    assert len(written) > 2 * model.cfg.n_layers  # every matrix went through the file
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 9)]
    for r in (inline, streamed):
        assert [r.add_sequence() for _ in tokens] == [0, 1]
    for _ in range(3):
        a, b = inline.step([0, 1], tokens), streamed.step([0, 1], tokens)
        assert torch.equal(a, b)
        tokens = [[int(t)] for t in a.argmax(-1)]
