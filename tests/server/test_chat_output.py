"""Reading chat output: reasoning split at </think>, tool calls in both Qwen formats, and
streamed deltas (the text cut at every position) assembling to the non-streamed message."""

import json

import pytest

from deltaspec.server.chat_output import ChatOutput, OutputSettings
from deltaspec.server.reasoning import ReasoningParser, reasoning_enabled
from deltaspec.server.tool_parsers import (HermesParser, Qwen3CoderParser, make_tool_call_parser,
                                           tool_call_parser_name)

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "threshold": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}

QWEN3_CODER_TWO_CALLS = (
    "Let me check both.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
    "<parameter=threshold>\n2.5\n</parameter>\n"
    "<parameter=options>\n{\"units\": {\"temp\": \"F\"}, \"hours\": [1, 2]}\n</parameter>\n"
    "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
    "<parameter=note>\nline one\nline <two> & 3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_ARGUMENTS = [
    {"city": "San Francisco, CA", "days": 3, "metric": False, "threshold": 2.5,
     "options": {"units": {"temp": "F"}, "hours": [1, 2]}, "tags": ["a", "b"], "note": "line one\nline <two> & 3"},
    {"query": "42"},  # a string parameter stays a string
]
HERMES_TWO_CALLS = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "options": {"units": {"temp": "C"}}}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "search", "arguments": {"query": "</think> <tool_call>"}}\n</tool_call>'
)
HERMES_ARGUMENTS = [{"city": "Paris", "options": {"units": {"temp": "C"}}}, {"query": "</think> <tool_call>"}]


def settings(parser: str | None = "qwen3_coder", reasoning: bool | None = None, **options) -> OutputSettings:
    return OutputSettings(reasoning=None if reasoning is None else ReasoningParser(reasoning),
                          tool_calls=make_tool_call_parser(parser, SCHEMAS) if parser else None, **options)


def whole(text: str, output_settings: OutputSettings) -> dict:
    output = ChatOutput(output_settings)
    output.push(text, final=True)
    message = output.message()
    return {"reasoning": message.reasoning_content, "content": message.content,
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []]}


def streamed(pieces: list[str], output_settings: OutputSettings) -> dict:
    """Assemble the deltas as an OpenAI client does: text concatenated, calls by index."""
    output = ChatOutput(output_settings)
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = output.push(piece, final=i == len(pieces) - 1)
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None  # the name comes once, first
            calls[call.index][1] += call.function.arguments or ""
        if i < len(pieces) - 1:  # never a partial tag shown as text before the end
            assert not content.endswith(("<", "<tool")) and not reasoning.endswith(("<", "</thi"))
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def test_qwen3_coder_calls_with_typed_arguments_and_text_before():
    parsed = whole(QWEN3_CODER_TWO_CALLS, settings())
    assert parsed["content"] == "Let me check both.\n\n" and parsed["reasoning"] is None
    assert [name for name, _ in parsed["calls"]] == ["get_weather", "search"]
    assert [json.loads(arguments) for _, arguments in parsed["calls"]] == QWEN3_CODER_ARGUMENTS


def test_hermes_calls_with_nested_arguments():
    parsed = whole(HERMES_TWO_CALLS, settings("hermes"))
    assert parsed["content"] == "Let me check both.\n"
    assert [name for name, _ in parsed["calls"]] == ["get_weather", "search"]
    assert [json.loads(arguments) for _, arguments in parsed["calls"]] == HERMES_ARGUMENTS


def test_values_that_do_not_fit_their_type_stay_text():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
            "<parameter=metric>\nmaybe\n</parameter>\n<parameter=options>\n{broken\n</parameter>\n"
            "<parameter=unknown>\n7\n</parameter>\n</function>\n</tool_call>")
    [(_, arguments)] = whole(text, settings())["calls"]
    assert json.loads(arguments) == {"days": "three", "metric": "maybe", "options": "{broken", "unknown": "7"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    parsed = whole(QWEN3_CODER_TWO_CALLS, settings(max_tool_calls=1))
    assert [name for name, _ in parsed["calls"]] == ["get_weather"]


def test_no_parser_leaves_the_text_as_content():
    assert whole(QWEN3_CODER_TWO_CALLS, settings(None)) == {"reasoning": None, "content": QWEN3_CODER_TWO_CALLS,
                                                            "calls": []}


def test_unclosed_call_at_the_end_is_closed_and_a_nameless_one_dropped():
    cut = "<tool_call>\n<function=search>\n<parameter=query>\nhalf a val"
    [(name, arguments)] = whole(cut, settings())["calls"]
    assert name == "search" and json.loads(arguments) == {"query": "half a val"}
    assert whole("Hi <tool_call>\n<func", settings()) == {"reasoning": None, "content": "Hi ", "calls": []}
    forced = '<tool_call>\n{"name": "search", "arguments": {"query": "x"'  # hermes JSON cut short
    assert whole(forced, settings("hermes"))["calls"] == [("search", "{}")]


THINKING = "I should look this up.\nMaybe <tool_call> here is only a thought.\n</think>\n\n"
# (name, text, settings): the streamed-equals-whole cases.
CASES = [
    ("qwen3_coder", QWEN3_CODER_TWO_CALLS, settings()),
    ("hermes", HERMES_TWO_CALLS, settings("hermes")),
    ("thinking_then_call", THINKING + QWEN3_CODER_TWO_CALLS, settings(reasoning=True)),
    ("thinking_then_answer", THINKING + "The answer is 4.", settings(reasoning=True)),
    ("thinking_cut_short", "Still thinking </thi", settings(reasoning=True)),
    ("thinking_off", "The answer <b>is</b> 4.", settings(reasoning=False)),
    ("model_opens_think", "<think>\nhmm\n</think>\n\nFour.", settings(reasoning=False)),
    ("forced_named_call", "<parameter=query>\ncats\n</parameter>\n</function>\n</tool_call>",
     settings(reasoning=True, forced_text="</think>\n\n<tool_call>\n<function=search>\n", max_tool_calls=1)),
]


@pytest.mark.parametrize("text, output_settings", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_stream_cut_at_every_position_equals_the_whole_parse(text, output_settings):
    expected = whole(text, output_settings)
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]], output_settings) == expected, cut
    assert streamed(list(text), output_settings) == expected  # one character per delta


def test_reasoning_split_with_thinking_on_and_off():
    assert whole(THINKING + "Four.", settings(None, reasoning=True)) == {
        "reasoning": THINKING[:-len("</think>\n\n")], "content": "Four.", "calls": []}
    # Tool calls inside the reasoning are not calls.
    inside = "<tool_call>\n<function=search>\n</function>\n</tool_call>\n</think>\n\nNo call."
    assert whole(inside, settings(reasoning=True))["calls"] == []
    # Thinking off (an empty think block in the prompt): all content.
    assert whole("Four.", settings(None, reasoning=False)) == {"reasoning": None, "content": "Four.", "calls": []}
    assert whole("Four.</think>", settings(None, reasoning=False))["content"] == "Four.</think>"
    # Cut off while thinking: all reasoning, no content.
    assert whole("Let me see", settings(None, reasoning=True)) == {"reasoning": "Let me see", "content": None,
                                                                    "calls": []}


def test_parsers_are_picked_from_the_chat_template():
    qwen3_5 = "... '<tool_call>\\n<function=' + tool_call.name + '>\\n' ... <think>"
    qwen3_next = '... <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call> ...'
    assert tool_call_parser_name(None, qwen3_5) == "qwen3_coder"
    assert tool_call_parser_name(None, qwen3_next) == "hermes"
    assert tool_call_parser_name(None, "{{ messages }}") == "qwen3_coder"
    assert tool_call_parser_name("hermes", qwen3_5) == "hermes"
    assert make_tool_call_parser("none", SCHEMAS) is None
    assert isinstance(make_tool_call_parser("hermes", {}), HermesParser)
    assert isinstance(make_tool_call_parser("qwen3_coder", {}), Qwen3CoderParser)
    assert reasoning_enabled(None, qwen3_5) and not reasoning_enabled(None, qwen3_next)
    assert not reasoning_enabled("none", qwen3_5)
    with pytest.raises(ValueError, match="unknown"):
        tool_call_parser_name("pythonic", qwen3_5)
