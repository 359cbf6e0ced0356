"""Acceptance of drafted tokens against the target's verify logits.

A verify row fed [t, d_1, .., d_k] (t: the newest token, d: drafts) and got target logits at
those k+1 positions; logits at position i predict the token after d_i (after t for i = 0).

Greedy rows accept the longest prefix with d_{i+1} == argmax_i, then add the target's own next
token argmax_a: the emitted tokens are exactly argmax_0 .. argmax_a, identical to greedy
decoding without speculation.

Knows nothing about requests or the engine: every input is a batched tensor on the device.
"""

from __future__ import annotations

import torch


def greedy_accept(target_argmax: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [B, K+1], drafts [B, K], num_drafts [B] (row r uses its first k_r drafts).
    Returns (num_accepted [B], emitted [B, K+1]): row r emits emitted[r, :num_accepted[r] + 1]."""
    k = drafts.shape[1]
    match = (target_argmax[:, :k] == drafts) & (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None])
    num_accepted = match.int().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax
