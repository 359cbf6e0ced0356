"""The aiohttp application: OpenAI routes over one AsyncLLM, SSE streaming, JSON errors, auth, metrics.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> SSE)
    GET  /v1/models             GET  /health                   GET  /metrics (Prometheus text)
    POST /tokenize              POST /detokenize               GET  /version     (vLLM's shapes)

Every failure is an OpenAI error body (`errors.APIError`), aiohttp's own included (unknown route
404, wrong method 405, body over the limit 413). A request's engine stream is closed whenever its
handler exits: normally, on an error, on a write to a client that went away, or on cancellation
(the runner in `serve` cancels the handler of a client that disconnects); closing it aborts the
request, so a vanished client never holds a slot.

Knows the engine only through AsyncLLM's public API; knows nothing about processes or signals.
"""

from __future__ import annotations

import codecs
import contextlib
import hmac
import importlib.metadata
import logging
import time
import zlib
from collections.abc import AsyncIterator, Iterator

import msgspec
from aiohttp import web

from ..engine import AsyncLLM, RequestDelta
from .chat_output import ChatOutput
from .config import ServerConfig
from .errors import APIError, decode_error
from .inputs import ChatParsers, EngineInput, chat_input, completion_input
from .messages import check_tools, render_prompt
from .metrics import RequestTimer, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, Model,
                       ModelList, SamplingFields, TokenizeRequest, TokenizeResponse, Usage)
from .reasoning import reasoning_enabled
from .responses import ChatRenderer, CompletionRenderer, Renderer
from .tool_parsers import tool_call_parser_name

logger = logging.getLogger("deltaspec.server")

_encoder = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_RETRY_AFTER_SECONDS = "1"  # on a 503: the queue moves every step
_PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The Content-Encodings a body may have: zlib's window bits for each (gzip's header: + 16).
_ZLIB_WBITS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# aiohttp's own refusals, as OpenAI-style error codes.
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
try:
    _VERSION = importlib.metadata.version("deltaspec")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    _VERSION = "unknown"


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics()
        self.in_flight: set[str] = set()  # engine request ids of the generation handlers running now
        # Generation requests admitted and not yet answered (being tokenized, waiting or running):
        # at most the engine's running requests plus config.max_waiting.
        self.num_admitted = 0
        self._created = int(time.time())
        chat_template = engine.tokenizer.chat_template
        self.chat_parsers = ChatParsers(tool_call_parser_name(config.tool_call_parser, chat_template),
                                        reasoning_enabled(config.reasoning_parser, chat_template))
        # aiohttp reads at most client_max_size bytes of a body and then raises 413.
        self.app = web.Application(client_max_size=config.max_body_bytes,
                                   middlewares=[self._count, self._errors, self._authenticate])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_get("/version", self.version)

    async def abort_in_flight(self) -> None:
        """Abort every running generation; their handlers end at the next step boundary."""
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)

    # Routes -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, CompletionRequest)
        self._check_model(body.model)
        with self._admit():
            engine_input = completion_input(body, self.engine.tokenizer, self.engine.max_model_len)
            return await self._generate(request, body, engine_input,
                                        CompletionRenderer(self.config.model_name, self.engine.tokenizer), arrival)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, ChatCompletionRequest)
        self._check_model(body.model)
        with self._admit():
            engine_input, output = chat_input(body, self.engine.tokenizer, self.engine.max_model_len,
                                              self.chat_parsers)
            renderer = ChatRenderer(self.config.model_name, self.engine.tokenizer, ChatOutput(output))
            return await self._generate(request, body, engine_input, renderer, arrival)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._decode(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt", code="invalid_value")
        if body.messages is not None:
            check_tools(body.tools or [])
            text = render_prompt(self.engine.tokenizer, body.messages, body.tools, body.chat_template_kwargs,
                                 body.add_generation_prompt)
        else:
            text = body.prompt
        tokens = self.engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return _json(TokenizeResponse(len(tokens), self.engine.max_model_len, tokens))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._decode(request, DetokenizeRequest)
        self._check_model(body.model)
        return _json(DetokenizeResponse(self.engine.tokenizer.decode(body.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _VERSION})

    async def models(self, request: web.Request) -> web.Response:
        model = Model(self.config.model_name, self._created, self.engine.max_model_len)
        return _json(ModelList([model]))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.engine.stats())
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE})

    # Generation ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request, body: SamplingFields, engine_input: EngineInput,
                        renderer: Renderer, arrival: float) -> web.StreamResponse:
        prompt_token_ids, params = engine_input.prompt_token_ids, engine_input.params
        deltas = self.engine.generate(prompt_token_ids, params, renderer.id)
        self.in_flight.add(renderer.id)
        try:
            # Closing the stream aborts an unfinished request. aclosing closes it on every exit,
            # also when the handler leaves from outside the generator (a failed write, a
            # cancellation during a write), where garbage collection would only do it later.
            async with contextlib.aclosing(deltas):
                try:
                    # Submission happens on the first step of the stream: the engine's own checks
                    # (empty prompt, context length, vocabulary) fail here, before any header is sent.
                    first = await anext(deltas)
                except ValueError as error:
                    raise APIError(400, str(error)) from error
                timer = self.metrics.timer(len(prompt_token_ids), arrival)
                progress = _Progress(timer, len(prompt_token_ids))
                try:
                    if body.stream:
                        include_usage = bool(body.stream_options and body.stream_options.include_usage)
                        return await self._stream(request, renderer, first, deltas, progress, include_usage)
                    return await self._respond(renderer, first, deltas, progress)
                finally:
                    timer.finish(progress.finish_reason or "abort")
        finally:
            self.in_flight.discard(renderer.id)

    async def _respond(self, renderer: Renderer, first: RequestDelta, deltas: AsyncIterator[RequestDelta],
                       progress: _Progress) -> web.Response:
        parts, token_ids, logprobs, delta = [], [], [], first
        while True:
            progress.record(delta)
            parts.append(delta.text)
            token_ids += delta.token_ids
            logprobs += delta.logprobs or []
            if delta.finish_reason is not None:
                break
            delta = await anext(deltas)
        text = "".join(parts)
        if progress.finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
        return _json(renderer.response(text, progress.finish_reason, progress.usage(), token_ids,
                                       logprobs if first.logprobs is not None else None))

    async def _stream(self, request: web.Request, renderer: Renderer, first: RequestDelta,
                      deltas: AsyncIterator[RequestDelta], progress: _Progress,
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            for chunk in renderer.opening():
                await _send(response, chunk)
            delta = first
            while True:
                progress.record(delta)
                if delta.finish_reason == "abort":
                    # Headers are out: the error travels as an event (the openai client raises it).
                    error = APIError(503, "the request was aborted: the server is shutting down", code="aborted")
                    await _send(response, error.body())
                    return response
                for chunk in renderer.chunks(delta.text, delta.finish_reason, delta.token_ids, delta.logprobs):
                    await _send(response, chunk)
                if delta.finish_reason is not None:
                    break
                delta = await anext(deltas)
            if include_usage:
                await _send(response, renderer.usage_chunk(progress.usage()))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; leaving `_generate`'s aclosing block aborts the request
        return response

    # Middleware and helpers ---------------------------------------------------------------

    @web.middleware
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"  # bounded label values
        status = "499"  # nginx's "client closed request": the handler was cancelled
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        finally:
            self.metrics.requests.inc(route=route, status=status)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as error:
            return _error_response(error)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            messages = {404: f"no route {request.method} {request.path}",
                        405: f"method {request.method} is not allowed on {request.path}",
                        413: f"request body larger than {self.config.max_body_bytes} bytes"}
            message = messages.get(error.status, error.reason)
            return _error_response(APIError(error.status, message, code=_HTTP_ERROR_CODES.get(error.status)))
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            return _error_response(APIError(500, "internal server error", code="internal_error"))

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        # /health and /metrics stay open for probes and scrapers.
        if self.config.api_key is not None and request.path not in ("/health", "/metrics"):
            # The scheme is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY".
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                    self.config.api_key.encode()):
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        return await handler(request)

    async def _decode(self, request: web.Request, request_type: type[msgspec.Struct]):
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in _ZLIB_WBITS:
            raise APIError(415, f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)",
                           code="unsupported_media_type")
        # JSON travels as UTF-8 (RFC 8259 8.1): a body declared in another charset would be misread.
        if request.charset is not None and not _is_utf8(request.charset):
            raise APIError(415, f"charset {request.charset!r} is not supported: send JSON as UTF-8",
                           code="unsupported_media_type")
        body = await request.read()  # as sent: `serve.start` turns aiohttp's decompression off
        if encoding != "identity":
            body = _decompress(body, encoding, self.config.max_body_bytes)
        try:
            return msgspec.json.decode(body, type=request_type)
        except msgspec.DecodeError as error:
            raise decode_error(error) from error
        except UnicodeDecodeError as error:  # msgspec checks UTF-8 only when it builds a string
            raise APIError(400, f"request body is not valid UTF-8: {error}", code="invalid_json") from error
        except RecursionError as error:  # JSON nested deeper than Python's recursion limit
            raise APIError(400, "request body is nested too deeply", code="invalid_json") from error

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        """Hold one of the max_num_seqs + max_waiting places for a generation request while its
        handler runs, or refuse it with a 503. Counted here, not from the engine's queue: the
        engine queues every request until its next step, and a request being tokenized is not
        in it yet."""
        capacity = self.engine.max_num_seqs + self.config.max_waiting
        if self.num_admitted >= capacity:
            raise APIError(503, f"the server is overloaded ({self.num_admitted} requests running or queued); "
                                f"retry later", code="overloaded", headers={"Retry-After": _RETRY_AFTER_SECONDS})
        self.num_admitted += 1
        try:
            yield
        finally:
            self.num_admitted -= 1

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")


class _Progress:
    """What one request has produced so far: token counts for `usage`, timings, finish reason."""

    def __init__(self, timer: RequestTimer, num_prompt_tokens: int) -> None:
        self.timer = timer
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None

    def record(self, delta: RequestDelta) -> None:
        self.num_completion_tokens += len(delta.token_ids)
        self.timer.on_tokens(len(delta.token_ids))
        self.finish_reason = delta.finish_reason

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_completion_tokens,
                     self.num_prompt_tokens + self.num_completion_tokens)


async def _send(response: web.StreamResponse, chunk: msgspec.Struct) -> None:
    await response.write(b"data: " + _encoder.encode(chunk) + b"\n\n")


def _json(body: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(body), status=status, content_type="application/json")


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """A gzip or deflate body, decompressed to at most max_bytes (a small bomb cannot fill memory)."""
    decompressor = zlib.decompressobj(_ZLIB_WBITS[encoding])
    try:
        text = decompressor.decompress(body, max_bytes + 1)
    except zlib.error as error:
        raise APIError(400, f"the request body is not valid {encoding}: {error}", code="invalid_body") from error
    if len(text) > max_bytes:
        raise APIError(413, f"request body larger than {max_bytes} bytes once decompressed",
                       code="request_too_large")
    if not decompressor.eof:
        raise APIError(400, f"the request body is a truncated {encoding} stream", code="invalid_body")
    return text


def _is_utf8(charset: str) -> bool:
    try:
        return codecs.lookup(charset).name == "utf-8"
    except LookupError:
        return False


def _error_response(error: APIError) -> web.Response:
    response = _json(error.body(), error.status)
    response.headers.update(error.headers)
    return response
