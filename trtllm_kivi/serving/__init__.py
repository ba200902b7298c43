"""Serving: a Triton Inference Server model repository (python backend) over trtllm-kivi's runners and scheduler.

    ServingConfig, load_runner      what is served (engine folder or model spec + KV spec) and how it is loaded
    write_repository(out, cfg)      REPO/<name>/{config.pbtxt, serving.json, 1/model.py}
    TritonEnv, TritonServer         the serving venv (build_scripts/setup_triton_env.sh) and a tritonserver process
    parse_request, InvalidRequest   the request protocol and its validation (serving/protocol.py)
serving/triton_model.py runs inside Triton's python backend only (it imports triton_python_backend_utils).
"""

from .config import ServingConfig, load_runner
from .protocol import INPUTS, OUTPUTS, InvalidRequest, ParsedRequest, parse_request
from .repository import DEFAULT_MODEL_NAME, config_pbtxt, write_repository
from .server import TritonEnv, TritonServer, free_port

__all__ = ["DEFAULT_MODEL_NAME", "INPUTS", "OUTPUTS", "InvalidRequest", "ParsedRequest", "ServingConfig",
           "TritonEnv", "TritonServer", "config_pbtxt", "free_port", "load_runner", "parse_request",
           "write_repository"]
