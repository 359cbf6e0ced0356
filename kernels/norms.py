"""RMSNorm variants of the Qwen3.5 / Qwen3-Next family.

- `rms_norm`: layer norm with a zero-centred weight, `x / rms(x) * (1 + w)`, optionally fused
  with the residual add that precedes it (`x + residual` is normalised and also returned as
  the new residual stream).
- `gated_rms_norm`: the GDN output norm, `x / rms(x) * w * silu(z)` per value head (plain `w`).

Math is done in float32 and rounded once at the end, as HF transformers does. Knows nothing
about layers or models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H]. Returns (normed, new_residual).

    new_residual = x + residual (or x when residual is None), kept in x's dtype.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return normed.to(x.dtype), x


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """x, gate: [..., D] (one value head per row); weight: [D]. Returns x's dtype.

    HF rounds the normalised value to the input dtype before multiplying by `w`; we keep fp32
    throughout, which differs only below the input dtype's precision.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float() * F.silu(gate.float())).to(x.dtype)
