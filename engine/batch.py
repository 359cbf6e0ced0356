"""One step's flattened varlen batch, built once and passed explicitly to every layer.

Rows are ordered decode/verify first (run by the recurrent deferred-commit kernels), prefill
chunks after (run by the chunked kernels); attention sees all rows at once. Knows nothing
about requests or scheduling: a row is a slot, a block table and the tokens to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels.gdn_chunked import CHUNK_SIZE


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host values on `device` without stalling its stream: a copy from pageable
    memory waits for all queued GPU work, one from pinned memory is queued like a kernel (the
    caching host allocator keeps the staging buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class Row:
    """The tokens one sequence runs this step.

    start_position: tokens of the sequence already folded into its state and KV cache.
    num_logits: how many of the row's last positions need logits (1 to generate, all to score).
    checkpoints (prefill rows): (n, slot) pairs, write the state after the row's first n tokens
    into slot (n a multiple of the GDN chunk size or the row's length; kernels/gdn_chunked.py).
    """

    token_ids: Sequence[int]
    start_position: int
    slot: int
    block_table: Sequence[int]
    num_logits: int = 1
    checkpoints: Sequence[tuple[int, int]] = ()

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a row must carry at least one token")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"num_logits={self.num_logits} outside 0..{len(self.token_ids)}")
        lengths = [n for n, _ in self.checkpoints]
        if any(not 0 < n <= len(self.token_ids) or (n % CHUNK_SIZE and n != len(self.token_ids)) for n in lengths) \
                or lengths != sorted(set(lengths)):
            raise ValueError(f"checkpoint lengths {lengths} must increase, each in (0, {len(self.token_ids)}] and a "
                             f"multiple of {CHUNK_SIZE} or the row's length")


@dataclass(frozen=True)
class RowGroup:
    """A contiguous run of rows (decode group or prefill group), re-based to its own tokens."""

    token_start: int
    token_end: int
    cu_seqlens: torch.Tensor         # [rows + 1] int32, offsets within the group
    slot_ids: torch.Tensor           # [rows] int32
    has_initial_state: torch.Tensor  # [rows] bool: read the slot's state (else start from zero)

    @property
    def num_rows(self) -> int:
        return self.slot_ids.numel()


@dataclass(frozen=True)
class PrefillCheckpoints:
    """States the prefill group's forward writes into checkpoint slots (N of them, CSR by row).
    Token indices are within the prefill group."""

    cu: torch.Tensor           # [prefill rows + 1] int32
    lengths: torch.Tensor      # [N] int32: tokens of its row before the checkpoint
    slots: torch.Tensor        # [N] int64: the slot the state goes to
    last_token: torch.Tensor   # [N] int64: index of the last token before the checkpoint
    row_start: torch.Tensor    # [N] int64: index of its row's first token
    row_slot: torch.Tensor     # [N] int64: its row's own slot


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    cu_seqlens: torch.Tensor      # [B + 1] int32, all rows
    context_lens: torch.Tensor    # [B] int32: keys per row after this step's tokens
    block_tables: torch.Tensor    # [B, max_blocks] int32 (padded with scratch block 0)
    slot_mapping: torch.Tensor    # [T] int64: KV cache flat index of each token
    logits_indices: torch.Tensor  # [N] int64: token indices that need logits
    decode: RowGroup
    prefill: RowGroup
    commit: bool                  # decode rows fold their new tokens at once (no speculation)
    checkpoints: PrefillCheckpoints | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(cls, decode_rows: Sequence[Row], prefill_rows: Sequence[Row], block_size: int,
              device: torch.device | str, commit: bool = True) -> "ForwardBatch":
        rows = [*decode_rows, *prefill_rows]
        if not rows:
            raise ValueError("empty batch")
        lengths = [len(r.token_ids) for r in rows]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        input_ids, positions, slot_mapping, logits_indices = [], [], [], []
        max_blocks = max(len(r.block_table) for r in rows)
        for r, start in zip(rows, offsets):
            end_position = r.start_position + len(r.token_ids)
            if len(r.block_table) * block_size < end_position:
                raise ValueError(f"block table of slot {r.slot} covers {len(r.block_table) * block_size} "
                                 f"tokens, row needs {end_position}")
            input_ids.extend(r.token_ids)
            span = range(r.start_position, end_position)
            positions.extend(span)
            slot_mapping.extend(r.block_table[p // block_size] * block_size + p % block_size for p in span)
            logits_indices.extend(range(start + len(r.token_ids) - r.num_logits, start + len(r.token_ids)))

        def tensor(values, dtype):
            return device_tensor(values, dtype, device)

        def group(first: int, last: int) -> RowGroup:
            base = offsets[first]
            return RowGroup(token_start=base, token_end=offsets[last],
                            cu_seqlens=tensor([o - base for o in offsets[first:last + 1]], torch.int32),
                            slot_ids=tensor([r.slot for r in rows[first:last]], torch.int32),
                            has_initial_state=tensor([r.start_position > 0 for r in rows[first:last]], torch.bool))

        num_decode = len(decode_rows)
        checkpoints = None
        if any(r.checkpoints for r in prefill_rows):
            base = offsets[num_decode]
            owners = [(i, n, slot) for i, r in enumerate(prefill_rows) for n, slot in r.checkpoints]
            cu = [0]
            for r in prefill_rows:
                cu.append(cu[-1] + len(r.checkpoints))
            checkpoints = PrefillCheckpoints(
                cu=tensor(cu, torch.int32),
                lengths=tensor([n for _, n, _ in owners], torch.int32),
                slots=tensor([slot for _, _, slot in owners], torch.int64),
                last_token=tensor([offsets[num_decode + i] - base + n - 1 for i, n, _ in owners], torch.int64),
                row_start=tensor([offsets[num_decode + i] - base for i, _, _ in owners], torch.int64),
                row_slot=tensor([prefill_rows[i].slot for i, _, _ in owners], torch.int64))
        return cls(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            cu_seqlens=tensor(offsets, torch.int32),
            context_lens=tensor([r.start_position + len(r.token_ids) for r in rows], torch.int32),
            block_tables=tensor([list(r.block_table) + [0] * (max_blocks - len(r.block_table)) for r in rows],
                                torch.int32),
            slot_mapping=tensor(slot_mapping, torch.int64),
            logits_indices=tensor(logits_indices, torch.int64),
            decode=group(0, num_decode),
            prefill=group(num_decode, len(rows)),
            commit=commit,
            checkpoints=checkpoints,
        )
