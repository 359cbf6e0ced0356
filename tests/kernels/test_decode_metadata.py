"""decode_metadata (kernels/decode_metadata.py): the torch reference against a per-row Python
reading of the packed layout, then the Triton kernel against the reference.

Rows are random: slots (padding rows on slot 0 among them), fed and unfed rows continuing random
rows of a random latest step, positions and catch-up starts just before and after block
boundaries, block sizes 4 and 16, tables of random block ids (a row's gathered table zero past
its context), rows carrying a table entry to append (read by every call, written with feed); a
plain layout (C = 0) and a
speculative one (C = 4); every RowTokens kind, with an offset. The kernel gets a copy of the same
packed rows and must complete the fed ones alike. CPU: the interpreter. GPU (`gpu` marker): 256
rows.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.decode_metadata import (CATCH_UP_IDS, POSITION, SLOT, TABLE_BLOCK, TABLE_COLUMN, RowTokens,
                                               decode_metadata)

NUM_SLOTS, TABLE_WIDTH, NUM_SOURCES = 9, 6, 5


def random_case(num_rows: int, catch_up: int, block_size: int, seed: int, device: str = "cpu",
                table_width: int = TABLE_WIDTH) -> dict:
    """Packed rows, slot tables and a latest step's outputs whose every position stays inside
    its table (at most q = max(C, 3) positions from any start, after a fed row's derivation)."""
    rng = random.Random(seed)
    span = max(catch_up, 3)
    limit = table_width * block_size - span - 1  # the furthest start a row may have

    def near_boundary() -> int:
        return min(limit, max(catch_up + 1, rng.randrange(1, table_width) * block_size + rng.randint(-2, 1)))

    width = max(catch_up, 1)
    emitted = [[rng.randrange(1000) for _ in range(NUM_SOURCES)] for _ in range(width)]
    accepted = [rng.randrange(width) for _ in range(NUM_SOURCES)] if catch_up else [0] * NUM_SOURCES
    last_positions = [near_boundary() - width for _ in range(NUM_SOURCES)]
    rows = []
    for _ in range(num_rows):
        if rng.random() < 0.2:
            rows.append([0] * (CATCH_UP_IDS + catch_up))  # a padding row
            continue
        position = near_boundary()
        num_catch_up = rng.randint(0, catch_up)
        fed = rng.random() < 0.5
        rows.append([rng.randrange(1, NUM_SLOTS), int(fed), rng.randrange(NUM_SOURCES) if fed else 0,
                     rng.randint(0, 3), 0, 0, rng.randrange(1000), position, position - num_catch_up, num_catch_up,
                     *[rng.randrange(1000) for _ in range(catch_up)]])
    # Table entries to append, on rows whose slot no other row has (a step's rows are one request
    # each, in slots of their own; padding rows all share slot 0 and append nothing).
    slots = Counter(row[SLOT] for row in rows)
    for row in rows:
        if row[SLOT] and slots[row[SLOT]] == 1 and rng.random() < 0.5:
            row[TABLE_COLUMN], row[TABLE_BLOCK] = rng.randrange(1, table_width + 1), rng.randrange(500, 600)
    tables = [[rng.randrange(1, 500) for _ in range(table_width)] for _ in range(NUM_SLOTS)]
    tables[0] = [0] * table_width  # scratch slot 0: scratch block 0
    as_tensor = lambda values, dtype=torch.int64: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    return dict(packed=as_tensor(rows).reshape(num_rows, CATCH_UP_IDS + catch_up),
                slot_tables=as_tensor(tables, torch.int32), emitted=as_tensor(emitted), accepted=as_tensor(accepted),
                last_positions=as_tensor(last_positions), block_size=block_size)


def by_hand(case: dict, num_positions: int, tokens: RowTokens, extra: list | None, offset: int, feed: bool):
    """What each row runs, read from the packed layout one row at a time, and the slot tables
    after the call."""
    catch_up = case["packed"].shape[1] - CATCH_UP_IDS
    emitted, accepted = case["emitted"].tolist(), case["accepted"].tolist()
    last_positions, tables = case["last_positions"].tolist(), case["slot_tables"].tolist()
    block_size = case["block_size"]
    packed, out = [], {name: [] for name in ("input_ids", "positions", "slot_mapping", "context_lens", "slot_ids",
                                              "block_tables")}
    rows = case["packed"].tolist()
    own_tables = []  # each row's table as the call reads it: with the entry it carries
    for slot, _, _, _, column, block, *_ in rows:
        own_tables.append(list(tables[slot]))
        if column:
            own_tables[-1][column - 1] = block
            if feed:
                tables[slot][column - 1] = block
    for r, (slot, fed, source, drafts, column, block, newest, position, mtp_start, num_catch_up, *ids) in \
            enumerate(rows):
        table = own_tables[r]
        if feed and fed:
            if catch_up:
                taken = accepted[source]
                newest, position, mtp_start = emitted[taken][source], last_positions[source] + taken + 1, \
                    last_positions[source]
                num_catch_up, ids = taken + 1, [emitted[d][source] for d in range(catch_up)]
            else:
                newest = emitted[0][source]
        packed.append([slot, fed, source, drafts, column, block, newest, position, mtp_start, num_catch_up, *ids])
        if tokens == RowTokens.CATCH_UP:
            start, row_ids = mtp_start + offset, ids[:num_positions]
        elif tokens == RowTokens.NEWEST:
            start, row_ids = position + offset, [newest, *extra[r][:num_positions - 1]]
        else:
            start, row_ids = position + offset, extra[r][:num_positions]
        for j in range(num_positions):
            p = start + j
            out["input_ids"].append(row_ids[j])
            out["positions"].append(p)
            out["slot_mapping"].append(table[p // block_size] * block_size + p % block_size)
        out["context_lens"].append(start + num_positions)
        out["slot_ids"].append(slot)
        used = -(-(start + num_positions) // block_size)  # blocks holding the row's context; zero after
        out["block_tables"].append(table[:used] + [0] * (len(table) - used))
    return packed, out, tables


CALLS = [  # (C, tokens, q, offset): plain decode; catch-up, chain, verify of a speculative step
    (0, RowTokens.NEWEST, 1, 0), (4, RowTokens.CATCH_UP, 4, 0), (4, RowTokens.EXTRA, 1, 2),
    (4, RowTokens.NEWEST, 3, 0), (0, RowTokens.EXTRA, 2, 1)]


def extra_ids(num_rows: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, 1000, (num_rows, 3), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("feed", [False, True])
@pytest.mark.parametrize("catch_up,tokens,num_positions,offset", CALLS)
def test_reference_reads_the_packed_rows(catch_up, tokens, num_positions, offset, feed):
    case = random_case(7, catch_up, 4, seed=catch_up * 10 + num_positions + feed)
    extra = extra_ids(7, 0, "cpu")
    packed, wanted, tables = by_hand(case, num_positions, tokens, extra.tolist(), offset, feed)
    meta = REFERENCE_OPS.decode_metadata(**case, num_positions=num_positions, tokens=tokens, extra=extra,
                                         offset=offset, feed=feed)
    assert case["packed"].tolist() == packed
    assert case["slot_tables"].tolist() == tables
    assert {name: getattr(meta, name).tolist() for name in wanted} == wanted
    assert meta.context_lens.dtype == meta.slot_ids.dtype == meta.block_tables.dtype == torch.int32


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("catch_up,tokens,num_positions,offset", CALLS)
def test_triton_equals_reference(kernel_device, poisoned_empty, num_rows, block_size, catch_up, tokens,
                                 num_positions, offset):
    seed = num_rows * 100 + block_size + catch_up * 7 + num_positions
    case = random_case(num_rows, catch_up, block_size, seed, kernel_device)
    extra = extra_ids(num_rows, seed, kernel_device)
    for feed in (False, True):
        ours = dict(case, packed=case["packed"].clone(), slot_tables=case["slot_tables"].clone())
        meta = poisoned_empty(decode_metadata, **ours, num_positions=num_positions, tokens=tokens, extra=extra,
                              offset=offset, feed=feed)
        theirs = dict(case, packed=case["packed"].clone(), slot_tables=case["slot_tables"].clone())
        reference = REFERENCE_OPS.decode_metadata(**theirs, num_positions=num_positions, tokens=tokens, extra=extra,
                                                  offset=offset, feed=feed)
        assert torch.equal(ours["packed"], theirs["packed"])
        assert torch.equal(ours["slot_tables"], theirs["slot_tables"])
        for name, values in reference._asdict().items():
            assert torch.equal(getattr(meta, name), values), name


def test_triton_gathers_tables_wider_than_a_tile(kernel_device, poisoned_empty):
    """Tables of 1,100 entries: the kernel copies a row's table in tiles of 1,024."""
    case = random_case(6, 0, 1, seed=9, device=kernel_device, table_width=1100)
    case["packed"][0, SLOT], case["packed"][0, POSITION] = 3, 1090  # a row past the first tile
    meta = poisoned_empty(decode_metadata, **case, num_positions=1, tokens=RowTokens.NEWEST)
    reference = REFERENCE_OPS.decode_metadata(**case, num_positions=1, tokens=RowTokens.NEWEST)
    assert all(torch.equal(getattr(meta, name), values) for name, values in reference._asdict().items())


@pytest.mark.parametrize("catch_up,tokens,num_positions,offset", CALLS[:3])
def test_rope_deltas_shift_positions_only(kernel_device, poisoned_empty, catch_up, tokens, num_positions, offset):
    """Each slot's RoPE shift (a prompt's images) added to its rows' positions, by the kernel as
    by the reference; the KV metadata (slot_mapping, context_lens, tables) as without it."""
    case = random_case(8, catch_up, 4, seed=41 + num_positions, device=kernel_device)
    extra = extra_ids(8, 41, kernel_device)
    deltas = torch.randint(-500, 500, (NUM_SLOTS,), generator=torch.Generator().manual_seed(42)).to(kernel_device)
    args = dict(num_positions=num_positions, tokens=tokens, extra=extra, offset=offset)
    shifted = poisoned_empty(decode_metadata, **case, **args, rope_deltas=deltas)
    reference = REFERENCE_OPS.decode_metadata(**case, **args, rope_deltas=deltas)
    plain = REFERENCE_OPS.decode_metadata(**case, **args)
    for name, values in reference._asdict().items():
        assert torch.equal(getattr(shifted, name), values), name
    slots = case["packed"][:, SLOT].repeat_interleave(num_positions)
    assert torch.equal(shifted.positions, plain.positions + deltas[slots])
    for name in ("input_ids", "slot_mapping", "context_lens", "slot_ids", "block_tables"):
        assert torch.equal(getattr(shifted, name), getattr(plain, name)), name


def test_bad_arguments_are_refused():
    case = random_case(2, 4, 16, seed=1)
    with pytest.raises(AssertionError):  # the catch-up runs all C positions
        decode_metadata(**case, num_positions=2, tokens=RowTokens.CATCH_UP)
    with pytest.raises(AssertionError):  # a verify needs its drafts
        decode_metadata(**case, num_positions=3, tokens=RowTokens.NEWEST)
    with pytest.raises(AssertionError):
        decode_metadata(**dict(case, slot_tables=case["slot_tables"].long()), num_positions=1,
                        tokens=RowTokens.NEWEST)


@pytest.mark.gpu
def test_triton_at_serving_batch():
    case = random_case(256, 4, 16, seed=3, device="cuda")
    extra = extra_ids(256, 3, "cuda")
    ours = dict(case, packed=case["packed"].clone(), slot_tables=case["slot_tables"].clone())
    meta = decode_metadata(**ours, num_positions=4, tokens=RowTokens.NEWEST, extra=extra, feed=True)
    reference = REFERENCE_OPS.decode_metadata(**case, num_positions=4, tokens=RowTokens.NEWEST, extra=extra, feed=True)
    assert torch.equal(ours["packed"], case["packed"])
    assert torch.equal(ours["slot_tables"], case["slot_tables"])
    assert all(torch.equal(getattr(meta, name), values) for name, values in reference._asdict().items())
