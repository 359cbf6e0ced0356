"""Runs one StepPlan on the device: builds the step's metadata once, runs the model, samples.

Without speculation a step is one forward (decode rows commit their token at once; decode-only
steps replay a CUDA graph). With speculation (the model's MTP layer drafts) a step is:

  1. draft:  the MTP layer catches up over the positions verified last step (inputs shifted
             by one, the target hidden states kept from that step), then chains k-1 more
             single-token steps on its own output; drafts are the MTP's argmax.
  2. verify: one target forward over every row — decode rows feed [newest, d_1 .. d_k] through
             the deferred-commit kernels (the newest token, always accepted, is folded into
             the committed state; the drafts are not yet), prefill chunks run as usual.
  3. accept: on the device — argmax matching for greedy rows, rejection sampling for sampled
             rows (lossless in distribution); each slot's pending count becomes the number of
             drafts that were accepted (rollback is that counter), the hidden states of
             the fed positions are kept for the next catch-up, and prefill chunks run the MTP
             over their own positions so the MTP's KV cache stays complete.

Around the forward it executes the prefix cache's device work (checkpoint_io.py): restores
before, and after it the hidden states of the checkpoints the forward wrote. Cached rows (a
fully cached prompt) take their logits from the restored checkpoint's hidden state.

One host sync per step (the emitted tokens). Returns a typed StepOutput and never reads
scheduler state beyond the plan it is handed. Knows nothing about queues or stop conditions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..kernels import Ops
from ..spec import greedy_accept
from .batch import ForwardBatch, Row, device_tensor
from .checkpoint_io import CheckpointIO
from .cuda_graphs import DecodeGraphs
from .models import HybridLM
from .request import TokenLogprobs
from .scheduler import ScheduledRow, StepPlan
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


class Runner:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, ops: Ops, block_size: int,
                 device: torch.device, graphs: DecodeGraphs | None = None, speculative: bool = False) -> None:
        self.model, self.states, self.kv, self.ops = model, states, kv, ops
        self.block_size, self.device, self.graphs = block_size, device, graphs
        self.speculative = speculative
        self.checkpoint_io = CheckpointIO(states, kv)
        if speculative and (model.mtp is None or states.mtp_hidden is None):
            raise ValueError("speculation needs a model with MTP weights and a pool that keeps MTP inputs")
        # The draft stage: rows -> drafts [B, max k] (or None). The MTP drafter by default; a seam
        # for scripted drafters (tests force every acceptance count through it).
        self.drafter = self.draft_with_mtp

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        self.checkpoint_io.before_forward(plan.cache_ops)
        output = StepOutput([])
        if plan.decode_rows or plan.prefill_rows:
            forward = dataclasses.replace(plan, cached_rows=())
            output = self._run_speculative(forward) if self.speculative else self._run_plain(forward)
        self.checkpoint_io.after_forward(plan.cache_ops)
        return output.then(self._run_cached(plan.cached_rows)) if plan.cached_rows else output

    def _run_plain(self, plan: StepPlan) -> StepOutput:
        decode = [self._row(r) for r in plan.decode_rows]
        if self.graphs is not None and self.graphs.can_run(decode, len(plan.prefill_rows)):
            logits = self.graphs.run(decode)
        else:
            batch = self._batch(decode, [self._row(r) for r in plan.prefill_rows], commit=True)
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
        started = time.perf_counter()
        drafts = self.drafter(decode_rows)                                   # [B, K] or None
        drafted = time.perf_counter()
        # Verify: decode rows feed [newest, drafts...] (draft ids filled in on the device).
        rows = [Row(list(r.token_ids) + [0] * r.num_draft_tokens, r.start_position, r.slot, r.block_table,
                    num_logits=1 + r.num_draft_tokens) for r in decode_rows]
        batch = self._batch(rows, [self._row(r) for r in prefill_rows], commit=False)
        input_ids = batch.input_ids
        if drafts is not None:
            draft_rows = [i for i, r in enumerate(decode_rows) for _ in range(r.num_draft_tokens)]
            draft_depths = [d for r in decode_rows for d in range(r.num_draft_tokens)]
            starts = _offsets([len(r.token_ids) for r in rows])
            draft_positions = [starts[i] + 1 + d for i, d in zip(draft_rows, draft_depths)]
            input_ids = input_ids.clone()
            input_ids[self._tensor(draft_positions)] = drafts[self._tensor(draft_rows), self._tensor(draft_depths)]
            batch = dataclasses.replace(batch, input_ids=input_ids)
        hidden = self.model(batch, self.states, self.kv)
        self._keep_checkpoint_hidden(batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_indices])

        # Accept (greedy): decode rows' logits come first, k_r + 1 per row.
        emitted: list[list[int]] = []
        logit_rows: list[list[int]] = []  # per row: the logits rows of its emitted tokens
        num_pending: list[int] = []
        if decode_rows:
            num_decode_logits = sum(1 + r.num_draft_tokens for r in decode_rows)
            accepted, tokens = self._accept(logits[:num_decode_logits], decode_rows, drafts)
            slots = self._tensor([r.slot for r in decode_rows])
            self.states.pending_counts[slots] = accepted.to(torch.int32)  # the newest token is committed
            self._keep_hidden(hidden, rows, decode_rows)
            accepted_host, tokens_host = accepted.tolist(), tokens.tolist()
            emitted = [tokens_host[i][:accepted_host[i] + 1] for i in range(len(decode_rows))]
            num_pending = list(accepted_host)  # as pending_counts above
            starts = _offsets([1 + r.num_draft_tokens for r in decode_rows])
            logit_rows = [list(range(start, start + len(e))) for start, e in zip(starts, emitted)]
        if prefill_rows:
            # A fresh prefill leaves nothing pending; its MTP pass keeps the MTP KV complete.
            self.states.pending_counts[self._tensor([r.slot for r in prefill_rows])] = 0
            self._prefill_mtp(hidden, batch, prefill_rows)
            sampling = [r for r in prefill_rows if r.sample]
            first = len(logits) - len(sampling)
            sampled = iter(self._sample(logits[first:], sampling) if sampling else [])
            emitted += [[next(sampled)] if r.sample else [] for r in prefill_rows]
            logit_row = iter(range(first, len(logits)))
            logit_rows += [[next(logit_row)] if r.sample else [] for r in prefill_rows]
            num_pending += [0] * len(prefill_rows)
        verified = time.perf_counter()
        return StepOutput(emitted, draft_seconds=drafted - started, verify_seconds=verified - drafted,
                          logprobs=self._logprobs(logits, plan.rows, logit_rows, emitted), num_pending=num_pending)

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

    def draft_with_mtp(self, rows: tuple[ScheduledRow, ...]) -> torch.Tensor | None:
        """Greedy drafts [B, max k] for the decode rows (None when no row drafts). Every row
        runs the MTP catch-up over its last verified positions, drafting or not."""
        # A row whose MTP is already at its newest position (the prompt's last token fed alone
        # after a chunk) has nothing to catch up and drafts nothing.
        catching = [i for i, r in enumerate(rows) if r.mtp_end > r.mtp_start]
        if not catching:
            return None
        catch_up = [Row(rows[i].mtp_token_ids, rows[i].mtp_start, rows[i].slot, rows[i].block_table)
                    for i in catching]
        batch = self._batch([], catch_up, commit=True)
        # Target hidden states of the catch-up positions were kept at the slot, in order.
        slots = [rows[i].slot for i in catching for _ in range(rows[i].mtp_end - rows[i].mtp_start)]
        depths = [d for i in catching for d in range(rows[i].mtp_end - rows[i].mtp_start)]
        hidden = self.states.mtp_hidden[self._tensor(slots), self._tensor(depths)]
        last = self.model.draft_hidden(batch.input_ids, hidden, batch, self.kv)[batch.logits_indices]
        max_drafts = max(r.num_draft_tokens for r in rows)
        if max_drafts == 0:
            return None
        out = torch.zeros(len(rows), last.shape[1], dtype=last.dtype, device=self.device)
        out[self._tensor(catching)] = last
        drafts = torch.zeros(len(rows), max_drafts, dtype=torch.int64, device=self.device)
        drafting = self._tensor([i for i, r in enumerate(rows) if r.num_draft_tokens > 0])
        drafts[drafting, 0] = self.model.draft_tokens(out[drafting])
        for depth in range(1, max_drafts):
            # Rows still drafting: one MTP step at position (newest - 1 + depth) on its own output.
            active = [i for i, r in enumerate(rows) if r.num_draft_tokens > depth]
            chain = [Row([0], rows[i].mtp_end - 1 + depth, rows[i].slot, rows[i].block_table) for i in active]
            batch = self._batch([], chain, commit=True)
            index = self._tensor(active)
            out[index] = self.model.draft_hidden(drafts[index, depth - 1], out[index], batch, self.kv)
            drafts[index, depth] = self.model.draft_tokens(out[index])
        return drafts

    def _accept(self, logits: torch.Tensor, rows: tuple[ScheduledRow, ...],
                drafts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [sum(k_r + 1), V] of the decode rows -> (accepted [B], tokens [B, K+1]).

        Greedy rows match drafts against the target's argmax. Sampled rows verify the (greedy)
        drafts by rejection sampling against the target's filtered distribution: accept d with
        probability p(d), else resample from p without d — emitted tokens are distributed
        exactly as without speculation. Their uniforms are the stream plain sampling would use
        at those positions (seed, position)."""
        max_drafts = max(r.num_draft_tokens for r in rows)
        row_of = [i for i, r in enumerate(rows) for _ in range(1 + r.num_draft_tokens)]
        depth_of = [d for r in rows for d in range(1 + r.num_draft_tokens)]
        target = torch.zeros(len(rows), max_drafts + 1, dtype=torch.int64, device=self.device)
        target[self._tensor(row_of), self._tensor(depth_of)] = logits.argmax(dim=-1)
        if drafts is None:
            drafts = torch.zeros(len(rows), max_drafts, dtype=torch.int64, device=self.device)
        num_drafts = self._tensor([r.num_draft_tokens for r in rows])
        accepted, tokens = greedy_accept(target, drafts, num_drafts)
        sampled = [i for i, r in enumerate(rows) if not r.request.params.greedy]
        if not sampled:
            return accepted, tokens
        # Filtered target distributions of the sampled rows, padded to [S, K+1, V].
        flat = [j for j, i in enumerate(row_of) if not rows[i].request.params.greedy]
        params = [rows[row_of[j]].request.params for j in flat]

        probs = self.ops.filter_probs(logits[self._tensor(flat)], *self._filter_columns(params))
        position = {i: n for n, i in enumerate(sampled)}
        padded = torch.zeros(len(sampled), max_drafts + 1, logits.shape[1], dtype=torch.float32, device=self.device)
        padded[self._tensor([position[row_of[j]] for j in flat]), self._tensor([depth_of[j] for j in flat])] = probs
        index = self._tensor(sampled)
        sampled_tokens, sampled_accepted = self.ops.rejection_sample(
            padded, None, drafts[index].contiguous(), num_drafts[index],
            self._tensor([rows[i].request.seed for i in sampled]),
            self._tensor([rows[i].start_position + 1 for i in sampled]))
        accepted, tokens = accepted.clone(), tokens.clone()
        accepted[index] = sampled_accepted.to(accepted.dtype)
        tokens[index] = sampled_tokens
        return accepted, tokens

    def _keep_hidden(self, hidden: torch.Tensor, rows: list[Row], scheduled: tuple[ScheduledRow, ...]) -> None:
        """Keep the target hidden states of every fed position of the decode rows (the next
        step's catch-up reads the accepted prefix of them)."""
        slots = [r.slot for r in rows for _ in r.token_ids]
        depths = [d for r in rows for d in range(len(r.token_ids))]
        self.states.mtp_hidden[self._tensor(slots), self._tensor(depths)] = hidden[:len(slots)]

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
        params = [r.request.params for r in rows]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()  # greedy fast path: no filtering, no noise

        tokens, _ = self.ops.sample(
            logits, *self._filter_columns(params),
            self._tensor([r.request.seed for r in rows]),
            # The position the sampled token will take: a seeded draw depends on nothing else.
            self._tensor([r.start_position + len(r.token_ids) for r in rows]),
        )
        return tokens.tolist()


def _offsets(lengths: list[int]) -> list[int]:
    """Start index of each row in a flattened batch."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts
