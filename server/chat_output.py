"""One chat completion's output as OpenAI's message fields: reasoning, content, tool calls.

The text so far (behind any text forced into the prompt, which the parsers read as already
written) goes through the reasoning split (`reasoning`) and the tool-call parser
(`tool_parsers`) whole at every delta. Both only extend what they return as the text grows, so a
delta is the difference between two parses, and a stream assembles to exactly the non-streamed
message: the same code path, with `final` on the last push. Tool calls get their `call_...` ids
here, once each. An echo (vLLM's) starts the message's content; a stream sends it before any
output (`responses.ChatRenderer.opening`).

Knows nothing about HTTP, the engine or the request beyond what `inputs` settles.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .protocol import AssistantMessage, ChatDelta, ResponseFunctionCall, ResponseToolCall
from .reasoning import ReasoningParser
from .tool_parsers import ParsedToolCall, ToolCallParser, parse


@dataclass(frozen=True)
class OutputSettings:
    """How one request's output is read; `inputs` decides it."""

    reasoning: ReasoningParser | None = None
    tool_calls: ToolCallParser | None = None  # None: tool calls are not parsed (no tools, tool_choice none)
    max_tool_calls: int | None = None         # 1 with parallel_tool_calls false or a named function
    forced_text: str = ""                     # appended to the prompt: the start of the output
    # vLLM's chat echo: the final assistant message of the request, which the content starts
    # with (outside the parse: it is the client's text, not the model's).
    echo: str = ""


@dataclass
class _Parsed:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, settings: OutputSettings) -> None:
        self.settings = settings
        self._text = settings.forced_text
        self._sent = _Parsed()
        self._ids: list[str] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._sent.tool_calls)

    def push(self, text: str, final: bool) -> ChatDelta | None:
        """Add output text; what the message gained, or None when nothing can be shown yet."""
        self._text += text
        parsed = self._parse(final)
        sent = self._sent
        reasoning = parsed.reasoning[len(sent.reasoning):] or None
        delta = ChatDelta(reasoning=reasoning, reasoning_content=reasoning,
                          content=parsed.content[len(sent.content):] or None)
        calls = []
        for index, call in enumerate(parsed.tool_calls):
            if index == len(self._ids):
                self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
                calls.append(ResponseToolCall(ResponseFunctionCall(call.name, call.arguments), index=index,
                                              id=self._ids[index], type="function"))
            elif fragment := call.arguments[len(sent.tool_calls[index].arguments):]:
                calls.append(ResponseToolCall(ResponseFunctionCall(arguments=fragment), index=index))
        self._sent = parsed
        if calls:
            delta.tool_calls = calls
        return delta if delta.reasoning_content or delta.content or calls else None

    def message(self) -> AssistantMessage:
        """The whole message so far (after the final push: the response's)."""
        sent = self._sent
        calls = [ResponseToolCall(ResponseFunctionCall(call.name, call.arguments), id=call_id, type="function")
                 for call_id, call in zip(self._ids, sent.tool_calls)]
        # OpenAI sends null content beside tool calls or reasoning rather than "".
        content = sent.content if sent.content or not (calls or sent.reasoning) else None
        if self.settings.echo:
            content = self.settings.echo + (content or "")
        return AssistantMessage(content, reasoning=sent.reasoning or None, reasoning_content=sent.reasoning or None,
                                tool_calls=calls or None)

    def _parse(self, final: bool) -> _Parsed:
        text, reasoning = self._text, ""
        if self.settings.reasoning is not None:
            split = self.settings.reasoning.split(text, final)
            reasoning, text = split.reasoning, split.content
        if self.settings.tool_calls is None:
            return _Parsed(reasoning, text)
        content = parse(self.settings.tool_calls, text, final, self.settings.max_tool_calls)
        return _Parsed(reasoning, content.content, content.tool_calls)
