"""The physical floor of a decode step (issue #32): how fast the bytes a step reads can be read
at all, and in the step's launch structure, beside the engine's own step, on one GPU in one run.

    python bench/decode_floor.py [--shape 0.8b] [--batch 1] [--out DIR]

The bytes are decode_reads.py's: the step's launches in order, each with what it reads (weights,
the batch's recurrent and conv state and KV context, activations), from the model's forward
traced on the CPU. Each launch's bytes (padded to 256) lie one after another in one int32 arena
of random words, which the read kernel (stream_read.py: vectorized loads, a sum per program
stored so the loads stay) reads. Rows, each in µs per step, GB/s and share of the roofline:

    roofline          bytes / copy bandwidth, the bandwidth (read + write bytes per second) of
                      torch's device-to-device copy of the arena
    read, 1 launch    (a) one read of the whole arena
    read, per layer   (c) one launch per decoder layer, plus one for the final norm and head:
                      what a step of fully fused layers launches
    read, per kernel  (b) one launch per launch of the step, over that launch's bytes: the best
                      an unfused engine with the step's launch count can do
    engine step       (d) the model's decode step (profile_step.measure: random weights, CONTEXT
                      tokens of context per row; the engine's PDL setting)

(b) and (c) with and without programmatic dependent launch (kernels/launch.py) where the GPU has
it. Every row is a CUDA graph of GRAPH_CALLS steps, timed as its median replay after warm-up
(common.graph_time_us), as profile_step times (d). The read kernel's tile and grid are the
fastest of a small sweep over the whole arena. Writes (the new state, KV and activations) are
not counted: at batch 1 of the 0.8B shape the recurrent state written back is ~1% of the bytes.

Writes bench/results/decode_floor-<gpu>.json (batch 1; decode_floor_b<N>-<gpu>.json otherwise)
and a PNG bar chart beside it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import itertools
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
import triton

from common import commit_id, device_tag, graph_time_us
from decode_reads import CONTEXT, Read, decode_reads, shape_config
from profile_step import measure as measure_engine_step
from spec_step import GRAPH_CALLS, random_model
from stream_read import ReadConfig, stream_read
from deltaspec.kernels.device import num_sms, supports_dependent_launch
from deltaspec.kernels.launch import dependent_launch

ALIGN_WORDS = 64   # each launch's bytes start 256-byte aligned (int32 words)
GRANULARITIES = ("step", "layer", "kernel")
SWEEP = tuple(ReadConfig(block, 4, per_sm) for block in (1024, 2048, 4096) for per_sm in (2, 4, 8))


@dataclass(frozen=True)
class Span:
    """A launch's range of the arena, in int32 words."""

    start: int
    num_words: int


def launch_spans(reads: Sequence[Read], granularity: str) -> list[Span]:
    """The arena ranges the launches of one granularity read: "kernel" one per read (its bytes
    padded to ALIGN_WORDS words, in the step's order), "layer" the consecutive reads of one
    layer merged, "step" the whole arena. Every granularity covers the same words."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    sizes = [triton.cdiv(read.num_bytes, 4 * ALIGN_WORDS) * ALIGN_WORDS for read in reads]
    starts = list(itertools.accumulate(sizes, initial=0))
    if granularity == "step":
        return [Span(0, starts[-1])]
    spans = [Span(start, size) for start, size in zip(starts, sizes)]
    if granularity == "kernel":
        return spans
    merged = []
    for _, group in itertools.groupby(zip(reads, spans), key=lambda pair: pair[0].layer):
        layer_spans = [span for _, span in group]
        merged.append(Span(layer_spans[0].start, sum(span.num_words for span in layer_spans)))
    return merged


class ReadChain:
    """stream_read launched over each span of one arena in order, each launch with its own
    slice of `partials` (a program's tile sum; nothing reads them but the test)."""

    def __init__(self, words: torch.Tensor, spans: Sequence[Span], config: ReadConfig, dependent: bool) -> None:
        sms = num_sms(words.device)
        programs = [config.num_programs(span.num_words, sms) for span in spans]
        self.partials = torch.zeros(sum(programs), dtype=torch.int32, device=words.device)
        self.launches = [(words[span.start:span.start + span.num_words], self.partials[first:first + count])
                         for span, first, count in zip(spans, itertools.accumulate(programs, initial=0), programs)]
        self.config, self.dependent = config, dependent

    def __len__(self) -> int:
        return len(self.launches)

    def __call__(self) -> None:
        for words, partials in self.launches:
            stream_read(words, partials, self.config, self.dependent)


def step_us(step) -> float:
    return graph_time_us(lambda _: step(), GRAPH_CALLS)


def row(name: str, launches: int | None, dependent: bool | None, us: float, num_bytes: int, roofline_us: float) -> dict:
    return {"name": name, "launches": launches, "dependent_launch": dependent, "us_per_step": us,
            "gb_per_s": num_bytes / us / 1e3, "share_of_roofline": roofline_us / us}


def measure_floor(reads: Sequence[Read], device: torch.device) -> dict:
    """Rows roofline, (a), (c), (b) over an arena of the reads' bytes, and the read sweep."""
    num_bytes = sum(read.num_bytes for read in reads)
    spans = {granularity: launch_spans(reads, granularity) for granularity in GRANULARITIES}
    words = torch.empty(spans["step"][0].num_words, dtype=torch.int32, device=device).random_()
    copy_us = step_us(partial(torch.Tensor.copy_, torch.empty_like(words), words))
    bandwidth = 2 * words.numel() * 4 / (copy_us * 1e-6)
    roofline_us = num_bytes / bandwidth * 1e6
    sweep = [{**dataclasses.asdict(config), "us": step_us(ReadChain(words, spans["step"], config, False))}
             for config in SWEEP]
    best = ReadConfig(**{key: value for key, value in min(sweep, key=lambda entry: entry["us"]).items() if key != "us"})
    whole = ReadChain(words, spans["step"], best, dependent=False)  # one launch a step: no PDL to overlap within it
    rows = [row("roofline", None, None, roofline_us, num_bytes, roofline_us),
            row("read, 1 launch", 1, None, step_us(whole), num_bytes, roofline_us)]
    for granularity in ("layer", "kernel"):
        for dependent in (False, True) if supports_dependent_launch(device) else (False,):
            chain = ReadChain(words, spans[granularity], best, dependent)
            rows.append(row(f"read, per {granularity}", len(chain), dependent, step_us(chain), num_bytes, roofline_us))
    return {"bytes_streamed": words.numel() * 4, "copy_us": copy_us, "copy_bandwidth_bytes_per_s": bandwidth,
            "roofline_us": roofline_us, "read_config": dataclasses.asdict(best), "read_config_sweep": sweep,
            "rows": rows}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [r["name"] + ("" if r["dependent_launch"] is None else " (PDL)" if r["dependent_launch"] else " (no PDL)")
              for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    colors = ["tab:gray" if r["launches"] is None else "tab:orange" if r["name"] == "engine step" else "tab:blue"
              for r in rows]
    bars = ax.barh(labels[::-1], [r["us_per_step"] for r in rows][::-1], color=colors[::-1])
    for bar, r in zip(bars, rows[::-1]):
        launches = "" if r["launches"] is None else f", {r['launches']} launch" + "es" * (r["launches"] > 1)
        ax.annotate(f" {r['us_per_step']:.0f} µs, {r['share_of_roofline']:.0%}{launches}",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlabel("µs per decode step (CUDA graph replay)")
    ax.set_xlim(0, 1.35 * max(r["us_per_step"] for r in rows))
    ax.set_title(f"{report['shape']} decode step at batch {report['batch']}: {report['bytes_read_per_step'] / 1e9:.2f} "
                 f"GB read, {report['device']} ({report['commit'][:7]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    device = torch.device("cuda")
    reads = decode_reads(shape_config(args.shape), args.batch)
    name = torch.cuda.get_device_name()
    report = {"benchmark": "decode_floor", "device": name, "shape": args.shape, "batch": args.batch,
              "context": CONTEXT, "dtype": "bfloat16",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "torch": torch.__version__,
              "triton": triton.__version__, "steps_per_graph": GRAPH_CALLS,
              "bytes_read_per_step": sum(read.num_bytes for read in reads),
              "bytes_by_kind": {kind: sum(getattr(read, f"{kind}_bytes") for read in reads)
                                for kind in ("weight", "state", "activation")}}
    by_op: dict[str, dict] = collections.defaultdict(lambda: {"launches": 0, "bytes": 0})
    for read in reads:
        by_op[read.op]["launches"] += 1
        by_op[read.op]["bytes"] += read.num_bytes
    report["launches_by_op"] = dict(by_op)
    report.update(measure_floor(reads, device))
    torch.cuda.empty_cache()
    engine = measure_engine_step(random_model(args.shape, "cuda", torch.bfloat16), args.batch, 0)
    report["rows"].append(row("engine step", engine["launches_per_step"], dependent_launch(device),
                              engine["graph_replay_us"], report["bytes_read_per_step"], report["roofline_us"]))
    report["engine"] = engine
    report["reads"] = [[read.op, read.layer, read.num_bytes, *read.tensors] for read in reads]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.batch == 1 else f"_b{args.batch}"
    path = args.out / f"decode_floor{suffix}-{device_tag(name)}.json"
    path.write_text(json.dumps(report, indent=2))
    plot(report, path.with_suffix(".png"))
    print(f"{name}: {report['bytes_read_per_step'] / 1e9:.3f} GB read per step, copy bandwidth "
          f"{report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, read config {report['read_config']}")
    for r in report["rows"]:
        pdl = "" if r["dependent_launch"] is None else " PDL" if r["dependent_launch"] else " no PDL"
        launches = f"{r['launches']:4d} launches" if r["launches"] else ""
        print(f"  {r['name'] + pdl:26s} {launches:13s} {r['us_per_step']:8.1f} us {r['gb_per_s']:6.0f} GB/s "
              f"{r['share_of_roofline']:6.1%}")
    print(f"  engine: kernels {engine['kernel_sum_us']:.0f} us, graph overhead {engine['graph_overhead_us']:.0f} us")
    print("wrote", path)


if __name__ == "__main__":
    main()
