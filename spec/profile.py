"""Forced acceptance for benchmarks: verify rows accept as a given per-position profile says.

A random-weight model of a real size accepts almost nothing, so its speculative steps would be
timed at the wrong acceptance. With an `AcceptanceProfile` every stage still runs for real (the
MTP drafts, verify, acceptance, rollback, the next step's catch-up); only each row's accepted
count is replaced by a draw from the profile: by_position[i] is the chance that draft i + 1 is
accepted (unconditionally, as SpecStats.acceptance_by_position reports it), so depth i + 1 is
accepted given depth i was with by_position[i] / by_position[i - 1]. The emitted tokens are the
target's own at those positions: what a model with that acceptance would emit, in count.
Drawn on the device (graph-safe: torch's generator advances per replay). Never used in serving.
"""

from __future__ import annotations

from typing import Sequence

import torch


class AcceptanceProfile:
    def __init__(self, by_position: Sequence[float]) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}
        self.set(by_position)

    def set(self, by_position: Sequence[float]) -> None:
        """Another profile, in place: graphs captured with this one draw from the new one."""
        values = list(by_position)
        if not values or any(not 0 <= p <= 1 for p in values) or any(b > a for a, b in zip(values, values[1:])):
            raise ValueError("an acceptance profile is a non-increasing list of chances in [0, 1]")
        self.by_position = tuple(values)
        previous = (1.0, *values[:-1])
        self._conditional = [p / q if q else 0.0 for p, q in zip(values, previous)]
        with torch.inference_mode():  # the tensors were made in the engine's inference mode
            for (max_drafts, _), tensor in self._tensors.items():
                tensor.copy_(torch.tensor(self._padded(max_drafts)))

    def draw(self, num_drafts: torch.Tensor, max_drafts: int) -> torch.Tensor:
        """Accepted counts [B] int64 for rows that drafted num_drafts [B] (<= max_drafts): the
        profile's depths past its length are never accepted."""
        conditional = self._conditional_tensor(max_drafts, num_drafts.device)
        accepted = torch.rand(num_drafts.shape[0], max_drafts, device=num_drafts.device) < conditional
        return torch.minimum(accepted.long().cumprod(dim=1).sum(dim=1), num_drafts)

    def _conditional_tensor(self, max_drafts: int, device: torch.device) -> torch.Tensor:
        """Made once per shape (never inside a graph capture: warm-up runs make it first)."""
        key = (max_drafts, str(device))
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(self._padded(max_drafts), dtype=torch.float32, device=device)
        return self._tensors[key]

    def _padded(self, max_drafts: int) -> list[float]:
        return (self._conditional + [0.0] * max_drafts)[:max_drafts]
