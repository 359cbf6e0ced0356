"""all_reduce_rms_norm (kernels/all_reduce_norm.py) on one device: every rank's run simulated
in turn, its peers' rows already in their buffers (no signal pads: no barrier).

Reference: against a sum written here (float32, in rank order, rounded once to the dtype) and a
float64 norm. Kernel: against the reference on fresh random inputs (fp32 and fp16; bf16 on the
GPU only, as the interpreter truncates to bf16), strided rows, more rows than programs, widths
that are not powers of two, 2 and 4 ranks: each rank copies its x into its own buffer, the new
residual equals the reference's bit for bit, and every rank computes the same bits. The barrier
(inline PTX) is compiled by tests/kernels/test_compile.py and runs in
tests/engine/test_symmetric_all_reduce.py on two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.all_reduce_norm import all_reduce_rms_norm, all_reduce_rms_norm_reference
from kernel_helpers import TOLERANCE, assert_close, assert_close_elementwise, naive_rms


def partial_sums(device: str, dtype: torch.dtype, world_size: int, tokens: int, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = (2 * torch.randn(world_size, tokens, hidden + 8, generator=gen)).to(dtype).to(device)
    partials = wide[..., 8:]  # each rank's x: a strided row view
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return partials, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_reference_sums_in_rank_order_then_norms(dtype, with_residual):
    partials, residual, weight = partial_sums("cpu", dtype, 3, 4, 24, seed=1)
    residual = residual if with_residual else None
    normed, new_residual = all_reduce_rms_norm_reference(partials, weight, 1e-6, residual)
    summed = ((partials[0].float() + partials[1].float()) + partials[2].float()).to(dtype)
    if with_residual:
        summed = (summed.float() + residual.float()).to(dtype)
    assert torch.equal(new_residual, summed)
    w = weight.double().tolist()
    for t in range(summed.shape[0]):
        row = summed[t].double().tolist()
        r = naive_rms(row, 1e-6)
        expected = torch.tensor([v * r * (1.0 + w[i]) for i, v in enumerate(row)], dtype=torch.float64)
        assert_close_elementwise(normed[t], expected, 1e-5 if dtype == torch.float32 else 1e-2, f"token {t}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size, tokens, hidden, num_slots", [
    (2, 1, 64, 8),     # a decode row
    (2, 5, 40, 2),     # more rows than programs (pad slots); a width that is not a power of two
    (4, 3, 96, 3),     # four ranks: the rank order of the float32 sum matters
])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_every_rank_gets_the_reference(kernel_device, dtype, world_size, tokens, hidden, num_slots,
                                       with_residual):
    if dtype == torch.bfloat16 and kernel_device == "cpu":
        pytest.skip("the interpreter rounds float32 to bfloat16 by truncation")
    partials, residual, weight = partial_sums(kernel_device, dtype, world_size, tokens, hidden,
                                              seed=world_size * 100 + tokens)
    residual = residual if with_residual else None
    expected, expected_residual = all_reduce_rms_norm_reference(partials, weight, 1e-6, residual)
    capacity = tokens * hidden + hidden  # room for one more row than this message
    results = []
    for rank in range(world_size):
        buffers = torch.full((world_size, capacity), float("nan"), dtype=dtype, device=kernel_device)
        for peer in range(world_size):
            if peer != rank:  # what the peers copied before the barrier
                buffers[peer, :tokens * hidden] = partials[peer].reshape(-1)
        addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=kernel_device)
        normed, new_residual = all_reduce_rms_norm(partials[rank], weight, 1e-6, residual, addresses, None, rank,
                                                   capacity, num_slots)
        assert torch.equal(buffers[rank, :tokens * hidden].view(tokens, hidden), partials[rank]), \
            f"rank {rank} copies its x into its own buffer"
        assert torch.equal(new_residual, expected_residual), f"rank {rank}: the sum (+ residual) in x's dtype"
        assert_close(normed, expected, TOLERANCE.get(dtype, 2e-3), f"rank {rank} normed")
        results.append(normed)
    assert all(torch.equal(r, results[0]) for r in results), "every rank computes the same bits"


def test_arguments_are_checked():
    x, weight = torch.zeros(2, 8), torch.zeros(8)
    addresses = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(AssertionError, match="elements"):
        all_reduce_rms_norm(x, weight, 1e-6, None, addresses, None, 0, 15, 4)       # past the capacity
    with pytest.raises(AssertionError, match="16-byte"):
        all_reduce_rms_norm(torch.zeros(2, 6), torch.zeros(6), 1e-6, None, addresses, None, 0, 64, 4)
    with pytest.raises(AssertionError, match="residual"):
        all_reduce_rms_norm(x, weight, 1e-6, torch.zeros(2, 8, dtype=torch.float64), addresses, None, 0, 64, 4)
    with pytest.raises(AssertionError, match="rank"):
        all_reduce_rms_norm(x, weight, 1e-6, None, addresses, None, 2, 64, 4)
    with pytest.raises(AssertionError, match="signal_pads"):
        all_reduce_rms_norm(x, weight, 1e-6, None, addresses, torch.zeros(3, dtype=torch.int64), 0, 64, 4)
