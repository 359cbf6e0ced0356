"""Host time of a decode step by part, speculative against plain, and the host cost of a CUDA
graph replay. The engine's own loop (`LLM.generate`, steps launched ahead), 16 sampled requests
(T = 0.7) of 512 tokens on the shipped model: run once to warm up, then timed.

    python bench/tools/step_host_split.py [--out DIR]   -> DIR/step_host_split-<gpu>.json

`parts_ms_per_step`: inclusive wall time of each wrapped method per step, with its call count
(parts nest: `Runner.launch` holds `Speculator.launch`, which holds `SpecGraphs.run`, which holds
`_StaticRows.load`, which holds `pack_rows` and `DecodeStep.sync_tables`). `graph_replay`: the
host time of `CUDAGraph.replay` for captured decode graphs with the device idle, right after a
replay of the same graph and right after another graph's (medians of 30), and each graph's
device time (`_StaticRows.measure`). Knows the engine through the methods it wraps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import timed, write_result  # noqa: E402
from deltaspec.engine import LLM, SamplingParams, core, cuda_graphs, decode_step, runner, scheduler  # noqa: E402
from deltaspec.engine import speculation  # noqa: E402
from deltaspec.server.acceptance_benchmark import device_name  # noqa: E402
from deltaspec.spec import adaptive  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
PARTS = [(core.EngineCore, "dispatch"), (core.EngineCore, "commit"), (scheduler.Scheduler, "commit"),
         (scheduler.Scheduler, "continuation"), (scheduler.Scheduler, "_record_verify"),
         (scheduler.Scheduler, "_choose_drafts"), (adaptive.DraftPolicy, "choose"), (adaptive.DraftPolicy, "record"),
         (adaptive.DraftPolicy, "observe"), (runner.Runner, "launch"), (runner.Runner, "_launch_plain"),
         (runner.Runner, "_hand_over"), (runner.InFlight, "decide"), (runner.InFlight, "result"),
         (speculation.Speculator, "launch"), (cuda_graphs.SpecGraphs, "run"), (cuda_graphs.DecodeGraphs, "run"),
         (cuda_graphs._StaticRows, "load"), (decode_step.DecodeStep, "sync_tables"),
         (torch.cuda.CUDAGraph, "replay")]


class Timers:
    """Inclusive seconds and calls of each wrapped method (and of cuda_graphs.pack_rows)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for owner, name in PARTS:
            setattr(owner, name, self._timed(getattr(owner, name), f"{owner.__name__}.{name}"))
        cuda_graphs.pack_rows = self._timed(cuda_graphs.pack_rows, "pack_rows")

    def _timed(self, function, label: str):
        def record(seconds: float) -> None:
            self.seconds[label] += seconds
            self.calls[label] += 1

        return timed(function, record)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def graph_replay(llm: LLM) -> dict:
    plain, spec = llm.core.runner.graphs, llm.core.runner.spec_graphs
    cases = {"plain, 16 rows, sampled": plain.graphs[16, True].graph,
             "plain, 32 rows, sampled": plain.graphs[32, True].graph}
    if spec is not None:
        cases["1 draft, 16 rows, sampled"] = spec.graphs[16, 1, True].graph
        cases["3 drafts, 16 rows, sampled"] = spec.graphs[16, 3, True].graph

    def host_ms(graph) -> float:
        start = time.perf_counter()
        graph.replay()
        return (time.perf_counter() - start) * 1e3

    report = {}
    for name, graph in cases.items():
        other = cases["plain, 32 rows, sampled"] if name != "plain, 32 rows, sampled" else cases["plain, 16 rows, sampled"]
        idle, same, after_other = [], [], []
        for _ in range(30):
            torch.cuda.synchronize()
            idle.append(host_ms(graph))
            torch.cuda.synchronize()
            graph.replay()
            same.append(host_ms(graph))
            torch.cuda.synchronize()
            other.replay()
            after_other.append(host_ms(graph))
        torch.cuda.synchronize()
        report[name] = {key: round(statistics.median(values), 4) for key, values in
                        (("host_ms_device_idle", idle), ("host_ms_after_same_graph", same),
                         ("host_ms_after_other_graph", after_other))}
        report[name]["device_ms"] = round(plain.measure(graph, replays=30) * 1e3, 4)
    return report


def main(args: argparse.Namespace) -> dict:
    timers = Timers()
    prompts = [f"def function_{i}(x):\n    return" for i in range(16)]
    params = SamplingParams(max_tokens=512, temperature=0.7, ignore_eos=True)
    report = {}
    for name, options in (("speculative", {}), ("plain", {"num_draft_tokens": 0})):
        llm = LLM(str(args.model), device="cuda", dtype="bfloat16", **options)
        llm.generate(prompts, params)
        timers.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        steps = timers.calls["EngineCore.commit"]
        report[name] = {"steps": steps, "ms_per_step": round(wall * 1e3 / steps, 4),
                        "parts_ms_per_step": {label: [round(seconds * 1e3 / steps, 4), timers.calls[label]]
                                              for label, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1])},
                        "graph_replay": graph_replay(llm)}
        print(name, json.dumps(report[name]), flush=True)
        del llm
        torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    results = main(args)
    write_result(args.out, "step_host_split", device_name("cuda"), results)
