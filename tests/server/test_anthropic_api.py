"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), driven by the
official `anthropic` client and raw HTTP.

One in-process server over a tiny random Qwen3.5 checkpoint with Qwen3.5's chat template
(thinking, XML tool calls), so thinking and tool_use blocks are exercised; the random model
rarely closes its thoughts, so requests that want text turn thinking off. Every request is
greedy with few tokens. A message must answer as /v1/chat/completions answers the equivalent
chat request, render its prompt token for token (count_tokens and usage.input_tokens both), a
stream must assemble to the whole message, and whatever cannot be honoured gets a typed error.
"""

import asyncio
import json

import aiohttp
import anthropic
import msgspec
import pytest
import pytest_asyncio
from anthropic._models import construct_type
from anthropic.types import RawMessageStreamEvent
from prometheus_client.parser import text_string_to_metric_families

from deltaspec.engine import AsyncLLM
from deltaspec.server.anthropic_api import SIGNATURE, MessagesRenderer, chat_request, messages_input
from deltaspec.server.anthropic_protocol import MessageInput, MessagesRequest
from deltaspec.server.chat_output import ChatOutput, OutputSettings
from deltaspec.server.config import ServerConfig
from deltaspec.server.protocol import Usage
from deltaspec.server.reasoning import ReasoningParser
from deltaspec.server.serve import start
from deltaspec.server.tool_parsers import make_tool_call_parser
from fixtures import assert_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
NO_THINKING = {"type": "disabled"}
THINKING = {"type": "enabled", "budget_tokens": 1024}
# The anthropic client (2.x) has no sampling parameters any more; the API, and this server, still
# take temperature, top_p and top_k.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}
SEARCH = {"name": "search", "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}


def chat_tool(tool: dict) -> dict:
    """An Anthropic tool in chat's shape."""
    function = {"name": tool["name"], **({"description": tool["description"]} if "description" in tool else {}),
                "parameters": tool["input_schema"]}
    return {"type": "function", "function": function}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen3_5_checkpoint):
    engine = AsyncLLM(qwen3_5_checkpoint, max_model_len=2048)
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def claude(base_url):
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0) as claude:
        yield claude


async def tokenize(http: aiohttp.ClientSession, base_url: str, messages: list, **fields) -> list[int]:
    """The prompt /v1/chat/completions renders for these chat messages."""
    async with http.post(f"{base_url}/tokenize", json={"messages": messages, **fields}) as reply:
        assert reply.status == 200, await reply.text()
        return (await reply.json())["tokens"]


async def count(claude: anthropic.AsyncAnthropic, **request) -> int:
    return (await claude.messages.count_tokens(model=MODEL, **request)).input_tokens


def without_ids(value):
    """A message (as JSON data) without what differs between two runs of one request: ids, and
    how its prompt splits into computed and cache-read tokens (a later run finds the prompt
    cached); the prompt's total stays."""
    if isinstance(value, dict):
        if "cache_read_input_tokens" in value:
            value = {**value, "input_tokens": value["input_tokens"] + value["cache_read_input_tokens"],
                     "cache_read_input_tokens": None}
        return {key: without_ids(item) for key, item in value.items() if key != "id"}
    if isinstance(value, list):
        return [without_ids(item) for item in value]
    return value


def check_stream(events: list) -> anthropic.types.Message:
    """The message a stream's events assemble to, after checking them: message_start first
    (empty, no stop reason), then each block's content_block_start, deltas of its kind (a
    thinking block's signature last) and content_block_stop, the blocks one after the other,
    then message_delta and message_stop."""
    assert [event.type for event in events[:1] + events[-2:]] == ["message_start", "message_delta", "message_stop"]
    message = events[0].message.model_copy(deep=True)
    assert message.content == [] and message.stop_reason is None and message.id.startswith("msg_")
    delta_kinds = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                   "tool_use": {"input_json_delta"}}
    block, partial_json = None, ""
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert block is None and event.index == len(message.content)
            block = event.content_block.model_copy(deep=True)
            message.content.append(block)
            assert block.type != "tool_use" or block.input == {}
            continue
        assert block is not None and event.index == len(message.content) - 1, event
        if event.type == "content_block_stop":
            if block.type == "tool_use":
                block.input, partial_json = json.loads(partial_json), ""
            if block.type == "thinking":
                assert block.signature == SIGNATURE
            block = None
            continue
        delta = event.delta
        assert event.type == "content_block_delta" and delta.type in delta_kinds[block.type]
        assert block.type != "thinking" or not block.signature  # the signature comes last
        if delta.type == "text_delta":
            block.text += delta.text
        elif delta.type == "thinking_delta":
            block.thinking += delta.thinking
        elif delta.type == "signature_delta":
            block.signature = delta.signature
        else:
            partial_json += delta.partial_json
    assert block is None
    end = events[-2]
    message.stop_reason, message.stop_sequence = end.delta.stop_reason, end.delta.stop_sequence
    assert (end.usage.input_tokens, end.usage.cache_read_input_tokens) == \
        (message.usage.input_tokens, message.usage.cache_read_input_tokens)
    message.usage.output_tokens = end.usage.output_tokens
    return message


def prompt_tokens(message) -> int:
    """The whole prompt: Anthropic's usage splits it into computed and cache-read tokens."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


async def stream_events(claude: anthropic.AsyncAnthropic, **request) -> list:
    return [event async for event in await claude.messages.create(model=MODEL, stream=True, **request)]


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict:
    async with http.get(f"{base_url}/metrics") as response:
        text = await response.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def num_finished(scraped: dict) -> float:
    return sum(value for (name, _), value in scraped.items() if name == "deltaspec_requests_finished_total")


# Answers ----------------------------------------------------------------------------------------

async def test_a_message_answers_as_chat_does(claude, client, http, base_url):
    """A system prompt and a user message are chat's system and user messages: the text, the
    usage and the prompt (count_tokens) are the chat completion's; cut by max_tokens, the
    stop_reason is max_tokens. The route is counted and timed as every /v1 route is."""
    answered = ("deltaspec_requests_total", (("route", "/v1/messages"), ("status", "200")))
    scraped = await scrape(http, base_url)
    before = scraped.get(answered, 0), num_finished(scraped)
    request = dict(system="Be brief.", messages=[{"role": "user", "content": "What is 2 + 2?"}])
    message = await claude.messages.create(model=MODEL, max_tokens=8, thinking=NO_THINKING,
                                           metadata={"user_id": "u1"},
                                           extra_body={"temperature": 0, "service_tier": "auto"}, **request)
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2 + 2?"}],
        temperature=0, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    text = answer.choices[0].message.content
    assert [block.type for block in message.content] == ["text"] * bool(text)
    assert (message.content[0].text if text else None) == text
    assert prompt_tokens(message) == answer.usage.prompt_tokens
    assert message.usage.output_tokens == answer.usage.completion_tokens
    assert message.stop_reason == ("max_tokens" if answer.choices[0].finish_reason == "length" else "end_turn")
    assert message.stop_sequence is None and message.usage.cache_creation_input_tokens == 0
    # The message computed this prompt just before: the chat completion restores it whole, and
    # the message's split into computed and cache-read tokens sums to it.
    assert answer.usage.prompt_tokens_details.cached_tokens == answer.usage.prompt_tokens
    assert message.usage.input_tokens > 0
    assert await count(claude, thinking=NO_THINKING, **request) == answer.usage.prompt_tokens
    scraped = await scrape(http, base_url)
    # One /v1/messages request and the chat one, each timed to its finish.
    assert (scraped[answered] - before[0], num_finished(scraped) - before[1]) == (1, 2)


async def test_system_blocks_and_system_messages_render_one_system_message(claude, http, base_url):
    """System text blocks join as sent; Claude Code's billing-header block is left out (its hash
    changes with every request, at the start of the prompt); a system message in `messages` is
    folded into the system prompt, after a blank line (Qwen's templates take one, first)."""
    user = {"role": "user", "content": "Hi"}
    expected = await tokenize(http, base_url, [{"role": "system", "content": "You are terse."}, user])
    assert await count(claude, system="You are terse.", messages=[user]) == len(expected)
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1; cch=1a2b3;"},
              {"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert await count(claude, system=blocks, messages=[user]) == len(expected)
    reminder = {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}
    folded = await tokenize(http, base_url, [{"role": "system", "content": "You are terse.\n\nAnswer in French."},
                                             user, {"role": "assistant", "content": "Salut"}, user])
    assert await count(claude, system="You are terse.",
                       messages=[user, {"role": "assistant", "content": "Salut"}, reminder, user]) == len(folded)
    message = await claude.messages.create(model=MODEL, max_tokens=2, system=blocks, messages=[user, reminder])
    assert prompt_tokens(message) == len(await tokenize(
        http, base_url, [{"role": "system", "content": "You are terse.\n\nAnswer in French."}, user]))


async def test_thinking_switches_the_templates_thinking(claude, client, http, base_url):
    """thinking disabled renders Qwen3.5's closed think block (enable_thinking false); enabled and
    adaptive its open one, as leaving it out does. The reasoning comes back as a thinking block
    (its text chat's reasoning_content), signed with a marker."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    thinking_on = await tokenize(http, base_url, messages)
    thinking_off = await tokenize(http, base_url, messages, chat_template_kwargs={"enable_thinking": False})
    assert thinking_on != thinking_off
    assert await count(claude, messages=messages, thinking=NO_THINKING) == len(thinking_off)
    for thinking in (THINKING, {"type": "adaptive"}, None):
        fields = {"thinking": thinking} if thinking else {}
        assert await count(claude, messages=messages, **fields) == len(thinking_on)
    message = await claude.messages.create(model=MODEL, max_tokens=8, messages=messages, thinking=THINKING,
                                           **GREEDY)
    answer = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    reasoning = answer.choices[0].message.reasoning_content
    assert reasoning and message.content[0].type == "thinking" and message.content[0].thinking == reasoning
    assert message.content[0].signature == SIGNATURE
    assert prompt_tokens(message) == len(thinking_on)


@pytest.mark.parametrize("case", ["text", "thinking", "tool_use", "stop_sequence"])
async def test_a_stream_assembles_to_the_whole_message(claude, case):
    """Greedy: the events of a stream (create(stream=True), and the stream helper's final
    message) come in order and assemble to the non-streamed message."""
    request = {"text": dict(thinking=NO_THINKING, max_tokens=8),
               "thinking": dict(thinking=THINKING, max_tokens=8),
               "tool_use": dict(tools=[WEATHER, SEARCH], tool_choice={"type": "any"}, max_tokens=24),
               "stop_sequence": dict(thinking=NO_THINKING, max_tokens=12)}[case]
    request.update(messages=[{"role": "user", "content": "Weather in Paris?"}], **GREEDY)
    if case == "stop_sequence":  # a piece of the greedy answer, so that the stream stops there
        text = (await claude.messages.create(model=MODEL, **request)).content[0].text
        assert len(text) >= 7, text
        request["stop_sequences"] = ["never written", text[4:7]]
    whole = await claude.messages.create(model=MODEL, **request)
    streamed = check_stream(await stream_events(claude, **request))
    assert without_ids(streamed.model_dump(mode="json")) == without_ids(whole.model_dump(mode="json"))
    async with claude.messages.stream(model=MODEL, **request) as stream:
        helped = await stream.get_final_message()
    assert without_ids(helped.model_dump(mode="json")) == without_ids(whole.model_dump(mode="json"))
    kinds = [block.type for block in whole.content]
    if case == "thinking":
        assert kinds[0] == "thinking"
    if case == "tool_use":
        assert kinds[-1] == "tool_use" and whole.stop_reason in ("tool_use", "max_tokens")
    if case == "stop_sequence":
        assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == text[4:7]
        assert "".join(block.text for block in whole.content) == text[:text.index(text[4:7])]


async def test_the_stream_is_server_sent_events_with_types_and_no_done(http, base_url):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "thinking": NO_THINKING,
            "messages": [{"role": "user", "content": "Hello"}]}
    async with http.post(f"{base_url}/v1/messages", json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        text = await response.text()
    blocks = [block for block in text.split("\n\n") if block]
    assert blocks and "[DONE]" not in text
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")
    assert blocks[-1].startswith("event: message_stop")


WRITTEN = ("Let me see.</think>\n\nChecking both.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
           "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
           "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("tokens_per_delta", [1, 3, 1000])
async def test_thinking_text_and_calls_stream_as_the_whole_message(engine, tokens_per_delta):
    """An output written out (the random model writes none like it): reasoning, text, two calls,
    read whole and in deltas of `tokens_per_delta` tokens: four blocks, streamed in order (the
    events as the anthropic client parses them), the same message either way."""
    tokenizer = engine.tokenizer
    token_ids = tokenizer.encode(WRITTEN)
    usage = Usage(5, len(token_ids), 5 + len(token_ids))
    request = MessagesRequest(model=MODEL, max_tokens=100, messages=[MessageInput("user", "Weather?")])

    def renderer() -> MessagesRenderer:
        parser = make_tool_call_parser("qwen3_coder", {"get_weather": WEATHER["input_schema"]})
        settings = OutputSettings(reasoning=ReasoningParser(True), tool_calls=parser)
        return MessagesRenderer(request, MODEL, tokenizer, ChatOutput(settings), 100)

    whole = renderer().response(WRITTEN, "stop", usage, token_ids, None, None)
    streaming = renderer()
    chunks = streaming.opening(Usage(5, 0, 5))
    for start in range(0, len(token_ids), tokens_per_delta):
        end = min(start + tokens_per_delta, len(token_ids))
        chunks += streaming.chunks(tokenizer.decode(token_ids[start:end]), "stop" if end == len(token_ids) else None,
                                   token_ids[start:end], None, None)
    raw = b"".join(map(streaming.event, chunks)) + streaming.end(usage)
    events = [construct_type(type_=RawMessageStreamEvent, value=json.loads(block.split(b"\ndata: ")[1]))
              for block in raw.split(b"\n\n") if block]
    streamed = check_stream(events)
    parsed = construct_type(type_=anthropic.types.Message, value=json.loads(msgspec.json.encode(whole)))
    assert [block.type for block in parsed.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, paris, rome = parsed.content
    assert (thinking.thinking, text.text) == ("Let me see.", "Checking both.")
    assert (paris.input, rome.input) == ({"city": "Paris", "days": 2}, {"city": "Rome"})
    assert paris.id.startswith("toolu_") and paris.id != rome.id and parsed.stop_reason == "tool_use"
    assert without_ids(streamed.model_dump()) == without_ids(parsed.model_dump())


# Tools and history --------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "search"}, {"type": "any"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
async def test_a_forced_tool_choice_yields_a_tool_use_block(claude, http, base_url, tool_choice):
    """The forced call's opening is part of the prompt: count_tokens counts it, as usage does.
    The message goes back as it came (the client's own blocks), with the call's result."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    message = await claude.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER, SEARCH],
                                           tool_choice=tool_choice, messages=messages, **GREEDY)
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and isinstance(call.input, dict)
    assert call.name in ({"search"} if tool_choice["type"] == "tool" else {"get_weather", "search"})
    assert message.stop_reason in ("tool_use", "max_tokens")
    assert await count(claude, tools=[WEATHER, SEARCH], tool_choice=tool_choice, messages=messages) == \
        prompt_tokens(message)
    history = [*messages, {"role": "assistant", "content": message.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    again = await claude.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER, SEARCH], messages=history)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_a_history_of_blocks_renders_the_prompt_chat_renders(claude, client, http, base_url, engine, server):
    """Blocks map to chat messages: an assistant's thinking is its reasoning_content, its tool_use
    blocks its tool_calls; a user's tool_result blocks are tool messages, in order, before the
    user message of its text; the rendered prompt is the equivalent chat request's, token for
    token (count_tokens and usage.input_tokens)."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris and Rome?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two calls.", "signature": "anything"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "25 C"}],
             "is_error": False},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris and Rome?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "Two calls.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "toolu_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text", "text": "25 C"}]},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    expected = await tokenize(http, base_url, messages, tools=[chat_tool(WEATHER)])
    parsed = msgspec.convert({"model": MODEL, "max_tokens": 6, "system": "You are a weather bot.", "tools": [WEATHER],
                              "messages": history}, MessagesRequest)
    engine_input, _ = messages_input(chat_request(parsed), parsed.max_tokens, engine.tokenizer, engine.max_model_len,
                                     server.server.chat_parsers)
    assert engine_input.prompt_token_ids == expected
    # Results alone: no new question, so the template renders the turn's reasoning.
    results_only = msgspec.structs.replace(parsed, messages=[*parsed.messages[:2], msgspec.structs.replace(
        parsed.messages[2], content=parsed.messages[2].content[:2])])
    engine_input, _ = messages_input(chat_request(results_only), results_only.max_tokens, engine.tokenizer,
                                     engine.max_model_len, server.server.chat_parsers)
    assert "<think>\nTwo calls.\n</think>" in engine.tokenizer.decode(engine_input.prompt_token_ids)
    # As Claude Code sends it: through the beta client (`?beta=true`, anthropic-beta), with
    # context_management (which edits nothing here).
    request = dict(model=MODEL, system="You are a weather bot.", tools=[WEATHER], messages=history,
                   betas=["context-management-2025-06-27"])
    edits = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
             "cache_control": {"type": "ephemeral"}}
    assert (await claude.beta.messages.count_tokens(**request, extra_body=edits)).input_tokens == len(expected)
    message = await claude.beta.messages.create(max_tokens=6, **request, extra_body={**edits, "temperature": 0})
    assert prompt_tokens(message) == len(expected)
    answer = await client.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool(WEATHER)],
                                                temperature=0, max_tokens=6)
    reasoning = answer.choices[0].message.reasoning_content
    assert [block.thinking for block in message.content if block.type == "thinking"] == [reasoning] * bool(reasoning)


async def test_a_final_assistant_message_is_continued(claude, client):
    """Prefill: the model goes on writing a final assistant message (chat's continue_final_message)."""
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    message = await claude.messages.create(model=MODEL, max_tokens=4, thinking=NO_THINKING, messages=messages,
                                           **GREEDY)
    answer = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_tokens(message) == answer.usage.prompt_tokens
    assert "".join(block.text for block in message.content if block.type == "text") == \
        (answer.choices[0].message.content or "")


async def test_max_tokens_past_the_context_is_cut_to_the_room_left(engine, server):
    """Claude Code asks for 32000 tokens and more whatever the context: the engine runs what the
    context leaves, and an output that fills it stops with model_context_window_exceeded (a
    smaller context stands in for a long prompt)."""
    request = MessagesRequest(model=MODEL, max_tokens=100_000, messages=[MessageInput("user", "Hello")])
    parsers = server.server.chat_parsers
    engine_input, settings = messages_input(chat_request(request), request.max_tokens, engine.tokenizer, 2048, parsers)
    assert engine_input.params.max_tokens == 2048 - len(engine_input.prompt_token_ids)
    short = len(engine_input.prompt_token_ids) + 5
    engine_input, settings = messages_input(chat_request(request), request.max_tokens, engine.tokenizer, short,
                                            parsers)
    assert engine_input.params.max_tokens == 5
    renderer = MessagesRenderer(request, MODEL, engine.tokenizer, ChatOutput(settings), engine_input.params.max_tokens)
    usage = Usage(len(engine_input.prompt_token_ids), 5, short)
    assert renderer.response("a b c", "length", usage, engine.tokenizer.encode("a b c"), None,
                             None).stop_reason == "model_context_window_exceeded"
    asked = MessagesRequest(model=MODEL, max_tokens=5, messages=[MessageInput("user", "Hello")])
    engine_input, settings = messages_input(chat_request(asked), asked.max_tokens, engine.tokenizer, 2048, parsers)
    renderer = MessagesRenderer(asked, MODEL, engine.tokenizer, ChatOutput(settings), engine_input.params.max_tokens)
    assert renderer.response("a b c", "length", usage, engine.tokenizer.encode("a b c"), None,
                             None).stop_reason == "max_tokens"


# Authentication, refusals and failures ------------------------------------------------------------

async def test_the_api_key_goes_as_x_api_key_or_bearer(engine, http):
    """Claude Code sends ANTHROPIC_API_KEY as x-api-key (ANTHROPIC_AUTH_TOKEN as a Bearer token):
    either is accepted, on every /v1 route; a wrong or missing key is Anthropic's
    authentication_error here (OpenAI's elsewhere)."""
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, api_key="sesame"))
    base_url = f"http://127.0.0.1:{running.port}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    try:
        for headers, status in (({"x-api-key": "sesame"}, 200), ({"Authorization": "Bearer sesame"}, 200),
                                ({"x-api-key": "wrong", "Authorization": "Bearer sesame"}, 200),
                                ({"x-api-key": "wrong"}, 401), ({"Authorization": "sesame"}, 401), ({}, 401)):
            async with http.post(f"{base_url}/v1/messages/count_tokens", json=body, headers=headers) as response:
                assert response.status == status, headers
                if status == 401:
                    assert (await response.json())["error"]["type"] == "authentication_error"
        async with http.get(f"{base_url}/v1/models", headers={"x-api-key": "sesame"}) as response:
            assert response.status == 200
        async with http.get(f"{base_url}/v1/models", headers={"x-api-key": "wrong"}) as response:
            assert (await response.json())["error"]["code"] == "invalid_api_key"  # OpenAI's shape
        # (The client sends api_key as x-api-key, or, in some 2.x releases, as a Bearer token.)
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="sesame", max_retries=0) as claude:
            assert await count(claude, messages=body["messages"]) > 0
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="wrong", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError) as raised:
                await claude.messages.create(model=MODEL, max_tokens=2, messages=body["messages"])
            assert raised.value.body["error"]["type"] == "authentication_error"
    finally:
        await running.stop()


# (body fields beside model and max_tokens, a substring of the error's message)
BAD_REQUESTS = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages: image input is not supported: this model reads no images"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0]: Object missing required field `type` - at `$.source`"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "content blocks of type 'image' are not supported: an assistant message takes"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "a user message takes text, image and tool_result blocks"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "an assistant message takes"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "Invalid enum value 'tool'"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "unknown field `mood`"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]: Object missing"),
    ({"messages": []}, "length >= 1"),
    ({"messages": [{"role": "system", "content": "Be brief."}]}, "not only system messages"),
    ({"mood": "happy"}, "unknown field `mood`"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]: tools of type 'web_search_20250305' are not supported: server tools run on Anthropic's servers"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "'bash_20250124'"),
    ({"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]}, "'text_editor_20250728'"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict is not supported"),
    ({"tools": [{"name": "f"}]}, "tools[0]: Object missing required field `input_schema`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers is not supported"),
    ({"container": "c1"}, "container is not supported"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens is required"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "omitted"}}, "thinking.display"),
    ({"thinking": {"type": "between_tools"}}, "Invalid enum value 'between_tools'"),
    ({"temperature": 1.5}, "Expected `float` <= 1"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "output_config.format"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "maximum context length is 2048"),
]


async def test_what_cannot_be_honoured_gets_a_typed_error(claude):
    for fields, message in BAD_REQUESTS:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
        with pytest.raises(anthropic.BadRequestError) as raised:
            await claude.post("/v1/messages", cast_to=object, body=body)
        error = raised.value.body
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", (fields, error)
        assert message in error["error"]["message"], (fields, error)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await claude.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]})
    for path, fields in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        with pytest.raises(anthropic.NotFoundError) as raised:
            await claude.post(path, cast_to=object, body={"model": "claude-sonnet-4-5", **fields,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert raised.value.body["error"]["type"] == "not_found_error"
        assert "'claude-sonnet-4-5' does not exist" in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):  # an Anthropic route this server does not serve
        await claude.post("/v1/messages/batches", cast_to=object, body={})
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])


async def test_a_failed_engine_step_ends_the_stream_with_an_error_event(http, base_url, engine,
                                                                        fail_a_decode_step):
    faults = fail_a_decode_step()
    # Greedy: a sampled reply could end (EOS) before the third token the fault waits for.
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "thinking": NO_THINKING, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]}
    async with http.post(f"{base_url}/v1/messages", json=body) as response:
        assert response.status == 200
        blocks = [block for block in (await response.text()).split("\n\n") if block]
    assert faults
    event, data = blocks[-1].split("\n")
    last = json.loads(data.removeprefix("data: "))
    assert event == "event: error" and last["type"] == "error" and last["error"]["type"] == "api_error"
    assert "CUDA out of memory (injected)" in last["error"]["message"]
    for _ in range(500):  # the failed request's slot and blocks are freed
        stats = engine.stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        await asyncio.sleep(0.01)
    assert_idle(stats)
