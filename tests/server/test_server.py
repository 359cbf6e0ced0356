"""The OpenAI-compatible server, driven over loopback by the official `openai` client and raw HTTP.

One in-process server (aiohttp runner inside the test's event loop) over a tiny random Qwen3.5
checkpoint with MTP speculation on serves most tests; the API-key and overload tests start their
own beside it. Everything is greedy with small max_tokens. The `deltaspec serve` process itself
(signals, exit code) is tested in test_cli.py.
"""

import asyncio
import gzip
import json
import time

import aiohttp
import openai
import pytest
import pytest_asyncio
import torch
from prometheus_client.parser import text_string_to_metric_families

from deltaspec.engine import LLM, AsyncLLM, SamplingParams
from deltaspec.server.config import ServerConfig
from deltaspec.server.cors import CorsPolicy
from deltaspec.server.serve import start
from fixtures import assert_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
MAX_MODEL_LEN = 256
GREEDY = {"temperature": 0, "max_tokens": 8}
IGNORE_EOS = {"ignore_eos": True}  # every request runs to max_tokens: lengths are predictable
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoint):
    # A fixed draft count: the adaptive one follows observed step times, and the verify width
    # moves log-probabilities in their last bits (test_logprobs compares them exactly).
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN, num_draft_tokens=2,
                      adaptive_draft_length=False)
    yield engine
    await engine.shutdown()


async def wait_idle(engine: AsyncLLM, timeout: float = 10.0) -> dict:
    """Stats once no request runs or waits; fails if slots or KV blocks stay taken."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["num_running"] == stats["num_waiting"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert_idle(stats)
    return stats


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict:
    """/metrics as {(sample name, sorted labels): value}, checked to parse as Prometheus text."""
    async with http.get(f"{base_url}/metrics") as response:
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


# The OpenAI routes ------------------------------------------------------------------------------

async def test_completions_streamed_equals_non_streamed_with_usage(client, engine):
    prompt = "def fibonacci(n):"
    response = await client.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.model == MODEL
    assert abs(response.created - time.time()) < 60
    [choice] = response.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.system_fingerprint.startswith("deltaspec-")
    num_prompt_tokens = len(engine.tokenizer.encode(prompt))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        num_prompt_tokens, 8, num_prompt_tokens + 8)

    stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                             stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                             **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == choice.text
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    # The same usage, but the prompt is now found cached (prompt_tokens_details.cached_tokens).
    assert usage_chunk.choices == [] and totals(usage_chunk.usage) == totals(response.usage)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == usage_chunk.usage.prompt_tokens
    assert all(chunk.usage is None for chunk in text_chunks)


async def test_a_list_of_prompts_gets_a_choice_each(client, engine):
    prompts = ["def fibonacci(n):", "Hello", "The engine schedules"]
    alone = [await client.completions.create(model=MODEL, prompt=p, extra_body=IGNORE_EOS, **GREEDY) for p in prompts]
    texts = [response.choices[0].text for response in alone]
    batch = await client.completions.create(model=MODEL, prompt=prompts, extra_body=IGNORE_EOS, **GREEDY)
    assert [(c.index, c.text, c.finish_reason) for c in batch.choices] == [
        (index, text, "length") for index, text in enumerate(texts)]
    num_prompt_tokens = sum(response.usage.prompt_tokens for response in alone)
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (num_prompt_tokens, 8 * len(prompts))
    token_ids = [engine.tokenizer.encode(p) for p in prompts]
    by_ids = await client.completions.create(model=MODEL, prompt=token_ids, extra_body=IGNORE_EOS, **GREEDY)
    assert [c.text for c in by_ids.choices] == texts

    stream = await client.completions.create(model=MODEL, prompt=prompts, stream=True, extra_body=IGNORE_EOS,
                                             stream_options={"include_usage": True}, **GREEDY)
    streamed, finish_reasons, usage = [""] * len(prompts), [None] * len(prompts), None
    async for chunk in stream:
        assert chunk.id == batch.id or chunk.id.startswith("cmpl-")
        for choice in chunk.choices:  # each chunk carries its prompt's index
            streamed[choice.index] += choice.text
            finish_reasons[choice.index] = choice.finish_reason or finish_reasons[choice.index]
        usage = chunk.usage or usage
    assert streamed == texts and finish_reasons == ["length"] * len(prompts) and totals(usage) == totals(batch.usage)
    await wait_idle(engine)


async def test_chat_streamed_equals_non_streamed_with_usage(client, engine):
    response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert 1 <= response.usage.completion_tokens <= 8

    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk.choices[0].delta.content or "" for chunk in text_chunks) == choice.message.content
    # As OpenAI sends it: the finish reason comes alone, in a last chunk with an empty delta.
    *text_chunks, finish_chunk = text_chunks
    assert finish_chunk.choices[0].finish_reason == choice.finish_reason
    assert finish_chunk.choices[0].delta.content is None and finish_chunk.choices[0].delta.role is None
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks)
    # The same usage, but the prompt is now found cached (prompt_tokens_details.cached_tokens).
    assert usage_chunk.choices == [] and totals(usage_chunk.usage) == totals(response.usage)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == usage_chunk.usage.prompt_tokens
    assert response.system_fingerprint.startswith("deltaspec-")
    assert {chunk.system_fingerprint for chunk in chunks} == {response.system_fingerprint}


SAMPLED = {"temperature": 0.9, "seed": 11, "max_tokens": 8}


def totals(usage) -> tuple[int, int, int]:
    """A usage's counts, without how much of the prompt was found cached (a repeat finds more)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_n_choices_equal_their_seeded_twins_and_prefill_once(client, engine, route):
    """n = 4: choice i equals a single request with seed + i, streamed or not; the prompt is
    computed once (the 3 forks restore it), its tokens counted once in usage."""
    async def create(n: int, seed: int, **options):
        body = dict(SAMPLED, seed=seed, n=n, extra_body=IGNORE_EOS, **options)
        if route == "chat":
            return await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count the {route} choices."}], **body)
        return await client.completions.create(model=MODEL, prompt=f"Four {route} choices of one prompt:", **body)

    def text(choice) -> str:
        return choice.message.content if route == "chat" else choice.text

    await wait_idle(engine)
    before = engine.stats()["prefix_cache"]
    response = await create(4, 11)
    after = engine.stats()["prefix_cache"]
    num_prompt_tokens = response.usage.prompt_tokens
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4 * num_prompt_tokens
    assert after["reused_tokens"] - before["reused_tokens"] == 3 * num_prompt_tokens  # the forks
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    twins = [await create(1, 11 + i) for i in range(4)]
    assert [text(c) for c in response.choices] == [text(t.choices[0]) for t in twins]
    assert len({text(c) for c in response.choices}) > 1  # seed + i: not one choice four times
    assert response.usage.completion_tokens == sum(t.usage.completion_tokens for t in twins)
    assert response.usage.prompt_tokens == twins[0].usage.prompt_tokens

    stream = await create(4, 11, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert len({chunk.id for chunk in chunks}) == 1
    streamed, finish_reasons, usage = [""] * 4, [None] * 4, None
    for chunk in chunks:
        for choice in chunk.choices:  # each chunk carries its choice's index
            streamed[choice.index] += (choice.delta.content or "") if route == "chat" else choice.text
            finish_reasons[choice.index] = choice.finish_reason or finish_reasons[choice.index]
        usage = chunk.usage or usage
    assert streamed == [text(c) for c in response.choices]
    assert finish_reasons == [c.finish_reason for c in response.choices]
    # The stream's prompt was computed by the first request: found cached now, counted once.
    assert totals(usage) == totals(response.usage) and usage.prompt_tokens_details.cached_tokens == num_prompt_tokens
    await wait_idle(engine)


async def test_chat_default_max_tokens_fills_the_context(client):
    # No max_tokens: a chat request may run to the end of the context (OpenAI's behaviour).
    response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                    extra_body=IGNORE_EOS)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == MAX_MODEL_LEN


async def test_sampling_parameters_reach_the_engine(client):
    async def complete(**options) -> openai.types.CompletionChoice:
        response = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, **options)
        return response.choices[0]

    sampled = dict(temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 50, "min_p": 0.05, **IGNORE_EOS})
    first, second = await complete(**sampled), await complete(**sampled)
    assert first.text == second.text  # the seed makes sampling reproducible
    text = (await complete(temperature=0, extra_body=IGNORE_EOS)).text
    stop = text[2:4]
    if stop.strip():  # a stop string cuts the text right before it
        stopped = await complete(temperature=0, stop=[stop], extra_body=IGNORE_EOS)
        assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]


async def test_penalties_bias_min_tokens_and_bad_words_reach_the_engine(client, engine):
    """The server's output with every penalty field equals the engine's with the same params,
    on both routes, and differs from the plain output."""
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={"7": 6.0},
                  min_tokens=4, bad_words=["the"])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **{**fields, "logit_bias": {7: 6.0}})
    expected = "".join([delta.text async for delta in engine.generate("Hello", params)])
    plain = await client.completions.create(model=MODEL, prompt="Hello", extra_body=IGNORE_EOS, **GREEDY)
    penalized = await client.completions.create(model=MODEL, prompt="Hello", extra_body={**IGNORE_EOS, **fields},
                                                **GREEDY)
    assert penalized.choices[0].text == expected != plain.choices[0].text
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={**IGNORE_EOS, **fields},
                                                **GREEDY)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = "".join([delta.text async for delta in engine.generate(engine.tokenizer.encode(prompt), params)])
    assert chat.choices[0].message.content == expected


SMALL_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                  "score": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["answer", "score"], "additionalProperties": False}


async def test_response_format_json_schema_on_both_routes(client):
    """The output follows the schema (the tiny random model alone would write garbage)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SMALL_SCHEMA,
                                                              "strict": True}}
    completion = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, temperature=1.0,
                                                 seed=3, extra_body={"response_format": response_format})
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0,
                                                seed=4, response_format=response_format)
    any_object = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                      response_format={"type": "json_object"})
    for text, reason in ((completion.choices[0].text, completion.choices[0].finish_reason),
                         (chat.choices[0].message.content, chat.choices[0].finish_reason)):
        value = json.loads(text)
        assert reason == "stop" and value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9, text
    assert any_object.choices[0].message.content.startswith("{")


async def test_models_and_health(client, http, base_url, engine):
    models = await client.models.list()
    assert [(m.id, m.object) for m in models.data] == [(MODEL, "model")]
    assert await client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("org/other-model")
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert models.data[0].model_extra["generation_defaults"] == dict(engine.generation_defaults)
    async with http.get(f"{base_url}/health") as response:
        assert response.status == 200 and (await response.json())["status"] == "ok"
    for method in (http.get, http.post):  # vLLM's alias
        async with method(f"{base_url}/ping") as response:
            assert response.status == 200 and (await response.json())["status"] == "ok"


async def test_64_concurrent_streams_get_the_text_each_gets_alone(client, engine):
    words = "fox dog cache model engine token draft verify slot block".split()
    prompts = [f"{words[i % 10]} {words[(i // 10) % 10]} {i}" for i in range(64)]
    alone = [(await client.completions.create(model=MODEL, prompt=p, extra_body=IGNORE_EOS, **GREEDY)).choices[0].text
             for p in prompts]

    async def stream(prompt: str) -> str:
        chunks = await client.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body=IGNORE_EOS,
                                                 **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in chunks])

    together = await asyncio.gather(*(stream(p) for p in prompts))
    assert together == alone
    await wait_idle(engine)


# Bad input --------------------------------------------------------------------------------------

ONE_MESSAGE = [{"role": "user", "content": "hi"}]
# (route, body: JSON value or raw bytes, status, expected param, a substring of the message)
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens":', 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "int"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "0 is allowed only with echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": False}, 400, "max_tokens", "only with echo"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p", "<= 1"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", ">= -1"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed", "<= 9223372036854775807"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop", "str"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "bool"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "n": 65}, 400, "n", "at most 64"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "n": 1000}, 400, "n", "at most 64"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "must equal n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "<= 20"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "<= 20"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs",
     "not available with stream"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "prompt_logprobs": 0, "stream": True}, 400,
     "prompt_logprobs", "not available with stream"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo", "bool"),
    ("/v1/completions", {"prompt": [1] * 256, "echo": True, "max_tokens": 0}, 400, "prompt",
     "256 in the prompt"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "prompt_logprobs": 21}, 400, "prompt_logprobs", "<= 20"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "prompt_logprobs": 0, "stream": True}, 400,
     "prompt_logprobs", "not available with stream"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "<= 2"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty", ">= -2"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x1": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, 400, None, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens", ">= 0"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 8}, 400, None, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [" "]}, 400, None, "bad_words"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "logit_bias": {"5": 101}}, 400, "logit_bias[...]", "<= 100"),
    ("/v1/completions", {"prompt": ["one", [1, 2]]}, 400, "prompt", "list of strings or of token-id lists"),
    ("/v1/completions", {"prompt": ["one", ""]}, 400, None, "empty"),
    ("/v1/completions", {"prompt": ""}, 400, None, "empty"),
    ("/v1/completions", {"prompt": [1, 100000]}, 400, None, "vocabulary"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt", "maximum context length is 256 tokens"),
    ("/v1/completions", {"prompt": "word " * 400, "max_tokens": 7}, 400, "prompt", " in the prompt, 7 in the completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages",
     "in the messages, 1 in the completion"),
    ("/v1/completions", {"prompt": [1] * 255, "max_tokens": 16}, 400, "max_tokens",
     "you requested 271 tokens (255 in the prompt, 16 in the completion)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens", "maximum context length"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "max_completion_tokens": 256}, 400, "max_completion_tokens",
     "in the messages, 256 in the completion"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "gpt-4"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (10 << 20) + b'"}', 413, None, "larger than"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "length"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "missing"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "top_logprobs": 3}, 400, "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].image_url", "is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content", "(text, image_url and video_url are)"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "<= 2"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [100000]}, 400, None, "stop_token_ids outside"),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 4}, 400, "max_completion_tokens", "unknown"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role",
     "Invalid enum value 'wizard'"),
    ("/v1/chat/completions", {"messages": [*ONE_MESSAGE, {"role": "tool", "content": "4"}]}, 400,
     "messages[1].tool_call_id", "required"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format", "xml"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "needs its json_schema"),
    ("/v1/chat/completions", {"messages": ONE_MESSAGE, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format", "objectx"),
    ("/v1/nowhere", {"prompt": "hi"}, 404, None, "no route"),
]


async def test_bad_input_gets_an_openai_error_and_harms_nothing(http, base_url, client, engine):
    before = await scrape(http, base_url)
    for route, body, status, param, message in BAD_REQUESTS:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(base_url + route, data=data, headers={"Content-Type": "application/json"}) as response:
            error = await response.json()
            case = f"{route} {data[:60]!r}: {response.status} {error}"
            assert response.status == status, case
            assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, case
            assert error["error"]["param"] == param and message in error["error"]["message"], case
            assert error["error"]["type"] == "invalid_request_error", case
    async with http.get(f"{base_url}/v1/completions") as response:
        assert response.status == 405 and (await response.json())["error"]["code"] == "method_not_allowed"
    async with http.get(f"{base_url}/no/such/route") as response:
        assert response.status == 404 and "no route" in (await response.json())["error"]["message"]

    # The openai client raises the matching exception classes.
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.completions.create(model=MODEL, prompt="hi", temperature=-1)

    # Nothing leaked, the server still serves, and the failures were counted.
    await wait_idle(engine)
    async with http.get(f"{base_url}/health") as response:
        assert response.status == 200
    ok = await client.completions.create(model=MODEL, prompt="still here?", **GREEDY)
    assert ok.choices[0].finish_reason in ("stop", "length")
    after = await scrape(http, base_url)
    key = ("deltaspec_requests_total", (("route", "/v1/completions"), ("status", "400")))
    assert after[key] - before.get(key, 0) == sum(1 for r, _, s, _, _ in BAD_REQUESTS
                                                  if r == "/v1/completions" and s == 400) + 1


# (route, body bytes, extra headers, status, a substring of the message)
MALFORMED_BODIES = [
    ("/v1/completions", b'{"prompt": "a\xff\xfeb"}', {}, 400, "not valid UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\xffb"}]}', {}, 400, "not valid UTF-8"),
    ("/v1/completions", '{"prompt": "caf\xe9"}'.encode("latin-1"),
     {"Content-Type": "application/json; charset=latin-1"}, 415, "UTF-8"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", {}, 400, "nested too deeply"),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Encoding": "zstd"}, 415, "not supported"),
    ("/v1/completions", gzip.compress(b'{"prompt": "hi", "max_tokens": 2}')[:-8], {"Content-Encoding": "gzip"},
     400, "truncated"),
    ("/v1/completions", gzip.compress(b" " * (2 << 20) + b"{}"), {"Content-Encoding": "gzip"}, 413,
     "once decompressed"),
]


async def test_malformed_bodies_get_4xx_without_a_traceback(http, base_url, engine, caplog):
    for route, data, headers, status, message in MALFORMED_BODIES:
        caplog.clear()
        async with http.post(base_url + route, data=data, compress=False,
                             headers={"Content-Type": "application/json", **headers}) as response:
            error = await response.json()
            case = f"{route} {data[:60]!r} {headers}: {response.status} {error}"
            assert response.status == status and message in error["error"]["message"], case
        await asyncio.sleep(0.05)  # aiohttp drains the body after the response
        assert not [record for record in caplog.records if record.exc_info], case
    body = gzip.compress(json.dumps({"prompt": "hi", **GREEDY}).encode())
    async with http.post(f"{base_url}/v1/completions", data=body, compress=False,
                         headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as response:
        assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] >= 1
    await wait_idle(engine)


async def test_tokenizing_long_prompts_leaves_the_loop_free(http, base_url, engine):
    # Four ~1 MB prompts keep the tokenizer busy for seconds on a CPU; /health meanwhile answers
    # promptly (the target is 50 ms on the GPU machine; 0.5 s on a shared test CPU).
    async def post(index: int) -> int:
        body = {"prompt": f"{index} " + "The quick brown fox jumps over the lazy dog. " * 22_000, "max_tokens": 1}
        async with http.post(f"{base_url}/v1/completions", json=body) as response:
            return response.status

    posts = asyncio.gather(*(post(i) for i in range(4)))
    await asyncio.sleep(0.2)  # the bodies are in, tokenizing
    # The client shares the server's event loop here: a blocked loop shows as a long round
    # (probe and pause), however short the probe itself looks.
    rounds = []
    while not posts.done():
        start = time.monotonic()
        async with http.get(f"{base_url}/health") as response:
            assert response.status == 200
        await asyncio.sleep(0.02)
        rounds.append(time.monotonic() - start)
    assert await posts == [400] * 4  # far over the context: refused once tokenized
    assert len(rounds) >= 5 and max(rounds) < 0.5, rounds
    await wait_idle(engine)


async def test_client_that_disconnects_aborts_its_request(client, http, base_url, engine):
    aborted = ("deltaspec_requests_finished_total", (("finish_reason", "abort"),))
    before = (await scrape(http, base_url)).get(aborted, 0)
    long = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "temperature": 0}
    # Streaming: hang up after the first chunk.
    stream = await client.completions.create(stream=True, extra_body=IGNORE_EOS, **long)
    async for _ in stream:
        break
    await stream.close()
    await wait_idle(engine)
    # Non-streaming: the client gives up while the request still runs (nothing is being written).
    with pytest.raises(asyncio.TimeoutError):
        await http.post(f"{base_url}/v1/completions", json={**long, **IGNORE_EOS},
                        timeout=aiohttp.ClientTimeout(total=0.1))
    await wait_idle(engine)
    assert (await scrape(http, base_url))[aborted] - before == 2
    ok = await client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert ok.usage.completion_tokens >= 1


async def test_a_failed_engine_step_gets_500s_and_the_server_serves_on(http, base_url, client, engine,
                                                                        fail_a_decode_step, caplog):
    """A fault injected into one engine step (the runner raises): a streamed request in it gets
    an error event and [DONE], a non-streamed one a 500 body; both free their slot and blocks,
    and the next request gets the text it gets alone."""
    body = {"model": MODEL, "prompt": "Hello", **GREEDY, **IGNORE_EOS}
    failed = ("deltaspec_requests_finished_total", (("finish_reason", "error"),))
    before = (await scrape(http, base_url)).get(failed, 0)
    async def text_alone() -> str:
        return (await client.completions.create(model=MODEL, prompt="Hello", extra_body=IGNORE_EOS,
                                                **GREEDY)).choices[0].text

    alone = await text_alone()
    faults = fail_a_decode_step()
    async with http.post(f"{base_url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        events = [line.removeprefix(b"data: ").strip() async for line in response.content if line.strip()]
    assert faults and events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "CUDA out of memory (injected)" in error["message"]
    assert all("choices" in json.loads(event) for event in events[:-2])
    await wait_idle(engine)

    faults.clear()
    async with http.post(f"{base_url}/v1/completions", json=body) as response:
        assert response.status == 500
        assert (await response.json())["error"]["code"] == "internal_error"
    assert faults
    await wait_idle(engine)
    assert await text_alone() == alone
    assert sum("a step failed with RuntimeError" in r.getMessage() for r in caplog.records) == 2
    assert (await scrape(http, base_url))[failed] - before == 2


async def test_nonfinite_logits_get_a_500_and_the_server_serves_on(http, base_url, client, engine, monkeypatch):
    """A NaN in a request's verify logits (the engine speculates with 2 drafts: the target's
    logits have 3 rows a request, the MTP's 1): a non-streamed request gets a 500 naming the
    numerical error, a streamed one an error event and [DONE]; slots and blocks are freed and
    the next request gets the text it gets alone."""
    body = {"model": MODEL, "prompt": "Hello", **GREEDY, **IGNORE_EOS}

    async def text_alone() -> str:
        response = await client.completions.create(model=MODEL, prompt="Hello", extra_body=IGNORE_EOS, **GREEDY)
        return response.choices[0].text

    alone = await text_alone()
    model, poisoned = engine.core.model, []
    logits_of = model.logits

    def logits(hidden, out=None):
        result = logits_of(hidden, out=out)
        if not poisoned and hidden.shape[0] == 3:  # one request's verify: newest + 2 drafts
            result[1] = float("nan")
            poisoned.append(True)
        return result

    monkeypatch.setattr(model, "logits", logits)
    message = "numerical error in the model output (non-finite logits)"
    async with http.post(f"{base_url}/v1/completions", json=body) as response:
        assert response.status == 500
        error = (await response.json())["error"]
        assert message in error["message"] and error["code"] == "internal_error"
    assert poisoned
    await wait_idle(engine)
    poisoned.clear()
    async with http.post(f"{base_url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        events = [line.removeprefix(b"data: ").strip() async for line in response.content if line.strip()]
    assert poisoned and events[-1] == b"[DONE]" and message in json.loads(events[-2])["error"]["message"]
    await wait_idle(engine)
    monkeypatch.undo()
    assert await text_alone() == alone


@pytest_asyncio.fixture(loop_scope="module")
async def impatient(engine):
    """A server beside the shared one whose socket and stream timeouts are short."""
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, shutdown_timeout=1, idle_timeout=0.5,
                                               body_timeout=0.5, stream_stall_timeout=0.5))
    yield running
    await running.stop()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent until it closed the connection (fails if it stays open longer)."""
    async with asyncio.timeout(seconds):
        return await reader.read()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["idle", "header"])
async def test_idle_and_header_only_sockets_are_closed(impatient, sent):
    reader, writer = await asyncio.open_connection("127.0.0.1", impatient.port)
    writer.write(sent)
    start_time = time.monotonic()
    assert await _closed_within(reader, 3) == b""
    assert 0.4 < time.monotonic() - start_time
    writer.close()


async def test_a_body_that_does_not_arrive_gets_408(impatient):
    reader, writer = await asyncio.open_connection("127.0.0.1", impatient.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    async with asyncio.timeout(3):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
    writer.close()


async def test_a_stream_whose_client_stops_reading_is_aborted(impatient, engine, http, caplog):
    """The client reads nothing (a small receive buffer, never read): while the server's writes
    are blocked its requests are paused; once blocked for the stall timeout, they are aborted,
    their slots and blocks freed, and the connection dropped."""
    import socket
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", impatient.port))
    # Top log-probabilities make each event about a kilobyte: more than the socket buffers hold.
    body = json.dumps({"model": MODEL, "prompt": ["Hello"] * 32, "max_tokens": 240, "temperature": 0,
                       "logprobs": 20, "stream": True, **IGNORE_EOS}).encode()
    await asyncio.get_running_loop().sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                  b"Content-Type: application/json\r\nContent-Length: "
                                                  + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline, paused = time.monotonic() + 30, False
    while not any("read nothing" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the stalled stream was never aborted"
        # Meanwhile its requests hold their slots but get no steps: the engine idles.
        paused = paused or (engine.stats()["num_running"] > 0 and not engine.core.has_work)
        await asyncio.sleep(0.02)
    assert paused
    stats = await wait_idle(engine)
    assert stats["num_running"] == 0
    sock.close()


async def test_metrics_parse_and_move_with_requests(http, base_url, client, engine):
    before = await scrape(http, base_url)
    prompt = "The engine schedules requests"
    await client.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                  extra_body=IGNORE_EOS, **GREEDY)
    [_ async for _ in stream]
    after = await scrape(http, base_url)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert moved("deltaspec_requests_total", route="/v1/completions", status="200") == 1
    assert moved("deltaspec_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved("deltaspec_requests_finished_total", finish_reason="length") == 2
    assert moved("deltaspec_generation_tokens_total") == 16
    assert moved("deltaspec_prompt_tokens_total") >= len(engine.tokenizer.encode(prompt)) + 1
    assert moved("deltaspec_time_to_first_token_seconds_count") == 2
    assert moved("deltaspec_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert moved("deltaspec_inter_token_latency_seconds_count") == 14  # 7 gaps per request
    assert moved("deltaspec_e2e_request_latency_seconds_count") == 2
    # Engine gauges, read from stats() at scrape time.
    stats = engine.stats()
    assert after[("deltaspec_free_slots", ())] == stats["num_free_slots"]
    assert after[("deltaspec_free_kv_blocks", ())] == stats["num_free_kv_blocks"]
    assert after[("deltaspec_num_requests_running", ())] == after[("deltaspec_num_requests_waiting", ())] == 0
    assert after[("deltaspec_num_draft_tokens", ())] == 2
    assert after[("deltaspec_prefix_cache_hit_rate", ())] == stats["prefix_cache"]["hit_rate"]
    assert after[("deltaspec_compiles_after_warm_up_total", ())] == stats["num_compiles_after_warm_up"]
    spec = stats["spec"]
    assert moved("deltaspec_spec_verify_steps_total") > 0
    for position, proposed in enumerate(spec["proposed_by_position"], start=1):
        assert after[("deltaspec_spec_draft_tokens_total", (("position", str(position)),))] == proposed
        assert 0 <= after[("deltaspec_spec_acceptance_rate", (("position", str(position)),))] <= 1
    assert after[("deltaspec_spec_mean_accepted_length", ())] == pytest.approx(spec["mean_accepted_length"])
    policy = stats["draft_policy"]
    assert sum(policy["steps"].values()) > 0
    for k, steps in policy["steps"].items():
        assert after[("deltaspec_spec_steps_total", (("drafts", str(k)),))] == steps
    for (bucket, k), seconds in policy["step_seconds"].items():
        assert after[("deltaspec_spec_step_cost_seconds", (("bucket", str(bucket)), ("drafts", str(k))))] \
            == pytest.approx(seconds)
    # vLLM's names for the same series, labelled with the model's name, as dashboards written
    # for vLLM read them.
    model = {"model_name": MODEL}
    for vllm, ours, labels in (("vllm:num_requests_running", "deltaspec_num_requests_running", {}),
                               ("vllm:num_requests_waiting", "deltaspec_num_requests_waiting", {}),
                               ("vllm:prompt_tokens_total", "deltaspec_prompt_tokens_total", {}),
                               ("vllm:generation_tokens_total", "deltaspec_generation_tokens_total", {}),
                               ("vllm:num_preemptions_total", "deltaspec_preemptions_total", {}),
                               ("vllm:spec_decode_num_drafts_total", "deltaspec_spec_verify_steps_total", {}),
                               ("vllm:request_success_total", "deltaspec_requests_finished_total",
                                {"finished_reason": "length"}),
                               ("vllm:time_to_first_token_seconds_count", "deltaspec_time_to_first_token_seconds_count",
                                {}),
                               ("vllm:inter_token_latency_seconds_bucket",
                                "deltaspec_inter_token_latency_seconds_bucket", {"le": "0.05"}),
                               ("vllm:e2e_request_latency_seconds_sum", "deltaspec_e2e_request_latency_seconds_sum",
                                {})):
        ours_labels = {("finish_reason" if k == "finished_reason" else k): v for k, v in labels.items()}
        assert after[(vllm, tuple(sorted({**model, **labels}.items())))] == \
            after[(ours, tuple(sorted(ours_labels.items())))], vllm
    blocks_used = 1 - stats["num_free_kv_blocks"] / stats["num_kv_blocks"]
    assert after[("vllm:kv_cache_usage_perc", (("model_name", MODEL),))] == pytest.approx(blocks_used)
    assert after[("vllm:spec_decode_num_draft_tokens_total", (("model_name", MODEL),))] == \
        sum(spec["proposed_by_position"])
    for position, accepted in enumerate(spec["accepted_by_position"]):
        assert after[("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                      (("model_name", MODEL), ("position", str(position))))] == accepted
    assert after[("vllm:prefix_cache_hits_total", (("model_name", MODEL),))] == stats["prefix_cache"]["reused_tokens"]


# Servers with other settings --------------------------------------------------------------------

async def test_api_key_guards_the_v1_routes(engine, http):
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, api_key="sesame"))
    base_url = f"http://127.0.0.1:{running.port}"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            async with http.post(f"{base_url}/v1/completions", json={"prompt": "hi"}, headers=headers) as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "invalid_api_key"
        async with http.get(f"{base_url}/health") as response:
            assert response.status == 200
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sesame", max_retries=0) as client:
            response = await client.completions.create(model=MODEL, prompt="hi", **GREEDY)
            assert response.choices[0].finish_reason in ("stop", "length")
        # The scheme is case-insensitive (RFC 7235).
        async with http.get(f"{base_url}/v1/models", headers={"Authorization": "bearer sesame"}) as response:
            assert response.status == 200
    finally:
        await running.stop()


async def test_cross_origin_requests_from_browsers(engine, http):
    """CORS as vLLM sets it up: by default any origin, a preflight answered before the API key
    (browsers send none on it) and the allow-origin header on every response, streams and
    errors included; a configured policy echoes its origins (with Vary and credentials) and
    refuses the others' preflights."""
    servers = [await start(engine, ServerConfig(model_name=MODEL, port=0, api_key="sesame")),
               await start(engine, ServerConfig(model_name=MODEL, port=0, cors=CorsPolicy(
                   origins=("http://app.example",), methods=("POST",), headers=("Authorization", "Content-Type"),
                   credentials=True)))]
    open_url, strict_url = (f"http://127.0.0.1:{running.port}" for running in servers)
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    try:
        async with http.options(f"{open_url}/v1/completions", headers={"Origin": "http://x.test", **preflight}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        key = {"Authorization": "Bearer sesame"}
        async with http.post(f"{open_url}/v1/completions", json=body, headers={"Origin": "http://x.test", **key}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert (await r.text()).rstrip().endswith("data: [DONE]")
        async with http.post(f"{open_url}/v1/completions", json=body, headers={"Origin": "http://x.test"}) as r:
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
        async with http.get(f"{open_url}/health") as r:  # no Origin: not a cross-origin request
            assert "Access-Control-Allow-Origin" not in r.headers
        origin = {"Origin": "http://app.example"}
        async with http.options(f"{strict_url}/v1/completions", headers={**origin, **preflight}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
            assert r.headers["Access-Control-Allow-Credentials"] == "true" and r.headers["Vary"] == "Origin"
            assert r.headers["Access-Control-Allow-Methods"] == "POST"
        async with http.post(f"{strict_url}/v1/completions", json=body, headers=origin) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
        for headers, refused in (({"Origin": "http://evil.example", **preflight}, "origin"),
                                 ({**origin, **preflight, "Access-Control-Request-Method": "DELETE"}, "method"),
                                 ({**origin, **preflight, "Access-Control-Request-Headers": "x-secret"}, "headers")):
            async with http.options(f"{strict_url}/v1/completions", headers=headers) as r:
                assert r.status == 400 and await r.text() == f"Disallowed CORS {refused}"
                assert "Access-Control-Allow-Origin" not in r.headers or refused != "origin"
        async with http.post(f"{strict_url}/v1/completions", json=body, headers={"Origin": "http://evil.example"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers
            await r.read()
    finally:
        for running in servers:
            await running.stop()


async def test_overload_gets_503_and_the_queue_recovers(checkpoint, http):
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, max_waiting=1))
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    long = {"prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        holder = await http.post(url, json=long)  # headers come with the first token: it holds the one slot
        await holder.content.readline()
        queued = asyncio.create_task(http.post(url, json={"prompt": "Hi", **GREEDY}))
        while engine.stats()["num_waiting"] == 0:
            await asyncio.sleep(0.005)
        async with http.post(url, json={"prompt": "Hey", **GREEDY}) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "overloaded"
        holder.close()  # hang up: the slot frees and the queued request runs
        async with await queued as response:
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] >= 1
        await wait_idle(engine)
    finally:
        await running.stop()
        await engine.shutdown()


async def test_admits_max_running_plus_max_waiting_at_once(checkpoint, http):
    # Requests arriving together all sit in the engine's queue until its next step: the limit
    # counts running and queued ones alike (2 + 3 here, as 64 + 256 with the CLI's defaults).
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, max_waiting=3))
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 32, "temperature": 0, "ignore_eos": True}

    async def status(index: int) -> tuple[int, str | None]:
        async with http.post(url, json={**body, "prompt": f"Hello {index}"}) as response:
            await response.read()
            return response.status, response.headers.get("Retry-After")

    try:
        statuses = await asyncio.gather(*(status(i) for i in range(8)))
        assert sorted(statuses, key=str) == [(200, None)] * 5 + [(503, "1")] * 3
        await wait_idle(engine)
    finally:
        await running.stop()
        await engine.shutdown()


async def test_logprobs(client, engine):
    """Log-probabilities of the chosen tokens (and the top alternatives) agree with the model's
    own distribution: a greedy token is the most likely one, so its logprob leads the top list."""
    completion = await client.completions.create(model=MODEL, prompt="def add(a, b):", logprobs=2, **GREEDY,
                                                 extra_body=IGNORE_EOS)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    # The chosen token and the 2 most likely (it is one of them: greedy); the legacy format keys
    # alternatives by text, so tokens that decode alike collapse into one.
    assert all(chosen <= 0 and 1 <= len(top) <= 2 and token in top
               for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                **GREEDY, extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4 for t in content)
    streamed = []
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                  stream=True, **GREEDY, extra_body=IGNORE_EOS)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [t.logprob for t in chunk.choices[0].logprobs.content]
    assert streamed == [t.logprob for t in content]


# Echo and prompt log-probabilities --------------------------------------------------------------

ATOL = 1e-4  # as the engine's prompt-logprob tests


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Log-probabilities of each next token, independently of the server and its engine:
    LLM.score's logits at every position, normalised here."""
    llm = LLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN)

    def scores(token_ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(llm.score(token_ids).double(), dim=-1)  # [T, V]: row t scores token t + 1

    yield scores
    llm.close()


async def test_echo_text_is_the_prompt_then_the_completion(client, engine):
    prompt = "def fibonacci(n):"
    plain = await client.completions.create(model=MODEL, prompt=prompt, extra_body=IGNORE_EOS, **GREEDY)
    echoed = await client.completions.create(model=MODEL, prompt=prompt, echo=True, extra_body=IGNORE_EOS, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert totals(echoed.usage) == totals(plain.usage) and echoed.choices[0].finish_reason == "length"
    # A token-id prompt echoes its ids decoded.
    token_ids = engine.tokenizer.encode(prompt)
    by_ids = await client.completions.create(model=MODEL, prompt=token_ids, echo=True, extra_body=IGNORE_EOS, **GREEDY)
    assert by_ids.choices[0].text == engine.tokenizer.decode(token_ids, skip_special_tokens=False) \
        + plain.choices[0].text == echoed.choices[0].text

    # Streamed: the first chunk holds the prompt, before any generated text.
    stream = await client.completions.create(model=MODEL, prompt=prompt, echo=True, stream=True,
                                             extra_body=IGNORE_EOS, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(chunk.choices[0].text for chunk in chunks) == echoed.choices[0].text

    # A list of prompts, n = 2 each: every choice echoes its own prompt (choice i of prompt p at
    # p * n + i).
    prompts = ["Hello", "The engine schedules"]
    alone = [(await client.completions.create(model=MODEL, prompt=p, extra_body=IGNORE_EOS, **GREEDY)).choices[0].text
             for p in prompts]
    batch = await client.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, extra_body=IGNORE_EOS,
                                            **GREEDY)
    assert [(c.index, c.text) for c in batch.choices] == [
        (index, prompts[index // 2] + alone[index // 2]) for index in range(4)]
    stream = await client.completions.create(model=MODEL, prompt=prompts, n=2, echo=True, stream=True,
                                             extra_body=IGNORE_EOS, **GREEDY)
    streamed, seen = [""] * 4, set()
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.index not in seen:  # each choice's first chunk starts with its prompt
                assert choice.text.startswith(prompts[choice.index // 2])
                seen.add(choice.index)
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in batch.choices]
    await wait_idle(engine)


async def test_echo_logprobs_score_the_prompt_as_the_reference_does(client, engine, reference):
    """lm-evaluation-harness's loglikelihood request: token ids, max_tokens 1, logprobs 1, echo.
    The prompt is a context plus its greedy continuation, so some of its tokens are the most
    likely at their position (is_greedy holds there) and others are not."""
    context = engine.tokenizer.encode("class Cache:\n    def get(self, key):")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = context + [t async for delta in engine.generate(context, params) for t in delta.token_ids]
    response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                               echo=True, seed=1234)
    [choice] = response.choices
    lp = choice.logprobs
    prompt_text = engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt) + 1
    assert lp.tokens[:len(prompt)] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert choice.text.startswith(prompt_text) and response.usage.completion_tokens == 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first
    assert lp.text_offset[:len(prompt)] == [len("".join(lp.tokens[:i])) for i in range(len(prompt))]
    assert lp.text_offset[-1] == len(prompt_text)  # the generated token starts after the echo

    scores = reference(prompt)
    num_greedy = num_not_greedy = 0
    for i in range(1, len(prompt)):
        row, top = scores[i - 1], lp.top_logprobs[i]
        assert lp.token_logprobs[i] == pytest.approx(float(row[prompt[i]]), abs=ATOL)
        # The token's own entry and the most likely token's (one entry when they decode alike).
        assert lp.tokens[i] in top and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(float(row.max()), abs=ATOL)
        # lm-eval's is_greedy (the token's logprob is the largest of its top_logprobs) holds
        # exactly where the reference's most likely token is the prompt's (away from near-ties).
        first, second = row.topk(2).values.tolist()
        is_argmax = int(row.argmax()) == prompt[i]
        if (first - second if is_argmax else first - float(row[prompt[i]])) > ATOL:
            assert (lp.token_logprobs[i] == max(top.values())) == is_argmax, i
            num_greedy += is_argmax
            num_not_greedy += not is_argmax
    assert num_greedy and num_not_greedy  # both cases were checked
    # The continuation's log-likelihood, as lm-eval sums it.
    ctxlen = len(context)
    expected = sum(float(scores[i - 1, prompt[i]]) for i in range(ctxlen, len(prompt)))
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(expected, abs=len(prompt) * ATOL)
    # The generated token (greedy) leads its own top_logprobs.
    assert lp.tokens[-1] in lp.top_logprobs[-1] and lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())

    # max_tokens 0: the prompt alone (vLLM's echo without generation), scored the same way.
    only = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=3,
                                           echo=True)
    [alone] = only.choices
    assert alone.text == prompt_text and alone.finish_reason == "length"
    assert (only.usage.prompt_tokens, only.usage.completion_tokens, only.usage.total_tokens) == (
        len(prompt), 0, len(prompt))
    assert alone.logprobs.tokens == lp.tokens[:-1] and alone.logprobs.text_offset == lp.text_offset[:-1]
    assert alone.logprobs.token_logprobs[0] is None and alone.logprobs.top_logprobs[0] is None
    assert alone.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=ATOL)
    for i, top in enumerate(alone.logprobs.top_logprobs[1:], 1):
        assert alone.logprobs.tokens[i] in top and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(float(scores[i - 1].max()), abs=ATOL)
    # Without logprobs: the text alone.
    text_only = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert text_only.choices[0].text == prompt_text and text_only.choices[0].logprobs is None
    assert text_only.usage.completion_tokens == 0
    await wait_idle(engine)


async def test_streamed_echo_logprobs_come_first_and_equal_the_response(client, engine):
    prompt = "def add(a, b):"
    num_prompt_tokens = len(engine.tokenizer.encode(prompt))
    options = dict(model=MODEL, prompt=prompt, echo=True, logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    whole = (await client.completions.create(**options)).choices[0]
    stream = await client.completions.create(stream=True, **options)
    chunks = [chunk.choices[0] async for chunk in stream]
    first = chunks[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) > num_prompt_tokens  # the prompt's entries and the first token's
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, field)] == getattr(whole.logprobs, field), field

    # max_tokens 0: one chunk with the prompt, its log-probabilities, "length", no tokens in usage.
    stream = await client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
                                             stream=True, stream_options={"include_usage": True})
    *text_chunks, usage_chunk = [chunk async for chunk in stream]
    [only] = [chunk.choices[0] for chunk in text_chunks]
    assert only.text == prompt and only.finish_reason == "length"
    assert only.logprobs.tokens == whole.logprobs.tokens[:num_prompt_tokens]
    assert usage_chunk.usage.completion_tokens == 0 and usage_chunk.usage.prompt_tokens == num_prompt_tokens
    await wait_idle(engine)


def check_prompt_logprobs(entries: list, prompt: list[int], scores: torch.Tensor, top_n: int, tokenizer) -> None:
    """vLLM's prompt_logprobs shape, against the reference: the first null, then per position
    {token id: {logprob, rank, decoded_token}} for the prompt token and the top_n most likely."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry = scores[i - 1], entries[i]
        own = entry[str(prompt[i])]
        assert own["logprob"] == pytest.approx(float(row[prompt[i]]), abs=ATOL)
        assert own["decoded_token"] == tokenizer.decode([prompt[i]], skip_special_tokens=False)
        assert int((row > row[prompt[i]] + ATOL).sum()) + 1 <= own["rank"] <= int((row >= row[prompt[i]] - ATOL).sum())
        # The top_n most likely hold ranks 1..top_n (the prompt token among them when it is).
        top = sorted((value for value in entry.values() if value["rank"] <= top_n), key=lambda value: value["rank"])
        assert len(entry) in (top_n, top_n + 1) and [value["rank"] for value in top] == list(range(1, top_n + 1))
        assert [value["logprob"] for value in top] == pytest.approx(row.topk(top_n).values.tolist(), abs=ATOL)


async def test_prompt_logprobs_in_vllm_shape_on_both_routes(http, base_url, engine, reference):
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    return")

    async def post(route: str, body: dict) -> dict:
        async with http.post(base_url + route, json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    completion = await post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                "prompt_logprobs": 3})
    [choice] = completion["choices"]
    check_prompt_logprobs(choice["prompt_logprobs"], prompt, reference(prompt), 3, engine.tokenizer)
    assert choice["logprobs"] is None  # (logprobs were not asked for)
    plain = await post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert "prompt_logprobs" not in plain["choices"][0] and plain["choices"][0]["text"] == choice["text"]
    # Both, and echo: the engine scores the prompt once, for the larger count; each takes its own.
    both = await post("/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                          "prompt_logprobs": 3})
    [choice] = both["choices"]
    check_prompt_logprobs(choice["prompt_logprobs"], prompt, reference(prompt), 3, engine.tokenizer)
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    async with http.post(f"{base_url}/tokenize", json={"messages": messages}) as response:
        chat_prompt = (await response.json())["tokens"]
    chat = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0, "n": 2,
                                               "prompt_logprobs": 0})
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt) and len(chat["choices"]) == 2
    check_prompt_logprobs(chat["prompt_logprobs"], chat_prompt, reference(chat_prompt), 0, engine.tokenizer)
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the prompt token's own alone
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    plain = await post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert "prompt_logprobs" not in plain
    await wait_idle(engine)
