"""`deltaspec bench serve`: closed-loop load on the OpenAI server, and the same load on AsyncLLM
in-process, in one run.

For each stream count N, N streams send streamed /v1/completions back to back (the next request
as soon as the last one ends: closed loop) from a prompt set (the held-out code prompts of the
acceptance benchmark), for `--requests-per-stream` requests each or `--duration` seconds. Every
request records its time to first token (TTFT), the gaps between the chunks that carry tokens
(inter-token latency, ITL), its end-to-end latency and its output tokens (usage). Each stream's
first request is its warm-up, stream i's asking for (i + 1) / N of the output, and the measured
window opens when the last of them has ended: the streams, which all started at once, are then
spread over a request's life, as a closed loop's clients are in its steady state; only requests
that start in the window count (N identical requests sent at once would stay in step, arriving
together again each time, their prompts queued behind each other's prefill). Tokens/s = the
counted requests' output tokens / (the last one's end - the window's start): requests under way
when the window opens are not counted, which understates it by up to one request a stream, both
ways alike. Then the same prompts, streams and sampling go through `AsyncLLM.generate` with no
HTTP, so the report holds the served / in-process ratio of output tokens/s. The server is
started as its own process (`deltaspec serve` with the same engine flags, its engine in a process
of its own, or on the server's loop with `--single-process`: it never shares a CPU core's loop
with the client) and stopped before the in-process engine is built, or is the one at `--url`. The client's own CPU time is reported for the server it started: above 90% of the wall
time the client, not the server, may be the limit, and the report says so.

`--abuse`: the issue's bar under abuse. The streams run twice for `--duration` seconds (at
least 4): without, then with `--abuse-prompts` prompts of `--abuse-bytes` (about 1 MiB: under
the body limit, far over the context) fired at a quarter of the run, while /health is polled
every 20 ms; reports ITL p99 of each run (the abused one over the gaps after the prompts were
sent) and /health's latency.

Writes serve-<device>.json and .png (latency CDFs, tokens/s by stream count) under --out with
device, date, commit and command. Knows the server only through HTTP and the engine only through
AsyncLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from ..engine import AsyncLLM, EngineConfig, SamplingParams
from ..engine.async_llm import run
from .acceptance_benchmark import device_name, device_tag, load_prompts
from .engine_args import add_engine_options, engine_flags, engine_options
from ..engine.async_llm import freeze_startup_heap

_MODEL_NAME = "bench"
_CLIENT_BOUND = 0.9  # client CPU seconds per wall second above which the client may be the limit
_HEALTH_PERIOD = 0.02


@dataclass
class Sample:
    """One request as its client saw it (seconds since the run's start, or durations)."""

    start: float
    ttft: float
    itls: list[float]  # between chunks that carried tokens
    token_times: list[float]  # when each such chunk arrived (for the abuse window)
    e2e: float
    output_tokens: int


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for (ignore_eos: each runs to max_tokens)."""

    max_tokens: int
    temperature: float


@dataclass
class Load:
    """One closed-loop run: its streams, how long they send, what they measured."""

    prompts: list[str]
    num_streams: int
    max_tokens: int  # each counted request's output
    requests_per_stream: int | None  # counted requests a stream (after its warm-up)
    duration: float | None  # seconds of the window in which counted requests start
    samples: list[Sample] = field(default_factory=list)  # the counted requests
    window_start: float = 0.0  # seconds after the run's start: every stream's warm-up has ended


# Clients ---------------------------------------------------------------------------------------

async def _served_request(http: aiohttp.ClientSession, url: str, sampling: Sampling, prompt: str,
                          origin: float, max_tokens: int | None = None) -> Sample:
    body = {"model": _MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens or sampling.max_tokens,
            "temperature": sampling.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, num_tokens = [], 0
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
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                times.append(time.perf_counter())
    return _sample(start, times, num_tokens, origin)


async def _in_process_request(engine: AsyncLLM, sampling: Sampling, prompt: str, origin: float,
                              max_tokens: int | None = None) -> Sample:
    params = SamplingParams(max_tokens=max_tokens or sampling.max_tokens, temperature=sampling.temperature,
                            ignore_eos=True)
    start = time.perf_counter()
    times, num_tokens = [], 0
    async for delta in engine.generate(prompt, params):
        num_tokens += len(delta.token_ids)
        if delta.text:
            times.append(time.perf_counter())
    return _sample(start, times, num_tokens, origin)


def _sample(start: float, times: list[float], num_tokens: int, origin: float) -> Sample:
    end = times[-1] if times else time.perf_counter()
    return Sample(start - origin, (times[0] if times else end) - start, list(np.diff(times)),
                  [t - origin for t in times], end - start, num_tokens)


async def closed_loop(load: Load, send) -> float:
    """Run load.num_streams streams, each sending `send(prompt, origin)` back to back: its warm-up
    request, then until its count or the window's end. Fills load.samples with the requests that
    started in the window and returns the window's seconds (to the last such request's end)."""
    origin = time.perf_counter()
    num_warm = 0
    warm = asyncio.Event()

    async def stream(index: int) -> None:
        nonlocal num_warm
        sent = 0
        # Warm-ups of 1/N, 2/N, .. N/N of the output: the streams leave them spread over a
        # request's life, as a closed loop's steady state has them (N identical requests sent at
        # once would stay in step: they finish and return together, a burst each time).
        warm_up_tokens = -(-load.max_tokens * (index + 1) // load.num_streams)
        await send(load.prompts[index % len(load.prompts)], origin, warm_up_tokens)
        num_warm += 1
        if num_warm == load.num_streams:
            load.window_start = time.perf_counter() - origin
            warm.set()
        while True:
            if load.requests_per_stream is not None and sent >= load.requests_per_stream:
                return
            if load.duration is not None and warm.is_set() and \
                    time.perf_counter() - origin >= load.window_start + load.duration:
                return
            prompt = load.prompts[(index + (sent + 1) * load.num_streams) % len(load.prompts)]
            sample = await send(prompt, origin)
            if warm.is_set() and sample.start >= load.window_start:
                load.samples.append(sample)
                sent += 1

    await asyncio.gather(*(stream(i) for i in range(load.num_streams)))
    return max((s.start + s.e2e for s in load.samples), default=load.window_start) - load.window_start


def summary(load: Load, seconds: float) -> dict:
    samples = load.samples
    itls = [x for s in samples for x in s.itls]
    tokens = sum(s.output_tokens for s in samples)
    return {"streams": load.num_streams, "num_requests": len(samples), "seconds": seconds,
            "window_start_s": load.window_start,
            "output_tokens": tokens, "output_tokens_per_s": tokens / seconds, "requests_per_s": len(samples) / seconds,
            "ttft_s": _percentiles([s.ttft for s in samples]), "itl_s": _percentiles(itls),
            "e2e_s": _percentiles([s.e2e for s in samples]),
            "ttft_cdf": sorted(s.ttft for s in samples), "itl_cdf": _thinned(sorted(itls)),
            # When the slowest first tokens happened (start of the request, seconds into the run):
            # at the start (compiles), in waves (arrivals queued behind each other), or spread out.
            "ttft_slowest": [(round(s.start, 4), round(s.ttft, 4))
                             for s in sorted(samples, key=lambda s: s.ttft)[-max(1, len(samples) // 100):]]}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def _thinned(values: list[float], size: int = 2000) -> list[float]:
    """At most `size` evenly spaced order statistics (enough for a CDF plot)."""
    if len(values) <= size:
        return values
    return [values[i] for i in np.linspace(0, len(values) - 1, size).astype(int)]


# The server under test --------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def server_process(args: argparse.Namespace):
    """`deltaspec serve` with the benchmark's engine flags on a free port; yields its URL. Its log
    goes to server.log under --out."""
    command = [sys.executable, "-m", "deltaspec.server.cli", "serve", str(args.model), "--port", "0",
               "--served-model-name", _MODEL_NAME, "--max-waiting", str(max(args.streams) * 2 + args.abuse_prompts),
               *_engine_flags(args), *(["--single-process"] if args.single_process else [])]
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    drain = None
    log: list[bytes] = []  # the start-up lines
    try:
        port = None
        while port is None:
            log.append(await asyncio.wait_for(process.stderr.readline(), args.start_timeout))
            line = log[-1].decode()
            if not line:
                raise RuntimeError(f"the server exited before listening: {' '.join(command)}")
            if match := re.search(r"serving .* on http://[^:]+:(\d+)/v1", line):
                port = int(match.group(1))
        drain = asyncio.create_task(process.stderr.read())  # keep the pipe from filling
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.returncode is None:
            process.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), 30)
            if process.returncode is None:
                process.kill()
                await process.wait()
        if drain is not None:  # the server's log (late compiles, warnings) beside the report
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "server.log").write_bytes(b"".join(log) + await drain)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = engine_flags(args) + ["--max-running", str(args.max_running)]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


def _engine(args: argparse.Namespace) -> AsyncLLM:
    return AsyncLLM(config=EngineConfig(model=Path(args.model), max_model_len=args.max_model_len,
                                        max_num_seqs=args.max_running, **engine_options(args)))


# Runs -------------------------------------------------------------------------------------------

async def measure(args: argparse.Namespace, prompts: list[str], send, served: bool) -> list[dict]:
    """One closed-loop run per stream count (each stream's first request its warm-up).
    served: the server is another process, so this process's CPU time is the client's."""
    results = []
    for num_streams in args.streams:
        load = Load(prompts, num_streams, args.max_tokens, args.requests_per_stream, args.duration)
        cpu, wall = time.process_time(), time.perf_counter()
        seconds = await closed_loop(load, send)
        result = summary(load, seconds)
        wall = time.perf_counter() - wall
        result["client_cpu_fraction"] = (time.process_time() - cpu) / wall if served else None
        result["client_bound"] = served and result["client_cpu_fraction"] > _CLIENT_BOUND
        results.append(result)
    return results


async def abuse(args: argparse.Namespace, url: str, http: aiohttp.ClientSession, prompts: list[str], send) -> dict:
    """ITL p99 of the streams without and with big prompts arriving, and /health latency then."""
    num_streams = args.streams[0]
    duration = max(args.duration or 0.0, 4.0)
    load = Load(prompts, num_streams, args.max_tokens, None, duration)
    await closed_loop(load, send)
    calm = _percentiles([x for s in load.samples for x in s.itls])
    load = Load(prompts, num_streams, args.max_tokens, None, duration)
    line = "# " + "x" * 70 + "\n"  # code-like text; the body (JSON escapes each newline) just under the limit
    big = line * ((args.abuse_bytes - 100) // (len(json.dumps(line)) - 2))
    health: list[float] = []
    statuses: list[int] = []
    fired: list[float] = []

    async def fire(origin: float) -> None:
        await asyncio.sleep(duration / 4)
        fired.append(time.perf_counter() - origin)

        async def one() -> None:
            body = {"model": _MODEL_NAME, "prompt": big, "max_tokens": 4}
            async with http.post(f"{url}/v1/completions", json=body) as response:
                statuses.append(response.status)
                await response.read()

        await asyncio.gather(*(one() for _ in range(args.abuse_prompts)))
        fired.append(time.perf_counter() - origin)

    async def poll() -> None:
        while True:
            started = time.perf_counter()
            async with http.get(f"{url}/health") as response:
                await response.read()
            health.append(time.perf_counter() - started)
            await asyncio.sleep(_HEALTH_PERIOD)

    origin = time.perf_counter()
    polling = asyncio.create_task(poll())  # through the whole run
    await asyncio.gather(fire(origin), closed_loop(load, send))
    polling.cancel()
    # The gaps that ended while the big prompts were in flight (sent until answered), and 1 s after.
    start, end = fired[0], fired[-1] + 1.0
    window = [gap for s in load.samples for gap, t in zip(s.itls, s.token_times[1:]) if start <= t <= end]
    abused = _percentiles(window)
    return {"streams": num_streams, "duration_s": duration, "abuse_prompts": args.abuse_prompts,
            "abuse_bytes": len(big), "abuse_statuses": sorted(statuses), "abuse_window_s": [start, end],
            "itl_p99_without_s": calm["p99"], "itl_p99_with_s": abused["p99"],
            "itl_p99_ratio": abused["p99"] / calm["p99"] if abused["p99"] and calm["p99"] else None,
            "health_s": {**_percentiles(health), "max": max(health) if health else None, "count": len(health)}}


async def benchmark(args: argparse.Namespace) -> dict:
    prompts = load_prompts(Path(args.model), args.prompts, args.num_prompts, args.max_prompt_chars, args.seed)
    report: dict = {}
    sampling = Sampling(args.max_tokens, args.temperature)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    freeze_startup_heap()  # the client's own collections would show as latency spikes
    async with contextlib.AsyncExitStack() as stack:
        url = args.url or await stack.enter_async_context(server_process(args))
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout, connector=connector))
        send = functools.partial(_served_request, http, url, sampling)
        report["served"] = await measure(args, prompts, send, served=args.url is None)
        if args.abuse:
            report["abuse"] = await abuse(args, url, http, prompts, send)
    if not args.no_in_process:
        engine = _engine(args)
        freeze_startup_heap()  # as `deltaspec serve` does after building its engine
        try:
            report["in_process"] = await measure(args, prompts, functools.partial(_in_process_request, engine,
                                                                                  sampling), served=False)
        finally:
            await engine.shutdown()
        report["served_over_in_process"] = [
            {"streams": s["streams"], "output_tokens_per_s": s["output_tokens_per_s"] / i["output_tokens_per_s"]}
            for s, i in zip(report["served"], report["in_process"])]
    return report


# Output -----------------------------------------------------------------------------------------

def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(15, 4))
    for mode in ("served", "in_process"):
        for result in report.get(mode, []):
            label = f"{mode} {result['streams']} streams"
            for axis, key in ((ttft, "ttft_cdf"), (itl, "itl_cdf")):
                values = np.asarray(result[key]) * 1e3
                if len(values):
                    axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        results = report.get(mode, [])
        rate.plot([r["streams"] for r in results], [r["output_tokens_per_s"] for r in results], marker="o",
                  label=mode)
    ttft.set(title="time to first token", xlabel="ms", ylabel="fraction of requests")
    itl.set(title="inter-token latency", xlabel="ms", ylabel="fraction of gaps", xscale="log")
    rate.set(title="output tokens/s", xlabel="concurrent streams", ylabel="tokens/s", xscale="log")
    for axis in (ttft, itl, rate):
        axis.legend(fontsize=7)
    figure.suptitle(f"deltaspec bench serve — {report['device']}, {report['commit'][:10]}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser, default_model: Path) -> None:
    parser.add_argument("--model", default=str(default_model))
    parser.add_argument("--url", default=None, help="benchmark this server instead of starting one")
    add_engine_options(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-running", type=int, default=64, help="requests decoding at once (the server's)")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64], help="concurrent streams, one run each")
    parser.add_argument("--requests-per-stream", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="seconds each run lasts (default: 4 requests "
                                                                      "a stream)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", nargs="*", default=[], help="code files or a JSONL of {\"prompt\": ...}")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-prompt-chars", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process AsyncLLM run")
    parser.add_argument("--single-process", action="store_true",
                        help="start the server with its engine on its own event loop (`deltaspec serve "
                             "--single-process`) instead of in a process of its own")
    parser.add_argument("--abuse", action="store_true",
                        help="also: ITL p99 and /health latency with big prompts arriving mid-run")
    parser.add_argument("--abuse-prompts", type=int, default=8)
    parser.add_argument("--abuse-bytes", type=int, default=(1 << 20) - 4096, help="each big prompt's size")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte from a stream")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.requests_per_stream is None and args.duration is None:
        args.requests_per_stream = 4
    if args.requests_per_stream is not None and args.duration is not None:
        raise ValueError("pass --requests-per-stream or --duration, not both")
    device = device_name(args.device)  # before the run: a mistake here costs nothing yet
    measured = run(benchmark(args))
    report = {"benchmark": "serve", "model": str(args.model), "device": device,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": os.environ.get("DELTASPEC_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "command": "deltaspec bench serve " + " ".join(argv), "url": args.url,
              "server": None if args.url else "single process" if args.single_process else "engine process",
              "max_tokens": args.max_tokens, "temperature": args.temperature,
              "requests_per_stream": args.requests_per_stream, "duration_s": args.duration,
              "timing": "closed loop: each stream sends its next request when the last ends; its first request "
                        "is its warm-up, stream i's of (i + 1) / N of the output; counted: the requests that "
                        "start once every warm-up has ended",
              **measured}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve-" + device_tag(device)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"{name}.png")
    for mode in ("served", "in_process"):
        for r in report.get(mode, []):
            print(f"{mode:10s} {r['streams']:4d} streams: {r['output_tokens_per_s']:9.1f} tok/s "
                  f"{r['requests_per_s']:6.2f} req/s  TTFT p50/p99 {_ms(r['ttft_s']['p50'])}/{_ms(r['ttft_s']['p99'])}"
                  f"  ITL p50/p99 {_ms(r['itl_s']['p50'])}/{_ms(r['itl_s']['p99'])} ms"
                  + ("  (client-bound)" if r["client_bound"] else ""))
    for ratio in report.get("served_over_in_process", []):
        print(f"served / in-process at {ratio['streams']} streams: {ratio['output_tokens_per_s']:.2f}")
    if "abuse" in report:
        a = report["abuse"]
        print(f"abuse: ITL p99 {_ms(a['itl_p99_without_s'])} -> {_ms(a['itl_p99_with_s'])} ms, "
              f"/health max {_ms(a['health_s']['max'])} ms")
    print(f"wrote {args.out / name}.{{json,png}}")
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
