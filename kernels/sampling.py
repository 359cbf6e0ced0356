"""Token selection on device: temperature, top-k, top-p, min-p, seeded, without a host sync.

Randomness is counter-based: the uniform number for (row, token v) is a hash of the row's
seed, its offset (the position being sampled) and v. A row's draw therefore depends only on
its own seed and position — reproducible across runs and independent of the other rows in the
batch and of the batch size. Sampling uses the exponential race (Gumbel-max): argmax of
log p_v - log(-log u_v) is distributed as p.

Knows nothing about requests: every parameter arrives as a per-row tensor.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding uint32 values (products wrap mod 2^64)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, offsets: [B] int64 -> u: [B, V] float32 in (0, 1)."""
    seeds, offsets = seeds.long(), offsets.long()
    row = _fmix32((seeds & _MASK32) ^ _fmix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9))
    row = _fmix32(row ^ ((offsets * 0x85EBCA77) & _MASK32))
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _fmix32(row[:, None] ^ ((token[None, :] * 0xC2B2AE3D) & _MASK32))
    # 23 high bits: (n + 0.5) * 2^-23 needs 24 significant bits, exact in float32, so u lies
    # strictly inside (0, 1) (with 24 bits, n = 2^24 - 1 would round up to exactly 1.0).
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def filter_probs_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> filtered, renormalised probabilities [B, V] float32 (temperature > 0).
    top_k <= 0 or >= V, top_p == 1 and min_p == 0 switch the respective filter off."""
    scaled = logits.float() / temperature.float().clamp_min(1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[1]).long()[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays).
    mass_before = probs.cumsum(-1) - probs
    keep = (mass_before < top_p.float()[:, None]) | (rank == 0)
    keep &= probs >= min_p.float()[:, None] * probs[:, :1]
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                     offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; per-row params [B]; temperature 0 = greedy.
    Returns (tokens [B] int64, log-probabilities of those tokens under the raw logits [B])."""
    greedy = logits.argmax(dim=-1)
    probs = filter_probs_reference(logits, temperature, top_k, top_p, min_p)
    race = probs.log() - (-uniform_noise(seeds, offsets, logits.shape[1]).log()).log()
    tokens = torch.where(temperature > 0, race.argmax(dim=-1), greedy)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
