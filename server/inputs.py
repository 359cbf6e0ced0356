"""Turns a validated OpenAI request into what the engine takes: prompt token ids and SamplingParams.

The server tokenizes (rendering the chat template for chat requests) so that `usage` counts the
exact ids the engine runs. OpenAI options the engine cannot honour are rejected with a 400 that
names the field, never silently ignored. Range checks already happened in `protocol`; the
engine's own checks (empty prompt, context length, vocabulary) happen when the request is
submitted.

Knows nothing about HTTP or streaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..engine import SamplingParams
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# OpenAI's default for /v1/completions; chat requests default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class PromptTokenizer(Protocol):
    """What the server needs of the engine's tokenizer (`AsyncLLM.tokenizer`)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class EngineInput:
    prompt_token_ids: list[int]
    params: SamplingParams


def completion_input(request: CompletionRequest, tokenizer: PromptTokenizer) -> EngineInput:
    _reject_unsupported(request, [
        ("echo", bool(request.echo), "the prompt is not echoed"),
        ("best_of", request.best_of not in (None, 1), "only best_of=1 is supported"),
        ("suffix", bool(request.suffix), "insertion (suffix) is not supported"),
    ])
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif all(isinstance(t, int) for t in prompt):
        token_ids = list(prompt)
    else:
        raise APIError(400, "prompt must be a string or one prompt's token ids; batches of prompts are "
                            "not supported (send one request per prompt)", param="prompt",
                       code="unsupported_parameter")
    max_tokens = request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    return EngineInput(token_ids, _sampling_params(request, max_tokens, request.logprobs))


def chat_input(request: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int) -> EngineInput:
    _reject_unsupported(request, [
        ("top_logprobs", request.top_logprobs is not None and not request.logprobs,
         "top_logprobs needs logprobs: true"),
        ("tools", bool(request.tools), "tool calling is not supported"),
        ("response_format", request.response_format is not None and request.response_format.type != "text",
         "only response_format {\"type\": \"text\"} is supported"),
    ])
    messages = [{"role": message.role, "content": _message_text(message.content, index)}
                for index, message in enumerate(request.messages)]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               **(request.chat_template_kwargs or {}))
    except ValueError as error:  # the template's raise_exception, or no template at all
        raise APIError(400, str(error), param="messages") from error
    except TypeError as error:
        if not request.chat_template_kwargs:
            raise
        # A kwarg that collides with the template's own variables (messages, bos_token, ...).
        raise APIError(400, f"chat_template_kwargs: {error}", param="chat_template_kwargs") from error
    token_ids = tokenizer.encode(prompt)
    max_tokens = request.max_completion_tokens or request.max_tokens or max(1, max_model_len - len(token_ids))
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return EngineInput(token_ids, _sampling_params(request, max_tokens, logprobs))


def _message_text(content, index: int) -> str:
    """A message's text: a string, or the concatenated text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                           param=f"messages[{index}].content", code="unsupported_parameter")
    return "".join(part.text for part in content)


def _reject_unsupported(request: SamplingFields, specific: list[tuple[str, bool, str]]) -> None:
    checks = [
        ("n", request.n not in (None, 1), "only n=1 is supported"),
        *specific,
    ]
    for field, is_set, why in checks:
        if is_set:
            raise APIError(400, f"{field} is not supported: {why}", param=field, code="unsupported_parameter")


def _sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    options = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                   min_p=request.min_p, seed=request.seed, stop=request.stop,
                   stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
                   presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                   repetition_penalty=request.repetition_penalty, logit_bias=_logit_bias(request.logit_bias),
                   min_tokens=request.min_tokens, bad_words=request.bad_words)
    try:
        # Unset (None) fields keep SamplingParams' defaults: the sampling ones are resolved
        # against the checkpoint's generation defaults when the engine takes the request.
        return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in options.items() if v is not None})
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    bad = [key for key in bias if not key.strip().isdigit()]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids (non-negative integers as strings), got {bad[:8]}",
                       param="logit_bias")
    return {int(key): value for key, value in bias.items()}
