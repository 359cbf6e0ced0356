"""deltaspec.spec: the math and policies of MTP speculative decoding, on tensors and numbers.

- accept.py      greedy acceptance and rejection sampling (coupled with plain sampling) of drafts
- adaptive.py    the draft length of each step, from measured step costs and recent acceptance
- stats.py       speculation counters (per-position acceptance, mean accepted length)
- draft_vocab.py the reduced draft vocabulary's file format
- profile.py     forced acceptance from a per-position profile (benchmarks at real sizes)

The engine's speculation module (engine/speculation.py) runs the draft and verify forwards on
the pools and calls this package to decide what is accepted. Depends only on deltaspec.kernels.
"""

from .accept import greedy_accept, sampled_accept
from .adaptive import AcceptanceEstimate, DraftPolicy, StepCosts
from .draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab, write_draft_vocab
from .profile import AcceptanceProfile
from .stats import SpecStats

__all__ = ["AcceptanceEstimate", "AcceptanceProfile", "DRAFT_VOCAB_FILE", "DraftPolicy", "SpecStats", "StepCosts",
           "greedy_accept", "load_draft_vocab", "sampled_accept", "write_draft_vocab"]
