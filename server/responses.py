"""Builds the OpenAI response bodies of one request: the whole response, or the stream's chunks.

One renderer per route shape (text completion, chat completion) behind one small interface, so
the streaming loop in `app` is written once. A renderer fixes the request's id (`cmpl-...` /
`chatcmpl-...`, also the engine's request id), `created` and `model`.

Knows nothing about HTTP, SSE framing or the engine.
"""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from typing import Protocol

import msgspec

from ..engine import TokenLogprobs
from .chat_output import ChatOutput
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                       ChatDelta, ChatLogprobs, ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs,
                       TopLogprob, Usage)


try:
    VERSION = importlib.metadata.version("deltaspec")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    VERSION = "unknown"
# OpenAI's "backend configuration" marker on every response: which deltaspec produced it.
FINGERPRINT = f"deltaspec-{VERSION}"


class TokenText(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Renderer(Protocol):
    id: str          # the response's
    request_id: str  # the engine request's

    def opening(self) -> list[msgspec.Struct]:
        """Chunks sent before any text."""

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None) -> list[msgspec.Struct]:
        """The chunks for one engine delta (none while the text shows nothing yet)."""

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None) -> msgspec.Struct: ...


class CompletionRenderer:
    """Choice `index` of a request (one per prompt of a batch, n per prompt with n > 1); the
    renderers of a request share the response's id (given to all but the first)."""

    def __init__(self, model: str, tokenizer: TokenText, index: int = 0, response_id: str | None = None) -> None:
        self.id = response_id or f"cmpl-{uuid.uuid4().hex}"
        self.index = index
        self.request_id = self.id if index == 0 else f"{self.id}-{index}"
        self.created = int(time.time())
        self.model, self.tokenizer = model, tokenizer
        self._offset = 0  # text_offset of the next token, relative to the completion's start

    def opening(self) -> list[msgspec.Struct]:
        return []

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None) -> list[Completion]:
        if not (text or finish_reason is not None or logprobs):
            return []
        return [Completion(self.id, self.created, self.model,
                           [CompletionChoice(self.index, text, finish_reason, self._logprobs(token_ids, logprobs))],
                           system_fingerprint=FINGERPRINT)]

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [], usage, system_fingerprint=FINGERPRINT)

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None) -> Completion:
        return Completion(self.id, self.created, self.model,
                          [CompletionChoice(self.index, text, finish_reason, self._logprobs(token_ids, logprobs))],
                          usage, system_fingerprint=FINGERPRINT)

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [_token_text(self.tokenizer, t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return CompletionLogprobs(tokens, [entry.logprob for entry in logprobs],
                                  [{_token_text(self.tokenizer, t): lp for t, lp in entry.top} for entry in logprobs],
                                  offsets)


class ChatRenderer:
    """Chat responses; the text goes through the choice's own `ChatOutput` (reasoning, tool
    calls). Choice `index` of a request (n > 1); its renderers share the response's id (given to
    all but the first)."""

    def __init__(self, model: str, tokenizer: TokenText, output: ChatOutput, index: int = 0,
                 response_id: str | None = None) -> None:
        self.id = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.index = index
        self.request_id = self.id if index == 0 else f"{self.id}-{index}"
        self.created = int(time.time())
        self.model, self.tokenizer, self.output = model, tokenizer, output

    def opening(self) -> list[msgspec.Struct]:
        # OpenAI announces the role first, with empty content.
        return [self._chunk(ChatDelta(role="assistant", content=""), None, None)]

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int],
               logprobs: list[TokenLogprobs] | None) -> list[ChatCompletionChunk]:
        delta = self.output.push(text, final=finish_reason is not None)
        chunks = []
        if delta is not None or logprobs:
            chunks.append(self._chunk(delta or ChatDelta(), None, self._logprobs(token_ids, logprobs)))
        if finish_reason is not None:
            # As OpenAI sends it: the finish reason in a last chunk of its own, with an empty delta.
            chunks.append(self._chunk(ChatDelta(), self._finish_reason(finish_reason), None))
        return chunks

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], usage, system_fingerprint=FINGERPRINT)

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None) -> ChatCompletion:
        self.output.push(text, final=True)
        return ChatCompletion(self.id, self.created, self.model,
                              [ChatChoice(self.index, self.output.message(), self._finish_reason(finish_reason),
                                          self._logprobs(token_ids, logprobs))], usage,
                              system_fingerprint=FINGERPRINT)

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        # A turn that ends on its calls (EOS or a stop) finished to call tools; one cut by
        # max_tokens still says so.
        if finish_reason == "stop" and self.output.has_tool_calls:
            return "tool_calls"
        return finish_reason

    def _chunk(self, delta: ChatDelta, finish_reason: str | None,
               logprobs: ChatLogprobs | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model,
                                   [ChatChunkChoice(self.index, delta, finish_reason, logprobs)],
                                   system_fingerprint=FINGERPRINT)

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None

        def top(token_id: int, logprob: float) -> TopLogprob:
            text = _token_text(self.tokenizer, token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        content = []
        for token_id, entry in zip(token_ids, logprobs):
            text = _token_text(self.tokenizer, token_id)
            content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()),
                                            top_logprobs=[top(i, lp) for i, lp in entry.top]))
        return ChatLogprobs(content)


def _token_text(tokenizer: TokenText, token_id: int) -> str:
    """One token's text; a token holding part of a multi-byte character shows U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
