"""Splits a chat completion's text into reasoning and content at `</think>` (Qwen3, Qwen3.5).

A thinking template's generation prompt opens the block (`<think>\n`), so the output starts as
reasoning and `</think>` ends it; with thinking off (`enable_thinking: false`) the template
renders an empty block and the output is all content, unless the model opens `<think>` itself.
`split` works on the whole text so far and only ever extends its parts as the text grows (a
possible partial `</think>` at the end is held back until the text says what it is), so a
stream's deltas are the differences between successive splits (`chat_output`) and a stream
assembles to the non-streamed split.

Knows nothing about tool calls, HTTP or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "none")


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str


def reasoning_enabled(name: str | None, chat_template: str | None) -> bool:
    """--reasoning-parser: qwen3 or none; unset: qwen3 when the chat template thinks."""
    if name is None:
        return THINK_START in (chat_template or "")
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(REASONING_PARSERS)}")
    return name == "qwen3"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (its output starts as reasoning)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`: characters a stream
    must not emit yet, since the next delta may complete the tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str, final: bool) -> ReasoningSplit:
        if not self.starts_in_reasoning:
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
            elif not final and THINK_START.startswith(text):
                return ReasoningSplit("", "")  # may still become "<think>"
            else:
                return ReasoningSplit("", text)
        end = text.find(THINK_END)
        if end < 0:
            return ReasoningSplit(text if final else text[:len(text) - held_back(text, THINK_END)], "")
        # The template puts "\n\n" after </think>: not part of the answer.
        return ReasoningSplit(text[:end], text[end + len(THINK_END):].lstrip("\n"))
