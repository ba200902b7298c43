#!/usr/bin/env bash
# Build the KIVI CUDA kernel library (and the TensorRT plugin when TensorRT headers are found).
#
#   build_scripts/build_plugin.sh [--arch "80;90"] [--build-dir DIR] [--tensorrt-root DIR] [--ptxas-verbose]
#                                 [--jobs N] [--debug]
#
# --arch           CUDA architectures (CMAKE_CUDA_ARCHITECTURES); "90" or "80;90" (default "80;90"; $KIVI_CUDA_ARCHS).
#                  Engines run only where the plugin has code for their GPU: "80;120" covers every TensorRT-RTX
#                  target the kernels run on (8.0, 8.6, 8.9, 12.0, 12.1), "90" Hopper (docs/tensorrt.md).
# --build-dir      out-of-source build directory (default <repo>/build/plugins, git-ignored).
# --tensorrt-root  TensorRT install/headers directory, passed to CMake as TensorRT_ROOT (default $TensorRT_ROOT):
#                  e.g. a checkout of github.com/NVIDIA/TensorRT (its include/ holds the public headers).
# --ptxas-verbose  print ptxas register/spill usage per kernel.
# Exits nonzero on any configure or compile error. Prints the library path on success.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCHS="${KIVI_CUDA_ARCHS:-80;90}"
BUILD_DIR="${ROOT}/build/plugins"
TRT_ROOT="${TensorRT_ROOT:-}"
PTXAS=OFF
JOBS="$(nproc 2>/dev/null || echo 2)"
BUILD_TYPE=Release

while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) ARCHS="$2"; shift 2 ;;
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --tensorrt-root) TRT_ROOT="$2"; shift 2 ;;
    --ptxas-verbose) PTXAS=ON; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --debug) BUILD_TYPE=Debug; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "build_plugin.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
ARCHS="${ARCHS//,/;}"  # accept "80,90" too

if ! command -v nvcc >/dev/null 2>&1 && [[ -z "${CUDACXX:-}" ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then export CUDACXX=/usr/local/cuda/bin/nvcc
  else echo "build_plugin.sh: nvcc not found (put it on PATH or set CUDACXX)" >&2; exit 1; fi
fi

CMAKE_ARGS=(-S "${ROOT}/plugins" -B "${BUILD_DIR}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE}"
            "-DCMAKE_CUDA_ARCHITECTURES=${ARCHS}" -DKIVI_PTXAS_VERBOSE="${PTXAS}")
if [[ -n "${TRT_ROOT}" ]]; then
  CMAKE_ARGS+=("-DTensorRT_ROOT=${TRT_ROOT}")
fi

echo "build_plugin.sh: archs=${ARCHS} build_dir=${BUILD_DIR} TensorRT_ROOT=${TRT_ROOT:-<none>}"
start=$(date +%s)
cmake "${CMAKE_ARGS[@]}"
cmake --build "${BUILD_DIR}" --parallel "${JOBS}"
end=$(date +%s)
LIB="${BUILD_DIR}/libtrtllm_kivi_kernels.so"
if [[ ! -f "${LIB}" ]]; then
  echo "build_plugin.sh: build finished but ${LIB} is missing" >&2; exit 1
fi
echo "build_plugin.sh: built ${LIB} in $((end - start)) s"
# KiviAttention plugin status (written by plugins/kiviAttentionPlugin/CMakeLists.txt): built, or skipped and why.
if [[ -f "${BUILD_DIR}/kivi_plugin_status.txt" ]]; then
  echo "build_plugin.sh: KiviAttention plugin: $(cat "${BUILD_DIR}/kivi_plugin_status.txt")"
fi
# The GPU code in the plugin (trtllm-kivi build checks it against an engine's targets and refuses a mismatch).
PLUGIN="${BUILD_DIR}/libtrtllm_kivi_plugin.so"
CUOBJDUMP="$(command -v cuobjdump || ls "${ROOT}"/.venv/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump 2>/dev/null | head -n1 || true)"
if [[ -f "${PLUGIN}" && -n "${CUOBJDUMP}" ]]; then
  echo "build_plugin.sh: KiviAttention plugin GPU code: $("${CUOBJDUMP}" --list-elf "${PLUGIN}" | grep -o 'sm_[0-9]*' | sort -u -V | tr '\n' ' ')"
fi
