"""AsyncLLM's hand-off of deltas: when a step's deltas reach their consumers (once the next step
is on the device) and how a consumer that fell behind gets them (merged). Over a scripted
engine core (no model): each step gives every request one token and waits where the test says;
on the GPU (marked `gpu`), over the real engine with CUDA graphs and steps launched ahead."""

import asyncio
import random
import threading
from types import SimpleNamespace

import pytest

from deltaspec.engine import LLM, AsyncLLM, RequestDelta, SamplingParams, TokenLogprobs
from deltaspec.engine.async_llm import _coalesced
from deltaspec.engine.core import Dispatched, StepResult
from fixtures import GPU_SHAPE, assert_idle


class ScriptedCore:
    """EngineCore's surface AsyncLLM uses. Step n gives each request token n (text "<n>"),
    finishing it at max_tokens. Its wait (in the runner thread) counts the steps launched and,
    given `consumed`, ends only once the consumer has set it (from the second step on)."""

    def __init__(self, consumed: threading.Event | None = None) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.config = SimpleNamespace(max_num_seqs=8)
        self.num_steps = 0  # committed
        self.num_launched = 0
        self._consumed = consumed

    def add_request(self, prompt, params, request_id, resume_from=None, fork_of=None, images=(), videos=()):
        request = SimpleNamespace(request_id=request_id, max_tokens=params.max_tokens, num_tokens=0)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def dispatch(self) -> Dispatched:
        def wait(on_device=None) -> StepResult:
            self.num_launched += 1
            if on_device is not None:
                on_device()
            if self._consumed is not None and self.num_launched > 1:
                assert self._consumed.wait(10), "the consumer never got the step before's delta"
                self._consumed.clear()
            return StepResult(None)

        return Dispatched(list(self.requests.values()), wait)

    def commit(self, plan, result) -> list[RequestDelta]:
        self.num_steps += 1
        deltas = []
        for request in plan:
            request.num_tokens += 1
            finish_reason = "length" if request.num_tokens == request.max_tokens else None
            if finish_reason is not None:
                del self.requests[request.request_id]
            deltas.append(RequestDelta(request.request_id, [self.num_steps], f"<{self.num_steps}>", finish_reason))
        return deltas

    def close(self) -> None:
        pass


async def test_a_steps_deltas_reach_their_consumer_once_the_next_step_is_launched():
    """So the consumer's work overlaps the next step's device work (here each step waits for
    the consumer to get the delta before it); the last delta, with no step after it, comes as
    soon as it is committed."""
    consumed = threading.Event()
    engine = AsyncLLM(core=ScriptedCore(consumed))
    received, launched = [], []
    async with asyncio.timeout(10):
        async for delta in engine.generate([1], SamplingParams(max_tokens=4), request_id="a"):
            received.append(delta.token_ids)
            launched.append(engine.core.num_launched)
            consumed.set()
    assert received == [[1], [2], [3], [4]] and launched == [2, 3, 4, 4]
    await engine.shutdown()


async def test_a_consumer_that_fell_behind_gets_one_merged_delta():
    engine = AsyncLLM(core=ScriptedCore())
    stream = engine.generate([1], SamplingParams(max_tokens=6), request_id="a")
    first = await anext(stream)
    while engine.core.has_work:  # the engine runs on while nobody reads
        await asyncio.sleep(0.001)
    rest = [delta async for delta in stream]
    assert [first.token_ids] + [d.token_ids for d in rest] == [[1], [2, 3, 4, 5, 6]]
    assert rest[-1].text == "<2><3><4><5><6>" and rest[-1].finish_reason == "length"
    await engine.shutdown()


def test_coalesced_keeps_ends_and_errors_apart():
    def delta(token_id, finish_reason=None, logprobs=False):
        return RequestDelta("a", [token_id], str(token_id), finish_reason,
                            [TokenLogprobs(-float(token_id), [], 1)] if logprobs else None)

    merged = _coalesced([delta(1, logprobs=True), delta(2, logprobs=True), delta(3, "stop", logprobs=True)])
    assert merged == [RequestDelta("a", [1, 2, 3], "123", "stop",
                                   [TokenLogprobs(-1.0, [], 1), TokenLogprobs(-2.0, [], 1), TokenLogprobs(-3.0, [], 1)])]
    # An abort or error delta, or an exception, ends the stream: what came before stays its own.
    abort = RequestDelta("a", [], "", "abort")
    error = RuntimeError("step failed")
    assert _coalesced([delta(1), delta(2), abort]) == [RequestDelta("a", [1, 2], "12", None), abort]
    assert _coalesced([delta(1), error, delta(2)]) == [delta(1), error, delta(2)]
    assert _coalesced([delta(1), delta(2, "error")]) == [delta(1), delta(2, "error")]
    # The prompt's log-probabilities (on the first delta) and the speculation counters (on the last) stay.
    prompt = [None, TokenLogprobs(-0.5, [], 2)]
    first = RequestDelta("a", [1], "1", None, prompt_logprobs=prompt)
    last = RequestDelta("a", [2], "2", "stop", spec_stats={"num_drafts": 3})
    assert _coalesced([first, last]) == [RequestDelta("a", [1, 2], "12", "stop", None, {"num_drafts": 3}, prompt)]


@pytest.mark.gpu
async def test_streams_on_the_gpu_give_the_sync_engines_tokens(checkpoint):
    """The device path (graphs, MTP, steps launched ahead, on_device from the runner thread while
    consumers run): 16 concurrent greedy streams, every fourth consumer slow enough to fall
    behind (its deltas merge), get exactly the sync engine's tokens (float32: batches composed
    differently round alike)."""
    path = checkpoint("qwen3_5", **GPU_SHAPE)
    options = dict(device="cuda", dtype="float32", num_draft_tokens=2, adaptive_draft_length=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(2, 120))] for _ in range(16)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = [output.token_ids for output in LLM(path, **options).generate(prompts, params)]
    engine = AsyncLLM(path, **options)

    async def consume(index: int, prompt: list[int]) -> list[int]:
        await asyncio.sleep(0.001 * index)
        tokens = []
        async for delta in engine.generate(prompt, params):
            tokens += delta.token_ids
            if index % 4 == 0:
                await asyncio.sleep(0.005)  # the engine steps on meanwhile: its deltas pile up
        return tokens

    assert await asyncio.gather(*(consume(i, prompt) for i, prompt in enumerate(prompts))) == expected
    assert_idle(engine.stats())
    await engine.shutdown()
