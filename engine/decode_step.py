"""Decode rows at fixed shapes: their device form, block tables, the plain decode step, and the
batch builder the speculative stages (speculation.py) run on.

Every decode row of a step runs the same number of positions, so a step's device work is a
function of (number of rows, positions per row) alone: the engine captures it in CUDA graphs per
batch bucket (cuda_graphs.py), and the same code runs eagerly on the CPU. A plain decode row
feeds its newest token, committed at once. With speculation a row also carries its draft count
k_r and the MTP positions it has to catch up (at most C = k + 1, the positions verified and
accepted last step, with their next tokens).

Padding is harmless by construction. Every position a row writes past its valid ones lies in its
own KV blocks (the scheduler reserves room for k drafts) at or after the first position whose
KV is not valid yet, so it is overwritten before any valid query reads it, and causal attention
keeps valid queries from seeing it; drafts past k_r are never accepted. Padding rows point at
scratch slot 0 and scratch block 0.

Positions, slot mappings and context lengths are derived on the device from a few integers per
row, so a step copies one small packed tensor to the device. Block tables live on the device
per slot (`slot_tables`): a step sends only the entries that changed since a slot's table was
last sent, and each stage gathers its rows' tables there. The usual change, a row's table grown
by one block (every block_size tokens; with speculation the rows reach their block boundaries on
different steps, so most steps have one), rides in the row's packed columns and the step's
first stage writes it; any other (a slot's new request, growth by several blocks) is one small
copy and one scatter before the step. A row may also be *fed* (`DecodeRow.fed_from`):
it continues a row of the latest step, whose outputs that step left on the device (`emitted`,
`accepted`, `last_positions`: its decode rows', then the first tokens its prefill chunks and
cached prompts drew, `record_first`), and the step's first stage derives its newest token
(and with speculation its position and MTP catch-up) there, so a step can be launched before the
host has seen the outputs of the step before it (async scheduling, core.py). A stage's whole
batch metadata, fed rows included, is one kernel (`batch`: kernels/decode_metadata.py), and a
step's greedy tokens and non-finite flags one more (kernels/greedy.py): a plain step's graph
runs nothing beyond the model's forward but those two launches. A *sampled* step also draws
every row whose slot samples (`draw`: the sampling kernel over the slots' parameters in the
sampling table, sampling_table.py), so plainly sampled rows need nothing after the step either.
Knows nothing about requests or scheduling beyond the rows it is handed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import msgspec
import numpy as np
import torch

# The packed rows' columns (the kernel's layout, kernels/decode_metadata.py).
from ..kernels.decode_metadata import (CATCH_UP_IDS, MTP_START, NEWEST, NUM_CATCH_UP, NUM_DRAFTS, POSITION, SLOT,
                                       RowTokens)
from .batch import ForwardBatch, RowGroup
from .models import HybridLM
from .state_pool import KVPool, StatePool

if TYPE_CHECKING:  # sampling_table.py imports step.py, which imports this module
    from .sampling_table import SamplingTable

NO_APPEND = (0, 0)  # a packed row's (table column + 1, block) when its table needs no entry written


class DecodeRow(msgspec.Struct, frozen=True, gc=False):
    """What the device needs of one decode row (the scheduler's ScheduledRow, distilled). A
    msgspec Struct: every decode row of every step builds one (as RequestDelta says why).

    position: where the newest token sits (its state is not folded in yet). With speculation the
    MTP catches up positions [mtp_start, position) whose next tokens are catch_up_ids. A fed row
    continues the row `fed_from` of the latest decode step, whose outputs are still on the
    device (`DecodeStep.batch` with feed): its newest token is the last that row emitted; in a
    speculative engine its position and MTP catch-up follow from that row's accepted count too,
    and `position` is only the furthest it can be (what its blocks must cover)."""

    slot: int
    newest: int
    position: int
    block_table: Sequence[int]
    num_drafts: int = 0
    mtp_start: int = 0
    catch_up_ids: Sequence[int] = ()
    fed_from: int | None = None


class DecodeRows(NamedTuple):
    """The decode rows of a step on the device, padding rows included ([B] leading dim)."""

    packed: torch.Tensor  # [B, 10 + C] int64: slot, is_fed, fed_from, k_r, table column + 1, table block,
    #                                     newest, position, mtp_start, n_r, catch-up ids

    @property
    def num_rows(self) -> int:
        return self.packed.shape[0]

    @property
    def slots(self) -> torch.Tensor:
        return self.packed[:, SLOT]

    @property
    def newest(self) -> torch.Tensor:
        return self.packed[:, NEWEST]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[:, POSITION]

    @property
    def num_drafts(self) -> torch.Tensor:
        return self.packed[:, NUM_DRAFTS]

    @property
    def mtp_start(self) -> torch.Tensor:
        return self.packed[:, MTP_START]

    @property
    def num_catch_up(self) -> torch.Tensor:
        return self.packed[:, NUM_CATCH_UP]

    @property
    def catch_up_ids(self) -> torch.Tensor:
        return self.packed[:, CATCH_UP_IDS:]

    def head(self, num_rows: int) -> "DecodeRows":
        """The first num_rows rows (a bucket of static buffers)."""
        return DecodeRows(self.packed[:num_rows])

    @classmethod
    def zeros(cls, num_rows: int, catch_up: int, device: torch.device) -> "DecodeRows":
        """Static buffers holding padding rows."""
        return cls(torch.zeros(num_rows, CATCH_UP_IDS + catch_up, dtype=torch.int64, device=device))


def pack_rows(rows: Sequence[DecodeRow], catch_up: int, block_size: int, num_rows: int,
              pin_memory: bool, appends: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """The host tensor packed [num_rows, 10 + C] of `rows` followed by padding rows (all zeros:
    slot 0, nothing to draft or catch up); appends: each row's table entry to write
    (DecodeStep.sync_tables), none by default. Every position a row may write, up to
    position + max(C, 1) - 1, must be in its own blocks."""
    packed = torch.zeros(num_rows, CATCH_UP_IDS + catch_up, dtype=torch.int64, pin_memory=pin_memory)
    packed_rows = packed.numpy()  # a row is one slice assignment (torch.tensor of lists is ~5x slower)
    for i, r in enumerate(rows):
        num_catch_up = len(r.catch_up_ids)
        if num_catch_up > catch_up or r.mtp_start + num_catch_up > r.position:
            raise ValueError(f"slot {r.slot}: MTP catch-up of {num_catch_up} positions from {r.mtp_start} "
                             f"(at most {catch_up}, ending before the newest position {r.position})")
        last = r.position + max(catch_up, 1) - 1
        if last >= len(r.block_table) * block_size:
            raise ValueError(f"slot {r.slot}: {len(r.block_table)} KV blocks do not cover positions up to {last}")
        fed = r.fed_from is not None
        packed_rows[i, :CATCH_UP_IDS + num_catch_up] = (r.slot, fed, r.fed_from if fed else 0, r.num_drafts,
                                                        *(appends[i] if appends else NO_APPEND), r.newest,
                                                        r.position, r.mtp_start, num_catch_up, *r.catch_up_ids)
    return packed


class DecodeStep:
    def __init__(self, model: HybridLM, states: StatePool, kv: KVPool, block_size: int, speculative: bool,
                 max_rows: int, max_blocks_per_row: int, table: SamplingTable) -> None:
        """max_rows: decode rows per step at most (padding rows included); max_blocks_per_row: a
        row's block table at most; table: each slot's sampling parameters (sampled steps' draws)."""
        self.model, self.states, self.kv, self.block_size = model, states, kv, block_size
        self.table = table
        self.speculative = speculative
        # C: MTP positions caught up per step at most, those verified and accepted last step.
        self.catch_up = states.max_pending + 1 if speculative else 0
        # The latest step's outputs by row, which the next step's fed rows read (`batch`): its
        # decode rows, then the rows that drew their first token (`record_first`). Row r emitted
        # emitted[:accepted[r] + 1, r] (drafts it accepted, then the target's token; the runner
        # writes sampled rows' tokens here too) with its newest token at last_positions[r].
        # W = C rows: a row accepts at most k drafts. A plain engine keeps
        # only emitted[0] (its positions are known to the host, its accepted counts are 0).
        # nonfinite[r]: 1 where row r's logits held a NaN or an infinity (a numerical fault of
        # the model). All three are rows of one buffer, `outputs` [C + 2, max_rows], so that the
        # host reads a step's outputs in one copy (runner.py: a second copy costs each overlapped
        # step a few microseconds of stream time, 1-2% of a small model's batch-1 step).
        device = states.pending_counts.device
        width = max(self.catch_up, 1)
        self.outputs = torch.zeros(width + 2, max_rows, dtype=torch.int64, device=device)
        self.emitted, self.accepted, self.nonfinite = self.outputs[:width], self.outputs[width], self.outputs[width + 1]
        self.last_positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # Block tables by slot, zero (scratch block 0) where nothing was written: slot 0 (padding
        # rows) stays all zeros. Entries past a row's own blocks may be stale: no position of the
        # row reaches them. _sent[slot]: the table last written there (compared by identity:
        # a request's table is an immutable tuple, replaced when it grows).
        self.max_blocks_per_row = max_blocks_per_row
        self.slot_tables = torch.zeros(states.num_slots, max_blocks_per_row, dtype=torch.int32, device=device)
        self._sent: dict[int, Sequence[int]] = {}
        # Each slot's RoPE shift (its prompt's images': engine/vision/prompt.py), which the
        # decode metadata adds to every position (a model that reads images only); _deltas
        # mirrors the nonzero ones on the host.
        self.rope_deltas = torch.zeros(states.num_slots, dtype=torch.int64, device=device) \
            if model.config.vision is not None else None
        self._deltas: dict[int, int] = {}
        self._constants: dict[tuple, torch.Tensor] = {}

    def row_tensors(self, rows: Sequence[DecodeRow], device: torch.device) -> DecodeRows:
        """DecodeRows on the device for an eager step (graphs copy into static buffers instead)."""
        cuda = device.type == "cuda"
        packed = pack_rows(rows, self.catch_up, self.block_size, len(rows), pin_memory=cuda,
                           appends=self.sync_tables(rows))
        return DecodeRows(packed.to(device, non_blocking=cuda))

    def sync_tables(self, rows: Sequence[DecodeRow]) -> list[tuple[int, int]]:
        """Bring the rows' block tables in `slot_tables` up to date with what changed since last
        sent: returns each row's packed (table column + 1, block), the one entry by which its
        table extends the one sent (written by the step's first stage: `batch` with feed), else
        NO_APPEND; any other change (a table that grew by more, a slot's new table) is written
        here, one small copy and one scatter for the step, none when there is none. The step
        these rows are packed into must run: what they carry counts as sent."""
        appends = []
        slots: list[int] = []
        columns: list[int] = []
        blocks: list[int] = []
        for r in rows:
            table, sent = r.block_table, self._sent.get(r.slot)
            if table is sent:
                appends.append(NO_APPEND)
                continue
            if len(table) > self.max_blocks_per_row:
                raise ValueError(f"slot {r.slot}: {len(table)} KV blocks, at most {self.max_blocks_per_row}")
            start = len(sent) if sent is not None and table[:len(sent)] == sent else 0
            self._sent[r.slot] = table
            if len(table) == start + 1:
                appends.append((len(table), table[start]))
                continue
            appends.append(NO_APPEND)
            slots += [r.slot] * (len(table) - start)
            columns += range(start, len(table))
            blocks += table[start:]
        if not blocks:
            return appends
        cuda = self.slot_tables.device.type == "cuda"
        updates = torch.from_numpy(np.array((slots, columns, blocks), dtype=np.int64))
        if cuda:
            updates = updates.pin_memory().to(self.slot_tables.device, non_blocking=True)
        self.slot_tables[updates[0], updates[1]] = updates[2].to(torch.int32)
        return appends

    def set_rope_deltas(self, deltas: Sequence[tuple[int, int]]) -> None:
        """(slot, delta) for sequences (re)starting in those slots; one small copy when any
        changes (text prompts keep 0: none, unless the slot last held an image prompt)."""
        changed = [(slot, delta) for slot, delta in deltas if self._deltas.get(slot, 0) != delta]
        if not changed:
            return
        assert self.rope_deltas is not None, "a RoPE shift on a model that reads no images"
        for slot, delta in changed:
            if delta:
                self._deltas[slot] = delta
            else:
                self._deltas.pop(slot, None)
        slots, values = zip(*changed)
        self.rope_deltas[list(slots)] = torch.tensor(values, dtype=torch.int64).to(self.rope_deltas.device)

    def record(self, rows: DecodeRows, accepted: torch.Tensor | None, emitted: torch.Tensor | None = None) -> None:
        """Keep a speculative step's outputs for the next step's fed rows: accepted [B] and
        emitted [B, K + 1] (None, None: a plain step, whose argmax is in emitted[0] already)."""
        num_rows = rows.num_rows
        if accepted is None:
            self.accepted[:num_rows] = 0
        else:
            self.accepted[:num_rows] = accepted
            self.emitted[:emitted.shape[1], :num_rows] = emitted.T
        self.last_positions[:num_rows] = rows.positions

    def record_first(self, start: int, tokens: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the first tokens [N] that rows of a step drew from logits [N, V] (prefill chunks
        ending their prompt, cached prompts; at `positions` [N]) at output rows start..start + N,
        after the step's decode rows, as rows that accepted nothing (the next step's fed rows
        read them: `batch` with feed), with their non-finite flags."""
        rows = slice(start, start + tokens.shape[0])
        self.model.ops.greedy_argmax(logits, 1, nonfinite=self.nonfinite[rows])  # the flags (its argmax unused)
        self.emitted[0, rows] = tokens
        # The rest are the padding ids of the MTP catch-up of the rows fed from these (one real
        # position): zeros, as a packed row's, not whatever an earlier step left in the columns
        # (a graph bucket's padding rows, whose tokens are made of scratch).
        self.emitted[1:, rows] = 0
        self.accepted[rows] = 0
        self.last_positions[rows] = positions - 1

    def plain(self, rows: DecodeRows, sampled: bool = False,
              logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A plain decode step: each row's newest token (fed rows' from the latest step),
        committed at once. Returns (logits [B, V] in the model's dtype, into `logits_out` when
        given (a graph's static buffer): every reader widens them, exactly, as the verify
        logits; the step's tokens [B]: a view of `emitted[0]`, where the runner
        writes redecided rows' tokens; `nonfinite` flags the rows whose logits are not finite).
        The tokens are the argmax, and with `sampled` each sampling slot's seeded draw
        (`draw`). Beyond the model: one launch before (the metadata), one after (greedy tokens
        and flags), and a sampled step's draw. In a speculative engine (a step where no row
        drafts) it also folds the slots' pending drafts (its kernels commit everything: nothing
        stays pending) and keeps the hidden state for the next step's MTP catch-up; the MTP
        itself does not run, so its KV cache misses this position: drafts attend to a stale
        entry there, which costs acceptance, never correctness."""
        num_rows = rows.num_rows
        batch = self.batch(rows, RowTokens.NEWEST, 1, feed=True)
        hidden = self.model(batch, self.states, self.kv)
        logits = self.model.logits(hidden, out=logits_out)
        tokens, _ = self.model.ops.greedy_argmax(logits, 1, tokens=self.emitted[0, :num_rows],
                                                 nonfinite=self.nonfinite[:num_rows])
        if sampled:
            tokens.copy_(self.draw(logits, rows, tokens))
        if self.speculative:
            self.states.pending_counts.index_fill_(0, rows.slots, 0)  # (no host scalar: graph-safe)
            self.states.mtp_hidden[rows.slots, 0] = hidden
            self.record(rows, None)
        return logits, tokens

    def draw(self, logits: torch.Tensor, rows: DecodeRows, greedy: torch.Tensor) -> torch.Tensor:
        """The tokens [B * W] of the rows at W = logits rows / B consecutive positions each
        (logits [B * W, V], row-major by (row, position); the token at position i of a row goes
        to its newest position + 1 + i): where the row's slot samples (temperature > 0), the
        seeded draw of the sampling kernel from the slot's parameters (sampling_table.py),
        else `greedy` [B * W]. The same kernel, columns and (seed, position) noise as
        Sampler.draw, so a row drawn here gets the token the runner would draw for it after
        the step. No host sync, fixed shapes: it runs inside the step's CUDA graph. Padding
        rows' scratch slot 0 is never started: temperature 0, they keep `greedy`."""
        width = logits.shape[0] // rows.num_rows
        columns = self.table.columns(rows.slots, width)
        drawn, _ = self.model.ops.sample(logits, *columns, self.draw_positions(rows, width))
        return torch.where(columns.temperature > 0, drawn, greedy)

    def draw_positions(self, rows: DecodeRows, width: int) -> torch.Tensor:
        """Where the tokens drawn at W = width consecutive positions of each row go [B * W],
        row-major by (row, position): position i of a row predicts its newest position + 1 + i."""
        return (rows.positions[:, None] + 1 + self.arange(width)).reshape(-1)

    def batch(self, rows: DecodeRows, tokens: RowTokens, num_positions: int, extra: torch.Tensor | None = None,
              offset: int = 0, feed: bool = False, commit: bool = True) -> ForwardBatch:
        """A batch of the rows with q = num_positions consecutive positions each, their token ids
        by `tokens` (extra [B, ...]: the drafts the ids take after or instead of the row's own;
        offset: added to each row's start), built by one kernel (kernels/decode_metadata.py).
        feed: first complete the fed rows in place from the latest step's outputs (`emitted`,
        `accepted`, `last_positions`): the first stage of every step does."""
        meta = self.model.ops.decode_metadata(rows.packed, self.slot_tables, self.emitted, self.accepted,
                                              self.last_positions, self.block_size, num_positions, tokens,
                                              extra=extra, offset=offset, feed=feed, rope_deltas=self.rope_deltas)
        num_rows, num_tokens = rows.num_rows, rows.num_rows * num_positions
        cu_seqlens = self.arange(num_rows + 1, num_positions, torch.int32)
        empty = self.arange(1, 0, torch.int32)
        return ForwardBatch(
            input_ids=meta.input_ids, positions=meta.positions, cu_seqlens=cu_seqlens, context_lens=meta.context_lens,
            block_tables=meta.block_tables, slot_mapping=meta.slot_mapping, logits_indices=self.arange(num_tokens),
            decode=RowGroup(0, num_tokens, cu_seqlens, meta.slot_ids, self.ones(num_rows)),
            prefill=RowGroup(num_tokens, num_tokens, empty, empty[:0], self.ones(0)), commit=commit)

    def arange(self, n: int, step: int = 1, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """arange(n) * step on the device, made once (not a kernel per graph replay)."""
        return self._constant(("arange", n, step, dtype),
                              lambda device: torch.arange(n, dtype=dtype, device=device) * step)

    def ones(self, n: int) -> torch.Tensor:
        return self._constant(("ones", n), lambda device: torch.ones(n, dtype=torch.bool, device=device))

    def _constant(self, key: tuple, make) -> torch.Tensor:
        """A constant made on first use. Never during a CUDA-graph capture: there it would be
        recorded, not computed (graph warm-up runs make every constant a capture needs)."""
        if key not in self._constants:
            device = self.states.pending_counts.device
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"decode_step constant {key} first needed inside a graph capture; warm up first")
            self._constants[key] = make(device)
        return self._constants[key]
