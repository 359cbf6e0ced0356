"""Speculation counters: per-position acceptance and mean accepted length.

Position i (1-based) counts how often a draft at depth i was proposed and accepted. The mean
accepted length is tokens emitted per verify step (accepted drafts + the target's own token).
Every verify row of every step is recorded (twice: per request and per engine), so a record is
one count of its (drafted, accepted) pair; the per-position counts are derived when read.
Knows nothing about tensors or the engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class SpecStats:
    rows: Counter[tuple[int, int]] = field(default_factory=Counter)  # (drafted, accepted) -> verify rows

    def record(self, outcomes: Iterable[tuple[int, int]]) -> None:
        """Verify rows' (drafted, accepted) pairs: a step's at once for the engine, one for a request."""
        self.rows.update(outcomes)

    @property
    def proposed(self) -> list[int]:
        """proposed[i]: drafts at depth i+1."""
        counts = [0] * max((drafted for drafted, _ in self.rows), default=0)
        for (drafted, _), n in self.rows.items():
            for depth in range(drafted):
                counts[depth] += n
        return counts

    @property
    def accepted(self) -> list[int]:
        """accepted[i]: accepted drafts at depth i+1."""
        counts = [0] * max((drafted for drafted, _ in self.rows), default=0)
        for (drafted, accepted), n in self.rows.items():
            for depth in range(min(accepted, drafted)):
                counts[depth] += n
        return counts

    @property
    def num_verify_steps(self) -> int:
        """Rows verified (one per request per step)."""
        return sum(self.rows.values())

    @property
    def num_emitted_tokens(self) -> int:
        return sum((accepted + 1) * n for (_, accepted), n in self.rows.items())

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"acceptance_by_position": self.acceptance_by_position, "proposed_by_position": self.proposed,
                "accepted_by_position": self.accepted, "mean_accepted_length": self.mean_accepted_length,
                "num_verify_steps": self.num_verify_steps}
