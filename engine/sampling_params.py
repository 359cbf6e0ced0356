"""Per-request sampling settings, validated at construction (a bad value never reaches a batch).

The distribution fields (temperature, top_p, top_k, min_p and the three penalties) may be left
None, "unset": `resolve` fills them from the checkpoint's generation defaults
(generation_defaults.py) when the request is added, else from the built-in neutral values
(`BUILT_IN`). A request the engine runs always holds resolved params.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Mapping

from .structured import Structured

# The value of each distribution field when neither the request nor the checkpoint sets it.
# The sampler keeps top_k in int32 (any k >= the vocabulary keeps every token).
MAX_TOP_K = 2**31 - 1
BUILT_IN = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0)

MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word at most (penalties.py keeps that many - 1 per slot)
MAX_LOGIT_BIAS = 100.0    # |bias| at most, as OpenAI and vLLM


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k <= 0 (vLLM uses -1), top_p = 1 and min_p = 0 switch those
    filters off. seed makes sampling reproducible and independent of the rest of the batch.

    Penalties and bias, as vLLM defines them (applied in this order, before temperature and the
    filters, and before greedy argmax: penalties.py): bad_words bans each word's tokens (a
    one-token word always, a longer word's last token when the output so far ends with the rest);
    logit_bias adds a bias to a token's logit; min_tokens bans the stop tokens (EOS unless
    ignore_eos, and stop_token_ids) until that many tokens were generated; repetition_penalty
    divides the positive logits and multiplies the negative ones of every token seen in the
    prompt or the output; frequency_penalty subtracts itself times the token's count in the
    output, presence_penalty itself once for a token in the output. allowed_token_ids (vLLM's)
    keeps only those tokens' logits (EOS too may then be drawn only when listed); applied with
    the penalties, and like a grammar's mask it holds at every position a verify row scores.

    include_stop_str_in_output: a stop string that ends the output stays in its text (cut after
    it, not before). skip_special_tokens: the text leaves out special tokens (those the
    tokenizer marks special); False writes them, as the tokenizer's decode does."""

    # Choices of the prompt (vLLM's): LLM.generate returns them in one RequestOutput's `outputs`,
    # its prompt prefilled once; a request through the engine is one choice (n = 1).
    n: int = 1
    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's plus the N most likely
    # None: none; N >= 0: each prompt token's log-probability given the tokens before it, plus the N
    # most likely tokens there (vLLM's prompt_logprobs). The prompt is then computed whole: no
    # cached prefix is restored for it.
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None   # > 0; 1: off
    presence_penalty: float | None = None     # [-2, 2]; 0: off
    frequency_penalty: float | None = None    # [-2, 2]; 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a mapping is taken too
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token; else non-empty
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's request priority: lower is served first (then by arrival); only an engine whose
    # scheduling_policy is "priority" takes a non-zero one (scheduler.py).
    priority: int = 0
    # vLLM's cache_salt (of a prompt dict or a request): the request's prefixes are shared in the
    # prefix cache only with requests of the same salt (prefix_cache.py); None: with unsalted ones.
    # A request property carried here, as priority is, so every path that takes params takes it.
    cache_salt: str | None = None
    # Output constrained to a grammar (structured.py): a JSON schema, any JSON object, a regex,
    # a choice of strings or a context-free grammar. A (kind, spec) pair or a mapping {kind: spec} is taken too.
    structured: Structured | None = None
    # Derived: length of the longest stop string (1 without any), for stop-string search windows.
    longest_stop: int = field(init=False, repr=False, compare=False)
    # Derived: whether anything of penalties.py applies (read for every row of every step).
    penalized: bool = field(init=False, repr=False, compare=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        # Accept a single stop string or any iterable, store tuples (the object stays hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str)
                           else tuple(self.bad_words))
        object.__setattr__(self, "longest_stop", max(map(len, self.stop), default=1))
        problems = []
        if self.allowed_token_ids is not None:
            try:
                allowed = tuple(sorted({int(t) for t in self.allowed_token_ids}))
            except (TypeError, ValueError):
                allowed = (-1,)
            if not allowed or allowed[0] < 0:
                problems.append(f"allowed_token_ids must be a non-empty list of token ids >= 0, "
                                f"got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.structured is not None and not isinstance(self.structured, Structured):
            value = self.structured
            pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(value)] \
                if isinstance(value, (tuple, list)) else []
            if len(pairs) != 1 or len(pairs[0]) != 2:
                raise ValueError(f"structured must be a Structured, a (kind, spec) pair or {{kind: spec}}, "
                                 f"got {value!r}")
            # A constraint that does not compile raises its own ValueError here.
            object.__setattr__(self, "structured", Structured(*pairs[0]))
        try:
            bias = dict(self.logit_bias)
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias.items())))
        except (TypeError, ValueError):
            problems.append(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", ())
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            problems.append(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature is not None and not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K):
            problems.append(f"top_k must be an int in -1..{MAX_TOP_K} (-1 or 0: off), got {self.top_k!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**63):
            problems.append(f"seed must be an int in -2**63..2**63 - 1 (the sampler's int64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= self.MAX_LOGPROBS):
                problems.append(f"{name} must be an int in 0..{self.MAX_LOGPROBS}, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if self.repetition_penalty is not None and not (self.repetition_penalty > 0
                                                        and math.isfinite(self.repetition_penalty)):
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if any(t < 0 or not abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias):
            problems.append(f"logit_bias keys must be token ids >= 0 and values in [-{MAX_LOGIT_BIAS:g}, "
                            f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            problems.append(f"priority must be an int, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            problems.append(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            problems.append("bad_words must be non-empty strings")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "penalized", bool(
            self.repetition_penalty not in (None, 1) or self.presence_penalty or self.frequency_penalty
            or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids is not None))

    def resolve(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """These params with every unset distribution field taken from `defaults` (the
        checkpoint's generation config), else from BUILT_IN."""
        defaults = defaults or {}
        unset = {name: defaults.get(name, value) for name, value in BUILT_IN.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def for_choices(self, n: int, base_seed: int | None = None) -> list[SamplingParams]:
        """The params of choices 0..n-1 of one prompt, each one choice (n = 1): for n > 1 choice
        i samples with seed + i (from base_seed when seed is unset, else a random base), as vLLM
        does, so each choice is reproducible as a single request with that seed. Seeds wrap around
        the sampler's int64 (2**63 - 1 + 1 is -2**63), as its two's-complement sum would."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if n == 1:
            return [dataclasses.replace(self, n=1) if self.n != 1 else self]
        base = self.seed if self.seed is not None else base_seed if base_seed is not None else random.getrandbits(63)
        return [dataclasses.replace(self, n=1, seed=(base + i + 2**63) % 2**64 - 2**63) for i in range(n)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def redecided(self) -> bool:
        """Whether a decode step's own choice is not this request's: penalties or a grammar
        change its logits (the runner decides its tokens again after the step)."""
        return self.penalized or self.structured is not None

    @property
    def drawn_in_step(self) -> bool:
        """Whether a decode step draws this request's tokens itself: it samples from its raw
        logits (DecodeStep.draw, inside the step's CUDA graph)."""
        return not self.greedy and not self.redecided
