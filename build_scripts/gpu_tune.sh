#!/usr/bin/env bash
# One-command tuning run of the KIVI kernels on a bare GPU machine, in ~290 s of wall time: every GPU minute returns
# the measurements that choose among designs. Run build_scripts/gpu_check.sh first (correctness); this script runs
# no tests. In order of value, each part with its own time budget (what does not fit is listed in its JSON):
#   0. the kernel library as gpu_check.sh finds it (build_scripts/gpu_lib.sh: prebuilt when given or present; a
#      build here only with --build or when none is found, and it eats the budget);
#   1. benchmarks/bench_kernels.py: every decode variant at every shape (Llama-3-8B and Llama-2-7B, batch 1/8/32,
#      context 4K/32K/128K where memory allows; attention and whole step at flush and non-flush steps), the read
#      ceiling (read-only streaming kernel) and stream reads of each shape's bytes, the same kernel over FP16, torch
#      SDPA; L2-cold (~100 s); then benchmarks/plan_winners.py: the winning variant per shape class (plan_winners.json,
#      the rows for the plan table in plugins/kernels/include/kiviDecodeVariants.h);
#   2. benchmarks/bench_prefill.py: the prefill kernel (chunks 512/2K/8K over 0/8K/32K of history) and the append,
#      against torch SDPA causal FP16 and a plain FP16 cache write (~30 s);
#   3. benchmarks/bench_e2e_gpu.py: a Llama-3-8B-shaped model (random fp16 weights made on the GPU) through the torch
#      runtime with CUDA-graph decode steps, KIVI-2 and FP16 at batch 1/8/32 x 4K/32K, and the largest batch at 32K
#      each fits, found by allocating (~80 s);
#   4. benchmarks/ncu_profile.py with the time left (>= 30 s): hardware counters (DRAM read bandwidth, IPC, pipe
#      utilisation, top stall reasons, stall samples per SASS region) of the headline shape's default and best
#      variants, where ncu can read counters;
#   5. gpu_tune.json: the library, seconds and status of each part, the machine, the headline numbers and targets.
# Usage: build_scripts/gpu_tune.sh [--build] [--library PATH] [--dry-run [--gpu h100|h200]]
#   --dry-run: no GPU needed: checks the arguments, says which library would be used, prints every part's budget and
#   planned runs with estimated seconds (benchmarks/gpu_plan.py), and exits 0.
# Outputs in $OUT (default build/gpu_tune), 7 files: gpu_tune.json, bench_kernels.json, plan_winners.json,
# bench_prefill.json, bench_e2e_gpu.json, ncu.json, logs.tar.gz (every log, ncu's CSV pages and, when they fit,
# its reports). Exit status: nonzero when the library is missing or the decode sweep fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=build_scripts/gpu_lib.sh
source "${ROOT}/build_scripts/gpu_lib.sh"
OUT="${OUT:-${ROOT}/build/gpu_tune}"
PY="${PYTHON:-python3}"
BUILD=0 LIBRARY="" DRY_RUN=0 DRY_GPU=h100
TOTAL=290 B_SWEEP=100 B_PREFILL=30 B_E2E=80 NCU_MIN=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    --library|--gpu) [[ $# -ge 2 ]] || { echo "gpu_tune.sh: $1 needs a value" >&2; exit 2; }
                     set -- "$1=$2" "${@:3}" ;;
  esac
  case "$1" in
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) gpu_lib_parse_arg "$1" || { echo "gpu_tune.sh: unknown argument '$1' (see --help)" >&2; exit 2; } ;;
  esac
  shift
done
if [[ "${DRY_GPU}" != h100 && "${DRY_GPU}" != h200 ]]; then
  echo "gpu_tune.sh: --gpu ${DRY_GPU}: h100 or h200" >&2; exit 2
fi
cd "${ROOT}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
T0=$(date +%s)
gpu_lib_detect_arch
gpu_lib_find || exit 2

if [[ "${DRY_RUN}" == 1 ]]; then
  echo "gpu_tune.sh --dry-run: arch sm_${ARCH}, output ${OUT#"${ROOT}"/}"
  echo "  library: ${LIB_SOURCE}"
  echo "  budgets: sweep ${B_SWEEP} s, prefill ${B_PREFILL} s, e2e ${B_E2E} s, ncu the rest (>= ${NCU_MIN} s);" \
       "total <= ${TOTAL} s"
  exec ${PY} benchmarks/gpu_plan.py tune --gpu "${DRY_GPU}" ${LIB:+--library "${LIB}"} --sweep-budget "${B_SWEEP}" \
    --prefill-budget "${B_PREFILL}" --e2e-budget "${B_E2E}" --ncu-budget $(( TOTAL - B_SWEEP - B_PREFILL - B_E2E - 25 ))
fi

mkdir -p "${OUT}/logs"
echo "gpu_tune.sh: arch sm_${ARCH}, output ${OUT}, library: ${LIB_SOURCE}"
gpu_lib_prepare 150
[[ -f "${OUT}/build.log" ]] && mv "${OUT}/build.log" "${OUT}/logs/build.log"
if [[ ${BUILD_RC} -ne 0 || ! -f "${TRTLLM_KIVI_KERNELS_LIB}" ]]; then
  echo "gpu_tune.sh: no kernel library (build rc=${BUILD_RC}); see ${OUT}/logs/build.log" >&2
  exit 1
fi
declare -A RC SEC
run_part() {  # run_part NAME BUDGET_S CMD...: runs CMD with a hard timeout of BUDGET + 40 s, log in logs/NAME.log
  local name="$1" budget="$2"; shift 2
  local t=$(date +%s)
  timeout $(( budget + 40 )) "$@" >"${OUT}/logs/${name}.log" 2>&1
  RC[${name}]=$?; SEC[${name}]=$(( $(date +%s) - t ))
  echo "gpu_tune.sh: ${name} rc=${RC[${name}]} in ${SEC[${name}]} s"
}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }

run_part sweep "${B_SWEEP}" ${PY} benchmarks/bench_kernels.py --time-budget "${B_SWEEP}" \
  --out "${OUT}/bench_kernels.json"
run_part winners 10 ${PY} benchmarks/plan_winners.py "${OUT}/bench_kernels.json" --out "${OUT}/plan_winners.json"
L=$(left); BP=$(( L - B_E2E - NCU_MIN - 20 < B_PREFILL ? L - B_E2E - NCU_MIN - 20 : B_PREFILL ))
if [[ ${BP} -ge 10 ]]; then
  run_part prefill "${BP}" ${PY} benchmarks/bench_prefill.py --time-budget "${BP}" --out "${OUT}/bench_prefill.json"
fi
L=$(left); BE=$(( L - NCU_MIN - 15 < B_E2E ? L - NCU_MIN - 15 : B_E2E ))
if [[ ${BE} -ge 20 ]]; then
  run_part e2e "${BE}" ${PY} benchmarks/bench_e2e_gpu.py --time-budget "${BE}" --out "${OUT}/bench_e2e_gpu.json"
fi
L=$(left); BN=$(( L - 15 ))
if [[ ${BN} -ge ${NCU_MIN} ]]; then
  run_part ncu "${BN}" ${PY} benchmarks/ncu_profile.py run --sweep "${OUT}/bench_kernels.json" \
    --out "${OUT}/ncu.json" --raw-dir "${OUT}/logs" --time-budget "${BN}"
fi

PARTS=""; for k in "${!RC[@]}"; do PARTS+="${k}=${RC[${k}]}:${SEC[${k}]} "; done
${PY} - "${OUT}" "${ARCH}" "${LIB_SOURCE}" "${PARTS}" <<'PYEOF'
import json, subprocess, sys
from pathlib import Path
out, arch, lib_source, parts = sys.argv[1:]
out = Path(out)
s = {"arch": arch, "library": lib_source, "parts": {}}
for p in parts.split():
    name, rest = p.split("=")
    rc, sec = rest.split(":")
    s["parts"][name] = {"rc": int(rc), "seconds": int(sec)}
try:
    s["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip() or "unknown"
except (OSError, subprocess.SubprocessError):
    s["git_commit"] = "unknown"
def load(name):
    f = out / name
    return json.loads(f.read_text()) if f.exists() else None
k, w, pf, e2e, ncu = (load(n) for n in ("bench_kernels.json", "plan_winners.json", "bench_prefill.json",
                                        "bench_e2e_gpu.json", "ncu.json"))
lines = []
if k:
    s["machine"] = k.get("machine")
    s["read_ceiling_gbps"] = k.get("read_ceiling", {}).get("gbps")
    s["kernel_targets"] = k.get("targets")
    lines.append(f"{k['machine'].get('gpu')} ({k['machine'].get('sms')} SMs): read ceiling "
                 f"{s['read_ceiling_gbps']:.0f} GB/s; variants {[v['name'] for v in k.get('variants', [])]}")
    for r in k.get("decode", []):
        b = r.get("best_variant") or {}
        lines.append(f"  {r['model']} b{r['batch']} {r['context']}: default "
                     f"{1e3 * r.get('kivi_attention', {}).get('median_ms', 0):.1f} us, best {b.get('name')} "
                     f"{1e3 * (b.get('attention_ms') or 0):.1f} us, sdpa "
                     f"{1e3 * r.get('sdpa_fp16', {}).get('median_ms', 0):.1f} us, "
                     f"{100 * r.get('kivi_fraction_of_read_ceiling', 0):.0f}% of the ceiling")
if w:
    s["plan_winners"] = {c: {kk: v.get(kk) for kk in ("variant", "name", "geomean_vs_best", "plan_row")}
                         for c, v in w.items() if v.get("measured")}
    lines += [f"  plan {c}: {v['plan_row']}" for c, v in s["plan_winners"].items()]
if pf:
    s["prefill"] = [{kk: r.get(kk) for kk in ("chunk", "history", "attention_speedup_vs_sdpa",
                                              "append_time_vs_fp16_write", "step_speedup_vs_sdpa_plus_write")}
                    for r in pf.get("prefill", [])]
    lines += [f"  prefill {r['chunk']} over {r['history']}: x{r['attention_speedup_vs_sdpa'] or 0:.2f} sdpa"
              for r in s["prefill"]]
if e2e:
    s["e2e"] = {"targets": e2e.get("targets"), "fp16_attention": e2e.get("fp16_attention"),
                "max_batch": {kk: v.get("max_batch") for kk, v in e2e.get("max_batch", {}).items()},
                "tokens_per_s": {f"{r['kind']} b{r['batch']} {r['context']}": r["tokens_per_s"]
                                 for r in e2e.get("decode", [])}}
    lines += [f"  e2e {kk}: {v:.0f} tok/s" for kk, v in s["e2e"]["tokens_per_s"].items()]
    lines.append(f"  e2e max batch at 32K: {s['e2e']['max_batch']}; targets {s['e2e']['targets']}")
if ncu:
    s["ncu"] = {"skipped": ncu.get("skipped"), "profiles": [
        {"variant": p.get("variant"), "error": p.get("error"),
         "main_kernel": max(p.get("kernels", []), key=lambda x: x.get("duration_ns") or 0, default=None)}
        for p in ncu.get("profiles", [])]}
    for p in s["ncu"]["profiles"]:
        m = p["main_kernel"] or {}
        lines.append(f"  ncu variant {p['variant']}: {p['error'] or ''}{m.get('dram_read_gbps') or 0:.0f} GB/s DRAM "
                     f"read, IPC {m.get('ipc_active')}, stalls {list((m.get('top_stalls') or {}))[:3]}")
(out / "gpu_tune.json").write_text(json.dumps(s, indent=1))
print("\n".join(lines))
PYEOF
# Every log, ncu's CSV pages and (when they fit the 16 MiB a returned file may have) its reports, in one file.
tar -czf "${OUT}/logs.tar.gz" -C "${OUT}" --exclude='*.ncu-rep' logs 2>/dev/null
if [[ -n "$(ls "${OUT}"/logs/*.ncu-rep 2>/dev/null)" ]]; then
  tar -czf "${OUT}/logs_full.tar.gz" -C "${OUT}" logs 2>/dev/null
  [[ $(stat -c %s "${OUT}/logs_full.tar.gz") -lt 16000000 ]] && mv "${OUT}/logs_full.tar.gz" "${OUT}/logs.tar.gz"
  rm -f "${OUT}/logs_full.tar.gz"
fi
rm -rf "${OUT}/logs"
echo "gpu_tune.sh: total $(( $(date +%s) - T0 )) s; outputs: $(cd "${OUT}" && ls | tr '\n' ' ')"
[[ ${RC[sweep]:-1} -eq 0 ]]
