"""Structured output: a request's output constrained to a grammar (llguidance).

`Structured` names the constraint (SamplingParams.structured): a JSON schema, any JSON object,
a regex, one of a list of strings, or a context-free grammar (Lark, llguidance's dialect, or
llama.cpp's GBNF, which vLLM users send as EBNF); it is compiled to llguidance's grammar format
and checked when the params are built (a bad schema, regex or grammar is a ValueError). `Grammars` (one per engine)
owns the tokenizer llguidance matches against, built on the first constrained request (about a
second for a large vocabulary), and makes each request's `Matcher` at add_request.

A Matcher follows the request's committed output: `advance` consumes a step's tokens as the
request records them (Request.extend), in one call while the grammar goes on, and reports the
token that completes it (the request then stops there).
`Grammars.bitmask` packs the tokens the grammar permits at each position of a step's rows into
int32 words (llguidance's layout, kernels/token_bitmask.py applies it on the device): after the
output, and for a verify row after each prefix drafts[:j] of its drafts (consumed tentatively,
then rolled back), so every position is decided as plain decoding would decide it. A draft the
grammar refuses ends the prefixes: the positions after it cannot be accepted anyway. EOS is
allowed only where the grammar accepts. The masks are computed by llguidance's own thread pool
with the GIL released; when they are computed (while the device runs the step's forward) is the
runner's business (runner.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:  # step.py imports this module (through request.py and sampling_params.py)
    from .step import ScheduledRow
    from .tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_JSON_KINDS = ("json_schema", "json_object")


@dataclass(frozen=True)
class Structured:
    """kind: one of KINDS. spec: the JSON schema (a JSON string or a dict, stored as a string:
    the params stay hashable) for json_schema, the pattern for regex, the options (a tuple of
    strings) for choice, the grammar's text for grammar (Lark or GBNF, told apart by its rules'
    syntax: `::=` is GBNF), nothing for json_object.
    any_whitespace (JSON kinds only): JSON may have whitespace between its tokens. Off by
    default, compact JSON: a model cannot spin in whitespace until its length runs out, and a
    completed value ends the grammar at once (vLLM allows any unless disable_any_whitespace)."""

    kind: str
    spec: str | tuple[str, ...] | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as error:
                    raise ValueError(f"json_schema is not valid JSON: {error}") from error
            if not isinstance(spec, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(spec).__name__}")
            object.__setattr__(self, "spec", json.dumps(spec, sort_keys=True))
        elif self.kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"regex must be a non-empty string, got {spec!r}")
        elif self.kind == "choice":
            options = (spec,) if isinstance(spec, str) else tuple(spec or ())
            if not options or any(not isinstance(o, str) or not o for o in options):
                raise ValueError(f"choice must be non-empty strings, got {spec!r}")
            object.__setattr__(self, "spec", options)
        elif self.kind == "grammar":
            if not isinstance(spec, str) or not spec.strip():
                raise ValueError(f"grammar must be a non-empty string, got {spec!r}")
        elif spec is not None:
            raise ValueError("json_object takes no spec")
        if self.any_whitespace and self.kind not in _JSON_KINDS:
            raise ValueError(f"any_whitespace applies to JSON constraints only, not {self.kind}")
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"invalid {self.kind} constraint: {error.strip()}")

    def grammar(self) -> str:
        """The constraint in llguidance's grammar format."""
        make = llguidance.LLMatcher
        if self.kind in _JSON_KINDS:
            schema = self.spec if self.kind == "json_schema" else {"type": "object"}
            return make.grammar_from_json_schema(schema, defaults={"whitespace_flexible": self.any_whitespace})
        if self.kind == "regex":
            return make.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            try:
                return make.grammar_from_lark(any_to_lark(self.spec))
            except Exception as error:  # the GBNF converter raises its own parse errors
                raise ValueError(f"invalid grammar constraint: {error}") from error
        return make.grammar_from_regex("|".join(re.escape(o) for o in self.spec))


class Matcher:
    """One request's grammar state, at the end of its committed output."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.llmatcher = matcher

    def advance(self, token_ids: list[int]) -> int | None:
        """Consume a step's committed tokens in order. Returns how many were taken when one
        completed the grammar (or, by a bug, was refused: the request stops rather than run
        unconstrained), that token included; None when the grammar goes on. One llguidance
        call (and a check) while it goes on; only the step that completes it, once a request,
        is rolled back and walked token by token to find where."""
        matcher = self.llmatcher
        consumed = matcher.try_consume_tokens(token_ids)
        if consumed == len(token_ids) and not matcher.is_stopped():
            return None
        matcher.rollback(consumed)
        for taken, token_id in enumerate(token_ids, start=1):
            matcher.consume_token(token_id)
            if matcher.is_stopped():  # by the first refused token at the latest
                break
        return taken


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """vocab_size: the model's (ids past the tokenizer's are never allowed)."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None  # llguidance's thread pool, made with the tokenizer

    @property
    def num_words(self) -> int:
        """int32 words of one packed mask row."""
        return -(-self._vocab_size // 32)

    def matcher(self, structured: Structured) -> Matcher:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab_size,
                                                       eos_token=list(self._tokenizer.eos_token_ids))
            self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._lltokenizer, structured.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {structured.kind} constraint: {matcher.get_error()}")
        return Matcher(matcher)

    def bitmask(self, rows: Sequence[ScheduledRow], out: torch.Tensor, drafts: Sequence[Sequence[int]] = (),
                computing: Callable[[], None] | None = None) -> None:
        """Write the packed masks (kernels/token_bitmask.py) of W consecutive positions of each
        row into out, int32 [N * W, num_words] (contiguous host memory): all bits set for
        unconstrained rows; position j of a verify row is the grammar after drafts[i][:j] (the
        module docstring). Positions after a draft the grammar refuses are left as they were
        (they are never accepted: a buffer that only ever holds masks keeps them harmless).
        Computed by llguidance's thread pool, all rows and positions at once, without the GIL
        (`computing` is called just before)."""
        width = out.shape[0] // len(rows)
        constrained = []
        for i, r in enumerate(rows):
            if r.request.grammar is None:
                out[i * width:(i + 1) * width] = -1
            else:
                constrained.append(i)
        if not constrained:
            return
        assert out.is_contiguous() and out.dtype == torch.int32 and out.shape[1] == self.num_words
        one_row = self.num_words * 4
        if width == 1:
            entries = [(rows[i].request.grammar.llmatcher, i) for i in constrained]
            compute = self._executor.unsafe_compute_mask_ptr
        else:
            entries = [(rows[i].request.grammar.llmatcher, i * width, list(drafts[i][:width - 1])) for i in constrained]
            compute = self._executor.unsafe_compute_mask_ptr_with_draft_token
        if computing is not None:
            computing()
        compute(entries, out.data_ptr(), one_row, len(out))
