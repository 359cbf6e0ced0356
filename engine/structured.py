"""Structured output: a request's output constrained to a grammar (llguidance).

`Structured` names the constraint (SamplingParams.structured): a JSON schema, any JSON object,
a regex, or one of a list of strings; it is compiled to llguidance's grammar format and checked
when the params are built (a bad schema or regex is a ValueError). `Grammars` (one per engine)
owns the tokenizer llguidance matches against, built on the first constrained request (about a
second for a large vocabulary), and makes each request's `Matcher` at add_request.

A Matcher follows the request's committed output: `advance` consumes each token as the request
records it (Request.extend), and reports when the grammar is complete (the request then stops).
`allowed` gives the tokens the grammar permits at each position of a row: after the output,
and for a verify row after each prefix drafts[:j] of its drafts (consumed tentatively, then
rolled back), so every position is decided as plain decoding would decide it. A draft the
grammar refuses ends the prefixes: the positions after it cannot be accepted anyway. EOS is
allowed only where the grammar accepts. `mask` sets the logits outside those tokens to -inf on
the device, before penalties' output reaches the sampler's draw or argmax.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import llguidance
import numpy as np
import torch

if TYPE_CHECKING:  # step.py imports this module (through request.py and sampling_params.py)
    from .step import ScheduledRow
    from .tensor_parallel import TensorParallel
    from .tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice")
# Compact JSON: no whitespace between tokens, so a model cannot spin in whitespace until its
# length runs out (and a completed value ends the grammar at once).
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Structured:
    """kind: one of KINDS. spec: the JSON schema (a JSON string or a dict, stored as a string:
    the params stay hashable) for json_schema, the pattern for regex, the options (a tuple of
    strings) for choice, nothing for json_object."""

    kind: str
    spec: str | tuple[str, ...] | None = None

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
        elif spec is not None:
            raise ValueError("json_object takes no spec")
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"invalid {self.kind} constraint: {error.strip()}")

    def grammar(self) -> str:
        """The constraint in llguidance's grammar format."""
        make = llguidance.LLMatcher
        if self.kind == "json_schema":
            return make.grammar_from_json_schema(self.spec, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return make.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return make.grammar_from_regex(self.spec)
        return make.grammar_from_regex("|".join(re.escape(o) for o in self.spec))


class Matcher:
    """One request's grammar state, at the end of its committed output."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self._vocab_size = matcher, vocab_size

    def advance(self, token_id: int) -> bool:
        """Consume a committed token; True when the grammar is complete (or, by a bug, the
        token was refused: the request stops rather than run unconstrained)."""
        self._matcher.consume_token(token_id)
        return self._matcher.is_stopped()

    def allowed(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """bool [len(drafts) + 1, V]: the tokens allowed at each position (the module docstring)."""
        result = np.ones((len(drafts) + 1, self._vocab_size), dtype=bool)
        # Consuming a refused token would leave the matcher in its error state for good:
        # only the drafts' valid prefix is consumed.
        valid = self._matcher.validate_tokens(list(drafts)) if drafts else 0
        for j in range(valid + 1):
            result[j] = self._mask()
            if j < valid:
                self._matcher.consume_token(drafts[j])
        self._matcher.rollback(valid)
        return result

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self._vocab_size].astype(bool)


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """vocab_size: the model's (ids past the tokenizer's are never allowed)."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, structured: Structured) -> Matcher:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab_size,
                                                       eos_token=list(self._tokenizer.eos_token_ids))
        matcher = llguidance.LLMatcher(self._lltokenizer, structured.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {structured.kind} constraint: {matcher.get_error()}")
        return Matcher(matcher, self._vocab_size)

    @staticmethod
    def mask(logits: torch.Tensor, rows: Sequence[ScheduledRow], drafts: torch.Tensor | None = None,
             tp: TensorParallel | None = None) -> torch.Tensor:
        """logits [N * W, V] as Penalties.adjust takes them. Returns them with each constrained
        row's disallowed tokens at -inf (a new tensor; the input itself when no row is
        constrained). Reads a verify step's drafts on the host (a sync). Under tensor
        parallelism only rank 0 holds the matchers: it computes the mask and broadcasts it, and
        every rank masks alike."""
        constrained = [i for i, r in enumerate(rows) if r.request.params.structured is not None]
        if not constrained:
            return logits
        if tp is not None and tp.rank > 0:
            allowed = torch.empty(logits.shape, dtype=torch.uint8, device=logits.device)
        else:
            width = logits.shape[0] // len(rows)
            host_drafts = drafts.tolist() if drafts is not None and width > 1 else None
            host = np.ones((logits.shape[0], logits.shape[1]), dtype=np.uint8)
            for i in constrained:
                row_drafts = host_drafts[i][:width - 1] if host_drafts is not None else ()
                host[i * width:(i + 1) * width] = rows[i].request.grammar.allowed(row_drafts)
            allowed = torch.from_numpy(host).to(logits.device, non_blocking=True)
        if tp is not None:
            tp.broadcast(allowed)
        return logits.float().masked_fill(allowed == 0, float("-inf"))
