#!/usr/bin/env bash
# Build the native CPU KIVI library (plugins/cpu -> build/cpu/libtrtllm_kivi_cpu.so): g++ and CMake only, no CUDA.
#
#   build_scripts/build_cpu_kernels.sh [--build-dir DIR] [--jobs N] [--debug] [--bench]
#   (--bench: also benchmarks/cpu_inner_loops.cpp as DIR/kivi_cpu_inner_loops)
#
# The AVX2 and AVX-512 paths are compiled in and chosen at run time, so the library runs on any x86-64 CPU.
# trtllm_kivi/cpu finds it in build/cpu/ (or $TRTLLM_KIVI_CPU_LIB). Exits nonzero on a configure/compile error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${ROOT}/build/cpu"
JOBS="$(nproc 2>/dev/null || echo 2)"
BUILD_TYPE=Release
BENCH=OFF
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --debug) BUILD_TYPE=Debug; shift ;;
    --bench) BENCH=ON; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "build_cpu_kernels.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cmake -S "${ROOT}/plugins/cpu" -B "${BUILD_DIR}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE}" -DKIVI_CPU_BENCH="${BENCH}" >/dev/null
cmake --build "${BUILD_DIR}" --parallel "${JOBS}"
LIB="${BUILD_DIR}/libtrtllm_kivi_cpu.so"
[[ -f "${LIB}" ]] || { echo "build_cpu_kernels.sh: build finished but ${LIB} is missing" >&2; exit 1; }
echo "build_cpu_kernels.sh: built ${LIB}"
