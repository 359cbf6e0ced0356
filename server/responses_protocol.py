"""OpenAI's Responses API (`POST /v1/responses`) as msgspec Structs: the request, its input items,
the response, its output items and the stream's events.

The request extends `SamplingFields`, so the engine's sampling options chat takes (top_k, min_p,
seed, stop, penalties, ...) are accepted here too and reach the engine through the chat path
unchanged; the chat-only ones among them (max_tokens, n, response_format, ...) are refused by
name in `responses_api`. Input items and tools are decoded as JSON objects and checked one by
one against their own Struct there (`InputMessage`, `FunctionCallInput`, ..., `FunctionTool`):
a message may leave out its `type`, which a tagged union cannot, and an item of a type the
server does not serve (a file, a web search) gets a 400 naming that type.

Output items and stream events are tagged Structs (`type`); every event has a
`sequence_number`, set as it is written (`ResponsesRenderer.event`).

Knows nothing about HTTP, the engine or tokenization.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from .protocol import ChatTokenLogprob, NumLogprobs, PositiveInt, Request, SamplingFields

# OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512.
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]


# Requests -----------------------------------------------------------------------------------

class TextFormat(Request, kw_only=True, omit_defaults=True):
    """`text.format`: flat, unlike chat's response_format ({"type": "json_schema", "name", "schema", ...})."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's (required there)
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema, strict or not
    description: str | None = None


class TextConfig(Request):
    format: TextFormat | None = None


class ReasoningConfig(Request):
    # Given to the chat template as `reasoning_effort` (as vLLM does): the template decides.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Only "auto" is served (no summary: the reasoning itself is returned); `responses_api`
    # refuses the others.
    summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionToolChoice(Request):
    name: str
    type: Literal["function"] = "function"


class ResponsesRequest(SamplingFields, kw_only=True):
    # A string (one user message) or the conversation's items (`responses_api` checks each).
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]
    instructions: str | None = None  # a system message placed first
    max_output_tokens: PositiveInt | None = None  # reasoning and output tokens together
    top_logprobs: NumLogprobs | None = None  # with include ["message.output_text.logprobs"]
    # The tools as sent, flat ({"type": "function", "name", "parameters", ...}); `responses_api`
    # checks each against `FunctionTool` and refuses other types by name.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None  # echoed back
    include: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on /v1/chat/completions (vLLM's name)
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key
    service_tier: Literal["auto", "default"] | None = None  # one tier: no flex or priority processing
    # Declared only to be refused when set (`responses_api`): no responses are stored, none run
    # in the background, and the context is never truncated.
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None


class InputText(Request, kw_only=True):
    """A text part of a message's content: input_text, or output_text in an assistant message
    sent back (with the annotations and logprobs the response gave it)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(Request, kw_only=True):
    """An image part of a message's content (or of a function_call_output's output): chat's
    image_url part."""

    type: Literal["input_image"]
    image_url: str | None = None  # a data:, http(s): or file: URL
    file_id: str | None = None  # refused when set: no files are stored here
    # "auto", "low" or "high": accepted, any value, with no effect (vLLM ignores it too): an
    # image's tokens follow from its size alone.
    detail: str | None = None


class InputMessage(Request, kw_only=True):
    """A message item (EasyInputMessage: `type` may be left out), or an output message sent back."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]  # text, or parts (each checked against `InputText` or `InputImage`)
    type: Literal["message"] = "message"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallInput(Request, kw_only=True):
    """A call the model made, sent back in the history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(Request, kw_only=True):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]  # text, or input_text and input_image parts
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningTextInput(Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(Request, kw_only=True):
    """A reasoning item sent back: its text becomes the next assistant message's reasoning_content."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextInput] = []
    content: list[ReasoningTextInput] | None = None
    encrypted_content: str | None = None  # refused when set: this server encrypts nothing
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionTool(Request, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema: parsers convert argument types by it
    strict: bool | None = None


# Responses ----------------------------------------------------------------------------------

class OutputItem(msgspec.Struct, tag_field="type", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(OutputItem, tag="reasoning"):
    """The model's reasoning, in plain text (no summary, no encrypted_content)."""

    content: list[ReasoningText]
    summary: list[Any] = []


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatTokenLogprob] = []  # with include ["message.output_text.logprobs"]


class OutputMessage(OutputItem, tag="message"):
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(OutputItem, tag="function_call"):
    call_id: str
    name: str
    arguments: str  # JSON text


Output = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # input tokens restored from the prefix cache, not computed


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    output_tokens_details: OutputTokensDetails
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(msgspec.Struct):
    code: str | None
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[Output]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    # The request's settings, echoed back (OpenAI's defaults where it left them unset).
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: str | FunctionToolChoice = "auto"
    tools: list[dict[str, Any]] = []
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] = "disabled"
    object: Literal["response"] = "response"


# Stream events ------------------------------------------------------------------------------

class Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0  # set as the event is written


class ResponseCreated(Event, tag="response.created"):
    response: Response


class ResponseInProgress(Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(Event, tag="response.incomplete"):
    response: Response


class ResponseFailed(Event, tag="response.failed"):
    response: Response


class OutputItemAdded(Event, tag="response.output_item.added"):
    output_index: int
    item: Output


class OutputItemDone(Event, tag="response.output_item.done"):
    output_index: int
    item: Output


class ContentPartAdded(Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob] = []


class OutputTextDone(Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob] = []


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


StreamEvent = Union[ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete, ResponseFailed,
                    OutputItemAdded, OutputItemDone, ContentPartAdded, ContentPartDone, OutputTextDelta,
                    OutputTextDone, ReasoningTextDelta, ReasoningTextDone, FunctionCallArgumentsDelta,
                    FunctionCallArgumentsDone]
