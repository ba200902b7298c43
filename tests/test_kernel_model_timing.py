"""tools/kernel_model's timing model (timing.py, decode.py, fullprec.py, split.py): the queueing arithmetic, the phases
of an SM, waves and launches, the measured kernel's and the split kernel's warp assignments, the round-trip walker and
the L1 line count. CPU only, no compiler.

Oracles: closed-network results that hold exactly (one warp alone takes its delay plus its demands; W warps on one
centre with no delay share it, W x D per item -- processor sharing; throughput never exceeds the bottleneck's 1 / D,
an item never takes less than alone); Little's law for items in flight; the streaming contract's n_q(T) from
trtllm_kivi.format; the key ranges of kiviDecodeMma.cuh's warp assignment recomputed from its definition; the split
kernel's tiles counted from the window's length.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from trtllm_kivi.format import KiviConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tools/ is the repository's, not the installed package's
    sys.path.insert(0, str(ROOT))
from tools.kernel_model import decode, fullprec, plan, shapes, split, timing  # noqa: E402
from tools.kernel_model.sass import Instr  # noqa: E402

M = timing.Machine(sms=4, clock_ghz=1.0)  # 1000 cycles per us
K = timing.Constants(launch_us=2.0, latency_us=0.5, issue_ipc=1.0, line_cycles=1.0, split_us=0.25,
                     read_gbps=4.0 * 1024, sdpa_us=0.0)


def _issue_only(instructions: float) -> timing.ChunkClass:
    """An item that only issues: D = instructions / (IPC x clock) = instructions / 1000 us, no delay."""
    return timing.ChunkClass("c", instructions, 0.0)


def test_one_warp_alone_takes_its_delay_plus_its_demands():
    c = timing.ChunkClass("c", 400.0, 1024.0, lines=100.0, round_trips=3.0)
    d, z = timing.demands(c, K, M)
    assert d == pytest.approx([0.4, 1024.0 / (4.0 * 1024 * 1e3 / 4), 0.1])
    assert z == pytest.approx(1.5)
    r, _ = timing.periods({"c": 1}, {"c": c}, K, M)["c"]
    assert r == pytest.approx(z + sum(d))


@pytest.mark.parametrize("warps", [1, 2, 5, 12])
def test_warps_on_one_centre_share_it(warps):
    """No delay, one centre: processor sharing, each item takes W x D."""
    r, _ = timing.periods({"c": warps}, {"c": _issue_only(300.0)}, K, M)["c"]
    assert r == pytest.approx(warps * 0.3, rel=1e-6)


def test_bottleneck_and_alone_bounds_hold():
    rng = random.Random(7)
    for _ in range(50):
        c = timing.ChunkClass("c", rng.uniform(100, 2000), rng.uniform(0, 20000), lines=rng.uniform(0, 1000),
                              round_trips=rng.randint(0, 10), in_flight=rng.choice([0, 2, 3]))
        w = rng.randint(1, 16)
        d, z = timing.demands(c, K, M)
        r, _ = timing.periods({"c": w}, {"c": c}, K, M)["c"]
        assert r >= z + sum(d) - 1e-9  # never faster than alone
        assert w / r <= 1.0 / max(d) + 1e-9  # throughput <= the bottleneck's
        assert r <= z + w * sum(d) + 1e-9  # never slower than queueing behind every other warp at every centre


def test_littles_law_sets_a_pipelined_items_delay():
    """n items in flight: a warp waits L / n per item -- plus its own compute when it refills only after it."""
    own = 200.0 / (M.clock_ghz * 1e3)
    for n in (1, 2, 3):
        _, z = timing.demands(timing.ChunkClass("q", 200.0, 0.0, in_flight=n), K, M)
        assert z == pytest.approx(max(own, K.latency_us / n))
        _, z = timing.demands(timing.ChunkClass("q", 200.0, 0.0, in_flight=n, refill_after_compute=True), K, M)
        assert z == pytest.approx(max(own, (own + K.latency_us) / n))


def test_an_sm_runs_contended_then_alone():
    """Two warps sharing one centre (no delay): the short one's n items take 2nD each side; the long one's last n
    run alone at D: 3nD in all, plus one latency (the pipeline fill)."""
    classes = {"c": _issue_only(100.0)}
    n = 5.0
    t = timing.sm_time([(("c", n),), (("c", 2 * n),)], classes, K, M)
    assert t["us"] == pytest.approx(3 * n * 0.1 + K.latency_us)
    assert t["residence_us"]["issue"] == pytest.approx(3 * n * 0.1)


def test_waves_launches_and_combine_add_up():
    classes = {"c": _issue_only(100.0)}
    cta = ((("c", 4.0),),)
    one = timing.step_time(timing.Step([cta] * M.sms, 1, 3, 0), classes, K, M)
    two = timing.step_time(timing.Step([cta] * (2 * M.sms), 1, 3, 6), classes, K, M)
    body = 4 * 0.1 + K.latency_us
    assert one["us"] == pytest.approx(3 * K.launch_us + body)
    assert [w["ctas_per_sm"] for w in two["waves"]] == [1, 1]
    assert two["us"] == pytest.approx(3 * K.launch_us + 2 * body + 6 * K.split_us)
    assert one["bound"] == "launch_and_combine"  # 6 us of launches against 0.9 us of work


@pytest.mark.parametrize("past", [0, 127, 128, 159, 160, 4095, 32767, 131071])
def test_quantized_keys_follow_the_streaming_contract(past):
    assert decode.quantized_keys(past, 128) == KiviConfig().num_quantized(past)


@pytest.mark.parametrize("model", list(shapes.MODELS))
@pytest.mark.parametrize("batch,context", [(1, 4096), (1, 131072), (8, 32768), (32, 4096)])
def test_the_measured_kernels_warps_take_contiguous_ranges(model, batch, context):
    """Every key of a (sequence, KV head) is in exactly one warp's range, the quantized ones first; ranges are
    ceil(chunks / 4) long, so the window's chunks land on one or two warps at the end of the last split."""
    shape = shapes.MODELS[model]
    st = decode.baseline_step(shape, batch, context, context - 1, decode.KIVI2, 3, 132)
    p = plan.mma_launch_plan(shape, batch, context, 132, context, 3)
    splits = st.ctas[::p.num_tiles * shape.num_kv_heads]
    length = p.seq_split_len
    assert len(splits) == -(-context // length)
    q = sum(n for cta in splits for warp in cta for cls, n in warp if cls == "quantized")
    f = sum(n for cta in splits for warp in cta for cls, n in warp if cls == "full")
    assert q == decode.quantized_keys(context - 1, 128) // 32
    assert q + f == sum(-(-min(length, context - z * length) // 32) for z in range(len(splits)))
    for cta in splits:
        per = -(-sum(n for warp in cta for _, n in warp) // 4)
        assert all(sum(n for _, n in warp) <= per for warp in cta)
        kinds = [cls for warp in cta for cls, n in warp for _ in range(int(n))]
        assert kinds == sorted(kinds, key=lambda c: c == "full")  # key order: the quantized chunks, then the window
    assert all(dict(warp)["full"] == 0 for cta in splits[:-1] for warp in cta)
    assert dict(splits[-1][-1])["full"] > 0  # the last warp of the last split holds window chunks
    assert st.combined_splits == (len(splits) if len(splits) > 1 else 0)


def _ins(opcode: str, operands: str) -> tuple[Instr, float]:
    return Instr(0, "", opcode, operands, ()), 1.0


def test_round_trips_count_waits_on_outstanding_loads():
    path = [_ins("LDG.E", "R4, desc[UR4][R2.64]"), _ins("LDG.E", "R6, desc[UR4][R2.64+0x10]"),
            _ins("IADD3", "R9, R1, 0x4, RZ"),  # reads no load: no wait
            _ins("FADD", "R8, R4, R6"),  # waits for both (one round trip)
            _ins("LDG.E.64", "R10, desc[UR4][R2.64+0x20]"),
            _ins("HMMA.16816.F32", "R12, R16, R11, R12"),  # reads R11 = the .64 load's high half
            _ins("LDG.E", "R20, desc[UR4][R2.64+0x40]"), _ins("MOV", "R20, RZ"),  # overwritten: never waited for
            _ins("STG.E", "desc[UR4][R2.64], R20")]
    assert fullprec.round_trips(path) == 2


def test_lines_touched_by_a_warp_wide_load():
    assert fullprec.lines_touched([4 * lane for lane in range(32)], 4) == 1  # 128 contiguous bytes
    assert fullprec.lines_touched([(lane // 4) * 256 + 4 * (lane % 4) for lane in range(32)], 4) == 8
    assert fullprec.lines_touched([2 * (lane % 4) * 256 + 2 * (lane // 4) for lane in range(32)], 2) == 4
    assert fullprec.lines_touched([126 + 0 * lane for lane in range(32)], 4) == 2  # one word across a line end
    assert fullprec.lines_touched([None] * 32, 4) == 0


@pytest.mark.parametrize("model", list(shapes.MODELS))
@pytest.mark.parametrize("batch,context", [(1, 4096), (8, 32768), (32, 131072)])
@pytest.mark.parametrize("vid", [v.id for v in split.VARIANTS if v.kernel == "split" and v.id])
def test_split_variants_spread_the_window(model, batch, context, vid):
    """The split kernel's step: every quantized chunk once; the window's 16-key tiles spread over the splits and, in
    each, over warps 3 and 2 (no warp holds more than its share); fused variants launch once."""
    shape = shapes.MODELS[model]
    st = split.split_step(shape, batch, context, context - 1, vid, 3, 132)
    nq = decode.quantized_keys(context - 1, 128)
    per_split = len(st.ctas) // max(st.combined_splits, 1)
    splits = st.ctas[::per_split]
    total = {c: sum(n for cta in splits for warp in cta for cls, n in warp if cls == c)
             for c in ("quantized", "tile_first", "tile")}
    assert total["quantized"] == nq // 32
    tiles = -(-(context - nq) // 16)
    assert total["tile_first"] + total["tile"] == tiles
    assert all(dict(warp)["tile_first"] + dict(warp)["tile"] == 0 for cta in splits for warp in cta[:2])
    most = max(dict(warp)["tile_first"] + dict(warp)["tile"] for cta in splits for warp in cta)
    assert most == -(-tiles // (2 * len(splits)))
    assert st.launches == (1 if split.VARIANTS[vid].fused else 3)
