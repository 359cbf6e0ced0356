"""Continuous batching: which requests run this step, with which tokens, in which slots/blocks.

Pure Python; never touches a tensor. Each step:
  1. aborted requests release their slot and KV blocks (the step boundary);
  2. decode rows: every running request whose prompt is done feeds its newest token, oldest
     first; when KV blocks run out, the newest running request is preempted (its slot and
     blocks are freed, it goes back to the front of the queue and later recomputes its prompt
     and output so far, which reproduces its state exactly);
  3. prefill chunks under the remaining token budget: first running requests mid-prompt, then
     waiting requests admitted FIFO while a slot, max_num_seqs and KV blocks allow.
Rows are ordered decode first, prefill after (the runner's kernels rely on it).
`commit` folds the step's sampled tokens back in and finishes requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..spec import AdaptivePolicy, DraftLengthState
from .allocators import BlockAllocator, SlotAllocator
from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64             # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step (decode tokens + prefill chunks)
    draft_policy: AdaptivePolicy | None = None  # None: no speculation
    max_model_len: int = 1 << 30

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request "
                             "needs one token per step)")


@dataclass(frozen=True)
class ScheduledRow:
    """One request's work this step.

    Decode rows feed the newest token plus `num_draft_tokens` drafts (verify). With speculation
    on, the MTP layer also runs over positions [mtp_start, mtp_end) with inputs shifted by one:
    for a decode row those are the positions verified and accepted last step (their target
    hidden states were kept), for a prefill row the chunk's positions (hidden states from this
    step's forward)."""

    request: Request
    token_ids: list[int]
    start_position: int
    slot: int
    block_table: tuple[int, ...]
    sample: bool  # the row ends at the request's newest token: its logits give the next token
    num_draft_tokens: int = 0
    mtp_start: int = 0
    mtp_end: int = 0

    @property
    def mtp_token_ids(self) -> list[int]:
        """MTP inputs: the token after each MTP position."""
        return self.request.token_ids(self.mtp_start + 1, self.mtp_end + 1)


@dataclass(frozen=True)
class StepPlan:
    decode_rows: tuple[ScheduledRow, ...]
    prefill_rows: tuple[ScheduledRow, ...]

    @property
    def rows(self) -> tuple[ScheduledRow, ...]:
        return self.decode_rows + self.prefill_rows

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, slots: SlotAllocator, blocks: BlockAllocator) -> None:
        self.config, self.slots, self.blocks = config, slots, blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preempted = 0
        self._aborted: list[Request] = []

    # Admission and abort ------------------------------------------------------------------

    def can_ever_fit(self, request: Request) -> bool:
        return self.blocks.blocks_needed(request.max_num_tokens) <= self.blocks.capacity - 1

    def add(self, request: Request) -> None:
        if not self.can_ever_fit(request):
            raise ValueError(f"request needs {self.blocks.blocks_needed(request.max_num_tokens)} KV blocks, "
                             f"the pool has {self.blocks.capacity - 1}")
        if self.config.draft_policy is not None:
            request.draft_length = DraftLengthState(self.config.draft_policy)
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Takes effect at the next step boundary (the request may be in the step running now)."""
        request.abort_requested = True

    def take_aborted(self) -> list[Request]:
        aborted, self._aborted = self._aborted, []
        return aborted

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    # One step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._release_aborted()
        budget = self.config.max_num_batched_tokens
        decode_rows: list[ScheduledRow] = []
        scheduled: set[int] = set()
        decoding = [r for r in self.running if not self._in_prefill(r)]
        # Every decoding request gets its one token; drafts share what is left of the budget.
        spare = budget - len(decoding)
        for request in decoding:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older request
            num_drafts = min(self._draft_length(request), spare)
            spare -= num_drafts
            if not self._reserve_blocks(request, request.num_tokens + num_drafts, scheduled):
                continue  # the request itself was preempted
            decode_rows.append(self._row(request, 1, num_drafts))
            scheduled.add(id(request))
            budget -= 1 + num_drafts
        prefill_rows: list[ScheduledRow] = []
        for request in [r for r in self.running if self._in_prefill(r)]:
            if budget == 0:
                break
            chunk = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, request.num_computed_tokens + chunk, scheduled):
                continue
            prefill_rows.append(self._row(request, chunk))
            scheduled.add(id(request))
            budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            chunk = min(request.num_tokens, budget)
            if not (self.slots.can_allocate(1) and self.blocks.can_allocate(self.blocks.blocks_needed(chunk))):
                break
            self.waiting.popleft()
            request.slot = self.slots.allocate(1)[0]
            request.block_table = self.blocks.allocate(self.blocks.blocks_needed(chunk))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            prefill_rows.append(self._row(request, chunk))
            scheduled.add(id(request))
            budget -= chunk
        return StepPlan(tuple(decode_rows), tuple(prefill_rows))

    def commit(self, plan: StepPlan, emitted: list[list[int]], logprobs: list | None = None) -> list[Request]:
        """Fold the step's results in. emitted[i]: the tokens plan.rows[i] produced (none for a
        prefill chunk that does not end the prompt; accepted drafts + one for a verify row).
        logprobs[i]: their TokenLogprobs when the request asked for them.
        Returns the requests that got tokens or finished."""
        updated = []
        for index, (row, tokens) in enumerate(zip(plan.rows, emitted)):
            request = row.request
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted while this step ran: it recomputes from scratch
            accepted_drafts = len(tokens) - 1 if row.num_draft_tokens else 0
            # Fed tokens whose state is now pending or committed: the row's token(s) and the
            # drafts the target confirmed.
            request.num_computed_tokens += len(row.token_ids) + accepted_drafts
            request.mtp_position = max(request.mtp_position, row.mtp_end)
            if request.draft_length is not None and index < len(plan.decode_rows):
                request.draft_length.record(row.num_draft_tokens, accepted_drafts)
                if row.num_draft_tokens:
                    request.spec_stats.record(row.num_draft_tokens, accepted_drafts)
            if row.sample:
                request.extend(tokens, logprobs[index] if logprobs else None)
                updated.append(request)
                if request.finished:
                    self._finish(request)
        return updated

    # Helpers ------------------------------------------------------------------------------

    @staticmethod
    def _in_prefill(request: Request) -> bool:
        """More than the newest token is still to be computed, or nothing is yet (a fresh or
        recomputing request starts from a zero state through the chunked path)."""
        remaining = request.num_tokens - request.num_computed_tokens
        return remaining > 1 or request.num_computed_tokens == 0

    def _row(self, request: Request, num_tokens: int, num_drafts: int = 0) -> ScheduledRow:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
        if self.config.draft_policy is None:
            mtp_start = mtp_end = 0
        elif self._in_prefill(request):
            # The chunk's positions, except the prompt's last: its next token is not sampled yet.
            mtp_start, mtp_end = start, min(end, request.num_tokens - 1)
        else:
            mtp_start, mtp_end = request.mtp_position, request.num_tokens - 1
        return ScheduledRow(request, request.token_ids(start, end), start, request.slot, tuple(request.block_table),
                            sample=end == request.num_tokens, num_draft_tokens=num_drafts, mtp_start=mtp_start,
                            mtp_end=mtp_end)

    def _draft_length(self, request: Request) -> int:
        """Drafts for this step: the request's adaptive length, never past max_tokens or the
        context."""
        if request.draft_length is None:
            return 0
        if request.mtp_position >= request.num_tokens - 1:
            return 0  # the prompt's last token, fed alone after a chunk: no MTP output to chain from
        room = min(self.config.max_model_len - request.num_tokens,
                   request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(0, min(request.draft_length.num_draft_tokens, room))

    def _reserve_blocks(self, request: Request, num_tokens: int, scheduled: set[int]) -> bool:
        """Grow the block table to hold num_tokens, preempting the newest running requests not
        yet scheduled this step. False when `request` itself had to be preempted."""
        needed = self.blocks.blocks_needed(num_tokens) - len(request.block_table)
        while not self.blocks.can_allocate(needed):
            victims = [r for r in self.running if id(r) not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.arrival) if victims else request
            if victim.arrival < request.arrival:
                victim = request  # never preempt an older request to grow a newer one
            self._preempt(victim)
            if victim is request:
                return False
        if needed > 0:
            request.block_table.extend(self.blocks.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.mtp_position = 0
        request.num_preemptions += 1
        self.num_preempted += 1
        # Back to the queue in arrival order, ahead of anything that arrived later.
        position = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(position, request)

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.slots.free([request.slot])
            self.blocks.free(request.block_table)
        request.slot, request.block_table = None, []
        if request in self.running:
            self.running.remove(request)

    def _finish(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.FINISHED

    def _release_aborted(self) -> None:
        for queue in (self.running, self.waiting):
            for request in [r for r in queue if r.abort_requested]:
                if request in self.waiting:
                    self.waiting.remove(request)
                self._release(request)
                request.status = RequestStatus.FINISHED
                request.abort()
                self._aborted.append(request)
