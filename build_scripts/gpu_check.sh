#!/usr/bin/env bash
# One-command GPU check of the KIVI kernels on a bare GPU machine (python3 with torch, pytest, numpy; nvcc and cmake
# only when it must build), in ~290 s of wall time:
#   0. the kernel library (build_scripts/gpu_lib.sh): a prebuilt one when given or present (--library, then
#      $TRTLLM_KIVI_KERNELS_LIB, build/gpu-lib/ as build_scripts/stage_gpu_lib.sh prepares it, build/plugins/): no GPU
#      second goes to nvcc; --build, or none found, builds for this GPU's arch (<= 150 s, ptxas info in build.log);
#   1. correctness, the gpu tests (-m gpu): tests/test_kernels_gpu.py (the kernels against the reference),
#      test_decode_variants_gpu.py (every decode variant), test_stream_read.py (the roofline kernel),
#      test_cuda_graph.py (captured decode steps), test_runtime_torch_runner.py; <= 150 s, junit XML;
#   2. benchmarks/bench_kernels.py --headline: every decode variant at the headline shapes (Llama-3-8B B8 32K, B1 4K,
#      B1 32K; attention and whole step, flush and non-flush) against the read ceiling of the read-only streaming
#      kernel, the same kernel over FP16 and torch SDPA, L2-cold; the time left minus ~70 s (>= 40 s);
#   3. with >= 60 s left, compute-sanitizer memcheck and racecheck over a few small GPU tests (sanitizer.log);
#   4. gpu_check.json: status and seconds of each part, the library used, nvidia-smi state, ptxas registers/spills
#      (of a build here, or the carried build.log), test counts and failures, the benchmark's headline and targets.
# Usage: build_scripts/gpu_check.sh [--quick] [--build] [--library PATH] [--dry-run [--gpu h100|h200]]
#   --dry-run: no GPU needed: checks the arguments, says which library would be used or built, prints each part's
#   budget and the benchmark's planned runs (benchmarks/gpu_plan.py), and exits 0.
# Outputs in $OUT (default build/gpu_check): gpu_check.json, bench_kernels.json, tests.log, gpu_tests.xml, bench.log,
# sanitizer.log, build.log (7 files). $PYTHON picks the interpreter, $KIVI_GPU_ARCH overrides the detected arch.
# Exit status: nonzero when the build or a test fails (the benchmark's targets are reported, never enforced).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=build_scripts/gpu_lib.sh
source "${ROOT}/build_scripts/gpu_lib.sh"
OUT="${OUT:-${ROOT}/build/gpu_check}"
PY="${PYTHON:-python3}"
QUICK="" BUILD=0 LIBRARY="" DRY_RUN=0 DRY_GPU=h100
TOTAL=290 BUILD_MAX=150 TESTS_MAX=150 SAN_MIN=60
GPU_TESTS=(tests/test_kernels_gpu.py tests/test_decode_variants_gpu.py tests/test_stream_read.py
           tests/test_cuda_graph.py tests/test_runtime_torch_runner.py)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --library|--gpu) [[ $# -ge 2 ]] || { echo "gpu_check.sh: $1 needs a value" >&2; exit 2; }
                     set -- "$1=$2" "${@:3}" ;;
  esac
  case "$1" in
    --quick) QUICK="--quick" ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) gpu_lib_parse_arg "$1" || { echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2; } ;;
  esac
  shift
done
if [[ "${DRY_GPU}" != h100 && "${DRY_GPU}" != h200 ]]; then
  echo "gpu_check.sh: --gpu ${DRY_GPU}: h100 or h200" >&2; exit 2
fi
cd "${ROOT}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
T0=$(date +%s)
gpu_lib_detect_arch
gpu_lib_find || exit 2

if [[ "${DRY_RUN}" == 1 ]]; then
  echo "gpu_check.sh --dry-run: arch sm_${ARCH}, output ${OUT#"${ROOT}"/}"
  echo "  library: ${LIB_SOURCE}"
  if [[ -n "${LIB}" ]]; then echo "  0. build: skipped (prebuilt)"
  else echo "  0. build: build_plugin.sh --arch ${ARCH}, <= ${BUILD_MAX} s"; fi
  echo "  1. tests: ${PY} -m pytest -m gpu ${GPU_TESTS[*]} (<= ${TESTS_MAX} s)"
  echo "  2. bench: benchmarks/bench_kernels.py --headline ${QUICK} (the time left minus 70 s, >= 40 s)"
  echo "  3. sanitizer: memcheck + racecheck when >= ${SAN_MIN} s are left; 4. gpu_check.json; total <= ${TOTAL} s"
  exec ${PY} benchmarks/gpu_plan.py check --gpu "${DRY_GPU}" ${LIB:+--library "${LIB}"} --sweep-budget 100
fi

mkdir -p "${OUT}"
echo "gpu_check.sh: arch sm_${ARCH}, output ${OUT}, library: ${LIB_SOURCE}"
gpu_lib_prepare "${BUILD_MAX}"
build_rc=${BUILD_RC}
T1=$(date +%s)
echo "gpu_check.sh: library rc=${build_rc} in $((T1 - T0)) s: ${TRTLLM_KIVI_KERNELS_LIB}"

tests_rc=1
if [[ ${build_rc} -eq 0 ]]; then
  LEFT=$(( TOTAL - (T1 - T0) - 60 ))
  timeout $(( LEFT < TESTS_MAX ? LEFT : TESTS_MAX )) ${PY} -m pytest -p no:cacheprovider -q --durations=8 \
    "${GPU_TESTS[@]}" -m gpu --junitxml="${OUT}/gpu_tests.xml" >"${OUT}/tests.log" 2>&1
  tests_rc=$?
fi
T2=$(date +%s)
echo "gpu_check.sh: gpu tests rc=${tests_rc} in $((T2 - T1)) s"; tail -n 5 "${OUT}/tests.log" 2>/dev/null

bench_rc=1
if [[ ${build_rc} -eq 0 ]]; then
  LEFT=$(( TOTAL - (T2 - T0) ))
  BUDGET=$(( LEFT > 110 ? LEFT - 70 : 40 ))  # ~70 s stay for the sanitizer and the summary
  PYTHONUNBUFFERED=1 timeout $(( BUDGET + 30 )) ${PY} benchmarks/bench_kernels.py --headline ${QUICK} \
    --time-budget "${BUDGET}" --out "${OUT}/bench_kernels.json" >"${OUT}/bench.log" 2>&1
  bench_rc=$?
fi
T3=$(date +%s)
echo "gpu_check.sh: bench rc=${bench_rc} in $((T3 - T2)) s"

# Out-of-bounds accesses and shared-memory races the value checks can miss (small shapes: sanitized kernels run
# far slower). Skipped when under SAN_MIN s of the budget are left.
san_rc=-1
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)"
LEFT=$(( TOTAL + 10 - (T3 - T0) ))
if [[ ${build_rc} -eq 0 && -n "${SAN}" && ${LEFT} -ge ${SAN_MIN} ]]; then
  san_rc=0
  for tool in memcheck racecheck; do
    if [[ ${tool} == memcheck ]]
    then SEL="batch_sweep and 128-4-dtype0-3- or sink_tokens and 4-2-2 or rows_no_sequence"
    else SEL="batch_sweep and 128-4-dtype0-3- or unhinted and 1-dtype0 or decode_loop and 2-2-32-32"; fi
    echo "== ${tool}: -k '${SEL}'" >>"${OUT}/sanitizer.log"
    timeout $(( LEFT / 2 )) "${SAN}" --tool "${tool}" --error-exitcode 97 ${PY} -m pytest -p no:cacheprovider -q \
      tests/test_kernels_gpu.py -k "${SEL}" >>"${OUT}/sanitizer.log" 2>&1
    rc=$?; echo "== ${tool} rc=${rc}" >>"${OUT}/sanitizer.log"; [[ ${rc} -ne 0 ]] && san_rc=${rc}
  done
fi
T3b=$(date +%s)
echo "gpu_check.sh: sanitizer rc=${san_rc} in $((T3b - T3)) s (${SAN:-no compute-sanitizer})"
grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "${OUT}/sanitizer.log" 2>/dev/null | tail -n 12

${PY} - "${OUT}" "${ARCH}" "${build_rc}" "${tests_rc}" "${bench_rc}" \
  "$((T1 - T0))" "$((T2 - T1))" "$((T3 - T2))" "${san_rc}" "$((T3b - T3))" "${LIB_SOURCE}" <<'PYEOF'
import json, sys, re
from pathlib import Path
import xml.etree.ElementTree as ET
import subprocess
out, arch, b, t, bench, tb, tt, tbench, san, tsan, lib_source = sys.argv[1:]
out = Path(out)
summary = {"arch": arch, "build_rc": int(b), "tests_rc": int(t), "bench_rc": int(bench), "sanitizer_rc": int(san),
           "seconds": {"build": int(tb), "tests": int(tt), "bench": int(tbench), "sanitizer": int(tsan)},
           "library": lib_source}
try:  # the commit, never the checkout's path: the summary is committed as a result
    summary["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           timeout=10).stdout.strip() or "unknown"
except (OSError, subprocess.SubprocessError):
    summary["git_commit"] = "unknown"
try:
    summary["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw",
         "--format=csv"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
except (OSError, subprocess.SubprocessError) as e:
    summary["nvidia_smi"] = f"unavailable: {e}"
san_log = out / "sanitizer.log"
if san_log.exists():
    summary["sanitizer"] = [l for l in san_log.read_text(errors="replace").splitlines()
                            if l.startswith("==") or "SUMMARY" in l or " passed" in l or " failed" in l][-16:]
log = (out / "build.log").read_text(errors="replace") if (out / "build.log").exists() else ""
kernels, cur = [], None
for line in log.splitlines():  # ptxas -v: "Compiling entry function 'NAME' for 'sm_XX'", then spills, registers
    m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
    if m:
        cur = {"kernel": m.group(1), "arch": m.group(2)}
        kernels.append(cur)
    elif cur is not None:
        if (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
        if (m := re.search(r"Used (\d+) registers", line)):
            cur["registers"] = int(m.group(1))
summary["ptxas"] = kernels
summary["spilling_kernels"] = [k["kernel"] for k in kernels if k.get("spill_stores", 0) or k.get("spill_loads", 0)]
junit = out / "gpu_tests.xml"
if junit.exists():
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
bench_json = out / "bench_kernels.json"
if bench_json.exists():
    rep = json.loads(bench_json.read_text())
    summary["bench"] = {"read_ceiling_gbps": rep.get("read_ceiling", {}).get("gbps"),
                        "copy_gbps": rep.get("copy", {}).get("gbps"), "targets": rep.get("targets"),
                        "goals": rep.get("goals"), "variants": [v["name"] for v in rep.get("variants", [])],
                        "decode": [{k: r.get(k) for k in ("model", "batch", "context", "speedup_vs_fp16_mma",
                                                          "speedup_vs_sdpa_fp16", "kivi_fraction_of_read_ceiling",
                                                          "best_variant", "kivi_step_amortized_ms")}
                                   for r in rep.get("decode", [])],
                        "quantize_gbps": rep.get("quantize", {}).get("gbps"), "file": bench_json.name}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k not in ("ptxas", "bench")}, indent=1))
PYEOF
# The benchmark's own table last: the reply of a GPU run carries the end of the output.
sed -n '/^shape /,$p' "${OUT}/bench.log" 2>/dev/null | tail -n 12
T4=$(date +%s)
echo "gpu_check.sh: total $((T4 - T0)) s"
[[ ${build_rc} -eq 0 && ${tests_rc} -eq 0 ]]
