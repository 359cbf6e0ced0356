"""q/k norm + partial RoPE (kernels/rope.py): the torch reference against a naive float64 loop
written here, then the Triton kernel against the reference.

Reference. Contracts checked: a (1 + w) RMSNorm per token and head, then only the first
rotary_dim channels rotate, pairs (i, i + rotary_dim/2), at each token's own position (out of
order, far apart); channels past rotary_dim are only normalised; GQA heads.

Triton kernel, with the reference as the oracle: q sliced from [q | gate] per head and k from a
fused qkv row, as the model passes them. CPU: the interpreter, fp32, rotary_dim 8 and 32.
(bf16 at attention widths on the GPU: test_norms_and_rope_gpu_bf16 in test_norms.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.rope import Yarn, qk_norm_rope, qk_norm_rope_reference
from kernel_helpers import TOLERANCE, assert_close, assert_close_elementwise, naive_rms, rope_case


ops = REFERENCE_OPS


# ----------------------------------------------------------------------------------------------
# Torch reference vs a float64 loop
# ----------------------------------------------------------------------------------------------

def naive_norm_rope(x: torch.Tensor, weight: torch.Tensor, positions: list[int], rotary_dim: int,
                    theta: float, eps: float) -> torch.Tensor:
    """x [T, H, D] -> per token and head: (1 + w) RMSNorm, then rotate pairs (i, i + R/2) of
    the first R channels by position * theta^(-2i/R); channels >= R pass through."""
    tokens, heads, dim = x.shape
    half = rotary_dim // 2
    w = weight.tolist()
    out = torch.empty(tokens, heads, dim, dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            row = x[t, h].double().tolist()
            r = naive_rms(row, eps)
            y = [row[i] * r * (1.0 + w[i]) for i in range(dim)]
            z = list(y)
            for i in range(half):
                angle = positions[t] * theta ** (-2.0 * i / rotary_dim)
                c, s = math.cos(angle), math.sin(angle)
                z[i] = y[i] * c - y[i + half] * s
                z[i + half] = y[i + half] * c + y[i] * s
            out[t, h] = torch.tensor(z)
    return out


def test_qk_norm_partial_rope():
    """head_dim 64, rotary_dim 16 (0.25), GQA heads; positions out of order and far apart."""
    gen = torch.Generator().manual_seed(5)
    heads_q, heads_k, dim, rotary_dim, theta, eps = 4, 2, 64, 16, 10_000.0, 1e-6
    positions = [0, 1, 517, 3, 64, 1999, 2, 200]
    q = torch.randn(len(positions), heads_q, dim, generator=gen)
    k = torch.randn(len(positions), heads_k, dim, generator=gen)
    q_weight, k_weight = 0.1 * torch.randn(dim, generator=gen), 0.1 * torch.randn(dim, generator=gen)
    q_out, k_out = ops.qk_norm_rope(q, k, q_weight, k_weight, torch.tensor(positions), rotary_dim, theta, eps)
    # fp32 angles at position ~2000 carry ~1e-4 rad of rounding (as HF's), hence 5e-4.
    assert_close_elementwise(q_out, naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps), 5e-4, "q")
    assert_close_elementwise(k_out, naive_norm_rope(k, k_weight, positions, rotary_dim, theta, eps), 5e-4, "k")
    # Channels past rotary_dim are only normalised: tight tolerance there.
    assert_close_elementwise(q_out[..., rotary_dim:], naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps)[..., rotary_dim:],
                 1e-5, "q pass-through channels")


# ----------------------------------------------------------------------------------------------
# Triton kernel vs the torch reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_qk_norm_rope(kernel_device, rotary_dim):
    args = rope_case(kernel_device, torch.float32, 6, 4, 2, 32, 5000, seed=92)
    expected = qk_norm_rope_reference(*args, rotary_dim, 10_000.0, 1e-6)
    actual = qk_norm_rope(*args, rotary_dim, 10_000.0, 1e-6)
    for a, e, name in zip(actual, expected, "qk"):
        assert_close(a, e, TOLERANCE[torch.float32], name)


def test_qk_norm_rope_yarn(kernel_device):
    """YaRN: blended frequencies and the cos/sin attention factor, on the rotary channels only."""
    args = rope_case(kernel_device, torch.float32, 6, 4, 2, 32, 5000, seed=95)
    yarn = Yarn(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=1, attention_factor=1.2)
    expected = qk_norm_rope_reference(*args, 16, 10_000.0, 1e-6, yarn)
    actual = qk_norm_rope(*args, 16, 10_000.0, 1e-6, yarn)
    for a, e, name in zip(actual, expected, "qk"):
        assert_close(a, e, TOLERANCE[torch.float32], name)
    plain = qk_norm_rope_reference(*args, 16, 10_000.0, 1e-6)
    assert not torch.allclose(expected[0][..., :16], plain[0][..., :16])
    assert torch.equal(expected[0][..., 16:], plain[0][..., 16:])
