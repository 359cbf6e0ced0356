"""Anthropic's Messages API over the chat path: a `MessagesRequest` becomes a `ChatCompletionRequest`
(`chat_request`), which `inputs.chat_input` turns into the engine input as for /v1/chat/completions;
the output is read by the chat route's `ChatOutput` and rewritten as content blocks
(`MessagesRenderer`). /v1/messages/count_tokens counts the prompt that same rendering gives.

What maps to what:

    system (a string or text blocks)   a system message, first (without Claude Code's
                                       x-anthropic-billing-header line: `_system_parts`)
    messages of role "system"          their text appended to that system message, after "\\n\\n"
    user text, image blocks            a user message (text parts, image_url parts: a base64
                                       source as a data: URL, a url source's url)
    tool_result blocks                 tool messages (tool_call_id = tool_use_id), one per block, in
                                       order, before the user message of the rest of their message;
                                       their content's text and image blocks as a user message's
    assistant text, tool_use blocks    an assistant message: text parts, tool_calls (arguments =
                                       the input as JSON text)
    thinking blocks                    that assistant message's reasoning_content
    a final assistant message          prefilled: the model continues it (continue_final_message)
    tools, tool_choice                 chat's function tools; auto, any, tool, none -> auto,
                                       required, the named function, none;
                                       disable_parallel_tool_use -> parallel_tool_calls false
    thinking                           the template's enable_thinking: false when disabled, true
                                       when enabled or adaptive (unset: the template's default)
    output_config.effort, .format      the template's reasoning_effort; response_format json_schema
    stop_sequences, temperature, top_p, top_k    stop and the sampling fields of those names
    max_tokens                         the engine's max_tokens, cut to the room the context leaves

and back: reasoning_content -> a thinking block, content -> a text block, each tool call -> a
tool_use block (its arguments parsed into `input`); finish reason "length" -> stop_reason
max_tokens, or model_context_window_exceeded when the context left less room than max_tokens
(Anthropic's answer for that case: Claude Code asks for 32000 tokens and more, whatever the
prompt); "stop" -> stop_sequence (with the sequence that matched), tool_use when the model
called tools, else end_turn.

What cannot be honoured is refused with a 400 naming it: document blocks, an image's file source
(no files are stored here), images outside user messages and tool results, server tools (web
search, bash, text editor, ...: Anthropic's servers run them), MCP servers, containers, a tool's
strict: true (inputs are parsed, not constrained), and thinking display "omitted" (the reasoning
is always returned). Accepted with no effect, as documented: cache_control (the engine caches
prompt prefixes on its own), context_management (no edits: the conversation renders as sent),
thinking.budget_tokens (the reasoning is not cut at the budget: max_tokens bounds reasoning and
answer together), tool_result's is_error (the template has no place for it), the signatures of
thinking blocks sent back (nothing is signed here), and redacted_thinking blocks sent back (left
out: encrypted by Anthropic).

The anthropic-version and anthropic-beta headers are not read: one version of the API is served,
and a beta's fields are served or refused as any field is.

Knows nothing about HTTP or the engine; the stream's SSE framing is here because it is this
API's own (`event:` lines, no [DONE]).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

import msgspec

from ..engine import TokenLogprobs
from .anthropic_protocol import (AnthropicErrorBody, AnthropicErrorDetail, AnthropicMessage, ContentBlock,
                                 ContentBlockDelta, ContentBlockStart, ContentBlockStop, CustomTool, FileImageSource,
                                 ImageBlockInput, InputJsonDelta, MessageDelta, MessageDeltaFields, MessageDeltaUsage,
                                 MessageStart, MessageStop, MessageUsage, MessagesRequest, OutputConfig, PromptFields,
                                 RedactedThinkingInput, SignatureDelta, StopReason, TextBlock, TextBlockInput,
                                 TextDelta, ThinkingBlock, ThinkingDelta, ThinkingInput, ToolChoice, ToolResultInput,
                                 ToolUseBlock, ToolUseInput, URLImageSource)
from .chat_output import ChatOutput, OutputSettings
from .errors import APIError, convert, refuse
from .inputs import ChatImages, ChatParsers, EngineInput, PromptTokenizer, translated_chat_input
from .protocol import (AssistantMessage, ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall, FunctionName,
                       ImageURL, JsonSchemaFormat, NamedToolChoice, ResponseFormat, ToolCall, Usage)
from .responses import TokenText

# A thinking block's signature: a marker, never checked (nothing is signed here). Not empty:
# Claude Code discards a thinking block that comes without one.
SIGNATURE = "deltaspec-unsigned"
# Claude Code's first system block: a hash that changes with every request, at the very start of
# the prompt, where it would defeat prefix caching; it tells the model nothing (vLLM drops it too).
BILLING_HEADER = "x-anthropic-billing-header:"
# Chat's field names in errors from the chat path, as this API names them (chat messages are
# numbered differently from these messages: an error naming one names the messages).
_CHAT_PARAMS = {"response_format": "output_config.format", "stop": "stop_sequences"}
# Anthropic's error type for each client error status (a 5xx is api_error, or overloaded_error
# when the queue is full).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}
# What takes which blocks (by the role of the message, or a tool_result's content).
_SERVED_BLOCKS = {"user": "a user message takes text, image and tool_result blocks",
                  "assistant": "an assistant message takes text, tool_use, thinking and redacted_thinking blocks",
                  "system": "a system message takes text blocks",
                  "tool_result": "a tool_result's content takes text and image blocks"}
_TAKE_IMAGES = ("user", "tool_result")

_encoder = msgspec.json.Encoder()


def messages_input(chat: ChatCompletionRequest, max_tokens: int, tokenizer: PromptTokenizer, max_model_len: int,
                   parsers: ChatParsers, images: ChatImages | None = None) -> tuple[EngineInput, OutputSettings]:
    """The engine input and how to read its output for a request's chat equivalent
    (`chat_request`) and the images of its image parts, with the request's max_tokens cut to
    the room the context leaves (`MessagesRenderer` says so in stop_reason)."""
    engine_input, settings = _chat_input(chat, tokenizer, max_model_len, parsers, images)
    room = engine_input.params.max_tokens  # a chat request without max_tokens runs to the context's end
    params = replace(engine_input.params, max_tokens=min(max_tokens, room))
    return replace(engine_input, params=params), settings


def count_tokens(chat: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
                 parsers: ChatParsers, images: ChatImages | None = None) -> int:
    """The number of prompt tokens a /v1/messages request with this chat equivalent runs (its
    images' tokens and a forced tool call's opening included: they are part of the prompt)."""
    engine_input, _ = _chat_input(chat, tokenizer, max_model_len, parsers, images)
    return len(engine_input.prompt_token_ids)


def _chat_input(chat: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
                parsers: ChatParsers, images: ChatImages | None) -> tuple[EngineInput, OutputSettings]:
    return translated_chat_input(chat, tokenizer, max_model_len, parsers, "messages", _CHAT_PARAMS, images)


def chat_request(request: PromptFields) -> ChatCompletionRequest:
    """The chat request that asks for what `request` asks for (its fields checked first), without
    max_tokens (`messages_input` sets the engine's)."""
    _check(request)
    tools = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(request.tools or [])]
    tool_choice, parallel_tool_calls = _tool_choice(request.tool_choice, bool(tools))
    messages = _messages(request)
    sampling: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        sampling = dict(stream=request.stream, stop=request.stop_sequences, temperature=request.temperature,
                        top_p=request.top_p, top_k=request.top_k)
    return ChatCompletionRequest(messages=messages, tools=tools or None, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls,
                                 chat_template_kwargs=_template_kwargs(request),
                                 response_format=_response_format(request.output_config),
                                 continue_final_message=messages[-1].role == "assistant" or None, **sampling)


def _check(request: PromptFields) -> None:
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is None:
        raise APIError(400, "thinking.budget_tokens is required with thinking type \"enabled\"",
                       param="thinking.budget_tokens", code="missing_required_parameter")
    refuse([
        ("mcp_servers", bool(request.mcp_servers),
         "this server connects to no MCP server: run MCP tools on the client, as custom tools"),
        ("thinking.display", thinking is not None and thinking.display == "omitted",
         "the reasoning is always returned, in full (display \"summarized\")"),
        ("container", isinstance(request, MessagesRequest) and request.container is not None,
         "this server runs no code-execution containers"),
    ])


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A custom tool as chat's function tool (the template renders its name, description and
    input_schema as the function's parameters)."""
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise APIError(400, f"{where}: tools of type {kind!r} are not supported: server tools run on Anthropic's "
                            f"servers; custom tools (name, description, input_schema) are served",
                       param=f"{where}.type", code="unsupported_parameter")
    custom = convert(tool, CustomTool, where)
    if custom.strict:
        raise APIError(400, f"{where}.strict is not supported: tool inputs are parsed from the model's text, not "
                            f"constrained to input_schema", param=f"{where}.strict", code="unsupported_parameter")
    function: dict[str, Any] = {"name": custom.name}
    if custom.description is not None:
        function["description"] = custom.description
    function["parameters"] = custom.input_schema
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice | None, has_tools: bool) -> tuple[Any, bool | None]:
    """Chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None  # chat's default: auto with tools, none without
    parallel_tool_calls = False if choice.disable_parallel_tool_use else None
    if (choice.type == "tool") != (choice.name is not None):
        raise APIError(400, "tool_choice.name is required with type \"tool\", and only there",
                       param="tool_choice.name", code="invalid_value")
    if choice.type == "tool":
        return NamedToolChoice(FunctionName(choice.name)), parallel_tool_calls
    if choice.type == "auto" and not has_tools:
        return None, parallel_tool_calls  # "auto" among no tools calls none: chat's default there
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel_tool_calls


def _template_kwargs(request: PromptFields) -> dict[str, Any] | None:
    kwargs: dict[str, Any] = {}
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking.type != "disabled"
    if request.output_config is not None and request.output_config.effort is not None:
        kwargs["reasoning_effort"] = request.output_config.effort
    return kwargs or None


def _response_format(config: OutputConfig | None) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    return ResponseFormat("json_schema", JsonSchemaFormat("output", config.format.schema))


def _messages(request: PromptFields) -> list[ChatMessage]:
    system = _system_parts(request.system)
    messages: list[ChatMessage] = []
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "system":
            parts = [_part(block, f"{where}.content[{i}]", "system") for i, block in enumerate(blocks)]
            system += ([ContentPart("text", "\n\n")] if system else []) + parts
        elif message.role == "user":
            messages += _user_messages(blocks, where)
        else:
            messages.append(_assistant_message(blocks, where))
    if not messages:
        raise APIError(400, "messages must hold a user or an assistant message, not only system messages",
                       param="messages", code="invalid_value")
    return ([ChatMessage(role="system", content=system)] if system else []) + messages


def _system_parts(system: str | list[TextBlockInput] | None) -> list[ContentPart]:
    texts = [system] if isinstance(system, str) else [block.text for block in system or []]
    parts = []
    for text in texts:
        if text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]
        if text:
            parts.append(ContentPart("text", text))
    return parts


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[ChatMessage]:
    """Its tool results as tool messages, then its text as a user message (none when it has
    only results)."""
    results, parts = [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        if block.get("type") == "tool_result":
            result = convert(block, ToolResultInput, at)
            results.append(ChatMessage(role="tool", tool_call_id=result.tool_use_id,
                                       content=_result_content(result.content, f"{at}.content")))
        else:
            parts.append(_part(block, at, "user"))
    return results + ([ChatMessage(role="user", content=parts)] if parts or not results else [])


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> ChatMessage:
    parts, calls, reasoning = [], [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = block.get("type")
        if kind == "tool_use":
            use = convert(block, ToolUseInput, at)
            calls.append(ToolCall(FunctionCall(use.name, json.dumps(use.input)), id=use.id))
        elif kind == "thinking":
            reasoning.append(convert(block, ThinkingInput, at).thinking)
        elif kind == "redacted_thinking":
            convert(block, RedactedThinkingInput, at)  # left out: only Anthropic's servers can read it
        else:
            parts.append(_part(block, at, "assistant"))
    return ChatMessage(role="assistant", content=parts or None, tool_calls=calls or None,
                       reasoning_content="\n".join(reasoning) if reasoning else None)


def _part(block: dict[str, Any], where: str, role: str) -> ContentPart:
    """A text block's part, or an image block's where role takes them. role: whose block it is
    (a message's role, or "tool_result")."""
    kind = block.get("type")
    if kind == "image" and role in _TAKE_IMAGES:
        return _image_part(convert(block, ImageBlockInput, where), where)
    if kind != "text":
        why = "documents are not read: send their text" if kind == "document" else _SERVED_BLOCKS[role]
        raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported: {why}",
                       param=f"{where}.type", code="unsupported_parameter")
    return ContentPart("text", convert(block, TextBlockInput, where).text)


def _image_part(image: ImageBlockInput, where: str) -> ContentPart:
    """Chat's image_url part of the same image: a base64 source as a data: URL."""
    source = image.source
    if isinstance(source, FileImageSource):
        raise APIError(400, f"{where}.source: file sources are not supported: no files are stored here; send the "
                            f"image as a base64 or url source", param=f"{where}.source", code="unsupported_parameter")
    url = source.url if isinstance(source, URLImageSource) else f"data:{source.media_type};base64,{source.data}"
    return ContentPart("image_url", image_url=ImageURL(url))


def _result_content(content: str | list[dict[str, Any]], where: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [_part(block, f"{where}[{index}]", "tool_result") for index, block in enumerate(content)]



def error_body(error: APIError) -> AnthropicErrorBody:
    """An error as Anthropic's API writes it (the anthropic client raises the class its status
    names). It has no `param`: the field goes first in the message (as Anthropic's do) when the
    message does not name it."""
    if error.status >= 500:
        kind = "overloaded_error" if error.code == "overloaded" else "api_error"
    else:
        kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
    message = error.message
    if error.param is not None and error.param.partition(".")[0].partition("[")[0] not in message:
        message = f"{error.param}: {message}"
    return AnthropicErrorBody(AnthropicErrorDetail(kind, message))


class MessagesRenderer:
    """One message, whole or as a stream of events, read through the chat route's `ChatOutput`
    (reasoning split, tool-call parser), so both routes read an output alike.

    Content blocks, in the order the text has them: a thinking block when there is reasoning, a
    text block when there is text, a tool_use block per call (an empty output has none). A stream
    opens each block when its first text arrives (content_block_start), fills it with deltas and
    closes it (content_block_stop) when the next one opens or the output ends, a thinking block
    after its signature (signature_delta); a tool's input streams as pieces of its JSON text,
    one per parameter closed. A stream's blocks and ids are the final message's.

    Also the stream's SSE format (`app.EventFormat`): `event: <type>` lines; message_start
    first, message_delta (stop reason, usage) and message_stop last; no [DONE]; a failure after
    the headers is an `error` event."""

    done = b""

    def __init__(self, request: MessagesRequest, model: str, tokenizer: TokenText, output: ChatOutput,
                 max_tokens: int) -> None:
        """max_tokens: the engine's (`messages_input`: the request's, or the room left in the context)."""
        self.id = self.request_id = f"msg_{uuid.uuid4().hex}"
        self.model, self.tokenizer, self.output = model, tokenizer, output
        self.stop_sequences = request.stop_sequences or []
        self.context_limited = max_tokens < request.max_tokens  # then a "length" finish is the context's end
        # The stream's state.
        self._text = ""
        self._token_ids: list[int] = []
        self._opened: list[str] = []  # blocks' keys ("thinking", "text", "call <index>") in their order
        self._open: str | None = None
        self._stop: tuple[StopReason, str | None] | None = None

    # The Renderer interface (responses.Renderer) ---------------------------------------------

    def opening(self, usage: Usage) -> list[MessageStart]:
        computed, cached = _prompt_split(usage)
        return [MessageStart(self._message([], None, None, MessageUsage(computed, 0, cached)))]

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
               prompt_logprobs: list[TokenLogprobs | None] | None) -> list[msgspec.Struct]:
        # (no logprobs: none are asked for, the API has no place for them)
        self._text += text
        self._token_ids += token_ids
        events: list[msgspec.Struct] = []
        delta = self.output.push(text, final=finish_reason is not None)
        if delta is not None:
            if delta.reasoning_content:
                events += self._switch_to("thinking")
                events.append(self._delta(ThinkingDelta(delta.reasoning_content)))
            if delta.content:
                events += self._switch_to("text")
                events.append(self._delta(TextDelta(delta.content)))
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: its id and name
                    events += self._switch_to(f"call {call.index}")
                if call.function.arguments:
                    events.append(self._delta(InputJsonDelta(call.function.arguments)))
        if finish_reason is not None:
            self._stop = self._stop_reason(finish_reason, self._text, self._token_ids)
            events += self._close()
        return events

    def usage_chunk(self, usage: Usage) -> MessageDelta:
        """The stream's last delta: why it stopped, and the usage."""
        computed, cached = _prompt_split(usage)
        return MessageDelta(MessageDeltaFields(*self._stop), MessageDeltaUsage(computed, usage.completion_tokens, cached))

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None) -> AnthropicMessage:
        self.output.push(text, final=True)
        stop_reason, stop_sequence = self._stop_reason(finish_reason, text, token_ids)
        computed, cached = _prompt_split(usage)
        return self._message(_blocks(self.output.message()), stop_reason, stop_sequence,
                             MessageUsage(computed, usage.completion_tokens, cached))

    # The SSE format (app.EventFormat) ----------------------------------------------------------

    def event(self, chunk: msgspec.Struct) -> bytes:
        kind = type(chunk).__struct_config__.tag
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(chunk) + b"\n\n"

    def end(self, usage: Usage) -> bytes:
        return self.event(self.usage_chunk(usage)) + self.event(MessageStop())

    def failure(self, error: APIError) -> bytes:
        return self.event(error_body(error))

    # Blocks and stop reasons -------------------------------------------------------------------

    def _switch_to(self, key: str) -> list[msgspec.Struct]:
        """Close the open block and open `key`'s (nothing when it is the open one)."""
        if key == self._open:
            return []
        events = self._close()
        self._opened.append(key)
        self._open = key
        if key == "thinking":
            block: ContentBlock = ThinkingBlock("", "")
        elif key == "text":
            block = TextBlock("")
        else:
            call = self.output.message().tool_calls[int(key.split()[1])]
            block = ToolUseBlock(_tool_use_id(call.id), call.function.name, {})  # the input follows as deltas
        return events + [ContentBlockStart(len(self._opened) - 1, block)]

    def _close(self) -> list[msgspec.Struct]:
        key, self._open = self._open, None
        if key is None:
            return []
        index = len(self._opened) - 1  # blocks open one after the other: the open one is the last
        signature = [ContentBlockDelta(index, SignatureDelta(SIGNATURE))] if key == "thinking" else []
        return signature + [ContentBlockStop(index)]

    def _delta(self, delta: msgspec.Struct) -> ContentBlockDelta:
        return ContentBlockDelta(len(self._opened) - 1, delta)

    def _stop_reason(self, finish_reason: str, text: str, token_ids: list[int]) -> tuple[StopReason, str | None]:
        """(stop_reason, stop_sequence) of an output whose whole text and tokens these are."""
        if finish_reason == "length":
            return ("model_context_window_exceeded" if self.context_limited else "max_tokens"), None
        sequence = self._matched_stop_sequence(text, token_ids)
        if sequence is not None:
            return "stop_sequence", sequence
        return ("tool_use" if self.output.has_tool_calls else "end_turn"), None

    def _matched_stop_sequence(self, text: str, token_ids: list[int]) -> str | None:
        """The stop sequence the output ended at, if any. The engine cuts the text right before
        a stop string and reports only "stop"; the output's tokens, decoded whole, go on past the
        cut with the string that matched: the first listed of those starting there (the
        engine's own rule, `Request._append_searching_stops`). After EOS they go on with nothing."""
        if not self.stop_sequences:
            return None
        rest = self.tokenizer.decode(token_ids)[len(text):]
        return next((sequence for sequence in self.stop_sequences if rest.startswith(sequence)), None)

    def _message(self, content: list[ContentBlock], stop_reason: StopReason | None, stop_sequence: str | None,
                 usage: MessageUsage) -> AnthropicMessage:
        return AnthropicMessage(id=self.id, model=self.model, content=content, stop_reason=stop_reason,
                                stop_sequence=stop_sequence, usage=usage)


def _blocks(message: AssistantMessage) -> list[ContentBlock]:
    """A whole message's blocks (ChatOutput.message: content is None beside reasoning or calls
    when empty, "" when the whole output is)."""
    blocks: list[ContentBlock] = [ThinkingBlock(message.reasoning_content, SIGNATURE)] \
        if message.reasoning_content else []
    if message.content:
        blocks.append(TextBlock(message.content))
    return blocks + [ToolUseBlock(_tool_use_id(call.id), call.function.name, json.loads(call.function.arguments))
                     for call in message.tool_calls or []]


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id shape for the call id chat gives (`ChatOutput`): the same for a stream and
    the whole message."""
    return "toolu_" + call_id.removeprefix("call_")


def _prompt_split(usage: Usage) -> tuple[int, int]:
    """(input_tokens, cache_read_input_tokens): the prompt's computed tokens and those restored
    from the prefix cache, as Anthropic splits them."""
    cached = usage.prompt_tokens_details.cached_tokens
    return usage.prompt_tokens - cached, cached
