"""Measurement helpers shared by the GPU benchmarks (run as scripts from the repo root, so
`from common import ...` resolves to this file)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import triton

from deltaspec.server.acceptance_benchmark import device_tag  # noqa: F401  (the results' device naming)


def timed(function: Callable, record: Callable[[float], None]) -> Callable:
    """`function` wrapped to hand its wall seconds to `record` after each call (raised or not):
    the host-time splits wrap engine methods with it (setattr on their class or module)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    return wrapper


def closed_loop(core, send: Callable[[], None], steps: int):
    """`steps` steps of an EngineCore (dispatch, wait, commit), each request that finishes
    replaced at once by `send()`, as a closed-loop client does (`deltaspec bench serve`'s
    streams). Yields each step's plan, its host seconds (dispatch to the end of its commit) and
    the requests it finished."""
    for _ in range(steps):
        start = time.perf_counter()
        step = core.dispatch()
        deltas = core.commit(step.plan, step.wait())
        seconds = time.perf_counter() - start
        finished = sum(delta.finish_reason is not None for delta in deltas)
        for _ in range(finished):
            send()
        yield step.plan, seconds, finished


def free_port() -> int:
    """A TCP port free on this host now (a store's or a server's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def random_model(config, device: str, dtype: torch.dtype):
    """A HybridLM with its MTP layer and random weights at the scales a trained model has
    (engine/weights.py `random_model`; block-FP8 configs get e4m3 weights drawn in place): what
    the benchmarks time."""
    from deltaspec.engine.weights import random_model as build
    from deltaspec.kernels import select_ops

    return build(config, select_ops(device), dtype, device)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy of random data (median)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def capture_graph(launch, repeats: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `repeats` calls of launch(r), captured after up to two warm-up calls on a
    side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for r in range(min(repeats, 2)):
            launch(r)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(repeats):
            launch(r)
    return graph


def graph_time_us(launch, repeats: int, replays: int = 20) -> float:
    """Median replay time of a CUDA graph of `repeats` calls of launch(r), per call, in µs."""
    graph = capture_graph(launch, repeats)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / repeats)
    del graph
    return sorted(times)[len(times) // 2]


def commit_id() -> str:
    """The checkout's commit; the GPU machine's copy has no .git, so callers pass DELTASPEC_COMMIT."""
    return os.environ.get("DELTASPEC_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"


def write_result(out: Path, benchmark: str, device: str, results: dict) -> Path:
    """out/<benchmark>-<device tag>.json: the device, date, commit, the command line that ran
    (this script and its arguments) and the results."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}-{device_tag(device)}.json"
    path.write_text(json.dumps({"benchmark": benchmark, "device": device, "commit": commit_id(),
                                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "command": "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
                                "results": results}, indent=1))
    print("wrote", path)
    return path


def eager_time_us(launch, repeats: int, rounds: int = 9) -> float:
    """Median over rounds of (events around launch(0..repeats-1), back to back) / repeats, in µs.
    For code that cannot be captured in a graph (host syncs, autotuning on first call)."""
    for r in range(repeats):
        launch(r)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(repeats):
            launch(r)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / repeats)
    return sorted(times)[len(times) // 2]
