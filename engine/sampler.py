"""Next tokens from logits on the device, and the log-probabilities requests ask for.

`sample` draws each row's token without a host sync: greedy rows take the argmax, sampled rows
the seeded draw of the sampling kernel (temperature, top-k, top-p, min-p and the seed of each
slot, kept on the device from the request's start: sampling_table.py), which depends only on
(seed, position), so a request's samples do not depend on the rest of its batch (and rejection
sampling of drafts can be coupled with it: spec/accept.py). `logprobs` scores emitted tokens
under the raw distribution. Penalized rows' logits are adjusted before either (penalties.py),
constrained rows' masked to their grammar: packed masks from llguidance (structured.py), copied
to the device on a stream of their own by the thread that computed them, and applied there
(kernels/token_bitmask.py) once the copy has run, a wait on the device only.
Knows nothing about steps or speculation: a row is a ScheduledRow's request parameters, slot
and position.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence

import torch

from ..kernels import Ops
from .batch import device_tensor
from .penalties import Penalties
from .request import TokenLogprobs
from .sampling_table import SamplingTable
from .structured import Grammars
from .step import ScheduledRow
from .tensor_parallel import TensorParallel

# Reads a verify step's drafts of the rows being decided on the host ([N][W - 1]), waiting for
# the device to have made them (speculation.HostDrafts.reader).
ReadDrafts = Callable[[], Sequence[Sequence[int]]]


class Sampler:
    def __init__(self, ops: Ops, device: torch.device, table: SamplingTable, penalties: Penalties,
                 grammars: Grammars, tp: TensorParallel | None = None) -> None:
        """table: each slot's sampling parameters; penalties: the per-slot statistics of
        penalized requests, which `sample` applies; grammars: what masks constrained rows; tp:
        the tensor-parallel group (only rank 0 holds the grammar matchers: it computes the masks
        and broadcasts them)."""
        self.ops, self.device, self.table, self.penalties = ops, device, table, penalties
        self.grammars, self.tp = grammars, tp
        self._masks = _MaskStaging(device)
        # Computes a launched step's grammar masks, and queues their copy to the device, while
        # the engine commits the step before it and plans the next (llguidance releases the
        # GIL): `prefetch_masks`.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaspec-grammar")

    def start(self, rows: Sequence[ScheduledRow]) -> None:
        """Rows about to sample their request's first token (after admission, a restore or a
        preemption): their slots' sampling parameters and penalty statistics are written."""
        self.table.start(rows)
        self.penalties.start(rows)

    def sample(self, logits: torch.Tensor, rows: Sequence[ScheduledRow],
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """The next token of each row [N] int64, on the device, from logits [N, V], added to the
        penalty statistics: penalized rows' logits adjusted first (penalties.py), greedy rows'
        too, then `draw` (positions: as `draw` takes them). A seeded draw depends only on
        (seed, position)."""
        penalized = self.penalties.select(rows)
        tokens = self.draw(self.penalties.adjust(logits, penalized), rows, positions, owned=penalized is not None)
        self.penalties.record(penalized, tokens[:, None])
        return tokens

    def draw(self, logits: torch.Tensor, rows: Sequence[ScheduledRow], positions: torch.Tensor | None = None,
             drafts: ReadDrafts | None = None, masks: Future | None = None,
             slots: torch.Tensor | None = None, owned: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The token at each of W consecutive positions of each row [N * W] int64, on the
        device, from logits [N * W, V] the penalties have already adjusted: constrained rows'
        tokens outside their grammar masked (`constrain`; masks: their `prefetch_masks`), then
        the argmax or the seeded draw. W = 1 but in verification, where drafts reads the tokens
        the positions after a row's first were fed (constrained rows' masks need them on the
        host). positions [N * W]: where the drawn tokens go, when only the device knows (fed
        rows, drafts); slots [N]: the rows' slots on the device; both by default from the rows.
        owned: logits is the penalties' float32 working copy (`Penalties.adjust` made it), which
        the masks may overwrite instead of being copied again. out: where the tokens go (int64
        [N * W]: the step's own token buffer), else a new tensor. Split off `sample` so that a
        step can adjust its rows as it is launched and draw once their masks can be computed
        (runner.py)."""
        params = [r.request.params for r in rows]
        greedy = all(p.greedy for p in params)
        if not greedy:  # queued before the wait for masks
            if positions is None:
                positions = self.tensor([r.start_position + r.num_tokens for r in rows])
            columns = self.table.step_columns(rows, slots, logits.shape[0] // len(rows))
        logits = self.constrain(logits, rows, drafts, masks, owned)
        if greedy:  # greedy fast path: no filtering, no noise
            return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
        tokens, _ = self.ops.sample(logits, *columns, positions, out=out)
        return tokens

    def constrain(self, logits: torch.Tensor, rows: Sequence[ScheduledRow], drafts: ReadDrafts | None = None,
                  masks: Future | None = None, owned: bool = False) -> torch.Tensor:
        """logits [N * W, V] as `draw` takes them, with each constrained row's tokens outside
        its grammar at -inf (float32; the input itself when no row is constrained, masked in
        place when `owned`: the penalties' working copy). The masks come from `prefetch_masks`
        when given, else are computed now, from the matchers' state, while the device works
        through what is queued; a verify step's masks need its drafts on the host (a wait for
        them). Under tensor parallelism rank 0 computes them and every
        rank applies rank 0's (the same call on every rank: a broadcast)."""
        if all(r.request.params.structured is None for r in rows):
            return logits
        if self.tp is not None and self.tp.rank > 0:
            on_device = torch.empty(logits.shape[0], self.grammars.num_words, dtype=torch.int32, device=self.device)
        else:
            copied = masks.result() if masks is not None else \
                self._compute_masks(rows, logits.shape[0] // len(rows), drafts)
            on_device = self._masks.take(copied)
        if self.tp is not None:
            self.tp.broadcast(on_device)
        return self.ops.apply_token_bitmask(logits, on_device, out=logits if owned else None)

    def prefetch_masks(self, rows: Sequence[ScheduledRow], width: int = 1,
                       drafts: ReadDrafts | None = None) -> Future:
        """Start computing the masks `constrain` will apply to these rows (W = width positions
        each; drafts: the verify step's drafts, read in the worker) and their copy to the device
        in a worker thread, from the matchers' state now: they must not change until
        `constrain` has taken the result. Returns once the worker computes without the GIL (or
        waits for the drafts): it needs the GIL to start, and this thread holds it through the
        pure-Python work that follows (commit, planning), so without this hand-over the masks
        would start only when this thread next blocks, at `constrain`, and not overlap anything."""
        started = threading.Event()

        def compute() -> _CopiedMasks:
            try:
                return self._compute_masks(rows, width, drafts, started.set)
            finally:
                started.set()

        masks = self._worker.submit(compute)
        started.wait()
        return masks

    def _compute_masks(self, rows: Sequence[ScheduledRow], width: int, drafts: ReadDrafts | None,
                       started: Callable[[], None] | None = None) -> _CopiedMasks:
        """started: called once the rest runs without the GIL or waits for the device."""
        masks = self._masks.host(len(rows) * width, self.grammars.num_words)
        host_drafts = ()
        if drafts is not None and width > 1:
            if started is not None:
                started()  # reading the drafts waits for the step's draft stage
            host_drafts = drafts()
        self.grammars.bitmask(rows, masks, host_drafts, started)
        return self._masks.to_device(masks)

    def logprobs(self, logits: torch.Tensor, rows: Sequence[ScheduledRow], logit_rows: list[list[int]],
                 emitted: list[list[int]]) -> list[list[TokenLogprobs] | None] | None:
        """Raw-distribution log-probabilities of each emitted token (logits row logit_rows[i][j]
        scored emitted[i][j]) and the top-N, for rows whose request set `logprobs`."""
        asking = [i for i, r in enumerate(rows) if r.request.params.logprobs is not None and emitted[i]]
        if not asking:
            return None
        index = [j for i in asking for j in logit_rows[i]]
        chosen = [t for i in asking for t in emitted[i]]
        top_n = max(rows[i].request.params.logprobs for i in asking)
        scored = iter(self.score(logits[self.tensor(index)], self.tensor(chosen), top_n).read())
        result: list[list[TokenLogprobs] | None] = [None] * len(rows)
        for i in asking:
            result[i] = [next(scored).top_n(rows[i].request.params.logprobs) for _ in emitted[i]]
        return result

    def score(self, logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> TokenScores:
        """Chosen tokens [N] scored under their logits rows [N, V] (any float dtype: the model's
        own, no float32 copy), with the top_n most likely tokens of each row."""
        logprob, rank, lse = self.ops.token_logprobs(logits, chosen)
        if not top_n:
            return TokenScores(logprob, rank, lse.new_empty(len(lse), 0), rank.new_empty(len(rank), 0))
        top_values, top_ids = self.ops.top_logits(logits, top_n)
        return TokenScores(logprob, rank, top_values - lse[:, None], top_ids)

    def tensor(self, values: Sequence[int]) -> torch.Tensor:
        """int64 values on the device, without stalling its stream."""
        return device_tensor(values, torch.int64, self.device)


class TokenScores(NamedTuple):
    """Chosen tokens scored on the device under the raw distribution of their logits rows
    (`Sampler.score`); `read` brings them to the host (a sync)."""

    logprob: torch.Tensor       # [N] float32
    rank: torch.Tensor          # [N] int64: 1 + the tokens with a higher logit
    top_values: torch.Tensor    # [N, top_n] float32 log-probabilities, most likely first
    top_ids: torch.Tensor       # [N, top_n] int64

    @classmethod
    def cat(cls, parts: Sequence[TokenScores]) -> TokenScores:
        return cls(*(torch.cat(field) for field in zip(*parts)))

    def read(self) -> list[TokenLogprobs]:
        """One TokenLogprobs a chosen token, with all top_n tokens (TokenLogprobs.top_n cuts them)."""
        return [TokenLogprobs(logprob, list(zip(ids, values)), rank) for logprob, rank, values, ids
                in zip(self.logprob.tolist(), self.rank.tolist(), self.top_values.tolist(), self.top_ids.tolist())]


class _CopiedMasks(NamedTuple):
    """Packed masks queued for the device (`_MaskStaging.to_device`)."""

    on_device: torch.Tensor         # [rows, num_words] int32
    ready: torch.cuda.Event | None  # recorded after the copy (None off the GPU: nothing to wait for)


class _MaskStaging:
    """Two host buffers the grammar masks are written into and copied to the device from, used
    in turn (pinned on the GPU, so the copy is queued like a kernel). Reused, never reallocated
    per step: a fresh multi-megabyte buffer costs page faults and pinning. A buffer is written
    again only after its last copy has run (at most two steps are in flight, so that wait is
    already over). Filled with all-ones masks when made, so it only ever holds masks. One
    `host` call, then its `to_device`, at a time (a prefetch runs both in the worker while the
    engine's thread waits for nothing else from here).

    On the GPU the copy runs on a stream of its own, queued by whichever thread computed the
    masks (the worker, for a prefetch), so the engine's thread never issues it and it overlaps
    the forward queued before it; `take` makes the engine's stream wait for it (a device-side
    wait, not a host one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def host(self, num_rows: int, num_words: int) -> torch.Tensor:
        """A contiguous int32 [num_rows, num_words] host buffer to write masks into."""
        buffer, copied = self._buffers[self._turn], self._copied[self._turn]
        if buffer is None or buffer.shape[0] < num_rows or buffer.shape[1] != num_words:
            buffer = torch.full((num_rows, num_words), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._buffers[self._turn] = buffer  # the caching host allocator keeps the old one until its copy ran
        elif copied is not None:
            copied.synchronize()
        return buffer[:num_rows]

    def to_device(self, masks: torch.Tensor) -> _CopiedMasks:
        """Queue the masks' copy to the device (the buffer itself off the GPU); the next `host`
        call gets the other buffer."""
        if self.device.type != "cuda":
            return _CopiedMasks(masks, None)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            on_device = masks.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._copied[self._turn] = ready
        self._turn ^= 1
        return _CopiedMasks(on_device, ready)

    def take(self, copied: _CopiedMasks) -> torch.Tensor:
        """The masks for use on the current stream, once their copy has run there."""
        if copied.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied.ready)
            # Allocated on the copy stream, used on this one: not reused before this use ran.
            copied.on_device.record_stream(stream)
        return copied.on_device
