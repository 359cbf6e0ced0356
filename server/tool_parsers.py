"""Tool calls out of a chat completion's content text, in the two formats Qwen models write.

    qwen3_coder (Qwen3.5):  <tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n</function>\n</tool_call>
    hermes (Qwen3-Next):    <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>

`parse(text, final)` works on the whole content so far: the content is the text before the first
`<tool_call>` (a possible partial tag at its end is held back until the text says what it is);
text after it outside calls is dropped, as vLLM does. A call appears once its name is known, and
its arguments (JSON text) only ever grow: qwen3_coder adds each parameter as it closes, hermes
gives the whole object when the call closes. So a stream's deltas are the differences between
successive parses (`chat_output`). At the end (`final`), an unclosed call whose name is known is
closed: a call forced by `tool_choice` and cut by max_tokens still parses.

qwen3_coder parameter values are plain text; they are converted to the type the tool's JSON
schema declares (integer, number, boolean, object/array from JSON, string kept as written).

Knows nothing about reasoning, HTTP or the engine.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from .reasoning import held_back

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("qwen3_coder", "hermes", "none")


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text; a prefix of it while the call is open


@dataclass(frozen=True)
class ParsedContent:
    content: str
    tool_calls: list[ParsedToolCall]


class ToolCallParser(Protocol):
    def parse_call(self, body: str, closed: bool) -> ParsedToolCall | None:
        """The call in the text after `<tool_call>` (up to `</tool_call>` when `closed`), or
        None while its name is unknown (or, closed, when it is no call)."""

    def forced_prefix(self, function_name: str | None) -> str:
        """The text that opens a call (of `function_name`, when given): appended to the prompt
        to force one."""

    def name_pattern(self, names: list[str]) -> str:
        """A regex (llguidance's syntax) for the output after `forced_prefix(None)`: one of the
        names, then anything; it constrains decoding so that a forced call names a real tool."""


def parse(parser: ToolCallParser, text: str, final: bool, max_calls: int | None = None) -> ParsedContent:
    first = start = text.find(CALL_START)
    if start < 0:
        return ParsedContent(text if final else text[:len(text) - held_back(text, CALL_START)], [])
    calls: list[ParsedToolCall] = []
    while start >= 0 and (max_calls is None or len(calls) < max_calls):
        body_start = start + len(CALL_START)
        end = text.find(CALL_END, body_start)
        closed = end >= 0 or final
        call = parser.parse_call(text[body_start:end] if end >= 0 else text[body_start:], closed)
        if call is not None:
            calls.append(call)
        if end < 0:
            break
        start = text.find(CALL_START, end + len(CALL_END))
    return ParsedContent(text[:first], calls)


def tool_call_parser_name(name: str | None, chat_template: str | None) -> str:
    """--tool-call-parser, or (unset) the format the chat template shows; a template that shows
    none (plain ChatML) gets Qwen3.5's, the format of the family deltaspec serves."""
    if name is None:
        template = chat_template or ""
        return "hermes" if CALL_START in template and "<function=" not in template else "qwen3_coder"
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(TOOL_CALL_PARSERS)}")
    return name


def make_tool_call_parser(name: str, tools: dict[str, dict[str, Any]]) -> ToolCallParser | None:
    """The parser for one request; `tools`: name -> JSON schema of the parameters. None for "none"."""
    if name == "none":
        return None
    return Qwen3CoderParser(tools) if name == "qwen3_coder" else HermesParser()


class Qwen3CoderParser:
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAMETER, _PARAMETER_END, _FUNCTION_END = "<parameter=", "</parameter>", "</function>"

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self.tools = tools

    def forced_prefix(self, function_name: str | None) -> str:
        return f"{CALL_START}\n<function={function_name}>\n" if function_name else f"{CALL_START}\n<function="

    def name_pattern(self, names: list[str]) -> str:
        return f"({_alternatives(names)})>\\n[\\s\\S]*"

    def parse_call(self, body: str, closed: bool) -> ParsedToolCall | None:
        function = self._FUNCTION.match(body)
        if function is None:
            return None
        name = function.group(1).strip()
        properties = (self.tools.get(name) or {}).get("properties") or {}
        fields, position = [], function.end()
        while (start := body.find(self._PARAMETER, position)) >= 0:
            name_end = body.find(">", start)
            if name_end < 0:
                break
            end = body.find(self._PARAMETER_END, name_end)
            if end >= 0:
                position = end + len(self._PARAMETER_END)
            elif closed:
                # A model may leave the last parameter unclosed: the next one or </function> ends it.
                ends = [i for i in (body.find(self._PARAMETER, name_end), body.find(self._FUNCTION_END, name_end))
                        if i >= 0]
                end = position = min(ends, default=len(body))
            else:
                break  # the value may still grow
            parameter = body[start + len(self._PARAMETER):name_end].strip()
            value = _convert(_strip_newlines(body[name_end + 1:end]), properties.get(parameter))
            fields.append(f"{json.dumps(parameter, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        # Joined as json.dumps joins, so a finished call's text is json.dumps(arguments).
        return ParsedToolCall(name, "{" + ", ".join(fields) + ("}" if closed else ""))


class HermesParser:
    _NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
    _ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name:
            return f'{CALL_START}\n{{"name": {json.dumps(function_name)}, "arguments": '
        return f'{CALL_START}\n{{"name": "'

    def name_pattern(self, names: list[str]) -> str:
        return f'({_alternatives(names)})"[\\s\\S]*'

    def parse_call(self, body: str, closed: bool) -> ParsedToolCall | None:
        if not closed:
            return None  # JSON is only known whole
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, TypeError, KeyError):
            # Malformed JSON (a forced call cut by max_tokens): the name, and the arguments
            # object when it parses on its own.
            name_match = self._NAME.search(body)
            if name_match is None:
                return None
            name, arguments = name_match.group(1), {}
            if (arguments_match := self._ARGUMENTS.search(body, name_match.end())) is not None:
                try:
                    arguments = json.JSONDecoder().raw_decode(body, arguments_match.end())[0]
                except ValueError:
                    pass
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _strip_newlines(value: str) -> str:
    """The template writes a value between newlines: "<parameter=x>\\nVALUE\\n</parameter>"."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _convert(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the type its JSON schema declares; kept as text when it is not one."""
    declared = (schema or {}).get("type", "string")
    if isinstance(declared, list):
        declared = next((t for t in declared if t != "null"), "string")
    if declared != "string" and value.strip() == "null":
        return None
    try:
        if declared == "integer":
            return int(value)
        if declared == "number":
            number = float(value)
            if math.isfinite(number):  # JSON has no NaN or infinity
                return int(number) if number.is_integer() and not re.search(r"[.eE]", value) else number
        if declared == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if declared in ("object", "array"):
            return json.loads(value)
    except ValueError:
        pass
    return value


def _alternatives(names: list[str]) -> str:
    """names as a regex alternation, each matched literally."""
    return "|".join(re.escape(name) for name in sorted(names))
