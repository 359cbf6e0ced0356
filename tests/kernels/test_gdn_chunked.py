"""Chunked varlen GDN prefill (kernels/gdn_chunked.py: `gdn_chunked`): the torch reference against
the token-by-token gated delta rule in float64 (kernel_helpers.naive_gdn), then the Triton kernel
against the reference, and the reference's checkpoint output against the reference itself.

Reference: chunked varlen prefill = the token-by-token recurrence (outputs and final state), with
and without an initial state read from a permuted slot, HV = HK and HV = 2 HK; a row without an
initial state never reads its slot (it may hold NaN); slots not in the batch are bit-identical.

Triton kernel. Contracts checked (CPU: the interpreter in fp32 / fp16 at tiny K, V; GPU: bf16 at
K = V = 128):
  - ragged rows of 1, 63, 64, 65, 130 tokens (chunks of 64 from each row start), HV = 2 HK (with
    one and two key heads: value head h reads key head h // 2) and HV = HK; q, k, v and a, b as
    strided views of packed projections, as the model passes them;
  - initial states from permuted slots; rows without one start from zero and never read their
    slot (it holds NaN); slots outside the batch (scratch slot 0 included) stay bit-identical;
  - every buffer the launcher allocates starts as NaN (`torch.empty` is poisoned), so any output
    element not written, or any scratch element read before being written, shows up;
  - checkpoints: the kernel writes what the reference writes, and a reference checkpoint at p
    equals the final state of a run over only the first p tokens of its row; invalid checkpoint
    lengths are refused;
  - a bf16 state pool;
  - both paths: outputs inside the state kernel (fused) and by their own kernel from stored
    chunk states (split), forced either way;
  - `out=`: a row slice of a larger buffer is written in place, nothing outside it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels import gdn_chunked as chunked
from deltaspec.kernels.gdn_chunked import gdn_chunked
from kernel_helpers import (assert_close_elementwise, assert_slots_untouched, bits, cu_seqlens_of, naive_gdn,
                            random_gating_params)


# Through the backend table, so the tests follow the reference wherever it lives.
gdn_chunked_reference = REFERENCE_OPS.gdn_chunked


# ----------------------------------------------------------------------------------------------
# Torch reference vs the token-by-token recurrence in float64
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_key_heads,num_value_heads", [(2, 4), (2, 2)])
def test_gdn_chunked_prefill_matches_naive_recurrence(num_key_heads, num_value_heads):
    """Varlen rows across chunk boundaries (1 .. 200 tokens, CHUNK_SIZE 64), initial state read
    from permuted slots for some rows, zeros for the others (whose slots hold stale garbage)."""
    gen = torch.Generator().manual_seed(100 + num_value_heads)
    key_dim, value_dim, num_slots = 16, 12, 11
    lengths = [1, 5, 64, 65, 130, 200]
    slots = [7, 3, 9, 1, 4, 8]
    has_initial = [True, False, True, True, False, True]
    total = sum(lengths)
    q = torch.randn(total, num_key_heads, key_dim, generator=gen)
    k = torch.randn(total, num_key_heads, key_dim, generator=gen)
    v = torch.randn(total, num_value_heads, value_dim, generator=gen)
    a = torch.randn(total, num_value_heads, generator=gen)
    b = torch.randn(total, num_value_heads, generator=gen)
    A_log, dt_bias = random_gating_params(gen, num_value_heads)
    state = 0.5 * torch.randn(num_slots, num_value_heads, key_dim, value_dim, generator=gen)
    before = state.clone()

    out = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens_of(lengths),
                                torch.tensor(slots, dtype=torch.int32), torch.tensor(has_initial), state)

    assert out.shape == v.shape and out.dtype == v.dtype
    start = 0
    for length, slot, initial in zip(lengths, slots, has_initial):
        span = slice(start, start + length)
        init = before[slot] if initial else torch.zeros_like(before[slot])
        expected_out, expected_state = naive_gdn(q[span], k[span], v[span], a[span], b[span], A_log, dt_bias, init)
        assert_close_elementwise(out[span], expected_out, what=f"output of row len {length}")
        assert_close_elementwise(state[slot], expected_state, what=f"final state of slot {slot}")
        start += length
    assert_slots_untouched({"state": state}, {"state": before}, owned=set(slots))


# ----------------------------------------------------------------------------------------------
# Stale state must never be read (design: a fresh slot's "state is not read until written"). A
# previous owner that diverged can leave inf/NaN there; multiplying by 0 instead of selecting
# lets it leak into a new sequence.
# ----------------------------------------------------------------------------------------------

def test_gdn_prefill_without_initial_state_ignores_nonfinite_stale_slot():
    gen = torch.Generator().manual_seed(21)
    hk, hv, key_dim, value_dim = 2, 4, 8, 6
    q = torch.randn(5, hk, key_dim, generator=gen)
    k = torch.randn(5, hk, key_dim, generator=gen)
    v = torch.randn(5, hv, value_dim, generator=gen)
    a, b = torch.randn(5, hv, generator=gen), torch.randn(5, hv, generator=gen)
    A_log, dt_bias = random_gating_params(gen, hv)
    state = torch.full((4, hv, key_dim, value_dim), float("nan"))
    out = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens_of([5]), torch.tensor([2], dtype=torch.int32),
                                torch.tensor([False]), state)
    expected, final = naive_gdn(q, k, v, a, b, A_log, dt_bias, torch.zeros(hv, key_dim, value_dim))
    assert_close_elementwise(out, expected, what="output from a fresh (stale NaN) slot")
    assert_close_elementwise(state[2], final, what="final state from a fresh (stale NaN) slot")


# ----------------------------------------------------------------------------------------------
# Triton kernel vs the torch reference
# ----------------------------------------------------------------------------------------------

KEY_DIM, VALUE_DIM = 16, 32

LENGTHS = [1, 63, 64, 65, 130]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), "non-finite values (unwritten or read before written)"
    return float((actual - expected).norm() / expected.norm())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """Elementwise |a - e| <= rtol * (|e| + max|e|), and everything finite."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    error = (actual - expected).abs()
    bound = rtol * (expected.abs() + expected.abs().max())
    assert bool((error <= bound).all()), f"{what}: max abs error {float(error.max()):.3e} (rtol {rtol:.0e})"


@pytest.fixture
def interpreter_device(kernel_device) -> str:
    """The tiny-head tests (K = 16, V = 32) run under the interpreter only: on the GPU the state
    kernel needs V >= 64 (see _state_configs); the `gpu` tests below cover it at K = V = 128."""
    if kernel_device != "cpu":
        pytest.skip("sized for the interpreter; the gpu-marked tests cover CUDA")
    return kernel_device


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors while a kernel launcher runs."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", nan_empty)
            return fn(*args, **kwargs)

    return run


class Batch:
    """A varlen batch as the model builds it, plus a state pool of num_slots slots."""

    def __init__(self, gen: torch.Generator, device: str, lengths: list[int], num_key_heads: int,
                 num_value_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 state_dtype: torch.dtype = torch.float32, num_slots: int = 9, extra_columns: int = 1) -> None:
        self.lengths, total = lengths, sum(lengths)
        hk, hv = num_key_heads, num_value_heads
        # q | k | v packed per token (plus extra columns), then split: token stride != heads * dim.
        mixed = torch.randn(total, 2 * hk * key_dim + hv * value_dim + extra_columns, generator=gen)
        q, k, v, _ = mixed.to(device, dtype).split((hk * key_dim, hk * key_dim, hv * value_dim, extra_columns), -1)
        self.q, self.k = q.view(total, hk, key_dim), k.view(total, hk, key_dim)
        self.v = v.view(total, hv, value_dim)
        ba = torch.randn(total, 2 * hv + extra_columns, generator=gen).to(device, dtype)
        self.b, self.a = ba[:, :hv], ba[:, hv:2 * hv]
        self.A_log = (torch.rand(hv, generator=gen) * 5.0 - 4.0).to(device)   # decay rates 0.02 .. 2.7
        self.dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(device)
        self.cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(device, torch.int32)
        # Row i uses slot perm[i] (never 0, the scratch slot); rows alternate with/without a state.
        perm = (torch.randperm(num_slots - 1, generator=gen)[:len(lengths)] + 1).tolist()
        self.slots = perm
        self.slot_ids = torch.tensor(perm, dtype=torch.int32, device=device)
        self.has_initial = torch.tensor([i % 3 != 1 for i in range(len(lengths))], device=device)
        state = 0.5 * torch.randn(num_slots, hv, key_dim, value_dim, generator=gen)
        for slot, initial in zip(perm, self.has_initial.tolist()):
            if not initial:
                state[slot] = float("nan")  # a fresh slot's stale contents must never be read
        self.state = state.to(device, state_dtype)

    def args(self) -> tuple:
        return (self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, self.cu_seqlens, self.slot_ids,
                self.has_initial)

    def check_untouched(self, state: torch.Tensor) -> None:
        for slot in range(state.shape[0]):
            if slot not in self.slots:
                assert torch.equal(bits(state[slot]), bits(self.state[slot])), f"slot {slot} changed"


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("num_key_heads,num_value_heads", [(1, 2), (2, 4), (2, 2)],
                         ids=["HV=2HK", "HV=2HK-HK=2", "HV=HK"])
def test_kernel_matches_reference(interpreter_device, poisoned_empty, num_key_heads, num_value_heads, split):
    gen = torch.Generator().manual_seed(10 + num_key_heads)
    batch = Batch(gen, interpreter_device, LENGTHS, num_key_heads, num_value_heads, KEY_DIM, VALUE_DIM, torch.float32)
    state, expected_state = batch.state.clone(), batch.state.clone()

    out = poisoned_empty(gdn_chunked, *batch.args(), state, split=split)
    expected = gdn_chunked_reference(*batch.args(), expected_state)

    assert out.shape == batch.v.shape and out.dtype == batch.v.dtype
    assert_close(out, expected, 1e-4, "output")
    for slot in batch.slots:
        assert_close(state[slot], expected_state[slot], 1e-4, f"final state of slot {slot}")
    batch.check_untouched(state)


def checkpoint_plan(lengths: list[int], device: str) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Per row: every multiple of 64 inside it, plus its end for every other row."""
    plan = [list(range(64, n, 64)) + ([n] if i % 2 == 0 or n % 64 == 0 else []) for i, n in enumerate(lengths)]
    cu = torch.tensor([0] + [len(p) for p in plan]).cumsum(0).to(device, torch.int32)
    flat = torch.tensor([p for row in plan for p in row], dtype=torch.int32, device=device)
    return plan, cu, flat


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_checkpoints_match_reference_and_prefix_runs(interpreter_device, poisoned_empty, split):
    gen = torch.Generator().manual_seed(3)
    lengths = [130, 64, 65, 1, 200]
    batch = Batch(gen, interpreter_device, lengths, 1, 2, KEY_DIM, VALUE_DIM, torch.float32)
    plan, checkpoint_cu, checkpoint_lengths = checkpoint_plan(lengths, interpreter_device)
    num = checkpoint_lengths.numel()
    shape = (num,) + tuple(batch.state.shape[1:])
    checkpoints = torch.full(shape, float("nan"), device=interpreter_device)
    expected_checkpoints = torch.full(shape, float("nan"), device=interpreter_device)
    state, expected_state = batch.state.clone(), batch.state.clone()

    out = poisoned_empty(gdn_chunked, *batch.args(), state, checkpoint_cu, checkpoint_lengths, checkpoints,
                         split=split)
    expected = gdn_chunked_reference(*batch.args(), expected_state, checkpoint_cu, checkpoint_lengths,
                                     expected_checkpoints)

    assert_close(out, expected, 1e-4, "output")
    assert_close(checkpoints, expected_checkpoints, 1e-4, "checkpoints")
    batch.check_untouched(state)
    # Each reference checkpoint = the state after a run over that prefix of its row alone.
    j = 0
    for i, (n, row_plan) in enumerate(zip(lengths, plan)):
        start = int(batch.cu_seqlens[i])
        for p in row_plan:
            pool = batch.state.clone()
            span = slice(start, start + p)
            one = lambda x: x[span]
            gdn_chunked_reference(one(batch.q), one(batch.k), one(batch.v), one(batch.a), one(batch.b),
                                  batch.A_log, batch.dt_bias, batch.cu_seqlens.new_tensor([0, p]),
                                  batch.slot_ids[i:i + 1], batch.has_initial[i:i + 1], pool)
            assert_close(expected_checkpoints[j], pool[batch.slots[i]], 1e-5, f"row {i} checkpoint at {p}")
            j += 1
    assert j == num


@pytest.mark.parametrize("positions", [[70], [0], [128, 64], [192]], ids=["not-multiple", "zero", "decreasing",
                                                                           "past-end"])
def test_invalid_checkpoint_lengths_are_refused(interpreter_device, positions):
    gen = torch.Generator().manual_seed(4)
    batch = Batch(gen, interpreter_device, [130, 5], 1, 2, KEY_DIM, VALUE_DIM, torch.float32)
    checkpoint_cu = torch.tensor([0, len(positions), len(positions)], dtype=torch.int32, device=interpreter_device)
    checkpoint_lengths = torch.tensor(positions, dtype=torch.int32, device=interpreter_device)
    checkpoints = torch.empty((len(positions),) + tuple(batch.state.shape[1:]), device=interpreter_device)
    for fn in (gdn_chunked, gdn_chunked_reference):
        with pytest.raises(ValueError, match="checkpoint lengths"):
            fn(*batch.args(), batch.state.clone(), checkpoint_cu, checkpoint_lengths, checkpoints)


def test_fp16_activations_bf16_state_pool(interpreter_device, poisoned_empty):
    gen = torch.Generator().manual_seed(5)
    batch = Batch(gen, interpreter_device, [70, 3, 64], 1, 2, KEY_DIM, VALUE_DIM, torch.float16,
                  state_dtype=torch.bfloat16)
    state, expected_state = batch.state.clone(), batch.state.clone()
    out = poisoned_empty(gdn_chunked, *batch.args(), state)
    expected = gdn_chunked_reference(*batch.args(), expected_state)
    assert out.dtype == torch.float16 and state.dtype == torch.bfloat16
    assert relative_error(out, expected) < 3e-3
    for slot in batch.slots:
        assert relative_error(state[slot], expected_state[slot]) < 1e-2, f"final state of slot {slot}"
    batch.check_untouched(state)


def check_row_slice_output(batch: Batch, fn, rtol: float) -> None:
    """out= a row slice of a NaN-poisoned buffer (the prefill rows of the layer's output, which
    the decode rows precede): it holds what a fresh output holds; rows outside it stay NaN."""
    num_tokens = batch.v.shape[0]
    fp32 = [x.float() if x.is_floating_point() else x for x in batch.args()]
    expected = gdn_chunked_reference(*fp32, batch.state.clone().float())
    buffer = torch.full((num_tokens + 4, *batch.v.shape[1:]), float("nan"), dtype=batch.v.dtype,
                        device=batch.v.device)
    out = buffer[3:3 + num_tokens]
    state = batch.state.clone()
    returned = fn(*batch.args(), state, out=out)
    assert returned.data_ptr() == out.data_ptr() and returned.shape == out.shape
    assert relative_error(out, expected) < rtol
    assert buffer[:3].isnan().all() and buffer[3 + num_tokens:].isnan().all(), "rows outside out were written"
    batch.check_untouched(state)


@pytest.mark.parametrize("fn", [gdn_chunked, functools.partial(gdn_chunked, split=True), gdn_chunked_reference],
                         ids=["triton-fused", "triton-split", "reference"])
def test_writes_into_a_row_slice(interpreter_device, fn):
    gen = torch.Generator().manual_seed(7)
    batch = Batch(gen, interpreter_device, [65, 3], 1, 2, KEY_DIM, VALUE_DIM, torch.float32)
    check_row_slice_output(batch, fn, 1e-5)


# ----------------------------------------------------------------------------------------------
# GPU: bf16 activations at the model's head size against the reference in fp32

@pytest.mark.gpu
@pytest.mark.parametrize("split", [None, False, True], ids=["auto", "fused", "split"])
@pytest.mark.parametrize("num_key_heads,num_value_heads,state_dtype",
                         [(16, 32, torch.float32), (16, 16, torch.bfloat16)], ids=["HV=2HK-fp32-pool", "HV=HK-bf16-pool"])
def test_gpu_bf16_matches_fp32_reference(poisoned_empty, num_key_heads, num_value_heads, state_dtype, split):
    """The model's head shapes (those of bench/kernels_gdn.py, so compiled kernels are shared)."""
    gen = torch.Generator().manual_seed(6)
    lengths = [1, 63, 64, 65, 130, 1000, 300, 2]
    batch = Batch(gen, "cuda", lengths, num_key_heads, num_value_heads, 128, 128, torch.bfloat16,
                  state_dtype=state_dtype, num_slots=12, extra_columns=0)
    plan, checkpoint_cu, checkpoint_lengths = checkpoint_plan(lengths, "cuda")
    shape = (checkpoint_lengths.numel(),) + tuple(batch.state.shape[1:])
    checkpoints = torch.full(shape, float("nan"), device="cuda", dtype=state_dtype)
    expected_checkpoints = torch.full(shape, float("nan"), device="cuda")
    state, expected_state = batch.state.clone(), batch.state.float()

    out = poisoned_empty(gdn_chunked, *batch.args(), state, checkpoint_cu, checkpoint_lengths, checkpoints,
                         split=split)
    fp32 = [x.float() if x.is_floating_point() else x for x in batch.args()]
    expected = gdn_chunked_reference(*fp32, expected_state, checkpoint_cu, checkpoint_lengths, expected_checkpoints)

    assert out.dtype == torch.bfloat16
    for i in range(len(lengths)):
        span = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]))
        assert relative_error(out[span], expected[span]) < 2e-2, f"output of row {i} (length {lengths[i]})"
        slot = batch.slots[i]
        assert relative_error(state[slot], expected_state[slot]) < 2e-2, f"final state of row {i}"
    assert relative_error(checkpoints, expected_checkpoints) < 2e-2
    batch.check_untouched(state)


@pytest.mark.gpu
def test_gpu_writes_into_a_row_slice():
    gen = torch.Generator().manual_seed(8)
    batch = Batch(gen, "cuda", [1, 130, 64], 16, 32, 128, 128, torch.bfloat16, num_slots=6, extra_columns=0)
    check_row_slice_output(batch, gdn_chunked, 2e-2)


def test_split_output_only_for_few_programs(monkeypatch):
    """On a 132-SM GPU, one 16K row at HV = 16 (32 fused programs) takes the split path; at
    HV = 32 (64 programs) the fused path, which measured faster there."""
    monkeypatch.setattr(chunked, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert chunked.split_output(1, 16, 128, cuda)
    assert not chunked.split_output(1, 32, 128, cuda)
    assert not chunked.split_output(1, 16, 128, torch.device("cpu"))
