"""DecodeStep: the device-side block tables (a step sends only what changed, and the tables the
stages gather always equal the rows' own: growth, a slot handed to a new request, row order),
the packed row layout, fed rows derived on the device from the latest step's outputs, the decode
stages through the Triton table (the interpreter on the CPU), and on the GPU the captured steps
against the eager ones."""

import random

import pytest
import torch

from deltaspec.engine import LLM, EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore
from deltaspec.engine.decode_step import NO_APPEND, DecodeRow, DecodeRows, DecodeStep, RowTokens, pack_rows
from fixtures import GPU_SHAPE, TRITON_TABLE_SHAPE


def test_slot_tables_follow_growth_and_reuse(checkpoint):
    """Growth by one block rides in the row's packed columns and the first stage (feed) writes it;
    growth by more and a slot's new table are written before the step; every stage then gathers
    the rows' own tables."""
    core = LLM(checkpoint("qwen3_5"), num_draft_tokens=0).core
    step = DecodeStep(core.model, core.states, core.kv, 16, False, 4, 12, core.runner.sampler.table)
    rng = random.Random(0)
    tables = {slot: tuple(rng.sample(range(1, 100), 2)) for slot in (1, 2, 3)}
    first = [DecodeRow(slot, 7, 16 * len(table) - 1, table) for slot, table in tables.items()]
    assert step.sync_tables(first) == [NO_APPEND] * 3  # new slots: their whole tables, written at once
    appended = 0
    for _ in range(40):
        grew = set()  # slots with one entry to send: grown by a block, or a new one-block table
        for slot in tables:
            if rng.random() < 0.3 and len(tables[slot]) < 12:  # grows by a block
                tables[slot] = tables[slot] + (rng.randrange(1, 100),)
                grew.add(slot)
            elif rng.random() < 0.1:  # a new request in the slot: another table altogether
                tables[slot] = tuple(rng.sample(range(1, 100), rng.randint(1, 5)))
                if len(tables[slot]) == 1:
                    grew.add(slot)
            elif rng.random() < 0.1 and len(tables[slot]) < 11:  # grows by two blocks
                tables[slot] = tables[slot] + tuple(rng.sample(range(1, 100), 2))
        rows = [DecodeRow(slot, 7, 16 * len(table) - 1, table) for slot, table in tables.items()]
        rng.shuffle(rows)  # row order changes between steps
        appends = step.sync_tables(rows)
        assert [a != NO_APPEND for a in appends] == [r.slot in grew for r in rows]
        assert all(a == (len(r.block_table), r.block_table[-1]) for a, r in zip(appends, rows) if a != NO_APPEND)
        assert all(a == NO_APPEND for a in step.sync_tables(rows))  # what a step carries counts as sent
        appended += len(grew)
        packed = DecodeRows(pack_rows(rows, step.catch_up, step.block_size, len(rows) + 1, pin_memory=False,
                                      appends=appends))
        for feed in (True, False):  # the step's first stage writes the appended entries; the next reads them
            gathered = step.batch(packed, RowTokens.NEWEST, 1, feed=feed).block_tables.tolist()
            for row, table in zip(rows, gathered):
                assert table[:len(row.block_table)] == list(row.block_table)
            assert not any(gathered[-1])  # the padding row: slot 0, scratch block 0
        assert step.sync_tables(rows) == [NO_APPEND] * 3  # nothing changed since: nothing is sent
    assert appended > 10


def test_pack_rows_matches_the_rows():
    """Columns: slot, is_fed, fed_from, k_r, table column + 1 and block to append, newest,
    position, mtp_start, n_r, catch-up ids; a fed row names the previous step's row it continues;
    padding rows are all zeros."""
    rows = [DecodeRow(3, 11, 40, (1, 2, 3), 2, 37, (5, 6, 7)), DecodeRow(5, 12, 20, (4, 9), 0, 19, (8,)),
            DecodeRow(6, 0, 21, (10, 11), 3, fed_from=1)]
    packed = pack_rows(rows, 4, 16, 4, pin_memory=False, appends=[NO_APPEND, (2, 9), NO_APPEND])
    assert packed.tolist() == [[3, 0, 0, 2, 0, 0, 11, 40, 37, 3, 5, 6, 7, 0], [5, 0, 0, 0, 2, 9, 12, 20, 19, 1, 8, 0, 0, 0],
                               [6, 1, 1, 3, 0, 0, 0, 21, 0, 0, 0, 0, 0, 0], [0] * 14]


@pytest.mark.parametrize("speculative", [False, True])
def test_fed_rows_continue_the_latest_step(checkpoint, speculative):
    """A fed row takes its newest token from the row it continues; with speculation its position
    moves past that row's accepted drafts and its MTP catch-up covers the positions that row
    verified and accepted, with the tokens it emitted (an independent reading of the buffers)."""
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), max_num_seqs=4,
                                   num_draft_tokens=3 if speculative else 0))
    step = DecodeStep(core.model, core.states, core.kv, 16, speculative, 4, 12, core.runner.sampler.table)
    width = step.emitted.shape[0]
    rng = random.Random(int(speculative))
    emitted = [[rng.randrange(1, 500) for _ in range(4)] for _ in range(width)]   # [W, rows]
    accepted = [rng.randrange(width) for _ in range(4)] if speculative else [0] * 4
    positions = [rng.randrange(20, 60) for _ in range(4)]
    step.emitted.copy_(torch.tensor(emitted))
    step.accepted.copy_(torch.tensor(accepted))
    step.last_positions.copy_(torch.tensor(positions))
    table = tuple(range(1, 6))
    rows = [DecodeRow(2, 0, 70, table, 1, fed_from=3), DecodeRow(1, 7, 33, table, 2, 30, (4, 5, 6)[:step.catch_up]),
            DecodeRow(3, 0, 70, table, 0, fed_from=0)]
    packed = DecodeRows(pack_rows(rows, step.catch_up, 16, 3, pin_memory=False))
    before = packed.packed.clone()
    step.batch(packed, RowTokens.NEWEST, 1, feed=True)
    assert torch.equal(packed.packed[1], before[1])  # not fed: untouched
    for i, source in ((0, 3), (2, 0)):
        a = accepted[source]
        assert packed.newest[i] == emitted[a][source]
        assert packed.slots[i] == rows[i].slot and packed.num_drafts[i] == rows[i].num_drafts
        if speculative:
            assert packed.positions[i] == positions[source] + a + 1
            assert packed.mtp_start[i] == positions[source] and packed.num_catch_up[i] == a + 1
            assert packed.catch_up_ids[i, :a + 1].tolist() == [emitted[d][source] for d in range(a + 1)]
        else:
            assert packed.positions[i] == 70  # the host knows a plain row's position


# One GDN layer of two value heads and one attention layer: the interpreter runs every kernel.


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked tests run the Triton table")
@pytest.mark.parametrize("num_draft_tokens", [0, 2])
def test_decode_steps_through_the_triton_table(checkpoint, num_draft_tokens):
    """The decode stages through the engine's Triton table (interpreted): its metadata kernel
    (fed rows of steps launched ahead, the catch-up, chain and verify batches), greedy kernel
    (writing the step's output buffers) and, in the sampled steps a sampled row makes, sampling
    kernel (DecodeStep.draw) give the torch table's tokens, plain and speculative."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **TRITON_TABLE_SHAPE)
    prompts = [[random.Random(n).randrange(500) for _ in range(n)] for n in (3, 20)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=3, ignore_eos=True)]
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, kernel_backend=backend, num_draft_tokens=num_draft_tokens, adaptive_draft_length=False)
        assert llm.core.ops.name == backend
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("num_draft_tokens", [0, 3])
def test_batch_one_graph_steps_equal_eager_steps_bit_for_bit(checkpoint, num_draft_tokens):
    """bf16 at batch 1 (graph bucket 1: the eager step's very shapes): the captured decode steps
    (plain, or speculative) give the eager steps' tokens and log-probabilities exactly."""
    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True, **GPU_SHAPE)
    prompt = [random.Random(1).randrange(500) for _ in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = []
    for graphs in (True, False):
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=4, num_draft_tokens=num_draft_tokens,
                  adaptive_draft_length=False, enable_cuda_graphs=graphs)
        assert (llm.core.runner.graphs is not None) == graphs
        [output] = llm.generate([prompt], params)
        outputs.append((output.token_ids, output.logprobs))
    assert outputs[0] == outputs[1]
