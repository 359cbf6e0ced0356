"""ForwardBatch.build against a per-token loop written here from its field definitions, on
random rows (decode and prefill, cached prefixes, checkpoints), the one-copy packer and the
chosen rows' index."""

import random

import numpy as np
import pytest
import torch

from deltaspec.engine.batch import BatchLayout, ForwardBatch, Padding, Row, device_arrays, row_index, spans
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


def test_row_index_selects_the_chosen_rows():
    """Every row chosen: a slice, so indexing gives views of the step's buffers (no gather);
    some rows: their indices. Either selects the same rows of a buffer with padding rows after."""
    rng = random.Random(7)
    buffer = torch.randn(12, 5)  # 9 rows of a step, 3 padding rows
    for chosen in (list(range(9)), sorted(rng.sample(range(9), 4)), [8]):
        index = row_index(chosen, 9, "cpu")
        assert isinstance(index, slice) == (len(chosen) == 9)
        assert torch.equal(buffer[index], buffer[torch.tensor(chosen)])
    assert buffer[row_index(list(range(9)), 9, "cpu")].data_ptr() == buffer.data_ptr()


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


@pytest.mark.slow
def test_a_padded_prefill_forward_changes_nothing_real(checkpoint, kernel_device):
    """The forward over prefill rows padded to a bucket (Padding: the CUDA graphs' batches)
    gives the real tokens' hidden states, the real slots' states and KV, and the checkpoint
    states of the same forward unpadded, through the Triton table (interpreted on the CPU); the
    padding writes only scratch slot 0 and scratch block 0."""
    from deltaspec.engine import LLM
    from deltaspec.engine.state_pool import KVPool, StatePool
    from fixtures import GPU_SHAPE, TRITON_TABLE_SHAPE

    path = checkpoint("qwen3_5", **TRITON_TABLE_SHAPE, **(GPU_SHAPE if kernel_device == "cuda" else {}))
    llm = LLM(path, device=kernel_device, block_size=BLOCK, kernel_backend="triton", enable_cuda_graphs=False)
    model, config, device = llm.model, llm.config, llm.core.device
    rng = random.Random(3)
    tokens = {name: [rng.randrange(0, 500) for _ in range(n)] for name, n in (("a", 70), ("b", 21))}
    tables = {"a": [3, 5, 7, 9, 11], "b": [2, 4]}
    # b has 16 tokens folded in already; a writes checkpoints after 64 and 70 tokens, b after 21.
    first = Row(tokens["b"][:16], 0, 2, tables["b"])
    rows = [Row(tokens["a"], 0, 1, tables["a"], checkpoints=((64, 4), (70, 5))),
            Row(tokens["b"][16:], 16, 2, tables["b"], checkpoints=((5, 6),))]

    @torch.inference_mode()
    def run(padding):
        states = StatePool(config, 8, 0, llm.core.dtype, device)
        kv = KVPool(model.num_kv_layers, 16, BLOCK, config.num_key_value_heads, config.head_dim, llm.core.dtype,
                    device)
        model(ForwardBatch.build([], [first], BLOCK, device), states, kv)
        layout = BatchLayout.of([], rows, BLOCK, padding)
        batch = layout.batch(device_arrays(layout.arrays, device), commit=True)
        hidden = model(batch, states, kv)
        return hidden, states, kv, batch

    hidden, states, kv, batch = run(None)
    padded_hidden, padded_states, padded_kv, padded_batch = run(Padding(128, 4, 6, 12))
    assert padded_hidden.shape[0] == 128 and padded_batch.block_tables.shape == (4, 12)
    assert torch.equal(padded_batch.logits_indices, batch.logits_indices)
    torch.testing.assert_close(padded_hidden[:75], hidden, rtol=0, atol=0)
    real_slots = [1, 2, 4, 5, 6]
    for layer, padded_layer in zip(states.layers, padded_states.layers):
        torch.testing.assert_close(padded_layer.recurrent[real_slots], layer.recurrent[real_slots], rtol=0, atol=0)
        torch.testing.assert_close(padded_layer.conv[real_slots], layer.conv[real_slots], rtol=0, atol=0)
        assert layer.recurrent[real_slots].abs().sum() > 0
    for layer, padded_layer in zip(kv.layers, padded_kv.layers):
        torch.testing.assert_close(padded_layer.k_cache[1:], layer.k_cache[1:], rtol=0, atol=0)
        torch.testing.assert_close(padded_layer.v_cache[1:], layer.v_cache[1:], rtol=0, atol=0)


@pytest.mark.parametrize("padding", [Padding(64, 2, 2, 8),      # no token left for the padding row
                                     Padding(128, 1, 2, 8),     # no padding row
                                     Padding(128, 2, 0, 8),     # the row's checkpoint has no entry
                                     Padding(128, 2, 2, 3)])    # its table is 4 blocks wide
def test_padding_refuses_what_does_not_fit(padding):
    rows = [Row([1] * 64, 0, 1, [1, 2, 3, 4], checkpoints=((64, 9),))]
    BatchLayout.of([], rows, BLOCK, Padding(128, 2, 1, 4))
    with pytest.raises(ValueError, match="do not fit"):
        BatchLayout.of([], rows, BLOCK, padding)
