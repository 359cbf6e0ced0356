"""Speculation counters: per-position acceptance, mean accepted length, draft/verify time.

Position i (1-based) counts how often a draft at depth i was proposed and accepted. The mean
accepted length is tokens emitted per verify step (accepted drafts + the target's own token).
Knows nothing about tensors or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    proposed: list[int] = field(default_factory=list)  # proposed[i]: drafts at depth i+1
    accepted: list[int] = field(default_factory=list)
    num_verify_steps: int = 0   # rows verified (one per request per step)
    num_emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        grow = num_drafted - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        for depth in range(num_drafted):
            self.proposed[depth] += 1
            self.accepted[depth] += depth < num_accepted
        self.num_verify_steps += 1
        self.num_emitted_tokens += num_accepted + 1

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self, with_times: bool = True) -> dict:
        """The counters (and the stage times, which only the engine-wide stats keep)."""
        counters = {"acceptance_by_position": self.acceptance_by_position, "proposed_by_position": list(self.proposed),
                    "accepted_by_position": list(self.accepted), "mean_accepted_length": self.mean_accepted_length,
                    "num_verify_steps": self.num_verify_steps}
        if with_times:
            counters.update(draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds)
        return counters
