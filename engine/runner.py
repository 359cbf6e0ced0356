"""Runs one StepPlan on the device: builds the step's metadata once, runs the model, samples.

Returns a typed StepOutput and never reads scheduler state beyond the plan it is handed (rows
carry the request only so that sampling parameters travel with them). Knows nothing about
queues, stop conditions or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Ops
from .batch import ForwardBatch, Row
from .cuda_graphs import DecodeGraphs
from .models import HybridLM
from .scheduler import ScheduledRow, StepPlan
from .state_pool import KVPool, StatePool


@dataclass(frozen=True)
class StepOutput:
    sampled: list[int | None]  # per plan row (decode rows first); None for rows that do not sample


class Runner:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, ops: Ops, block_size: int,
                 device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model, self.states, self.kv, self.ops = model, states, kv, ops
        self.block_size, self.device, self.graphs = block_size, device, graphs

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        decode = [self._row(r) for r in plan.decode_rows]
        sampling = [r for r in plan.rows if r.sample]
        if self.graphs is not None and self.graphs.can_run(decode, len(plan.prefill_rows)):
            logits = self.graphs.run(decode)
        else:
            batch = ForwardBatch.build(decode, [self._row(r) for r in plan.prefill_rows], self.block_size,
                                       self.device)
            logits = self.model.compute_logits(self.model(batch, self.states, self.kv)[batch.logits_indices])
        tokens = iter(self._sample(logits, sampling) if sampling else [])
        return StepOutput([next(tokens) if r.sample else None for r in plan.rows])

    @staticmethod
    def _row(row: ScheduledRow) -> Row:
        return Row(row.token_ids, row.start_position, row.slot, row.block_table, num_logits=int(row.sample))

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> list[int]:
        params = [r.request.params for r in rows]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()  # greedy fast path: no filtering, no noise

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        tokens, _ = self.ops.sample(
            logits,
            column([p.temperature for p in params], torch.float32),
            column([p.top_k for p in params], torch.int64),
            column([p.top_p for p in params], torch.float32),
            column([p.min_p for p in params], torch.float32),
            column([r.request.seed for r in rows], torch.int64),
            # The position the sampled token will take: a seeded draw depends on nothing else.
            column([r.start_position + len(r.token_ids) for r in rows], torch.int64),
        )
        return tokens.tolist()
