"""The calibrated timing of a decode step (a MODEL, not a measurement): warps, SMs, waves, launches.

A warp's work is a sequence of items of a few classes (ChunkClass: a 32-key quantized chunk, a 32-key full-precision
chunk read per lane from global memory, a 16-key full-precision tile staged by cp.async), each described by what the
SASS and the launch plan say about it: executed warp-instructions, device bytes, L1 lines of per-lane global loads,
global-load round trips waited for in series, items in flight. An SM is a closed queueing network: its resident
warps loop over their items; an item of class c spends Z_c in a delay (latency nothing else on the SM hides for it)
and D_c,k in three shared centres -- the SM's issue (instructions / (sustained IPC x clock)), its share of the read
ceiling (bytes / (read ceiling / SMs)) and its L1 tag stage (lines x cycles per line / clock). Mean-value analysis
(Schweitzer's approximation for several classes) gives each class's time per item at the current population; an SM
is simulated phase by phase (the population changes when a warp finishes or turns to another class), so the window
chunks of the one warp that holds them run contended while the others still stream, and alone after. A wave of CTAs
takes its busiest SM's last warp; a step adds its launches and the split combine. The constants (Constants) are fitted
to GPU measurements by calibrate.py; README.md states each with its value and meaning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

CENTRES = ("issue", "memory", "l1_lines")


@dataclass(frozen=True)
class Constants:
    """The fitted constants (their values: calibrate.FITTED; what each means and how it was fitted: README.md)."""
    launch_us: float  # per kernel of a step inside a CUDA graph: the launch gap plus a tiny kernel's own run
    latency_us: float  # one device-memory round trip under load (L)
    issue_ipc: float  # sustained warp-instructions per clock per SM while every resident warp streams
    line_cycles: float  # L1 cycles per 128-byte line one warp-wide per-lane global load touches
    split_us: float  # the combine's time per split of a (token, head): its serial loop over the partials
    read_gbps: float  # the read ceiling: GB/s a streaming read sustains (torch SDPA's fitted rate, same run)
    sdpa_us: float  # torch SDPA's fixed time per call


@dataclass(frozen=True)
class ChunkClass:
    """One warp's unit of work (per item)."""
    name: str
    instructions: float  # executed warp-instructions (SASS)
    bytes: float  # device bytes read
    lines: float = 0.0  # L1 lines touched by per-lane global loads (0: staged by cp.async)
    round_trips: float = 0.0  # global-load round trips waited for in series (fullprec.round_trips)
    in_flight: float = 0.0  # items the warp keeps in flight while it computes one (cp.async stages); 0: none
    refill_after_compute: bool = False  # the refill of a stage is issued after the item's compute


@dataclass(frozen=True)
class Machine:
    sms: int
    clock_ghz: float


def demands(c: ChunkClass, k: Constants, m: Machine) -> tuple[list[float], float]:
    """([issue, memory, L1-lines] service demands in us, delay Z in us) of one item. Little's law sets the delay of
    a pipelined item: with n items in flight a warp waits L / n per item (plus its own compute when the refill is
    issued only after it), and never less than its own issue time at one instruction per clock."""
    f = m.clock_ghz * 1e3  # cycles per us
    d = [c.instructions / (k.issue_ipc * f), c.bytes / (k.read_gbps * 1e3 / m.sms), c.lines * k.line_cycles / f]
    own = c.instructions / f
    z = c.round_trips * k.latency_us
    if c.in_flight > 0:
        z += max(own, ((own if c.refill_after_compute else 0.0) + k.latency_us) / c.in_flight)
    return d, z


def periods(pop: dict[str, int], classes: dict[str, ChunkClass], k: Constants, m: Machine,
            iters: int = 60) -> dict[str, tuple[float, list[float]]]:
    """Time per item of each class with pop[c] warps on class c, and its residence per centre (approximate MVA)."""
    live = [c for c, n in pop.items() if n > 0]
    dz = {c: demands(classes[c], k, m) for c in live}
    q = {c: [0.0] * len(CENTRES) for c in live}
    out: dict[str, tuple[float, list[float]]] = {}
    for _ in range(iters):
        tot = [sum(q[c][j] for c in live) for j in range(len(CENTRES))]
        for c in live:
            d, z = dz[c]
            rk = [d[j] * (1.0 + tot[j] - q[c][j] / pop[c]) for j in range(len(CENTRES))]
            r = z + sum(rk)
            q[c] = [pop[c] / r * v for v in rk]
            out[c] = (r, rk)
    return out


Work = tuple[tuple[str, float], ...]  # one warp's items in order: (class, count)


def sm_time(warps: Sequence[Work], classes: dict[str, ChunkClass], k: Constants, m: Machine) -> dict:
    """One SM running `warps` to completion: phases of constant population. Each warp pays one latency first (its
    pipeline fill). Returns the time and the residence per centre / delay accumulated by the last warp to finish."""
    items = [[it for it in w if it[1] > 0] for w in warps]
    seg = [0] * len(items)
    left = [w[0][1] if w else 0.0 for w in items]
    busy = {name: 0.0 for name in (*CENTRES, "delay")}
    now = 0.0
    while any(seg[i] < len(items[i]) for i in range(len(items))):
        active = [i for i in range(len(items)) if seg[i] < len(items[i])]
        pop = Counter(items[i][seg[i]][0] for i in active)
        per = periods(dict(pop), classes, k, m)
        step = min(left[i] * per[items[i][seg[i]][0]][0] for i in active)
        last = max(active, key=lambda i: (sum(n for _, n in items[i][seg[i]:]), i))
        r, rk = per[items[last][seg[last]][0]]
        for j, name in enumerate(CENTRES):
            busy[name] += step * rk[j] / r
        busy["delay"] += step * (r - sum(rk)) / r
        for i in active:
            left[i] -= step / per[items[i][seg[i]][0]][0]
            if left[i] <= 1e-9:
                seg[i] += 1
                left[i] = items[i][seg[i]][1] if seg[i] < len(items[i]) else 0.0
        now += step
    fill = k.latency_us if any(items) else 0.0
    busy["delay"] += fill
    return {"us": now + fill, "residence_us": busy}


@dataclass(frozen=True)
class Step:
    """A decode step as the model sees it: the attention CTAs in launch order (each: its warps' work), resident CTAs
    per SM, kernel launches, and the splits the combine merges per (token, head) (0: no combine)."""
    ctas: Sequence[tuple[Work, ...]]
    ctas_per_sm: int
    launches: int
    combined_splits: int


def step_time(st: Step, classes: dict[str, ChunkClass], k: Constants, m: Machine) -> dict:
    """Launches + the waves (each: its busiest SM, the heaviest CTA kind with the wave's most common kind beside it
    on the SM's other slots) + the combine."""
    slots = st.ctas_per_sm * m.sms
    waves = []
    for w0 in range(0, len(st.ctas), slots):
        wave = list(st.ctas[w0:w0 + slots])
        per_sm = -(-len(wave) // m.sms)
        kinds = Counter(wave)
        common = kinds.most_common(1)[0][0]
        worst = max((sm_time(list(cta) + [w for _ in range(per_sm - 1) for w in common], classes, k, m)
                     for cta in kinds), key=lambda r: r["us"])
        waves.append({"ctas": len(wave), "ctas_per_sm": per_sm, **worst})
    combine = k.split_us * st.combined_splits if st.combined_splits > 1 else 0.0
    launch = st.launches * k.launch_us
    total = launch + sum(w["us"] for w in waves) + combine
    limit = {name: sum(w["residence_us"][name] for w in waves) for name in (*CENTRES, "delay")}
    limit["launch_and_combine"] = launch + combine
    return {"us": total, "waves": waves, "launch_us": launch, "combine_us": combine, "time_by_limit_us": limit,
            "bound": max(limit, key=lambda x: limit[x])}
