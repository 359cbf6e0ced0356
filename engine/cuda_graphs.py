"""CUDA graphs of decode steps (decode_step.py, speculation.py), captured at start-up per batch bucket.

A decode step is dozens of small launches per layer; replaying a captured graph removes their
launch cost. Each bucket's graphs read their inputs from static buffers; a step with B rows
copies its packed rows into the first B entries and pads the rest of the bucket with rows that
point at scratch slot 0 and scratch KV block 0, so a padding row never touches a real sequence's
state.

`DecodeGraphs`: plain decode steps (no row drafts), one graph per (bucket, sampled).
`SpecGraphs`: speculative decode steps, one graph per (bucket, K drafts per row, sampled)
holding the whole step: fed rows, MTP catch-up and chain, the drafts' copy to the host (a branch
beside the verify: speculation.HostDrafts), verify, acceptance and rollback. With a draft editor
(tests, speculation.py) each is captured as two graphs, draft then verify, so the drafts can be
edited in place between the replays (and are copied to the host after the edit).

Every graph comes in two variants. The greedy one (sampled = False) takes each row's argmax
(greedy acceptance). The sampled one also draws every row whose slot samples, from its
parameters in the sampling table with the seeded noise of (seed, position) (DecodeStep.draw:
the kernel the runner's eager draw uses, so the same tokens), and in a speculative step accepts
those rows by rejection sampling (spec/accept.py), the rollback following. The runner replays
the sampled variant when a step has plainly sampled rows (SamplingParams.drawn_in_step), else
the greedy one, whose work is what it was before the variants existed; penalized and
constrained rows are redecided after either (runner.py, speculation.py). Both variants are
captured at start-up into one memory pool, and every graph of a kind writes its logits into one
static buffer, so the variants add capture time but no logits memory.

`measure` times every captured greedy graph at start-up (replays on padding rows); the
draft-length policy chooses each step's K from those costs and its own per-row sampling cost
(spec/adaptive.py).

Requires kernels with no host synchronisation and launch parameters that depend only on tensor
shapes (the Triton table). Knows nothing about requests: it is handed `DecodeRow`s.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .decode_step import DecodeRow, DecodeRows, DecodeStep, pack_rows
from .speculation import Drafted, Speculator


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (padding wastes at most 15 rows)."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_batch, 16)) if b < max_batch} | {max_batch})


@contextlib.contextmanager
def no_garbage_collection():
    """Python's collector must not run during a capture: objects it frees (tensors of earlier
    engines, pinned host buffers) release device or host memory through CUDA calls that are
    illegal while a stream captures, which invalidates the capture."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def warm_up_on_side_stream(run, times: int) -> None:
    """Run eagerly on a side stream before a capture: compiles every kernel, sizes workspaces."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(stream)


def release(graphs: Iterable[torch.cuda.CUDAGraph | None]) -> None:
    """Destroy captured graphs now rather than when their last reference goes."""
    for graph in graphs:
        if graph is not None:
            graph.reset()


class _StaticRows:
    """The static decode rows of the largest bucket, and a step's copy into them."""

    def __init__(self, step: DecodeStep, max_batch: int, device: torch.device) -> None:
        self.step = step
        self.buckets = default_buckets(max_batch)
        self.rows = DecodeRows.zeros(max_batch, step.catch_up, device)

    def fits(self, rows: list[DecodeRow]) -> bool:
        return 0 < len(rows) <= self.buckets[-1]

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    def measure(self, graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
        """Median seconds of a replay (after one untimed)."""
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    def load(self, rows: list[DecodeRow]) -> int:
        """Copy rows (and padding rows up to their bucket) into the static buffer (one pinned
        copy), their block tables' changes with them (DecodeStep.sync_tables). Returns the
        bucket."""
        bucket = self.bucket(len(rows))
        packed = pack_rows(rows, self.step.catch_up, self.step.block_size, bucket, pin_memory=True,
                           appends=self.step.sync_tables(rows))
        self.rows.packed[:bucket].copy_(packed, non_blocking=True)
        return bucket


# Warm-up runs before a capture: the greedy variant's compile the model's kernels and size its
# workspaces, after which the sampled variant's one run has only the sampling kernels to compile.
_WARM_UPS = {False: 2, True: 1}


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bucket] the step's tokens (DecodeStep.emitted[0])


class DecodeGraphs(_StaticRows):
    def __init__(self, step: DecodeStep, max_batch: int, device: torch.device) -> None:
        super().__init__(step, max_batch, device)
        # The logits of every graph ([max_batch, V], the model's dtype): a step's are read before
        # the next step replays any graph (runner.py).
        self.logits = torch.empty(max_batch, step.model.config.vocab_size, dtype=step.model.embed_tokens.dtype,
                                  device=device)
        self.graphs: dict[tuple[int, bool], _Graph] = {}

    @torch.inference_mode()
    @no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            rows, logits = self.rows.head(bucket), self.logits[:bucket]
            for sampled in (False, True):
                warm_up_on_side_stream(lambda: self.step.plain(rows, sampled, logits), _WARM_UPS[sampled])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    _, tokens = self.step.plain(rows, sampled, logits)
                self.graphs[bucket, sampled] = _Graph(graph, tokens)
        torch.cuda.synchronize()

    def run(self, rows: list[DecodeRow], sampled: bool) -> tuple[DecodeRows, torch.Tensor, torch.Tensor]:
        """(the B rows on the device, logits [B, V] in the model's dtype, the step's tokens [B]) of one decode
        step of the B rows; sampled: replay the variant that draws sampling rows."""
        bucket = self.load(rows)
        entry = self.graphs[bucket, sampled]
        entry.graph.replay()
        return self.rows.head(len(rows)), self.logits[:len(rows)], entry.tokens[:len(rows)]

    def step_costs(self) -> dict[int, float]:
        """Seconds of a plain (greedy) step by bucket."""
        return {bucket: self.measure(entry.graph) for (bucket, sampled), entry in self.graphs.items() if not sampled}

    def release(self) -> None:
        """Destroy the graphs, both variants (Runner.release_graphs)."""
        release(entry.graph for entry in self.graphs.values())
        self.graphs.clear()


@dataclass
class _SpecGraph:
    graph: torch.cuda.CUDAGraph        # the whole step, or its draft half when `verify` is set
    verify: torch.cuda.CUDAGraph | None
    drafts: torch.Tensor               # [bucket, K] written by the draft (half)
    logits: torch.Tensor               # [bucket * (K + 1), V] verify logits


class SpecGraphs(_StaticRows):
    def __init__(self, step: DecodeStep, speculator: Speculator, max_batch: int, max_drafts: int,
                 device: torch.device, split: bool = False) -> None:
        """split: capture draft and verify apart (a draft editor edits in between)."""
        super().__init__(step, max_batch, device)
        self.speculator, self.max_drafts, self.split = speculator, max_drafts, split
        # The verify logits of every graph.
        self.logits = torch.empty(max_batch * (max_drafts + 1), step.model.config.vocab_size,
                                  dtype=step.model.embed_tokens.dtype, device=device)
        self.graphs: dict[tuple[int, int, bool], _SpecGraph] = {}

    @torch.inference_mode()
    @no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        speculator = self.speculator
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            rows = self.rows.head(bucket)
            for num_drafts in range(self.max_drafts, 0, -1):  # no row drafting: a plain step
                logits = self.logits[:bucket * (num_drafts + 1)]
                for sampled in (False, True):
                    warm_up_on_side_stream(lambda: speculator.step(rows, num_drafts, logits, sampled), 1)
                    graph, verify = torch.cuda.CUDAGraph(), None
                    if self.split:
                        with torch.cuda.graph(graph, pool=pool):
                            drafts = speculator.draft(rows, num_drafts)
                        verify = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(verify, pool=pool):
                            speculator.verify(rows, drafts, logits, sampled)
                    else:
                        with torch.cuda.graph(graph, pool=pool):
                            drafts, _ = speculator.step(rows, num_drafts, logits, sampled)
                    self.graphs[bucket, num_drafts, sampled] = _SpecGraph(graph, verify, drafts, logits)
        torch.cuda.synchronize()

    def can_run(self, rows: list[DecodeRow], num_drafts: int) -> bool:
        """A step where no row drafts is a plain one (DecodeGraphs), unless it rides along
        with cached rows; that rare step runs eagerly."""
        return 0 < num_drafts <= self.max_drafts and self.fits(rows)

    def run(self, rows: list[DecodeRow], num_drafts: int, sampled: bool,
            edit: Callable[[torch.Tensor], None] | None = None) -> Drafted:
        """Load the rows and replay the step's graph(s) (sampled: the variant that draws and
        accepts sampling rows by rejection sampling); edit: called with the rows' drafts [B, K]
        between the draft and verify halves (split graphs only). Outputs are views of the
        static buffers, the first B rows of the bucket."""
        num_rows = len(rows)
        entry = self.graphs[self.load(rows), num_drafts, sampled]
        entry.graph.replay()
        if entry.verify is not None:
            if edit is not None:
                edit(entry.drafts[:num_rows])
            host_drafts = self.speculator.host_drafts
            host_drafts.copy(entry.drafts[:num_rows])
            entry.verify.replay()
            host_drafts.join()
        return Drafted(self.rows.head(num_rows), entry.drafts[:num_rows], entry.logits[:num_rows * (num_drafts + 1)])

    def step_costs(self) -> dict[tuple[int, int], float]:
        """Seconds of a speculative (greedy) step by (bucket, K) (both halves when split)."""
        return {(bucket, num_drafts): self.measure(entry.graph) +
                (self.measure(entry.verify) if entry.verify is not None else 0.0)
                for (bucket, num_drafts, sampled), entry in self.graphs.items() if not sampled}

    def release(self) -> None:
        """Destroy the graphs, both variants (Runner.release_graphs)."""
        release(graph for entry in self.graphs.values() for graph in (entry.graph, entry.verify))
        self.graphs.clear()
