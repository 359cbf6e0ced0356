"""The OpenAI wire format as msgspec Structs: request bodies, responses, stream chunks, errors.

Request Structs carry the range checks (`msgspec.Meta`), so `msgspec.json.decode(body, type=...)`
rejects a wrong type or an out-of-range value with a message naming the field. Every optional
request field also accepts JSON null (some clients send null for "unset"); defaults are applied
in `inputs`. Beside OpenAI's fields are the extras of vLLM's server that scripts written for it
send (structured_outputs, the legacy guided_* fields, truncate_prompt_tokens, ...), with vLLM's
names. Fields the engine cannot honour (suffix, guided_decoding_backend, ...) are declared so that
`inputs` can reject them by name instead of msgspec silently dropping them. Unknown fields are
rejected (`forbid_unknown_fields`), as the OpenAI API does: nothing in a request is dropped
silently.

Knows nothing about HTTP, the engine or tokenization.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]  # SamplingParams.MAX_LOGPROBS
TokenId = Annotated[int, msgspec.Meta(ge=0)]
# Any int64, as vLLM and OpenAI take it (clients send -1 too): the sampler hashes all 64 bits.
Seed = Annotated[int, msgspec.Meta(ge=-2**63, le=2**63 - 1)]


# Requests -----------------------------------------------------------------------------------

class Request(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every request Struct: an unknown field is a 400 naming it."""


class StreamOptions(Request):
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool | None = None


class SamplingFields(Request, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None  # OpenAI's range
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | None = None  # SamplingParams.MAX_TOP_K
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
    # Structured output (engine/structured.py): one source per request (`inputs` checks it).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's current form
    # vLLM's legacy form (removed in vLLM 0.12, still sent by many scripts): one of the four at most.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Declared only to be rejected when set: the first shapes JSON's whitespace (this server's
    # JSON is compact unless disable_any_whitespace is false), the second picked vLLM's
    # implementation, not the output.
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    n: PositiveInt | None = None  # choices per prompt (`inputs.num_choices` caps it)
    # vLLM's: each prompt token's log-probability and the N most likely tokens at its position
    # (not with stream, as in vLLM: `inputs` rejects it).
    prompt_logprobs: NumLogprobs | None = None
    # vLLM's sampling and detokenization extras (SamplingParams fields of the same names).
    allowed_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # vLLM's: keep the last N prompt tokens (-1: as many as leave room for max_tokens); `inputs`
    # rejects 0.
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    # vLLM's: lower is served first; a server without --scheduling-policy priority refuses any
    # but 0 (the engine's check, a 400).
    priority: int | None = None
    # vLLM's: the request's prefixes are shared in the prefix cache only with requests of the
    # same salt (SamplingParams.cache_salt): a tenant's random salt keeps others from timing
    # which prompts it sent.
    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    user: str | None = None  # an end-user id for abuse monitoring: accepted, nothing to do with it


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, one prompt's token ids, or a list of prompts (strings or token-id lists); `inputs`
    # rejects a list that mixes them.
    prompt: str | list[TokenId | str | list[TokenId]]
    # 0 with echo: the prompt alone, scored (vLLM's echo without generation); `inputs` rejects 0
    # without echo.
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    echo: bool | None = None  # each choice's text (and logprobs) start with its prompt's
    logprobs: NumLogprobs | None = None
    best_of: PositiveInt | None = None  # accepted when it equals n (`inputs.num_choices`)
    suffix: str | None = None
    add_special_tokens: bool | None = None  # vLLM's: the tokenizer's own BOS/EOS around a text prompt (default true)


class ImageURL(Request):
    url: str  # data:, http(s): or file: (media.py reads them)
    # "auto", "low" or "high": accepted, any value, with no effect (vLLM ignores it too): an
    # image's tokens follow from its size alone.
    detail: str | None = None


class VideoURL(Request):
    url: str  # data:video/...;base64, http(s): or file: (media.py reads them)


class ContentPart(Request):
    """One part of a message's content list; text, image_url and video_url parts are served
    (`messages` rejects the rest by name), but any part decodes so the error can say which type
    it was."""

    type: str
    text: str | None = None
    image_url: str | ImageURL | None = None  # an image_url part's (vLLM also takes the URL as a bare string)
    video_url: str | VideoURL | None = None  # a video_url part's (vLLM's; a bare string too)
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class FunctionCall(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it; `messages` parses it for the template


class ToolCall(Request):
    """A call in an assistant message of the history."""

    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Request, kw_only=True):
    """Every field of an OpenAI chat message a chat template can use."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # A turn's reasoning sent back: vLLM's `reasoning` (since its 0.11; OpenRouter's) or the older
    # `reasoning_content` (DeepSeek's; the AI SDK, qwen-code): either, or both when equal.
    reasoning: str | None = None
    reasoning_content: str | None = None
    # Declared only to be rejected when set (an assistant message echoed back by a client
    # carries them as null).
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None


class FunctionDefinition(Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema: parsers convert argument types by it
    strict: bool | None = None


class Tool(Request):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(Request):
    name: str


class NamedToolChoice(Request):
    function: FunctionName
    type: Literal["function"] = "function"


class JsonSchemaFormat(Request):
    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema, strict or not
    description: str | None = None


class ResponseFormat(Request):
    type: str  # "text" (no constraint), "json_object" or "json_schema" (`inputs` checks it)
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Request, kw_only=True):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar (EBNF/GBNF or
    Lark) or json_object: true (`inputs` checks it). Unset options keep this server's defaults."""

    json: dict[str, Any] | str | None = None  # a JSON schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # JSON only; unset: compact JSON (this server's default)
    # vLLM's: no fallback to another backend on error; this server has one backend, never a fallback.
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None  # object schemas without it get "additionalProperties": false
    # Declared only to be rejected when set (`inputs`).
    whitespace_pattern: str | None = None
    structural_tag: Any = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (vLLM's name)
    # vLLM's: the image processor's pixel bounds for this request's images ({"max_pixels": N}) and
    # the video processor's options for its videos ({"fps": 1, "num_frames": 8, ...}).
    mm_processor_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    # The tools as sent: the template renders these dicts (key order kept, as HF renders what
    # it is given); `inputs` checks each against `Tool`.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's; reaches the chat template as the `reasoning_effort` variable (vLLM's way). Qwen3.5's
    # template knows no effort: "none" turns its thinking off (enable_thinking false), as
    # chat_template_kwargs {"enable_thinking": false} does; the other efforts leave it on.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    store: bool | None = None  # OpenAI's; nothing is stored (`inputs` rejects true)
    # vLLM's chat extras (`inputs.chat_input` says what each does).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None  # reaches the chat template as `documents`


class TokenizeRequest(Request, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # As on chat: unset, the opposite of continue_final_message; both true is a 400.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(Request, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# Responses ----------------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not computed


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per token of the choice's text
    (with echo the prompt's first, the first of them null: no token comes before it). A
    top_logprobs entry holds the token's own log-probability besides the most likely ones, so
    it has up to logprobs + 1 (OpenAI's and vLLM's shape); text_offset counts characters from
    the start of the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """One token of a prompt_logprobs entry (vLLM's Logprob)."""

    logprob: float
    rank: int  # 1 + the number of tokens more likely at that position
    decoded_token: str


# vLLM's prompt_logprobs: one entry per prompt token, the first null (no token comes before
# it); each other keyed by token id (as a string): the prompt token's own and the N most likely.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # sent only when the request asked for them


class Completion(msgspec.Struct):
    """The body of a non-streaming completion and of each streamed completion chunk (OpenAI
    uses object "text_completion" for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    object: Literal["text_completion"] = "text_completion"


class ResponseFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # JSON text (a fragment of it in a stream delta)


class ResponseToolCall(msgspec.Struct, omit_defaults=True):
    """A tool call the model made: whole in a response (no index); in a stream, the first delta
    of a call carries its index, id, type and name, later ones the index and argument fragments."""

    function: ResponseFunctionCall
    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None


class AssistantMessage(msgspec.Struct):
    # The reasoning goes out under both names clients read: vLLM's current `reasoning` and the
    # `reasoning_content` of vLLM before 0.11 and DeepSeek (the same text).
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
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
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # sent only when the request asked for them
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None            # both names, as AssistantMessage
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


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
    system_fingerprint: str | None = None
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


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Health(msgspec.Struct):
    status: Literal["ok"] = "ok"


class VersionInfo(msgspec.Struct):
    version: str


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
