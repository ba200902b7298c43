"""The Triton python-backend model (decoupled): generation through our runner + continuous-batching scheduler.

Loaded by the generated `<repo>/<name>/1/model.py` inside Triton's python backend stub; it imports
`triton_python_backend_utils`, which only exists there. The scheduler runs in a background thread; `execute`
validates and queues each request and returns at once, and the scheduler thread sends the responses (one per token
when streaming, or one final response). A malformed request gets an INVALID_ARG error response (HTTP 400); nothing
else is affected. A request the client cancels (gRPC stream cancel, a dropped HTTP stream: Triton's
request.is_cancelled) is dropped by the scheduler before its next step, frees its slot and blocks there, and gets a
CANCELLED error as its final response. Custom metrics (serving/metrics.py) appear on Triton's metrics endpoint.

Shutdown (SIGTERM): Triton 2.51 releases a decoupled python model's requests when `execute` returns, so it does not
wait for them; it unloads the model, and `finalize` drains: queued requests are cancelled ("server shutdown"),
running ones get DRAIN_S more seconds, the rest are cancelled; every request gets its final response. (Before
that, Triton's HTTP endpoint waits up to --exit-timeout-secs for its open connections, so HTTP streams in flight
usually finish; a gRPC stream keeps being served until the model unloads.)
"""

from __future__ import annotations

import json
import os
import time
import traceback

import triton_python_backend_utils as pb_utils

from ..runtime.scheduler import Request, RequestRejected, Scheduler
from .config import ServingConfig, load_runner, runner_description
from .metrics import TritonMetrics
from .protocol import INPUTS, InvalidRequest, parse_request, response_arrays

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# At shutdown, how long running requests may still take: Triton has already waited (up to its exit timeout) for open
# HTTP connections before it unloads the model, and what is left of that timeout must cover this finalize.
DRAIN_S = 2.0


def _response(text: str, ids: list[int], finish_reason: str):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in
                                       response_arrays(text, ids, finish_reason).items()])


def _error(msg: str, code: str = "INTERNAL"):
    """An error response; code names a pb_utils.TritonError code (INVALID_ARG -> HTTP 400, CANCELLED, ...)."""
    # (TritonError exists only once the stub has started: look it up at call time, not at import)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(msg, getattr(pb_utils.TritonError, code)))


def _throttled(check, every_s: float = 0.05):
    """check() at most every every_s seconds (each call is a round trip to the server); True once it was True."""
    last, seen = [0.0], [False]

    def cancelled() -> bool:
        now = time.monotonic()
        if not seen[0] and now - last[0] >= every_s:
            last[0], seen[0] = now, bool(check())
        return seen[0]
    return cancelled


def _parameters(request) -> dict:
    text = request.parameters()
    return json.loads(text) if text else {}


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
                                   prefill_chunk=self.cfg.prefill_chunk,
                                   prefix_caching=self.cfg.prefix_caching).start()
        self.eos = tuple(getattr(self.tokenizer, "eos_ids", ()) or ())
        self.metrics = TritonMetrics(pb_utils, self.scheduler, args["model_name"])
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
                                       self.cfg.default_max_tokens, self.eos, _parameters(request))
                self.scheduler.submit(parsed.prompt, parsed.params, self._callback(sender, parsed.stream, tag),
                                      request_id=rid or None, cancelled=_throttled(request.is_cancelled))
            except (InvalidRequest, RequestRejected) as e:
                sender.send(_error(f"{tag}invalid request: {e}", "INVALID_ARG"), flags=FINAL)
            except Exception as e:  # never let one request take the model down
                pb_utils.Logger.log_error(f"trtllm-kivi: request failed: {traceback.format_exc()}")
                sender.send(_error(f"{tag}internal error: {type(e).__name__}: {e}"), flags=FINAL)
        return None

    def _callback(self, sender, stream: bool, tag: str):
        def on_update(req: Request, new: list[int], delta: str) -> None:
            if req.finish_reason == "cancelled":
                why = f" ({req.error})" if req.error else ""
                sender.send(_error(f"{tag}request cancelled after {len(req.tokens)} tokens{why}", "CANCELLED"),
                            flags=FINAL)
            elif req.finish_reason == "error":
                sender.send(_error(f"{tag}generation failed: {req.error}"), flags=FINAL)
            elif req.finished:
                if stream:
                    sender.send(_response(delta, new, req.finish_reason or ""), flags=FINAL)
                else:
                    sender.send(_response(req.text, req.tokens, req.finish_reason or ""), flags=FINAL)
            elif stream and (new or delta):
                sender.send(_response(delta, new, ""))
        return on_update

    def finalize(self) -> None:
        left = self.scheduler.drain(DRAIN_S)  # every unfinished request gets its CANCELLED final response
        pb_utils.Logger.log_info(f"trtllm-kivi: stopped; {left} requests cancelled at shutdown")
        self.metrics.close()
