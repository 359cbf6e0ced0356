"""Counter-based noise for sampling.py: the uniform number for (row,
token v) is a hash of the row's seed, its offset (the position being sampled) and v. A row's
draw therefore depends only on its own seed and position — reproducible across runs and
independent of the other rows in the batch and of the batch size. Torch (`row_hashes`,
`uniform_at`, `uniform_noise`) and Triton (`row_hash_tl`, `uniform_tl`) compute bit-identical
numbers.

`race_block` is the exponential race (Gumbel-max) over one block of a row: argmax of
log p_v - log(-log u_v) is distributed as p. Knows nothing about filters or drafts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding uint32 values (products wrap mod 2^64)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def row_hashes(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """seeds, offsets: int64 (any shape) -> the uint32 (in int64) hash of each (seed, offset)."""
    seeds, offsets = seeds.long(), offsets.long()
    row = _fmix32((seeds & _MASK32) ^ _fmix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9))
    return _fmix32(row ^ ((offsets * 0x85EBCA77) & _MASK32))


def uniform_at(row: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """row hashes and token ids (broadcasting, int64) -> float32 uniforms in (0, 1)."""
    bits = _fmix32(row ^ ((tokens * 0xC2B2AE3D) & _MASK32))
    # 23 high bits: (n + 0.5) * 2^-23 needs 24 significant bits, exact in float32, so u lies
    # strictly inside (0, 1) (with 24 bits, n = 2^24 - 1 would round up to exactly 1.0).
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, offsets: [B] int64 -> u: [B, V] float32 in (0, 1)."""
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return uniform_at(row_hashes(seeds, offsets)[:, None], token[None, :])


@triton.jit
def _fmix32_tl(x):
    """murmur3 finaliser on uint32 (products wrap mod 2^32), as `_fmix32`."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def row_hash_tl(seed, offset):
    """int64 seed, offset -> uint32 hash, bit-identical to `row_hashes`."""
    low = seed.to(tl.uint32)  # truncation: the low 32 bits
    high = (seed >> 32).to(tl.uint32)
    row = _fmix32_tl(low ^ _fmix32_tl(high ^ 0x9E3779B9))
    return _fmix32_tl(row ^ (offset.to(tl.uint32) * 0x85EBCA77))


@triton.jit
def uniform_tl(row, token):
    """uint32 row hash, int token ids -> float32 uniforms, bit-identical to `uniform_at`."""
    bits = _fmix32_tl(row ^ (token.to(tl.uint32) * 0xC2B2AE3D))
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def race_block(s, token, kept, top, row_hash):
    """Exponential race over one block: (best value, its token; the first on ties).
    value = (s - top) - log(-log u): log p up to the row's normalisation."""
    u = uniform_tl(row_hash, token)
    value = tl.where(kept, (s - top) - tl.log(-tl.log(u)), float("-inf"))
    best = tl.max(value, 0)
    return best, tl.min(tl.where(value == best, token, 2147483647), 0)
