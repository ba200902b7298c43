"""The Triton python-backend model (decoupled): generation through our runner + continuous-batching scheduler.

Loaded by the generated `<repo>/<name>/1/model.py` inside Triton's python backend stub; it imports
`triton_python_backend_utils`, which only exists there. The scheduler runs in a background thread; `execute`
validates and queues each request and returns at once, and the scheduler thread sends the responses (one per token
when streaming, or one final response). A malformed request gets a TritonError response; nothing else is affected.
"""

from __future__ import annotations

import json
import os
import traceback

import triton_python_backend_utils as pb_utils

from ..runtime.scheduler import Request, RequestRejected, Scheduler
from .config import ServingConfig, load_runner, runner_description
from .protocol import INPUTS, InvalidRequest, parse_request, response_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _response(text: str, ids: list[int], finish_reason: str):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in
                                       response_arrays(text, ids, finish_reason).items()])


def _error(msg: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(msg))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("this model must be decoupled (model_transaction_policy)")
        model_dir = args["model_repository"]  # this model's folder (serving.json, config.pbtxt, 1/)
        with open(os.path.join(model_dir, "serving.json")) as f:
            self.cfg = ServingConfig.from_json(f.read())
        self.runner, self.tokenizer = load_runner(self.cfg)
        self.scheduler = Scheduler(self.runner, self.tokenizer, max_batch_tokens=self.cfg.max_batch_tokens,
                                   prefill_chunk=self.cfg.prefill_chunk).start()
        self.eos = tuple(getattr(self.tokenizer, "eos_ids", ()) or ())
        pb_utils.Logger.log_info(f"trtllm-kivi model at {model_dir}: {self.cfg.engine or self.cfg.model}, "
                                 f"KV {self.cfg.kv}; {runner_description(self.runner)}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            rid = request.request_id()
            tag = f"[request id: {rid}] " if rid else ""  # as Triton's own errors: a streaming client can tell
            try:
                tensors = {}
                for name in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        tensors[name] = t.as_numpy()
                parsed = parse_request(tensors, self.tokenizer, self.runner.vocab_size, self.runner.max_seq_len,
                                       self.cfg.default_max_tokens, self.eos)
                self.scheduler.submit(parsed.prompt, parsed.params,
                                      self._callback(request, sender, parsed.stream, tag), request_id=rid or None)
            except (InvalidRequest, RequestRejected) as e:
                sender.send(_error(f"{tag}invalid request: {e}"), flags=FINAL)
            except Exception as e:  # never let one request take the model down
                pb_utils.Logger.log_error(f"trtllm-kivi: request failed: {traceback.format_exc()}")
                sender.send(_error(f"{tag}internal error: {type(e).__name__}: {e}"), flags=FINAL)
        return None

    def _callback(self, triton_request, sender, stream: bool, tag: str):
        def on_update(req: Request, new: list[int], delta: str) -> None:
            if hasattr(triton_request, "is_cancelled") and triton_request.is_cancelled() and not req.finished:
                req.cancel()
                return
            if req.finish_reason == "error":
                sender.send(_error(f"{tag}generation failed: {req.error}"), flags=FINAL)
            elif req.finished:
                if stream:
                    sender.send(_response(delta, new, req.finish_reason), flags=FINAL)
                else:
                    sender.send(_response(req.text, req.tokens, req.finish_reason), flags=FINAL)
            elif stream and (new or delta):
                sender.send(_response(delta, new, ""))
        return on_update

    def finalize(self) -> None:
        self.scheduler.stop(cancel=True)
