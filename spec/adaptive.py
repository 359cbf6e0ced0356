"""Per-request adaptive draft length.

Policy (documented, switchable off): each request keeps an exponential moving average of the
acceptance rate of its drafted positions, alpha (fraction of proposed drafts accepted; weight
0.3 for the newest step). A verify step with k drafts costs about 1 + c*k decode steps of work
(c ~ the draft-plus-verify cost of one extra token relative to a decode step; 0.15 by default)
and yields 1 + alpha + .. + alpha^k tokens in expectation. The next k is the one in 0..k_max
that maximises expected tokens per unit of cost. When drafting does not pay (alpha low), k
drops to 0; a request at k = 0 still runs the MTP catch-up each step, and probes again with
k = 1 every `probe_interval` steps so that it can grow back when acceptance recovers.

Knows nothing about tensors or the scheduler.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdaptivePolicy:
    max_draft_tokens: int
    enabled: bool = True
    cost_per_draft: float = 0.15
    smoothing: float = 0.3
    initial_acceptance: float = 0.7
    probe_interval: int = 16
    # Derived: costs[k] = 1 + cost_per_draft * k, the cost of a step with k drafts; thresholds[j]
    # ~ the least acceptance whose best length exceeds j (see `best_length`).
    costs: tuple[float, ...] = field(init=False, repr=False, compare=False)
    thresholds: tuple[float, ...] = field(init=False, repr=False, compare=False)

    # Acceptances this close to a threshold are decided by the direct search (bisection and
    # the direct sums may round differently there).
    _NEAR = 1e-9

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 0 or self.cost_per_draft < 0:
            raise ValueError("max_draft_tokens and cost_per_draft must be >= 0")
        object.__setattr__(self, "costs", tuple(1 + self.cost_per_draft * k for k in range(self.max_draft_tokens + 1)))
        object.__setattr__(self, "thresholds", self._thresholds())

    def best_length(self, acceptance: float) -> int:
        """The k in 0..max_draft_tokens with the most expected tokens per unit of cost (the
        smallest such k on a tie), for an acceptance in [0, 1]; runs for every decoding request
        every step, so it is a lookup. The best k never decreases as acceptance grows: for
        j < k, value_k / value_j = (S_k / S_j) (cost_j / cost_k) with S_k = 1 + a + .. + a^k, and
        S_k / S_j = 1 + (a^(j+1) + .. + a^k) / (1 + .. + a^j) increases with a (every power
        above is higher than every power below). So best_length(a) = #thresholds below a."""
        k = bisect.bisect_right(self.thresholds, acceptance)
        if (k and acceptance - self.thresholds[k - 1] < self._NEAR) or \
                (k < len(self.thresholds) and self.thresholds[k] - acceptance < self._NEAR):
            return self._search(acceptance)
        return k

    def _search(self, acceptance: float) -> int:
        """best_length by evaluating every k."""
        best, best_value = 0, -math.inf
        expected_tokens = 0.0  # 1 + alpha + .. + alpha^k, summed in that order
        for k, cost in enumerate(self.costs):
            expected_tokens += acceptance ** k
            value = expected_tokens / cost
            if value > best_value:
                best, best_value = k, value
        return best

    def _thresholds(self) -> tuple[float, ...]:
        """thresholds[j]: the least acceptance in [0, 1] (to float bisection) with _search > j,
        or 2.0 (never) when even acceptance 1 keeps the best length at j or below. At acceptance
        0 every k yields one token and k = 0 costs least, so each search starts above 0."""
        best_at_one = self._search(1.0)
        thresholds = []
        for j in range(self.max_draft_tokens):
            if best_at_one <= j:
                thresholds.append(2.0)
                continue
            low, high = 0.0, 1.0  # _search(low) <= j < _search(high)
            for _ in range(64):
                middle = (low + high) / 2
                low, high = (low, middle) if self._search(middle) > j else (middle, high)
            thresholds.append(high)
        return tuple(thresholds)


@dataclass
class DraftLengthState:
    """One request's acceptance history and current draft length."""

    policy: AdaptivePolicy
    acceptance: float = field(init=False)
    steps_at_zero: int = 0

    def __post_init__(self) -> None:
        self.acceptance = self.policy.initial_acceptance

    @property
    def num_draft_tokens(self) -> int:
        if not self.policy.enabled:
            return self.policy.max_draft_tokens
        k = self.policy.best_length(self.acceptance)
        if k == 0 and self.steps_at_zero >= self.policy.probe_interval:
            return 1
        return k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            self.steps_at_zero += 1
            return
        self.steps_at_zero = 0
        rate = num_accepted / num_drafted
        self.acceptance += self.policy.smoothing * (rate - self.acceptance)
