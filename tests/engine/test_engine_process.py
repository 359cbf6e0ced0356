"""EngineProcess: an AsyncLLM in its own process behind AsyncLLM's serving API.

Its output equals the in-process engine's token for token (greedy, MTP speculation on, requests
interleaved); the engine's refusals arrive as ValueError and leave it serving; a stream closed
early aborts its request; shutdown aborts what runs; a start-up failure raises in the caller as
in-process (one line, the same exception type); an engine process that dies fails every request
with EngineDeadError, at once and from then on."""

import asyncio
import os
import shutil
import signal

import pytest
import pytest_asyncio

from deltaspec.engine import AsyncLLM, EngineConfig, EngineDeadError, SamplingParams
from deltaspec.engine.engine_process import EngineProcess
from fixtures import assert_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [5] * 20, [11, 12]]


def config(checkpoint) -> EngineConfig:
    # A fixed draft count: the adaptive one follows measured step times, which differ between runs.
    return EngineConfig(model=checkpoint("qwen3_5"), max_model_len=256, num_draft_tokens=2,
                        adaptive_draft_length=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoint):
    engine = await EngineProcess.start(config(checkpoint))
    yield engine
    await engine.shutdown()


async def collect(engine, prompt, params=GREEDY, request_id=None) -> list[int]:
    return [t async for delta in engine.generate(prompt, params, request_id) for t in delta.token_ids]


async def wait_idle(engine: EngineProcess) -> dict:
    for _ in range(500):
        stats = await engine.fetch_stats()
        assert set(stats["gc_pauses"]["series"]) == {"0", "1", "2"}  # the engine process's collections come along
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        await asyncio.sleep(0.01)
    assert_idle(stats)
    return stats


async def test_output_equals_the_in_process_engine(engine, checkpoint):
    reference = AsyncLLM(config=config(checkpoint))
    try:
        expected = await asyncio.gather(*(collect(reference, p) for p in PROMPTS))
        expected_text = "".join([delta.text async for delta in reference.generate("def f(x):", GREEDY)])
    finally:
        await reference.shutdown()
    got = await asyncio.gather(*(collect(engine, p) for p in PROMPTS))
    assert got == expected
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got)
    # A text prompt is tokenized in the caller's process.
    assert "".join([delta.text async for delta in engine.generate("def f(x):", GREEDY)]) == expected_text
    await wait_idle(engine)


async def test_refused_requests_raise_value_error_and_the_engine_serves_on(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        await collect(engine, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await collect(engine, [10**6])
    with pytest.raises(ValueError, match="stop_token_ids"):
        await collect(engine, [1, 2], SamplingParams(max_tokens=2, stop_token_ids=(10**6,)))
    assert len(await collect(engine, [1, 2, 3])) == GREEDY.max_tokens
    await wait_idle(engine)


async def test_a_request_id_in_use_is_refused(engine):
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), "twice")
    await anext(stream)
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine, [4, 5], request_id="twice")
    await stream.aclose()
    await wait_idle(engine)


async def test_closing_a_stream_aborts_its_request(engine):
    stream = engine.generate([3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True))
    first = await anext(stream)
    assert first.token_ids
    await stream.aclose()
    await wait_idle(engine)


async def test_pause_stops_a_request_and_resume_restarts_it(engine):
    stream = engine.generate([3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True), "paused")
    await anext(stream)
    assert engine.pause("paused")
    await asyncio.sleep(0.2)  # the engine takes the pause in a step or two
    before = (await engine.fetch_stats())["num_running"]
    assert engine.resume("paused")
    tokens = [t async for delta in stream for t in delta.token_ids]
    assert before == 1 and tokens
    assert not engine.pause("no such request")
    await wait_idle(engine)


@pytest.mark.parametrize("broken", ["config", "tokenizer"])
async def test_start_up_failures_raise_as_in_process(tmp_path, checkpoint, broken):
    shutil.copytree(checkpoint("qwen3_5"), tmp_path, dirs_exist_ok=True)
    if broken == "config":
        (tmp_path / "config.json").write_text("{not json")
    else:
        (tmp_path / "tokenizer.json").unlink()
    with pytest.raises((ValueError, FileNotFoundError)) as in_process:
        AsyncLLM(config=EngineConfig(model=tmp_path))
    with pytest.raises((ValueError, FileNotFoundError)) as raised:
        await EngineProcess.start(EngineConfig(model=tmp_path))
    # The caller raises the engine's category: FileNotFoundError, or ValueError for its subclasses.
    assert isinstance(raised.value, FileNotFoundError) == isinstance(in_process.value, FileNotFoundError)
    assert str(raised.value) == str(in_process.value) and "\n" not in str(raised.value)


async def test_shutdown_aborts_running_requests(checkpoint):
    engine = await EngineProcess.start(config(checkpoint))
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=240, ignore_eos=True))
    await anext(stream)
    await engine.shutdown()
    last = [delta async for delta in stream][-1]
    assert last.finish_reason == "abort"
    assert engine._process.exitcode == 0
    with pytest.raises(EngineDeadError):
        await collect(engine, [1, 2])


async def test_a_dead_engine_process_fails_every_request(checkpoint):
    engine = await EngineProcess.start(config(checkpoint))
    try:
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=240, ignore_eos=True))
        await anext(stream)
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert engine.error is not None
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2])
        with pytest.raises(EngineDeadError):
            await engine.fetch_stats()
    finally:
        await engine.shutdown()
