"""Acceptance of drafted tokens against the target's verify logits: greedy and rejection sampling.

A verify row fed [t, d_1, .., d_k] (t: the newest token, d: drafts) and got target logits at
those k+1 positions; logits at position i predict the token after d_i (after t for i = 0).

Greedy rows accept the longest prefix with d_{i+1} == argmax_i, then add the target's own next
token argmax_a: the emitted tokens are exactly argmax_0 .. argmax_a, identical to greedy
decoding without speculation.

Sampled rows use rejection sampling (the kernel `rejection_sample`). With p_i the target's
filtered distribution at position i and q_i the drafter's (one-hot at d_i for the MTP's greedy
drafts): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a
token from max(0, p_i - q_i) renormalised, and when every draft is accepted a bonus token from
p_k. Each emitted token is then distributed exactly as p: speculation changes how many forwards
a token costs, never which tokens come out. Position i draws the uniforms of (seed, position),
the stream plain sampling would use there.

Both return (num_accepted [B], emitted [B, K+1]): row r emits emitted[r, :num_accepted[r] + 1].
Knows nothing about requests or the engine: every input is a batched tensor on the device.
"""

from __future__ import annotations

from typing import Callable

import torch


def greedy_accept(target_argmax: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [B, K+1], drafts [B, K], num_drafts [B] (row r uses its first k_r drafts)."""
    k = drafts.shape[1]
    match = (target_argmax[:, :k] == drafts) & (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None])
    num_accepted = match.int().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax


def rejection_accept(rejection_sample: Callable, target_probs: torch.Tensor, drafts: torch.Tensor,
                     num_drafts: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K+1, V] float32 (filtered p at each position), greedy drafts [B, K],
    num_drafts [B]; seeds [B] and positions [B] (the position of each row's first emitted token)
    pick the uniforms. rejection_sample: the backend's kernel (kernels.Ops.rejection_sample)."""
    emitted, num_accepted = rejection_sample(target_probs, None, drafts, num_drafts, seeds, positions)
    return num_accepted, emitted
