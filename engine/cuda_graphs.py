"""CUDA graphs of decode steps (decode_step.py, speculation.py), captured at start-up per batch bucket.

A decode step is dozens of small launches per layer; replaying a captured graph removes their
launch cost. Each bucket's graphs read their inputs from static buffers; a step with B rows
copies its packed rows into the first B entries and pads the rest of the bucket with rows that
point at scratch slot 0 and scratch KV block 0, so a padding row never touches a real sequence's
state.

`DecodeGraphs`: plain decode steps (no speculation), one graph per bucket.
`SpecGraphs`: the speculative stages, a draft graph and a verify graph per (bucket, K drafts
per row); the verify graph reads the draft graph's output, so between the two replays the
drafts can be edited in place.

Requires kernels with no host synchronisation and launch parameters that depend only on tensor
shapes (the Triton table). Knows nothing about requests: it is handed `DecodeRow`s.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from .decode_step import DecodeRow, DecodeRows, DecodeStep, pack_rows
from .speculation import Speculator, Verified


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (padding wastes at most 15 rows)."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_batch, 16)) if b < max_batch} | {max_batch})


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's collector must not run during a capture: objects it frees (tensors of earlier
    engines, pinned host buffers) release device or host memory through CUDA calls that are
    illegal while a stream captures, which invalidates the capture."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _warm_up(run, times: int) -> None:
    """Run eagerly on a side stream before a capture: compiles every kernel, sizes workspaces."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(stream)


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

    def load(self, rows: list[DecodeRow]) -> int:
        """Copy rows (and padding rows up to their bucket) into the static buffer (one pinned
        copy) and bring their block tables up to date on the device (DecodeStep.sync_tables).
        Returns the bucket."""
        bucket = self.bucket(len(rows))
        packed = pack_rows(rows, self.step.catch_up, self.step.block_size, bucket, pin_memory=True)
        self.rows.packed[:bucket].copy_(packed, non_blocking=True)
        self.step.sync_tables(rows)
        return bucket


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by replay
    tokens: torch.Tensor  # [bucket] their argmax


class DecodeGraphs(_StaticRows):
    def __init__(self, step: DecodeStep, max_batch: int, device: torch.device) -> None:
        super().__init__(step, max_batch, device)
        self.graphs: dict[int, _Graph] = {}

    @torch.inference_mode()
    @_no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            rows = self.rows.head(bucket)
            _warm_up(lambda: self.step.plain(rows), 2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, tokens = self.step.plain(rows)
            self.graphs[bucket] = _Graph(graph, logits, tokens)
        torch.cuda.synchronize()

    def run(self, rows: list[DecodeRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [B, V], greedy tokens [B]) of one decode step of the B rows."""
        entry = self.graphs[self.load(rows)]
        entry.graph.replay()
        return entry.logits[:len(rows)], entry.tokens[:len(rows)]


@dataclass
class _SpecGraph:
    draft: torch.cuda.CUDAGraph
    drafts: torch.Tensor     # [bucket, K] written by the draft replay, read by the verify replay
    verify: torch.cuda.CUDAGraph
    verified: Verified       # written by the verify replay


class SpecGraphs(_StaticRows):
    def __init__(self, step: DecodeStep, speculator: Speculator, max_batch: int, max_drafts: int,
                 device: torch.device) -> None:
        super().__init__(step, max_batch, device)
        self.speculator, self.max_drafts = speculator, max_drafts
        model = step.model
        # The verify logits of every graph.
        self.logits = torch.empty(max_batch * (max_drafts + 1), model.config.vocab_size,
                                  dtype=model.embed_tokens.dtype, device=device)
        self.graphs: dict[tuple[int, int], _SpecGraph] = {}

    @torch.inference_mode()
    @_no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        step = self.speculator
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            rows = self.rows.head(bucket)
            for num_drafts in range(self.max_drafts, -1, -1):
                logits = self.logits[:bucket * (num_drafts + 1)]
                _warm_up(lambda: step.verify(rows, step.draft(rows, num_drafts), logits), 1)
                draft = torch.cuda.CUDAGraph()
                with torch.cuda.graph(draft, pool=pool):
                    drafts = step.draft(rows, num_drafts)
                verify = torch.cuda.CUDAGraph()
                with torch.cuda.graph(verify, pool=pool):
                    verified = step.verify(rows, drafts, logits)
                self.graphs[bucket, num_drafts] = _SpecGraph(draft, drafts, verify, verified)
        torch.cuda.synchronize()

    def can_run(self, rows: list[DecodeRow], num_drafts: int) -> bool:
        return num_drafts <= self.max_drafts and self.fits(rows)

    def draft(self, rows: list[DecodeRow], num_drafts: int) -> tuple[DecodeRows, torch.Tensor]:
        """Load the rows and replay the draft graph -> (the bucket's DecodeRows, its drafts
        [bucket, K])."""
        bucket = self.load(rows)
        entry = self.graphs[bucket, num_drafts]
        entry.draft.replay()
        return self.rows.head(bucket), entry.drafts

    def verify(self, num_rows: int, num_drafts: int) -> Verified:
        """Replay the verify graph of the bucket `draft` used; outputs cover the whole bucket."""
        entry = self.graphs[self.bucket(num_rows), num_drafts]
        entry.verify.replay()
        return entry.verified
