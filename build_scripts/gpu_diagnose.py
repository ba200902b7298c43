"""Localize a wrong CUDA attention output: many small crafted one-step cases on the GPU, analysed on the CPU.

    python3 build_scripts/gpu_diagnose.py run --out DIR      # on a GPU machine: writes DIR/diag.pt (GPU outputs only)
    python3 build_scripts/gpu_diagnose.py analyze DIR/diag.pt  # anywhere: reference, lane-level emulation, tables

Every case is one sequence (batch 1) whose history of n tokens is stored by the reference append, then one step of
`chunk` tokens through the kernels (attention phase only). Inputs come from numpy's PCG64 (the same bits on both
machines; a checksum per case proves it), so `analyze` rebuilds them and computes the reference
(reference.kivi_attention_), the lane-level emulation of the kernels (cuda.mma_model.attention, same plan) and the
derived tolerance (mma_model.step_tolerance) without a GPU. Contents isolate the two halves of the kernel:
  rand  K, V ~ N(0, 1);
  kzero K = 0 (every score equal): out = the mean of V, so only the value path (codes, V scales, bias, l) matters;
  vhot  V[t] = one-hot(t mod D): out[c] = the softmax weight of the keys t = c (mod D), so only the score path
        (K codes, K scales / zeros, the fold, masking, the online softmax) matters.
Each case also runs with max_seq_len = its length (one split) and 0 (the split sized for the block table: several).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_kivi.format import KiviConfig  # noqa: E402
from trtllm_kivi.reference import KiviBuffers  # noqa: E402
from trtllm_kivi.reference.attention import append as ref_append  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
BITS = [(2, 2), (4, 4), (8, 8), (2, 8), (8, 2), (2, 4)]
HKV, R, BLOCK, NUM_BLOCKS = 2, 32, 128, 6


def cases() -> list[dict]:
    out = []
    for act, sdt_kind, (kb, vb), g, d, gqa in itertools.product(
            ("float16", "bfloat16"), ("act", "float32", "other"), BITS, (32, 64), (64, 128), (1, 4)):
        sdt = act if sdt_kind == "act" else ("float32" if sdt_kind == "float32" else
                                             ("bfloat16" if act == "float16" else "float16"))
        for content in ("rand", "kzero", "vhot"):
            n = R + 4 * g + 7  # n_q = 4 G quantized tokens (2 blocks at G = 64), the rest in the window
            chunk = 20 if (content == "rand" and gqa == 4) else 1  # 80 query rows: the prefill kernel
            out.append({"act": act, "sdt": sdt, "kb": kb, "vb": vb, "g": g, "d": d, "gqa": gqa, "content": content,
                        "n": n, "chunk": chunk})
    # zhot (shot): every quantized group's keys are constant (scale 0, codes 0) and one-hot in channel c(group, head, j),
    # window keys 0, q a ramp: the score of group g is exactly rnd(qsc)[c], so the GPU's per-group weights name the
    # channel its key fold paired with the zero of channel c
    for act, kb in (("float16", 2), ("bfloat16", 8), ("float16", 8), ("bfloat16", 2)):
        for d in (64, 128):
            for j in range(d // 8):
                for content in ("zhot", "shot"):
                    out.append({"act": act, "sdt": act, "kb": kb, "vb": kb, "g": 32, "d": d, "gqa": 1,
                                "content": content, "n": R + 4 * 32 + 7, "chunk": 1, "j": j})
    return out


def zhot_channel(case: dict, group: int, head: int) -> int:
    return (8 * case["j"] + 4 * head + group) % case["d"]


def inputs(case: dict, idx: int) -> tuple[torch.Tensor, ...]:
    """History K/V [Hkv, n, D] and the step's q [c, H, D], k/v [c, Hkv, D] in the activation dtype."""
    rng = np.random.default_rng(1000 + idx)
    d, n, c, h = case["d"], case["n"], case["chunk"], HKV * case["gqa"]
    dt = DTYPES[case["act"]]
    kh, vh = rng.standard_normal((HKV, n, d)), rng.standard_normal((HKV, n, d))
    q, k, v = rng.standard_normal((c, h, d)), rng.standard_normal((c, HKV, d)), rng.standard_normal((c, HKV, d))
    if case["content"] in ("zhot", "shot"):  # shot: the hot channel alternates 1, 0 (scale 1 / (2^b - 1), zero 0)
        kh[:], k[:] = 0, 0
        for hh in range(HKV):
            for grp in range(4):
                kh[hh, 32 * grp:32 * grp + 32:(2 if case["content"] == "shot" else 1), zhot_channel(case, grp, hh)] = 1
        q[:] = (np.arange(d) - d / 2 + 0.5) / 8  # distinct per channel, |q| <= 8
        vh[:] = 0
        vh[:, np.arange(n), np.arange(n) % d] = 1
        v[:] = 0
        v[np.arange(c), :, (n + np.arange(c)) % d] = 1
    elif case["content"] == "kzero":
        kh[:], k[:] = 0, 0
    elif case["content"] == "vhot":
        kh, k = 0.5 * kh, 0.5 * k
        vh[:] = 0
        vh[:, np.arange(n), np.arange(n) % d] = 1
        v[:] = 0
        v[np.arange(c), :, (n + np.arange(c)) % d] = 1
    return tuple(torch.from_numpy(x.astype(np.float32)).to(dt) for x in (kh, vh, q, k, v))


def config(case: dict) -> KiviConfig:
    return KiviConfig(k_bits=case["kb"], v_bits=case["vb"], group_size=case["g"], residual_length=R,
                      block_size=BLOCK, scale_dtype=case["sdt"])


def stored_state(case: dict, kh: torch.Tensor, vh: torch.Tensor) -> tuple[KiviBuffers, torch.Tensor]:
    cfg = config(case)
    buf = KiviBuffers.allocate(cfg, HKV, case["d"], NUM_BLOCKS, 1, DTYPES[case["act"]])
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32).flip(0).reshape(1, NUM_BLOCKS)  # not the identity
    ref_append(buf, cfg, 0, table[0], 0, kh, vh)
    return buf, table


def run(out_dir: Path, limit: int, content: str | None = None) -> int:
    from trtllm_kivi.cuda import _abi
    from trtllm_kivi.cuda.ops import _ctas_per_sm, kivi_attention_cuda_, make_params
    lib = _abi.load_library()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results, t0 = [], time.time()
    for idx, case in enumerate(cases()[:limit]):
        if content is not None and case["content"] != content:
            continue
        kh, vh, q, k, v = inputs(case, idx)
        buf, table = stored_state(case, kh, vh)
        gbuf = KiviBuffers(*(t.cuda() for t in buf))
        rec: dict = {"idx": idx, "case": case, "checksum": float(q.double().sum() + kh.double().sum() + vh.double().sum()), "sms": sms}
        cfg = config(case)
        for msl in (case["n"] + case["chunk"], 0):
            o = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            try:
                kivi_attention_cuda_(q.cuda(), k.cuda(), v.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda"),
                                     torch.tensor([case["n"]], dtype=torch.int32, device="cuda"),
                                     torch.tensor([case["chunk"]], dtype=torch.int32, device="cuda"), table.cuda(),
                                     gbuf, cfg, max_chunk_len=case["chunk"], max_seq_len=msl, error_flag=flag,
                                     out=o, phase=_abi.PHASE_ATTENTION, lib=lib)
                torch.cuda.synchronize()
                rec[f"out_{msl > 0}"] = o.float().cpu()
                rec[f"flag_{msl > 0}"] = int(flag.item())
            except Exception as e:  # noqa: BLE001 - recorded per case, the sweep goes on
                rec[f"error_{msl > 0}"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
        one = torch.ones(1, dtype=torch.int32)  # pointers only: the occupancy query reads no tensor
        rec["ctas_per_sm"] = _ctas_per_sm(lib, make_params(q, k, v, None, one, one, one, table, buf, cfg),
                                          torch.device("cuda"))
        results.append(rec)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "numpy": np.__version__, "gpu": torch.cuda.get_device_name(0),
            "seconds": time.time() - t0}
    parts = 4  # files of < 16 MB each (what a device call brings back)
    for i in range(parts):
        torch.save({**meta, "results": results[i::parts]}, out_dir / f"diag{i}.pt")
    bad = sum(1 for r in results if any(k.startswith("error") for k in r))
    print(f"gpu_diagnose: {len(results)} cases in {time.time() - t0:.0f} s, {bad} with launch errors")
    return 0


def analyze(path: Path, show: int, json_out: Path | None = None) -> int:
    from trtllm_kivi.cuda import mma_model
    from trtllm_kivi.reference import kivi_attention_
    data = torch.load(path, weights_only=False)
    for extra in sorted(path.parent.glob(path.stem.rstrip("0123456789") + "[0-9]*.pt")):
        if extra != path:
            data["results"] += torch.load(extra, weights_only=False)["results"]
    print(f"{path}: {data['gpu']}, torch {data['torch']}, numpy {data['numpy']}, {len(data['results'])} cases")
    rows = []
    for rec in data["results"]:
        idx, case = rec["idx"], rec["case"]
        kh, vh, q, k, v = inputs(case, idx)
        chk = float(q.double().sum() + kh.double().sum() + vh.double().sum())
        assert abs(chk - rec["checksum"]) < 1e-6 * max(1.0, abs(chk)), f"case {idx}: inputs differ ({chk})"
        buf, table = stored_state(case, kh, vh)
        cfg = config(case)
        args = (q, k, v, torch.zeros(1, dtype=torch.int32), torch.tensor([case["n"]]).int(),
                torch.tensor([case["chunk"]]).int(), table)
        want = kivi_attention_(*args, buf.clone(), cfg).float()
        tol = mma_model.step_tolerance(buf, cfg, *args)
        for one in (True, False):
            row = {**case, "hinted": one}
            if f"error_{one}" in rec:
                row["status"] = rec[f"error_{one}"]
                rows.append(row)
                continue
            got = rec[f"out_{one}"]
            cps = rec["ctas_per_sm"]
            emu, plan, _ = mma_model.attention(*args, buf, cfg, max_chunk_len=case["chunk"],
                                               max_seq_len=case["n"] + case["chunk"] if one else 0,
                                               num_sms=rec["sms"], ctas_per_sm=cps)
            err = (got - want).abs()
            bad = ~(err <= tol)
            row.update(status="ok" if not bad.any() else "BAD", splits=plan.num_splits, flag=rec[f"flag_{one}"],
                       n_bad=int(bad.sum()), of=bad.numel(), max_err=float(err.nan_to_num(1e9).max()),
                       emu_err=float((emu.float() - want).abs().max()), gpu_emu=float((got - emu.float()).abs()
                                                                                      .nan_to_num(1e9).max()),
                       bad_heads=sorted({int(i) for i in bad.nonzero()[:, 1].tolist()}),
                       bad_ch=sorted({int(i) for i in bad.nonzero()[:, 2].tolist()})[:12],
                       bad_tok=sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})[:8])
            rows.append(row)
    if json_out is not None:
        import json
        json_out.write_text(json.dumps(rows))
    keys = ("act", "sdt", "kb", "vb", "g", "d", "gqa", "content", "chunk", "hinted")
    n_bad = sum(r["status"] != "ok" for r in rows)
    print(f"{n_bad} of {len(rows)} runs outside the tolerance or failed\n")
    for factor in ("act", "sdt", "kb", "vb", "g", "d", "gqa", "content", "chunk", "hinted"):
        groups: dict = {}
        for r in rows:
            groups.setdefault(r[factor], []).append(r["status"] != "ok")
        print(f"{factor:10s} " + "  ".join(f"{k}: {sum(v)}/{len(v)}" for k, v in groups.items()))
    print()
    shown = 0
    for r in rows:
        if r["status"] != "ok" and shown < show:
            shown += 1
            desc = " ".join(f"{k}={r[k]}" for k in keys)
            if r["status"] == "BAD":
                print(f"{desc}: {r['n_bad']}/{r['of']} off, max {r['max_err']:.3g} (emulation {r['emu_err']:.3g}, "
                      f"gpu-emu {r['gpu_emu']:.3g}), splits {r['splits']}, heads {r['bad_heads']}, "
                      f"tokens {r['bad_tok']}, channels {r['bad_ch']}")
            else:
                print(f"{desc}: {r['status']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--limit", type=int, default=10 ** 9, help="first N cases only")
    r.add_argument("--content", default=None, help="only cases of this content (rand, kzero, vhot, zhot)")
    a = sub.add_parser("analyze")
    a.add_argument("path", type=Path)
    a.add_argument("--show", type=int, default=40)
    a.add_argument("--json", type=Path, default=None, help="write every run's row here")
    args = ap.parse_args(argv)
    return run(args.out, args.limit, args.content) if args.cmd == "run" else analyze(args.path, args.show, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
