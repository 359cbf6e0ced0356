"""Async scheduling (EngineCore.dispatch + Scheduler.continuation): step n+1 is launched before
step n's tokens reach the host, its rows fed those tokens on the device (a decode row's, or the
first token of a prompt step n finished), with the requests waiting admitted beside them.
Output must be exactly what the step-by-step engine produces: with requests that stop on stop
tokens (an unpredictable finish while the next step is already in flight), max_tokens
finishes, staggered arrivals, aborts, seeded sampling, log-probabilities and prefix-cache
restores. A request that stops while its next step is in flight keeps a checkpoint of every
token it has."""

import random
import statistics
import time

import pytest
import torch

from deltaspec.engine import EngineConfig, SamplingParams
from deltaspec.engine.core import EngineCore
from deltaspec.engine.runner import InFlight
from deltaspec.engine.step import StepOutput
from fixtures import assert_idle
from harness import Job, LaunchCounter, run_staggered

VOCAB = 512
OPTIONS = dict(max_num_batched_tokens=256, max_num_seqs=8, checkpoint_interval=64)


def stopping_jobs(n: int, seed: int) -> list[Job]:
    """Jobs that often stop on one of 12 stop tokens (each step stops with ~2% chance)."""
    rng = random.Random(seed)
    stops = tuple(rng.sample(range(VOCAB), 12))
    jobs = []
    for i in range(n):
        sampled = rng.random() < 0.5
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.8 if sampled else 0.0,
                                top_p=0.95, seed=rng.randint(0, 2**31) if sampled else None, stop_token_ids=stops,
                                logprobs=2 if rng.random() < 0.2 else None)
        abort_after = rng.randint(1, 6) if rng.random() < 0.15 else None
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, rng.randint(2, 30), rng.randint(31, 200)]))]
        jobs.append(Job(prompt, params, rng.randint(0, 2 * n), abort_after))
    return jobs


@pytest.mark.parametrize("n", [2, 12])
def test_async_scheduling_matches_step_by_step(family, checkpoint, n):
    """Same tokens, finish reasons, text and log-probabilities (to float32 rounding: batches are
    composed differently) as without async scheduling, aborted requests included: an abort
    takes effect when the step in flight is committed, which then drops the request's token."""
    path = checkpoint(family)
    jobs = stopping_jobs(n, seed=n)
    results = {}
    for async_scheduling in (False, True):
        core = EngineCore(EngineConfig(model=path, async_scheduling=async_scheduling, **OPTIONS))
        counter = LaunchCounter(core)
        results[async_scheduling] = run_staggered(core, jobs)
        assert_idle(core.stats())
        assert counter.fed_steps == 0 or async_scheduling
        if async_scheduling and max(len(r.output_token_ids) for r in results[True].values()) > 8:
            assert counter.fed_steps > 0
        if async_scheduling and n > 2:
            # Requests arriving while others decode are admitted by a step launched ahead, and
            # the step after it is fed their first tokens.
            assert counter.admitting_fed_steps > 0 and counter.fed_first_tokens > 0
    for i in range(n):
        ours, reference = results[True][i], results[False][i]
        assert (ours.output_token_ids, ours.finish_reason, ours.text) == \
            (reference.output_token_ids, reference.finish_reason, reference.text)
        assert len(ours.output_logprobs) == len(reference.output_logprobs)
        for a, b in zip(ours.output_logprobs, reference.output_logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert any(r.finish_reason == "stop" for r in results[True].values())


def test_an_abort_takes_effect_at_the_next_step(checkpoint):
    """With the next step already in flight, an abort still frees everything at the next step
    and the request gets no token after it."""
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), **OPTIONS))
    counter = LaunchCounter(core)
    request = core.add_request(list(range(1, 40)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    while len(request.output_token_ids) < 6:
        core.step()
    assert counter.fed_steps > 0  # the step after the current one is in flight
    produced = list(request.output_token_ids)
    core.abort(request.request_id)
    core.step()
    assert request.finish_reason == "abort" and request.output_token_ids == produced
    assert not core.has_work
    assert_idle(core.stats())


def cached_and_plain(path) -> tuple[EngineCore, EngineCore, LaunchCounter]:
    """An engine with the prefix cache and async scheduling (its launches counted), and the
    reference: one with neither."""
    cached = EngineCore(EngineConfig(model=path, **OPTIONS))
    plain = EngineCore(EngineConfig(model=path, enable_prefix_cache=False, async_scheduling=False, **OPTIONS))
    return cached, plain, LaunchCounter(cached)


def test_a_request_stopped_in_flight_keeps_every_token(checkpoint):
    """A chat whose turns end on a stop token while the next step is in flight: the kept
    checkpoint covers the whole turn (the stop token included), and the next turn restores it
    and answers exactly as an engine without a cache."""
    path = checkpoint("qwen3_5")
    rng = random.Random(5)
    cached, plain, counter = cached_and_plain(path)
    conversation = [rng.randrange(VOCAB) for _ in range(70)]
    stopped = 0
    for turn in range(5):
        # Stop on the greedy answer's 4th token: the turn stops mid-stream, with its next step in flight.
        probe = plain.add_request(conversation, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while plain.has_work:
            plain.step()
        params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(probe.output_token_ids[-1],))
        answers = []
        for core in (cached, plain):
            reused_before = core.stats()["prefix_cache"]["reused_tokens"]
            request = core.add_request(conversation, params)
            while core.has_work:
                core.step()
            answers.append((request.output_token_ids, request.finish_reason))
            if core is cached and turn:
                # Everything but the new user message comes from the previous turn's checkpoint.
                assert core.stats()["prefix_cache"]["reused_tokens"] - reused_before == len(previous)
        assert answers[0] == answers[1]
        stopped += answers[0][1] == "stop"
        previous = conversation + answers[0][0]
        conversation = previous + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))]
    assert stopped >= 3 and counter.fed_steps > 0
    assert_idle(cached.stats())


def test_admissions_launched_ahead_restore_cached_prefixes(checkpoint):
    """Chat turns that arrive while another request decodes are admitted by a step launched
    ahead of the one in flight, restoring the previous turn's checkpoint (kept when that turn
    finished), and the step after it is fed their first token: the answers, greedy and seeded
    samples, equal an engine's without a cache or async scheduling."""
    path = checkpoint("qwen3_5")
    rng = random.Random(7)
    cached, plain, counter = cached_and_plain(path)
    background = [rng.randrange(VOCAB) for _ in range(40)]
    for core in (cached, plain):
        core.add_request(background, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        core.step()
    conversation = [rng.randrange(VOCAB) for _ in range(70)]
    for turn in range(4):
        params = SamplingParams(max_tokens=rng.randint(2, 12), temperature=0.7 * (turn % 2), seed=turn,
                                ignore_eos=True)
        answers = []
        for core in (cached, plain):
            reused_before = core.stats()["prefix_cache"]["reused_tokens"]
            request = core.add_request(conversation, params)
            while not request.finished:
                core.step()
            answers.append(request.output_token_ids)
            if core is cached and turn:
                # At least the previous turn's prompt (its finished answer's last token was
                # never fed: a "length" finish keeps the state before it).
                assert core.stats()["prefix_cache"]["reused_tokens"] - reused_before >= len(previous)
        assert answers[0] == answers[1]
        previous = conversation
        conversation = previous + answers[0] + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))]
    assert counter.admitting_fed_steps >= 4 and counter.fed_first_tokens >= 4
    for core in (cached, plain):
        assert core.has_work  # the background request was decoding throughout
        for request_id in list(core.requests):
            core.abort(request_id)
        while core.has_work:
            core.step()
        assert_idle(core.stats())


def test_rows_fed_a_first_token_catch_up_over_clean_padding(checkpoint):
    """A row fed its request's first token catches the MTP up over one real position; the
    catch-up's padding positions take zeros as ids, as a packed row's, not whatever earlier
    steps left in the outputs' columns: an engine whose outputs start poisoned writes the same
    MTP KV cache (short answers keep the padding positions' entries to the end)."""
    path = checkpoint("qwen3_5")
    rng = random.Random(11)
    background = [rng.randrange(VOCAB) for _ in range(30)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(6)]

    def run(poisoned: bool) -> tuple[list, torch.Tensor]:
        core = EngineCore(EngineConfig(model=path, num_draft_tokens=3, adaptive_draft_length=False, **OPTIONS))
        if poisoned:
            core.runner.decode.outputs.random_(1, VOCAB)
        counter = LaunchCounter(core)
        core.add_request(background, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        requests = []
        for prompt in prompts:
            core.step()
            requests.append(core.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        while core.has_work:
            core.step()
        assert counter.fed_first_tokens >= 3
        mtp = core.kv.layers[len(core.model_config.attention_layer_ids)]
        return [r.output_token_ids for r in requests], torch.stack([mtp.k_cache[1:], mtp.v_cache[1:]])

    tokens, kv = run(poisoned=False)
    poisoned_tokens, poisoned_kv = run(poisoned=True)
    assert tokens == poisoned_tokens
    torch.testing.assert_close(poisoned_kv, kv, rtol=0, atol=0)


def test_wait_tells_once_the_step_and_the_one_ahead_are_launched(checkpoint):
    """Dispatched.wait(on_device) calls on_device once, before it reads the step's tokens and
    after launching the step launched ahead (AsyncLLM hands the last step's deltas out then),
    the prefill too: it launches the first decode step, fed its first token, before it reads."""
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), **OPTIONS))
    events, launch = [], core.runner.launch

    def launching(plan):
        events.append("launch")
        launched = launch(plan)
        read = launched.result

        def reading():
            events.append("read")
            return read()

        launched.result = reading
        return launched

    core.runner.launch = launching
    core.add_request(list(range(1, 40)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    kinds = []
    while core.has_work:
        events.clear()
        step = core.dispatch()
        core.commit(step.plan, step.wait(lambda: events.append("told")))
        kinds.append(tuple(events))
    assert kinds[0] == ("launch", "launch", "told", "read")  # the prefill and the step after it
    # Every step tells after its launches, before it reads; later ones were launched by the step
    # before (only the next is launched).
    assert all(kind[-2:] == ("told", "read") for kind in kinds)
    assert ("launch", "launch", "told", "read") in kinds and ("launch", "told", "read") in kinds


class _TimedRunner:
    """Stands in for the Runner: each step's tokens at once, its launch taking LAUNCH_SECONDS
    of host time by K (the speculative launch dearer, as on the GPU)."""

    LAUNCH_SECONDS = {0: 0.002, 1: 0.012}

    def __init__(self) -> None:
        self.random = random.Random(0)

    def launch(self, plan) -> InFlight:
        time.sleep(self.LAUNCH_SECONDS[max((r.num_draft_tokens for r in plan.decode_rows), default=0)])
        output = self.run(plan)
        return InFlight(plan, lambda masks: lambda: output)

    def run(self, plan) -> StepOutput:
        emitted = [[self.random.randrange(VOCAB) for _ in range(r.num_draft_tokens + 1)] for r in plan.decode_rows]
        emitted += [[self.random.randrange(VOCAB)] if r.sample else [] for r in plan.prefill_rows + plan.cached_rows]
        pending = [r.num_draft_tokens for r in plan.decode_rows] + [0] * len(plan.prefill_rows + plan.cached_rows)
        return StepOutput(emitted, num_pending=pending)


def test_a_lone_step_of_another_k_is_priced_at_its_own_host_work(checkpoint):
    """The draft policy prices each K by the wall time of its steps run back to back. A launched
    step's wait launches the step after it, so that time holds its neighbour's launch: a plain
    probe among speculative steps would be priced at a speculative launch, and the policy
    would keep drafting where plain steps are faster. Each observed step must cost its own
    launch: about 2 ms at K = 0 and 12 ms at K = 1 here, whatever runs around it."""
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), device="cpu", num_draft_tokens=1,
                                   enable_prefix_cache=False, **OPTIONS))
    core.runner = _TimedRunner()
    policy = core.scheduler.draft_policy
    script = iter([1] * 6 + [0] + [1] * 6 + [0, 0, 0] + [1] * 40)
    policy.choose = lambda *args, **kwargs: next(script)
    observed: list[tuple[int, float]] = []
    policy.observe = lambda num_rows, num_drafts, seconds: observed.append((num_drafts, seconds))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(4):
        core.add_request([1 + i, 2, 3], params)
    while core.has_work:
        core.step()
    by_k = {k: [s for kk, s in observed if kk == k] for k in (0, 1)}
    assert len(by_k[0]) >= 2 and len(by_k[1]) >= 8
    # Medians: a loaded machine may stretch a step or two (the neighbour's launch adds 10 ms).
    assert 0.002 <= statistics.median(by_k[0]) < 0.008, by_k[0]
    assert 0.012 <= statistics.median(by_k[1]) < 0.018, by_k[1]
