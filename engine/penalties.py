"""Penalties, logit bias, min_tokens, bad words and allowed tokens (SamplingParams) on the device, per slot.

Each slot running a penalized request has a row of statistics on the device: `output_counts`
[N, V] int32 (how often each token was generated), `prompt_mask` [N, V] bool (tokens of the
prompt), `num_output` [N] (tokens generated) and `recent` [N, R] (the last R =
MAX_BAD_WORD_TOKENS - 1 generated tokens, right-aligned, -1 before the first). N = the running
requests at most (max_num_seqs), not the slots (checkpoints hold slots too): a slot gets the
least recently used row when its request starts. Every running penalized request uses its row
every step (a request not scheduled in a step is preempted, and starts again), so the rows
of running requests are the most recently used. `start` builds a slot's from the host's
token lists when the request's first token is sampled (after admission, a restore or a
preemption: the host knows every token then); `record` adds the tokens a step emitted, on the
device (one kernel: kernels/penalties.py), so a step launched before the host has read the step
before it (fed rows) sees them.
The tensors are allocated on the first penalized request (a plain engine pays nothing:
N x V x 5 bytes, 0.3 GiB at N = 256 and V = 248,320). `start` also writes the row's parameters:
its (repetition, frequency, presence) coefficients and its logit_bias as (token, bias) pairs
padded with (0, 0.0) to the widest bias started so far (adding 0.0 changes no logit), so a step
reads every parameter of its penalized rows on the device: `select` finds their statistics rows
once per step, for `adjust` and `record`, and nothing else goes from host lists to the device.
While a steady batch keeps its statistics rows (the same index tensor, step after step) the
parameters gathered for them are reused, not gathered again: a step's adjustment is then one
pass (when every row is penalized; a copy of the others first when some are not).

`adjust` rewrites the logits of penalized rows before sampling (vLLM's order): allowed_token_ids,
bad words and min_tokens set the tokens they exclude to -inf, logit_bias adds, then for a token with output count c,
seen in prompt or output: x / r if x > 0 else x * r (repetition r), then x - f * c - p * [c > 0].
The pass does the bias and the penalties while it widens the logits to the float32 working copy;
the bans follow it (-inf stays -inf through both: the same logits as banning first).
A verify row scores W positions; position j is adjusted as if the drafts before it,
drafts[:j], were generated already (counts, min_tokens length and bad-word context), so every
accepted token was chosen from exactly the distribution plain decoding would have used.
That costs one pass (kernels/penalties.py: one read of each logit, count and prompt flag, the
bias and the drafts' counts added in registers). Rows without penalties are not touched, and a
step without penalized rows does nothing at all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch

from ..kernels import Ops
from .batch import device_tensor, row_index
from .sampling_params import MAX_BAD_WORD_TOKENS
from .step import ScheduledRow

_RECENT = MAX_BAD_WORD_TOKENS - 1  # a bad word's prefix is at most this long


class PenalizedRows(NamedTuple):
    """The penalized rows among a step's N rows (`Penalties.select`), for `adjust` and `record`."""

    rows: list[ScheduledRow]          # the P penalized rows
    index: slice | torch.Tensor       # [P] their places among the N rows (batch.row_index: a slice when P = N)
    stats: torch.Tensor               # [P] their statistics rows
    num_rows: int                     # N


class _Parameters(NamedTuple):
    """The parameters of P statistics rows, gathered once for as long as they stay a step's rows."""

    repetition: torch.Tensor          # [P] float32
    frequency: torch.Tensor           # [P] float32
    presence: torch.Tensor            # [P] float32
    bias_tokens: torch.Tensor         # [P, B] int64, padded with token 0
    bias_values: torch.Tensor         # [P, B] float32, padded with 0.0


class Penalties:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device, ops: Ops) -> None:
        """num_rows: penalized requests running at once at most; ops: the dense pass's and the
        statistics update's kernels."""
        self.num_rows, self.vocab_size, self.device, self.ops = num_rows, vocab_size, device, ops
        self.output_counts: torch.Tensor | None = None  # allocated by the first `start`
        self._row_of: OrderedDict[int, int] = OrderedDict()  # slot -> its statistics row, least recently used first
        # The last `_rows` result and what it holds: consecutive steps of a steady batch (a step
        # launched ahead runs the rows of the one before) index the same statistics rows.
        self._last_rows: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)
        # The parameters `adjust` gathered for a statistics-row index (`_parameters`), reused
        # while `_rows` hands out that same index and no `start` has rewritten any row.
        self._gathered: tuple[torch.Tensor | None, _Parameters | None] = (None, None)

    def select(self, rows: Sequence[ScheduledRow]) -> PenalizedRows | None:
        """The penalized rows among `rows` (None: none), their statistics rows now the most
        recently used."""
        penalized = [i for i, r in enumerate(rows) if r.request.params.penalized]
        if not penalized:
            return None
        chosen = [rows[i] for i in penalized]
        return PenalizedRows(chosen, row_index(penalized, len(rows), self.device), self._rows(chosen), len(rows))

    def start(self, rows: Sequence[ScheduledRow]) -> None:
        """Rebuild the statistics and coefficients of the penalized rows among `rows` (prefill or
        cached rows; those that sample their request's next token) from the request's params,
        prompt and output so far."""
        rows = [r for r in rows if r.sample and r.request.params.penalized]
        if not rows:
            return
        if self.output_counts is None:
            s, v = self.num_rows, self.vocab_size
            self.output_counts = torch.zeros(s, v, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(s, v, dtype=torch.bool, device=self.device)
            self.num_output = torch.zeros(s, dtype=torch.int64, device=self.device)
            self.recent = torch.full((s, _RECENT), -1, dtype=torch.int64, device=self.device)
            # Per statistics row: (repetition, frequency, presence) (a column each: one gather
            # gives a step's rows each coefficient contiguously), and its logit_bias as (token,
            # bias) pairs padded with (0, 0.0) to the widest bias started so far.
            self.coefficients = torch.ones(3, s, dtype=torch.float32, device=self.device)
            self.bias_tokens = torch.zeros(s, 0, dtype=torch.int64, device=self.device)
            self.bias_values = torch.zeros(s, 0, dtype=torch.float32, device=self.device)
        # The rows' slots that hold a statistics row already (a slot reused) become the most
        # recently used first: a new slot evicts the least recently used, never one of these.
        for r in rows:
            if r.slot in self._row_of:
                self._row_of.move_to_end(r.slot)
        for r in rows:
            if r.slot not in self._row_of:
                self._row_of[r.slot] = self._row_of.popitem(last=False)[1] if len(self._row_of) == self.num_rows \
                    else len(self._row_of)
        stats = self._rows(rows)
        params = [r.request.params for r in rows]
        prompts = [r.request.prompt_token_ids for r in rows]
        outputs = [r.request.output_token_ids for r in rows]
        self.output_counts[stats] = 0
        self.prompt_mask[stats] = False
        self.output_counts.index_put_(self._scatter_index(rows, outputs), self._ones(outputs, torch.int32),
                                      accumulate=True)
        self.prompt_mask.index_put_(self._scatter_index(rows, prompts), self._ones(prompts, torch.bool))
        self.num_output[stats] = self._tensor([len(o) for o in outputs])
        tails = [o[-_RECENT:] if o else [] for o in outputs]
        self.recent[stats] = self._tensor([[-1] * (_RECENT - len(t)) + t for t in tails]).view(len(rows), -1)
        self.coefficients[:, stats] = device_tensor(
            [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params], torch.float32,
            self.device).view(len(rows), 3).T
        width = max(len(p.logit_bias) for p in params)
        if width > self.bias_tokens.shape[1]:
            grow = width - self.bias_tokens.shape[1]
            self.bias_tokens = torch.cat([self.bias_tokens, self.bias_tokens.new_zeros(self.num_rows, grow)], dim=1)
            self.bias_values = torch.cat([self.bias_values, self.bias_values.new_zeros(self.num_rows, grow)], dim=1)
        width = self.bias_tokens.shape[1]
        if width:
            padded = [list(p.logit_bias) + [(0, 0.0)] * (width - len(p.logit_bias)) for p in params]
            self.bias_tokens[stats] = self._tensor([[t for t, _ in entries] for entries in padded]).view(len(rows), -1)
            self.bias_values[stats] = device_tensor([b for entries in padded for _, b in entries], torch.float32,
                                                    self.device).view(len(rows), -1)
        self._gathered = (None, None)  # rows' parameters rewritten

    def adjust(self, logits: torch.Tensor, penalized: PenalizedRows | None,
               drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [N * W, V]: W consecutive positions of each of the N rows (W = 1, or a verify
        row's newest token and its W - 1 drafts [N, W - 1]). Returns float32 logits with the
        penalized rows (`select`) adjusted (the input itself when there are none)."""
        if penalized is None:
            return logits
        rows, index, stats = penalized.rows, penalized.index, penalized.stats
        vocab = logits.shape[1]
        width = logits.shape[0] // penalized.num_rows
        steps = logits.view(-1, width, vocab)                                              # [N, W, V]
        drafts = None if width == 1 else drafts[index]                                     # [P, W - 1]
        gathered = self._parameters(stats)
        bias = (gathered.bias_tokens, gathered.bias_values) if any(r.request.params.logit_bias for r in rows) \
            else (None, None)
        if isinstance(index, slice):
            # Every row penalized (the common case): the pass writes each of them, widened, into
            # the float32 working copy; no copy before it.
            out, penalized_rows = torch.empty(steps.shape, dtype=torch.float32, device=logits.device), None
        else:
            # The others widened as they are, then the pass rewrites the penalized ones in place.
            out = torch.empty(steps.shape, dtype=torch.float32, device=logits.device).copy_(steps)
            penalized_rows = index
        out = self.ops.penalize_rows(steps, self.output_counts, self.prompt_mask, stats, gathered.repetition,
                                     gathered.frequency, gathered.presence, drafts, penalized_rows, *bias, out=out)
        if any(r.request.bad_words_token_ids or r.request.params.min_tokens
               or r.request.params.allowed_token_ids is not None for r in rows):
            # Bans after the pass: -inf stays -inf through the bias and the penalties (repetition
            # > 0), so banning first, as vLLM orders it, gives the same logits.
            x = out[index]                                                                 # [P, W, V]
            self._ban_bad_words(x, rows, stats, drafts)
            self._ban_stops_before_min_tokens(x, rows, stats)
            self._keep_allowed_tokens(x, rows)
            if not isinstance(index, slice):  # x is a gathered copy then
                out[index] = x
        return out.view(-1, vocab)

    def record(self, penalized: PenalizedRows | None, emitted: torch.Tensor,
               num_emitted: torch.Tensor | None = None) -> None:
        """Add the tokens the step's N rows emitted, emitted [N, W] (row r's first num_emitted[r],
        all W when None), to the penalized rows' (`select`) slot statistics."""
        if penalized is None:
            return
        index = penalized.index
        self.ops.record_tokens(self.output_counts, self.num_output, self.recent, penalized.stats, emitted[index],
                               None if num_emitted is None else num_emitted[index])

    def _ban_bad_words(self, x: torch.Tensor, rows: Sequence[ScheduledRow], stats: torch.Tensor,
                       drafts: torch.Tensor | None) -> None:
        """A bad word's last token is banned at position j when the R tokens before j (generated
        ones, then drafts[:j]; drafts None: W = 1) end with the word's other tokens (none: always)."""
        words = [(p, w) for p, r in enumerate(rows) for w in r.request.bad_words_token_ids]
        if not words:
            return
        width = x.shape[1]
        generated = self.recent[stats]
        context = (generated if drafts is None else torch.cat([generated, drafts], dim=1)).unfold(1, _RECENT, 1)
        # context [P, W, R]: the R tokens before position j
        prefixes = self._tensor([[-1] * (_RECENT - len(w) + 1) + list(w[:-1]) for _, w in words]).view(len(words), -1)
        used = self._tensor([[0] * (_RECENT - len(w) + 1) + [1] * (len(w) - 1) for _, w in words]).view(
            len(words), -1).bool()
        row = self._tensor([p for p, _ in words])
        match = ((context[row] == prefixes[:, None]) | ~used[:, None]).all(-1)          # [num_words, W]
        ban = torch.where(match, float("-inf"), 0.0)
        last = self._tensor([w[-1] for _, w in words])
        x.index_put_((row[:, None].expand(-1, width), torch.arange(width, device=self.device).expand_as(ban),
                      last[:, None].expand(-1, width)), ban, accumulate=True)

    def _ban_stops_before_min_tokens(self, x: torch.Tensor, rows: Sequence[ScheduledRow], stats: torch.Tensor) -> None:
        """Position j of a row has generated num_output + j tokens before it."""
        entries = [(p, t) for p, r in enumerate(rows) if r.request.params.min_tokens
                   for t in sorted(r.request.stop_token_ids)]
        if not entries:
            return
        minimum = self._tensor([r.request.params.min_tokens for r in rows])
        positions = torch.arange(x.shape[1], device=self.device)
        early = self.num_output[stats][:, None] + positions < minimum[:, None]       # [P, W]
        row, token = (self._tensor(column) for column in zip(*entries))
        banned = x[row, :, token]                                                      # [E, W]
        x[row, :, token] = torch.where(early[row], float("-inf"), banned)

    def _keep_allowed_tokens(self, x: torch.Tensor, rows: Sequence[ScheduledRow]) -> None:
        """Every position of a row with allowed_token_ids: all other tokens at -inf."""
        entries = [(p, t) for p, r in enumerate(rows) if r.request.params.allowed_token_ids is not None
                   for t in r.request.params.allowed_token_ids]
        if not entries:
            return
        row, token = (self._tensor(column) for column in zip(*entries))
        kept = x[row, :, token]                                                        # [E, W]
        x[self._tensor(sorted({p for p, _ in entries}))] = float("-inf")
        x[row, :, token] = kept

    def _rows(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """The statistics rows of the rows' slots, on the device (now the most recently used)."""
        for r in rows:
            if r.slot not in self._row_of:
                raise RuntimeError(f"slot {r.slot}: penalized, but its request never started (Penalties.start)")
            self._row_of.move_to_end(r.slot)
        stats = tuple(self._row_of[r.slot] for r in rows)
        if stats != self._last_rows[0]:  # else no copy in: the same rows as the step before
            self._last_rows = stats, self._tensor(stats)
        return self._last_rows[1]

    def _parameters(self, stats: torch.Tensor) -> _Parameters:
        """The parameters of statistics rows `stats` (a `_rows` result): gathered on the device
        the first time, then the same tensors while a steady batch keeps its rows (no kernel)."""
        index, gathered = self._gathered
        if index is not stats:
            # Indexing, not index_select (serial over <= 16 indices on CUDA: sampling_table.py).
            gathered = _Parameters(*self.coefficients[:, stats], self.bias_tokens[stats],
                                   self.bias_values[stats])
            self._gathered = (stats, gathered)
        return gathered

    def _scatter_index(self, rows: Sequence[ScheduledRow], lists: list[list[int]]) -> tuple[torch.Tensor, ...]:
        stats_rows = [self._row_of[r.slot] for r, tokens in zip(rows, lists) for _ in tokens]
        return self._tensor(stats_rows), self._tensor([t for tokens in lists for t in tokens])

    def _ones(self, lists: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(sum(map(len, lists)), dtype=dtype, device=self.device)

    def _tensor(self, values) -> torch.Tensor:
        """int64 values (a flat or nested list) on the device, without stalling its stream."""
        flat = [v for row in values for v in row] if values and isinstance(values[0], list) else values
        return device_tensor(flat, torch.int64, self.device)
