"""An AsyncLLM in a process of its own, and `EngineProcess`, which stands in for it in the caller's.

Why a process: in one process the server's per-token work (its coroutines, the SSE framing, a
socket write per delta) and the engine's host work per step (schedule, launch, commit,
detokenize) take turns on one GIL. For a small model the engine's host work is the step's
critical path, so every microsecond the server spends on a token lengthens every step. Here the
engine's process does nothing else: its event loop reads requests and writes one message per
step, and the caller's process (the HTTP server) streams the deltas out on a core of its own.
Its steps wait for the device in the loop's own thread (AsyncLLM wait_in_loop): nothing else
needs the loop while a step runs, and the hop to a runner thread and back cost the shipped
model's plain served step 0.67 -> 0.39 ms (H100, bench/results/serve_wait_in_loop_ab-h100).

    engine = await EngineProcess.start(EngineConfig(model=path))    # returns once it is ready
    async for delta in engine.generate(prompt_token_ids, params, request_id):
        ...
    await engine.shutdown()

`EngineProcess` has the part of AsyncLLM's API a server uses (generate without resume_from,
abort, pause, resume, fetch_stats, error, shutdown, the tokenizer and the limits); the
tokenizer is loaded in the caller's process too, so prompts are tokenized there.

Wire: a Unix socket pair; each message a msgspec msgpack Struct of a tagged union, prefixed by
its 4-byte length. To the engine: Add (the SamplingParams pickled: they hold grammar specs and
validate themselves on construction), Abort, Pause, Resume, StatsRequest, Shutdown. From the
engine: Ready or StartFailed, then Outputs (one step's deltas), Failed (a step that raised),
Rejected (add_request refused the request: ValueError), Dead (the engine task ended), Stats,
Closed (after Shutdown: everything aborted and stopped).

The engine process ignores SIGINT and SIGTERM (the caller decides when it stops: a Ctrl-C
reaches the whole process group) and ends when the caller's end of the socket closes or the
caller's process is gone. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Mapping, Sequence as Seq

import msgspec

from .async_llm import AsyncLLM, Outbox, Outboxes, drain, freeze_startup_heap, run
from . import gc_pauses
from .core import engine_image_processor, engine_video_processor
from .engine_config import EngineConfig
from .errors import EngineDeadError, StepFailedError
from .model_source import local_config
from .request import RequestDelta
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer
from .vision.image import ImageInput, VideoInput
from .vision.preprocess import ImageProcessor
from .vision.video import VideoProcessor

logger = logging.getLogger("deltaspec")

# Seconds `shutdown` waits for the engine to abort its requests and stop, then for its process
# to exit before it is killed.
_SHUTDOWN_SECONDS = 60.0
_EXIT_SECONDS = 5.0
_LENGTH = struct.Struct("<I")  # a message's size in bytes, before it


# Messages to the engine -------------------------------------------------------------------------

class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams
    fork_of: str | None
    images: list[ImageInput] = []  # resized pixels: 3 bytes a pixel over the socket
    videos: list[VideoInput] = []


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Pause(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Resume(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class StatsRequest(msgspec.Struct, tag=True, array_like=True):
    ticket: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


# Messages from the engine -----------------------------------------------------------------------

class Ready(msgspec.Struct, tag=True, array_like=True):
    max_model_len: int
    max_num_seqs: int
    generation_defaults: dict[str, float | int]
    images_refused: str | None  # why the engine reads no images or videos (None: it reads them)


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    kind: str  # "value" (bad options, config or checkpoint), "file" (a missing file) or "other"
    message: str


class Outputs(msgspec.Struct, tag=True, array_like=True):
    deltas: list[RequestDelta]


class Failed(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    message: str


class Rejected(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str


class Dead(msgspec.Struct, tag=True, array_like=True):
    message: str


class Stats(msgspec.Struct, tag=True, array_like=True):
    ticket: int
    stats: dict


class Closed(msgspec.Struct, tag=True, array_like=True):
    pass


ToEngine = Add | Abort | Pause | Resume | StatsRequest | Shutdown
FromEngine = Ready | StartFailed | Outputs | Failed | Rejected | Dead | Stats | Closed
_START_ERRORS: dict[str, type[Exception]] = {"value": ValueError, "file": FileNotFoundError}


def _framed(encoder: msgspec.msgpack.Encoder, message: msgspec.Struct) -> bytearray:
    """The message as sent: its length, then its msgpack bytes."""
    buffer = bytearray(_LENGTH.size)
    encoder.encode_into(message, buffer, _LENGTH.size)
    _LENGTH.pack_into(buffer, 0, len(buffer) - _LENGTH.size)
    return buffer


class _Wire:
    """One end of the socket: length-prefixed msgpack messages, written without waiting (the
    other end reads as fast as it can; a write never blocks the loop)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: type) -> None:
        self.reader, self.writer = reader, writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def send(self, message: msgspec.Struct) -> None:
        if self.writer.is_closing():
            return  # the other end is gone; the reading side finds out and ends
        self.writer.write(_framed(self._encoder, message))

    async def receive(self):
        """The next message; asyncio.IncompleteReadError once the other end is gone."""
        (size,) = _LENGTH.unpack(await self.reader.readexactly(_LENGTH.size))
        return self._decoder.decode(await self.reader.readexactly(size))

    def close(self) -> None:
        self.writer.close()


async def _open_wire(sock: socket.socket, incoming: type) -> _Wire:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    return _Wire(reader, writer, incoming)


# The engine's process ---------------------------------------------------------------------------

class _Sender:
    """The engine process's DeltaSink: each step's output as one message to the caller, sent
    at its commit (the caller's work on it runs in the caller's process)."""

    immediate = True

    def __init__(self) -> None:
        self.wire: _Wire | None = None  # attached once the loop runs (the engine is built before)

    def deltas(self, deltas: list[RequestDelta]) -> None:
        self.wire.send(Outputs(deltas))

    def failed(self, request_ids: list[str], error: StepFailedError) -> None:
        self.wire.send(Failed(request_ids, str(error)))

    def dead(self, error: BaseException) -> None:
        self.wire.send(Dead(f"the engine failed: {type(error).__name__}: {error}"))


def _engine_main(sock: socket.socket, config: EngineConfig, log_level: int) -> None:
    """The engine process: build the engine, say Ready (or why not), then serve the wire."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    _exit_with_parent()
    sender = _Sender()
    try:
        llm = AsyncLLM(config=config, sink=sender, wait_in_loop=True)
    except Exception as error:  # noqa: BLE001 - the caller reports it
        kind = next((kind for kind, category in _START_ERRORS.items() if isinstance(error, category)), "other")
        if kind == "other":
            logger.exception("the engine failed to start")
        with sock:
            sock.sendall(_framed(msgspec.msgpack.Encoder(), StartFailed(kind, str(error) or type(error).__name__)))
        return
    freeze_startup_heap()
    gc_pauses.install()
    run(_serve_wire(sock, llm, sender))


def _exit_with_parent() -> None:
    """End this process once the caller's is gone, even while the engine is still loading (its
    loop, which would see the socket close, is not running yet)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="deltaspec-parent-watch", daemon=True).start()


async def _serve_wire(sock: socket.socket, llm: AsyncLLM, sender: _Sender) -> None:
    wire = sender.wire = await _open_wire(sock, ToEngine)
    wire.send(Ready(llm.max_model_len, llm.max_num_seqs, dict(llm.generation_defaults), llm.images_refused))
    asked_to_stop = False
    try:
        while not asked_to_stop:
            try:
                message = await wire.receive()
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the caller is gone
            asked_to_stop = isinstance(message, Shutdown)
            if not asked_to_stop:
                await _handle(message, llm, wire)
    finally:
        await llm.shutdown()  # aborts what runs: its requests' last deltas go out first
        if asked_to_stop:
            wire.send(Closed())
            with contextlib.suppress(ConnectionError):
                await wire.writer.drain()
        wire.close()


async def _handle(message: ToEngine, llm: AsyncLLM, wire: _Wire) -> None:
    if isinstance(message, Add):
        try:
            llm.submit(message.prompt_token_ids, pickle.loads(message.params), message.request_id,
                       fork_of=message.fork_of, images=message.images, videos=message.videos)
        except ValueError as error:
            wire.send(Rejected(message.request_id, str(error)))
        except EngineDeadError as error:
            wire.send(Dead(str(error)))
        except Exception as error:  # noqa: BLE001 - a fault adding one request fails that request only
            logger.exception("adding request %r failed", message.request_id)
            wire.send(Failed([message.request_id], f"adding the request failed: {type(error).__name__}: {error}"))
    elif isinstance(message, Abort):
        await llm.abort(message.request_id)
    elif isinstance(message, Pause):
        llm.pause(message.request_id)
    elif isinstance(message, Resume):
        llm.resume(message.request_id)
    elif isinstance(message, StatsRequest):
        # The server's process has a collector and a CPU clock of its own: this one's pauses and
        # CPU seconds come with the stats.
        wire.send(Stats(message.ticket, {**llm.stats(), "gc_pauses": gc_pauses.installed().snapshot(),
                                         "process_cpu_seconds": time.process_time()}))


# The caller's process ---------------------------------------------------------------------------

class EngineProcess:
    """AsyncLLM's serving API over an engine in its own process (see the module docstring)."""

    def __init__(self, process: multiprocessing.Process, wire: _Wire, ready: Ready, tokenizer: Tokenizer,
                 image_processor: ImageProcessor | None, video_processor: VideoProcessor | None) -> None:
        self.tokenizer = tokenizer
        self.image_processor, self.video_processor = image_processor, video_processor
        self.images_refused = ready.images_refused
        self.max_model_len = ready.max_model_len
        self.max_num_seqs = ready.max_num_seqs
        self.generation_defaults: Mapping[str, float | int] = ready.generation_defaults
        self._process = process
        self._wire = wire
        self._outboxes = Outboxes()
        self._stats: dict[int, asyncio.Future] = {}
        self._tickets = itertools.count()
        self._request_ids = itertools.count()
        self._error: EngineDeadError | None = None
        self._stopping = False
        self._reading = asyncio.get_running_loop().create_task(self._read(), name="deltaspec-engine-wire")

    @classmethod
    async def start(cls, config: EngineConfig) -> EngineProcess:
        """Start the engine's process and return once its engine is built and warmed up. A
        start-up failure raises there as it would in-process: ValueError (bad options, config or
        checkpoint) and FileNotFoundError with the engine's one-line message, RuntimeError else
        (the engine's process logged the traceback). A Hub repo id is resolved here, once: the
        download's progress shows on this process's terminal, and both processes read the copy."""
        config = await asyncio.to_thread(local_config, config)
        ours, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(
            target=_engine_main, args=(theirs, config, logging.getLogger().getEffectiveLevel()),
            name="deltaspec-engine")
        process.start()
        theirs.close()
        wire = await _open_wire(ours, FromEngine)
        # The tokenizer loads here while the engine loads there; the engine's verdict comes
        # first (its checks of the config and checkpoint precede its tokenizer's, as in-process).
        tokenizer = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_dir, Path(config.model)))
        try:
            first = await wire.receive()
            if isinstance(first, Ready):
                # The front end resizes images and videos as the engine's processors would (its
                # own copies).
                processors = (None, None) if first.images_refused is not None else await asyncio.to_thread(
                    lambda: (engine_image_processor(config), engine_video_processor(config)))
                return cls(process, wire, first, await tokenizer, *processors)
        except asyncio.IncompleteReadError:
            first = None
        except BaseException:  # (a cancellation, Ctrl-C, no tokenizer): no engine to wait for
            wire.close()
            await _stop(process, grace=0)
            raise
        finally:
            tokenizer.cancel()
            await asyncio.gather(tokenizer, return_exceptions=True)
        wire.close()
        await _stop(process)
        if isinstance(first, StartFailed):
            raise _START_ERRORS.get(first.kind, RuntimeError)(first.message)
        raise RuntimeError(f"the engine process exited with code {process.exitcode} before it was ready "
                           f"(its log above says why)")

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine stopped, once it has (every request then fails); None while it runs."""
        return self._error

    def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                 fork_of: str | None = None, images: Seq[ImageInput] = (),
                 videos: Seq[VideoInput] = ()) -> AsyncIterator[RequestDelta]:
        """As AsyncLLM.generate: submitted at the first iteration, where bad input raises
        ValueError (the engine's own checks answer one message later, before any delta)."""

        def open_stream() -> tuple[str, Outbox]:
            if self._error is not None:
                raise self._error
            submitted = str(next(self._request_ids)) if request_id is None else str(request_id)
            if submitted in self._outboxes:
                raise ValueError(f"request id {submitted!r} is already in use")
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._wire.send(Add(submitted, token_ids, pickle.dumps(params or SamplingParams()), fork_of, list(images),
                                list(videos)))
            outbox = self._outboxes[submitted] = Outbox()
            return submitted, outbox

        def close(submitted: str, finished: bool) -> None:
            self._outboxes.pop(submitted, None)
            if not finished and self._error is None:  # the consumer went away
                self._wire.send(Abort(submitted))

        return drain(open_stream, close)

    async def abort(self, request_id: str) -> bool:
        return self._tell(request_id, Abort(request_id))

    def pause(self, request_id: str) -> bool:
        return self._tell(request_id, Pause(request_id))

    def resume(self, request_id: str) -> bool:
        return self._tell(request_id, Resume(request_id))

    async def fetch_stats(self) -> dict:
        """AsyncLLM.stats, asked of the engine: its answer comes after every message sent before."""
        if self._error is not None:
            raise self._error
        ticket = next(self._tickets)
        answer = self._stats[ticket] = asyncio.get_running_loop().create_future()
        self._wire.send(StatsRequest(ticket))
        return await answer

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the engine and wait for its process to exit."""
        if self._stopping:
            return
        self._stopping = True
        if self._error is None:
            self._wire.send(Shutdown())
            try:
                await asyncio.wait_for(asyncio.shield(self._reading), _SHUTDOWN_SECONDS)
            except TimeoutError:
                logger.warning("the engine did not stop within %gs; ending its process", _SHUTDOWN_SECONDS)
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)
        self._wire.close()
        await _stop(self._process)

    def _tell(self, request_id: str, message: Abort | Pause | Resume) -> bool:
        """Send a message about a request this process is streaming; False for any other."""
        if request_id not in self._outboxes or self._error is not None:
            return False
        self._wire.send(message)
        return True

    async def _read(self) -> None:
        """Hands each message from the engine to whom it concerns, until Closed or the end."""
        outboxes = self._outboxes
        try:
            while True:
                message = await self._wire.receive()
                if isinstance(message, Outputs):
                    outboxes.deltas(message.deltas)
                elif isinstance(message, Failed):
                    outboxes.failed(message.request_ids, StepFailedError(message.message))
                elif isinstance(message, Rejected):
                    if (outbox := outboxes.get(message.request_id)) is not None:
                        outbox.put(ValueError(message.message))
                elif isinstance(message, Stats):
                    if (answer := self._stats.pop(message.ticket, None)) is not None and not answer.done():
                        answer.set_result(message.stats)
                elif isinstance(message, Dead):
                    self._die(EngineDeadError(message.message))
                elif isinstance(message, Closed):
                    self._die(EngineDeadError("the engine was shut down"))
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._stopping:
                logger.error("the engine process exited unexpectedly; every request fails from now on")
            self._die(EngineDeadError("the engine process exited"))

    def _die(self, error: EngineDeadError) -> None:
        if self._error is None:
            self._error = error
        self._outboxes.dead(self._error)
        for answer in self._stats.values():
            if not answer.done():
                answer.set_exception(self._error)
        self._stats.clear()


async def _stop(process: multiprocessing.Process, grace: float = _EXIT_SECONDS) -> None:
    """Wait up to `grace` seconds for the engine's process to exit, then kill it (it ignores
    SIGTERM: see the module docstring)."""
    await asyncio.to_thread(process.join, grace)
    if process.exitcode is None:
        process.kill()
        await asyncio.to_thread(process.join)
