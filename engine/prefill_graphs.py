"""CUDA graphs of prefill forwards, captured at start-up per (tokens, rows) bucket.

A small model's prefill step is host-bound: its eager forward is ~120 kernel launches and ~150
torch ops whatever its tokens, 10-20 ms of host time against 1-3 ms of kernels for the shipped
model on an H200 (bench/step_trace.py), and every running stream waits for it. A step whose
prefill chunks fit a bucket copies its metadata, padded to the bucket (batch.Padding: padding
rows in scratch slot 0 over scratch KV block 0), into the bucket's static inputs with one copy
and replays the forward. Two forwards are captured so (core.py): the target's, whose prefix-cache
checkpoint writes are part of it, and, with speculation, the MTP's over the chunks' positions
(Speculator.prefill_mtp), one layer whose eager host time rivals the target's; it reads a static
buffer of input hidden states [tokens, H] that the caller fills before the replay. The first
tokens' sampling and the checkpoints' hidden states stay eager (runner.py).

Buckets: tokens 64, 128, .. max_num_batched_tokens (powers of two, and the budget itself) x rows
2, 4, .. (powers of two up to the first >= max_num_seqs + 1: one padding row at least); a bucket's
graph runs tokens + rows tokens (room for the padding rows' tokens, at least one each) and has
room for rows + tokens / checkpoint_interval checkpoints, or none (a step needing more runs eagerly).
Captured smallest token bucket first; at each, the start-up times the eager forward of its
largest row bucket against the replay and stops capturing where the replay saves less than a
third: a GPU-bound forward (a large model's long prefill) gains nothing from a graph and would
pay for its padding. Requires what the decode graphs require (cuda_graphs.py). Knows nothing
about requests or which model it runs: it is handed a forward and `Row`s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .batch import BatchLayout, ForwardBatch, Padding, Row, device_arrays, packed_size
from .cuda_graphs import no_garbage_collection, release, warm_up_on_side_stream

# What a graph captures: (the batch, the static input hidden states [tokens, H] or None) -> the
# output hidden states [tokens, H].
Forward = Callable[[ForwardBatch, torch.Tensor | None], torch.Tensor]

MIN_TOKENS = 64
# A bucket is captured while its replay takes at most this share of the eager forward's time.
HOST_BOUND_SHARE = 2 / 3


def token_buckets(max_tokens: int) -> list[int]:
    """64, 128, .. up to max_tokens, and max_tokens itself."""
    buckets, tokens = [], MIN_TOKENS
    while tokens < max_tokens:
        buckets.append(tokens)
        tokens *= 2
    return buckets + [max_tokens]


def row_buckets(max_rows: int) -> list[int]:
    """2, 4, .. up to the first power of two >= max_rows + 1 (a bucket has a padding row)."""
    buckets = [2]
    while buckets[-1] < max_rows + 1:
        buckets.append(2 * buckets[-1])
    return buckets


@dataclass
class _PrefillGraph:
    padding: Padding
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor       # the static metadata (device_arrays' packed buffer)
    batch: ForwardBatch        # views of `packed`, logits_indices empty
    inputs: torch.Tensor | None  # [padding.num_tokens, H] static input hidden states (a view)
    hidden: torch.Tensor       # [padding.num_tokens, H] written by a replay


class PrefillGraphs:
    def __init__(self, forward: Forward, block_size: int, table_width: int, max_tokens: int, max_rows: int,
                 checkpoint_interval: int | None, commit: bool, device: torch.device,
                 inputs: tuple[int, torch.dtype] | None = None) -> None:
        """table_width: blocks of the longest sequence (every bucket's block tables are that
        wide); checkpoint_interval: None for a forward whose rows write no checkpoints; commit:
        as the eager prefill batches' (ForwardBatch.commit); inputs: (H, dtype) of the static
        input buffer the forward reads (None: it reads none)."""
        self.forward = forward
        self.block_size, self.table_width, self.commit, self.device = block_size, table_width, commit, device
        self.interval = checkpoint_interval
        self.token_buckets = [t for t in token_buckets(max_tokens) if t >= MIN_TOKENS]
        self.row_buckets = row_buckets(max_rows)
        # One buffer for every bucket (a bucket's inputs are its first rows): replays never overlap.
        largest = max(self.token_buckets, default=0) + self.row_buckets[-1]
        self.inputs = None if inputs is None else torch.zeros(largest, inputs[0], dtype=inputs[1], device=device)
        self.graphs: list[_PrefillGraph] = []    # by tokens, then rows: the first that fits is the smallest
        self.timings: dict[int, tuple[float, float]] = {}  # token bucket -> (eager s, replay s)

    @torch.inference_mode()
    @no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        capacity = self.table_width * self.block_size
        for tokens in self.token_buckets:
            # A bucket's padding rows share its tokens and must stay inside their block tables
            # (an engine whose context is shorter than its step budget has few long buckets).
            # Room for `tokens` real tokens beside r - 1 rows and the padding rows' tokens.
            def padding(r: int) -> Padding:
                checkpoints = 0 if self.interval is None else r + tokens // self.interval
                return Padding(tokens + r, r, checkpoints, self.table_width)

            rows = [r for r in self.row_buckets if r <= tokens and padding(r).max_row_tokens(0, 0) <= capacity]
            if not rows:
                break
            # The largest row bucket first: it decides whether this token bucket pays.
            largest = self._capture(padding(rows[-1]), pool)
            eager, replay = self._eager_seconds(largest), _seconds(largest.graph.replay)
            self.timings[tokens] = (eager, replay)
            if replay > HOST_BOUND_SHARE * eager:
                break
            self.graphs += [self._capture(padding(r), pool) for r in rows[:-1]] + [largest]
        torch.cuda.synchronize()

    def _capture(self, padding: Padding, pool) -> _PrefillGraph:
        layout = BatchLayout.of([], [], self.block_size, padding)
        arrays = dict(layout.arrays, logits_indices=layout.arrays["logits_indices"][:0])
        packed = torch.empty(packed_size(arrays), dtype=torch.uint8, device=self.device)
        batch = layout.batch(device_arrays(arrays, self.device, into=packed), self.commit)
        inputs = None if self.inputs is None else self.inputs[:padding.num_tokens]
        warm_up_on_side_stream(lambda: self.forward(batch, inputs), 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.forward(batch, inputs)
        return _PrefillGraph(padding, graph, packed, batch, inputs, hidden)

    def release(self) -> None:
        """Destroy the graphs (Runner.release_graphs)."""
        release(entry.graph for entry in self.graphs)
        self.graphs.clear()

    def _eager_seconds(self, entry: _PrefillGraph) -> float:
        return _seconds(lambda: self.forward(entry.batch, entry.inputs))

    def run(self, rows: Sequence[Row], fill: Callable[[torch.Tensor], None] | None = None
            ) -> tuple[ForwardBatch, torch.Tensor] | None:
        """(the batch, hidden [tokens, H]) of the prefill forward over `rows` by a graph replay:
        the rows' tokens come first, in order, then the padding's. fill: writes the rows' input
        hidden states into the view [tokens of the rows, H] of the static inputs it is handed,
        before the replay (graphs with inputs). None: no bucket fits, or a row turns by three
        positions (multimodal RoPE: the graphs' positions are [T]); nothing was filled."""
        if any(r.rope is not None for r in rows):
            return None
        num_tokens = sum(len(r.token_ids) for r in rows)
        num_checkpoints = sum(len(r.checkpoints) for r in rows)
        width = max(len(r.block_table) for r in rows)
        capacity = self.table_width * self.block_size
        entry = next((g for g in self.graphs if g.padding.fits(num_tokens, len(rows), num_checkpoints, width)
                      and g.padding.max_row_tokens(num_tokens, len(rows)) <= capacity), None)
        if entry is None:
            return None
        layout = BatchLayout.of([], rows, self.block_size, entry.padding)
        logits_indices = layout.arrays["logits_indices"]   # the one array whose shape varies: copied apart
        device_arrays(dict(layout.arrays, logits_indices=logits_indices[:0]), self.device, into=entry.packed)
        if fill is not None:
            fill(entry.inputs[:num_tokens])
        entry.graph.replay()
        indices = device_arrays({"logits_indices": logits_indices}, self.device)["logits_indices"]
        return dataclasses.replace(entry.batch, logits_indices=indices), entry.hidden

    def describe(self) -> str:
        kept = sorted({g.padding.num_tokens - g.padding.num_rows for g in self.graphs})
        timings = ", ".join(f"{t}: {1e3 * e:.2f} -> {1e3 * r:.2f} ms" for t, (e, r) in self.timings.items())
        return f"token buckets {kept} x row buckets {self.row_buckets} (eager -> replay: {timings})"


def _seconds(run, times: int = 3) -> float:
    """Median wall seconds of run(), synchronized (after one untimed)."""
    run()
    samples = []
    for _ in range(times):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]
