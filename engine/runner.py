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

from .batch import ForwardBatch, Row, device_tensor
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .decode_step import DecodeStep
from .models import HybridLM
from .prefix_cache import CacheOps
from .sampler import Sampler
from .speculation import Speculator
from .state_pool import KVPool, StatePool
from .step import ScheduledRow, StepOutput, StepPlan


class InFlight:
    """A launched decode-only step: `result()` waits for its outputs (on the host by then, or
    on their way in pinned buffers) and returns its StepOutput."""

    def __init__(self, plan: StepPlan, output: StepOutput | None = None, emitted: torch.Tensor | None = None,
                 accepted: torch.Tensor | None = None, done: torch.cuda.Event | None = None) -> None:
        """output: the finished result; or emitted [W, B] (and accepted [B] when the step
        speculated) pinned tensors the outputs are being copied into, and done: the event after
        those copies."""
        self.plan, self._output = plan, output
        self._emitted, self._accepted, self._done = emitted, accepted, done

    def result(self) -> StepOutput:
        if self._output is None:
            self._done.synchronize()
            emitted = self._emitted.tolist()
            if self._accepted is None:
                self._output = StepOutput([[t] for t in emitted[0]])
            else:
                accepted = self._accepted.tolist()
                self._output = StepOutput([[emitted[d][r] for d in range(a + 1)] for r, a in enumerate(accepted)],
                                          num_pending=accepted)
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
        # Pinned buffers of launched steps' outputs (emitted, accepted), used in turn: at most
        # two steps are in flight (the one being waited for and the one launched after it).
        self._host_outputs = [(torch.empty_like(decode.emitted, device="cpu", pin_memory=True),
                               torch.empty_like(decode.accepted, device="cpu", pin_memory=True))
                              for _ in range(2)] if device.type == "cuda" else []
        self._launches = 0

    def apply_cache_ops(self, ops: CacheOps) -> None:
        """The prefix cache's device work outside a step (clearing it: host drops)."""
        self.checkpoint_io.before_forward(ops)

    def can_launch(self, plan: StepPlan) -> bool:
        """Whether `launch` takes the plan: decode rows only."""
        return bool(plan.decode_rows) and not plan.prefill_rows and not plan.cached_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Launch a decode-only step (`can_launch`) without waiting for its outputs: a plain step
        when no row drafts, else a speculative one. Its rows may be fed (ScheduledRow.fed_from)
        from the step launched before it. A step whose rows ask for log-probabilities is waited
        for here (they need the logits before the next step overwrites them), as is every step
        off the GPU (nothing runs asynchronously there)."""
        self.checkpoint_io.before_forward(plan.cache_ops)
        rows = plan.decode_rows
        speculative = any(r.num_draft_tokens for r in rows)
        if speculative:
            drafted = self.speculator.launch(rows, self.spec_graphs)
            logits, width = drafted.logits, drafted.drafts.shape[1] + 1
        else:
            logits, width = self._launch_plain(rows), 1
        self.checkpoint_io.after_forward(plan.cache_ops)
        if self.device.type != "cuda" or any(r.request.params.logprobs is not None for r in rows):
            emitted, logit_rows, num_pending = self.speculator.read(len(rows), width) if speculative else \
                ([[t] for t in self.decode.emitted[0, :len(rows)].tolist()], [[i] for i in range(len(rows))], None)
            return InFlight(plan, StepOutput(emitted, logprobs=self.sampler.logprobs(logits, rows, logit_rows, emitted),
                                             num_pending=num_pending))
        host_emitted, host_accepted = self._host_outputs[self._launches % 2]
        self._launches += 1
        # A contiguous destination: a strided one makes the copy wait for the device.
        host_emitted = host_emitted.view(-1)[:width * len(rows)].view(width, len(rows))
        host_emitted.copy_(self.decode.emitted[:width, :len(rows)], non_blocking=True)
        if speculative:
            host_accepted = host_accepted[:len(rows)]
            host_accepted.copy_(self.decode.accepted[:len(rows)], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return InFlight(plan, emitted=host_emitted, accepted=host_accepted if speculative else None, done=done)

    def _launch_plain(self, rows: tuple[ScheduledRow, ...]) -> torch.Tensor:
        """Queue a plain decode step: greedy tokens land in DecodeStep.emitted[0], where
        sampled, penalized and constrained rows' tokens then go too (their seeded draws use the
        positions on the device: a fed row's is known there only), decided after the graph from
        its logits. Returns the raw logits [B, V]."""
        decode_rows = [r.decode_row() for r in rows]
        if self.graphs is not None and self.graphs.fits(decode_rows):
            device_rows, logits, tokens = self.graphs.run(decode_rows)
        else:
            device_rows = self.decode.row_tensors(decode_rows, self.device)
            logits, tokens = self.decode.plain(device_rows)
        sampling = [i for i, r in enumerate(rows) if r.request.params.redecided]
        if sampling:
            index = device_tensor(sampling, torch.int64, self.device)
            chosen = [rows[i] for i in sampling]
            tokens[index] = self.sampler.sample(logits[index], chosen, device_rows.positions[index] + 1)
            self.sampler.penalties.record(chosen, tokens[index, None])
        return logits

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
        self.sampler.penalties.start(plan.prefill_rows)
        sampled = self.sampler.sample(logits, sampling) if sampling else None
        if sampling:
            self.sampler.penalties.record(sampling, sampled[:, None])
        tokens = iter(sampled.tolist() if sampling else [])
        emitted = [[next(tokens)] if r.sample else [] for r in plan.rows]
        # Sampling rows' logits are in row order: logits row j belongs to the j-th sampling row.
        logit_row = iter(range(len(sampling)))
        wanted = [[next(logit_row)] if r.sample else [] for r in plan.rows]
        return StepOutput(emitted, logprobs=self.sampler.logprobs(logits, plan.rows, wanted, emitted))

    def _run_cached(self, rows: tuple[ScheduledRow, ...]) -> StepOutput:
        """Fully cached prompts: the first token's logits from the hidden state the checkpoint
        kept for its last position (restored into the row's slot before the forward)."""
        slots = device_tensor([r.slot for r in rows], torch.int64, self.device)
        logits = self.model.compute_logits(self.states.last_hidden[slots])
        self.sampler.penalties.start(rows)
        tokens = self.sampler.sample(logits, rows)
        self.sampler.penalties.record(rows, tokens[:, None])
        emitted = [[t] for t in tokens.tolist()]
        logprobs = self.sampler.logprobs(logits, rows, [[i] for i in range(len(rows))], emitted)
        return StepOutput(emitted, logprobs=logprobs, num_pending=[0] * len(rows))

    @torch.inference_mode()
    def score(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Float32 logits [T, V] on the CPU at every position of each sequence, run as one
        varlen prefill in scratch pools of their own (the engine's pools are not touched)."""
        config, dtype = self.model.config, self.model.norm.dtype
        block_counts = [-(-len(ids) // self.block_size) for ids in sequences]
        states = StatePool(config, len(sequences) + 1, 0, dtype, self.device)
        kv = KVPool(self.model.num_kv_layers, sum(block_counts) + 1, self.block_size, config.num_key_value_heads,
                    config.head_dim, dtype, self.device)
        rows, next_block = [], 1
        for slot, (ids, count) in enumerate(zip(sequences, block_counts), start=1):
            rows.append(Row(ids, 0, slot, list(range(next_block, next_block + count)), num_logits=len(ids)))
            next_block += count
        batch = ForwardBatch.build([], rows, self.block_size, self.device)
        logits = self.model.compute_logits(self.model(batch, states, kv)[batch.logits_indices]).cpu()
        return list(logits.split([len(ids) for ids in sequences]))
