"""Turns a validated OpenAI request into what the engine takes: prompt token ids and SamplingParams.

The server tokenizes (rendering the chat template for chat requests, `messages`) so that `usage`
counts the exact ids the engine runs, and settles how a chat request's output is read
(`chat_output.OutputSettings`: reasoning split, tool-call parser, the text tool_choice forces).
vLLM's extra fields that scripts written for vLLM send are honoured with vLLM's meaning
(structured_outputs and the legacy guided_* fields, allowed_token_ids, truncate_prompt_tokens,
continue_final_message, ...). Options the engine cannot honour are rejected with a 400 that
names the field, never silently ignored. Range checks already happened in `protocol`; the
engine's own checks (empty prompt, context length, vocabulary) happen when the request is
submitted.

Knows nothing about HTTP or streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..engine import SamplingParams, Structured, TooManyTokensError
from ..engine.vision.image import ImageInput, VideoInput
from ..engine.vision.preprocess import ImageProcessor
from ..engine.vision.prompt import expand_image_tokens
from ..engine.vision.video import VideoProcessor
from .chat_output import OutputSettings
from .errors import APIError, refuse
from .messages import check_tools, message_text, render_prompt
from .protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat, SamplingFields
from .reasoning import THINK_END, ReasoningParser, prompt_opens_reasoning
from .tool_parsers import make_tool_call_parser

MAX_N = 64  # choices per prompt at most (`n`): each is a running request of its own

# OpenAI's default for /v1/completions (less where the context has less room); chat requests
# default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class PromptTokenizer(Protocol):
    """What the server needs of the engine's tokenizer (`AsyncLLM.tokenizer`)."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = False, max_length: int | None = None) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class EngineInput:
    prompt_token_ids: list[int]
    params: SamplingParams
    # n > 1: the index of the input of the same prompt's first choice, whose prefill this one
    # reuses (AsyncLLM.generate's fork_of); None for a prompt's first choice.
    fork_of: int | None = None
    # /v1/completions with echo: the text the choice starts with (the prompt as sent, or its
    # token ids decoded); None: not echoed.
    echo: str | None = None
    # max_tokens 0 with echo (vLLM's echo without generation): the engine runs max_tokens 1 (the
    # prompt's log-probabilities come with the first token), and the choice leaves that token
    # out; usage does not count it.
    echo_only: bool = False
    # A chat request's images in prompt order (resized) and its videos (decoded), whose tokens
    # prompt_token_ids holds expanded (`with_images`, `with_videos`); every choice of the
    # request shares them.
    images: tuple[ImageInput, ...] = ()
    videos: tuple[VideoInput, ...] = ()


@dataclass(frozen=True)
class ChatImages:
    """A chat request's images in the order its messages hold them (resized), and the processor
    that names their token and counts each one's tokens."""

    images: tuple[ImageInput, ...]
    processor: ImageProcessor


@dataclass(frozen=True)
class ChatVideos:
    """A chat request's videos in the order its messages hold them (decoded: sampled frames,
    resized, in temporal patches), and the processor that names their tokens and counts each
    patch's tokens."""

    videos: tuple[VideoInput, ...]
    processor: VideoProcessor


def num_choices(request: SamplingFields) -> int:
    """The request's `n` (choices per prompt), checked before the request takes any room."""
    n = request.n or 1
    if n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", param="n", code="invalid_value")
    best_of = getattr(request, "best_of", None)  # /v1/completions only
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of must equal n ({n}) or be unset: choosing the best of more choices "
                            f"than are returned is not supported", param="best_of", code="unsupported_parameter")
    return n


def with_choices(inputs: list[EngineInput], n: int) -> list[EngineInput]:
    """n inputs per input, choice i of a prompt at i of its n (OpenAI's choice order): choice i
    samples with seed + i (SamplingParams.for_choices) and forks the prompt's first choice."""
    expanded = []
    for engine_input in inputs:
        first = len(expanded)
        for i, params in enumerate(engine_input.params.for_choices(n)):
            expanded.append(replace(engine_input, params=params, fork_of=first if i else None))
    return expanded


def completion_inputs(request: CompletionRequest, tokenizer: PromptTokenizer,
                      max_model_len: int) -> list[EngineInput]:
    """One engine input per prompt: `prompt` is one prompt (a string or token ids) or a list of
    them (a batch, as LangChain sends it; choice i answers prompt i).

    echo (vLLM's): each choice's text starts with its prompt's, and with logprobs its logprobs
    start with the prompt tokens' (the engine scores the prompt: SamplingParams.prompt_logprobs);
    max_tokens 0 with echo returns the prompt alone, how clients score a text (perplexity,
    lm-evaluation-harness's loglikelihood).

    truncate_prompt_tokens (vLLM's) keeps each prompt's last N tokens: usage counts those, and
    echo shows their text (a prompt that lost tokens echoes its kept ids decoded, special tokens
    included, as a token-id prompt does). add_special_tokens (vLLM's, default true): the
    tokenizer's own BOS/EOS around a text prompt (Qwen's tokenizers add none)."""
    refuse([
        ("suffix", bool(request.suffix), "insertion (suffix) is not supported"),
    ])
    _check_prompt_logprobs(request)
    echo_only = request.max_tokens == 0
    if echo_only and not request.echo:
        raise APIError(400, "max_tokens must be at least 1; 0 is allowed only with echo: true (the prompt alone, "
                            "scored with logprobs)", param="max_tokens", code="invalid_value")
    # The engine scores the prompt once, with the larger count: echo's logprobs and
    # prompt_logprobs each take their own N most likely.
    counts = [n for n in (request.logprobs if request.echo else None, request.prompt_logprobs) if n is not None]
    prompt_logprobs = max(counts, default=None)
    keep = _num_kept(request, max_model_len, 1 if echo_only else request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
    add_special_tokens = request.add_special_tokens is not False
    structured = _structured(request)
    inputs = []
    for prompt in prompts(request):
        token_ids = _encode(tokenizer, prompt, add_special_tokens, keep is not None, max_model_len, request.max_tokens,
                            "prompt", "max_tokens") if isinstance(prompt, str) else list(prompt)
        truncated = keep is not None and len(token_ids) > keep
        if truncated:
            token_ids = token_ids[-keep:]
        room = max_model_len - len(token_ids)
        max_tokens = 1 if echo_only else request.max_tokens or max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, room))
        _check_context(len(token_ids), max_tokens, max_model_len, "prompt", "max_tokens")
        echo = None
        if request.echo:
            echo = prompt if isinstance(prompt, str) and not truncated \
                else tokenizer.decode(token_ids, skip_special_tokens=False)
        params = _sampling_params(request, max_tokens, request.logprobs, prompt_logprobs, structured)
        inputs.append(EngineInput(token_ids, params, echo=echo, echo_only=echo_only))
    return inputs


def prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a string, one prompt's token ids, or a list of either."""
    prompt = request.prompt
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    raise APIError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id "
                        "lists (one prompt each)", param="prompt", code="invalid_value")


@dataclass(frozen=True)
class ChatParsers:
    """How the server reads chat output, settled at start-up from the chat template and the
    --tool-call-parser / --reasoning-parser options."""

    tool_call_parser: str  # qwen3_coder, hermes or none
    reasoning: bool


def chat_input(request: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
               parsers: ChatParsers, images: ChatImages | None = None,
               videos: ChatVideos | None = None) -> tuple[EngineInput, OutputSettings]:
    """The engine input and how to read its output. images: those of the messages' image parts
    (`messages.image_parts`, fetched and resized), videos: those of its video parts
    (`messages.video_parts`, fetched and decoded), whose tokens the prompt holds expanded.

    tool_choice is enforced by forcing the start of the output: after the template renders, the
    opening of a call (`<tool_call>\n<function=NAME>\n` for a named function; for "required",
    `<tool_call>\n<function=`, with the name too when there is one tool) is appended to the
    prompt, closing an open think block first, and the parser reads it as already written. So
    the output always parses as a call; of that function when one is named or there is one tool;
    with several, decoding is constrained (a regex grammar, engine/structured.py) to write one
    of their names. "none" renders the tools, as vLLM does, and parses no calls.

    vLLM's chat extras: add_generation_prompt false renders no opening of the assistant's turn;
    continue_final_message leaves the final message, an assistant's, open (the prompt is cut
    right after its text: `messages.render_prompt`) so the model goes on writing it, and unless
    add_generation_prompt is sent (then true is a 400, as in vLLM) renders none; echo starts the
    content with the final message's when it is an assistant's (with continue_final_message:
    the whole message); documents and reasoning_effort reach the template as variables of
    those names, over chat_template_kwargs' (as vLLM merges them), and reasoning_effort "none"
    turns thinking off on a template that switches it with enable_thinking and knows no effort; add_special_tokens (default
    false: the template writes them) adds the tokenizer's own around the rendered prompt;
    truncate_prompt_tokens keeps the rendered prompt's last N tokens."""
    refuse([
        ("top_logprobs", request.top_logprobs is not None and not request.logprobs,
         "top_logprobs needs logprobs: true"),
        ("store", bool(request.store), "responses are not stored"),
        ("truncate_prompt_tokens", request.truncate_prompt_tokens is not None and images is not None,
         "a prompt with images is not cut (the cut could split an image's tokens)"),
        ("truncate_prompt_tokens", request.truncate_prompt_tokens is not None and videos is not None,
         "a prompt with videos is not cut (the cut could split a video's tokens)"),
    ])
    _check_prompt_logprobs(request)
    if request.continue_final_message and request.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: the first "
                            "continues the final message, the second opens a new one",
                       param="continue_final_message", code="invalid_value")
    structured = _structured(request)
    schemas = check_tools(request.tools or [])
    tool_choice = request.tool_choice or ("auto" if request.tools else "none")
    named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    if tool_choice != "none" and not request.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    if named is not None and named not in schemas:
        raise APIError(400, f"tool_choice names the function {named!r}, which is not in tools",
                       param="tool_choice", code="invalid_value")
    if tool_choice != "none" and parsers.tool_call_parser == "none":
        raise APIError(400, "tool calling needs a tool-call parser: this server runs with --tool-call-parser none",
                       param="tool_choice", code="unsupported_parameter")
    template_kwargs = {**(request.chat_template_kwargs or {}),
                       **{name: value for name, value in (("documents", request.documents),
                                                          ("reasoning_effort", request.reasoning_effort))
                          if value is not None}}
    template = tokenizer.chat_template or ""
    if request.reasoning_effort == "none" and "enable_thinking" not in template_kwargs \
            and "enable_thinking" in template and "reasoning_effort" not in template:
        # A template that switches thinking with enable_thinking (Qwen3.5's) and knows no effort:
        # "none", OpenAI's no reasoning, turns it off; other efforts leave it on.
        template_kwargs["enable_thinking"] = False
    continue_final_message = bool(request.continue_final_message)
    add_generation_prompt = request.add_generation_prompt if request.add_generation_prompt is not None \
        else not continue_final_message
    prompt = render_prompt(tokenizer, request.messages, request.tools, template_kwargs, add_generation_prompt,
                           continue_final_message)

    tool_calls = make_tool_call_parser(parsers.tool_call_parser, schemas) if tool_choice != "none" else None
    in_reasoning = parsers.reasoning and prompt_opens_reasoning(prompt)
    forced_text, name_constraint = "", None
    if tool_calls is not None and tool_choice != "auto":
        if tool_choice == "required" and len(schemas) == 1:
            named = next(iter(schemas))
        forced_text = (THINK_END + "\n\n" if in_reasoning else "") + tool_calls.forced_prefix(named)
        if named is None:  # "required" with several tools: the model picks, among them only
            if structured is not None:
                field = _constraint_fields(request)[0]
                raise APIError(400, f"{field} cannot be combined with tool_choice \"required\"",
                               param=field, code="invalid_value")
            name_constraint = Structured("regex", tool_calls.name_pattern(list(schemas)))
    single_call = named is not None or request.parallel_tool_calls is False
    last = request.messages[-1]
    settings = OutputSettings(reasoning=ReasoningParser(in_reasoning) if parsers.reasoning else None,
                              tool_calls=tool_calls, max_tool_calls=1 if single_call else None,
                              forced_text=forced_text,
                              echo=message_text(last) if request.echo and last.role == "assistant" else "")

    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    requested = request.max_completion_tokens or request.max_tokens
    keep = _num_kept(request, max_model_len, requested or 1)
    token_ids = _encode(tokenizer, prompt + forced_text, bool(request.add_special_tokens), keep is not None,
                        max_model_len, requested, "messages", max_tokens_field)
    # Before the context check: image and video tokens count.
    token_ids = with_videos(with_images(token_ids, images), videos, tokenizer)
    if keep is not None:
        token_ids = token_ids[-keep:]
    max_tokens = requested or max(1, max_model_len - len(token_ids))
    _check_context(len(token_ids), max_tokens, max_model_len, "messages", max_tokens_field)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _sampling_params(request, max_tokens, logprobs, request.prompt_logprobs, structured or name_constraint)
    return EngineInput(token_ids, params, images=images.images if images is not None else (),
                       videos=videos.videos if videos is not None else ()), settings


def with_images(token_ids: list[int], images: ChatImages | None) -> list[int]:
    """The rendered prompt with each image's token repeated to that image's count (the places
    the encoder's output takes). The template writes one token per image part; a template that
    reads no parts (content joined as text) writes none, and the request is refused: its images
    would have no place in the prompt."""
    if images is None:
        return token_ids
    token_id, num_images = images.processor.image_token_id, len(images.images)
    placed = token_ids.count(token_id)
    if placed < num_images:
        raise APIError(400, f"the chat template places no image tokens for {num_images - placed} of the request's "
                            f"{num_images} images: it does not render image parts", param="messages",
                       code="unsupported_parameter")
    try:
        return expand_image_tokens(token_ids, images.images, token_id, images.processor.num_tokens)
    except ValueError as error:  # more image tokens than images: the text holds some
        raise APIError(400, str(error), param="messages", code="invalid_value") from None


def with_videos(token_ids: list[int], videos: ChatVideos | None, tokenizer: PromptTokenizer) -> list[int]:
    """The prompt with each video's token replaced by its temporal patches: each patch's time as
    text (`<1.5 seconds>`) and its tokens between vision start and end (the engine's
    `expand_video_tokens`, which the engine applies to a prompt that holds one token per video
    and leaves an expanded one as it is). As for images, a template that writes no video token
    for a video part has no place for it: a 400."""
    if videos is None:
        return token_ids
    processor, num_videos = videos.processor, len(videos.videos)
    placed = token_ids.count(processor.video_token_id)
    if placed < num_videos:
        raise APIError(400, f"the chat template places no video tokens for {num_videos - placed} of the request's "
                            f"{num_videos} videos: it does not render video parts", param="messages",
                       code="unsupported_parameter")
    try:
        return processor.expand(token_ids, videos.videos, tokenizer.encode)
    except ValueError as error:  # more video tokens than videos: the text holds some
        raise APIError(400, str(error), param="messages", code="invalid_value") from None


def translated_chat_input(chat: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int,
                          parsers: ChatParsers, messages_param: str, params: dict[str, str],
                          images: ChatImages | None = None) -> tuple[EngineInput, OutputSettings]:
    """`chat_input` of a request another API shape was turned into (the Responses and Messages
    APIs): an error names the field as that API names it, chat's messages[...] as
    messages_param (its items are numbered otherwise) and chat's other fields by `params`."""
    try:
        return chat_input(chat, tokenizer, max_model_len, parsers, images)
    except APIError as error:
        if error.param is not None:
            error.param = messages_param if error.param.startswith("messages") \
                else params.get(error.param, error.param)
        raise


def _encode(tokenizer: PromptTokenizer, text: str, add_special_tokens: bool, truncating: bool, max_model_len: int,
            max_tokens: int | None, prompt_field: str, max_tokens_field: str) -> list[int]:
    """The prompt's ids. One longer than the context is refused by its count alone, its ids'
    list never built (Tokenizer.encode's max_length: a megabyte prompt's list would hold the GIL
    for tens of milliseconds, stalling every stream), unless it is to be truncated
    (truncate_prompt_tokens: its last tokens are the ones kept)."""
    if truncating:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, max_length=max_model_len)
    except TooManyTokensError as error:
        raise _context_error(error.num_tokens, max_tokens or 1, max_model_len, prompt_field,
                             max_tokens_field) from None


def _num_kept(request: SamplingFields, max_model_len: int, max_tokens: int) -> int | None:
    """truncate_prompt_tokens as the number of prompt tokens kept (vLLM's): N >= 1, or -1 for
    as many as leave room for max_tokens (the request's, else its route's least: 16 on
    /v1/completions, OpenAI's default, and 1 on chat, whose default is the room left)."""
    keep = request.truncate_prompt_tokens
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be at least 1, or -1 (as many tokens as leave room for "
                            "max_tokens)", param="truncate_prompt_tokens", code="invalid_value")
    if keep == -1:
        return max(1, max_model_len - max_tokens)  # none left: the context check refuses the request
    return keep


def _check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_field: str,
                   max_tokens_field: str) -> None:
    """The prompt and the tokens asked for must fit the context: a request is refused up front
    rather than cut short (vLLM's check and message)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise _context_error(num_prompt_tokens, max_tokens, max_model_len, prompt_field, max_tokens_field)


def _context_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_field: str,
                   max_tokens_field: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                         f"{prompt_field}, {max_tokens} in the completion). Please reduce the length of the "
                         f"{prompt_field} or completion.",
                    param=max_tokens_field if num_prompt_tokens < max_model_len else prompt_field,
                    code="context_length_exceeded")


def _check_prompt_logprobs(request: SamplingFields) -> None:
    """prompt_logprobs go in the response body, which a stream does not have (vLLM refuses the
    pair too)."""
    if request.prompt_logprobs is not None and request.stream:
        raise APIError(400, "prompt_logprobs are not available with stream: true (ask without streaming)",
                       param="prompt_logprobs", code="unsupported_parameter")


def _sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None, structured: Structured | None) -> SamplingParams:
    options = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                   min_p=request.min_p, seed=request.seed, stop=request.stop,
                   stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs,
                   presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                   repetition_penalty=request.repetition_penalty, logit_bias=_logit_bias(request.logit_bias),
                   min_tokens=request.min_tokens, bad_words=request.bad_words, structured=structured,
                   allowed_token_ids=request.allowed_token_ids,
                   include_stop_str_in_output=request.include_stop_str_in_output,
                   skip_special_tokens=request.skip_special_tokens, priority=request.priority,
                   cache_salt=request.cache_salt)
    try:
        # Unset (None) fields keep SamplingParams' defaults: the sampling ones are resolved
        # against the checkpoint's generation defaults when the engine takes the request.
        return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in options.items() if v is not None})
    except ValueError as error:
        raise APIError(400, str(error)) from error


# vLLM's legacy constraint fields and the engine's kind each names.
_GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_JSON_KINDS = ("json_schema", "json_object")
_WHITESPACE_PATTERN = ("JSON's whitespace is none (the default) or any (structured_outputs.disable_any_whitespace: "
                       "false), not a pattern")


def _structured(request: SamplingFields) -> Structured | None:
    """The request's output constraint (engine/structured.py), from whichever field sent it:
    OpenAI's response_format, vLLM's structured_outputs, or vLLM's legacy guided_json,
    guided_regex, guided_choice and guided_grammar (removed in vLLM 0.12, still sent by many
    scripts). Two at once are a 400. So are guided_whitespace_pattern and
    guided_decoding_backend: the second picked vLLM's implementation, not the output (this
    server has one; vLLM 0.12 says to remove it too), so accepting it would pretend to honour it."""
    refuse([
        ("guided_decoding_backend", request.guided_decoding_backend is not None,
         "it picks vLLM's structured-output implementation, not the output; this server has one (vLLM 0.12 "
         "removed the field too): remove it"),
        ("guided_whitespace_pattern", request.guided_whitespace_pattern is not None, _WHITESPACE_PATTERN),
    ])
    fields = _constraint_fields(request)
    if len(fields) > 1:
        raise APIError(400, f"{fields[0]} and {fields[1]} both constrain the output: send one", param=fields[1],
                       code="invalid_value")
    if not fields:
        return None
    if fields[0] == "response_format":
        return _response_format(request.response_format)
    if fields[0] == "structured_outputs":
        return _structured_outputs(request)
    return _compile(fields[0], _GUIDED_KINDS[fields[0]], getattr(request, fields[0]))


def _constraint_fields(request: SamplingFields) -> list[str]:
    """The request's fields that constrain its output ("text" is no constraint)."""
    response_format = request.response_format
    return [field for field, is_set in (
        ("response_format", response_format is not None and response_format.type != "text"),
        ("structured_outputs", request.structured_outputs is not None),
        *((field, getattr(request, field) is not None) for field in _GUIDED_KINDS)) if is_set]


def _response_format(response_format: ResponseFormat) -> Structured:
    """OpenAI's response_format: "json_object" any JSON object, "json_schema" its schema (strict
    or not: the output always follows it)."""
    kind = response_format.type
    if kind not in _JSON_KINDS:
        raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format", code="invalid_value")
    if kind == "json_schema" and response_format.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema field", param="response_format",
                       code="invalid_value")
    schema = response_format.json_schema.schema if kind == "json_schema" else None
    return _compile("response_format", "json_schema", schema) if schema is not None \
        else _compile("response_format", "json_object")


def _structured_outputs(request: SamplingFields) -> Structured:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar and json_object:
    true. disable_any_whitespace, when sent, says whether JSON may hold whitespace (unset:
    compact JSON, this server's default; vLLM's is any); disable_additional_properties closes
    the schema's objects (`_closed_objects`); disable_fallback changes nothing here (one
    backend: there is never a fallback). whitespace_pattern and structural_tag are refused."""
    options = request.structured_outputs
    refuse([
        ("structured_outputs.whitespace_pattern", options.whitespace_pattern is not None, _WHITESPACE_PATTERN),
        ("structured_outputs.structural_tag", options.structural_tag is not None,
         "structural tags (grammars triggered by tags in free text) are not served"),
    ])
    constraints = [(name, value) for name, value in (("json", options.json), ("regex", options.regex),
                                                     ("choice", options.choice), ("grammar", options.grammar),
                                                     ("json_object", options.json_object or None))
                   if value is not None]
    if len(constraints) != 1:
        raise APIError(400, f"structured_outputs must set exactly one of json, regex, choice, grammar and "
                            f"json_object: true; got {', '.join(name for name, _ in constraints) or 'none'}",
                       param="structured_outputs", code="invalid_value")
    [(name, spec)] = constraints
    param = f"structured_outputs.{name}"
    kind = {"json": "json_schema", "json_object": "json_object"}.get(name, name)
    if kind == "json_object":
        spec = None
    elif kind == "json_schema" and options.disable_additional_properties:
        spec = _closed_objects(_json_schema(spec, param))
    whitespace = {} if options.disable_any_whitespace is None or kind not in _JSON_KINDS \
        else {"any_whitespace": not options.disable_any_whitespace}
    return _compile(param, kind, spec, **whitespace)


def _compile(param: str, kind: str, spec: Any = None, **options: Any) -> Structured:
    """The engine's constraint; one that does not compile is a 400 naming the field that sent it."""
    try:
        return Structured(kind, spec, **options)
    except ValueError as error:
        raise APIError(400, str(error), param=param, code="invalid_value") from error


def _json_schema(schema: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A schema sent as a dict or as its JSON text, as a dict."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise APIError(400, f"{param} is not valid JSON: {error}", param=param, code="invalid_value") from error
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param, code="invalid_value")
    return schema


# Keywords whose value maps names to subschemas, and those whose value is data, never a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")


def _closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: a copy of the schema where every object schema (one
    with properties or patternProperties) that does not say whether it allows others gets
    "additionalProperties": false. Only subschemas are walked, not the data in enum, default,
    ..., nor a property that happens to be named "properties"."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed_objects(subschema) for name, subschema in value.items()}
        else:
            closed[key] = _closed_objects(value)
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    bad = [key for key in bias if not key.strip().isdigit()]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids (non-negative integers as strings), got {bad[:8]}",
                       param="logit_bias")
    return {int(key): value for key, value in bias.items()}
