"""Runs one StepPlan on the device: builds the step's metadata once, runs the model, samples.

Without speculation a step is one forward (decode rows commit their token at once; decode-only
steps replay a CUDA graph). With speculation (the model's MTP layer drafts) a step is:

  1. draft:  the MTP layer catches up over the positions verified last step (inputs shifted
             by one, the target hidden states kept from that step), then chains K-1 more
             single-token steps on its own output; drafts are the MTP's argmax.
  2. verify: one target forward over every row — decode rows feed [newest, d_1 .. d_K] through
             the deferred-commit kernels (the newest token, always accepted, is folded into
             the committed state; the drafts are not yet), prefill chunks run as usual.
  3. accept: on the device — argmax matching for greedy rows, rejection sampling for sampled
             rows (lossless in distribution); each slot's pending count becomes the number of
             drafts that were accepted (rollback is that counter), the hidden states of
             the fed positions are kept for the next catch-up, and prefill chunks run the MTP
             over their own positions so the MTP's KV cache stays complete.
Decode rows run at fixed shapes (decode_step.py): a decode-only step replays CUDA graphs (plain:
one; speculative: draft and verify); a step with prefill chunks runs its forward eagerly (with
speculation, after the draft graph).

Around the forward it executes the prefix cache's device work (checkpoint_io.py): restores
before, and after it the hidden states of the checkpoints the forward wrote. Cached rows (a
fully cached prompt) take their logits from the restored checkpoint's hidden state.

One host sync per step (the emitted tokens). A plain decode-only step can also be `launch`ed:
its tokens go to the host by an asynchronous copy and the returned `InFlight` waits for them
only when asked, so the engine can launch the next step first (its rows fed from the device,
decode_step.fed_token). Returns typed StepOutputs and never reads scheduler state beyond the
plan it is handed. Knows nothing about queues or stop conditions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..kernels import Ops
from .batch import ForwardBatch, Row, device_tensor
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs, SpecGraphs
from .models import HybridLM
from .request import TokenLogprobs
from .scheduler import ScheduledRow, StepPlan
from .decode_step import DecodeRow, DecodeRows, DecodeStep, Verified
from .state_pool import KVPool, StatePool


@dataclass(frozen=True)
class StepOutput:
    emitted: list[list[int]]  # per plan row (decode rows first): the tokens it produced
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # Per plan row: one TokenLogprobs per emitted token, for rows whose request asked for them.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per plan row: fed tokens left pending in its slot (None: none anywhere, no speculation).
    num_pending: list[int] | None = None

    def then(self, other: "StepOutput") -> "StepOutput":
        """This step's rows followed by other's."""
        def joined(mine, theirs, size_mine, size_theirs):
            if mine is None and theirs is None:
                return None
            return (mine or [None] * size_mine) + (theirs or [None] * size_theirs)

        n, m = len(self.emitted), len(other.emitted)
        pending = None if self.num_pending is None and other.num_pending is None else \
            (self.num_pending or [0] * n) + (other.num_pending or [0] * m)
        return StepOutput(self.emitted + other.emitted, self.draft_seconds + other.draft_seconds,
                          self.verify_seconds + other.verify_seconds, joined(self.logprobs, other.logprobs, n, m),
                          pending)


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
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, ops: Ops, block_size: int,
                 device: torch.device, decode: DecodeStep, graphs: DecodeGraphs | None = None,
                 spec_graphs: SpecGraphs | None = None) -> None:
        """decode: the fixed-shape decode stages (speculative or not); graphs / spec_graphs: their
        captured plain / speculative graphs (None: eager)."""
        self.model, self.states, self.kv, self.ops = model, states, kv, ops
        self.block_size, self.device, self.graphs = block_size, device, graphs
        self.decode, self.spec_graphs = decode, spec_graphs
        self.speculative = decode.speculative
        self.checkpoint_io = CheckpointIO(states, kv)
        # Pinned buffers of launched steps' tokens, used in turn: at most two steps are in flight
        # (the one being waited for and the one launched after it).
        self._host_tokens = [torch.empty(decode.last_tokens.shape[0], dtype=torch.int64, pin_memory=True)
                             for _ in range(2)] if device.type == "cuda" else []
        self._launches = 0
        # A seam for tests: called with (decode rows, drafts [B, K]) between drafting and verify,
        # it may edit the drafts in place (scripted drafters force every acceptance count).
        self.draft_hook = None

    def can_launch(self, plan: StepPlan) -> bool:
        """Whether `launch` takes the plan: plain decode rows only."""
        return not self.speculative and bool(plan.decode_rows) and not plan.prefill_rows and not plan.cached_rows

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Launch a plain decode-only step (`can_launch`) without waiting for its tokens. Its rows
        may be fed (decode_step.fed_token) from the step launched before it. A step whose rows
        ask for log-probabilities is waited for here (they need the logits before the next step
        overwrites them), as is every step off the GPU (nothing runs asynchronously there)."""
        self.checkpoint_io.before_forward(plan.cache_ops)
        rows = [_decode_row(r) for r in plan.decode_rows]
        if self.graphs is not None and self.graphs.fits(rows):
            logits, tokens = self.graphs.run(rows)
        else:
            logits, tokens = self.decode.plain(self.decode.row_tensors(rows, self.device))
        self.checkpoint_io.after_forward(plan.cache_ops)
        sampling = [i for i, r in enumerate(plan.decode_rows) if not r.request.params.greedy]
        if sampling:
            # tokens is DecodeStep.last_tokens: the sampled rows' tokens go where fed rows read.
            index = self._tensor(sampling)
            tokens[index] = self._sample_tokens(logits[index], [plan.decode_rows[i] for i in sampling])
        if self.device.type != "cuda" or any(r.request.params.logprobs is not None for r in plan.decode_rows):
            emitted = [[t] for t in tokens.tolist()]
            logprobs = self._logprobs(logits, plan.rows, [[i] for i in range(len(rows))], emitted)
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
            output = self._run_speculative(forward) if self.speculative else self._run_plain(forward)
        self.checkpoint_io.after_forward(plan.cache_ops)
        return output.then(self._run_cached(plan.cached_rows)) if plan.cached_rows else output

    def _run_plain(self, plan: StepPlan) -> StepOutput:
        """A step with prefill chunks (decode-only steps are `launch`ed)."""
        batch = self._batch([self._row(r) for r in plan.decode_rows], [self._row(r) for r in plan.prefill_rows],
                            commit=True)
        hidden = self.model(batch, self.states, self.kv)
        self._keep_checkpoint_hidden(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampling = [r for r in plan.rows if r.sample]
        sampled = self._sample(logits, sampling) if sampling else []
        tokens = iter(sampled)
        emitted = [[next(tokens)] if r.sample else [] for r in plan.rows]
        # Sampling rows' logits are in row order: logits row j belongs to the j-th sampling row.
        logit_row = iter(range(len(sampling)))
        wanted = [[next(logit_row)] if r.sample else [] for r in plan.rows]
        return StepOutput(emitted, logprobs=self._logprobs(logits, plan.rows, wanted, emitted))

    # Speculative step ---------------------------------------------------------------------

    def _run_speculative(self, plan: StepPlan) -> StepOutput:
        decode_rows, prefill_rows = plan.decode_rows, plan.prefill_rows
        clock = _StageClock(self.device)
        drafted, on_graph = None, False
        if decode_rows:
            num_drafts = max(r.num_draft_tokens for r in decode_rows)
            rows = [_decode_row(r) for r in decode_rows]
            on_graph = self.spec_graphs is not None and self.spec_graphs.can_run(rows, num_drafts)
            if on_graph:  # the draft stage only reads decode rows: a graph serves mixed steps too
                bucket_rows, bucket_drafts = self.spec_graphs.draft(rows, num_drafts)
                drafted = bucket_rows.head(len(rows)), bucket_drafts[:len(rows)]  # views: edits reach the graph
            else:
                device_rows = self.decode.row_tensors(rows, self.device)
                drafted = device_rows, self.decode.draft(device_rows, num_drafts)
            if self.draft_hook is not None:
                self.draft_hook(decode_rows, drafted[1])  # edits the drafts in place
        clock.mark()
        if prefill_rows:
            verified, logits = self._verify_mixed(decode_rows, prefill_rows, drafted)
        else:
            verified = self.spec_graphs.verify(len(decode_rows), num_drafts) if on_graph else self.decode.verify(*drafted)
            logits = verified.logits
        clock.mark()
        emitted, logit_rows, num_pending = self._accepted(decode_rows, verified, *drafted) if decode_rows \
            else ([], [], [])
        if prefill_rows:
            sampling = [r for r in prefill_rows if r.sample]
            first = len(logits) - len(sampling)  # the prefill rows' logits follow the decode rows'
            sampled = iter(self._sample(logits[first:].float(), sampling) if sampling else [])
            emitted += [[next(sampled)] if r.sample else [] for r in prefill_rows]
            logit_row = iter(range(first, len(logits)))
            logit_rows += [[next(logit_row)] if r.sample else [] for r in prefill_rows]
            num_pending += [0] * len(prefill_rows)
        draft_seconds, verify_seconds = clock.seconds()
        return StepOutput(emitted, draft_seconds=draft_seconds, verify_seconds=verify_seconds,
                          logprobs=self._logprobs(logits, plan.rows, logit_rows, emitted), num_pending=num_pending)

    def _verify_mixed(self, decode_rows: tuple[ScheduledRow, ...], prefill_rows: tuple[ScheduledRow, ...],
                      drafted: tuple[DecodeRows, torch.Tensor] | None) -> tuple[Verified | None, torch.Tensor]:
        """One target forward over decode rows (K + 1 tokens each, as DecodeStep.verify) and
        prefill chunks. Returns the decode rows' Verified (None without decode rows) and the
        logits of every row that needs them (decode rows' first, in the model's dtype)."""
        num_drafts = drafted[1].shape[1] if drafted else 0
        rows = [Row([r.token_ids[0]] + [0] * num_drafts, r.start_position, r.slot, r.block_table,
                    num_logits=1 + num_drafts) for r in decode_rows]
        batch = self._batch(rows, [self._row(r) for r in prefill_rows], commit=False)
        num_decode_tokens = len(rows) * (1 + num_drafts)
        if num_drafts:
            input_ids = batch.input_ids.clone()
            input_ids[:num_decode_tokens].view(len(rows), 1 + num_drafts)[:, 1:] = drafted[1]
            batch = dataclasses.replace(batch, input_ids=input_ids)
        hidden = self.model(batch, self.states, self.kv)
        self._keep_checkpoint_hidden(batch, hidden)
        logits = self.model.logits(hidden[batch.logits_indices])
        # A fresh prefill leaves nothing pending; its MTP pass keeps the MTP KV complete.
        self.states.pending_counts[self._tensor([r.slot for r in prefill_rows])] = 0
        self._prefill_mtp(hidden, batch, prefill_rows)
        if not drafted:
            return None, logits
        decode_logits = logits[:num_decode_tokens]
        accepted, emitted = self.decode.accept(hidden[:num_decode_tokens], decode_logits, *drafted)
        return Verified(decode_logits, accepted, emitted), logits

    def _accepted(self, rows: tuple[ScheduledRow, ...], verified: Verified, device_rows: DecodeRows,
                  drafts: torch.Tensor) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Decode rows' emitted tokens, the logits rows that scored them, and their pending
        counts. Greedy rows were accepted on the device; sampled rows are redone here by
        rejection sampling against the target's filtered distribution: accept a (greedy) draft d
        with probability p(d), else resample from p without d, so emitted tokens are distributed
        exactly as without speculation. Their uniforms are the stream plain sampling would use
        at those positions (seed, position)."""
        accepted, emitted = verified.accepted, verified.emitted
        width = drafts.shape[1] + 1
        sampled = [i for i, r in enumerate(rows) if not r.request.params.greedy]
        if sampled:
            index = self._tensor(sampled)
            flat = (index[:, None] * width + torch.arange(width, device=self.device)).reshape(-1)
            params = [rows[i].request.params for i in sampled for _ in range(width)]
            probs = self.ops.filter_probs(verified.logits[flat].float(), *self._filter_columns(params))
            tokens, sampled_accepted = self.ops.rejection_sample(
                probs.view(len(sampled), width, -1), None, drafts[index].contiguous(), device_rows.num_drafts[index],
                self._tensor([rows[i].request.seed for i in sampled]),
                self._tensor([rows[i].start_position + 1 for i in sampled]))
            accepted, emitted = accepted.clone(), emitted.clone()
            accepted[index] = sampled_accepted.to(accepted.dtype)
            emitted[index] = tokens
            self.states.pending_counts[device_rows.slots[index]] = sampled_accepted.to(torch.int32)
        accepted_host, emitted_host = accepted[:len(rows)].tolist(), emitted[:len(rows)].tolist()
        tokens = [emitted_host[i][:accepted_host[i] + 1] for i in range(len(rows))]
        logit_rows = [list(range(i * width, i * width + len(t))) for i, t in enumerate(tokens)]
        return tokens, logit_rows, accepted_host

    def _run_cached(self, rows: tuple[ScheduledRow, ...]) -> StepOutput:
        """Fully cached prompts: the first token's logits from the hidden state the checkpoint
        kept for its last position (restored into the row's slot before the forward)."""
        logits = self.model.compute_logits(self.states.last_hidden[self._tensor([r.slot for r in rows])])
        emitted = [[t] for t in self._sample(logits, list(rows))]
        return StepOutput(emitted, logprobs=self._logprobs(logits, rows, [[i] for i in range(len(rows))], emitted),
                          num_pending=[0] * len(rows))

    def _keep_checkpoint_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """Checkpoints the forward wrote keep the hidden state of their last position (a full
        hit's logits; the MTP catch-up of a checkpoint one position behind). Their pending
        counts are never read: a restore zeroes the destination's."""
        written = batch.checkpoints
        if written is None:
            return
        last = hidden[batch.prefill.token_start + written.last_token]
        self.states.last_hidden[written.slots] = last
        if self.states.mtp_hidden is not None:
            self.states.mtp_hidden[written.slots, 0] = last

    def _prefill_mtp(self, hidden: torch.Tensor, batch: ForwardBatch, rows: tuple[ScheduledRow, ...]) -> None:
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
        if mtp_rows:
            inputs = hidden.new_empty(len(fresh_place) + len(kept_place), hidden.shape[1])
            inputs[self._tensor(fresh_place)] = hidden[self._tensor(fresh_index)]
            if kept_place:
                inputs[self._tensor(kept_place)] = self.states.mtp_hidden[self._tensor(kept_slots),
                                                                          self._tensor(kept_depths)]
            mtp_batch = self._batch([], mtp_rows, commit=True)
            self.model.draft_hidden(mtp_batch.input_ids, inputs, mtp_batch, self.kv)
        if keep_slots:
            self.states.mtp_hidden[self._tensor(keep_slots), 0] = hidden[self._tensor(keep_index)]

    def _logprobs(self, logits: torch.Tensor, rows: tuple[ScheduledRow, ...], logit_rows: list[list[int]],
                  emitted: list[list[int]]) -> list[list[TokenLogprobs] | None] | None:
        """Raw-distribution log-probabilities of each emitted token (logits row logit_rows[i][j]
        scored emitted[i][j]) and the top-N, for rows whose request set `logprobs`."""
        asking = [i for i, r in enumerate(rows) if r.request.params.logprobs is not None and emitted[i]]
        if not asking:
            return None
        index = [j for i in asking for j in logit_rows[i]]
        chosen = [t for i in asking for t in emitted[i]]
        scores = torch.log_softmax(logits[self._tensor(index)].float(), dim=-1)
        chosen_lp = scores.gather(1, self._tensor(chosen)[:, None])[:, 0].tolist()
        top_n = max(rows[i].request.params.logprobs for i in asking)
        top_values, top_ids = scores.topk(top_n, dim=-1) if top_n else (scores[:, :0], scores[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        result: list[list[TokenLogprobs] | None] = [None] * len(rows)
        position = 0
        for i in asking:
            n = rows[i].request.params.logprobs
            entries = []
            for _ in emitted[i]:
                entries.append(TokenLogprobs(chosen_lp[position],
                                             list(zip(top_ids[position][:n], top_values[position][:n]))))
                position += 1
            result[i] = entries
        return result

    # Helpers ------------------------------------------------------------------------------

    def _batch(self, decode: list[Row], prefill: list[Row], commit: bool) -> ForwardBatch:
        return ForwardBatch.build(decode, prefill, self.block_size, self.device, commit=commit)

    def _filter_columns(self, params: list) -> tuple[torch.Tensor, ...]:
        """Per-row (temperature, top_k, top_p, min_p) tensors of the sampling ops."""
        def column(values, dtype):
            return device_tensor(values, dtype, self.device)

        return (column([p.temperature for p in params], torch.float32), column([p.top_k for p in params], torch.int64),
                column([p.top_p for p in params], torch.float32), column([p.min_p for p in params], torch.float32))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return device_tensor(values, torch.int64, self.device)

    @staticmethod
    def _row(row: ScheduledRow) -> Row:
        return Row(row.token_ids, row.start_position, row.slot, row.block_table, num_logits=int(row.sample),
                   checkpoints=tuple((w.position - row.start_position, w.slot) for w in row.checkpoints))

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> list[int]:
        return self._sample_tokens(logits, rows).tolist()

    def _sample_tokens(self, logits: torch.Tensor, rows: list[ScheduledRow]) -> torch.Tensor:
        """The next token of each row (logits row i is rows[i]'s) on the device, no host sync."""
        params = [r.request.params for r in rows]
        if all(p.greedy for p in params):  # greedy fast path: no filtering, no noise
            return logits.argmax(dim=-1)
        tokens, _ = self.ops.sample(
            logits, *self._filter_columns(params),
            self._tensor([r.request.seed for r in rows]),
            # The position the sampled token will take: a seeded draw depends on nothing else.
            self._tensor([r.start_position + len(r.token_ids) for r in rows]),
        )
        return tokens


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
