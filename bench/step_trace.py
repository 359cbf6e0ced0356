"""Where a serving run's time goes, step by step: AsyncLLM driven by concurrent streams (as
`deltaspec serve` drives it, without HTTP), every step recorded.

For each setting (engine defaults, or --num-draft-tokens N), in one process one after another:
`streams` concurrent clients each send --requests-per-stream requests of --max-tokens tokens
("ignore_eos"), prompts as bench/serve_spec.py cuts them, after one untimed warm-up request per
stream. Each step the engine dispatches is recorded: when it was dispatched and committed, its
rows (decode, prefill, cached), its drafts per row K, prefill tokens, whether it was launched
ahead of the step before it (back to back), and the running/waiting counts at dispatch. Each
request records its first and last token times and the steps it was a decode row of.

    python bench/step_trace.py [--model models/default] [--device cuda --dtype bfloat16]
        [--streams 16] [--temperature 0] [--max-tokens 256] [--requests-per-stream 2]
        [--settings default,0] [--out bench/results]

Writes <out>/step_trace-<device>.json (per setting: a summary by step kind, per-request
latencies and step counts, and the whole step list) and a PNG timeline (rows and K per step
over wall time, one panel per setting); prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from common import commit_id, device_tag  # noqa: E402
from deltaspec.engine import AsyncLLM, EngineConfig, SamplingParams  # noqa: E402
from deltaspec.server.acceptance_benchmark import load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """Wraps one EngineCore's dispatch and commit; records each step, the Triton compiles and
    autotuning runs that happened during it, and (profile_mixed > 0) a cProfile summary of that
    many steps with prefill rows."""

    def __init__(self, core, profile_mixed: int = 0, profiler: str = "cprofile") -> None:
        self.core, self.steps, self.origin = core, [], time.perf_counter()
        self.enabled = False
        self.profiles, self.profile_mixed, self.profiler = [], profile_mixed, profiler
        self.compiles: list[str] = []
        _watch_triton(self.compiles)
        dispatch, commit = core.dispatch, core.commit

        def traced_dispatch():
            started = time.perf_counter()
            back_to_back = core._in_flight is not None
            running, waiting = len(core.scheduler.running), len(core.scheduler.waiting)
            step = dispatch()
            self.compiles.clear()
            if self.enabled:
                plan = step.plan
                if plan.admits and len(self.profiles) < self.profile_mixed:
                    step = step._replace(wait=self._profiled(step.wait, plan))
                self.steps.append({
                    "dispatch_s": started - self.origin, "scheduled_s": time.perf_counter() - started,
                    "back_to_back": back_to_back, "running": running, "waiting": waiting,
                    "decode_rows": len(plan.decode_rows), "prefill_rows": len(plan.prefill_rows),
                    "cached_rows": len(plan.cached_rows),
                    "drafts": max((r.num_draft_tokens for r in plan.decode_rows), default=0),
                    "prefill_tokens": sum(r.num_tokens for r in plan.prefill_rows),
                    "requests": [r.request.request_id for r in plan.decode_rows]})
            return step

        def traced_commit(plan, result):
            waited = time.perf_counter()
            deltas = commit(plan, result)
            if self.enabled and self.steps:
                step = self.steps[-1]
                step["waited_s"] = waited - self.origin
                step["committed_s"] = time.perf_counter() - self.origin
                step["launched_ahead"] = result.launched is not None
                step["tokens"] = sum(len(d.token_ids) for d in deltas)
                step["compiles"] = list(self.compiles)
            return deltas

        core.dispatch, core.commit = traced_dispatch, traced_commit


    def _profiled(self, wait, plan):
        """wait() under cProfile (the host's time by function: a mixed step runs eagerly) or
        torch.profiler (ops and kernels)."""
        def profiled_wait(on_device=None):
            import cProfile
            import io
            import pstats

            text = io.StringIO()
            started = time.perf_counter()
            if self.profiler == "torch":
                import torch
                from torch.profiler import ProfilerActivity, profile

                cuda = torch.cuda.is_available()
                with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                    result = wait(on_device)
                    if cuda:
                        torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                text.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
                text.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
            else:
                profiler = cProfile.Profile()
                profiler.enable()
                result = wait(on_device)
                profiler.disable()
                seconds = time.perf_counter() - started
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats(40)
            self.profiles.append({
                "decode_rows": len(plan.decode_rows), "prefill_rows": len(plan.prefill_rows),
                "prefill_tokens": sum(r.num_tokens for r in plan.prefill_rows), "wall_ms": 1e3 * seconds,
                "cprofile": text.getvalue()})
            return result
        return profiled_wait


def _watch_triton(compiles: list[str]) -> None:
    """Appends to `compiles` the name of every Triton kernel specialization compiled (or loaded
    from the disk cache) in this process, and 'autotune:<kernel>' for every autotuning run."""
    try:
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return

    def on_compile(*args, **kwargs):
        compiles.append(kwargs["fn"].name if "fn" in kwargs else "?")
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = on_compile
    bench = Autotuner._bench

    def timed_bench(self, *args, **kwargs):
        compiles.append(f"autotune:{self.base_fn.__name__}")
        return bench(self, *args, **kwargs)

    Autotuner._bench = timed_bench


def kind(step: dict) -> str:
    if step["prefill_rows"] or step["cached_rows"]:
        return "mixed" if step["decode_rows"] else "prefill"
    return f"decode K={step['drafts']}" + (" ahead" if step["back_to_back"] else "")


def summarize(steps: list[dict]) -> dict:
    """Per step kind: count, wall time between consecutive commits (what the step cost the
    loop), rows and tokens."""
    by_kind = defaultdict(list)
    for previous, step in zip(steps, steps[1:]):
        by_kind[kind(step)].append((step["committed_s"] - previous["committed_s"], step))
    summary = {}
    for name, entries in sorted(by_kind.items()):
        walls = [w for w, _ in entries]
        summary[name] = {"steps": len(entries), "wall_ms_total": 1e3 * sum(walls),
                         "wall_ms_median": 1e3 * statistics.median(walls),
                         "wall_ms_p90": 1e3 * sorted(walls)[int(0.9 * (len(walls) - 1))],
                         "rows_mean": statistics.mean(s["decode_rows"] + s["prefill_rows"] for _, s in entries),
                         "tokens": sum(s.get("tokens", 0) for _, s in entries)}
    return summary


async def run_setting(args: argparse.Namespace, setting: str, prompts: list[str]) -> dict:
    options = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.streams)
    if args.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if setting != "default":
        options["num_draft_tokens"] = int(setting)
    engine = AsyncLLM(args.model, **options)
    recorder = Recorder(engine.core, args.profile_mixed if setting == args.settings.split(",")[-1] else 0,
                        args.profiler)
    per_stream = args.requests_per_stream
    requests: dict[str, dict] = {}

    async def one(index: int, timed: bool) -> None:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                                seed=index if args.temperature > 0 else None)
        sent = time.perf_counter() - recorder.origin
        record = {"sent_s": sent, "first_s": None, "last_s": None, "tokens": 0}
        async for delta in engine.generate(prompts[index], params, request_id=str(index)):
            now = time.perf_counter() - recorder.origin
            record["first_s"] = record["first_s"] or now
            record["last_s"] = now
            record["tokens"] += len(delta.token_ids)
        if timed:
            requests[str(index)] = record

    await asyncio.gather(*(one(s, False) for s in range(args.streams)))

    async def stream(s: int) -> None:
        for i in range(per_stream):
            await one(args.streams + s * per_stream + i, True)

    recorder.enabled = True
    started = time.perf_counter()
    await asyncio.gather(*(stream(s) for s in range(args.streams)))
    seconds = time.perf_counter() - started
    recorder.enabled = False
    steps = recorder.steps
    decode_steps_of = defaultdict(int)
    for step in steps:
        for request_id in step.pop("requests"):
            decode_steps_of[request_id] += 1
    for request_id, record in requests.items():
        record["decode_steps"] = decode_steps_of[request_id]
        record["latency_s"] = record["last_s"] - record["sent_s"]
    tokens = sum(r["tokens"] for r in requests.values())
    policy = engine.core.scheduler.draft_policy
    costs = {"start_up_ms": {f"{b},{k}": 1e3 * s for (b, k), s in policy.costs.seconds.items()},
             "observed_ms": {f"{b},{k}": 1e3 * s for (b, k), s in policy.observed.items()},
             "acceptance": engine.core.stats()["spec"]["acceptance_by_position"]} if policy is not None else None
    await engine.shutdown()
    del engine
    return {"setting": setting, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "steps": len(steps), "by_kind": summarize(steps), "requests": requests, "profiles": recorder.profiles,
            "policy": costs,
            "trace": steps}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    figure, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for axis, run in zip(axes[:, 0], runs):
        trace = run["trace"]
        if not trace:
            continue
        start = trace[0]["dispatch_s"]
        times = [1e3 * (s["committed_s"] - start) for s in trace]
        axis.step(times, [s["decode_rows"] for s in trace], where="post", label="decode rows")
        axis.step(times, [s["drafts"] for s in trace], where="post", label="drafts K")
        prefill = [t for t, s in zip(times, trace) if s["prefill_rows"] or s["cached_rows"]]
        axis.plot(prefill, [0] * len(prefill), "|", color="red", markersize=12, label="prefill/cached step")
        axis.set_title(f"setting {run['setting']}: {run['tokens_per_s']:.0f} tok/s, {run['steps']} steps")
        axis.set_xlabel("ms since the first timed step")
        axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-prompt-chars", type=int, default=2000)
    parser.add_argument("--settings", default="default,0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--profile-mixed", type=int, default=0,
                        help="profiles of this many steps with prefill rows (last setting)")
    parser.add_argument("--profiler", choices=("cprofile", "torch"), default="cprofile")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval (seconds) for the run: the GIL's hand-over period")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    prompts = load_prompts(args.model, [], args.streams * (1 + args.requests_per_stream), args.max_prompt_chars,
                           args.seed)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    runs = []
    for setting in args.settings.split(","):
        runs.append(asyncio.run(run_setting(args, setting, prompts)))
        print(f"setting {setting}: {runs[-1]['tokens_per_s']:.0f} tok/s in {runs[-1]['steps']} steps", flush=True)
        for name, row in runs[-1]["by_kind"].items():
            print(f"  {name:>18}: {row['steps']:5d} steps, {row['wall_ms_total']:8.1f} ms, median "
                  f"{row['wall_ms_median']:.3f} ms, p90 {row['wall_ms_p90']:.3f} ms, rows {row['rows_mean']:.1f}, "
                  f"tokens {row['tokens']}")
        compiled = [c for step in runs[-1]["trace"] for c in step.get("compiles", [])]
        print(f"  Triton compiles/autotunes during timed steps: {len(compiled)} {sorted(set(compiled))[:12]}")
        for profiled in runs[-1]["profiles"]:
            print(f"  profiled mixed step: {profiled['wall_ms']:.1f} ms wall, {profiled['decode_rows']} decode + "
                  f"{profiled['prefill_rows']} prefill rows ({profiled['prefill_tokens']} tokens)")
        if runs[-1]["policy"] is not None:
            policy = runs[-1]["policy"]
            print("  step costs ms (bucket,K): start-up " + json.dumps({k: round(v, 3) for k, v in
                                                                     policy["start_up_ms"].items()}))
            print("  observed " + json.dumps({k: round(v, 3) for k, v in policy["observed_ms"].items()})
                  + f"; acceptance by position {[round(a, 3) for a in policy['acceptance']]}")
        latencies = sorted(r["latency_s"] for r in runs[-1]["requests"].values())
        print(f"  request latency s: min {latencies[0]:.3f} median {statistics.median(latencies):.3f} "
              f"max {latencies[-1]:.3f}")
    device = device_tag(torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device)
    report = {"benchmark": "step_trace", "model": str(args.model), "device": device, "dtype": args.dtype,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": "python " + " ".join(sys.argv), "streams": args.streams,
              "temperature": args.temperature, "max_tokens": args.max_tokens,
              "requests_per_stream": args.requests_per_stream, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_trace-{device}.json"
    path.write_text(json.dumps(report, indent=1))
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
