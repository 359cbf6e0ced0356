"""AsyncLLM: the asyncio front end. One engine task drives EngineCore; requests stream deltas.

    async for delta in engine.generate(prompt, params):   # new token ids, new text,
        ...                                               # finish_reason on the last
    await engine.abort(request_id)
    engine.stats()

The engine task dispatches and commits steps on the event loop (pure Python, fast) and waits for
the device in one worker thread, so the loop keeps serving other coroutines while the device
works. A step's deltas are handed to their consumers once the next step is on the device
(`Dispatched.wait` says when), so streaming them out (the server's per-token work) overlaps the
device's work instead of delaying the next launch, or at once to a sink that only sends them on
(`DeltaSink.immediate`: the engine process's); in steady plain decoding the step after is
launched even before the current one is waited for (EngineCore.dispatch). Deltas reach
per-request outboxes without ever blocking; a consumer that fell behind takes every delta
waiting at once, merged into one (`_coalesced`). A consumer that stops iterating (client
disconnect) aborts its request; one that cannot keep up pauses it (`pause`/`resume`). A step
that raises fails its requests only (StepFailedError), a row with non-finite logits its own
request only (NonFiniteLogitsError); several failed steps in a row end the engine
(EngineDeadError), as does a tensor-parallel worker's death at once. Runs on uvloop when the
caller's loop is uvloop (see `run`).

What the engine task produces goes to a `DeltaSink`: the per-request outboxes `generate` reads,
or, in an engine process of its own (engine_process.py), one message per step to the front end
there, whose requests come in through `submit`. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Protocol, Sequence as Seq

from .core import EngineCore, StepResult
from .engine_config import EngineConfig
from . import vllm_options
from .errors import EngineDeadError, NonFiniteLogitsError, StepFailedError
from .executor import TensorParallelError
from .prefix_cache import CheckpointHandle
from .request import RequestDelta
from .sampling_params import SamplingParams
from .step import StepPlan
from .vision.image import ImageInput, VideoInput
from .vision.preprocess import ImageProcessor
from .vision.video import VideoProcessor


logger = logging.getLogger("deltaspec")

# Steps in a row that may fail before the engine gives up: a fault that repeats with no step
# succeeding in between (a lost device: CUDA errors are sticky) would otherwise fail every new
# request forever.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class DeltaSink(Protocol):
    """Where the engine task's output goes, on the event loop, in step order.

    immediate: a step's deltas are delivered as soon as it is committed. Otherwise they wait
    until the next step is on the device: the outboxes' consumers are coroutines on this loop,
    whose work (a server's, per token) would otherwise run while the next step is launched and
    delay it. A sink that only sends the deltas on (to another process) costs the launch little
    and saves every token the launch's latency."""

    immediate: bool

    def deltas(self, deltas: list[RequestDelta]) -> None:
        """A step's deltas (one per request it advanced)."""

    def failed(self, request_ids: list[str], error: StepFailedError) -> None:
        """These requests' step raised; the engine dropped them."""

    def dead(self, error: BaseException) -> None:
        """The engine task ended with `error`: no request will make progress."""


class AsyncLLM:
    def __init__(self, model_path: str | Path | None = None, *, config: EngineConfig | None = None,
                 core: EngineCore | None = None, sink: DeltaSink | None = None, wait_in_loop: bool = False,
                 **engine_options) -> None:
        """core: an engine core built already, in place of one from the config (the server's
        overhead benchmark drives the front end over a stub core: bench/tools/serve_overhead.py).
        sink: where the engine's output goes instead of `generate`'s streams (requests then come
        through `submit`; engine_process.py). wait_in_loop: each step waits for the device in
        the event loop's thread, not a runner thread, for a process whose loop does nothing but
        the engine (engine_process.py): no thread hop per step, while the loop's other work
        (reading new requests) waits for the step."""
        if core is None:
            core = EngineCore(config or EngineConfig(model=model_path,
                                                     **vllm_options.engine_options(model_path, engine_options)))
        self.core = core
        self._outboxes = Outboxes()
        self._sink: DeltaSink = self._outboxes if sink is None else sink
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaspec-runner")
        self._wait_in_loop = wait_in_loop
        self._error: BaseException | None = None

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def image_processor(self) -> ImageProcessor | None:
        """What resizes a prompt's images for this engine (None: it reads none: `images_refused`)."""
        return self.core.image_processor

    @property
    def video_processor(self) -> VideoProcessor | None:
        """What decodes and resizes a prompt's videos for this engine (None: it reads none:
        `images_refused`)."""
        return self.core.video_processor

    @property
    def images_refused(self) -> str | None:
        """Why this engine reads no images or videos; None when it does."""
        return self.core.images_refused

    @property
    def generation_defaults(self) -> Mapping[str, float | int]:
        """What unset sampling fields become (generation_config.json; empty with "none")."""
        return self.core.generation_defaults

    @property
    def max_num_seqs(self) -> int:
        """Requests running at once at most; more wait in the engine's queue."""
        return self.core.config.max_num_seqs

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold at most: prompt plus output."""
        return self.core.max_model_len

    # Public API ---------------------------------------------------------------------------

    def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                 request_id: str | None = None,
                 resume_from: CheckpointHandle | None = None,
                 fork_of: str | None = None, images: Seq[ImageInput] = (),
                 videos: Seq[VideoInput] = ()) -> AsyncIterator[RequestDelta]:
        """Submit a request and stream its deltas. The request is submitted at the first
        iteration; bad input raises ValueError there, before anything is queued. resume_from: a
        session saved by `save_checkpoint`; the prompt continues it. fork_of: the id of another
        choice of the same prompt, submitted first, whose prefill this one reuses; images,
        videos: the prompt's (EngineCore.add_request)."""
        if self._sink is not self._outboxes:
            raise RuntimeError("this AsyncLLM delivers its output to a sink: submit requests with submit()")

        def open_stream() -> tuple[str, Outbox]:
            submitted = self.submit(prompt, params, request_id, resume_from, fork_of, images, videos)
            outbox = self._outboxes[submitted] = Outbox()
            return submitted, outbox

        def close(submitted: str, finished: bool) -> None:
            self._outboxes.pop(submitted, None)
            if not finished:  # the consumer went away (disconnect, cancellation)
                self.core.abort(submitted)
                self._wakeup.set()

        return drain(open_stream, close)

    def submit(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
               resume_from: CheckpointHandle | None = None, fork_of: str | None = None,
               images: Seq[ImageInput] = (), videos: Seq[VideoInput] = ()) -> str:
        """Queue a request (arguments as `generate`); returns its id. Its deltas go to the sink.
        Bad input raises ValueError, queueing nothing."""
        self._ensure_running()
        request = self.core.add_request(prompt, params or SamplingParams(), request_id, resume_from, fork_of, images,
                                        videos)
        self._wakeup.set()
        return request.request_id

    async def fetch_stats(self) -> dict:
        """`stats`, as an engine in its own process answers it (EngineProcess.fetch_stats): the
        server reads either through this."""
        return self.stats()

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, once it has (every request then fails); None while it runs."""
        return self._error

    async def abort(self, request_id: str) -> bool:
        aborted = self.core.abort(request_id)
        if aborted and self._wakeup is not None:
            self._wakeup.set()
        return aborted

    def pause(self, request_id: str) -> bool:
        """Backpressure: schedule no more of the request until `resume` (its client reads
        nothing), so its output queue stops growing; it keeps its slot and blocks."""
        return self.core.pause(request_id)

    def resume(self, request_id: str) -> bool:
        resumed = self.core.resume(request_id)
        if resumed and self._wakeup is not None:
            self._wakeup.set()  # the engine may have gone idle with every request paused
        return resumed

    def save_checkpoint(self, request_id: str) -> CheckpointHandle:
        """A handle on a finished request's state for `generate(..., resume_from=handle)`."""
        return self.core.save_checkpoint(request_id)

    def release_checkpoint(self, handle: CheckpointHandle) -> None:
        self.core.release_checkpoint(handle)

    def stats(self) -> dict:
        return self.core.stats()

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine task."""
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
        if self._task is not None:
            self._wakeup.set()
            while self.core.has_work and not self._task.done():
                await asyncio.sleep(0.01)
            self._task.cancel()
            # A dead engine's task ended with the error its requests were given (EngineDeadError).
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._executor.shutdown(wait=True)
        self.core.close()

    # The engine task ----------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine failed") from self._error
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._engine_loop(), name="deltaspec-engine")

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        num_failed = 0  # steps failed in a row
        committed: list[RequestDelta] = []  # the last step's deltas, handed out once the next is launched
        try:
            while True:
                if not self.core.has_work:
                    committed = self._hand_out(committed)
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                plan = None
                try:
                    step = self.core.dispatch()
                    plan = step.plan
                    if self._wait_in_loop:
                        committed = self._hand_out(committed)
                        result = step.wait()
                        await asyncio.sleep(0)  # the loop's I/O between steps: requests, aborts
                    elif committed:
                        on_device = _OnDevice(loop)
                        waited = loop.run_in_executor(self._executor, on_device.wait, step.wait)
                        await on_device.future
                        # Their consumers run while the device works (and the runner waits).
                        committed = self._hand_out(committed)
                        result = await waited
                    else:
                        result = await loop.run_in_executor(self._executor, step.wait)
                    deltas = self.core.commit(step.plan, result)
                except Exception as error:  # noqa: BLE001 - one step's fault fails its requests only
                    committed = self._hand_out(committed)  # (they came before the failure)
                    num_failed += 1
                    if isinstance(error, TensorParallelError):
                        logger.error("%s", error)
                        raise
                    if num_failed >= MAX_CONSECUTIVE_FAILED_STEPS:
                        logger.error("%d steps failed in a row, the last with %s: %s; the engine stops",
                                     num_failed, type(error).__name__, error)
                        raise
                    self._fail_step(plan, error)
                    continue
                num_failed = 0
                committed = self._hand_out(deltas) if self._sink.immediate else deltas
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - every waiting request must hear about it
            self._error = error
            self._sink.dead(error)
            raise

    def _hand_out(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Deliver a step's deltas; returns the empty list that replaces them."""
        if deltas:
            self._sink.deltas(deltas)
        return []

    def _fail_step(self, plan: StepPlan | None, error: Exception) -> None:
        failed = self.core.fail(plan)
        named = ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else "")
        logger.error("a step failed with %s: %s; failing its %d requests (%s), serving the rest",
                     type(error).__name__, error, len(failed), named)
        logger.debug("the failed step's traceback", exc_info=error)
        self._sink.failed(failed, StepFailedError(f"the engine step running this request failed: "
                                                  f"{type(error).__name__}: {error}"))


def drain(open_stream: Callable[[], tuple[str, Outbox]],
          close: Callable[[str, bool], None]) -> AsyncIterator[RequestDelta]:
    """A request's stream: open_stream() submits it at the first iteration (so bad input raises
    ValueError there, queueing nothing, and a stream never iterated submits nothing) and returns
    its id and outbox; then its deltas until the one with a finish reason. An error put in the
    outbox is raised: StepFailedError and ValueError (the engine dropped or refused the request)
    as they are, EngineDeadError as it is or for anything else. close(request_id, finished) runs
    when the stream ends, however it ends (finished: the engine holds nothing of the request)."""

    async def deltas() -> AsyncIterator[RequestDelta]:
        request_id, outbox = open_stream()
        finished = False
        try:
            while not finished:
                while not outbox.items:
                    await outbox.arrival()
                for delta in outbox.take():
                    if isinstance(delta, (StepFailedError, ValueError)):
                        finished = True  # the engine dropped it already
                        raise delta
                    if isinstance(delta, EngineDeadError):
                        raise delta
                    if isinstance(delta, BaseException):
                        raise EngineDeadError("the engine failed") from delta
                    finished = delta.finish_reason is not None
                    if delta.finish_reason == "error":
                        raise NonFiniteLogitsError([request_id])
                    yield delta
                    if finished:
                        break
        finally:
            close(request_id, finished)

    return deltas()


class Outboxes(dict):
    """request id -> Outbox of `generate`'s streams: the default DeltaSink."""

    immediate = False

    def deltas(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            outbox = self.get(delta.request_id)
            if outbox is not None:
                outbox.put(delta)

    def failed(self, request_ids: list[str], error: StepFailedError) -> None:
        for request_id in request_ids:
            outbox = self.get(request_id)
            if outbox is not None:
                outbox.put(error)

    def dead(self, error: BaseException) -> None:
        for outbox in self.values():
            outbox.put(error)


class Outbox:
    """One request's deltas (or the error that ends it) on their way to its consumer: a list
    and the consumer's waiter, lighter than an asyncio.Queue (every running request gets one
    put per step, and its consumer awaits a bare future, no coroutine)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list[RequestDelta | BaseException] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestDelta | BaseException) -> None:
        self.items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def arrival(self) -> asyncio.Future:
        """Done once something is put."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def take(self) -> list[RequestDelta | BaseException]:
        """Everything put since the last take, runs of deltas merged."""
        items, self.items = self.items, []
        return items if len(items) == 1 else _coalesced(items)


def _coalesced(items: list[RequestDelta | BaseException]) -> list[RequestDelta | BaseException]:
    """Consecutive deltas of one request as one: what it produced since the consumer last
    looked (token ids, text and log-probabilities concatenated, the last finish reason and
    speculation counters, the prompt's log-probabilities and cached-token count from whichever
    carried them). An
    abort or error delta and an exception stay on their own: they end the stream, and what
    came before them is output the consumer must see first."""
    merged: list[RequestDelta | BaseException] = []
    for item in items:
        last = merged[-1] if merged else None
        if (isinstance(item, RequestDelta) and item.finish_reason not in ("abort", "error")
                and isinstance(last, RequestDelta) and last.finish_reason is None):
            merged[-1] = RequestDelta(last.request_id, last.token_ids + item.token_ids, last.text + item.text,
                                      item.finish_reason,
                                      None if last.logprobs is None else last.logprobs + item.logprobs,
                                      item.spec_stats, last.prompt_logprobs or item.prompt_logprobs,
                                      item.num_cached_tokens if last.num_cached_tokens is None
                                      else last.num_cached_tokens)
        else:
            merged.append(item)
    return merged


class _OnDevice:
    """Tells the engine task, from the runner thread, that a step is on the device: once,
    at the latest when its wait ends (also by raising)."""

    __slots__ = ("future", "_loop", "_told")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future = loop.create_future()
        self._loop = loop
        self._told = False

    def wait(self, wait: Callable[..., StepResult]) -> StepResult:
        """Runs in the runner thread: wait(self.tell)."""
        try:
            return wait(self.tell)
        finally:
            self.tell()

    def tell(self) -> None:
        if not self._told:
            self._told = True
            self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


def freeze_startup_heap() -> None:
    """Move every object alive now (the engine, torch, the tokenizer: ~200k of them) out of the
    garbage collector's reach. A full collection walks them all (82 ms for the shipped model's
    process on a 2-core CPU), and a server allocating per token triggers one every few seconds:
    a stall of every stream at once, the tail of time to first token. What is frozen lives for
    the process anyway; objects made later are collected as before. They are handed back to
    the collector at exit, where extension modules check that their objects were freed (Triton's
    nanobind bindings print hundreds of "leaked" lines otherwise)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def run(main) -> object:
    """asyncio.run on uvloop when it is installed (the engine's default loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
