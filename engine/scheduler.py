"""Continuous batching: which requests run this step, with which tokens, in which slots/blocks.

Pure Python; never touches a tensor. Each step:
  1. aborted requests release their slot and KV blocks (at the step boundary: when a step is
     committed or the next one scheduled);
  2. decode rows: every running request whose prompt is done feeds its newest token, oldest
     first; when KV blocks run out, the last-ranked running request is preempted (its slot and
     blocks are freed, it goes back to the queue in rank order and later recomputes its prompt
     and output so far, which reproduces its state exactly);
  3. prefill chunks under the remaining token budget: first running requests mid-prompt, then
     waiting requests admitted in rank order while a slot, max_num_seqs and KV blocks allow. An admitted
     request restores the longest cached prefix of its tokens (prefix_cache.py) and prefills
     only the rest; a fully cached one samples its first token from the checkpoint (a cached
     row). Chunks that do not end the prompt end on a multiple of the GDN chunk size, so the
     chunked kernel can write checkpoints at the block boundaries they pass. A request asking
     for prompt log-probabilities restores no prefix past the prompt positions already scored
     (Request.restorable); its chunks say which positions the step scores.
Rows are ordered decode first, prefill after, cached rows last (the runner relies on it). With
speculation, every decode row of a step runs the step's draft count K (fixed shapes), which the
draft policy chooses from measured step costs and the rows' acceptance (spec/adaptive.py).
`commit` folds the step's tokens back in, counts speculation, and finishes requests; a finished
request's slot and blocks become the checkpoint of its committed state.

`continuation` plans the step after a step whose tokens are not known yet (async scheduling):
the same requests, each fed from its row of that step on the device (its newest token, and with
speculation its position and MTP catch-up, follow from what that row emits: the tokens a decode
row emits, or the first token of a prefill row that ends its prompt), and the waiting requests
admitted after them as `schedule` admits them. Only when the rest can wait a step: no abort, no
preemption, no prompt mid-way (its next chunk starts where the step in flight ends), no cached
row in the step in flight (its MTP may be a position behind). A request that the step in flight
may finish with "length" is left out (that is known in advance); one it finishes with "stop" has
been fed its last token when the step is committed, so its kept checkpoint covers every token it
has (or, when the step emitted tokens past the stop, nothing is kept: its state went past them).
The checkpoints a step's prefill chunks write are its own (StepPlan.writes): the step planned
ahead reserves its writes before the one in flight registers its own.
When slots or KV blocks run short, cached checkpoints are evicted before anything is preempted.

A request's rank (Request.rank) is its arrival under the "fcfs" policy, (priority, arrival) under
"priority" (vLLM's policies: lower priority values first). Under "priority" a waiting request
that outranks running ones also takes their place when it cannot be admitted (no sequence slot
under max_num_seqs, or not the KV blocks of its first chunk): the last-ranked running requests
are preempted for it at the start of `schedule` (vLLM's forced preemption), and `continuation`
leaves such a step to `schedule`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..kernels.gdn_chunked import CHUNK_SIZE
from ..spec import DraftPolicy, SpecStats
from .allocators import BlockAllocator, SlotAllocator
from .prefix_cache import Checkpoint, CheckpointWrite, PrefixCache
from .request import Request, RequestStatus
from .step import ScheduledRow, StepOutput, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int                  # running requests at most
    max_num_batched_tokens: int        # tokens per step (decode tokens + prefill chunks)
    max_model_len: int = 1 << 30
    # Positions past its newest token a decode row may write (its drafts, the MTP catch-up's
    # padding): the pools' k, whatever the draft policy drafts.
    max_draft_tokens: int = 0
    scheduling_policy: str = "fcfs"  # or "priority" (module docstring)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request "
                             "needs one token per step)")


class Scheduler:
    def __init__(self, config: SchedulerConfig, slots: SlotAllocator, blocks: BlockAllocator,
                 cache: PrefixCache, draft_policy: DraftPolicy | None = None) -> None:
        """draft_policy: how many drafts each step runs (None: no speculation). It may be
        replaced between steps (benchmarks compare settings on one engine) by one drafting at
        most config.max_draft_tokens, what the pools are sized for."""
        if draft_policy is not None and not 0 < draft_policy.max_draft_tokens <= config.max_draft_tokens:
            raise ValueError(f"a draft policy of up to {draft_policy.max_draft_tokens} drafts on pools sized for "
                             f"{config.max_draft_tokens}")
        self.config, self.slots, self.blocks, self.cache = config, slots, blocks, cache
        self.draft_policy = draft_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preempted = 0
        self.spec_stats = SpecStats()  # engine-wide speculation counters
        self._aborted: list[Request] = []
        self._abort_requested = False  # since the last step boundary

    # Admission and abort ------------------------------------------------------------------

    def can_ever_fit(self, request: Request) -> bool:
        return self._blocks_for_life(request) <= self.blocks.capacity - 1

    def _blocks_for_life(self, request: Request) -> int:
        """KV blocks the request needs at most: every token it may hold, and the positions past
        its newest that a decode row writes."""
        return self.blocks.blocks_needed(request.max_num_tokens + self.config.max_draft_tokens)

    def add(self, request: Request) -> None:
        if not self.can_ever_fit(request):
            raise ValueError(f"request needs {self._blocks_for_life(request)} "
                             f"KV blocks, the pool has {self.blocks.capacity - 1}")
        if self.draft_policy is not None:
            request.acceptance = self.draft_policy.new_estimate()
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the queue in rank order, after every request ranked before it (found from the
        back: under fcfs a new request goes last at once, a preempted one near the front)."""
        waiting = self.waiting
        position = len(waiting)
        while position and waiting[position - 1].rank > request.rank:
            position -= 1
        waiting.insert(position, request)

    def abort(self, request: Request) -> None:
        """Takes effect at the next step boundary (the request may be in the step running now)."""
        request.abort_requested = True
        self._abort_requested = True

    def pause(self, request: Request) -> None:
        """Schedule no more of the request until `resume` (its client is not reading): it keeps
        its slot and blocks, and may be preempted like any running request."""
        request.paused = True

    def resume(self, request: Request) -> None:
        request.paused = False

    def reset_counters(self) -> None:
        """Speculation and preemption counters back to zero (after the start-up warm-up)."""
        self.spec_stats = SpecStats()
        self.num_preempted = 0

    def take_aborted(self) -> list[Request]:
        aborted, self._aborted = self._aborted, []
        return aborted

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._aborted or self._abort_requested
                    or any(not request.paused for request in self.running))

    # One step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._release_aborted()
        if self.config.scheduling_policy == "priority":
            self._make_way()
        budget = self.config.max_num_batched_tokens
        decode_rows: list[ScheduledRow] = []
        scheduled: set[int] = set()
        decoding, prefilling = [], []
        for request in self.running:
            if not request.paused:
                (prefilling if self._in_prefill(request) else decoding).append(request)
        running = RequestStatus.RUNNING  # looked up once: on Python 3.11 an Enum member costs a call
        # Each row holds KV blocks for the positions of k drafts whatever the step drafts. (A
        # request scheduled here is never preempted for a later one.)
        decoded = []
        for request in decoding:
            if request.status is not running:
                continue  # preempted to make room for a request ranked before it
            if self._reserve_blocks(request, request.num_tokens + self.config.max_draft_tokens, scheduled):
                decoded.append(request)
                scheduled.add(id(request))
        rooms = [self._draft_room_of(r) for r in decoded]
        # Every decode row runs the step's K (decode_step.py: fixed shapes), within the token budget;
        # beside prefill chunks too (the runner runs decode rows through the same stages).
        limit = budget // len(decoded) - 1 if decoded else 0
        num_drafts = self._choose_drafts(decoded, rooms, limit)
        decode_rows = [self._row(r, 1, min(num_drafts, room)) for r, room in zip(decoded, rooms)]
        budget -= len(decode_rows) * (1 + num_drafts)
        prefill_rows: list[ScheduledRow] = []
        for request in prefilling:
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted to make room for a request ranked before it
            chunk = self._chunk(request, request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, request.num_computed_tokens + chunk, scheduled):
                continue
            prefill_rows.append(self._prefill_row(request, chunk))
            scheduled.add(id(request))
            budget -= chunk
        return self._plan(decode_rows, prefill_rows, budget)

    def _make_way(self) -> None:
        """Priority policy: while the first waiting request outranks the last-ranked running one
        and cannot be admitted (max_num_seqs running, or the KV blocks of its first chunk, as if
        nothing of it were cached, not there), preempt that running request."""
        while self.waiting and self.running:
            head = self.waiting[0]
            if head.fork_of is not None and not self._prompt_computed(head.fork_of):
                return  # it waits for its parent's prompt, not for room
            victim = self._outranked_by(head)
            if victim is None:
                return
            first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
            if len(self.running) < self.config.max_num_seqs \
                    and self.cache.make_room(1, self.blocks.blocks_needed(first_chunk)):
                return
            self._preempt(victim)

    def _outranked_by(self, request: Request) -> Request | None:
        """The last-ranked running request, when `request` ranks before it."""
        victim = max(self.running, key=lambda r: r.rank)
        return victim if request.rank < victim.rank else None

    def _plan(self, decode_rows: list[ScheduledRow], prefill_rows: list[ScheduledRow], budget: int) -> StepPlan:
        """The step of these rows, with the waiting requests admitted in rank order after them
        while a slot, max_num_seqs, the token budget left and KV blocks allow (never by
        preempting: `_make_way` did that)."""
        cached_rows: list[ScheduledRow] = []
        pinned: list[Checkpoint] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.fork_of is not None and not self._prompt_computed(request.fork_of):
                break  # in order: what ranks after a waiting fork waits too (its parent prefills meanwhile)
            chunk = self._admit(request, budget, pinned)
            if chunk is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if chunk == 0:
                cached_rows.append(self._row(request, 0))
            else:
                prefill_rows.append(self._prefill_row(request, chunk))
                budget -= chunk
        return StepPlan(tuple(decode_rows), tuple(prefill_rows), tuple(cached_rows), self.cache.take_ops(),
                        tuple(pinned), self.cache.take_writes())

    def continuation(self, plan: StepPlan) -> StepPlan | None:
        """The next step of `plan`, a step still in flight, or None when the next step needs
        `schedule` (see the module docstring). Each of its requests is fed from its row of
        `plan`: a decode row feeds the newest token, at position num_tokens - 1, and emits 1 ..
        k + 1 tokens, so the fed row's newest token sits between num_tokens and num_tokens + k
        (the device knows where: DecodeStep.feed); a prefill row ending its prompt emits the
        first token, at num_tokens. The fed row's start_position is that furthest place. Waiting
        requests are admitted after them as `schedule` admits them (`_plan`)."""
        if self._abort_requested or plan.cached_rows:
            return None
        if self.config.scheduling_policy == "priority" and self.waiting and self.running \
                and self._outranked_by(self.waiting[0]) is not None:
            return None  # the waiting request may take a running one's place: `schedule`'s business
        running = RequestStatus.RUNNING
        capacity = self.blocks.block_size
        in_plan = 0
        fed = []
        # A row's index in `plan` is its output row there (runner.py: a prefill row ending its
        # prompt keeps its first token after the decode rows, every prefill row here does).
        for index, row in enumerate(plan.decode_rows + plan.prefill_rows):
            request = row.request
            if request.paused:
                return None  # paused since `plan` was scheduled
            if request.status is not running:
                continue  # finished by the step before `plan`: its row there is discarded
            if not row.sample:
                return None  # a prompt mid-way: its next chunk starts where `plan` leaves it
            in_plan += 1
            most = row.num_draft_tokens + 1  # tokens `plan` may emit for it (a prefill row: its first)
            furthest = request.num_tokens + most - 1
            if furthest + 1 >= request.max_num_tokens:
                continue  # `plan` may give it its last token
            # Blocks for the furthest newest position and the K positions after it. (Most rows
            # have room in their last block: checked before calling.)
            needed = furthest + 1 + self.config.max_draft_tokens
            if needed > len(request.block_table) * capacity and not self._reserve_blocks(request, needed, scheduled=None):
                return None  # preemption is `schedule`'s business
            fed.append((index, request, furthest, most))
        if not fed or in_plan != len(self.running):
            return None  # nothing left to decode, or a running request needs a prefill chunk
        # Room as if `plan` emitted its most tokens (the least room it can leave).
        rooms = [self._draft_room_of(request, ahead=most) for _, request, _, most in fed]
        budget = self.config.max_num_batched_tokens
        num_drafts = self._choose_drafts([request for _, request, _, _ in fed], rooms, budget // len(fed) - 1)
        rows = [ScheduledRow(request, [], furthest, request.slot, request.block_table, True, min(num_drafts, room),
                             fed_from=index)
                for (index, request, furthest, _), room in zip(fed, rooms)]
        return self._plan(rows, [], budget - len(rows) * (1 + num_drafts))

    def commit(self, plan: StepPlan, output: StepOutput, ahead: StepPlan | None = None,
               advanced: Callable[[], None] | None = None) -> list[Request]:
        """Fold the step's output in (StepOutput: per plan row, the emitted tokens, their
        log-probabilities, the fed tokens left pending in the slot). ahead: the step launched
        after this one (`continuation`), which already fed its rows their newest token.
        advanced: called once the constrained rows' grammars have taken the step's tokens,
        first, before the rest of the commit (the engine starts the next step's grammar masks
        then, so that they are computed while this thread commits and plans).
        Returns the requests that got tokens or finished. A row whose logits were not finite
        (`output.nonfinite`) fails its request alone: no tokens, slot and blocks freed, and none
        of the step's checkpoints kept (a prefill row's would hold the broken state)."""
        nonfinite = output.nonfinite
        if nonfinite is None:
            self.cache.register_writes(plan.writes)
        else:
            self.cache.discard_writes(plan.writes)
        # Aborts take effect here too: a request aborted while this step ran gets none of its
        # tokens, as if it had been released before the step (the next step may be in flight).
        self._release_aborted()
        for checkpoint in plan.pinned:
            self.cache.unpin(checkpoint)
        logprobs, num_pending, prompt_logprobs = output.logprobs, output.num_pending, output.prompt_logprobs
        updated = []
        num_decode_rows = len(plan.decode_rows)
        running = RequestStatus.RUNNING  # looked up once: on Python 3.11 an Enum member costs a call
        # The grammars take the step's tokens first, for the rows that record them below.
        grammar_ends = {index: row.request.advance_grammar(tokens)
                        for index, (row, tokens) in enumerate(zip(plan.rows, output.emitted))
                        if row.request.grammar is not None and row.sample and row.request.status is running
                        and not (nonfinite is not None and nonfinite[index])}
        if advanced is not None:
            advanced()
        verified: list[tuple[Request, int, int]] = []  # decode rows' (request, drafted, accepted)
        for index, (row, tokens) in enumerate(zip(plan.rows, output.emitted)):
            request = row.request
            if request.status is not running:
                continue  # preempted while this step ran: it recomputes from scratch
            if nonfinite is not None and nonfinite[index]:
                self._drop(request, failed=True)
                updated.append(request)
                continue
            request.num_pending = num_pending[index] if num_pending else 0
            if prompt_logprobs is not None and prompt_logprobs[index] is not None:
                request.add_prompt_logprobs(row.prompt_logprob_span[0], prompt_logprobs[index])
            accepted_drafts = len(tokens) - 1 if row.num_draft_tokens else 0
            # Fed tokens whose state is now pending or committed: the row's token(s) and the
            # drafts the target confirmed.
            request.num_computed_tokens += row.num_tokens + accepted_drafts
            if request.acceptance is not None and index < num_decode_rows:
                # The next catch-up starts at this step's newest position: the MTP caught up to
                # it (a plain step kept its hidden state instead).
                request.mtp_position = request.num_tokens - 1
                verified.append((request, row.num_draft_tokens, accepted_drafts))
            elif row.mtp_end > request.mtp_position:
                request.mtp_position = row.mtp_end
            if row.sample:
                request.starting = False
                num_known = request.num_tokens
                request.extend(tokens, logprobs[index] if logprobs else None, grammar_ends.get(index))
                updated.append(request)
                if request.finish_reason is not None:
                    fed_ahead = ahead is not None and any(r.request is request for r in ahead.decode_rows)
                    self._finish(request, fed_ahead, request.num_tokens - num_known == len(tokens))
        if verified:
            self._record_verify(verified)
        Request.update_texts(updated)
        return updated

    def _record_verify(self, verified: list[tuple[Request, int, int]]) -> None:
        """The one place decode rows' speculation outcomes are counted, a step's at once (each
        row's request, drafts and accepted drafts): the requests' acceptance estimates and the
        prior (for the draft-length policy), their counters and the engine's."""
        self.draft_policy.record([(request.acceptance, drafted, accepted) for request, drafted, accepted in verified])
        self.spec_stats.record((drafted, accepted) for _, drafted, accepted in verified if drafted)
        for request, drafted, accepted in verified:
            if drafted:
                request.spec_stats.record(((drafted, accepted),))

    # Helpers ------------------------------------------------------------------------------

    @staticmethod
    def _in_prefill(request: Request) -> bool:
        """More than the newest token is still to be computed, or nothing is yet (a fresh or
        recomputing request starts from a zero state through the chunked path), or its first
        token is still to be sampled (Request.starting: a prompt whose last chunk is one token,
        a session resumed with no new tokens)."""
        remaining = request.num_tokens - request.num_computed_tokens
        return remaining > 1 or request.num_computed_tokens == 0 or request.starting

    @staticmethod
    def _prompt_computed(request: Request) -> bool:
        """Whether a fork's parent is past its prompt (its prompt-end checkpoint is written,
        unless the cache is off or had no room) or gone (finished, aborted)."""
        return request.num_computed_tokens >= len(request.prompt_token_ids) or request.finished

    def _admit(self, request: Request, budget: int, pinned: list[Checkpoint]) -> int | None:
        """Give a waiting request a slot and the KV blocks of its first chunk, restoring the
        longest cached prefix of its tokens (or the session it resumes). Returns the chunk
        length (0: everything is cached) or None when it does not fit now."""
        if request.prompt_logprobs is not None and request.fork_of is not None and request.fork_of.prompt_scored:
            request.prompt_logprobs = list(request.fork_of.prompt_logprobs)  # the same prompt, the same scores
        restorable = request.restorable
        hit = request.resume_from or (self.cache.lookup(request.cache_key(restorable), request.cache_salt)
                                      if restorable else None)
        start = hit.position if hit is not None else 0
        full_hit = start == request.num_tokens
        chunk = 0 if full_hit else self._chunk(request, start, budget)
        shared = 0
        if hit is not None:
            shared = self.cache.restore_plan(hit, full_hit)[0]
            if request.resume_from is None:
                self.cache.pin(hit)  # a resumed session arrives pinned by its request
        num_blocks = self.blocks.blocks_needed(start + chunk)
        if not self.cache.make_room(1, num_blocks - shared):
            if hit is not None and request.resume_from is None:
                self.cache.unpin(hit)
            return None
        request.slot = self.slots.allocate(1)[0]
        block_table = []
        if hit is not None:
            block_table, request.mtp_position = self.cache.restore(hit, request.slot, full_hit)
            request.num_computed_tokens = start
            request.resume_from = None
            pinned.append(hit)
        request.block_table = tuple(block_table + self.blocks.allocate(num_blocks - len(block_table)))
        if request.num_cached_tokens is None:  # its first admission (a readmission recomputes)
            request.num_cached_tokens = min(start, len(request.prompt_token_ids))
        request.fork_of = None  # a later recompute (preemption) needs no parent
        self.cache.count_admission(request.num_tokens, start)
        return chunk

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """Prefill tokens from `start` under the budget. A chunk that does not reach the end of
        the known tokens ends on a multiple of the GDN chunk size when it can, so every later
        chunk starts aligned and the chunked kernel can checkpoint the boundaries it passes."""
        chunk = min(request.num_tokens - start, budget)
        end = start + chunk
        if end < request.num_tokens and end - end % CHUNK_SIZE > start:
            chunk = end - end % CHUNK_SIZE - start
        return chunk

    def _prefill_row(self, request: Request, num_tokens: int) -> ScheduledRow:
        """A prefill chunk and the checkpoints its forward writes: at every checkpoint-interval
        boundary it passes and at the end of the known tokens, where the chunked kernel can
        (a multiple of its chunk size from the row's start, or the row's end)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
        interval = self.cache.interval
        positions = list(range((start // interval + 1) * interval, end + 1, interval))
        if end == request.num_tokens and end not in positions:
            positions.append(end)
        writes = []
        for position in reversed(positions):  # the longest prefixes first, when slots run short
            if ((position - start) % CHUNK_SIZE and position != end) \
                    or not self.cache.wants_checkpoint(position, request.num_tokens):
                continue
            write = self.cache.reserve_write(request.cache_key(position), request.block_table,
                                             ends_tokens=position == request.num_tokens, salt=request.cache_salt)
            if write is not None:
                writes.append(write)
        return self._row(request, num_tokens, checkpoints=tuple(reversed(writes)),
                         prompt_logprob_span=request.prompt_logprob_span(start, end))

    def _row(self, request: Request, num_tokens: int, num_drafts: int = 0,
             checkpoints: tuple[CheckpointWrite, ...] = (), prompt_logprob_span: tuple[int, int] = (0, 0)
             ) -> ScheduledRow:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
        num_known = request.num_tokens
        if self.draft_policy is None:
            mtp_start = mtp_end = 0
        else:
            # From the MTP's first missing position (the chunk's start, or one before after a
            # restore) through the row, except the last known token: its next is not sampled
            # yet. A decode row (or a cached one) ends at the newest token: through num_known - 1.
            mtp_start, mtp_end = request.mtp_position, min(end, num_known - 1)
        return ScheduledRow(request, request.token_ids(start, end), start, request.slot, request.block_table,
                            end == num_known, num_drafts, mtp_start, mtp_end, checkpoints, None, prompt_logprob_span)

    def _draft_room_of(self, request: Request, ahead: int = 0) -> int:
        """Drafts a decode row of the request may take, never past max_tokens or the context;
        ahead: tokens the step in flight may still add first (a continuation's fed row)."""
        num_tokens = request.num_tokens + ahead
        if request.mtp_position >= num_tokens - 1:
            return 0  # the prompt's last token, fed alone after a chunk: no MTP output to chain from
        return max(0, min(self.config.max_model_len - num_tokens,
                          request.params.max_tokens - len(request.output_token_ids) - ahead - 1))

    def _choose_drafts(self, requests: list[Request], rooms: list[int], limit: int) -> int:
        """The step's K (spec/adaptive.py); 0 without speculation."""
        if self.draft_policy is None or not requests:
            return 0
        return self.draft_policy.choose([r.acceptance for r in requests], rooms, limit,
                                        sum(not r.params.greedy for r in requests))

    def _reserve_blocks(self, request: Request, num_tokens: int, scheduled: set[int] | None) -> bool:
        """Grow the block table to hold num_tokens, preempting the last-ranked running requests
        not yet scheduled this step. False when `request` itself had to be preempted, or
        (scheduled None: nothing may be preempted) when the blocks are not there."""
        if num_tokens <= len(request.block_table) * self.blocks.block_size:
            return True  # most decode steps: the last block has room
        needed = self.blocks.blocks_needed(num_tokens) - len(request.block_table)
        while not self.cache.make_room(0, needed):
            if scheduled is None:
                return False
            victims = [r for r in self.running if id(r) not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.rank) if victims else request
            if victim.rank < request.rank:
                victim = request  # never preempt a request ranked first to grow a later one
            self._preempt(victim)
            if victim is request:
                return False
        request.block_table += tuple(self.blocks.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.mtp_position = request.num_pending = 0
        request.starting = True
        request.num_preemptions += 1
        self.num_preempted += 1
        self._enqueue(request)  # back to the queue, ahead of anything ranked after it

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.slots.free([request.slot])
            self.blocks.free(request.block_table)
        request.slot, request.block_table = None, ()
        if request in self.running:
            self.running.remove(request)

    def _finish(self, request: Request, fed_ahead: bool = False, took_every_token: bool = True) -> None:
        if took_every_token or not fed_ahead:
            self._keep_checkpoint(request, fed_ahead)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def _keep_checkpoint(self, request: Request, fed_ahead: bool) -> None:
        """Hand a finished request's slot and the blocks of its committed tokens to the prefix
        cache (the next turn of a chat restores all of it). Committed: fed tokens minus those
        still pending, or every token when the step in flight feeds the last one (its newest
        token is committed at once, and with it everything pending before it; a request whose
        last step emitted tokens past its stop keeps nothing then: the state went past them);
        the MTP must be at most as far as that, and the step in flight catches it up to the
        newest position."""
        committed = request.num_tokens if fed_ahead else request.num_computed_tokens - request.num_pending
        if self.draft_policy is None:
            mtp_position = committed
        else:
            mtp_position = request.num_tokens - 1 if fed_ahead else request.mtp_position
        if request.slot is None or committed <= 0 or mtp_position > committed:
            return
        keep = self.blocks.blocks_needed(committed)
        if self.cache.adopt(request.request_id, request.cache_key(committed), request.cache_key(request.num_tokens),
                            mtp_position, request.slot, request.block_table[:keep], request.cache_salt):
            self.blocks.free(request.block_table[keep:])
            request.slot, request.block_table = None, ()

    def fail(self, plans: Sequence[StepPlan], requests: list[Request]) -> None:
        """A step raised: `requests` (the rows of `plans`: the step and the one launched after
        it, which is forgotten) finish without its tokens and free their slots and blocks, and
        the plans' pins are released. The step may have written part of any state it touched,
        so every checkpoint being written is dropped and so is every unpinned cached one (a
        request finished one step ahead handed over a slot the failed step was feeding)."""
        for plan in plans:
            for checkpoint in plan.pinned:
                self.cache.unpin(checkpoint)
        self.cache.discard_writes(self.cache.pending_writes)
        for request in requests:
            self._drop(request)
        self.cache.clear()

    def _release_aborted(self) -> None:
        if not self._abort_requested:
            return  # most steps: no queue to search
        self._abort_requested = False
        for queue in (self.running, self.waiting):
            for request in [r for r in queue if r.abort_requested]:
                self._drop(request)
                self._aborted.append(request)

    def _drop(self, request: Request, failed: bool = False) -> None:
        """Finish `request` as aborted (failed: with "error"): out of the queue, its resumed
        session unpinned, its slot and blocks released."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request.resume_from is not None:
            self.cache.unpin(request.resume_from)
            request.resume_from = None
        self._release(request)
        request.status = RequestStatus.FINISHED
        if failed:
            request.fail()
        else:
            request.abort()
