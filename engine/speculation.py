"""MTP speculation on the pools: draft, verify, accept and roll back, for one step's decode rows.

A speculative step (Speculator.run) is:

  1. draft:  the MTP catch-up over C = k + 1 positions from each row's first missing MTP
             position (its n_r <= C real ones are the positions verified and accepted last step,
             inputs shifted by one, with the target hidden states kept at the slot; the rest is
             padding), then K - 1 chained single-token MTP steps on the MTP's own output. K is
             the step's largest k_r; drafts are the MTP's argmax [B, K].
  2. verify: one target forward over [newest, d_1 .. d_K] of every decode row through the
             deferred-commit kernels (the newest token, always accepted, is folded into the
             committed state; the drafts are left pending), with the step's prefill chunks in
             the same forward when there are any (a mixed step).
  3. accept: greedy rows take the longest prefix matching the target's argmax, sampled rows
             are decided by rejection sampling (spec/accept.py: lossless in distribution).
  4. roll back: each slot's pending count becomes its accepted drafts (`_set_pending`, the one
             place it is written): the rejected drafts' inputs stay in the pending buffer
             unread, so rollback is a counter, not a copy or a re-run. The fed positions'
             hidden states are kept at the slot for the next step's catch-up, and prefill chunks
             run the MTP over their own positions so the MTP's KV cache stays complete.

`draft` and `verify` run at fixed shapes (decode_step.py), so a decode-only step replays two
CUDA graphs per (batch bucket, K) (cuda_graphs.SpecGraphs); steps with prefill chunks run the
draft graph, then their verify forward eagerly. A test or benchmark may pass `edit_drafts`,
called between draft and verify with the rows and the drafts [B, K], to rewrite the drafts in
place (forcing acceptance counts). Knows nothing about queues, stop conditions or the adaptive
draft length: the plan says how many drafts each row gets.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from ..spec import greedy_accept, rejection_accept
from .batch import ForwardBatch, Row
from .checkpoint_io import CheckpointIO
from .decode_step import DecodeRow, DecodeRows, DecodeStep
from .models import HybridLM
from .sampler import Sampler
from .state_pool import KVPool, StatePool
from .step import ScheduledRow, StepOutput, StepPlan

if TYPE_CHECKING:
    from .cuda_graphs import SpecGraphs

# Called between draft and verify with the step's decode rows and their drafts [B, K] (B >= the
# number of rows: a graph bucket's padding rows follow); may rewrite the drafts in place.
DraftEditor = Callable[[Sequence[ScheduledRow], torch.Tensor], None]


class Verified(NamedTuple):
    logits: torch.Tensor    # [B * (K + 1), V] in the model's dtype, row-major by (row, depth)
    accepted: torch.Tensor  # [B] int64: drafts accepted (greedy; sampled rows are redone by `run`)
    emitted: torch.Tensor   # [B, K + 1] int64: row r emits emitted[r, :accepted[r] + 1]


class Speculator:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, decode: DecodeStep, sampler: Sampler,
                 checkpoint_io: CheckpointIO, edit_drafts: DraftEditor | None = None) -> None:
        if model.mtp is None or states.mtp_hidden is None or not decode.speculative:
            raise ValueError("speculation needs a model with MTP weights and a pool that keeps MTP inputs")
        self.model, self.states, self.kv, self.decode = model, states, kv, decode
        self.sampler, self.checkpoint_io, self.edit_drafts = sampler, checkpoint_io, edit_drafts
        self.device = states.pending_counts.device

    # Fixed-shape stages (captured in CUDA graphs) ------------------------------------------

    def draft(self, rows: DecodeRows, num_drafts: int) -> torch.Tensor:
        """MTP catch-up + chain -> drafts [B, num_drafts] int64 (the catch-up runs even for
        num_drafts = 0: it keeps the MTP's KV cache complete for later drafting)."""
        decode, num_rows, catch_up = self.decode, rows.num_rows, self.decode.catch_up
        tables = decode.tables(rows)
        positions = rows.mtp_start[:, None] + decode.arange(catch_up)                       # [B, C]
        batch = decode.batch(rows, tables, positions, rows.catch_up_ids.reshape(-1), commit=True)
        kept = self.states.mtp_hidden[rows.slots].flatten(0, 1)                             # [B*C, H]
        out = self.model.draft_hidden(batch.input_ids, kept, batch, self.kv).view(num_rows, catch_up, -1)
        if num_drafts == 0:
            return rows.packed.new_empty(num_rows, 0)
        # The MTP output at each row's newest caught-up position predicts the first draft.
        hidden = out[decode.arange(num_rows), (rows.num_catch_up - 1).clamp(min=0)]        # [B, H]
        drafts = [self.model.draft_tokens(hidden)]
        for depth in range(1, num_drafts):
            # MTP position (newest - 1 + depth): input the previous draft and the MTP's own output.
            positions = (rows.positions + (depth - 1))[:, None]
            batch = decode.batch(rows, tables, positions, drafts[-1], commit=True)
            hidden = self.model.draft_hidden(drafts[-1], hidden, batch, self.kv)
            drafts.append(self.model.draft_tokens(hidden))
        return torch.stack(drafts, dim=1)

    def verify(self, rows: DecodeRows, drafts: torch.Tensor, logits_out: torch.Tensor | None = None) -> Verified:
        """The target over [newest, drafts] of every row, then `accept`. logits_out: where the
        logits go ([B * (K + 1), V]; a graph's static buffer), or None for a new tensor."""
        decode, (num_rows, num_drafts) = self.decode, drafts.shape
        positions = rows.positions[:, None] + decode.arange(num_drafts + 1)                # [B, K+1]
        input_ids = torch.cat([rows.newest[:, None], drafts], dim=1).reshape(-1)
        batch = decode.batch(rows, decode.tables(rows), positions, input_ids, commit=False)
        hidden = self.model(batch, self.states, self.kv)
        logits = self.model.logits(hidden, out=logits_out)
        accepted, emitted = self.accept(hidden, logits, rows, drafts)
        return Verified(logits, accepted, emitted)

    def accept(self, hidden: torch.Tensor, logits: torch.Tensor, rows: DecodeRows,
               drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B*(K+1), H], logits [B*(K+1), V] of the fed tokens -> greedy (accepted,
        emitted); rolls each slot back to its accepted drafts and keeps the hidden states for
        the next catch-up. Argmax of the model-dtype logits equals argmax of their float32
        copies (the widening is exact)."""
        num_rows, width = drafts.shape[0], drafts.shape[1] + 1
        self.states.mtp_hidden[rows.slots, :width] = hidden.view(num_rows, width, -1)
        target = logits.argmax(dim=-1).view(num_rows, width)
        accepted, emitted = greedy_accept(target, drafts, rows.num_drafts)
        self._set_pending(rows.slots, accepted)
        return accepted, emitted

    # One step -------------------------------------------------------------------------------

    def run(self, plan: StepPlan, graphs: SpecGraphs | None) -> StepOutput:
        """A speculative step over the plan's decode and prefill rows (no cached rows)."""
        decode_rows, prefill_rows = plan.decode_rows, plan.prefill_rows
        clock = _StageClock(self.device)
        drafted, on_graph = None, False
        if decode_rows:
            num_drafts = max(r.num_draft_tokens for r in decode_rows)
            rows = [_decode_row(r) for r in decode_rows]
            on_graph = graphs is not None and graphs.can_run(rows, num_drafts)
            if on_graph:  # the draft stage only reads decode rows: a graph serves mixed steps too
                bucket_rows, bucket_drafts = graphs.draft(rows, num_drafts)
                drafted = bucket_rows.head(len(rows)), bucket_drafts[:len(rows)]  # views: edits reach the graph
            else:
                device_rows = self.decode.row_tensors(rows, self.device)
                drafted = device_rows, self.draft(device_rows, num_drafts)
            if self.edit_drafts is not None:
                self.edit_drafts(decode_rows, drafted[1])
        clock.mark()
        if prefill_rows:
            verified, logits = self._verify_mixed(decode_rows, prefill_rows, drafted)
        else:
            verified = graphs.verify(len(decode_rows), num_drafts) if on_graph else self.verify(*drafted)
            logits = verified.logits
        clock.mark()
        emitted, logit_rows, num_pending = self._accepted(decode_rows, verified, *drafted) if decode_rows \
            else ([], [], [])
        if prefill_rows:
            sampling = [r for r in prefill_rows if r.sample]
            first = len(logits) - len(sampling)  # the prefill rows' logits follow the decode rows'
            sampled = iter(self.sampler.sample(logits[first:].float(), sampling).tolist() if sampling else [])
            emitted += [[next(sampled)] if r.sample else [] for r in prefill_rows]
            logit_row = iter(range(first, len(logits)))
            logit_rows += [[next(logit_row)] if r.sample else [] for r in prefill_rows]
            num_pending += [0] * len(prefill_rows)
        draft_seconds, verify_seconds = clock.seconds()
        return StepOutput(emitted, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                          logprobs=self.sampler.logprobs(logits, plan.rows, logit_rows, emitted),
                          num_pending=num_pending)

    def _verify_mixed(self, decode_rows: Sequence[ScheduledRow], prefill_rows: Sequence[ScheduledRow],
                      drafted: tuple[DecodeRows, torch.Tensor] | None) -> tuple[Verified | None, torch.Tensor]:
        """One target forward over decode rows (K + 1 tokens each, as `verify`) and prefill
        chunks. Returns the decode rows' Verified (None without decode rows) and the logits of
        every row that needs them (decode rows' first, in the model's dtype)."""
        num_drafts = drafted[1].shape[1] if drafted else 0
        rows = [Row([r.token_ids[0]] + [0] * num_drafts, r.start_position, r.slot, r.block_table,
                    num_logits=1 + num_drafts) for r in decode_rows]
        batch = ForwardBatch.build(rows, [r.forward_row() for r in prefill_rows], self.decode.block_size,
                                   self.device, commit=False)
        num_decode_tokens = len(rows) * (1 + num_drafts)
        if num_drafts:
            input_ids = batch.input_ids.clone()
            input_ids[:num_decode_tokens].view(len(rows), 1 + num_drafts)[:, 1:] = drafted[1]
            batch = dataclasses.replace(batch, input_ids=input_ids)
        hidden = self.model(batch, self.states, self.kv)
        self.checkpoint_io.keep_hidden(batch, hidden)
        logits = self.model.logits(hidden[batch.logits_indices])
        # A fresh prefill leaves nothing pending; its MTP pass keeps the MTP KV complete.
        self._set_pending(self.sampler.tensor([r.slot for r in prefill_rows]), None)
        self._prefill_mtp(hidden, batch, prefill_rows)
        if not drafted:
            return None, logits
        decode_logits = logits[:num_decode_tokens]
        accepted, emitted = self.accept(hidden[:num_decode_tokens], decode_logits, *drafted)
        return Verified(decode_logits, accepted, emitted), logits

    def _accepted(self, rows: Sequence[ScheduledRow], verified: Verified, device_rows: DecodeRows,
                  drafts: torch.Tensor) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Decode rows' emitted tokens, the logits rows that scored them, and their pending
        counts. Greedy rows were accepted on the device; sampled rows are redone here by
        rejection sampling against the target's filtered distribution (spec/accept.py), with
        the uniforms plain sampling would use at those positions (seed, position)."""
        accepted, emitted = verified.accepted, verified.emitted
        width = drafts.shape[1] + 1
        sampled = [i for i, r in enumerate(rows) if not r.request.params.greedy]
        if sampled:
            index = self.sampler.tensor(sampled)
            flat = (index[:, None] * width + torch.arange(width, device=self.device)).reshape(-1)
            params = [rows[i].request.params for i in sampled for _ in range(width)]
            probs = self.sampler.filter_probs(verified.logits[flat], params)
            sampled_accepted, tokens = rejection_accept(
                self.model.ops.rejection_sample, probs.view(len(sampled), width, -1), drafts[index].contiguous(),
                device_rows.num_drafts[index], self.sampler.tensor([rows[i].request.seed for i in sampled]),
                self.sampler.tensor([rows[i].start_position + 1 for i in sampled]))
            accepted, emitted = accepted.clone(), emitted.clone()
            accepted[index] = sampled_accepted.to(accepted.dtype)
            emitted[index] = tokens
            self._set_pending(device_rows.slots[index], sampled_accepted)
        accepted_host, emitted_host = accepted[:len(rows)].tolist(), emitted[:len(rows)].tolist()
        tokens = [emitted_host[i][:accepted_host[i] + 1] for i in range(len(rows))]
        logit_rows = [list(range(i * width, i * width + len(t))) for i, t in enumerate(tokens)]
        return tokens, logit_rows, accepted_host

    def _set_pending(self, slots: torch.Tensor, num_accepted: torch.Tensor | None) -> None:
        """Roll the slots back to their accepted drafts: the next step folds the first
        num_accepted pending inputs into the committed state and ignores the rest (None: zero,
        nothing pending)."""
        if num_accepted is None:
            self.states.pending_counts[slots] = 0
        else:
            self.states.pending_counts[slots] = num_accepted.to(torch.int32)

    def _prefill_mtp(self, hidden: torch.Tensor, batch: ForwardBatch, rows: Sequence[ScheduledRow]) -> None:
        """Run the MTP over each prefill chunk's positions [mtp_start, mtp_end) with the target
        hidden states: this step's for the chunk's own positions, the slot's kept ones for the
        position before the chunk (a restored checkpoint whose MTP was one behind); a chunk
        that ends the prompt keeps its last hidden state."""
        decode_tokens = batch.prefill.token_start
        offsets = _offsets([len(r.token_ids) for r in rows])
        mtp_rows, fresh_index, fresh_place, kept_slots, kept_depths, kept_place = [], [], [], [], [], []
        keep_slots, keep_index = [], []
        for r, offset in zip(rows, offsets):
            if r.mtp_end > r.mtp_start:
                for position in range(r.mtp_start, r.mtp_end):
                    place = len(fresh_place) + len(kept_place)
                    if position < r.start_position:
                        kept_slots.append(r.slot)
                        kept_depths.append(position - r.mtp_start)
                        kept_place.append(place)
                    else:
                        fresh_index.append(decode_tokens + offset + position - r.start_position)
                        fresh_place.append(place)
                mtp_rows.append(Row(r.mtp_token_ids, r.mtp_start, r.slot, r.block_table, num_logits=0))
            if r.sample:
                keep_slots.append(r.slot)
                keep_index.append(decode_tokens + offset + len(r.token_ids) - 1)
        tensor = self.sampler.tensor
        if mtp_rows:
            inputs = hidden.new_empty(len(fresh_place) + len(kept_place), hidden.shape[1])
            inputs[tensor(fresh_place)] = hidden[tensor(fresh_index)]
            if kept_place:
                inputs[tensor(kept_place)] = self.states.mtp_hidden[tensor(kept_slots), tensor(kept_depths)]
            mtp_batch = ForwardBatch.build([], mtp_rows, self.decode.block_size, self.device, commit=True)
            self.model.draft_hidden(mtp_batch.input_ids, inputs, mtp_batch, self.kv)
        if keep_slots:
            self.states.mtp_hidden[tensor(keep_slots), 0] = hidden[tensor(keep_index)]


def _decode_row(row: ScheduledRow) -> DecodeRow:
    return DecodeRow(row.slot, row.token_ids[0], row.start_position, row.block_table, row.num_draft_tokens,
                     row.mtp_start, row.mtp_token_ids)


class _StageClock:
    """Durations between marks: device time from CUDA events (read after the step's host sync),
    host time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def mark(self) -> None:
        self.marks.append(self._now())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()  # a step whose rows sample nothing has not synced yet
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def _offsets(lengths: list[int]) -> list[int]:
    """Start index of each row in a flattened batch."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts
