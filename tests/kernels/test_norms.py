"""Norm, RoPE, SwiGLU and MoE torch references (kernels/norms.py, rope.py, activation.py,
moe.py) against naive float64 per-row / per-token formulas written here.

Contracts checked: rms_norm multiplies by (1 + w) and fuses the residual add (returning the sum
as the new residual); gated_rms_norm is norm(x) * w * silu(z) with plain w; q/k norm + partial
RoPE rotates only the first rotary_dim channels, pairs (i, i + rotary_dim/2), at each token's
own position; MoE routing is softmax -> top-k (optionally renormalised) and the experts output is
sum_k weight_k * down_k(silu(gate_k x) * up_k x).
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS

ops = REFERENCE_OPS


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max())
    error = (actual - expected).abs()
    worst = float((error - rtol * (expected.abs() + scale)).max())
    assert worst <= 0, f"{what}: max abs error {float(error.max()):.3e} (scale {scale:.3e})"


def silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


def naive_rms(row: list[float], eps: float) -> float:
    """1 / sqrt(mean(x^2) + eps) of one row."""
    return 1.0 / math.sqrt(sum(x * x for x in row) / len(row) + eps)


# ----------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_one_plus_w_with_residual(with_residual):
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, eps = 7, 48, 1e-6
    x = torch.randn(tokens, hidden, generator=gen) * 3
    residual = torch.randn(tokens, hidden, generator=gen) if with_residual else None
    weight = 0.1 * torch.randn(hidden, generator=gen)
    normed, new_residual = ops.rms_norm(x, weight, eps, residual)
    summed = x + residual if with_residual else x
    assert torch.equal(new_residual, summed), "new residual is x + residual, in x's dtype"
    w = weight.tolist()
    for t in range(tokens):
        row = summed[t].double().tolist()
        r = naive_rms(row, eps)
        expected = torch.tensor([row[i] * r * (1.0 + w[i]) for i in range(hidden)], dtype=torch.float64)
        assert_close(normed[t], expected, 1e-5, f"token {t}")


def test_rms_norm_bf16_rounds_once():
    """bf16 in, bf16 out: within one bf16 rounding of the float64 value."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    residual = torch.randn(5, 64, generator=gen).bfloat16()
    weight = (0.1 * torch.randn(64, generator=gen)).bfloat16()
    normed, new_residual = ops.rms_norm(x, weight, 1e-6, residual)
    assert normed.dtype == torch.bfloat16 and new_residual.dtype == torch.bfloat16
    h = new_residual.double()
    expected = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.double())
    assert_close(normed, expected, 2 ** -8, "bf16")


def test_gated_rms_norm_plain_w_times_silu_gate():
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, eps = 6, 3, 16, 1e-6
    x = torch.randn(tokens, heads, dim, generator=gen)
    gate = torch.randn(tokens, heads, dim, generator=gen) * 2
    weight = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    out = ops.gated_rms_norm(x, gate, weight, eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    w = weight.tolist()
    for t in range(tokens):
        for h in range(heads):  # one value head per row
            row, z = x[t, h].double().tolist(), gate[t, h].double().tolist()
            r = naive_rms(row, eps)
            expected = torch.tensor([row[i] * r * w[i] * silu(z[i]) for i in range(dim)])
            assert_close(out[t, h], expected, 1e-5, f"token {t} head {h}")


def test_silu_and_mul_gate_columns_first():
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(5, 2 * 12, generator=gen) * 2
    out = ops.silu_and_mul(gate_up)
    rows = gate_up.double().tolist()
    expected = torch.tensor([[silu(r[i]) * r[12 + i] for i in range(12)] for r in rows])
    assert_close(out, expected, 1e-6)


# ----------------------------------------------------------------------------------------------
# q/k norm + partial RoPE
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
    assert_close(q_out, naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps), 5e-4, "q")
    assert_close(k_out, naive_norm_rope(k, k_weight, positions, rotary_dim, theta, eps), 5e-4, "k")
    # Channels past rotary_dim are only normalised: tight tolerance there.
    assert_close(q_out[..., rotary_dim:], naive_norm_rope(q, q_weight, positions, rotary_dim, theta, eps)[..., rotary_dim:],
                 1e-5, "q pass-through channels")


# ----------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------

def naive_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Per token in float64: softmax, the top_k largest (descending), optionally renormalised."""
    weights, experts = [], []
    for row in logits.double().tolist():
        top = max(row)
        e = [math.exp(x - top) for x in row]
        probs = [x / sum(e) for x in e]
        chosen = sorted(range(len(row)), key=lambda i: -probs[i])[:top_k]
        w = [probs[i] for i in chosen]
        if renormalize:
            w = [x / sum(w) for x in w]
        weights.append(w)
        experts.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(experts)


@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_route_and_experts_match_per_token_loop(renormalize):
    gen = torch.Generator().manual_seed(6 + renormalize)
    tokens, hidden, inter, num_experts, top_k = 13, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, num_experts, generator=gen) * 2
    router_logits[:, 4] = -30.0  # expert 4 gets no token: the grouped loop must skip it
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / 3

    weights, experts = ops.moe_route(router_logits, top_k, renormalize)
    expected_weights, expected_experts = naive_route(router_logits, top_k, renormalize)
    assert weights.dtype == router_logits.dtype
    assert torch.equal(experts.long(), expected_experts)
    assert_close(weights, expected_weights, 1e-6, "routing weights")

    out = ops.moe_experts(x, weights, experts, w_gate_up, w_down)
    assert out.shape == x.shape and out.dtype == x.dtype
    xd, gu, dn = x.double(), w_gate_up.double(), w_down.double()
    for t in range(tokens):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for j in range(top_k):
            e = int(expected_experts[t, j])
            gate, up = gu[e, :inter] @ xd[t], gu[e, inter:] @ xd[t]
            expected += expected_weights[t, j] * (dn[e] @ (gate * torch.sigmoid(gate) * up))
        assert_close(out[t], expected, 1e-5, f"token {t}")
