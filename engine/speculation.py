"""MTP speculation on the pools: draft, verify, accept and roll back, for one step's decode rows.

A speculative step (`launch`) is:

  1. draft:  the MTP catch-up over C = k + 1 positions from each row's first missing MTP
             position (its n_r <= C real ones are the positions verified and accepted last step,
             inputs shifted by one, with the target hidden states kept at the slot; the rest is
             padding), then K - 1 chained single-token MTP steps on the MTP's own output. K is
             the step's draft count (spec/adaptive.py chooses it; a row drafts k_r <= K);
             drafts are the MTP's argmax [B, K].
  2. verify: one target forward over [newest, d_1 .. d_K] of every decode row through the
             deferred-commit kernels (the newest token, always accepted, is folded into the
             committed state; the drafts are left pending).
  3. accept: greedy rows take the longest prefix matching the target's argmax, sampled rows
             are decided by rejection sampling coupled with plain sampling (spec/accept.py):
             they emit exactly the tokens plain sampling would, whatever the drafts. A step
             with plainly sampled rows (SamplingParams.drawn_in_step) is a *sampled* step: it
             draws their targets itself (DecodeStep.draw), inside its graph.
  4. roll back: each slot's pending count becomes its accepted drafts (`_set_pending`, the one
             place it is written): the rejected drafts' inputs stay in the pending buffer
             unread, so rollback is a counter, not a copy or a re-run. The fed positions'
             hidden states are kept at the slot for the next step's catch-up, and prefill chunks
             run the MTP over their own positions so the MTP's KV cache stays complete.

As soon as the drafts are made, before the verify forward, they are copied to the host
(`HostDrafts`): constrained rows' grammar masks follow the drafts, and are computed from them
while the device verifies.

`draft` and `verify` run at fixed shapes (decode_step.py), so a decode-only step replays one
CUDA graph per (batch bucket, K, sampled) (cuda_graphs.SpecGraphs) and can be launched before
the step before it is read: its outputs stay on the device (`launch`), penalized and constrained
rows' acceptance too (`resample`), and the host reads them one step late (runner.py). A step with
prefill chunks runs its decode rows the same way and its chunks in an eager forward after them
(runner.py), where `prefill_mtp` runs the MTP over the chunks' positions (a graph replay
where one fits: prefill_graphs.py). A test may pass `edit_drafts`,
called between draft and verify with the rows and the drafts [B, K], to rewrite the drafts in
place (forcing acceptance counts); a benchmark may pass `forced_acceptance` (spec/profile.py),
which replaces each row's accepted count with a draw from a per-position profile, every other
stage running as it does. Knows nothing about queues, stop conditions or the adaptive
draft length: the plan says how many drafts each row gets.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..spec import AcceptanceProfile, greedy_accept, sampled_accept
from .batch import ForwardBatch, device_arrays, row_index, spans
from .checkpoint_io import CheckpointIO
from .decode_step import DecodeRows, DecodeStep, RowTokens
from .models import HybridLM
from .penalties import PenalizedRows
from .sampler import ReadDrafts, Sampler
from .state_pool import KVPool, StatePool
from .step import ScheduledRow

if TYPE_CHECKING:
    from .cuda_graphs import SpecGraphs
    from .prefill_graphs import PrefillGraphs

# Called between draft and verify with the step's decode rows and their drafts [B, K] (B >= the
# number of rows: a graph bucket's padding rows follow); may rewrite the drafts in place.
DraftEditor = Callable[[Sequence[ScheduledRow], torch.Tensor], None]


class Drafted(NamedTuple):
    """A speculative step's decode rows on the device and what it made of them."""

    rows: DecodeRows
    drafts: torch.Tensor        # [B, K]
    logits: torch.Tensor | None  # [B * (K + 1), V] verify logits (None until verified)


class _Resampling(NamedTuple):
    """Verify rows whose acceptance is redone after the step (Speculator.prepare)."""

    index: slice | torch.Tensor  # [R] the rows' places in the step (batch.row_index)
    rows: list[ScheduledRow]
    logits: torch.Tensor       # [R * W, V] verify logits adjusted by the penalties
    positions: torch.Tensor    # [R * W] where each position's token goes
    drafts: torch.Tensor       # [R, K]
    read_drafts: ReadDrafts    # the same drafts on the host (HostDrafts.reader)
    num_drafts: torch.Tensor   # [R]
    slots: torch.Tensor        # [R]
    penalized: PenalizedRows | None  # the penalized ones among them


class HostDrafts:
    """The drafts [B, K] of the latest speculative step, on the host as soon as the MTP has made
    them: a constrained row's grammar masks follow its drafts (structured.py), and with the
    drafts here before the verify forward they are computed while the device verifies rather
    than after the whole step. On the GPU the copy into one pinned buffer is queued on a stream
    of its own, forked from the step's stream after the drafts are made (`copy`) and joined back
    after the verify (`join`): inside a captured graph that is a memcpy node beside the verify,
    not in front of it, and an external event record node the host waits on (`reader`). Off the
    GPU the buffer is written at once. The buffer holds one step's drafts: they are read before
    the next speculative step is launched (the engine decides a step's constrained rows, the
    only readers, before it launches the next: core.py)."""

    def __init__(self, max_rows: int, max_drafts: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._values = torch.zeros(max_rows * max_drafts, dtype=torch.int64, pin_memory=cuda)
        self._stream = torch.cuda.Stream(device) if cuda else None
        # external: recorded inside a graph, the event is a record node the host can wait on
        # (an internal one would only order streams within the graph). Recorded once here so
        # that it exists before any capture.
        self._ready = torch.cuda.Event(external=True) if cuda else None
        if self._ready is not None:
            self._ready.record(torch.cuda.current_stream(device))

    def copy(self, drafts: torch.Tensor) -> None:
        """Queue the copy of a step's drafts [B, K] (contiguous), between its draft and verify
        stages; `join` once the verify is queued."""
        values = self._values[:drafts.numel()].view(drafts.shape)
        if self._stream is None:
            values.copy_(drafts)
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            values.copy_(drafts, non_blocking=True)
            self._ready.record(self._stream)

    def join(self) -> None:
        """The step's stream waits for the copy (a graph's capture must end on its own stream)."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def reader(self, chosen: Sequence[int], num_drafts: int) -> ReadDrafts:
        """What reads the latest step's drafts of its rows `chosen` (in that order), K =
        num_drafts each, waiting (without the GIL) for the copy."""
        def read() -> list[list[int]]:
            if self._ready is not None:
                self._ready.synchronize()
            every = self._values[:(max(chosen) + 1) * num_drafts].view(-1, num_drafts).tolist()
            return [every[i] for i in chosen]
        return read


class Speculator:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, decode: DecodeStep, sampler: Sampler,
                 checkpoint_io: CheckpointIO, edit_drafts: DraftEditor | None = None,
                 forced_acceptance: AcceptanceProfile | None = None) -> None:
        """edit_drafts, forced_acceptance: for tests and benchmarks (the module docstring)."""
        if model.mtp is None or states.mtp_hidden is None or not decode.speculative:
            raise ValueError("speculation needs a model with MTP weights and a pool that keeps MTP inputs")
        self.model, self.states, self.kv, self.decode = model, states, kv, decode
        self.sampler, self.checkpoint_io, self.edit_drafts = sampler, checkpoint_io, edit_drafts
        self.forced_acceptance = forced_acceptance
        self.device = states.pending_counts.device
        self.host_drafts = HostDrafts(decode.outputs.shape[1], decode.catch_up - 1, self.device)

    # Fixed-shape stages (captured in CUDA graphs) ------------------------------------------

    def draft(self, rows: DecodeRows, num_drafts: int) -> torch.Tensor:
        """MTP catch-up + chain -> drafts [B, num_drafts] int64, its first batch filling in the
        fed rows (DecodeStep.batch). The catch-up runs even for num_drafts = 0: it keeps the
        MTP's KV cache complete for later drafting."""
        decode, num_rows, catch_up = self.decode, rows.num_rows, self.decode.catch_up
        # Positions [mtp_start, mtp_start + C), inputs the catch-up ids: the step's first stage,
        # which completes the fed rows.
        batch = decode.batch(rows, RowTokens.CATCH_UP, catch_up, feed=True)
        kept = self.states.mtp_hidden[rows.slots].flatten(0, 1)                             # [B*C, H]
        out = self.model.draft_hidden(batch.input_ids, kept, batch, self.kv).view(num_rows, catch_up, -1)
        if num_drafts == 0:
            return rows.packed.new_empty(num_rows, 0)
        # The MTP output at each row's newest caught-up position predicts the first draft.
        hidden = out[decode.arange(num_rows), (rows.num_catch_up - 1).clamp(min=0)]        # [B, H]
        drafts = [self.model.draft_tokens(hidden)]
        for depth in range(1, num_drafts):
            # MTP position (newest - 1 + depth): input the previous draft and the MTP's own output.
            batch = decode.batch(rows, RowTokens.EXTRA, 1, extra=drafts[-1][:, None], offset=depth - 1)
            hidden = self.model.draft_hidden(batch.input_ids, hidden, batch, self.kv)
            drafts.append(self.model.draft_tokens(hidden))
        return torch.stack(drafts, dim=1)

    def verify(self, rows: DecodeRows, drafts: torch.Tensor, logits_out: torch.Tensor | None = None,
               sampled: bool = False) -> torch.Tensor:
        """The target over [newest, drafts] of every row, then `accept`; returns the logits
        [B * (K + 1), V], row-major by (row, depth): `logits_out` (a graph's static buffer) when
        given."""
        batch = self.decode.batch(rows, RowTokens.NEWEST, drafts.shape[1] + 1, extra=drafts, commit=False)
        hidden = self.model(batch, self.states, self.kv)
        logits = self.model.logits(hidden, out=logits_out)
        self.accept(hidden, logits, rows, drafts, sampled)
        return logits

    def step(self, rows: DecodeRows, num_drafts: int, logits_out: torch.Tensor | None = None,
             sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """draft, the drafts' copy to the host, then verify: a whole speculative decode step on
        the device (one CUDA graph). Returns (drafts, logits)."""
        drafts = self.draft(rows, num_drafts)
        self.host_drafts.copy(drafts)
        logits = self.verify(rows, drafts, logits_out, sampled)
        self.host_drafts.join()
        return drafts, logits

    def accept(self, hidden: torch.Tensor, logits: torch.Tensor, rows: DecodeRows, drafts: torch.Tensor,
               sampled: bool = False) -> None:
        """Acceptance of every row from hidden [B*(K+1), H] and logits [B*(K+1), V] of the fed
        tokens: greedy, or with `sampled` rejection sampling (spec/accept.py) for the rows whose
        slot samples (DecodeStep.draw: their targets are plain sampling's draws at each
        position). Rolls each slot back to its accepted drafts, keeps the hidden states for the
        next catch-up and the accepted counts and emitted tokens for the host and the next
        step's fed rows (DecodeStep.record). Argmax of the model-dtype logits equals argmax of
        their float32 copies (the widening is exact), and so do the draws."""
        num_rows, width = drafts.shape[0], drafts.shape[1] + 1
        self.states.mtp_hidden[rows.slots, :width] = hidden.view(num_rows, width, -1)
        # The target's tokens and each row's non-finite flag (over its W positions), one launch.
        target, _ = self.model.ops.greedy_argmax(logits, width, nonfinite=self.decode.nonfinite[:num_rows])
        acceptance = greedy_accept
        if sampled:
            target, acceptance = self.decode.draw(logits, rows, target), sampled_accept
        accepted, emitted = self._forced(*acceptance(target.view(num_rows, width), drafts, rows.num_drafts),
                                         rows.num_drafts)
        self._set_pending(rows.slots, accepted)
        self.decode.record(rows, accepted, emitted)

    # One step -------------------------------------------------------------------------------

    def launch(self, rows: Sequence[ScheduledRow], graphs: SpecGraphs | None, deferred: Sequence[int] = ()) -> Drafted:
        """A decode-only speculative step, queued on the device with no host sync: draft,
        verify, accept, roll back. Its outputs stay in DecodeStep's buffers (`accepted`,
        `emitted`), where the next step's fed rows read them and the runner copies them to the host.
        A step with plainly sampled rows is a sampled step (`accept`); penalized and
        constrained rows are redecided (`resample`). deferred: rows whose acceptance the caller
        redoes later (constrained rows, whose grammar masks wait for the step before to be
        committed)."""
        num_drafts = max(r.num_draft_tokens for r in rows)
        sampled = any(r.request.params.drawn_in_step for r in rows)
        decode_rows = [r.decode_row() for r in rows]
        if graphs is not None and graphs.can_run(decode_rows, num_drafts):
            drafted = graphs.run(decode_rows, num_drafts, sampled, self._edit_in_place(rows))
        else:
            device_rows = self.decode.row_tensors(decode_rows, self.device)
            drafts = self.draft(device_rows, num_drafts)
            self._edit(rows, drafts)
            self.host_drafts.copy(drafts)
            drafted = Drafted(device_rows, drafts, self.verify(device_rows, drafts, sampled=sampled))
            self.host_drafts.join()
        now = [i for i, r in enumerate(rows) if r.request.params.redecided and i not in deferred]
        self.resample(rows, drafted, now)
        return drafted

    def resample(self, rows: Sequence[ScheduledRow], drafted: Drafted, sampled: Sequence[int]) -> None:
        """Redo the acceptance of the rows `sampled` indexes (penalized and constrained ones:
        SamplingParams.redecided), on the device: at each verified position the token plain
        decoding would choose there (same seed, same position; the penalties counting the drafts before it as
        generated: penalties.py; the grammar after the drafts before it: structured.py), the
        drafts accepted while they match — rejection sampling for sampled rows
        (spec/accept.py), greedy acceptance of the penalized argmax for greedy ones. Overwrites
        those rows' accepted counts, emitted tokens and pending counts (greedy acceptance of
        the raw logits ran for all), and adds penalized rows' emitted tokens to their
        statistics. `prepare` then `decide`: a caller may decide later (constrained rows)."""
        self.decide(self.prepare(rows, drafted, sampled))

    def prepare(self, rows: Sequence[ScheduledRow], drafted: Drafted, sampled: Sequence[int]) -> _Resampling | None:
        """What `decide` needs, the penalties applied to the rows' verify logits, read from the
        step's buffers before the next step is loaded into them: gathered now, or, when every
        row is sampled, views of them that `decide` reads before the next launch."""
        if not sampled:
            return None
        width = drafted.drafts.shape[1] + 1
        index = row_index(sampled, len(rows), self.device)
        device_rows = DecodeRows(drafted.rows.packed[index])  # the chosen rows, one gather (or a view)
        positions = self.decode.draw_positions(device_rows, width)
        chosen, drafts = [rows[i] for i in sampled], drafted.drafts[index]
        penalized = self.sampler.penalties.select(chosen)
        # In the model's dtype: the penalties, the grammar masks and the draws widen it exactly.
        logits = drafted.logits.view(-1, width, drafted.logits.shape[1])[index].flatten(0, 1)  # [R * W, V]
        adjusted = self.sampler.penalties.adjust(logits, penalized, drafts)
        return _Resampling(index, chosen, adjusted, positions, drafts, self.host_drafts.reader(sampled, width - 1),
                           device_rows.num_drafts, device_rows.slots, penalized)

    def decide(self, resampling: _Resampling | None, masks: Future | None = None) -> None:
        """Draw the prepared rows' targets (masks: their prefetched grammar masks, else computed
        now: a constrained row's masks need its drafts on the host, a wait for the step's draft
        stage), accept, roll back (`resample`)."""
        if resampling is None:
            return
        index, rows, drafts, num_drafts = resampling.index, resampling.rows, resampling.drafts, resampling.num_drafts
        width = drafts.shape[1] + 1
        targets = self.sampler.draw(resampling.logits, rows, resampling.positions, resampling.read_drafts, masks,
                                    resampling.slots, owned=resampling.penalized is not None).view(len(rows), width)
        accepted, emitted = self._forced(*sampled_accept(targets, drafts, num_drafts), num_drafts)
        self.decode.accepted[index] = accepted
        self.decode.emitted[:width, index] = emitted.T
        self._set_pending(resampling.slots, accepted)
        self.sampler.penalties.record(resampling.penalized, emitted, accepted + 1)

    def _forced(self, accepted: torch.Tensor, emitted: torch.Tensor,
                num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted, emitted), the accepted counts drawn from the forced profile if one is set."""
        if self.forced_acceptance is None:
            return accepted, emitted
        return self.forced_acceptance.draw(num_drafts, emitted.shape[1] - 1), emitted

    def _edit(self, rows: Sequence[ScheduledRow], drafts: torch.Tensor) -> None:
        if self.edit_drafts is not None:
            self.edit_drafts(rows, drafts)

    def _edit_in_place(self, rows: Sequence[ScheduledRow]) -> Callable[[torch.Tensor], None] | None:
        """What a graph replay calls between its draft and verify halves (None: one graph)."""
        if self.edit_drafts is None:
            return None
        return lambda drafts: self.edit_drafts(rows, drafts)

    def _set_pending(self, slots: torch.Tensor, num_accepted: torch.Tensor | None) -> None:
        """Roll the slots back to their accepted drafts: the next step folds the first
        num_accepted pending inputs into the committed state and ignores the rest (None: zero,
        nothing pending)."""
        if num_accepted is None:
            self.states.pending_counts.index_fill_(0, slots, 0)
        else:
            self.states.pending_counts[slots] = num_accepted.to(torch.int32)

    def prefill_mtp(self, hidden: torch.Tensor, batch: ForwardBatch, rows: Sequence[ScheduledRow],
                    graphs: PrefillGraphs | None = None,
                    embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After the target's forward over prefill chunks (hidden [T, H]): a fresh prefill leaves
        nothing pending, and the MTP runs over each chunk's positions [mtp_start, mtp_end) with
        the target hidden states — this step's for the chunk's own positions, the slot's kept
        ones for the position before the chunk (a restored checkpoint whose MTP was one behind)
        — so the MTP's KV cache stays complete; a chunk that ends the prompt keeps its last
        hidden state for the first catch-up. graphs: the MTP forward's captured graphs (the
        inputs are gathered into their static buffer), else it runs eagerly; so do runs that
        read image tokens (embeds: their features, as ForwardBatch.embeds of the MTP's rows)."""
        decode_tokens = batch.prefill.token_start
        lengths = np.array([len(r.token_ids) for r in rows], dtype=np.int64)
        row_offsets = decode_tokens + np.cumsum(lengths) - lengths       # each row's first token in hidden
        starts, mtp_starts, mtp_ends = (np.array(column, dtype=np.int64).reshape(-1) for column in
                                        zip(*((r.start_position, r.mtp_start, r.mtp_end) for r in rows)))
        # A row's MTP positions [mtp_start, mtp_end) are laid out one row after another: those
        # before `split` precede the chunk (the slot's kept hidden states, depth position -
        # mtp_start), those from `split` on are the chunk's own (this forward's hidden states).
        runs = mtp_ends > mtp_starts
        split = np.minimum(np.maximum(starts, mtp_starts), mtp_ends)
        num_kept, num_positions = (split - mtp_starts) * runs, (mtp_ends - mtp_starts) * runs
        place = np.cumsum(num_positions) - num_positions
        slots = np.array([r.slot for r in rows], dtype=np.int64)
        sampled = np.array([r.sample for r in rows], dtype=bool)
        t = device_arrays(dict(
            slots=slots,
            fresh_place=spans(place + num_kept, num_positions - num_kept),
            fresh_index=spans(row_offsets + split - starts, num_positions - num_kept),
            kept_place=spans(place, num_kept),
            kept_slots=np.repeat(slots, num_kept),
            kept_depths=spans(np.zeros_like(num_kept), num_kept),
            keep_slots=slots[sampled],
            keep_index=(row_offsets + lengths - 1)[sampled]), self.device)
        self._set_pending(t["slots"], None)
        mtp_rows = [r.mtp_row() for r in rows if r.mtp_end > r.mtp_start]
        if mtp_rows:
            def fill(inputs: torch.Tensor) -> None:
                inputs[t["fresh_place"]] = hidden[t["fresh_index"]]
                if num_kept.any():
                    inputs[t["kept_place"]] = self.states.mtp_hidden[t["kept_slots"], t["kept_depths"]]

            if graphs is None or embeds is not None or graphs.run(mtp_rows, fill) is None:
                inputs = hidden.new_empty(int(num_positions.sum()), hidden.shape[1])
                fill(inputs)
                mtp_batch = replace(ForwardBatch.build([], mtp_rows, self.decode.block_size, self.device, commit=True),
                                    embeds=embeds)
                self.model.draft_hidden(mtp_batch.input_ids, inputs, mtp_batch, self.kv)
        if sampled.any():
            self.states.mtp_hidden[t["keep_slots"], 0] = hidden[t["keep_index"]]
