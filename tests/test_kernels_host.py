"""Host side of the KIVI kernels without a GPU: the validation messages, the ctypes ABI mirror and the launch plan.

The host-only part of the library (plugins/kernels/src/kiviParams.cpp + kiviCApiHost.cpp: plain C++) is compiled
here with g++ -Werror and loaded with ctypes; oracles: the messages the contract requires (each names the bad value),
format.FORMAT_VERSION, and the Python model of the plan (trtllm_kivi/cuda/launch.py) checked for the bounds the
kernels rely on.
"""

from __future__ import annotations

import ctypes
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi.cuda import _abi, launch, variants
from trtllm_kivi.format import FORMAT_VERSION, KiviConfig

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "plugins" / "kernels" / "src"
INCLUDES = [ROOT / "plugins" / "kernels" / "include", ROOT / "plugins" / "include"]


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory) -> _abi.KiviLibrary:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not on PATH: cannot build the host-only KIVI library")
    out = tmp_path_factory.mktemp("kivi_host") / "libtrtllm_kivi_host.so"
    cmd = [gxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Wshadow", "-Werror",
           *(f"-I{p}" for p in INCLUDES), str(SRC / "kiviParams.cpp"), str(SRC / "kiviCApiHost.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return _abi.KiviLibrary(out)


def make(cfg: KiviConfig = KiviConfig(), h: int = 32, hkv: int = 8, d: int = 128, batch: int = 4, tokens: int = 4,
         **over) -> _abi.KiviStepParams:
    """Valid params with fake (aligned, never dereferenced) device pointers; `over` overrides fields."""
    p = _abi.KiviStepParams()
    vals = dict(numHeads=h, numKvHeads=hkv, headDim=d, kBits=cfg.k_bits, vBits=cfg.v_bits, groupSize=cfg.group_size,
                residualLength=cfg.residual_length, blockSize=cfg.block_size, scaleDtype=0, keyGrouping=0,
                actDtype=0, batch=batch, numTokens=tokens, maxChunkLen=0, maxSeqLen=0, numBlocks=1000, numSlots=8,
                maxBlocksPerSeq=64, numSms=0, ctasPerSm=0)
    for i, name in enumerate(_abi._PTR_FIELDS):
        setattr(p, name, 0x100000 * (i + 1))
    vals.update(over)
    for name, value in vals.items():
        setattr(p, name, value)
    return p


def with_workspace(lib: _abi.KiviLibrary, p: _abi.KiviStepParams) -> _abi.KiviStepParams:
    p.workspaceSize = lib.workspace_size(p)
    return p


def test_abi_mirror_and_format_version(host_lib):
    # KiviLibrary's constructor already refuses a size mismatch; check it explicitly too.
    assert host_lib.lib.kiviCParamsSize() == ctypes.sizeof(_abi.KiviStepParams)
    assert host_lib.format_version() == FORMAT_VERSION
    assert not host_lib.has_launchers


def test_valid_params_pass(host_lib):
    for phase in (_abi.PHASE_ATTENTION, _abi.PHASE_APPEND, _abi.PHASE_STEP):
        assert host_lib.validate(with_workspace(host_lib, make()), phase) == ""


@pytest.mark.parametrize("over, match", [
    (dict(headDim=96), r"head_dim=96 .*allowed: 64, 128"),
    (dict(kBits=3), r"k_bits=3 .*allowed: 2, 4, 8"),
    (dict(vBits=16), r"v_bits=16 .*allowed: 2, 4, 8"),
    (dict(groupSize=48), r"group_size=48 .*allowed: 32, 64, 128"),
    (dict(groupSize=64, blockSize=96), r"block_size=96 must be a positive multiple of group_size=64"),
    (dict(keyGrouping=1), r"key_grouping=1 is not supported by the KIVI kernels; allowed: 0 \(per_channel\)"),
    (dict(actDtype=2), r"act_dtype=2 .*allowed: 0 \(float16\), 1 \(bfloat16\)"),
    (dict(scaleDtype=3), r"scale_dtype=3 .*allowed"),
    (dict(numHeads=30), r"num_heads=30 must be a multiple of num_kv_heads=8"),
    (dict(numHeads=64, numKvHeads=2), r"num_heads/num_kv_heads=32 .*allowed: 1\.\.16"),
    (dict(residualLength=-1), r"residual_length=-1 must be >= 0"),
    (dict(maxChunkLen=5), r"max_chunk_len=5 is out of range; .*num_tokens=4"),
    (dict(maxSeqLen=64 * 128 + 160 + 1), r"max_seq_len=8353 is past the capacity of 8351 tokens"),
    (dict(q=None), r"q is a null pointer"),
    (dict(vWindow=None), r"v_window is a null pointer"),
    (dict(k=0x100008), r"k=0x100008 is not 16-byte aligned"),
    (dict(kScale=0x100008), r"k_scale=0x100008 is not 16-byte aligned"),
    (dict(numBlocks=0), r"num_blocks=0, .*must be positive"),
    (dict(batch=-1), r"batch=-1 and num_tokens=4 must be >= 0"),
    (dict(attentionImpl=4), r"attention_impl=4 is not supported; allowed: 0 \(auto\), 3 \(mma\)"),
    (dict(attentionImpl=1), r"attention_impl=1 \(legacy SIMT/WMMA kernel\) reads the FORMAT_VERSION 1 code layout"),
    (dict(attentionImpl=2), r"attention_impl=2 \(legacy"),
    (dict(ctasPerSm=-1), r"ctas_per_sm=-1 is out of range; allowed: 0 \(= 3 for these bits\) \.\. 64"),
    (dict(numSms=-1), r"num_sms=-1 must be >= 0"),
    (dict(sinkTokens=129), r"sink_tokens=129 is out of range; allowed: 0 \.\. 128"),
    (dict(sinkTokens=4, maxSeqLen=64 * 128 + 4 + 160), r"max_seq_len=8356 is past the capacity of 8355 tokens"),
    (dict(decodeVariant=7), r"decode_variant=7 is out of range; allowed: 0 \(auto\) \.\. 6 \(split-unfused\)"),
    (dict(decodeVariant=-1), r"decode_variant=-1 is out of range"),
    (dict(decodeVariant=1, headDim=64), r"decode_variant=1 \(baseline\) is compiled for head_dim 128 with 2-bit keys "
     r"and values only; this step has head_dim=64, k_bits=2, v_bits=2; use 0 \(auto\) or 2 \(split\)"),
    (dict(decodeVariant=3, kBits=4), r"decode_variant=3 \(split-s3\) is compiled for .* k_bits=4, v_bits=2"),
])
def test_validation_names_the_bad_value(host_lib, over, match):
    p = make(**over)
    p.workspaceSize = 1 << 40  # not the subject here
    msg = host_lib.validate(p)
    assert msg, f"{over} was accepted"
    import re
    assert re.search(match, msg), msg


def test_phase_specific_pointers(host_lib):
    # The append phase never touches q or out: null is fine there, not for attention.
    p = with_workspace(host_lib, make(q=None, out=None))
    assert host_lib.validate(p, _abi.PHASE_APPEND) == ""
    assert "q is a null pointer" in host_lib.validate(p, _abi.PHASE_ATTENTION)


def test_workspace_checks(host_lib):
    p = make(batch=2, tokens=3000, maxChunkLen=0)
    need = host_lib.workspace_size(p)
    assert need > 0
    p.workspaceSize = need - 1
    assert f"workspace_size={need - 1} is too small; this step needs {need} bytes" in host_lib.validate(p)
    p.workspaceSize = need
    p.workspace = 0x100080  # 128-byte aligned only
    assert "workspace=0x100080 is not 256-byte aligned" in host_lib.validate(p)
    # An empty step needs nothing and accepts null pointers.
    assert host_lib.workspace_size(make(batch=0, tokens=0)) == 0
    assert host_lib.validate(make(batch=0, tokens=0, q=None, workspace=None)) == ""


def test_variant_table_matches_the_model(host_lib):
    """kiviCDecodeVariantDescribe (the C++ table) against trtllm_kivi/cuda/variants.py, field for field; names,
    count, bad ids; and what auto resolves to (kiviCDecodeVariantFor) over random shapes, archs and SM counts."""
    got = host_lib.decode_variants()
    assert [v["id"] for v in got] == list(range(len(variants.VARIANTS)))
    for g, v in zip(got, variants.VARIANTS, strict=True):
        assert (g["name"], g["stages"], g["keys_per_stage"], g["waves"]) == (v.name, v.stages, v.keys_per_stage,
                                                                             v.waves)
        assert g["kernel"] == {"baseline": "kiviDecodeMmaKernel", "split": "kiviDecodeSplitKernel"}[v.kernel]
        assert (g["combine"] == "fused (last CTA)") == v.fused
        assert g["compiled"].startswith("every") == v.all_combos
        assert host_lib.lib.kiviCDecodeVariantName(v.id).decode() == v.name
    assert host_lib.lib.kiviCDecodeVariantName(len(got)) is None
    buf = ctypes.create_string_buffer(8)
    assert host_lib.lib.kiviCDecodeVariantDescribe(2, buf, len(buf)) == -1  # too small: refused, not truncated
    assert host_lib.lib.kiviCDecodeVariantDescribe(-1, ctypes.create_string_buffer(1024), 1024) == -1
    rng = random.Random(3)
    for _ in range(200):
        cfg, hkv, grp, batch, chunks = _random_case(rng)
        d, tokens = rng.choice((64, 128)), max(1, sum(chunks))
        mcl, sms, sm = rng.choice((0, 1)), rng.choice((0, 8, 132, 1000)), rng.choice((80, 90, 100))
        vid = rng.choice((0, 0, 1, 2, 3, 4, 5, 6))
        p = make(cfg, h=hkv * grp, hkv=hkv, d=d, batch=batch, tokens=tokens, maxChunkLen=min(mcl, tokens),
                 decodeVariant=vid)
        cls = variants.shape_class(hkv * grp, hkv, batch, tokens, min(mcl, tokens), sms)
        want = variants.variant_for(vid, d, cfg.k_bits, cfg.v_bits, cls, sm, sms)
        assert host_lib.decode_variant_for(p, sm, sms) == want
        assert want == vid or variants.variant_compiled(want, d, cfg.k_bits, cfg.v_bits)


def _random_case(rng: random.Random):
    cfg = KiviConfig(k_bits=rng.choice((2, 4, 8)), v_bits=rng.choice((2, 4, 8)), group_size=rng.choice((32, 64)),
                     residual_length=rng.choice((0, 32, 128)), block_size=128)
    hkv = rng.choice((1, 2, 8))
    grp = rng.choice((1, 3, 4, 8, 16))
    batch = rng.randint(1, 40)
    chunks = [rng.choice((0, 1, 1, 1, rng.randint(1, 300))) for _ in range(batch)]
    return cfg, hkv, grp, batch, chunks


def test_launch_plan_matches_the_model_and_bounds_the_work(host_lib):
    """Oracle: the C++ plan equals launch.launch_plan field for field (every variant, auto resolved for sm_80 and
    sm_90), and the bounds the kernels rely on hold: numTiles >= sum ceil(c / tileTokens) (decode mode: a tile range
    per sequence), splits cover max_seq_len within the variant's waves, flushGroupsPerSeq >= groups any chunk
    flushes."""
    rng = random.Random(0)
    for _ in range(300):
        cfg, hkv, grp, batch, chunks = _random_case(rng)
        tokens = sum(chunks)
        if tokens == 0:
            continue
        d = rng.choice((64, 128))
        mbs = rng.choice((1, 8, 1024))
        max_seq = rng.choice((0, 0, min(rng.randint(1, 5000), mbs * 128 + cfg.window_capacity)))
        sms = rng.choice((0, 1, 132, 1000))
        cps = rng.choice((0, 0, 1, 4, 7))
        mcl = rng.choice((0, 0, 1)) if max(chunks) <= 1 else 0
        vid = rng.choice([v.id for v in variants.VARIANTS if v.id == 0 or variants.variant_compiled(
            v.id, d, cfg.k_bits, cfg.v_bits)])
        sm = rng.choice((None, 80, 90))
        p = make(cfg, h=hkv * grp, hkv=hkv, d=d, batch=batch, tokens=tokens, maxBlocksPerSeq=mbs, maxSeqLen=max_seq,
                 numSms=sms, ctasPerSm=cps, maxChunkLen=mcl, decodeVariant=vid)
        got = host_lib.launch_plan(p, sm)
        want = launch.launch_plan(cfg, hkv * grp, hkv, d, batch, tokens, mbs, mcl, max_seq, sms, cps,
                                  decode_variant=vid, sm_version=sm or 90)
        assert got == want.__dict__, (got, want)
        variant = variants.VARIANTS[want.decode_variant]
        # every sequence runs in exactly one kernel, and each kernel's grid covers its sequences' tiles
        pf = [c for c in chunks if want.is_prefill(c)]
        dec = [c for c in chunks if not want.is_prefill(c)]
        assert want.num_tiles >= sum(math.ceil(c * grp / want.tile_rows) for c in dec)
        if want.decode_mode:  # tile x = b x tiles_per_seq + i covers a one-token chunk's grp rows
            assert want.num_tiles == batch * want.tiles_per_seq and want.tiles_per_seq * 8 >= grp
            assert variant.fused and max(chunks) <= 1 and want.max_chunk_len == 1
        assert want.num_prefill_tiles >= sum(math.ceil(c * grp / 64) for c in pf)
        assert (want.num_prefill_tiles > 0) == ((mcl or tokens) * grp >= 64 and tokens * grp >= 64)
        # the default occupancy: the decode kernels' __launch_bounds__ one (2 CTAs per SM with an 8-bit operand),
        # lower where the split kernel's shared memory allows fewer on sm_90
        bounds = 2 if 8 in (cfg.k_bits, cfg.v_bits) else 3
        assert want.ctas_per_sm == cps or (cps == 0 and 1 <= want.ctas_per_sm <= bounds)
        slots = (sms or 132) * want.ctas_per_sm * variant.waves
        base = (want.num_tiles + want.num_prefill_tiles) * hkv
        assert base * want.num_splits <= max(slots, base)  # never past the variant's waves
        assert want.fused_combine == int(variant.fused and want.num_splits > 1 and want.num_prefill_tiles == 0)
        assert want.counter_bytes == (math.ceil(want.num_tiles * hkv * 4 / 256) * 256 if want.fused_combine else 0)
        assert want.split_len % 32 == 0 and want.num_splits * want.split_len >= want.max_seq_len
        assert (want.num_splits - 1) * want.split_len < want.max_seq_len  # no split is empty for every length
        for c in chunks:
            for s in (0, 1, cfg.residual_length, rng.randint(0, 10_000)):
                flushed = (cfg.num_quantized(s + c) - cfg.num_quantized(s)) // cfg.group_size
                assert flushed <= want.flush_groups_per_seq


def _used_bytes(plan: dict, t: int, h: int, d: int, hkv: int = 0) -> int:
    """Workspace bytes a step's kernels index (kiviLaunch.cu): seq info, then [T, H, numSplits, D] and
    [T, H, numSplits, 2] fp32 partials when the keys are split, then one int32 arrival counter per (tile, KV head)
    with the fused merge. The oracle of what a workspace must hold."""
    if plan["num_splits"] == 1:
        return plan["seq_info_bytes"]
    rows = t * h * plan["num_splits"]
    acc = math.ceil(rows * d * 4 / 256) * 256
    if not plan["fused_combine"]:
        return plan["seq_info_bytes"] + acc + rows * 2 * 4
    return plan["seq_info_bytes"] + acc + math.ceil(rows * 2 * 4 / 256) * 256 + plan["num_tiles"] * hkv * 4


def _random_variant(rng: random.Random, d: int, cfg: KiviConfig) -> int:
    return rng.choice([v.id for v in variants.VARIANTS if v.id == 0 or variants.variant_compiled(
        v.id, d, cfg.k_bits, cfg.v_bits)])


def test_step_workspace_is_what_the_step_uses(host_lib):
    """kiviWorkspaceSize is the step's own plan (auto: the largest plan of the variants the plan table may pick on
    any arch): partials only when it splits, sized T x H x numSplits, and the fused merge's counters."""
    rng = random.Random(1)
    for _ in range(200):
        cfg, hkv, grp, batch, _ = _random_case(rng)
        d, mbs, t = rng.choice((64, 128)), rng.choice((1, 16, 1024)), rng.randint(1, 5000)
        mcl = rng.choice((0, 1)) if t <= batch else 0
        p = make(cfg, h=hkv * grp, hkv=hkv, d=d, batch=batch, tokens=t, maxBlocksPerSeq=mbs, maxChunkLen=mcl,
                 decodeVariant=_random_variant(rng, d, cfg))
        plan = host_lib.launch_plan(p)
        used = _used_bytes(plan, t, hkv * grp, d, hkv)
        assert used <= plan["workspace_size"] < used + 256, (plan, used)
        assert (plan["partial_bytes"] == 0) == (plan["num_splits"] == 1)
        for sm in (80, 90):  # the launcher resolves auto for its device: within the same workspace
            assert _used_bytes(host_lib.launch_plan(p, sm), t, hkv * grp, d, hkv) <= plan["workspace_size"]


def test_profile_workspace_serves_every_step_of_the_profile(host_lib):
    """TensorRT sizes the workspace once for an optimization profile and runs every smaller step in it. Oracle:
    the bytes each step's plan indexes (_used_bytes), over token counts, batches and block-table widths inside
    random profiles; the profile size is also no larger than the largest step's need (it is computed, not
    bounded loosely)."""
    rng = random.Random(2)
    for _ in range(60):
        cfg, hkv, grp, _, _ = _random_case(rng)
        d, mbs, sms = rng.choice((64, 128)), rng.choice((1, 16, 300)), rng.choice((0, 7, 132))
        t_max, b_max = rng.randint(1, 700), rng.randint(1, 16)
        t_min, b_min = rng.randint(1, t_max), rng.randint(1, b_max)
        h = hkv * grp
        vid = _random_variant(rng, d, cfg)
        big = make(cfg, h=h, hkv=hkv, d=d, batch=b_max, tokens=t_max, maxBlocksPerSeq=mbs, numSms=sms,
                   decodeVariant=vid)
        m_min = rng.choice((1, mbs))  # a range of block-table widths, or the exporter's fixed one
        limit = host_lib.workspace_size_for_profile(big, t_min, b_min, m_min)
        largest_need = 0
        for t in range(t_min, t_max + 1):
            for b in sorted({b_min, (b_min + b_max) // 2, b_max}):
                for m in sorted({m_min, (m_min + mbs) // 2, mbs}):
                    p = make(cfg, h=h, hkv=hkv, d=d, batch=b, tokens=t, maxBlocksPerSeq=m, numSms=sms,
                             decodeVariant=vid)
                    for sm in (80, 90):
                        need = _used_bytes(host_lib.launch_plan(p, sm), t, h, d, hkv)
                        assert need <= limit, (t, b, m, t_min, t_max, b_min, b_max, m_min, mbs, vid, sm)
                        largest_need = max(largest_need, need)
        if m_min == mbs:  # exact for a fixed width: the largest step need, with the largest batch's seq info and
            # the bound on the fused merge's counters (half the CTA slots of the variant's waves)
            seq_info_max = host_lib.launch_plan(big)["seq_info_bytes"]
            counters = max(math.ceil((sms or 132) * variants.variant_ctas_per_sm(cfg, d, v) * variants.VARIANTS[
                v].waves // 2 * 4 / 256) * 256 for v in launch.candidate_variants(vid, d, cfg.k_bits, cfg.v_bits))
            assert limit <= largest_need + seq_info_max + 256 + counters


def test_profile_workspace_numbers_for_long_prefill_profiles(host_lib):
    """A Llama-3-8B layer (32 q heads, 8 KV heads, D 128) with profiles up to 8K and 32K tokens per step and 32K /
    128K contexts must not get 141 MB and 550 MB of split workspace, as a bound on T x numSplits would give:
    splits = floor(132 SMs x 3 CTAs / (tiles of both kernels x 8 KV heads)): at batch 1 and T >= 16 tokens (64 query
    rows, GQA 4) the sequence may be a prefill one, so the grid holds at most 8 decode tiles + floor(4T / 64) + 1
    prefill tiles; the step with the most partial rows is T = 255: 8 + 16 tiles x 8 = 192 CTAs, 2 splits,
    255 x 32 x 2 rows of 130 fp32 (T = 256 has 8 + 17 tiles: 1 split) + seq info: 8.1 MB, not 141 / 550 MB."""
    base = dict(h=32, hkv=8, d=128, decodeVariant=variants.VARIANT_BASELINE)  # one wave, as measured
    for t_max, mbs in ((8192, 256), (32768, 1024)):
        big = make(batch=8, tokens=t_max, maxBlocksPerSeq=mbs, **base)
        limit = host_lib.workspace_size_for_profile(big, 1, 1, mbs)
        rows = 255 * 32 * 2
        assert limit == math.ceil(rows * 128 * 4 / 256) * 256 + math.ceil(rows * 2 * 4 / 256) * 256 + 256, limit
        plan = host_lib.launch_plan(make(batch=1, tokens=255, maxBlocksPerSeq=mbs, **base))
        assert (plan["num_splits"], plan["num_tiles"], plan["num_prefill_tiles"]) == (2, 8, 16)
        assert host_lib.launch_plan(make(batch=1, tokens=256, maxBlocksPerSeq=mbs, **base))["num_splits"] == 1
        assert limit < 9 * 2 ** 20
    # A profile whose minimum already fills the GPU never splits: seq info only.
    big = make(batch=8, tokens=8192, maxBlocksPerSeq=256, **base)
    assert host_lib.workspace_size_for_profile(big, 4096, 8, 256) == 256


def test_profile_workspace_numbers_for_the_default_variant(host_lib):
    """The same profiles with auto (the split kernel: two waves of 3 CTAs per SM): the largest step is the
    one-token decode step (decode mode: 1 tile x 8 KV heads, 99 splits) or a short prefill step; oracle: the Python
    plan (trtllm_kivi/cuda/launch.py) maximized over the profile's token counts at batch 1, plus the largest batch's
    seq info and the counter bound (half of 132 x 3 x 2 slots). A few MB, not a bound on T x numSplits."""
    cfg = KiviConfig()
    for t_max, mbs in ((8192, 256), (32768, 1024)):
        limit = host_lib.workspace_size_for_profile(make(h=32, hkv=8, d=128, batch=8, tokens=t_max,
                                                         maxBlocksPerSeq=mbs), 1, 1, mbs)
        partial, splits, t = 0, 2, 1
        while t == 1 or splits > 1:  # t = 1: decode mode; then the split count only falls with t
            plan = launch.launch_plan(cfg, 32, 8, 128, 1, t, mbs)
            partial, splits, t = max(partial, plan.partial_bytes), plan.num_splits, t + 1
        assert t < 2000  # no split past a thousand-odd tokens
        assert limit == 256 + partial + math.ceil(132 * 3 * 2 // 2 * 4 / 256) * 256, limit
        assert limit < 40 * 2 ** 20


def test_attention_needs_sm80(host_lib):
    """The default attention kernel (mma.sync bf16/f16, movmatrix, cp.async) needs sm_80: the launcher checks the
    device's compute capability and names both."""
    for impl in (_abi.ATTN_AUTO, _abi.ATTN_MMA):
        p = make(attentionImpl=impl)
        msg = host_lib.check_arch(p, 75)
        assert (f"attention_impl={impl} (the mma.sync attention kernel) needs compute capability >= 8.0; this device "
                "is sm_75 (7.5)") in msg
        assert host_lib.check_arch(p, 80) == "" and host_lib.check_arch(p, 90) == ""


def test_built_cuda_library_exports_the_same_abi():
    """The full CUDA library (when build_scripts/build_plugin.sh has built it) loads without a GPU and agrees with
    the host-only build: params size, format version, validation messages, launch plan."""
    path = _abi.find_library()
    if path is None:
        pytest.skip(f"kernel library not built (tried {', '.join(map(str, _abi.library_candidates()))})")
    lib = _abi.load_library(path)  # the constructor checks sizeof(KiviStepParams)
    assert lib.has_launchers and lib.format_version() == FORMAT_VERSION
    assert "head_dim=80" in lib.validate(make(headDim=80))
    p = make(batch=3, tokens=40)
    assert lib.launch_plan(p) == launch.launch_plan(KiviConfig(), 32, 8, 128, 3, 40, 64).__dict__
    assert [v["name"] for v in lib.decode_variants()] == [v.name for v in variants.VARIANTS]


def test_strided_qkv_are_refused_without_the_full_check(host_lib):
    """check=False (the runner's fast path) still refuses a strided q/k/v: the kernels read dense [tokens, heads, D]
    rows, and on an H200 the model's v (a view of the fused qkv projection) was read as garbage before the cuda
    backend made it contiguous. Oracle: ValueError naming the tensor, raised before any launch."""
    import torch

    from trtllm_kivi.cuda.ops import kivi_attention_cuda_
    from trtllm_kivi.reference import KiviBuffers
    cfg = KiviConfig()
    buf = KiviBuffers.allocate(cfg, 2, 64, 2, 1, torch.float16)
    qkv = torch.zeros(2, (4 + 2 + 2) * 64, dtype=torch.float16)  # 2 tokens: a 1-token view counts as contiguous
    q, k, v = (x.view(2, -1, 64) for x in qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1))
    i = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q with strides .* must be contiguous"):
        kivi_attention_cuda_(q, k, v, i, i, i + 1, torch.zeros(1, 2, dtype=torch.int32), buf, cfg, check=False,
                             lib=host_lib)
    with pytest.raises(ValueError, match=r"v with strides .* must be contiguous"):
        kivi_attention_cuda_(q.contiguous(), k.contiguous(), v, i, i, i + 1, torch.zeros(1, 2, dtype=torch.int32),
                             buf, cfg, check=False, lib=host_lib)
