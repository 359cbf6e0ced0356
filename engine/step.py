"""The step contract between the scheduler and the runner: what one step runs and what it gave.

    Scheduler.schedule() -> StepPlan ──► Runner.launch(plan) -> InFlight -> StepOutput ──► Scheduler.commit(plan, output)

A StepPlan lists the step's rows in the order the runner relies on: decode rows first (one token
each, plus the drafts the runner makes for them when speculating), then prefill chunks, then
cached rows (fully cached prompts, nothing to run). A StepOutput holds, per plan row in that
order, the tokens it emitted and what the scheduler needs to fold them in. Data flows one way:
the runner reads nothing of the scheduler beyond the plan, the scheduler nothing of the device.

A decode row's token may be *fed*: when the step is planned before the step in flight has been
read (async scheduling), the row names the row of that step whose emitted token it takes
(`fed_from`: a decode row's, or the first token of a prefill row that ended its prompt), and the
runner reads the token on the device. Knows nothing about how rows are chosen or run.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from .batch import Row
from .decode_step import DecodeRow
from .prefix_cache import CacheOps, Checkpoint, CheckpointWrite
from .request import Request, TokenLogprobs
from .vision.prompt import rope as prompt_rope


class ScheduledRow(msgspec.Struct, frozen=True, gc=False):
    """One request's work this step.

    Decode rows feed the newest token (`token_ids`, or the token the step in flight emits at its
    row `fed_from`) plus `num_draft_tokens` drafts (verify). With speculation on, the MTP layer
    also runs over positions [mtp_start, mtp_end) with inputs shifted by one: for a decode row
    those are the positions verified and accepted last step (their target hidden states were
    kept), for a prefill row the chunk's positions (hidden states from this step's forward).

    A msgspec Struct: every running request gets one per step (as RequestDelta says why).
    block_table is the request's own (immutable) tuple."""

    request: Request
    token_ids: list[int]  # empty for a fed row
    start_position: int
    slot: int
    block_table: tuple[int, ...]
    sample: bool  # the row ends at the request's newest token: its logits give the next token
    num_draft_tokens: int = 0
    mtp_start: int = 0
    mtp_end: int = 0
    checkpoints: tuple[CheckpointWrite, ...] = ()  # prefill rows: checkpoints the forward writes
    fed_from: int | None = None  # a fed decode row: the row of the step in flight giving its token
    # Prefill rows of a request asking for prompt log-probabilities: the positions [a, b) of the
    # row whose next prompt token the step scores (Request.prompt_logprob_span; (0, 0): none).
    prompt_logprob_span: tuple[int, int] = (0, 0)

    @property
    def num_tokens(self) -> int:
        """Tokens the row feeds (drafts aside)."""
        return 1 if self.fed_from is not None else len(self.token_ids)

    @property
    def mtp_token_ids(self) -> list[int]:
        """MTP inputs: the token after each MTP position."""
        return self.request.token_ids(self.mtp_start + 1, self.mtp_end + 1)

    def decode_row(self) -> DecodeRow:
        """The decode row as the fixed-shape decode stages take it. A fed row's token, position
        and MTP catch-up come from the step in flight (DecodeStep.feed); its start_position is
        the furthest the row can be, which its blocks cover."""
        if self.fed_from is not None:
            return DecodeRow(self.slot, 0, self.start_position, self.block_table, self.num_draft_tokens,
                             fed_from=self.fed_from)
        return DecodeRow(self.slot, self.token_ids[0], self.start_position, self.block_table, self.num_draft_tokens,
                         self.mtp_start, self.mtp_token_ids)

    def forward_row(self) -> Row:
        """The row as the model's varlen batch takes it (known tokens only)."""
        rope, delta = prompt_rope(self.request.images, self.start_position, self.start_position + len(self.token_ids))
        return Row(self.token_ids, self.start_position, self.slot, self.block_table, num_logits=int(self.sample),
                   checkpoints=tuple((w.position - self.start_position, w.slot) for w in self.checkpoints),
                   rope=rope, rope_delta=delta)

    def mtp_row(self) -> Row:
        """The MTP's varlen row over positions [mtp_start, mtp_end): each turned as the target
        turns it, fed the token after it (`mtp_token_ids`)."""
        rope, delta = prompt_rope(self.request.images, self.mtp_start, self.mtp_end)
        return Row(self.mtp_token_ids, self.mtp_start, self.slot, self.block_table, num_logits=0, rope=rope,
                   rope_delta=delta)


@dataclass(frozen=True)
class StepPlan:
    decode_rows: tuple[ScheduledRow, ...]
    prefill_rows: tuple[ScheduledRow, ...]
    # Fully cached prompts: no tokens to run, the first token comes from the restored hidden state.
    cached_rows: tuple[ScheduledRow, ...] = ()
    cache_ops: CacheOps = CacheOps()
    pinned: tuple[Checkpoint, ...] = ()  # checkpoints this step restores (unpinned at commit)
    writes: tuple[Checkpoint, ...] = ()  # checkpoints its prefill chunks write (registered at commit)

    @property
    def rows(self) -> tuple[ScheduledRow, ...]:
        return self.decode_rows + self.prefill_rows + self.cached_rows

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def admits(self) -> bool:
        """Whether the step has new rows (prefill chunks or cached prompts): an admitting step,
        not a decode step (its time is not a decode step's price, nor counted as one)."""
        return bool(self.prefill_rows or self.cached_rows)


@dataclass(frozen=True)
class StepOutput:
    """Per plan row (decode rows first), what the step produced."""

    emitted: list[list[int]]  # the tokens each row emitted (accepted drafts + one for a verify row)
    # One TokenLogprobs per emitted token, for rows whose request asked for them.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Fed tokens of each row left pending in its slot (None: none anywhere, no speculation).
    num_pending: list[int] | None = None
    # Per plan row, the scores of the prompt tokens after its prompt_logprob_span's positions
    # (None: none anywhere).
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # Whether each row's logits held a NaN or an infinity (None: no row's did, or none were
    # checked); such a row's tokens are garbage and its request fails (Scheduler.commit).
    nonfinite: list[bool] | None = None


def flagged(nonfinite: list[bool] | list[int]) -> list[bool] | None:
    """Per-row non-finite flags (bools, or 0/1 as the device keeps them) as StepOutput keeps
    them: None when no row is flagged."""
    return [bool(flag) for flag in nonfinite] if any(nonfinite) else None
