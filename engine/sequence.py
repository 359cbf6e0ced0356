"""A request's generated tokens, text and stop conditions.

Stop rules: max_tokens and the context limit finish with "length"; EOS (unless ignore_eos),
a stop token id, or a stop string finish with "stop". A stop string may span token
boundaries: it is searched in the newly decoded text plus the tail that could hold its start,
and the returned text ends right before it. Knows nothing about devices or batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_model_len: int
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
               max_model_len: int, tokenizer: Tokenizer) -> "Sequence":
        return cls(request_id, list(prompt_token_ids), params, seed, max_model_len,
                   IncrementalDetokenizer(tokenizer, list(prompt_token_ids)),
                   frozenset(() if params.ignore_eos else tokenizer.eos_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> None:
        """Record one sampled token and decide whether the sequence is done."""
        self.output_token_ids.append(token_id)
        # A stop string completed by this token starts at most (longest stop - 1) chars before
        # the new text.
        search_from = max(0, len(self.text) - max(map(len, self.params.stop), default=1) + 1)
        self.text += self.detokenizer.push([token_id])
        cut = min((i for i in (self.text.find(s, search_from) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            return
        if token_id in self.eos_token_ids or token_id in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
        if self.finished:
            self.text += self.detokenizer.flush()
