"""Builds the OpenAI response bodies of one request: the whole response, or the stream's chunks.

One renderer per route shape (text completion, chat completion) behind one small interface, so
the streaming loop in `app` is written once. A renderer fixes the request's id (`cmpl-...` /
`chatcmpl-...`, also the engine's request id), `created` and `model`.

Knows nothing about HTTP, SSE framing or the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol

import msgspec

from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                       ChatDelta, Completion, CompletionChoice, Usage)


class Renderer(Protocol):
    id: str

    def opening(self) -> list[msgspec.Struct]:
        """Chunks sent before any text."""

    def chunk(self, text: str, finish_reason: str | None) -> msgspec.Struct: ...

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""

    def response(self, text: str, finish_reason: str, usage: Usage) -> msgspec.Struct: ...


class CompletionRenderer:
    def __init__(self, model: str) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def opening(self) -> list[msgspec.Struct]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> Completion:
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, text, finish_reason)])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [CompletionChoice(0, text, finish_reason)], usage)


class ChatRenderer:
    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def opening(self) -> list[msgspec.Struct]:
        # OpenAI announces the role first, with empty content.
        return [self._chunk(ChatDelta(role="assistant", content=""), None)]

    def chunk(self, text: str, finish_reason: str | None) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text or None), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletion:
        return ChatCompletion(self.id, self.created, self.model,
                              [ChatChoice(0, AssistantMessage(text), finish_reason)], usage)

    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [ChatChunkChoice(0, delta, finish_reason)])
