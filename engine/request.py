"""A request as the engine tracks it: its tokens, text, stop conditions and scheduling state.

Stop rules: max_tokens and the context limit finish with "length" (a constrained output cut
there is unfinished, and reported so); EOS (unless ignore_eos), a stop token id, a stop string,
or a completed grammar (SamplingParams.structured) finish with "stop"; an abort finishes with "abort". A stop
string may span token boundaries: it is searched in the new text plus the tail that could hold
its start, and the text ends right before it. A stop token's own text is left out too (EOS's is
empty unless special tokens are written). SamplingParams.include_stop_str_in_output keeps both
(the text then ends right after the stop string). While streaming, text that could still turn
into a stop string is held back until it cannot.

Knows nothing about devices or batching; the scheduler owns the scheduling fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import msgspec

from ..spec import AcceptanceEstimate, SpecStats
from .prefix_cache import Checkpoint
from .sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from .structured import Matcher
from .tokenizer import Detokenizer, Tokenizer
from .vision.prompt import PromptImages


def bad_word_token_ids(word: str, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token sequences a bad word bans, as vLLM finds them: the word (leading spaces
    stripped) at the start of a text, and with one leading space (in the middle of a text) when
    that is a different tokenization of the same length."""
    bare = tuple(tokenizer.encode(word.lstrip()))
    spaced = tuple(tokenizer.encode(" " + word.lstrip()))
    if len(bare) > MAX_BAD_WORD_TOKENS or len(spaced) > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad word {word!r} is more than {MAX_BAD_WORD_TOKENS} tokens long")
    return [bare, spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [bare]


# Why a request finishes with "error": a step's logits for it held a NaN or an infinity.
NONFINITE_LOGITS = "numerical error in the model output (non-finite logits)"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprobs(NamedTuple):
    """Log-probability of a token (emitted, or of the prompt) under the model's raw distribution
    at its position, the most likely tokens there (as many as the request asked for), and its
    rank: 1 + the number of tokens more likely than it (vLLM's)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int

    def top_n(self, n: int) -> TokenLogprobs:
        """This entry with its n most likely tokens."""
        return self if len(self.top) <= n else self._replace(top=self.top[:n])


class Logprob(NamedTuple):
    """vLLM's: a token's log-probability at a position, its rank (1: the most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def vllm_logprobs(entries: list[TokenLogprobs], token_ids: list[int],
                  decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """TokenLogprobs as vLLM gives them: per position {token id: Logprob} of the chosen token and
    the most likely ones; decode (a tokenizer's decode_token) fills decoded_token."""
    text = decode or (lambda token_id: None)
    positions = []
    for entry, chosen in zip(entries, token_ids):
        position = {chosen: Logprob(entry.logprob, entry.rank, text(chosen))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            position.setdefault(token_id, Logprob(logprob, rank, text(token_id)))
        positions.append(position)
    return positions


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM's: `index` is its choice's number; `logprobs` in
    vLLM's shape (vllm_logprobs) when they were asked for."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' log-probabilities (None: they were not asked for)."""
        if self.logprobs is None:
            return None
        return sum(position[token_id].logprob for position, token_id in zip(self.logprobs, self.token_ids))


@dataclass(frozen=True)
class RequestOutput:
    """The final result of a request: its completion (text, token_ids, ...), also as vLLM's
    `outputs` list, which holds every choice when LLM.generate ran SamplingParams.n of them (the
    fields above it are then choice 0's)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error" (NONFINITE_LOGITS)
    logprobs: list[TokenLogprobs] | None = None
    # Speculation counters of this request (SpecStats.as_dict without times; None: no verify step).
    spec_stats: dict | None = None
    # One per prompt token when the request asked for them (SamplingParams.prompt_logprobs); the
    # first is None: no token comes before it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt: str | None = None   # the prompt's text, when it came as text (LLM.generate)
    # Prompt tokens restored from the prefix cache (or a resumed session) instead of computed
    # (vLLM's; the server's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    outputs: list[CompletionOutput] = None  # None: this request's completion alone (__post_init__)

    def __post_init__(self) -> None:
        if self.outputs is None:
            object.__setattr__(self, "outputs", [self.completion(0)])

    def completion(self, index: int, decode: Callable[[int], str] | None = None) -> CompletionOutput:
        """This request's completion as choice `index` (decode: log-probabilities' token texts)."""
        logprobs = None if self.logprobs is None else vllm_logprobs(self.logprobs, self.token_ids, decode)
        return CompletionOutput(index, self.text, self.token_ids, self.finish_reason, logprobs)

    @property
    def finished(self) -> bool:
        """vLLM's: a final result always is."""
        return True


class RequestDelta(msgspec.Struct, frozen=True, gc=False):
    """What a request produced since its previous delta; finish_reason is set on the last.
    A msgspec Struct: every running request gets one per step, and one is built ~2x faster
    than a NamedTuple, ~5x faster than a frozen dataclass (gc=False: it holds no cycles)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per token when the request asked for them
    spec_stats: dict | None = None  # on the last delta, as RequestOutput.spec_stats
    # As RequestOutput.prompt_logprobs, all at once, on the first delta after the prompt is computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # As RequestOutput.num_cached_tokens, on the first delta after the request was admitted.
    num_cached_tokens: int | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # submission order
    max_num_tokens: int  # prompt + max_tokens, within the context: it finishes with "length" there
    detokenizer: Detokenizer
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and params.stop_token_ids
    bad_words_token_ids: tuple[tuple[int, ...], ...]  # params.bad_words tokenized (`bad_word_token_ids`)
    # params.structured's grammar state at the end of the output (advanced as tokens are recorded).
    grammar: Matcher | None = None
    # The prompt's images, where they sit and the multimodal RoPE positions they give (None: text).
    images: PromptImages | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The prompt's log-probabilities computed so far, when asked for (SamplingParams.prompt_logprobs):
    # entry i scores prompt token i, given by the logits at position i - 1; entry 0 is None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Prompt + output tokens: a count kept as tokens are appended (read many times per step).
    num_tokens: int = field(init=False)
    text: str = ""
    finish_reason: str | None = None
    # Scheduling state.
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    # Replaced, not mutated, when it grows (every block_size tokens): a step's row shares it.
    block_table: tuple[int, ...] = ()
    num_computed_tokens: int = 0  # tokens already folded into the slot's state and KV blocks
    num_pending: int = 0  # of those, tokens whose state is still pending in the slot (speculation)
    # No token sampled since the request was admitted (or readmitted after a preemption): its
    # next sampling row is a prefill or cached row, whose first-token path starts the slot's
    # sampling parameters and penalty statistics (runner._first_tokens), never a decode row.
    starting: bool = True
    resume_from: Checkpoint | None = None  # a saved session to restore instead of a prefix lookup
    # Another choice of the same prompt (n > 1): this request is admitted only once that one's
    # prompt is computed, so it restores the prompt from that prefill's checkpoint instead of
    # prefilling it again. Dropped at admission.
    fork_of: Request | None = None
    num_preemptions: int = 0
    # Prompt tokens its first admission restored from the prefix cache or a resumed session
    # (vLLM's num_cached_tokens; None until admitted): tokens no step of it computed.
    num_cached_tokens: int | None = None
    abort_requested: bool = False
    paused: bool = False  # its consumer reads nothing for now: not scheduled (Scheduler.pause)
    # Speculation: the next MTP catch-up starts at mtp_position (its KV below is written, stale
    # where plain steps ran: drafts then see stale entries, which costs acceptance only).
    mtp_position: int = 0
    acceptance: AcceptanceEstimate | None = None  # for the draft-length policy (spec/adaptive.py)
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # Streaming cursors.
    _num_detokenized: int = 0  # output tokens the detokenizer has (their text is in `text`)
    # 1 when the last output token is a stop token whose text stays out of `text` (vLLM's rule,
    # unless include_stop_str_in_output): it is never given to the detokenizer.
    _hidden_tail: int = 0
    _emitted_tokens: int = 0
    _emitted_chars: int = 0
    _prompt_logprobs_sent: bool = False
    _cached_sent: bool = False

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
               arrival: int, max_model_len: int, tokenizer: Tokenizer) -> "Request":
        """params: resolved (SamplingParams.resolve)."""
        return cls(request_id, list(prompt_token_ids), params, seed, arrival,
                   min(len(prompt_token_ids) + params.max_tokens, max_model_len),
                   tokenizer.detokenizer(list(prompt_token_ids), params.skip_special_tokens),
                   frozenset(params.stop_token_ids).union(() if params.ignore_eos else tokenizer.eos_token_ids),
                   tuple(ids for word in params.bad_words for ids in bad_word_token_ids(word, tokenizer)))

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    def cache_key(self, end: int) -> list[int]:
        """The prefix cache's key of tokens 0..end-1: the token ids, image tokens replaced by
        their image's key ids (PromptImages.key_ids)."""
        token_ids = self.token_ids(0, end)
        return token_ids if self.images is None else self.images.key_ids(token_ids)

    @property
    def cache_salt(self) -> str:
        """The prefix cache's namespace of the request (SamplingParams.cache_salt; "" unsalted)."""
        return self.params.cache_salt or ""

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling order, first served first: (priority, arrival). The last-ranked running
        request is preempted first."""
        return self.params.priority, self.arrival

    @property
    def prompt_scored(self) -> bool:
        """Whether its prompt's log-probabilities are all computed (False: none asked for)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)

    @property
    def restorable(self) -> int:
        """The longest prefix of its tokens a restore may skip: all of them, unless prompt
        log-probabilities are still to be computed, whose positions must run (from
        len(prompt_logprobs) - 1 on)."""
        pending = self.prompt_logprobs is not None and not self.prompt_scored
        return len(self.prompt_logprobs) - 1 if pending else self.num_tokens

    def prompt_logprob_span(self, start: int, end: int) -> tuple[int, int]:
        """The positions of [start, end) whose next prompt token is still to be scored (empty:
        (0, 0))."""
        if self.prompt_logprobs is None:
            return 0, 0
        first, last = max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1)
        return (first, last) if first < last else (0, 0)

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        """The scores of the prompt tokens after positions start.. (`prompt_logprob_span`), in order."""
        assert len(self.prompt_logprobs) == start + 1, "prompt log-probabilities are added in position order"
        self.prompt_logprobs += entries

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def advance_grammar(self, token_ids: list[int]) -> int | None:
        """Its grammar takes a step's tokens at once, before `extend` records them (it is never
        used again if the request stops before the last): how many of them complete it, if any
        do (Matcher.advance); None without a grammar or once finished."""
        if self.grammar is None or not token_ids or self.finish_reason is not None:
            return None
        return self.grammar.advance(token_ids)

    def extend(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None = None,
               grammar_end: int | None = None) -> None:
        """Record the tokens of one step in order, stopping at the first that finishes (the
        grammar_end-th completes the grammar: `advance_grammar`). Without stop strings their
        text follows in `update_texts`, for all of a step's requests at once."""
        if self.finish_reason is not None:
            return
        if self.params.stop:
            # A stop string can end in any token: the text is searched after each one.
            for i, token_id in enumerate(token_ids):
                if logprobs is not None:
                    self.output_logprobs.append(logprobs[i])
                self._append_searching_stops(token_id, i + 1 == grammar_end)
                if self.finish_reason is not None:
                    return
            return
        # Token ids alone decide where the step's tokens stop.
        taken = 0
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self.num_tokens += 1
            taken += 1
            self.finish_reason = self._stop_reason(token_id, taken == grammar_end)
            if self.finish_reason is not None:
                self._hidden_tail = int(self._hides(token_id))
                break
        if logprobs is not None:
            self.output_logprobs += logprobs[:taken]

    @staticmethod
    def update_texts(requests: Sequence[Request]) -> None:
        """Bring the text of a step's requests up to date: the output tokens their detokenizers
        do not have yet go in one push each, as they would token by token, and all the pushes in
        one batch (push_all of the detokenizers' class: one tokenizer, so one kind). A finished
        request gets the text its detokenizer still held back."""
        behind = [r for r in requests if r._num_detokenized < len(r.output_token_ids)]
        if not behind:
            return
        deltas = type(behind[0].detokenizer).push_all(
            [r.detokenizer for r in behind],
            [r.output_token_ids[r._num_detokenized:len(r.output_token_ids) - r._hidden_tail] for r in behind])
        for request, delta in zip(behind, deltas):
            request.text += delta
            request._num_detokenized = len(request.output_token_ids)
            if request.finish_reason is not None:
                request.text += request.detokenizer.flush()

    def _append_searching_stops(self, token_id: int, completes_grammar: bool) -> None:
        """Record one token of a request with stop strings; the text ends right before a stop
        string the token completes."""
        self.output_token_ids.append(token_id)
        self.num_tokens += 1
        if self._hides(token_id):
            self._num_detokenized += 1
            self.finish_reason = "stop"
            self.text += self.detokenizer.flush()
            return
        # A stop string completed by this token starts at most (longest stop - 1) chars before
        # the new text.
        search_from = max(0, len(self.text) - self.params.longest_stop + 1)
        self.text += self.detokenizer.push([token_id])
        self._num_detokenized += 1
        found = [(i, stop) for stop in self.params.stop if (i := self.text.find(stop, search_from)) >= 0]
        if found:
            cut, stop = min(found, key=lambda f: f[0])  # the first to start; of those, the first listed
            self.text = self.text[:cut + len(stop) if self.params.include_stop_str_in_output else cut]
            self.finish_reason = "stop"
            return
        self.finish_reason = self._stop_reason(token_id, completes_grammar)
        if self.finish_reason is not None:
            self.text += self.detokenizer.flush()

    def _hides(self, token_id: int) -> bool:
        """Whether token_id is a stop token whose text stays out of the output."""
        return token_id in self.stop_token_ids and not self.params.include_stop_str_in_output

    def _stop_reason(self, token_id: int, completes_grammar: bool) -> str | None:
        """Why the request ends after token_id, its newest output token (stop strings aside);
        completes_grammar: the token completes its structured output's grammar (Matcher.advance)."""
        if token_id in self.stop_token_ids:
            return "stop"
        if completes_grammar:
            return "stop"  # nothing but EOS could follow
        if self.num_tokens >= self.max_num_tokens:
            return "length"
        return None

    def abort(self) -> None:
        self.finish_reason = "abort"

    def fail(self) -> None:
        """Its logits were not finite (NONFINITE_LOGITS): its tokens of that step are garbage."""
        self.finish_reason = "error"

    def take_delta(self) -> RequestDelta:
        """New tokens and text since the last call. Until the request finishes, the last
        (longest stop - 1) characters stay back: they could be the start of a stop string."""
        text, emitted_tokens, emitted_chars, params = self.text, self._emitted_tokens, self._emitted_chars, self.params
        finished = self.finish_reason is not None
        safe_chars = len(text)
        if not finished and params.stop:
            safe_chars = max(emitted_chars, safe_chars - params.longest_stop + 1)
        prompt_logprobs = None
        if self.prompt_scored and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = list(self.prompt_logprobs), True
        num_cached_tokens = None
        if self.num_cached_tokens is not None and not self._cached_sent:
            num_cached_tokens, self._cached_sent = self.num_cached_tokens, True
        delta = RequestDelta(self.request_id, self.output_token_ids[emitted_tokens:], text[emitted_chars:safe_chars],
                             self.finish_reason,
                             self.output_logprobs[emitted_tokens:] if params.logprobs is not None else None,
                             self.spec_summary if finished else None, prompt_logprobs, num_cached_tokens)
        self._emitted_tokens, self._emitted_chars = len(self.output_token_ids), safe_chars
        return delta

    @property
    def spec_summary(self) -> dict | None:
        """This request's acceptance counters (None when it never went through a verify step)."""
        return self.spec_stats.as_dict() if self.spec_stats.num_verify_steps else None

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_token_ids, list(self.output_token_ids), self.text,
                             self.finish_reason,
                             list(self.output_logprobs) if self.params.logprobs is not None else None,
                             self.spec_summary,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             num_cached_tokens=self.num_cached_tokens or 0)
