"""The OpenAI wire format as msgspec Structs: request bodies, responses, stream chunks, errors.

Request Structs carry the range checks (`msgspec.Meta`), so `msgspec.json.decode(body, type=...)`
rejects a wrong type or an out-of-range value with a message naming the field. Every optional
request field also accepts JSON null (some clients send null for "unset"); defaults are applied
in `inputs`. Fields the engine cannot honour (n > 1, ...) are declared so that
`inputs` can reject them by name instead of msgspec silently dropping them. Unknown fields are
ignored, as the OpenAI API does.

Knows nothing about HTTP, the engine or tokenization.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


# Requests -----------------------------------------------------------------------------------

class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    max_tokens: PositiveInt | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # OpenAI: token ids as strings -> bias in [-100, 100] (`inputs` checks the keys).
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    bad_words: list[str] | None = None
    # Declared only to be rejected when set to anything but its neutral value.
    n: PositiveInt | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string or one prompt's token ids; lists of prompts (batches) are rejected in `inputs`.
    prompt: str | list[TokenId | str]
    echo: bool | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ResponseFormat(msgspec.Struct):
    type: str


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (vLLM's name)
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None


# Responses ----------------------------------------------------------------------------------

class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    """The body of a non-streaming completion and of each streamed completion chunk (OpenAI
    uses object "text_completion" for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class AssistantMessage(msgspec.Struct):
    content: str
    role: Literal["assistant"] = "assistant"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class Model(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    # The checkpoint's defaults for sampling fields a request leaves unset (generation_config.json).
    generation_defaults: dict[str, float | int] = {}
    owned_by: str = "deltaspec"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: Literal["list"] = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
