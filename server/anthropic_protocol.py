"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as msgspec
Structs: the requests, their content blocks and tools, the message, the stream's events and the
error body.

Unknown fields are a 400 naming them, as on every route. Fields that Claude Code sends and that
change nothing here are declared and accepted (`cache_control` anywhere, `context_management`,
`metadata`, `service_tier`); fields that ask for what this server cannot do are declared only to
be refused by name in `anthropic_api` (`container`, `mcp_servers`, a tool's `strict: true`,
thinking `display: "omitted"`). A message's content blocks and the tools are decoded as JSON
objects and checked one by one against their own Struct there (`TextBlockInput`,
`ToolResultInput`, ..., `CustomTool`), so that a block or tool of a type the server does not
serve (a document, a server tool such as `web_search_20250305`) gets a 400 naming that type.

The message's blocks and the stream's events are tagged Structs (`type`); an error, whole or in
a stream, is `{"type": "error", "error": {"type", "message"}}`.

Knows nothing about HTTP, the engine or tokenization.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from .protocol import PositiveInt, Request


# Requests -----------------------------------------------------------------------------------

class CacheControl(Request):
    """A prompt-cache breakpoint: accepted wherever Anthropic takes one, with no effect (the
    engine caches every prompt prefix on its own, no breakpoints needed)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockInput(Request, kw_only=True):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an assistant's text sent back with its citations: the text is rendered


class Base64ImageSource(Request, tag_field="type", tag="base64"):
    media_type: str  # image/jpeg, image/png, image/gif or image/webp
    data: str


class URLImageSource(Request, tag_field="type", tag="url"):
    url: str


class FileImageSource(Request, tag_field="type", tag="file"):
    """A file uploaded to Anthropic's Files API: refused (no files are stored here)."""

    file_id: str


class ImageBlockInput(Request, kw_only=True):
    """An image, in a user message or a tool_result's content (Claude Code sends screenshots there)."""

    type: Literal["image"]
    source: Base64ImageSource | URLImageSource | FileImageSource
    cache_control: CacheControl | None = None


class ToolUseInput(Request, kw_only=True):
    """A call the model made, sent back in an assistant message."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultInput(Request, kw_only=True):
    """A call's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    # text, or text and image blocks (each checked against `TextBlockInput` or `ImageBlockInput`)
    content: str | list[dict[str, Any]] = ""
    # The chat template has no place for it: the result renders as its content alone.
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingInput(Request, kw_only=True):
    """Reasoning sent back in an assistant message: that turn's reasoning_content. Its signature
    is not checked: nothing is signed here."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingInput(Request, kw_only=True):
    """Reasoning Anthropic's servers encrypted: accepted in an assistant message sent back and
    left out of the prompt (no model here can read it; this server writes none)."""

    type: Literal["redacted_thinking"]
    data: str


class MessageInput(Request):
    """A message of the conversation. "system" (a mid-conversation system message, which Claude
    Code sends) is folded into the system prompt: Qwen's templates take one system message,
    first."""

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]  # text, or content blocks (`anthropic_api` checks each)


class CustomTool(Request, kw_only=True):
    """A tool the client runs: chat's function tool (input_schema is its parameters)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # true is refused: tool inputs are parsed, not constrained to the schema
    eager_input_streaming: bool | None = None  # accepted: inputs stream a parameter at a time either way


class ToolChoice(Request, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"'s (required there)
    disable_parallel_tool_use: bool | None = None  # true: at most one call (chat's parallel_tool_calls false)


class ThinkingConfig(Request, kw_only=True):
    """enabled and adaptive turn the template's thinking on, disabled off (enable_thinking)."""

    type: Literal["enabled", "disabled", "adaptive"]
    # enabled's (required there). Not enforced: the reasoning is not cut at this many tokens
    # (max_tokens bounds reasoning and answer together).
    budget_tokens: PositiveInt | None = None
    display: Literal["summarized", "omitted"] | None = None  # "omitted" is refused: the reasoning is returned


class JsonOutputFormat(Request):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Request):
    # Given to the chat template as `reasoning_effort` (as chat's reasoning_effort): the template decides.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None  # the text follows the schema (structured output)


class RequestMetadata(Request):
    user_id: str | None = None  # accepted: nothing to do with it


class PromptFields(Request, kw_only=True):
    """What decides the prompt: the fields /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: Annotated[list[MessageInput], msgspec.Meta(min_length=1)]
    system: str | list[TextBlockInput] | None = None
    # The tools as sent; `anthropic_api` checks each against `CustomTool` and refuses other
    # types (server tools: web search, bash, text editor, ...) by name.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Server-side context editing (clearing old tool results or thinking): accepted, and no
    # edits are made: the conversation is rendered as sent. Claude Code sends it.
    context_management: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None  # refused: this server connects to no MCP server


class CountTokensRequest(PromptFields, kw_only=True):
    """`POST /v1/messages/count_tokens`: the prompt a /v1/messages request with these fields runs."""


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: PositiveInt  # reasoning and answer together; cut to the room the context leaves
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None  # 0: off
    metadata: RequestMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier
    container: Any = None  # refused: no code-execution containers here


# Responses ----------------------------------------------------------------------------------

class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str  # `anthropic_api.SIGNATURE`: a marker, not a signature


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessageUsage(msgspec.Struct):
    # Anthropic's split of the prompt: input_tokens computed, cache_read_input_tokens restored
    # from the prefix cache (their sum is the prompt). Nothing is written to a cache on request
    # (the prefix cache keeps what it keeps), so cache_creation_input_tokens stays 0.
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class AnthropicMessage(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None  # None in message_start only
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct):
    type: str  # invalid_request_error, authentication_error, not_found_error, ..., api_error
    message: str


class AnthropicErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    """An error response's body, and a stream's `error` event."""

    error: AnthropicErrorDetail


# Stream events ------------------------------------------------------------------------------

class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: AnthropicMessage


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str  # a piece of the tool's input as JSON text; the pieces join into the whole


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: Union[TextDelta, ThinkingDelta, SignatureDelta, InputJsonDelta]


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDeltaFields(msgspec.Struct):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaUsage(msgspec.Struct):
    input_tokens: int  # as MessageUsage
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: MessageDeltaFields
    usage: MessageDeltaUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


StreamEvent = Union[MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop,
                    AnthropicErrorBody]
