"""The load generator of `deltaspec bench serve`: what each request sends, when it is sent, and the
client processes that send it over HTTP, so that the client is never the server's limit.

A run's load (`Load`) is closed loop (N streams, each sending its next request when its last one
ends) or open loop (requests sent at fixed times: Poisson arrivals at a rate, gamma-distributed
gaps for burstier or smoother traffic, or a constant gap). Request k of a run gets the prompt
`PromptSet.prompt(run, k)`: the same in every process and in the in-process run, so both see the
same load. `drive` runs a share of a load (some of the streams, some of the arrivals) with any
`send(prompt, origin, max_tokens=None) -> Sample`; `ClientProcesses` runs the shares in worker
processes (multiprocessing spawn), each with its own event loop and aiohttp session, and merges
their samples. Times are seconds since the run's origin, one instant for every process:
time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for the whole machine.

Closed-loop warm-up (why: serve_benchmark's docstring): each stream's first request is its
warm-up, and the measured window opens when the last warm-up of every stream in every process
has ended (`Window`, shared memory); a stream counts only the requests it starts after that.

Knows the server only through HTTP and nothing of the engine.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import json
import multiprocessing
import queue
import random
import time
import traceback
from array import array
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Union

import aiohttp
import numpy as np

MODEL_NAME = "bench"  # the name the benchmark's server is started with
_START_LEAD = 0.05  # seconds between telling the processes the origin and the origin itself
_POLL = 1.0  # seconds between checks that every client process is alive

Prompt = Union[str, list[int]]


@dataclass
class Sample:
    """One request as its client saw it (seconds since the run's origin, or durations)."""

    start: float
    ttft: float
    # Float arrays, not lists: the garbage collector walks a list of floats element by element, and
    # a run's samples (a time per token of every request, ~350k per client process at 16 streams
    # over 20 s) made full collections of 25-110 ms in the client processes (H100 runs, a
    # gc.callbacks probe), in which a client reads no chunk: measured as the server's latency.
    itls: array  # between chunks that carried tokens
    token_times: array  # when each such chunk arrived (for the abuse window)
    e2e: float
    output_tokens: int
    prompt_tokens: int | None = None  # as the server counted them (usage); None where unknown


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for (ignore_eos: each runs to max_tokens)."""

    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class PromptSet:
    """The prompts of a benchmark. `texts`: code prompts, request k of a run sending texts[k % len]
    (prefixed with a first line naming the request when `unique`); or, with `input_len`, random
    token ids, input_len * (1 +- input_len_range) of them (uniform), drawn from the first
    `vocab_size` ids. `nonce` (one per benchmark) keys the unique and random prompts, so neither
    hits another request's prefix cache entries, nor an earlier benchmark's on the same server."""

    name: str
    texts: tuple[str, ...] = ()
    unique: bool = False
    input_len: int | None = None
    input_len_range: float = 0.0
    vocab_size: int = 0
    nonce: str = ""

    def prompt(self, run: str, index: int) -> Prompt:
        if self.input_len is not None:
            # numpy draws the ids (3x faster than `random`: 0.5 ms for 8k; the client's CPU counts).
            key = hashlib.sha256(f"{self.nonce}/{run}/{index}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
            low = max(1, round(self.input_len * (1 - self.input_len_range)))
            length = rng.integers(low, max(low, round(self.input_len * (1 + self.input_len_range))) + 1)
            return rng.integers(0, self.vocab_size, length).tolist()
        text = self.texts[index % len(self.texts)]
        return f"# request {self.nonce}-{run}-{index}\n{text}" if self.unique else text

    def describe(self) -> dict:
        if self.input_len is not None:
            return {"name": self.name, "input_len": self.input_len, "input_len_range": self.input_len_range,
                    "unique": True}
        return {"name": self.name, "num_prompts": len(self.texts), "unique": self.unique}


@dataclass(frozen=True)
class Load:
    """One run. Closed loop: `num_streams` streams, each after its warm-up sending
    `requests_per_stream` counted requests or sending until `duration` seconds after the window
    opened. Open loop: request k sent `arrivals[k]` seconds after the origin, every one counted."""

    run: str  # the run's name in the prompts' keys
    max_tokens: int  # each counted request's output (the mean of them with max_tokens_range)
    num_streams: int | None = None
    requests_per_stream: int | None = None
    duration: float | None = None
    arrivals: tuple[float, ...] | None = None
    request_rate: float | None = None  # the open loop's asked rate (what `arrivals` were drawn for)
    # Each counted request's output uniform in max_tokens * (1 +- this), keyed by the run and
    # index as its prompt is. 0: every request the same; then a closed loop's streams that once
    # finish on the same step stay in step (plain decoding emits a token a row each step), so
    # their successors keep sharing admissions, as real traffic's varied lengths would not.
    max_tokens_range: float = 0.0

    @property
    def closed(self) -> bool:
        return self.arrivals is None

    def output_tokens(self, index: int) -> int | None:
        """Request `index`'s max_tokens, or None (the sampling's) when every request has the same."""
        if not self.max_tokens_range:
            return None
        key = hashlib.sha256(f"{self.run}/{index}".encode()).digest()
        low = max(1, round(self.max_tokens * (1 - self.max_tokens_range)))
        high = max(low, round(self.max_tokens * (1 + self.max_tokens_range)))
        return low + int.from_bytes(key[:8], "little") % (high - low + 1)

    def share(self, part: int, parts: int) -> tuple[int, ...]:
        """What client process `part` of `parts` runs: its streams (closed) or requests (open)."""
        return tuple(range(part, self.num_streams if self.closed else len(self.arrivals), parts))


def arrival_times(rate: float, count: int | None, duration: float | None, burstiness: float, constant: bool,
                  seed: int) -> tuple[float, ...]:
    """Send times (seconds after the origin, the first at 0) of an open loop at `rate` requests/s,
    `count` of them or as many as start within `duration`. Gaps: 1 / rate each (constant), else
    gamma-distributed with shape `burstiness` and mean 1 / rate (vLLM's benchmark_serving):
    burstiness 1 is a Poisson process, below 1 burstier, above 1 more even."""
    rng = random.Random(seed)
    times, now = [], 0.0
    while (count is None or len(times) < count) and (duration is None or now < duration):
        times.append(now)
        now += 1 / rate if constant else rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return tuple(times)


class Window:
    """When a closed loop's measured window opens: the moment the last of its streams' warm-ups
    ended (seconds after the origin). In shared memory, so streams in every client process see
    one window; reset by the coordinator between runs, while no stream runs."""

    def __init__(self, context) -> None:
        self._warm = context.Value("i", 0)  # its lock guards _latest too
        self._latest = context.Value("d", 0.0, lock=False)  # the latest warm-up end so far
        self._start = context.Value("d", -1.0)

    def reset(self) -> None:
        self._warm.value, self._latest.value, self._start.value = 0, 0.0, -1.0

    def warmed(self, num_streams: int, now: float) -> None:
        """A stream's warm-up ended at `now`; the last one opens the window at the latest end
        (the last to take the lock may have read the clock a moment before another)."""
        with self._warm.get_lock():
            self._warm.value += 1
            self._latest.value = max(self._latest.value, now)
            if self._warm.value == num_streams:
                self._start.value = self._latest.value

    @property
    def start(self) -> float | None:
        """None until the window has opened."""
        start = self._start.value
        return None if start < 0 else start


Send = Callable[..., Awaitable[Sample]]  # send(prompt, origin, max_tokens=None)


async def drive(load: Load, share: tuple[int, ...], prompts: PromptSet, window: Window, send: Send,
                origin: float) -> list[Sample]:
    """Run this share of the load from `origin` (a time.perf_counter() instant); returns the
    counted requests (closed loop: those started in the window)."""
    if not load.closed:
        # One task a request, made at its arrival (the share is in arrival order): a long run
        # keeps only the requests in flight, not every future arrival, on the loop.
        requests = []
        for index in share:
            await asyncio.sleep(origin + load.arrivals[index] - time.perf_counter())
            requests.append(asyncio.create_task(send(prompts.prompt(load.run, index), origin,
                                                     load.output_tokens(index))))
        return list(await asyncio.gather(*requests))

    samples: list[Sample] = []
    num_streams = load.num_streams

    async def stream(index: int) -> None:
        # Warm-ups of 1/N, 2/N, .. N/N of the output: the streams leave them spread over a
        # request's life, as a closed loop's steady state has them (N identical requests sent at
        # once would stay in step: they finish and return together, a burst each time).
        warm_up_tokens = -(-load.max_tokens * (index + 1) // num_streams)
        await send(prompts.prompt(load.run, index), origin, warm_up_tokens)
        window.warmed(num_streams, time.perf_counter() - origin)
        sent, counted = 1, 0
        while True:
            start = window.start
            if load.requests_per_stream is not None and counted >= load.requests_per_stream:
                return
            if load.duration is not None and start is not None and \
                    time.perf_counter() - origin >= start + load.duration:
                return
            request = index + sent * num_streams
            sample = await send(prompts.prompt(load.run, request), origin, load.output_tokens(request))
            sent += 1
            start = window.start
            if start is not None and sample.start >= start:
                samples.append(sample)
                counted += 1

    await asyncio.gather(*(stream(index) for index in share))
    return samples


# Over HTTP --------------------------------------------------------------------------------------

async def served_request(http: aiohttp.ClientSession, url: str, sampling: Sampling, prompt: Prompt,
                         origin: float, max_tokens: int | None = None) -> Sample:
    """A streamed /v1/completions request (a prompt of token ids goes as such)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens or sampling.max_tokens,
            "temperature": sampling.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, num_tokens, num_prompt_tokens = [], 0, None
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
                num_prompt_tokens = chunk["usage"]["prompt_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                times.append(time.perf_counter())
    return sample(start, times, num_tokens, origin, num_prompt_tokens)


def sample(start: float, times: list[float], num_tokens: int, origin: float,
           num_prompt_tokens: int | None = None) -> Sample:
    """A request's Sample from its start and the arrival times of its token-carrying chunks."""
    end = times[-1] if times else time.perf_counter()
    itls = array("d", [b - a for a, b in zip(times, times[1:])])
    return Sample(start - origin, (times[0] if times else end) - start, itls, array("d", [t - origin for t in times]),
                  end - start, num_tokens, num_prompt_tokens)


def http_session(timeout: float) -> aiohttp.ClientSession:
    """A session with no connection limit; `timeout`: seconds a stream may go without a byte."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout),
                                 connector=aiohttp.TCPConnector(limit=0))


@dataclass
class Measured:
    """A run's counted requests (from every process, by start), its window's opening (seconds
    after the origin) and each client process's CPU seconds per wall second of the run."""

    samples: list[Sample]
    window_start: float
    client_cpu_fractions: list[float] = field(default_factory=list)


class ClientProcesses:
    """`count` client processes, started once and given one run at a time. A run: each process
    gets its share and answers ready; then all get one origin a moment ahead, wait for it, run,
    and send back their samples and CPU fraction."""

    def __init__(self, count: int, url: str, timeout: float, sampling: Sampling, prompts: PromptSet) -> None:
        context = multiprocessing.get_context("spawn")
        self.window = Window(context)
        self._inboxes = [context.Queue() for _ in range(count)]
        self._outbox = context.Queue()
        self._processes = [context.Process(target=_client_main, name=f"bench-client-{i}", daemon=True,
                                           args=(url, timeout, sampling, prompts, self.window, inbox, self._outbox))
                           for i, inbox in enumerate(self._inboxes)]
        for process in self._processes:
            process.start()

    def __len__(self) -> int:
        return len(self._processes)

    async def run(self, load: Load, on_start: Callable[[float], None] | None = None) -> Measured:
        """Run `load` across the processes; `on_start(origin)` is called once the origin is set."""
        self.window.reset()
        for part, inbox in enumerate(self._inboxes):
            inbox.put((load, load.share(part, len(self))))
        for _ in self._inboxes:
            await self._receive("ready")
        origin = time.perf_counter() + _START_LEAD
        for inbox in self._inboxes:
            inbox.put(origin)
        if on_start is not None:
            on_start(origin)
        samples, fractions = [], []
        for _ in self._inboxes:
            part_samples, fraction = await self._receive("samples")
            samples += part_samples
            fractions.append(fraction)
        window_start = self.window.start if load.closed else 0.0
        return Measured(sorted(samples, key=lambda s: s.start), window_start, fractions)

    async def _receive(self, expected: str) -> tuple:
        """The next (kind, *body) message's body from any process; a failure's traceback raises."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                kind, *body = await loop.run_in_executor(None, self._outbox.get, True, _POLL)
            except queue.Empty:
                if not all(process.is_alive() for process in self._processes):
                    raise RuntimeError("a bench client process died") from None
                continue
            if kind == "failed":
                raise RuntimeError(f"a bench client process failed:\n{body[0]}")
            assert kind == expected, (kind, expected)
            return tuple(body)

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def _client_main(url: str, timeout: float, sampling: Sampling, prompts: PromptSet, window: Window,
                 inbox, outbox) -> None:
    """A client process: runs the loads its inbox brings until None."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_client(url, timeout, sampling, prompts, window, inbox, outbox))
    # Handed back before exit: extension modules that the spawn start imported with the parent's
    # main module (Triton's nanobind bindings, under the CLI) check at exit that their objects were freed.
    gc.unfreeze()


async def _client(url: str, timeout: float, sampling: Sampling, prompts: PromptSet, window: Window,
                  inbox, outbox) -> None:
    async with http_session(timeout) as http:
        send = functools.partial(served_request, http, url, sampling)
        # A collection walking the start-up heap would show as a latency spike.
        gc.collect()
        gc.freeze()
        while (message := inbox.get()) is not None:  # between runs nothing else runs here
            load, share = message
            try:
                outbox.put(("ready",))
                origin = inbox.get()
                await asyncio.sleep(origin - time.perf_counter())
                cpu, wall = time.process_time(), time.perf_counter()
                samples = await drive(load, share, prompts, window, send, origin)
                outbox.put(("samples", samples, (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)))
            except Exception:  # noqa: BLE001 (reported to the coordinator, which raises)
                outbox.put(("failed", traceback.format_exc()))
                return
