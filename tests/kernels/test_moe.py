"""MoE routing and experts (kernels/moe.py): the torch references against a naive float64
per-token loop written here, then the Triton kernels against the references.

References. Contracts checked: routing is softmax -> top-k (optionally renormalised) and the
experts output is sum_k weight_k * down_k(silu(gate_k x) * up_k x); an expert no token chose is
skipped.

Triton kernels, with the references as the oracle. Inputs are fresh seeded random draws (no
zeros); every buffer a launcher allocates starts as garbage (`torch.empty` is poisoned: NaN for
floats, a large negative number for integers), so an unwritten output or workspace entry that is
read shows up. CPU: the interpreter on tiny shapes (fp32 / fp16), with the tiling shrunk so that
both expert paths (per token, grouped) and the dispatch between them run. GPU (`gpu` marker):
bf16 at Qwen-like shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.moe import (moe_experts, moe_experts_grouped, moe_experts_per_token, moe_experts_reference,
                                   route, route_reference)
from deltaspec.kernels.tiles import TileConfig
from kernel_helpers import assert_close, assert_close_elementwise


ops = REFERENCE_OPS


# ----------------------------------------------------------------------------------------------
# Torch references vs a float64 per-token loop
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
    assert_close_elementwise(weights, expected_weights, 1e-6, "routing weights")

    out = ops.moe_experts(x, weights, experts, w_gate_up, w_down)
    assert out.shape == x.shape and out.dtype == x.dtype
    xd, gu, dn = x.double(), w_gate_up.double(), w_down.double()
    for t in range(tokens):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for j in range(top_k):
            e = int(expected_experts[t, j])
            gate, up = gu[e, :inter] @ xd[t], gu[e, inter:] @ xd[t]
            expected += expected_weights[t, j] * (dn[e] @ (gate * torch.sigmoid(gate) * up))
        assert_close_elementwise(out[t], expected, 1e-5, f"token {t}")


def other_ranks(experts: torch.Tensor, num_experts: int, seed: int) -> torch.Tensor:
    """experts with about half of the pairs given an id outside [0, num_experts), as expert
    parallelism marks the pairs of other ranks' experts (num_experts itself, or -1)."""
    gen = torch.Generator().manual_seed(seed)
    outside = torch.rand(experts.shape, generator=gen) < 0.5
    outside[0] = True  # a token with no pair of this rank at all
    marks = torch.where(torch.rand(experts.shape, generator=gen) < 0.5, num_experts, -1)
    return torch.where(outside.to(experts.device), marks.to(experts.device, experts.dtype), experts)


def test_pairs_of_other_ranks_experts_contribute_nothing():
    """The reference against a float64 loop over this rank's pairs only."""
    gen = torch.Generator().manual_seed(8)
    tokens, hidden, inter, num_experts, top_k = 9, 16, 8, 4, 3
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    experts = other_ranks(torch.randint(0, num_experts, (tokens, top_k), generator=gen), num_experts, seed=9)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / 3
    out = ops.moe_experts(x, weights, experts, w_gate_up, w_down)
    assert torch.equal(out[0], torch.zeros(hidden))
    xd, gu, dn = x.double(), w_gate_up.double(), w_down.double()
    for t in range(tokens):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for j in range(top_k):
            e = int(experts[t, j])
            if 0 <= e < num_experts:
                gate, up = gu[e, :inter] @ xd[t], gu[e, inter:] @ xd[t]
                expected += float(weights[t, j]) * (dn[e] @ (gate * torch.sigmoid(gate) * up))
        assert_close_elementwise(out[t], expected, 1e-5, f"token {t}")


# ----------------------------------------------------------------------------------------------
# Triton kernels vs the torch references
# ----------------------------------------------------------------------------------------------

def assert_same_top_k(experts: torch.Tensor, expected: torch.Tensor, router_logits: torch.Tensor) -> None:
    """Same experts in the same order, up to the order among experts of equal probability
    (frequent with bf16 logits; torch.topk does not promise an order for ties)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, experts), probs.gather(1, expected))
    assert bool((experts.sort(1).values.diff(dim=1) > 0).all()), "an expert chosen twice"


def moe_case(gen: torch.Generator, tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
             dtype: torch.dtype, device: str):
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, num_experts, generator=gen) * 2
    router_logits[:, 1] = -30.0  # expert 1 gets no token: the grouped path must skip it
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    to = dict(device=device, dtype=dtype)
    return x.to(**to), router_logits.to(**to), w_gate_up.to(**to), w_down.to(**to)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_reference(kernel_device, poisoned_empty, dtype, renormalize):
    gen = torch.Generator().manual_seed(1 + renormalize)
    logits = (torch.randn(9, 40, generator=gen) * 2).to(kernel_device, dtype)  # 40 experts: not a power of 2
    for top_k in (1, 3):
        weights, experts = poisoned_empty(route, logits, top_k, renormalize)
        expected_weights, expected_experts = route_reference(logits, top_k, renormalize)
        assert weights.dtype == dtype and experts.dtype == torch.int64
        assert_same_top_k(experts, expected_experts, logits)
        assert_close(weights, expected_weights, 1e-6 if dtype == torch.float32 else 1e-3, f"top_k {top_k}")


PATHS = {
    "per_token": lambda *a: moe_experts_per_token(*a, gate_up_config=TileConfig(block_n=8, block_k=32),
                                                  down_config=TileConfig(block_n=16, block_k=32)),
    "grouped": lambda *a: moe_experts_grouped(*a, config=TileConfig(block_m=16, block_n=16, block_k=16,
                                                                    num_stages=1)),
    "dispatch": moe_experts,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tokens", [1, 13])
def test_moe_experts_match_reference(kernel_device, poisoned_empty, path, tokens):
    """H = 48, I = 24 (no tile divides them), 6 experts, one of them unused, top-2."""
    gen = torch.Generator().manual_seed(10 + tokens)
    x, router_logits, w_gate_up, w_down = moe_case(gen, tokens, 48, 24, 6, 2, torch.float32, kernel_device)
    weights, experts = route_reference(router_logits, 2, True)
    out = poisoned_empty(PATHS[path], x, weights, experts, w_gate_up, w_down)
    assert out.dtype == x.dtype
    assert_close(out, moe_experts_reference(x, weights, experts, w_gate_up, w_down), 1e-5, path)


@pytest.mark.parametrize("path", PATHS)
def test_moe_experts_skip_other_ranks_pairs(kernel_device, poisoned_empty, path):
    """Expert parallelism: pairs of experts outside [0, E) are neither computed nor summed (their
    rows of the poisoned workspaces are never read); token 0 has none of this rank's."""
    gen = torch.Generator().manual_seed(30)
    x, router_logits, w_gate_up, w_down = moe_case(gen, 13, 48, 24, 6, 2, torch.float32, kernel_device)
    weights, experts = route_reference(router_logits, 2, True)
    experts = other_ranks(experts, 6, seed=31)
    out = poisoned_empty(PATHS[path], x, weights, experts, w_gate_up, w_down)
    assert torch.equal(out[0].cpu(), torch.zeros(48))
    assert_close(out, moe_experts_reference(x, weights, experts, w_gate_up, w_down), 1e-5, path)


def test_moe_grouped_crosses_blocks_and_matches_alone(kernel_device, poisoned_empty):
    """40 tokens, slot 0 of every token on expert 3 (three 16-row blocks, the last partial),
    fp16: matches the reference, and each token alone gives its row of the batch."""
    gen = torch.Generator().manual_seed(20)
    x, router_logits, w_gate_up, w_down = moe_case(gen, 40, 32, 16, 5, 2, torch.float16, kernel_device)
    router_logits[:, 3] = 20.0
    weights, experts = route_reference(router_logits, 2, False)
    config = TileConfig(block_m=16, block_n=16, block_k=16, num_stages=1)
    out = poisoned_empty(moe_experts_grouped, x, weights, experts, w_gate_up, w_down, config)
    assert_close(out, moe_experts_reference(x, weights, experts, w_gate_up, w_down), 3e-3, "fp16 grouped")
    for t in (0, 17, 39):
        alone = moe_experts_grouped(x[t:t + 1], weights[t:t + 1], experts[t:t + 1], w_gate_up, w_down, config)
        assert_close(alone, out[t:t + 1], 1e-3, f"token {t} alone")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_moe_bf16_qwen_like_shapes(tokens):
    """bf16, 64 experts, top-8, H 512, I 128: route and both paths against the reference."""
    gen = torch.Generator().manual_seed(30 + tokens)
    x, router_logits, w_gate_up, w_down = moe_case(gen, tokens, 512, 128, 64, 8, torch.bfloat16, "cuda")
    weights, experts = route(router_logits, 8, True)
    expected_weights, expected_experts = route_reference(router_logits, 8, True)
    assert_same_top_k(experts, expected_experts, router_logits)
    assert_close(weights, expected_weights, 1e-2, "routing weights")
    expected = moe_experts_reference(x, weights, experts, w_gate_up, w_down)
    for path in (moe_experts_per_token, moe_experts_grouped, moe_experts):
        assert_close(path(x, weights, experts, w_gate_up, w_down), expected, 2e-2, path.__name__)
