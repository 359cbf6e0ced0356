"""OpenAI's Responses API (`POST /v1/responses`), driven by the official `openai` client and raw HTTP.

One in-process server over a tiny random Qwen3.5 checkpoint with Qwen3.5's chat template
(thinking, XML tool calls), so reasoning items and function calls are exercised; the random
model rarely closes its thoughts, so requests that want a message turn thinking off
(chat_template_kwargs). Every request is greedy with few tokens. A response must equal what
/v1/chat/completions answers to the same request, a stream must assemble to the whole response,
and whatever cannot be honoured gets a 400 naming the field.
"""

import asyncio
import json

import aiohttp
import msgspec
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from openai._models import construct_type
from openai.types.responses import ResponseStreamEvent

from deltaspec.engine import AsyncLLM, TokenLogprobs
from deltaspec.server.chat_output import ChatOutput, OutputSettings
from deltaspec.server.protocol import Usage
from deltaspec.server.reasoning import ReasoningParser
from deltaspec.server.responses_api import ResponsesRenderer, chat_request, responses_input
from deltaspec.server.responses_protocol import ResponsesRequest
from deltaspec.server.tool_parsers import make_tool_call_parser
from fixtures import assert_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0, "max_output_tokens": 8}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
SEARCH = {"type": "function", "name": "search",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
YES_OR_NO = {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"],
    "additionalProperties": False}}}


def chat_tool(tool: dict) -> dict:
    """A flat Responses tool in chat's shape."""
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen3_5_checkpoint):
    # A fixed draft count: the verify width moves log-probabilities in their last bits, and the
    # tests compare them exactly.
    engine = AsyncLLM(qwen3_5_checkpoint, max_model_len=2048, num_draft_tokens=2, adaptive_draft_length=False)
    yield engine
    await engine.shutdown()


def without_ids(value):
    """A response (as JSON data) without what differs between two runs of one request: ids,
    times, the stream helper's parsed fields, and how many input tokens were found cached (a
    later run finds the prompt cached)."""
    if isinstance(value, dict):
        return {key: without_ids(item) for key, item in value.items()
                if key not in ("id", "call_id", "item_id", "created_at", "parsed", "parsed_arguments",
                               "cached_tokens")}
    if isinstance(value, list):
        return [without_ids(item) for item in value]
    return value


# The events of one output item, in order (`check_stream`).
ITEM_EVENTS = {
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"],
    "reasoning": ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                  "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}
DELTAS = ("response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta")


def check_stream(events: list):
    """The stream's final response, after checking the events: sequence numbers 0, 1, ...;
    created and in_progress first, the terminal event last; each item's events in order, items
    one after the other; the deltas of each item add up to its final text, and its done event
    carries the final item."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete")
    assert {event.response.id for event in (events[0], events[1], events[-1])} == {final.id}
    by_item: dict[int, list] = {}
    for event in events[2:-1]:
        assert event.output_index >= max(by_item, default=0)  # items do not interleave
        by_item.setdefault(event.output_index, []).append(event)
    assert list(by_item) == list(range(len(final.output)))
    for index, item in enumerate(final.output):
        item_events = by_item[index]
        types = [event.type for event in item_events]
        expected = ITEM_EVENTS[item.type]
        # Deltas: one or more (an empty item may have none); nothing else repeats.
        assert [t for i, t in enumerate(types) if t not in DELTAS or types[i - 1] != t] == \
            [t for t in expected if t in types] and set(expected) - set(DELTAS) <= set(types), types
        assert item_events[0].item.id == item.id and item_events[-1].item == item
        deltas = "".join(event.delta for event in item_events if event.type in DELTAS)
        if item.type == "function_call":
            assert deltas == item.arguments and item_events[-2].arguments == item.arguments
        else:
            assert deltas == item.content[0].text and item_events[-3].text == item.content[0].text
    return final


async def stream_events(client: openai.AsyncOpenAI, **request) -> list:
    return [event async for event in await client.responses.create(model=MODEL, stream=True, **request)]


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict:
    async with http.get(f"{base_url}/metrics") as response:
        text = await response.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


# Answers ----------------------------------------------------------------------------------------

async def test_text_input_and_instructions_answer_as_chat_does(client, engine, http, base_url):
    """A string input with instructions is a system and a user message: the response's text,
    status and usage are the chat completion's; cut by max_output_tokens, it is incomplete."""
    answered = ("deltaspec_requests_total", (("route", "/v1/responses"), ("status", "200")))
    before = (await scrape(http, base_url)).get(answered, 0)
    response = await client.responses.create(model=MODEL, input="What is 2 + 2?", instructions="Be brief.",
                                             extra_body={**NO_THINKING, "ignore_eos": True}, **GREEDY)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2 + 2?"}],
        temperature=0, max_completion_tokens=8, extra_body={**NO_THINKING, "ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete"
    assert response.output_text == message.content[0].text == chat.choices[0].message.content
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens, 8, chat.usage.prompt_tokens + 8)
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens == 0
    # The request's settings come back.
    assert (response.instructions, response.max_output_tokens, response.temperature) == ("Be brief.", 8, 0)
    assert response.store is False and response.error is None and response.tools == []
    assert response.text.format.type == "text" and response.parallel_tool_calls is True
    assert (await scrape(http, base_url))[answered] - before == 1  # counted as every /v1 route is

    ended = await client.responses.create(model=MODEL, input="What is 2 + 2?", extra_body=NO_THINKING,
                                          temperature=0, max_output_tokens=64, metadata={"run": "7"})
    if ended.usage.output_tokens < 64:  # the model wrote its end of turn
        assert ended.status == "completed" and ended.incomplete_details is None
    assert ended.metadata == {"run": "7"}


async def test_reasoning_becomes_a_reasoning_item(client, engine):
    """With thinking on, the think block is a reasoning item (its text in content, no summary),
    as chat's reasoning_content; reasoning_tokens count the tokens up to `</think>`."""
    response = await client.responses.create(model=MODEL, input="What is 2 + 2?", extra_body={"ignore_eos": True},
                                             reasoning={"effort": "low", "summary": "auto"}, **GREEDY)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                                temperature=0, max_tokens=8, reasoning_effort="low",
                                                extra_body={"ignore_eos": True})
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert response.reasoning.effort == "low"
    content = chat.choices[0].message.content
    assert (response.output_text or None) == content
    if content is None:  # never closed its thoughts: every token was reasoning
        assert response.usage.output_tokens_details.reasoning_tokens == 8 and len(response.output) == 1
    else:
        assert 1 <= response.usage.output_tokens_details.reasoning_tokens < 8


@pytest.mark.parametrize("case", ["text", "json", "reasoning", "tool_call", "logprobs"])
async def test_a_stream_assembles_to_the_whole_response(client, case):
    """Greedy: the events of a stream (create(stream=True) and the stream helper) come in order
    and assemble to the response they end with, which is the non-streamed response. (The
    helper's get_final_response wants response.completed: an incomplete one ends the stream
    with response.incomplete.)"""
    request = {"text": dict(input="Hello", extra_body=NO_THINKING, **GREEDY),
               "json": dict(input="Is 2 + 2 four?", text=YES_OR_NO, extra_body=NO_THINKING, temperature=0,
                            max_output_tokens=32),
               "reasoning": dict(input="Hello", extra_body={"ignore_eos": True}, **GREEDY),
               "tool_call": dict(input="Weather in Paris?", tools=[WEATHER, SEARCH], tool_choice="required",
                                 temperature=0, max_output_tokens=24),
               "logprobs": dict(input="Hello", extra_body=NO_THINKING, include=["message.output_text.logprobs"],
                                top_logprobs=2, **GREEDY)}[case]
    whole = await client.responses.create(model=MODEL, **request)
    final = check_stream(await stream_events(client, **request))
    assert without_ids(final.model_dump(mode="json")) == without_ids(whole.model_dump(mode="json"))
    async with client.responses.stream(model=MODEL, **request) as stream:
        events = [event async for event in stream]
        helped = await stream.get_final_response() if whole.status == "completed" else events[-1].response
    assert events[-1].type == f"response.{whole.status}"
    assert without_ids(helped.model_dump(mode="json")) == without_ids(whole.model_dump(mode="json"))
    assert case != "json" or whole.status == "completed"
    if case == "logprobs":
        [message] = whole.output
        entries = message.content[0].logprobs
        assert len(entries) == whole.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in entries)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                    logprobs=True, top_logprobs=2, temperature=0, max_tokens=8,
                                                    extra_body=NO_THINKING)
        assert [e.model_dump() for e in entries] == [e.model_dump() for e in chat.choices[0].logprobs.content]


async def test_the_stream_is_server_sent_events_with_types_and_no_done(http, base_url):
    body = {"model": MODEL, "input": "Hello", "stream": True, **GREEDY, **NO_THINKING}
    async with http.post(f"{base_url}/v1/responses", json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        text = await response.text()
    blocks = [block for block in text.split("\n\n") if block]
    assert blocks and "[DONE]" not in text
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")
    assert json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))["type"] in (
        "response.completed", "response.incomplete")


WRITTEN = ("Let me see.</think>\n\nChecking both.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
           "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
           "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("tokens_per_delta", [1, 3, 1000])
async def test_reasoning_text_and_calls_stream_as_the_whole_response(engine, tokens_per_delta):
    """An output written out (the random model writes none like it): reasoning, text, two calls,
    read by the renderer whole and in deltas of `tokens_per_delta` tokens: four items, streamed in
    order (the events as the openai client parses them), the same response either way; the
    message's logprobs are those of the tokens before it closed (in a stream, the calls' tokens
    come after it closed); reasoning_tokens count the tokens up to `</think>`."""
    tokenizer = engine.tokenizer
    token_ids = tokenizer.encode(WRITTEN)
    logprobs = [TokenLogprobs(-0.5, [(token_id, -0.5)], 1) for token_id in token_ids]
    usage = Usage(5, len(token_ids), 5 + len(token_ids))
    request = ResponsesRequest(input="Weather?", include=["message.output_text.logprobs"], top_logprobs=1)

    def renderer() -> ResponsesRenderer:
        parser = make_tool_call_parser("qwen3_coder", {"get_weather": WEATHER["parameters"]})
        settings = OutputSettings(reasoning=ReasoningParser(True), tool_calls=parser)
        return ResponsesRenderer(request, MODEL, tokenizer, ChatOutput(settings), [1, 2, 3, 4, 5])

    whole = renderer().response(WRITTEN, "stop", usage, token_ids, logprobs, None)
    streaming = renderer()
    chunks = streaming.opening(Usage(5, 0, 5))
    for start in range(0, len(token_ids), tokens_per_delta):
        end = min(start + tokens_per_delta, len(token_ids))
        chunks += streaming.chunks(tokenizer.decode(token_ids[start:end]), "stop" if end == len(token_ids) else None,
                                   token_ids[start:end], logprobs[start:end], None)
    chunks.append(streaming.usage_chunk(usage))
    events = [construct_type(type_=ResponseStreamEvent, value=json.loads(streaming.event(chunk).split(b"data: ")[1]))
              for chunk in chunks]
    final = check_stream(events)

    parsed = construct_type(type_=openai.types.responses.Response, value=json.loads(msgspec.json.encode(whole)))
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, paris, rome = parsed.output
    assert reasoning.content[0].text == "Let me see." and message.content[0].text == "Checking both."
    assert (paris.arguments, rome.arguments) == ('{"city": "Paris"}', '{"city": "Rome"}')
    whole_logprobs = [entry.model_dump() for entry in message.content[0].logprobs]
    streamed_logprobs = [entry.model_dump() for entry in final.output[1].content[0].logprobs]
    assert len(whole_logprobs) == len(token_ids) and streamed_logprobs == whole_logprobs[:len(streamed_logprobs)]
    assert len(tokenizer.decode(token_ids[:len(streamed_logprobs)])) >= WRITTEN.index("<tool_call>")

    def comparable(response) -> dict:
        response = without_ids(response.model_dump(mode="json"))
        response["output"][1]["content"][0]["logprobs"] = None  # compared above
        return response

    assert comparable(final) == comparable(parsed)
    closed = next(k for k in range(1, len(token_ids) + 1) if "</think>" in tokenizer.decode(token_ids[:k]))
    assert whole.usage.output_tokens_details.reasoning_tokens == closed
    assert final.usage.output_tokens_details.reasoning_tokens == closed


# Tools and history --------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "search"}, "required"])
async def test_a_forced_tool_choice_yields_a_function_call(client, tool_choice):
    response = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER, SEARCH],
                                             tool_choice=tool_choice, temperature=0, max_output_tokens=24)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name in ({"search"} if isinstance(tool_choice, dict) else {"get_weather", "search"})
    assert isinstance(json.loads(call.arguments), dict) and call.status in ("completed", "incomplete")
    assert (response.tool_choice.name if isinstance(tool_choice, dict) else response.tool_choice) == \
        (tool_choice["name"] if isinstance(tool_choice, dict) else tool_choice)
    assert [tool.name for tool in response.tools] == ["get_weather", "search"]
    # The output goes back as it came (the client's own objects), with the call's result.
    history = [{"role": "user", "content": "Weather in Paris?"}, *response.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    again = await client.responses.create(model=MODEL, input=history, tools=[WEATHER, SEARCH], temperature=0,
                                          max_output_tokens=4)
    assert again.status in ("completed", "incomplete")


async def test_a_history_of_items_renders_the_prompt_chat_renders(client, engine, server, base_url, http):
    """Items map to chat messages: function_call items join the assistant message before them
    (one turn), a reasoning item becomes its reasoning_content, function_call_output items are
    tool messages; the rendered prompt is the equivalent chat request's, token for token."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "id": "fc_2", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25 C"}]},
    ]
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Paris and Rome?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "reasoning_content": "Two calls.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
    ]
    request = {"model": MODEL, "input": items, "instructions": "You are a weather bot.", "tools": [WEATHER],
               "temperature": 0, "max_output_tokens": 6, "extra_body": {"ignore_eos": True}}
    async with http.post(f"{base_url}/tokenize", json={"messages": messages, "tools": [chat_tool(WEATHER)]}) as reply:
        expected = (await reply.json())["tokens"]
    parsed = ResponsesRequest(input=items, instructions="You are a weather bot.", tools=[WEATHER])
    engine_input, _ = responses_input(chat_request(parsed), engine.tokenizer, engine.max_model_len,
                                      server.server.chat_parsers)
    assert engine_input.prompt_token_ids == expected
    assert "<think>\nTwo calls.\n</think>" in engine.tokenizer.decode(expected)
    response = await client.responses.create(**request)
    chat = await client.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool(WEATHER)],
                                                temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert response.usage.input_tokens == chat.usage.prompt_tokens == len(expected)
    message = chat.choices[0].message
    assert [item.content[0].text for item in response.output if item.type == "reasoning"] == \
        [message.reasoning_content] * (message.reasoning_content is not None)
    assert (response.output_text or None) == message.content


async def test_json_schema_text_format_constrains_the_output(client):
    response = await client.responses.create(model=MODEL, input="Is 2 + 2 four?", text=YES_OR_NO, temperature=0,
                                             max_output_tokens=32, extra_body=NO_THINKING)
    assert response.status == "completed" and json.loads(response.output_text) in ({"answer": "yes"}, {"answer": "no"})
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"
    object_only = await client.responses.create(model=MODEL, input="Hi", text={"format": {"type": "json_object"}},
                                                temperature=0, max_output_tokens=32, extra_body=NO_THINKING)
    if object_only.status == "completed":
        assert isinstance(json.loads(object_only.output_text), dict)


# Refusals and failures ----------------------------------------------------------------------------

# (body fields beside model, the param the 400 names, a substring of its message)
BAD_REQUESTS = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"input": "hi", "store": True}, "store", "not stored"),
    ({"input": "hi", "background": True}, "background", "foreground"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "never truncated"),
    ({"input": "hi", "reasoning": {"summary": "detailed"}}, "reasoning.summary", "no summaries"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include", "cannot be served"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs", "needs include"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens", "max_output_tokens"),
    ({"input": "hi", "n": 2}, "n", "one output"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"input": "hi", "stream_options": {"include_usage": True}}, "stream_options", "response.completed"),
    ({"input": "hi", "mood": "happy"}, "mood", "unknown field"),
    ({"input": "hi", "service_tier": "priority"}, "service_tier", "Invalid enum value"),
    ({"input": []}, "input", "length >= 1"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input", "image input is not supported: this model reads no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type", "'input_file'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "Invalid enum value"),
    ({"input": [{"role": "user", "content": "hi", "mood": "happy"}]}, "input[0].mood", "unknown field"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments", "not valid JSON"),
    ({"input": [{"type": "function_call_output", "output": "21 C"}]}, "input[0].call_id", "call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "xyz"},
                {"role": "assistant", "content": "a"}]}, "input[0].encrypted_content", "cannot be read"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                {"role": "user", "content": "hi"}]}, "input[1]", "reasoning item"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
                {"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[1]", "reasoning item"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]}, "input", "reasoning item"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
    ({"input": "hi", "tools": [{"type": "function", "description": "no name"}]}, "tools[0].name", "name"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "hi", "tools": [WEATHER, SEARCH], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format", "cannot be combined"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "name"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "Invalid enum value"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens", "maximum context length"),
    ({"input": [{"role": "assistant", "content": "no user"}]}, "input", "No user query"),
]


async def test_what_cannot_be_honoured_gets_a_400_naming_it(client):
    for body, param, message in BAD_REQUESTS:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.post("/responses", cast_to=object, body={"model": MODEL, **body})
        error = raised.value.body
        assert error["param"] == param and message in error["message"], (body, error)
    accepted = await client.responses.create(model=MODEL, input="hi", store=False, truncation="disabled",
                                             include=["reasoning.encrypted_content"], service_tier="auto",
                                             prompt_cache_key="k", user="u", max_output_tokens=2)
    assert accepted.status in ("completed", "incomplete")
    assert all(item.encrypted_content is None for item in accepted.output if item.type == "reasoning")


async def test_a_failed_engine_step_ends_the_stream_with_response_failed(http, base_url, engine,
                                                                         fail_a_decode_step):
    faults = fail_a_decode_step()
    body = {"model": MODEL, "input": "Hello", "stream": True, **GREEDY, **NO_THINKING, "ignore_eos": True}
    async with http.post(f"{base_url}/v1/responses", json=body) as response:
        assert response.status == 200
        blocks = [block for block in (await response.text()).split("\n\n") if block]
    assert faults
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "internal_error"
    assert "CUDA out of memory (injected)" in last["response"]["error"]["message"]
    for _ in range(500):  # the failed request's slot and blocks are freed
        stats = engine.stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        await asyncio.sleep(0.01)
    assert_idle(stats)
