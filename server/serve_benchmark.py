"""`deltaspec bench serve`: load on the OpenAI server from client processes of its own, and the
same load on AsyncLLM in-process, in one run.

Runs: one closed loop per `--streams` count N (N streams send streamed /v1/completions back to
back: the next request as soon as the last one ends), for `--requests-per-stream` requests each
or `--duration` seconds; then one open loop per `--request-rate` R (requests sent at their arrival
times whatever the answers: Poisson at R/s, gamma gaps with `--burstiness`, or `--constant-rate`),
`--num-requests` of them or as many as arrive in `--duration` seconds. Every request records its
time to first token (TTFT), the gaps between the chunks that carry tokens (inter-token latency,
ITL), its end-to-end latency, and its prompt and output tokens (usage).

Closed-loop timing: each stream's first request is its warm-up, stream i's asking for (i + 1) / N
of the output, and the measured window opens when the last of them, in any client process, has
ended: the streams, which all started at once, are then spread over a request's life, as a closed
loop's clients are in its steady state; only requests that start in the window count (N identical
requests sent at once would stay in step, arriving together again each time, their prompts queued
behind each other's prefill). Tokens/s = the counted requests' output tokens / (the last one's
end - the window's start): requests under way when the window opens are not counted, which
understates it by up to one request a stream, both ways alike. An open loop counts every request,
its window opening at the first arrival.

The client (load_generator.py): `--client-processes` processes (default one per 32 streams or
requests/s), each with its own event loop and HTTP session running its share of the streams or
arrivals; each reports its CPU seconds per wall second, and a run where any is above 90% says
`client_bound` (the client, not the server, may be the limit). This process starts the server
(`deltaspec serve` with the same engine flags, its engine in a process of its own, or on the
server's loop with `--single-process`) or targets the one at `--url`, scrapes its /metrics before
and after each run (the counters' deltas, the gauges after; `server_timings`: steps by kind, GC
pauses, each server process's CPU share; `host_load`: this host's busy CPUs and steal over the
run, whether other work shared the machine), and stops it before the in-process
engine is built. Then the same runs, prompts and sampling go through `AsyncLLM.generate` on this
process's loop with no HTTP, so the report holds the served / in-process ratio of output tokens/s.

Prompts (`prompt_set` in the report): the held-out code prompts of the acceptance benchmark, code
files or a JSONL (cycled: repeated prompts hit the prefix cache; `--unique-prompts` gives each
request a distinct first line, so its prefill is measured cold); or `--input-len` random token ids
a request (`--input-len-range` spreads the lengths), sent as token-id lists, none sharing a prefix.
`--max-tokens-range` spreads the output lengths likewise (each request runs to its own max_tokens).
`--goodput ttft:MS itl:MS e2e:MS` (any subset) adds each run's rate of requests that met every
target (itl: the request's mean time per output token after the first).

`--abuse`: the issue's bar under abuse. The first stream count's streams run twice for
`--duration` seconds (at least 4): without, then with `--abuse-prompts` prompts of `--abuse-bytes`
(about 1 MiB: under the body limit, far over the context) fired from this process at a quarter of
the run, while /health is polled every 20 ms; reports ITL p99 of each run (the abused one over the
gaps after the prompts were sent) and /health's latency.

Writes serve-<device>.json and .png (latency CDFs, tokens/s by run, goodput when asked) under
--out with device, date, commit and command. Knows the server only through HTTP and the engine
only through AsyncLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import math
import multiprocessing
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from ..engine import AsyncLLM, EngineConfig, SamplingParams
from ..engine.async_llm import freeze_startup_heap, run
from ..engine.engine_config import concrete_device
from ..engine.model_source import resolve_model
from .acceptance_benchmark import device_name, device_tag, load_prompts
from .engine_args import add_engine_options, engine_flags, engine_options
from .load_generator import (MODEL_NAME, ClientProcesses, Load, Measured, Prompt, PromptSet, Sample, Sampling,
                             Window, arrival_times, drive, http_session, sample)

_CLIENT_BOUND = 0.9  # client CPU seconds per wall second above which the client may be the limit
_STREAMS_PER_CLIENT = 32  # default client processes: one per 32 streams (or requests/s)
_HEALTH_PERIOD = 0.02
GOODPUT_METRICS = ("ttft", "itl", "e2e")


async def _in_process_request(engine: AsyncLLM, sampling: Sampling, prompt: Prompt, origin: float,
                              max_tokens: int | None = None) -> Sample:
    params = SamplingParams(max_tokens=max_tokens or sampling.max_tokens, temperature=sampling.temperature,
                            ignore_eos=True)
    start = time.perf_counter()
    times, num_tokens = [], 0
    async for delta in engine.generate(prompt, params):
        num_tokens += len(delta.token_ids)
        if delta.text:
            times.append(time.perf_counter())
    return sample(start, times, num_tokens, origin, len(prompt) if isinstance(prompt, list) else None)


# Loads and prompts ------------------------------------------------------------------------------

def loads(args: argparse.Namespace) -> list[Load]:
    """The runs: one closed loop per stream count, then one open loop per request rate."""
    closed = [Load(f"streams{n}", args.max_tokens, num_streams=n, requests_per_stream=args.requests_per_stream,
                   duration=args.duration, max_tokens_range=args.max_tokens_range) for n in args.streams]
    opened = [Load(f"rate{rate:g}", args.max_tokens, request_rate=rate,
                   arrivals=arrival_times(rate, args.num_requests, args.duration, args.burstiness,
                                          args.constant_rate, args.seed + i), max_tokens_range=args.max_tokens_range)
              for i, rate in enumerate(args.request_rate)]
    return closed + opened


def prompt_set(args: argparse.Namespace) -> PromptSet:
    """Random token ids with --input-len, else the code prompts (files, a JSONL, or the model's
    held-out code). The nonce keys unique prompts: none hits a cache entry of this benchmark's
    other requests, nor of an earlier benchmark on the same server."""
    nonce = secrets.token_hex(4)
    if args.input_len is not None:
        from tokenizers import Tokenizer

        # Ordinary tokens only: the added ones are the model's specials (chat markers, EOS).
        vocab_size = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")).get_vocab_size(
            with_added_tokens=False)
        return PromptSet("synthetic", input_len=args.input_len, input_len_range=args.input_len_range,
                         vocab_size=vocab_size, nonce=nonce)
    texts = load_prompts(Path(args.model), args.prompts, args.num_prompts, args.max_prompt_chars, args.seed)
    name = "held-out code" if not args.prompts else \
        "jsonl" if all(s.endswith(".jsonl") for s in args.prompts) else "code files"
    return PromptSet(name, tuple(texts), unique=args.unique_prompts, nonce=nonce)


# Results ----------------------------------------------------------------------------------------

def summary(load: Load, measured: Measured, goodput_targets: dict[str, float]) -> dict:
    """Throughput over the window (its opening to the last counted request's end), latency
    percentiles and CDFs, goodput under the targets (when any)."""
    samples = measured.samples
    end = max((s.start + s.e2e for s in samples), default=measured.window_start)
    seconds = end - measured.window_start
    itls = [x for s in samples for x in s.itls]
    tokens = sum(s.output_tokens for s in samples)
    prompt_tokens = [s.prompt_tokens for s in samples]
    starts = [s.start for s in samples]
    result = {
        "streams": load.num_streams, "request_rate": load.request_rate,
        "num_requests": len(samples), "seconds": seconds, "window_start_s": measured.window_start,
        "output_tokens": tokens, "prompt_tokens": None if None in prompt_tokens else sum(prompt_tokens),
        "output_tokens_per_s": _per(tokens, seconds), "requests_per_s": _per(len(samples), seconds),
        # Open loop: the rate the requests were sent at (their count - 1 over the first to last send).
        "achieved_request_rate": None if load.closed or len(samples) < 2 else
        (len(samples) - 1) / (max(starts) - min(starts)),
        "ttft_s": percentiles([s.ttft for s in samples]), "itl_s": percentiles(itls),
        "e2e_s": percentiles([s.e2e for s in samples]),
        "ttft_cdf": sorted(s.ttft for s in samples), "itl_cdf": _thinned(sorted(itls)),
        # When the slowest first tokens happened (start of the request, seconds into the run):
        # at the start (compiles), in waves (arrivals queued behind each other), or spread out.
        "ttft_slowest": [(round(s.start, 4), round(s.ttft, 4))
                         for s in sorted(samples, key=lambda s: s.ttft)[-max(1, len(samples) // 100):]]}
    if goodput_targets:
        result["goodput"] = goodput(samples, seconds, goodput_targets)
    return result


def goodput(samples: list[Sample], seconds: float, targets: dict[str, float]) -> dict:
    """Requests/s and output tokens/s of the requests that met every target (seconds) — vLLM's
    goodput. ttft: time to first token; itl: the request's mean time per output token after the
    first, (e2e - ttft) / (output tokens - 1) (vLLM's TPOT; one chunk may carry several
    speculated tokens, so a single gap is not a token's latency); e2e: end-to-end latency."""
    good = [s for s in samples if all(_latency(s, metric) <= target for metric, target in targets.items())]
    return {"targets_ms": {metric: target * 1e3 for metric, target in targets.items()},
            "num_requests": len(good), "fraction": len(good) / len(samples) if samples else None,
            "requests_per_s": _per(len(good), seconds),
            "output_tokens_per_s": _per(sum(s.output_tokens for s in good), seconds)}


def _latency(s: Sample, metric: str) -> float:
    if metric == "ttft":
        return s.ttft
    if metric == "e2e":
        return s.e2e
    return (s.e2e - s.ttft) / (s.output_tokens - 1) if s.output_tokens > 1 else 0.0


def parse_goodput_target(text: str) -> tuple[str, float]:
    """`ttft:200` -> ("ttft", 0.2): a metric and its target in milliseconds."""
    metric, _, value = text.partition(":")
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if metric not in GOODPUT_METRICS or not milliseconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected METRIC:MS with METRIC one of "
                                         f"{', '.join(GOODPUT_METRICS)} and MS > 0")
    return metric, milliseconds / 1e3


def _per(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def _thinned(values: list[float], size: int = 2000) -> list[float]:
    """At most `size` evenly spaced order statistics (enough for a CDF plot)."""
    if len(values) <= size:
        return values
    return [values[i] for i in np.linspace(0, len(values) - 1, size).astype(int)]


# The server's own metrics -----------------------------------------------------------------------

async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, tuple[str, float]]:
    """/metrics as {sample: (its family's type, value)}, a sample named with its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{url}/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    return {_sample_name(s.name, s.labels): (family.type, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sample_name(name: str, labels: dict[str, str]) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")


def metrics_delta(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict:
    """What the server counted over a run (warm-ups included): the change of every counter and of
    every histogram sample (buckets, sum, count: e.g. how many garbage collections paused a
    process past 20 ms); the gauges as the run left them; the drafts accepted over the run
    (accepted / proposed, every position)."""
    counters = {name: value - before.get(name, ("", 0.0))[1] for name, (kind, value) in after.items()
                if kind in ("counter", "histogram")}
    drafts = [sum(v for name, v in counters.items() if name.startswith(prefix))
              for prefix in ("deltaspec_spec_accepted_tokens_total", "deltaspec_spec_draft_tokens_total")]
    return {"counters": counters,
            "gauges": {name: value for name, (kind, value) in after.items() if kind == "gauge"},
            "spec_acceptance_rate": drafts[0] / drafts[1] if drafts[1] else None}


STEP_WITHIN = 0.005  # a step this long or shorter is counted as quick
PAUSE_PAST = 0.02    # a collection longer than this is counted as a stall


def server_timings(counters: dict[str, float], seconds: float) -> dict:
    """From a run's metric deltas (`metrics_delta`) over `seconds` of wall time between its two
    scrapes: the engine's steps by kind (how many, their mean, the share within STEP_WITHIN),
    the garbage collector's pauses past PAUSE_PAST by process and each process's CPU time over
    the wall time (1.0: a process busy throughout, its loop the limit); empty parts where the
    server exports none (an older server, `--url`)."""
    steps = {}
    for kind in ("decode", "admit"):
        count = counters.get(f'deltaspec_step_seconds_count{{kind="{kind}"}}')
        if count:
            quick = counters.get(f'deltaspec_step_seconds_bucket{{kind="{kind}",le="{STEP_WITHIN!r}"}}', 0.0)
            steps[kind] = {"count": count, "mean_s": counters[f'deltaspec_step_seconds_sum{{kind="{kind}"}}'] / count,
                           "share_within": quick / count}
    stalls: dict[str, float] = {}
    for name, value in counters.items():
        match = re.fullmatch(r'deltaspec_gc_pause_seconds_count\{generation="(\d)",process="(\w+)"\}', name)
        if match:
            generation, process = match.groups()
            within = counters.get(f'deltaspec_gc_pause_seconds_bucket{{generation="{generation}",'
                                  f'le="{PAUSE_PAST!r}",process="{process}"}}', 0.0)
            stalls[process] = stalls.get(process, 0.0) + value - within
    cpu = {}
    for name, value in counters.items():
        match = re.fullmatch(r'deltaspec_process_cpu_seconds_total\{process="(\w+)"\}', name)
        if match:
            cpu[match.group(1)] = value / seconds
    return {"steps": steps, "step_within_s": STEP_WITHIN, "gc_pauses_past": stalls, "gc_pause_past_s": PAUSE_PAST,
            "cpu_fraction": cpu}


def host_cpu_times() -> tuple[float, ...] | None:
    """This host's CPU times from /proc/stat (user, nice, system, idle, iowait, irq, softirq,
    steal, in clock ticks, all CPUs together), or None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return tuple(float(v) for v in fields[1:9]) if fields and fields[0] == "cpu" else None


def host_load(before: tuple[float, ...] | None, after: tuple[float, ...] | None, seconds: float) -> dict | None:
    """Between two host_cpu_times: the CPUs kept busy on average (all but idle, iowait and steal
    time; the benchmark's own processes included) and the share of CPU time a hypervisor gave to
    others (steal): whether a slow run shared its host with other work."""
    if before is None or after is None:
        return None
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta)
    if total <= 0:
        return None
    busy = total - delta[3] - delta[4] - delta[7]
    return {"busy_cpus": busy / os.sysconf("SC_CLK_TCK") / seconds, "steal_share": delta[7] / total}


# The server under test --------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def server_process(args: argparse.Namespace, max_waiting: int):
    """`deltaspec serve` with the benchmark's engine flags on a free port; yields its URL. Its log
    goes to server.log under --out."""
    command = [sys.executable, "-m", "deltaspec.server.cli", "serve", str(args.model), "--port", "0",
               "--served-model-name", MODEL_NAME, "--max-waiting", str(max_waiting),
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


def _max_waiting(args: argparse.Namespace, runs: list[Load]) -> int:
    """Room for every request a run can have queued: twice the streams (a closed loop), every
    request of an open loop (it does not wait for answers), and the abuse prompts."""
    return max(2 * load.num_streams if load.closed else len(load.arrivals) for load in runs) + args.abuse_prompts


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = engine_flags(args) + ["--max-running", str(args.max_running)]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


def _engine(args: argparse.Namespace) -> AsyncLLM:
    return AsyncLLM(config=EngineConfig(model=Path(args.model), max_model_len=args.max_model_len,
                                        max_num_seqs=args.max_running, **engine_options(args)))


def _client_processes(args: argparse.Namespace) -> int:
    if args.client_processes is not None:
        return args.client_processes
    return max(1, math.ceil(max([*args.streams, *args.request_rate]) / _STREAMS_PER_CLIENT))


# Runs -------------------------------------------------------------------------------------------

async def measure_served(runs: list[Load], clients: ClientProcesses, http: aiohttp.ClientSession, url: str,
                         goodput_targets: dict[str, float]) -> list[dict]:
    """Each run from the client processes, the server's /metrics scraped before and after it."""
    results = []
    for load in runs:
        host_before, before = host_cpu_times(), await scrape(http, url)
        start = time.perf_counter()
        measured = await clients.run(load)
        after = await scrape(http, url)
        seconds, host_after = time.perf_counter() - start, host_cpu_times()
        result = summary(load, measured, goodput_targets)
        result["client_processes"] = len(clients)
        result["client_cpu_fractions"] = measured.client_cpu_fractions
        result["client_cpu_fraction"] = max(measured.client_cpu_fractions)
        result["client_bound"] = result["client_cpu_fraction"] > _CLIENT_BOUND
        result["server_metrics"] = metrics_delta(before, after)
        result["server_timings"] = server_timings(result["server_metrics"]["counters"], seconds)
        result["host_load"] = host_load(host_before, host_after, seconds)
        results.append(result)
    return results


async def measure_in_process(runs: list[Load], engine: AsyncLLM, prompts: PromptSet, sampling: Sampling,
                             goodput_targets: dict[str, float]) -> list[dict]:
    """Each run on this process's loop, through AsyncLLM.generate (no HTTP, no client process)."""
    window = Window(multiprocessing.get_context("spawn"))
    send = functools.partial(_in_process_request, engine, sampling)
    results = []
    for load in runs:
        window.reset()
        samples = await drive(load, load.share(0, 1), prompts, window, send, time.perf_counter())
        measured = Measured(sorted(samples, key=lambda s: s.start), window.start if load.closed else 0.0)
        results.append({**summary(load, measured, goodput_targets), "client_processes": None,
                        "client_cpu_fraction": None, "client_bound": False})
    return results


async def abuse(args: argparse.Namespace, url: str, http: aiohttp.ClientSession, clients: ClientProcesses) -> dict:
    """ITL p99 of the streams (from the client processes) without and with big prompts arriving
    (from this process, which also polls /health), and /health's latency meanwhile."""
    num_streams = args.streams[0]
    duration = max(args.duration or 0.0, 4.0)
    calm = await clients.run(Load("abuse-calm", args.max_tokens, num_streams=num_streams, duration=duration))
    calm_itl = percentiles([x for s in calm.samples for x in s.itls])
    line = "# " + "x" * 70 + "\n"  # code-like text; the body (JSON escapes each newline) just under the limit
    big = line * ((args.abuse_bytes - 100) // (len(json.dumps(line)) - 2))
    health: list[float] = []
    statuses: list[int] = []
    fired: list[float] = []
    started = asyncio.get_running_loop().create_future()  # the run's origin

    async def fire() -> None:
        origin = await started
        await asyncio.sleep(origin + duration / 4 - time.perf_counter())
        fired.append(time.perf_counter() - origin)

        async def one() -> None:
            body = {"model": MODEL_NAME, "prompt": big, "max_tokens": 4}
            async with http.post(f"{url}/v1/completions", json=body) as response:
                statuses.append(response.status)
                await response.read()

        await asyncio.gather(*(one() for _ in range(args.abuse_prompts)))
        fired.append(time.perf_counter() - origin)

    async def poll() -> None:
        while True:
            begun = time.perf_counter()
            async with http.get(f"{url}/health") as response:
                await response.read()
            health.append(time.perf_counter() - begun)
            await asyncio.sleep(_HEALTH_PERIOD)

    polling = asyncio.create_task(poll())  # through the whole run
    abused_load = Load("abuse", args.max_tokens, num_streams=num_streams, duration=duration)
    _, abused = await asyncio.gather(fire(), clients.run(abused_load, on_start=started.set_result))
    polling.cancel()
    # The gaps that ended while the big prompts were in flight (sent until answered), and 1 s after.
    start, end = fired[0], fired[-1] + 1.0
    window = [gap for s in abused.samples for gap, t in zip(s.itls, s.token_times[1:]) if start <= t <= end]
    abused_itl = percentiles(window)
    return {"streams": num_streams, "duration_s": duration, "abuse_prompts": args.abuse_prompts,
            "abuse_bytes": len(big), "abuse_statuses": sorted(statuses), "abuse_window_s": [start, end],
            "itl_p99_without_s": calm_itl["p99"], "itl_p99_with_s": abused_itl["p99"],
            "itl_p99_ratio": abused_itl["p99"] / calm_itl["p99"] if abused_itl["p99"] and calm_itl["p99"] else None,
            "health_s": {**percentiles(health), "max": max(health) if health else None, "count": len(health)}}


async def benchmark(args: argparse.Namespace) -> dict:
    prompts = prompt_set(args)
    runs = loads(args)
    report: dict = {"prompt_set": prompts.describe()}
    sampling = Sampling(args.max_tokens, args.temperature)
    goodput_targets = dict(args.goodput)
    freeze_startup_heap()  # the coordinator's own collections would delay /health polls and arrivals
    async with contextlib.AsyncExitStack() as stack:
        url = args.url or await stack.enter_async_context(server_process(args, _max_waiting(args, runs)))
        http = await stack.enter_async_context(http_session(args.request_timeout))
        clients = ClientProcesses(_client_processes(args), url, args.request_timeout, sampling, prompts)
        stack.callback(clients.close)
        report["served"] = await measure_served(runs, clients, http, url, goodput_targets)
        if args.abuse:
            report["abuse"] = await abuse(args, url, http, clients)
    if not args.no_in_process:
        engine = _engine(args)
        freeze_startup_heap()  # as `deltaspec serve` does after building its engine
        try:
            report["in_process"] = await measure_in_process(runs, engine, prompts, sampling, goodput_targets)
        finally:
            await engine.shutdown()
        report["served_over_in_process"] = [
            {"streams": s["streams"], "request_rate": s["request_rate"],
             "output_tokens_per_s": _per(s["output_tokens_per_s"], i["output_tokens_per_s"])}
            for s, i in zip(report["served"], report["in_process"])]
    return report


# Output -----------------------------------------------------------------------------------------

def _run_name(result: dict) -> str:
    return f"{result['streams']} streams" if result["streams"] is not None else f"{result['request_rate']:g} req/s"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_goodput = any("goodput" in r for r in report.get("served", []))
    figure, axes = plt.subplots(1, 4 if with_goodput else 3, figsize=(20 if with_goodput else 15, 4))
    ttft, itl, rate = axes[:3]
    for mode in ("served", "in_process"):
        results = report.get(mode, [])
        for result in results:
            label = f"{mode} {_run_name(result)}"
            for axis, key in ((ttft, "ttft_cdf"), (itl, "itl_cdf")):
                values = np.asarray(result[key]) * 1e3
                if len(values):
                    axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        names = [_run_name(r) for r in results]
        rate.plot(names, [r["output_tokens_per_s"] for r in results], marker="o", label=mode)
        if with_goodput:
            axes[3].plot(names, [r["goodput"]["requests_per_s"] for r in results], marker="o",
                         label=f"{mode} goodput")
            axes[3].plot(names, [r["requests_per_s"] for r in results], marker="x", linestyle=":",
                         label=f"{mode} all requests")
    ttft.set(title="time to first token", xlabel="ms", ylabel="fraction of requests")
    itl.set(title="inter-token latency", xlabel="ms", ylabel="fraction of gaps", xscale="log")
    rate.set(title="output tokens/s", xlabel="run", ylabel="tokens/s")
    if with_goodput:
        targets = report["served"][0]["goodput"]["targets_ms"]
        axes[3].set(xlabel="run", ylabel="requests/s")
        axes[3].set_title("goodput: " + ", ".join(f"{k} <= {v:g} ms" for k, v in targets.items()), fontsize=9)
    for axis in axes:
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
    parser.add_argument("--streams", type=int, nargs="+", default=None,
                        help="closed loop: concurrent streams, one run each (default 16 64 without --request-rate)")
    parser.add_argument("--requests-per-stream", type=int, default=None)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[],
                        help="open loop: requests/s, one run each (after the closed-loop runs)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="open loop: the gamma shape of the gaps between arrivals (1: Poisson; below: burstier)")
    parser.add_argument("--constant-rate", action="store_true", help="open loop: a gap of exactly 1 / rate")
    parser.add_argument("--num-requests", type=int, default=None, help="open loop: requests a run")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds each run lasts (closed loop default: 4 requests a stream)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", nargs="*", default=[], help="code files or a JSONL of {\"prompt\": ...}")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-prompt-chars", type=int, default=2000)
    parser.add_argument("--unique-prompts", action="store_true",
                        help="code prompts: a distinct first line per request (its prefill measured cold)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="synthetic prompts: random token ids, this many (each request its own)")
    parser.add_argument("--input-len-range", type=float, default=0.0,
                        help="synthetic prompts: lengths uniform in input-len * (1 +- this)")
    parser.add_argument("--max-tokens-range", type=float, default=0.0,
                        help="each request's max_tokens uniform in max-tokens * (1 +- this): varied output "
                             "lengths, as real traffic has (0: all equal, closed-loop streams then finish in step)")
    parser.add_argument("--goodput", type=parse_goodput_target, nargs="+", default=[], metavar="METRIC:MS",
                        help="latency targets (ttft, itl: mean per output token, e2e): also report the rate of "
                             "requests that met them all")
    parser.add_argument("--client-processes", type=int, default=None,
                        help=f"load generator processes (default: one per {_STREAMS_PER_CLIENT} streams or "
                             "requests/s, at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process AsyncLLM run")
    parser.add_argument("--single-process", action="store_true",
                        help="start the server with its engine on its own event loop (`deltaspec serve "
                             "--single-process`) instead of in a process of its own")
    parser.add_argument("--abuse", action="store_true",
                        help="also: ITL p99 and /health latency with big prompts arriving mid-run (at the first "
                             "--streams count)")
    parser.add_argument("--abuse-prompts", type=int, default=8)
    parser.add_argument("--abuse-bytes", type=int, default=(1 << 20) - 4096, help="each big prompt's size")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte from a stream")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def _check(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on other flags; refuse combinations that mean nothing."""
    if args.streams is None:
        args.streams = [] if args.request_rate else [16, 64]
    if args.streams and args.requests_per_stream is None and args.duration is None:
        args.requests_per_stream = 4
    if args.requests_per_stream is not None and args.duration is not None:
        raise ValueError("pass --requests-per-stream or --duration, not both")
    if args.request_rate and (args.num_requests is None) == (args.duration is None):
        raise ValueError("--request-rate needs --num-requests or --duration (one of them)")
    if args.abuse and not args.streams:
        raise ValueError("--abuse runs closed-loop streams: pass --streams")
    if args.input_len is not None and args.prompts:
        raise ValueError("pass --input-len (synthetic prompts) or --prompts, not both")
    if not 0 <= args.input_len_range < 1:
        raise ValueError("--input-len-range must be in [0, 1)")
    if not 0 <= args.max_tokens_range < 1:
        raise ValueError("--max-tokens-range must be in [0, 1)")
    if args.client_processes is not None and args.client_processes < 1:
        raise ValueError("--client-processes must be >= 1")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    _check(args)
    args.device = concrete_device(args.device or "auto")
    device = device_name(args.device)  # before the run: a mistake here costs nothing yet
    # A Hub repo id: downloaded once; the prompts, the server and the in-process engine read the copy.
    args.model = str(resolve_model(args.model, args.revision, args.download_dir))
    args.revision = args.download_dir = None
    measured = run(benchmark(args))
    report = {"benchmark": "serve", "model": str(args.model), "device": device,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": os.environ.get("DELTASPEC_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "command": "deltaspec bench serve " + " ".join(argv), "url": args.url,
              "server": None if args.url else "single process" if args.single_process else "engine process",
              "max_tokens": args.max_tokens, "max_tokens_range": args.max_tokens_range,
              "temperature": args.temperature,
              "requests_per_stream": args.requests_per_stream, "duration_s": args.duration,
              "num_requests": args.num_requests,
              "arrivals": None if not args.request_rate else "constant" if args.constant_rate else
              "poisson" if args.burstiness == 1 else f"gamma (burstiness {args.burstiness:g})",
              "timing": "closed loop: each stream sends its next request when the last ends; its first request "
                        "is its warm-up, stream i's of (i + 1) / N of the output; counted: the requests that "
                        "start once every warm-up (in every client process) has ended. Open loop: every request "
                        "sent at its arrival time, all counted, the window from the first arrival",
              **measured}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve-" + device_tag(device)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"{name}.png")
    for mode in ("served", "in_process"):
        for r in report.get(mode, []):
            print(f"{mode:10s} {_run_name(r):>12s}: {r['output_tokens_per_s']:9.1f} tok/s "
                  f"{r['requests_per_s']:6.2f} req/s  TTFT p50/p99 {_ms(r['ttft_s']['p50'])}/{_ms(r['ttft_s']['p99'])}"
                  f"  ITL p50/p99 {_ms(r['itl_s']['p50'])}/{_ms(r['itl_s']['p99'])} ms"
                  + (f"  goodput {r['goodput']['requests_per_s']:.2f} req/s" if "goodput" in r else "")
                  + ("  (client-bound)" if r["client_bound"] else ""))
    for r in report.get("served", []):
        timings = r.get("server_timings") or {}
        if timings.get("steps") or timings.get("gc_pauses_past"):
            steps = ", ".join(f"{kind} {t['count']:.0f} (mean {t['mean_s'] * 1e3:.2f} ms, "
                              f"{t['share_within']:.0%} <= {STEP_WITHIN * 1e3:g} ms)"
                              for kind, t in timings["steps"].items())
            pauses = ", ".join(f"{process} {n:.0f}" for process, n in timings["gc_pauses_past"].items())
            cpu = ", ".join(f"{process} {share:.0%}" for process, share in timings.get("cpu_fraction", {}).items())
            host = r.get("host_load")
            print(f"server {_run_name(r):>12s}: steps {steps}; GC pauses > {PAUSE_PAST * 1e3:g} ms: {pauses}"
                  + (f"; CPU {cpu}" if cpu else "")
                  + (f"; host {host['busy_cpus']:.1f} CPUs busy, steal {host['steal_share']:.1%}" if host else ""))
    for ratio in report.get("served_over_in_process", []):
        print(f"served / in-process at {_run_name(ratio)}: {ratio['output_tokens_per_s']:.2f}")
    if "abuse" in report:
        a = report["abuse"]
        print(f"abuse: ITL p99 {_ms(a['itl_p99_without_s'])} -> {_ms(a['itl_p99_with_s'])} ms, "
              f"/health max {_ms(a['health_s']['max'])} ms")
    print(f"wrote {args.out / name}.{{json,png}}")
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
