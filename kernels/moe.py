"""Mixture-of-experts MLP: softmax top-k routing and the routed SwiGLU experts.

Routing as Qwen3-Next / Qwen3.5-MoE define it: probabilities = softmax(router logits) in
float32, keep the top k, optionally renormalise them to sum to 1, cast to the activation dtype.
The shared expert and its sigmoid gate are dense GEMMs done by the model. Knows nothing about
layers or checkpoints.
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul_reference


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def moe_experts_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; weights, experts: [T, k]; w_gate_up: [E, 2I, H]; w_down: [E, H, I] -> [T, H].
    Tokens are grouped by expert so each expert runs one GEMM over its tokens."""
    out = torch.zeros_like(x)
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]
    weight_of = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        hidden = silu_and_mul_reference(x[tokens] @ w_gate_up[expert].T) @ w_down[expert].T
        out.index_add_(0, tokens, hidden * weight_of[start:start + count, None])
        start += count
    return out
