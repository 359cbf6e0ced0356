"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.

A decode step (every row feeds one token through the recurrent kernels) is dozens of small
launches per layer; replaying a captured graph removes their launch cost. Each bucket's graph
reads its inputs from static buffers; a step with B rows copies its metadata into the first B
entries and pads the rest of the bucket with rows that point at scratch slot 0 and scratch KV
block 0 (context length 1), so a padding row never touches a real sequence's state.

Requires kernels with no host synchronisation and launch parameters that depend only on tensor
shapes (the Triton table). Knows nothing about requests: it is handed `Row`s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import ForwardBatch, Row, RowGroup
from .models import HybridLM
from .state_pool import KVPool, StatePool


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (padding wastes at most 15 rows)."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_batch, 16)) if b < max_batch} | {max_batch})


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
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):  # largest first: the pool fits the rest
            batch = self.batch_for(bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up compiles every kernel outside the capture
                for _ in range(2):
                    self.model.compute_logits(self.model(batch, self.states, self.kv))
            torch.cuda.current_stream().wait_stream(stream)
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
