"""Acceptance of drafted tokens against the target's verify logits: greedy and rejection sampling.

A verify row fed [t, d_1, .., d_k] (t: the newest token, d: drafts) and got target logits at
those k+1 positions; logits at position i predict the token after d_i (after t for i = 0).

Greedy rows accept the longest prefix with d_{i+1} == argmax_i, then add the target's own next
token argmax_a: the emitted tokens are exactly argmax_0 .. argmax_a, identical to greedy
decoding without speculation.

Sampled rows use rejection sampling, realised as a coupling with plain sampling. The MTP's
drafts are greedy, so the drafter's q_i is one-hot at d_i, and rejection sampling reads: accept
d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i); on rejection emit a token from
max(0, p_i - q_i) renormalised, i.e. from p_i without d_i; when every draft is accepted, a bonus
token from p_k. Draw x_i ~ p_i at every position with the seeded noise plain sampling would use
there (seed, position), accept d_i iff x_i = d_i, and emit x_i at the first mismatch (or as the
bonus): P(accept) = p_i(d_i), and a rejected position emits x_i given x_i != d_i, which is p_i
without d_i renormalised — the same law. So `sampled_accept` is `greedy_accept` on the sampled
tokens, and more: the emitted tokens are exactly those plain sampling emits with the same seed,
whatever the drafts and however many there are. Speculation changes how many forwards a token
costs, never which tokens come out, for greedy and seeded rows alike.

Both return (num_accepted [B], emitted [B, K+1]): row r emits emitted[r, :num_accepted[r] + 1].
Knows nothing about requests or the engine: every input is a batched tensor on the device.
"""

from __future__ import annotations

import torch


def greedy_accept(target_argmax: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [B, K+1], drafts [B, K], num_drafts [B] (row r uses its first k_r drafts)."""
    k = drafts.shape[1]
    match = (target_argmax[:, :k] == drafts) & (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None])
    num_accepted = match.int().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax


def sampled_accept(target_sampled: torch.Tensor, drafts: torch.Tensor,
                   num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_sampled [B, K+1]: the token plain sampling draws from the target's filtered
    distribution at each position (with that position's seeded noise); drafts [B, K] greedy."""
    return greedy_accept(target_sampled, drafts, num_drafts)
