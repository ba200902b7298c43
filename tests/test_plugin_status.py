"""The KiviAttention status output (op.STATUS_OUTPUT): one int32 per layer and step carrying the kernels'
KiviErrorBits, so a sequence the kernels skipped (bad lengths, capacity, slot or block id) is observable instead of
silent zero rows.

Oracles: the exported graph's declared outputs; the onnxruntime op (the reference, which raises on a bad step, so a
step that returns reports 0); the TensorRT runner's check of that output (its method, on a status tensor as the
engine writes it: the engine itself needs TensorRT and a GPU, tests/test_runners_trt.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_kivi.builder.onnx_export import export_llama, graph_info
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.models.tiny import tiny_model
from trtllm_kivi.op import STATUS_BITS, ExportSpec, status_name
from trtllm_kivi.runtime.ort_runner import OrtRunner, step_feeds
from trtllm_kivi.runtime.trt_runner import TrtRunner

CFG = KiviConfig(residual_length=32, block_size=64)
SPEC = ExportSpec("float16", max_batch_size=2, max_seq_len=96, max_num_tokens=64)


def test_onnxruntime_graph_reports_status_zero_for_every_layer():
    model, mc = tiny_model(seed=1)
    ort = OrtRunner(export_llama(model, CFG, SPEC), graph_info(model, CFG, SPEC))
    slots = [ort.add_sequence(), ort.add_sequence()]
    st = ort.cache.begin_step(slots, [40, 3])
    feeds = step_feeds(st, [list(range(40)), [7, 8, 9]], all_logits=False)  # the cache is updated in place
    outs = dict(zip(ort._outputs, ort.session.run(None, feeds), strict=True))
    for layer in range(mc.n_layers):
        status = outs[status_name(layer)]
        assert status.dtype == np.int32 and status.tolist() == [0], (layer, status)


def _runner_with_status(bits: list[int]) -> TrtRunner:
    """A TrtRunner holding only what _check_status reads: the per-layer status tensor the engine writes into."""
    r = TrtRunner.__new__(TrtRunner)
    r._status = torch.tensor(bits, dtype=torch.int32).reshape(-1, 1)
    return r


class _Step:
    slots = [3, 0]


def test_trt_runner_raises_on_a_nonzero_status_naming_layer_and_bits():
    _runner_with_status([0, 0, 0])._check_status(_Step())  # all ran: no error
    with pytest.raises(RuntimeError, match=r"slots \[3, 0\] in 2 layer\(s\) \(first: layer 1, status 0x6: "
                                           + STATUS_BITS[2].split(" (")[0]):
        _runner_with_status([0, 6, 6])._check_status(_Step())
