"""Per-request sampling settings, validated at construction (a bad value never reaches a batch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k <= 0 (vLLM uses -1), top_p = 1 and min_p = 0 switch those
    filters off. seed makes sampling reproducible and independent of the rest of the batch."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's plus the N most likely
    # Derived: length of the longest stop string (1 without any), for stop-string search windows.
    longest_stop: int = field(init=False, repr=False, compare=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        # Accept a single stop string or any iterable, store tuples (the object stays hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "longest_stop", max(map(len, self.stop), default=1))
        problems = []
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k must be an int >= -1 (-1 or 0: off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be a non-negative int, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            problems.append(f"logprobs must be an int in 0..{self.MAX_LOGPROBS}, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop strings must be non-empty strings")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
