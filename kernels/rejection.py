"""Rejection sampling of speculative drafts, without a host sync.

`rejection_sample` accepts draft token d_i with probability min(1, p_i(d_i) / q_i(d_i)) using
the uniform of (seed, offset + i, d_i); at the first rejection it races over
max(0, p_i - q_i) with the uniforms of (seed, offset + i, ·), which excludes d_i itself
(p_i(d_i) < q_i(d_i) there), so the two uses of one position's noise are independent. After a
fully accepted draft the bonus token races over p at the next position. Emitted tokens are
distributed exactly as sampling from p alone. Noise and race: noise.py, the stream `sample`
(sampling.py) draws from at the same position.

`rejection_sample` is the Triton kernel (one program per row), `rejection_sample_reference` its
torch oracle. Knows nothing about requests: every parameter arrives as a per-row tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .noise import race_block, row_hash_tl, row_hashes, uniform_at, uniform_tl


def rejection_sample_reference(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                               draft_tokens: torch.Tensor, num_draft: torch.Tensor, seeds: torch.Tensor,
                               offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify sampled drafts so that the emitted tokens are distributed exactly as p.

    target_probs [B, K+1, V] float32: the target's (filtered) distribution p_i at each draft
    position and at the bonus position; draft_probs [B, K, V] float32: the drafter's q_i, or None
    for a greedy drafter (q_i one-hot at d_i); draft_tokens [B, K] int64; num_draft [B] int64 in
    [0, K] (positions past it are ignored); seeds, offsets [B] int64: position i of a row uses the
    uniforms of (seed, offset + i), the stream a plain `sample` at that position would use.
    A greedy target row is a one-hot p: that is exactly argmax matching.

    Returns (output_tokens [B, K+1] int64: the accepted drafts, then the correction or bonus
    token, then -1; num_accepted [B] int64: the emitted length is num_accepted + 1).
    """
    batch, num_positions, vocab = target_probs.shape
    max_draft = num_positions - 1
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    positions = torch.arange(num_positions, device=device)
    hashes = row_hashes(seeds[:, None], offsets[:, None] + positions[None, :])  # [B, K+1]
    tokens = draft_tokens.long()
    p_draft = target_probs[:, :max_draft].gather(2, tokens[..., None])[..., 0]  # [B, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, tokens[..., None])[..., 0]
    # accept d_i iff u_i < p_i(d_i) / q_i(d_i), i.e. with probability min(1, p / q)
    rejected = ~(uniform_at(hashes[:, :max_draft], tokens) < p_draft / q_draft)
    rejected &= positions[None, :max_draft] < num_draft[:, None]
    # first rejected position (an appended column holding K stands for "none rejected")
    first_rejection = torch.where(rejected, positions[None, :max_draft], max_draft)
    num_accepted = torch.cat([first_rejection, positions[None, -1:].expand(batch, 1)], 1).amin(1)
    num_accepted = torch.minimum(num_accepted, num_draft.long())

    p = target_probs[rows, num_accepted]  # [B, V]: p at the correction / bonus position
    q = torch.zeros_like(p)
    if max_draft > 0:
        last = num_accepted.clamp(max=max_draft - 1)
        if draft_probs is None:
            q.scatter_(1, tokens[rows, last][:, None], 1.0)
        else:
            q = draft_probs[rows, last].float()
        q = q * (num_accepted < num_draft)[:, None]  # a bonus position races over p itself
    residual = (p - q).clamp_min(0.0)
    u = uniform_at(hashes[rows, num_accepted][:, None], torch.arange(vocab, device=device)[None, :])
    final = (residual.log() - (-u.log()).log()).argmax(-1)

    padded = torch.cat([tokens, tokens.new_zeros(batch, 1)], dim=1)
    output = torch.where(positions[None, :] < num_accepted[:, None], padded, -1)
    output[rows, num_accepted] = final
    return output, num_accepted


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rejection_kernel(target_probs, draft_probs, draft_tokens, num_draft, seeds, offsets, output_tokens,
                      num_accepted, V, K: tl.constexpr, K_PAD: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One row: accept drafts while u_i < p_i(d_i) / q_i(d_i); then race over the residual
    max(0, p_j - q_j) at the first rejection j, or over p_j at the bonus position j = num_draft.
    target_probs [B, K+1, V], draft_probs [B, K, V] contiguous; output_tokens [B, K+1]."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft + row)
    seed = tl.load(seeds + row)
    offset = tl.load(offsets + row)
    i = tl.arange(0, K_PAD)
    is_draft = i < n
    d = tl.load(draft_tokens + row * K + i, mask=is_draft, other=0)
    p_d = tl.load(target_probs + (row * (K + 1) + i) * V + d, mask=is_draft, other=0.0)
    if HAS_DRAFT_PROBS:
        q_d = tl.load(draft_probs + (row * K + i) * V + d, mask=is_draft, other=1.0)
    else:
        q_d = tl.full([K_PAD], 1.0, tl.float32)
    accept = uniform_tl(row_hash_tl(seed, offset + i), d) < p_d / q_d
    j = tl.min(tl.where(is_draft & ~accept, i, K), 0)  # first rejection, or K
    j = tl.minimum(j, n).to(tl.int64)
    rejected = j < n
    d_j = tl.where(rejected, tl.sum(tl.where(i == j, d, 0), 0), -1)
    row_hash = row_hash_tl(seed, offset + j)
    best = float("-inf")
    best_token = 0
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < V
        p = tl.load(target_probs + (row * (K + 1) + j) * V + v, mask=ok, other=0.0)
        if HAS_DRAFT_PROBS:
            # q only at a rejection ((v * 0 + j) < n: j < n as a vector; scalar masks trip the interpreter)
            q = tl.load(draft_probs + (row * K + j) * V + v, mask=ok & (v * 0 + j < n), other=0.0)
        else:
            q = tl.where(v == d_j, 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        value, token = race_block(tl.log(residual), v, ok, 0.0, row_hash)
        best_token = tl.where(value > best, token, best_token)
        best = tl.maximum(best, value)
    out = tl.arange(0, 2 * K_PAD)
    drafts = tl.load(draft_tokens + row * K + out, mask=out < j, other=-1)
    tl.store(output_tokens + row * (K + 1) + out, tl.where(out == j, best_token.to(tl.int64), drafts),
             mask=out < K + 1)
    tl.store(num_accepted + row, j)


def _check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft, seeds, offsets) -> None:
    batch, num_positions, vocab = target_probs.shape
    max_draft = num_positions - 1
    assert target_probs.dtype == torch.float32 and target_probs.is_contiguous(), "target_probs: contiguous float32"
    if draft_probs is not None:
        assert draft_probs.shape == (batch, max_draft, vocab), f"draft_probs {tuple(draft_probs.shape)}"
        assert draft_probs.dtype == torch.float32 and draft_probs.is_contiguous(), "draft_probs: contiguous float32"
    assert draft_tokens.shape == (batch, max_draft) and draft_tokens.dtype == torch.int64, "draft_tokens [B, K] int64"
    assert draft_tokens.is_contiguous(), "draft_tokens must be contiguous"
    for name, x in (("num_draft", num_draft), ("seeds", seeds), ("offsets", offsets)):
        assert x.shape == (batch,) and x.dtype == torch.int64 and x.is_contiguous(), f"{name}: contiguous [B] int64"


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                     num_draft: torch.Tensor, seeds: torch.Tensor,
                     offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rejection_sample_reference` (same arguments and results, ties aside): one
    program per row, no host sync."""
    _check_rejection_sample_args(target_probs, draft_probs, draft_tokens, num_draft, seeds, offsets)
    batch, num_positions, vocab = target_probs.shape
    max_draft = num_positions - 1
    output_tokens = torch.empty(batch, num_positions, dtype=torch.int64, device=target_probs.device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=target_probs.device)
    if batch == 0:
        return output_tokens, num_accepted
    _rejection_kernel[(batch,)](target_probs, target_probs if draft_probs is None else draft_probs, draft_tokens,
                                num_draft, seeds, offsets, output_tokens, num_accepted, vocab, K=max_draft,
                                K_PAD=triton.next_power_of_2(max(max_draft, 1)),
                                HAS_DRAFT_PROBS=draft_probs is not None, BLOCK=min(4096, triton.next_power_of_2(vocab)),
                                num_warps=8)
    return output_tokens, num_accepted
