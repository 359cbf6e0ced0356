"""One step's flattened varlen batch, built once and passed explicitly to every layer.

Rows are ordered decode/verify first (run by the recurrent deferred-commit kernels), prefill
chunks after (run by the chunked kernels); attention sees all rows at once. Knows nothing
about requests or scheduling: a row is a slot, a block table and the tokens to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..kernels.gdn_chunked import CHUNK_SIZE


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host values on `device` without stalling its stream: a copy from pageable
    memory waits for all queued GPU work, one from pinned memory is queued like a kernel (the
    caching host allocator keeps the staging buffer until the copy has run)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def row_index(chosen: Sequence[int], num_rows: int, device: torch.device | str) -> slice | torch.Tensor:
    """Where the chosen rows (distinct, ascending) of a step's num_rows rows sit, to index its
    per-row tensors with: the slice of the first len(chosen) rows when every row is chosen (views,
    no copy in and no gather: a batch whose rows all need the same treatment), else their
    indices on the device."""
    if len(chosen) == num_rows:
        return slice(0, num_rows)
    return device_tensor(chosen, torch.int64, device)


def device_arrays(arrays: dict[str, np.ndarray], device: torch.device | str,
                  into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Host arrays on `device` by one copy: packed into one pinned buffer, copied as
    device_tensor copies, then viewed back in their dtypes and shapes. A step's metadata is a
    dozen small arrays; a copy each costs a dozen allocations and launches. Each array starts at
    a multiple of 16 bytes, as a fresh allocation does: Triton specializes a kernel on whether
    each pointer is 16-byte aligned, so a view at another offset would compile a new variant
    mid-serving, one the warm-up never built. into: a uint8 device buffer of packed_size(arrays)
    bytes to copy into (a CUDA graph's static inputs) instead of a new one."""
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    if torch.device(device).type != "cuda":
        return {name: torch.from_numpy(a.copy()).to(device) for name, a in arrays.items()}
    offsets, total = _packing(arrays)
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for name, a in arrays.items():
        host[offsets[name]:offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
    if into is None:
        packed = staging.to(device, non_blocking=True)
    else:
        packed = into.copy_(staging[:into.numel()], non_blocking=True)
    return {name: packed[offsets[name]:offsets[name] + a.nbytes].view(_TORCH_DTYPE[a.dtype]).view(a.shape)
            for name, a in arrays.items()}


def packed_size(arrays: dict[str, np.ndarray]) -> int:
    """Bytes of device_arrays' packed buffer for arrays of these dtypes and shapes."""
    return max(_packing(arrays)[1], _ALIGN)


def _packing(arrays: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    offsets, total = {}, 0
    for name, a in arrays.items():
        offsets[name] = total
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, total


_ALIGN = 16
_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                np.dtype(np.float32): torch.float32}


def spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ranges [starts[i], starts[i] + counts[i]) one after another, as one int64 array."""
    starts, counts = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # each element: its range's start + its index within the range
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class Row:
    """The tokens one sequence runs this step.

    start_position: tokens of the sequence already folded into its state and KV cache.
    num_logits: how many of the row's last positions need logits (1 to generate, all to score).
    checkpoints (prefill rows): (n, slot) pairs, write the state after the row's first n tokens
    into slot (n a multiple of the GDN chunk size or the row's length; kernels/gdn_chunked.py).
    RoPE turns token i of the row by position start_position + i + rope_delta, or, where rope
    is given ([3, tokens] int64: a run among a prompt's images), by its three positions.
    """

    token_ids: Sequence[int]
    start_position: int
    slot: int
    block_table: Sequence[int]
    num_logits: int = 1
    checkpoints: Sequence[tuple[int, int]] = ()
    rope: np.ndarray | None = None
    rope_delta: int = 0

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
        if self.rope is not None and self.rope.shape != (3, len(self.token_ids)):
            raise ValueError(f"rope positions {list(self.rope.shape)} for a row of {len(self.token_ids)} tokens")


def _rope_positions(positions: np.ndarray, lengths: np.ndarray, ropes: Sequence[np.ndarray | None],
                    deltas: Sequence[int], offsets: np.ndarray) -> np.ndarray:
    """The batch's RoPE positions from its KV positions [T]: [T] (+ each row's delta) when no
    row gives its own, else [3, T] (the others' broadcast over the three axes)."""
    shifted = positions + np.repeat(np.asarray(deltas, dtype=np.int64), lengths) if any(deltas) else positions
    if all(rope is None for rope in ropes):
        return shifted
    out = np.repeat(shifted[None, :], 3, axis=0)
    for i, rope in enumerate(ropes):
        if rope is not None:
            out[:, offsets[i]:offsets[i + 1]] = rope
    return out


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
    positions: torch.Tensor       # [T] int64 RoPE positions, or [3, T] (multimodal RoPE of image tokens)
    cu_seqlens: torch.Tensor      # [B + 1] int32, all rows
    context_lens: torch.Tensor    # [B] int32: keys per row after this step's tokens
    block_tables: torch.Tensor    # [B, max_blocks] int32 (padded with scratch block 0)
    slot_mapping: torch.Tensor    # [T] int64: KV cache flat index of each token
    logits_indices: torch.Tensor  # [N] int64: token indices that need logits
    decode: RowGroup
    prefill: RowGroup
    commit: bool                  # decode rows fold their new tokens at once (no speculation)
    checkpoints: PrefillCheckpoints | None = None
    # Input embeddings that replace the token embeddings at some tokens (image features):
    # (token indices [M] int64, embeddings [M, H] in the model dtype); None: none.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(cls, decode_rows: Sequence[Row], prefill_rows: Sequence[Row], block_size: int,
              device: torch.device | str, commit: bool = True) -> "ForwardBatch":
        """The batch of these rows on `device` (one host-to-device copy)."""
        layout = BatchLayout.of(decode_rows, prefill_rows, block_size)
        return layout.batch(device_arrays(layout.arrays, device), commit)


@dataclass(frozen=True)
class Padding:
    """Rows that bring a prefill batch to a fixed shape (a CUDA graph's, prefill_graphs.py):
    num_tokens tokens in num_rows rows, num_checkpoints checkpoint entries, block tables
    table_width wide. Padding rows run from zero state in scratch slot 0 over scratch KV block
    0 (never a sequence's), the padding tokens spread evenly over them, each row at least one
    token long (no kernel sees an empty row); the padding checkpoint entries have length 0,
    which no chunk boundary matches, so the kernels write none of them and the copies after the
    forward go to the scratch slot."""

    num_tokens: int
    num_rows: int
    num_checkpoints: int
    table_width: int

    def fits(self, num_tokens: int, num_rows: int, num_checkpoints: int, table_width: int) -> bool:
        return (num_rows < self.num_rows and self.num_tokens - num_tokens >= self.num_rows - num_rows
                and num_checkpoints <= self.num_checkpoints and table_width <= self.table_width)

    def max_row_tokens(self, num_tokens: int, num_rows: int) -> int:
        """Tokens of the longest padding row beside num_tokens real tokens in num_rows rows."""
        return -(-(self.num_tokens - num_tokens) // (self.num_rows - num_rows))


@dataclass(frozen=True)
class BatchLayout:
    """A batch's arrays on the host (numpy, no Python loop over tokens) and where its row
    groups start, before they go to the device."""

    arrays: dict[str, np.ndarray]
    offsets: list[int]      # [rows + 1] token offsets of the rows
    num_decode: int
    num_rows: int           # real and padding rows

    @classmethod
    def of(cls, decode_rows: Sequence[Row], prefill_rows: Sequence[Row], block_size: int,
           padding: Padding | None = None) -> "BatchLayout":
        """Padding (prefill rows only) appends padding rows after the real ones."""
        rows = [*decode_rows, *prefill_rows]
        if not rows and padding is None:
            raise ValueError("empty batch")
        if padding is not None and decode_rows:
            raise ValueError("a padded batch holds prefill rows only")
        num_decode = len(decode_rows)
        lengths = [len(r.token_ids) for r in rows]
        starts = [r.start_position for r in rows]
        slots = [r.slot for r in rows]
        num_logits = [r.num_logits for r in rows]
        tables = [r.block_table for r in rows]
        ropes = [r.rope for r in rows]
        deltas = [r.rope_delta for r in rows]
        owners = [(i, n, slot) for i, r in enumerate(prefill_rows) for n, slot in r.checkpoints]
        counts = [len(r.checkpoints) for r in prefill_rows]
        token_ids = [np.asarray(r.token_ids, dtype=np.int64) for r in rows]
        width = max((len(t) for t in tables), default=0)
        if padding is not None:
            num_tokens = sum(lengths)
            if not padding.fits(num_tokens, len(rows), len(owners), width):
                raise ValueError(f"{num_tokens} tokens in {len(rows)} rows, {len(owners)} checkpoints, tables "
                                 f"{width} wide do not fit {padding}")
            # The padding tokens spread evenly over the padding rows: no row longer than needed
            # (a row's positions stay inside its table and the model's positions).
            longest = padding.max_row_tokens(num_tokens, len(rows))
            if longest > padding.table_width * block_size:
                raise ValueError(f"padding rows of {longest} tokens overrun tables of {padding.table_width} blocks")
            extra_rows = padding.num_rows - len(rows)
            share, rest = divmod(padding.num_tokens - num_tokens, extra_rows)
            extra = [share + 1] * rest + [share] * (extra_rows - rest)
            lengths += extra
            starts += [0] * extra_rows
            slots += [0] * extra_rows
            num_logits += [0] * extra_rows
            deltas += [0] * extra_rows
            token_ids.append(np.zeros(sum(extra), dtype=np.int64))
            # The padding checkpoint entries belong to the first padding row.
            owners += [(len(prefill_rows), 0, 0)] * (padding.num_checkpoints - len(owners))
            counts += [padding.num_checkpoints - sum(counts)] + [0] * (extra_rows - 1)
            width = padding.table_width
        num_rows = len(lengths)
        lengths, starts = np.array(lengths, dtype=np.int64), np.array(starts, dtype=np.int64)
        offsets = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ends = starts + lengths
        block_tables = np.zeros((num_rows, width), dtype=np.int32)  # padded with scratch block 0
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
        short = np.flatnonzero(np.array([len(t) for t in tables], dtype=np.int64) * block_size < ends[:len(rows)])
        if short.size:
            i = int(short[0])
            raise ValueError(f"block table of slot {rows[i].slot} covers {len(tables[i]) * block_size} "
                             f"tokens, row needs {ends[i]}")
        positions = spans(starts, lengths)
        row_of_token = np.repeat(np.arange(num_rows), lengths)
        slot_mapping = (block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
                        + positions % block_size)
        num_logits = np.array(num_logits, dtype=np.int64)
        arrays = dict(
            input_ids=np.concatenate(token_ids),
            positions=_rope_positions(positions, lengths, ropes, deltas, offsets),
            cu_seqlens=offsets.astype(np.int32),
            context_lens=ends.astype(np.int32),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=spans(offsets[1:] - num_logits, num_logits),
            slot_ids=np.array(slots, dtype=np.int32),
            has_initial_state=starts > 0,
            decode_cu=offsets[:num_decode + 1].astype(np.int32),
            prefill_cu=(offsets[num_decode:] - offsets[num_decode]).astype(np.int32))
        if owners:
            index, length, slot = (np.array(column, dtype=np.int64) for column in zip(*owners))
            row_start = offsets[num_decode + index] - offsets[num_decode]
            arrays.update(
                checkpoint_cu=np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
                checkpoint_lengths=length.astype(np.int32),
                checkpoint_slots=slot,
                checkpoint_last_token=np.maximum(row_start + length - 1, 0),
                checkpoint_row_start=row_start,
                checkpoint_row_slot=arrays["slot_ids"][num_decode + index].astype(np.int64))
        return cls(arrays, offsets.tolist(), num_decode, num_rows)

    def batch(self, t: dict[str, torch.Tensor], commit: bool) -> ForwardBatch:
        """The ForwardBatch over `t`, this layout's arrays on the device."""
        offset, num_decode = self.offsets, self.num_decode

        def group(first: int, last: int, cu: torch.Tensor) -> RowGroup:
            return RowGroup(token_start=offset[first], token_end=offset[last], cu_seqlens=cu,
                            slot_ids=t["slot_ids"][first:last], has_initial_state=t["has_initial_state"][first:last])

        checkpoints = None if "checkpoint_cu" not in t else PrefillCheckpoints(
            cu=t["checkpoint_cu"], lengths=t["checkpoint_lengths"], slots=t["checkpoint_slots"],
            last_token=t["checkpoint_last_token"], row_start=t["checkpoint_row_start"],
            row_slot=t["checkpoint_row_slot"])
        return ForwardBatch(
            input_ids=t["input_ids"],
            positions=t["positions"],
            cu_seqlens=t["cu_seqlens"],
            context_lens=t["context_lens"],
            block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"],
            logits_indices=t["logits_indices"],
            decode=group(0, num_decode, t["decode_cu"]),
            prefill=group(num_decode, self.num_rows, t["prefill_cu"]),
            commit=commit,
            checkpoints=checkpoints,
        )
