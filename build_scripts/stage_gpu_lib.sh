#!/usr/bin/env bash
# Build the kernel library for a GPU machine on this (development) machine, so that no GPU second goes to nvcc:
# build_plugin.sh for the given arch (default 90: H100 / H200) with ptxas info, then the library and its build log
# (registers and spills per kernel, which gpu_check.json reports) copied into build/gpu-lib/, the folder
# build_scripts/gpu_check.sh and gpu_tune.sh use first. Carry build/gpu-lib with the run (it is git-ignored).
#   build_scripts/stage_gpu_lib.sh [--arch 90] [--build-dir build/plugins-gpu] [--jobs N]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH=90 BUILD_DIR="${ROOT}/build/plugins-gpu" JOBS=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "stage_gpu_lib.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
DEST="${ROOT}/build/gpu-lib"
mkdir -p "${DEST}"
"${ROOT}/build_scripts/build_plugin.sh" --arch "${ARCH}" --build-dir "${BUILD_DIR}" --ptxas-verbose --jobs "${JOBS}" \
  >"${DEST}/build.log" 2>&1 || { tail -n 30 "${DEST}/build.log" >&2; exit 1; }
cp "${BUILD_DIR}/libtrtllm_kivi_kernels.so" "${DEST}/"
SIZE=$(du -sm "${DEST}" | cut -f1)
[[ ${SIZE} -le 60 ]] || { echo "stage_gpu_lib.sh: ${DEST} is ${SIZE} MiB; a run carries at most 64 MiB" >&2; exit 1; }
echo "stage_gpu_lib.sh: build/gpu-lib (${SIZE} MiB, sm_${ARCH}): carry [\"build/gpu-lib\"]"
