"""deltaspec.spec: the math and policies of MTP speculative decoding — draft selection,
acceptance (greedy and rejection sampling), adaptive draft length and counters. The engine's
runner executes the forwards; this package decides. Depends only on deltaspec.kernels."""

from .accept import greedy_accept
from .adaptive import AdaptivePolicy, DraftLengthState
from .stats import SpecStats

__all__ = ["AdaptivePolicy", "DraftLengthState", "SpecStats", "greedy_accept"]
