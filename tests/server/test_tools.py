"""Agents over the OpenAI server: tool calls, reasoning and whole chat messages, driven by the
official `openai` client.

A tiny random Qwen3.5 checkpoint serves with Qwen3.5's chat template (thinking, XML tool calls):
a three-turn agent loop renders, at every turn, the prompt HF's `apply_chat_template` renders
for the same conversation; tool_choice "required" and a named function yield a valid call on it
and on the shipped model (plain ChatML template); bad messages get a 400 naming the field.
"""

import copy
import json
from pathlib import Path

import msgspec
import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from deltaspec.engine import AsyncLLM, SamplingParams
from deltaspec.server.config import ServerConfig
from deltaspec.server.messages import render_prompt
from deltaspec.server.protocol import ChatMessage
from deltaspec.server.serve import start

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}


async def serve(path: Path):
    engine = AsyncLLM(path, max_model_len=4096)
    running = await start(engine, ServerConfig(model_name=MODEL, port=0))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="unused", max_retries=0)
    return engine, running, client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen3_5(qwen3_5_checkpoint):
    engine, running, client = await serve(qwen3_5_checkpoint)
    yield engine, client
    await client.close()
    await running.stop()
    await engine.shutdown()


async def complete(client: openai.AsyncOpenAI, stream: bool, **request) -> tuple[dict, str]:
    """(the assistant message as a dict, finish_reason), streamed or not: a stream's deltas
    assembled as an agent would."""
    if not stream:
        response = await client.chat.completions.create(model=MODEL, **request)
        [choice] = response.choices
        message = choice.message
        calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        # The reasoning under both names clients read (vLLM's current one, and DeepSeek's).
        assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)
        return _message(message.content, getattr(message, "reasoning_content", None), calls), choice.finish_reason
    chunks = await client.chat.completions.create(model=MODEL, stream=True, **request)
    content, reasoning, calls, finish_reason = "", "", [], None
    async for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                calls.append({"id": call.id, "type": call.type,
                              "function": {"name": call.function.name, "arguments": ""}})
            calls[call.index]["function"]["arguments"] += call.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return _message(content or None, reasoning or None, calls), finish_reason


def _message(content, reasoning, calls) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def as_hf(messages: list[dict]) -> list[dict]:
    """The conversation as HF's apply_chat_template takes it: tool-call arguments as dicts."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


async def assert_renders_as_hf(client: openai.AsyncOpenAI, engine: AsyncLLM, hf, messages: list[dict], tools):
    expected = hf.apply_chat_template(as_hf(messages), tools=tools, tokenize=False, add_generation_prompt=True)
    parsed = msgspec.convert(messages, list[ChatMessage])
    assert render_prompt(engine.tokenizer, parsed, tools, None) == expected
    tokenized = await client.post("/../tokenize", cast_to=object, body={"messages": messages, "tools": tools})
    assert tokenized["tokens"] == engine.tokenizer.encode(expected) and tokenized["count"] == len(tokenized["tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_agent_loop_renders_the_prompt_hf_renders(qwen3_5, qwen3_5_checkpoint, stream):
    engine, client = qwen3_5
    hf = AutoTokenizer.from_pretrained(qwen3_5_checkpoint)
    tools = [WEATHER, SEARCH]
    messages = [{"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]}]
    # Turn 1: the model calls a tool (named: a random model would not choose to).
    await assert_renders_as_hf(client, engine, hf, messages, tools)
    message, finish_reason = await complete(client, stream, messages=messages, tools=tools, max_tokens=16,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert finish_reason in ("tool_calls", "length") and "reasoning_content" not in message
    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 21}'}]
    # Turn 2: the answer, after the tool's result (the model thinks first: reasoning_content).
    await assert_renders_as_hf(client, engine, hf, messages, tools)
    message, _ = await complete(client, stream, messages=messages, tools=tools, max_tokens=12, temperature=0)
    messages += [message, {"role": "user", "content": "Thanks! And tomorrow?"}]
    # Turn 3: a new question, with the whole history (reasoning_content included).
    await assert_renders_as_hf(client, engine, hf, messages, tools)
    await complete(client, stream, messages=messages, tools=tools, max_tokens=4)


async def test_a_turns_reasoning_comes_back_under_either_name(qwen3_5):
    """vLLM's `reasoning` and the older `reasoning_content` render the same prompt (both, equal,
    too); two different texts are a 400 naming the message."""
    engine, client = qwen3_5
    # Qwen3.5's template keeps the reasoning of the turns after the last user message (an agent
    # loop's): a call, and its result.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'}]

    async def rendered(**reasoning) -> list[int]:
        messages = copy.deepcopy(history)
        messages[1].update(reasoning)
        body = {"messages": messages, "tools": [WEATHER]}
        return (await client.post("/../tokenize", cast_to=object, body=body))["tokens"]

    expected = await rendered(reasoning_content="Adding two and two.")
    assert "Adding two and two." in engine.tokenizer.decode(expected)
    assert await rendered(reasoning="Adding two and two.") == expected
    assert await rendered(reasoning="Adding two and two.", reasoning_content="Adding two and two.") == expected
    with pytest.raises(openai.BadRequestError, match="messages\\[1\\] sets reasoning and reasoning_content"):
        await client.chat.completions.create(model=MODEL, max_tokens=1, tools=[WEATHER], messages=[
            history[0], {**history[1], "reasoning": "a", "reasoning_content": "b"}, history[2]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_reasoning_with_thinking_on_and_off(qwen3_5, stream):
    engine, client = qwen3_5
    request = dict(messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, temperature=0,
                   extra_body={"ignore_eos": True})
    thinking, _ = await complete(client, stream, **request)
    text = await raw_text(engine, request["messages"], {})
    if "</think>" not in text:  # the random model rarely closes its thoughts: all reasoning
        assert thinking == {"role": "assistant", "content": None, "reasoning_content": text}
    off = {**request, "extra_body": {**request["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}}
    answer, _ = await complete(client, stream, **off)
    assert answer == {"role": "assistant",
                      "content": await raw_text(engine, request["messages"], {"enable_thinking": False}) or None}


async def raw_text(engine: AsyncLLM, messages: list[dict], kwargs: dict) -> str:
    """The greedy text the engine writes for this conversation, unparsed."""
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return "".join([delta.text async for delta in engine.generate(engine.tokenizer.encode(prompt), params)])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shipped():
    engine, running, client = await serve(DEFAULT_MODEL)
    yield client
    await client.close()
    await running.stop()
    await engine.shutdown()


@pytest.mark.parametrize("model", ["random_qwen3_5", "shipped"])
async def test_required_and_named_tool_choice_always_yield_a_valid_call(model, qwen3_5, shipped):
    client = qwen3_5[1] if model == "random_qwen3_5" else shipped
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    # "required" with several tools: the name is the model's, constrained to one of theirs.
    choices = [({"type": "function", "function": {"name": "search"}}, [WEATHER, SEARCH], {"search"}),
               ("required", [WEATHER], {"get_weather"}),
               ("required", [WEATHER, SEARCH], {"get_weather", "search"})]
    for tool_choice, tools, names in choices:
        for seed in range(4):
            for stream in (False, True):
                message, finish_reason = await complete(client, stream, messages=messages, tools=tools,
                                                        tool_choice=tool_choice, max_tokens=24, temperature=1.0,
                                                        seed=seed)
                [call] = message["tool_calls"]
                assert call["function"]["name"] in names, message
                assert isinstance(json.loads(call["function"]["arguments"]), dict), message
                assert finish_reason in ("tool_calls", "length")


async def test_tokenize_detokenize_version(qwen3_5):
    engine, client = qwen3_5
    tokenized = await client.post("/../tokenize", cast_to=object, body={"prompt": "Hello world"})
    assert tokenized == {"count": len(engine.tokenizer.encode("Hello world")), "max_model_len": 4096,
                         "tokens": engine.tokenizer.encode("Hello world")}
    assert await client.post("/../detokenize", cast_to=object, body={"tokens": tokenized["tokens"]}) == {
        "prompt": "Hello world"}
    assert "version" in await client.get("/../version", cast_to=object)


ONE_MESSAGE = [{"role": "user", "content": "hi"}]
BAD_CALL = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{oops"}}]}
# (body fields beside model, the param the 400 names, a substring of its message)
BAD_CHAT_REQUESTS = [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0]", "image input is not supported: this model reads no images"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood", "unknown field"),
    ({"messages": ONE_MESSAGE, "functions": [{"name": "f"}]}, "functions", "unknown field"),
    ({"messages": [{"role": "assistant", "content": "no", "refusal": "I can't"}, *ONE_MESSAGE]},
     "messages[0].refusal", "not supported"),
    ({"messages": [*ONE_MESSAGE, BAD_CALL]}, "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": ONE_MESSAGE, "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0]", "name"),
    ({"messages": ONE_MESSAGE, "tools": [SEARCH], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "not in tools"),
    ({"messages": ONE_MESSAGE, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": ONE_MESSAGE, "tools": [WEATHER, SEARCH], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"messages": ONE_MESSAGE, "tools": [WEATHER, SEARCH], "tool_choice": "required",
      "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs", "cannot be combined"),
    ({"messages": ONE_MESSAGE, "tools": [WEATHER, SEARCH], "tool_choice": "required", "guided_choice": ["a"]},
     "guided_choice", "cannot be combined"),
    ({"messages": ONE_MESSAGE, "tool_choice": "sometimes"}, "tool_choice", "Invalid enum value"),
]


async def test_fields_the_server_cannot_honour_get_a_400_naming_them(qwen3_5):
    client = qwen3_5[1]
    for body, param, message in BAD_CHAT_REQUESTS:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.post("/chat/completions", cast_to=object, body={"model": MODEL, **body})
        error = raised.value.body
        assert error["param"] == param and message in error["message"], (body, error)
    ok, _ = await complete(client, False, messages=ONE_MESSAGE, max_tokens=2)
    assert ok["role"] == "assistant"


async def test_the_clients_own_message_object_goes_back_into_the_history(qwen3_5):
    client = qwen3_5[1]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    response = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                    tool_choice="required", max_tokens=8)
    reply = response.choices[0].message  # a pydantic object, sent back as the client serializes it
    messages += [reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "21 C"}]
    again = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_a_developer_message_renders_as_the_system_message(qwen3_5):
    """OpenAI's clients send "developer" for the system role; Qwen3.5's template knows only
    system (any other role raises): the prompt equals the system message's."""
    engine, client = qwen3_5
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    prompts = [(await client.post("/../tokenize", cast_to=object,
                                  body={"messages": [{"role": role, "content": "Be brief."}, *chat]}))["tokens"]
               for role in ("developer", "system")]
    assert prompts[0] == prompts[1]
    reply = await client.chat.completions.create(model=MODEL, max_tokens=2,
                                                 messages=[{"role": "developer", "content": "Be brief."}, *chat])
    assert reply.usage.prompt_tokens == len(prompts[1])
