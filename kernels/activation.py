"""SwiGLU activation of the dense and expert MLPs: silu(gate) * up on a fused [.., 2I] input.
Knows nothing about weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns first) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
