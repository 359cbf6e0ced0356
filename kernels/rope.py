"""Per-head q/k RMSNorm fused with partial rotary position embedding.

Gated attention normalises every query and key head with its own `(1 + w)` RMSNorm and then
rotates only the first `rotary_dim` channels (partial RoPE, Qwen3.5: 0.25 of head_dim) with
the rotate-half convention: pairs are (i, i + rotary_dim/2). Knows nothing about the KV cache.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, rotary_dim // 2] float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, R/2]
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    # HF rounds after the norm, then rotates in the activation dtype.
    h = h.to(x.dtype).float()
    half = cos.shape[-1]
    x1, x2, rest = h[..., :half], h[..., half:2 * half], h[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return rotated.to(x.dtype)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                           theta: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns normalised, rotated (q, k)."""
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)
