"""Model definitions: one module tree (`HybridLM`) for Qwen3.5, Qwen3.5-MoE and Qwen3-Next,
plus the MTP drafter."""

from .hybrid import HybridLM
from .mtp import MTP

__all__ = ["HybridLM", "MTP"]
