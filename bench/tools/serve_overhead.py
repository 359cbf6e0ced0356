"""The server's CPU cost per streamed token: the real aiohttp app over a stub engine core.

What it measures, for each stream count N: N closed-loop clients (each sends a streamed
/v1/completions as soon as its last one ended) in a *separate process* (raw asyncio sockets, so
the client stays cheap) against the real application (`server.serve.start`, on uvloop as
`deltaspec serve` runs it) over the real `AsyncLLM` whose `EngineCore` is a stub. Over the
measured window: the server process's CPU time (time.process_time: every thread) per token
streamed, and tokens/s. Then the same stub engine driven in-process (N coroutines iterating
`AsyncLLM.generate`, as `deltaspec bench serve` does), so served - in-process is what the HTTP
layer costs per token and served / in-process the ratio issue #33's bar is about. `--profile`:
a cProfile of the server's event-loop thread over one window at the largest --streams, top 30
by own time (the profiler slows the loop: its tokens/s and CPU per token are not comparable).

What it does not measure: no model and no device. The stub core gives every running request one
token per step (real token ids and texts of models/default's tokenizer, so the chunks look like
the real ones); its wait, in the runner thread, spins `--launch-ms` holding the GIL (the
launches), says the step is on the device and sleeps until the step before it is done on a
device that runs steps of `--step-ms` one after another: the engine's steady decoding, each wait
launching the step after the one it reads (with a step time, served / in-process shows how much
of the server's work the device's time hides). The engine's own scheduling and commit cost is not in
it (bench/host_overhead.py measures that). `--step-ms 0` makes every number CPU-bound: this
CPU's speed, not an H100 host's; the client shares the machine's cores.

    python bench/tools/serve_overhead.py --streams 16 64 --duration 8 --step-ms 0 --label after-step0ms
    python bench/tools/serve_overhead.py --streams 64 --profile --label after-step0ms

Writes bench/results/serve_overhead-cpu.json: per --label, the date, commit, command, CPU and
each stream count's numbers (the median of --repeats runs, and every run), or with --profile
the profile's top 30 lines.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import datetime
import io
import itertools
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "default"
MODEL_NAME = "stub"
PROMPT = "def fibonacci(n):"
# What every stream's requests stream, token by token, over and over.
TEXT = ('def fibonacci(n):\n    """The n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
        '        a, b = b, a + b\n    return a\n\n\nif __name__ == "__main__":\n    print(fibonacci(10))\n')
# A streamed response ends with the [DONE] event and the last (empty) chunk of chunked encoding.
END = b"data: [DONE]\n\n\r\n0\r\n\r\n"


# The stub engine core ---------------------------------------------------------------------------

class StubCore:
    """What AsyncLLM and the server use of EngineCore. A step is every running request that is
    not paused; its wait models launches and a device (`_wait`); its commit gives each
    of them its next token, finishing it with "length" at max_tokens, and an abort delta to each
    request aborted since the last commit (as EngineCore's scheduler does)."""

    def __init__(self, tokenizer, step_seconds: float, max_num_seqs: int, launch_seconds: float = 0.0) -> None:
        from deltaspec.engine.core import Dispatched, StepResult
        from deltaspec.engine.request import RequestDelta

        self._dispatched, self._result, self._delta = Dispatched, StepResult, RequestDelta
        self.tokenizer = tokenizer
        self.generation_defaults: dict = {}
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.max_model_len = 4096
        self.requests: dict[str, SimpleNamespace] = {}
        self.num_tokens = 0  # tokens committed so far
        self._tokens = [(token_id, tokenizer.decode_token(token_id)) for token_id in tokenizer.encode(TEXT)]
        self._aborted: list[str] = []
        self._arrivals = itertools.count()
        self._step_seconds = step_seconds
        self._launch_seconds = launch_seconds
        self._device_queue: collections.deque[float] = collections.deque()  # launched steps' end times
        self._device_free_at = 0.0

    def add_request(self, prompt, params, request_id, resume_from=None, fork_of=None):
        request_id = request_id or str(next(self._arrivals))  # AsyncLLM's own requests have none
        request = SimpleNamespace(request_id=request_id, max_tokens=params.max_tokens, num_tokens=0, paused=False)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        if self.requests.pop(request_id, None) is None:
            return False
        self._aborted.append(request_id)
        return True

    def pause(self, request_id: str) -> bool:
        return self._set_paused(request_id, True)

    def resume(self, request_id: str) -> bool:
        return self._set_paused(request_id, False)

    def _set_paused(self, request_id: str, paused: bool) -> bool:
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused
        return request is not None

    @property
    def has_work(self) -> bool:
        return bool(self._aborted) or any(not r.paused for r in self.requests.values())

    def dispatch(self):
        plan = [r for r in self.requests.values() if not r.paused]
        return self._dispatched(plan, self._wait)

    def _wait(self, on_device=None):
        """In AsyncLLM's runner thread (Dispatched.wait): launch a step (Python holding the GIL
        for launch_seconds, as the runner's launches do; two after an idle device, the step and
        the one after it), then sleep until the oldest launched step is done on a device that
        runs them one after another, step_seconds each: the engine's steady decoding, where
        each wait launches the step after the one it reads (EngineCore.dispatch)."""
        for _ in range(1 if self._device_queue else 2):
            end = time.perf_counter() + self._launch_seconds
            while time.perf_counter() < end:
                pass
            self._device_free_at = max(time.perf_counter(), self._device_free_at) + self._step_seconds
            self._device_queue.append(self._device_free_at)
        if on_device is not None:
            on_device()
        done = self._device_queue.popleft()
        time.sleep(max(0.0, done - time.perf_counter()))
        return self._result(None)

    def commit(self, plan, result) -> list:
        deltas = []
        for request in plan:
            if self.requests.get(request.request_id) is not request:
                continue  # aborted since dispatch: its abort delta follows
            token_id, text = self._tokens[request.num_tokens % len(self._tokens)]
            request.num_tokens += 1
            finish_reason = "length" if request.num_tokens >= request.max_tokens else None
            if finish_reason is not None:
                del self.requests[request.request_id]
            deltas.append(self._delta(request.request_id, [token_id], text, finish_reason))
        self.num_tokens += len(deltas)
        deltas += [self._delta(request_id, [], "", "abort") for request_id in self._aborted]
        self._aborted.clear()
        return deltas

    def close(self) -> None:
        pass


def stub_engine(args: argparse.Namespace, num_streams: int):
    from deltaspec.engine import AsyncLLM
    from deltaspec.engine.tokenizer import Tokenizer

    core = StubCore(Tokenizer.from_dir(MODEL), args.step_ms / 1e3, max(num_streams, 1), args.launch_ms / 1e3)
    return core, AsyncLLM(core=core)


# Served and in-process runs ---------------------------------------------------------------------

async def served(args: argparse.Namespace, num_streams: int, profiler: cProfile.Profile | None) -> dict:
    from deltaspec.server.config import ServerConfig
    from deltaspec.server.serve import start

    core, engine = stub_engine(args, num_streams)
    running = await start(engine, ServerConfig(model_name=MODEL_NAME, port=0, shutdown_timeout=1,
                                               max_waiting=num_streams))
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", str(running.port), "--streams", str(num_streams),
        "--warm-up", str(args.warm_up), "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
        stdout=asyncio.subprocess.PIPE)
    try:
        if (await client.stdout.readline()).strip() != b"go":
            raise RuntimeError("the client failed during its warm-up")
        tokens, cpu, wall = core.num_tokens, time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        line = await client.stdout.readline()
        if profiler is not None:
            profiler.disable()
        tokens, cpu, wall = core.num_tokens - tokens, time.process_time() - cpu, time.perf_counter() - wall
        if not line.startswith(b"stop "):
            raise RuntimeError("the client failed")
        client_report = json.loads(line[5:])
        await client.wait()
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
        await running.stop()
        await engine.shutdown()
    return {"tokens_per_s": tokens / wall, "server_cpu_us_per_token": cpu / tokens * 1e6,
            "server_cpu_share": cpu / wall, "client_cpu_share": client_report["cpu_share"],
            "requests": client_report["requests"]}


async def in_process(args: argparse.Namespace, num_streams: int) -> dict:
    from deltaspec.engine import SamplingParams

    core, engine = stub_engine(args, num_streams)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompt = engine.tokenizer.encode(PROMPT)
    stopping = False

    async def stream() -> None:
        while not stopping:
            async for _ in engine.generate(prompt, params):
                pass

    tasks = [asyncio.create_task(stream()) for _ in range(num_streams)]
    await asyncio.sleep(args.warm_up)
    tokens, cpu, wall = core.num_tokens, time.process_time(), time.perf_counter()
    await asyncio.sleep(args.duration)
    tokens, cpu, wall = core.num_tokens - tokens, time.process_time() - cpu, time.perf_counter() - wall
    stopping = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.shutdown()
    return {"tokens_per_s": tokens / wall, "cpu_us_per_token": cpu / tokens * 1e6}


# The client (its own process) -------------------------------------------------------------------

async def client(port: int, num_streams: int, warm_up: float, duration: float, max_tokens: int) -> None:
    """num_streams connections, each sending the next request when the last one's stream ended.
    Prints "go" after the warm-up and "stop {json}" (requests finished, own CPU share) after the
    measured window, then drops its connections."""
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    finished = [0]

    async def stream() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while True:
            writer.write(request)
            tail = b""
            while not tail.endswith(END):
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the server closed the connection")
                tail = (tail + data)[-len(END):]
            finished[0] += 1

    tasks = [asyncio.create_task(stream()) for _ in range(num_streams)]
    await asyncio.sleep(warm_up)
    print("go", flush=True)
    requests, cpu, wall = finished[0], time.process_time(), time.perf_counter()
    await asyncio.sleep(duration)
    report = {"requests": finished[0] - requests,
              "cpu_share": (time.process_time() - cpu) / (time.perf_counter() - wall)}
    for task in tasks:
        if task.done():
            task.result()  # a failed stream fails the run
    print("stop " + json.dumps(report), flush=True)


# Recording --------------------------------------------------------------------------------------

def profile_top(profiler: cProfile.Profile, lines: int = 30) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def median_run(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def record(args: argparse.Namespace, numbers: dict) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from common import commit_id
    from host_overhead import cpu_name

    out = Path(args.out)
    recorded = json.loads(out.read_text()) if out.exists() else {"benchmark": "serve_overhead", "device": "cpu",
                                                                  "runs": {}}
    run = recorded["runs"].setdefault(args.label, {})
    run["profile" if args.profile else "measured"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "cpu": cpu_name(),
        "python": platform.python_version(), **numbers}
    out.write_text(json.dumps(recorded, indent=2) + "\n")


async def benchmark(args: argparse.Namespace) -> None:
    if args.profile:
        profiler = cProfile.Profile()
        result = await served(args, max(args.streams), profiler)
        top = profile_top(profiler)
        print(json.dumps(result))
        print("\n".join(top))
        record(args, {"streams": max(args.streams), "step_ms": args.step_ms, "served": result, "top30": top})
        return
    results = []
    for num_streams in args.streams:
        runs_served = [await served(args, num_streams, None) for _ in range(args.repeats)]
        runs_in_process = [await in_process(args, num_streams) for _ in range(args.repeats)]
        result = {"streams": num_streams, "step_ms": args.step_ms, "launch_ms": args.launch_ms,
                  "max_tokens": args.max_tokens,
                  "served": median_run(runs_served), "in_process": median_run(runs_in_process),
                  "served_runs": runs_served, "in_process_runs": runs_in_process}
        result["served_over_in_process"] = result["served"]["tokens_per_s"] / result["in_process"]["tokens_per_s"]
        result["http_cpu_us_per_token"] = (result["served"]["server_cpu_us_per_token"]
                                           - result["in_process"]["cpu_us_per_token"])
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_runs")}), flush=True)
        results.append(result)
    record(args, {"results": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per run")
    parser.add_argument("--warm-up", type=float, default=2.0, help="seconds of load before each measured window")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0, help="the stub step's wait (a device step)")
    parser.add_argument("--launch-ms", type=float, default=0.0,
                        help="the stub step's launches before it: Python work in the runner thread, holding the GIL")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--label", default="after")
    parser.add_argument("--profile", action="store_true", help="profile the server at the largest --streams")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_overhead-cpu.json"))
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args()
    if args.client is not None:
        import uvloop  # not through deltaspec: the client process imports no torch
        uvloop.run(client(args.client, args.streams[0], args.warm_up, args.duration, args.max_tokens))
        return
    from deltaspec.engine.async_llm import run
    run(benchmark(args))


if __name__ == "__main__":
    main()
