"""How many drafts each speculative step runs: chosen from measured step costs and each request's
recent acceptance, so that speculation runs only where it pays.

A decode step runs every row at the same number of positions (fixed shapes, CUDA graphs), so
its cost depends on its number of rows B and its draft count K alone, not on each row's own
count. The policy therefore chooses one K per step, the one in 0..max_draft_tokens with the most
expected tokens per second:

    value(K) = sum_r E_r(min(K, room_r)) / cost(B, K),   E_r(k) = 1 + c_r1 + c_r1 c_r2 + .. + c_r1 .. c_rk,

with c_ri request r's conditional acceptance at depth i (the chance that draft i is accepted
when draft i - 1 was), an exponential moving average of what its verify steps saw (weight
`smoothing` for the newest: steady enough that one request's estimate does not swing to a short
K after a single rejection, bench/tools/policy_sim.py) starting from the engine's `prior` (every
verify step's outcome, smoothed slowly: what this model's drafts usually do), room_r the drafts
its token limit leaves, and cost(B, K) the seconds of a step (`StepCosts`, measured at start-up
on the captured graphs; K = 0 is the plain decode step, which runs no MTP at all), plus the
sampling of every verified position of the step's sampled rows (S (K + 1) draws instead of S). A K > 0 must beat K = 0 by `min_gain`: the
costs are measured on short contexts, where a verify's extra positions cost least, and a step
that only breaks even is a loss once that is wrong. So K = 0 wherever drafting does not pay:
large batches, low acceptance, cheap steps. A step at K = 0 observes no acceptance, so after
`probe_interval` of them in a row the policy runs one step at K = 1 (the cheapest probe) and
acceptance can grow back. Ties go to the smaller K.

The start-up costs time the device alone. Where the host is the bottleneck (small models,
many rows to schedule and commit) a step costs its wall time, not its device time, so the
engine reports the wall time of every step it ran back to back (`observe`), and an observed
cost (an exponential moving average per bucket and K) replaces the start-up one: a K whose
steps turn out slower than they promised is dropped after a few steps. A K not yet observed in
a bucket costs its start-up figure scaled by what the observed ones there cost over their own
start-up figures, so both are in the same units (seconds of wall time; the start-up figures
of an eager engine are only relative). Plain steps are observed too: one as soon as a K > 0
has been in a bucket. A hiccup (a collector pause, a burst of admissions) only ever makes a
step slower, so a K's estimate starts as the faster of its first two sights, and a K seen once
runs again after one probe interval for its second; after that a K not chosen for 16 probe
intervals runs once more, so that an estimate taken before contexts grew does not decide for
good.

With `adaptive` off every step drafts max_draft_tokens (a fixed K, as benchmarks compare).
Knows nothing about tensors or the scheduler.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a decode step by (rows, K). Measured per graph bucket: a step of B rows costs
    what its bucket (the smallest >= B) costs, as it replays that bucket's graph padded."""

    buckets: tuple[int, ...]
    seconds: Mapping[tuple[int, int], float]  # (bucket, K) -> seconds; K = 0: the plain step
    sample_seconds_per_row: float = 0.0       # one seeded top-k/top-p draw over the vocabulary

    def __post_init__(self) -> None:
        if not self.buckets or any((b, 0) not in self.seconds for b in self.buckets):
            raise ValueError("step costs need the plain step (K = 0) of every bucket")

    @classmethod
    def relative(cls, max_draft_tokens: int, cost_per_draft: float = 0.15) -> StepCosts:
        """Unmeasured (eager engines): a step with K drafts costs 1 + cost_per_draft * K plain
        steps at every batch size."""
        return cls((1 << 30,), {(1 << 30, k): 1 + cost_per_draft * k for k in range(max_draft_tokens + 1)})

    def bucket(self, num_rows: int) -> int:
        return self.buckets[min(bisect.bisect_left(self.buckets, num_rows), len(self.buckets) - 1)]

    def __call__(self, num_rows: int, num_drafts: int, num_sampled: int = 0) -> float:
        """Seconds of a step of num_rows rows at K = num_drafts, num_sampled of them sampled."""
        graph = self.seconds[self.bucket(num_rows), num_drafts]
        return graph + num_sampled * (num_drafts + 1) * self.sample_seconds_per_row

    def as_dict(self) -> dict:
        """{"K=k": {bucket: seconds}, "sample_seconds_per_row": s} for stats and benchmarks."""
        table: dict = {}
        for (bucket, k), seconds in sorted(self.seconds.items()):
            table.setdefault(f"K={k}", {})[bucket] = seconds
        table["sample_seconds_per_row"] = self.sample_seconds_per_row
        return table


@dataclass
class AcceptanceEstimate:
    """One request's recent acceptance: conditional[i] = c_(i+1), and reach[i] = c_1 .. c_(i+1),
    the chance that its first i + 1 drafts are all accepted (so E(k) = 1 + reach[0] + .. +
    reach[k - 1])."""

    conditional: list[float]

    @property
    def reach(self) -> list[float]:
        return list(accumulate(self.conditional, mul))

    def record(self, num_drafted: int, num_accepted: int, smoothing: float) -> None:
        """A verify step drafted k and accepted a: depths 1..min(a + 1, k) were reached; each
        of them but a rejected one at depth a + 1 was accepted."""
        conditional = self.conditional
        for depth in range(min(num_accepted + 1, num_drafted)):
            conditional[depth] += smoothing * ((depth < num_accepted) - conditional[depth])


@dataclass
class DraftPolicy:
    max_draft_tokens: int
    costs: StepCosts
    adaptive: bool = True
    smoothing: float = 0.15
    initial_acceptance: float = 0.7  # every depth's conditional acceptance before any is seen
    # The engine-wide acceptance a new request starts from (`new_estimate`): every verify step's
    # outcome, smoothed slowly (`prior_smoothing`), so a model whose drafts rarely land does not
    # make each new request speculate its way down from initial_acceptance again.
    prior_smoothing: float = 0.02
    prior: AcceptanceEstimate | None = None  # set in __post_init__ (initial_acceptance at every depth)
    probe_interval: int = 16
    min_gain: float = 0.03  # the least relative gain in tokens/s a K > 0 must promise over K = 0
    steps_at_zero: int = 0  # steps in a row at K = 0 (a probe follows `probe_interval` of them)
    steps: int = 0          # steps chosen so far
    # The step at which each (bucket, K) was last chosen (stale estimates are probed again).
    last_chosen: dict[tuple[int, int], int] = field(default_factory=dict)
    observed_at: dict[tuple[int, int], int] = field(default_factory=dict)  # the step of each last sight
    # Observed wall seconds of a step by (bucket, K), sampled rows' draws included, and the
    # sights behind each estimate (1 or 2: the first two are treated apart).
    observed: dict[tuple[int, int], float] = field(default_factory=dict)
    sights: dict[tuple[int, int], int] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)  # steps run at each K, probes included (stats)
    pinned: int | None = None  # every step runs this K where it fits (`pin`), whatever it costs

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError("a draft policy needs max_draft_tokens >= 1 (0: no speculation, no policy)")
        if not 0 < self.smoothing <= 1 or not 0 < self.prior_smoothing <= 1 or not 0 <= self.initial_acceptance <= 1 \
                or self.probe_interval < 1 or self.min_gain < 0:
            raise ValueError("smoothing and prior_smoothing in (0, 1], initial_acceptance in [0, 1], "
                             "probe_interval >= 1, min_gain >= 0")
        if self.prior is None:
            self.prior = AcceptanceEstimate([self.initial_acceptance] * self.max_draft_tokens)

    def observe(self, num_rows: int, num_drafts: int, seconds: float) -> None:
        """The wall time of a step run back to back with the one before it. The first sight,
        and the first after 16 probe intervals without one (a stale estimate's probe), are
        taken as they are (the first puts the start-up figures, maybe in other units, on the
        wall-time scale); the second replaces the first if faster. After that a moving average,
        in which a step that took more than twice the estimate (a collector pause, a host
        hiccup) counts as twice it: one outlier must not price a K out."""
        key = self.costs.bucket(num_rows), num_drafts
        previous = self.observed.get(key)
        stale = self.steps - self.observed_at.get(key, self.steps) >= 16 * self.probe_interval
        if previous is None or stale:
            self.observed[key], self.sights[key] = seconds, 1
        elif self.sights[key] == 1:
            self.observed[key], self.sights[key] = min(previous, seconds), 2
        else:
            self.observed[key] = previous + self.smoothing * (min(seconds, 2 * previous) - previous)
        self.observed_at[key] = self.steps

    def snapshot(self) -> dict:
        """What the policy knows and did, for stats and metrics: {"steps": {K: steps chosen},
        "step_seconds": {(bucket, K): the cost it prices a step at}} over the observed (bucket, K)."""
        return {"steps": dict(sorted(self.chosen.items())), "step_seconds": dict(sorted(self.observed.items()))}

    def fresh(self) -> DraftPolicy:
        """The same policy with nothing observed (after the start-up warm-up): no step costs,
        and the prior back at initial_acceptance."""
        return dataclasses.replace(self, steps_at_zero=0, steps=0, last_chosen={}, observed={}, observed_at={},
                                   sights={}, chosen={}, prior=None)

    def pin(self, num_drafts: int) -> DraftPolicy:
        """A fresh copy that runs num_drafts (0..max_draft_tokens) on every step where the rows'
        room and the step's budget allow: the start-up warm-up's way to each draft count."""
        if not 0 <= num_drafts <= self.max_draft_tokens:
            raise ValueError(f"pin: 0..{self.max_draft_tokens} drafts, got {num_drafts}")
        return dataclasses.replace(self.fresh(), pinned=num_drafts)

    def cost(self, num_rows: int, num_drafts: int, num_sampled: int) -> float:
        bucket = self.costs.bucket(num_rows)
        observed = self.observed.get((bucket, num_drafts))
        if observed is not None:
            return observed
        # Scale: observed / start-up cost of the K observed in this bucket (1 when none is).
        ratios = [seconds / self.costs(num_rows, k, num_sampled)
                  for (b, k), seconds in self.observed.items() if b == bucket]
        scale = sum(ratios) / len(ratios) if ratios else 1.0
        return self.costs(num_rows, num_drafts, num_sampled) * scale

    def new_estimate(self) -> AcceptanceEstimate:
        """A new request's acceptance estimate: the engine-wide prior as it stands."""
        return AcceptanceEstimate(list(self.prior.conditional))

    def record(self, outcomes: Iterable[tuple[AcceptanceEstimate, int, int]]) -> None:
        """A step's verify outcomes (each row's request estimate, drafts, accepted drafts), in
        row order: into each request's estimate and the prior."""
        smoothing, prior, prior_smoothing = self.smoothing, self.prior, self.prior_smoothing
        for estimate, num_drafted, num_accepted in outcomes:
            estimate.record(num_drafted, num_accepted, smoothing)
            prior.record(num_drafted, num_accepted, prior_smoothing)

    def choose(self, estimates: Sequence[AcceptanceEstimate], rooms: Sequence[int], limit: int,
               num_sampled: int = 0) -> int:
        """K for a step of these rows (their estimates, and the drafts room_r each may take);
        limit: the most K the step's token budget allows; num_sampled: rows that sample."""
        top = min(self.max_draft_tokens if self.pinned is None else self.pinned, limit, max(rooms, default=0))
        if top <= 0:
            return 0
        if not self.adaptive or self.pinned is not None:
            self.chosen[top] = self.chosen.get(top, 0) + 1
            return top
        # gains[i]: expected tokens that depth i + 1 adds over the batch.
        gains = [0.0] * top
        for estimate, room in zip(estimates, rooms):
            for i, reach in enumerate(estimate.reach[:min(room, top)]):
                gains[i] += reach
        num_rows = len(estimates)
        plain = num_rows / self.cost(num_rows, 0, num_sampled)
        best, best_value, tokens = 0, plain * (1 + self.min_gain), float(num_rows)
        for k in range(1, top + 1):
            tokens += gains[k - 1]
            value = tokens / self.cost(num_rows, k, num_sampled)
            if value > best_value:
                best, best_value = k, value
        if best == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero > self.probe_interval:
                best = 1
        else:
            best = self._stale_probe(num_rows, best, top)
        if best:
            self.steps_at_zero = 0
        self.steps += 1
        self.last_chosen[self.costs.bucket(num_rows), best] = self.steps
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def _stale_probe(self, num_rows: int, best: int, top: int) -> int:
        """The K to run instead of `best` to refresh what the policy knows of its cost: K = 0
        once a K > 0 has been observed in the bucket and K = 0 has not (the start-up figures may
        be in other units), a K seen once and not chosen for a probe interval (its second
        sight), and any K not chosen for 16 probe intervals, whose estimate is therefore stale
        (a K not chosen is not observed again). Else `best`."""
        bucket = self.costs.bucket(num_rows)
        if (bucket, 0) not in self.observed:
            return 0 if any(b == bucket for b, _ in self.observed) else best
        for k in range(top + 1):
            key = bucket, k
            if k == best or key not in self.observed:
                continue
            horizon = self.probe_interval if self.sights[key] == 1 else 16 * self.probe_interval
            if self.steps - self.last_chosen.get(key, 0) >= horizon:
                return k
        return best
