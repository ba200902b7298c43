#!/usr/bin/env bash
# One-command GPU check of the KIVI kernels on a bare GPU machine (nvcc, cmake, python3 with torch + pytest + numpy):
#   1. build the kernel library for this GPU's arch only (nvidia-smi, else torch), with ptxas register/spill info;
#   2. run the GPU tests (tests/test_kernels_gpu.py: the default mma.sync kernel against the reference);
#   3. run the kernel benchmark (benchmarks/bench_kernels.py: KIVI vs the same kernel over an FP16 cache, torch SDPA,
#      copy bandwidth);
#   4. with the time left, compute-sanitizer memcheck and racecheck over a few small GPU tests (sanitizer.log);
#   5. write $OUT/gpu_check.json (summary) next to build.log, tests.log, junit XML and bench_kernels.json.
# Usage: build_scripts/gpu_check.sh [--quick]    ($OUT defaults to build/gpu_check; total budget ~5 minutes;
#        $PYTHON picks the interpreter, $KIVI_GPU_ARCH overrides the detected arch)
# Exit status: nonzero when the build or a test fails (the benchmark's goals are reported, not enforced).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-${ROOT}/build/gpu_check}"
QUICK=""
[[ "${1:-}" == "--quick" ]] && QUICK="--quick"
mkdir -p "${OUT}"
cd "${ROOT}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
PY="${PYTHON:-python3}"
T0=$(date +%s)

ARCH="${KIVI_GPU_ARCH:-}"  # override (e.g. to dry-run the script on a machine without a GPU)
if [[ -z "${ARCH}" ]]; then
  ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
fi
if [[ -z "${ARCH}" ]]; then
  ARCH="$(${PY} -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")' 2>/dev/null)"
fi
if [[ -z "${ARCH}" ]]; then
  echo "gpu_check.sh: cannot detect the GPU arch (nvidia-smi and torch both failed)" >&2
  ARCH="unknown"
fi
echo "gpu_check.sh: arch sm_${ARCH}, output ${OUT}"

build_rc=1
if [[ "${ARCH}" != "unknown" ]]; then
  timeout 150 "${ROOT}/build_scripts/build_plugin.sh" --arch "${ARCH}" --build-dir "${ROOT}/build/plugins" \
    --ptxas-verbose >"${OUT}/build.log" 2>&1
  build_rc=$?
fi
T1=$(date +%s)
echo "gpu_check.sh: build rc=${build_rc} in $((T1 - T0)) s"

tests_rc=1
if [[ ${build_rc} -eq 0 ]]; then
  timeout 170 ${PY} -m pytest -p no:cacheprovider -q --durations=8 tests/test_kernels_gpu.py \
    tests/test_runtime_torch_runner.py -m gpu --junitxml="${OUT}/gpu_tests.xml" >"${OUT}/tests.log" 2>&1
  tests_rc=$?
fi
T2=$(date +%s)
echo "gpu_check.sh: gpu tests rc=${tests_rc} in $((T2 - T1)) s"; tail -n 5 "${OUT}/tests.log" 2>/dev/null

bench_rc=1
if [[ ${build_rc} -eq 0 ]]; then
  LEFT=$(( 290 - (T2 - T0) ))
  BUDGET=$(( LEFT > 160 ? LEFT - 120 : 40 ))  # ~80 s stay for the sanitizer
  timeout $(( BUDGET + 30 )) ${PY} benchmarks/bench_kernels.py ${QUICK} --time-budget "${BUDGET}" \
    --out "${OUT}/bench_kernels.json" >"${OUT}/bench.log" 2>&1
  bench_rc=$?
fi
T3=$(date +%s)
echo "gpu_check.sh: bench rc=${bench_rc} in $((T3 - T2)) s"; tail -n 25 "${OUT}/bench.log" 2>/dev/null

# Out-of-bounds accesses and shared-memory races the value checks can miss (small shapes: sanitized kernels run
# far slower). Skipped when under 60 s of the ~300 s budget are left.
san_rc=-1
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)"
LEFT=$(( 300 - (T3 - T0) ))
if [[ ${build_rc} -eq 0 && -n "${SAN}" && ${LEFT} -ge 60 ]]; then
  san_rc=0
  for tool in memcheck racecheck; do
    if [[ ${tool} == memcheck ]]; then SEL="batch_sweep and 128-4-dtype0-3- or sink_tokens and 4-2-2 or rows_no_sequence"
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
  "$((T1 - T0))" "$((T2 - T1))" "$((T3 - T2))" "${san_rc}" "$((T3b - T3))" <<'PYEOF'
import json, sys, re
from pathlib import Path
import xml.etree.ElementTree as ET
import subprocess
out, arch, b, t, bench, tb, tt, tbench, san, tsan = sys.argv[1:]
out = Path(out)
summary = {"arch": arch, "build_rc": int(b), "tests_rc": int(t), "bench_rc": int(bench), "sanitizer_rc": int(san),
           "seconds": {"build": int(tb), "tests": int(tt), "bench": int(tbench), "sanitizer": int(tsan)}}
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
    summary["bench"] = {"copy_gbps": rep["copy"]["gbps"], "goals": rep.get("goals"),
                        "decode": [{k: r.get(k) for k in ("model", "batch", "context", "speedup_vs_fp16_mma",
                                                          "speedup_vs_sdpa_fp16", "kivi_fraction_of_copy_bw")}
                                   for r in rep.get("decode", [])],
                        "quantize_gbps": rep.get("quantize", {}).get("gbps"), "file": bench_json.name}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k != "ptxas"}, indent=1))
PYEOF
T4=$(date +%s)
echo "gpu_check.sh: total $((T4 - T0)) s"
[[ ${build_rc} -eq 0 && ${tests_rc} -eq 0 ]]
