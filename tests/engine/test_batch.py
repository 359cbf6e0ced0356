"""ForwardBatch.build against a per-token loop written here from its field definitions, on
random rows (decode and prefill, cached prefixes, checkpoints), and the one-copy packer."""

import random

import numpy as np
import pytest
import torch

from deltaspec.engine.batch import ForwardBatch, Row, device_arrays, spans
from deltaspec.kernels.gdn_chunked import CHUNK_SIZE

BLOCK = 16


def random_row(rng: random.Random, slot: int, decode: bool) -> Row:
    start = rng.randrange(0, 300)
    length = rng.randrange(1, 5) if decode else rng.randrange(1, 3 * CHUNK_SIZE + 7)
    blocks = -(-(start + length) // BLOCK) + rng.randrange(0, 3)       # tables may run past the row
    table = rng.sample(range(1, 500), blocks)
    checkpoints = ()
    if not decode:
        candidates = [n for n in range(CHUNK_SIZE, length, CHUNK_SIZE)] + [length]
        chosen = sorted(rng.sample(candidates, rng.randrange(0, len(candidates) + 1)))
        checkpoints = tuple((n, 600 + slot * 8 + j) for j, n in enumerate(chosen))
    return Row([rng.randrange(0, 1000) for _ in range(length)], start, slot, table,
               num_logits=rng.randrange(0, length + 1), checkpoints=checkpoints)


def reference(decode_rows, prefill_rows):
    """Every field, a token or a row at a time."""
    rows = [*decode_rows, *prefill_rows]
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r.token_ids))
    ids, positions, slot_mapping, logits = [], [], [], []
    for r, start in zip(rows, offsets):
        for j, token in enumerate(r.token_ids):
            p = r.start_position + j
            ids.append(token)
            positions.append(p)
            slot_mapping.append(r.block_table[p // BLOCK] * BLOCK + p % BLOCK)
            if j >= len(r.token_ids) - r.num_logits:
                logits.append(start + j)
    width = max(len(r.block_table) for r in rows)
    nd = len(decode_rows)
    base = offsets[nd]
    owners = [(i, n, s) for i, r in enumerate(prefill_rows) for n, s in r.checkpoints]
    return dict(
        input_ids=ids, positions=positions, cu_seqlens=offsets,
        context_lens=[r.start_position + len(r.token_ids) for r in rows],
        block_tables=[list(r.block_table) + [0] * (width - len(r.block_table)) for r in rows],
        slot_mapping=slot_mapping, logits_indices=logits,
        decode=(0, base, offsets[:nd + 1], [r.slot for r in decode_rows], [r.start_position > 0 for r in decode_rows]),
        prefill=(base, offsets[-1], [o - base for o in offsets[nd:]], [r.slot for r in prefill_rows],
                 [r.start_position > 0 for r in prefill_rows]),
        checkpoints=None if not owners else dict(
            cu=[sum(len(r.checkpoints) for r in prefill_rows[:i]) for i in range(len(prefill_rows) + 1)],
            lengths=[n for _, n, _ in owners], slots=[s for _, _, s in owners],
            last_token=[offsets[nd + i] - base + n - 1 for i, n, _ in owners],
            row_start=[offsets[nd + i] - base for i, _, _ in owners],
            row_slot=[prefill_rows[i].slot for i, _, _ in owners]))


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_a_per_token_loop(seed):
    rng = random.Random(seed)
    slots = iter(rng.sample(range(1, 64), 24))
    decode_rows = [random_row(rng, next(slots), True) for _ in range(rng.randrange(0, 6))]
    prefill_rows = [random_row(rng, next(slots), False) for _ in range(rng.randrange(0 if decode_rows else 1, 6))]
    batch = ForwardBatch.build(decode_rows, prefill_rows, BLOCK, "cpu", commit=seed % 2 == 0)
    want = reference(decode_rows, prefill_rows)
    for name, dtype in (("input_ids", torch.int64), ("positions", torch.int64), ("cu_seqlens", torch.int32),
                        ("context_lens", torch.int32), ("block_tables", torch.int32), ("slot_mapping", torch.int64),
                        ("logits_indices", torch.int64)):
        got = getattr(batch, name)
        assert got.dtype == dtype and got.tolist() == want[name], name
    for group, (token_start, token_end, cu, slot_ids, initial) in ((batch.decode, want["decode"]),
                                                                   (batch.prefill, want["prefill"])):
        assert (group.token_start, group.token_end) == (token_start, token_end)
        assert group.cu_seqlens.dtype == torch.int32 and group.cu_seqlens.tolist() == cu
        assert group.slot_ids.dtype == torch.int32 and group.slot_ids.tolist() == slot_ids
        assert group.has_initial_state.dtype == torch.bool and group.has_initial_state.tolist() == initial
    assert batch.commit == (seed % 2 == 0)
    if want["checkpoints"] is None:
        assert batch.checkpoints is None
    else:
        for name, values in want["checkpoints"].items():
            assert getattr(batch.checkpoints, name).tolist() == values, name


def test_build_refuses_a_short_block_table():
    with pytest.raises(ValueError, match="block table of slot 3 covers 16 tokens, row needs 17"):
        ForwardBatch.build([], [Row([1] * 2, 15, 3, [5])], BLOCK, "cpu")


def test_spans():
    rng = np.random.default_rng(0)
    starts, counts = rng.integers(-50, 50, 20), rng.integers(0, 6, 20)
    want = [s + j for s, c in zip(starts, counts) for j in range(c)]
    assert spans(starts, counts).tolist() == want
    assert spans([], []).tolist() == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_arrays_round_trip(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    rng = np.random.default_rng(1)
    arrays = dict(a=rng.integers(-2**40, 2**40, 7), b=rng.integers(-9, 9, (3, 5)).astype(np.int32),
                  c=rng.random(3) > 0.5, d=np.zeros(0, dtype=np.int32), e=rng.random(5).astype(np.float32))
    got = device_arrays(arrays, device)
    for name, a in arrays.items():
        t = got[name]
        assert t.device.type == device and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a), name
        assert a.size == 0 or t.data_ptr() % 16 == 0, f"{name}: kernels are specialized on 16-byte alignment"
