"""vLLM's extra request fields, sent as scripts written for vLLM send them (the official `openai`
client's `extra_body`), each honoured: structured_outputs and the legacy guided_* fields, the
sampling and detokenization extras, truncate_prompt_tokens, and the chat extras
(continue_final_message, echo, add_generation_prompt, ...); and the 400s for what is refused.

The tiny random checkpoint writes gibberish, so a constraint is checked by the output matching
it, and a field that must not change the output by greedy equality with a plain request.
"""

import json
import re

import msgspec
import openai
import pytest
import pytest_asyncio

from deltaspec.engine import AsyncLLM
from deltaspec.engine.tokenizer import Tokenizer
from deltaspec.server.config import ServerConfig
from deltaspec.server.inputs import ChatParsers, chat_input, completion_inputs
from deltaspec.server.protocol import ChatCompletionRequest, CompletionRequest
from deltaspec.server.serve import start

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
MAX_MODEL_LEN = 256
GREEDY = {"temperature": 0, "max_tokens": 8}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
PROMPT = "The engine schedules requests"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoint):
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN, num_draft_tokens=2,
                      adaptive_draft_length=False)
    yield engine
    await engine.shutdown()


async def complete(client, route: str, **body):
    """(the text, the response) of a completion or a chat completion."""
    if route == "chat":
        response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **body)
        return response.choices[0].message.content, response
    response = await client.completions.create(model=MODEL, prompt=PROMPT, **body)
    return response.choices[0].text, response


# Structured outputs -----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"]}
GBNF = 'root ::= "yes" | "no" | digit digit\ndigit ::= [0-9]\n'
LARK = 'start: "yes" | "no" | DIGIT DIGIT\nDIGIT: /[0-9]/\n'


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99


# (the fields sent, what the output must satisfy)
CONSTRAINTS = [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda text: text in ("red", "green", "blue")),
    ({"structured_outputs": {"json": SCHEMA}}, matches_schema),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True,
                             "disable_fallback": True}}, matches_schema),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, matches_schema),
    # Any object: the random model writes keys until its length runs out.
    ({"structured_outputs": {"json_object": True}}, lambda text: text.startswith('{"')),
    ({"structured_outputs": {"grammar": GBNF}}, lambda text: re.fullmatch("yes|no|[0-9]{2}", text)),
    ({"structured_outputs": {"grammar": LARK}}, lambda text: re.fullmatch("yes|no|[0-9]{2}", text)),
    ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"guided_json": SCHEMA}, matches_schema),
    ({"guided_grammar": GBNF}, lambda text: re.fullmatch("yes|no|[0-9]{2}", text)),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_structured_outputs_and_guided_fields_constrain_the_output(client, route):
    for fields, check in CONSTRAINTS:
        text, _ = await complete(client, route, max_tokens=32, temperature=1.0, seed=5,
                                 extra_body={"response_format": {"type": "text"}, **fields})
        assert check(text), (fields, text)
    # JSON is compact unless disable_any_whitespace is false: then the random model spins in it.
    for disable, has_whitespace in ((None, False), (False, True)):
        options = {} if disable is None else {"disable_any_whitespace": disable}
        text, _ = await complete(client, route, max_tokens=16, temperature=1.0, seed=5,
                                 extra_body={"structured_outputs": {"json": SCHEMA, **options}})
        assert bool(re.search(r"\s", text)) == has_whitespace, text


async def test_structured_outputs_options_reach_the_engine(engine):
    def structured(**fields):
        request = msgspec.convert({"prompt": PROMPT, "structured_outputs": fields}, CompletionRequest)
        return completion_inputs(request, engine.tokenizer, MAX_MODEL_LEN)[0].params.structured

    # Unset: compact JSON, this server's default; sent, it says whether whitespace may come.
    assert not structured(json=SCHEMA).any_whitespace
    assert structured(json=SCHEMA, disable_any_whitespace=False).any_whitespace
    assert not structured(json_object=True, disable_any_whitespace=True).any_whitespace
    assert not structured(regex="[0-9]+", disable_any_whitespace=False).any_whitespace  # JSON only
    # disable_additional_properties closes every object schema that leaves it open, and only those.
    schema = {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
              "properties": {"properties": {"type": "object", "properties": {"a": {"type": "string"}}},
                             "open": {"type": "object", "properties": {}, "additionalProperties": True},
                             "items": {"type": "array", "items": {"$ref": "#/$defs/point"}},
                             "tag": {"enum": [{"properties": {}}]}}}
    closed = json.loads(structured(json=schema, disable_additional_properties=True).spec)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]["items"]  # an array schema
    assert closed["properties"]["tag"] == {"enum": [{"properties": {}}]}  # data, not a schema
    assert set(closed["properties"]) == {"properties", "open", "items", "tag"}
    assert json.loads(structured(json=schema).spec) == schema


ONE_MESSAGE = [{"role": "user", "content": "hi"}]
# (route, body, the param the 400 names, a substring of its message)
REFUSED = [
    ("completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "structured_outputs", "both constrain"),
    ("chat", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ("chat", {"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA}, "guided_json", "both constrain"),
    ("completions", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    ("chat", {"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("completions", {"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}}},
     "structured_outputs.structural_tag", "not supported"),
    ("completions", {"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "not supported"),
    ("chat", {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "remove it"),
    ("completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
    ("chat", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "grammar"),
    ("completions", {"structured_outputs": {"grammar": "start: UNDEFINED_RULE"}}, "structured_outputs.grammar",
     "grammar"),
    ("completions", {"guided_regex": "[z-a]"}, "guided_regex", "regex"),
    ("chat", {"structured_outputs": {"json": "{not json", "disable_additional_properties": True}},
     "structured_outputs.json", "not valid JSON"),
    ("chat", {"messages": [*ONE_MESSAGE, {"role": "assistant", "content": "It is"}], "continue_final_message": True,
              "add_generation_prompt": True}, "continue_final_message", "cannot both be true"),
    ("chat", {"continue_final_message": True}, "continue_final_message", "assistant message last"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ("chat", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ">= -1"),
    ("chat", {"store": True}, "store", "not stored"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids", "length >= 1"),
    ("chat", {"cache_salt": ""}, "cache_salt", "length >= 1"),
    ("completions", {"cache_salt": 7}, "cache_salt", "Expected `str | null`"),
    ("chat", {"allowed_token_ids": [10**6]}, None, "outside the vocabulary"),  # the engine's check
    ("chat", {"reasoning_effort": "maximal"}, "reasoning_effort", "Invalid enum value"),
    ("completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "unknown field"),
    ("completions", {"continue_final_message": True}, "continue_final_message", "unknown field"),
]


async def test_what_cannot_be_honoured_gets_a_400_naming_the_field(client):
    for route, fields, param, message in REFUSED:
        body = {"model": MODEL, "max_tokens": 4, **({"messages": ONE_MESSAGE} if route == "chat" else {"prompt": "hi"}),
                **fields}
        with pytest.raises(openai.BadRequestError) as raised:
            await client.post("/chat/completions" if route == "chat" else "/completions", cast_to=object, body=body)
        error = raised.value.body
        assert error["param"] == param and message in error["message"], (fields, error)


# Sampling and detokenization extras ------------------------------------------------------------

@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_include_stop_str_in_output_keeps_the_stop_string(client, route):
    plain, _ = await complete(client, route, extra_body={"ignore_eos": True}, **GREEDY)
    stop = plain[len(plain) // 2:len(plain) // 2 + 2]
    end = plain.find(stop)
    without, response = await complete(client, route, stop=[stop], extra_body={"ignore_eos": True}, **GREEDY)
    kept, kept_response = await complete(client, route, stop=[stop],
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **GREEDY)
    assert response.choices[0].finish_reason == kept_response.choices[0].finish_reason == "stop"
    assert without == plain[:end] and kept == plain[:end + len(stop)] and kept.endswith(stop)


async def test_allowed_token_ids_and_tokens_as_ids(client, engine):
    allowed = sorted(set(engine.tokenizer.encode(" quick brown fox")))
    completion = await client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=2, extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                                            "return_tokens_as_token_ids": True}, **GREEDY)
    logprobs = completion.choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
    assert len(ids) == 8 and set(ids) <= set(allowed) and all(t.startswith("token_id:") for t in logprobs.tokens)
    assert engine.tokenizer.decode(ids) == completion.choices[0].text
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top)

    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "return_tokens_as_token_ids": True}, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert {int(entry.token.removeprefix("token_id:")) for entry in content} <= set(allowed)
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_return_tokens_as_token_ids_changes_only_the_names(client, engine, route):
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if route == "chat":
        options = {"logprobs": True, "top_logprobs": 2}
        plain = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True},
                                                      **options, **GREEDY)).choices[0]
        named = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=as_ids, **options,
                                                      **GREEDY)).choices[0]
        assert named.message.content == plain.message.content
        for entry, plain_entry in zip(named.logprobs.content, plain.logprobs.content, strict=True):
            token_id = int(entry.token.removeprefix("token_id:"))
            assert engine.tokenizer.decode([token_id], skip_special_tokens=False) == plain_entry.token
            assert entry.bytes == plain_entry.bytes and entry.logprob == plain_entry.logprob
        return
    plain = (await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, echo=True,
                                             extra_body={"ignore_eos": True}, **GREEDY)).choices[0]
    named = (await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, echo=True, extra_body=as_ids,
                                             **GREEDY)).choices[0]
    assert named.text == plain.text and named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    texts = [engine.tokenizer.decode([int(token.removeprefix("token_id:"))], skip_special_tokens=False)
             for token in named.logprobs.tokens]
    assert texts == plain.logprobs.tokens


async def test_skip_special_tokens(client, engine):
    special = engine.tokenizer.encode("<|im_start|>")
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    skipped = await client.completions.create(**body, extra_body={"ignore_eos": True, "allowed_token_ids": special})
    written = await client.completions.create(**body, extra_body={"ignore_eos": True, "allowed_token_ids": special,
                                                                  "skip_special_tokens": False})
    assert skipped.choices[0].text == "" and written.choices[0].text == "<|im_start|>" * 3


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_truncate_prompt_tokens_runs_the_last_tokens(client, engine, route):
    if route == "chat":
        prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        text, response = await complete(client, route, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5},
                                        **GREEDY)
    else:
        prompt = PROMPT
        text, response = await complete(client, route, echo=True,
                                        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5}, **GREEDY)
    kept = engine.tokenizer.encode(prompt)[-5:]
    alone = await client.completions.create(model=MODEL, prompt=kept, extra_body={"ignore_eos": True}, **GREEDY)
    assert response.usage.prompt_tokens == 5
    echo = "" if route == "chat" else engine.tokenizer.decode(kept, skip_special_tokens=False)  # the kept prompt's
    assert text == echo + alone.choices[0].text

    # -1: as many as leave room for max_tokens, so a prompt longer than the context still runs.
    long = await client.completions.create(model=MODEL, prompt="The quick brown fox. " * 100,
                                           extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1}, **GREEDY)
    assert long.usage.prompt_tokens == MAX_MODEL_LEN - 8 and long.usage.completion_tokens == 8


# Chat extras ------------------------------------------------------------------------------------

PARTIAL = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]


async def test_continue_final_message_continues_it_and_echo_returns_it_whole(client, engine):
    # The template's own rendering, without a generation prompt, cut after the final message.
    rendered = engine.tokenizer.apply_chat_template(PARTIAL, add_generation_prompt=False)
    prompt_ids = engine.tokenizer.encode(rendered[:rendered.rindex("The answer is") + len("The answer is")])
    assert engine.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nThe answer is")
    alone = await client.completions.create(model=MODEL, prompt=prompt_ids, extra_body={"ignore_eos": True}, **GREEDY)
    extras = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    continued = await client.chat.completions.create(model=MODEL, messages=PARTIAL, extra_body=extras, **GREEDY)
    assert continued.usage.prompt_tokens == len(prompt_ids)
    assert continued.choices[0].message.content == alone.choices[0].text
    # /tokenize renders it alike (vLLM's field there too).
    tokenized = await client.post("/../tokenize", cast_to=object,
                                  body={"messages": PARTIAL, "continue_final_message": True})
    assert tokenized["tokens"] == prompt_ids
    # add_generation_prompt unset follows continue_final_message (vLLM refuses only both true).
    del extras["add_generation_prompt"]
    echoed = await client.chat.completions.create(model=MODEL, messages=PARTIAL, extra_body={**extras, "echo": True},
                                                  **GREEDY)
    assert echoed.choices[0].message.content == "The answer is" + alone.choices[0].text

    stream = await client.chat.completions.create(model=MODEL, messages=PARTIAL, stream=True,
                                                  extra_body={**extras, "echo": True}, **GREEDY)
    deltas = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices[0].delta.content]
    assert deltas[0] == "The answer is" and "".join(deltas) == echoed.choices[0].message.content


async def test_echo_without_an_assistant_message_last_and_add_generation_prompt(client, engine):
    plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    echoed = await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"echo": True}, **GREEDY)
    assert echoed.choices[0].message.content == plain.choices[0].message.content  # nothing to echo
    no_opening = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                      extra_body={"add_generation_prompt": False}, **GREEDY)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_opening.usage.prompt_tokens == len(engine.tokenizer.encode(prompt)) < plain.usage.prompt_tokens


class RecordingTokenizer:
    """The engine's tokenizer, recording the add_special_tokens of each encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.chat_template, self.flags = tokenizer, tokenizer.chat_template, []

    def encode(self, text, add_special_tokens=False, max_length=None):
        self.flags.append(add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, max_length=max_length)

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)


async def test_add_special_tokens_defaults_as_vllm_and_is_honoured(engine):
    tokenizer = RecordingTokenizer(engine.tokenizer)
    for fields in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
        completion_inputs(msgspec.convert({"prompt": PROMPT, **fields}, CompletionRequest), tokenizer, MAX_MODEL_LEN)
        chat_input(msgspec.convert({"messages": MESSAGES, **fields}, ChatCompletionRequest), tokenizer, MAX_MODEL_LEN,
                   ChatParsers("none", False))
    assert tokenizer.flags == [True, False, False, False, True, True]  # completions: true; chat: false


async def test_documents_and_reasoning_effort_reach_the_template(checkpoint):
    tokenizer = Tokenizer.from_dir(checkpoint("qwen3_5"))
    tokenizer.chat_template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                               "effort={{ reasoning_effort }} thinking={{ enable_thinking }}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    request = msgspec.convert({"messages": ONE_MESSAGE, "documents": [{"title": "Doc", "text": "body"}],
                               "reasoning_effort": "high",
                               "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}},
                              ChatCompletionRequest)
    engine_input, _ = chat_input(request, tokenizer, MAX_MODEL_LEN, ChatParsers("none", False))
    # The request's fields win over chat_template_kwargs', as vLLM merges them.
    assert tokenizer.decode(engine_input.prompt_token_ids) == "[Doc: body]effort=high thinking=Falsehi"


@pytest.mark.parametrize("effort, kwargs, thinking", [("none", {}, "False"), ("low", {}, ""),
                                                      ("none", {"enable_thinking": True}, "True"), (None, {}, "")])
async def test_reasoning_effort_none_turns_thinking_off(checkpoint, effort, kwargs, thinking):
    """A template that switches thinking with enable_thinking and knows no effort (Qwen3.5's):
    "none" sets enable_thinking false unless chat_template_kwargs says otherwise."""
    tokenizer = Tokenizer.from_dir(checkpoint("qwen3_5"))
    tokenizer.set_chat_template("thinking={{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    fields = {"reasoning_effort": effort} if effort else {}
    request = msgspec.convert({"messages": ONE_MESSAGE, **fields, "chat_template_kwargs": kwargs},
                              ChatCompletionRequest)
    engine_input, _ = chat_input(request, tokenizer, MAX_MODEL_LEN, ChatParsers("none", False))
    assert tokenizer.decode(engine_input.prompt_token_ids) == f"thinking={thinking}|hi"


async def test_priority_needs_the_priority_policy(client, checkpoint):
    """vLLM's priority field: 0 is every request's; another needs --scheduling-policy priority
    (a 400 naming why otherwise); with it, a request is served by its priority."""
    text, _ = await complete(client, "completions", extra_body={"priority": 0}, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="scheduling_policy 'priority'"):
        await complete(client, "chat", extra_body={"priority": -1}, **GREEDY)
    engine = AsyncLLM(checkpoint("qwen3_5"), max_model_len=MAX_MODEL_LEN, scheduling_policy="priority")
    running = await start(engine, ServerConfig(model_name=MODEL, port=0, shutdown_timeout=1))
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="unused",
                                      max_retries=0) as prioritized:
            assert (await complete(prioritized, "completions", extra_body={"priority": -1}, **GREEDY))[0] == text
    finally:
        await running.stop()
        await engine.shutdown()


async def test_cache_salt_shares_cached_prefixes_within_a_salt_only(client):
    """vLLM's cache_salt: a request's usage counts cached prompt tokens only from earlier requests
    of its own salt (no salt: unsalted ones); the output does not change. /v1/responses takes
    the field too."""
    messages = [{"role": "user", "content": "Salted prefixes stay apart: " + "tenant " * 40}]
    cached, texts = [], []
    for salt in (None, "tenant-a", "tenant-a", "tenant-b", None):
        response = await client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={} if salt is None else {"cache_salt": salt}, **GREEDY)
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
        texts.append(response.choices[0].message.content)
    assert cached[0] == cached[1] == cached[3] == 0 and cached[2] > 0 and cached[4] > 0, cached
    assert len(set(texts)) == 1
    cached = []
    for salt in ("tenant-c", "tenant-c", "tenant-d"):
        response = await client.responses.create(model=MODEL, input="Responses too: " + "salt " * 40,
                                                 max_output_tokens=4, extra_body={"cache_salt": salt})
        cached.append(response.usage.input_tokens_details.cached_tokens)
    assert cached[0] == cached[2] == 0 and cached[1] > 0, cached


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(base_url, http, route):
    """stream_options.continuous_usage_stats (vLLM's), with include_usage: every chunk carries its
    choice's usage so far, the completion tokens never falling and ending at its total; without
    it the chunks carry none and the usage chunk comes last alone."""
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    body.update({"messages": MESSAGES} if route == "chat" else {"prompt": PROMPT})
    path = f"{base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"

    async def chunks(stream_options: dict) -> list[dict]:
        async with http.post(path, json={**body, "stream_options": stream_options}) as response:
            assert response.status == 200, await response.text()
            lines = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    continuous = await chunks({"include_usage": True, "continuous_usage_stats": True})
    *per_choice, last = continuous
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    counts = [chunk["usage"]["completion_tokens"] for chunk in per_choice]
    assert counts == sorted(counts) and counts[-1] == 6 and len(per_choice) > 2
    assert {chunk["usage"]["prompt_tokens"] for chunk in continuous} == {last["usage"]["prompt_tokens"]}
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in continuous)
    plain = await chunks({"include_usage": True})
    assert all(chunk.get("usage") is None for chunk in plain[:-1]) and plain[-1]["usage"] == last["usage"]
