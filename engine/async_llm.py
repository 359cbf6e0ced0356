"""AsyncLLM: the asyncio front end. One engine task drives EngineCore; requests stream deltas.

    async for delta in engine.generate(prompt, params):   # new token ids, new text,
        ...                                               # finish_reason on the last
    await engine.abort(request_id)
    engine.stats()

The engine task dispatches and commits steps on the event loop (pure Python, fast) and waits
for the device in one worker thread, so the loop keeps serving other coroutines while the
device works; the next step's CPU work (streaming deltas out, admitting requests) overlaps the
current step's device work, and in steady plain decoding the next step is already launched
before the current one is waited for (EngineCore.dispatch). Results reach per-request queues with put_nowait: never blocking. A consumer that
stops iterating (client disconnect) aborts its request; one that cannot keep up pauses it
(`pause`/`resume`). A step that raises fails its requests only (StepFailedError), a row with
non-finite logits its own request only (NonFiniteLogitsError); several failed steps in a row end
the engine (EngineDeadError), as does a tensor-parallel worker's death at once. Runs on uvloop when the caller's loop
is uvloop (see `run`). Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence as Seq

from .core import EngineCore
from .engine_config import EngineConfig
from .errors import EngineDeadError, NonFiniteLogitsError, StepFailedError
from .executor import TensorParallelError
from .prefix_cache import CheckpointHandle
from .request import RequestDelta
from .sampling_params import SamplingParams
from .step import StepPlan


logger = logging.getLogger("deltaspec")

# Steps in a row that may fail before the engine gives up: a fault that repeats with no step
# succeeding in between (a lost device: CUDA errors are sticky) would otherwise fail every new
# request forever.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class AsyncLLM:
    def __init__(self, model_path: str | Path | None = None, *, config: EngineConfig | None = None,
                 core: EngineCore | None = None, **engine_options) -> None:
        """core: an engine core built already, in place of one from the config (the server's
        overhead benchmark drives the front end over a stub core: bench/tools/serve_overhead.py)."""
        if core is None:
            core = EngineCore(config or EngineConfig(model=model_path, **engine_options))
        self.core = core
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaspec-runner")
        self._error: BaseException | None = None

    @property
    def tokenizer(self):
        return self.core.tokenizer

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

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       request_id: str | None = None,
                       resume_from: CheckpointHandle | None = None,
                       fork_of: str | None = None) -> AsyncIterator[RequestDelta]:
        """Submit a request and stream its deltas. Bad input raises ValueError before anything
        is queued. resume_from: a session saved by `save_checkpoint`; the prompt continues it.
        fork_of: the id of another choice of the same prompt, submitted first, whose prefill this
        one reuses (EngineCore.add_request)."""
        self._ensure_running()
        request = self.core.add_request(prompt, params or SamplingParams(), request_id, resume_from, fork_of)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if isinstance(delta, StepFailedError):
                    finished = True  # the engine dropped it already
                    raise delta
                if isinstance(delta, BaseException):
                    raise EngineDeadError("the engine failed") from delta
                finished = delta.finish_reason is not None
                if delta.finish_reason == "error":
                    raise NonFiniteLogitsError([request.request_id])
                yield delta
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:  # the consumer went away (disconnect, cancellation)
                self.core.abort(request.request_id)
                self._wakeup.set()

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
        try:
            while True:
                if not self.core.has_work:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                plan = None
                try:
                    step = self.core.dispatch()
                    plan = step.plan
                    result = await loop.run_in_executor(self._executor, step.wait)
                    deltas = self.core.commit(step.plan, result)
                except Exception as error:  # noqa: BLE001 - one step's fault fails its requests only
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
                for delta in deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                await asyncio.sleep(0)  # let consumers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - every waiting request must hear about it
            self._error = error
            for queue in self._queues.values():
                queue.put_nowait(error)
            raise

    def _fail_step(self, plan: StepPlan | None, error: Exception) -> None:
        failed = self.core.fail(plan)
        named = ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else "")
        logger.error("a step failed with %s: %s; failing its %d requests (%s), serving the rest",
                     type(error).__name__, error, len(failed), named)
        logger.debug("the failed step's traceback", exc_info=error)
        for request_id in failed:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(StepFailedError(f"the engine step running this request failed: "
                                                 f"{type(error).__name__}: {error}"))


def run(main) -> object:
    """asyncio.run on uvloop when it is installed (the engine's default loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
