"""Causal conv1d prefill and decode (kernels/conv1d.py): the prefill reference against per-row
F.conv1d in float64, then the Triton kernels against the references. (The decode reference is
checked against float64 truth by the deferred-commit tests of test_gdn_decode.py, as part of a
GDN layer.)

Reference. Contracts checked: causal conv1d prefill = F.conv1d over (initial window ++ row),
final window = last W-1 inputs; a row without an initial state never reads its slot (it may hold
inf); slots not in the batch are bit-identical.

Triton kernels, with the references as the oracle. Inputs are fresh seeded random draws; x is
the model's mixed q|k|v rows, a strided view of a wider projection output; every pool slot a
batch does not own holds finite garbage and must stay bit-identical. Decode batches are ragged
(1 to P+1 new tokens per row over 0..P pending columns, NaN past the count; P = 0 for plain
decode), slots permuted, pad rows on scratch slot 0; a sequence of verify steps with acceptance
and a commit step follows the reference. The `out=` views the GDN layer passes (row slices of its
step buffer, also column-strided) are written in place by kernels and references alike, and
nothing outside them is; channels must have unit stride.

CPU: the interpreter, fp32. GPU (`gpu` marker): bf16 at the real conv width (8192 channels), a
long prefill row.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels import conv1d
from deltaspec.kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernel_helpers import (PAD_SLOT, RAGGED, TOLERANCE, assert_close, assert_close_elementwise,
                            assert_slots_untouched, bits, clone, conv_pool, cu_seqlens_of, naive_conv,
                            run_conv_decode)


# Through the backend table, so the tests follow the references wherever they live.
causal_conv1d_prefill_reference = REFERENCE_OPS.causal_conv1d_prefill
causal_conv1d_decode_reference = REFERENCE_OPS.causal_conv1d_decode


# ----------------------------------------------------------------------------------------------
# Torch reference vs F.conv1d in float64
# ----------------------------------------------------------------------------------------------

def test_conv1d_prefill_matches_f_conv1d():
    """Per row: silu(F.conv1d(initial window ++ row)); the final window is the last W-1 inputs of
    (initial ++ row), which for rows shorter than W-1 still holds initial-state columns."""
    gen = torch.Generator().manual_seed(3)
    channels, width, num_slots = 10, 4, 9
    lengths = [1, 2, 3, 7, 20, 1, 2]
    slots = [5, 2, 8, 1, 6, 3, 7]
    has_initial = [True, True, True, False, True, False, False]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    conv_state = torch.randn(num_slots, width - 1, channels, generator=gen)
    before = conv_state.clone()

    out = causal_conv1d_prefill_reference(x, weight, cu_seqlens_of(lengths), torch.tensor(slots, dtype=torch.int32),
                                          torch.tensor(has_initial), conv_state)

    start = 0
    for length, slot, initial in zip(lengths, slots, has_initial):
        rows = x[start:start + length]
        window = before[slot] if initial else torch.zeros(width - 1, channels)
        sequence = torch.cat([window, rows])
        assert_close_elementwise(out[start:start + length], naive_conv(sequence, weight), what=f"row len {length}")
        assert torch.equal(conv_state[slot], sequence[-(width - 1):]), f"final window of slot {slot}"
        start += length
    assert_slots_untouched({"conv": conv_state}, {"conv": before}, owned=set(slots))


# ----------------------------------------------------------------------------------------------
# Stale state must never be read (design: a fresh slot's "state is not read until written"). A
# previous owner that diverged can leave inf/NaN there; multiplying by 0 instead of selecting
# lets it leak into a new sequence.
# ----------------------------------------------------------------------------------------------

def test_conv_prefill_without_initial_state_ignores_nonfinite_stale_slot():
    gen = torch.Generator().manual_seed(22)
    channels, width = 6, 4
    x = torch.randn(3, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    conv_state = torch.full((4, width - 1, channels), float("inf"))
    out = causal_conv1d_prefill_reference(x, weight, cu_seqlens_of([3]), torch.tensor([1], dtype=torch.int32),
                                          torch.tensor([False]), conv_state)
    sequence = torch.cat([torch.zeros(width - 1, channels), x])
    assert_close_elementwise(out, naive_conv(sequence, weight), what="output from a fresh (stale inf) slot")
    assert torch.equal(conv_state[1], sequence[-(width - 1):])


# ----------------------------------------------------------------------------------------------
# Triton kernels vs the torch references
# ----------------------------------------------------------------------------------------------

def conv_inputs(gen: torch.Generator, num_tokens: int, channels: int, dtype, device):
    """x as the model's mixed q|k|v rows: a strided view of a wider projection output."""
    wide = torch.randn(num_tokens, channels + 5, generator=gen).to(dtype).to(device)
    return wide[:, 2:2 + channels]


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("channels", [24, 160])
def test_conv1d_prefill(kernel_device, channels, splits, monkeypatch):
    """Rows shorter than, equal to and longer than W-1 and than a token block (16 under the
    interpreter), with and without an initial window (the stale window of a fresh row is NaN);
    programs along a row's tokens: one looping over its blocks, two, or more than the longest
    row has blocks (3)."""
    monkeypatch.setattr(conv1d, "prefill_splits", lambda num_tokens, num_rows, block_t: splits)
    gen = torch.Generator().manual_seed(channels)
    width, num_slots = 4, 9
    lengths = [1, 2, 3, 5, 40, 1, 17]
    slots = [5, 2, 8, 1, 6, 3, 7]
    has_initial = [True, False, True, True, False, True, False]
    x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    conv_state = torch.randn(num_slots, width - 1, channels, generator=gen).to(kernel_device)
    for slot, initial in zip(slots, has_initial):
        if not initial:
            conv_state[slot] = float("nan")
    before = conv_state.clone()
    args = (cu_seqlens_of(lengths, kernel_device), torch.tensor(slots, dtype=torch.int32, device=kernel_device),
            torch.tensor(has_initial, device=kernel_device))
    expected_state, actual_state = conv_state.clone(), conv_state.clone()
    expected = causal_conv1d_prefill_reference(x, weight, *args, expected_state)
    actual = causal_conv1d_prefill(x, weight, *args, actual_state)
    assert_close(actual, expected, TOLERANCE[torch.float32], "output")
    assert torch.equal(actual_state[slots], expected_state[slots]), "final windows"
    assert_slots_untouched({"conv": actual_state}, {"conv": before}, owned=set(slots))


def check_conv_step(pool, x, weight, lengths: list[int], slots: list[int], commit: bool, rtol: float) -> None:
    """One call, kernel vs reference on copies of the pool: outputs of the new tokens and of the
    pending tokens (step buffer, first p entries) of real rows, windows and pending columns of
    real slots bit for bit, every other slot untouched."""
    before = clone(pool)
    expected_pool, actual_pool = clone(pool), clone(pool)
    expected, expected_pending = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
    actual, actual_pending = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
    start = 0
    for row, (length, slot) in enumerate(zip(lengths, slots)):
        if slot != PAD_SLOT:
            span = slice(start, start + length)
            assert_close(actual[span], expected[span], rtol, f"output of slot {slot}")
            count = int(before["pending_counts"][slot])
            assert_close(actual_pending[row, :count], expected_pending[row, :count], rtol, f"pending of slot {slot}")
            assert torch.equal(actual_pool["conv"][slot], expected_pool["conv"][slot]), f"window of slot {slot}"
            assert torch.equal(bits(actual_pool["pending_conv"][slot]), bits(expected_pool["pending_conv"][slot]))
        start += length
    assert_slots_untouched(actual_pool, before, owned=set(slots))


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "verify"])
def test_conv1d_decode_ragged_batch(kernel_device, commit):
    """1..P+1 new tokens per row over 0..P pending columns (NaN past the count), pad rows on slot 0."""
    gen = torch.Generator().manual_seed(70)
    channels, width, max_pending, num_slots = 40, 4, 4, 10
    pool = conv_pool(gen, num_slots, max_pending, channels, width, kernel_device)
    for _, slot, count in RAGGED:
        if count is not None:
            pool["pending_counts"][slot] = count
            pool["pending_conv"][slot, count:] = float("nan")
    lengths, slots = [n for n, _, _ in RAGGED], [s for _, s, _ in RAGGED]
    x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    check_conv_step(pool, x, weight, lengths, slots, commit, TOLERANCE[torch.float32])


def test_conv1d_plain_decode_without_pending_buffers(kernel_device):
    """P = 0 (no speculation): empty pending buffers, one token per row, commit."""
    gen = torch.Generator().manual_seed(72)
    pool = conv_pool(gen, 6, 0, 40, 4, kernel_device)
    x = conv_inputs(gen, 4, 40, torch.float32, kernel_device)
    weight = torch.randn(40, 4, generator=gen).to(kernel_device)
    check_conv_step(pool, x, weight, [1, 1, 1, 1], [4, 1, 3, PAD_SLOT], True, TOLERANCE[torch.float32])


def test_conv1d_decode_verify_rollback_sequence(kernel_device):
    gen = torch.Generator().manual_seed(71)
    channels, width, max_pending = 24, 4, 3
    pool = conv_pool(gen, 8, max_pending, channels, width, kernel_device)
    lengths, slots = [4, 1, 3], [6, 2, 5]
    pool["pending_counts"][slots] = 0
    weight = torch.randn(channels, width, generator=gen).to(kernel_device)
    expected_pool, actual_pool = clone(pool), clone(pool)
    for step, counts in enumerate([[3, 0, 0], [0, 0, 2], [1, 0, 2], None]):  # accepted drafts
        x = conv_inputs(gen, sum(lengths), channels, torch.float32, kernel_device)
        commit = counts is None
        expected, _ = run_conv_decode(False, x, weight, lengths, slots, expected_pool, commit)
        actual, _ = run_conv_decode(True, x, weight, lengths, slots, actual_pool, commit)
        assert_close(actual, expected, TOLERANCE[torch.float32], f"step {step}")
        for pool_ in (expected_pool, actual_pool):
            pool_["pending_counts"][slots] = torch.tensor(counts or [0, 0, 0], dtype=torch.int32,
                                                          device=kernel_device)
    assert torch.equal(actual_pool["conv"][slots], expected_pool["conv"][slots])


def check_conv_layer_buffers(kernel: bool, channels: int, dtype: torch.dtype, device: str, rtol: float) -> None:
    """The conv as the GDN layer drives it: x is the q|k|v column view of one projection output
    (row stride C + 9), decode rows (verify, pending 0..P) first and prefill rows after, each
    group writing its rows of one NaN-poisoned buffer through out= (itself a strided view: the
    buffer is wider than C). Outputs and windows equal the reference's fresh outputs; rows and
    columns outside the view stay NaN."""
    gen = torch.Generator().manual_seed(73 + channels)
    width, max_pending = 4, 4
    pool = conv_pool(gen, 10, max_pending, channels, width, device)
    pool = {name: t.to(dtype) if t.is_floating_point() else t for name, t in pool.items()}
    decode_lengths, decode_slots, counts = [1, 5, 3], [5, 2, 8], [0, 4, 2]
    prefill_lengths, prefill_slots, has_initial = [7, 1, 20], [3, 9, 6], [True, False, True]
    pool["pending_counts"][decode_slots] = torch.tensor(counts, dtype=torch.int32, device=device)
    num_decode, num_prefill = sum(decode_lengths), sum(prefill_lengths)
    num_tokens = num_decode + num_prefill
    projection = torch.randn(num_tokens, channels + 9, generator=gen).to(dtype).to(device)
    mixed = projection[:, :channels]                               # the q|k|v columns; z, b, a follow
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(device)
    ids = lambda slots: torch.tensor(slots, dtype=torch.int32, device=device)  # noqa: E731
    decode_args = (cu_seqlens_of(decode_lengths, device), ids(decode_slots))
    prefill_args = (cu_seqlens_of(prefill_lengths, device), ids(prefill_slots),
                    torch.tensor(has_initial, device=device))

    expected_pool, actual_pool = clone(pool), clone(pool)
    expected_decode, expected_pending = causal_conv1d_decode_reference(
        mixed[:num_decode], weight, *decode_args, expected_pool["conv"], expected_pool["pending_conv"],
        expected_pool["pending_counts"], False)
    expected_prefill = causal_conv1d_prefill_reference(mixed[num_decode:], weight, *prefill_args, expected_pool["conv"])

    buffer = torch.full((num_tokens + 3, channels + 2), float("nan"), dtype=dtype, device=device)
    conv_out = buffer[1:1 + num_tokens, 1:1 + channels]
    decode = causal_conv1d_decode if kernel else causal_conv1d_decode_reference
    prefill = causal_conv1d_prefill if kernel else causal_conv1d_prefill_reference
    returned, pending = decode(mixed[:num_decode], weight, *decode_args, actual_pool["conv"],
                               actual_pool["pending_conv"], actual_pool["pending_counts"], False,
                               out=conv_out[:num_decode])
    assert returned.data_ptr() == conv_out.data_ptr() and returned.shape == (num_decode, channels)
    returned = prefill(mixed[num_decode:], weight, *prefill_args, actual_pool["conv"], out=conv_out[num_decode:])
    assert returned.data_ptr() == conv_out[num_decode:].data_ptr() and returned.shape == (num_prefill, channels)

    assert_close(conv_out[:num_decode], expected_decode, rtol, "decode rows")
    assert_close(conv_out[num_decode:], expected_prefill, rtol, "prefill rows")
    for row, count in enumerate(counts):
        assert_close(pending[row, :count], expected_pending[row, :count], rtol, f"pending outputs of row {row}")
    for slot in decode_slots + prefill_slots:
        assert torch.equal(actual_pool["conv"][slot], expected_pool["conv"][slot]), f"window of slot {slot}"
    outside = torch.ones(buffer.shape, dtype=torch.bool, device=device)
    outside[1:1 + num_tokens, 1:1 + channels] = False
    assert buffer[outside].isnan().all(), "the launchers wrote outside out"


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "reference"])
def test_conv1d_strided_inputs_write_into_out_views(kernel_device, kernel):
    check_conv_layer_buffers(kernel, 40, torch.float32, kernel_device, TOLERANCE[torch.float32])


def test_conv1d_launchers_check_channel_strides(kernel_device):
    """Rows may be strided, channels may not (the kernels load a channel tile as one vector)."""
    gen = torch.Generator().manual_seed(74)
    pool = conv_pool(gen, 4, 2, 16, 4, kernel_device)
    weight = torch.randn(16, 4, generator=gen).to(kernel_device)
    x = torch.randn(16, 3, generator=gen).to(kernel_device).t()          # [3, 16], channel stride 3
    good = conv_inputs(gen, 3, 16, torch.float32, kernel_device)
    args = (cu_seqlens_of([3], kernel_device), torch.tensor([1], dtype=torch.int32, device=kernel_device))
    flags = torch.tensor([False], device=kernel_device)
    with pytest.raises(AssertionError):
        causal_conv1d_prefill(x, weight, *args, flags, pool["conv"])
    with pytest.raises(AssertionError, match="unit channel stride"):
        causal_conv1d_prefill(good, weight, *args, flags, pool["conv"], out=torch.empty_like(x))
    with pytest.raises(AssertionError):
        causal_conv1d_decode(x, weight, *args, pool["conv"], pool["pending_conv"], pool["pending_counts"], False)


@pytest.mark.gpu
def test_conv1d_gpu_bf16():
    """The real conv width (2 x 16 x 128 + 32 x 128 channels), a long prefill row, bf16."""
    gen = torch.Generator().manual_seed(80)
    channels, width, max_pending = 8192, 4, 4
    lengths, slots, has_initial = [1, 3, 1000, 70], [3, 1, 7, 5], [True, False, True, True]
    x = conv_inputs(gen, sum(lengths), channels, torch.bfloat16, "cuda")
    weight = torch.randn(channels, width, generator=gen).to(torch.bfloat16).cuda()
    pool = conv_pool(gen, 9, max_pending, channels, width, "cuda")
    pool = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in pool.items()}
    args = (cu_seqlens_of(lengths, "cuda"), torch.tensor(slots, dtype=torch.int32, device="cuda"),
            torch.tensor(has_initial, device="cuda"))
    expected_state, actual_state = pool["conv"].clone(), pool["conv"].clone()
    expected = causal_conv1d_prefill_reference(x, weight, *args, expected_state)
    actual = causal_conv1d_prefill(x, weight, *args, actual_state)
    assert_close(actual, expected, TOLERANCE[torch.bfloat16], "prefill output")
    assert torch.equal(actual_state, expected_state)
    for commit in (True, False):
        lengths, slots = [1, 5, 2, 1], [3, 1, 7, PAD_SLOT]
        x = conv_inputs(gen, sum(lengths), channels, torch.bfloat16, "cuda")
        check_conv_step(pool, x, weight, lengths, slots, commit, TOLERANCE[torch.bfloat16])
    check_conv_layer_buffers(True, channels, torch.bfloat16, "cuda", TOLERANCE[torch.bfloat16])
