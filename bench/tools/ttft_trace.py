"""Where time to first token goes: `deltaspec bench serve`'s closed-loop load through AsyncLLM
in-process, with every engine step and every request's milestones timestamped.

Per request: sent (the consumer calls generate), submitted (AsyncLLM.submit ran: the prompt is
tokenized and queued), scheduled (the first dispatched step holding it as a prefill or cached
row), computed (that step's commit began: its first token exists on the host) and delivered (the
consumer got its first delta). TTFT is split into queue (sent -> scheduled), step (scheduled ->
computed, the steps that prefilled it: a long prompt may take several) and hand-out (computed ->
delivered). Reported for all requests and for the slowest 1%, with what the steps in their
queue and step spans were (prefill rows and tokens, decode rows, launched ahead or not).

    python bench/tools/ttft_trace.py --device cuda --dtype bfloat16 [--streams 16 64] [--duration 10]
        [--temperature 0] [--num-draft-tokens N] [--unique-prompts] [--sync-audit] [--device-times]
        [--wait-in-loop] [--profile] [--out DIR]
        -> DIR/ttft_trace-<gpu>.json

Each step's host time by part (`mean_host_ms_per_step`, steps with new rows and decode-only ones
apart) also says where a decode step's time goes, plain (--num-draft-tokens 0) against
speculative: `InFlight.result` includes the wait for the device, `AsyncLLM._hand_out` is the
event loop handing the step before's tokens out while the runner thread works.

`time_budget` splits the window's wall time by step: admitting steps, and decode steps by draft
count and by whether they were launched ahead or scheduled afresh (after an admission); with
speculation, `draft_policy` is what the policy priced each (bucket, K) at and how often it ran each K.

--unique-prompts gives every request a prompt of its own (no prefix-cache hits: every prompt is
prefilled, as in `deltaspec bench serve --unique-prompts`). --sync-audit turns on torch's
synchronisation debug mode during the measured runs and counts each call site (its innermost
deltaspec frames) that made the host wait for the device, by step kind: a site outside a step's
one read of its outputs stalls the host while the device drains. --device-times reports each
launched decode step's device time and the device's idle time before it, by draft count.

Knows the engine only through AsyncLLM, EngineCore.dispatch and EngineCore.commit (wrapped).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import multiprocessing
import pstats
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import timed, write_result  # noqa: E402
from deltaspec.engine import AsyncLLM, EngineConfig, SamplingParams  # noqa: E402
from deltaspec.engine.async_llm import freeze_startup_heap, run  # noqa: E402
from deltaspec.engine.runner import InFlight  # noqa: E402
from deltaspec.server.acceptance_benchmark import device_name, load_prompts  # noqa: E402
from deltaspec.server.load_generator import Load, PromptSet, Window, drive, sample  # noqa: E402
from deltaspec.server.serve_benchmark import percentiles  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"


def step_kind(step: dict) -> str:
    """A traced step's kind in the reports: with new rows (prefill chunks, cached prompts) or not."""
    return "with_new_rows" if step["prefill_rows"] + step["cached_rows"] else "decode_only"


class Trace:
    """Step events and request milestones, in perf_counter seconds."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.steps: list[dict] = []
        self.requests: dict[str, dict] = {}
        core = engine.core
        dispatch, commit, submit = core.dispatch, core.commit, engine.submit

        def traced_dispatch():
            start = time.perf_counter()
            launched_ahead = core._in_flight is not None
            dispatched = dispatch()
            plan = dispatched.plan
            new = [r.request.request_id for r in plan.prefill_rows + plan.cached_rows]
            step = {"dispatch": start, "dispatched": time.perf_counter(), "ahead": launched_ahead,
                    "waiting": len(core.scheduler.waiting),
                    "decode_rows": len(plan.decode_rows), "prefill_rows": len(plan.prefill_rows),
                    "cached_rows": len(plan.cached_rows),
                    "prefill_tokens": sum(r.num_tokens for r in plan.prefill_rows),
                    "drafts": max((r.num_draft_tokens for r in plan.decode_rows), default=0)}
            self.steps.append(step)
            for request_id in new:
                self.requests.setdefault(request_id, {}).setdefault("scheduled", start)
            for row in plan.prefill_rows:
                self.requests.setdefault(row.request.request_id, {})["prefilled"] = True
            return dispatched

        def traced_commit(plan, result):
            start = time.perf_counter()
            deltas = commit(plan, result)
            for row in plan.prefill_rows + plan.cached_rows:
                if row.sample:
                    self.requests.setdefault(row.request.request_id, {}).setdefault("computed", start)
            step = next((s for s in reversed(self.steps) if "commit" not in s), None)
            if step is not None:
                step["commit"], step["committed"] = start, time.perf_counter()
            return deltas

        def traced_submit(*args, **kwargs):
            request_id = submit(*args, **kwargs)
            self.requests.setdefault(request_id, {})["submitted"] = time.perf_counter()
            return request_id

        core.dispatch, core.commit, engine.submit = traced_dispatch, traced_commit, traced_submit
        # Python's cyclic collections (a full one can stall the loop for tens of ms).
        self.collections: list[tuple[float, float, int]] = []  # (start, end, generation)
        started = []

        def on_collection(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                self.collections.append((started.pop(), time.perf_counter(), info["generation"]))

        gc.callbacks.append(on_collection)
        # Host time of the parts of a step (in whichever thread runs them), added to the step
        # dispatched last: steps run one at a time, a launched-ahead one's launch counted in the
        # step that launched it.
        runner = core.runner
        parts = [(core.scheduler, "schedule"), (core.scheduler, "continuation"), (core.scheduler, "commit"),
                 (runner, "run"), (runner, "launch"), (runner, "_launch_decode"), (runner, "_prefill"),
                 (runner, "_first_tokens"), (runner, "_read"), (runner.checkpoint_io, "release"),
                 (runner.checkpoint_io, "restore"), (runner.checkpoint_io, "after_forward"),
                 (runner.checkpoint_io, "keep_hidden"), (runner.sampler, "start"), (runner.sampler, "sample"),
                 (runner.model, "compute_logits"), (engine, "_hand_out")]
        labelled = [(owner, name, f"{type(owner).__name__}.{name}") for owner, name in parts]
        # The class's method: every launched step's (its reader waits for the device).
        labelled.append((InFlight, "result", "InFlight.result"))
        if runner.prefill_graphs is not None:
            labelled.append((runner.prefill_graphs, "run", "PrefillGraphs.run (target)"))
        if runner.speculator is not None:
            labelled += [(runner.speculator, "prefill_mtp", "Speculator.prefill_mtp"),
                         (runner.speculator, "launch", "Speculator.launch")]
        if runner.mtp_prefill_graphs is not None:
            labelled.append((runner.mtp_prefill_graphs, "run", "PrefillGraphs.run (MTP)"))
        for owner, name, label in labelled:
            if hasattr(owner, name):  # an older tree (an A/B baseline) may lack a part
                self._time(owner, name, label)

    def _time(self, owner, name: str, label: str) -> None:
        def record(seconds: float) -> None:
            if self.steps:
                host = self.steps[-1].setdefault("host_ms", {})
                host[label] = host.get(label, 0.0) + seconds * 1e3

        setattr(owner, name, timed(getattr(owner, name), record))


class SyncAudit:
    """Counts the call sites that made the host wait for the device (torch's synchronisation
    debug mode warns at each), by the kind of step dispatched last."""

    _PACKAGES = tuple(f"/{package}/" for package in ("engine", "spec", "kernels", "server"))

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.sites: Counter[tuple[str, str]] = Counter()

    def __enter__(self) -> "SyncAudit":
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return show(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if any(p in f.filename for p in self._PACKAGES)]
            site = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                              for f in reversed(frames[-3:])) or f"{filename}:{lineno}"
            self.sites[step_kind(self.trace.steps[-1]) if self.trace.steps else "none", site] += 1

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)

    def report(self) -> dict:
        """Per step kind: the sites, each with its waits per step of that kind."""
        steps = Counter(step_kind(s) for s in self.trace.steps)
        report: dict[str, dict[str, float]] = {}
        for (kind, site), count in self.sites.most_common():
            report.setdefault(kind, {})[site] = round(count / max(steps[kind], 1), 3)
        return {"steps": dict(steps), "waits_per_step": report}


class DeviceTimes:
    """Each step's device time: CUDA events recorded before and after its launch
    (Runner.launch, and Runner.run where an older tree runs admitting steps there), read after
    the run, so nothing waits for them while it runs. busy: the device from reaching the step to
    finishing it; idle: the device's wait for the host before it (the end of the step launched
    before to this one's start). By kind: "admit" (prefill chunks or cached rows), else the
    decode rows' draft count."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._depth = 0  # a `run` that calls `launch` is one step: only the outer call records
        for name in ("launch", "run"):
            setattr(runner, name, self._timed(getattr(runner, name)))

    def _timed(self, method):
        def timed(plan):
            if self._depth:
                return method(plan)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._depth += 1
            try:
                result = method(plan)
            finally:
                self._depth -= 1
            end.record()
            # Not StepPlan.admits: the trace also runs in baseline trees older than it.
            kind = "admit" if plan.prefill_rows or plan.cached_rows else \
                f"K={max((r.num_draft_tokens for r in plan.decode_rows), default=0)}"
            self.steps.append((kind, len(plan.rows), start, end))
            return result
        return timed

    def report(self) -> dict:
        """By kind: steps, mean busy and idle ms, and the mean rows; the decode steps again by
        their distance from the last admitting step ("admit+1" .. "admit+4", then "admit+5.."),
        which says whether a change's device idle sits beside admissions or in every step; and
        the totals."""
        torch.cuda.synchronize()
        by_kind: dict[str, list[tuple[int, float, float]]] = {}
        since = None  # steps since the last admitting one
        for (_, _, _, before), (kind, rows, start, end) in zip(self.steps, self.steps[1:]):
            entry = (rows, start.elapsed_time(end), max(before.elapsed_time(start), 0.0))
            by_kind.setdefault(kind, []).append(entry)
            since = 0 if kind == "admit" else None if since is None else since + 1
            if since:
                by_kind.setdefault(f"admit+{since}" if since < 5 else "admit+5..", []).append(entry)
        self.steps.clear()
        report = {k: {"steps": len(v), "rows": round(float(np.mean([r for r, _, _ in v])), 1),
                      "busy_ms": round(float(np.mean([b for _, b, _ in v])), 3),
                      "idle_ms": round(float(np.mean([i for _, _, i in v])), 3)}
                  for k, v in sorted(by_kind.items())}
        every = [entry for k, v in by_kind.items() if not k.startswith("admit+") for entry in v]
        report["total"] = {"busy_ms": round(sum(b for _, b, _ in every), 1), "idle_ms": round(sum(i for _, _, i in every), 1)}
        return report


def sender(engine: AsyncLLM, trace: Trace, max_tokens: int, temperature: float):
    counter = iter(range(10**9))

    async def send(prompt: str, origin: float, tokens: int | None = None):
        request_id = f"t{next(counter)}"
        params = SamplingParams(max_tokens=tokens or max_tokens, temperature=temperature, ignore_eos=True)
        sent = time.perf_counter()
        trace.requests.setdefault(request_id, {})["sent"] = sent
        times, num_tokens = [], 0
        async for delta in engine.generate(prompt, params, request_id):
            num_tokens += len(delta.token_ids)
            if not times:
                trace.requests[request_id]["delivered"] = time.perf_counter()
            if delta.text:
                times.append(time.perf_counter())
        return sample(sent, times, num_tokens, origin)

    return send


def _pct(values: list[float]) -> dict:
    """serve_benchmark's percentiles and mean, in ms."""
    return {name: round(value * 1e3, 3) for name, value in percentiles(values).items()} if values else {}


def analyse(trace: Trace, window: tuple[float, float]) -> dict:
    done = [(rid, r) for rid, r in trace.requests.items()
            if {"sent", "scheduled", "computed", "delivered"} <= r.keys() and window[0] <= r["sent"] <= window[1]]
    ttft = {rid: r["delivered"] - r["sent"] for rid, r in done}
    parts = {rid: {"submit": r.get("submitted", r["sent"]) - r["sent"],
                   "queue": r["scheduled"] - r["sent"], "step": r["computed"] - r["scheduled"],
                   "hand_out": r["delivered"] - r["computed"]} for rid, r in done}
    slowest = sorted(ttft, key=ttft.get)[-max(1, len(ttft) // 100):]

    def split(ids):
        return {name: _pct([parts[i][name] for i in ids]) for name in ("submit", "queue", "step", "hand_out")} | \
            {"ttft": _pct([ttft[i] for i in ids])}

    def overlapping(a: float, b: float) -> list[dict]:
        """The steps that ran at some point of [a, b]."""
        return [s for s in trace.steps if s["dispatch"] <= b and s.get("committed", b) >= a]

    def steps_between(a: float, b: float) -> list[dict]:
        """overlapping(a, b), their times in ms after a."""
        return [{k: (round((v - a) * 1e3, 3) if k in ("dispatch", "dispatched", "commit", "committed") else v)
                 for k, v in s.items()} for s in overlapping(a, b)]

    examples = [{"ttft_ms": round(ttft[i] * 1e3, 3), **{k: round(v * 1e3, 3) for k, v in parts[i].items()},
                 "steps": steps_between(trace.requests[i]["sent"], trace.requests[i]["delivered"])}
                for i in slowest[-5:]]
    # The slowest requests come in bursts (closed-loop streams that finished in the same step
    # arrive together): each burst of the slowest 1% (sent within 20 ms of each other) with the
    # steps and collections from its first send to its last first token.
    bursts: list[list[str]] = []
    for i in sorted(slowest, key=lambda i: trace.requests[i]["sent"]):
        if bursts and trace.requests[i]["sent"] - trace.requests[bursts[-1][-1]]["sent"] < 0.02:
            bursts[-1].append(i)
        else:
            bursts.append([i])

    def burst_report(ids: list[str]) -> dict:
        a = min(trace.requests[i]["sent"] for i in ids)
        b = max(trace.requests[i]["delivered"] for i in ids)
        return {"requests": len(ids), "ttft_ms": [round(ttft[i] * 1e3, 1) for i in ids],
                "prefilled": sum(1 for i in ids if trace.requests[i].get("prefilled")),
                "collections": [(round((s - a) * 1e3, 2), round((e - s) * 1e3, 2), g)
                                for s, e, g in trace.collections if a <= e and s <= b],
                "steps": [[round((s["dispatch"] - a) * 1e3, 1), round((s.get("committed", b) - a) * 1e3, 1),
                           s["decode_rows"], s["prefill_rows"], s["prefill_tokens"], s["cached_rows"],
                           s["waiting"], s["ahead"]] for s in overlapping(a, b)]}

    in_window = [s for s in trace.steps if window[0] <= s["dispatch"] <= window[1] and "committed" in s]
    durations = {kind: _pct([s["committed"] - s["dispatch"] for s in in_window if pick(s)])
                 for kind, pick in (("prefill", lambda s: s["prefill_rows"] + s["cached_rows"] > 0),
                                    ("decode_ahead", lambda s: not s["prefill_rows"] + s["cached_rows"] and s["ahead"]),
                                    ("decode_not_ahead",
                                     lambda s: not s["prefill_rows"] + s["cached_rows"] and not s["ahead"]))}
    # Where the window's wall time went: each step's share is from the end of the commit before
    # it to the end of its own (so the shares add up to the window), by kind, draft count and
    # whether it was launched ahead (back to back with the step before) or scheduled afresh.
    budget: dict[str, dict] = {}
    for before, step in zip(in_window, in_window[1:]):
        kind = "admit" if step["prefill_rows"] + step["cached_rows"] else \
            f"decode K={step['drafts']} {'ahead' if step['ahead'] else 'afresh'}"
        entry = budget.setdefault(kind, {"steps": 0, "ms": 0.0, "rows": 0})
        entry["steps"] += 1
        entry["ms"] += (step["committed"] - before["committed"]) * 1e3
        entry["rows"] += step["decode_rows"]
    for entry in budget.values():
        entry["mean_ms"], entry["mean_rows"] = round(entry["ms"] / entry["steps"], 3), round(entry["rows"] / entry["steps"], 1)
        entry["ms"] = round(entry["ms"], 1)
        del entry["rows"]
    host_by_kind = {}
    for kind in ("with_new_rows", "decode_only"):
        chosen = [s for s in in_window if step_kind(s) == kind]
        labels = {label for s in chosen for label in s.get("host_ms", {})}
        host_by_kind[kind] = {label: round(float(np.mean([s.get("host_ms", {}).get(label, 0.0) for s in chosen])), 3)
                              for label in sorted(labels)}
    return {"num_requests": len(done), "all": split(list(ttft)), "slowest_1pct": split(slowest),
            "mean_host_ms_per_step": host_by_kind,
            "num_steps": len(in_window),
            "steps_with_new_rows": sum(1 for s in in_window if s["prefill_rows"] + s["cached_rows"]),
            "step_dispatch_to_commit_end_ms": durations, "time_budget": dict(sorted(budget.items())), "slowest_examples": examples,
            "collections_in_window": [(round((e - s) * 1e3, 2), g) for s, e, g in trace.collections
                                      if window[0] <= s <= window[1]],
            "slowest_bursts_steps_columns": ["dispatch_ms", "committed_ms", "decode_rows", "prefill_rows",
                                             "prefill_tokens", "cached_rows", "waiting", "ahead"],
            "slowest_bursts": [burst_report(ids) for ids in bursts]}


def _host_memory_stats() -> dict:
    """torch's caching host allocator counters (flattened), {} where torch has none."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return dict(stats()) if stats is not None and torch.cuda.is_available() else {}


async def main(args: argparse.Namespace) -> dict:
    engine = AsyncLLM(config=EngineConfig(model=Path(args.model), device=args.device, dtype=args.dtype,
                                          max_num_seqs=args.max_running, num_draft_tokens=args.num_draft_tokens),
                      wait_in_loop=args.wait_in_loop)
    freeze_startup_heap()
    trace = Trace(engine)
    device_times = DeviceTimes(engine.core.runner) if args.device_times else None
    prompts = PromptSet("held-out code", tuple(load_prompts(Path(args.model), [], 128, 2000, 0)),
                        unique=args.unique_prompts, nonce=f"{time.time_ns():x}")
    window = Window(multiprocessing.get_context("spawn"))
    report = {}
    try:
        for streams in args.streams:
            trace.steps.clear()
            trace.requests.clear()
            trace.collections.clear()
            load = Load(f"streams{streams}", args.max_tokens, num_streams=streams, duration=args.duration)
            window.reset()
            origin = time.perf_counter()
            profile = cProfile.Profile() if args.profile else None
            pinned_before = _host_memory_stats()
            with SyncAudit(trace) if args.sync_audit else contextlib.nullcontext() as audit, \
                    profile if profile is not None else contextlib.nullcontext():
                await drive(load, load.share(0, 1), prompts, window,
                            sender(engine, trace, args.max_tokens, args.temperature), origin)
            if profile is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                with open(args.out / f"profile-{streams}.txt", "w") as text:
                    for order in ("tottime", "cumulative"):
                        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(60)
            start = origin + window.start
            report[str(streams)] = analyse(trace, (start, start + args.duration))
            # Pinned host memory: fresh cudaHostAlloc calls (the caching host allocator found no
            # block to reuse) and their time, over the run.
            pinned_after = _host_memory_stats()
            report[str(streams)]["pinned_host_memory"] = {
                key: value - pinned_before.get(key, 0) for key, value in pinned_after.items()
                if isinstance(value, (int, float)) and value != pinned_before.get(key, 0)}
            if (policy := engine.core.scheduler.draft_policy) is not None:
                snapshot = policy.snapshot()
                report[str(streams)]["draft_policy"] = {
                    "steps": snapshot["steps"],
                    "step_ms": {f"{b} rows K={k}": round(s * 1e3, 3) for (b, k), s in snapshot["step_seconds"].items()}}
            if audit is not None:
                report[str(streams)]["sync_audit"] = audit.report()
            if device_times is not None:
                report[str(streams)]["device_times"] = device_times.report()
            brief = {k: v for k, v in report[str(streams)].items() if k not in ("slowest_examples", "slowest_bursts")}
            print(streams, json.dumps(brief))
    finally:
        await engine.shutdown()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="default: the engine's (0: no MTP)")
    parser.add_argument("--unique-prompts", action="store_true", help="no prompt hits the prefix cache")
    parser.add_argument("--sync-audit", action="store_true",
                        help="count the call sites that make the host wait for the device")
    parser.add_argument("--device-times", action="store_true",
                        help="each launched decode step's device time (busy) and the device's wait before it (idle)")
    parser.add_argument("--wait-in-loop", action="store_true",
                        help="steps wait for the device in the event loop's thread (as in the engine's own process)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the event loop's thread over each run: DIR/profile-<streams>.txt")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    results = run(main(args))
    write_result(args.out, "ttft_trace", device_name(args.device), results)
