"""Runs one StepPlan on the device: builds the step's metadata once, runs the model, samples.

Without speculation a step is one forward: decode rows commit their token at once, and a
decode-only step replays a CUDA graph per batch bucket (cuda_graphs.DecodeGraphs). With
speculation the step's decode and prefill rows go to the Speculator (speculation.py: draft,
verify, accept, roll back). Cached rows (a fully cached prompt) take their logits from the
restored checkpoint's hidden state.

Around the forward it executes the prefix cache's device work (checkpoint_io.py): restores
before, and after it the hidden states of the checkpoints the forward wrote.

One host sync per step (the emitted tokens). A plain decode-only step can also be `launch`ed:
its tokens go to the host by an asynchronous copy and the returned `InFlight` waits for them
only when asked, so the engine can launch the next step first (its rows fed from the device,
ScheduledRow.fed_from). Returns StepOutputs (step.py) and reads nothing of the scheduler beyond
the plan it is handed. Knows nothing about queues or stop conditions.
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import ForwardBatch
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .decode_step import DecodeRow, DecodeStep
from .models import HybridLM
from .sampler import Sampler
from .speculation import Speculator
from .state_pool import KVPool, StatePool
from .step import ScheduledRow, StepOutput, StepPlan


class InFlight:
    """A launched plain decode step: `result()` waits for its tokens (on the host by then, or
    on their way in a pinned buffer) and returns its StepOutput."""

    def __init__(self, plan: StepPlan, tokens: torch.Tensor | None, done: torch.cuda.Event | None,
                 output: StepOutput | None = None) -> None:
        """tokens: [B] pinned tensor the step's tokens are being copied into and done: the event
        after that copy; or output: the finished result."""
        self.plan, self._tokens, self._done, self._output = plan, tokens, done, output

    def result(self) -> StepOutput:
        if self._output is None:
            self._done.synchronize()
            self._output = StepOutput([[t] for t in self._tokens.tolist()])
        return self._output


class Runner:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, sampler: Sampler, checkpoint_io: CheckpointIO,
                 block_size: int, device: torch.device, decode: DecodeStep, graphs: DecodeGraphs | None = None,
                 speculator: Speculator | None = None, spec_graphs: SpecGraphs | None = None) -> None:
        """decode: the fixed-shape decode stages; graphs: their captured plain graphs (None:
        eager). speculator: the speculative stages (None: no speculation) and spec_graphs their
        captured graphs."""
        self.model, self.states, self.kv, self.sampler = model, states, kv, sampler
        self.block_size, self.device, self.graphs = block_size, device, graphs
        self.decode, self.speculator, self.spec_graphs = decode, speculator, spec_graphs
        self.checkpoint_io = checkpoint_io
        # Pinned buffers of launched steps' tokens, used in turn: at most two steps are in flight
        # (the one being waited for and the one launched after it).
        self._host_tokens = [torch.empty(decode.last_tokens.shape[0], dtype=torch.int64, pin_memory=True)
                             for _ in range(2)] if device.type == "cuda" else []
        self._launches = 0

    def can_launch(self, plan: StepPlan) -> bool:
        """Whether `launch` takes the plan: plain decode rows only."""
        return self.speculator is None and bool(plan.decode_rows) and not plan.prefill_rows and not plan.cached_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Launch a plain decode-only step (`can_launch`) without waiting for its tokens. Its rows
        may be fed (ScheduledRow.fed_from) from the step launched before it. A step whose rows
        ask for log-probabilities is waited for here (they need the logits before the next step
        overwrites them), as is every step off the GPU (nothing runs asynchronously there)."""
        self.checkpoint_io.before_forward(plan.cache_ops)
        rows = [_plain_decode_row(r) for r in plan.decode_rows]
        if self.graphs is not None and self.graphs.fits(rows):
            logits, tokens = self.graphs.run(rows)
        else:
            logits, tokens = self.decode.plain(self.decode.row_tensors(rows, self.device))
        self.checkpoint_io.after_forward(plan.cache_ops)
        sampling = [i for i, r in enumerate(plan.decode_rows) if not r.request.params.greedy]
        if sampling:
            # tokens is DecodeStep.last_tokens: the sampled rows' tokens go where fed rows read.
            index = self.sampler.tensor(sampling)
            tokens[index] = self.sampler.sample(logits[index], [plan.decode_rows[i] for i in sampling])
        if self.device.type != "cuda" or any(r.request.params.logprobs is not None for r in plan.decode_rows):
            emitted = [[t] for t in tokens.tolist()]
            logprobs = self.sampler.logprobs(logits, plan.rows, [[i] for i in range(len(rows))], emitted)
            return InFlight(plan, None, None, StepOutput(emitted, logprobs=logprobs))
        host = self._host_tokens[self._launches % 2][:len(rows)]
        self._launches += 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(plan, host, done)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        if self.can_launch(plan):
            return self.launch(plan).result()
        self.checkpoint_io.before_forward(plan.cache_ops)
        output = StepOutput([])
        if plan.decode_rows or plan.prefill_rows:
            forward = dataclasses.replace(plan, cached_rows=())
            output = self.speculator.run(forward, self.spec_graphs) if self.speculator is not None \
                else self._run_plain(forward)
        self.checkpoint_io.after_forward(plan.cache_ops)
        return output.then(self._run_cached(plan.cached_rows)) if plan.cached_rows else output

    def _run_plain(self, plan: StepPlan) -> StepOutput:
        """A step with prefill chunks (decode-only steps are `launch`ed)."""
        batch = ForwardBatch.build([r.forward_row() for r in plan.decode_rows],
                                   [r.forward_row() for r in plan.prefill_rows], self.block_size, self.device)
        hidden = self.model(batch, self.states, self.kv)
        self.checkpoint_io.keep_hidden(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampling = [r for r in plan.rows if r.sample]
        sampled = self.sampler.sample(logits, sampling).tolist() if sampling else []
        tokens = iter(sampled)
        emitted = [[next(tokens)] if r.sample else [] for r in plan.rows]
        # Sampling rows' logits are in row order: logits row j belongs to the j-th sampling row.
        logit_row = iter(range(len(sampling)))
        wanted = [[next(logit_row)] if r.sample else [] for r in plan.rows]
        return StepOutput(emitted, logprobs=self.sampler.logprobs(logits, plan.rows, wanted, emitted))

    def _run_cached(self, rows: tuple[ScheduledRow, ...]) -> StepOutput:
        """Fully cached prompts: the first token's logits from the hidden state the checkpoint
        kept for its last position (restored into the row's slot before the forward)."""
        logits = self.model.compute_logits(self.states.last_hidden[self.sampler.tensor([r.slot for r in rows])])
        emitted = [[t] for t in self.sampler.sample(logits, rows).tolist()]
        return StepOutput(emitted, logprobs=self.sampler.logprobs(logits, rows, [[i] for i in range(len(rows))], emitted),
                          num_pending=[0] * len(rows))


def _plain_decode_row(row: ScheduledRow) -> DecodeRow:
    if row.fed_from is not None:
        return DecodeRow(row.slot, 0, row.start_position, row.block_table, fed_from=row.fed_from)
    return DecodeRow(row.slot, row.token_ids[0], row.start_position, row.block_table)
