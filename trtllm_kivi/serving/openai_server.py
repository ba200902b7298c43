"""`trtllm-kivi serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn) over the same runner, continuous-
batching Scheduler, admission and prefix cache as the Triton model.

    GET  /v1/models, /health, /version, /metrics (Prometheus text)
    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, `data: [DONE]` at the end)

One scheduler thread runs the model; the event loop parses requests (serving/openai_protocol.py), submits them and
relays the scheduler's per-token callbacks (loop.call_soon_threadsafe into a per-request queue). A client that
disconnects (streaming or not) is noticed by a task that waits on the ASGI receive channel, and its request is
cancelled: the scheduler frees its slot and blocks before its next step. SIGTERM / SIGINT: the server stops
admitting (new requests get 503), lets running requests finish for up to `drain_s` seconds (queued ones are
cancelled: 503, or an error event on a stream), cancels what is left, closes and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import trtllm_kivi

from ..runtime.scheduler import Request, RequestRejected, Scheduler
from .openai_metrics import ServerMetrics
from .openai_protocol import (APIError, Context, GenerationRequest, chunk, parse_body, parse_chat, parse_completion,
                              response, sse, usage)


@dataclass
class ServeOptions:
    model_name: str
    max_batch_tokens: int = 512
    prefill_chunk: int = 128
    prefix_caching: bool = True
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20
    drain_s: float = 30.0


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Relay:
    """Carries a scheduler request's updates from the scheduler thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: ServerMetrics) -> None:
        self.loop, self.metrics = loop, metrics
        self.queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    def __call__(self, r: Request, new: list[int], delta: str) -> None:  # scheduler thread
        if r.finished:
            self.metrics.finished(r)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (delta, r.finished))


def _end_error(r: Request) -> APIError:
    if r.finish_reason == "cancelled":
        return APIError(503, f"the request was cancelled: {r.error or 'server shutdown'}", code="cancelled")
    return APIError(500, f"generation failed: {r.error}", code="internal_error")


class GenerationResponse(Response):
    """Streams a generation (SSE) or sends it whole, and cancels the request when the client goes away."""

    def __init__(self, request: Request, body: Callable[[], AsyncIterator[bytes]] | None,
                 result: Callable[[], Awaitable[tuple[int, bytes]]] | None) -> None:
        self.request, self.body_iter, self.result = request, body, result
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.request.cancel()  # the client went away: the scheduler frees its slot before the next step

        watcher = asyncio.ensure_future(watch())
        try:
            if self.body_iter is not None:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache")]})
                async for part in self.body_iter():
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                assert self.result is not None
                status, body = await self.result()
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError:  # the connection broke while sending
            self.request.cancel()
        finally:
            watcher.cancel()
            if not self.request.finished:
                self.request.cancel()


class OpenAIServer:
    """The Starlette app (`.app`) over a runner + tokenizer; `start()` / `stop()` the scheduler thread."""

    def __init__(self, runner, tokenizer, opts: ServeOptions) -> None:
        self.runner, self.tokenizer, self.opts = runner, tokenizer, opts
        self.scheduler = Scheduler(runner, tokenizer, max_batch_tokens=opts.max_batch_tokens,
                                   prefill_chunk=opts.prefill_chunk, prefix_caching=opts.prefix_caching)
        self.metrics = ServerMetrics(self.scheduler)
        self.ctx = Context(opts.model_name, tokenizer, runner.vocab_size, runner.max_seq_len,
                           opts.default_max_tokens, tuple(getattr(tokenizer, "eos_ids", ()) or ()))
        self.draining = False
        self.created = int(time.time())
        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/version", self.version, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                Exception: self._internal_error})

    def start(self) -> OpenAIServer:
        self.scheduler.start()
        return self

    def drain(self) -> int:
        """Stop admitting, let running requests finish (up to opts.drain_s), cancel the rest; returns how many."""
        self.draining = True
        return self.scheduler.drain(self.opts.drain_s)

    # ------------------------------------------------------------------------------------------ small endpoints

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.opts.model_name, "object": "model", "created": self.created, "owned_by": "trtllm-kivi",
             "max_model_len": self.runner.max_seq_len}]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.draining:
            return _error(APIError(503, "the server is shutting down", code="service_unavailable"))
        return JSONResponse({"status": "ok"})

    async def version(self, request: HTTPRequest) -> Response:
        kv = self.runner.kivi_config
        return JSONResponse({"version": trtllm_kivi.__version__, "model": self.opts.model_name,
                             "runner": self.runner.name, "attention_backend": self.runner.attention_backend,
                             "kv_cache": kv.to_dict() if kv is not None else str(self.runner.activation_dtype),
                             "max_slots": self.runner.max_slots, "max_seq_len": self.runner.max_seq_len,
                             "prefix_caching": self.scheduler.prefix is not None})

    async def prometheus(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _http_error(self, request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return _error(APIError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}
                               .get(exc.status_code)))

    async def _internal_error(self, request: HTTPRequest, exc: Exception) -> Response:
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    # ------------------------------------------------------------------------------------------ generation

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, parse_completion, "completions")

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, parse_chat, "chat")

    async def _read_body(self, request: HTTPRequest) -> bytes:
        limit = self.opts.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body has {length} bytes; at most {limit} are accepted",
                           code="request_too_large")
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    async def _generate(self, request: HTTPRequest, parse, endpoint: str) -> Response:
        try:
            if self.draining:
                raise APIError(503, "the server is shutting down; no new requests", code="service_unavailable")
            gen = parse(parse_body(await self._read_body(request)), self.ctx)
            relay = _Relay(asyncio.get_running_loop(), self.metrics)
            try:
                r = self.scheduler.submit(gen.prompt, gen.params, relay, request_id=gen.id)
            except RequestRejected as e:
                if self.draining:
                    raise APIError(503, "the server is shutting down; no new requests",
                                   code="service_unavailable") from None
                raise APIError(400, str(e), "max_tokens" if "max_new_tokens" in str(e) else "prompt",
                               "context_length_exceeded") from None
        except APIError as e:
            self.metrics.count(endpoint, e.status)
            return _error(e)
        self.metrics.count(endpoint, 200)
        if gen.stream:
            return GenerationResponse(r, lambda: self._events(gen, r, relay), None)
        return GenerationResponse(r, None, lambda: self._result(gen, r, relay))

    def _usage(self, gen: GenerationRequest, r: Request) -> dict:
        return usage(len(gen.prompt), len(r.tokens), r.cached_tokens)

    async def _result(self, gen: GenerationRequest, r: Request, relay: _Relay) -> tuple[int, bytes]:
        while not (await relay.queue.get())[1]:
            pass
        if r.finish_reason not in ("stop", "length"):
            e = _end_error(r)
            return e.status, json.dumps(e.body()).encode()
        return 200, json.dumps(response(gen, r.text, r.finish_reason or "", self._usage(gen, r))).encode()

    async def _events(self, gen: GenerationRequest, r: Request, relay: _Relay) -> AsyncIterator[bytes]:
        first = True
        if gen.kind == "chat" or gen.echo:  # the role (chat) / the echoed prompt first, as OpenAI does
            yield sse(chunk(gen, "", first=True))
            first = False
        while True:
            delta, done = await relay.queue.get()
            while not done and not relay.queue.empty():  # coalesce what arrived meanwhile
                more, done = relay.queue.get_nowait()
                delta += more
            if done:
                break
            if delta:
                yield sse(chunk(gen, delta, first=first))
                first = False
        if r.finish_reason not in ("stop", "length"):
            yield sse(_end_error(r).body())
            return
        yield sse(chunk(gen, delta, r.finish_reason, first=first))
        if gen.include_usage:
            yield sse(chunk(gen, None, use=self._usage(gen, r)))
        yield sse("[DONE]")


def serve(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          ready: Callable[[int], None] | None = None) -> int:
    """Run uvicorn on host:port until SIGTERM / SIGINT, then drain (see the module doc) and return 0."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # (main thread, in the signal handler: never block)
            if server.draining:
                self.force_exit = sig == signal.SIGINT  # a second Ctrl-C: stop at once
                return

            def drain() -> None:
                server.drain()
                self.should_exit = True
            server.draining = True
            threading.Thread(target=drain, name="trtllm-kivi-drain", daemon=True).start()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if ready is not None and self.servers:
                ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="off")
    server.start()
    try:
        _Server(config).run()
    finally:
        if server.scheduler.running:
            server.scheduler.stop(cancel=True)
    return 0


__all__ = ["GenerationResponse", "OpenAIServer", "ServeOptions", "serve"]
