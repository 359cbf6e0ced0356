"""DecodeStep's device-side block tables: a step sends only what changed, and the tables the
stages gather always equal the rows' own (growth, a slot handed to a new request, row order)."""

import random

from deltaspec.engine import LLM
from deltaspec.engine.decode_step import DecodeRow, DecodeRows, DecodeStep, pack_rows


def test_slot_tables_follow_growth_and_reuse(checkpoint):
    core = LLM(checkpoint("qwen3_5")).core
    step = DecodeStep(core.model, core.states, core.kv, 16, False, 4, 12)
    rng = random.Random(0)
    tables = {slot: tuple(rng.sample(range(1, 100), 2)) for slot in (1, 2, 3)}
    first = [DecodeRow(slot, 7, 16 * len(table) - 1, table) for slot, table in tables.items()]
    assert step.sync_tables(first) == 6  # new slots: their whole tables
    sent = []
    for _ in range(40):
        changed = 0
        for slot in tables:
            if rng.random() < 0.3 and len(tables[slot]) < 12:  # grows by a block
                tables[slot] = tables[slot] + (rng.randrange(1, 100),)
                changed += 1
            elif rng.random() < 0.1:  # a new request in the slot: another table altogether
                tables[slot] = tuple(rng.sample(range(1, 100), rng.randint(1, 5)))
                changed += len(tables[slot])
        rows = [DecodeRow(slot, 7, 16 * len(table) - 1, table) for slot, table in tables.items()]
        rng.shuffle(rows)  # row order changes between steps
        sent.append(step.sync_tables(rows))
        assert sent[-1] <= changed  # growth sends the new entry only
        packed = pack_rows(rows, step.catch_up, step.block_size, len(rows) + 1, pin_memory=False)
        gathered = step.tables(DecodeRows(packed)).tolist()
        for row, table in zip(rows, gathered):
            assert table[:len(row.block_table)] == list(row.block_table)
        assert not any(gathered[-1])  # the padding row: slot 0, scratch block 0
        assert step.sync_tables(rows) == 0  # nothing changed since: nothing is sent
    assert 0 < sum(sent) < 40 * 3


def test_pack_rows_matches_the_rows():
    """Columns: slot, newest, is_fed, fed_from, position, k_r, mtp_start, n_r, catch-up ids; a fed
    row names the previous step's row whose token it takes; padding rows are all zeros."""
    rows = [DecodeRow(3, 11, 40, (1, 2, 3), 2, 37, (5, 6, 7)), DecodeRow(5, 12, 20, (4, 9), 0, 19, (8,)),
            DecodeRow(6, 0, 21, (10, 11), fed_from=1)]
    packed = pack_rows(rows, 4, 16, 4, pin_memory=False)
    assert packed.tolist() == [[3, 11, 0, 0, 40, 2, 37, 3, 5, 6, 7, 0], [5, 12, 0, 0, 20, 0, 19, 1, 8, 0, 0, 0],
                               [6, 0, 1, 1, 21, 0, 0, 0, 0, 0, 0, 0], [0] * 12]
