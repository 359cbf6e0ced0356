"""vLLM's beam search (`LLM.beam_search(prompts, BeamSearchParams(...))`), as vLLM runs it: a
step of every live beam of every prompt is one `generate` of one token with the 2W most likely
next tokens' log-probabilities (W the beam width, as HF transformers' beam search expands),
and each prompt keeps its W best candidates.

A beam's next step is its previous prompt plus one token, so the prefix cache restores the
previous step's prompt-end checkpoint (recurrent state and KV) and prefills one token: a step
costs a decode-sized forward per beam, not a prefill of the whole beam.

Scores (vLLM's get_beam_search_score): cumulative log-probability / L ** length_penalty, where
L counts the prompt's tokens and the generated ones, less a final end-of-sequence token. A
candidate that ends with one of the tokenizer's EOS tokens (unless ignore_eos) is complete and
leaves the beam; so is one that reaches the context limit. After max_tokens steps the W best of
the complete and live beams are the result, best first. Knows nothing about the engine but the
`generate` it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .request import Logprob, RequestOutput
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. length_penalty > 0 favours longer sequences. temperature is each
    step's sampling temperature: the scores are the raw distribution's log-probabilities (as the
    engine's logprobs are, and vLLM's), so a temperature only adds the token it samples as one
    more candidate where that falls outside the 2W most likely (0, greedy: never)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or \
                not 1 <= self.beam_width <= SamplingParams.MAX_LOGPROBS // 2:
            problems.append(f"beam_width must be an int in [1, {SamplingParams.MAX_LOGPROBS // 2}] (each step asks "
                            f"for 2 * beam_width log-probabilities), got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            problems.append(f"length_penalty must be a number, got {self.length_penalty!r}")
        if problems:
            raise ValueError("invalid BeamSearchParams: " + "; ".join(problems))


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` are the prompt's and the generated ones, `logprobs` one
    {token id: Logprob} per generated token (the 2W most likely there and the one taken), `text`
    the decoded tokens, special tokens included (vLLM decodes `tokens` whole). finish_reason:
    "stop" (it ended with an EOS token) or "length" (max_tokens or the context limit)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's result (vLLM's): its beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score (the module docstring)."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length ** length_penalty


def beam_search(generate: Callable[[list[tuple[int, list[int]]], SamplingParams], list[RequestOutput]],
                prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
                max_model_len: int, decode: Callable[[list[int]], str],
                on_step: Callable[[], None] = lambda: None) -> list[BeamSearchOutput]:
    """Beam search from each prompt's token ids. generate(beams, sampling params) runs one step
    of a batch of beams, each (the index of its prompt, its tokens), and returns their outputs in
    order (LLM.generate); decode(tokens) is a sequence's text; on_step() after each step (a
    progress bar)."""
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                                 ignore_eos=True)
    eos = frozenset() if params.ignore_eos else eos_token_ids
    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    score = lambda beam: beam_score(beam, eos, params.length_penalty)  # noqa: E731
    for _ in range(params.max_tokens):
        if not any(live):
            break
        outputs = iter(generate([(index, beam.tokens) for index, group in enumerate(live) for beam in group],
                                step_params))
        for index, group in enumerate(live):
            candidates = []
            for beam in group:
                position = next(outputs).outputs[0].logprobs[0]
                for token_id, logprob in position.items():
                    candidate = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [position],
                                                   beam.cum_logprob + logprob.logprob)
                    if token_id in eos:
                        candidate.finish_reason = "stop"
                        done[index].append(candidate)
                    elif len(candidate.tokens) >= max_model_len:  # no room for another token
                        candidate.finish_reason = "length"
                        done[index].append(candidate)
                    else:
                        candidates.append(candidate)
            live[index] = sorted(candidates, key=score, reverse=True)[:params.beam_width]
        on_step()
    results = []
    for group, finished in zip(live, done):
        for beam in group:
            beam.finish_reason = "length"
        best = sorted(finished + group, key=score, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
