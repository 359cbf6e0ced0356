"""The counter-based noise of sampling (kernels/noise.py): `uniform_noise`,
the torch side, against statistics computed here, and the Triton side (`row_hash_tl`,
`uniform_tl`) against it.

Contracts checked: u(seed, offset, v) does not depend on other rows or on the vocabulary size;
values lie strictly in (0, 1) (never exactly 1.0, a case found by search) with a flat histogram
(chi-square, p = 0.001) and no lag-1 correlation; the Triton helpers give bit-identical noise
(CPU: the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaspec.kernels.noise import row_hash_tl, uniform_noise, uniform_tl
from kernel_helpers import CHI2_CRITICAL_P001, U_ONE_OFFSET, U_ONE_SEED, U_ONE_TOKEN, U_ONE_VOCAB


# ----------------------------------------------------------------------------------------------
# uniform_noise vs statistics
# ----------------------------------------------------------------------------------------------

def test_uniform_noise_is_per_row_per_token_and_uniform():
    """u(seed, offset, v) does not depend on other rows or on the vocabulary size; values lie
    strictly in (0, 1) with a flat histogram (chi-square, 16 bins, p = 0.001)."""
    gen = torch.Generator().manual_seed(4)
    seeds = torch.randint(-2**62, 2**62, (256,), generator=gen)
    offsets = torch.randint(0, 2**40, (256,), generator=gen)
    u = uniform_noise(seeds, offsets, 1024)
    assert u.dtype == torch.float32 and u.shape == (256, 1024)
    assert torch.equal(uniform_noise(seeds[7:8], offsets[7:8], 1024), u[7:8])
    assert torch.equal(uniform_noise(seeds, offsets, 100), u[:, :100])
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 3e-3
    counts = torch.histc(u.double(), bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < CHI2_CRITICAL_P001[15], f"histogram chi-square {stat:.1f}"
    flat = u.double().flatten()
    lag1 = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]
    assert abs(float(lag1)) < 0.01


def test_uniform_noise_never_reaches_one():
    u = uniform_noise(torch.tensor([U_ONE_SEED]), torch.tensor([U_ONE_OFFSET]), U_ONE_VOCAB)
    assert float(u[0, U_ONE_TOKEN]) < 1.0, "uniform_noise returned exactly 1.0"


# ----------------------------------------------------------------------------------------------
# Triton noise vs uniform_noise
# ----------------------------------------------------------------------------------------------

@triton.jit
def _noise_kernel(seeds, offsets, out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    v = tl.arange(0, BLOCK)
    u = uniform_tl(row_hash_tl(tl.load(seeds + row), tl.load(offsets + row)), v)
    tl.store(out + row * V + v, u, mask=v < V)


def test_kernel_noise_is_bit_identical(kernel_device):
    gen = torch.Generator().manual_seed(40)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (6,), generator=gen)
    seeds[0], seeds[1] = 0, -1
    offsets = torch.randint(0, 2 ** 40, (6,), generator=gen)
    out = torch.empty(6, 100, device=kernel_device)
    _noise_kernel[(6,)](seeds.to(kernel_device), offsets.to(kernel_device), out, 100, BLOCK=128)
    assert torch.equal(out.cpu(), uniform_noise(seeds, offsets, 100))
