"""Engine core: the isolation harness (every request's output in a batch equals its output
alone), abort, preemption, input validation, the scheduler's invariants, and AsyncLLM."""

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch

from deltaspec.engine import AsyncLLM, EngineConfig, EngineDeadError, SamplingParams, StepFailedError
from deltaspec.engine import async_llm
from deltaspec.engine.core import EngineCore
from deltaspec.engine.request import RequestStatus
from fixtures import assert_idle
from harness import Job, assert_all_free, check_isolation, make_jobs, run_alone, run_staggered


@pytest.mark.parametrize("n, max_num_seqs", [(1, 8), (2, 8), (3, 8), (4, 8), (8, 8), (16, 8),
                                             pytest.param(64, 16, marks=pytest.mark.slow),
                                             pytest.param(64, 64, marks=pytest.mark.slow)])
def test_isolation(family, checkpoint, n, max_num_seqs):
    check_isolation(checkpoint(family), n, seed=n + max_num_seqs, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=256, num_draft_tokens=0)


def test_preemption_gives_identical_output(checkpoint):
    """A KV pool that holds about three requests at once: the newest are preempted, recompute,
    and finish with the output of an unconstrained run."""
    path = checkpoint("qwen3_5")
    jobs = [Job(random.Random(i).choices(range(512), k=60 + 10 * i),
                SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True), 0, None)
            for i in range(8)]
    free = EngineCore(EngineConfig(model=path, max_num_seqs=8))
    expected = [r.output_token_ids for r in run_staggered(free, jobs).values()]
    tight = EngineCore(EngineConfig(model=path, max_num_seqs=8, num_kv_blocks=22))
    got = run_staggered(tight, jobs)
    assert tight.stats()["num_preempted"] > 0
    assert [got[i].output_token_ids for i in range(8)] == expected
    assert_all_free(tight)


@pytest.mark.parametrize("num_kv_blocks", [None, 24], ids=["slots", "kv-blocks"])
def test_priority_scheduling(checkpoint, num_kv_blocks):
    """scheduling_policy "priority" (vLLM's): the queue is served by (priority, arrival), and a
    request that outranks running ones takes the place of the last-ranked (no sequence slot
    under max_num_seqs, or not the KV blocks of its first chunk), which recomputes and still
    gives its output alone; the same engine without the option refuses a priority."""
    path = checkpoint("qwen3_5")
    rng = random.Random(8)
    prompts = [rng.choices(range(512), k=70) for _ in range(5)]

    def params(priority: int, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=30, temperature=0.7 if seed % 2 else 0.0, seed=seed, ignore_eos=True,
                              priority=priority)

    # Priorities 5, 5 run first; 9, 1 and 3 arrive later: 1 and 3 take the places of the 5s (of
    # the later one at least: three requests' blocks fit the small pool), 9 waits.
    jobs = [Job(prompts[i], params(priority, i), step, None)
            for i, (priority, step) in enumerate([(5, 0), (5, 0), (9, 3), (1, 3), (3, 4)])]
    core = EngineCore(EngineConfig(model=path, max_num_seqs=2 if num_kv_blocks is None else 5,
                                   num_kv_blocks=num_kv_blocks, scheduling_policy="priority", num_draft_tokens=0))
    alone = [run_alone(core, job) for job in jobs]
    core.scheduler.reset_counters()
    firsts: dict[int, int] = {}
    requests, step = {}, 0
    while len(requests) < len(jobs) or core.has_work:
        for i, job in enumerate(jobs):
            if i not in requests and job.arrival_step <= step:
                requests[i] = core.add_request(job.prompt, job.params)
        core.step()
        step += 1
        for i, request in requests.items():
            if request.finished:
                firsts.setdefault(i, step)
    assert [requests[i].output_token_ids for i in range(5)] == alone
    assert core.stats()["num_preempted"] > 0
    # 1 and 3 finish before the 5 that arrived last (preempted for them), 9 after everything.
    assert max(firsts[3], firsts[4]) < firsts[1] and firsts[2] == max(firsts.values())
    assert_all_free(core)
    fcfs = EngineCore(EngineConfig(model=path))
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        fcfs.add_request([1, 2], SamplingParams(priority=1))
    assert not fcfs.has_work


def test_request_that_can_never_fit_is_refused(checkpoint):
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), num_kv_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request(list(range(1, 60)), SamplingParams(max_tokens=10))
    assert not core.has_work


def test_bad_input_changes_nothing(checkpoint):
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), max_model_len=64))
    good = core.add_request([5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    before = core.stats()
    for prompt in ([], list(range(1, 80)), [1, 2, 512], [-1]):
        with pytest.raises(ValueError):
            core.add_request(prompt, SamplingParams())
    for options in ({"max_tokens": 0}, {"max_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.01},
                    {"top_k": 2**31}, {"seed": 2**63}):  # past the sampler's int32 / int64
        with pytest.raises(ValueError):
            core.add_request([1, 2], SamplingParams(**options))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request([1, 2], SamplingParams(), request_id=good.request_id)
    assert core.stats() == before
    while core.has_work:
        core.step()
    assert len(good.output_token_ids) == 5
    assert_all_free(core)


def test_scheduler_never_hands_out_slot_or_block_zero_and_respects_budget(checkpoint):
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), max_num_seqs=4, max_num_batched_tokens=32,
                                   num_draft_tokens=0))
    for i in range(6):
        core.add_request(list(range(1, 2 + 13 * i)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while core.has_work:
        plan = core.schedule()
        assert plan.num_tokens <= 32
        assert len(plan.rows) <= 4
        assert all(len(r.token_ids) == 1 for r in plan.decode_rows)
        for row in plan.rows:
            assert row.slot != 0 and 0 not in row.block_table
        core.commit(plan, core.run(plan))
    assert_all_free(core)


def test_preempted_mid_prefill_request_gets_no_row(checkpoint):
    """Growing one prefill chunk preempts a newer request that is also mid-prompt: it goes back
    to the queue (once) and gets no row in that step, and every output equals its output alone."""
    path = checkpoint("qwen3_5")
    # A configuration where the step after admission grows the oldest prefill into the blocks of
    # a newer one (found by searching small configurations of the pure-Python scheduler).
    jobs = [Job(random.Random(i).choices(range(512), k=length), SamplingParams(max_tokens=16, temperature=0.0,
                                                                                ignore_eos=True), 0, None)
            for i, length in enumerate([40, 200, 130, 100])]
    core = EngineCore(EngineConfig(model=path, max_num_seqs=4, max_num_batched_tokens=80, num_kv_blocks=18,
                                   enable_prefix_cache=False, num_draft_tokens=0))
    alone = [run_alone(core, job) for job in jobs]
    requests = [core.add_request(job.prompt, job.params) for job in jobs]
    while core.has_work:
        plan = core.schedule()
        assert all(row.request.status is RequestStatus.RUNNING and row.slot is not None for row in plan.rows)
        assert len(set(map(id, core.scheduler.waiting))) == len(core.scheduler.waiting)
        core.commit(plan, core.run(plan))
    assert core.stats()["num_preempted"] > 0
    assert [r.output_token_ids for r in requests] == alone
    assert_all_free(core)


def test_long_prompt_does_not_stall_decodes(checkpoint):
    """Chunked prefill: while a 300-token prompt is prefilled in 32-token chunks, the running
    request still decodes one token every step."""
    core = EngineCore(EngineConfig(model=checkpoint("qwen3_5"), max_num_seqs=2, max_num_batched_tokens=33,
                                   num_draft_tokens=0))
    short = core.add_request([1, 2, 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    core.step()
    core.add_request(list(range(100, 400)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for _ in range(9):
        plan = core.schedule()
        assert [r.request for r in plan.decode_rows] == [short]
        assert plan.prefill_rows and len(plan.prefill_rows[0].token_ids) == 32
        core.commit(plan, core.run(plan))


# AsyncLLM ---------------------------------------------------------------------------------------

async def test_async_generate_streams_and_matches_sync(checkpoint):
    path = checkpoint("qwen3_next")
    engine = AsyncLLM(path, max_num_seqs=8)
    jobs = make_jobs(10, seed=3, max_prompt=120)
    alone = [run_alone(engine.core, job) for job in jobs]

    async def consume(job: Job, delay: float):
        await asyncio.sleep(delay)
        tokens, text, reasons = [], "", []
        async for delta in engine.generate(job.prompt, job.params):
            tokens += delta.token_ids
            text += delta.text
            reasons.append(delta.finish_reason)
        return tokens, text, reasons

    results = await asyncio.gather(*(consume(job, 0.002 * i) for i, job in enumerate(jobs)))
    for (tokens, text, reasons), expected in zip(results, alone):
        assert tokens == expected
        assert text == engine.tokenizer.decode(tokens) or "\ufffd" in text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert_idle(engine.stats())
    await engine.shutdown()


async def test_async_abort_and_disconnect_free_resources(checkpoint):
    engine = AsyncLLM(checkpoint("qwen3_5"))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def abort_after_first(request_id):
        reasons = []
        async for delta in engine.generate([1, 2, 3], params, request_id=request_id):
            reasons.append(delta.finish_reason)
            if len(reasons) == 1:
                assert await engine.abort(request_id)
        return reasons

    async def disconnect_after_first():
        stream = engine.generate([4, 5, 6], params)
        async for _ in stream:
            break
        await stream.aclose()

    reasons, _ = await asyncio.gather(abort_after_first("x"), disconnect_after_first())
    assert reasons[-1] == "abort"
    for _ in range(100):
        if engine.stats()["num_running"] == 0:
            break
        await asyncio.sleep(0.01)
    assert_idle(engine.stats())
    assert await engine.abort("unknown") is False
    await engine.shutdown()


def _fail_steps(engine: AsyncLLM, error: Exception, when) -> list:
    """Make the runner raise a copy of `error` on each step whose plan `when` accepts (run, or
    launch for decode steps, which may run one ahead); returns those plans. A copy: a raised
    exception keeps its traceback, and with it the engine's frames, for as long as it lives (the
    parametrized errors live as long as the test session)."""
    failed, runner = [], engine.core.runner

    def faulty(method):
        def call(plan):
            if when(plan):
                failed.append(plan)
                raise type(error)(*error.args)
            return method(plan)
        return call

    runner.run, runner.launch = faulty(runner.run), faulty(runner.launch)
    return failed


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   ZeroDivisionError("division by zero")])
async def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(checkpoint, caplog, error):
    engine = AsyncLLM(checkpoint("qwen3_5"), max_num_seqs=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = run_alone(engine.core, Job([7, 8, 9], params, 0, None))
    # Once "a" has three tokens: "a" and "b" decode in that step.
    failed = _fail_steps(engine, error, lambda plan: any(
        row.request.request_id == "a" and len(row.request.output_token_ids) >= 3 for row in plan.rows))

    async def consume(prompt, request_id):
        tokens = []
        async for delta in engine.generate(prompt, params, request_id=request_id):
            tokens += delta.token_ids
        return tokens

    results = await asyncio.gather(consume([1, 2, 3], "a"), consume([4, 5, 6], "b"), return_exceptions=True)
    assert len(failed) == 1 and {row.request.request_id for row in failed[0].rows} == {"a", "b"}
    for result in results:
        assert isinstance(result, StepFailedError) and type(error).__name__ in str(result)
    assert_idle(engine.stats())
    assert await consume([7, 8, 9], "c") == expected  # submitted after: served as if nothing happened
    lines = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and str(error) in lines[0].getMessage() and "2 requests" in lines[0].getMessage()
    await engine.shutdown()


async def test_a_failed_admission_ahead_fails_the_requests_it_admitted(checkpoint):
    """The launch of a step planned ahead, which admits "b" beside "a"'s fed row, raises: "a"
    (whose step in flight is never read) and "b" (admitted by the forgotten step) both fail,
    everything they held is freed, and the engine serves on."""
    engine = AsyncLLM(checkpoint("qwen3_5"), max_num_seqs=8)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = run_alone(engine.core, Job([7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                          0, None))
    failed = _fail_steps(engine, RuntimeError("injected"), lambda plan: any(
        row.request.request_id == "b" for row in plan.prefill_rows) and any(
        row.fed_from is not None for row in plan.decode_rows))
    a_decoding = asyncio.Event()

    async def consume(prompt, request_id):
        tokens = []
        async for delta in engine.generate(prompt, params, request_id=request_id):
            tokens += delta.token_ids
            if len(tokens) >= 3:
                a_decoding.set()
        return tokens

    async def consume_b():
        await a_decoding.wait()
        return await consume([4, 5, 6], "b")

    a, b = await asyncio.gather(consume([1, 2, 3], "a"), consume_b(), return_exceptions=True)
    assert len(failed) == 1  # the admitting step launched ahead of "a"'s step in flight
    assert isinstance(a, StepFailedError) and isinstance(b, StepFailedError)
    assert_idle(engine.stats())
    c = [t async for delta in engine.generate([7, 8, 9], SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True), request_id="c")
         for t in delta.token_ids]
    assert c == expected
    await engine.shutdown()


async def test_a_failure_to_schedule_fails_the_running_requests(checkpoint):
    """Scheduling itself raises (no plan to name the step's rows): the running requests fail,
    a waiting one does not, and the engine serves on."""
    # Every step scheduled (none launched ahead), one request running at a time.
    engine = AsyncLLM(checkpoint("qwen3_5"), max_num_seqs=1, async_scheduling=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = run_alone(engine.core, Job([4, 5, 6], params, 0, None))
    scheduler, schedule, faults = engine.core.scheduler, engine.core.scheduler.schedule, []

    def faulty():
        running = scheduler.running
        if not faults and running and running[0].request_id == "a" and running[0].output_token_ids:
            faults.append(running[0])
            raise MemoryError("injected")
        return schedule()

    scheduler.schedule = faulty

    async def consume(prompt, request_id):
        return [t async for delta in engine.generate(prompt, params, request_id=request_id) for t in delta.token_ids]

    a, b = await asyncio.gather(consume([1, 2, 3], "a"), consume([4, 5, 6], "b"), return_exceptions=True)
    assert faults and isinstance(a, StepFailedError) and "MemoryError" in str(a)
    assert b == expected  # waited behind "a" (one running at most), then ran
    assert_idle(engine.stats())
    await engine.shutdown()


async def test_steps_failing_in_a_row_stop_the_engine(checkpoint, monkeypatch):
    """A fault that repeats with no step succeeding (a lost device) ends in EngineDeadError
    after MAX_CONSECUTIVE_FAILED_STEPS, for the requests then and every later one."""
    monkeypatch.setattr(async_llm, "MAX_CONSECUTIVE_FAILED_STEPS", 3)
    engine = AsyncLLM(checkpoint("qwen3_5"))
    _fail_steps(engine, RuntimeError("CUDA error: an illegal memory access was encountered"), lambda plan: True)
    errors = []
    for prompt in ([1, 2], [3, 4], [5, 6]):
        with pytest.raises((StepFailedError, EngineDeadError)) as raised:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=4)):
                pass
        errors.append(raised.type)
    assert errors == [StepFailedError, StepFailedError, EngineDeadError]
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([7, 8], SamplingParams(max_tokens=4)):
            pass
    await engine.shutdown()


async def test_a_paused_request_is_not_scheduled_until_resumed(checkpoint):
    """Backpressure: a paused request gets no steps (beyond those already launched) while others
    run to the end, the engine idles rather than spins, and resumed it finishes with its output
    alone."""
    engine = AsyncLLM(checkpoint("qwen3_5"), max_num_seqs=8)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [run_alone(engine.core, Job(prompt, params, 0, None)) for prompt in ([1, 2, 3], [4, 5, 6])]
    paused = engine.generate([1, 2, 3], params, request_id="a")
    tokens = list((await anext(paused)).token_ids)
    assert engine.pause("a")
    at_pause = len(engine.core.requests["a"].output_token_ids)
    assert [t async for delta in engine.generate([4, 5, 6], params) for t in delta.token_ids] == expected[1]
    await asyncio.sleep(0.05)
    held = len(engine.core.requests["a"].output_token_ids)
    # At most the steps on the device before its consumer saw the delta (AsyncLLM hands a step's
    # deltas out once the next step is launched): that one and the one launched ahead of it.
    assert held <= at_pause + 2 * (1 + engine.core.num_draft_tokens) < 16
    assert not engine.core.has_work  # idle, not spinning on empty steps
    assert engine.resume("a")
    tokens += [t async for delta in paused for t in delta.token_ids]
    assert tokens == expected[0]
    assert_idle(engine.stats())
    await engine.shutdown()


async def test_async_bad_input_raises_at_submission(checkpoint):
    engine = AsyncLLM(checkpoint("qwen3_5"))
    with pytest.raises(ValueError, match="empty"):
        async for _ in engine.generate([], SamplingParams()):
            pass
    assert engine.stats()["num_waiting"] == 0
    await engine.shutdown()


def test_a_dropped_engine_frees_its_pools_at_once(checkpoint):
    """No reference cycle keeps an engine (and its memory-budget-sized pools) alive after its
    last reference goes: tests and benchmarks build many engines one after another."""
    import gc
    import weakref

    path = checkpoint("qwen3_5", mtp_copy_of_last_layer=True)
    gc.collect()
    gc.disable()
    try:
        for options in ({}, {"num_draft_tokens": 3}):
            core = EngineCore(EngineConfig(model=path, **options))
            core.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            while core.has_work:
                core.step()
            pool = weakref.ref(core.states.pending_counts)
            del core
            assert pool() is None, f"engine with {options} outlived its last reference"
    finally:
        gc.enable()


def test_gpu_memory_utilization_is_the_share_of_the_whole_device(monkeypatch):
    """vLLM's meaning: the engine's pools get utilization x the device's memory, less what the
    engine holds already (its weights) and its activations; never more than is free."""
    gib = 2**30
    c = SimpleNamespace(hidden_size=64, intermediate_size=128, conv_dim=32, linear_value_dim=64, num_experts_per_tok=1,
                        moe_intermediate_size=0, vocab_size=1000)
    core = SimpleNamespace(device=torch.device("cuda", 0), model=SimpleNamespace(config=c), num_draft_tokens=0,
                           dtype=torch.bfloat16,
                           config=EngineConfig(model="unused", gpu_memory_utilization=0.5, max_num_seqs=4))
    activations = 8192 * (6 * 64 + 3 * 128) * 2 + 4 * 1000 * 6 * 2
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * gib)
    for free, expected in ((70 * gib, 30 * gib), (20 * gib, 20 * gib)):  # another process holds 60 GiB in the second
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 80 * gib))
        assert EngineCore._device_memory_budget(core) == expected - activations
