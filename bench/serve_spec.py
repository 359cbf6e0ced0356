"""What speculation is worth to a client of `deltaspec serve`: streamed completion tokens/s of
the server with its defaults against the same server with `--num-draft-tokens 0`.

The issue's target: the shipped model, 256-token streamed completions of held-out code prompts,
>= 1.5x at 1 greedy stream and >= 0.98x at 16 and 64 streams and at T=0.7. The engine-level
acceptance benchmark (server/acceptance_benchmark.py) cannot show this: it fixes the draft
length, drives EngineCore directly and has no HTTP, detokenization or SSE on the path, while the
default server picks each step's draft count adaptively (up to 3 MTP drafts) behind aiohttp.
So this runs the real thing as a client would: one `deltaspec serve` process per setting
("default": no --num-draft-tokens flag; "0": plain decoding; any other value is passed as
--num-draft-tokens), on 127.0.0.1, talked to over `POST /v1/completions` with aiohttp.

Per setting, temperature and stream count, one round:
    warm-up : every stream sends one request like the timed ones, untimed, so Triton compilation
              and autotuning, first-use allocations and the adaptive draft policy's start-up are
              paid before the clock starts (the first configuration otherwise pays them all);
    timed   : `streams` concurrent clients each send --requests-per-stream streaming requests
              one after another ("ignore_eos", so each completion is exactly --max-tokens long);
              wall time from the first request sent to the last stream's [DONE].
Tokens are the server's own count (the usage chunk of stream_options.include_usage): one SSE
chunk can carry several tokens when drafts are accepted, so counting chunks would undercount.
Time to first token is from sending the request to the first text chunk; inter-token latency
is (last chunk - first chunk) / (tokens - 1), vLLM's TPOT, since per-token arrival times do not
exist when a chunk holds a verify step's tokens. Every request gets its own prompt (its own cut
of a held-out file; rounds and their warm-ups do not share prompts), and every setting sees the
same prompts and seeds in the same order: prompts cut from the two short held-out files
(json/scanner.py, json/tool.py) share their openings, and whatever the prefix cache (on, as by
default) makes of that, it makes of it for every setting alike. Speculation counters (/metrics)
are read around each timed round.

    python bench/serve_spec.py [--model models/default] [--device cuda --dtype bfloat16]
        [--streams 1 16 64] [--temperatures 0 0.7] [--max-tokens 256] [--requests-per-stream 4]
        [--settings default,0] [--out bench/results]

Writes <out>/serve_spec-<device>.json (measurements per setting x temperature x streams, and a
`speedup` table: each setting's tokens/s over setting "0" at the same temperature and streams,
from the same run) and prints the table. On the CPU the numbers mean nothing (a smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from common import commit_id, device_tag  # noqa: E402
from deltaspec.server.acceptance_benchmark import load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# serve.py's "serving <name> on http://127.0.0.1:<port>/v1 (engine: <device>, <dtype>, <k> drafts per step)".
LISTENING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)/v1")
DRAFTS = re.compile(r"(\d+) drafts per step")
SHUTDOWN_WAIT_S = 60  # after SIGINT: the server drains in-flight requests (none by then) and stops the engine


# Server ---------------------------------------------------------------------------------------

class Server:
    """One `deltaspec serve` process on a free port; its log goes to a file (a pipe left unread
    would fill and stall it) that is shown when anything fails."""

    def __init__(self, args: argparse.Namespace, setting: str, log_dir: Path) -> None:
        self.setting = setting
        self.command = [sys.executable, "-m", "deltaspec.server.cli", "serve", str(args.model),
                        "--host", HOST, "--port", "0", "--device", args.device, "--dtype", args.dtype,
                        "--max-running", str(max(args.streams))]
        if setting != "default":
            self.command += ["--num-draft-tokens", setting]
        self.command += shlex.split(args.server_args)
        self.log_path = log_dir / f"serve-{setting}.log"
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.num_draft_tokens: int | None = None

    async def start(self, http: aiohttp.ClientSession, timeout: float) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while self.port is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.setting!r} exited ({self.process.returncode}) before listening")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {self.setting!r} not listening after {timeout:g}s")
            text = self.log_path.read_text(errors="replace")
            if match := LISTENING.search(text):
                self.port = int(match.group(1))
                drafts = DRAFTS.search(text[match.start():])
                self.num_draft_tokens = int(drafts.group(1)) if drafts else None
            else:
                await asyncio.sleep(0.2)
        while True:  # listening already; /health proves the routes answer
            try:
                async with http.get(self.url("/health"), timeout=aiohttp.ClientTimeout(total=10)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"server {self.setting!r}: /health never answered 200")
            await asyncio.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def stop(self) -> None:
        """SIGINT (graceful), then SIGKILL if it has not exited in time. Synchronous, so it also
        runs to the end in a `finally` reached by cancellation."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- {self.log_path} (last {lines} lines) ---\n" + "\n".join(text)


async def scrape_counters(http: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    """The speculation and preemption counters of /metrics, keyed 'name{labels}'."""
    async with http.get(server.url("/metrics"), timeout=aiohttp.ClientTimeout(total=30)) as response:
        response.raise_for_status()
        text = await response.text()
    counters = {}
    for line in text.splitlines():
        if line.startswith(("deltaspec_spec_", "deltaspec_preemptions_total")) and " " in line:
            key, value = line.rsplit(" ", 1)
            counters[key] = float(value)
    return counters


def spec_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Acceptance over one timed round: the counters' growth across it."""
    def grown(prefix: str) -> dict[str, float]:
        return {key: after[key] - before.get(key, 0.0) for key in after if key.startswith(prefix)}

    proposed = grown("deltaspec_spec_draft_tokens_total{")
    accepted = grown("deltaspec_spec_accepted_tokens_total{")
    positions = sorted(proposed, key=lambda key: int(re.search(r'position="(\d+)"', key).group(1)))
    verify_steps = grown("deltaspec_spec_verify_steps_total").get("deltaspec_spec_verify_steps_total", 0.0)
    accepted_total = sum(accepted.values())
    return {"verify_steps": verify_steps,
            "proposed_by_position": [proposed[key] for key in positions],
            "acceptance_by_position": [accepted.get(key.replace("draft_tokens", "accepted_tokens"), 0.0)
                                       / proposed[key] if proposed[key] else 0.0 for key in positions],
            "mean_accepted_length": (accepted_total + verify_steps) / verify_steps if verify_steps else None,
            "preemptions": after.get("deltaspec_preemptions_total", 0.0)
            - before.get("deltaspec_preemptions_total", 0.0)}


# Client ---------------------------------------------------------------------------------------

async def complete(http: aiohttp.ClientSession, server: Server, prompt: str, args: argparse.Namespace,
                   temperature: float, seed: int) -> dict:
    """One streamed completion; its token count, time to first token and per-token latency."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature > 0:
        body["seed"] = seed
    sent = time.perf_counter()
    first = last = None
    chunks, tokens, done = 0, None, False
    async with http.post(server.url("/v1/completions"), json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"error event in the stream: {event['error']}")
            if event.get("choices"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not done or tokens is None or first is None:
        raise RuntimeError(f"stream ended early (done={done}, usage={tokens}, chunks={chunks})")
    if tokens != args.max_tokens:
        raise RuntimeError(f"{tokens} completion tokens, not {args.max_tokens}: was ignore_eos honoured?")
    return {"tokens": tokens, "chunks": chunks, "ttft_s": first - sent, "latency_s": last - sent,
            "itl_s": (last - first) / (tokens - 1) if tokens > 1 else 0.0}


async def all_or_nothing(coroutines) -> list:
    """Run concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_round(http: aiohttp.ClientSession, server: Server, args: argparse.Namespace, temperature: float,
                    streams: int, prompts: list[str], seed: int) -> dict:
    """Warm-up (one request per stream, untimed), then the timed requests; prompts holds
    streams * (1 + requests_per_stream) prompts, the warm-up's first."""
    per_stream = args.requests_per_stream

    async def request(index: int) -> dict:
        return await asyncio.wait_for(complete(http, server, prompts[index], args, temperature, seed + index),
                                      args.request_timeout)

    await all_or_nothing(request(s) for s in range(streams))

    async def stream(s: int) -> list[dict]:
        return [await request(streams + s * per_stream + i) for i in range(per_stream)]

    before = await scrape_counters(http, server)
    started = time.perf_counter()
    results = await all_or_nothing(stream(s) for s in range(streams))
    seconds = time.perf_counter() - started
    after = await scrape_counters(http, server)
    requests = [r for rs in results for r in rs]
    tokens = sum(r["tokens"] for r in requests)
    return {"setting": server.setting, "temperature": temperature, "streams": streams,
            "requests": len(requests), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_ms_mean": 1e3 * statistics.mean(r["ttft_s"] for r in requests),
            "ttft_ms_max": 1e3 * max(r["ttft_s"] for r in requests),
            "itl_ms_mean": 1e3 * statistics.mean(r["itl_s"] for r in requests),
            "tokens_per_chunk": tokens / sum(r["chunks"] for r in requests),
            "per_stream": [{"ttft_ms": 1e3 * statistics.mean(r["ttft_s"] for r in rs),
                            "itl_ms": 1e3 * statistics.mean(r["itl_s"] for r in rs),
                            "latency_s": [r["latency_s"] for r in rs]} for rs in results],
            "spec": spec_summary(before, after)}


# Report ---------------------------------------------------------------------------------------

def target(setting: str, temperature: float, streams: int) -> float | None:
    """The issue's bar for the default server."""
    if setting != "default":
        return None
    return 1.5 if temperature == 0 and streams == 1 else 0.98


def speedups(measurements: list[dict]) -> list[dict]:
    baseline = {(m["temperature"], m["streams"]): m["tokens_per_s"] for m in measurements if m["setting"] == "0"}
    rows = []
    for m in measurements:
        base = baseline.get((m["temperature"], m["streams"]))
        if m["setting"] == "0" or base is None:
            continue
        bar = target(m["setting"], m["temperature"], m["streams"])
        speedup = m["tokens_per_s"] / base
        rows.append({"setting": m["setting"], "temperature": m["temperature"], "streams": m["streams"],
                     "tokens_per_s": m["tokens_per_s"], "baseline_tokens_per_s": base, "speedup": speedup,
                     "target": bar, "meets_target": None if bar is None else speedup >= bar})
    return rows


def table(report: dict) -> str:
    speedup = {(r["setting"], r["temperature"], r["streams"]): r for r in report["speedup"]}
    lines = [f"{'setting':>8} {'T':>4} {'streams':>7} {'tok/s':>9} {'speedup':>8} {'target':>7} "
             f"{'ttft ms':>8} {'itl ms':>7} {'tok/chunk':>9} {'accepted/step':>13}"]
    for m in report["measurements"]:
        row = speedup.get((m["setting"], m["temperature"], m["streams"]))
        accepted = m["spec"]["mean_accepted_length"]
        speedup_text = f"{row['speedup']:.3f}" if row else "-"
        target_text = f"{row['target']:g}" if row and row["target"] else "-"
        accepted_text = f"{accepted:.2f}" if accepted else "-"
        lines.append(f"{m['setting']:>8} {m['temperature']:>4g} {m['streams']:>7} {m['tokens_per_s']:>9.1f} "
                     f"{speedup_text:>8} {target_text:>7} {m['ttft_ms_mean']:>8.1f} {m['itl_ms_mean']:>7.2f} "
                     f"{m['tokens_per_chunk']:>9.2f} {accepted_text:>13}")
    return "\n".join(lines)


def device_name(device: str) -> str:
    """Asked only after the servers are gone: a CUDA context here would take memory the server
    sizes its pools from."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch
    return torch.cuda.get_device_name(torch.device(device))


# Main -----------------------------------------------------------------------------------------

async def benchmark(args: argparse.Namespace) -> list[dict]:
    rounds = [(t, s) for t in args.temperatures for s in args.streams]
    sizes = [s * (1 + args.requests_per_stream) for _, s in rounds]
    prompts = load_prompts(args.model, [], sum(sizes), args.max_prompt_chars, args.seed)
    offsets = [sum(sizes[:i]) for i in range(len(rounds))]
    measurements = []
    connector = aiohttp.TCPConnector(limit=max(args.streams) + 4)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    with tempfile.TemporaryDirectory(prefix="serve_spec-") as log_dir, \
            tqdm(total=len(args.settings) * len(rounds), desc="serve_spec") as bar:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            for setting in args.settings:
                server = Server(args, setting, Path(log_dir))
                bar.set_postfix_str(f"starting server {setting!r}")
                try:
                    await server.start(http, args.server_timeout)
                    for (temperature, streams), offset, size in zip(rounds, offsets, sizes):
                        bar.set_postfix_str(f"{setting} T={temperature:g} streams={streams}")
                        measured = await run_round(http, server, args, temperature, streams,
                                                   prompts[offset:offset + size], args.seed + offset)
                        measured.update(server_num_draft_tokens=server.num_draft_tokens,
                                        server_command=shlex.join(["deltaspec"] + server.command[3:]))
                        measurements.append(measured)
                        bar.update()
                except BaseException:
                    print(server.log_tail(), file=sys.stderr)
                    raise
                finally:
                    server.stop()
    return measurements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--settings", default="default,0",
                        help="comma-separated: 'default' (no --num-draft-tokens flag) or the flag's value")
    parser.add_argument("--max-prompt-chars", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `deltaspec serve` options, for every setting")
    parser.add_argument("--server-timeout", type=float, default=300.0,
                        help="seconds a server gets to start (model load, CUDA graph capture)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.model = args.model.resolve()  # the servers run from the repo root
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for setting in args.settings:
        if setting != "default" and not setting.isdigit():
            parser.error(f"--settings: {setting!r} is neither 'default' nor a draft count")
    if min(args.streams) < 1 or args.requests_per_stream < 1 or args.max_tokens < 1:
        parser.error("--streams, --requests-per-stream and --max-tokens must be positive")
    if "0" not in args.settings:
        print("note: no setting '0' in --settings, so no speedups", file=sys.stderr)

    measurements = asyncio.run(benchmark(args))
    name = device_name(args.device)
    report = {"benchmark": "serve_spec", "model": str(args.model), "device": name, "dtype": args.dtype,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
              "settings": args.settings, "streams": args.streams, "temperatures": args.temperatures,
              "max_tokens": args.max_tokens, "requests_per_stream": args.requests_per_stream,
              "max_prompt_chars": args.max_prompt_chars, "seed": args.seed,
              "prompts": "held-out stdlib modules of the model's training.json (load_prompts), disjoint per round",
              "timing": "per setting x temperature x streams: one untimed warm-up request per stream, then "
                        "streams x requests_per_stream streamed requests timed from first sent to last [DONE]; "
                        "tokens from the usage chunk",
              "measurements": measurements, "speedup": speedups(measurements)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_spec-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    print(table(report))
    print("wrote", path)


if __name__ == "__main__":
    main()
