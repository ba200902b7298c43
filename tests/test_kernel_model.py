"""tools/kernel_model, the static performance model of the decode kernels (CPU only).

Oracles: the bank model on patterns whose wavefront counts follow from 32 banks x 4 bytes; the occupancy arithmetic of
the CUDA occupancy rules worked by hand; the launch plan against trtllm_kivi/cuda/launch.py (itself tested against the
C++ kiviLaunchPlan in test_kernels_host.py) and the numbers the mma.sync kernel was designed from (9 splits, 576 CTAs,
528 slots, 1.09 waves); the SASS walker on a tiny nvcc-compiled kernel whose executed counts are known from its
source; the calibration against the hand count of the SIMT and WMMA kernels (within 20%); determinism of two runs;
the calibrated timing against every committed H200 timing (within 25%), a refit against the committed constants, a
fit to one model against the other model's timings; the gate against the measured kernel's measured 1.6 TB/s.
The compile-based tests skip with the missing tool's name when nvcc or the nvdisasm / cuobjdump wheels are absent.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path

import pytest

from trtllm_kivi.cuda import launch as cpu_model
from trtllm_kivi.format import KiviConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tools/ is the repository's, not the installed package's
    sys.path.insert(0, str(ROOT))
from tools.kernel_model import __main__ as cli  # noqa: E402
from tools.kernel_model import (analysis, append, banks, calibrate, constants, fullprec, kernels, plan,  # noqa: E402
                                predict, report, sass, shapes, spec, split, timing, toolchain)


def _tools_or_skip() -> None:
    try:
        toolchain.find_nvcc()
        toolchain.find_wheel_tool("nvdisasm")
        toolchain.find_wheel_tool("cuobjdump")
    except toolchain.ToolMissing as exc:
        pytest.skip(f"kernel model needs its tools: {exc}")


# ----------------------------------------------------------------------------------------------- bank model


def test_bank_model_known_patterns():
    assert banks.wavefronts([lane * 4 for lane in range(32)], 4) == 1  # consecutive words
    assert banks.wavefronts([lane * 128 for lane in range(32)], 4) == 32  # stride 32 words: one bank, 32 words
    assert banks.wavefronts([lane * 64 for lane in range(32)], 4) == 16  # stride 16 words: 2 banks x 16 words
    assert banks.wavefronts([0] * 32, 4) == 1  # broadcast
    assert banks.wavefronts([lane * 2 for lane in range(32)], 2) == 1  # 16-bit consecutive: 16 words
    assert banks.wavefronts([lane * 16 for lane in range(32)], 16) == 4  # 512 contiguous bytes
    assert banks.wavefronts([lane * 8 for lane in range(32)], 8) == 2
    assert banks.wavefronts([lane * 129 * 4 for lane in range(32)], 4) == 1  # padded rows (kS[lane][d])
    assert banks.wavefronts([None] * 31 + [0], 4) == 1
    assert banks.wavefronts([None] * 32, 4) == 0


def test_declared_mappings_give_the_known_conflicts():
    """The SIMT V staging store (kiviAttention.cuh vS[tok][wi * 16 + i]) is 16-way; its K store and the padded
    kS[lane][d] read are conflict-free; the WMMA kernel's 16-bit V store is 4-way."""
    ctx = spec.Ctx(shapes.MODELS["llama-3-8b"], True)
    by = {(a.text, a.op): banks.wavefronts(a.lanes(ctx), 4 if a.op != "LDSM" else 16) for a in kernels.SIMT_SMEM}
    assert by[("storeSmem<T>(vS[tok][wi * kPW + i]", "STS")] == 16
    assert by[("storeSmem<T>(kS[wi * kPW + i][d]", "STS")] == 1
    assert by[("float const kv = kS[lane][d];", "LDS")] == 1
    tc = {(a.text, a.op): a for a in kernels.TC_SMEM}
    assert banks.wavefronts(tc[("storeSmem<T>(vS[tok][wi * kPW + i]", "STS")].lanes(ctx), 2) == 4
    assert banks.wavefronts(tc[("wmma::load_matrix_sync(aFrag, &qS[0][kk * 16], kLDH);", "LDSM")].lanes(ctx), 16) == 4


# ----------------------------------------------------------------------------------------------- occupancy


@pytest.mark.parametrize("regs,smem,gpu,ctas,limiter", [
    (128, 41088, "H200", 4, "registers"),  # 128 x 32 = 4096 per warp, 16384 per CTA -> 65536 / 16384
    (80, 33984, "H200", 6, "registers"),  # 2560 per warp x 4 = 10240 -> 6.4; smem 228K / 35008 = 6.67
    (65, 0, "H200", 7, "registers"),  # 65 x 32 = 2080 -> 2304 per warp (256-register units) -> 65536 / 9216 = 7.1
    (128, 41088, "A100", 3, "shared_memory"),  # 164K / (41088 + 1024) = 3.99
    (24, 0, "H200", 16, "threads"),  # 2048 / 128 (registers would allow 21)
])
def test_occupancy_arithmetic(regs, smem, gpu, ctas, limiter):
    occ = plan.occupancy(plan.Resources(regs, smem, 0, 0, 0), 128, shapes.GPUS[gpu])
    assert occ["ctas_per_sm"] == ctas
    assert occ["limiter"] == limiter


def test_occupancy_cta_limit():
    occ = plan.occupancy(plan.Resources(16, 0, 0, 0, 0), 32, shapes.GPUS["H200"])
    assert occ["ctas_per_sm"] == 32 and occ["limiter"] == "cta_limit"


# ----------------------------------------------------------------------------------------------- launch plan


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-7b"])
@pytest.mark.parametrize("batch", [1, 3, 8, 32, 100])
@pytest.mark.parametrize("context", [300, 4096, 32768, 131072])
@pytest.mark.parametrize("sms", [108, 132])
def test_launch_plan_matches_kiviparams(model, batch, context, sms):
    """The model's mirror of the tree's kiviLaunchPlan for the measured kernel (decode variant 1 = baseline where the
    plan has variants): its split rule at 3 CTAs per SM."""
    shape = shapes.MODELS[model]
    cfg = KiviConfig()
    mbs = -(-context // cfg.block_size)
    args = (cfg, shape.num_heads, shape.num_kv_heads, shape.head_dim, batch, batch, mbs, 1, context, sms)
    if "ctas_per_sm" in inspect.signature(cpu_model.launch_plan).parameters:
        got = plan.mma_launch_plan(shape, batch, context, sms, context, 3)
        variant = {"decode_variant": 1} if "decode_variant" in inspect.signature(cpu_model.launch_plan).parameters \
            else {}
        want = cpu_model.launch_plan(*args, ctas_per_sm=3, **variant)
    else:
        got = plan.launch_plan(shape, batch, context, sms, context)
        want = cpu_model.launch_plan(*args)
    assert (got.num_tiles, got.split_len, got.num_splits) == (want.num_tiles, want.split_len, want.num_splits)
    infos, _ = cpu_model.prepare(want, cfg, list(range(batch)), [context - 1] * batch, [1] * batch,
                                 __import__("torch").zeros(batch, mbs, dtype=__import__("torch").int32), batch,
                                 batch * mbs, batch)
    assert all(i.split_len == got.seq_split_len for i in infos)


def test_waves_of_the_simt_kernel():
    """The SIMT kernel's plan, Llama-3-8B, batch 8, 32K on 132 SMs: 9 splits -> 576 CTAs for 528 resident slots,
    1.09 waves."""
    lp = plan.launch_plan(shapes.MODELS["llama-3-8b"], 8, 32768, 132, 32768)
    assert lp.num_splits == 9
    assert lp.num_tiles * 8 * lp.num_splits == 576
    occ = plan.occupancy(plan.Resources(128, 41088, 0, 0, 0), 128, shapes.GPUS["H200"])
    assert occ["ctas_per_sm"] * 132 == 528
    assert round(576 / 528, 2) == 1.09


def test_mma_plan_fills_one_wave():
    """The new kernel's split rule (splits = slots / (tiles x Hkv)): Llama-3-8B, batch 8, 32K, 3 CTAs/SM on 132 SMs ->
    396 slots, 8 x 8 = 64 base CTAs, 6 splits of 5,472 keys = 384 CTAs, one wave; never more CTAs than slots while
    tiles x Hkv fit in them."""
    lp = plan.mma_launch_plan(shapes.MODELS["llama-3-8b"], 8, 32768, 132, 32768, 3)
    assert (lp.num_tiles, lp.num_splits, lp.split_len) == (8, 6, 5472)
    for model in shapes.MODELS.values():
        for batch in (1, 8, 32):
            for ctx in (4096, 32768, 131072):
                p = plan.mma_launch_plan(model, batch, ctx, 132, ctx, 3)
                base = p.num_tiles * model.num_kv_heads
                assert base * p.num_splits <= max(396, base)


def test_kivi_tile_bytes():
    assert spec.kivi_tile_bytes(shapes.MODELS["llama-3-8b"]) == 3072  # the "3,072-byte tile"
    assert spec.kivi_code_words(shapes.MODELS["llama-3-8b"]) == 512


# ----------------------------------------------------------------------------------------------- SASS parsing

SASS = """
.text.myKernel:
	//## File "/x/k.cuh", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
	//## File "/x/c.cuh", line 3 inlined at "/x/k.cuh", line 12
	//## File "/x/k.cuh", line 12
        /*0010*/                   LDS.128 R4, [R2] ;
        /*0020*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
	//## File "/x/k.cuh", line 14
        /*0030*/                   FFMA R4, R4, R5, R6 ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/                   BRA.DIV UR4, `(.L_x_3) ;
        /*0058*/              @!PT LDS RZ, [RZ] ;
        /*005c*/               @P2 CALL.REL.NOINC `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
.L_x_3:
        /*0070*/                   WARPSYNC.ALL ;
        /*0080*/                   BRA `(.L_x_1) ;
"""


def test_parse_sass_stacks_blocks_and_loops():
    funcs = sass.parse_sass(SASS)
    ins = funcs["myKernel"]
    assert [i.opcode for i in ins] == ["MOV", "LDS.128", "BRA", "FFMA", "BRA", "BRA.DIV", "LDS", "CALL.REL.NOINC",
                                       "EXIT", "WARPSYNC.ALL", "BRA"]
    assert ins[1].stack == (("/x/c.cuh", 3), ("/x/k.cuh", 12))  # innermost first
    assert ins[2].stack == ins[1].stack and ins[2].pred == "@!P0"
    assert ins[3].label == ".L_x_2" and ins[3].stack == (("/x/k.cuh", 14),)
    assert ins[6].pred == "@!PT"
    blocks = sass.basic_blocks(ins)
    # a CALL to a local label is a (here conditional) jump: sm_80 loops exit that way
    assert [len(b.instrs) for b in blocks] == [3, 2, 1, 2, 1, 2]
    assert blocks[0].succs == [4, 1] and blocks[1].succs == [1, 2] and blocks[2].div_succs == [5]
    assert blocks[3].succs == [4, 4]
    live = sass.reachable(blocks)
    assert live == {0, 1, 2, 3, 4}  # the BRA.DIV fallback is not reached by converged warps
    loops = sass.find_loops(blocks, live)
    assert [(lp.head, lp.tail) for lp in loops] == [(1, 1)]
    assert sass.op_class("LDS.128") == "LDS" and sass.op_class("HMMA.16816.F32") == "MMA"
    assert sass.op_class("LDGSTS.E.BYPASS.128") == "LDGSTS" and sass.op_class("IADD3") == "ALU"
    assert banks.smem_width("LDS.128") == 16 and banks.smem_width("STS.U16") == 2 and banks.smem_width("LDS") == 4


def test_parse_ptxas():
    text = ("ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\nptxas info    : Function properties "
            "for _Z3fooPf\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 40 "
            "registers, used 1 barriers, 2048 bytes smem\nptxas info    : Compiling entry function '_Z3barPf' for "
            "'sm_90'\nptxas info    : Used 20 registers\n")
    assert toolchain.parse_ptxas(text, "3foo") == plan.Resources(40, 2048, 8, 4, 4)
    assert toolchain.parse_ptxas(text, "3bar") == plan.Resources(20, 0, 0, 0, 0)


def test_a_kernel_absent_from_the_tree_is_skipped(tmp_path):
    elsewhere = analysis.from_root(kernels.KERNELS[0], tmp_path)  # no plugins/ there
    assert not analysis.present(elsewhere) and analysis.present(kernels.KERNELS[0])


def test_missing_tools_are_named(monkeypatch, capsys):
    monkeypatch.setattr(toolchain, "find_wheel_tool", lambda name: (_ for _ in ()).throw(
        toolchain.ToolMissing(f"{name} not found: pip install the test extra")))
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: "/usr/bin/true")
    assert cli.main(["--out", "/nonexistent/x.json"]) == 2
    assert "nvdisasm not found" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- tiny kernel

TINY = r"""
#pragma once
__global__ void tinyKernel(float const* __restrict__ x, float* y, int tiles)
{
    __shared__ float s[512];
    float acc = 0.F;
    for (int t = 0; t < tiles; ++t) // KIVI_MODEL_LOOP(tile)
    {
        PRAGMA
        for (int u = threadIdx.x; u < 512; u += 128) // KIVI_MODEL_LOOP(fill)
        {
            s[u] = x[t * 512 + u]; // KIVI_MODEL_ANCHOR(fill)
        }
        __syncthreads();
        acc += s[(threadIdx.x * 32) % 512];
        __syncthreads();
    }
    y[threadIdx.x] = acc;
}
"""


def _tiny_spec(tmp_path: Path, pragma: str):
    (tmp_path / "tiny.cuh").write_text(TINY.replace("PRAGMA", pragma))
    return spec.KernelSpec(
        "tiny", "10tinyKernel", ("tiny.cuh",), "", 128,
        (spec.LoopSpec("tile", lambda c: 1, "BRA"), spec.LoopSpec("fill", lambda c: 4, "STS")), (), (),
        (spec.SmemAccess("tiny.cuh", "acc += s[(threadIdx.x * 32) % 512];", "LDS",
                       spec.lanes(lambda lane: (lane * 32) % 512 * 4), "stride 32 words"),
         spec.SmemAccess("tiny.cuh", "s[u] = x[t * 512 + u];", "STS", spec.lanes(lambda lane: lane * 4),
                         "consecutive")),
        lambda s: 2048, lambda s: 512, 1, include_dirs=(tmp_path,))


@pytest.mark.slow
@pytest.mark.parametrize("pragma", ["#pragma unroll 1", "#pragma unroll 2", ""])
def test_walker_counts_a_tiny_kernel(tmp_path, pragma):
    """Per tile and CTA (4 warps; 128 threads, so 4 iterations of the fill loop per thread): 16 warp-LDGs and 16 STS
    (one wavefront each), 2 barriers per warp -> 8, one LDS per warp at word (lane * 32) % 512 -> 16 words of bank 0
    -> 16 wavefronts each. nvcc's unrolled versions (a runtime remainder for an N it cannot see) are either counted
    exactly or refused with a message naming the loop -- never miscounted."""
    _tools_or_skip()
    results, _ = analysis.analyze([_tiny_spec(tmp_path, pragma)], ["sm_90"], jobs=1, work=tmp_path)
    ctx = spec.Ctx(shapes.MODELS["llama-3-8b"], True)
    try:
        tile, _rest = results[("tiny", "sm_90")].counts(ctx)
    except ValueError as exc:
        assert pragma != "#pragma unroll 1", exc  # the plain loop must be counted
        assert "loop fill" in str(exc)
        return
    assert tile.by_class["LDG"] == pytest.approx(16)
    assert tile.by_class["STS"] == pytest.approx(16)
    assert tile.by_class["LDS"] == pytest.approx(4)
    assert tile.by_class["BAR"] == pytest.approx(8)
    assert tile.wavefronts == pytest.approx(16 * 1 + 4 * 16)
    assert not tile.unmapped_smem


# ----------------------------------------------------------------------------------------------- today's kernels


SPLIT_DEFAULT = next(k for k in split.SPLIT_KERNELS if k.min_arch == 80)  # the default variant's kernel


@pytest.fixture(scope="module")
def sm90_results():
    _tools_or_skip()
    return analysis.analyze([*kernels.KERNELS, SPLIT_DEFAULT], archs=["sm_90"])


def _h200_records(results, versions):
    return predict.build_records(results, versions, gpus=["H200"])


@pytest.mark.slow
def test_calibration_against_the_hand_count(sm90_results):
    records = _h200_records(*sm90_results)
    cal = predict.calibration(records)
    assert {c["kernel"] for c in cal} == {"simt", "wmma"}
    for c in cal:
        for row in c["rows"]:
            assert row["within_tolerance"], (c["kernel"], row)


@pytest.mark.slow
def test_records_have_the_contract_fields(sm90_results):
    records = _h200_records(*sm90_results)
    names = {name for name, _ in sm90_results[0]}
    assert names == {s.name for s in kernels.KERNELS if analysis.present(s)} | {SPLIT_DEFAULT.name}
    on_default = [v for v in split.VARIANTS if v.kernel == "split" and v.id and split.kernel_of(v.id) == SPLIT_DEFAULT.name]
    assert len(records) == (len(names) - 1 + len(on_default)) * 2 * 3 * 3
    for r in records:
        assert {"gpu", "model", "batch", "context", "kernel", "default", "predicted_us", "fp16_us",
                "speedup_vs_fp16", "bound", "timing", "label", "resources", "zero_spills"} <= set(r)
        assert r["predicted_us"] > 0 and r["fp16_us"] > 0 and r["label"] == "static model, not a measurement"
        assert r["zero_spills"] is (r["resources"]["spill_stores"] == 0 and r["resources"]["spill_loads"] == 0)
        assert not r["per_tile"]["unmapped_smem"], r["per_tile"]["unmapped_smem"]
        if r["kernel"] in ("mma", SPLIT_DEFAULT.name):  # the calibrated timing, its limit and share of the ceiling
            assert r["bound"] in (*timing.CENTRES, "delay", "launch_and_combine")
            assert 0 < r["read_fraction"] < 1
            assert r["timing"].startswith("calibrated" if r["kernel"] == "mma" else "uncalibrated")
        if r["kernel"] == SPLIT_DEFAULT.name:
            assert set(r["timed"]["chunk_classes"]) == {"quantized", "tile_first", "tile"}
            continue
        assert {"ideal_us", "ideal_bound"} <= set(r) and r["ideal_bound"] in ("issue", "shared", "memory")
        if r["kernel"] == "mma":
            assert r["variant"] == "baseline" and set(r["timed"]["chunk_classes"]) == {"quantized", "full"}
        else:
            assert r["timing"].startswith("ideal") and r["predicted_us"] == r["ideal_us"]
        assert r["resources"]["cuobjdump"]["REG"] == r["resources"]["registers"]
        if r["gpu"] == "H200":  # the budget: <= 880 issue slots and ~220 wavefronts per 3,072-byte tile
            assert round(r["budget_per_tile_at_85pct_copy_bw"]["warp_instructions"], -1) == 880
            assert round(r["budget_per_tile_at_85pct_copy_bw"]["wavefronts"], -1) == 220
    for shape in {(r["model"], r["batch"], r["context"]) for r in records}:
        default = [r for r in records if (r["model"], r["batch"], r["context"]) == shape and r["default"]]
        assert len(default) == 1 and default[0]["variant"] == split.default_variant(
            shapes.GPUS["H200"], shapes.MODELS[shape[0]], shape[1])


def _headline(records: list[dict], **match) -> dict:
    return next(r for r in records if (r["gpu"], r["model"], r["batch"], r["context"]) == report.HEADLINE
                and all(r.get(k) == v for k, v in match.items()))


@pytest.mark.slow
def test_gate_judges_the_default_by_its_share_of_the_read_ceiling(sm90_results):
    """Memory-bound = reading at >= 80% of the read ceiling; a measurement of the default, where one exists, wins
    over the model."""
    records = _h200_records(*sm90_results)
    default = _headline(records, default=True)
    why = report.gate_default_memory_bound(records)
    assert (why is None) == (default["read_fraction"] >= report.MEMORY_BOUND_FRACTION)
    at = default["read_bytes"] / (default["read_ceiling_gbps"] * 1e3)  # us at the ceiling
    key = (*report.HEADLINE, default["variant"])
    assert report.gate_default_memory_bound(records, {key: at / 0.9}) is None
    slow = report.gate_default_memory_bound(records, {key: at / 0.5})
    assert slow is not None and "50% of the read ceiling" in slow and "measured" in slow
    fast = dict(default, predicted_us=at / 0.85)
    assert report.gate_default_memory_bound([fast]) is None
    assert "found 0" in report.gate_default_memory_bound([dict(default, default=False)])


@pytest.mark.slow
def test_the_gate_fails_the_measured_kernel(sm90_results):
    """The measured kernel read at 1.6 TB/s at Llama-3-8B, batch 8, 32K on an H200 whose streaming read sustained
    ~4.5: its measurement and the calibrated model alone both say it is not memory-bound."""
    records = _h200_records(*sm90_results)
    base = _headline(records, kernel="mma")
    measured = calibrate.measured_attention(calibrate.load_measurements())
    ok, why = report.read_verdict(base, measured[(*report.HEADLINE, "baseline")])
    assert not ok and "1.61 TB/s" in why and "measured" in why
    ok, why = report.read_verdict(base)
    assert not ok and base["bound"] == "issue", why
    as_default = [dict(r, default=r is base) for r in records]
    assert "'mma'" in report.gate_default_memory_bound(as_default)


@pytest.mark.slow
def test_ci_gate_fails_a_default_slower_than_the_measured_kernel(sm90_results):
    """The CI gate: the default variant at the headline shape must not be slower than the measured baseline kernel
    (127.8 us on the H200) -- its own measurement where one exists, else the calibrated model. It passes today's
    default (the model puts the split kernel below the baseline) and fails a default made slower, by measurement or
    by the model, and one with nothing to compare against."""
    records = _h200_records(*sm90_results)
    measured = calibrate.measured_attention(calibrate.load_measurements())
    base_us = measured[(*report.HEADLINE, "baseline")]
    default = _headline(records, default=True)
    assert default["predicted_us"] < base_us
    assert report.gate_default_no_regression(records, measured) is None
    key = (*report.HEADLINE, default["variant"])
    slower = report.gate_default_no_regression(records, {**measured, key: base_us * 1.1})
    assert slower is not None and "slower than the measured baseline" in slower and "measured" in slower
    modelled = [dict(r, predicted_us=base_us * 1.2) if r is default else r for r in records]
    assert "model" in report.gate_default_no_regression(modelled, measured)
    assert "no committed measurement" in report.gate_default_no_regression(records, {})


@pytest.fixture(scope="module")
def h200_setup(sm90_results):
    return calibrate.setup_for(sm90_results[0][("mma", "sm_90")], shapes.GPUS["H200"])


@pytest.mark.slow
def test_calibrated_model_within_tolerance_of_every_measurement(h200_setup):
    """Every committed H200 timing (18 shapes x the measured kernel over KIVI-2, the same kernel over FP16, torch
    SDPA) within 25% of the model with the committed constants; the committed calibration file is this model's."""
    ms = calibrate.load_measurements()
    assert len(ms) == 54 and len({calibrate.shape_of(m) for m in ms}) == 18
    doc = json.loads(calibrate.CALIBRATION_OUT.read_text())
    committed = {(r["model"], r["batch"], r["context"], r["kernel"]): r for r in doc["records"]}
    assert len(committed) == len(ms)
    for m in ms:
        p = calibrate.predict_us(m, constants.FITTED, h200_setup)
        assert abs(p / m.measured_us - 1) <= calibrate.TOLERANCE, (m, p)
        rec = committed[(m.model, m.batch, m.context, m.kernel)]
        assert {"gpu", "model", "batch", "context", "kernel", "predicted_us", "measured_us"} <= set(rec)
        assert rec["gpu"] == m.gpu and rec["measured_us"] == pytest.approx(m.measured_us, abs=0.01)
        assert rec["predicted_us"] == pytest.approx(p, rel=0.005), rec
    assert {c["name"]: c["value"] for c in doc["constants"]} == {
        n: getattr(constants.FITTED, n) for n in ("launch_us", "latency_us", "issue_ipc", "line_cycles", "split_us",
                                                  "read_gbps", "sdpa_us")}


@pytest.mark.slow
def test_the_fit_reproduces_the_committed_constants(h200_setup):
    k = calibrate.fit(calibrate.load_measurements(), h200_setup)
    for name in dataclasses.asdict(k):
        assert getattr(k, name) == pytest.approx(getattr(constants.FITTED, name), rel=0.01), name


@pytest.mark.slow
@pytest.mark.parametrize("train", list(shapes.MODELS))
def test_a_fit_to_one_model_predicts_the_other(h200_setup, train):
    """Held out: the constants fitted to one model's 9 shapes predict the other model's 27 timings within 25%."""
    ms = calibrate.load_measurements()
    k = calibrate.fit([m for m in ms if m.model == train], h200_setup)
    for m in ms:
        if m.model != train:
            p = calibrate.predict_us(m, k, h200_setup)
            assert abs(p / m.measured_us - 1) <= calibrate.TOLERANCE, (m, p)


@pytest.mark.slow
def test_the_split_kernels_classes_from_the_sass(sm90_results):
    """The split kernel: a quantized chunk with stages - 1 in flight and no serial round trip; full-precision 16-key
    tiles staged by cp.async (no per-lane line), the first prefetched, each later one a round trip."""
    res = sm90_results[0][(SPLIT_DEFAULT.name, "sm_90")]
    c = split.split_classes(res, shapes.MODELS["llama-3-8b"])
    assert c["quantized"].in_flight == SPLIT_DEFAULT.stages // 4 - 1 and c["quantized"].round_trips == 0
    assert c["quantized"].instructions == res.counts(spec.Ctx(shapes.MODELS["llama-3-8b"], True))[0].instructions
    assert c["tile"].round_trips == 1 and c["tile_first"].round_trips == 0
    assert c["tile"].lines == c["tile_first"].lines == 0 and c["tile"].bytes == 16 * 128 * 2 * 2
    assert 0 < c["tile"].instructions <= c["tile_first"].instructions


@pytest.mark.slow
def test_the_full_precision_chunk_from_the_sass(sm90_results):
    """The measured kernel's full-precision chunk: 2 x 16-key tiles, each 8 score blocks of 4 per-lane 32-bit loads
    (8 rows x 16 B: 8 lines) and 8 value blocks of 4 pairs of 16-bit loads (4 rows x 16 B: 4 lines); it waits for
    its loads in series a few times and costs more instructions than a quantized chunk."""
    res = sm90_results[0][("mma", "sm_90")]
    ctx = spec.Ctx(shapes.MODELS["llama-3-8b"], True)
    fc = fullprec.full_chunk(res, ctx)
    assert fc.loads == 2 * (8 * 4 + 8 * 4 * 2)
    assert fc.lines == 2 * (8 * 4 * 8 + 8 * 4 * 2 * 4)
    assert 2 <= fc.round_trips <= 2 * (8 + 8 * 2)
    assert fc.instructions > res.counts(ctx)[0].instructions


@pytest.mark.slow
def test_two_runs_are_equal(sm90_results):
    """A second compile + disassembly + walk of the default kernel gives byte-identical records."""
    again = analysis.analyze(specs=[kernels.KERNELS[0]], archs=["sm_90"])
    first = {k: v for k, v in sm90_results[0].items() if k[0] == kernels.KERNELS[0].name}
    a = json.dumps(_h200_records(first, sm90_results[1]), sort_keys=True)
    b = json.dumps(_h200_records(*again), sort_keys=True)
    assert a == b


# ----------------------------------------------------------------------------------------------- the append kernel


@pytest.mark.slow
def test_append_model_records_and_gate():
    """kiviAppendKernel (the quantize-and-store path of a prefill chunk): one record per (GPU, model, batch, chunk),
    every executed shared-memory access mapped, no spills, no untagged loop on the path, and the gate follows the
    records' fraction of copy bandwidth (the target: >= 80% for chunks of >= 4K tokens)."""
    _tools_or_skip()
    results, versions = analysis.analyze(append.APPEND_KERNELS, ["sm_90"], jobs=1)
    records = append.append_records(results, versions)
    h200 = [r for r in records if r["gpu"] == "H200"]
    assert len(h200) == len(shapes.MODELS) * len(append.APPEND_BATCHES) * len(append.APPEND_CHUNKS)
    for r in h200:
        assert r["label"] == "static model, not a measurement" and r["bound"] in ("issue", "shared", "memory")
        assert r["zero_spills"] and r["per_group"]["bytes"] == append.append_group_bytes(shapes.MODELS[r["model"]])
        assert not r["per_group"]["unmapped_smem"], r["per_group"]["unmapped_smem"]
        assert not r["per_cta_outside_group_loop"]["untagged_loops_counted_once"]
        assert 0 < r["fraction_of_copy_bw"] <= 1.0 and r["predicted_us"] >= r["copy_bw_us"]
    worst = min((r for r in h200 if r["chunk"] >= 4096), key=lambda r: r["fraction_of_copy_bw"])
    why = report.gate_append(h200)
    assert (why is None) == (worst["fraction_of_copy_bw"] >= append.APPEND_MIN_FRACTION)
    assert "of copy bandwidth" in report.gate_append([dict(worst, fraction_of_copy_bw=0.5)])
    assert report.gate_append([dict(worst, fraction_of_copy_bw=0.9)]) is None
