"""A fixed-shape decode batch's metadata, built on the device in one launch from its packed rows.

A decode step's rows arrive as one packed int64 tensor [B, 10 + C] (columns below: slot, fed
flag and source row, draft count, a table entry to append, newest token, position, MTP start,
catch-up count, C catch-up ids); block tables live on the device per slot (`slot_tables` [S, W]
int32). Each row runs q consecutive positions from a start, with token ids by `RowTokens`:

    NEWEST    its newest token at `position`, then extra[r, :q - 1] (plain decode: q = 1; verify:
              the drafts, q = K + 1)
    CATCH_UP  its C catch-up ids at [mtp_start, mtp_start + C) (the MTP catch-up, q = C)
    EXTRA     extra[r, :q] at [position + offset, ...) (the MTP chain: one draft a row)

From those, per row r and position j (p = start_r + j, table = slot_tables[slot_r]):

    input_ids[r q + j]    the token id above           positions[r q + j]     p + rope_deltas[slot_r]
    slot_mapping[r q + j] table[p // bs] * bs + p % bs context_lens[r]        start_r + q (int32)
    slot_ids[r]           slot_r (int32)               block_tables[r]        table (int32 [W])

with a row's table entries past its context (ceil(context_lens[r] / bs) blocks) zero, scratch
block 0: no kernel reads them, and the kernel loads none of them (a long max_model_len's table
is thousands of entries a row, of which a short sequence uses a few). positions are RoPE's:
rope_deltas [S] int64 (optional, else 0) shifts a slot's by its prompt's images (multimodal
RoPE: engine/vision/prompt.py); the KV positions behind slot_mapping and context_lens are p.

A row may carry one table entry of its slot (TABLE_COLUMN = c + 1, TABLE_BLOCK = b; 0: none):
every call reads the row's table with entry c = b, and `feed` writes it into `slot_tables` for
good. A table growing by a block per step (every decode row, every block_size tokens) thus
needs no copy and no scatter of its own: the step's one packed copy carries it, and its first
stage (the one with `feed`) writes it.

`feed` first completes the fed rows (fed flag set) in place from the latest step's outputs:
emitted [E, R] (row e: each row's e-th emitted token), accepted [R], last_positions [R]. Without
catch-up columns (C = 0, a plain engine) a fed row's newest token is emitted[0, source]; with
them (speculation) a fed row continues the a = accepted[source] drafts its source accepted:
newest emitted[a, source], position last_positions[source] + a + 1, MTP start
last_positions[source], a + 1 positions to catch up with ids emitted[:C, source].

`decode_metadata` (Triton, one program per row) replaces the chain of small torch ops that
`decode_metadata_reference` (its oracle, also the CPU path) runs: each of those is a launch in
every decode step's graph. Positions must lie inside their row's table (the host checks it when
it packs the rows); the kernel reads scratch block 0 beyond it rather than out of bounds. Knows
nothing about requests, steps or speculation beyond these columns.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Columns of the packed rows: those the host always knows, then those a fed row derives on the
# device (NEWEST onwards), then C catch-up ids.
(SLOT, IS_FED, FED_FROM, NUM_DRAFTS, TABLE_COLUMN, TABLE_BLOCK, NEWEST, POSITION, MTP_START, NUM_CATCH_UP,
 CATCH_UP_IDS) = range(11)
# The kernel's copies (a Triton kernel reads only constexpr globals).
_SLOT, _IS_FED, _FED_FROM, _TABLE_COLUMN, _TABLE_BLOCK, _NEWEST, _POSITION, _MTP_START, _NUM_CATCH_UP, \
    _CATCH_UP_IDS = (tl.constexpr(c) for c in (SLOT, IS_FED, FED_FROM, TABLE_COLUMN, TABLE_BLOCK, NEWEST, POSITION,
                                               MTP_START, NUM_CATCH_UP, CATCH_UP_IDS))


class RowTokens(enum.IntEnum):
    """Which token ids a decode batch's rows run, and from where (the module docstring)."""

    NEWEST = 0
    CATCH_UP = 1
    EXTRA = 2


_TOKENS_NEWEST, _TOKENS_CATCH_UP = tl.constexpr(RowTokens.NEWEST.value), tl.constexpr(RowTokens.CATCH_UP.value)


class DecodeMetadata(NamedTuple):
    """What the forward reads of a decode batch (B rows of q positions)."""

    input_ids: torch.Tensor     # [B q] int64
    positions: torch.Tensor     # [B q] int64
    slot_mapping: torch.Tensor  # [B q] int64: KV cache flat index of each position
    context_lens: torch.Tensor  # [B] int32: keys of each row after its q positions
    slot_ids: torch.Tensor      # [B] int32
    block_tables: torch.Tensor  # [B, W] int32: each row's slot's table, zero past its context


def feed_reference(packed: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor,
                   last_positions: torch.Tensor) -> None:
    """Completes the fed rows of packed in place (the module docstring)."""
    catch_up = packed.shape[1] - CATCH_UP_IDS
    fed, source = packed[:, IS_FED].bool(), packed[:, FED_FROM]
    if catch_up == 0:
        packed[:, NEWEST] = torch.where(fed, emitted[0, source], packed[:, NEWEST])
        return
    taken, previous = accepted[source], last_positions[source]
    derived = torch.cat([torch.stack([emitted[taken, source], previous + taken + 1, previous, taken + 1], dim=1),
                         emitted[:catch_up, source].T], dim=1)                            # [B, 4 + C]
    packed[:, NEWEST:] = torch.where(fed[:, None], derived, packed[:, NEWEST:])


def decode_metadata_reference(packed: torch.Tensor, slot_tables: torch.Tensor, emitted: torch.Tensor,
                              accepted: torch.Tensor, last_positions: torch.Tensor, block_size: int,
                              num_positions: int, tokens: RowTokens, extra: torch.Tensor | None = None,
                              offset: int = 0, feed: bool = False,
                              rope_deltas: torch.Tensor | None = None) -> DecodeMetadata:
    """packed [B, 10 + C] int64 (fed rows completed and rows' table entries written into
    slot_tables in place when feed); slot_tables [S, W] int32; emitted [E, R], accepted [R],
    last_positions [R] int64: the latest step's outputs; extra [B, >= q - 1 or q] int64 (NEWEST,
    EXTRA). Returns the rows' DecodeMetadata."""
    appended, column = packed[:, TABLE_COLUMN] > 0, packed[:, TABLE_COLUMN] - 1
    if feed:
        feed_reference(packed, emitted, accepted, last_positions)
        slot_tables[packed[appended, SLOT], column[appended]] = packed[appended, TABLE_BLOCK].to(slot_tables.dtype)
    q = num_positions
    slots = packed[:, SLOT]
    start = packed[:, MTP_START if tokens == RowTokens.CATCH_UP else POSITION] + offset
    positions = start[:, None] + torch.arange(q, device=packed.device)                     # [B, q]
    if tokens == RowTokens.NEWEST:
        input_ids = torch.cat([packed[:, NEWEST, None], extra[:, :q - 1] if q > 1 else packed[:, :0]], dim=1)
    elif tokens == RowTokens.CATCH_UP:
        input_ids = packed[:, CATCH_UP_IDS:CATCH_UP_IDS + q]
    else:
        input_ids = extra[:, :q]
    context_lens = positions[:, -1] + 1
    tables = slot_tables[slots]
    own = appended[:, None] & (torch.arange(tables.shape[1], device=packed.device) == column[:, None])
    tables = torch.where(own, packed[:, TABLE_BLOCK, None].to(tables.dtype), tables)
    blocks = tables.gather(1, positions // block_size).long()
    used = torch.arange(tables.shape[1], device=packed.device) < (context_lens[:, None] + block_size - 1) // block_size
    rope = positions if rope_deltas is None else positions + rope_deltas[slots][:, None]
    return DecodeMetadata(input_ids.reshape(-1), rope.reshape(-1),
                          (blocks * block_size + positions % block_size).reshape(-1), context_lens.to(torch.int32),
                          slots.to(torch.int32), tables.masked_fill(~used, 0))


@triton.jit(do_not_specialize=["offset"])
def _decode_metadata_kernel(packed, emitted, accepted, last_positions, slot_tables, extra, rope_deltas,
                            input_ids, positions, slot_mapping, context_lens, slot_ids, block_tables,
                            stride_packed, stride_emitted, stride_tables, stride_extra, num_positions, table_width,
                            block_size, offset, TOKENS: tl.constexpr, FEED: tl.constexpr, CATCH_UP: tl.constexpr,
                            ROPE_DELTA: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program r: row r's metadata (the module docstring). Fed values and the appended table
    entry stay in registers once derived (a store then a load of the same address within a
    program is not ordered)."""
    row = tl.program_id(0).to(tl.int64)
    own = packed + row * stride_packed
    slot = tl.load(own + _SLOT)
    table = slot_tables + slot * stride_tables
    appended = tl.load(own + _TABLE_COLUMN) - 1  # -1: none
    appended_block = tl.load(own + _TABLE_BLOCK).to(tl.int32)
    newest = tl.load(own + _NEWEST)
    position = tl.load(own + _POSITION)
    mtp_start = tl.load(own + _MTP_START)
    j = tl.arange(0, BLOCK_Q)
    in_catch_up = j < CATCH_UP
    catch_up_ids = tl.load(own + _CATCH_UP_IDS + j, mask=in_catch_up, other=0)
    if FEED:
        fed = tl.load(own + _IS_FED) != 0
        source = tl.load(own + _FED_FROM)  # 0 on rows not fed: every load below stays in bounds
        if CATCH_UP == 0:
            newest = tl.where(fed, tl.load(emitted + source), newest)
        else:
            taken = tl.load(accepted + source)
            previous = tl.load(last_positions + source)
            newest = tl.where(fed, tl.load(emitted + taken * stride_emitted + source), newest)
            position = tl.where(fed, previous + taken + 1, position)
            mtp_start = tl.where(fed, previous, mtp_start)
            num_catch_up = tl.where(fed, taken + 1, tl.load(own + _NUM_CATCH_UP))
            catch_up_ids = tl.where(fed, tl.load(emitted + j * stride_emitted + source, mask=in_catch_up, other=0),
                                    catch_up_ids)
            tl.store(own + _POSITION, position)
            tl.store(own + _MTP_START, mtp_start)
            tl.store(own + _NUM_CATCH_UP, num_catch_up)
            tl.store(own + _CATCH_UP_IDS + j, catch_up_ids, mask=in_catch_up)
        tl.store(own + _NEWEST, newest)
        tl.store(table + tl.maximum(appended, 0), appended_block, mask=appended >= 0)
    inside = j < num_positions
    if TOKENS == _TOKENS_CATCH_UP:  # (q = C)
        start = mtp_start + offset
        ids = catch_up_ids
    elif TOKENS == _TOKENS_NEWEST:  # then extra[:, :q - 1]
        start = position + offset
        ids = tl.load(extra + row * stride_extra + j - 1, mask=inside & (j > 0), other=0)
        ids = tl.where(j == 0, newest, ids)
    else:  # EXTRA
        start = position + offset
        ids = tl.load(extra + row * stride_extra + j, mask=inside, other=0)
    p = start + j
    out = row * num_positions + j
    tl.store(input_ids + out, ids, mask=inside)
    if ROPE_DELTA:
        tl.store(positions + out, p + tl.load(rope_deltas + slot), mask=inside)
    else:
        tl.store(positions + out, p, mask=inside)
    index = p // block_size
    block = tl.load(table + index, mask=inside & (index < table_width), other=0)
    block = tl.where(index == appended, appended_block, block).to(tl.int64)
    tl.store(slot_mapping + out, block * block_size + p % block_size, mask=inside)
    context = start + num_positions
    tl.store(context_lens + row, context.to(tl.int32))
    tl.store(slot_ids + row, slot.to(tl.int32))
    used = (context + block_size - 1) // block_size
    for first in range(0, table_width, BLOCK_W):
        w = first + tl.arange(0, BLOCK_W)
        entries = tl.load(table + w, mask=(w < used) & (w < table_width), other=0)
        entries = tl.where((w == appended) & (w < used), appended_block, entries)
        tl.store(block_tables + row * table_width + w, entries, mask=w < table_width)


def _check_decode_metadata_args(packed, slot_tables, emitted, accepted, last_positions, block_size, num_positions,
                                tokens, extra) -> None:
    assert packed.dtype == torch.int64 and packed.dim() == 2 and packed.stride(1) == 1 \
        and packed.shape[1] >= CATCH_UP_IDS, "packed: int64 [B, 10 + C] with unit column stride"
    catch_up = packed.shape[1] - CATCH_UP_IDS
    assert slot_tables.dtype == torch.int32 and slot_tables.dim() == 2 and slot_tables.stride(1) == 1, \
        "slot_tables: int32 [S, W] with unit column stride"
    assert emitted.dtype == torch.int64 and emitted.dim() == 2 and emitted.stride(1) == 1 \
        and emitted.shape[0] >= max(catch_up, 1), f"emitted: int64 [>= {max(catch_up, 1)}, R], unit column stride"
    for name, values in (("accepted", accepted), ("last_positions", last_positions)):
        assert values.dtype == torch.int64 and values.dim() == 1 and values.is_contiguous() \
            and values.shape[0] == emitted.shape[1], f"{name}: contiguous int64 [R]"
    assert block_size > 0 and num_positions >= 1, f"block_size {block_size}, num_positions {num_positions}"
    tokens = RowTokens(tokens)
    if tokens == RowTokens.CATCH_UP:
        assert num_positions == catch_up, f"the catch-up runs all C = {catch_up} positions, not {num_positions}"
    wanted = {RowTokens.NEWEST: num_positions - 1, RowTokens.EXTRA: num_positions}.get(tokens, 0)
    if wanted:
        assert extra is not None and extra.dtype == torch.int64 and extra.dim() == 2 and extra.stride(1) == 1 \
            and extra.shape[0] == packed.shape[0] and extra.shape[1] >= wanted, \
            f"extra: int64 [B, >= {wanted}] with unit column stride"
    tensors = [packed, slot_tables, emitted, accepted, last_positions] + ([extra] if wanted else [])
    assert all(t.device == packed.device for t in tensors), "every tensor on one device"


def decode_metadata(packed: torch.Tensor, slot_tables: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor,
                    last_positions: torch.Tensor, block_size: int, num_positions: int, tokens: RowTokens,
                    extra: torch.Tensor | None = None, offset: int = 0, feed: bool = False,
                    rope_deltas: torch.Tensor | None = None) -> DecodeMetadata:
    """Triton decode_metadata_reference: one launch, grid (B,), shapes only (CUDA-graph safe)."""
    _check_decode_metadata_args(packed, slot_tables, emitted, accepted, last_positions, block_size, num_positions,
                                tokens, extra)
    num_rows, catch_up = packed.shape[0], packed.shape[1] - CATCH_UP_IDS
    table_width, device = slot_tables.shape[1], packed.device
    num_tokens = num_rows * num_positions
    meta = DecodeMetadata(
        input_ids=torch.empty(num_tokens, dtype=torch.int64, device=device),
        positions=torch.empty(num_tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=device),
        context_lens=torch.empty(num_rows, dtype=torch.int32, device=device),
        slot_ids=torch.empty(num_rows, dtype=torch.int32, device=device),
        block_tables=torch.empty(num_rows, table_width, dtype=torch.int32, device=device))
    if num_rows == 0:
        return meta
    assert rope_deltas is None or (rope_deltas.dtype == torch.int64 and rope_deltas.shape == slot_tables.shape[:1]
                                   and rope_deltas.device == device), "rope_deltas: int64 [S] beside slot_tables"
    extra = packed if extra is None else extra  # never read
    _decode_metadata_kernel[(num_rows,)](
        packed, emitted, accepted, last_positions, slot_tables, extra,
        packed if rope_deltas is None else rope_deltas, *meta, packed.stride(0), emitted.stride(0),
        slot_tables.stride(0), extra.stride(0), num_positions, table_width, block_size, offset,
        TOKENS=int(tokens), FEED=feed, CATCH_UP=catch_up, ROPE_DELTA=rope_deltas is not None,
        BLOCK_Q=triton.next_power_of_2(max(num_positions, catch_up, 2)),
        BLOCK_W=min(1024, triton.next_power_of_2(max(table_width, 2))), num_warps=4)
    return meta
