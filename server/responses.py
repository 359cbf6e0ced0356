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
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
                       ChatLogprobs, ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs, PromptLogprob,
                       PromptLogprobs, TopLogprob, Usage)


try:
    VERSION = importlib.metadata.version("deltaspec")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    VERSION = "unknown"
# OpenAI's "backend configuration" marker on every response: which deltaspec produced it.
FINGERPRINT = f"deltaspec-{VERSION}"


class TokenText(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# A token's log-probability as the completions format writes it: finite (JSON has no -inf; vLLM's floor).
MIN_LOGPROB = -9999.0


class Renderer(Protocol):
    id: str          # the response's
    request_id: str  # the engine request's

    def opening(self, usage: Usage) -> list[msgspec.Struct]:
        """Chunks sent before any text; usage: the prompt's (no output yet)."""

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
               prompt_logprobs: list[TokenLogprobs | None] | None) -> list[msgspec.Struct]:
        """The chunks for one engine delta (none while the text shows nothing yet)."""

    def usage_chunk(self, usage: Usage) -> msgspec.Struct:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None) -> msgspec.Struct: ...


class CompletionRenderer:
    """Choice `index` of a request (one per prompt of a batch, n per prompt with n > 1); the
    renderers of a request share the response's id (given to all but the first).

    With echo, the choice's text starts with `echo` and its logprobs with the prompt tokens'
    (the first null: no token comes before it), both in the choice's first chunk when
    streaming. echo_only (max_tokens 0): the engine's one generated token is left out, and the
    choice finishes with "length" (the 0 tokens asked for). prompt_logprobs: the request's
    count; the choice then carries vLLM's prompt_logprobs list. tokens_as_ids (vLLM's
    return_tokens_as_token_ids): logprobs name each token "token_id:<id>"; text_offset still
    counts the text's characters."""

    def __init__(self, model: str, tokenizer: TokenText, prompt_token_ids: list[int], index: int = 0,
                 response_id: str | None = None, *, echo: str | None = None, echo_only: bool = False,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 tokens_as_ids: bool = False) -> None:
        self.id = response_id or f"cmpl-{uuid.uuid4().hex}"
        self.index = index
        self.request_id = self.id if index == 0 else f"{self.id}-{index}"
        self.created = int(time.time())
        self.model, self.tokenizer = model, tokenizer
        self.prompt_token_ids, self.echo, self.echo_only = prompt_token_ids, echo, echo_only
        self.num_logprobs, self.num_prompt_logprobs = logprobs, prompt_logprobs
        self.tokens_as_ids = tokens_as_ids
        self._offset = 0  # text_offset of the next token, relative to the choice's text

    def opening(self, usage: Usage) -> list[msgspec.Struct]:
        return []

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
               prompt_logprobs: list[TokenLogprobs | None] | None) -> list[Completion]:
        if self.echo is not None and not (token_ids or finish_reason is not None):
            return []  # the echo goes out with the first token, which its log-probabilities come with
        choice = self._choice(text, finish_reason, token_ids, logprobs, prompt_logprobs)
        if not (choice.text or finish_reason is not None or choice.logprobs is not None and choice.logprobs.tokens):
            return []
        return [Completion(self.id, self.created, self.model, [choice], system_fingerprint=FINGERPRINT)]

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(self.id, self.created, self.model, [], usage, system_fingerprint=FINGERPRINT)

    def response(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None) -> Completion:
        return Completion(self.id, self.created, self.model,
                          [self._choice(text, finish_reason, token_ids, logprobs, prompt_logprobs)], usage,
                          system_fingerprint=FINGERPRINT)

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int],
                logprobs: list[TokenLogprobs] | None,
                prompt_logprobs: list[TokenLogprobs | None] | None) -> CompletionChoice:
        """The choice for the whole output or one delta of it; the echo goes with the first."""
        if self.echo_only:
            text, token_ids, logprobs = "", [], [] if logprobs is not None else None
            if finish_reason == "stop":  # the token the engine had to generate was a stop
                finish_reason = "length"
        echo, self.echo = self.echo, None
        entries = None
        if logprobs is not None:
            entries = CompletionLogprobs([], [], [], [])
            if echo is not None:
                self._add_logprobs(entries, self.prompt_token_ids, prompt_logprobs)
                # The generated text starts right after the echo, whatever the prompt tokens'
                # texts add up to (a token holding part of a character shows U+FFFD).
                self._offset = len(echo)
            self._add_logprobs(entries, token_ids, logprobs)
        choice = CompletionChoice(self.index, text if echo is None else echo + text, finish_reason, entries)
        if self.num_prompt_logprobs is not None and prompt_logprobs is not None:
            choice.prompt_logprobs = _prompt_logprobs(self.tokenizer, self.prompt_token_ids, prompt_logprobs,
                                                      self.num_prompt_logprobs)
        return choice

    def _add_logprobs(self, logprobs: CompletionLogprobs, token_ids: list[int],
                      entries: list[TokenLogprobs | None]) -> None:
        """The tokens' entries, from text_offset self._offset on; an entry's top_logprobs hold
        the token itself and the request's N most likely (up to N + 1, as OpenAI's), by text."""
        for token_id, entry in zip(token_ids, entries, strict=True):
            token = _logprob_token(self.tokenizer, token_id, self.tokens_as_ids)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(self._offset)
            self._offset += len(_token_text(self.tokenizer, token_id))  # of the text, whatever names the token
            if entry is None:
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            logprob = max(entry.logprob, MIN_LOGPROB)
            # Tokens that decode alike share a key, which keeps the largest value: so
            # max(top.values()) is the token's own logprob exactly when it is the most likely
            # (lm-evaluation-harness's is_greedy), even where its text is another's.
            top = {token: logprob}
            for top_id, top_logprob in entry.top[:self.num_logprobs]:
                key = _logprob_token(self.tokenizer, top_id, self.tokens_as_ids)
                top[key] = max(top.get(key, MIN_LOGPROB), top_logprob)
            logprobs.token_logprobs.append(logprob)
            logprobs.top_logprobs.append(top)


class ChatRenderer:
    """Chat responses; the text goes through the choice's own `ChatOutput` (reasoning, tool
    calls). Choice `index` of a request (n > 1); its renderers share the response's id (given to
    all but the first). prompt_logprobs: the request's count; the response then carries vLLM's
    prompt_logprobs list (the rendered prompt's tokens), beside the choices. tokens_as_ids: as
    CompletionRenderer's."""

    def __init__(self, model: str, tokenizer: TokenText, output: ChatOutput, prompt_token_ids: list[int],
                 index: int = 0, response_id: str | None = None, prompt_logprobs: int | None = None,
                 tokens_as_ids: bool = False) -> None:
        self.id = response_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.index = index
        self.request_id = self.id if index == 0 else f"{self.id}-{index}"
        self.created = int(time.time())
        self.model, self.tokenizer, self.output = model, tokenizer, output
        self.prompt_token_ids, self.num_prompt_logprobs = prompt_token_ids, prompt_logprobs
        self.tokens_as_ids = tokens_as_ids

    def opening(self, usage: Usage) -> list[msgspec.Struct]:
        # OpenAI announces the role first, with empty content; an echo follows, as vLLM sends it.
        opening = [self._chunk(ChatDelta(role="assistant", content=""), None, None)]
        if self.output.settings.echo:
            opening.append(self._chunk(ChatDelta(content=self.output.settings.echo), None, None))
        return opening

    def chunks(self, text: str, finish_reason: str | None, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
               prompt_logprobs: list[TokenLogprobs | None] | None) -> list[ChatCompletionChunk]:
        # (prompt_logprobs: none asked for; a stream cannot carry them, `inputs` refuses the pair)
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
                 logprobs: list[TokenLogprobs] | None,
                 prompt_logprobs: list[TokenLogprobs | None] | None) -> ChatCompletion:
        self.output.push(text, final=True)
        response = ChatCompletion(self.id, self.created, self.model,
                                  [ChatChoice(self.index, self.output.message(), self._finish_reason(finish_reason),
                                              self._logprobs(token_ids, logprobs))], usage,
                                  system_fingerprint=FINGERPRINT)
        if self.num_prompt_logprobs is not None and prompt_logprobs is not None:
            response.prompt_logprobs = _prompt_logprobs(self.tokenizer, self.prompt_token_ids, prompt_logprobs,
                                                        self.num_prompt_logprobs)
        return response

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

        # bytes are the token's text's, whatever names the token.
        def top(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(token=_logprob_token(self.tokenizer, token_id, self.tokens_as_ids), logprob=logprob,
                              bytes=list(_token_text(self.tokenizer, token_id).encode()))

        content = []
        for token_id, entry in zip(token_ids, logprobs):
            chosen = top(token_id, entry.logprob)
            content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                            top_logprobs=[top(i, lp) for i, lp in entry.top]))
        return ChatLogprobs(content)


def _prompt_logprobs(tokenizer: TokenText, prompt_token_ids: list[int], entries: list[TokenLogprobs | None],
                     num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its own entry and
    those of the num_top most likely tokens at its position (ranks 1..num_top), by token id."""
    logprobs = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            logprobs.append(None)
            continue
        tokens = {str(token_id): PromptLogprob(max(entry.logprob, MIN_LOGPROB), entry.rank,
                                               _token_text(tokenizer, token_id))}
        for rank, (top_id, top_logprob) in enumerate(entry.top[:num_top], 1):
            tokens[str(top_id)] = PromptLogprob(max(top_logprob, MIN_LOGPROB), rank, _token_text(tokenizer, top_id))
        logprobs.append(tokens)
    return logprobs


def _token_text(tokenizer: TokenText, token_id: int) -> str:
    """One token's text; a token holding part of a multi-byte character shows U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob_token(tokenizer: TokenText, token_id: int, as_id: bool) -> str:
    """How a logprobs entry names a token: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:<id>" (exact where a text is not: a part of a multi-byte character)."""
    return f"token_id:{token_id}" if as_id else _token_text(tokenizer, token_id)
