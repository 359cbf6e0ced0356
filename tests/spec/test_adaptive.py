"""Adaptive draft length (spec/adaptive.py) without an engine: the per-depth acceptance
estimate, the draft policy's choice of K (the most expected tokens per second, checked against a
direct search over every K), its probes after turning speculation off, and observed step costs
replacing the measured ones."""

import random

import pytest

from deltaspec.spec import AcceptanceEstimate, DraftPolicy, StepCosts


def test_acceptance_estimate_follows_each_depth():
    """A verify of k drafts that accepted a saw depths 1..min(a + 1, k): accepted up to a, the
    next rejected; deeper ones unseen keep their estimate."""
    estimate = AcceptanceEstimate([0.5, 0.5, 0.5])
    estimate.record(3, 1, smoothing=0.5)   # depth 1 accepted, depth 2 rejected, depth 3 unseen
    assert estimate.conditional == [0.75, 0.25, 0.5]
    assert estimate.reach == pytest.approx([0.75, 0.1875, 0.09375])
    estimate.record(0, 0, smoothing=0.5)   # a step without drafts observes nothing
    assert estimate.conditional == [0.75, 0.25, 0.5]


def _best_by_search(seconds, per_row, estimates, rooms, top, num_sampled, min_gain):
    """Evaluate value(K) = sum_r E_r(min(K, room_r)) / cost(B, K) for every K directly: cost
    from the bucket B pads to plus S (K + 1) sampled draws; K > 0 must beat K = 0 by min_gain."""
    bucket = min(b for b, _ in seconds if b >= len(estimates))
    values = []
    for k in range(top + 1):
        tokens = 0.0
        for estimate, room in zip(estimates, rooms):
            product, expected = 1.0, 1.0
            for c in estimate.conditional[:min(k, room)]:
                product *= c
                expected += product
            tokens += expected
        values.append(tokens / (seconds[bucket, k] + num_sampled * (k + 1) * per_row))
    best = max(range(1, top + 1), key=lambda k: (values[k], -k)) if top else 0
    return best if top and values[best] > values[0] * (1 + min_gain) else 0


@pytest.mark.parametrize("seed", range(6))
def test_draft_policy_picks_the_most_tokens_per_second(seed):
    rng = random.Random(seed)
    max_drafts = rng.randint(1, 6)
    buckets = (1, 2, 4, 8, 16)
    seconds = {(b, k): (1 + 0.05 * b) * (1 + rng.uniform(0.02, 0.6) * k) for b in buckets for k in range(max_drafts + 1)}
    per_row = rng.choice([0.0, 0.01])
    costs = StepCosts(buckets, seconds, per_row)
    min_gain = rng.choice([0.0, 0.05])
    policy = DraftPolicy(max_drafts, costs, probe_interval=10**9, min_gain=min_gain)
    for _ in range(50):
        rows = rng.randint(1, 16)
        estimates = [AcceptanceEstimate([rng.random() for _ in range(max_drafts)]) for _ in range(rows)]
        rooms = [rng.choice([0, 1, max_drafts, max_drafts]) for _ in range(rows)]
        limit = rng.randint(0, max_drafts + 1)
        num_sampled = rng.randint(0, rows)
        top = min(max_drafts, limit, max(rooms))
        expected = _best_by_search(seconds, per_row, estimates, rooms, top, num_sampled, min_gain)
        assert policy.choose(estimates, rooms, limit, num_sampled) == expected


def test_a_pinned_policy_runs_its_k_wherever_it_fits():
    """pin(k): every step runs k drafts, less only where the rows' room or the step's budget
    stop it, whatever the costs and acceptance say (0: never drafts); out of range refused."""
    costs = StepCosts((1, 4), {(b, k): 1.0 + k for b in (1, 4) for k in range(4)}, 0.0)
    policy = DraftPolicy(3, costs)
    low = [AcceptanceEstimate([0.01] * 3)] * 2  # an adaptive policy would not draft at all
    for k in range(4):
        pinned = policy.pin(k)
        assert pinned.observed == {} and pinned.adaptive
        assert [pinned.choose(low, [3, 3], 3) for _ in range(40)] == [k] * 40
        assert pinned.choose(low, [1, 0], 3) == min(k, 1) and pinned.choose(low, [3, 3], 2) == min(k, 2)
    assert policy.choose(low, [3, 3], 3) == 0
    with pytest.raises(ValueError, match="0..3"):
        policy.pin(4)


def test_draft_policy_turns_off_probes_and_grows_back():
    costs = StepCosts.relative(4, cost_per_draft=0.3)
    policy = DraftPolicy(4, costs, probe_interval=5)
    good, bad = AcceptanceEstimate([0.95] * 4), AcceptanceEstimate([0.05] * 4)
    assert policy.choose([good], [4], limit=100) == 4
    chosen = [policy.choose([bad], [4], limit=100) for _ in range(12)]
    assert chosen == [0] * 5 + [1] + [0] * 5 + [1]      # a probe after every 5 steps at K = 0
    assert policy.chosen == {4: 1, 0: 10, 1: 2} and policy.fresh().chosen == {}
    cheap = DraftPolicy(4, StepCosts.relative(4, cost_per_draft=0.05))
    assert cheap.choose([good, good], [4, 2], limit=100) == 4  # rooms cap rows, not the step
    assert cheap.choose([good], [4], limit=2) == 2             # the token budget caps the step
    assert policy.choose([good], [0], limit=100) == 0
    fixed = DraftPolicy(3, costs, adaptive=False)
    assert fixed.choose([bad], [3], limit=100) == 3 and fixed.choose([bad], [1], limit=100) == 1
    with pytest.raises(ValueError):
        StepCosts((1, 2), {(1, 0): 1.0})


def test_observed_step_costs_replace_the_measured_ones():
    """Start-up costs time the device alone; steps that really cost more (a busy host) are
    observed, and a K that does not pay in wall time is dropped while plain steps stay."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=10**9)
    rows = [AcceptanceEstimate([0.9] * 3)] * 4
    assert policy.choose(rows, [3] * 4, limit=100) == 3
    policy.observe(4, 0, 1.0)
    # Each K tried turns out to cost 4 plain steps: the policy steps down, and once two of them
    # have shown the start-up figures 3x too low, K = 1 (scaled likewise) is not worth a try.
    for k, then in ((3, 2), (2, 0)):
        policy.observe(4, k, 4.0)
        assert policy.choose(rows, [3] * 4, limit=100) == then
    policy.observe(4, 3, 1.5)   # K = 3 got cheap again (observed on a probe): back to it
    assert policy.choose(rows, [3] * 4, limit=100) == 3


def test_unobserved_costs_are_scaled_to_the_observed_ones():
    """Start-up costs in other units (relative, or device time only) are scaled by the observed
    ones of the same bucket: a K = 3 observed at 40x its start-up figure makes K = 0, not yet
    observed, cost 40x its own, and K = 3 keeps winning only if its tokens pay for that."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=10**9)
    good = [AcceptanceEstimate([0.9] * 3)] * 4
    poor = [AcceptanceEstimate([0.1] * 3)] * 4
    policy.observe(4, 3, 1.3 * 40)       # seconds, against a relative start-up cost of 1.3
    assert policy.cost(4, 0, 0) == pytest.approx(1.0 * 40)
    assert policy.cost(64, 0, 0) == pytest.approx(1.0 * 40)   # one bucket for the relative table
    assert policy.choose(good, [3] * 4, limit=100) == 0       # the plain probe (test below)
    policy.observe(4, 0, 40.0)
    assert policy.choose(good, [3] * 4, limit=100) == 3
    assert policy.choose(poor, [3] * 4, limit=100) == 0


COSTS = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}  # wall seconds of a step by K (4 rows)


def run_policy(policy: DraftPolicy, rows: list, steps: int) -> list[int]:
    """The Ks a policy chooses over `steps` steps that each cost COSTS[K], observed as the
    engine observes them."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(rows, [3] * len(rows), limit=100)
        chosen.append(k)
        policy.observe(len(rows), k, COSTS[k])
    return chosen


def test_plain_steps_are_observed_too():
    """Once a K > 0 has been observed in a bucket, the next step is a plain one (its wall time
    unknown), again one probe interval later (its second sight), and later whenever K = 0 has
    not run for 16 probe intervals."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=2)
    rows = [AcceptanceEstimate([0.9] * 3)] * 4
    assert run_policy(policy, rows, 2) == [3, 0]              # K = 0 never seen here: probe it
    chosen = run_policy(policy, rows, 40)
    assert chosen[:3] == [3, 3, 0]                            # its second sight
    assert chosen[3:35] == [3] * 32 and chosen[35] == 0       # 32 steps after the last plain one


def test_a_k_priced_out_by_one_bad_sight_is_tried_again():
    """K = 3 first observed during a hiccup looks too costly and K = 1 runs; after 16 probe
    intervals K = 3 runs once more, is seen at its real cost, and wins again."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=2)
    rows = [AcceptanceEstimate([0.9] * 3)] * 4
    for k, seconds in ((0, 1.0), (3, 20.0), (2, 20.0), (1, 1.1)):
        policy.observe(4, k, seconds)
    chosen = run_policy(policy, rows, 40)
    # K = 1 wins on the first sights; K = 3, seen once, runs again after one probe interval,
    # at its real cost, and wins from then on (until the stale probes, 16 intervals later).
    assert chosen[0] == 1 and chosen.index(3) <= 2 * policy.probe_interval
    assert chosen[6:30] == [3] * 24


def test_a_slow_first_sight_does_not_price_a_k_out():
    """A first sight during a hiccup (2.5x the real cost) is replaced by the second, which the
    policy takes after one probe interval (K = 0, also seen once, is checked first): K = 3 wins
    from then on."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=4)
    rows = [AcceptanceEstimate([0.9] * 3)] * 4
    policy.observe(4, 0, COSTS[0])
    policy.observe(4, 3, 2.5 * COSTS[3])
    chosen = run_policy(policy, rows, 30)
    first = chosen.index(3)
    assert 0 < first <= policy.probe_interval + 1 and chosen[first:] == [3] * (30 - first)


def test_one_slow_step_does_not_price_a_k_out():
    """An observed step more than twice the estimate (a collector pause) counts as twice it."""
    policy = DraftPolicy(3, StepCosts.relative(3, cost_per_draft=0.1), probe_interval=10**9)
    policy.observe(4, 3, 1.0)
    policy.observe(4, 3, 50.0)                 # a second sight only lowers the first
    assert policy.cost(4, 3, 0) == pytest.approx(1.0)
    policy.observe(4, 3, 50.0)
    assert policy.cost(4, 3, 0) == pytest.approx(1.0 + policy.smoothing * (2.0 - 1.0))
    policy.observe(4, 3, 0.5)
    assert policy.cost(4, 3, 0) < 1.3


def test_new_requests_start_from_what_the_engine_saw():
    """The prior: every verify outcome, smoothed slowly. A model whose drafts rarely land makes
    new requests start low (no speculating their way down again); fresh() forgets it."""
    costs = StepCosts.relative(3, cost_per_draft=0.15)
    policy = DraftPolicy(3, costs, prior_smoothing=0.1)
    assert policy.new_estimate().conditional == [0.7] * 3
    first = policy.new_estimate()
    assert policy.choose([first], [3], limit=100) == 3
    for _ in range(20):
        policy.record([(first, 3, 0), (first, 3, 0)])  # every first draft rejected, two rows a step
    assert first.conditional[0] < 0.01 and 0.005 < policy.prior.conditional[0] < 0.02
    assert policy.prior.conditional[1:] == [0.7, 0.7]  # depths never reached keep the initial value
    assert policy.choose([policy.new_estimate()], [3], limit=100) == 0
    assert policy.fresh().new_estimate().conditional == [0.7] * 3
    with pytest.raises(ValueError, match="prior_smoothing"):
        DraftPolicy(3, costs, prior_smoothing=0)
