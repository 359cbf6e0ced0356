"""The aiohttp application: OpenAI routes over one engine, SSE streaming, JSON errors, auth, metrics.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> SSE)
    POST /v1/responses          (OpenAI's Responses API over the chat path: responses_api.py)
    POST /v1/messages           POST /v1/messages/count_tokens
                                (Anthropic's Messages API over the chat path: anthropic_api.py)
    GET  /v1/models             GET  /v1/models/{id}           GET  /health
    GET  /metrics (Prometheus text)
    POST /tokenize              POST /detokenize               GET  /version     (vLLM's shapes)
    GET  /openapi.json (every route's bodies, from the protocol Structs: openapi.py)

Every failure is an OpenAI error body (`errors.APIError`), aiohttp's own included (unknown route
404, wrong method 405, body over the limit 413); under /v1/messages, Anthropic's error body. A
request's engine stream is closed whenever its handler exits: normally, on an error, on a write to
a client that went away, or on cancellation (the runner in `serve` cancels the handler of a client
that disconnects); closing it aborts the request, so a vanished client never holds a slot. A
request whose engine step failed (StepFailedError) gets a 500, one whose engine has stopped
(EngineDeadError) a 503: a JSON body before the headers are out, an error event and [DONE] after
(on /v1/responses: response.failed; on /v1/messages: an `error` event, no [DONE]).

Images (image parts of the three chat APIs) are fetched concurrently (`media.MediaConnector`,
its HTTP session the app's) and resized off the loop by the engine's `image_processor` before the
prompt is rendered; a model without one refuses them. Videos (chat's video_url parts) are
fetched the same way and decoded by the engine's `video_processor` in threads of their own, a
few at once (`MAX_VIDEOS_AT_ONCE`).

Knows the engine only through the API AsyncLLM and EngineProcess (an engine in its own process)
share; knows nothing about processes or signals.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import hmac
import logging
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from ..engine import AsyncLLM, EngineDeadError, RequestDelta, StepFailedError
from ..engine.engine_process import EngineProcess
from ..engine.vision.image import ImageInput, VideoInput
from ..engine.vision.preprocess import ImageProcessor
from ..engine.vision.video import VideoProcessor
from ..engine.vllm_options import mm_processor_options
from . import anthropic_api, responses_api
from .anthropic_api import MessagesRenderer, count_tokens, error_body, messages_input
from .anthropic_protocol import CountTokensRequest, CountTokensResponse, MessagesRequest
from .chat_output import ChatOutput
from .config import ServerConfig
from .cors import Cors
from .errors import APIError, decode_error
from .inputs import (ChatImages, ChatParsers, ChatVideos, EngineInput, chat_input, completion_inputs, num_choices,
                     prompts, with_choices, with_images, with_videos)
from .media import MediaConnector, MediaPart
from .messages import check_tools, image_parts, render_prompt, video_parts
from .metrics import RequestTimer, ServerMetrics
from .openapi import openapi_document
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                       Health, Model, ModelList, PromptTokensDetails, SamplingFields, StreamOptions, TokenizeRequest,
                       TokenizeResponse, Usage, VersionInfo)
from .reasoning import reasoning_enabled
from .responses import VERSION, ChatRenderer, CompletionRenderer, Renderer
from .responses_api import ResponsesRenderer, responses_input
from .responses_protocol import ResponsesRequest
from .tool_parsers import tool_call_parser_name

logger = logging.getLogger("deltaspec.server")

Engine = AsyncLLM | EngineProcess  # what the server runs on: in this process or in its own

_encoder = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_NUM_REQUEST_WORKERS = 2  # threads tokenizing request bodies (the tokenizer releases the GIL)
T = TypeVar("T")
_RETRY_AFTER_SECONDS = "1"  # on a 503: the queue moves every step
_PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The Content-Encodings a body may have: zlib's window bits for each (gzip's header: + 16).
_ZLIB_WBITS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# aiohttp's own refusals, as OpenAI-style error codes.
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# Request bodies at most unless --max-body-bytes says otherwise: a text request's, and one
# carrying base64 images (a phone photo is a few MB; Claude Code sends screenshots) or videos.
# Not raised for videos (vLLM sets no cap): 64 MiB holds ~48 MB of video inline, a minute or
# more of 1080p H.264; a larger one comes by URL, fetched in chunks up to media.MAX_VIDEO_BYTES.
# A body is read whole, then parsed as JSON and its base64 decoded on the event loop (~100 ms
# for 64 MiB, every stream waits meanwhile), and every admitted request may hold one.
TEXT_BODY_BYTES = 1 << 20
IMAGE_BODY_BYTES = 64 << 20
# Videos fetched or being decoded at once, across requests; the rest wait for a place before
# their fetch begins. Each holds up to media.MAX_VIDEO_BYTES of encoded bytes and, while it
# decodes, its sampled frames: 4 bound that to ~1 GiB of encoded bytes and two decodes' frames,
# however many video requests arrive. A decode runs in one of _NUM_VIDEO_WORKERS threads of its
# own (not the tokenizing threads: a long video's seconds of decoding never queue a text
# request's tokenizing), two so that a Python-level decode loop shares the GIL with the event
# loop and the tokenizing threads rather than taking most of its turns; the two further places
# let the next videos' fetches overlap the decodes.
MAX_VIDEOS_AT_ONCE = 4
_NUM_VIDEO_WORKERS = 2


class OpenAIServer:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        self.in_flight: set[str] = set()  # engine request ids of the generation handlers running now
        # Streams' writes under way, by id(request): the loop time each began and its request
        # (`_drop_stalled` reads it).
        self._writing: dict[int, tuple[float, web.Request]] = {}
        # Generation requests admitted and not yet answered (being tokenized, waiting or running):
        # at most the engine's running requests plus config.max_waiting.
        self.num_admitted = 0
        self._created = int(time.time())
        chat_template = engine.tokenizer.chat_template
        self.chat_parsers = ChatParsers(tool_call_parser_name(config.tool_call_parser, chat_template),
                                        reasoning_enabled(config.reasoning_parser, chat_template))
        cors = Cors(config.cors)  # a preflight is answered before authentication and routing
        # aiohttp reads at most client_max_size bytes of a body and then raises 413.
        self.max_body_bytes = config.max_body_bytes or (
            IMAGE_BODY_BYTES if engine.image_processor is not None else TEXT_BODY_BYTES)
        self.app = web.Application(client_max_size=self.max_body_bytes,
                                   middlewares=[cors.preflight, self._count, self._errors, self._authenticate])
        self.app.on_response_prepare.append(cors.on_prepare)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/responses", self.responses)
        self.app.router.add_post("/v1/messages", self.messages)
        self.app.router.add_post("/v1/messages/count_tokens", self.count_message_tokens)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model)  # ids may hold a '/'
        self.app.router.add_get("/health", self.health)
        # vLLM's liveness alias, what SageMaker-style platforms probe (GET and POST).
        self.app.router.add_get("/ping", self.health)
        self.app.router.add_post("/ping", self.health)
        self.app.router.add_get("/metrics", self.prometheus)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/detokenize", self.detokenize)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_get("/openapi.json", self.openapi)
        self._openapi = _encoder.encode(openapi_document(VERSION))
        # Tokenizing and template rendering of request bodies (up to max_body_bytes each) run
        # here, off the event loop that streams every response and answers /health.
        self._executor = ThreadPoolExecutor(max_workers=_NUM_REQUEST_WORKERS, thread_name_prefix="deltaspec-request")
        self._video_executor = ThreadPoolExecutor(max_workers=_NUM_VIDEO_WORKERS, thread_name_prefix="deltaspec-video")
        self._video_places = asyncio.Semaphore(MAX_VIDEOS_AT_ONCE)
        self.app.on_cleanup.append(self._shut_down_executor)
        self.app.cleanup_ctx.append(self._drop_stalled)
        self.media = MediaConnector(config.media)
        self.app.cleanup_ctx.append(self.media.session)

    async def abort_in_flight(self) -> None:
        """Abort every running generation; their handlers end at the next step boundary."""
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)

    # Routes -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, CompletionRequest)
        self._check_model(body.model)
        n = num_choices(body)
        with self._admit(len(prompts(body)) * n):
            inputs = await self._off_loop(completion_inputs, body, self.engine.tokenizer, self.engine.max_model_len)
            inputs = with_choices(inputs, n)
            renderers = []
            for index, engine_input in enumerate(inputs):
                renderers.append(CompletionRenderer(
                    self.config.model_name, self.engine.tokenizer, engine_input.prompt_token_ids, index,
                    renderers[0].id if renderers else None, echo=engine_input.echo, echo_only=engine_input.echo_only,
                    logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs,
                    tokens_as_ids=bool(body.return_tokens_as_token_ids)))
            return await self._generate(request, body, inputs, renderers, arrival)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, ChatCompletionRequest)
        self._check_model(body.model)
        n = num_choices(body)
        with self._admit(n):
            images, videos = await self._chat_media(body.messages, body.mm_processor_kwargs)
            engine_input, output = await self._off_loop(chat_input, body, self.engine.tokenizer,
                                                        self.engine.max_model_len, self.chat_parsers, images, videos)
            renderers = []
            for index in range(n):
                # prompt_logprobs go beside the choices, once: the first choice's renderer writes them.
                renderers.append(ChatRenderer(self.config.model_name, self.engine.tokenizer, ChatOutput(output),
                                              engine_input.prompt_token_ids, index,
                                              renderers[0].id if renderers else None,
                                              body.prompt_logprobs if index == 0 else None,
                                              bool(body.return_tokens_as_token_ids)))
            return await self._generate(request, body, with_choices([engine_input], n), renderers, arrival)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, ResponsesRequest)
        self._check_model(body.model)
        with self._admit():
            chat = await self._off_loop(responses_api.chat_request, body)
            images = await self._chat_images(chat.messages, "input")
            engine_input, output = await self._off_loop(responses_input, chat, self.engine.tokenizer,
                                                        self.engine.max_model_len, self.chat_parsers, images)
            renderer = ResponsesRenderer(body, self.config.model_name, self.engine.tokenizer, ChatOutput(output),
                                         engine_input.prompt_token_ids)
            return await self._generate(request, body, [engine_input], [renderer], arrival, events=renderer)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._decode(request, MessagesRequest)
        self._check_model(body.model)
        with self._admit():
            chat = await self._off_loop(anthropic_api.chat_request, body)
            images = await self._chat_images(chat.messages, "messages")
            engine_input, output = await self._off_loop(messages_input, chat, body.max_tokens, self.engine.tokenizer,
                                                        self.engine.max_model_len, self.chat_parsers, images)
            renderer = MessagesRenderer(body, self.config.model_name, self.engine.tokenizer, ChatOutput(output),
                                        engine_input.params.max_tokens)
            return await self._generate(request, body, [engine_input], [renderer], arrival, events=renderer)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        body = await self._decode(request, CountTokensRequest)
        self._check_model(body.model)
        chat = await self._off_loop(anthropic_api.chat_request, body)
        images = await self._chat_images(chat.messages, "messages")
        num_tokens = await self._off_loop(count_tokens, chat, self.engine.tokenizer, self.engine.max_model_len,
                                          self.chat_parsers, images)
        return _json(CountTokensResponse(num_tokens))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._decode(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt", code="invalid_value")
        images, videos = await self._chat_media(body.messages, body.mm_processor_kwargs) \
            if body.messages is not None else (None, None)
        tokens = await self._off_loop(_tokenize, self.engine.tokenizer, body, images, videos)
        return _json(TokenizeResponse(len(tokens), self.engine.max_model_len, tokens))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._decode(request, DetokenizeRequest)
        self._check_model(body.model)
        return _json(DetokenizeResponse(await self._off_loop(self.engine.tokenizer.decode, body.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return _json(VersionInfo(VERSION))

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        # One card per served name, as vLLM lists them.
        return _json(ModelList([self._model(name) for name in self.config.served_model_names]))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self._check_model(name)
        return _json(self._model(name))

    async def health(self, request: web.Request) -> web.Response:
        self._check_engine()
        return _json(Health())

    async def prometheus(self, request: web.Request) -> web.Response:
        self._check_engine()
        try:
            stats = await self.engine.fetch_stats()
        except EngineDeadError as error:
            raise _engine_dead(error) from error
        text = self.metrics.render(stats)
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE})

    # Generation ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request, body: SamplingFields, inputs: list[EngineInput],
                        renderers: list[Renderer], arrival: float,
                        events: EventFormat | None = None) -> web.StreamResponse:
        """One engine request per input (renderer i renders choice i), answered together. A
        fork (n > 1) is submitted after the choice it forks (the streams start in order), and its
        prompt tokens count once, on that choice. events: how a stream is written (by default
        the chunk events of /v1/completions and /v1/chat/completions)."""
        streams = [self.engine.generate(engine_input.prompt_token_ids, engine_input.params, renderer.request_id,
                                        fork_of=None if engine_input.fork_of is None
                                        else renderers[engine_input.fork_of].request_id,
                                        images=engine_input.images, videos=engine_input.videos)
                   for engine_input, renderer in zip(inputs, renderers)]
        request_ids = [renderer.request_id for renderer in renderers]
        self.in_flight.update(request_ids)
        try:
            # Closing the streams aborts unfinished requests. aclosing closes them on every exit,
            # also when the handler leaves from outside the generator (a failed write, a
            # cancellation during a write), where garbage collection would only do it later.
            async with contextlib.aclosing(_merged(streams)) as deltas:
                try:
                    # Submission happens on the first step of each stream: the engine's own checks
                    # (empty prompt, vocabulary) fail here, before any header is sent.
                    started = await _until_each_started(deltas, len(streams))
                except ValueError as error:
                    raise APIError(400, str(error)) from error
                num_prompt_tokens = [len(e.prompt_token_ids) if e.fork_of is None else 0 for e in inputs]
                progress = {renderer.request_id: _Progress(renderer, self.metrics.timer(num, arrival), num,
                                                           engine_input.params.logprobs is not None,
                                                           not engine_input.echo_only)
                            for engine_input, renderer, num in zip(inputs, renderers, num_prompt_tokens)}
                try:
                    if body.stream:
                        chunk_usage = False
                        if events is None:
                            options = body.stream_options or StreamOptions()
                            events = _ChunkEvents(renderers[0], bool(options.include_usage))
                            chunk_usage = bool(options.include_usage and options.continuous_usage_stats)
                        return await self._stream(request, started, deltas, progress, events, chunk_usage)
                    return await self._respond(started, deltas, progress)
                except _ENGINE_FAILURES:
                    for each in progress.values():
                        each.fail()
                    raise
                finally:
                    for each in progress.values():
                        each.timer.finish(each.finish_reason or "abort")
        except _ENGINE_FAILURES as error:
            raise _engine_failure(error) from error
        finally:
            self.in_flight.difference_update(request_ids)

    async def _respond(self, started: list[RequestDelta], deltas: AsyncIterator[RequestDelta],
                       progress: dict[str, _Progress]) -> web.Response:
        parts = {request_id: [] for request_id in progress}
        for delta in [*started, *[delta async for delta in deltas]]:
            progress[delta.request_id].record(delta)
            parts[delta.request_id].append(delta)
        if any(each.finish_reason == "abort" for each in progress.values()):
            raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
        responses = []
        for each, index_parts in zip(progress.values(), parts.values()):
            token_ids = [t for delta in index_parts for t in delta.token_ids]
            logprobs = [entry for delta in index_parts for entry in delta.logprobs or []] if each.logprobs else None
            prompt_logprobs = next((delta.prompt_logprobs for delta in index_parts
                                    if delta.prompt_logprobs is not None), None)
            responses.append(each.renderer.response("".join(delta.text for delta in index_parts), each.finish_reason,
                                                    each.usage(), token_ids, logprobs, prompt_logprobs))
        if len(responses) == 1:
            return _json(responses[0])
        # A batch of prompts or n > 1: one response, a choice each, the usage summed.
        return _json(msgspec.structs.replace(responses[0], choices=[r.choices[0] for r in responses],
                                             usage=_total_usage(progress.values())))

    async def _stream(self, request: web.Request, started: list[RequestDelta], deltas: AsyncIterator[RequestDelta],
                      progress: dict[str, _Progress], events: EventFormat,
                      chunk_usage: bool = False) -> web.StreamResponse:
        """One write per engine delta (its chunks together), the last chunks with the end of
        the response: a write is a system call, the largest cost the server adds per token.
        chunk_usage (vLLM's continuous_usage_stats): each chunk carries its choice's usage so far."""
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        protocol = request.protocol
        request_ids = list(progress)
        writing, key, loop = self._writing, id(request), asyncio.get_running_loop()

        async def send(data: bytes, last: bool = False) -> None:
            """A write waits while the client reads nothing (aiohttp paused writing: the
            transport's buffer went past its high-water mark); meanwhile its requests are
            paused, so the engine stops producing what nobody reads. A write that waits past the
            stall timeout has its connection dropped by `_drop_stalled`, which ends the stream
            as a disconnect does. last: the response's end goes with the data."""
            paused = protocol.writing_paused
            if paused:
                for request_id in request_ids:
                    self.engine.pause(request_id)
            writing[key] = (loop.time(), request)
            try:
                await (response.write_eof(data) if last else response.write(data))
            finally:
                writing.pop(key, None)
            if paused:  # (not when the write failed: the requests are aborted then)
                for request_id in request_ids:
                    self.engine.resume(request_id)

        def encoded(each: _Progress, chunks: list[msgspec.Struct]) -> list[bytes]:
            """The chunks' events, each carrying its choice's usage so far with chunk_usage."""
            if chunk_usage:
                chunks = [msgspec.structs.replace(chunk, usage=each.usage()) for chunk in chunks]
            return [events.event(chunk) for chunk in chunks]

        async def stream_delta(delta: RequestDelta) -> bool:
            """Send one delta's chunks; False once the stream is over (an aborted request)."""
            each = progress[delta.request_id]
            each.record(delta)
            if delta.finish_reason == "abort":
                # Headers are out: the error travels as an event (the openai client raises it).
                error = APIError(503, "the request was aborted: the server is shutting down", code="aborted")
                await send(events.failure(error), last=True)  # (no [DONE]: the stream failed)
                return False
            chunks = each.renderer.chunks(delta.text, delta.finish_reason, delta.token_ids, delta.logprobs,
                                          delta.prompt_logprobs)
            if chunks:
                await send(b"".join(encoded(each, chunks)))
            return True

        try:
            try:
                for delta in started:  # the prompt's usage is known before any output (message_start says it)
                    progress[delta.request_id].note_cached(delta)
                opening = b"".join(event for each in progress.values()
                                   for event in encoded(each, each.renderer.opening(each.usage())))
                if opening:
                    await send(opening)
                for delta in started:
                    if not await stream_delta(delta):
                        return response
                async for delta in deltas:
                    if not await stream_delta(delta):
                        return response
                end = events.end(_total_usage(progress.values()))
            except _ENGINE_FAILURES as error:
                for each in progress.values():
                    each.fail()
                end = events.failure(_engine_failure(error))  # and the stream ends as usual
            await send(end + events.done, last=True)
        except ConnectionResetError:
            pass  # the client went away; leaving `_generate`'s aclosing block aborts the requests
        return response

    async def _drop_stalled(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: every quarter of the stall timeout, drop the connections whose
        write has waited longer than the stall timeout (their client reads nothing). One record
        per write (`_writing`) instead of a timer per write."""
        timeout = self.config.stream_stall_timeout
        loop = asyncio.get_running_loop()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(timeout / 4)
                now = loop.time()
                for key, (since, request) in list(self._writing.items()):
                    if now - since >= timeout:
                        del self._writing[key]
                        logger.warning("%s %s: the client read nothing for %gs; aborting its request",
                                       request.method, request.path, timeout)
                        if request.transport is not None:
                            request.transport.abort()  # close() would wait to flush what the client does not read

        task = loop.create_task(sweep(), name="deltaspec-stall-sweep")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # Images and videos --------------------------------------------------------------------

    async def _chat_media(self, messages: list[ChatMessage], mm_processor_kwargs: dict[str, Any] | None
                          ) -> tuple[ChatImages | None, ChatVideos | None]:
        """A chat request's images and videos (`_chat_images`, `_chat_videos`), fetched at once."""
        images, videos = await _each([self._chat_images(messages, mm_processor_kwargs=mm_processor_kwargs),
                                      self._chat_videos(messages, mm_processor_kwargs)])
        return images, videos

    async def _chat_images(self, messages: list[ChatMessage], param: str | None = None,
                           mm_processor_kwargs: dict[str, Any] | None = None) -> ChatImages | None:
        """The images of the messages' image parts, fetched concurrently and resized (None: the
        messages have none). param: the field errors name (`messages.image_parts`);
        mm_processor_kwargs: the request's pixel bounds (vLLM's field)."""
        parts = image_parts(messages, param)
        if not parts:
            return None
        processor = self._media_processor(
            parts, "image", self.engine.image_processor, self.config.media.max_images,
            mm_processor_kwargs and (lambda p: p.with_pixels(**mm_processor_options(mm_processor_kwargs)[0])))
        images = await _each(self._image(part, processor) for part in parts)
        return ChatImages(tuple(images), processor)

    def _media_processor(self, parts: list[MediaPart], modality: str, processor: Any, limit: int | None,
                         configure: Callable[[Any], Any] | None) -> Any:
        """What a request's parts of one modality go through: the engine's processor (none: a
        400 saying why, a text-only checkpoint, --language-model-only, ...), configured for the
        request (`configure`: its mm_processor_kwargs; a bad one a 400 naming the field); more
        parts than --limit-mm-per-prompt's count are a 400."""
        if processor is None:
            raise APIError(400, f"{modality} input is not supported: {self.engine.images_refused}",
                           param=parts[0].param, code="unsupported_parameter")
        if configure:
            try:
                processor = configure(processor)
            except ValueError as error:
                raise APIError(400, str(error), param="mm_processor_kwargs", code="invalid_value") from None
        if limit is not None and len(parts) > limit:
            raise APIError(400, f"the request holds {len(parts)} {modality}s; at most {limit} are taken per prompt "
                                f"(--limit-mm-per-prompt)", param=parts[limit].param, code="invalid_value")
        return processor

    async def _image(self, part: MediaPart, processor: ImageProcessor) -> ImageInput:
        """One image part's image, fetched, then decoded and resized off the loop (CPU work)."""
        data = await self.media.fetch(part)
        try:
            return await self._off_loop(processor.resize, data)
        except ValueError as error:  # not an image, a decompression bomb, an extreme aspect ratio
            raise part.error(str(error), code="invalid_image") from None

    async def _chat_videos(self, messages: list[ChatMessage],
                           mm_processor_kwargs: dict[str, Any] | None = None) -> ChatVideos | None:
        """The videos of the messages' video_url parts, fetched and decoded concurrently (None:
        the messages have none). mm_processor_kwargs: the request's video options (vLLM's field:
        fps, num_frames, ...)."""
        parts = video_parts(messages)
        if not parts:
            return None
        processor = self._media_processor(
            parts, "video", self.engine.video_processor, self.config.media.max_videos,
            mm_processor_kwargs and (lambda p: p.with_options(**mm_processor_options(mm_processor_kwargs)[1])))
        videos = await _each(self._video(part, processor) for part in parts)
        return ChatVideos(tuple(videos), processor)

    async def _video(self, part: MediaPart, processor: VideoProcessor) -> VideoInput:
        """One video part's video, fetched, then decoded off the loop (demuxing, decoding the
        sampled frames, resizing them: CPU work). It holds one of MAX_VIDEOS_AT_ONCE places from
        its fetch until its decode ends, also when its request goes away first (a decode thread
        cannot be stopped: the place is freed when it finishes, or when it is dropped unstarted),
        so bytes and frames held stay bounded however many video requests come and go."""
        places = self._video_places
        await places.acquire()
        loop = asyncio.get_running_loop()
        try:
            data = await self.media.fetch(part)
            decoding = self._video_executor.submit(processor.decode, data)
        except BaseException:
            places.release()
            raise
        decoding.add_done_callback(functools.partial(_release_from_thread, loop, places))
        try:
            return await asyncio.wrap_future(decoding)
        except ValueError as error:  # not a video, no video stream, no frame that decodes
            raise part.error(str(error), code="invalid_video") from None

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
            return _error_response(error, request.path)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            messages = {404: f"no route {request.method} {request.path}",
                        405: f"method {request.method} is not allowed on {request.path}",
                        413: f"request body larger than {self.max_body_bytes} bytes"}
            message = messages.get(error.status, error.reason)
            return _error_response(APIError(error.status, message, code=_HTTP_ERROR_CODES.get(error.status)),
                                   request.path)
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            return _error_response(APIError(500, "internal server error", code="internal_error"), request.path)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        # /health and /metrics stay open for probes and scrapers.
        if self.config.api_key is not None and request.path not in ("/health", "/metrics"):
            # The scheme is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY".
            # Anthropic's clients (Claude Code with ANTHROPIC_API_KEY) send the key as x-api-key.
            scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
            keys = [bearer if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "")]
            if not any(hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()) for key in keys):
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>' or "
                                    "'x-api-key: <key>')", code="invalid_api_key")
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
        try:
            async with asyncio.timeout(self.config.body_timeout):
                body = await request.read()  # as sent: `serve.start` turns aiohttp's decompression off
        except TimeoutError:
            # The connection is done: what is left of the body would be read as the next request.
            raise APIError(408, f"the request body did not arrive within {self.config.body_timeout:g}s",
                           code="timeout", headers={"Connection": "close"}) from None
        if encoding != "identity":
            body = _decompress(body, encoding, self.max_body_bytes)
        try:
            return msgspec.json.decode(body, type=request_type)
        except msgspec.DecodeError as error:
            raise decode_error(error) from error
        except UnicodeDecodeError as error:  # msgspec checks UTF-8 only when it builds a string
            raise APIError(400, f"request body is not valid UTF-8: {error}", code="invalid_json") from error
        except RecursionError as error:  # JSON nested deeper than Python's recursion limit
            raise APIError(400, "request body is nested too deeply", code="invalid_json") from error

    @contextlib.contextmanager
    def _admit(self, num_requests: int = 1) -> Iterator[None]:
        """Hold num_requests of the max_num_seqs + max_waiting places for generation requests
        while their handler runs, or refuse them with a 503. Counted here, not from the engine's
        queue: the engine queues every request until its next step, and a request being
        tokenized is not in it yet."""
        capacity = self.engine.max_num_seqs + self.config.max_waiting
        if self.num_admitted + num_requests > capacity:
            raise APIError(503, f"the server is overloaded ({self.num_admitted} requests running or queued); "
                                f"retry later", code="overloaded", headers={"Retry-After": _RETRY_AFTER_SECONDS})
        self.num_admitted += num_requests
        try:
            yield
        finally:
            self.num_admitted -= num_requests

    async def _off_loop(self, function: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(function, *args))

    async def _shut_down_executor(self, app: web.Application) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._video_executor.shutdown(wait=False, cancel_futures=True)

    def _model(self, name: str) -> Model:
        return Model(name, self._created, self.engine.max_model_len, dict(self.engine.generation_defaults))

    def _check_engine(self) -> None:
        """503 once the engine has stopped (its process died, or steps kept failing): every
        request would fail, so a health probe must see it and restart the server."""
        if self.engine.error is not None:
            raise _engine_dead(self.engine.error)

    def _check_model(self, model: str | None) -> None:
        """A request may name any served name; its response names the first (vLLM's)."""
        names = self.config.served_model_names
        if model is not None and model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, names))}", param="model", code="model_not_found")


class _Progress:
    """What one engine request has produced so far: token counts for `usage`, timings, finish
    reason; and the renderer of its choice."""

    def __init__(self, renderer: Renderer, timer: RequestTimer, num_prompt_tokens: int, logprobs: bool,
                 counts_output: bool) -> None:
        self.renderer = renderer
        self.timer = timer
        self.num_prompt_tokens = num_prompt_tokens
        self.logprobs = logprobs  # whether the request asked for log-probabilities
        # False: the output is not the client's (echo with max_tokens 0), so usage counts none
        # of it; the metrics count what the engine generated.
        self.counts_output = counts_output
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    def note_cached(self, delta: RequestDelta) -> None:
        """The prompt tokens the engine restored instead of computing, from the delta that says
        (a choice that counts no prompt tokens, a fork of the first, counts none of them)."""
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = min(delta.num_cached_tokens, self.num_prompt_tokens)

    def record(self, delta: RequestDelta) -> None:
        self.note_cached(delta)
        num_tokens = len(delta.token_ids)
        if self.counts_output:
            self.num_completion_tokens += num_tokens
        self.timer.on_tokens(num_tokens)
        self.finish_reason = delta.finish_reason

    def fail(self) -> None:
        """Its engine step failed (the metrics count it as finished with "error")."""
        if self.finish_reason is None:
            self.finish_reason = "error"

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_completion_tokens,
                     self.num_prompt_tokens + self.num_completion_tokens, PromptTokensDetails(self.num_cached_tokens))


def _total_usage(progress: Iterable[_Progress]) -> Usage:
    usages = [each.usage() for each in progress]
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.total_tokens for u in usages),
                 PromptTokensDetails(sum(u.prompt_tokens_details.cached_tokens for u in usages)))


async def _each(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Their results, in order, run concurrently; the first failure cancels the others and is
    raised as it is (not in an exception group)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(awaitable) for awaitable in awaitables]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


def _merged(streams: list[AsyncGenerator[RequestDelta, None]]) -> AsyncGenerator[RequestDelta, None]:
    """The deltas of every stream as they come (each names its request), until each has
    finished; closing this closes them all (which aborts their unfinished requests). One stream
    is its own merge: no layer in between for the common case."""
    return streams[0] if len(streams) == 1 else _pumped(streams)


async def _pumped(streams: list[AsyncGenerator[RequestDelta, None]]) -> AsyncGenerator[RequestDelta, None]:
    """`_merged` for several streams: a task per stream feeds one queue."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncGenerator[RequestDelta, None]) -> None:
        async with contextlib.aclosing(stream):
            try:
                async for delta in stream:
                    queue.put_nowait(delta)
            except Exception as error:  # noqa: BLE001 - raised to the consumer
                queue.put_nowait(error)

    pumps = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        num_open = len(streams)
        while num_open:
            delta = await queue.get()
            if isinstance(delta, Exception):
                raise delta
            num_open -= delta.finish_reason is not None
            yield delta
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _until_each_started(deltas: AsyncIterator[RequestDelta], num_streams: int) -> list[RequestDelta]:
    """The deltas that came until every stream produced its first one (each was submitted)."""
    started, seen = [], set()
    while len(seen) < num_streams:
        delta = await anext(deltas)
        started.append(delta)
        seen.add(delta.request_id)
    return started


_ENGINE_FAILURES = (StepFailedError, EngineDeadError)


def _engine_failure(error: StepFailedError | EngineDeadError) -> APIError:
    if isinstance(error, EngineDeadError):
        return _engine_dead(error)
    return APIError(500, str(error), code="internal_error")


def _engine_dead(error: BaseException) -> APIError:
    return APIError(503, f"the engine has stopped: {error}", code="engine_dead")


def _event(chunk: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(chunk) + b"\n\n"


_DONE = b"data: [DONE]\n\n"  # a stream's last event


class EventFormat(Protocol):
    """How a route's stream is written as server-sent events: each chunk a renderer makes, the
    end after the last delta, and a failure once the headers are out (a JSON body no longer can)."""

    done: bytes  # the stream's last bytes, after its end or an engine failure

    def event(self, chunk: msgspec.Struct) -> bytes: ...

    def end(self, usage: Usage) -> bytes: ...

    def failure(self, error: APIError) -> bytes: ...


class _ChunkEvents:
    """/v1/completions' and /v1/chat/completions' streams: `data: <chunk JSON>` events; at the end
    the usage chunk when stream_options.include_usage asks for it, then `data: [DONE]`; a failure
    is an error body (the openai client raises it)."""

    done = _DONE

    def __init__(self, renderer: Renderer, include_usage: bool) -> None:
        self.renderer, self.include_usage = renderer, include_usage

    def event(self, chunk: msgspec.Struct) -> bytes:
        return _event(chunk)

    def end(self, usage: Usage) -> bytes:
        return _event(self.renderer.usage_chunk(usage)) if self.include_usage else b""

    def failure(self, error: APIError) -> bytes:
        return _event(error.body())


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


def _release_from_thread(loop: asyncio.AbstractEventLoop, semaphore: asyncio.Semaphore, _: Any) -> None:
    """A done callback of a thread's work: the semaphore released on its loop (none left once
    the server has stopped)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(semaphore.release)


def _tokenize(tokenizer, body: TokenizeRequest, images: ChatImages | None, videos: ChatVideos | None) -> list[int]:
    """/tokenize's work: the prompt, or the messages rendered as /v1/chat/completions renders them
    (with their images' and videos' tokens)."""
    if body.messages is not None:
        check_tools(body.tools or [])
        add_generation_prompt = not body.continue_final_message if body.add_generation_prompt is None \
            else body.add_generation_prompt
        text = render_prompt(tokenizer, body.messages, body.tools, body.chat_template_kwargs, add_generation_prompt,
                             body.continue_final_message)
    else:
        text = body.prompt
    return with_videos(with_images(tokenizer.encode(text, add_special_tokens=body.add_special_tokens), images),
                       videos, tokenizer)


def _is_utf8(charset: str) -> bool:
    try:
        return codecs.lookup(charset).name == "utf-8"
    except LookupError:
        return False


def _error_response(error: APIError, path: str) -> web.Response:
    # Under /v1/messages, Anthropic's shape: the anthropic client reads no other.
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    response = _json(error_body(error) if anthropic else error.body(), error.status)
    response.headers.update(error.headers)
    return response
