"""OpenAI's Responses API over the chat path: a `ResponsesRequest` becomes a `ChatCompletionRequest`
(`chat_request`), which `inputs.chat_input` turns into the engine input as for /v1/chat/completions;
the output is read by a `ChatRenderer` and rewritten as output items (`ResponsesRenderer`).

What maps to what:

    instructions                 a system message, first
    input "text"                 one user message
    message item                 a message of its role (text parts: input_text, output_text;
                                 input_image parts: chat's image_url parts, the image_url as
                                 sent, detail with no effect)
    function_call items          one assistant message with those tool_calls (joining the
                                 assistant message just before them: one turn)
    function_call_output         a tool message (tool_call_id = call_id; its output's parts as
                                 a message's)
    reasoning item               the next assistant message's reasoning_content
    tools (flat), tool_choice    chat's tools ({"type": "function", "function": {...}}), tool_choice
    text.format                  response_format
    reasoning.effort             chat's reasoning_effort (the template's variable, as vLLM gives it)
    max_output_tokens            max_completion_tokens (reasoning and output tokens together)
    include logprobs, top_logprobs   logprobs, top_logprobs

and back: reasoning_content -> a reasoning item (the text in `content`, `summary` empty), content
-> a message item, each tool call -> a function_call item, finish reason "length" -> status
"incomplete". What cannot be honoured is refused with a 400 naming the field: stored responses
(store true, previous_response_id), background runs, truncation "auto", reasoning summaries
("concise", "detailed"), encrypted reasoning, items and tools other than text, images and
functions, an input_image's file_id (no files are stored), and chat's own fields (max_tokens, n,
response_format, stream_options, prompt_logprobs).

Knows nothing about HTTP or the engine; the stream's SSE framing is here because it is this
API's own (`event:` lines, sequence numbers, no [DONE]).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec

from ..engine import TokenLogprobs
from .chat_output import ChatOutput, OutputSettings
from .errors import APIError, convert, refuse
from .inputs import ChatImages, ChatParsers, EngineInput, PromptTokenizer, translated_chat_input
from .protocol import (AssistantMessage, ChatCompletionRequest, ChatMessage, ChatTokenLogprob, ContentPart,
                       FunctionCall, FunctionName, ImageURL, JsonSchemaFormat, NamedToolChoice, ResponseFormat,
                       SamplingFields, ToolCall, Usage)
from .reasoning import THINK_END
from .responses import ChatRenderer, TokenText
from .responses_protocol import (ContentPartAdded, ContentPartDone, Event, FunctionCallArgumentsDelta,
                                 FunctionCallArgumentsDone, FunctionCallInput, FunctionCallItem,
                                 FunctionCallOutputInput, FunctionTool, FunctionToolChoice, IncompleteDetails,
                                 InputImage, InputMessage, InputText, InputTokensDetails, Output, OutputItemAdded,
                                 OutputItemDone, OutputMessage, OutputText, OutputTextDelta, OutputTextDone,
                                 OutputTokensDetails, ReasoningInput, ReasoningItem, ReasoningText, ReasoningTextDelta,
                                 ReasoningTextDone, Response, ResponseCompleted, ResponseCreated, ResponseError,
                                 ResponseFailed, ResponseInProgress, ResponseIncomplete, ResponseUsage,
                                 ResponsesRequest, TextConfig, TextFormat)

_INPUT_ITEMS = {"message": InputMessage, "function_call": FunctionCallInput,
                "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Accepted, though nothing is encrypted: the reasoning comes back in plain text, in the reasoning
# item's content, and goes back into the prompt from there (Codex CLI asks for it with store false).
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
# Chat's field names in errors from the chat path, as this API names them (chat messages are
# numbered differently from input items: an error naming one names the input).
_CHAT_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}

_encoder = msgspec.json.Encoder()


def responses_input(chat: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
                    parsers: ChatParsers, images: ChatImages | None = None) -> tuple[EngineInput, OutputSettings]:
    """The engine input and how to read its output for a request's chat equivalent (`chat_request`)
    and the images of its image parts."""
    return translated_chat_input(chat, tokenizer, max_model_len, parsers, "input", _CHAT_PARAMS, images)


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks for what `request` asks for (its fields checked first)."""
    include = set(request.include or ())
    summary = request.reasoning.summary if request.reasoning is not None else None
    refuse([
        ("max_tokens", request.max_tokens is not None, "use max_output_tokens"),
        ("n", request.n is not None, "a response has one output"),
        ("response_format", request.response_format is not None, "use text.format"),
        ("stream_options", request.stream_options is not None,
         "a stream always ends with the whole response and its usage (response.completed)"),
        ("prompt_logprobs", request.prompt_logprobs is not None, "a response has no place for them"),
        ("store", bool(request.store), "responses are not stored: send store false or leave it out"),
        ("previous_response_id", request.previous_response_id is not None,
         "responses are not stored: send the whole conversation as input"),
        ("background", bool(request.background), "responses run in the foreground only"),
        ("truncation", request.truncation == "auto",
         "the input is never truncated: one longer than the context is refused (truncation \"disabled\")"),
        ("reasoning.summary", summary not in (None, "auto"),
         "no summaries are written; the reasoning itself is in the reasoning item's content (summary \"auto\")"),
        ("top_logprobs", request.top_logprobs is not None and LOGPROBS_INCLUDE not in include,
         f"top_logprobs needs include [\"{LOGPROBS_INCLUDE}\"]"),
    ])
    unknown = sorted(include - {LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE})
    if unknown:
        raise APIError(400, f"include {unknown} cannot be served: only {LOGPROBS_INCLUDE!r} and "
                            f"{ENCRYPTED_REASONING_INCLUDE!r}", param="include", code="unsupported_parameter")
    tools = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(request.tools or [])]
    tool_choice = request.tool_choice
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = NamedToolChoice(FunctionName(tool_choice.name))
    elif tool_choice == "auto" and not tools:
        tool_choice = None  # "auto" among no tools calls none: chat's "none", which needs no tools
    # Every sampling field as sent (the chat-only ones were refused above: all unset).
    fields = {name: getattr(request, name) for name in SamplingFields.__struct_fields__}
    fields["response_format"] = _response_format(request.text)
    effort = request.reasoning.effort if request.reasoning is not None else None
    return ChatCompletionRequest(**fields, messages=_messages(request), max_completion_tokens=request.max_output_tokens,
                                 logprobs=(LOGPROBS_INCLUDE in include) or None, top_logprobs=request.top_logprobs,
                                 tools=tools or None, tool_choice=tool_choice,
                                 parallel_tool_calls=request.parallel_tool_calls, reasoning_effort=effort,
                                 chat_template_kwargs=request.chat_template_kwargs)


def _messages(request: ResponsesRequest) -> list[ChatMessage]:
    messages = [] if request.instructions is None else [ChatMessage(role="system", content=request.instructions)]
    if isinstance(request.input, str):
        return messages + [ChatMessage(role="user", content=request.input)]
    reasoning: list[str] = []  # reasoning items not yet placed: the next assistant turn's
    for index, value in enumerate(request.input):
        where = f"input[{index}]"
        kind = value.get("type", "message")
        if not isinstance(kind, str) or kind not in _INPUT_ITEMS:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                f"function_call_output and reasoning are)", param=f"{where}.type",
                           code="unsupported_parameter")
        item = convert(value, _INPUT_ITEMS[kind], where)
        if isinstance(item, ReasoningInput):
            reasoning.append(_reasoning_text(item, where))
            continue
        if reasoning and not (isinstance(item, FunctionCallInput)
                              or isinstance(item, InputMessage) and item.role == "assistant"):
            raise APIError(400, f"{where}: a reasoning item must come right before the assistant message or "
                                f"function_call of its turn", param=where, code="invalid_value")
        if isinstance(item, FunctionCallOutputInput):
            messages.append(ChatMessage(role="tool", content=_content(item.output, f"{where}.output"),
                                        tool_call_id=item.call_id))
        elif isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=_content(item.content, f"{where}.content"),
                                        reasoning_content="\n".join(reasoning) if reasoning else None))
            reasoning = []
        else:
            call = ToolCall(FunctionCall(item.name, _arguments(item.arguments, f"{where}.arguments")), id=item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not reasoning:
                last.tool_calls = [*(last.tool_calls or []), call]  # the same turn: its text, then its calls
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call],
                                            reasoning_content="\n".join(reasoning) if reasoning else None))
                reasoning = []
    if reasoning:
        raise APIError(400, "the last input item is a reasoning item: it must come right before the assistant "
                            "message or function_call of its turn", param="input", code="invalid_value")
    return messages


def _content(content: str | list[dict[str, Any]], where: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for index, value in enumerate(content):
        at = f"{where}[{index}]"
        kind = value.get("type")
        if kind == "input_image":
            parts.append(_image_part(convert(value, InputImage, at), at))
        elif kind in ("input_text", "output_text"):
            parts.append(ContentPart("text", convert(value, InputText, at).text))
        else:
            raise APIError(400, f"content parts of type {kind!r} are not supported (input_text, output_text and "
                                f"input_image are): {at}", param=f"{at}.type", code="unsupported_parameter")
    return parts


def _image_part(image: InputImage, where: str) -> ContentPart:
    """Chat's image_url part of the same image."""
    if image.file_id is not None:
        raise APIError(400, f"{where}.file_id is not supported: no files are stored here; send the image in "
                            f"image_url (a URL or a data: URL)", param=f"{where}.file_id", code="unsupported_parameter")
    if image.image_url is None:
        raise APIError(400, f"{where}.image_url is required in an input_image part", param=f"{where}.image_url",
                       code="missing_required_parameter")
    return ContentPart("image_url", image_url=ImageURL(image.image_url))


def _reasoning_text(item: ReasoningInput, where: str) -> str:
    """The reasoning's own text; its summary where it has none (a summary is all some servers return)."""
    if item.encrypted_content is not None:
        raise APIError(400, f"{where}.encrypted_content cannot be read: this server encrypts no reasoning; send "
                            f"its text in content", param=f"{where}.encrypted_content", code="unsupported_parameter")
    parts = item.content if item.content else item.summary
    return "".join(part.text for part in parts)


def _arguments(arguments: str, where: str) -> str:
    """Checked here, where the error can name the input item (the template takes them as an object)."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError) as error:  # (JSON nested deeper than Python's recursion limit)
        raise APIError(400, f"{where} is not valid JSON: {error}", param=where, code="invalid_value") from error
    if not isinstance(parsed, dict):
        raise APIError(400, f"{where} must be a JSON object", param=where, code="invalid_value")
    return arguments


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A flat function tool as chat's tool; the function's fields as sent (the template renders them)."""
    if tool.get("type") != "function":
        raise APIError(400, f"{where}: tools of type {tool.get('type')!r} are not supported (function tools are)",
                       param=f"{where}.type", code="unsupported_parameter")
    convert(tool, FunctionTool, where)
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat("json_object")
    if form.name is None:
        raise APIError(400, "text.format json_schema needs its name", param="text.format.name",
                       code="missing_required_parameter")
    return ResponseFormat("json_schema", JsonSchemaFormat(form.name, form.schema, form.strict, form.description))


class ResponsesRenderer:
    """One response, whole or as a stream of events, read through the chat route's `ChatRenderer`
    (reasoning, content, tool calls, logprobs), so both routes read an output alike.

    Output items, in the order the text has them: a reasoning item when there is reasoning; a
    message when there is content, or nothing else at all; a function_call per call. A stream
    opens each item when its first text arrives and closes it when the next one opens or the
    output ends; the ids of its items are the final response's. The message's logprobs are those
    of every token generated before it closes (the reasoning's included, as chat's logprobs
    include them): in a stream each text delta carries the tokens since the one before, and a
    call's tokens, coming after the message closed, have no place in it.

    Also the stream's SSE format (`app.EventFormat`): `event: <type>` lines, sequence numbers
    in the order the events are written, and no [DONE]: the terminal event (response.completed,
    response.incomplete, response.failed) carries the whole response."""

    done = b""

    def __init__(self, request: ResponsesRequest, model: str, tokenizer: TokenText, output: ChatOutput,
                 prompt_token_ids: list[int]) -> None:
        self.id = self.request_id = f"resp_{uuid.uuid4().hex}"
        self.chat = ChatRenderer(model, tokenizer, output, prompt_token_ids, response_id=self.id,
                                 tokens_as_ids=bool(request.return_tokens_as_token_ids))
        self.request, self.model, self.tokenizer = request, model, tokenizer
        self.created_at = int(time.time())
        self._item_ids: dict[str, str] = {}
        # The stream's state.
        self._token_ids: list[int] = []
        self._opened: list[str] = []  # items' keys (_keys) in their output order
        self._open: str | None = None
        self._pending_logprobs: list[ChatTokenLogprob] = []  # for the next text delta
        self._sent_logprobs: list[ChatTokenLogprob] = []
        self._finish_reason: str | None = None
        self._sequence_number = 0

    # The Renderer interface (responses.Renderer) ---------------------------------------------

    def opening(self, usage: Usage) -> list[Event]:
        response = self._response("in_progress", [], None)
        return [ResponseCreated(response=response), ResponseInProgress(response=response)]

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
               prompt_logprobs: list[TokenLogprobs | None] | None) -> list[Event]:
        self._token_ids += token_ids
        events: list[Event] = []
        for chunk in self.chat.chunks(text, finish_reason, token_ids, logprobs, prompt_logprobs):
            [choice] = chunk.choices
            if choice.logprobs is not None:
                self._pending_logprobs += choice.logprobs.content
            delta = choice.delta
            if delta.reasoning_content:
                events += self._switch_to("reasoning")
                events.append(ReasoningTextDelta(item_id=self._item_id("reasoning"), output_index=len(self._opened) - 1,
                                                 content_index=0, delta=delta.reasoning_content))
            if delta.content:
                events += self._switch_to("message")
                logprobs_now, self._pending_logprobs = self._pending_logprobs, []
                self._sent_logprobs += logprobs_now
                events.append(OutputTextDelta(item_id=self._item_id("message"), output_index=len(self._opened) - 1,
                                              content_index=0, delta=delta.content, logprobs=logprobs_now))
            for call in delta.tool_calls or []:
                key = f"call {call.index}"
                if call.id is not None:  # a call's first delta: its id and name
                    events += self._switch_to(key)
                if call.function.arguments:
                    events.append(FunctionCallArgumentsDelta(item_id=self._item_id(key),
                                                             output_index=len(self._opened) - 1,
                                                             delta=call.function.arguments))
        if finish_reason is not None:
            self._finish_reason = finish_reason
            if not self._opened:
                events += self._switch_to("message")  # an empty answer is still a message
            events += self._close()
        return events

    def usage_chunk(self, usage: Usage) -> Event:
        """The stream's terminal event: the whole response, with its usage."""
        message = self.chat.output.message()
        status = "incomplete" if self._finish_reason == "length" else "completed"
        response = self._response(status, self._output(message, self._sent_logprobs, status),
                                  self._usage(usage, message, self._token_ids))
        return ResponseIncomplete(response=response) if status == "incomplete" else ResponseCompleted(response=response)

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None) -> Response:
        [choice] = self.chat.response(text, finish_reason, usage, token_ids, logprobs, prompt_logprobs).choices
        status = "incomplete" if finish_reason == "length" else "completed"
        entries = choice.logprobs.content if choice.logprobs is not None else []
        return self._response(status, self._output(choice.message, entries, status),
                              self._usage(usage, choice.message, token_ids))

    # The SSE format (app.EventFormat) ----------------------------------------------------------

    def event(self, chunk: Event) -> bytes:
        chunk.sequence_number = self._sequence_number
        self._sequence_number += 1
        kind = type(chunk).__struct_config__.tag
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(chunk) + b"\n\n"

    def end(self, usage: Usage) -> bytes:
        return self.event(self.usage_chunk(usage))

    def failure(self, error: APIError) -> bytes:
        """response.failed, with the items streamed so far (the open one incomplete)."""
        message = self.chat.output.message()
        output = [self._item(key, message, "incomplete" if key == self._open else "completed", self._sent_logprobs)
                  for key in self._opened]
        return self.event(ResponseFailed(response=self._response("failed", output, None,
                                                                 ResponseError(error.code, error.message))))

    # Items -------------------------------------------------------------------------------------

    def _switch_to(self, key: str) -> list[Event]:
        """Close the open item and open `key`'s (nothing when it is the open one)."""
        if key == self._open:
            return []
        events = self._close()
        self._opened.append(key)
        self._open = key
        index, item_id = len(self._opened) - 1, self._item_id(key)
        if key == "reasoning":
            return events + [OutputItemAdded(output_index=index, item=ReasoningItem(id=item_id, status="in_progress",
                                                                                    content=[])),
                             ContentPartAdded(item_id=item_id, output_index=index, content_index=0,
                                              part=ReasoningText(""))]
        if key == "message":
            return events + [OutputItemAdded(output_index=index, item=OutputMessage(id=item_id, status="in_progress",
                                                                                    content=[])),
                             ContentPartAdded(item_id=item_id, output_index=index, content_index=0,
                                              part=OutputText(""))]
        item = self._item(key, self.chat.output.message(), "in_progress", [])
        item.arguments = ""  # they follow as deltas
        return events + [OutputItemAdded(output_index=index, item=item)]

    def _close(self) -> list[Event]:
        """The open item's done events (none when no item is open). One closed at the end of an
        output cut by max_output_tokens is incomplete."""
        key, self._open = self._open, None
        if key is None:
            return []
        index, item_id = self._opened.index(key), self._item_id(key)
        events: list[Event] = []
        if key == "message" and self._pending_logprobs:
            # Tokens after the last text (a stop token): the message's too.
            logprobs_now, self._pending_logprobs = self._pending_logprobs, []
            self._sent_logprobs += logprobs_now
            events.append(OutputTextDelta(item_id=item_id, output_index=index, content_index=0, delta="",
                                          logprobs=logprobs_now))
        status = "incomplete" if self._finish_reason == "length" else "completed"
        item = self._item(key, self.chat.output.message(), status, self._sent_logprobs)
        if key == "reasoning":
            part = item.content[0]
            return events + [ReasoningTextDone(item_id=item_id, output_index=index, content_index=0, text=part.text),
                             ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=part),
                             OutputItemDone(output_index=index, item=item)]
        if key == "message":
            part = item.content[0]
            return events + [OutputTextDone(item_id=item_id, output_index=index, content_index=0, text=part.text,
                                            logprobs=part.logprobs),
                             ContentPartDone(item_id=item_id, output_index=index, content_index=0, part=part),
                             OutputItemDone(output_index=index, item=item)]
        return [FunctionCallArgumentsDone(item_id=item_id, output_index=index, arguments=item.arguments),
                OutputItemDone(output_index=index, item=item)]

    def _output(self, message: AssistantMessage, logprobs: list[ChatTokenLogprob], status: str) -> list[Output]:
        """The response's items; the last is incomplete when the response is."""
        keys = _keys(message)
        return [self._item(key, message, status if i == len(keys) - 1 else "completed", logprobs)
                for i, key in enumerate(keys)]

    def _item(self, key: str, message: AssistantMessage, status: str, logprobs: list[ChatTokenLogprob]) -> Output:
        item_id = self._item_id(key)
        if key == "reasoning":
            return ReasoningItem(id=item_id, status=status, content=[ReasoningText(message.reasoning_content or "")])
        if key == "message":
            return OutputMessage(id=item_id, status=status,
                                 content=[OutputText(message.content or "", logprobs=list(logprobs))])
        call = message.tool_calls[int(key.split()[1])]
        return FunctionCallItem(id=item_id, status=status, call_id=call.id, name=call.function.name,
                                arguments=call.function.arguments)

    def _item_id(self, key: str) -> str:
        """An item's id, made when first asked for: a stream's items keep theirs in the final response."""
        if key not in self._item_ids:
            prefix = {"reasoning": "rs", "message": "msg"}.get(key, "fc")
            self._item_ids[key] = f"{prefix}_{uuid.uuid4().hex}"
        return self._item_ids[key]

    def _usage(self, usage: Usage, message: AssistantMessage, token_ids: list[int]) -> ResponseUsage:
        reasoning = _num_reasoning_tokens(self.tokenizer, token_ids) if message.reasoning_content else 0
        return ResponseUsage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                             OutputTokensDetails(reasoning), InputTokensDetails(usage.prompt_tokens_details.cached_tokens))

    def _response(self, status: str, output: list[Output], usage: ResponseUsage | None,
                  error: ResponseError | None = None) -> Response:
        request = self.request
        return Response(id=self.id, created_at=self.created_at, model=self.model, status=status, output=output,
                        usage=usage, error=error,
                        incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
                        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                        metadata=request.metadata or {}, parallel_tool_calls=request.parallel_tool_calls is not False,
                        temperature=request.temperature, top_p=request.top_p, top_logprobs=request.top_logprobs,
                        tool_choice=request.tool_choice or "auto", tools=request.tools or [],
                        text=request.text or TextConfig(TextFormat(type="text")), reasoning=request.reasoning,
                        user=request.user, prompt_cache_key=request.prompt_cache_key,
                        service_tier=request.service_tier)


def _keys(message: AssistantMessage) -> list[str]:
    """The keys of a message's output items, in their order (ChatOutput.message: content is None
    when empty beside reasoning or calls, "" when the output is empty)."""
    keys = ["reasoning"] if message.reasoning_content else []
    if message.content is not None:
        keys.append("message")
    return keys + [f"call {index}" for index in range(len(message.tool_calls or []))]


def _num_reasoning_tokens(tokenizer: TokenText, token_ids: list[int]) -> int:
    """The output tokens up to the one that closes the think block (all of them when none does):
    the fewest whose text holds `</think>`, found by bisection, so that a stream and a whole
    response count alike whatever their deltas."""
    if THINK_END not in tokenizer.decode(token_ids, skip_special_tokens=False):
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if THINK_END in tokenizer.decode(token_ids[:middle], skip_special_tokens=False):
            high = middle
        else:
            low = middle + 1
    return low
