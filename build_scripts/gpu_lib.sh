# Shared by build_scripts/gpu_check.sh and gpu_tune.sh (sourced, not run): the GPU's arch, the kernel library to use,
# and a build only when asked or when none is there, so that no GPU second goes to nvcc in the usual case.
#
# The library, first found: --library PATH, $TRTLLM_KIVI_KERNELS_LIB, build/gpu-lib/libtrtllm_kivi_kernels.so
# (what build_scripts/stage_gpu_lib.sh prepares on the development machine, to be carried to the GPU machine),
# build/plugins/libtrtllm_kivi_kernels.so. --build (or nothing found) builds it for this GPU's arch into build/plugins
# with ptxas info (build.log). The chosen library is exported as TRTLLM_KIVI_KERNELS_LIB for every test and benchmark.
# A library whose fat binary lacks this GPU's sm_XX is rebuilt when nvcc is there, else refused (cuobjdump checks).

gpu_lib_parse_arg() {  # sets BUILD / LIBRARY / DRY_RUN / DRY_GPU from one option; returns 1 when not ours
  case "$1" in
    --build) BUILD=1 ;;
    --library=*) LIBRARY="${1#--library=}" ;;
    --dry-run) DRY_RUN=1 ;;
    --gpu=*) DRY_GPU="${1#--gpu=}" ;;
    *) return 1 ;;
  esac
}

gpu_lib_detect_arch() {  # ARCH = compute capability without the dot (90), "unknown" when nothing answers
  ARCH="${KIVI_GPU_ARCH:-}"
  if [[ -z "${ARCH}" && "${DRY_RUN:-0}" != 1 ]]; then
    ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
    [[ -z "${ARCH}" ]] && ARCH="$(${PY} -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")' \
                                   2>/dev/null)"
  fi
  ARCH="${ARCH:-unknown}"
}

gpu_lib_find() {  # LIB = the library to use ("" when it must be built); LIB_SOURCE says why
  LIB=""; LIB_SOURCE=""
  local cand
  if [[ -n "${LIBRARY:-}" && ! -f "${LIBRARY}" ]]; then
    echo "$(basename "$0"): --library ${LIBRARY} does not exist" >&2; return 2
  fi
  for cand in "${LIBRARY:-}" "${TRTLLM_KIVI_KERNELS_LIB:-}" "${ROOT}/build/gpu-lib/libtrtllm_kivi_kernels.so" \
              "${ROOT}/build/plugins/libtrtllm_kivi_kernels.so"; do
    if [[ -n "${cand}" && -f "${cand}" ]]; then
      LIB="$(cd "$(dirname "${cand}")" && pwd)/$(basename "${cand}")"; break
    fi
  done
  if [[ "${BUILD:-0}" == 1 ]]; then LIB_SOURCE="--build: built here for sm_${ARCH}"; LIB=""
  elif [[ -z "${LIB}" ]]; then LIB_SOURCE="none found: built here for sm_${ARCH}"
  else LIB_SOURCE="prebuilt ${LIB#"${ROOT}"/}"; fi
}

gpu_lib_has_arch() {  # 0 when the library's fat binary has SASS for sm_${ARCH} (or cuobjdump cannot tell)
  local dump
  dump="$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -n1)"
  [[ -z "${dump}" || "${ARCH}" == unknown ]] && return 0
  "${dump}" --list-elf "$1" 2>/dev/null | grep -q "sm_${ARCH}"
}

gpu_lib_prepare() {  # builds when needed (timeout $1 s); exports TRTLLM_KIVI_KERNELS_LIB; BUILD_RC, BUILD_S
  local t0=$(date +%s)
  BUILD_RC=0
  if [[ -n "${LIB}" ]] && ! gpu_lib_has_arch "${LIB}"; then
    LIB_SOURCE="${LIB_SOURCE} has no sm_${ARCH} code: built here"; LIB=""
  fi
  if [[ -z "${LIB}" ]]; then
    if [[ "${ARCH}" == unknown ]]; then
      echo "$(basename "$0"): cannot build: the GPU arch is unknown (nvidia-smi and torch both failed)" >&2
      BUILD_RC=1
    else
      timeout "$1" "${ROOT}/build_scripts/build_plugin.sh" --arch "${ARCH}" --build-dir "${ROOT}/build/plugins" \
        --ptxas-verbose >"${OUT}/build.log" 2>&1
      BUILD_RC=$?
      LIB="${ROOT}/build/plugins/libtrtllm_kivi_kernels.so"
    fi
  elif [[ -f "$(dirname "${LIB}")/build.log" ]]; then
    cp "$(dirname "${LIB}")/build.log" "${OUT}/build.log"  # the ptxas report of the carried build
  fi
  export TRTLLM_KIVI_KERNELS_LIB="${LIB}"
  BUILD_S=$(( $(date +%s) - t0 ))
}
