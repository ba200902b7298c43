"""The GPU scripts and benchmarks plan and dry-run on the CPU, so they cannot rot between GPU runs.

build_scripts/gpu_check.sh and gpu_tune.sh with --dry-run (argument checks, which library, each part's budget, the
planned runs) and every benchmark's --dry-run run here without a GPU and without importing torch; their plan
(benchmarks/gpu_plan.py) is checked against independent oracles: format.py's n_q(T) for flush steps, the byte counts
the earlier H200 run recorded, the L2 rotation rule, every variant at every shape within the budget. The winner tool
(benchmarks/plan_winners.py) and the ncu CSV parsers run on small hand-written inputs (a fake variant list plans only:
nothing measured is faked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_kivi.format import KiviConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_plan  # noqa: E402
import plan_winners  # noqa: E402

FAKE_VARIANTS = [{"id": i, "name": n, "tunables": {}} for i, n in
                 enumerate(("auto", "baseline", "split", "split-s3", "split-s6", "split-1wave", "split-unfused"))]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRTLLM_KIVI_KERNELS_LIB", "KIVI_GPU_ARCH", "OUT")}
    env["PYTHON"] = sys.executable
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)


def test_gpu_check_dry_run_plans_tests_and_the_headline_sweep():
    res = run_script("build_scripts/gpu_check.sh", "--dry-run", "--gpu", "h200")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    tests = out.split("1. tests:")[1].split("\n")[0].split("-m gpu ")[1].split(" (")[0].split()
    assert tests and all((ROOT / t).is_file() for t in tests), tests  # every listed GPU test file exists
    assert "tests/test_decode_variants_gpu.py" in tests and "tests/test_stream_read.py" in tests
    assert "bench_kernels --headline" in out and "assumed GPU h200" in out
    for model, batch, ctx in gpu_plan.HEADLINE:
        assert f"model={model} batch={batch} context={ctx}" in out
    assert "batch=32" not in out  # the check times the headline shapes only


def test_gpu_tune_dry_run_plans_every_part_within_its_budget():
    res = run_script("build_scripts/gpu_tune.sh", "--dry-run")
    assert res.returncode == 0, res.stderr
    heads = [line for line in res.stdout.splitlines() if line.startswith("== ") and "runs planned" in line]
    assert [h.split()[1] for h in heads] == ["bench_kernels", "bench_prefill", "bench_e2e_gpu", "ncu_profile"]
    budgets = res.stdout.split("budgets: ")[1].split("\n")[0]
    assert "sweep 100 s" in budgets and "total <= 290 s" in budgets


@pytest.mark.parametrize("args,message", [
    (("--bogus",), "unknown argument '--bogus'"),
    (("--dry-run", "--library", "no/such/lib.so"), "--library no/such/lib.so does not exist"),
    (("--dry-run", "--gpu", "a100"), "--gpu a100: h100 or h200"),
    (("--gpu",), "--gpu needs a value"),
])
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_tune.sh"])
def test_scripts_refuse_bad_arguments_by_name(script, args, message):
    res = run_script(f"build_scripts/{script}", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_benchmark_dry_runs_import_no_torch(tmp_path):
    """Each benchmark's --dry-run prints its plan with the standard library alone (fast, runs anywhere)."""
    fake = tmp_path / "variants.json"
    fake.write_text(json.dumps(FAKE_VARIANTS))
    code = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]
import bench_kernels, bench_prefill, bench_e2e_gpu, ncu_profile
assert bench_kernels.main(["--dry-run", "--variants-json", {str(fake)!r}]) == 0
assert bench_prefill.main(["--dry-run", "--gpu", "h200"]) == 0
assert bench_e2e_gpu.main(["--dry-run"]) == 0
assert ncu_profile.main(["--dry-run"]) == 0
assert "torch" not in sys.modules, "a dry run imported torch"
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "fake list variants.json (planning only)" in res.stdout
    assert res.stdout.count("split-unfused:attention@flush") == 18  # every variant at every shape
    assert "== bench_prefill: 45 runs planned" in res.stdout
    assert "fp16_decode" in res.stdout and "kivi2_max_batch@32k" in res.stdout


def test_a_fake_variant_list_never_reaches_a_gpu_run(tmp_path):
    fake = tmp_path / "v.json"
    fake.write_text(json.dumps(FAKE_VARIANTS))
    code = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]
import bench_kernels
bench_kernels.main(["--variants-json", {str(fake)!r}])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--variants-json plans a dry run only" in res.stderr


@pytest.mark.parametrize("cfg", [KiviConfig(), KiviConfig(residual_length=32, group_size=64, block_size=128),
                                 KiviConfig(sink_tokens=4)])
def test_flush_and_nonflush_steps_follow_the_format(cfg):
    """A step from past to past + 1 flushes iff n_q grows (format.KiviConfig.num_quantized)."""
    for past in range(0, 700):
        assert gpu_plan.is_flush_step(cfg, past) == (cfg.num_quantized(past + 1) > cfg.num_quantized(past)), past
    for ctx in gpu_plan.CONTEXTS:
        f, n = gpu_plan.flush_past(cfg, ctx), gpu_plan.nonflush_past(cfg, ctx)
        assert gpu_plan.is_flush_step(cfg, f) and not gpu_plan.is_flush_step(cfg, n) and ctx - cfg.group_size <= f
    assert gpu_plan.flush_past(KiviConfig(), 4096) == 4095  # R - 1 mod G, as the earlier runs timed


def test_decode_bytes_are_what_the_earlier_gpu_run_counted():
    runs = [p for p in (ROOT / "benchmarks" / "results").glob("bench_kernels_*.json")
            if json.loads(p.read_text()).get("decode")]
    if not runs:
        pytest.skip("no committed bench_kernels result with decode rows")
    cfg = KiviConfig()
    checked = 0
    for path in runs:
        for r in json.loads(path.read_text())["decode"]:
            rd, wr = gpu_plan.kivi_decode_bytes(cfg, r["heads"], r["kv_heads"], r["head_dim"], r["batch"],
                                                r["context"] - 1)
            assert rd + wr == r["kivi_attention"]["bytes"], (path.name, r["model"], r["batch"], r["context"])
            if "sdpa_fp16" in r:
                assert gpu_plan.fp16_decode_bytes(r["kv_heads"], r["head_dim"], r["batch"], r["context"]) \
                    == r["sdpa_fp16"]["bytes"]
            checked += 1
    assert checked >= 1


def test_rotation_reads_more_than_twice_the_l2():
    l2 = 50 << 20
    for nbytes in (1 << 10, 3_694_592, 16 << 20, 25_714_688, 205_717_504):
        c = gpu_plan.rotation_copies(nbytes, l2)
        assert c * nbytes > 2 * l2 or c == gpu_plan.MAX_COPIES
        assert c == 1 or (c - 1) * nbytes <= 2 * l2  # no more copies than needed
    assert gpu_plan.rotation_copies(3_694_592, l2, "warm") == 1


def test_every_variant_at_every_shape_fits_the_sweep_budget():
    runs = gpu_plan.decode_plan(FAKE_VARIANTS, gpu_plan.ASSUMED_GPUS["h100"])
    kept, cut = gpu_plan.fit_budget(runs, 100.0)
    timed = {(r.name, tuple(r.shape.values())) for r in kept if ":" in r.name}
    assert len(timed) == len(FAKE_VARIANTS) * 4 * 18  # 4 timings per variant and shape
    assert all(r.skip for r in cut), [r.name for r in cut if not r.skip]  # only memory skips, nothing over budget


def test_the_library_accepts_every_variant_at_every_planned_shape():
    """The built library's host checks (kiviCValidate, the launch plan) of every variant's decode step at every shape
    the sweep times, flush and non-flush: none refused, an explicit variant runs as itself, auto resolves to one."""
    from trtllm_kivi.cuda import _abi

    path = _abi.find_library()
    if path is None:
        pytest.skip(f"kernel library not built (tried {', '.join(map(str, _abi.library_candidates()))})")
    variants, source = gpu_plan.load_variants(path)
    if source != "library":
        pytest.skip(f"{path}: {source}")
    checks = gpu_plan.param_checks(path, variants, headline_only=False)
    assert len(checks) == len(variants) * 18 * 2
    assert [c for c in checks if "refused" in c] == []
    ids = {v["name"]: v["id"] for v in variants}
    for c in checks:
        if "decode_variant" in c:
            assert c["decode_variant"] == ids[c["variant"]] or (ids[c["variant"]] == 0 and c["decode_variant"] > 0), c


def _row(model, batch, ctx, times):
    h, hkv, d = gpu_plan.MODELS[model]
    return {"model": model, "heads": h, "kv_heads": hkv, "head_dim": d, "batch": batch, "context": ctx,
            "variants": [{"id": i, "name": FAKE_VARIANTS[i]["name"], "step_amortized_ms": t,
                          "attention_flush": {"median_ms": t * 0.8}} for i, t in times.items()]}


def test_plan_winners_picks_the_geomean_best_per_class(tmp_path):
    sweep = {"benchmark": "bench_kernels", "machine": {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132,
                                                       "compute_capability": "9.0"},
             "decode": [_row("llama-3-8b", 1, 4096, {0: 0.001, 1: 0.040, 2: 0.030, 3: 0.020}),  # few_ctas
                        _row("llama-3-8b", 1, 32768, {0: 0.001, 1: 0.060, 2: 0.050, 3: 0.055}),
                        _row("llama-2-7b", 32, 4096, {0: 0.3, 1: 0.5, 2: 0.4}),  # many_ctas; 3 not measured
                        _row("llama-2-7b", 8, 32768, {0: 0.3, 1: 0.9, 2: 0.7, 3: 0.6})]}
    w = plan_winners.winners(sweep, source="sweep.json")
    assert w["few_ctas"]["variant"] == 3  # 0.020/0.020 and 0.055/0.050: geomean 1.049 < variant 2's 1.225
    assert w["many_ctas"]["variant"] == 2  # variant 3 is missing at one shape: it does not compete
    assert w["mixed"] == {"measured": False}
    assert w["few_ctas"]["plan_row"].startswith("{90, 132, 132, kKIVI_SHAPE_FEW_CTAS, 3}, // measured: NVIDIA H100")
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    assert plan_winners.main([str(path), "--out", str(tmp_path / "w.json")]) == 0
    assert json.loads((tmp_path / "w.json").read_text())["many_ctas"]["name"] == "split"


def test_ncu_pages_parse_into_kernels_and_sass_regions():
    import ncu_profile

    raw = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_read.sum.per_second",'
           '"sm__inst_executed.avg.per_cycle_active","sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",'
           '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
           '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\n'
           '"","","nsecond","byte","byte/second","inst/cycle","%","",""\n'
           '"0","kiviDecodeKernel","127800","205717504","1609683130000","1.92","35.5","4.2","0.7"\n')
    k = ncu_profile.parse_raw(raw)[0]
    assert k["kernel"] == "kiviDecodeKernel" and k["duration_ns"] == 127800 and k["ipc_active"] == 1.92
    assert abs(k["dram_read_gbps"] - 1609.68313) < 1e-6 and k["pipes_pct"] == {"lsu": 35.5}
    assert list(k["top_stalls"]) == ["long_scoreboard", "barrier"]
    src = ('"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
           '"0x00","LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]","5","4"\n"0x10","BAR.SYNC 0x0","40","40"\n'
           '"0x20","HMMA.16816.F32 R4, R8, R12, R4","5","1"\n"0x30","@P0 BRA 0x00","45","30"\n')
    regions = ncu_profile.parse_source(src)
    assert [(g["start"], g["end"], g["samples"]) for g in regions] == [("0x20", "0x30", 50.0), ("0x00", "0x10", 45.0)]
    assert regions[0]["opcodes"] == {"HMMA": 1, "BRA": 1} and abs(sum(g["share"] for g in regions) - 1) < 1e-9
