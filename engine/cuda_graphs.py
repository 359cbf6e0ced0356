"""CUDA graphs for decode steps, captured at start-up per batch-size bucket.

A decode step (every row feeds one token through the recurrent kernels) is dozens of small
launches per layer; replaying a captured graph removes their launch cost. Each bucket's graph
reads its inputs from static buffers; a step with B rows copies its metadata into the first B
entries and pads the rest of the bucket with rows that point at scratch slot 0 and scratch KV
block 0 (context length 1), so a padding row never touches a real sequence's state.

`DecodeGraphs`: plain decode steps (no speculation), one graph per bucket.
`SpecGraphs`: the speculative stages of spec_decode.py, a draft graph and a verify graph per
(bucket, K drafts per row); the verify graph reads the draft graph's output, so between the two
replays the drafts can be edited in place.

Requires kernels with no host synchronisation and launch parameters that depend only on tensor
shapes (the Triton table). Knows nothing about requests: it is handed `Row`s / `SpecRow`s.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from .batch import ForwardBatch, Row, RowGroup
from .models import HybridLM
from .spec_decode import SpecDecoder, SpecRow, SpecRows, Verified, pack_rows
from .state_pool import KVPool, StatePool


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


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by replay


class DecodeGraphs:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, block_size: int, max_batch: int,
                 max_blocks_per_row: int, device: torch.device) -> None:
        self.model, self.states, self.kv = model, states, kv
        self.block_size, self.max_batch, self.max_blocks = block_size, max_batch, max_blocks_per_row
        self.buckets = default_buckets(max_batch)
        b = max_batch

        def buffer(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Static inputs; padding values (zeros / ones below) make every unused row a scratch row.
        self.input_ids = buffer(b, dtype=torch.int64)
        self.positions = buffer(b, dtype=torch.int64)
        self.slot_ids = buffer(b)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = buffer(b, max_blocks_per_row)
        self.slot_mapping = buffer(b, dtype=torch.int64)
        self.cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.row_indices = torch.arange(b, dtype=torch.int64, device=device)
        self.has_state = torch.ones(b, dtype=torch.bool, device=device)
        self.empty_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self.empty_rows = torch.zeros(0, dtype=torch.int32, device=device)
        self.empty_flags = torch.zeros(0, dtype=torch.bool, device=device)
        self.graphs: dict[int, _Graph] = {}

    def batch_for(self, bucket: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            cu_seqlens=self.cu_seqlens[:bucket + 1], context_lens=self.context_lens[:bucket],
            block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:bucket],
            logits_indices=self.row_indices[:bucket],
            decode=RowGroup(0, bucket, self.cu_seqlens[:bucket + 1], self.slot_ids[:bucket], self.has_state[:bucket]),
            prefill=RowGroup(bucket, bucket, self.empty_cu, self.empty_rows, self.empty_flags),
            commit=True)

    @torch.inference_mode()
    @_no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            batch = self.batch_for(bucket)
            _warm_up(lambda: self.model.compute_logits(self.model(batch, self.states, self.kv)), 2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(batch, self.states, self.kv))
            self.graphs[bucket] = _Graph(graph, logits)
        torch.cuda.synchronize()

    def can_run(self, decode_rows: list[Row], num_prefill_rows: int) -> bool:
        return (num_prefill_rows == 0 and 0 < len(decode_rows) <= self.max_batch
                and all(len(r.token_ids) == 1 and len(r.block_table) <= self.max_blocks for r in decode_rows))

    @torch.inference_mode()
    def run(self, rows: list[Row]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step."""
        n = len(rows)
        bucket = next(b for b in self.buckets if b >= n)
        positions = [r.start_position for r in rows]
        tables = torch.zeros(bucket, self.max_blocks, dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
        pad = bucket - n
        host = {
            "input_ids": torch.tensor([r.token_ids[0] for r in rows] + [0] * pad, dtype=torch.int64),
            "positions": torch.tensor(positions + [0] * pad, dtype=torch.int64),
            "slot_ids": torch.tensor([r.slot for r in rows] + [0] * pad, dtype=torch.int32),
            "context_lens": torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32),
            "slot_mapping": torch.tensor([r.block_table[p // self.block_size] * self.block_size + p % self.block_size
                                          for r, p in zip(rows, positions)] + [0] * pad, dtype=torch.int64),
        }
        for name, values in host.items():
            getattr(self, name)[:bucket].copy_(values, non_blocking=True)
        self.block_tables[:bucket].copy_(tables, non_blocking=True)
        entry = self.graphs[bucket]
        entry.graph.replay()
        return entry.logits[:n]


@dataclass
class _SpecGraph:
    draft: torch.cuda.CUDAGraph
    drafts: torch.Tensor     # [bucket, K] written by the draft replay, read by the verify replay
    verify: torch.cuda.CUDAGraph
    verified: Verified       # written by the verify replay


class SpecGraphs:
    def __init__(self, decoder: SpecDecoder, max_batch: int, max_blocks_per_row: int, max_drafts: int,
                 device: torch.device) -> None:
        self.decoder, self.max_blocks, self.max_drafts = decoder, max_blocks_per_row, max_drafts
        self.buckets = default_buckets(max_batch)
        model = decoder.model
        # Static inputs (all zeros: padding rows) and the verify logits of every graph.
        self.rows = SpecRows(torch.zeros(max_batch, decoder.catch_up + 6, dtype=torch.int64, device=device),
                             torch.zeros(max_batch, max_blocks_per_row, dtype=torch.int32, device=device))
        self.logits = torch.empty(max_batch * (max_drafts + 1), model.config.vocab_size,
                                  dtype=model.embed_tokens.dtype, device=device)
        self.graphs: dict[tuple[int, int], _SpecGraph] = {}

    @torch.inference_mode()
    @_no_garbage_collection()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        decoder = self.decoder
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            rows = self.rows.head(bucket)
            for num_drafts in range(self.max_drafts, -1, -1):
                logits = self.logits[:bucket * (num_drafts + 1)]
                _warm_up(lambda: decoder.verify(rows, decoder.draft(rows, num_drafts), logits), 1)
                draft = torch.cuda.CUDAGraph()
                with torch.cuda.graph(draft, pool=pool):
                    drafts = decoder.draft(rows, num_drafts)
                verify = torch.cuda.CUDAGraph()
                with torch.cuda.graph(verify, pool=pool):
                    verified = decoder.verify(rows, drafts, logits)
                self.graphs[bucket, num_drafts] = _SpecGraph(draft, drafts, verify, verified)
        torch.cuda.synchronize()

    def can_run(self, rows: list[SpecRow], num_drafts: int) -> bool:
        return (0 < len(rows) <= self.buckets[-1] and num_drafts <= self.max_drafts
                and all(len(r.block_table) <= self.max_blocks for r in rows))

    def draft(self, rows: list[SpecRow], num_drafts: int) -> tuple[SpecRows, torch.Tensor]:
        """Copy the rows into the static inputs and replay the draft graph -> (the bucket's
        SpecRows, its drafts [bucket, K]). Block-table columns past the widest row keep stale
        values: no position of any row reaches them."""
        bucket = next(b for b in self.buckets if b >= len(rows))
        width = max(len(r.block_table) for r in rows)
        packed, tables = pack_rows(rows, self.decoder.catch_up, self.decoder.block_size, bucket, width,
                                   pin_memory=True)
        self.rows.packed[:bucket].copy_(packed, non_blocking=True)
        self.rows.block_tables[:bucket, :width].copy_(tables, non_blocking=True)
        entry = self.graphs[bucket, num_drafts]
        entry.draft.replay()
        return self.rows.head(bucket), entry.drafts

    def verify(self, num_rows: int, num_drafts: int) -> Verified:
        """Replay the verify graph of the bucket `draft` used; outputs cover the whole bucket."""
        entry = self.graphs[next(b for b in self.buckets if b >= num_rows), num_drafts]
        entry.verify.replay()
        return entry.verified
