"""Soak: the server under mixed traffic with random disconnects for minutes; nothing lost, nothing leaked.

`--streams` clients send requests back to back for `--duration` seconds: completions and chat,
streamed or not, greedy or sampled, random lengths (ignore_eos, so each must return exactly its
max_tokens), a list of prompts or n > 1 now and then; a `--disconnect-rate` share of streamed
requests is dropped by the client after a random number of chunks, and every 10th request is the
greedy reference prompt, whose text must never change. The server runs in this process (`start`)
over its engine in a process of its own, as `deltaspec serve` runs it (`--single-process`: on
this process's loop), and reads the engine's gauges with `fetch_stats`.

Lost: a request not dropped by its client that got anything but a whole answer (a 5xx, an error
event, a stream without [DONE], fewer tokens than asked), or a reference text that changed.
Leaked: once the clients stop, a request still running or waiting, a slot or KV block neither free
nor held by the prefix cache, a pinned cache entry, or the processes' RSS (the server's and the
engine's) grown past `--max-rss-growth-mib` since the warm-up. Writes soak-<device>.json; exits 1 on any of them.

    python bench/soak.py --device cuda --dtype bfloat16 --duration 600 --streams 64
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import resource
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit_id  # noqa: E402

from deltaspec.engine import AsyncLLM, EngineConfig  # noqa: E402
from deltaspec.engine.engine_process import EngineProcess  # noqa: E402
from deltaspec.server.acceptance_benchmark import device_name, device_tag  # noqa: E402
from deltaspec.server.config import ServerConfig  # noqa: E402
from deltaspec.server.serve import start  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "default"
REFERENCE = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Cache:\n    def __init__(self",
           "for i in range(10):", "# parse the arguments\nparser = argparse.ArgumentParser(", "Hello"]


def _rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory now (Linux), else this process's peak."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Tally:
    def __init__(self) -> None:
        self.counts = {"sent": 0, "ok": 0, "dropped_by_client": 0, "lost": 0, "overloaded_503": 0}
        self.lost: list[str] = []
        self.reference: str | None = None

    def lose(self, what: str) -> None:
        self.counts["lost"] += 1
        if len(self.lost) < 20:
            self.lost.append(what)


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally, index: int) -> None:
    tally.counts["sent"] += 1
    reference = index % 10 == 0
    max_tokens = REFERENCE["max_tokens"] if reference else rng.randint(1, 64)
    stream = rng.random() < 0.7 and not reference
    chat = rng.random() < 0.4 and not reference
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                  "temperature": 0 if reference or rng.random() < 0.5 else 0.8}
    if stream:
        body["stream_options"] = {"include_usage": True}
    num_choices = 1
    if reference:
        body.update(REFERENCE)
    elif chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    elif rng.random() < 0.1:
        body["prompt"] = rng.sample(PROMPTS, 3)
        num_choices = 3
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if not reference and rng.random() < 0.05:
        body["n"] = 2
        num_choices *= 2  # n choices of each prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    drop_after = rng.randint(0, 8) if stream and rng.random() < ARGS.disconnect_rate else None
    what = f"{path} {json.dumps(body)[:200]}"
    async with http.post(url + path, json=body) as response:
        if response.status == 503:
            tally.counts["overloaded_503"] += 1  # admission control: answered, not lost
            return
        if response.status != 200:
            tally.lose(f"{response.status} {await response.text()} for {what}")
            return
        if not stream:
            answer = await response.json()
            if answer["usage"]["completion_tokens"] != max_tokens * num_choices:
                tally.lose(f"{answer['usage']} for {what}")
            elif reference:
                text = answer["choices"][0]["text"]
                tally.reference = tally.reference or text
                if text != tally.reference:
                    tally.lose(f"reference text changed: {text!r} != {tally.reference!r}")
                    return
            tally.counts["ok"] += 1
            return
        chunks, done, usage = 0, False, None
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if drop_after is not None and chunks >= drop_after:
                response.close()  # the client goes away mid-stream
                tally.counts["dropped_by_client"] += 1
                return
            chunks += 1
            if line.startswith(b"data: [DONE]"):
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.lose(f"error event {chunk['error']} for {what}")
                return
            usage = chunk.get("usage") or usage
        if not done or usage is None or usage["completion_tokens"] != max_tokens * num_choices:
            tally.lose(f"stream ended without [DONE] or short ({usage}) for {what}")
            return
        tally.counts["ok"] += 1


async def soak() -> dict:
    config = EngineConfig(model=MODEL, device=ARGS.device, dtype=ARGS.dtype, max_model_len=1024,
                          max_num_seqs=ARGS.max_running)
    engine = AsyncLLM(config=config) if ARGS.single_process else await EngineProcess.start(config)
    pids = ["self"] if ARGS.single_process else ["self", engine.pid]

    def rss_mib() -> float:
        return sum(_rss_mib(pid) for pid in pids)

    running = await start(engine, ServerConfig(model_name="default", port=0, max_waiting=ARGS.streams * 3))
    url = f"http://127.0.0.1:{running.port}"
    tally, warm = Tally(), Tally()
    rng = random.Random(ARGS.seed)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            await asyncio.gather(*(one_request(http, url, rng, warm, i) for i in range(ARGS.streams)))
            rss_before = rss_mib()
            deadline = time.monotonic() + ARGS.duration
            counter = iter(range(10**9))

            async def client() -> None:
                while time.monotonic() < deadline:
                    await one_request(http, url, rng, tally, next(counter))

            await asyncio.gather(*(client() for _ in range(ARGS.streams)))
        idle_by = time.monotonic() + 30
        while ((stats := await engine.fetch_stats())["num_running"] or stats["num_waiting"]) and \
                time.monotonic() < idle_by:
            await asyncio.sleep(0.05)
        rss_growth = rss_mib() - rss_before
    finally:
        await running.stop()
        await engine.shutdown()
    leaks = []
    if stats["num_running"] or stats["num_waiting"]:
        leaks.append(f"{stats['num_running']} running, {stats['num_waiting']} waiting after the clients stopped")
    if stats["num_free_slots"] + stats["num_cached_slots"] != stats["num_slots"]:
        leaks.append(f"slots: {stats['num_free_slots']} free + {stats['num_cached_slots']} cached "
                     f"!= {stats['num_slots']}")
    if stats["num_free_kv_blocks"] + stats["num_cached_kv_blocks"] != stats["num_kv_blocks"]:
        leaks.append(f"KV blocks: {stats['num_free_kv_blocks']} free + {stats['num_cached_kv_blocks']} cached "
                     f"!= {stats['num_kv_blocks']}")
    if stats["prefix_cache"]["pinned"]:
        leaks.append(f"{stats['prefix_cache']['pinned']} cache entries still pinned")
    if rss_growth > ARGS.max_rss_growth_mib:
        leaks.append(f"RSS grew {rss_growth:.0f} MiB (limit {ARGS.max_rss_growth_mib})")
    return {"counts": tally.counts, "lost": tally.lost, "leaks": leaks, "rss_growth_mib": rss_growth,
            "final_stats": {k: v for k, v in stats.items() if k.startswith("num_")}}


def main() -> int:
    result = asyncio.run(soak())
    device = device_name(ARGS.device)
    report = {"benchmark": "soak", "device": device, "commit": commit_id(),
              "server": "single process" if ARGS.single_process else "engine process",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/soak.py " + " ".join(sys.argv[1:]), **result}
    ARGS.out.mkdir(parents=True, exist_ok=True)
    path = ARGS.out / f"soak-{device_tag(device)}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("counts", "lost", "leaks", "rss_growth_mib")}, indent=2))
    passed = not result["lost"] and not result["leaks"] and result["counts"]["ok"] > 0
    print(f"soak: {'PASS' if passed else 'FAIL'}; wrote {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--disconnect-rate", type=float, default=0.2)
    parser.add_argument("--max-rss-growth-mib", type=float, default=512.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-process", action="store_true", help="the engine on the server's loop")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    ARGS = parser.parse_args()
    sys.exit(main())
